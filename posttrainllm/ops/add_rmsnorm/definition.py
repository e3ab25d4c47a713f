"""The pre-norm block's residual add + RMSNorm as a lab op: h = x + r; y = h / sqrt(mean(h², last dim) + eps) · w,
x, r (rows, C), weight w (C,) -> out = y (rows, C) and h (rows, C), both returned and both differentiable.

A pre-norm transformer block runs "x = x + attn(...); mlp(norm(x))": the add writes the residual stream h and the
norm reads it straight back. Fused, h is written once and never re-read; both outputs feed the rest of the graph,
so each brings its own upstream gradient (OpDef.differentiable_outputs; lab/oracle.py upstream_gradients), and a
backward that ignores h's gradient fails parity on grad_x and grad_residual.

Paths (one function each: checked and timed as the same function):
    reference   reference.add_rmsnorm: fp32 math (float64 for the oracle), h rounded once for its output
    torch       h = x + r in the point's dtype, then torch.nn.functional.rms_norm(h): PyTorch unfused
    triton      kernels.add_rmsnorm: one row per program in blocks of tile.block_n columns (h and Σh², then y);
                dx = dr one row per program, dW one program per column block (no atomics)
    compiled    (opt-in, op.peers) the reference under torch.compile
    user paths  op.user_impls, in the natural signature SIGNATURE

Cases: the point's (rows, C) with rows = shape.batch · shape.seq_len and C = architecture.d_model; a single row;
e x e for e in shape.edge_seq_lens (C off every block); and, on the first seed, rows of ~1e4 (h² overflows fp16
unless upcast), of ~1e-4 (mean(h²) ~1e-8 << eps: where eps sits shows) and rows where r = −x (h = 0 exactly: eps
alone keeps y finite, and a kernel that normalises x or r instead of their sum shows).

bench-train: in every block of the model, the residual add after attention and the MLP's norm become this op's
path (the model's add_norm slot: y feeds the MLP, h the residual stream), with the model built at norm_eps = op.eps; the
other norms (before attention, the final one) stay the model's RMSNorm. The receipt says so (model_problem).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from posttrainllm.config import LabConfig, itemsize
from posttrainllm.ops.base import (LIBRARY, REFERENCE, BatchAxis, Case, Costs, Impl, ModelHook, OpDef, Tensors,
                                      seeded_randn)
from posttrainllm.ops.peers import compiled
from posttrainllm.ops.rows import refuse_tile_auto
import posttrainllm.ops.add_rmsnorm.reference as reference  # the module (not the package: its OP is this file)

_RMS_NORM = LIBRARY["torch.nn.functional.rms_norm"]  # bound at start (base.LIBRARY)

INPUT_KINDS = ("large", "small", "cancel")
SCALES = {"normal": 1.0, "large": 1e4, "small": 1e-4, "cancel": 1.0}
OUTPUTS = ("out", "h")


def _reference(x: Tensors, cfg: LabConfig) -> Tensors:
    y, h = reference.add_rmsnorm(x["x"], x["residual"], x["weight"], cfg.op.eps)
    return {"out": y, "h": h}


def _torch(x: Tensors, cfg: LabConfig) -> Tensors:
    h = x["x"] + x["residual"]  # rounded to the point's dtype, as the unfused model adds
    return {"out": _RMS_NORM(h, (h.shape[-1],), x["weight"], cfg.op.eps), "h": h}


def _triton(x: Tensors, cfg: LabConfig) -> Tensors:
    from posttrainllm.ops.add_rmsnorm.kernels import add_rmsnorm

    y, h = add_rmsnorm(x["x"], x["residual"], x["weight"], cfg.op.eps, block_c=cfg.tile.block_n,
                       num_warps=cfg.workgroup.num_warps)
    return {"out": y, "h": h}


def _triton_geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
    """One program per row (forward, dx and dr), one per column block (dW), each walking tile.block_n columns."""
    from posttrainllm.ops.add_rmsnorm.kernels import add_rmsnorm_launch

    return add_rmsnorm_launch(case.dims["rows"], case.dims["hidden"], block_c=cfg.tile.block_n,
                              num_warps=cfg.workgroup.num_warps)


IMPLS = {
    REFERENCE: Impl(REFERENCE, "reference", _reference, outputs=OUTPUTS,
                    backend="posttrainllm.ops.add_rmsnorm.reference.add_rmsnorm", cost_model="materialised"),
    # torch's rms_norm: composite aten ops on the CPU, a fused kernel on CUDA: no model, placed at the floor
    "torch": Impl("torch", "peer", _torch, outputs=OUTPUTS, backend="x + r, then torch.nn.functional.rms_norm"),
    "triton": Impl("triton", "triton", _triton, outputs=OUTPUTS, geometry=_triton_geometry,
                   backend="posttrainllm.ops.add_rmsnorm.kernels.add_rmsnorm",
                   kernels={"forward": ("_add_rmsnorm_forward_kernel",),
                            "backward": ("_add_rmsnorm_backward_dx_kernel", "_add_rmsnorm_backward_dw_kernel")},
                   promises=("deterministic", "batch_invariant"),  # a program owns its row or columns; no atomics
                   cost_model="triton"),
}


def _case(rows: int, hidden: int, seed: int, main: bool, kind: str = "normal") -> Case:
    suffix = f"seed{seed}" if kind == "normal" else kind
    return Case(f"{rows}x{hidden}-{suffix}", seed, dict(rows=rows, hidden=hidden), main, kind)


def _cases(cfg: LabConfig) -> list[Case]:
    """Per seed: the point's (rows, C), a single row, then e x e for e in shape.edge_seq_lens; on the first seed the
    point's shape with each adversarial kind (INPUT_KINDS). A size met twice runs once."""
    rows, hidden = cfg.shape.batch * cfg.shape.seq_len, cfg.architecture.d_model
    out = []
    for seed in cfg.parity.seeds:
        sizes = dict.fromkeys([(rows, hidden), (1, hidden), *((e, e) for e in cfg.shape.edge_seq_lens)])
        out += [_case(r, c, seed, (r, c) == (rows, hidden)) for r, c in sizes]
    out += [_case(rows, hidden, cfg.parity.seeds[0], False, kind) for kind in INPUT_KINDS]
    return out


