"""The lm_head and the cross-entropy: the readable math.
"""

from __future__ import annotations

import torch


# Shape legend (cross-entropy)
#     N   tokens (rows of h)      C   model width       V   vocabulary
# h (N, C) the last hidden states, weight (V, C) the lm_head, targets (N,) int64 class ids.


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                         label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of the logits h @ weightᵀ against targets, materialising the (N, V) logits.

    h: (N, C), weight: (V, C), targets: (N,) int64 -> a 0-dim loss in fp32 (float64 for float64 inputs).
    Rows whose target is ignore_index contribute nothing and the mean divides by the count of the others
    (all ignored: 0/0 = NaN, as F.cross_entropy). With smoothing ε the target distribution is
    (1 − ε)·one_hot + ε/V: loss_row = (1 − ε)·(lse − x_y) + ε·(lse − mean_j x_j).
    """
    dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    logits = h.to(dtype) @ weight.to(dtype).t()  # (N, V), the loss's precision whatever h's dtype
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index,
                                             label_smoothing=label_smoothing)
