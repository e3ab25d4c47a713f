"""Attention's readable math (causal and not, MHA/GQA/MQA): the oracle its paths are checked against.

No performance tricks live here: the textbook formula in eager PyTorch, run in whatever dtype its inputs
have: call it on float64 inputs for the oracle, or on the point's precision for the plain in-precision
baseline.

Shape legend
    B   batch                 S   sequence length
    H   query heads           D   head dim
    Hkv key/value heads
        (H % Hkv == 0; Hkv == H is MHA, 1 < Hkv < H is GQA, Hkv == 1 is MQA)
"""

from __future__ import annotations

import math
from typing import Callable

import torch


def repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Share each key/value head with its group of query heads.

    x: (B, Hkv, S, D) -> (B, H, S, D); query head h reads kv head h // (H // Hkv).
    """
    n_kv_heads = x.shape[1]
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    return x.repeat_interleave(n_heads // n_kv_heads, dim=1)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    softmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """softmax(Q Kᵀ · scale + mask) · V, materialising the (S, S) score matrix.

    q: (B, H, S, D), k and v: (B, Hkv, S, D) -> (B, H, S, D).
    scale defaults to 1/sqrt(D); the causal mask lets query i see keys j <= i.
    softmax: the row softmax's formulation (default torch.softmax; `softmax_from_logsumexp` as a flash backward).
    """
    n_heads, seq_len, head_dim = q.shape[1], q.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    k = repeat_kv(k, n_heads)  # (B, H, S, D)
    v = repeat_kv(v, n_heads)  # (B, H, S, D)
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, S, S)
    if causal:
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = (softmax or _softmax)(scores)  # (B, H, S, S), rows sum to 1
    return probs @ v  # (B, H, S, D)


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores, dim=-1)


def softmax_from_logsumexp(scores: torch.Tensor) -> torch.Tensor:
    """exp(S − logsumexp(S)) over the last dim: the same function as the softmax, formed as a flash backward forms
    it, from the row logsumexp (rounded to the precision) and the recomputed scores. With scores of magnitude |s|,
    that rounding of lse alone moves each probability by ~ulp(|s|) relatively: the readable math's own error for
    a kernel that stores lse, and none for torch.softmax, which normalises by the exact row sum."""
    return torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))


def attention_logsumexp(
    q: torch.Tensor, k: torch.Tensor, *, causal: bool = True, sm_scale: float | None = None
) -> torch.Tensor:
    """Row logsumexp of the masked, scaled scores: (B, H, S). The flash forward saves it."""
    n_heads, seq_len, head_dim = q.shape[1], q.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    scores = (q @ repeat_kv(k, n_heads).transpose(-2, -1)) * scale
    if causal:
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.logsumexp(scores, dim=-1)
