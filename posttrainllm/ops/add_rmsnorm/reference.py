"""The residual add + RMSNorm's readable math: the oracle every path is checked against (float64 inputs) and the
plain in-precision baseline (the point's dtype). Textbook formula in eager PyTorch, no tricks.

Shape legend
    rows  the flattened leading dims (the model's B·T)      C  hidden size, the normalised last dim
"""

from __future__ import annotations

import torch


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual;  y = h / sqrt(mean(h², last dim) + eps) · weight.   Returns (y, h).

    x, residual: (rows, C), weight: (C,) -> y (rows, C) and h (rows, C), both in x's dtype. The pre-norm block's
    "x = x + attn(...); mlp(norm(x))": h is the new residual stream, y what the next layer reads. Computed in fp32
    at least (float64 stays float64: the oracle); h is rounded to x's dtype once for its output, and y is
    normalised from the unrounded sum (h² of an fp16 value near 1e4 overflows fp16).
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    h = x.to(dtype) + residual.to(dtype)  # (rows, C)
    rstd = torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)  # (rows, 1), eps inside the root
    return (h * rstd * weight.to(dtype)).to(x.dtype), h.to(x.dtype)
