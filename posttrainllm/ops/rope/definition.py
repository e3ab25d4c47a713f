"""RoPE as a lab op: rotate q or k by their positions, "rotate half" layout (GPT-NeoX, Hugging Face Llama).

    y[..., i] = x1·cos − x2·sin,  y[..., i + D/2] = x1·sin + x2·cos,  x1 = x[..., i], x2 = x[..., i + D/2]
    x (B, H, T, D), cos and sin (T, D/2) fp32 for positions [offset, offset + T) -> y (B, H, T, D) in x's dtype

The tables are inputs, as the model passes them (its fp32 buffers, sliced at the cache's length, or one row per
entry of a tree verification): fp32 in every precision (make_inputs), and constants: listed in nondiff_inputs,
and every path detaches them (the lab's stages make each floating-point input an autograd leaf), so no
gradient is asked of or computed for them; parity checks out and grad_x.

Paths (one function each: checked, timed and trained as the rotation of every q and k of the model):
    reference   posttrainllm.ops.rope.reference.rope: the math in fp32 (float64 for the oracle), cast back
    triton      posttrainllm.ops.rope.kernels: one program per (b·h, block of T rows), both halves rotated in fp32;
                the backward is the same kernel rotating by −angle (Rᵀ)
    compiled    (opt-in, op.peers) the reference under torch.compile
    user paths  op.user_impls, in the natural signature SIGNATURE (lab/isolation/user.py)
PyTorch has no RoPE of its own (torch.nn.functional has none), so there is no eager peer.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from posttrainllm.config import LabConfig, itemsize
from posttrainllm.ops.base import REFERENCE, BatchAxis, Case, Costs, Impl, ModelHook, OpDef, Tensors, seeded_randn
from posttrainllm.ops.peers import compiled
import posttrainllm.ops.rope.reference as reference

# Cases past any trained length: the tables of positions [FAR_OFFSET, FAR_OFFSET + T), large angles (pair 0
# turns ~1592 times by position 10_000) taken from fp32 tables as the model makes them
FAR_OFFSET = 10_000
# Head dims off every block besides the architecture's: D/2 = 4 (one small block), 17 (a prime: 15 masked
# lanes of 32), 32
EDGE_HEAD_DIMS = (8, 34, 64)


def _tables(x: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as constants: the stages make every floating-point input a leaf requiring grad."""
    return x["cos"].detach(), x["sin"].detach()