def _make_inputs(case: Case, dtype: torch.dtype, device: str) -> Tensors:
    """x and residual standard normal (x1e4 for `large`, x1e-4 for `small`; `cancel`: residual = −x on the first
    and the last row, so h = 0 there) and weight = 1 + N(0, 0.5²) (not all ones: a kernel that skips the weight
    fails), drawn in fp32 from the case's seed, cast to the point's dtype."""
    if case.inputs not in SCALES:
        raise ValueError(f"unknown add_rmsnorm input kind {case.inputs!r}: valid are normal, "
                         f"{', '.join(INPUT_KINDS)}")
    randn, d = seeded_randn(case.seed, torch.float32, "cpu"), case.dims
    x = randn(d["rows"], d["hidden"], scale=SCALES[case.inputs])  # (rows, C)
    residual = randn(d["rows"], d["hidden"], scale=SCALES[case.inputs])  # (rows, C)
    weight = 1.0 + randn(d["hidden"], scale=0.5)  # (C,)
    if case.inputs == "cancel":
        residual[0], residual[-1] = -x[0], -x[-1]
    return {name: t.to(device=device, dtype=dtype) for name, t in (("x", x), ("residual", residual),
                                                                     ("weight", weight))}


def _problem(case: Case) -> str:
    return f"rows={case.dims['rows']} C={case.dims['hidden']}"


def _costs(case: Case, cfg: LabConfig) -> Costs:
    """Forward, per element: x + r, h² and its add, h·rstd·w (x + r again, two more) -> 6·rows·C FLOPs (the per-row
    rsqrt left out). Bytes, the floor: read x, r and weight, write y and h in the point's dtype, and rstd (4 B per
    row, saved). Backward, per element: ĥ (2), g·ĥ (2) and its add, then ĥ again (2), g, the dx sum (4), dh's add,
    dW's ĥ (2) and multiply-add (2) -> 18·rows·C = 3x the forward; it reads dy, dh, x, r, weight, rstd and writes
    dx, dr and dW."""
    rows, hidden, size = case.dims["rows"], case.dims["hidden"], itemsize(cfg.precision.dtype)
    return Costs(6 * rows * hidden, (4 * rows * hidden + hidden) * size + 4 * rows, 3.0,
                 "6*rows*C", "(4*rows*C + C)*itemsize + 4*rows (read x, r, w; write y, h; rstd fp32)",
                 "backward = 3 x forward (18*rows*C: dx = dr = rstd*(g - h_hat*mean(g*h_hat)) + dh, g = dy*w, "
                 "dW = sum dy*h_hat); bytes: (6*rows*C + 2*C)*itemsize + 4*rows")



