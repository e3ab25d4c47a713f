"""FLOPs and minimal bytes per op: the formulas next to the code that uses them.

A multiply-add counts as 2 FLOPs. "Bytes" are the minimum an implementation must
move to and from memory: read every input once, write every output once.
"""

from __future__ import annotations


def matmul_flops(m: int, n: int, k: int) -> int:
    """(M, K) @ (K, N): M·N dot products of length K -> 2·M·N·K."""
    return 2 * m * n * k


def matmul_bytes(m: int, n: int, k: int, itemsize: int) -> int:
    """Read A (M·K) and B (K·N), write C (M·N)."""
    return (m * k + k * n + m * n) * itemsize


def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool) -> int:
    """Q Kᵀ and P V are each 2·S·S·D per head -> 4·B·H·S²·D; causal keeps about half.

    The softmax's exp/sum/max are O(S²) and left out, as FlashAttention's papers do.
    """
    flops = 4 * batch * heads * seq_len * seq_len * head_dim
    return flops // 2 if causal else flops


def attention_bytes(batch: int, heads: int, kv_heads: int, seq_len: int, head_dim: int, itemsize: int) -> int:
    """Read Q (B·H·S·D), K and V (B·Hkv·S·D each), write O (B·H·S·D).

    A naive implementation also writes and reads the (S, S) score and probability
    matrices; this is the floor a fused kernel can reach.
    """
    return (2 * batch * heads + 2 * batch * kv_heads) * seq_len * head_dim * itemsize
