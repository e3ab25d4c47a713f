"""RMSNorm, y = x / sqrt(mean(x², last dim) + eps) · weight, one row per program.

Forward: each program loads one row of x (BLOCK_C = the next power of two >= C, the lanes past C masked
to 0, so they add nothing to Σx² and are never stored), upcasts it to fp32 (x² of an fp16 value near 1e4
overflows fp16), and writes y = x · rstd · w in x's dtype and rstd = 1/sqrt(mean(x²) + eps), fp32, one per
row, saved for the backward.

Backward, per row with x̂ = x · rstd and g = dy · w:
    dx = rstd · (g − x̂ · mean(g · x̂))      the mean term: rstd depends on every x of the row
    dW = Σ_rows dy · x̂
dx is per row. dW sums over every row, so without atomics: P programs each walk a contiguous group of
rows, accumulate their partial Σ dy · x̂ in fp32 and write it to row `pid` of a (P, C) fp32 buffer (no two
programs write the same place: no race); torch then sums the P partials, as Liger-Kernel does. P is the
GPU's SM count (one resident program each), at most one per row; under the interpreter a few programs.

bf16 under Triton's interpreter: loads and `.to(tl.float32)` are exact, but fp32 -> bf16 conversion
truncates instead of rounding to nearest. With UPCAST_OUT (the launchers' bf16 emulation) y and dx are
stored in fp32 and PyTorch rounds them to bf16; every other step is fp32 already.

Shapes: x (rows, C), weight (C,) -> y (rows, C) in x's dtype; rstd (rows,) fp32; dW in weight's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from posttrainllm.ops import use_bf16_emulation
from posttrainllm.ops.rows import check_grads, check_rows, row_launch, row_outputs, unit_stride

INTERPRETER_PROGRAMS = 4  # backward programs off the GPU: the interpreter runs them one after another


@triton.jit
def _rmsnorm_forward_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr,
    n_cols, stride_x, stride_y, eps,
    BLOCK_C: tl.constexpr,
):
    # -- one row per program; 64-bit row offsets (rows · C may pass 2^31)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # -- Σx² in fp32 over the C real lanes (masked ones are 0), eps inside the root
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * stride_y + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_backward_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr,
    n_rows, n_cols, stride_dy, stride_x, stride_dx, rows_per_program,
    BLOCK_C: tl.constexpr,
):
    # -- program `pid` walks rows [first, last) and owns row `pid` of the (P, C) partials
    pid = tl.program_id(0)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    # -- pointers to row `first` (64-bit offsets), advanced one row per step
    start = first.to(tl.int64)
    x_ptrs = x_ptr + start * stride_x + cols
    dy_ptrs = dy_ptr + start * stride_dy + cols
    dx_ptrs = dx_ptr + start * stride_dx + cols
    rstd_ptrs = rstd_ptr + start
    for _ in range(first, last):
        x_row = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptrs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptrs)
        x_hat = x_row * rstd
        g = dy * w
        # -- dx = rstd · (g − x̂ · mean(g · x̂)); masked lanes are 0 in g and x̂
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols))
        tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * x_hat
        x_ptrs += stride_x
        dy_ptrs += stride_dy
        dx_ptrs += stride_dx
        rstd_ptrs += 1
    tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, dw_acc, mask=mask)


def backward_programs(n_rows: int, sm_count: int | None) -> tuple[int, int]:
    """(P, rows per program) of the backward: P = the SM count (None: INTERPRETER_PROGRAMS) at most one per
    row, then as many as needed for groups of that many rows (so no program is empty)."""
    per_program = triton.cdiv(n_rows, max(1, min(n_rows, sm_count or INTERPRETER_PROGRAMS)))
    return triton.cdiv(n_rows, per_program), per_program


def rmsnorm_launch(n_rows: int, n_cols: int, *, num_warps: int, sm_count: int | None = None) -> dict:
    """Dispatch geometry: one forward program per whole row (BLOCK_C = C's next power of two), P backward programs
    over groups of rows."""
    launch = row_launch(n_rows, n_cols, block_c=None, num_warps=num_warps)
    programs, per_program = backward_programs(n_rows, sm_count)
    return {**launch, "backward_grid": [programs], "rows_per_program": per_program,
            "dw_partials": [programs, n_cols]}  # fp32, summed by torch


def _sm_count(device: torch.device) -> int | None:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None


def rmsnorm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, *, num_warps: int = 4,
                    emulate_bf16: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """y (rows, C) in x's dtype and rstd (rows,) fp32. emulate_bf16: None = only under the interpreter."""
    check_rows(x, per_column={"weight": weight}, eps=eps)
    x = unit_stride(x)
    (n_rows, n_cols) = x.shape
    launch = rmsnorm_launch(n_rows, n_cols, num_warps=num_warps)
    (y,) = row_outputs(x, 1, use_bf16_emulation(x.dtype, emulate_bf16))
    rstd = torch.empty(n_rows, device=x.device, dtype=torch.float32)
    _rmsnorm_forward_kernel[tuple(launch["grid"])](
        x, weight.contiguous(), y, rstd, n_cols, x.stride(0), y.stride(0), float(eps),
        BLOCK_C=launch["block_c"], num_warps=num_warps,
    )
    return y.to(x.dtype), rstd


def rmsnorm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, *,
                     num_warps: int = 4, emulate_bf16: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (rows, C) in x's dtype and dW (C,) in weight's dtype from the forward's saved rstd."""
    check_grads("x", x, dy=dy)
    dy, x = unit_stride(dy), unit_stride(x)
    (n_rows, n_cols) = x.shape
    launch = rmsnorm_launch(n_rows, n_cols, num_warps=num_warps, sm_count=_sm_count(x.device))
    (dx,) = row_outputs(x, 1, use_bf16_emulation(x.dtype, emulate_bf16))
    dw_partial = torch.empty(launch["dw_partials"], device=x.device, dtype=torch.float32)  # every row written
    _rmsnorm_backward_kernel[tuple(launch["backward_grid"])](
        dy, x, weight.contiguous(), rstd, dx, dw_partial,
        n_rows, n_cols, dy.stride(0), x.stride(0), dx.stride(0), launch["rows_per_program"],
        BLOCK_C=launch["block_c"], num_warps=num_warps,
    )
    dw = dw_partial.sum(dim=0)  # (C,): the P per-program partials, in fp32
    return dx.to(x.dtype), dw.to(weight.dtype)


class TritonRMSNorm(torch.autograd.Function):
    """RMSNorm whose backward reads the forward's rstd instead of recomputing Σx²."""

    @staticmethod
    def forward(ctx, x, weight, eps, num_warps):
        y, rstd = rmsnorm_forward(x, weight, eps, num_warps=num_warps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.num_warps = num_warps
        return y  # (rows, C)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rmsnorm_backward(dy, x, weight, rstd, num_warps=ctx.num_warps)
        return (dx if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None, None, None)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, num_warps: int = 4) -> torch.Tensor:
    """Differentiable RMSNorm: x (rows, C), weight (C,) -> (rows, C) in x's dtype; fp32 accumulation."""
    return TritonRMSNorm.apply(x, weight, eps, num_warps)