# --- each kind of path's own traffic (OpDef.path_costs; Impl.cost_model names one) --------------------------
#
# E = rows·C elements, R = rows, s the point's itemsize, c = 4 (the fp32 the reference and the kernels compute in).


def _materialised(case: Case, cfg: LabConfig) -> Costs:
    """The readable reference (reference.add_rmsnorm) as eager PyTorch runs it, every aten op reading its inputs and
    writing its outputs (measure/traffic.py counts the same, tests/test_traffic.py).

    forward, in c: x + r (2·E, E), h² (E, E), its mean (E, R), + eps and rsqrt (2·R, 2·R), h·rstd (E + R, E), ·w
    (E + C, E): c·(10·E + 6·R + C). backward: those ops' gradients, dh's add into h's and dW's sum over rows:
    c·(28·E + 10·R + 2·C). A 16-bit point adds the casts of x, r, w, y and h: (4·E + C)·(s + c) forward; backward
    the same less one in-place (rows, C) add the fp32 graph runs and the 16-bit one does not (2·E·c).
    Working set: x, r, w, y and h in s, and two (rows, C) in c alive at once (h·rstd and the next)."""
    rows, hidden, size = case.dims["rows"], case.dims["hidden"], itemsize(cfg.precision.dtype)
    e, c = rows * hidden, 4
    casts = 0 if size == c else (4 * e + hidden) * (size + c)
    forward = c * (10 * e + 6 * rows + hidden) + casts
    backward = c * (28 * e + 10 * rows + 2 * hidden) + (0 if size == c else casts - 2 * e * c)
    return dataclasses.replace(
        _costs(case, cfg), bytes=forward,
        bytes_formula="c*(10*E + 6*R + C)" + ("" if size == c else " + (4*E + C)*(s + c) (casts)")
                      + " (E = rows*C, R = rows, c = 4)",
        train_bytes=forward + backward,
        train_bytes_formula="forward + c*(28*E + 10*R + 2*C)" + ("" if size == c else
                                                                 " + (4*E + C)*(s + c) - 2*E*c (casts)"),
        working_set=(4 * e + hidden) * size + 2 * e * c, working_set_formula="(4*E + C)*s + 2*E*c",
        model="materialised",
        note="h, h², h·rstd and the product written and read in fp32, one eager op at a time (no cache between them)")


def _triton_costs(case: Case, cfg: LabConfig) -> Costs:
    """The Triton kernels: forward the floor (pass 2 re-reads x and r from the cache). backward, two kernels: dx/dr
    (dy, dh, x, r, w, rstd read; dx and dr written) and dW, one program per column block reading dy, x, r and rstd
    again from memory and writing fp32 dW (4·C), cast to a 16-bit weight's dtype (C·(c + s)):
    (9·E + C)·s + 8·R + 4·C."""
    rows, hidden, size = case.dims["rows"], case.dims["hidden"], itemsize(cfg.precision.dtype)
    e, c = rows * hidden, 4
    floor = _costs(case, cfg)
    backward = (9 * e + hidden) * size + 8 * rows + 4 * hidden + (0 if size == c else hidden * (c + size))
    return dataclasses.replace(
        floor, train_bytes=floor.bytes + backward,
        train_bytes_formula="forward + (9*E + C)*s + 8*R + 4*C" + ("" if size == c else " + C*(c + s)"),
        working_set=floor.bytes, working_set_formula="= bytes (x, r, w, y, h, rstd)", model="triton",
        note="one kernel forward; the backward's dW kernel reads dy, x and r a second time")


PATH_COSTS = {"materialised": _materialised, "triton": _triton_costs}


def _curve_sizes(cfg: LabConfig) -> list[int]:
    """rows = shape.batch · S for S in shape.curve: the model's B·T at the curve's sequence lengths."""
    return [cfg.shape.batch * s for s in cfg.shape.curve]


def _curve_case(cfg: LabConfig, x: int) -> Case:
    return _case(x, cfg.architecture.d_model, cfg.parity.seeds[0], True)


