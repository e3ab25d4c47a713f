"""Scaled fp8 GEMM, C = (A_q · s_a) @ (B_q · s_b), forward only.

The operands arrive quantized (posttrainllm.ops.quantize.quantize_fp8, once per case, in PyTorch): A_q (M, K) and
B_q (K, N) in float8_e4m3fn, with fp32 dequantization scales s_a and s_b, per tensor (0-dim each) or rowwise
(s_a (M, 1): one per row of A; s_b (1, N): one per column of B). Each program computes one (BLOCK_M, BLOCK_N)
tile of C with tl.dot on the fp8 operands into an fp32 accumulator (each K slab's partial sum added in fp32:
max_num_imprecise_acc, below), walking K as ops/matmul/kernels.py does (the same GROUP_M ordering and wrapped rows and
columns). The scales are applied once, in the epilogue: a scale constant along K factors out of the sum,
Σ_k (a_mk s_m)(b_kn s_n) = s_m s_n Σ_k a_mk b_kn, so the tile is multiplied by s_a[rows] · s_b[cols] before
the store, in bf16.

Quantizing stays out of the kernel: Triton's interpreter casts fp32 -> fp8 wrongly (docs/parity.md, Triton on CPU),
while its fp8 loads and tl.dot on them are exact against the upcast product. Under the interpreter the tile is
stored in fp32 and PyTorch rounds it to bf16 (its fp32 -> bf16 cast truncates, see ops/matmul/kernels.py). On the GPU,
tl.dot on fp8 takes K in steps of 32 (Triton's min_dot_size for 8-bit operands): BLOCK_K >= 32.

Gradients of a quantized GEMM are a recipe's (e5m2 dY, its own scaling), not this kernel's: `fp8_matmul` returns
no autograd history.

Layout: any strides. B K-major (column-major (K, N)) is what Hopper's fp8 wgmma reads, and what op=matmul's inputs
give it (ops/matmul/definition.py make_inputs, once per case); the GPU needs compute capability 8.9 for tl.dot on fp8
(ops/matmul/definition.py triton_fp8_refusal).

Shapes: a (M, K), b (K, N) -> c (M, N) bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from posttrainllm.ops import use_bf16_emulation
from posttrainllm.ops.matmul.kernels import grouped_tile, k_walk, matmul_launch, store_tile

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # e5m2: a training recipe's gradients (ops/quantize.py fp8_linear)
MIN_BLOCK_K = 32  # tl.dot on 8-bit operands (NVIDIA): K per MMA step


@triton.jit
def _fp8_matmul_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr,
    M, N, K,
    stride_am, stride_ak,
    stride_bk, stride_bn,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    ROWWISE: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)  # grouped ordering of the tiles

    # -- rows of A and columns of B, wrapped modulo M and N: a ragged edge tile re-reads valid ones (never stored)
    offs_m = (pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    # -- Σ_k A_q B_q over K in fp32, on the fp8 operands as loaded (ops/matmul/kernels.py k_walk, its FP8 dot)
    acc = k_walk(a_ptrs, b_ptrs, offs_k, K, stride_ak, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, "ieee", False,
                 True)

    # -- epilogue: the scales, once per tile (rowwise: A's of each row, B's of each column)
    if ROWWISE:
        a_s = tl.load(a_scale_ptr + offs_m)[:, None]  # (BLOCK_M, 1)
        b_s = tl.load(b_scale_ptr + offs_n)[None, :]  # (1, BLOCK_N)
    else:
        a_s = tl.load(a_scale_ptr)
        b_s = tl.load(b_scale_ptr)
    acc = acc * a_s * b_s
    store_tile(c_ptr, acc, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)


def scaling_of(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> str:
    """"tensor" (both scales hold one value) or "row" (a_scale (M, 1), b_scale (1, N)); anything else is refused."""
    (M, _), N = a.shape, b.shape[1]
    if a_scale.numel() == 1 and b_scale.numel() == 1:
        return "tensor"
    if tuple(a_scale.shape) == (M, 1) and tuple(b_scale.shape) == (1, N):
        return "row"
    raise ValueError(f"scales {tuple(a_scale.shape)} and {tuple(b_scale.shape)}: expected one value each (per "
                     f"tensor), or ({M}, 1) and (1, {N}) (rowwise)")


def fp8_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    block_m: int = 64,
    block_n: int = 64,
    block_k: int = 32,
    group_m: int = 8,
    num_warps: int = 4,
    num_stages: int = 2,
    emulate_bf16: bool | None = None,
) -> torch.Tensor:
    """(a · a_scale) @ (b · b_scale) -> (M, N) bf16; a (M, K), b (K, N) float8_e4m3fn, any strides; fp32 scales.

    emulate_bf16: None = store fp32 and round to bf16 in PyTorch only under the interpreter; False/True force it.
    """
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"expected 2-D a (M, K) and b (K, N), got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dims differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        raise ValueError(f"dtypes {a.dtype} and {b.dtype}: expected {FP8_DTYPES}")
    if a_scale.dtype != torch.float32 or b_scale.dtype != torch.float32:
        raise ValueError(f"scales are {a_scale.dtype} and {b_scale.dtype}: expected torch.float32")
    if len({a.device, b.device, a_scale.device, b_scale.device}) != 1:
        raise ValueError("a, b and their scales must be on one device")
    if block_k < MIN_BLOCK_K:
        raise ValueError(f"block_k={block_k}: tl.dot on fp8 takes K in steps of {MIN_BLOCK_K}")
    rowwise = scaling_of(a, a_scale, b, b_scale) == "row"

    (M, K), N = a.shape, b.shape[1]
    launch = matmul_launch(M, N, K, block_m=block_m, block_n=block_n, block_k=block_k, group_m=group_m,
                           num_warps=num_warps, num_stages=num_stages)
    upcast = use_bf16_emulation(torch.bfloat16, emulate_bf16)
    c = torch.empty((M, N), device=a.device, dtype=torch.float32 if upcast else torch.bfloat16)
    a_s, b_s = a_scale.contiguous().reshape(-1), b_scale.contiguous().reshape(-1)  # (M,) or (1,); (N,) or (1,)
    _fp8_matmul_kernel[tuple(launch["grid"])](
        a, b, c, a_s, b_s, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, EVEN_K=launch["even_k"],
        ROWWISE=rowwise, num_warps=num_warps, num_stages=num_stages,
    )
    return c.to(torch.bfloat16)
