"""The matmul's readable math: the oracle its paths are checked against, in bf16/fp32 and under fp8.

No performance tricks live here: the textbook formula in eager PyTorch, run in whatever dtype its inputs
have: call it on float64 inputs for the oracle, or on the point's precision for the plain in-precision
baseline.

Shape legend
    M, N, K   matmul sizes: (M, K) @ (K, N) -> (M, N)
"""

from __future__ import annotations

import torch

from posttrainllm.ops import quantize  # by module: a test's patch of it reaches here


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """C = A @ B.   a: (M, K), b: (K, N) -> (M, N)."""
    return a @ b


def fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """C = (A_q · s_a) @ (B_q · s_b): dequantize, then the product.

    a: (M, K) fp8 (or its values in a wider dtype), a_scale: () or (M, 1); b: (K, N), b_scale: () or (1, N).
    In fp32 rounded to out_dtype (an fp8 GEMM's fp32 accumulator and 16-bit output); in float64 for float64
    inputs (the oracle: exact dequantized values, their product in float64), left in float64.
    """
    compute = torch.float64 if a.dtype == torch.float64 else torch.float32
    c = quantize.dequantize_fp8(a, a_scale, compute) @ quantize.dequantize_fp8(b, b_scale, compute)  # (M, N)
    return c if compute == torch.float64 else c.to(out_dtype)
