"""A causal attention forward in Triton, written the way the Triton fused-attention tutorial writes it, to bring
to the lab as a user path (nothing here imports posttrainllm):

    posttrainllm bench op=attention 'op.user_impls=[examples/triton_attention.py:attention]'

Online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022): each program owns BLOCK_M query
rows of one (batch, head) and streams the keys BLOCK_N at a time, keeping a running max m, a running sum l and
an unnormalised accumulator, so the (S, S) score matrix is never written. The backward recomputes the readable
math in PyTorch (torch.autograd.Function below): the lab checks it as this function's own backward.
"""

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _attn_fwd(Q, K, V, Out, sm_scale, S, HEAD_DIM,
              stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_ob, stride_oh, stride_os,
              GROUP: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr):
    start_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2).to(tl.int64)
    kv_h = h // GROUP  # GQA: query head h reads K/V head h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    # load q: it stays in SRAM throughout
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=(offs_m[:, None] < S) & d_ok[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + b * stride_kb + kv_h * stride_kh
    v_base = V + b * stride_kb + kv_h * stride_kh
    end = tl.minimum((start_m + 1) * BLOCK_M, S) if CAUSAL else S
    for start_n in range(0, end, BLOCK_N):
        cols = start_n + offs_n
        kT = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None],
                     mask=(cols[None, :] < S) & d_ok[:, None], other=0.0).to(tl.float32)
        scores = tl.dot(q, kT) * sm_scale  # (BLOCK_M, BLOCK_N)
        visible = cols[None, :] < S
        if CAUSAL:
            visible = visible & (offs_m[:, None] >= cols[None, :])
        scores = tl.where(visible, scores, float("-inf"))
        # online softmax: rescale what was summed so far to the new running max
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * stride_ks + offs_d[None, :],
                    mask=(cols[:, None] < S) & d_ok[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=(offs_m[:, None] < S) & d_ok[None, :])


def attention_forward(q, k, v, causal, sm_scale, block_m=64, block_n=64):
    """q (B, H, S, D), k and v (B, Hkv, S, D) -> (B, H, S, D) in q's dtype."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    batch, heads, seq, head_dim = q.shape
    out = torch.empty_like(q)
    grid = (triton.cdiv(seq, block_m), batch, heads)
    _attn_fwd[grid](q, k, v, out, sm_scale, seq, head_dim,
                    q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                    out.stride(0), out.stride(1), out.stride(2),
                    GROUP=heads // k.shape[1], CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n,
                    BLOCK_D=max(16, triton.next_power_of_2(head_dim)))
    return out


def _readable(q, k, v, causal, sm_scale):
    n_heads, seq = q.shape[1], q.shape[2]
    k = k.repeat_interleave(n_heads // k.shape[1], dim=1)
    v = v.repeat_interleave(n_heads // v.shape[1], dim=1)
    scores = (q.float() @ k.float().transpose(-2, -1)) * sm_scale
    if causal:
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.sm_scale = causal, sm_scale
        return attention_forward(q, k, v, causal, sm_scale)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = _readable(q, k, v, ctx.causal, ctx.sm_scale)
        return (*torch.autograd.grad(out, (q, k, v), grad_out), None, None)


def attention(q, k, v, *, causal: bool, sm_scale: float) -> torch.Tensor:
    return _Attention.apply(q, k, v, causal, sm_scale)


if __name__ == "__main__":  # a quick self-check: python examples/triton_attention.py (TRITON_INTERPRET=1 on a CPU)
    q, k, v = (torch.randn(1, 2, 100, 32) for _ in range(3))
    got = attention(q, k, v, causal=True, sm_scale=1 / math.sqrt(32))
    print("max error:", (got - _readable(q, k, v, True, 1 / math.sqrt(32))).abs().max().item())
