"""fp8's readable math, shared by the ops that quantize and by training: scales, quantize, dequantize, and the
fp8 linear layer (a recipe over any fp8 GEMM `gemm`). Not an op: the precision=fp8 recipe the ops apply.
"""

from __future__ import annotations

from typing import Any

import torch


# --- fp8: scaled 8-bit operands (precision=fp8, fp8_rowwise) ----------------------------
# A value x is stored as q = fp8(x / s) with a scale s = amax / FP8_MAX (fp32), so the largest |x| of its group maps
# to ±FP8_MAX and x ≈ q · s. The group is the whole tensor (dim None) or one row / column (dim = the reduced dim).
# Every path of a quantized point sees the same q and s, made once per case by these functions (ops/matmul/definition.py).
AMAX_EPS = 1e-12  # an all-zero group's amax: a finite scale (q = 0 then), not 0/0


def fp8_scale(x: torch.Tensor, dim: int | tuple[int, ...] | None = None,
              fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """The dequantization scale s = max(amax|x|, eps) / FP8_MAX, in fp32: x ≈ quantize_fp8(x, s) · s.

    dim None: one scale, a 0-dim tensor. dim=1: one per row of a 2-D x, (M, 1); dim=0: one per column, (1, N);
    the reduced dims kept as 1 (MoE's expert weights (E, d, f): dim=1 one per expert and column, (E, 1, f))."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    return amax.float().clamp_min(AMAX_EPS) / torch.finfo(fp8_dtype).max


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """q = fp8(x / s): in fp32, saturated to ±FP8_MAX (|x| <= amax keeps x / s in range, bar the division's rounding;
    a cast past it would be NaN in e4m3fn), rounded to nearest. x: any shape, s broadcast to it -> x's shape, fp8."""
    fp8_max = torch.finfo(fp8_dtype).max
    return (x.float() * scale.reciprocal()).clamp(-fp8_max, fp8_max).to(fp8_dtype)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q · s in `dtype` (float64: exact, the oracle's; fp32 rounds the product of 4 + 24 significant bits)."""
    return q.to(dtype) * scale.to(dtype)



# --- fp8 training: a linear layer's three GEMMs in 8 bits (bench-train under precision=fp8, fp8_rowwise) --------
# y = x Wᵀ, dx = dy W, dW = dyᵀ x, each an fp8 GEMM C = (A_q s_A)(B_q s_B) with fresh dynamic scales (amax of the
# tensor as it is now: no history). The forward operands x and W are e4m3; dy is the recipe's grad_format (e5m2:
# range for gradients, the tensorwise recipe's; e4m3 where the rowwise recipe keeps it). Rowwise, each operand is
# scaled along the dim its GEMM keeps (A per row, B per column), so a scale factors out of every sum over K; x, W
# and dy are quantized again per GEMM along the dim that GEMM keeps. Per tensor, one scale serves both orientations
# and the forward's x_q and W_q are reused. `gemm(a_q, a_scale, b_q, b_scale)` is the path: fp8_matmul above (the
# readable math), torch._scaled_mm, or the Triton fp8 GEMM; it returns C in the output dtype (bf16).


def _quantized(x: torch.Tensor, keep: int | None, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q, s) of a 2-D x: one scale per tensor (keep None), per row (keep 0: (M, 1)) or per column (keep 1: (1, N))."""
    scale = fp8_scale(x, None if keep is None else 1 - keep, fp8_dtype)
    return quantize_fp8(x, scale, fp8_dtype), scale


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, gemm: Any, rowwise: bool,
                grad_dtype: torch.dtype) -> torch.Tensor:
        e4m3 = torch.float8_e4m3fn
        row, col = (0, 1) if rowwise else (None, None)
        x_q, x_s = _quantized(x, row, e4m3)  # A = x (M, K): per row of x
        w_q, w_s = _quantized(weight.t(), col, e4m3)  # B = Wᵀ (K, N): per column of Wᵀ = per row of W
        ctx.gemm, ctx.rowwise, ctx.grad_dtype = gemm, rowwise, grad_dtype
        ctx.save_for_backward(x, weight, *(() if rowwise else (x_q, x_s, w_q, w_s)))
        return gemm(x_q, x_s, w_q, w_s)  # (M, N)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        e4m3, gemm = torch.float8_e4m3fn, ctx.gemm
        if ctx.rowwise:  # every operand scaled along the dim its GEMM keeps
            x, weight = ctx.saved_tensors
            dx = gemm(*_quantized(dy, 0, ctx.grad_dtype), *_quantized(weight, 1, e4m3))  # (M, N)(N, K): dy rows, W cols
            dw = gemm(*_quantized(dy.t(), 0, ctx.grad_dtype), *_quantized(x, 1, e4m3))  # (N, M)(M, K): dy cols, x cols
        else:  # one scale per tensor: the forward's x_q and W_q serve transposed
            x, weight, x_q, x_s, w_q, w_s = ctx.saved_tensors
            dy_q, dy_s = _quantized(dy, None, ctx.grad_dtype)
            dx = gemm(dy_q, dy_s, w_q.t(), w_s)
            dw = gemm(dy_q.t(), dy_s, x_q, x_s)
        return dx.to(x.dtype), dw.to(weight.dtype), None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, gemm: Any, *, rowwise: bool,
               grad_dtype: torch.dtype = torch.float8_e5m2) -> torch.Tensor:
    """x Wᵀ with its forward and both backward GEMMs in fp8 (the recipe above): x (..., K), weight (N, K) -> (..., N)
    in gemm's output dtype. Differentiable in x and weight."""
    rows = x.reshape(-1, x.shape[-1])  # (M, K)
    out = _Fp8Linear.apply(rows, weight, gemm, rowwise, grad_dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])
