"""Row softmax as a lab op: y = softmax(x) along the last dim, x (rows, C) -> y (rows, C).

The problem is one attention head's probabilities: rows = shape.batch · shape.seq_len queries, C = shape.seq_len
keys, so the curve over seq_len grows the problem as S² (what makes the (S, S) matrix attention's villain).

Paths (one function each: checked and timed as the same function):
    reference   posttrainllm.ops.softmax.reference.softmax: the max-subtracted math in fp32 (float64 for the oracle)
    torch       torch.softmax (PyTorch's own)
    triton      posttrainllm.ops.softmax.kernels: one row per program, online max and sum over BLOCK_C = tile.block_n
                columns at a time, then a second pass writing y; the backward reads the saved y
    compiled    (opt-in, op.peers) the reference under torch.compile
    user paths  op.user_impls, in the natural signature SIGNATURE (lab/isolation/user.py)

Cases: per seed the point's (B·S, S), a single row, and e x e for e in shape.edge_seq_lens (C off every block, so
the last block is masked); on the first seed, logits of ~1e4 (exp overflows in every dtype unless the row max is
subtracted first), of ~1e-4 (nearly uniform rows: y ≈ 1/C, where a wrong normaliser shows) and constant rows
(y = 1/C exactly, dx = 0 for a dy constant per row).

bench-train: the lab's transformer has no softmax layer of its own (its softmax lives inside attention, op=attention),
so nothing is trained, and the record says why (NO_MODEL).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from posttrainllm.config import LabConfig, itemsize
from posttrainllm.ops.base import REFERENCE, BatchAxis, Case, Costs, Impl, OpDef, Tensors, seeded_randn
from posttrainllm.ops.peers import compiled
from posttrainllm.ops.rows import refuse_tile_auto
import posttrainllm.ops.softmax.reference as reference

INPUT_KINDS = ("large", "tiny", "constant")
SCALES = {"normal": 1.0, "large": 1e4, "tiny": 1e-4, "constant": 1.0}
NO_MODEL = ("the lab's transformer has no softmax layer of its own (its softmax is inside attention: op=attention "
            "swaps that whole): bench-train trains nothing for op=softmax")


def _reference(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": reference.softmax(x["x"])}


class _ClosedFormBackward(torch.autograd.Function):
    """The reference's forward with the closed-form backward a fused softmax uses, dx = y·(dy − Σ y·dy) in the
    point's precision: on a nearly one-hot row the row's dot rounds to the top entry's dy and its dx to 0, where
    autograd through the readable math keeps it (gradient_baselines: the allowance is relative to the worse)."""

    @staticmethod
    def forward(ctx, x):
        y = reference.softmax(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        up = torch.promote_types(y.dtype, torch.float32)
        y32, dy32 = y.to(up), dy.to(up)
        return (y32 * (dy32 - (y32 * dy32).sum(dim=-1, keepdim=True))).to(y.dtype)


def _closed_form(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": _ClosedFormBackward.apply(x["x"])}


def _torch(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": torch.softmax(x["x"], dim=-1)}


def _triton(x: Tensors, cfg: LabConfig) -> Tensors:
    from posttrainllm.ops.softmax.kernels import softmax

    return {"out": softmax(x["x"], block_c=cfg.tile.block_n, num_warps=cfg.workgroup.num_warps)}


def _triton_geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
    """One program per row, forward and backward, walking its C columns in blocks of tile.block_n."""
    from posttrainllm.ops.softmax.kernels import softmax_launch

    return softmax_launch(case.dims["rows"], case.dims["cols"], block_c=cfg.tile.block_n,
                          num_warps=cfg.workgroup.num_warps)


IMPLS = {
    REFERENCE: Impl(REFERENCE, "reference", _reference, backend="posttrainllm.ops.softmax.reference.softmax",
                    train_refusal=NO_MODEL, cost_model="materialised"),
    "torch": Impl("torch", "peer", _torch, backend="torch.softmax", train_refusal=NO_MODEL, cost_model="fused"),
    "triton": Impl("triton", "triton", _triton, geometry=_triton_geometry, backend="posttrainllm.ops.softmax.softmax",
                   kernels={"forward": ("_softmax_forward_kernel",), "backward": ("_softmax_backward_kernel",)},
                   train_refusal=NO_MODEL,
                   promises=("deterministic", "batch_invariant"),  # a program owns its row; no atomics (checked)
                   cost_model="fused"),
}


def _case(rows: int, cols: int, seed: int, main: bool, kind: str = "normal") -> Case:
    suffix = f"seed{seed}" if kind == "normal" else kind
    return Case(f"{rows}x{cols}-{suffix}", seed, dict(rows=rows, cols=cols), main, kind)


def _main(cfg: LabConfig) -> tuple[int, int]:
    return cfg.shape.batch * cfg.shape.seq_len, cfg.shape.seq_len


def _cases(cfg: LabConfig) -> list[Case]:
    """Per seed: the point's (B·S, S), a single row, then e x e for e in shape.edge_seq_lens; on the first seed the
    point's shape with logits of ~1e4, of ~1e-4 and constant rows. A size met twice runs once."""
    rows, cols = _main(cfg)
    out = []
    for seed in cfg.parity.seeds:
        sizes = dict.fromkeys([(rows, cols), (1, cols), *((e, e) for e in cfg.shape.edge_seq_lens)])
        out += [_case(r, c, seed, (r, c) == (rows, cols)) for r, c in sizes]
    out += [_case(rows, cols, cfg.parity.seeds[0], False, kind) for kind in INPUT_KINDS]
    return out


