"""LayerNorm in Triton, y = (x − mean) / sqrt(var + eps) · w + b, a row walked in blocks of BLOCK_C columns.

Forward, one program per row, three passes over its row:
    pass 1   mean = Σx / C
    pass 2   var = Σ(x − mean)² / C (the centred squares: mean(x²) − mean² cancels on a row far from zero),
             rstd = 1 / sqrt(var + eps)
    pass 3   y = (x − mean) · rstd · w + b, written in x's dtype; mean and rstd (fp32, one per row) saved
The lanes past C are masked out of every sum and never stored. All arithmetic in fp32.

Backward, with x̂ = (x − mean) · rstd and g = dy · w:
    dx = rstd · (g − mean(g) − x̂ · mean(g · x̂))       one program per row, two passes (the two means, then dx)
    dW = Σ_rows dy · x̂,  dB = Σ_rows dy               one program per column block, walking every row in blocks
                                                       of BLOCK_R: each column's sum has one owner, in a fixed
                                                       order (no atomics, no partials to sum)

bf16 under Triton's interpreter: loads and `.to(tl.float32)` are exact, fp32 -> bf16 conversion truncates; with
UPCAST_OUT (the launchers' bf16 emulation) y and dx are stored in fp32 and PyTorch rounds them.

Shapes: x (rows, C), weight (C,), bias (C,) -> y (rows, C) in x's dtype; mean, rstd (rows,) fp32; dW, dB in
weight's and bias's dtypes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from posttrainllm.ops import use_bf16_emulation
from posttrainllm.ops.rows import cdiv, check_grads, check_rows, row_launch, row_outputs, unit_stride

BLOCK_R = 16  # rows per step of the dW/dB kernel


@triton.jit
def _layernorm_forward_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,
    n_cols, stride_x, stride_y, eps,
    BLOCK_C: tl.constexpr,
):
    # -- one row per program; 64-bit row offsets (rows · C may pass 2^31)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    # -- pass 1: the mean (masked lanes load 0)
    total = tl.zeros((), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_C):
        offs = start + cols
        total += tl.sum(tl.load(x_row + offs, mask=offs < n_cols, other=0.0).to(tl.float32), axis=0)
    mean = total / n_cols
    # -- pass 2: the variance from the centred squares (masked lanes would add mean²: kept out)
    sq = tl.zeros((), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_C):
        offs = start + cols
        mask = offs < n_cols
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - mean, 0.0)
        sq += tl.sum(d * d, axis=0)
    rstd = 1.0 / tl.sqrt(sq / n_cols + eps)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    # -- pass 3: y = (x − mean) · rstd · w + b
    for start in range(0, n_cols, BLOCK_C):
        offs = start + cols
        mask = offs < n_cols
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + offs, ((x - mean) * rstd * w + b).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layernorm_backward_dx_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr,
    n_cols, stride_dy, stride_x, stride_dx,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    # -- pass 1: Σ g and Σ g · x̂ over the row (masked lanes: dy = 0, so g = 0)
    sum_g = tl.zeros((), dtype=tl.float32)
    sum_gx = tl.zeros((), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_C):
        offs = start + cols
        mask = offs < n_cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = dy * w
        sum_g += tl.sum(g, axis=0)
        sum_gx += tl.sum(g * (x - mean) * rstd, axis=0)
    mean_g = sum_g / n_cols
    mean_gx = sum_gx / n_cols
    # -- pass 2: dx = rstd · (g − mean(g) − x̂ · mean(g · x̂))
    for start in range(0, n_cols, BLOCK_C):
        offs = start + cols
        mask = offs < n_cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x_hat = (x - mean) * rstd
        dx = rstd * (dy * w - mean_g - x_hat * mean_gx)
        tl.store(dx_ptr + row * stride_dx + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layernorm_backward_dwdb_kernel(
    dy_ptr, x_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr,
    n_rows, n_cols, stride_dy, stride_x,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # -- program `pid` owns columns [pid·BLOCK_C, (pid+1)·BLOCK_C) and sums them over every row
    offs = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = offs < n_cols
    dw = tl.zeros((BLOCK_C,), dtype=tl.float32)
    db = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, n_rows, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        r64 = rows.to(tl.int64)
        x = tl.load(x_ptr + r64[:, None] * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r64[:, None] * stride_dy + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        dw += tl.sum(dy * (x - mean[:, None]) * rstd[:, None], axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(dw_ptr + offs, dw, mask=col_mask)
    tl.store(db_ptr + offs, db, mask=col_mask)


def layernorm_launch(n_rows: int, n_cols: int, *, block_c: int, num_warps: int) -> dict:
    """Dispatch geometry: one program per row (forward, dx), one per column block (dW and dB)."""
    return {**row_launch(n_rows, n_cols, block_c=block_c, num_warps=num_warps),
            "dwdb_grid": [cdiv(n_cols, block_c)], "block_r": BLOCK_R}


def layernorm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, *, block_c: int,
                      num_warps: int = 4, emulate_bf16: bool | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y (rows, C) in x's dtype, mean and rstd (rows,) fp32. emulate_bf16: None = only under the interpreter."""
    check_rows(x, per_column={"weight": weight, "bias": bias}, eps=eps, eps_keeps="a constant row finite")
    x = unit_stride(x)
    n_rows, n_cols = x.shape
    launch = layernorm_launch(n_rows, n_cols, block_c=block_c, num_warps=num_warps)
    (y,) = row_outputs(x, 1, use_bf16_emulation(x.dtype, emulate_bf16))
    mean = torch.empty(n_rows, device=x.device, dtype=torch.float32)
    rstd = torch.empty(n_rows, device=x.device, dtype=torch.float32)
    _layernorm_forward_kernel[tuple(launch["grid"])](
        x, weight.contiguous(), bias.contiguous(), y, mean, rstd, n_cols, x.stride(0), y.stride(0), float(eps),
        BLOCK_C=block_c, num_warps=num_warps)
    return y.to(x.dtype), mean, rstd


