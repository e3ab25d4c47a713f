"""Rotary position embedding's readable math: the oracle.
"""

from __future__ import annotations

import torch


# Shape legend (RoPE)
#     T   positions (rows of a head)      D   head dim (even)
# cos, sin: (T, D/2), the tables of positions [offset, offset + T), pair i rotating at frequency
# theta^(-2i/D) (`rope_tables`).


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[..., i], x[..., i + D/2]) by its position's angle: the "rotate half" layout of
    GPT-NeoX and Hugging Face Llama.

        y[..., i]       = x[..., i] · cos[t, i] − x[..., i + D/2] · sin[t, i]
        y[..., i + D/2] = x[..., i] · sin[t, i] + x[..., i + D/2] · cos[t, i]

    x: (B, H, T, D); cos, sin: (T, D/2) -> (B, H, T, D) in x's dtype. Computed in fp32 for 16-bit and fp32
    inputs (this is the model's default rope: definition.py model_defaults), in float64 for float64
    ones (the oracle).
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x.to(compute).chunk(2, dim=-1)  # (B, H, T, D/2) each
    cos, sin = cos.to(compute), sin.to(compute)  # (T, D/2), broadcast over B and H
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)  # (B, H, T, D)


ROPE_THETA = 10000.0  # the model's default RoPE base (model/transformer.py ModelConfig.rope_theta)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency: (T, hs/2) each, fp32.

    Pair i of a head rotates at frequency theta^(-2i/hs): fast near i=0, slow near hs/2.
    """
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (hs/2,)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)  # (T, hs/2)
    return angles.cos().float(), angles.sin().float()