def _make_inputs(case: Case, dtype: torch.dtype, device: str) -> Tensors:
    """x standard normal (x1e4 for `large`, x1e-4 for `tiny`; `constant`: every row one value, its first entry),
    drawn in fp32 from the case's seed, cast to the point's dtype."""
    if case.inputs not in SCALES:
        raise ValueError(f"unknown softmax input kind {case.inputs!r}: valid are normal, {', '.join(INPUT_KINDS)}")
    randn, d = seeded_randn(case.seed, torch.float32, "cpu"), case.dims
    x = randn(d["rows"], d["cols"], scale=SCALES[case.inputs])  # (rows, C)
    if case.inputs == "constant":
        x = x[:, :1].expand(-1, d["cols"]).contiguous()
    return {"x": x.to(device=device, dtype=dtype)}


def _problem(case: Case) -> str:
    return f"rows={case.dims['rows']} C={case.dims['cols']}"


def _costs(case: Case, cfg: LabConfig) -> Costs:
    """Forward, per element: the max's compare, x − m, exp, the sum's add, the divide -> 5·rows·C FLOPs (exp
    counted as one). Bytes, the floor: read x once, write y, in the point's dtype (a row that leaves the cache
    between the two passes is read twice). Backward, per element: y·dy, its add, dy − dot, the product -> 4·rows·C
    = 0.8x the forward; it reads y and dy and writes dx (1.5x the forward's bytes)."""
    rows, cols, size = case.dims["rows"], case.dims["cols"], itemsize(cfg.precision.dtype)
    return Costs(5 * rows * cols, 2 * rows * cols * size, 0.8, "5*rows*C", "2*rows*C*itemsize (read x, write y)",
                 "backward = 0.8 x forward (4*rows*C: dx = y*(dy - sum(y*dy))); bytes 1.5 x forward: "
                 "3*rows*C*itemsize (read y, dy; write dx)")



# --- each kind of path's own traffic (OpDef.path_costs; Impl.cost_model names one) --------------------------
#
# E = rows·C elements, R = rows, s the point's itemsize, c = 4 (the fp32 the reference and the kernels compute in).


def _materialised(case: Case, cfg: LabConfig) -> Costs:
    """The readable reference (reference.softmax) as eager PyTorch runs it, every aten op reading its inputs and
    writing its outputs (measure/traffic.py counts the same, tests/test_traffic.py).

    forward, in c: amax (E read, R written), z − max (E + R, E), exp (E, E), the sum (E, R), e / sum (E + R, E):
    c·(8·E + 4·R). backward: the quotient's, exp's, the subtraction's and amax's (its (rows, C) bool masks, 3·E)
    gradients: c·(25·E + 14·R) + 3·E. A 16-bit point adds the casts to c and back: 2·E·(s + c) each way.
    Working set: x and y in s, and two (rows, C) in c alive at once (e and the quotient)."""
    rows, cols, size = case.dims["rows"], case.dims["cols"], itemsize(cfg.precision.dtype)
    e, c = rows * cols, 4
    casts = 0 if size == c else 2 * e * (size + c)
    forward = c * (8 * e + 4 * rows) + casts
    backward = c * (25 * e + 14 * rows) + 3 * e + casts
    cast = "" if size == c else " + 2*E*(s + c) (casts)"
    return dataclasses.replace(
        _costs(case, cfg), bytes=forward, bytes_formula=f"c*(8*E + 4*R){cast} (E = rows*C, R = rows, c = 4)",
        train_bytes=forward + backward, train_bytes_formula=f"forward + c*(25*E + 14*R) + 3*E{cast}",
        working_set=2 * e * (size + c), working_set_formula="2*E*(s + c)", model="materialised",
        note="exp(x - max) and the quotient written and read in fp32, one eager op at a time (no cache between them)")