def _reference(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": reference.rope(x["x"], *_tables(x))}


def _triton_options(cfg: LabConfig) -> dict[str, Any]:
    """tile.block_m rows of T per program (blocks over T are masked, so any power of two fits)."""
    return dict(block_t=cfg.tile.block_m, num_warps=cfg.workgroup.num_warps)


def _triton(x: Tensors, cfg: LabConfig) -> Tensors:
    from posttrainllm.ops.rope.kernels import rope

    return {"out": rope(x["x"], *_tables(x), **_triton_options(cfg))}


def _triton_geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
    from posttrainllm.ops.rope.kernels import rope_launch

    d = case.dims
    return {**rope_launch(d["batch"], d["heads"], d["seq_len"], d["head_dim"], **_triton_options(cfg)),
            "backward": "the same kernel, rotating by -angle (INVERSE)"}


IMPLS = {
    REFERENCE: Impl(REFERENCE, "reference", _reference, backend="posttrainllm.ops.rope.reference.rope"),
    "triton": Impl("triton", "triton", _triton, geometry=_triton_geometry, backend="posttrainllm.ops.rope.rope",
                   kernels={"forward": ("_rope_kernel",), "backward": ("_rope_kernel",)},
                   promises=("deterministic", "batch_invariant")),  # no atomics; a program owns its rows (checked)
}


# --- cases and inputs -------------------------------------------------------------------


def _case(name: str, seed: int, cfg: LabConfig, seq_len: int, *, head_dim: int | None = None, offset: int = 0,
          main: bool = False) -> Case:
    dims = dict(batch=cfg.shape.batch, heads=cfg.architecture.n_heads, seq_len=seq_len,
                head_dim=head_dim or cfg.architecture.head_dim, offset=offset)
    return Case(name, seed, dims, main)


def _cases(cfg: LabConfig) -> list[Case]:
    """The point's shape (B, the architecture's heads, shape.seq_len, its head_dim) from position 0, then each of
    shape.edge_seq_lens as a chunk after it (positions [seq_len, seq_len + T): T = 1 is a decode step), once per
    seed; on the first seed, the other head dims of EDGE_HEAD_DIMS and two chunks past the trained length
    (FAR_OFFSET: T = 1 and a longer one), at the smallest edge length over 1."""
    shape = cfg.shape
    out = []
    for seed in cfg.parity.seeds:
        out.append(_case(f"T{shape.seq_len}-seed{seed}", seed, cfg, shape.seq_len, main=True))
        out += [_case(f"T{t}-at{shape.seq_len}-seed{seed}", seed, cfg, t, offset=shape.seq_len)
                for t in shape.edge_seq_lens]
    seed, head_dim = cfg.parity.seeds[0], cfg.architecture.head_dim
    t = min([s for s in shape.edge_seq_lens if s > 1] or [shape.seq_len])
    out += [_case(f"T{t}-D{d}", seed, cfg, t, head_dim=d) for d in EDGE_HEAD_DIMS if d != head_dim]
    out += [_case(f"T{n}-at{FAR_OFFSET}", seed, cfg, n, offset=FAR_OFFSET) for n in sorted({1, t})]
    return out


def _make_inputs(case: Case, dtype: torch.dtype, device: str) -> Tensors:
    """Standard-normal x drawn in fp32 from the case's seed, cast to the point's dtype; cos and sin the model's
    fp32 tables (reference.py `rope_tables`, the model's default theta) of positions [offset, offset + T), fp32
    whatever the point's dtype, as the model keeps them."""
    d = case.dims
    x = seeded_randn(case.seed, dtype, device)(d["batch"], d["heads"], d["seq_len"], d["head_dim"])  # (B, H, T, D)
    cos, sin = reference.rope_tables(d["offset"] + d["seq_len"], d["head_dim"], reference.ROPE_THETA)  # (T+off, D/2)
    return {"x": x, "cos": cos[d["offset"]:].to(device), "sin": sin[d["offset"]:].to(device)}


def _problem(case: Case) -> str:
    d = case.dims
    return (f"B={d['batch']} H={d['heads']} T={d['seq_len']} D={d['head_dim']} "
            f"positions [{d['offset']}, {d['offset'] + d['seq_len']})")


def _costs(case: Case, cfg: LabConfig) -> Costs:
    """FLOPs: per pair, y1 = x1·cos − x2·sin and y2 = x1·sin + x2·cos, 4 multiplies and 2 adds: 6 per pair,
    B·H·T·D/2 pairs -> 3·B·H·T·D (the casts to and from fp32 not counted). Backward: dx = Rᵀ dy, the same
    rotation by −angle (the sign is free): 1x the forward. Bytes: read x and write y, B·H·T·D·itemsize each,
    and read the fp32 tables once, 2·T·(D/2)·4 (a kernel re-reads them per head; the minimum does not):
    at most 3/8 FLOP per byte in fp32 (3/4 in 16-bit), memory-bound on every device."""
    d, size = case.dims, itemsize(cfg.precision.dtype)
    elements = d["batch"] * d["heads"] * d["seq_len"] * d["head_dim"]
    return Costs(3 * elements, 2 * elements * size + d["seq_len"] * d["head_dim"] * 4, 1.0,
                 "3*B*H*T*D (6 per pair: 4 mul + 2 add)", "2*B*H*T*D*itemsize (x, y) + T*D*4 (fp32 cos, sin)",
                 "backward = 1 x forward (dx = the rotation by -angle of dy; no gradient for the tables)")


def _curve_case(cfg: LabConfig, x: int) -> Case:
    """x positions from 0 at the point's batch and the architecture's heads and head_dim."""
    seed = cfg.parity.seeds[0]
    return _case(f"T{x}-seed{seed}", seed, cfg, x, main=True)


def _reference_bytes(case: Case, cfg: LabConfig) -> int:
    """x, y, dy and dx in float64 and in the point's precision through autograd (~10 float64 copies of x), and the
    tables of every position up to the case's last, in float64 while rope_tables builds them."""
    d = case.dims
    return 10 * d["batch"] * d["heads"] * d["seq_len"] * d["head_dim"] * 8 \
        + 3 * (d["offset"] + d["seq_len"]) * d["head_dim"] // 2 * 8


# --- the model --------------------------------------------------------------------------


def _fill(impl: Impl, cfg: LabConfig) -> Callable[..., torch.Tensor]:
    """Every rotation of the model (q with its n_heads, k with its n_kv_heads: two calls per layer) runs `impl.fn`
    on (x, cos, sin) as the model passes them: x a transposed view of the projection, the tables fp32."""

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return impl.fn({"x": x, "cos": cos, "sin": sin}, cfg)["out"]

    return rope


def _model_problem(cfg: LabConfig) -> str:
    arch, train = cfg.architecture, cfg.train
    return (f"B={train.batch_size} H={arch.n_heads} (q) and {arch.n_kv_heads} (k) T={train.seq_len} "
            f"D={arch.head_dim}, two calls per layer")


def _check_config(cfg: LabConfig) -> None:
    """Nothing to refuse: the kernel keeps no shared memory, masks rows past T whatever tile.block_m is, and the
    architecture's head_dim is a power of two (even: RoPE rotates pairs)."""


SIGNATURE = ("fn(x, cos, sin) -> y; x (B, H, T, D), cos and sin (T, D/2) fp32; y (B, H, T, D) in x's dtype, "
             "pair (x[..., i], x[..., i + D/2]) rotated by the angle of cos[t, i], sin[t, i] (rotate half)")

TEMPLATE = '''
import torch


def {name}(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, "rotate half" layout: each pair (x[..., i], x[..., i + D/2]) rotated by its position's angle.

    x: (B, H, T, D); cos, sin: (T, D/2) fp32, the tables of the rows' positions -> (B, H, T, D) in x's dtype.
    The lab checks it against float64 math, per element and per row, forward and the gradient of x (autograd
    through this function, or your own torch.autograd.Function); the tables are constants (no gradient). Write
    a new tensor: a path that rotates x in place fails the lab's guard. No autograd history: forward-only.
    """
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, H, T, D/2) each, in fp32
    y = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, H, T, D)
    return y.to(x.dtype)
'''


def _adapt(fn: Any) -> Any:
    def path(x: Tensors, cfg: LabConfig) -> Tensors:
        return {"out": fn(x["x"], *_tables(x))}

    path.__name__ = getattr(fn, "__name__", "user")
    return path


OP = OpDef(
    name="rope", x_name="seq_len", input_names=("x", "cos", "sin"), impls=IMPLS, cases=_cases,
    make_inputs=_make_inputs, problem=_problem, costs=_costs, curve_case=_curve_case, model_hook=ModelHook("rope", _fill),
    model_problem=_model_problem, model_defaults={"rope": reference.rope, "rope_tables": reference.rope_tables}, check_config=_check_config,
    reference_bytes=_reference_bytes, nondiff_inputs=("cos", "sin"),
    optional_peers={"compiled": compiled("rope", _reference, _make_inputs, "posttrainllm.ops.rope.reference.rope")},
    signature=SIGNATURE, adapt=_adapt, template=TEMPLATE,
    batch_axis=BatchAxis("a token (one batch entry's tokens, each at its position of the shared tables)", {"x": 0},
                         {"out": 0}),
)
