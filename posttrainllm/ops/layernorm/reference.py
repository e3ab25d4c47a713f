"""LayerNorm's readable math: the oracle every path is checked against (float64 inputs) and the plain
in-precision baseline (the point's dtype). Textbook formula in eager PyTorch, no tricks.

Shape legend
    rows  the flattened leading dims (the model's B·T)      C  hidden size, the normalised last dim
"""

from __future__ import annotations

import torch


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """y = (x − mean(x)) / sqrt(var(x) + eps) · weight + bias, mean and (biased) variance over the last dim.

    x: (rows, C), weight: (C,), bias: (C,) -> (rows, C) in x's dtype. Computed in fp32 at least (float64 stays
    float64: the oracle), rounded to x's dtype once at the end. The variance is the mean of the centred squares,
    (x − mean)², not mean(x²) − mean²: on a row far from zero (1e4 + N(0, 1)) the latter cancels to noise.
    eps inside the root keeps a constant row finite (y = bias).
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    x_up = x.to(dtype)
    centred = x_up - x_up.mean(dim=-1, keepdim=True)  # (rows, C)
    rstd = torch.rsqrt(centred.pow(2).mean(dim=-1, keepdim=True) + eps)  # (rows, 1)
    return (centred * rstd * weight.to(dtype) + bias.to(dtype)).to(x.dtype)  # (rows, C)
