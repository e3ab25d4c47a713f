"""Readable reference math: the oracle every optimized path is checked against.

No performance tricks live here. Every function is the textbook formula in eager
PyTorch, run in whatever dtype its inputs have: call it on float64 inputs for the
oracle, or on the point's precision for the plain in-precision baseline.

Shape legend
    B   batch                 M, N, K   matmul sizes: (M, K) @ (K, N) -> (M, N)
    H   query heads           S         sequence length
    Hkv key/value heads       D         head dim
        (H % Hkv == 0; Hkv == H is MHA, 1 < Hkv < H is GQA, Hkv == 1 is MQA)
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """C = A @ B.   a: (M, K), b: (K, N) -> (M, N)."""
    return a @ b


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


# --- a query chunk against a KV cache (decode, speculative verification) ------------------
#     Sq   queries in the chunk (1: one decode step; K+1: a speculative verification)
#     Sk   keys in the cache, the chunk's own included (Sq <= Sk)


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


# --- mixture of experts -----------------------------------------------------------------
# Shape legend (MoE)
#     T   tokens (rows of x)      d   model width       f   expert FFN width
#     E   experts                 k   experts per token (top-k)
# Expert weights are stacked "x @ W" style: w_gate, w_up (E, d, f), w_down (E, f, d).
# The routing is two (T, k) tensors: route_idx (int64 expert ids, best first) and
# route_weight (the renormalised probabilities of those experts).


def moe_router(x: torch.Tensor, w_router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing, in the dtype of its inputs (the model and the lab call it in fp32).

    x: (T, d), w_router: (d, E) -> route_idx (T, k) int64, route_weight (T, k).
    logits = x · W_r; probs = softmax(logits); keep the k largest; weights = probs / Σ_k probs
    (renormalised over the chosen k, as Mixtral does). Tie-break: equal logits go to the lower
    expert index (a stable descending sort), so the rule is written down, not left to topk.
    """
    logits = x @ w_router  # (T, E)
    probs = torch.softmax(logits, dim=-1)  # (T, E)
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices  # (T, E): ties keep index order
    route_idx = order[:, :top_k]  # (T, k)
    chosen = probs.gather(1, route_idx)  # (T, k)
    return route_idx, chosen / chosen.sum(dim=-1, keepdim=True)


