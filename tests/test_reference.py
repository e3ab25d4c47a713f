"""The reference math against independent formulas written out element by element."""

import math

import pytest
import torch

from posttrainllm.ops.attention import reference as attention_reference
from posttrainllm.ops.matmul import reference as matmul_reference


def test_matmul_matches_explicit_sums():
    a, b = torch.randn(5, 7, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    expected = torch.tensor([[sum(a[i, p] * b[p, j] for p in range(7)) for j in range(3)] for i in range(5)])
    torch.testing.assert_close(matmul_reference.matmul(a, b), expected, rtol=1e-12, atol=1e-12)


def _attention_by_rows(q, k, v, causal):
    """Row by row with scalar exp and sum: out[b,h,i] = sum_j softmax_j(q_i·k_j/sqrt(D)) v_j."""
    B, H, S, D = q.shape
    group = H // k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.zeros(B, H, S, dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            kh, vh = k[b, h // group], v[b, h // group]
            for i in range(S):
                keys = range(i + 1) if causal else range(S)
                scores = [float(q[b, h, i] @ kh[j]) / math.sqrt(D) for j in keys]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                out[b, h, i] = sum(w / total * vh[j] for w, j in zip(weights, keys))
                lse[b, h, i] = top + math.log(total)
    return out, lse


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_matches_row_by_row_softmax(heads, kv_heads, causal):
    q = torch.randn(2, heads, 7, 8, dtype=torch.float64)
    k = torch.randn(2, kv_heads, 7, 8, dtype=torch.float64)
    v = torch.randn(2, kv_heads, 7, 8, dtype=torch.float64)
    expected, expected_lse = _attention_by_rows(q, k, v, causal)
    torch.testing.assert_close(attention_reference.attention(q, k, v, causal=causal), expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(attention_reference.attention_logsumexp(q, k, causal=causal), expected_lse, rtol=1e-10, atol=1e-10)


def test_causal_first_row_is_its_own_value():
    q, k, v = (torch.randn(1, 1, 4, 8, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(attention_reference.attention(q, k, v, causal=True)[0, 0, 0], v[0, 0, 0])


def test_kv_heads_must_divide_heads():
    q, kv = torch.randn(1, 4, 3, 8), torch.randn(1, 3, 3, 8)
    with pytest.raises(ValueError, match="not a multiple"):
        attention_reference.attention(q, kv, kv)
