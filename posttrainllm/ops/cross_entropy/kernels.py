"""Fused linear cross-entropy: the lm_head and the mean cross-entropy without the (N, V) logits.

As Liger-Kernel's fused linear cross-entropy does it: the tokens are taken a chunk at a time.
For each chunk,
    logits = h_chunk @ weightᵀ            (chunk, V) fp32, the only logits alive at once
    the kernel, one program per row, walks the vocabulary in BLOCK_V blocks twice:
        pass 1  online max m and sum-exp d = Σ exp(x − m) (the max subtracted: logits of 1e5 do not
                overflow), the target's logit, Σ x for label smoothing -> the row's loss
        pass 2  overwrites the logits with the loss's gradient (softmax − (1 − ε)·one_hot − ε/V) · scale
    grad_h_chunk = dlogits @ weight   and   grad_weight += dlogitsᵀ @ h_chunk
all inside the forward. The autograd backward only scales the saved gradients by the upstream scalar.

Memory, what the forward allocates (tests/ops/test_cross_entropy.py holds it at bf16): one (chunk, V) fp32
block of logits, reused by every chunk; at bf16/fp16 with gradients asked, its (chunk, V) copy in the inputs'
dtype for the backward GEMMs; grad_h (N, C) fp32 and grad_weight (V, C) fp32 where asked; the (N,) fp32 row
losses. No copy of the weight (on the CPU, slabs of CPU_SLAB vocabulary rows upcast at a time: _gemm). The
reference holds the (N, V) logits and log-probabilities (and their gradients).

The mean: scale = 1 / n_valid, the tokens of the whole batch whose target is not ignore_index, for the
loss and the gradients of every chunk alike. Ignored rows have zero loss and zero gradient; with every
target ignored the mean of nothing is NaN (as F.cross_entropy's) and the gradients are zero.
Label smoothing ε: loss_row = (1 − ε)·(lse − x_y) + ε·(lse − Σ_j x_j / V).

Precision: the three GEMMs take their operands in the inputs' dtype and sum in fp32 (_gemm: a tensor-core GEMM
with an fp32 result), so the logits, the loss and the gradients' accumulation are fp32 whatever h's dtype. At
bf16/fp16 the backward GEMMs take the gradient rounded to the inputs' dtype, as Liger's do, but unscaled
(softmax − one_hot, in [−1, 1]) with the scale applied to their fp32 result: times 1/n_valid its entries of
~1/(V·N) underflow fp16 (N 2048, V 32768: 88% of them zero, grad_h rows off by up to 2%, 40x fp16's own
rounding). The gradients are cast to the inputs' dtypes after the upstream scale. The kernel sees only fp32, so
the interpreter's bf16 defect does not reach it.

Shapes: h (N, C), weight (V, C), targets (N,) int64 (any stride) -> a 0-dim fp32 loss.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from posttrainllm.ops.rows import check_block, check_sizes, check_warps

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _cross_entropy_kernel(
    logits_ptr, stride_row,  # (rows, V) fp32, unit stride along V; overwritten with dloss/dlogits (WRITE_GRAD)
    targets_ptr, stride_target,  # (rows,) int64, any stride (a view such as targets[::2])
    loss_ptr,  # (rows,) fp32: each row's loss times scale
    V, scale, ignore_index, label_smoothing,
    BLOCK_V: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * stride_row
    target = tl.load(targets_ptr + row * stride_target)
    cols = tl.arange(0, BLOCK_V)

    # -- an ignored row: no loss, no gradient
    if target == ignore_index:
        if WRITE_GRAD:
            for start in range(0, V, BLOCK_V):
                tl.store(logits_ptr + start + cols, tl.zeros((BLOCK_V,), dtype=tl.float32), mask=start + cols < V)
        tl.store(loss_ptr + row, 0.0)
        return

    # -- pass 1: online max and sum-exp over the vocabulary (d is rescaled whenever the max grows)
    m = float("-inf")
    d = 0.0
    sum_x = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        x = tl.load(logits_ptr + offs, mask=offs < V, other=float("-inf"))
        block_max = tl.max(x, 0)
        m_new = tl.maximum(m, block_max)
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
        if HAS_SMOOTHING:
            sum_x += tl.sum(tl.where(offs < V, x, 0.0), 0)
    lse = m + tl.log(d)
    x_target = tl.load(logits_ptr + target)  # read before pass 2 overwrites it
    loss = lse - x_target
    if HAS_SMOOTHING:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - sum_x / V)
    tl.store(loss_ptr + row, loss * scale)

    # -- pass 2: the gradient of the row's loss in place of its logits
    if WRITE_GRAD:
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            x = tl.load(logits_ptr + offs, mask=offs < V, other=0.0)
            grad = tl.exp(x - m) / d - label_smoothing / V  # softmax − ε/V
            grad = tl.where(offs == target, grad - (1.0 - label_smoothing), grad)  # − (1 − ε)·one_hot
            tl.store(logits_ptr + offs, grad * scale, mask=offs < V)


def cross_entropy_launch(N: int, C: int, V: int, *, chunk_size: int, block_v: int, num_warps: int) -> dict:
    """Dispatch geometry: ceil(N / chunk_size) chunks, each one kernel launch of one program per row."""
    check_sizes(N=N, C=C, V=V, chunk_size=chunk_size)
    check_block("block_v", block_v)
    check_warps(num_warps)
    chunk = min(chunk_size, N)
    return {"chunks": triton.cdiv(N, chunk), "chunk_rows": chunk, "grid_per_chunk": [chunk], "block_v": block_v,
            "vocab_blocks": triton.cdiv(V, block_v), "num_warps": num_warps,
            "logits_bytes_per_chunk": chunk * V * 4}


def _check_inputs(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                  label_smoothing: float) -> None:
    if h.ndim != 2 or weight.ndim != 2 or targets.ndim != 1:
        raise ValueError(f"expected h (N, C), weight (V, C) and targets (N,), got {tuple(h.shape)}, "
                         f"{tuple(weight.shape)} and {tuple(targets.shape)}")
    if h.shape[1] != weight.shape[1] or h.shape[0] != targets.shape[0]:
        raise ValueError(f"shapes differ: h {tuple(h.shape)}, weight {tuple(weight.shape)}, "
                         f"targets {tuple(targets.shape)}")
    if h.dtype != weight.dtype or h.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"h is {h.dtype} and weight {weight.dtype}: give one dtype of {SUPPORTED_DTYPES}")
    if targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 class ids, got {targets.dtype}")
    if not h.device == weight.device == targets.device:
        raise ValueError(f"device mismatch: h {h.device}, weight {weight.device}, targets {targets.device}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= weight.shape[0]))
    if bool(bad.any()):
        raise ValueError(f"{int(bad.sum())} targets outside [0, V={weight.shape[0]}) and not "
                         f"ignore_index={ignore_index}")


CPU_SLAB = 1024  # rows (of the vocabulary) each 16-bit GEMM upcasts at a time on the CPU (_gemm)


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, alpha: float = 1.0,
          accumulate: bool = False) -> torch.Tensor:
    """out = alpha · (a @ b), or out += alpha · (a @ b) with accumulate: a and b in one dtype, out fp32, every
    product summed in fp32 (what a tensor-core GEMM with fp32 accumulation computes).

    fp32: torch's GEMM. bf16/fp16 on CUDA: cuBLAS's 16-bit GEMM keeping its fp32 result (out_dtype). The CPU has no
    16-bit GEMM with an fp32 result (aten::mm.dtype is CUDA's); a product of two 16-bit values is exact in fp32, so
    fp32 GEMMs on slabs upcast CPU_SLAB at a time along the longest dimension (the vocabulary) compute the same sum,
    in another order, without an fp32 copy of the weight."""
    beta = 1.0 if accumulate else 0.0  # 0: out's old contents (torch.empty's) are ignored, NaN included
    if a.dtype == torch.float32:
        return torch.addmm(out, a, b, beta=beta, alpha=alpha, out=out)
    if a.is_cuda:
        return torch.addmm(out, a, b, out_dtype=torch.float32, beta=beta, alpha=alpha, out=out)
    (M, K), N = a.shape, b.shape[1]
    if K >= max(M, N):  # the sum itself in slabs: dlogits @ weight
        for k in range(0, K, CPU_SLAB):
            out.addmm_(a[:, k:k + CPU_SLAB].float(), b[k:k + CPU_SLAB].float(), beta=beta if k == 0 else 1.0,
                       alpha=alpha)
    elif N >= M:  # slabs of out's columns: h_chunk @ weightᵀ
        a32 = a.float()
        for j in range(0, N, CPU_SLAB):
            out[:, j:j + CPU_SLAB].addmm_(a32, b[:, j:j + CPU_SLAB].float(), beta=beta, alpha=alpha)
    else:  # slabs of out's rows: dlogitsᵀ @ h_chunk
        b32 = b.float()
        for i in range(0, M, CPU_SLAB):
            out[i:i + CPU_SLAB].addmm_(a[i:i + CPU_SLAB].float(), b32, beta=beta, alpha=alpha)
    return out


def fused_linear_cross_entropy_forward(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    chunk_size: int = 16,
    block_v: int = 256,
    num_warps: int = 4,
    grad_h: bool = True,
    grad_weight: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The mean loss (0-dim fp32) and, where asked, d loss / d h (N, C) and d loss / d weight (V, C), both fp32."""
    _check_inputs(h, weight, targets, ignore_index, label_smoothing)
    (N, C), V = h.shape, weight.shape[0]
    launch = cross_entropy_launch(N, C, V, chunk_size=chunk_size, block_v=block_v, num_warps=num_warps)
    n_valid = int((targets != ignore_index).sum())  # the mean's divisor: the whole batch's non-ignored tokens
    scale = 1.0 / n_valid if n_valid else 0.0
    write_grad = grad_h or grad_weight
    loss_rows = torch.empty(N, device=h.device, dtype=torch.float32)  # (N,) each row's loss times scale
    dh = torch.empty(N, C, device=h.device, dtype=torch.float32) if grad_h else None
    dw = torch.zeros(V, C, device=h.device, dtype=torch.float32) if grad_weight else None
    chunk = launch["chunk_rows"]
    logits_buffer = torch.empty(chunk, V, device=h.device, dtype=torch.float32)  # reused by every chunk
    # bf16/fp16: the backward GEMMs' operand, the chunk's gradient unscaled in h's dtype; the scale goes on their result
    narrow = h.dtype != torch.float32 and write_grad
    grad_buffer = torch.empty(chunk, V, device=h.device, dtype=h.dtype) if narrow else None
    grad_scale = scale if narrow else 1.0
    for start in range(0, N, chunk):
        end = min(start + chunk, N)
        h_chunk = h[start:end]  # (n, C) in h's dtype
        logits = _gemm(h_chunk, weight.t(), logits_buffer[:end - start])  # (n, V) fp32
        _cross_entropy_kernel[(end - start,)](
            logits, logits.stride(0), targets[start:end], targets.stride(0), loss_rows[start:end],
            V, scale, ignore_index, label_smoothing,
            BLOCK_V=block_v, WRITE_GRAD=write_grad, HAS_SMOOTHING=label_smoothing > 0.0, num_warps=num_warps,
        )
        # logits now hold dloss/dlogits of the chunk's rows
        grad = torch.mul(logits, n_valid, out=grad_buffer[:end - start]) if narrow else logits
        if dh is not None:
            _gemm(grad, weight, dh[start:end], alpha=grad_scale)  # (n, V) @ (V, C)
        if dw is not None:
            _gemm(grad.t(), h_chunk, dw, alpha=grad_scale, accumulate=True)  # += (V, n) @ (n, C)
    # every target ignored: the mean of nothing, NaN as F.cross_entropy's 0/0
    loss = loss_rows.sum() if n_valid else torch.full((), float("nan"), device=h.device)
    return loss, dh, dw


class FusedLinearCrossEntropy(torch.autograd.Function):
    """The loss with its gradients computed in the forward; the backward scales them by d(out), in place.

    The gradients are kept on ctx, not saved: scaling them in place needs no second (V, C) buffer, so a
    backward can run once per forward (retain_graph is refused, as Liger's and torch's chunked loss do).
    """

    @staticmethod
    def forward(ctx, h, weight, targets, options):
        loss, dh, dw = fused_linear_cross_entropy_forward(h, weight, targets, **options)
        ctx.grads = (dh, dw)
        ctx.dtypes = (h.dtype, weight.dtype)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, dloss):
        if ctx.grads is None:
            raise RuntimeError("the fused cross-entropy's gradients were already used: one backward per forward")
        (dh, dw), (h_dtype, w_dtype) = ctx.grads, ctx.dtypes
        ctx.grads = None
        grad_h = None if dh is None else dh.mul_(dloss).to(h_dtype)
        grad_w = None if dw is None else dw.mul_(dloss).to(w_dtype)
        return grad_h, grad_w, None, None


def fused_linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    chunk_size: int = 16,
    block_v: int = 256,
    num_warps: int = 4,
) -> torch.Tensor:
    """Differentiable mean cross-entropy of h (N, C) @ weight (V, C)ᵀ against targets (N,): a 0-dim fp32 loss.

    The gradients are computed in the forward only for the inputs that require them with grad mode on;
    a call under torch.no_grad() computes the loss alone (one (chunk_size, V) block of logits at a time).
    """
    grad_mode = torch.is_grad_enabled()
    options = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, chunk_size=chunk_size,
                   block_v=block_v, num_warps=num_warps, grad_h=grad_mode and h.requires_grad,
                   grad_weight=grad_mode and weight.requires_grad)
    return FusedLinearCrossEntropy.apply(h, weight, targets, options)
