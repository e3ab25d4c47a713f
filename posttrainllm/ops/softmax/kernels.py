"""Row softmax, y = exp(x − max(x)) / Σ exp(x − max(x)) along the last dim, streamed over a row in blocks.

Forward (online softmax: Milakov & Gimelshein 2018, the trick inside FlashAttention): each program owns one row
and walks it in blocks of BLOCK_C columns twice.
    pass 1   a running max m and a running sum l of exp(x − m): a new block with max m' > m rescales the sum,
             l ← l · exp(m − m') + Σ exp(x − m'), so the row is read once for both statistics (a two-pass
             softmax reads it twice before it writes)
    pass 2   y = exp(x − m) / l, written in x's dtype
The lanes past C load −inf: exp(−inf − m) = 0 adds nothing, and they are never stored. All arithmetic in fp32
(tl.exp refuses 16-bit operands, and exp of an fp16 logit overflows).

Backward, per row: dx = y · (dy − Σ y · dy): pass 1 the row's dot Σ y · dy in fp32, pass 2 dx, from the saved y
(no recomputation of the statistics).

bf16 under Triton's interpreter: loads and `.to(tl.float32)` are exact, fp32 -> bf16 conversion truncates; with
UPCAST_OUT (the launchers' bf16 emulation) y and dx are stored in fp32 and PyTorch rounds them.

Shapes: x (rows, C) -> y (rows, C) in x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from posttrainllm.ops import use_bf16_emulation
from posttrainllm.ops.rows import check_grads, check_rows, row_launch, row_outputs, unit_stride


@triton.jit
def _softmax_forward_kernel(
    x_ptr, y_ptr,
    n_cols, stride_x, stride_y,
    BLOCK_C: tl.constexpr,
):
    # -- one row per program; 64-bit row offsets (rows · C may pass 2^31)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    # -- pass 1: the running max m and sum l = Σ exp(x − m), rescaled whenever m grows
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.zeros((), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_C):
        offs = start + cols
        x = tl.load(x_row + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    # -- pass 2: y = exp(x − m) / l
    for start in range(0, n_cols, BLOCK_C):
        offs = start + cols
        mask = offs < n_cols
        x = tl.load(x_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        tl.store(y_row + offs, (tl.exp(x - m) / l).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_backward_kernel(
    dy_ptr, y_ptr, dx_ptr,
    n_cols, stride_dy, stride_y, stride_dx,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    # -- pass 1: the row's Σ y · dy in fp32 (masked lanes are 0 in both)
    dot = tl.zeros((), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_C):
        offs = start + cols
        mask = offs < n_cols
        y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(y * dy, axis=0)
    # -- pass 2: dx = y · (dy − Σ y · dy)
    for start in range(0, n_cols, BLOCK_C):
        offs = start + cols
        mask = offs < n_cols
        y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * stride_dx + offs, (y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=mask)


def softmax_launch(n_rows: int, n_cols: int, *, block_c: int, num_warps: int) -> dict:
    """Dispatch geometry: one program per row, forward and backward, each walking its row in BLOCK_C blocks."""
    return row_launch(n_rows, n_cols, block_c=block_c, num_warps=num_warps)


def softmax_forward(x: torch.Tensor, *, block_c: int, num_warps: int = 4,
                    emulate_bf16: bool | None = None) -> torch.Tensor:
    """y (rows, C) in x's dtype. emulate_bf16: None = only under the interpreter."""
    check_rows(x)
    x = unit_stride(x)
    launch = softmax_launch(*x.shape, block_c=block_c, num_warps=num_warps)
    (y,) = row_outputs(x, 1, use_bf16_emulation(x.dtype, emulate_bf16))
    _softmax_forward_kernel[tuple(launch["grid"])](x, y, x.shape[1], x.stride(0), y.stride(0), BLOCK_C=block_c,
                                                    num_warps=num_warps)
    return y.to(x.dtype)


def softmax_backward(dy: torch.Tensor, y: torch.Tensor, *, block_c: int, num_warps: int = 4,
                     emulate_bf16: bool | None = None) -> torch.Tensor:
    """dx (rows, C) in y's dtype from the forward's saved y."""
    check_grads("y", y, dy=dy)
    dy, y = unit_stride(dy), unit_stride(y)
    launch = softmax_launch(*y.shape, block_c=block_c, num_warps=num_warps)
    (dx,) = row_outputs(y, 1, use_bf16_emulation(y.dtype, emulate_bf16))
    _softmax_backward_kernel[tuple(launch["grid"])](dy, y, dx, y.shape[1], dy.stride(0), y.stride(0), dx.stride(0),
                                                     BLOCK_C=block_c, num_warps=num_warps)
    return dx.to(y.dtype)


class TritonSoftmax(torch.autograd.Function):
    """Row softmax whose backward reads the forward's y instead of recomputing the row's statistics."""

    @staticmethod
    def forward(ctx, x, block_c, num_warps):
        y = softmax_forward(x, block_c=block_c, num_warps=num_warps)
        ctx.save_for_backward(y)
        ctx.block_c, ctx.num_warps = block_c, num_warps
        return y  # (rows, C)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return softmax_backward(dy, y, block_c=ctx.block_c, num_warps=ctx.num_warps), None, None


def softmax(x: torch.Tensor, *, block_c: int = 64, num_warps: int = 4) -> torch.Tensor:
    """Differentiable row softmax: x (rows, C) -> (rows, C) in x's dtype; fp32 statistics."""
    return TritonSoftmax.apply(x, block_c, num_warps)
