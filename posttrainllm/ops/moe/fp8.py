"""Routed SwiGLU experts with fp8 expert GEMMs (precision=fp8, fp8_rowwise), forward only.

ops/moe/kernels.py's grouped GEMM on e4m3 operands, through its plan (rows sorted by expert, each expert padded to
BLOCK_M), its row blocks and its unpermute, imported, not copied. The recipe (scales, where h is quantized) is
posttrainllm/ops/moe/reference.py fp8_moe; x and the expert weights arrive quantized (once per case, ops/moe/definition.py):

    1. gate/up   g = X_q[tok] W_gate_q[e], u = X_q[tok] W_up_q[e]: tl.dot on the e4m3 operands into fp32, the
                 scales in the epilogue (x's, per token or one; the weight's, per column or one per expert), then
                 h = silu(g) · u, stored in fp32                                              (P, f) fp32
    2. quantize  h -> e4m3 with its scale (per row, or one over the routed rows), in PyTorch between the
                 launches: a per-row or per-tensor amax spans every column tile of h, and Triton's interpreter
                 casts fp32 -> fp8 wrongly (ops/matmul/fp8.py)                                (P, f) e4m3
    3. down      y = (H_q W_down_q[e]) · s_h · s_down · route_weight: the scales and the routing weight in the
                 epilogue, y stored in fp32                                                   (P, d) fp32
    4. unpermute out[t] = Σ_slots y[row of (t, slot)] (ops/moe/kernels.py's kernel), rounded once to the output dtype

A scale constant along a GEMM's K factors out of its sum: Σ_k (a_k s_a)(b_k s_b) = s_a s_b Σ_k a_k b_k, so each is
applied to the fp32 accumulator once. Every scale is per row of the GEMM's A (x's token, h's row) or per column of
its B (the expert's output column), or one per expert: none varies along K.

h and y stay fp32 (not bf16 as in ops/moe/kernels.py): h is rounded once, to e4m3 (no bf16 rounding before it), and the
output once, to its dtype. Under Triton's interpreter (TRITON_INTERPRET=1) tl.dot on e4m3 operands is exact
against their upcast product, as fp8_matmul's; on the GPU (Hopper's fp8 MMA) each BLOCK_K slab's partial sum is
added into the fp32 accumulator (max_num_imprecise_acc). The output is rounded to bf16 on the bits there (ops/moe/kernels.py
_unpermute's emulation: the interpreter's own cast truncates). Nothing here has run on a GPU: unmeasured.

Offsets: the expert, token and padded-row bases are 64-bit, as in ops/moe/kernels.py (its moe_launch refuses what stays
32-bit). Forward only: no autograd history (a quantized training recipe's backward is not this kernel's).

Shapes: x (T, d) e4m3, x_scale () or (T, 1); w_gate, w_up (E, d, f) e4m3, scales (E, 1, 1) or (E, 1, f); w_down
(E, f, d) e4m3, scale (E, 1, 1) or (E, 1, d); route_idx (T, k) int64, route_weight (T, k) -> out (T, d).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from posttrainllm.ops import use_bf16_emulation
from posttrainllm.ops import quantize as reference
from posttrainllm.ops.matmul.fp8 import MIN_BLOCK_K
from posttrainllm.ops.moe.kernels import (_check_spans, _row_block, _unpermute, gate_up_dots, moe_launch, plan,
                                          rows_dot)

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _fp8_gate_up_kernel(
    x_ptr, x_scale_ptr, wg_ptr, wu_ptr, wg_scale_ptr, wu_scale_ptr, h_ptr,
    row_token_ptr, block_expert_ptr, block_rows_ptr,
    D, F,
    stride_xt, stride_xd,
    stride_we, stride_wd, stride_wf,
    stride_hp, stride_hf,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWWISE: tl.constexpr,
):
    expert, rows, valid, n_valid = _row_block(block_expert_ptr, block_rows_ptr, tl.program_id(0), BLOCK_M)
    token = tl.load(row_token_ptr + rows).to(tl.int64)  # (BLOCK_M,): the token each row reads (0 on padding)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xd  # gathered rows of X_q
    w_off = expert * stride_we + offs_k[:, None] * stride_wd + offs_n[None, :] * stride_wf
    wg_ptrs = wg_ptr + w_off
    wu_ptrs = wu_ptr + w_off

    # -- Σ_k X_q W_q over d in fp32 on the e4m3 operands as loaded; gate and up share the X tile (ops/moe/kernels.py)
    acc_g, acc_u = gate_up_dots(x_ptrs, wg_ptrs, wu_ptrs, valid, offs_k, offs_n, D, F, n_valid, stride_xd, stride_wd,
                                BLOCK_M, BLOCK_N, BLOCK_K, "ieee", False, True)

    # -- epilogue: the scales (x's per row or one; the expert's per column or one), then SwiGLU in fp32
    n_mask = offs_n < F
    if ROWWISE:
        x_s = tl.load(x_scale_ptr + token)[:, None]  # (BLOCK_M, 1): each row's token's scale
        g_s = tl.load(wg_scale_ptr + expert * F + offs_n, mask=n_mask, other=0.0)[None, :]  # (1, BLOCK_N)
        u_s = tl.load(wu_scale_ptr + expert * F + offs_n, mask=n_mask, other=0.0)[None, :]
    else:
        x_s = tl.load(x_scale_ptr)
        g_s = tl.load(wg_scale_ptr + expert)
        u_s = tl.load(wu_scale_ptr + expert)
    g = acc_g * x_s * g_s
    u = acc_u * x_s * u_s
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + rows[:, None] * stride_hp + offs_n[None, :] * stride_hf, h,
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _fp8_down_kernel(
    h_ptr, h_scale_ptr, wd_ptr, wd_scale_ptr, y_ptr,
    row_weight_ptr, block_expert_ptr, block_rows_ptr,
    F, D,
    stride_hp, stride_hf,
    stride_we, stride_wf, stride_wd,
    stride_yp, stride_yd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWWISE: tl.constexpr,
):
    expert, rows, valid, n_valid = _row_block(block_expert_ptr, block_rows_ptr, tl.program_id(0), BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None] * stride_hp + offs_k[None, :] * stride_hf
    w_ptrs = wd_ptr + expert * stride_we + offs_k[:, None] * stride_wf + offs_n[None, :] * stride_wd
    acc = rows_dot(h_ptrs, w_ptrs, valid, offs_k, offs_n, F, D, n_valid, stride_hf, stride_wf, BLOCK_M, BLOCK_N,
                   BLOCK_K, "ieee", False, True)

    # -- epilogue: h's scale (per row or one), the expert's (per column or one), the routing weight of each row
    n_mask = offs_n < D
    if ROWWISE:
        h_s = tl.load(h_scale_ptr + rows, mask=valid, other=0.0)[:, None]  # (BLOCK_M, 1)
        d_s = tl.load(wd_scale_ptr + expert * D + offs_n, mask=n_mask, other=0.0)[None, :]  # (1, BLOCK_N)
    else:
        h_s = tl.load(h_scale_ptr)
        d_s = tl.load(wd_scale_ptr + expert)
    weight = tl.load(row_weight_ptr + rows, mask=valid, other=0.0)  # padding rows hold NaN and are masked
    acc = acc * h_s * d_s * weight[:, None]
    tl.store(y_ptr + rows[:, None] * stride_yp + offs_n[None, :] * stride_yd, acc,
             mask=valid[:, None] & n_mask[None, :])


def scaling_of(x, x_scale, w_gate, w_gate_scale, w_up_scale, w_down_scale) -> str:
    """"tensor" (x_scale 0-dim, each expert's weight scales (E, 1, 1)) or "row" (x_scale (T, 1), w_gate's and
    w_up's (E, 1, f), w_down's (E, 1, d)); anything else is refused."""
    (n_tokens, d_model), (n_experts, _, ffn) = x.shape, w_gate.shape
    weights = [tuple(s.shape) for s in (w_gate_scale, w_up_scale, w_down_scale)]
    if x_scale.dim() == 0 and weights == [(n_experts, 1, 1)] * 3:
        return "tensor"
    if tuple(x_scale.shape) == (n_tokens, 1) and weights == [(n_experts, 1, ffn)] * 2 + [(n_experts, 1, d_model)]:
        return "row"
    raise ValueError(f"scales {tuple(x_scale.shape)}, {', '.join(map(str, weights))}: expected (), "
                     f"({n_experts}, 1, 1) x 3 (per tensor), or ({n_tokens}, 1), ({n_experts}, 1, {ffn}) x 2, "
                     f"({n_experts}, 1, {d_model}) (rowwise)")


def _check_inputs(x, x_scale, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_idx,
                  route_weight, out_dtype) -> str:
    if x.ndim != 2 or w_gate.ndim != 3 or w_gate.shape != w_up.shape or w_down.ndim != 3:
        raise ValueError(f"expected x (T, d), w_gate/w_up (E, d, f), w_down (E, f, d), got {tuple(x.shape)}, "
                         f"{tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)}")
    n_experts, d_model, ffn = w_gate.shape
    if x.shape[1] != d_model or tuple(w_down.shape) != (n_experts, ffn, d_model):
        raise ValueError(f"x {tuple(x.shape)}, w_gate {tuple(w_gate.shape)}, w_down {tuple(w_down.shape)} disagree")
    if route_idx.ndim != 2 or route_idx.shape != route_weight.shape or route_idx.shape[0] != x.shape[0]:
        raise ValueError(f"route_idx {tuple(route_idx.shape)} and route_weight {tuple(route_weight.shape)} must "
                         f"both be (T={x.shape[0]}, k)")
    if route_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"route_idx must be int32 or int64, got {route_idx.dtype}")
    if any(t.dtype != torch.float8_e4m3fn for t in (x, w_gate, w_up, w_down)):
        raise ValueError(f"x and the expert weights are {x.dtype}, {w_gate.dtype}, {w_up.dtype}, {w_down.dtype}: "
                         "expected torch.float8_e4m3fn")
    if any(s.dtype != torch.float32 for s in (x_scale, w_gate_scale, w_up_scale, w_down_scale)):
        raise ValueError("the scales must be torch.float32")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype}: choose one of {OUT_DTYPES}")
    if len({t.device for t in (x, x_scale, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale,
                               route_idx, route_weight)}) != 1:
        raise ValueError("x, the weights, their scales and the routing must be on one device")
    return scaling_of(x, x_scale, w_gate, w_gate_scale, w_up_scale, w_down_scale)


def quantize_h(h: torch.Tensor, inv: torch.Tensor, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """h (P, f) fp32 -> (e4m3, scale), in PyTorch between the launches (ops/moe/reference.py fp8_moe's recipe): one
    scale per row, (P, 1) (the padding rows' are never read), or one over the routed rows (inv (T, k): the padded row
    of every (token, slot))."""
    h_scale = reference.fp8_scale(h, 1) if rowwise else reference.fp8_scale(h[inv.reshape(-1).long()])
    return reference.quantize_fp8(h, h_scale), h_scale


def fp8_moe(x: torch.Tensor, x_scale: torch.Tensor, w_gate: torch.Tensor, w_gate_scale: torch.Tensor,
            w_up: torch.Tensor, w_up_scale: torch.Tensor, w_down: torch.Tensor, w_down_scale: torch.Tensor,
            route_idx: torch.Tensor, route_weight: torch.Tensor, *, block_m: int = 64, block_n: int = 64,
            block_k: int = 32, num_warps: int = 4, num_stages: int = 2, out_dtype: torch.dtype = torch.bfloat16,
            emulate_bf16: bool | None = None) -> torch.Tensor:
    """Routed SwiGLU experts on fp8 operands (the module docstring) -> (T, d) in out_dtype, no autograd history.

    emulate_bf16: None = round the output to bf16 in-kernel on fp32 buffers only under the interpreter (ops/moe/kernels.py).
    """
    rowwise = _check_inputs(x, x_scale, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale, route_idx,
                            route_weight, out_dtype) == "row"
    if block_k < MIN_BLOCK_K:
        raise ValueError(f"block_k={block_k}: tl.dot on fp8 takes K in steps of {MIN_BLOCK_K}")
    (n_tokens, top_k), (n_experts, d_model, ffn) = route_idx.shape, w_gate.shape
    moe_launch(max(n_tokens, 1), d_model, ffn, n_experts, top_k, block_m=block_m, block_n=block_n, block_k=block_k,
               num_warps=num_warps, num_stages=num_stages)  # refuses what the kernels cannot address
    if n_tokens == 0:
        return torch.zeros((0, d_model), device=x.device, dtype=out_dtype)
    x, w_gate, w_up, w_down = (t.contiguous() for t in (x, w_gate, w_up, w_down))
    _check_spans(x, w_gate, w_up, w_down)
    # the scales flat: x's (T,) or (1,); each weight's (E·f,) / (E·d,) rowwise, (E,) per tensor
    x_s, g_s, u_s, d_s = (s.contiguous().reshape(-1) for s in (x_scale, w_gate_scale, w_up_scale, w_down_scale))
    p = plan(route_idx, route_weight.detach(), n_experts, block_m)
    launch = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ROWWISE=rowwise, num_warps=num_warps,
                  num_stages=num_stages)

    h = torch.empty((p.padded_rows, ffn), device=x.device, dtype=torch.float32)  # (P, f); padding rows unwritten
    _fp8_gate_up_kernel[(p.n_blocks, triton.cdiv(ffn, block_n))](
        x, x_s, w_gate, w_up, g_s, u_s, h, p.row_token, p.block_expert, p.block_rows, d_model, ffn,
        x.stride(0), x.stride(1), w_gate.stride(0), w_gate.stride(1), w_gate.stride(2), h.stride(0), h.stride(1),
        **launch)

    h_q, h_scale = quantize_h(h, p.inv, rowwise)  # (P, f) e4m3
    y = torch.empty((p.padded_rows, d_model), device=x.device, dtype=torch.float32)  # (P, d)
    _fp8_down_kernel[(p.n_blocks, triton.cdiv(d_model, block_n))](
        h_q, h_scale.reshape(-1), w_down, d_s, y, p.row_weight, p.block_expert, p.block_rows, ffn, d_model,
        h_q.stride(0), h_q.stride(1), w_down.stride(0), w_down.stride(1), w_down.stride(2), y.stride(0),
        y.stride(1), **launch)

    emulate = use_bf16_emulation(out_dtype, emulate_bf16)
    tile = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    out = _unpermute(y, p.inv, torch.float32 if emulate else out_dtype, tile, emulate)  # (T, d)
    return out.to(out_dtype)