def layernorm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       mean: torch.Tensor, rstd: torch.Tensor, *, block_c: int, num_warps: int = 4,
                       emulate_bf16: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx (rows, C) in x's dtype, dW and dB (C,) in weight's and bias's dtypes, from the saved mean and rstd."""
    check_grads("x", x, dy=dy)
    dy, x = unit_stride(dy), unit_stride(x)
    n_rows, n_cols = x.shape
    launch = layernorm_launch(n_rows, n_cols, block_c=block_c, num_warps=num_warps)
    (dx,) = row_outputs(x, 1, use_bf16_emulation(x.dtype, emulate_bf16))
    _layernorm_backward_dx_kernel[tuple(launch["grid"])](
        dy, x, weight.contiguous(), mean, rstd, dx, n_cols, dy.stride(0), x.stride(0), dx.stride(0),
        BLOCK_C=block_c, num_warps=num_warps)
    dw = torch.empty(n_cols, device=x.device, dtype=torch.float32)
    db = torch.empty(n_cols, device=x.device, dtype=torch.float32)
    _layernorm_backward_dwdb_kernel[tuple(launch["dwdb_grid"])](
        dy, x, mean, rstd, dw, db, n_rows, n_cols, dy.stride(0), x.stride(0),
        BLOCK_R=BLOCK_R, BLOCK_C=block_c, num_warps=num_warps)
    return dx.to(x.dtype), dw.to(weight.dtype), db.to(bias.dtype)


class TritonLayerNorm(torch.autograd.Function):
    """LayerNorm whose backward reads the forward's mean and rstd instead of recomputing the row's statistics."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, block_c, num_warps):
        y, mean, rstd = layernorm_forward(x, weight, bias, eps, block_c=block_c, num_warps=num_warps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.block_c, ctx.num_warps = block_c, num_warps
        return y  # (rows, C)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = layernorm_backward(dy, x, weight, bias, mean, rstd, block_c=ctx.block_c,
                                        num_warps=ctx.num_warps)
        need = ctx.needs_input_grad
        return (dx if need[0] else None, dw if need[1] else None, db if need[2] else None, None, None, None)


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, *, block_c: int = 64,
              num_warps: int = 4) -> torch.Tensor:
    """Differentiable LayerNorm: x (rows, C), weight (C,), bias (C,) -> (rows, C) in x's dtype; fp32 statistics."""
    return TritonLayerNorm.apply(x, weight, bias, eps, block_c, num_warps)
