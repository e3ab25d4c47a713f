"""LayerNorm as a lab op: y = (x − mean(x)) / sqrt(var(x) + eps) · weight + bias over the last dim,
x (rows, C), weight (C,), bias (C,) -> y (rows, C).

Paths (one function each: checked, timed and trained as every norm of the model):
    reference   reference.layernorm: fp32 math (float64 for the oracle), the centred variance, rounded once
    torch       torch.nn.functional.layer_norm (PyTorch's own, with weight, bias and eps)
    triton      kernels.layernorm: one row per program in blocks of tile.block_n columns (mean, centred
                variance, then y); dx one row per program, dW and dB one program per column block (no atomics)
    compiled    (opt-in, op.peers) the reference under torch.compile
    user paths  op.user_impls, in the natural signature SIGNATURE

eps is op.eps (conf/op/layernorm.yaml); bench-train builds its model with norm_eps = op.eps (model_overrides), and
the model hook refuses any other eps, so the eps trained is the eps checked.

Cases: the point's (rows, C) with rows = shape.batch · shape.seq_len and C = architecture.d_model; a single row;
e x e for e > 1 in shape.edge_seq_lens (C off every block: the last one masked; C = 1 is left out: a LayerNorm of one
element is constant, y = bias and dx = 0 whatever x, with rstd = 1/sqrt(eps) amplifying the rounding of any dx that
does not cancel exactly, so an exact 0 gives the contract no scale to read); and, on the first seed, rows of ~1e4
(x² overflows fp16 unless upcast), rows at 32 + N(0, 1) (mean(x²) − mean² cancels: the variance must be taken
from the centred squares), rows of ~1e-4 (var ~1e-8 << eps: where eps sits shows) and constant rows (var = 0:
y = bias, and eps alone keeps dx finite).

bench-train: the lab's transformer normalises with RMSNorm; for op=layernorm every one of its norms (the blocks'
two and the final one) becomes this op's path, so the model trained is a LayerNorm transformer with the reference as
the baseline. The model's norms own a weight and no bias: the hook passes a zero bias that is not trained (the
bias's gradient is checked by parity, not trained); the receipt says so (model_problem).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from posttrainllm.config import LabConfig, itemsize
from posttrainllm.ops.base import REFERENCE, BatchAxis, Case, Costs, Impl, ModelHook, OpDef, Tensors, seeded_randn
from posttrainllm.ops.peers import compiled
from posttrainllm.ops.rows import refuse_tile_auto
import posttrainllm.ops.layernorm.reference as reference  # the module (not the package: its OP is this file)

_LAYER_NORM = torch.nn.functional.layer_norm  # bound at import: a later replacement of torch's changes no peer

INPUT_KINDS = ("large", "offset", "small", "constant")
SCALES = {"normal": 1.0, "large": 1e4, "offset": 1.0, "small": 1e-4, "constant": 1.0}
# The `offset` rows' mean: mean(x²) − mean² in fp32 misses the contract there many times over. Not larger: on a row
# that far from zero every fp32 path's error is the rounding of its mean (half an ulp of the offset, per row, by
# luck), which the per-row contract would then compare instead of the variance
OFFSET = 32.0


def _reference(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": reference.layernorm(x["x"], x["weight"], x["bias"], cfg.op.eps)}


def _torch(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": _LAYER_NORM(x["x"], (x["x"].shape[-1],), x["weight"], x["bias"], cfg.op.eps)}


def _triton(x: Tensors, cfg: LabConfig) -> Tensors:
    from posttrainllm.ops.layernorm.kernels import layernorm

    return {"out": layernorm(x["x"], x["weight"], x["bias"], cfg.op.eps, block_c=cfg.tile.block_n,
                             num_warps=cfg.workgroup.num_warps)}


def _triton_geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
    """One program per row (forward, dx), one per column block (dW, dB), each walking tile.block_n columns."""
    from posttrainllm.ops.layernorm.kernels import layernorm_launch

    return layernorm_launch(case.dims["rows"], case.dims["hidden"], block_c=cfg.tile.block_n,
                            num_warps=cfg.workgroup.num_warps)


IMPLS = {
    REFERENCE: Impl(REFERENCE, "reference", _reference, backend="posttrainllm.ops.layernorm.reference.layernorm",
                    cost_model="materialised"),
    "torch": Impl("torch", "peer", _torch, backend="torch.nn.functional.layer_norm", cost_model="fused"),
    "triton": Impl("triton", "triton", _triton, geometry=_triton_geometry,
                   backend="posttrainllm.ops.layernorm.kernels.layernorm",
                   kernels={"forward": ("_layernorm_forward_kernel",),
                            "backward": ("_layernorm_backward_dx_kernel", "_layernorm_backward_dwdb_kernel")},
                   promises=("deterministic", "batch_invariant"),  # a program owns its row or columns; no atomics
                   cost_model="triton"),
}


def _case(rows: int, hidden: int, seed: int, main: bool, kind: str = "normal") -> Case:
    suffix = f"seed{seed}" if kind == "normal" else kind
    return Case(f"{rows}x{hidden}-{suffix}", seed, dict(rows=rows, hidden=hidden), main, kind)


def _cases(cfg: LabConfig) -> list[Case]:
    """Per seed: the point's (rows, C), a single row, then e x e for e > 1 in shape.edge_seq_lens (C = 1: the module
    docstring); on the first seed the point's shape with each adversarial kind (INPUT_KINDS). A size met twice runs
    once."""
    rows, hidden = cfg.shape.batch * cfg.shape.seq_len, cfg.architecture.d_model
    out = []
    for seed in cfg.parity.seeds:
        sizes = dict.fromkeys([(rows, hidden), (1, hidden), *((e, e) for e in cfg.shape.edge_seq_lens if e > 1)])
        out += [_case(r, c, seed, (r, c) == (rows, hidden)) for r, c in sizes]
    out += [_case(rows, hidden, cfg.parity.seeds[0], False, kind) for kind in INPUT_KINDS]
    return out


def _make_inputs(case: Case, dtype: torch.dtype, device: str) -> Tensors:
    """x standard normal (x1e4 for `large`, 32 + N(0, 1) for `offset`, x1e-4 for `small`; `constant`: every row
    one value, its first entry), weight = 1 + N(0, 0.5²) and bias = N(0, 0.5²) (neither the identity: a kernel
    that skips one fails), drawn in fp32 from the case's seed, cast to the point's dtype."""
    if case.inputs not in SCALES:
        raise ValueError(f"unknown layernorm input kind {case.inputs!r}: valid are normal, {', '.join(INPUT_KINDS)}")
    randn, d = seeded_randn(case.seed, torch.float32, "cpu"), case.dims
    x = randn(d["rows"], d["hidden"], scale=SCALES[case.inputs])  # (rows, C)
    weight = 1.0 + randn(d["hidden"], scale=0.5)  # (C,)
    bias = randn(d["hidden"], scale=0.5)  # (C,)
    if case.inputs == "offset":
        x = x + OFFSET
    if case.inputs == "constant":
        x = x[:, :1].expand(-1, d["hidden"]).contiguous()
    return {name: t.to(device=device, dtype=dtype) for name, t in (("x", x), ("weight", weight), ("bias", bias))}


def _problem(case: Case) -> str:
    return f"rows={case.dims['rows']} C={case.dims['hidden']}"


def _costs(case: Case, cfg: LabConfig) -> Costs:
    """Forward, per element: the mean's add, x − mean, its square and add, then (x − mean)·rstd·w + b (x − mean
    again, three more) -> 8·rows·C FLOPs (the per-row divides and rsqrt left out). Bytes, the floor: read x,
    weight and bias, write y in the point's dtype, and mean and rstd (8 B per row, saved for the backward).
    Backward, per element: g = dy·w, Σg, x̂ (2), g·x̂ and its add, then x̂ again (2) and dx (4), dW's x̂ (2) and
    multiply-add (2), dB's add -> 17·rows·C = 2.125x the forward; it reads x, dy, weight, mean, rstd and writes
    dx, dW, dB."""
    rows, hidden, size = case.dims["rows"], case.dims["hidden"], itemsize(cfg.precision.dtype)
    return Costs(8 * rows * hidden, (2 * rows * hidden + 2 * hidden) * size + 8 * rows, 2.125,
                 "8*rows*C", "(2*rows*C + 2*C)*itemsize + 8*rows (mean, rstd: fp32)",
                 "backward = 2.125 x forward (17*rows*C: dx = rstd*(g - mean(g) - x_hat*mean(g*x_hat)), g = dy*w, "
                 "dW = sum dy*x_hat, dB = sum dy); bytes: (3*rows*C + 3*C)*itemsize + 8*rows")



# --- each kind of path's own traffic (OpDef.path_costs; Impl.cost_model names one) --------------------------
#
# E = rows·C elements, R = rows, s the point's itemsize, c = 4 (the fp32 the reference and the kernels compute in).


def _materialised(case: Case, cfg: LabConfig) -> Costs:
    """The readable reference (reference.layernorm) as eager PyTorch runs it, every aten op reading its inputs and
    writing its outputs (measure/traffic.py counts the same, tests/test_traffic.py).

    forward, in c: the mean (E, R), x − mean (E + R, E), its square (E, E) and mean (E, R), + eps and rsqrt
    (2·R, 2·R), ·rstd (E + R, E), ·w (E + C, E), + b (E + C, E): c·(12·E + 8·R + 2·C). backward: those ops'
    gradients and dW, dB's sums over rows: c·(31·E + 12·R + 3·C). A 16-bit point adds the casts of x, w, b and y
    (and their gradients): (2·E + 2·C)·(s + c) each way. Working set: x, w, b and y in s, and two (rows, C) in c
    alive at once (x − mean and the next)."""
    rows, hidden, size = case.dims["rows"], case.dims["hidden"], itemsize(cfg.precision.dtype)
    e, c = rows * hidden, 4
    casts = 0 if size == c else (2 * e + 2 * hidden) * (size + c)
    forward = c * (12 * e + 8 * rows + 2 * hidden) + casts
    backward = c * (31 * e + 12 * rows + 3 * hidden) + casts
    cast = "" if size == c else " + (2*E + 2*C)*(s + c) (casts)"
    return dataclasses.replace(
        _costs(case, cfg), bytes=forward, bytes_formula=f"c*(12*E + 8*R + 2*C){cast} (E = rows*C, R = rows, c = 4)",
        train_bytes=forward + backward, train_bytes_formula=f"forward + c*(31*E + 12*R + 3*C){cast}",
        working_set=(2 * e + 2 * hidden) * size + 2 * e * c, working_set_formula="(2*E + 2*C)*s + 2*E*c",
        model="materialised",
        note="x − mean, its square and the products written and read in fp32, one eager op at a time (no cache "
             "between them)")


def _fused(case: Case, cfg: LabConfig) -> Costs:
    """One kernel each way (torch's native_layer_norm and its backward): forward the floor; backward, dy, x, w,
    mean and rstd read, dx, dW and dB written once: (3·E + 3·C)·s + 8·R."""
    rows, hidden, size = case.dims["rows"], case.dims["hidden"], itemsize(cfg.precision.dtype)
    floor = _costs(case, cfg)
    return dataclasses.replace(
        floor, train_bytes=floor.bytes + (3 * rows * hidden + 3 * hidden) * size + 8 * rows,
        train_bytes_formula="forward + (3*E + 3*C)*s + 8*R", working_set=floor.bytes,
        working_set_formula="= bytes (x, w, b, y, mean, rstd)", model="fused", note="one kernel each way")


def _triton_costs(case: Case, cfg: LabConfig) -> Costs:
    """The Triton kernels: forward the floor (a row's passes after the first read it from the cache). backward,
    two kernels: dx (dy, x, w, mean, rstd read; dx written) and dW/dB, one program per column block reading dy, x,
    mean and rstd again from memory and writing fp32 dW and dB (8·C), cast to a 16-bit weight's dtype (2·C·(c + s)):
    (5·E + C)·s + 16·R + 8·C."""
    rows, hidden, size = case.dims["rows"], case.dims["hidden"], itemsize(cfg.precision.dtype)
    e, c = rows * hidden, 4
    floor = _costs(case, cfg)
    backward = (5 * e + hidden) * size + 16 * rows + 8 * hidden + (0 if size == c else 2 * hidden * (c + size))
    return dataclasses.replace(
        floor, train_bytes=floor.bytes + backward,
        train_bytes_formula="forward + (5*E + C)*s + 16*R + 8*C" + ("" if size == c else " + 2*C*(c + s)"),
        working_set=floor.bytes, working_set_formula="= bytes (x, w, b, y, mean, rstd)", model="triton",
        note="one kernel forward; the backward's dW/dB kernel reads dy and x a second time")


PATH_COSTS = {"materialised": _materialised, "fused": _fused, "triton": _triton_costs}


def _curve_sizes(cfg: LabConfig) -> list[int]:
    """rows = shape.batch · S for S in shape.curve: the model's B·T at the curve's sequence lengths."""
    return [cfg.shape.batch * s for s in cfg.shape.curve]


def _curve_case(cfg: LabConfig, x: int) -> Case:
    return _case(x, cfg.architecture.d_model, cfg.parity.seeds[0], True)


def _fill(impl: Impl, cfg: LabConfig) -> Callable[..., torch.Tensor]:
    """Every norm of the model runs `impl.fn` on the rows of x (..., C) -> (rows, C), its weight cast to x's dtype
    and a zero bias (the model's norms have none: the bias's gradient is checked by parity, not trained). The
    model's eps must be op.eps: bench-train builds it so (model_overrides)."""

    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if eps != cfg.op.eps:
            raise ValueError(f"the model's norm eps={eps!r} is not op.eps={cfg.op.eps!r}: the eps checked by "
                             f"parity is op.eps; build the model with norm_eps=op.eps")
        rows = x.reshape(-1, x.shape[-1])  # (rows, C)
        bias = torch.zeros(x.shape[-1], device=x.device, dtype=x.dtype)  # not a parameter: no gradient asked
        return impl.fn({"x": rows, "weight": weight.to(x.dtype), "bias": bias}, cfg)["out"].reshape(x.shape)

    return norm


def _model_problem(cfg: LabConfig) -> str:
    arch, train = cfg.architecture, cfg.train
    return (f"rows={train.batch_size * train.seq_len} C={arch.d_model} eps={cfg.op.eps:g}, every norm a LayerNorm, "
            f"zero bias ({2 * arch.n_layers + 1} calls per step)")


def _check_config(cfg: LabConfig) -> None:
    """BLOCK_C is tile.block_n (a power of two >= 16, TileConfig); tile=auto tunes nothing here."""
    refuse_tile_auto(cfg, "layernorm")


def _reference_bytes(case: Case, cfg: LabConfig) -> int:
    """The float64 oracle through autograd: x, dy, y, dx and ~5 intermediates of (rows, C), then the same in the
    point's precision and fp32: ~18 float64-sized copies."""
    return 18 * case.dims["rows"] * case.dims["hidden"] * 8


SIGNATURE = ("fn(x, weight, bias, eps) -> y; x (rows, C), weight (C,), bias (C,), eps a float (op.eps); y (rows, C) "
             "in x's dtype = (x - mean(x)) / sqrt(var(x) + eps) · weight + bias over the last dim")

TEMPLATE = '''
import torch


def {name}(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm: y = (x - mean(x)) / sqrt(var(x) + eps) · weight + bias over the last dim (biased variance).

    x: (rows, C), weight: (C,), bias: (C,), eps: op.eps -> (rows, C) in x's dtype. The lab checks it against
    float64 math, per element and per row, forward and the gradients of x, weight and bias (autograd through this
    function, or your own torch.autograd.Function); no autograd history: forward-only. Its cases include rows of
    ~1e4 (x² overflows fp16), rows at 32 + N(0, 1) (mean(x²) - mean² cancels), rows of ~1e-4 (var << eps) and
    constant rows (var = 0).
    """
    x32 = x.float()  # fp32 statistics
    centred = x32 - x32.mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt(centred.pow(2).mean(dim=-1, keepdim=True) + eps)  # (rows, 1), eps inside the root
    return (centred * rstd * weight.float() + bias.float()).to(x.dtype)
'''


def _adapt(fn: Any) -> Any:
    def path(x: Tensors, cfg: LabConfig) -> Tensors:
        return {"out": fn(x["x"], x["weight"], x["bias"], cfg.op.eps)}

    path.__name__ = getattr(fn, "__name__", "user")
    return path


OP = OpDef(
    name="layernorm", x_name="rows", input_names=("x", "weight", "bias"), impls=IMPLS, cases=_cases,
    make_inputs=_make_inputs, problem=_problem, costs=_costs, curve_case=_curve_case, model_hook=ModelHook("norm", _fill),
    model_problem=_model_problem,
    check_config=_check_config, reference_bytes=_reference_bytes, curve_sizes=_curve_sizes,
    path_costs=PATH_COSTS,
    model_overrides=lambda cfg: {"norm_eps": cfg.op.eps},
    optional_peers={"compiled": compiled("layernorm", _reference, _make_inputs,
                                         "posttrainllm.ops.layernorm.reference.layernorm")},
    signature=SIGNATURE, adapt=_adapt, template=TEMPLATE,
    batch_axis=BatchAxis("a token", {"x": 0}, {"out": 0},
                         note="grad_weight and grad_bias sum over the tokens: not a token's"),
)
