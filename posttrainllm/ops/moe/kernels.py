"""A routed SwiGLU expert layer as a grouped GEMM (MegaBlocks-style, dropless), forward and backward.

Every (token, slot) assignment of the routing is one row. Rows are sorted by expert and each
expert's rows are padded to a multiple of BLOCK_M, so a row block belongs to exactly one
expert (`plan`, in PyTorch: a stable sort and a few prefix sums). Then, one program per
(row block, column tile), each reading its block's expert id:

    1. gate/up   g = X[tok] W_gate[e], u = X[tok] W_up[e], both in one K loop; the SwiGLU
                 h = silu(g) * u in the epilogue                                    (P, f)
    2. down      y = w_row * (h W_down[e]): the routing weight applied in the epilogue (P, d)
    3. unpermute out[t] = Σ_slots y[row of (t, slot)]: a gather-sum, no atomics     (T, d)

Backward (TritonMoE.backward), through the same plan:
    4. down bwd  dĥ = dOut[tok] W_down[e]ᵀ; d w_row = Σ_f dĥ ∘ h (partial per column tile);
                 dh = w_row dĥ, then the SwiGLU backward in the epilogue: dg, du      (P, f)
    5. dX rows   dg W_gate[e]ᵀ + du W_up[e]ᵀ, then the unpermute gather-sum -> dX    (T, d)
    6. weights   one program per (expert, BLOCK_N x BLOCK_N tile of dW), walking only that expert's
                 row blocks: dW_gate[e] = Σ X[tok]ᵀ dg and dW_up[e] = Σ X[tok]ᵀ du in one launch (one
                 X tile, two accumulators), then dW_down[e] = Σ hᵀ (w_row dOut[tok]), w_row applied
                 in fp32 and cast back to the input dtype for the dot; an expert with no token stores zeros.

Padding rows hold token 0 (an in-bounds load) and routing weight NaN (a poison: a padding row
that leaks into any output makes it non-finite), and every load and store masks them: the
mask, not the padding values, makes them inert.

bf16 under Triton's interpreter (EMULATE_BF16, ops/__init__.py): the dot operands are upcast to fp32 (bf16
products are exact in fp32, as on the GPU's tensor cores with an fp32 accumulator), and every value the GPU kernel
stores or casts in bf16 (g, u, h, y, dg, du, the dX rows, w_row · dOut before the dW_down dot, dW, the outputs) is
rounded to bf16, to nearest with ties to even, on the bits (the interpreter's own cast truncates), in fp32 buffers.
The CPU thus runs the GPU's algorithm; what differs is the dots' accumulation order. d route_weight's partials are
fp32 on both.

Offsets: every token, padded-row and expert base is 64-bit (at DeepSeek-V3's d 7168 and top-8, P·d passes 2^31
from ~37k tokens; 256 experts of 7168 x 2048 hold 3.8e9 elements); offsets inside one row or one expert's weights
and the plan's int32 row indices stay 32-bit, and moe_launch refuses a problem that would pass 2^31 there.

Shapes: x (T, d); w_gate, w_up (E, d, f); w_down (E, f, d); route_idx (T, k) int64;
route_weight (T, k) -> out (T, d). P = padded rows: row_blocks_max · BLOCK_M, the bound over every routing
(a routing fills Σ_e ceil(n_e / BLOCK_M) · BLOCK_M of them).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from posttrainllm.ops import use_bf16_emulation
from posttrainllm.ops.rows import check_block, check_sizes

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INPUT_PRECISIONS = ("ieee", "tf32")
# Offsets: every base a program id or index multiplies by a stride (token, padded row, expert) is 64-bit; what stays
# 32-bit is refused at 2^31: an offset inside one row or one expert's weights, and the plan's int32 row indices.
OFFSET_LIMIT = 2 ** 31
GRID_DIM_LIMIT = 65535  # CUDA: grid dimensions 1 and 2


# --- kernels -----------------------------------------------------------------------------


@triton.jit
def _row_block(block_expert_ptr, block_rows_ptr, block, BLOCK_M: tl.constexpr):
    """A row block's expert, its padded row indices (BLOCK_M,), which of them are real rows, and how many are.

    The expert and the rows come back 64-bit: they multiply strides (expert x d·f passes 2^31 at 256 experts of
    7168 x 2048; padded row x d at ~37k tokens of top-8 and d 7168)."""
    expert = tl.load(block_expert_ptr + block)
    n_valid = tl.load(block_rows_ptr + block)
    offs = tl.arange(0, BLOCK_M)
    valid = offs < n_valid  # padding rows: masked in every load and store
    return expert.to(tl.int64), tl.cast(block, tl.int64) * BLOCK_M + offs, valid, n_valid


@triton.jit
def _bf16_round(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32: what the GPU's fp32 -> bf16 cast stores. On the
    bits, because the interpreter's own cast truncates; NaN stays NaN, and a value past bf16's max becomes inf."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)


@triton.jit
def _stored(x, EMULATE_BF16: tl.constexpr):
    """An fp32 value as the GPU stores or casts it in bf16: under emulation (fp32 buffers), rounded to bf16."""
    if EMULATE_BF16:
        x = _bf16_round(x)
    return x


@triton.jit
def _k_steps(size, BLOCK_K: tl.constexpr, n_valid):
    """Trips of a row block's K loop: none for a block past the routing's last (the grid is the plan's bound)."""
    return tl.where(n_valid > 0, tl.cdiv(size, BLOCK_K), 0)


@triton.jit
def _dot(a, b, acc, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr,
         FP8: tl.constexpr):
    """acc + a b in fp32. FP8 (ops/moe/fp8.py): on the e4m3 operands as loaded, each BLOCK_K slab's partial sum
    added into the fp32 accumulator (max_num_imprecise_acc, ops/matmul/kernels.py k_walk); else at INPUT_PRECISION, the
    operands upcast first under the interpreter's bf16 emulation."""
    if FP8:
        return tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    if EMULATE_BF16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def gate_up_dots(x_ptrs, wg_ptrs, wu_ptrs, valid, offs_k, offs_n, D, F, n_valid, stride_xd, stride_wd,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                 EMULATE_BF16: tl.constexpr, FP8: tl.constexpr):
    """(X[tok] W_gate[e], X[tok] W_up[e]) of one row block and column tile, in fp32: one K loop over d, the X tile
    shared by both dots; masked lanes (padding rows, past d or f) load 0."""
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, _k_steps(D, BLOCK_K, n_valid)):
        k_left = D - k * BLOCK_K
        a = tl.load(x_ptrs, mask=valid[:, None] & (offs_k[None, :] < k_left), other=0.0)
        w_mask = (offs_k[:, None] < k_left) & (offs_n[None, :] < F)
        bg = tl.load(wg_ptrs, mask=w_mask, other=0.0)
        bu = tl.load(wu_ptrs, mask=w_mask, other=0.0)
        acc_g = _dot(a, bg, acc_g, BLOCK_K, INPUT_PRECISION, EMULATE_BF16, FP8)
        acc_u = _dot(a, bu, acc_u, BLOCK_K, INPUT_PRECISION, EMULATE_BF16, FP8)
        x_ptrs += BLOCK_K * stride_xd
        wg_ptrs += BLOCK_K * stride_wd
        wu_ptrs += BLOCK_K * stride_wd
    return acc_g, acc_u


