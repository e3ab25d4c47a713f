"""The row softmax's readable math: the oracle its paths are checked against.

Shape legend
    rows  the flattened leading dims      C  the normalised last dim
"""

from __future__ import annotations

import torch


def softmax(x: torch.Tensor) -> torch.Tensor:
    """y = exp(x − max(x)) / Σ exp(x − max(x)) along the last dim.   x: (rows, C) -> (rows, C) in x's dtype.

    Computed in fp32 at least (float64 stays float64: the oracle), rounded to x's dtype once at the end. The row
    max is subtracted first: the result is the same function, and exp of a logit of ~1e4 would overflow.
    """
    z = x.to(torch.promote_types(x.dtype, torch.float32))
    z = z - z.amax(dim=-1, keepdim=True)  # (rows, C), every entry <= 0
    e = z.exp()
    return (e / e.sum(dim=-1, keepdim=True)).to(x.dtype)  # (rows, C)
