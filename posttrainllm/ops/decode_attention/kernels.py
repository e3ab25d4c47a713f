"""Attention for a query chunk against a KV cache: decode (Sq = 1) and speculative verification (Sq = K + 1).

    o = softmax(Q Kᵀ · scale + M) · V,   q (B, H, Sq, D), k and v (B, Hkv, Sk, D), Sq <= Sk

The chunk holds the last Sq positions of the cache, so the causal mask M is aligned
bottom-right: query i (position i + Sk - Sq) sees keys j <= i + Sk - Sq. PyTorch SDPA's
`is_causal` aligns it top-left when Sq != Sk (query i sees j <= i), so its peer takes an
explicit mask there (posttrainllm/ops/decode_attention/definition.py).

Why a kernel of its own: a decode step reads the whole KV cache to produce Sq rows. It is
memory-bound (about 4·G·Sq FLOPs per KV byte pair), so the kernel is shaped for reading the
cache once and in parallel (flash-decoding, Dao et al. 2023):

  * one program serves every query head of a KV head (the G = H / Hkv heads of a GQA group
    and the Sq queries of the chunk: G·Sq rows), so K and V are read once per KV head,
    not once per query head;
  * the cache is split along Sk into NUM_SPLITS pieces that run in parallel (B·Hkv programs
    alone would leave most of a GPU idle); each writes its partial online-softmax state
    (row max m, row sum l, unnormalised accumulator) in fp32;
  * a second kernel combines the pieces: o = Σ_s e^{m_s − m} acc_s / Σ_s e^{m_s − m} l_s.

How many pieces: by default enough to fill the device, so on a GPU the count follows the batch, and a
row's reduction order with it: the same sequence decodes to other bits in another batch, the sampler side
of the trainer–sampler gap. `split_blocks` (op.kv_split_blocks) fixes the piece at that many KV blocks:
batch-invariant, at the cost of idle SMs where B·Hkv·pieces is small.

Addressing: batch and head bases and the partials' row indices are 64-bit (B·H·Sk·D and the fp32 partials
can pass 2^31 elements); offsets inside one (batch, head) slice stay 32-bit, and check_addressable refuses
a slice whose strides reach 2^31. The launcher refuses a grid past CUDA's limits.

Forward only: decoding is inference. The autograd Function's backward is the readable
math's (posttrainllm.ops.decode_attention.reference.chunk_attention, recomputed), so that the lab's generic
stages can still run gradients through the path; the receipt names that backend.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from posttrainllm.ops import use_bf16_emulation
import posttrainllm.ops.decode_attention.reference as reference

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INPUT_PRECISIONS = ("ieee", "tf32")
MAX_GRID_X = 2**31 - 1  # CUDA: programs along grid axis 0
MAX_GRID_YZ = 65535  # along axes 1 and 2


@triton.jit
def _chunk_attn_split_kernel(
    Q, K, V, M, L, ACC,
    sm_scale,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    H, HKV, SQ, SK, HEAD_DIM, KV_PER_SPLIT,
    KV_GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    # -- which rows: block `start` of the G·Sq (query head, query) rows of kv head off_hkv; which piece of the cache
    start = tl.program_id(0)
    off_b = (tl.program_id(1) // HKV).to(tl.int64)  # 64-bit: batch and head bases can pass 2^31 elements
    off_hkv = (tl.program_id(1) % HKV).to(tl.int64)
    split = tl.program_id(2)

    rows = start * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (BLOCK_Q,) row r = (head g of the group, query i)
    row_ok = rows < KV_GROUP * SQ
    head = off_hkv * KV_GROUP + rows // SQ  # (BLOCK_Q,) query head, 64-bit
    query = rows % SQ  # (BLOCK_Q,) index in the chunk
    limit = query + SK - SQ  # (BLOCK_Q,) last key each row may see (bottom-right causal)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    # -- load q: every row of the group, it stays in SRAM throughout. Bases (batch, head) are 64-bit; offsets
    #    inside one (batch, head) slice stay 32-bit (the launcher refuses a slice that spans 2^31 elements)
    q_ptrs = Q + off_b * stride_qb + head[:, None] * stride_qh + query[:, None] * stride_qs + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_Q, BLOCK_D)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    kT_base = K + off_b * stride_kb + off_hkv * stride_kh + offs_d[:, None] * stride_kd  # (BLOCK_D, 1)
    v_base = V + off_b * stride_vb + off_hkv * stride_vh + offs_d[None, :] * stride_vd  # (1, BLOCK_D)

    # -- online-softmax state of this piece, fp32
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)

    lo = split * KV_PER_SPLIT
    hi = tl.minimum(lo + KV_PER_SPLIT, SK)
    for start_kv in range(lo, hi, BLOCK_KV):
        offs_kv = start_kv + tl.arange(0, BLOCK_KV)  # (BLOCK_KV,)
        kv_ok = offs_kv < hi
        kT = tl.load(kT_base + offs_kv[None, :] * stride_ks, mask=d_ok[:, None] & kv_ok[None, :], other=0.0)
        v = tl.load(v_base + offs_kv[:, None] * stride_vs, mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST_DOT:
            kT = kT.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kT, input_precision=INPUT_PRECISION) * sm_scale  # (BLOCK_Q, BLOCK_KV) fp32
        visible = kv_ok[None, :] & (offs_kv[None, :] <= limit[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: no NaN from -inf - -inf
        p = tl.exp(s - m_use[:, None])  # (BLOCK_Q, BLOCK_KV), 0 where masked
        alpha = tl.exp(m_i - m_use)  # rescale of what was summed under the old max
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    # -- the piece's partial state: row index ((b·H + head)·Sq + query)·NUM_SPLITS + split, 64-bit (off_b is)
    part = ((off_b * H + head) * SQ + query) * NUM_SPLITS + split  # (BLOCK_Q,)
    tl.store(M + part, m_i, mask=row_ok)
    tl.store(L + part, l_i, mask=row_ok)
    tl.store(ACC + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _chunk_attn_combine_kernel(
    M, L, ACC, O,
    stride_ob, stride_oh, stride_os, stride_od,
    H, SQ, HEAD_DIM,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # -- one output row (b, head, query): o = Σ_s e^{m_s − m} acc_s / Σ_s e^{m_s − m} l_s, m = max_s m_s
    row = tl.program_id(0).to(tl.int64)  # 64-bit: row·NUM_SPLITS·HEAD_DIM and the batch base can pass 2^31
    off_b = row // (H * SQ)
    off_h = (row // SQ) % H
    query = row % SQ
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_s = tl.load(M + row * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))  # (BLOCK_S,)
    l_s = tl.load(L + row * NUM_SPLITS + offs_s, mask=s_ok, other=0.0)
    acc_s = tl.load(ACC + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_S, BLOCK_D)
    m = tl.max(m_s, axis=0)  # finite: key 0 is visible to every row, and it lies in piece 0
    w = tl.where(s_ok, tl.exp(m_s - m), 0.0)  # (BLOCK_S,), 0 for an empty piece (m_s = -inf)
    out = tl.sum(acc_s * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)  # (BLOCK_D,)
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh + query * stride_os + offs_d * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=d_ok)


def _check_block(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name}={value}: must be a power of two >= 16 (tl.dot needs 16 on the GPU)")


def default_num_splits(batch: int, kv_heads: int, row_blocks: int, kv_len: int, block_kv: int) -> int:
    """How many pieces to cut the cache into: enough programs to fill the device, each with >= 1 KV block.

    CUDA: ~2 programs per SM (B·Hkv·row_blocks programs alone leave an H200's 132 SMs idle at
    decode). The interpreter runs programs one after another, so 2 pieces (when there are 2
    blocks) exercise the combine without multiplying the (serial) launch overhead.
    """
    kv_blocks = triton.cdiv(kv_len, block_kv)
    programs = batch * kv_heads * row_blocks
    if torch.cuda.is_available():
        target = 2 * torch.cuda.get_device_properties(0).multi_processor_count
        return max(1, min(kv_blocks, triton.cdiv(target, programs)))
    return min(2, kv_blocks)


def decode_attention_launch(batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int, head_dim: int, *,
                            block_q: int = 64, block_kv: int = 64, num_splits: int | None = None,
                            split_blocks: int | None = None, num_warps: int = 4, num_stages: int = 2) -> dict[str, Any]:
    """The dispatch geometry: rows per KV head (G·Sq) in blocks of BLOCK_Q (shrunk to fit, >= 16), pieces of Sk.

    The pieces: `num_splits` given outright; else `split_blocks` KV blocks a piece, the batch-invariant mode (their
    count follows the cache length alone, so a row's reduction order never depends on its batch or the device);
    else default_num_splits, which fills the device and so follows the batch on a GPU."""
    _check_block("block_q", block_q)
    _check_block("block_kv", block_kv)
    if num_splits is not None and split_blocks is not None:
        raise ValueError(f"num_splits={num_splits} and split_blocks={split_blocks}: give one or neither")
    if split_blocks is not None and split_blocks < 1:
        raise ValueError(f"split_blocks={split_blocks}: must be >= 1 KV block a piece")
    rows = heads // kv_heads * q_len  # G·Sq rows share one KV head
    block_q = min(block_q, max(16, triton.next_power_of_2(rows)))
    row_blocks = triton.cdiv(rows, block_q)
    kv_blocks = triton.cdiv(kv_len, block_kv)
    splits = num_splits or (triton.cdiv(kv_blocks, split_blocks) if split_blocks
                            else default_num_splits(batch, kv_heads, row_blocks, kv_len, block_kv))
    per_split = triton.cdiv(kv_blocks, splits) * block_kv  # keys per piece, a whole number of blocks
    for axis, size, limit in (("axis 1 (batch x kv heads)", batch * kv_heads, MAX_GRID_YZ),
                              ("axis 2 (cache pieces)", splits, MAX_GRID_YZ),
                              ("the combine's axis 0 (batch x heads x queries)", batch * heads * q_len, MAX_GRID_X)):
        if size > limit:
            raise ValueError(f"decode attention grid {axis} = {size} exceeds CUDA's {limit} programs")
    return {"kernel": "_chunk_attn_split_kernel + _chunk_attn_combine_kernel",
            "grid": [row_blocks, batch * kv_heads, splits], "combine_grid": [batch * heads * q_len],
            "rows_per_kv_head": rows, "block_q": block_q, "block_kv": block_kv,
            "block_d": max(16, triton.next_power_of_2(head_dim)), "num_splits": splits, "kv_per_split": per_split,
            "split_rule": ("given" if num_splits else f"{split_blocks} KV blocks a piece (batch-invariant)"
                           if split_blocks else "from the batch and the device (default_num_splits)"),
            "num_warps": num_warps, "num_stages": num_stages}


def check_addressable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The kernels address batches and heads with 64-bit bases and offsets inside one (batch, head) slice in
    32 bits: refuse a slice of q (Sq, D) or k, v (Sk, D) whose strides span 2^31 elements or more."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        span = (t.shape[2] - 1) * abs(t.stride(2)) + (t.shape[3] - 1) * abs(t.stride(3))
        if span >= 2**31:
            raise ValueError(f"{name}: offsets inside one (batch, head) slice reach {span} >= 2^31 elements (shape "
                             f"{tuple(t.shape)}, strides {t.stride()}), past 32-bit offsets; make it contiguous "
                             "per head")


def triton_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                            block_q: int = 64, block_kv: int = 64, num_splits: int | None = None,
                            split_blocks: int | None = None, num_warps: int = 4, num_stages: int = 2,
                            input_precision: str = "ieee", emulate_bf16: bool | None = None) -> torch.Tensor:
    """softmax(Q Kᵀ · scale + bottom-right causal mask) · V: q (B, H, Sq, D), k, v (B, Hkv, Sk, D) -> (B, H, Sq, D)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"expected 4-D q (B, H, Sq, D), k and v (B, Hkv, Sk, D) of one shape; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    (B, H, Sq, D), (Bk, Hkv, Sk, Dk) = q.shape, k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} disagree on batch or head dim")
    if not 1 <= Sq <= Sk:
        raise ValueError(f"a query chunk needs 1 <= Sq <= Sk, got Sq={Sq}, Sk={Sk}")
    if H % Hkv:
        raise ValueError(f"H={H} query heads is not a multiple of Hkv={Hkv} kv heads")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}: one of {SUPPORTED_DTYPES} for all three")
    if input_precision not in INPUT_PRECISIONS:
        raise ValueError(f"input_precision={input_precision!r}; choose one of {INPUT_PRECISIONS}")
    check_addressable(q, k, v)
    launch = decode_attention_launch(B, H, Hkv, Sq, Sk, D, block_q=block_q, block_kv=block_kv, num_splits=num_splits,
                                     split_blocks=split_blocks, num_warps=num_warps, num_stages=num_stages)
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    upcast = use_bf16_emulation(q.dtype, emulate_bf16)
    splits = launch["num_splits"]
    m = torch.empty((B, H, Sq, splits), device=q.device, dtype=torch.float32)  # per piece: row max
    l = torch.empty_like(m)  # per piece: row sum of e^{s - m}
    acc = torch.empty((B, H, Sq, splits, D), device=q.device, dtype=torch.float32)  # per piece: Σ e^{s - m} v
    _chunk_attn_split_kernel[tuple(launch["grid"])](
        q, k, v, m, l, acc, scale,
        *q.stride(), *k.stride(), *v.stride(),
        H, Hkv, Sq, Sk, D, launch["kv_per_split"],
        KV_GROUP=H // Hkv, NUM_SPLITS=splits,
        BLOCK_Q=launch["block_q"], BLOCK_KV=block_kv, BLOCK_D=launch["block_d"],
        INPUT_PRECISION=input_precision, UPCAST_DOT=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )
    # the interpreter's fp32 -> bf16 cast truncates: under emulation PyTorch rounds the fp32 result
    o = torch.empty((B, H, Sq, D), device=q.device, dtype=torch.float32 if upcast else q.dtype)
    _chunk_attn_combine_kernel[tuple(launch["combine_grid"])](
        m, l, acc, o, *o.stride(), H, Sq, D,
        NUM_SPLITS=splits, BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=launch["block_d"],
        num_warps=1,
    )
    return o.to(q.dtype)


class _DecodeAttention(torch.autograd.Function):
    """Forward: the Triton kernels. Backward: the readable math's, recomputed (decoding never trains)."""

    @staticmethod
    def forward(ctx, q, k, v, options):
        ctx.save_for_backward(q, k, v)
        ctx.sm_scale = options.get("sm_scale")  # the forward's scale (None: 1/sqrt(D), as both sides default)
        return triton_decode_attention(q, k, v, **options)

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v = (x.detach().requires_grad_() for x in ctx.saved_tensors)
        with torch.enable_grad():
            out = reference.chunk_attention(q, k, v, sm_scale=ctx.sm_scale)
        grad_q, grad_k, grad_v = torch.autograd.grad(out, (q, k, v), grad_o)
        return grad_q, grad_k, grad_v, None


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
    """The differentiable public function (options: block_q, block_kv, num_splits, split_blocks, num_warps,
    num_stages, input_precision, emulate_bf16, sm_scale); see triton_decode_attention."""
    return _DecodeAttention.apply(q, k, v, options)
