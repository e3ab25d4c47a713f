"""The pre-norm block's residual add + RMSNorm in Triton: h = x + r; y = h / sqrt(mean(h²) + eps) · w, both returned,
a row walked in blocks of BLOCK_C columns.

Forward, one program per row, two passes over its row:
    pass 1   h = x + r in fp32, written in x's dtype (the new residual stream), and Σh²; rstd = 1/sqrt(Σh²/C + eps)
    pass 2   y = h · rstd · w from x + r again (fp32, not the rounded h), written in x's dtype; rstd (fp32) saved
The lanes past C load 0 (they add nothing to Σh²) and are never stored.

Backward: y and h both feed the rest of the graph, so both bring an upstream gradient, dy and dh. With
ĥ = h · rstd and g = dy · w:
    dh_total = rstd · (g − ĥ · mean(g · ĥ)) + dh     one program per row, two passes (the mean, then the sum)
    dx = dr = dh_total                                the add passes it to both inputs (stored twice: no alias)
    dW = Σ_rows dy · ĥ                                 one program per column block over every row (no atomics)
h is recomputed from the saved x and r (fp32, as the forward normalised it), not read back rounded.

bf16 under Triton's interpreter: loads and `.to(tl.float32)` are exact, fp32 -> bf16 conversion truncates; with
UPCAST_OUT (the launchers' bf16 emulation) y, h, dx and dr are stored in fp32 and PyTorch rounds them.

Shapes: x, r (rows, C), weight (C,) -> y (rows, C), h (rows, C) in x's dtype; rstd (rows,) fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from posttrainllm.ops import use_bf16_emulation
from posttrainllm.ops.rows import cdiv, check_grads, check_rows, row_launch, row_outputs, unit_stride

BLOCK_R = 16  # rows per step of the dW kernel


@triton.jit
def _add_rmsnorm_forward_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr,
    n_cols, stride_x, stride_r, stride_y, stride_h, eps,
    BLOCK_C: tl.constexpr,
):
    # -- one row per program; 64-bit row offsets (rows · C may pass 2^31)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    # -- pass 1: h = x + r, stored; Σh² in fp32
    sq = tl.zeros((), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_C):
        offs = start + cols
        mask = offs < n_cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        h = x + r
        tl.store(h_ptr + row * stride_h + offs, h.to(h_ptr.dtype.element_ty), mask=mask)
        sq += tl.sum(h * h, axis=0)
    rstd = 1.0 / tl.sqrt(sq / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    # -- pass 2: y = h · rstd · w
    for start in range(0, n_cols, BLOCK_C):
        offs = start + cols
        mask = offs < n_cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + offs, ((x + r) * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rmsnorm_backward_dx_kernel(
    dy_ptr, dh_ptr, x_ptr, r_ptr, w_ptr, rstd_ptr, dx_ptr, dr_ptr,
    n_cols, stride_dy, stride_dh, stride_x, stride_r, stride_dx, stride_dr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    rstd = tl.load(rstd_ptr + row)
    # -- pass 1: Σ g · ĥ over the row (masked lanes: dy = 0)
    dot = tl.zeros((), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_C):
        offs = start + cols
        mask = offs < n_cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(dy * w * (x + r) * rstd, axis=0)
    mean_gh = dot / n_cols
    # -- pass 2: dh_total = rstd · (g − ĥ · mean(g · ĥ)) + dh, to both inputs
    for start in range(0, n_cols, BLOCK_C):
        offs = start + cols
        mask = offs < n_cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + row * stride_dh + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        total = rstd * (dy * w - (x + r) * rstd * mean_gh) + dh
        tl.store(dx_ptr + row * stride_dx + offs, total.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dr_ptr + row * stride_dr + offs, total.to(dr_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rmsnorm_backward_dw_kernel(
    dy_ptr, x_ptr, r_ptr, rstd_ptr, dw_ptr,
    n_rows, n_cols, stride_dy, stride_x, stride_r,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # -- program `pid` owns columns [pid·BLOCK_C, (pid+1)·BLOCK_C) and sums dy · ĥ over every row
    offs = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = offs < n_cols
    dw = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, n_rows, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        r64 = rows.to(tl.int64)
        x = tl.load(x_ptr + r64[:, None] * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + r64[:, None] * stride_r + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r64[:, None] * stride_dy + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        dw += tl.sum(dy * (x + r) * rstd[:, None], axis=0)
    tl.store(dw_ptr + offs, dw, mask=col_mask)


def add_rmsnorm_launch(n_rows: int, n_cols: int, *, block_c: int, num_warps: int) -> dict:
    """Dispatch geometry: one program per row (forward, dx and dr), one per column block (dW)."""
    return {**row_launch(n_rows, n_cols, block_c=block_c, num_warps=num_warps),
            "dw_grid": [cdiv(n_cols, block_c)], "block_r": BLOCK_R}


def add_rmsnorm_forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                        block_c: int, num_warps: int = 4, emulate_bf16: bool | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y and h (rows, C) in x's dtype, rstd (rows,) fp32. emulate_bf16: None = only under the interpreter."""
    check_rows(x, per_row={"residual": residual}, per_column={"weight": weight}, eps=eps)
    x, residual = unit_stride(x), unit_stride(residual)
    n_rows, n_cols = x.shape
    launch = add_rmsnorm_launch(n_rows, n_cols, block_c=block_c, num_warps=num_warps)
    y, h = row_outputs(x, 2, use_bf16_emulation(x.dtype, emulate_bf16))
    rstd = torch.empty(n_rows, device=x.device, dtype=torch.float32)
    _add_rmsnorm_forward_kernel[tuple(launch["grid"])](
        x, residual, weight.contiguous(), y, h, rstd, n_cols, x.stride(0), residual.stride(0), y.stride(0),
        h.stride(0), float(eps), BLOCK_C=block_c, num_warps=num_warps)
    return y.to(x.dtype), h.to(x.dtype), rstd


