"""The SwiGLU gate's readable math (the dense MLP's, and each MoE expert's).
"""

from __future__ import annotations

import torch


# Shape legend (SwiGLU)
#     rows   tokens (B·T)          F   the MLP's hidden width (architecture.mlp_hidden)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up, silu(g) = g · sigmoid(g), elementwise.   gate, up: (..., F) -> (..., F).

    In the inputs' dtype, as the model's MLP runs it (a 16-bit run rounds silu(gate), then the product).
    """
    return torch.nn.functional.silu(gate) * up
