"""RMSNorm's readable math: the oracle its paths are checked against.
"""

from __future__ import annotations

import torch


# Shape legend (RMSNorm)
#     rows  the flattened leading dims (the model's B·T)      C  hidden size, the normalised last dim


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x², last dim) + eps) · weight.   x: (rows, C), weight: (C,) -> (rows, C) in x's dtype.

    Computed in fp32 at least (float64 stays float64: the oracle), rounded to x's dtype once at the end:
    x² of an fp16 value near 1e4 overflows fp16. eps inside the root keeps an all-zero row finite (y = 0).
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    x_up = x.to(dtype)
    rstd = torch.rsqrt(x_up.pow(2).mean(dim=-1, keepdim=True) + eps)  # (rows, 1)
    return (x_up * rstd * weight.to(dtype)).to(x.dtype)  # (rows, C)