def add_rmsnorm_backward(dy: torch.Tensor, dh: torch.Tensor, x: torch.Tensor, residual: torch.Tensor,
                         weight: torch.Tensor, rstd: torch.Tensor, *, block_c: int, num_warps: int = 4,
                         emulate_bf16: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx and dr (rows, C) in x's dtype and dW (C,) in weight's dtype, from dy, dh and the saved rstd."""
    check_grads("x", x, dy=dy, dh=dh)
    dy, dh, x, residual = unit_stride(dy), unit_stride(dh), unit_stride(x), unit_stride(residual)
    n_rows, n_cols = x.shape
    launch = add_rmsnorm_launch(n_rows, n_cols, block_c=block_c, num_warps=num_warps)
    dx, dr = row_outputs(x, 2, use_bf16_emulation(x.dtype, emulate_bf16))
    _add_rmsnorm_backward_dx_kernel[tuple(launch["grid"])](
        dy, dh, x, residual, weight.contiguous(), rstd, dx, dr, n_cols, dy.stride(0), dh.stride(0), x.stride(0),
        residual.stride(0), dx.stride(0), dr.stride(0), BLOCK_C=block_c, num_warps=num_warps)
    dw = torch.empty(n_cols, device=x.device, dtype=torch.float32)
    _add_rmsnorm_backward_dw_kernel[tuple(launch["dw_grid"])](
        dy, x, residual, rstd, dw, n_rows, n_cols, dy.stride(0), x.stride(0), residual.stride(0),
        BLOCK_R=BLOCK_R, BLOCK_C=block_c, num_warps=num_warps)
    return dx.to(x.dtype), dr.to(x.dtype), dw.to(weight.dtype)


class TritonAddRMSNorm(torch.autograd.Function):
    """h = x + r and y = rmsnorm(h) · w in one pass over the rows; the backward takes both dy and dh."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, block_c, num_warps):
        y, h, rstd = add_rmsnorm_forward(x, residual, weight, eps, block_c=block_c, num_warps=num_warps)
        ctx.save_for_backward(x, residual, weight, rstd)
        ctx.block_c, ctx.num_warps = block_c, num_warps
        return y, h  # (rows, C) each

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dh):
        x, residual, weight, rstd = ctx.saved_tensors
        dx, dr, dw = add_rmsnorm_backward(dy, dh, x, residual, weight, rstd, block_c=ctx.block_c,
                                          num_warps=ctx.num_warps)
        need = ctx.needs_input_grad
        return (dx if need[0] else None, dr if need[1] else None, dw if need[2] else None, None, None, None)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, block_c: int = 64,
                num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable residual add + RMSNorm: x, residual (rows, C), weight (C,) -> (y, h), (rows, C) each in x's
    dtype; fp32 statistics."""
    return TritonAddRMSNorm.apply(x, residual, weight, eps, block_c, num_warps)
