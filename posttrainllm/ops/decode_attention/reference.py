"""A query chunk against a KV cache (decode, speculative verification): the readable math.

No performance tricks live here: the textbook formula in eager PyTorch, run in whatever dtype its inputs
have: call it on float64 inputs for the oracle, or on the point's precision for the plain in-precision
baseline.

Shape legend
    B   batch      H   query heads     Hkv   key/value heads     D   head dim
    Sq  queries in the chunk (1: one decode step; K+1: a speculative verification)
    Sk  keys in the cache, the chunk's own included (Sq <= Sk)
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from posttrainllm.ops.attention.reference import _softmax, repeat_kv


def chunk_causal_mask(q_len: int, kv_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """True where query i of the chunk may NOT see key j: (Sq, Sk), aligned bottom-right.

    The chunk holds the last Sq positions of the Sk in the cache, so query i sits at position
    i + Sk - Sq and sees keys j <= i + Sk - Sq. (torch SDPA's is_causal aligns top-left when
    Sq != Sk, i.e. query i sees keys j <= i: wrong for a chunk at the end of a cache.)
    """
    if not 1 <= q_len <= kv_len:
        raise ValueError(f"a query chunk needs 1 <= Sq <= Sk, got Sq={q_len}, Sk={kv_len}")
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).triu(kv_len - q_len + 1)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                    softmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """softmax(Q Kᵀ · scale + bottom-right causal mask) · V for a query chunk at the end of a KV cache.

    q: (B, H, Sq, D), k and v: (B, Hkv, Sk, D) with Sq <= Sk -> (B, H, Sq, D).
    Sq == Sk is ordinary causal attention; Sq == 1 is one decode step (sees every key).
    softmax: as in `attention`.
    """
    head_dim = q.shape[3]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    k = repeat_kv(k, q.shape[1])  # (B, H, Sk, D)
    v = repeat_kv(v, q.shape[1])  # (B, H, Sk, D)
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Sq, Sk)
    scores = scores.masked_fill(chunk_causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    probs = (softmax or _softmax)(scores)  # (B, H, Sq, Sk), rows sum to 1
    return probs @ v  # (B, H, Sq, D)


def masked_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor, *,
                           sm_scale: float | None = None) -> torch.Tensor:
    """softmax(Q Kᵀ · scale, with `blocked` keys at -inf) · V: a query chunk with an arbitrary mask.

    q: (B, H, Sq, D), k and v: (B, Hkv, Sk, D), blocked: (Sq, Sk) bool, True where query i may NOT see
    key j (every row must see at least one key) -> (B, H, Sq, D). Tree verification uses it: each
    candidate sees the cache and its own ancestors only (posttrainllm/model/decode.py `speculative_tree`).
    """
    head_dim = q.shape[3]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    k = repeat_kv(k, q.shape[1])  # (B, H, Sk, D)
    v = repeat_kv(v, q.shape[1])  # (B, H, Sk, D)
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Sq, Sk)
    scores = scores.masked_fill(blocked, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # (B, H, Sq, Sk), rows sum to 1
    return probs @ v  # (B, H, Sq, D)