@triton.jit
def rows_dot(a_ptrs, b_ptrs, valid, offs_k, offs_n, K, N, n_valid, stride_ak, stride_bk, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr,
             FP8: tl.constexpr):
    """A[rows] B[e] of one row block and column tile over K, in fp32 (the down GEMM: h rows, W_down[e])."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, _k_steps(K, BLOCK_K, n_valid)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        acc = _dot(a, b, acc, BLOCK_K, INPUT_PRECISION, EMULATE_BF16, FP8)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr, wg_ptr, wu_ptr, g_ptr, u_ptr, h_ptr,
    row_token_ptr, block_expert_ptr, block_rows_ptr,
    D, F,
    stride_xt, stride_xd,
    stride_we, stride_wd, stride_wf,
    stride_hp, stride_hf,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr, SAVE_PRE: tl.constexpr,
):
    expert, rows, valid, n_valid = _row_block(block_expert_ptr, block_rows_ptr, tl.program_id(0), BLOCK_M)
    token = tl.load(row_token_ptr + rows).to(tl.int64)  # (BLOCK_M,): the token each row reads
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xd  # gathered rows of X
    w_off = expert * stride_we + offs_k[:, None] * stride_wd + offs_n[None, :] * stride_wf
    wg_ptrs = wg_ptr + w_off
    wu_ptrs = wu_ptr + w_off

    # -- gate and up share the X tile: one K loop, two accumulators
    acc_g, acc_u = gate_up_dots(x_ptrs, wg_ptrs, wu_ptrs, valid, offs_k, offs_n, D, F, n_valid, stride_xd, stride_wd,
                                BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION, EMULATE_BF16, False)

    # -- epilogue: SwiGLU in fp32
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    out_mask = valid[:, None] & (offs_n[None, :] < F)
    out_off = rows[:, None] * stride_hp + offs_n[None, :] * stride_hf
    tl.store(h_ptr + out_off, _stored(h, EMULATE_BF16).to(h_ptr.dtype.element_ty), mask=out_mask)
    if SAVE_PRE:  # the backward's SwiGLU derivative needs g and u
        tl.store(g_ptr + out_off, _stored(acc_g, EMULATE_BF16).to(g_ptr.dtype.element_ty), mask=out_mask)
        tl.store(u_ptr + out_off, _stored(acc_u, EMULATE_BF16).to(u_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _down_kernel(
    h_ptr, wd_ptr, y_ptr,
    row_weight_ptr, block_expert_ptr, block_rows_ptr,
    F, D,
    stride_hp, stride_hf,
    stride_we, stride_wf, stride_wd,
    stride_yp, stride_yd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    expert, rows, valid, n_valid = _row_block(block_expert_ptr, block_rows_ptr, tl.program_id(0), BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None] * stride_hp + offs_k[None, :] * stride_hf
    w_ptrs = wd_ptr + expert * stride_we + offs_k[:, None] * stride_wf + offs_n[None, :] * stride_wd
    acc = rows_dot(h_ptrs, w_ptrs, valid, offs_k, offs_n, F, D, n_valid, stride_hf, stride_wf, BLOCK_M, BLOCK_N,
                   BLOCK_K, INPUT_PRECISION, EMULATE_BF16, False)

    # -- epilogue: the routing weight of each row (padding rows hold NaN and are masked)
    weight = tl.load(row_weight_ptr + rows, mask=valid, other=0.0)
    acc = acc * weight[:, None]
    tl.store(y_ptr + rows[:, None] * stride_yp + offs_n[None, :] * stride_yd,
             _stored(acc, EMULATE_BF16).to(y_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < D))


@triton.jit
def _unpermute_kernel(
    y_ptr, inv_ptr, out_ptr,
    T, D,
    stride_yp, stride_yd,
    stride_ot, stride_od,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    """out[t] = Σ over t's k slots of y[row of (t, slot)]: every row is read once, nothing is added twice."""
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_mask = offs_t < T
    mask = t_mask[:, None] & (offs_n[None, :] < D)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        row = tl.load(inv_ptr + offs_t * TOP_K + slot, mask=t_mask, other=0).to(tl.int64)  # (BLOCK_M,)
        acc += tl.load(y_ptr + row[:, None] * stride_yp + offs_n[None, :] * stride_yd, mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_t[:, None] * stride_ot + offs_n[None, :] * stride_od,
             _stored(acc, EMULATE_BF16).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _down_backward_kernel(
    dout_ptr, wd_ptr, h_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, dw_part_ptr,
    row_token_ptr, row_weight_ptr, block_expert_ptr, block_rows_ptr,
    F, D,
    stride_ot, stride_od,
    stride_we, stride_wf, stride_wd,
    stride_hp, stride_hf,
    stride_pp, stride_pn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    expert, rows, valid, n_valid = _row_block(block_expert_ptr, block_rows_ptr, tl.program_id(0), BLOCK_M)
    pid_n = tl.program_id(1)
    token = tl.load(row_token_ptr + rows).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # over f
    offs_k = tl.arange(0, BLOCK_K)  # over d
    do_ptrs = dout_ptr + token[:, None] * stride_ot + offs_k[None, :] * stride_od  # gathered rows of dOut
    wt_ptrs = wd_ptr + expert * stride_we + offs_n[None, :] * stride_wf + offs_k[:, None] * stride_wd  # W_down[e]ᵀ
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, _k_steps(D, BLOCK_K, n_valid)):
        k_left = D - k * BLOCK_K
        a = tl.load(do_ptrs, mask=valid[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(wt_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < F), other=0.0)
        if EMULATE_BF16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)  # dĥ = dOut W_downᵀ, before the weight
        do_ptrs += BLOCK_K * stride_od
        wt_ptrs += BLOCK_K * stride_wd

    mask = valid[:, None] & (offs_n[None, :] < F)
    off = rows[:, None] * stride_hp + offs_n[None, :] * stride_hf
    h = tl.load(h_ptr + off, mask=mask, other=0.0).to(tl.float32)
    # d(route weight of the row) = <dOut[tok], h W_down[e]> = Σ_f dĥ ∘ h: this tile's part
    tl.store(dw_part_ptr + rows * stride_pp + pid_n * stride_pn, tl.sum(acc * h, axis=1), mask=valid)
    weight = tl.load(row_weight_ptr + rows, mask=valid, other=0.0)
    dh = acc * weight[:, None]
    # -- epilogue: SwiGLU backward, h = silu(g) u: dg = dh u σ(g)(1 + g(1 − σ(g))), du = dh silu(g)
    g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + off, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    dg = dh * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(dg_ptr + off, _stored(dg, EMULATE_BF16).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + off, _stored(dh * g * sig, EMULATE_BF16).to(du_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dx_rows_kernel(
    dg_ptr, du_ptr, wg_ptr, wu_ptr, dxr_ptr,
    block_expert_ptr, block_rows_ptr,
    F, D,
    stride_gp, stride_gf,
    stride_we, stride_wd, stride_wf,
    stride_xp, stride_xd,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    """Each row's dX contribution: dg W_gate[e]ᵀ + du W_up[e]ᵀ (P, d); the unpermute sums a token's rows."""
    expert, rows, valid, n_valid = _row_block(block_expert_ptr, block_rows_ptr, tl.program_id(0), BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # over d
    offs_k = tl.arange(0, BLOCK_K)  # over f
    g_off = rows[:, None] * stride_gp + offs_k[None, :] * stride_gf
    w_off = expert * stride_we + offs_n[None, :] * stride_wd + offs_k[:, None] * stride_wf  # W[e]ᵀ tiles
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, _k_steps(F, BLOCK_K, n_valid)):
        k_left = F - k * BLOCK_K
        a_mask = valid[:, None] & (offs_k[None, :] < k_left)
        b_mask = (offs_k[:, None] < k_left) & (offs_n[None, :] < D)
        dg = tl.load(dg_ptr + g_off, mask=a_mask, other=0.0)
        du = tl.load(du_ptr + g_off, mask=a_mask, other=0.0)
        wg = tl.load(wg_ptr + w_off, mask=b_mask, other=0.0)
        wu = tl.load(wu_ptr + w_off, mask=b_mask, other=0.0)
        if EMULATE_BF16:
            dg = dg.to(tl.float32)
            du = du.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        acc = tl.dot(dg, wg, acc, input_precision=INPUT_PRECISION)
        acc = tl.dot(du, wu, acc, input_precision=INPUT_PRECISION)
        g_off += BLOCK_K * stride_gf
        w_off += BLOCK_K * stride_wf
    tl.store(dxr_ptr + rows[:, None] * stride_xp + offs_n[None, :] * stride_xd,
             _stored(acc, EMULATE_BF16).to(dxr_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < D))


@triton.jit
def _expert_grad_kernel(
    a_ptr, b_ptr, b2_ptr, dw_ptr, dw2_ptr,
    row_token_ptr, row_weight_ptr, block_expert_ptr, block_rows_ptr, expert_blocks_ptr,
    R, C,
    stride_ar, stride_ac,
    stride_br, stride_bc,
    stride_we, stride_wr, stride_wc,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    A_GATHER: tl.constexpr, B_GATHER_SCALED: tl.constexpr, TWO_B: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    """dW[e] (R, C) = Σ over expert e's rows of A[row]ᵀ B[row], walking only e's row blocks.

    A_GATHER: A's rows are tokens (X[tok]); else padded rows. B_GATHER_SCALED: B's rows are
    w_row · B[tok] (the routing weight times dOut of the row's token); else padded rows.
    TWO_B: also dW2[e] = Σ A[row]ᵀ B2[row] from the same A tile (dW_gate and dW_up share X[tok]).
    """
    expert = tl.program_id(0).to(tl.int64)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    first = tl.load(expert_blocks_ptr + expert)
    last = tl.load(expert_blocks_ptr + expert + 1)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for block in range(first, last):
        _, rows, valid, _ = _row_block(block_expert_ptr, block_rows_ptr, block, BLOCK_M)
        token = tl.load(row_token_ptr + rows).to(tl.int64)
        a_rows = rows
        b_rows = rows
        if A_GATHER:
            a_rows = token
        if B_GATHER_SCALED:
            b_rows = token
        a = tl.load(a_ptr + a_rows[:, None] * stride_ar + offs_r[None, :] * stride_ac,
                    mask=valid[:, None] & (offs_r[None, :] < R), other=0.0)  # (BLOCK_M, BLOCK_R)
        b_off = b_rows[:, None] * stride_br + offs_c[None, :] * stride_bc
        b_mask = valid[:, None] & (offs_c[None, :] < C)
        b = tl.load(b_ptr + b_off, mask=b_mask, other=0.0)  # (BLOCK_M, BLOCK_C)
        if TWO_B:
            b2 = tl.load(b2_ptr + b_off, mask=b_mask, other=0.0)
            if EMULATE_BF16:
                b2 = b2.to(tl.float32)
        if B_GATHER_SCALED:  # w_row · dOut[tok]: the weight applied in fp32, then back to A's dtype for the dot
            weight = tl.load(row_weight_ptr + rows, mask=valid, other=0.0)
            b = b.to(tl.float32) * weight[:, None]
            if EMULATE_BF16:  # A (h) is held in fp32 already; B rounded as the GPU's cast to bf16 rounds it
                a = a.to(tl.float32)
                b = _bf16_round(b)
            else:
                b = b.to(a.dtype)
        elif EMULATE_BF16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        a_t = tl.trans(a)
        acc = tl.dot(a_t, b, acc, input_precision=INPUT_PRECISION)
        if TWO_B:
            acc2 = tl.dot(a_t, b2, acc2, input_precision=INPUT_PRECISION)
    dw_off = expert * stride_we + offs_r[:, None] * stride_wr + offs_c[None, :] * stride_wc
    dw_mask = (offs_r[:, None] < R) & (offs_c[None, :] < C)
    tl.store(dw_ptr + dw_off, _stored(acc, EMULATE_BF16).to(dw_ptr.dtype.element_ty), mask=dw_mask)
    if TWO_B:
        tl.store(dw2_ptr + dw_off, _stored(acc2, EMULATE_BF16).to(dw2_ptr.dtype.element_ty), mask=dw_mask)


# --- launchers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Rows sorted by expert, each expert padded to BLOCK_M (built in PyTorch from the routing).

    row_token (P,) int32     the token of each padded row (0 on padding)
    row_weight (P,) fp32     the routing weight of each padded row (NaN on padding: a poison)
    inv (T, k) int32         the padded row of each (token, slot)
    block_expert (B,) int32  the expert of each row block;  block_rows (B,): its real rows
    expert_blocks (E+1,)     expert e owns row blocks [expert_blocks[e], expert_blocks[e+1])
    tokens_per_expert (E,)   assignments per expert (the histogram)

    B is row_blocks_max, the bound over every routing of T·k assignments, not this routing's count: sizing by the
    count would read it back to the host (a sync on every call). The blocks past the routing's last hold no real
    row (block_rows 0, expert E-1) and their programs skip the K loop.
    """

    row_token: torch.Tensor
    row_weight: torch.Tensor
    inv: torch.Tensor
    block_expert: torch.Tensor
    block_rows: torch.Tensor
    expert_blocks: torch.Tensor
    tokens_per_expert: torch.Tensor

    @property
    def padded_rows(self) -> int:
        return self.row_token.numel()

    @property
    def n_blocks(self) -> int:
        return self.block_expert.numel()


def row_blocks_max(assignments: int, n_experts: int, block_m: int) -> int:
    """Row blocks of any routing of `assignments` rows: Σ over the m non-empty experts of ceil(n_e / BLOCK_M)
    <= cdiv(T·k, BLOCK_M) + m - 1, with m <= min(E, T·k)."""
    return max(triton.cdiv(assignments, block_m) + min(n_experts, assignments) - 1, 0)


# route_idx tensors whose expert ids were checked: id -> (weak reference, version, E)
_CHECKED_ROUTINGS: dict[int, tuple] = {}


def _refuse_bad_expert_ids(route_idx: torch.Tensor, n_experts: int) -> None:
    if ((route_idx < 0) | (route_idx >= n_experts)).any():  # one bool read back: a device-to-host sync
        raise ValueError(f"route_idx must lie in [0, {n_experts})")


def check_routing(route_idx: torch.Tensor, n_experts: int) -> None:
    """Refuse expert ids outside [0, E), once per routing: a route_idx already checked and not written since (its
    version counter) is not read again, so the calls timed on one routing do no device-to-host sync."""
    try:
        version = route_idx._version
    except RuntimeError:  # an inference-mode tensor has no version counter: checked on every call
        _refuse_bad_expert_ids(route_idx, n_experts)
        return
    key = id(route_idx)
    seen = _CHECKED_ROUTINGS.get(key)
    if seen is not None and seen[0]() is route_idx and seen[1:] == (version, n_experts):
        return
    _refuse_bad_expert_ids(route_idx, n_experts)

    def forget(ref, key=key):
        if _CHECKED_ROUTINGS.get(key, (None,))[0] is ref:
            del _CHECKED_ROUTINGS[key]

    _CHECKED_ROUTINGS[key] = (weakref.ref(route_idx, forget), version, n_experts)


def plan(route_idx: torch.Tensor, route_weight: torch.Tensor, n_experts: int, block_m: int) -> Plan:
    """Sort the T·k assignments by expert (stable: token order within an expert) and pad each expert.

    Nothing is read back to the host but the expert-id check, once per routing (check_routing)."""
    check_routing(route_idx, n_experts)
    n_tokens, top_k = route_idx.shape
    device = route_idx.device
    flat = route_idx.reshape(-1)  # (A,) A = T·k, assignment a = t·k + slot
    sorted_expert, order = torch.sort(flat, stable=True)  # (A,): assignments grouped by expert
    experts = torch.arange(n_experts + 1, device=device, dtype=flat.dtype)
    count_start = torch.searchsorted(sorted_expert, experts)  # (E+1,) first sorted position of each expert
    counts = count_start[1:] - count_start[:-1]  # (E,) (bincount sizes its output on the host)
    blocks = (counts + block_m - 1) // block_m  # (E,) row blocks per expert
    expert_blocks = torch.zeros(n_experts + 1, dtype=torch.int64, device=device)
    expert_blocks[1:] = torch.cumsum(blocks, 0)
    rank = torch.arange(flat.numel(), device=device) - count_start[sorted_expert]  # (A,) rank within its expert
    row = expert_blocks[sorted_expert] * block_m + rank  # (A,) padded row of each sorted assignment
    n_blocks = row_blocks_max(flat.numel(), n_experts, block_m)
    padded = n_blocks * block_m
    row_token = torch.zeros(padded, dtype=torch.int32, device=device)
    row_token[row] = (order // top_k).to(torch.int32)
    row_weight = torch.full((padded,), float("nan"), dtype=torch.float32, device=device)
    row_weight[row] = route_weight.reshape(-1)[order].float()
    inv = torch.empty(flat.numel(), dtype=torch.int32, device=device)
    inv[order] = row.to(torch.int32)
    block_index = torch.arange(n_blocks, device=device)  # (B,)
    # block b belongs to the expert e with expert_blocks[e] <= b < expert_blocks[e+1]; past the last: E-1, no rows
    block_expert = torch.searchsorted(expert_blocks[1:], block_index, right=True).clamp(max=n_experts - 1)
    block_first = expert_blocks[block_expert]  # (B,)
    block_rows = (counts[block_expert] - (block_index - block_first) * block_m).clamp(0, block_m)  # (B,)
    return Plan(row_token, row_weight, inv.view(n_tokens, top_k), block_expert.to(torch.int32),
                block_rows.to(torch.int32), expert_blocks.to(torch.int32), counts)


def moe_launch(n_tokens: int, d_model: int, ffn: int, n_experts: int, top_k: int, *, block_m: int, block_n: int,
               block_k: int, num_warps: int, num_stages: int) -> dict:
    """Dispatch geometry. The row blocks depend on the routing; the grids take their bound (row_blocks_max).

    largest_offset: the largest element offset of each operand family, reached through a 64-bit base (it may pass
    2^31); what the kernels still address in 32 bits (inside one expert's weights, the plan's row indices) and a
    grid past CUDA's dimensions are refused here, naming the limit."""
    for name, block in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        check_block(name, block)
    check_sizes(T=n_tokens, d=d_model, f=ffn, E=n_experts, k=top_k)
    if top_k > n_experts:
        raise ValueError(f"top_k={top_k} must be <= n_experts={n_experts}")
    max_blocks = row_blocks_max(n_tokens * top_k, n_experts, block_m)
    padded = max_blocks * block_m
    if padded >= OFFSET_LIMIT:
        raise ValueError(f"T·k={n_tokens * top_k} assignments pad to up to {padded} rows: the plan's int32 row "
                         f"indices address < 2^31")
    if d_model * ffn >= OFFSET_LIMIT:
        raise ValueError(f"one expert's weights, d·f = {d_model}·{ffn}, span >= 2^31 elements: offsets inside one "
                         f"expert are 32-bit")
    launch = {
        "row_blocks_max": max_blocks,
        "forward": {"gate_up": [max_blocks, triton.cdiv(ffn, block_n)],
                    "down": [max_blocks, triton.cdiv(d_model, block_n)],
                    "unpermute": [triton.cdiv(n_tokens, block_m), triton.cdiv(d_model, block_n)]},
        "backward": {"down_backward": [max_blocks, triton.cdiv(ffn, block_n)],
                     "dx_rows": [max_blocks, triton.cdiv(d_model, block_n)],
                     "unpermute": [triton.cdiv(n_tokens, block_m), triton.cdiv(d_model, block_n)],
                     "grad_w_gate_and_up": [n_experts, triton.cdiv(d_model, block_n), triton.cdiv(ffn, block_n)],
                     "grad_w_down": [n_experts, triton.cdiv(ffn, block_n), triton.cdiv(d_model, block_n)]},
        "largest_offset": {"tokens": n_tokens * d_model, "padded_rows": padded * max(d_model, ffn),
                           "expert_weights": n_experts * d_model * ffn, "bases": "int64"},
        "block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": num_warps, "num_stages": num_stages,
    }
    for name, grid in (*launch["forward"].items(), *launch["backward"].items()):
        if max(grid[1:]) > GRID_DIM_LIMIT:
            raise ValueError(f"{name} grid {grid}: CUDA caps grid dimensions 1 and 2 at {GRID_DIM_LIMIT}; raise "
                             f"block_n")
    return launch


def _check_spans(x: torch.Tensor, *weights: torch.Tensor) -> None:
    """Offsets inside one row of x and inside one expert's weights are 32-bit (the bases are 64-bit)."""
    if (x.shape[1] - 1) * abs(x.stride(1)) >= OFFSET_LIMIT:
        raise ValueError("x: one row spans >= 2^31 elements; make it contiguous")
    for name, w in zip(("w_gate", "w_up", "w_down"), weights):
        if (w.shape[1] - 1) * abs(w.stride(1)) + (w.shape[2] - 1) * abs(w.stride(2)) >= OFFSET_LIMIT:
            raise ValueError(f"{name}: one expert's weights span >= 2^31 elements; make it contiguous per expert")


def _check_inputs(x, w_gate, w_up, w_down, route_idx, route_weight, input_precision) -> None:
    if x.ndim != 2 or w_gate.ndim != 3 or w_gate.shape != w_up.shape or w_down.ndim != 3:
        raise ValueError(f"expected x (T, d), w_gate/w_up (E, d, f), w_down (E, f, d), got {tuple(x.shape)}, "
                         f"{tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)}")
    n_experts, d_model, ffn = w_gate.shape
    if x.shape[1] != d_model or tuple(w_down.shape) != (n_experts, ffn, d_model):
        raise ValueError(f"x {tuple(x.shape)}, w_gate {tuple(w_gate.shape)}, w_down {tuple(w_down.shape)} disagree")
    if route_idx.shape != route_weight.shape or route_idx.shape[0] != x.shape[0] or route_idx.ndim != 2:
        raise ValueError(f"route_idx {tuple(route_idx.shape)} and route_weight {tuple(route_weight.shape)} must "
                         f"both be (T={x.shape[0]}, k)")
    if route_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"route_idx must be int32 or int64, got {route_idx.dtype}")
    if len({t.dtype for t in (x, w_gate, w_up, w_down)}) != 1 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x and the expert weights must share one dtype of {SUPPORTED_DTYPES}")
    if input_precision not in INPUT_PRECISIONS:
        raise ValueError(f"input_precision={input_precision!r}; choose one of {INPUT_PRECISIONS}")


def _unpermute(rows: torch.Tensor, inv: torch.Tensor, out_dtype: torch.dtype, tile: dict,
               emulate_bf16: bool) -> torch.Tensor:
    """(P, d) padded rows -> (T, d): each token's k rows summed."""
    n_tokens, top_k = inv.shape
    d_model = rows.shape[1]
    out = torch.empty((n_tokens, d_model), device=rows.device, dtype=out_dtype)
    grid = (triton.cdiv(n_tokens, tile["block_m"]), triton.cdiv(d_model, tile["block_n"]))
    _unpermute_kernel[grid](rows, inv, out, n_tokens, d_model, rows.stride(0), rows.stride(1), out.stride(0),
                            out.stride(1), TOP_K=top_k, BLOCK_M=tile["block_m"], BLOCK_N=tile["block_n"],
                            EMULATE_BF16=emulate_bf16, num_warps=tile["num_warps"], num_stages=tile["num_stages"])
    return out


def _dot_flags(dtype: torch.dtype, tile: dict) -> tuple[bool, torch.dtype, dict]:
    emulate = use_bf16_emulation(dtype, tile.get("emulate_bf16"))
    inter = torch.float32 if emulate else dtype  # intermediates: fp32 buffers holding bf16 values when emulated
    launch = dict(BLOCK_M=tile["block_m"], INPUT_PRECISION=tile["input_precision"], EMULATE_BF16=emulate,
                  num_warps=tile["num_warps"], num_stages=tile["num_stages"])
    return emulate, inter, launch


def moe_forward(x, w_gate, w_up, w_down, p: Plan, tile: dict, *, save_pre: bool):
    """The three forward launches; returns out (T, d) and what the backward needs (h, g, u)."""
    n_experts, d_model, ffn = w_gate.shape
    _check_spans(x, w_gate, w_up, w_down)
    emulate, inter, launch = _dot_flags(x.dtype, tile)
    bn, bk = tile["block_n"], tile["block_k"]
    h = torch.empty((p.padded_rows, ffn), device=x.device, dtype=inter)  # (P, f)
    g = torch.empty_like(h) if save_pre else h
    u = torch.empty_like(h) if save_pre else h
    _gate_up_kernel[(p.n_blocks, triton.cdiv(ffn, bn))](
        x, w_gate, w_up, g, u, h, p.row_token, p.block_expert, p.block_rows, d_model, ffn,
        x.stride(0), x.stride(1), w_gate.stride(0), w_gate.stride(1), w_gate.stride(2), h.stride(0), h.stride(1),
        BLOCK_N=bn, BLOCK_K=bk, SAVE_PRE=save_pre, **launch)
    y = torch.empty((p.padded_rows, d_model), device=x.device, dtype=inter)  # (P, d)
    _down_kernel[(p.n_blocks, triton.cdiv(d_model, bn))](
        h, w_down, y, p.row_weight, p.block_expert, p.block_rows, ffn, d_model,
        h.stride(0), h.stride(1), w_down.stride(0), w_down.stride(1), w_down.stride(2), y.stride(0), y.stride(1),
        BLOCK_N=bn, BLOCK_K=bk, **launch)
    out = _unpermute(y, p.inv, inter, tile, emulate)  # (T, d)
    return out.to(x.dtype), h, g, u


def moe_backward(dout, x, w_gate, w_up, w_down, h, g, u, p: Plan, tile: dict):
    """dX (T, d), dW_gate, dW_up, dW_down (E, ...) and d route_weight (T, k) through the same plan."""
    n_experts, d_model, ffn = w_gate.shape
    _check_spans(x, w_gate, w_up, w_down)
    emulate, inter, launch = _dot_flags(x.dtype, tile)
    bn, bk = tile["block_n"], tile["block_k"]
    dout = dout.contiguous()
    dg = torch.empty((p.padded_rows, ffn), device=x.device, dtype=inter)  # (P, f)
    du = torch.empty_like(dg)
    f_tiles = triton.cdiv(ffn, bn)
    dw_part = torch.zeros((p.padded_rows, f_tiles), device=x.device, dtype=torch.float32)  # (P, f tiles)
    _down_backward_kernel[(p.n_blocks, f_tiles)](
        dout, w_down, h, g, u, dg, du, dw_part, p.row_token, p.row_weight, p.block_expert, p.block_rows,
        ffn, d_model, dout.stride(0), dout.stride(1), w_down.stride(0), w_down.stride(1), w_down.stride(2),
        h.stride(0), h.stride(1), dw_part.stride(0), dw_part.stride(1), BLOCK_N=bn, BLOCK_K=bk, **launch)
    dx_rows = torch.empty((p.padded_rows, d_model), device=x.device, dtype=inter)  # (P, d)
    _dx_rows_kernel[(p.n_blocks, triton.cdiv(d_model, bn))](
        dg, du, w_gate, w_up, dx_rows, p.block_expert, p.block_rows, ffn, d_model, dg.stride(0), dg.stride(1),
        w_gate.stride(0), w_gate.stride(1), w_gate.stride(2), dx_rows.stride(0), dx_rows.stride(1),
        BLOCK_N=bn, BLOCK_K=bk, **launch)
    dx = _unpermute(dx_rows, p.inv, inter, tile, emulate).to(x.dtype)  # (T, d)

    # weight gradients: (BLOCK_N, BLOCK_N) tiles of dW[e], reducing over the expert's rows BLOCK_M at a time
    dwg = torch.empty((n_experts, d_model, ffn), device=x.device, dtype=inter)  # (E, d, f)
    dwu = torch.empty_like(dwg)
    dwd = torch.empty((n_experts, ffn, d_model), device=x.device, dtype=inter)  # (E, f, d)
    for a, b, b2, dw, dw2, a_gather, scaled in ((x, dg, du, dwg, dwu, True, False),
                                                (h, dout, dout, dwd, dwd, False, True)):
        rows_r, cols_c = dw.shape[1], dw.shape[2]
        _expert_grad_kernel[(n_experts, triton.cdiv(rows_r, bn), triton.cdiv(cols_c, bn))](
            a, b, b2, dw, dw2, p.row_token, p.row_weight, p.block_expert, p.block_rows, p.expert_blocks,
            rows_r, cols_c, a.stride(0), a.stride(1), b.stride(0), b.stride(1), dw.stride(0), dw.stride(1),
            dw.stride(2), BLOCK_R=bn, BLOCK_C=bn, A_GATHER=a_gather, B_GATHER_SCALED=scaled, TWO_B=not scaled,
            **launch)
    d_weight_rows = dw_part.sum(dim=1)  # (P,): Σ of the f tiles' parts
    grads = (dw.to(x.dtype) for dw in (dwg, dwu, dwd))
    return dx, *grads, d_weight_rows[p.inv.long()]  # d route_weight: (T, k)


class TritonMoE(torch.autograd.Function):
    """out = Σ_slots route_weight · expert(x); gradients for x, the three expert weights and route_weight."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, route_weight, route_idx, tile):
        x, w_gate, w_up, w_down = (t.contiguous() for t in (x, w_gate, w_up, w_down))
        p = plan(route_idx, route_weight.detach(), w_gate.shape[0], tile["block_m"])
        out, h, g, u = moe_forward(x, w_gate, w_up, w_down, p, tile, save_pre=any(ctx.needs_input_grad[:5]))
        ctx.save_for_backward(x, w_gate, w_up, w_down, h, g, u)
        ctx.plan, ctx.tile, ctx.weight_dtype = p, tile, route_weight.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        x, w_gate, w_up, w_down, h, g, u = ctx.saved_tensors
        dx, dwg, dwu, dwd, dweight = moe_backward(dout, x, w_gate, w_up, w_down, h, g, u, ctx.plan, ctx.tile)
        return dx, dwg, dwu, dwd, dweight.to(ctx.weight_dtype), None, None


def moe(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, route_idx: torch.Tensor,
        route_weight: torch.Tensor, *, block_m: int = 64, block_n: int = 64, block_k: int = 32, num_warps: int = 4,
        num_stages: int = 2, input_precision: str = "ieee", emulate_bf16: bool | None = None) -> torch.Tensor:
    """Differentiable routed SwiGLU experts: x (T, d) -> (T, d) in x's dtype (see the module docstring)."""
    _check_inputs(x, w_gate, w_up, w_down, route_idx, route_weight, input_precision)
    (n_tokens, top_k), (n_experts, d_model, ffn) = route_idx.shape, w_gate.shape
    # refuses what the kernels cannot address (T = 0 is fine: its grids are empty)
    moe_launch(max(n_tokens, 1), d_model, ffn, n_experts, top_k, block_m=block_m, block_n=block_n, block_k=block_k,
               num_warps=num_warps, num_stages=num_stages)
    tile = dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                input_precision=input_precision, emulate_bf16=emulate_bf16)
    return TritonMoE.apply(x, w_gate, w_up, w_down, route_weight, route_idx, tile)