def _fused(case: Case, cfg: LabConfig) -> Costs:
    """One kernel each way (the Triton kernel, torch.softmax): x read and y written once, forward; y and dy read,
    dx written, backward. A row's second pass re-reads it from the cache (C·s bytes), not from memory."""
    rows, cols, size = case.dims["rows"], case.dims["cols"], itemsize(cfg.precision.dtype)
    e = rows * cols
    return dataclasses.replace(
        _costs(case, cfg), train_bytes=5 * e * size, train_bytes_formula="forward + 3*E*s (read y, dy; write dx)",
        working_set=2 * e * size, working_set_formula="2*E*s (x, y)", model="fused",
        note="one kernel each way; a row's passes after the first read it from the cache")


PATH_COSTS = {"materialised": _materialised, "fused": _fused}


def _curve_case(cfg: LabConfig, s: int) -> Case:
    """The (B·S, S) probabilities of one head at sequence length S."""
    return _case(cfg.shape.batch * s, s, cfg.parity.seeds[0], True)


def _check_config(cfg: LabConfig) -> None:
    """BLOCK_C is tile.block_n (a power of two >= 16, TileConfig); tile=auto tunes nothing here."""
    refuse_tile_auto(cfg, "softmax")


def _reference_bytes(case: Case, cfg: LabConfig) -> int:
    """x, y, dy, dx and ~2 intermediates of (rows, C) in float64, then the same in the point's precision: ~12
    float64-sized copies."""
    return 12 * case.dims["rows"] * case.dims["cols"] * 8


SIGNATURE = "fn(x) -> y; x (rows, C), y (rows, C) in x's dtype = softmax(x) along the last dim"

TEMPLATE = '''
import torch


def {name}(x: torch.Tensor) -> torch.Tensor:
    """Row softmax: y = exp(x - max(x)) / sum(exp(x - max(x))) along the last dim.

    x: (rows, C) -> (rows, C) in x's dtype. The lab checks it against float64 math, per element and per row,
    forward and the gradient of x (autograd through this function, or your own torch.autograd.Function); no
    autograd history: forward-only. Its cases include logits of ~1e4 (exp overflows unless the row max is
    subtracted), of ~1e-4 (nearly uniform rows) and constant rows.
    """
    z = x.float()  # fp32 statistics
    z = z - z.amax(dim=-1, keepdim=True)  # the row max first: exp of a large logit overflows
    e = z.exp()
    return (e / e.sum(dim=-1, keepdim=True)).to(x.dtype)
'''


def _adapt(fn: Any) -> Any:
    def path(x: Tensors, cfg: LabConfig) -> Tensors:
        return {"out": fn(x["x"])}

    path.__name__ = getattr(fn, "__name__", "user")
    return path


OP = OpDef(
    name="softmax", x_name="seq_len", input_names=("x",), impls=IMPLS, cases=_cases, make_inputs=_make_inputs,
    problem=_problem, costs=_costs, curve_case=_curve_case, model_hook=None,
    model_problem=lambda cfg: "none: " + NO_MODEL, check_config=_check_config,
    reference_bytes=_reference_bytes, path_costs=PATH_COSTS,
    optional_peers={"compiled": compiled("softmax", _reference, _make_inputs, "posttrainllm.ops.softmax.reference.softmax")},
    gradient_baselines=(("y*(dy - sum(y*dy))", _closed_form),),
    signature=SIGNATURE, adapt=_adapt, template=TEMPLATE, no_model=NO_MODEL,
    batch_axis=BatchAxis("a row", {"x": 0}, {"out": 0}),
)
