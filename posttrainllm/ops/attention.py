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

Shapes: q (B, H, S, D), k and v (B, Hkv, S, D) -> o (B, H, S, D), lse (B, H, S).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

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
