"""Rotary position embedding (RoPE), "rotate half" layout: one elementwise pass over a (B, H, T, D) tensor.

Pair i of a head, (x[..., i], x[..., i + D/2]), is rotated by the angle of its row's position at pair i's
frequency; the angles come in as tables cos, sin (T, D/2), fp32, for positions [offset, offset + T)
(posttrainllm/ops/rope/reference.py `rope_tables`; a tree verification passes one row per entry). The math
is posttrainllm.ops.rope.reference.rope:

    y1 = x1 · cos − x2 · sin        x1 = x[..., :D/2], x2 = x[..., D/2:]
    y2 = x1 · sin + x2 · cos

Each program takes one (b, h) and a block of BLOCK_T rows of it: it loads both halves of every row and the
rows' table entries, rotates in fp32, and stores y in x's dtype. D/2 is padded to a power of two and masked
(D = 34: 17 lanes of 32), as are the rows past T. x and y may have any strides: the model hands in q and k as
transposed views of its projections (B, T, heads, D) -> (B, heads, T, D), read without a copy.

Backward: a rotation is orthogonal, so dx = Rᵀ dy is the rotation by −angle: the same kernel with sin
negated (INVERSE). cos and sin are constants (the model's buffers): no gradient flows to them.

Not in place: the model's q and k are fresh projections, so y could overwrite x there and save the output
buffer, but the lab's kernel-stage guard refuses a path that writes into its inputs (lab/isolation/guards.py), and the
lab checks the function the model trains. Every call here writes a new y.

bf16 under Triton's interpreter: loads of bf16 and `.to(tl.float32)` are exact, but fp32 -> bf16 casts
truncate instead of rounding (ops/__init__.py): with EMULATE_BF16 the kernel stores fp32 and PyTorch rounds.

Shapes: x (B, H, T, D), cos and sin (T, D/2) -> y (B, H, T, D) in x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from posttrainllm.ops import use_bf16_emulation

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, y_ptr,
    H, T, HALF,
    stride_xb, stride_xh, stride_xt, stride_xd,
    stride_ct, stride_cd,
    stride_st, stride_sd,
    stride_yb, stride_yh, stride_yt, stride_yd,
    INVERSE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # -- this program's head (b, h) and rows t; 64-bit offsets: B·H·T·D may pass 2^31
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    d = tl.arange(0, BLOCK_D)  # (BLOCK_D,): pair index i, lanes >= D/2 masked
    mask = (t[:, None] < T) & (d[None, :] < HALF)  # (BLOCK_T, BLOCK_D)

    # -- both halves of each row, and the rows' angles, in fp32
    x_rows = x_ptr + b * stride_xb + h * stride_xh + t[:, None] * stride_xt
    x1 = tl.load(x_rows + d[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + (d[None, :] + HALF) * stride_xd, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t[:, None] * stride_ct + d[None, :] * stride_cd, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t[:, None] * stride_st + d[None, :] * stride_sd, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:  # the backward: rotate by −angle (Rᵀ)
        sin = -sin

    # -- rotate each pair and write both halves in y's dtype (fp32 when the launcher emulates bf16)
    y1 = x1 * cos - x2 * sin
    y2 = x1 * sin + x2 * cos
    y_rows = y_ptr + b * stride_yb + h * stride_yh + t[:, None] * stride_yt
    tl.store(y_rows + d[None, :] * stride_yd, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_rows + (d[None, :] + HALF) * stride_yd, y2.to(y_ptr.dtype.element_ty), mask=mask)


def rope_launch(B: int, H: int, T: int, D: int, *, block_t: int, num_warps: int) -> dict:
    """Dispatch geometry: one program per (b·h, block of BLOCK_T rows); BLOCK_D = D/2 padded to a power of two."""
    for name, size in (("B", B), ("H", H), ("T", T), ("D", D)):
        if size < 1:
            raise ValueError(f"{name}={size} must be >= 1")
    if D % 2:
        raise ValueError(f"head dim D={D} must be even: RoPE rotates pairs (x[i], x[i + D/2])")
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"block_t={block_t} must be a power of two")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps={num_warps} must be a power of two")
    return {"grid": [B * H, triton.cdiv(T, block_t)], "block_t": block_t,
            "block_d": triton.next_power_of_2(D // 2), "num_warps": num_warps}


def triton_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inverse: bool = False,
    block_t: int = 32,
    num_warps: int = 4,
    emulate_bf16: bool | None = None,
) -> torch.Tensor:
    """x (B, H, T, D) rotated by the tables cos, sin (T, D/2) -> (B, H, T, D) in x's dtype, contiguous; x and the
    tables may have any strides. inverse: rotate by −angle (the backward). emulate_bf16: None = store fp32 and
    round in PyTorch only under the interpreter; False/True force it off/on."""
    if x.ndim != 4:
        raise ValueError(f"expected x (B, H, T, D), got shape {tuple(x.shape)}")
    B, H, T, D = x.shape
    launch = rope_launch(B, H, T, D, block_t=block_t, num_warps=num_warps)
    for name, table in (("cos", cos), ("sin", sin)):
        if tuple(table.shape) != (T, D // 2):
            raise ValueError(f"{name} must be (T, D/2) = ({T}, {D // 2}) for x {tuple(x.shape)}, "
                             f"got {tuple(table.shape)}")
        if table.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {table.dtype} not supported; choose one of {SUPPORTED_DTYPES}")
        if table.device != x.device:
            raise ValueError(f"device mismatch: x is on {x.device}, {name} is on {table.device}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {x.dtype} not supported; choose one of {SUPPORTED_DTYPES}")

    upcast = use_bf16_emulation(x.dtype, emulate_bf16)
    y = torch.empty((B, H, T, D), device=x.device, dtype=torch.float32 if upcast else x.dtype)
    _rope_kernel[tuple(launch["grid"])](
        x, cos, sin, y,
        H, T, D // 2,
        *x.stride(), *cos.stride(), *sin.stride(), *y.stride(),
        INVERSE=inverse, BLOCK_T=block_t, BLOCK_D=launch["block_d"],
        num_warps=num_warps,
    )
    return y.to(x.dtype)


class TritonRope(torch.autograd.Function):
    """y = R(angle) x; dx = R(−angle) dy, the same kernel (a rotation's inverse is its transpose).
    The tables get no gradient."""

    @staticmethod
    def forward(ctx, x, cos, sin, options):
        ctx.save_for_backward(cos, sin)
        ctx.options = options
        return triton_rope(x, cos, sin, **options)  # (B, H, T, D)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        dx = triton_rope(dy, cos, sin, inverse=True, **ctx.options)  # (B, H, T, D): Rᵀ dy
        return dx, None, None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, block_t: int = 32,
         num_warps: int = 4) -> torch.Tensor:
    """Differentiable in x: x (B, H, T, D), cos and sin (T, D/2) -> (B, H, T, D) in x's dtype, a new tensor."""
    return TritonRope.apply(x, cos, sin, dict(block_t=block_t, num_warps=num_warps))
