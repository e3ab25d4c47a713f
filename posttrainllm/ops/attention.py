"""Fused attention forward, FlashAttention-2 style (Dao 2023; Triton's fused-attention tutorial).

One program owns a block of BLOCK_Q queries of one (batch, head). It loads that Q
block once, then streams K and V in BLOCK_KV blocks and keeps the softmax online
(Milakov & Gimelshein 2018): a running row max m_i, a running row sum l_i, and an
fp32 accumulator that is rescaled by exp(m_old - m_new) whenever the max grows.
The (S, S) score matrix never exists in memory. Softmax runs in base 2 with
log2(e) folded into the scale; the saved row logsumexp L = m + log(l) is converted
back to natural-log units for the backward pass.

Causal: query i sees keys j <= i, so a query block stops at the diagonal.
GQA / MQA: K and V carry Hkv heads; query head h reads kv head h // (H // Hkv).

bf16 under Triton's interpreter: see posttrainllm.ops.matmul; with UPCAST_DOT the
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

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from posttrainllm.ops import use_bf16_emulation

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INPUT_PRECISIONS = ("ieee", "tf32")
MAX_HEAD_DIM = 256
LOG2_E = tl.constexpr(1.4426950408889634)  # exp(x) == exp2(x * log2(e))
LN_2 = tl.constexpr(0.6931471805599453)  # log(x) == log2(x) * ln(2)


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, L,
    sm_scale,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    H, S, HEAD_DIM,
    KV_GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # -- which queries: block start_q of head off_h in batch off_b; its kv head
    start_q = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    off_hkv = off_h // KV_GROUP

    offs_q = start_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_q[:, None] * stride_qs + offs_d[None, :] * stride_qd
    kT_base = K + off_b * stride_kb + off_hkv * stride_kh + offs_d[:, None] * stride_kd  # (BLOCK_D, 1)
    v_base = V + off_b * stride_vb + off_hkv * stride_vh + offs_d[None, :] * stride_vd  # (1, BLOCK_D)

    # -- load q: it stays in SRAM throughout
    q = tl.load(q_ptrs, mask=(offs_q[:, None] < S) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # -- online-softmax state, fp32, scores in log2 units
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2_E

    # -- causal: keys past this block's last query are never seen, stop at the diagonal
    if CAUSAL:
        hi = tl.minimum((start_q + 1) * BLOCK_Q, S)
    else:
        hi = S

    # -- stream K, V blocks: scores, new max, rescale, accumulate
    for start_kv in range(0, hi, BLOCK_KV):
        start_kv = tl.multiple_of(start_kv, BLOCK_KV)
        offs_kv = start_kv + tl.arange(0, BLOCK_KV)
        kT = tl.load(kT_base + offs_kv[None, :] * stride_ks,
                     mask=(offs_d[:, None] < HEAD_DIM) & (offs_kv[None, :] < S), other=0.0)
        if UPCAST_DOT:
            kT = kT.to(tl.float32)
        qk = tl.dot(q, kT, input_precision=INPUT_PRECISION)  # (BLOCK_Q, BLOCK_KV) fp32
        qk = qk * qk_scale
        visible = offs_kv[None, :] < S
        if CAUSAL:
            visible = visible & (offs_q[:, None] >= offs_kv[None, :])
        qk = tl.where(visible, qk, float("-inf"))

        # key 0 is visible to every row, so m_new is finite from the first block on
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]

        v = tl.load(v_base + offs_kv[:, None] * stride_vs,
                    mask=(offs_kv[:, None] < S) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        if UPCAST_DOT:
            v = v.to(tl.float32)
        else:
            p = p.to(v.dtype)
        acc = tl.dot(p, v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new

    # -- epilogue: normalise, save O and the natural-log row logsumexp
    o = acc / l_i[:, None]
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh + offs_q[:, None] * stride_os + offs_d[None, :] * stride_od
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=(offs_q[:, None] < S) & (offs_d[None, :] < HEAD_DIM))
    lse = (m_i + tl.math.log2(l_i)) * LN_2  # log2 units -> natural log
    tl.store(L + off_bh * S + offs_q, lse, mask=offs_q < S)


# --- backward ------------------------------------------------------------------------------
# dK/dV and dQ come from two kernels rather than one kernel with atomic adds into dQ: each
# output element then has exactly one writer, so the gradients are deterministic (fp32
# atomics land in whatever order the hardware picks). Triton's interpreter runs programs one
# after another, so a race between programs would never show in CPU tests; with no shared
# writes there is none to hide. The price is recomputing QKᵀ and dO Vᵀ once more for dQ.


@triton.jit
def _attn_bwd_preprocess(
    O, DO, Delta,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_dob, stride_doh, stride_dos, stride_dod,
    H, S, HEAD_DIM,
    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # -- which rows: block start_q of head off_h in batch off_b
    start_q = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    offs_q = start_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_q[:, None] < S) & (offs_d[None, :] < HEAD_DIM)

    # -- D = rowsum(dO ∘ O) in fp32 (upcast first: 16-bit elementwise math loses bits, and
    #    the interpreter's bf16 arithmetic is wrong)
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + offs_q[:, None] * stride_os + offs_d[None, :] * stride_od,
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_q[:, None] * stride_dos
                 + offs_d[None, :] * stride_dod, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)  # (BLOCK_Q,)
    tl.store(Delta + off_bh * S + offs_q, delta, mask=offs_q < S)


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
    H, HKV, S, HEAD_DIM,
    KV_GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # -- which keys: block start_kv of kv head off_hkv in batch off_b
    start_kv = tl.program_id(0)
    off_bhkv = tl.program_id(1)
    off_b = off_bhkv // HKV
    off_hkv = off_bhkv % HKV

    offs_kv = start_kv * BLOCK_KV + tl.arange(0, BLOCK_KV)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_kv[:, None] < S) & (offs_d[None, :] < HEAD_DIM)

    # -- load k, v: they stay in SRAM throughout; (BLOCK_KV, BLOCK_D)
    k = tl.load(K + off_b * stride_kb + off_hkv * stride_kh + offs_kv[:, None] * stride_ks
                + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(V + off_b * stride_vb + off_hkv * stride_vh + offs_kv[:, None] * stride_vs
                + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    if UPCAST_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    dk = tl.zeros([BLOCK_KV, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_KV, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2_E

    # -- causal: queries before this KV block see none of its keys, start at the diagonal
    if CAUSAL:
        lo = start_kv * BLOCK_KV
    else:
        lo = 0

    # -- every query head of this kv head's group adds into the same dK, dV
    for g in range(KV_GROUP):
        off_h = off_hkv * KV_GROUP + g
        q_base = Q + off_b * stride_qb + off_h * stride_qh
        do_base = DO + off_b * stride_dob + off_h * stride_doh
        row_base = (off_b * H + off_h) * S  # into L and Delta, (B, H, S) contiguous

        # -- stream query blocks: recompute Pᵀ from L, then dV, dPᵀ, dSᵀ, dK
        for start_m in range(lo, S, BLOCK_Q):
            offs_q = start_m + tl.arange(0, BLOCK_Q)
            qT = tl.load(q_base + offs_q[None, :] * stride_qs + offs_d[:, None] * stride_qd,
                         mask=(offs_d[:, None] < HEAD_DIM) & (offs_q[None, :] < S), other=0.0)  # (BLOCK_D, BLOCK_Q)
            if UPCAST_DOT:
                qT = qT.to(tl.float32)
            lse = tl.load(L + row_base + offs_q, mask=offs_q < S, other=0.0)  # (BLOCK_Q,) natural log

            qkT = tl.dot(k, qT, input_precision=INPUT_PRECISION)  # (BLOCK_KV, BLOCK_Q) fp32
            pT = tl.math.exp2(qkT * qk_scale - lse[None, :] * LOG2_E)
            seen = offs_q[None, :] < S
            if CAUSAL:
                seen = seen & (offs_q[None, :] >= offs_kv[:, None])
            pT = tl.where(seen, pT, 0.0)

            do = tl.load(do_base + offs_q[:, None] * stride_dos + offs_d[None, :] * stride_dod,
                         mask=(offs_q[:, None] < S) & (offs_d[None, :] < HEAD_DIM), other=0.0)  # (BLOCK_Q, BLOCK_D)
            if UPCAST_DOT:
                do = do.to(tl.float32)
            # dV += Pᵀ dO
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)

            # dPᵀ = V dOᵀ; dSᵀ = Pᵀ ∘ (dPᵀ - D); dK += dSᵀ Q (scale applied once, at the end)
            Di = tl.load(Delta + row_base + offs_q, mask=offs_q < S, other=0.0)  # (BLOCK_Q,)
            dpT = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)  # (BLOCK_KV, BLOCK_Q) fp32
            dsT = pT * (dpT - Di[None, :])
            dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=INPUT_PRECISION)

    # -- epilogue: dK picks up the softmax scale; store both in K's dtype (fp32 when emulating bf16)
    dk = dk * sm_scale
    dk_ptrs = (DK + off_b * stride_dkb + off_hkv * stride_dkh
               + offs_kv[:, None] * stride_dks + offs_d[None, :] * stride_dkd)
    dv_ptrs = (DV + off_b * stride_dvb + off_hkv * stride_dvh
               + offs_kv[:, None] * stride_dvs + offs_d[None, :] * stride_dvd)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, L, Delta, DQ,
    sm_scale,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_dob, stride_doh, stride_dos, stride_dod,
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,
    H, S, HEAD_DIM,
    KV_GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # -- which queries: block start_q of head off_h in batch off_b; the kv head it reads
    start_q = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_h = off_bh % H
    kv_head = off_h // KV_GROUP

    offs_q = start_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_q[:, None] < S) & (offs_d[None, :] < HEAD_DIM)
    kT_base = K + off_b * stride_kb + kv_head * stride_kh + offs_d[:, None] * stride_kd  # (BLOCK_D, 1)
    vT_base = V + off_b * stride_vb + kv_head * stride_vh + offs_d[:, None] * stride_vd  # (BLOCK_D, 1)

    # -- load q, dO, L, D for this block: they stay in SRAM throughout
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + offs_q[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=q_mask, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_q[:, None] * stride_dos
                 + offs_d[None, :] * stride_dod, mask=q_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(L + off_bh * S + offs_q, mask=offs_q < S, other=0.0)  # (BLOCK_Q,) natural log
    Di = tl.load(Delta + off_bh * S + offs_q, mask=offs_q < S, other=0.0)  # (BLOCK_Q,)

    dq = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2_E

    # -- causal: keys past this block's last query contribute nothing, stop at the diagonal
    if CAUSAL:
        kv_end = tl.minimum((start_q + 1) * BLOCK_Q, S)
    else:
        kv_end = S

    # -- stream K, V blocks: recompute P from L, then dP, dS, dQ
    for start_n in range(0, kv_end, BLOCK_KV):
        offs_kv = start_n + tl.arange(0, BLOCK_KV)
        kv_mask = (offs_d[:, None] < HEAD_DIM) & (offs_kv[None, :] < S)
        kT = tl.load(kT_base + offs_kv[None, :] * stride_ks, mask=kv_mask, other=0.0)  # (BLOCK_D, BLOCK_KV)
        vT = tl.load(vT_base + offs_kv[None, :] * stride_vs, mask=kv_mask, other=0.0)  # (BLOCK_D, BLOCK_KV)
        if UPCAST_DOT:
            kT = kT.to(tl.float32)
            vT = vT.to(tl.float32)

        s = tl.dot(q, kT, input_precision=INPUT_PRECISION)  # (BLOCK_Q, BLOCK_KV) fp32
        p = tl.math.exp2(s * qk_scale - lse[:, None] * LOG2_E)
        seen = offs_kv[None, :] < S
        if CAUSAL:
            seen = seen & (offs_kv[None, :] <= offs_q[:, None])
        p = tl.where(seen, p, 0.0)

        # dP = dO Vᵀ; dS = P ∘ (dP - D); dQ += dS K (scale applied once, at the end)
        dp = tl.dot(do, vT, input_precision=INPUT_PRECISION)  # (BLOCK_Q, BLOCK_KV) fp32
        ds = p * (dp - Di[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=INPUT_PRECISION)

    # -- epilogue: dQ picks up the softmax scale; store in Q's dtype (fp32 when emulating bf16)
    dq = dq * sm_scale
    dq_ptrs = DQ + off_b * stride_dqb + off_h * stride_dqh + offs_q[:, None] * stride_dqs + offs_d[None, :] * stride_dqd
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=q_mask)


def _check_block(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= 16")


def attention_launch(
    B: int, H: int, S: int, D: int, *, block_q: int, block_kv: int, num_warps: int, num_stages: int,
) -> dict:
    """Dispatch geometry: one program per (query block, batch * head)."""
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
        "grid": [triton.cdiv(S, block_q), B * H],
        "block_q": block_q, "block_kv": block_kv,
        "block_d": max(16, triton.next_power_of_2(D)),  # tl.dot needs K >= 16
        "num_warps": num_warps, "num_stages": num_stages,
    }


def attention_backward_launch(
    B: int, H: int, Hkv: int, S: int, D: int, *, block_q: int, block_kv: int, num_warps: int, num_stages: int,
) -> dict:
    """Backward dispatch geometry: three launches, no atomics.

    preprocess: one program per (query block, batch * head) computes D = rowsum(dO ∘ O);
    dkdv: one per (KV block, batch * kv head), sweeping the H // Hkv query heads of its group;
    dq: one per (query block, batch * head), sweeping the KV blocks.
    """
    fwd = attention_launch(B, H, S, D, block_q=block_q, block_kv=block_kv, num_warps=num_warps,
                           num_stages=num_stages)
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"H={H} query heads is not a multiple of Hkv={Hkv} kv heads")
    return {
        "preprocess_grid": [triton.cdiv(S, block_q), B * H],
        "dkdv_grid": [triton.cdiv(S, block_kv), B * Hkv],
        "dq_grid": [triton.cdiv(S, block_q), B * H],
        "kv_group": H // Hkv,
        "block_q": block_q, "block_kv": block_kv, "block_d": fwd["block_d"],
        "num_warps": num_warps, "num_stages": num_stages,
    }


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q Kᵀ · scale + mask) · V -> (o (B, H, S, D) in q's dtype, lse (B, H, S) fp32).

    scale defaults to 1/sqrt(D). input_precision is tl.dot's ("ieee" or "tf32";
    16-bit inputs ignore it). emulate_bf16: None = upcast bf16 dot operands only
    under the interpreter; False/True force it off/on.
    """
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

    launch = attention_launch(
        B, H, S, D, block_q=block_q, block_kv=block_kv, num_warps=num_warps, num_stages=num_stages
    )
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    upcast = use_bf16_emulation(q.dtype, emulate_bf16)
    o = torch.empty((B, H, S, D), device=q.device, dtype=torch.float32 if upcast else q.dtype)
    lse = torch.empty((B, H, S), device=q.device, dtype=torch.float32)
    _attn_fwd_kernel[tuple(launch["grid"])](
        q, k, v, o, lse,
        scale,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        H, S, D,
        KV_GROUP=H // Hkv,
        BLOCK_Q=block_q, BLOCK_KV=block_kv, BLOCK_D=launch["block_d"],
        CAUSAL=bool(causal),
        INPUT_PRECISION=input_precision,
        UPCAST_DOT=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of triton_attention's o w.r.t. q, k, v, given dO and the forward's o and lse.

    do, o: (B, H, S, D), any strides; lse: (B, H, S) fp32 as the forward returned it.
    Returns dq (B, H, S, D) in q's dtype, dk and dv (B, Hkv, S, D) in k's dtype.
    """
    (B, H, S, D), Hkv = q.shape, k.shape[1]
    if do.shape != o.shape or o.shape != q.shape:
        raise ValueError(f"dO {tuple(do.shape)} and o {tuple(o.shape)} must match q {tuple(q.shape)}")
    if lse.shape != (B, H, S) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be fp32 (B, H, S) = {(B, H, S)}, got {lse.dtype} {tuple(lse.shape)}")
    if input_precision not in INPUT_PRECISIONS:
        raise ValueError(f"input_precision={input_precision!r}; choose one of {INPUT_PRECISIONS}")
    launch = attention_backward_launch(
        B, H, Hkv, S, D, block_q=block_q, block_kv=block_kv, num_warps=num_warps, num_stages=num_stages
    )
    upcast = use_bf16_emulation(q.dtype, emulate_bf16)
    grad_dtype = torch.float32 if upcast else q.dtype
    lse = lse.contiguous()  # the kernels index L and D as (B * H, S) rows
    common = dict(
        KV_GROUP=launch["kv_group"],
        BLOCK_Q=block_q, BLOCK_KV=block_kv, BLOCK_D=launch["block_d"],
        CAUSAL=bool(causal),
        INPUT_PRECISION=input_precision,
        UPCAST_DOT=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )

    # -- D = rowsum(dO ∘ O): (B, H, S) fp32
    delta = torch.empty((B, H, S), device=q.device, dtype=torch.float32)
    _attn_bwd_preprocess[tuple(launch["preprocess_grid"])](
        o, do, delta,
        *o.stride(), *do.stride(),
        H, S, D,
        BLOCK_Q=block_q, BLOCK_D=launch["block_d"],
        num_warps=num_warps, num_stages=num_stages,
    )

    # -- dK, dV: (B, Hkv, S, D), one program per KV block
    dk = torch.empty((B, Hkv, S, D), device=q.device, dtype=grad_dtype)
    dv = torch.empty((B, Hkv, S, D), device=q.device, dtype=grad_dtype)
    _attn_bwd_dkdv[tuple(launch["dkdv_grid"])](
        q, k, v, do, lse, delta, dk, dv,
        sm_scale,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        H, Hkv, S, D,
        **common,
    )

    # -- dQ: (B, H, S, D), one program per query block
    dq = torch.empty((B, H, S, D), device=q.device, dtype=grad_dtype)
    _attn_bwd_dq[tuple(launch["dq_grid"])](
        q, k, v, do, lse, delta, dq,
        sm_scale,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        H, S, D,
        **common,
    )
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class TritonAttention(torch.autograd.Function):
    """(o, lse) = flash attention(q, k, v); saves q, k, v, o and the row logsumexp for the backward.

    lse is a by-product of the forward (the kernel writes it anyway) and is not differentiable.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, block_q, block_kv, num_warps, num_stages, input_precision):
        o, lse = triton_attention(
            q, k, v, causal=causal, sm_scale=sm_scale, block_q=block_q, block_kv=block_kv,
            num_warps=num_warps, num_stages=num_stages, input_precision=input_precision,
        )
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mark_non_differentiable(lse)
        ctx.params = dict(
            causal=bool(causal),
            sm_scale=1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale),
            block_q=block_q, block_kv=block_kv, num_warps=num_warps, num_stages=num_stages,
            input_precision=input_precision,
        )
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = triton_attention_backward(do, q, k, v, o, lse, **ctx.params)
        return dq, dk, dv, None, None, None, None, None, None, None


def flash_attention(
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
) -> torch.Tensor:
    """Differentiable softmax(Q Kᵀ · scale + mask) · V -> o (B, H, S, D) in q's dtype.

    Same arguments as triton_attention; the forward and backward share the tile and
    workgroup choices. q (B, H, S, D), k and v (B, Hkv, S, D) with H % Hkv == 0.
    """
    return flash_attention_with_lse(q, k, v, causal=causal, sm_scale=sm_scale, block_q=block_q, block_kv=block_kv,
                                    num_warps=num_warps, num_stages=num_stages, input_precision=input_precision)[0]


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attention, also returning the row logsumexp (B, H, S) fp32 that one forward launch writes."""
    return TritonAttention.apply(q, k, v, causal, sm_scale, block_q, block_kv, num_warps, num_stages, input_precision)