def swiglu_expert(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One expert: (silu(x W_gate) * (x W_up)) W_down.   x: (..., d), w_gate/w_up: (d, f), w_down: (f, d)."""
    return swiglu(x @ w_gate, x @ w_up) @ w_down


def moe_dense(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
              route_idx: torch.Tensor, route_weight: torch.Tensor, quantize_h: Any = None) -> torch.Tensor:
    """Every expert on every token, combined by a (T, E) gate that is zero for unchosen experts.

    E x the active FLOPs (the honest dense baseline). x: (T, d) -> (T, d).
    quantize_h(h, routed): what an fp8 chain does to h = silu(x W_gate) · (x W_up) (E, T, f) between its GEMMs,
    given which (expert, token) rows are routed ((E, T) bool); None: nothing (fp8_moe below passes one).
    """
    n_experts = w_gate.shape[0]
    gate = torch.zeros(x.shape[0], n_experts, dtype=route_weight.dtype, device=x.device)  # (T, E)
    gate = gate.scatter(1, route_idx, route_weight)  # (T, E): route_weight where chosen, else 0
    if quantize_h is None:
        expert_out = swiglu_expert(x.unsqueeze(0), w_gate, w_up, w_down)  # (1, T, d) through (E, ...) -> (E, T, d)
    else:
        rows = x.unsqueeze(0)  # (1, T, d)
        routed = torch.zeros(gate.shape, dtype=torch.bool, device=x.device).scatter(1, route_idx, True).t()  # (E, T)
        expert_out = quantize_h(swiglu(rows @ w_gate, rows @ w_up), routed) @ w_down  # (E, T, f) -> (E, T, d)
    return torch.einsum("te,etd->td", gate.to(expert_out.dtype), expert_out)  # (T, d)


def moe_sparse(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
               route_idx: torch.Tensor, route_weight: torch.Tensor) -> torch.Tensor:
    """For each expert: gather its tokens, run it, scatter-add the weighted result. x: (T, d) -> (T, d)."""
    out = torch.zeros_like(x)  # (T, d)
    for e in range(w_gate.shape[0]):
        token, slot = torch.nonzero(route_idx == e, as_tuple=True)  # (n_e,) each: which token, which of its k
        if token.numel() == 0:
            continue
        y = swiglu_expert(x[token], w_gate[e], w_up[e], w_down[e])  # (n_e, d)
        out = out.index_add(0, token, y * route_weight[token, slot, None].to(y.dtype))  # (T, d)
    return out


# --- RMSNorm ----------------------------------------------------------------------------
# Shape legend (RMSNorm)
#     rows  the flattened leading dims (the model's B·T)      C  hidden size, the normalised last dim


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x², last dim) + eps) · weight.   x: (rows, C), weight: (C,) -> (rows, C) in x's dtype.

    Computed in fp32 at least (float64 stays float64: the oracle), rounded to x's dtype once at the end:
    x² of an fp16 value near 1e4 overflows fp16. eps inside the root keeps an all-zero row finite (y = 0).
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    x_up = x.to(dtype)
    rstd = torch.rsqrt(x_up.pow(2).mean(dim=-1, keepdim=True) + eps)  # (rows, 1)
    return (x_up * rstd * weight.to(dtype)).to(x.dtype)  # (rows, C)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """y = exp(x − max(x)) / Σ exp(x − max(x)) along the last dim.   x: (rows, C) -> (rows, C) in x's dtype.

    Computed in fp32 at least (float64 stays float64: the oracle), rounded to x's dtype once at the end. The row
    max is subtracted first: the result is the same function, and exp of a logit of ~1e4 would overflow.
    """
    z = x.to(torch.promote_types(x.dtype, torch.float32))
    z = z - z.amax(dim=-1, keepdim=True)  # (rows, C), every entry <= 0
    e = z.exp()
    return (e / e.sum(dim=-1, keepdim=True)).to(x.dtype)  # (rows, C)


# --- rotary position embedding (RoPE) ---------------------------------------------------
# Shape legend (RoPE)
#     T   positions (rows of a head)      D   head dim (even)
# cos, sin: (T, D/2), the tables of positions [offset, offset + T), pair i rotating at frequency
# theta^(-2i/D) (posttrainllm/model/transformer.py `rope_tables`).


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[..., i], x[..., i + D/2]) by its position's angle: the "rotate half" layout of
    GPT-NeoX and Hugging Face Llama.

        y[..., i]       = x[..., i] · cos[t, i] − x[..., i + D/2] · sin[t, i]
        y[..., i + D/2] = x[..., i] · sin[t, i] + x[..., i + D/2] · cos[t, i]

    x: (B, H, T, D); cos, sin: (T, D/2) -> (B, H, T, D) in x's dtype. Computed in fp32 for 16-bit and fp32
    inputs (as posttrainllm/model/transformer.py `apply_rope`, the model's default), in float64 for float64
    ones (the oracle).
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x.to(compute).chunk(2, dim=-1)  # (B, H, T, D/2) each
    cos, sin = cos.to(compute), sin.to(compute)  # (T, D/2), broadcast over B and H
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)  # (B, H, T, D)


# --- the SwiGLU gate (the dense MLP's, and each MoE expert's) -----------------------------
# Shape legend (SwiGLU)
#     rows   tokens (B·T)          F   the MLP's hidden width (architecture.mlp_hidden)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up, silu(g) = g · sigmoid(g), elementwise.   gate, up: (..., F) -> (..., F).

    In the inputs' dtype, as the model's MLP runs it (a 16-bit run rounds silu(gate), then the product).
    """
    return torch.nn.functional.silu(gate) * up


# --- the lm_head and the cross-entropy (op=cross_entropy) -------------------------------
# Shape legend (cross-entropy)
#     N   tokens (rows of h)      C   model width       V   vocabulary
# h (N, C) the last hidden states, weight (V, C) the lm_head, targets (N,) int64 class ids.


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                         label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of the logits h @ weightᵀ against targets, materialising the (N, V) logits.

    h: (N, C), weight: (V, C), targets: (N,) int64 -> a 0-dim loss in fp32 (float64 for float64 inputs).
    Rows whose target is ignore_index contribute nothing and the mean divides by the count of the others
    (all ignored: 0/0 = NaN, as F.cross_entropy). With smoothing ε the target distribution is
    (1 − ε)·one_hot + ε/V: loss_row = (1 − ε)·(lse − x_y) + ε·(lse − mean_j x_j).
    """
    dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    logits = h.to(dtype) @ weight.to(dtype).t()  # (N, V), the loss's precision whatever h's dtype
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index,
                                             label_smoothing=label_smoothing)


# --- fp8: scaled 8-bit operands (precision=fp8, fp8_rowwise) ----------------------------
# A value x is stored as q = fp8(x / s) with a scale s = amax / FP8_MAX (fp32), so the largest |x| of its group maps
# to ±FP8_MAX and x ≈ q · s. The group is the whole tensor (dim None) or one row / column (dim = the reduced dim).
# Every path of a quantized point sees the same q and s, made once per case by these functions (opdefs/matmul.py).
AMAX_EPS = 1e-12  # an all-zero group's amax: a finite scale (q = 0 then), not 0/0


def fp8_scale(x: torch.Tensor, dim: int | tuple[int, ...] | None = None,
              fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """The dequantization scale s = max(amax|x|, eps) / FP8_MAX, in fp32: x ≈ quantize_fp8(x, s) · s.

    dim None: one scale, a 0-dim tensor. dim=1: one per row of a 2-D x, (M, 1); dim=0: one per column, (1, N);
    the reduced dims kept as 1 (MoE's expert weights (E, d, f): dim=1 one per expert and column, (E, 1, f))."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    return amax.float().clamp_min(AMAX_EPS) / torch.finfo(fp8_dtype).max


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """q = fp8(x / s): in fp32, saturated to ±FP8_MAX (|x| <= amax keeps x / s in range, bar the division's rounding;
    a cast past it would be NaN in e4m3fn), rounded to nearest. x: any shape, s broadcast to it -> x's shape, fp8."""
    fp8_max = torch.finfo(fp8_dtype).max
    return (x.float() * scale.reciprocal()).clamp(-fp8_max, fp8_max).to(fp8_dtype)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q · s in `dtype` (float64: exact, the oracle's; fp32 rounds the product of 4 + 24 significant bits)."""
    return q.to(dtype) * scale.to(dtype)


def fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """C = (A_q · s_a) @ (B_q · s_b): dequantize, then the product.

    a: (M, K) fp8 (or its values in a wider dtype), a_scale: () or (M, 1); b: (K, N), b_scale: () or (1, N).
    In fp32 rounded to out_dtype (an fp8 GEMM's fp32 accumulator and 16-bit output); in float64 for float64
    inputs (the oracle: exact dequantized values, their product in float64), left in float64.
    """
    compute = torch.float64 if a.dtype == torch.float64 else torch.float32
    c = dequantize_fp8(a, a_scale, compute) @ dequantize_fp8(b, b_scale, compute)  # (M, N)
    return c if compute == torch.float64 else c.to(out_dtype)


# --- fp8 MoE: the routed experts' GEMMs in 8 bits (op=moe under precision=fp8, fp8_rowwise), forward only --------
# The expert GEMMs are an fp8 GEMM chain: g = x W_gate[e], u = x W_up[e] on e4m3 x and weights, h = silu(g) · u in
# fp32, h quantized again to e4m3, y = h W_down[e] · route_weight. Scales, per recipe (x and the weights are quantized
# once per case by the op's make_inputs, opdefs/moe.py; h by each path, being an intermediate):
#     tensorwise  x: one scale (); each expert's w_gate, w_up, w_down: one scale each, (E, 1, 1); h: one scale over
#                 the routed rows (the T·k rows of a grouped GEMM; rows no token picked are no part of it)
#     rowwise     x: one per token (T, 1); w_gate[e], w_up[e] (d, f): one per output column, (E, 1, f); w_down[e]
#                 (f, d): (E, 1, d); h: one per routed row (over f)
# Every scale is constant along its GEMM's K, so it factors out of the sum and an fp8 kernel applies it in the epilogue.


def fp8_moe(x: torch.Tensor, x_scale: torch.Tensor, w_gate: torch.Tensor, w_gate_scale: torch.Tensor,
            w_up: torch.Tensor, w_up_scale: torch.Tensor, w_down: torch.Tensor, w_down_scale: torch.Tensor,
            route_idx: torch.Tensor, route_weight: torch.Tensor,
            out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """moe_dense on the dequantized operands, h quantized between the GEMMs (the recipe above): x_scale 0-dim is the
    tensorwise recipe, (T, 1) the rowwise one. x (T, d), w_gate, w_up (E, d, f), w_down (E, f, d) fp8 (or their
    values in a wider dtype) -> (T, d). In fp32, rounded to out_dtype; in float64 for float64 inputs (the oracle:
    exact dequantized values; h is quantized as every path does, from its value rounded to fp32), left in float64.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    rowwise = x_scale.dim() == 2

    def quantize_h(h: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:  # h (E, T, f), routed (E, T)
        scale = fp8_scale(h, -1) if rowwise else fp8_scale(h[routed])  # (E, T, 1), or () over the routed rows
        return dequantize_fp8(quantize_fp8(h, scale), scale, compute)

    out = moe_dense(dequantize_fp8(x, x_scale, compute), dequantize_fp8(w_gate, w_gate_scale, compute),
                    dequantize_fp8(w_up, w_up_scale, compute), dequantize_fp8(w_down, w_down_scale, compute),
                    route_idx, route_weight.to(compute), quantize_h=quantize_h)
    return out if compute == torch.float64 else out.to(out_dtype)


# --- fp8 training: a linear layer's three GEMMs in 8 bits (bench-train under precision=fp8, fp8_rowwise) --------
# y = x Wᵀ, dx = dy W, dW = dyᵀ x, each an fp8 GEMM C = (A_q s_A)(B_q s_B) with fresh dynamic scales (amax of the
# tensor as it is now: no history). The forward operands x and W are e4m3; dy is the recipe's grad_format (e5m2:
# range for gradients, the tensorwise recipe's; e4m3 where the rowwise recipe keeps it). Rowwise, each operand is
# scaled along the dim its GEMM keeps (A per row, B per column), so a scale factors out of every sum over K; x, W
# and dy are quantized again per GEMM along the dim that GEMM keeps. Per tensor, one scale serves both orientations
# and the forward's x_q and W_q are reused. `gemm(a_q, a_scale, b_q, b_scale)` is the path: fp8_matmul above (the
# readable math), torch._scaled_mm, or the Triton fp8 GEMM; it returns C in the output dtype (bf16).


def _quantized(x: torch.Tensor, keep: int | None, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q, s) of a 2-D x: one scale per tensor (keep None), per row (keep 0: (M, 1)) or per column (keep 1: (1, N))."""
    scale = fp8_scale(x, None if keep is None else 1 - keep, fp8_dtype)
    return quantize_fp8(x, scale, fp8_dtype), scale


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, gemm: Any, rowwise: bool,
                grad_dtype: torch.dtype) -> torch.Tensor:
        e4m3 = torch.float8_e4m3fn
        row, col = (0, 1) if rowwise else (None, None)
        x_q, x_s = _quantized(x, row, e4m3)  # A = x (M, K): per row of x
        w_q, w_s = _quantized(weight.t(), col, e4m3)  # B = Wᵀ (K, N): per column of Wᵀ = per row of W
        ctx.gemm, ctx.rowwise, ctx.grad_dtype = gemm, rowwise, grad_dtype
        ctx.save_for_backward(x, weight, *(() if rowwise else (x_q, x_s, w_q, w_s)))
        return gemm(x_q, x_s, w_q, w_s)  # (M, N)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        e4m3, gemm = torch.float8_e4m3fn, ctx.gemm
        if ctx.rowwise:  # every operand scaled along the dim its GEMM keeps
            x, weight = ctx.saved_tensors
            dx = gemm(*_quantized(dy, 0, ctx.grad_dtype), *_quantized(weight, 1, e4m3))  # (M, N)(N, K): dy rows, W cols
            dw = gemm(*_quantized(dy.t(), 0, ctx.grad_dtype), *_quantized(x, 1, e4m3))  # (N, M)(M, K): dy cols, x cols
        else:  # one scale per tensor: the forward's x_q and W_q serve transposed
            x, weight, x_q, x_s, w_q, w_s = ctx.saved_tensors
            dy_q, dy_s = _quantized(dy, None, ctx.grad_dtype)
            dx = gemm(dy_q, dy_s, w_q.t(), w_s)
            dw = gemm(dy_q.t(), dy_s, x_q, x_s)
        return dx.to(x.dtype), dw.to(weight.dtype), None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, gemm: Any, *, rowwise: bool,
               grad_dtype: torch.dtype = torch.float8_e5m2) -> torch.Tensor:
    """x Wᵀ with its forward and both backward GEMMs in fp8 (the recipe above): x (..., K), weight (N, K) -> (..., N)
    in gemm's output dtype. Differentiable in x and weight."""
    rows = x.reshape(-1, x.shape[-1])  # (M, K)
    out = _Fp8Linear.apply(rows, weight, gemm, rowwise, grad_dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])
