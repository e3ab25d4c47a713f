"""The lm_head and the cross-entropy as a lab op: out = mean CE of logits = h @ weightᵀ against targets, in fp32.

Paths (one function each: checked, timed and trained as the model's head + loss):
    reference   posttrainllm.ops.cross_entropy.reference.linear_cross_entropy: the (N, V) fp32 logits, then F.cross_entropy
    torch       torch.nn.functional.linear_cross_entropy with LinearCrossEntropyOptions (PyTorch's own chunked
                path), fed fp32 h and weight: given bf16 it computes the logits and the loss in bf16 (measured
                ~1% off the fp32 loss at N=64, V=32k), outside this op's fp32 contract. Absent from a PyTorch
                without it, and at label_smoothing > 0 (its chunked path refuses smoothing and falls back to the
                reference's math, which would be timed under its name)
    triton      posttrainllm.ops.cross_entropy.kernels: our fused linear cross-entropy (Liger-Kernel's scheme): chunks of
                tokens, a Triton kernel writing each row's loss and its logits' gradient in place, the gradients
                of h and weight accumulated in the forward
    compiled    (opt-in, op.peers) the reference under torch.compile
    user paths  op.user_impls, in the natural signature SIGNATURE (lab/isolation/user.py)

The options (conf/op/cross_entropy.yaml) are the point's: op.ignore_index (targets equal to it contribute nothing,
the mean divides by the others' count) and op.label_smoothing; every path and every case run with them, so a
point with label_smoothing > 0 checks the smoothing on every case. The parity cases: the point's shape, a single
token, a vocabulary off every block and tokens off every chunk (shape.ops.cross_entropy.edge), a wholly ignored chunk
(`ignored_chunk`: the first op.chunk_size targets and every 5th after them are ignore_index) and logits of ~1e5 that
overflow exp without the max subtraction (`large_logits`). Every target ignored gives NaN in every path (the mean
of nothing, as F.cross_entropy): not a parity case, since parity requires finite outputs (tests/ops).

Shapes: h (N, C), weight (V, C) in the point's dtype; targets (N,) int64 (not differentiable) -> out 0-dim fp32.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F

from posttrainllm.config import LabConfig, itemsize
from posttrainllm.ops.base import (REFERENCE, BatchAxis, Case, Costs, CurveAxis, Impl, ModelHook, OpDef, Tensors,
                                   seeded_randn)
from posttrainllm.ops.cross_entropy.config import Sizes
from posttrainllm.ops.peers import compiled
import posttrainllm.ops.cross_entropy.reference as reference

INPUT_KINDS = ("ignored_chunk", "large_logits")
SMOOTHING_CASE = 0.1  # the label-smoothing case's ε (0.2 where the point has 0.1)
MODEL_VOCAB = 256  # bench-train's model: the byte vocabulary
LARGE_LOGIT_STD = 3e4  # large_logits: logits ~N(0, 3e4²), up to ~1.5e5: exp overflows fp32 past ~88
TORCH_FUSED = getattr(F, "linear_cross_entropy", None)
TORCH_OPTIONS = getattr(torch.nn, "LinearCrossEntropyOptions", None)


def _options(cfg: LabConfig) -> dict[str, Any]:
    return {"ignore_index": cfg.op.ignore_index, "label_smoothing": cfg.op.label_smoothing}


# --- the paths -------------------------------------------------------------------------


def _reference(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": reference.linear_cross_entropy(x["h"], x["weight"], x["targets"], **_options(cfg))}


def _torch(x: Tensors, cfg: LabConfig) -> Tensors:
    out = TORCH_FUSED(x["h"].float(), x["weight"].float(), x["targets"], options=TORCH_OPTIONS(), **_options(cfg))
    return {"out": out}


def torch_refusal(cfg: LabConfig) -> str | None:
    """None if PyTorch's chunked linear_cross_entropy runs this point's options, else why not."""
    if TORCH_FUSED is None or TORCH_OPTIONS is None:
        return "torch.nn.functional.linear_cross_entropy is not in this PyTorch: no torch peer"
    if cfg.op.label_smoothing != 0.0:
        return (f"label_smoothing={cfg.op.label_smoothing}: PyTorch's chunked linear_cross_entropy refuses smoothing "
                "and falls back to its unfused reference (with a warning): no torch peer")
    return None


def _impls_for(cfg: LabConfig) -> dict[str, Impl]:
    """The registry for this point: torch only where its chunked path runs (torch_refusal)."""
    return {name: impl for name, impl in IMPLS.items() if name != "torch" or torch_refusal(cfg) is None}


def _triton(x: Tensors, cfg: LabConfig) -> Tensors:
    from posttrainllm.ops.cross_entropy.kernels import fused_linear_cross_entropy

    return {"out": fused_linear_cross_entropy(x["h"], x["weight"], x["targets"], **_options(cfg),
                                              chunk_size=cfg.op.chunk_size, block_v=cfg.op.block_v,
                                              num_warps=cfg.workgroup.num_warps)}


def _triton_geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
    from posttrainllm.ops.cross_entropy.kernels import cross_entropy_launch

    d = case.dims
    return cross_entropy_launch(d["tokens"], d["d_model"], d["vocab"], chunk_size=cfg.op.chunk_size,
                                block_v=cfg.op.block_v, num_warps=cfg.workgroup.num_warps)


IMPLS = {
    REFERENCE: Impl(REFERENCE, "reference", _reference, cost_model="materialised",
                    backend="posttrainllm.ops.cross_entropy.reference.linear_cross_entropy"),
    # torch's chunked path: its chunks are its own (not modelled), placed at the floor
    **({"torch": Impl("torch", "peer", _torch, backend="torch.nn.functional.linear_cross_entropy "
                      "(LinearCrossEntropyOptions(): chunked), on fp32 h and weight")}
       if TORCH_FUSED is not None and TORCH_OPTIONS is not None else {}),
    # the gradients are computed in the forward call (autograd's backward only scales them), so the kernel
    # launches in the training call too
    "triton": Impl("triton", "triton", _triton, geometry=_triton_geometry,
                   backend="posttrainllm.ops.cross_entropy.fused_linear_cross_entropy",
                   kernels={"forward": ("_cross_entropy_kernel",), "backward": ("_cross_entropy_kernel",)},
                   promises=("deterministic",),  # no atomics: every sum in one order (lab/invariance.py checks)
                   cost_model="chunked"),
}


# --- cases and inputs -------------------------------------------------------------------


def _dims(tokens: int, d_model: int, vocab: int, **extra: int) -> dict[str, int]:
    return dict(tokens=tokens, d_model=d_model, vocab=vocab, **extra)


def _cases(cfg: LabConfig) -> list[Case]:
    """Per seed: the point's shape and the edges (a single token, V off every block, N off every chunk). On the
    first seed: a wholly ignored chunk, and logits of ~1e5."""
    sizes, op = Sizes.of(cfg), cfg.op
    main = (sizes.tokens, sizes.d_model, sizes.vocab)
    out = []
    for seed in cfg.parity.seeds:
        out.append(Case(f"N{main[0]}-V{main[2]}-seed{seed}", seed, _dims(*main), True))
        out += [Case(f"N{n}-C{c}-V{v}-seed{seed}", seed, _dims(n, c, v), False) for n, c, v in sizes.edge]
    seed = cfg.parity.seeds[0]
    if main[0] > 1:  # the last target stays: every one ignored is NaN (the mean of nothing), no parity case
        out.append(Case(f"N{main[0]}-V{main[2]}-ignored_chunk", seed,
                        _dims(*main, ignore_index=op.ignore_index, ignored_rows=min(op.chunk_size, main[0] - 1)),
                        False, "ignored_chunk"))
    out.append(Case(f"N{main[0]}-V{main[2]}-large_logits", seed, _dims(*main), False, "large_logits"))
    # another label smoothing than the point's, with ignored rows, at the first small edge: a path that ignores
    # op.label_smoothing (or ignore_index under it) fails
    n, c, v = next(((n, c, v) for n, c, v in sizes.edge if n > 1), main)
    smoothing = SMOOTHING_CASE if op.label_smoothing != SMOOTHING_CASE else 2 * SMOOTHING_CASE
    if n > 1:
        out.append(Case(f"N{n}-C{c}-V{v}-smoothed", seed,
                        _dims(n, c, v, ignore_index=op.ignore_index, ignored_rows=1), False, "ignored_chunk",
                        options={"label_smoothing": smoothing}))
    # the model's lm_head and loss in bench-train: train.batch_size x train.seq_len tokens, d_model, the byte vocabulary
    train = _dims(cfg.train.batch_size * cfg.train.seq_len, cfg.architecture.d_model, MODEL_VOCAB)
    if not any(case.dims == train and case.inputs == "normal" and not case.options for case in out):
        out.append(Case(f"N{train['tokens']}-C{train['d_model']}-V{MODEL_VOCAB}-train", seed, train, False))
    return out


def _make_inputs(case: Case, dtype: torch.dtype, device: str) -> Tensors:
    """h and weight drawn in fp32 from the case's seed (weight scaled so the logits are ~N(0, 1)), cast to the
    point's dtype; targets uniform over the vocabulary.

    ignored_chunk  the first `ignored_rows` targets (a whole chunk of the fused path when N > op.chunk_size) and
                   every 5th after them are ignore_index; the last one never is
    large_logits   h and weight scaled so the logits are ~N(0, 3e4²) (entries of h and weight stay < ~400: finite
                   in fp16): exp(x) overflows fp32 unless the row's max is subtracted first
    """
    d = case.dims
    n, c, v = d["tokens"], d["d_model"], d["vocab"]
    randn = seeded_randn(case.seed, dtype, device)
    if case.inputs == "large_logits":
        scale = (LARGE_LOGIT_STD / c ** 0.5) ** 0.5  # std(h·w) = scale² · sqrt(C)
        h, weight = randn(n, c, scale=scale), randn(v, c, scale=scale)
    elif case.inputs in ("normal", "ignored_chunk"):
        h, weight = randn(n, c), randn(v, c, scale=c ** -0.5)
    else:
        raise ValueError(f"unknown cross_entropy input kind {case.inputs!r}: valid are normal, "
                         f"{', '.join(INPUT_KINDS)}")
    targets = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(case.seed + 7))
    if case.inputs == "ignored_chunk":
        targets[:d["ignored_rows"]] = d["ignore_index"]
        targets[d["ignored_rows"]:n - 1:5] = d["ignore_index"]
    return {"h": h, "weight": weight, "targets": targets.to(device)}


def _problem(case: Case) -> str:
    d = case.dims
    return f"N={d['tokens']} C={d['d_model']} V={d['vocab']}"


def _costs(case: Case, cfg: LabConfig) -> Costs:
    """Forward: the projection, N·V dot products of length C: 2·N·C·V; the softmax and the loss ~4·N·V (max,
    subtract, exp, sum per logit). Backward: dH = dlogits·W and dW = dlogitsᵀ·H, 2·N·C·V each, and
    dlogits = (softmax − one_hot)/n ~2·N·V: (4·N·C·V + 2·N·V) / (2·N·C·V + 4·N·V), ~2x the forward.
    Bytes: read h, weight and the int64 targets, write the fp32 loss; no logits (the fused path's minimum;
    the reference moves N·V·4·k more: `describe`)."""
    d, size = case.dims, itemsize(cfg.precision.dtype)
    n, c, v = d["tokens"], d["d_model"], d["vocab"]
    flops = 2 * n * c * v + 4 * n * v
    return Costs(flops, (n * c + v * c) * size + n * 8 + 4, (4 * n * c * v + 2 * n * v) / flops,
                 "2*N*C*V + 4*N*V", "(N*C + V*C)*itemsize + N*8 + 4 (no logits)",
                 "backward = (4*N*C*V + 2*N*V) / forward: dH and dW (2*N*C*V each), dlogits (2*N*V)")



# --- each kind of path's own traffic (OpDef.path_costs; Impl.cost_model names one) --------------------------
#
# N tokens, C width, V vocabulary; s the point's itemsize, c = 4 (the fp32 logits).


def _materialised(case: Case, cfg: LabConfig) -> Costs:
    """The readable reference (reference.linear_cross_entropy) as eager PyTorch runs it, every aten op reading its
    inputs and writing its outputs (measure/traffic.py counts the same, tests/test_traffic.py).

    forward, in c: the (N, V) logits h·Wᵀ (N·C + V·C read, N·V written), log_softmax (N·V, N·V), nll_loss (N·V and
    the int64 targets read, the loss written): c·(N·C + V·C + 4·N·V) + 8·N + 8. backward: nll's and log_softmax's
    gradients over (N, V) and the two GEMMs dH, dW: c·(2·N·C + 2·V·C + 7·N·V) + 8·N + 8. A 16-bit point adds the
    casts of h and W to fp32 and of their gradients back: (N·C + V·C)·(s + c) each way. Working set: h and W, and
    the (N, V) logits and log-probabilities in fp32. At label_smoothing = 0 (smoothing's extra pass is not counted)."""
    d, size = case.dims, itemsize(cfg.precision.dtype)
    n, cw, v, c = d["tokens"], d["d_model"], d["vocab"], 4
    casts = 0 if size == c else (n * cw + v * cw) * (size + c)
    forward = c * (n * cw + v * cw + 4 * n * v) + 8 * n + 8 + casts
    backward = c * (2 * n * cw + 2 * v * cw + 7 * n * v) + 8 * n + 8 + casts
    cast = "" if size == c else " + (N*C + V*C)*(s + c) (casts)"
    return dataclasses.replace(
        _costs(case, cfg), bytes=forward, bytes_formula=f"c*(N*C + V*C + 4*N*V) + 8*N + 8{cast} (c = 4)",
        train_bytes=forward + backward, train_bytes_formula=f"forward + c*(2*N*C + 2*V*C + 7*N*V) + 8*N + 8{cast}",
        working_set=(n * cw + v * cw) * (size if size == c else size + c) + 2 * c * n * v,
        working_set_formula="(N*C + V*C)*s (+ their fp32 copies) + 2*N*V*c (logits, log-probabilities)",
        model="materialised",
        note="the (N, V) logits and log-probabilities written and read in fp32, forward and backward"
             + ("" if cfg.op.label_smoothing == 0 else "; smoothing's pass over the log-probabilities not counted"))


def _chunked(case: Case, cfg: LabConfig) -> Costs:
    """The fused kernel (kernels.fused_linear_cross_entropy) over K = ceil(N / chunk_size) chunks of r rows: each
    chunk's GEMM reads its h rows and the whole W, so W is read K times; only r·V fp32 logits live at once.

    forward (no gradients): the GEMMs (s·(N·C + K·V·C) read, 4·N·V logits written), the kernel (the logits once,
    int64 targets, the row losses), their sum: s·(N·C + K·V·C) + 8·N·V + 16·N + 4.
    forward + backward (the gradients are computed in the forward call): the logits GEMM; the kernel reading them
    and overwriting them with their gradient (8·N·V); at 16 bits that gradient's copy in s ((4 + s)·N·V); dH =
    dlogits·W (g·N·V + K·s·V·C read, 4·N·C written, g = s at 16 bits, else 4); dW += dlogitsᵀ·h (g·N·V + s·N·C
    read, the fp32 dW read and written per chunk, 8·K·V·C, zeroed first, 4·V·C); the backward scales dH and dW in
    place (8·N·C + 8·V·C + 8) and casts them at 16 bits ((4 + s)·(N·C + V·C)).
    The GEMMs' operands are read once each (CUDA's 16-bit GEMM with an fp32 result; the CPU's fp32 slabs of 16-bit
    operands add copies not modelled)."""
    d, size = case.dims, itemsize(cfg.precision.dtype)
    n, cw, v = d["tokens"], d["d_model"], d["vocab"]
    rows = min(cfg.op.chunk_size, n)
    k = -(-n // rows)
    narrow = size != 4
    g = size if narrow else 4
    forward = size * (n * cw + k * v * cw) + 8 * n * v + 16 * n + 4
    train = (size * (2 * n * cw + 2 * k * v * cw) + (12 + 2 * g) * n * v + 12 * n * cw + (8 * k + 12) * v * cw
             + 16 * n + 12 + ((4 + size) * (n * v + n * cw + v * cw) if narrow else 0))
    return dataclasses.replace(
        _costs(case, cfg), bytes=forward,
        bytes_formula=f"s*(N*C + K*V*C) + 8*N*V + 16*N + 4 (K = ceil(N/chunk_size) = {k}: W read per chunk)",
        train_bytes=train,
        train_bytes_formula="s*(2*N*C + 2*K*V*C) + (12 + 2*g)*N*V + 12*N*C + (8*K + 12)*V*C + 16*N + 12"
                            + (" + (4 + s)*(N*V + N*C + V*C) (16-bit copies; g = s)" if narrow else " (g = 4)"),
        working_set=(n * cw + v * cw) * size + 4 * rows * v + 12 * n,
        working_set_formula="(N*C + V*C)*s + 4*r*V + 12*N (one chunk's r = min(chunk_size, N) rows of logits)",
        model="chunked",
        note=f"chunks of {rows} rows (op.chunk_size): W re-read per chunk, no (N, V) in memory")


PATH_COSTS = {"materialised": _materialised, "chunked": _chunked}


def _describe(case: Case, inputs: Tensors, cfg: LabConfig, measure: Any = None) -> dict[str, Any]:
    """What the microbench records beyond time: the logits the reference materialises and the fused path does not."""
    d = case.dims
    n, c, v = d["tokens"], d["d_model"], d["vocab"]
    chunk = min(cfg.op.chunk_size, n)
    return {
        "logits_bytes": n * v * 4, "logits_bytes_formula": "N*V*4 (fp32)",
        # the reference writes the fp32 logits, reads them into log_softmax, writes the log-probabilities and reads
        # them for the loss: k = 4 passes over N*V*4 bytes in the forward (its backward: as many again)
        "reference_extra_bytes": 4 * n * v * 4, "reference_extra_bytes_formula": "N*V*4*k, k = 4 (forward)",
        "fused_logits_bytes": chunk * v * 4, "fused_logits_bytes_formula": "min(chunk_size, N)*V*4 (one chunk)",
        "grad_weight_bytes": v * c * 4, "grad_weight_bytes_formula": "V*C*4 (fp32, held by the fused forward)",
        "ignored_targets": int((inputs["targets"] == cfg.op.ignore_index).sum()),
        "unavailable": {"torch": why} if (why := torch_refusal(cfg)) else {},
    }


def _curve_case(cfg: LabConfig, x: int) -> Case:
    sizes, seed = Sizes.of(cfg), cfg.parity.seeds[0]
    return Case(f"N{x}-V{sizes.vocab}-seed{seed}", seed, _dims(x, sizes.d_model, sizes.vocab), True)


def _vocab_curve_case(cfg: LabConfig, x: int) -> Case:
    """x vocabulary entries at shape.ops.cross_entropy.tokens tokens: the reference's (N, V) logits grow with V, the
    fused path's (chunk_size, V) block slower."""
    sizes, seed = Sizes.of(cfg), cfg.parity.seeds[0]
    return Case(f"N{sizes.tokens}-V{x}-seed{seed}", seed, _dims(sizes.tokens, sizes.d_model, x), True)


# --- the model --------------------------------------------------------------------------


def _fill(impl: Impl, cfg: LabConfig) -> Callable[..., torch.Tensor]:
    """The model's lm_head and loss run `impl.fn` on (the flattened hidden states, lm_head.weight, targets).

    Under 16-bit autocast h and weight are cast here, as the lm_head's F.linear would cast them; the path then
    runs with autocast off, so every path computes its logits and loss in fp32 from those values."""

    def loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        device = h.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            h, weight = h.to(dtype), weight.to(dtype)
        with torch.autocast(device, enabled=False):
            return impl.fn({"h": h, "weight": weight, "targets": targets}, cfg)["out"]

    return loss


def _model_problem(cfg: LabConfig) -> str:
    arch, train = cfg.architecture, cfg.train
    return (f"N={train.batch_size * train.seq_len} C={arch.d_model} V={MODEL_VOCAB} (the byte vocabulary's lm_head "
            "and loss)")


def _check_config(cfg: LabConfig) -> None:
    """Nothing beyond the schema's bounds on op.chunk_size, op.block_v and op.label_smoothing (config.py): a chunk
    or a vocabulary block larger than the problem is clipped or masked, and the tile group does not apply."""


def _reference_bytes(case: Case, cfg: LabConfig) -> int:
    """The float64 oracle: the (N, V) logits and log-probabilities and their gradients (~4 (N, V) tensors), h, weight
    and their gradients (~4 copies); then the fp32 baseline's ~4 (N, V) tensors."""
    d = case.dims
    n, c, v = d["tokens"], d["d_model"], d["vocab"]
    return 8 * (4 * n * v + 4 * (n + v) * c) + 4 * 4 * n * v


SIGNATURE = ("fn(h, weight, targets, *, ignore_index, label_smoothing) -> loss; h (N, C), weight (V, C), targets (N,) "
             "int64; loss 0-dim fp32 = mean cross-entropy of h @ weightᵀ over the targets != ignore_index")

TEMPLATE = '''
import torch
import torch.nn.functional as F


def {name}(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
           label_smoothing: float = 0.0) -> torch.Tensor:
    """The lm_head and the mean cross-entropy: h (N, C), weight (V, C), targets (N,) int64 -> a 0-dim fp32 loss.

    Rows whose target is ignore_index contribute nothing; the mean divides by the count of the others.
    With smoothing ε the target distribution is (1 − ε)·one_hot + ε/V. The lab checks the loss and the
    gradients of h and weight against float64 math (autograd through this function, or your own
    torch.autograd.Function); no autograd history: forward-only.
    """
    logits = h.float() @ weight.float().t()  # (N, V) fp32: the memory a fused kernel saves
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, label_smoothing=label_smoothing)
'''


def _adapt(fn: Any) -> Any:
    def path(x: Tensors, cfg: LabConfig) -> Tensors:
        return {"out": fn(x["h"], x["weight"], x["targets"], **_options(cfg))}

    path.__name__ = getattr(fn, "__name__", "user")
    return path


OP = OpDef(
    name="cross_entropy", x_name="tokens", input_names=("h", "weight", "targets"), impls=IMPLS, cases=_cases,
    make_inputs=_make_inputs, problem=_problem, costs=_costs, curve_case=_curve_case, model_hook=ModelHook("loss", _fill),
    model_problem=_model_problem, check_config=_check_config,
    reference_bytes=_reference_bytes, path_costs=PATH_COSTS, row_ndim={"out": 0}, nondiff_inputs=("targets",),
    curve_sizes=lambda cfg: list(Sizes.of(cfg).curve),
    extra_curves=(CurveAxis("vocab", lambda cfg: list(Sizes.of(cfg).vocab_curve), _vocab_curve_case),),
    describe=_describe, point_impls=_impls_for,
    optional_peers={"compiled": compiled("cross_entropy", _reference, _make_inputs,
                                         "posttrainllm.ops.cross_entropy.reference.linear_cross_entropy")},
    signature=SIGNATURE, adapt=_adapt, template=TEMPLATE,
    batch_axis=BatchAxis("a token", {"h": 0, "targets": 0}, {}, fixed_size=True,
                         note="out is the mean over the batch's tokens (one number, not a token's): not compared; a "
                         "token's grad_h carries 1/N of its batch, so it is compared in batches of the main case's "
                         "size only; grad_weight sums over the tokens"),
)
