"""Fused attention forward, FlashAttention-2 style (Dao 2023; Triton's fused-attention tutorial).

One program owns a block of BLOCK_Q queries of one (batch, head). It loads that Q
block once, then streams K and V in BLOCK_KV blocks and keeps the softmax online
(Milakov & Gimelshein 2018): a running row max m_i, a running row sum l_i, and an
fp32 accumulator that is rescaled by exp(m_old - m_new) whenever the max grows.
The (S, S) score matrix never exists in memory. Softmax runs in base 2 with
log2(e) folded into the scale; the saved row logsumexp L = m + log(l) is converted
back to natural-log units for the backward pass.

Causal: query i sees keys j <= i, so a query block stops at the diagonal. The KV loop runs in two
phases: blocks wholly below the diagonal without any mask, then the diagonal blocks (or, non-causal,
the ragged last block) masked. HEAD_DIM is a compile-time constant (the head-dim mask exists only
when D is padded to a power of two), causal blocks launch heaviest first across every head (_schedule),
the softmax scale is folded into one multiply-add (exp2(s·scale·log2 e − m)), and per-(batch, head) base
offsets are 64-bit. tile/workgroup=auto autotunes on CUDA, keyed on the problem size (see ops/autotune.py
AUTO_CPU_NOTE for CPU).
GQA / MQA: K and V carry Hkv heads; query head h reads kv head h // (H // Hkv).

bf16 under Triton's interpreter: see posttrainllm.ops.matmul.kernels; with UPCAST_DOT the
dot operands (Q, K, P, V) stay fp32 and the kernel stores fp32 O, which PyTorch
rounds to bf16.

Backward (FlashAttention-2, as in the tutorial): with P = exp(Q Kᵀ · scale - L)
recomputed block by block from the saved L, and D = rowsum(dO ∘ O),
    dV = Pᵀ dO,   dS = P ∘ (dO Vᵀ - D),   dK = dSᵀ Q · scale,   dQ = dS K · scale.
Three kernels: a preprocess for D, one that owns a KV block and sweeps the query
blocks (and, for GQA/MQA, every query head of its KV group) to accumulate dK and
dV, and one that owns a query block and sweeps the KV blocks to accumulate dQ.

Shapes: q (B, H, S, D), k and v (B, Hkv, S, D) -> o (B, H, S, D), lse (B, H, S).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from posttrainllm.ops import use_bf16_emulation
from posttrainllm.ops.autotune import autotune_smem, chosen_config
from posttrainllm.ops.attention.config import block_d as padded_head_dim
from posttrainllm.ops.attention.config import smem_bytes as attention_smem_bytes  # the one formula (config.py)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INPUT_PRECISIONS = ("ieee", "tf32")
MAX_HEAD_DIM = 256
LOG2_E = tl.constexpr(1.4426950408889634)  # exp(x) == exp2(x * log2(e))
LN_2 = tl.constexpr(0.6931471805599453)  # log(x) == log2(x) * ln(2)


# --- shared pieces -------------------------------------------------------------------------
# The causal loop is split in two (as Triton's fused-attention tutorial does): KV blocks that lie
# wholly below the diagonal (every query of the block sees every key, all in bounds) run without a
# single mask; only the diagonal blocks, or for non-causal attention the ragged last block, pay for
# the masks. Loads mask only the axes that can run past their extent: the head dim only when D is
# padded to BLOCK_D (PAD_D), the sequence only in masked blocks. Constexpr branches: the unmasked
# path carries no mask code at all.


@triton.jit
def _load_tile(ptrs, offs_r, n_r, offs_c, n_c, CHECK_R: tl.constexpr, CHECK_C: tl.constexpr):
    """A 2-D tile with rows checked against n_r only if CHECK_R, columns against n_c only if CHECK_C."""
    if CHECK_R:
        if CHECK_C:
            x = tl.load(ptrs, mask=(offs_r[:, None] < n_r) & (offs_c[None, :] < n_c), other=0.0)
        else:
            x = tl.load(ptrs, mask=offs_r[:, None] < n_r, other=0.0)
    else:
        if CHECK_C:
            x = tl.load(ptrs, mask=offs_c[None, :] < n_c, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _load_row(ptrs, offs, n, CHECK: tl.constexpr):
    """A 1-D fp32 vector (a block of L or D), checked against n only if CHECK."""
    if CHECK:
        x = tl.load(ptrs, mask=offs < n, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _visible(offs_q, offs_kv, S, CAUSAL: tl.constexpr):
    """(BLOCK_Q, BLOCK_KV): key in bounds and, if causal, not after the query."""
    visible = offs_kv[None, :] < S
    if CAUSAL:
        visible = visible & (offs_q[:, None] >= offs_kv[None, :])
    return visible


@triton.jit
def _kv_split(start_q, S, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, CAUSAL: tl.constexpr):
    """For the query block start_q: keys [0, diag_lo) need no mask, keys [diag_lo, hi) do.

    Causal: blocks before the one holding the block's first query are wholly visible and in bounds;
    from there to the block's last query is the diagonal. Non-causal: whole blocks, then the ragged tail.
    """
    if CAUSAL:
        diag_lo = (start_q * BLOCK_Q) // BLOCK_KV * BLOCK_KV
        hi = tl.minimum((start_q + 1) * BLOCK_Q, S)
    else:
        diag_lo = S // BLOCK_KV * BLOCK_KV
        hi = S
    return diag_lo, hi


@triton.jit
def _schedule(S, BH, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    """This program's (block of S, batch·head pair), ordered across every head, heaviest first.

    rank is the program's place in launch order (CUDA hands out programs axis 0 fastest), whatever the grid's
    shape (launch_grid: (blocks, BH), or (blocks·BH, 1) past axis 1's limit). Ranks [0, BH) take block 0 of
    every (batch, head), the next BH block 1, and so on; REVERSE counts blocks from the end. Causal: the
    forward and dQ reverse (the last query block sees every key), dK/dV does not (KV block 0 is seen by every
    query), so the long programs of all heads start before any short one.
    """
    rank = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)  # < blocks·BH <= 2^31 - 1 (launch_grid)
    block = rank // BH
    if REVERSE:
        block = tl.cdiv(S, BLOCK) - 1 - block
    return block, rank % BH


# --- forward -------------------------------------------------------------------------------


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q, kT_base, v_base, stride_ks, stride_vs,
    offs_q, offs_d, lo, hi, S, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_KV: tl.constexpr, PAD_D: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    # -- stream K, V blocks [lo, hi): scores, new max, rescale, accumulate
    for start_kv in range(lo, hi, BLOCK_KV):
        start_kv = tl.multiple_of(start_kv, BLOCK_KV)
        offs_kv = start_kv + tl.arange(0, BLOCK_KV)
        kT = _load_tile(kT_base + offs_kv[None, :] * stride_ks, offs_d, HEAD_DIM, offs_kv, S, PAD_D, MASKED)
        if UPCAST_DOT:
            kT = kT.to(tl.float32)
        qk = tl.dot(q, kT, input_precision=INPUT_PRECISION)  # (BLOCK_Q, BLOCK_KV) fp32, unscaled
        if MASKED:
            qk = tl.where(_visible(offs_q, offs_kv, S, CAUSAL), qk, float("-inf"))

        # the scale (with log2 e) is folded into one multiply-add: exp2(qk * qk_scale - m), m in log2 units;
        # every row sees a key in its first block, so m_new is finite from the first block on
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]

        v = _load_tile(v_base + offs_kv[:, None] * stride_vs, offs_kv, S, offs_d, HEAD_DIM, MASKED, PAD_D)
        if UPCAST_DOT:
            v = v.to(tl.float32)
        else:
            p = p.to(v.dtype)
        acc = tl.dot(p, v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, L,
    sm_scale,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    H, S, BH,
    HEAD_DIM: tl.constexpr,
    KV_GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # -- which queries: block start_q (causal: heaviest first, across heads) of head off_h in batch off_b;
    #    its kv head. BH = B·H
    start_q, off_bh = _schedule(S, BH, BLOCK_Q, CAUSAL)
    off_b = off_bh // H
    off_h = off_bh % H
    off_hkv = off_h // KV_GROUP
    PAD_D: tl.constexpr = HEAD_DIM != BLOCK_D

    # -- 64-bit bases: B·H·S·D can pass 2^31 elements; offsets inside one (batch, head) stay 32-bit
    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
    o_base = O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
    row_base = off_bh.to(tl.int64) * S  # into L, (B, H, S) contiguous

    offs_q = start_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)

    # -- load q: it stays in SRAM throughout
    q = _load_tile(q_base + offs_q[:, None] * stride_qs + offs_d[None, :] * stride_qd, offs_q, S, offs_d, HEAD_DIM,
                   True, PAD_D)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # -- online-softmax state, fp32, scores in log2 units
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2_E  # forward: exp(x * scale) == exp2(x * scale * log2(e))

    kT_base = k_base + offs_d[:, None] * stride_kd  # (BLOCK_D, 1)
    v_base = v_base + offs_d[None, :] * stride_vd  # (1, BLOCK_D)
    diag_lo, hi = _kv_split(start_q, S, BLOCK_Q, BLOCK_KV, CAUSAL)
    # -- phase 1: KV blocks every query of this block sees, in bounds: no mask
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, kT_base, v_base, stride_ks, stride_vs, offs_q, offs_d,
                                    0, diag_lo, S, qk_scale, HEAD_DIM, BLOCK_KV, PAD_D, False, CAUSAL,
                                    INPUT_PRECISION, UPCAST_DOT)
    # -- phase 2: the diagonal (causal) or the ragged last block: masked; keys past the last query never load
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, kT_base, v_base, stride_ks, stride_vs, offs_q, offs_d,
                                    diag_lo, hi, S, qk_scale, HEAD_DIM, BLOCK_KV, PAD_D, True, CAUSAL,
                                    INPUT_PRECISION, UPCAST_DOT)

    # -- epilogue: normalise, save O and the natural-log row logsumexp
    o = acc / l_i[:, None]
    o_ptrs = o_base + offs_q[:, None] * stride_os + offs_d[None, :] * stride_od
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=(offs_q[:, None] < S) & (offs_d[None, :] < HEAD_DIM))
    lse = (m_i + tl.math.log2(l_i)) * LN_2  # log2 units -> natural log
    tl.store(L + row_base + offs_q, lse, mask=offs_q < S)


# --- backward ------------------------------------------------------------------------------
# dK/dV and dQ come from two kernels rather than one kernel with atomic adds into dQ: each
# output element then has exactly one writer, so the gradients are deterministic (fp32
# atomics land in whatever order the hardware picks). Triton's interpreter runs programs one
# after another, so a race between programs would never show in CPU tests; with no shared
# writes there is none to hide. The price is recomputing QKᵀ and dO Vᵀ once more for dQ.
# Each kernel has its own block sizes (dK/dV: few queries per step against a tall KV block that
# stays in SRAM; dQ: the transpose), and both split the causal loop as the forward does.


@triton.jit
def _attn_bwd_preprocess(
    O, DO, Delta,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_dob, stride_doh, stride_dos, stride_dod,
    H, S, BH,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # -- which rows: block start_q of head off_h in batch off_b (every block the same work); BH = B·H
    start_q, off_bh = _schedule(S, BH, BLOCK_Q, False)
    off_b = off_bh // H
    off_h = off_bh % H
    offs_q = start_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_q[:, None] < S) & (offs_d[None, :] < HEAD_DIM)
    o_base = O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
    do_base = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh

    # -- D = rowsum(dO ∘ O) in fp32 (upcast first: 16-bit elementwise math loses bits, and
    #    the interpreter's bf16 arithmetic is wrong)
    o = tl.load(o_base + offs_q[:, None] * stride_os + offs_d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(do_base + offs_q[:, None] * stride_dos + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)  # (BLOCK_Q,)
    tl.store(Delta + off_bh.to(tl.int64) * S + offs_q, delta, mask=offs_q < S)


@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, k, v, q_group, do_group, L_group, D_group, stride_qh, stride_qs, stride_qd,
    stride_doh, stride_dos, stride_dod,
    offs_kv, offs_d, lo, hi, S, qk_scale,
    HEAD_DIM: tl.constexpr, KV_GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, PAD_D: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    # -- stream query blocks [lo, hi) of each query head g of the group (g, then the block, as counters carried
    #    from step to step): recompute Pᵀ from L, then dV, dPᵀ, dSᵀ, dK. One flat loop, not a loop over g around
    #    the loop over blocks, and no division per step: at D 128 on sm90 (BLOCK_Q 32, BLOCK_KV 64, 4 warps) the
    #    nested loops took 255 registers and spilled 312 B at KV_GROUP 4, a flat loop deriving g by division 16 B;
    #    this one 235 registers, no spill (docs/compile.md)
    n_blocks = tl.cdiv(hi - lo, BLOCK_Q)
    g = 0
    start_m = lo
    for _ in range(0, KV_GROUP * n_blocks):
        offs_q = start_m + tl.arange(0, BLOCK_Q)
        q_base = q_group + g.to(tl.int64) * stride_qh
        do_base = do_group + g.to(tl.int64) * stride_doh
        rows = g.to(tl.int64) * S  # this head's rows of L and Delta
        qT = _load_tile(q_base + offs_q[None, :] * stride_qs + offs_d[:, None] * stride_qd, offs_d, HEAD_DIM,
                        offs_q, S, PAD_D, MASKED)  # (BLOCK_D, BLOCK_Q)
        if UPCAST_DOT:
            qT = qT.to(tl.float32)
        m = _load_row(L_group + rows + offs_q, offs_q, S, MASKED) * LOG2_E  # (BLOCK_Q,) row logsumexp, log2 units

        qkT = tl.dot(k, qT, input_precision=INPUT_PRECISION)  # (BLOCK_KV, BLOCK_Q) fp32
        pT = tl.math.exp2(qkT * qk_scale - m[None, :])
        if MASKED:
            seen = offs_q[None, :] < S
            if CAUSAL:
                seen = seen & (offs_q[None, :] >= offs_kv[:, None])
            pT = tl.where(seen, pT, 0.0)

        do = _load_tile(do_base + offs_q[:, None] * stride_dos + offs_d[None, :] * stride_dod, offs_q, S, offs_d,
                        HEAD_DIM, MASKED, PAD_D)  # (BLOCK_Q, BLOCK_D)
        if UPCAST_DOT:
            do = do.to(tl.float32)
        # dV += Pᵀ dO
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)

        # dPᵀ = V dOᵀ; dSᵀ = Pᵀ ∘ (dPᵀ - D); dK += dSᵀ Q (scale applied once, at the end)
        Di = _load_row(D_group + rows + offs_q, offs_q, S, MASKED)  # (BLOCK_Q,)
        dpT = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)  # (BLOCK_KV, BLOCK_Q) fp32
        dsT = pT * (dpT - Di[None, :])
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=INPUT_PRECISION)
        start_m += BLOCK_Q
        wrap = start_m >= hi
        g += wrap.to(tl.int32)
        start_m = tl.where(wrap, lo, start_m)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, L, Delta, DK, DV,
    sm_scale,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dkb, stride_dkh, stride_dks, stride_dkd,
    stride_dvb, stride_dvh, stride_dvs, stride_dvd,
    H, HKV, S, BH,
    HEAD_DIM: tl.constexpr,
    KV_GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # -- which keys: block start_kv (causal: heaviest first, across heads) of kv head off_hkv in batch off_b;
    #    BH = B·Hkv here
    start_kv, off_bhkv = _schedule(S, BH, BLOCK_KV, False)
    off_b = off_bhkv // HKV
    off_hkv = off_bhkv % HKV
    PAD_D: tl.constexpr = HEAD_DIM != BLOCK_D

    offs_kv = start_kv * BLOCK_KV + tl.arange(0, BLOCK_KV)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_kv[:, None] < S) & (offs_d[None, :] < HEAD_DIM)

    # -- load k, v: they stay in SRAM throughout; (BLOCK_KV, BLOCK_D)
    k_base = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
    v_base = V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
    k = tl.load(k_base + offs_kv[:, None] * stride_ks + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(v_base + offs_kv[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    if UPCAST_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    dk = tl.zeros([BLOCK_KV, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_KV, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2_E

    # -- which queries: causal, queries before this KV block see none of its keys (start at the diagonal);
    #    [lo, diag_end) holds a query before some key of the block (masked), then whole query blocks that
    #    see every key (no mask), then the ragged last query block (masked)
    if CAUSAL:
        lo = start_kv * BLOCK_KV
        if BLOCK_KV >= BLOCK_Q:
            diag_end = tl.minimum(lo + BLOCK_KV, S)
        else:
            diag_end = tl.minimum(lo + BLOCK_Q, S)
    else:
        lo = 0
        diag_end = 0
    full_end = diag_end + (S - diag_end) // BLOCK_Q * BLOCK_Q

    # -- every query head of this kv head's group adds into the same dK, dV: heads off_hkv·KV_GROUP + g
    off_h0 = off_hkv * KV_GROUP
    q_group = Q + off_b.to(tl.int64) * stride_qb + off_h0.to(tl.int64) * stride_qh
    do_group = DO + off_b.to(tl.int64) * stride_dob + off_h0.to(tl.int64) * stride_doh
    row_base = (off_b.to(tl.int64) * H + off_h0) * S  # into L and Delta, (B, H, S) contiguous
    L_group = L + row_base
    D_group = Delta + row_base
    dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_group, do_group, L_group, D_group, stride_qh, stride_qs,
                                  stride_qd, stride_doh, stride_dos, stride_dod, offs_kv, offs_d,
                                  lo, diag_end, S, qk_scale, HEAD_DIM, KV_GROUP, BLOCK_Q, PAD_D, True, CAUSAL,
                                  INPUT_PRECISION, UPCAST_DOT)
    dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_group, do_group, L_group, D_group, stride_qh, stride_qs,
                                  stride_qd, stride_doh, stride_dos, stride_dod, offs_kv, offs_d,
                                  diag_end, full_end, S, qk_scale, HEAD_DIM, KV_GROUP, BLOCK_Q, PAD_D, False,
                                  CAUSAL, INPUT_PRECISION, UPCAST_DOT)
    dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_group, do_group, L_group, D_group, stride_qh, stride_qs,
                                  stride_qd, stride_doh, stride_dos, stride_dod, offs_kv, offs_d,
                                  full_end, S, S, qk_scale, HEAD_DIM, KV_GROUP, BLOCK_Q, PAD_D, True, CAUSAL,
                                  INPUT_PRECISION, UPCAST_DOT)

    # -- epilogue: dK picks up the softmax scale; store both in K's dtype (fp32 when emulating bf16)
    dk = dk * sm_scale
    dk_ptrs = (DK + off_b.to(tl.int64) * stride_dkb + off_hkv.to(tl.int64) * stride_dkh
               + offs_kv[:, None] * stride_dks + offs_d[None, :] * stride_dkd)
    dv_ptrs = (DV + off_b.to(tl.int64) * stride_dvb + off_hkv.to(tl.int64) * stride_dvh
               + offs_kv[:, None] * stride_dvs + offs_d[None, :] * stride_dvd)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, m, Di, kT_base, vT_base, stride_ks, stride_vs,
    offs_q, offs_d, lo, hi, S, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_KV: tl.constexpr, PAD_D: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    # -- stream K, V blocks [lo, hi): recompute P from L, then dP, dS, dQ
    for start_n in range(lo, hi, BLOCK_KV):
        start_n = tl.multiple_of(start_n, BLOCK_KV)
        offs_kv = start_n + tl.arange(0, BLOCK_KV)
        kT = _load_tile(kT_base + offs_kv[None, :] * stride_ks, offs_d, HEAD_DIM, offs_kv, S, PAD_D, MASKED)
        vT = _load_tile(vT_base + offs_kv[None, :] * stride_vs, offs_d, HEAD_DIM, offs_kv, S, PAD_D, MASKED)
        if UPCAST_DOT:
            kT = kT.to(tl.float32)
            vT = vT.to(tl.float32)

        s = tl.dot(q, kT, input_precision=INPUT_PRECISION)  # (BLOCK_Q, BLOCK_KV) fp32
        p = tl.math.exp2(s * qk_scale - m[:, None])
        if MASKED:
            p = tl.where(_visible(offs_q, offs_kv, S, CAUSAL), p, 0.0)

        # dP = dO Vᵀ; dS = P ∘ (dP - D); dQ += dS K (scale applied once, at the end)
        dp = tl.dot(do, vT, input_precision=INPUT_PRECISION)  # (BLOCK_Q, BLOCK_KV) fp32
        ds = p * (dp - Di[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, L, Delta, DQ,
    sm_scale,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,
    H, S, BH,
    HEAD_DIM: tl.constexpr,
    KV_GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # -- which queries: block start_q (causal: heaviest first, across heads) of head off_h in batch off_b;
    #    the kv head it reads. BH = B·H
    start_q, off_bh = _schedule(S, BH, BLOCK_Q, CAUSAL)
    off_b = off_bh // H
    off_h = off_bh % H
    kv_head = off_h // KV_GROUP
    PAD_D: tl.constexpr = HEAD_DIM != BLOCK_D

    offs_q = start_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_q[:, None] < S) & (offs_d[None, :] < HEAD_DIM)
    q_base = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    do_base = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
    kT_base = K + off_b.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh + offs_d[:, None] * stride_kd
    vT_base = V + off_b.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh + offs_d[:, None] * stride_vd
    row_base = off_bh.to(tl.int64) * S

    # -- load q, dO, L, D for this block: they stay in SRAM throughout
    q = tl.load(q_base + offs_q[:, None] * stride_qs + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
    do = tl.load(do_base + offs_q[:, None] * stride_dos + offs_d[None, :] * stride_dod, mask=q_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    m = tl.load(L + row_base + offs_q, mask=offs_q < S, other=0.0) * LOG2_E  # (BLOCK_Q,) logsumexp, log2 units
    Di = tl.load(Delta + row_base + offs_q, mask=offs_q < S, other=0.0)  # (BLOCK_Q,)

    dq = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2_E

    # -- the forward's split: unmasked KV blocks below the diagonal, then the diagonal (or ragged tail) masked
    diag_lo, hi = _kv_split(start_q, S, BLOCK_Q, BLOCK_KV, CAUSAL)
    dq = _attn_bwd_dq_inner(dq, q, do, m, Di, kT_base, vT_base, stride_ks, stride_vs, offs_q, offs_d,
                            0, diag_lo, S, qk_scale, HEAD_DIM, BLOCK_KV, PAD_D, False, CAUSAL,
                            INPUT_PRECISION, UPCAST_DOT)
    dq = _attn_bwd_dq_inner(dq, q, do, m, Di, kT_base, vT_base, stride_ks, stride_vs, offs_q, offs_d,
                            diag_lo, hi, S, qk_scale, HEAD_DIM, BLOCK_KV, PAD_D, True, CAUSAL,
                            INPUT_PRECISION, UPCAST_DOT)

    # -- epilogue: dQ picks up the softmax scale; store in Q's dtype (fp32 when emulating bf16)
    dq = dq * sm_scale
    dq_ptrs = (DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
               + offs_q[:, None] * stride_dqs + offs_d[None, :] * stride_dqd)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=q_mask)


# --- registers: what a program's tiles hold per thread --------------------------------------
# Through one step of its loop each kernel holds, per thread: its fp32 accumulators (forward: O; dK/dV: dK and dV;
# dQ: dQ) and the step's fp32 score tiles (forward: S; dK/dV: Sᵀ and dPᵀ; dQ: S and dP); at the operand width, the
# tiles it feeds a dot from registers (forward: P; dK/dV: Pᵀ and dSᵀ; dQ: dS) and the ones it loads once and keeps
# (forward: Q; dK/dV: K and V; dQ: Q and dO). tile_words counts them in 32-bit words. Against the counters
# (`posttrainllm compile`, sm90, 2026-12-02; the table in docs/compile.md):
# - tensor cores (wgmma): every tile of at most 256 words compiled without spilling at 2 stages, at bf16 (D 32 and
#   128) and at tf32 D 32 but one (the forward 128x64 on 4 warps at tf32, D 32: 192 words, 32 B; at 3 stages dK/dV
#   32x128 on 8 warps, 240 words, 24 B); every one of 288 and more at bf16 spilled (the forward 128x64 on 4 warps
#   at D 128: 288 words, 232 B; dK/dV 64x64 on 4 warps: 288, 128 B);
# - fp32 `ieee` dots (FMA code, D 32): at most 96 words spilled at most 24 B (dQ 64x32 on 4 warps and 128x32 on 8,
#   none; the forward 64x64 on 4 warps, 24 B), 128 and more up to 7.8 KB (every dK/dV candidate).
REGISTER_BUDGET = {"tensor_cores": 256, "fma": 96}  # 32-bit words of tiles per thread
WGMMA_ROWS = 64  # wgmma's M: a warpgroup (4 warps) takes 64 rows; more warps than 64-row groups split the columns
# and hold every row's operands again, so tile_words counts only 4 warps per 64 rows (measured at tf32, D 128: dK/dV
# 32x64 spills 224 B on 4 warps, 352 B on 8; dQ 64x64 none on 4, 32 B on 8)


def uses_tensor_cores(dtype: torch.dtype, input_precision: str) -> bool:
    """Whether the kernels' dots run on tensor cores: 16-bit operands, or fp32 ones at tf32 (`ieee` fp32 is FMA)."""
    return dtype in (torch.float16, torch.bfloat16) or input_precision == "tf32"


def tile_words(kernel: str, block_q: int, block_kv: int, block_d: int, num_warps: int, operand_bytes: int) -> int:
    """32-bit words per thread of the tiles `kernel` ("forward", "dkdv", "dq") holds through a step (above)."""
    q, kv, d = block_q, block_kv, block_d
    rows = kv if kernel == "dkdv" else q
    warps = min(num_warps, 4 * max(1, rows // WGMMA_ROWS))  # past 4 per 64 rows, warps split columns only
    fp32, operands = {"forward": (q * d + q * kv, q * kv + q * d), "dkdv": (2 * kv * d + 2 * kv * q,
                                                                             2 * kv * q + 2 * kv * d),
                      "dq": (q * d + 2 * q * kv, q * kv + 2 * q * d)}[kernel]
    return (fp32 + operands * operand_bytes // 4) // (32 * warps)


def register_budget(tensor_cores: bool) -> int:
    return REGISTER_BUDGET["tensor_cores" if tensor_cores else "fma"]


def _check_block(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= 16")


MAX_GRID_X = 2**31 - 1  # CUDA: programs along grid axis 0
MAX_GRID_Y = 65535  # along axis 1


def launch_grid(blocks: int, bh: int) -> list[int]:
    """The grid of `blocks` blocks of S for each of `bh` (batch, head) pairs; the kernels read their
    (block, pair) from the launch rank, not the axes (_schedule), so the shape is free: (blocks, bh) as a
    receipt reads it, or (blocks·bh, 1) when bh passes axis 1's limit."""
    total = blocks * bh
    if total > MAX_GRID_X:
        raise ValueError(f"{blocks} blocks x {bh} (batch, head) pairs = {total} programs exceed CUDA's {MAX_GRID_X}")
    return [blocks, bh] if bh <= MAX_GRID_Y else [total, 1]


def attention_launch(
    B: int, H: int, S: int, D: int, *, block_q: int, block_kv: int, num_warps: int, num_stages: int,
) -> dict:
    """Dispatch geometry: one program per (query block, batch * head); causal blocks run heaviest first,
    across every head (_schedule)."""
    for name, size in (("B", B), ("H", H), ("S", S), ("D", D)):
        if size < 1:
            raise ValueError(f"{name}={size} must be >= 1")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head dim D={D} exceeds {MAX_HEAD_DIM}")
    _check_block("block_q", block_q)
    _check_block("block_kv", block_kv)
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps={num_warps} must be a power of two")
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    return {
        "grid": launch_grid(triton.cdiv(S, block_q), B * H),
        "block_q": block_q, "block_kv": block_kv,
        "block_d": padded_head_dim(D),  # tl.dot needs K >= 16
        "num_warps": num_warps, "num_stages": num_stages,
    }


def backward_blocks(block_q: int, block_kv: int, dkdv_block_q: int | None = None, dkdv_block_kv: int | None = None,
                    dq_block_q: int | None = None, dq_block_kv: int | None = None) -> dict[str, int]:
    """The backward kernels' own block sizes; each one not given is the forward's."""
    return {"dkdv_block_q": dkdv_block_q or block_q, "dkdv_block_kv": dkdv_block_kv or block_kv,
            "dq_block_q": dq_block_q or block_q, "dq_block_kv": dq_block_kv or block_kv}


def attention_backward_launch(
    B: int, H: int, Hkv: int, S: int, D: int, *, block_q: int, block_kv: int, num_warps: int, num_stages: int,
    dkdv_block_q: int | None = None, dkdv_block_kv: int | None = None,
    dq_block_q: int | None = None, dq_block_kv: int | None = None,
) -> dict:
    """Backward dispatch geometry: three launches, no atomics; each kernel with its own blocks
    (the forward's block_q, block_kv where not given).

    preprocess: one program per (dq query block, batch * head) computes D = rowsum(dO ∘ O);
    dkdv: one per (KV block, batch * kv head), sweeping the H // Hkv query heads of its group;
    dq: one per (query block, batch * head), sweeping the KV blocks. Causal dkdv and dq programs run
    heaviest first across every head (_schedule).
    """
    blocks = backward_blocks(block_q, block_kv, dkdv_block_q, dkdv_block_kv, dq_block_q, dq_block_kv)
    fwd = attention_launch(B, H, S, D, block_q=block_q, block_kv=block_kv, num_warps=num_warps,
                           num_stages=num_stages)
    for name, block in blocks.items():
        _check_block(name, block)
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"H={H} query heads is not a multiple of Hkv={Hkv} kv heads")
    return {
        "preprocess_grid": launch_grid(triton.cdiv(S, blocks["dq_block_q"]), B * H),
        "dkdv_grid": launch_grid(triton.cdiv(S, blocks["dkdv_block_kv"]), B * Hkv),
        "dq_grid": launch_grid(triton.cdiv(S, blocks["dq_block_q"]), B * H),
        "kv_group": H // Hkv,
        **blocks, "block_d": fwd["block_d"],
        "num_warps": num_warps, "num_stages": num_stages,
    }


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, input_precision: str,
                  sm_scale: float | None) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            "expected 4-D q (B, H, S, D), k and v (B, Hkv, S, D); "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    (B, H, S, D), (Bk, Hkv, Sk, Dk) = q.shape, k.shape
    if Bk != B:
        raise ValueError(f"batch mismatch: q has B={B}, k/v have B={Bk}")
    if Sk != S:
        raise ValueError(f"sequence mismatch: q has S={S}, k/v have S={Sk}")
    if Dk != D:
        raise ValueError(f"head dim mismatch: q has D={D}, k/v have D={Dk}")
    if H % Hkv:
        raise ValueError(f"H={H} query heads is not a multiple of Hkv={Hkv} kv heads")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {q.dtype} not supported; choose one of {SUPPORTED_DTYPES}")
    if not q.device == k.device == v.device:
        raise ValueError(f"device mismatch: q {q.device}, k {k.device}, v {v.device}")
    if input_precision not in INPUT_PRECISIONS:
        raise ValueError(f"input_precision={input_precision!r}; choose one of {INPUT_PRECISIONS}")
    if sm_scale is not None and not sm_scale > 0:
        raise ValueError(f"sm_scale={sm_scale} must be > 0 (the running max is taken before scaling)")
    for name, t in (("q", q), ("k", k), ("v", v)):  # offsets inside one (batch, head) are 32-bit
        if (S - 1) * abs(t.stride(2)) + (D - 1) * abs(t.stride(3)) >= 2 ** 31:
            raise ValueError(f"{name}: one (batch, head) slice spans >= 2^31 elements; make it contiguous per head")


# --- autotuning (tile=auto / workgroup=auto): CUDA only ---------------------------------------
# Shared by every op's tuned launcher (ops/autotune.py): the shared memory candidates are pruned by (the device's,
# or a compile target's), the tuner's choice, and AUTO_CPU_NOTE where no autotuner runs.
# triton.autotune(configs, key, prune_configs_by=None, reset_to_zero=None, restore_value=None, ...): a config that
# overflows shared memory or registers raises OutOfResources / PTXASError inside its benchmark, which the autotuner
# scores as inf. Every tuned kernel writes its outputs with plain stores (no atomics, no accumulation into an
# input), so re-running it while benchmarking needs no reset_to_zero / restore_value.

# forward / dQ: tall query blocks; dK/dV: a tall KV block against short query steps
FWD_SPACE = [(64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8)]  # (block_q, block_kv, warps)
DKDV_SPACE = [(32, 64, 4), (32, 128, 4), (32, 128, 8), (64, 64, 4), (64, 128, 8)]
DQ_SPACE = [(64, 32, 4), (64, 64, 4), (128, 32, 4), (128, 32, 8), (128, 64, 8)]
STAGES = (2, 3)


STREAMED = {"forward": 1, "dkdv": 0, "dq": 1}  # the block a kernel steps through (its index in an entry)


def fitting_space(kernel: str, space, block_d: int, itemsize: int, tensor_cores: bool, shrink: bool):
    """The (block_q, block_kv, warps) of `space` whose tiles fit the register budget (tile_words, REGISTER_BUDGET),
    in the space's order. Where fewer than two fit (tile=auto, `shrink`), the cheapest of the others are added, each
    with its streamed block (the one the kernel steps through, never the rows it owns) halved, down to 16, until it
    fits, or as it is where none fits (the compile report shows what it spills). workgroup=auto (no `shrink`: its
    blocks are the point's) keeps at least its cheapest warp count. Each entry is a candidate per stage count."""
    budget = register_budget(tensor_cores)

    def words(entry):
        return tile_words(kernel, entry[0], entry[1], block_d, entry[2], itemsize)

    kept = [entry for entry in space if words(entry) <= budget]
    for entry in sorted(space, key=words):  # stable: the space's order among equal counts
        if len(kept) >= (2 if shrink else 1):
            break
        if entry in kept:
            continue
        smaller = list(entry)
        while shrink and words(smaller) > budget and smaller[STREAMED[kernel]] > 16:
            smaller[STREAMED[kernel]] //= 2
        smaller = tuple(smaller) if words(smaller) <= budget else entry
        if smaller not in kept:
            kept.append(smaller)
    return kept


def _configs(kernel: str, space, stages, smem: int, block_d: int, itemsize: int, tensor_cores: bool,
             shrink: bool):
    """triton.Config per (block_q, block_kv, warps) of the space that fits the registers (fitting_space) × stages,
    where it fits `smem` bytes."""
    out = []
    for bq, bkv, warps in fitting_space(kernel, space, block_d, itemsize, tensor_cores, shrink):
        for st in stages:
            if attention_smem_bytes(bq, bkv, block_d, st, itemsize) <= smem:
                out.append(triton.Config({"BLOCK_Q": bq, "BLOCK_KV": bkv}, num_warps=warps, num_stages=st))
    return out


_TUNERS: dict = {}
# The problem size is in the key (S, and BH: the (batch, head) pairs the grid covers), so each sequence length
# and batch·heads of a curve is tuned at its own size, not given the configuration tuned at the first size run.
TUNE_KEY = ["S", "BH", "HEAD_DIM", "CAUSAL", "KV_GROUP"]


TUNED = {"_attn_fwd_kernel": "forward", "_attn_bwd_dkdv": "dkdv", "_attn_bwd_dq": "dq"}  # kernel -> tile_words'


def _tuner(kernel, space, smem: int, block_d: int, itemsize: int, tensor_cores: bool, tune_tiles: bool,
           stages=STAGES):
    """An autotuned wrapper of `kernel` over `space`, built once per (kernel, device limits, dtype size, dot, mode)."""
    name = kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__
    key = (name, tuple(space), smem, block_d, itemsize, tensor_cores, tune_tiles, tuple(stages))
    if key not in _TUNERS:
        configs = _configs(TUNED[name], space, stages, smem, block_d, itemsize, tensor_cores, tune_tiles)
        if not configs:
            raise ValueError(f"no autotune configuration fits {smem} B of shared memory at block_d={block_d}")
        _TUNERS[key] = triton.autotune(configs=configs, key=TUNE_KEY)(kernel)
    return _TUNERS[key]


def _space(fixed: tuple[int, int, int], tune_tiles: bool, space):
    """The autotune space: every (block_q, block_kv, warps) when tiles are tuned, else the fixed blocks
    with each warp count (workgroup=auto alone tunes warps and stages only)."""
    if tune_tiles:
        return space
    return [(fixed[0], fixed[1], warps) for warps in (4, 8)]


LAST_AUTOTUNE: dict[str, dict] = {}  # kernel -> the configuration the autotuner chose at its last launch


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    block_q: int = 64,
    block_kv: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    input_precision: str = "ieee",
    emulate_bf16: bool | None = None,
    autotune: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q Kᵀ · scale + mask) · V -> (o (B, H, S, D) in q's dtype, lse (B, H, S) fp32).

    scale defaults to 1/sqrt(D) and must be > 0. input_precision is tl.dot's ("ieee" or "tf32";
    16-bit inputs ignore it). emulate_bf16: None = upcast bf16 dot operands only under the
    interpreter; False/True force it off/on. autotune: None = the given blocks, warps and stages;
    "tile" = autotune blocks, warps and stages jointly; "workgroup" = warps and stages at the given
    blocks. On CUDA only: elsewhere the given configuration runs (see ops/autotune.py AUTO_CPU_NOTE).
    """
    _check_inputs(q, k, v, input_precision, sm_scale)
    (B, H, S, D), Hkv = q.shape, k.shape[1]
    tensor_cores = uses_tensor_cores(q.dtype, input_precision)
    launch = attention_launch(
        B, H, S, D, block_q=block_q, block_kv=block_kv, num_warps=num_warps, num_stages=num_stages
    )
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    upcast = use_bf16_emulation(q.dtype, emulate_bf16)
    o = torch.empty((B, H, S, D), device=q.device, dtype=torch.float32 if upcast else q.dtype)
    lse = torch.empty((B, H, S), device=q.device, dtype=torch.float32)
    args = (q, k, v, o, lse, scale, *q.stride(), *k.stride(), *v.stride(), *o.stride(), H, S, B * H)
    meta = dict(HEAD_DIM=D, KV_GROUP=H // Hkv, BLOCK_D=launch["block_d"], CAUSAL=bool(causal),
                INPUT_PRECISION=input_precision, UPCAST_DOT=upcast)
    smem = autotune_smem(q) if autotune else None
    if smem is not None:
        tuner = _tuner(_attn_fwd_kernel, _space((block_q, block_kv, num_warps), autotune == "tile", FWD_SPACE),
                       smem, launch["block_d"], q.element_size(), tensor_cores, autotune == "tile")
        tuner[lambda m: tuple(launch_grid(triton.cdiv(S, m["BLOCK_Q"]), B * H))](*args, **meta)
        LAST_AUTOTUNE["forward"] = chosen_config(tuner)
    else:
        _attn_fwd_kernel[tuple(launch["grid"])](*args, **meta, BLOCK_Q=block_q, BLOCK_KV=block_kv,
                                                num_warps=num_warps, num_stages=num_stages)
    return o.to(q.dtype), lse


def triton_attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    sm_scale: float,
    block_q: int = 64,
    block_kv: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    input_precision: str = "ieee",
    emulate_bf16: bool | None = None,
    dkdv_block_q: int | None = None,
    dkdv_block_kv: int | None = None,
    dq_block_q: int | None = None,
    dq_block_kv: int | None = None,
    autotune: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of triton_attention's o w.r.t. q, k, v, given dO and the forward's o and lse.

    do, o: (B, H, S, D), any strides; lse: (B, H, S) fp32 as the forward returned it.
    dkdv_block_*, dq_block_*: each backward kernel's own blocks (None: the forward's block_q, block_kv).
    Returns dq (B, H, S, D) in q's dtype, dk and dv (B, Hkv, S, D) in k's dtype.
    """
    (B, H, S, D), Hkv = q.shape, k.shape[1]
    if do.shape != o.shape or o.shape != q.shape:
        raise ValueError(f"dO {tuple(do.shape)} and o {tuple(o.shape)} must match q {tuple(q.shape)}")
    if lse.shape != (B, H, S) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be fp32 (B, H, S) = {(B, H, S)}, got {lse.dtype} {tuple(lse.shape)}")
    if input_precision not in INPUT_PRECISIONS:
        raise ValueError(f"input_precision={input_precision!r}; choose one of {INPUT_PRECISIONS}")
    tensor_cores = uses_tensor_cores(q.dtype, input_precision)
    launch = attention_backward_launch(
        B, H, Hkv, S, D, block_q=block_q, block_kv=block_kv, num_warps=num_warps, num_stages=num_stages,
        dkdv_block_q=dkdv_block_q, dkdv_block_kv=dkdv_block_kv, dq_block_q=dq_block_q, dq_block_kv=dq_block_kv,
    )
    upcast = use_bf16_emulation(q.dtype, emulate_bf16)
    grad_dtype = torch.float32 if upcast else q.dtype
    lse = lse.contiguous()  # the kernels index L and D as (B * H, S) rows
    smem = autotune_smem(q) if autotune else None
    tuned = smem is not None
    common = dict(HEAD_DIM=D, KV_GROUP=launch["kv_group"], BLOCK_D=launch["block_d"], CAUSAL=bool(causal),
                  INPUT_PRECISION=input_precision, UPCAST_DOT=upcast)

    # -- D = rowsum(dO ∘ O): (B, H, S) fp32
    delta = torch.empty((B, H, S), device=q.device, dtype=torch.float32)
    _attn_bwd_preprocess[tuple(launch["preprocess_grid"])](
        o, do, delta,
        *o.stride(), *do.stride(),
        H, S, B * H,
        HEAD_DIM=D, BLOCK_Q=launch["dq_block_q"], BLOCK_D=launch["block_d"],
        num_warps=num_warps, num_stages=num_stages,
    )

    # -- dK, dV: (B, Hkv, S, D), one program per KV block
    dk = torch.empty((B, Hkv, S, D), device=q.device, dtype=grad_dtype)
    dv = torch.empty((B, Hkv, S, D), device=q.device, dtype=grad_dtype)
    args = (q, k, v, do, lse, delta, dk, dv, sm_scale,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), H, Hkv, S, B * Hkv)
    if tuned:
        fixed = (launch["dkdv_block_q"], launch["dkdv_block_kv"], num_warps)
        tuner = _tuner(_attn_bwd_dkdv, _space(fixed, autotune == "tile", DKDV_SPACE), smem, launch["block_d"],
                       q.element_size(), tensor_cores, autotune == "tile")
        tuner[lambda m: tuple(launch_grid(triton.cdiv(S, m["BLOCK_KV"]), B * Hkv))](*args, **common)
        LAST_AUTOTUNE["dkdv"] = chosen_config(tuner)
    else:
        _attn_bwd_dkdv[tuple(launch["dkdv_grid"])](*args, **common, BLOCK_Q=launch["dkdv_block_q"],
                                                   BLOCK_KV=launch["dkdv_block_kv"], num_warps=num_warps,
                                                   num_stages=num_stages)

    # -- dQ: (B, H, S, D), one program per query block
    dq = torch.empty((B, H, S, D), device=q.device, dtype=grad_dtype)
    args = (q, k, v, do, lse, delta, dq, sm_scale,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), H, S, B * H)
    if tuned:
        fixed = (launch["dq_block_q"], launch["dq_block_kv"], num_warps)
        tuner = _tuner(_attn_bwd_dq, _space(fixed, autotune == "tile", DQ_SPACE), smem, launch["block_d"],
                       q.element_size(), tensor_cores, autotune == "tile")
        tuner[lambda m: tuple(launch_grid(triton.cdiv(S, m["BLOCK_Q"]), B * H))](*args, **common)
        LAST_AUTOTUNE["dq"] = chosen_config(tuner)
    else:
        _attn_bwd_dq[tuple(launch["dq_grid"])](*args, **common, BLOCK_Q=launch["dq_block_q"],
                                               BLOCK_KV=launch["dq_block_kv"], num_warps=num_warps,
                                               num_stages=num_stages)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class TritonAttention(torch.autograd.Function):
    """(o, lse) = flash attention(q, k, v); saves q, k, v, o and the row logsumexp for the backward.

    lse is a by-product of the forward (the kernel writes it anyway) and is not differentiable.
    `params` holds the launch choices (causal, sm_scale, blocks, warps, stages, precision, autotune).
    """

    @staticmethod
    def forward(ctx, q, k, v, params):
        forward = {key: params[key] for key in ("causal", "sm_scale", "block_q", "block_kv", "num_warps",
                                                "num_stages", "input_precision", "autotune")}
        o, lse = triton_attention(q, k, v, **forward)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mark_non_differentiable(lse)
        ctx.params = {**params, "causal": bool(params["causal"]),
                      "sm_scale": 1.0 / math.sqrt(q.shape[-1]) if params["sm_scale"] is None
                      else float(params["sm_scale"])}
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = triton_attention_backward(do, q, k, v, o, lse, **ctx.params)
        return dq, dk, dv, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any) -> torch.Tensor:
    """Differentiable softmax(Q Kᵀ · scale + mask) · V -> o (B, H, S, D) in q's dtype.

    `options` are flash_attention_with_lse's keywords (the same as triton_attention's; the backward
    kernels take their own blocks, dkdv_block_* and dq_block_*, None: the forward's, and share warps
    and stages). q (B, H, S, D), k and v (B, Hkv, S, D) with H % Hkv == 0.
    """
    return flash_attention_with_lse(q, k, v, **options)[0]


def flash_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    block_q: int = 64,
    block_kv: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    input_precision: str = "ieee",
    dkdv_block_q: int | None = None,
    dkdv_block_kv: int | None = None,
    dq_block_q: int | None = None,
    dq_block_kv: int | None = None,
    autotune: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attention, also returning the row logsumexp (B, H, S) fp32 that one forward launch writes."""
    params = dict(causal=causal, sm_scale=sm_scale, block_q=block_q, block_kv=block_kv, num_warps=num_warps,
                  num_stages=num_stages, input_precision=input_precision, dkdv_block_q=dkdv_block_q,
                  dkdv_block_kv=dkdv_block_kv, dq_block_q=dq_block_q, dq_block_kv=dq_block_kv, autotune=autotune)
    return TritonAttention.apply(q, k, v, params)
