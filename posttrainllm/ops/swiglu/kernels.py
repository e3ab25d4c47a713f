"""SwiGLU's gate fused: h = silu(gate) · up, silu(g) = g · σ(g), σ(g) = 1 / (1 + e^(−g)), forward and backward.

Elementwise: each program owns one (BLOCK_ROWS, BLOCK_F) tile of the (rows, F) problem, masked at the ragged
edges; rows on grid axis 0 (up to 2^31 - 1 programs), F blocks on axis 1.

    forward   reads gate and up, writes h. Nothing else is saved: not silu(g), not σ(g).
    backward  reads gate, up and dh, recomputes s = σ(g), writes both gradients in one pass:
                  d_up   = dh · silu(g)                       = dh · g · s
                  d_gate = dh · up · silu'(g),  silu'(g)      = s · (1 + g · (1 − s))
              (silu'(g) = s + g · s · (1 − s), since σ' = σ (1 − σ).)

Every value is loaded, upcast to fp32 and computed there (tl.sigmoid and tl.exp refuse fp16/bf16), then
rounded once to the output's dtype on store. Large |g| is safe: σ(g) = 1 / (1 + e^(−g)) sends e^(−g) to inf
below g ≈ −88.7 in fp32 and σ to 0 (silu to −0), never inf / inf (the form e^g / (1 + e^g) would give NaN).

bf16 under Triton's interpreter (ops/__init__.py): loads and the upcast are exact, but its fp32 -> bf16 cast
truncates, so the kernels store fp32 and PyTorch rounds to bf16 (to nearest), as the GPU's cast does.

Offsets are 64-bit (rows and columns): a transposed input's column stride is `rows`.

Shapes: gate, up (rows, F) -> h (rows, F) in gate's dtype; any strides (a stride-0 dh from `.sum()` too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from posttrainllm.ops import use_bf16_emulation

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GRID_DIM_LIMIT = 65535  # CUDA: grid dimensions 1 and 2 (F blocks ride on axis 1)


@triton.jit
def _tile(R, F, BLOCK_ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
    """This program's rows (BLOCK_ROWS,) and columns (BLOCK_F,), 64-bit, and which of the tile are in bounds."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    return rows, cols, (rows[:, None] < R) & (cols[None, :] < F)


@triton.jit
def _swiglu_forward_kernel(
    gate_ptr, up_ptr, out_ptr,
    R, F,
    stride_gr, stride_gf,
    stride_ur, stride_uf,
    stride_or, stride_of,
    BLOCK_ROWS: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows, cols, mask = _tile(R, F, BLOCK_ROWS, BLOCK_F)
    g = tl.load(gate_ptr + rows[:, None] * stride_gr + cols[None, :] * stride_gf, mask=mask, other=0.0)
    u = tl.load(up_ptr + rows[:, None] * stride_ur + cols[None, :] * stride_uf, mask=mask, other=0.0)
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :] * stride_of, h.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    gate_ptr, up_ptr, dh_ptr, dgate_ptr, dup_ptr,
    R, F,
    stride_gr, stride_gf,
    stride_ur, stride_uf,
    stride_dr, stride_df,
    stride_or, stride_of,  # d_gate and d_up share one layout (the launcher allocates both)
    BLOCK_ROWS: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows, cols, mask = _tile(R, F, BLOCK_ROWS, BLOCK_F)
    g = tl.load(gate_ptr + rows[:, None] * stride_gr + cols[None, :] * stride_gf, mask=mask, other=0.0)
    u = tl.load(up_ptr + rows[:, None] * stride_ur + cols[None, :] * stride_uf, mask=mask, other=0.0)
    dh = tl.load(dh_ptr + rows[:, None] * stride_dr + cols[None, :] * stride_df, mask=mask, other=0.0)
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    dh = dh.to(tl.float32)
    # -- recompute σ(g) and silu(g) from gate (the forward saved neither)
    sig = tl.sigmoid(g)
    silu = g * sig
    d_up = dh * silu
    d_gate = dh * u * sig * (1.0 + g * (1.0 - sig))
    out_off = rows[:, None] * stride_or + cols[None, :] * stride_of
    tl.store(dgate_ptr + out_off, d_gate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + out_off, d_up.to(dup_ptr.dtype.element_ty), mask=mask)


