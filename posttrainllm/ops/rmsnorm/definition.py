"""RMSNorm as a lab op: y = x / sqrt(mean(x², last dim) + eps) · weight, x (rows, C), weight (C,) -> y (rows, C).

Paths (one function each: checked, timed and trained as every RMSNorm of the model):
    reference   posttrainllm.ops.rmsnorm.reference.rmsnorm: fp32 math (float64 for the oracle), rounded once
    torch       torch.nn.functional.rms_norm (PyTorch's own, with weight and eps)
    triton      posttrainllm.ops.rmsnorm.kernels: one row per program, rstd saved; the backward's dW from per-program
                fp32 partials summed by torch (no atomics)
    compiled    (opt-in, op.peers) the reference under torch.compile
    user paths  op.user_impls, in the natural signature SIGNATURE (lab/isolation/user.py)

eps is op.eps (conf/op/rmsnorm.yaml); bench-train builds its model with norm_eps = op.eps (model_overrides),
and the model hook refuses any other eps, so the eps trained is the eps checked.

Cases: the point's (rows, C) with rows = shape.batch · shape.seq_len (the tokens of the attention problem) and
C = architecture.d_model; a single row; C (and rows) off every power of two (shape.edge_seq_lens); and, on the
first seed, rows of ~1e4 (x² overflows fp16 unless upcast), rows of ~1e-4 (mean(x²) ~1e-8 << eps: where eps sits
shows) and all-zero rows (eps keeps them finite: y = 0, dx = rstd·w·dy).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from posttrainllm.config import ConfigError, LabConfig, itemsize, next_power_of_two
from posttrainllm.ops.base import (LIBRARY, REFERENCE, BatchAxis, Case, Costs, Impl, ModelHook, OpDef, Tensors,
                                   seeded_randn)
from posttrainllm.ops.peers import compiled
from posttrainllm.ops.rows import MAX_BLOCK_C
import posttrainllm.ops.rmsnorm.reference as reference

_RMS_NORM = LIBRARY["torch.nn.functional.rms_norm"]  # bound at start (base.LIBRARY)

INPUT_KINDS = ("large", "small", "zero_rows")
SCALES = {"normal": 1.0, "large": 1e4, "small": 1e-4, "zero_rows": 1.0}


def _reference(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": reference.rmsnorm(x["x"], x["weight"], cfg.op.eps)}


def _torch(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": _RMS_NORM(x["x"], (x["x"].shape[-1],), x["weight"], cfg.op.eps)}


def _on_cuda(cfg: LabConfig) -> bool:
    return cfg.device.name == "cuda" or (cfg.device.name == "auto" and torch.cuda.is_available())


def _sm_count(cfg: LabConfig) -> int | None:
    """The point's GPU's SM count (the backward's programs); None off CUDA."""
    return torch.cuda.get_device_properties(0).multi_processor_count if _on_cuda(cfg) else None


def _triton(x: Tensors, cfg: LabConfig) -> Tensors:
    from posttrainllm.ops.rmsnorm.kernels import rmsnorm

    return {"out": rmsnorm(x["x"], x["weight"], cfg.op.eps, num_warps=cfg.workgroup.num_warps)}


def _triton_geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
    """One forward program per row; the backward's P programs (the GPU's SM count) and their dW partials.
    tile and workgroup=auto tune nothing here: the row is the block, and workgroup's num_warps runs."""
    from posttrainllm.ops.rmsnorm.kernels import rmsnorm_launch

    return rmsnorm_launch(case.dims["rows"], case.dims["hidden"], num_warps=cfg.workgroup.num_warps,
                          sm_count=_sm_count(cfg))


IMPLS = {
    REFERENCE: Impl(REFERENCE, "reference", _reference, backend="posttrainllm.ops.rmsnorm.reference.rmsnorm",
                    cost_model="materialised"),
    # torch's rms_norm: composite aten ops on the CPU, a fused kernel on CUDA: no model, placed at the floor
    "torch": Impl("torch", "peer", _torch, backend="torch.nn.functional.rms_norm"),
    "triton": Impl("triton", "triton", _triton, geometry=_triton_geometry,
                   backend="posttrainllm.ops.rmsnorm.rmsnorm",
                   kernels={"forward": ("_rmsnorm_forward_kernel",), "backward": ("_rmsnorm_backward_kernel",)},
                   promises=("deterministic", "batch_invariant"),  # no atomics; a program owns its rows (checked)
                   cost_model="triton"),
}


def _main_rows(cfg: LabConfig) -> int:
    return cfg.shape.batch * cfg.shape.seq_len


def _case(rows: int, hidden: int, seed: int, main: bool, kind: str = "normal") -> Case:
    suffix = f"seed{seed}" if kind == "normal" else kind
    return Case(f"{rows}x{hidden}-{suffix}", seed, dict(rows=rows, hidden=hidden), main, kind)


def _cases(cfg: LabConfig) -> list[Case]:
    """Per seed: the point's (rows, C), a single row, then e x e for e in shape.edge_seq_lens (C off every
    power of two, so BLOCK_C is masked, and rows off the backward's row groups). On the first seed: the
    point's shape with rows of ~1e4, of ~1e-4, and with all-zero rows. A size met twice runs once."""
    rows, hidden = _main_rows(cfg), cfg.architecture.d_model
    out = []
    for seed in cfg.parity.seeds:
        sizes = dict.fromkeys([(rows, hidden), (1, hidden), *((e, e) for e in cfg.shape.edge_seq_lens)])
        out += [_case(r, c, seed, (r, c) == (rows, hidden)) for r, c in sizes]
    out += [_case(rows, hidden, cfg.parity.seeds[0], False, kind) for kind in INPUT_KINDS]
    return out


def _make_inputs(case: Case, dtype: torch.dtype, device: str) -> Tensors:
    """x standard normal (x1e4 for `large`, x1e-4 for `small`; `zero_rows`: the first and the last row all 0)
    and weight = 1 + N(0, 0.5²) (not all ones: a kernel that skips the weight fails), drawn in fp32 from the
    case's seed, cast to the point's dtype."""
    if case.inputs not in SCALES:
        raise ValueError(f"unknown rmsnorm input kind {case.inputs!r}: valid are normal, {', '.join(INPUT_KINDS)}")
    randn, d = seeded_randn(case.seed, torch.float32, "cpu"), case.dims
    x = randn(d["rows"], d["hidden"], scale=SCALES[case.inputs])  # (rows, C)
    weight = 1.0 + randn(d["hidden"], scale=0.5)  # (C,)
    if case.inputs == "zero_rows":
        x[0] = 0.0
        x[-1] = 0.0
    return {"x": x.to(device=device, dtype=dtype), "weight": weight.to(device=device, dtype=dtype)}


def _problem(case: Case) -> str:
    d = case.dims
    return f"rows={d['rows']} C={d['hidden']}"


def _costs(case: Case, cfg: LabConfig) -> Costs:
    """Forward, per element: x², its add into Σx², x·rstd, ·w -> 4·rows·C FLOPs (the per-row mean and rsqrt are
    left out). Bytes: read x and weight, write y in the point's dtype, and rstd (4 B per row, saved for the
    backward). Backward, per element: x̂ = x·rstd, g = dy·w, g·x̂ and its add, x̂·mean, g − it, ·rstd, and the dW
    partial's multiply-add -> 9·rows·C = 2.25x the forward (the (P, C) partials' sum left out); it moves
    about 1.5x the forward's bytes: reads x, dy, weight, rstd, writes dx (and P·C fp32 partials)."""
    d, size = case.dims, itemsize(cfg.precision.dtype)
    rows, hidden = d["rows"], d["hidden"]
    return Costs(4 * rows * hidden, (2 * rows * hidden + hidden) * size + 4 * rows, 2.25,
                 "4*rows*C", "(2*rows*C + C)*itemsize + 4*rows (rstd, fp32)",
                 "backward = 2.25 x forward (9*rows*C: dx = rstd*(g - x_hat*mean(g*x_hat)), g = dy*w, "
                 "dW += dy*x_hat); bytes ~1.5 x forward: (3*rows*C + C)*itemsize + 4*rows + 8*P*C partials")



# --- each kind of path's own traffic (OpDef.path_costs; Impl.cost_model names one) --------------------------
#
# E = rows·C elements, R = rows, s the point's itemsize, c = 4 (the fp32 the reference and the kernel compute in).


def _materialised(case: Case, cfg: LabConfig) -> Costs:
    """The readable reference (reference.rmsnorm) as eager PyTorch runs it, every aten op reading its inputs and
    writing its outputs (measure/traffic.py counts the same, tests/test_traffic.py).

    forward, in c: x² (E, E), its mean (E, R), + eps and rsqrt (2·R, 2·R), x·rstd (E + R, E), ·w (E + C, E):
    c·(7·E + 6·R + C). backward: the products', the mean's and the square's gradients, and dW's sum over rows:
    c·(23·E + 10·R + 2·C). A 16-bit point adds the casts of x, w and y (and their gradients): (2·E + C)·(s + c)
    each way. Working set: x, w and y in s, and two (rows, C) in c alive at once (x·rstd and its product)."""
    rows, hidden, size = case.dims["rows"], case.dims["hidden"], itemsize(cfg.precision.dtype)
    e, c = rows * hidden, 4
    casts = 0 if size == c else (2 * e + hidden) * (size + c)
    forward = c * (7 * e + 6 * rows + hidden) + casts
    backward = c * (23 * e + 10 * rows + 2 * hidden) + casts
    cast = "" if size == c else " + (2*E + C)*(s + c) (casts)"
    return dataclasses.replace(
        _costs(case, cfg), bytes=forward, bytes_formula=f"c*(7*E + 6*R + C){cast} (E = rows*C, R = rows, c = 4)",
        train_bytes=forward + backward, train_bytes_formula=f"forward + c*(23*E + 10*R + 2*C){cast}",
        working_set=(2 * e + hidden) * size + 2 * e * c, working_set_formula="(2*E + C)*s + 2*E*c",
        model="materialised",
        note="x², x·rstd and the product written and read in fp32, one eager op at a time (no cache between them)")


def _triton_costs(case: Case, cfg: LabConfig) -> Costs:
    """The Triton kernel: forward, x and w read, y and rstd written once (the floor). backward, one pass: x, dy, w
    and rstd read, dx written, and P programs' (C,) fp32 dW partials written and summed by torch (8·P·C + 4·C);
    a 16-bit weight's dW cast (C·(c + s)). P: the backward's programs (kernels.backward_programs, on this device)."""
    from posttrainllm.ops.rmsnorm.kernels import backward_programs

    rows, hidden, size = case.dims["rows"], case.dims["hidden"], itemsize(cfg.precision.dtype)
    e, c = rows * hidden, 4
    programs, _ = backward_programs(rows, _sm_count(cfg))
    floor = _costs(case, cfg)
    backward = (3 * e + hidden) * size + 4 * rows + 8 * programs * hidden + 4 * hidden
    backward += 0 if size == c else hidden * (c + size)
    return dataclasses.replace(
        floor, train_bytes=floor.bytes + backward,
        train_bytes_formula="forward + (3*E + C)*s + 4*R + 8*P*C + 4*C" + ("" if size == c else " + C*(c + s)")
                            + f" (P = {programs} programs' dW partials)",
        working_set=floor.bytes, working_set_formula="= bytes (x, w, y, rstd)", model="triton",
        note=f"one kernel each way; the backward's dW from {programs} programs' fp32 partials")


PATH_COSTS = {"materialised": _materialised, "triton": _triton_costs}


def _curve_sizes(cfg: LabConfig) -> list[int]:
    """rows = shape.batch · S for S in shape.curve: the model's B·T at the curve's sequence lengths."""
    return [cfg.shape.batch * s for s in cfg.shape.curve]


def _curve_case(cfg: LabConfig, x: int) -> Case:
    return _case(x, cfg.architecture.d_model, cfg.parity.seeds[0], True)


def _fill(impl: Impl, cfg: LabConfig) -> Callable[..., torch.Tensor]:
    """Every RMSNorm of the model runs `impl.fn` on the rows of x (..., C) -> (rows, C) and its weight, cast to
    x's dtype (the pair parity checked; the same dtype in this model, whose residual stream stays fp32 under
    autocast). The model's eps must be op.eps: bench-train builds it so (model_overrides); any other refuses."""

    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if eps != cfg.op.eps:
            raise ValueError(f"the model's RMSNorm eps={eps!r} is not op.eps={cfg.op.eps!r}: the eps checked by "
                             f"parity is op.eps; build the model with norm_eps=op.eps")
        rows = x.reshape(-1, x.shape[-1])  # (rows, C)
        return impl.fn({"x": rows, "weight": weight.to(x.dtype)}, cfg)["out"].reshape(x.shape)

    return norm


def _model_problem(cfg: LabConfig) -> str:
    arch, train = cfg.architecture, cfg.train
    return (f"rows={train.batch_size * train.seq_len} C={arch.d_model} eps={cfg.op.eps:g} "
            f"(2 per block + the final norm: {2 * arch.n_layers + 1} calls per step)")


def _check_config(cfg: LabConfig) -> None:
    """A row lives in one program: C (d_model and the edge sizes) at most MAX_BLOCK_C (ops/rows.py, the kernel's bound), BLOCK_C being its next power
    of two."""
    for where, hidden in [("architecture.d_model", cfg.architecture.d_model),
                          *(("shape.edge_seq_lens", e) for e in cfg.shape.edge_seq_lens)]:
        if next_power_of_two(hidden) > MAX_BLOCK_C:
            raise ConfigError(f"{where}={hidden}: an rmsnorm row must fit one program (C <= {MAX_BLOCK_C})")


def _reference_bytes(case: Case, cfg: LabConfig) -> int:
    """The float64 oracle through autograd: x, dy, y, dx and ~4 intermediates of (rows, C), then the same in the
    point's precision and fp32: ~16 float64-sized copies."""
    d = case.dims
    return 16 * d["rows"] * d["hidden"] * 8


SIGNATURE = ("fn(x, weight, eps) -> y; x (rows, C), weight (C,), eps a float (op.eps); y (rows, C) in x's dtype = "
             "x / sqrt(mean(x², last dim) + eps) · weight")

TEMPLATE = '''
import torch


def {name}(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm: y = x / sqrt(mean(x², last dim) + eps) · weight.

    x: (rows, C), weight: (C,), eps: op.eps -> (rows, C) in x's dtype. The lab checks it against float64 math,
    per element and per row, forward and the gradients of x and weight (autograd through this function, or
    your own torch.autograd.Function); no autograd history: forward-only. Its cases include rows of ~1e4
    (x² overflows fp16), of ~1e-4 (mean(x²) << eps) and of zeros.
    """
    x32 = x.float()  # fp32 accumulation
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)  # (rows, 1), eps inside the root
    return (x32 * rstd * weight.float()).to(x.dtype)
'''


def _adapt(fn: Any) -> Any:
    def path(x: Tensors, cfg: LabConfig) -> Tensors:
        return {"out": fn(x["x"], x["weight"], cfg.op.eps)}

    path.__name__ = getattr(fn, "__name__", "user")
    return path


OP = OpDef(
    name="rmsnorm", x_name="rows", input_names=("x", "weight"), impls=IMPLS, cases=_cases, make_inputs=_make_inputs,
    problem=_problem, costs=_costs, curve_case=_curve_case, model_hook=ModelHook("norm", _fill), model_problem=_model_problem,
    model_defaults={"norm": reference.rmsnorm}, check_config=_check_config, reference_bytes=_reference_bytes, curve_sizes=_curve_sizes,
    path_costs=PATH_COSTS,
    model_overrides=lambda cfg: {"norm_eps": cfg.op.eps},
    optional_peers={"compiled": compiled("rmsnorm", _reference, _make_inputs, "posttrainllm.ops.rmsnorm.reference.rmsnorm")},
    signature=SIGNATURE, adapt=_adapt, template=TEMPLATE,
    batch_axis=BatchAxis("a token", {"x": 0}, {"out": 0}, note="grad_weight sums over the tokens: not a token's"),
)
