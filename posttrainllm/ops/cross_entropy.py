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
Peak memory: one (chunk, V) block of logits plus grad_weight (V, C) fp32, instead of the reference's
(N, V) logits and log-probabilities (and their gradients).

The mean: scale = 1 / n_valid, the tokens of the whole batch whose target is not ignore_index, for the
loss and the gradients of every chunk alike. Ignored rows have zero loss and zero gradient; with every
target ignored the mean of nothing is NaN (as F.cross_entropy's) and the gradients are zero.
Label smoothing ε: loss_row = (1 − ε)·(lse − x_y) + ε·(lse − Σ_j x_j / V).

Precision: the logits, the loss and the gradients' accumulation are fp32 whatever h's dtype (bf16/fp16
inputs are upcast a chunk at a time, the weight once); the gradients are cast to the inputs' dtypes after
the upstream scale. The kernel sees only fp32, so the interpreter's bf16 defect does not reach it.

Shapes: h (N, C), weight (V, C), targets (N,) int64 (any stride) -> a 0-dim fp32 loss.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

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
    for name, size in (("N", N), ("C", C), ("V", V)):
        if size < 1:
            raise ValueError(f"{name}={size} must be >= 1")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v={block_v} must be a power of two >= 16")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps={num_warps} must be a power of two")
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
    w32 = weight.float()  # (V, C); no copy when weight is fp32
    loss_rows = torch.empty(N, device=h.device, dtype=torch.float32)  # (N,) each row's loss times scale
    dh = torch.empty(N, C, device=h.device, dtype=torch.float32) if grad_h else None
    dw = torch.zeros(V, C, device=h.device, dtype=torch.float32) if grad_weight else None
    chunk = launch["chunk_rows"]
    logits_buffer = torch.empty(chunk, V, device=h.device, dtype=torch.float32)  # reused by every chunk
    for start in range(0, N, chunk):
        end = min(start + chunk, N)
        h_chunk = h[start:end].float()  # (n, C)
        logits = torch.mm(h_chunk, w32.t(), out=logits_buffer[:end - start])  # (n, V) fp32
        _cross_entropy_kernel[(end - start,)](
            logits, logits.stride(0), targets[start:end], targets.stride(0), loss_rows[start:end],
            V, scale, ignore_index, label_smoothing,
            BLOCK_V=block_v, WRITE_GRAD=write_grad, HAS_SMOOTHING=label_smoothing > 0.0, num_warps=num_warps,
        )
        # logits now hold dloss/dlogits of the chunk's rows
        if dh is not None:
            torch.mm(logits, w32, out=dh[start:end])  # (n, V) @ (V, C)
        if dw is not None:
            dw.addmm_(logits.t(), h_chunk)  # += (V, n) @ (n, C)
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