def _fill(impl: Impl, cfg: LabConfig) -> Callable[..., torch.Tensor]:
    """Each block's add + norm runs `impl.fn` on the rows of x and a (..., C) -> (rows, C), a cast to x's dtype (the
    residual stream's: the unfused model's x + a promotes to it too) and the norm's weight likewise. The model's eps
    must be op.eps: bench-train builds it so (model_overrides); any other refuses."""

    def add_norm(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if eps != cfg.op.eps:
            raise ValueError(f"the model's norm eps={eps!r} is not op.eps={cfg.op.eps!r}: the eps checked by "
                             f"parity is op.eps; build the model with norm_eps=op.eps")
        c = x.shape[-1]
        got = impl.fn({"x": x.reshape(-1, c), "residual": a.to(x.dtype).reshape(-1, c),
                       "weight": weight.to(x.dtype)}, cfg)
        return got["out"].reshape(x.shape), got["h"].reshape(x.shape)

    return add_norm


def _model_problem(cfg: LabConfig) -> str:
    arch, train = cfg.architecture, cfg.train
    return (f"rows={train.batch_size * train.seq_len} C={arch.d_model} eps={cfg.op.eps:g}, each block's add after "
            f"attention and MLP norm ({arch.n_layers} calls per step)")


def _check_config(cfg: LabConfig) -> None:
    """BLOCK_C is tile.block_n (a power of two >= 16, TileConfig); tile=auto tunes nothing here."""
    refuse_tile_auto(cfg, "add_rmsnorm")


def _reference_bytes(case: Case, cfg: LabConfig) -> int:
    """The float64 oracle through autograd: x, r, h, y, dy, dh, dx, dr and ~4 intermediates of (rows, C), then the
    same in the point's precision and fp32: ~24 float64-sized copies."""
    return 24 * case.dims["rows"] * case.dims["hidden"] * 8


SIGNATURE = ("fn(x, residual, weight, eps) -> (y, h); x, residual (rows, C), weight (C,), eps a float (op.eps); "
             "h = x + residual and y = h / sqrt(mean(h², last dim) + eps) · weight, both (rows, C) in x's dtype")

TEMPLATE = '''
import torch


def {name}(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm block's residual add + RMSNorm: h = x + residual; y = h / sqrt(mean(h²) + eps) · weight.

    x, residual: (rows, C), weight: (C,), eps: op.eps -> (y, h), both (rows, C) in x's dtype. The lab checks both
    against float64 math, per element and per row, forward and the gradients of x, residual and weight, with an
    upstream gradient for y and another for h (autograd through this function, or your own
    torch.autograd.Function); no autograd history: forward-only. Its cases include rows of ~1e4 (h² overflows
    fp16), of ~1e-4 (mean(h²) << eps) and rows where residual = -x (h = 0).
    """
    h = x.float() + residual.float()  # fp32 sum
    rstd = torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)  # (rows, 1), eps inside the root
    return (h * rstd * weight.float()).to(x.dtype), h.to(x.dtype)
'''


def _adapt(fn: Any) -> Any:
    def path(x: Tensors, cfg: LabConfig) -> Tensors:
        y, h = fn(x["x"], x["residual"], x["weight"], cfg.op.eps)
        return {"out": y, "h": h}

    path.__name__ = getattr(fn, "__name__", "user")
    return path


OP = OpDef(
    name="add_rmsnorm", x_name="rows", input_names=("x", "residual", "weight"), impls=IMPLS, cases=_cases,
    make_inputs=_make_inputs, problem=_problem, costs=_costs, curve_case=_curve_case, model_hook=ModelHook("add_norm", _fill),
    model_problem=_model_problem,
    check_config=_check_config, reference_bytes=_reference_bytes, curve_sizes=_curve_sizes,
    path_costs=PATH_COSTS,
    differentiable_outputs=OUTPUTS, model_overrides=lambda cfg: {"norm_eps": cfg.op.eps},
    optional_peers={"compiled": compiled("add_rmsnorm", _reference, _make_inputs,
                                         "posttrainllm.ops.add_rmsnorm.reference.add_rmsnorm")},
    signature=SIGNATURE, adapt=_adapt, template=TEMPLATE,
    batch_axis=BatchAxis("a token", {"x": 0, "residual": 0}, {"out": 0, "h": 0},
                         note="grad_weight sums over the tokens: not a token's"),
)