def swiglu_launch(rows: int, F: int, *, block_rows: int, block_f: int, num_warps: int) -> dict:
    """Dispatch geometry of a (rows, F) problem: one program per (block_rows, block_f) tile, forward and backward."""
    for name, size in (("rows", rows), ("F", F)):
        if size < 1:
            raise ValueError(f"{name}={size} must be >= 1")
    for name, block in (("block_rows", block_rows), ("block_f", block_f)):
        if block < 1 or block & (block - 1):
            raise ValueError(f"{name}={block} must be a power of two")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps={num_warps} must be a power of two")
    grid = [triton.cdiv(rows, block_rows), triton.cdiv(F, block_f)]
    if grid[1] > GRID_DIM_LIMIT:
        raise ValueError(f"F={F} needs {grid[1]} column blocks of {block_f}, over CUDA's {GRID_DIM_LIMIT} per grid "
                         "dimension: use a larger block_f")
    return {"grid": grid, "block_rows": block_rows, "block_f": block_f, "num_warps": num_warps,
            "programs": grid[0] * grid[1]}


def _check_inputs(**tensors: torch.Tensor) -> None:
    (first_name, first), *rest = tensors.items()
    if first.ndim != 2:
        raise ValueError(f"expected 2-D {first_name} (rows, F), got {tuple(first.shape)}")
    if first.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {first.dtype} not supported; choose one of {SUPPORTED_DTYPES}")
    for name, x in rest:
        if x.shape != first.shape:
            raise ValueError(f"shape mismatch: {first_name} is {tuple(first.shape)}, {name} is {tuple(x.shape)}")
        if x.dtype != first.dtype:
            raise ValueError(f"dtype mismatch: {first_name} is {first.dtype}, {name} is {x.dtype}")
        if x.device != first.device:
            raise ValueError(f"device mismatch: {first_name} is on {first.device}, {name} is on {x.device}")


def triton_swiglu_forward(gate: torch.Tensor, up: torch.Tensor, *, block_rows: int = 32, block_f: int = 64,
                          num_warps: int = 4, emulate_bf16: bool | None = None) -> torch.Tensor:
    """silu(gate) · up: gate, up (rows, F) -> (rows, F) in gate's dtype. emulate_bf16: None = store fp32 for
    PyTorch to round only under the interpreter; False/True force it off/on."""
    _check_inputs(gate=gate, up=up)
    (R, F), dtype = gate.shape, gate.dtype
    launch = swiglu_launch(R, F, block_rows=block_rows, block_f=block_f, num_warps=num_warps)
    store = torch.float32 if use_bf16_emulation(dtype, emulate_bf16) else dtype
    out = torch.empty((R, F), device=gate.device, dtype=store)
    _swiglu_forward_kernel[tuple(launch["grid"])](
        gate, up, out, R, F, gate.stride(0), gate.stride(1), up.stride(0), up.stride(1), out.stride(0),
        out.stride(1), BLOCK_ROWS=block_rows, BLOCK_F=block_f, num_warps=num_warps)
    return out.to(dtype)


def triton_swiglu_backward(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor, *, block_rows: int = 32,
                           block_f: int = 64, num_warps: int = 4,
                           emulate_bf16: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) of h = silu(gate) · up for the upstream gradient dh, all (rows, F) in gate's dtype."""
    _check_inputs(gate=gate, up=up, dh=dh)
    (R, F), dtype = gate.shape, gate.dtype
    launch = swiglu_launch(R, F, block_rows=block_rows, block_f=block_f, num_warps=num_warps)
    store = torch.float32 if use_bf16_emulation(dtype, emulate_bf16) else dtype
    d_gate = torch.empty((R, F), device=gate.device, dtype=store)
    d_up = torch.empty_like(d_gate)
    _swiglu_backward_kernel[tuple(launch["grid"])](
        gate, up, dh, d_gate, d_up, R, F, gate.stride(0), gate.stride(1), up.stride(0), up.stride(1),
        dh.stride(0), dh.stride(1), d_gate.stride(0), d_gate.stride(1),
        BLOCK_ROWS=block_rows, BLOCK_F=block_f, num_warps=num_warps)
    return d_gate.to(dtype), d_up.to(dtype)


class TritonSwiGLU(torch.autograd.Function):
    """h = silu(gate) · up; the backward recomputes σ(gate) from the saved inputs (gate and up, no activation)."""

    @staticmethod
    def forward(ctx, gate, up, tile):
        ctx.save_for_backward(gate, up)
        ctx.tile = tile
        return triton_swiglu_forward(gate, up, **tile)  # (rows, F)

    @staticmethod
    @once_differentiable
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        d_gate, d_up = triton_swiglu_backward(gate, up, dh, **ctx.tile)  # one pass writes both
        return (d_gate if ctx.needs_input_grad[0] else None), (d_up if ctx.needs_input_grad[1] else None), None


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, block_rows: int = 32, block_f: int = 64,
           num_warps: int = 4) -> torch.Tensor:
    """Differentiable silu(gate) · up: gate, up (rows, F) -> (rows, F) in gate's dtype; forward and backward share
    the tile."""
    return TritonSwiGLU.apply(gate, up, dict(block_rows=block_rows, block_f=block_f, num_warps=num_warps))
