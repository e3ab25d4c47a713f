"""Tiled GEMM, C = A @ B, with grouped program ordering.

Each program computes one (BLOCK_M, BLOCK_N) tile of C, walking K in BLOCK_K
steps with an fp32 accumulator. Programs are numbered in groups of GROUP_M tile
rows ("super-grouping", as in Triton's matmul tutorial): consecutive programs
share the same columns of B while they are hot in L2, instead of sweeping a whole
row of C and evicting B.

bf16 under Triton's interpreter: loads of bf16 and `.to(tl.float32)` on them are
exact, and storing a bf16 tile is exact, but `tl.dot` computes on the raw bf16
bits (errors ~1e8 and more) and fp32 -> bf16 conversion truncates instead of
rounding to nearest. With UPCAST_DOT the dot operands are upcast to fp32 (bf16
products are exact in fp32, so this matches the GPU's bf16 MMA up to summation
order) and the kernel stores fp32, which PyTorch rounds to bf16.

Backward (TritonMatmul): dA = dC @ Bᵀ and dB = Aᵀ @ dC, the same kernel on
transposed views. `linear` is nn.Linear's x @ Wᵀ (no bias) on top of it.

Shapes: a (M, K), b (K, N) -> c (M, N).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from posttrainllm.ops import use_bf16_emulation
from posttrainllm.ops.autotune import autotune_smem, chosen_config
from posttrainllm.ops.matmul.config import smem_bytes as matmul_smem_bytes  # the one formula (config.py)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INPUT_PRECISIONS = ("ieee", "tf32")


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (pid_m, pid_n), GROUP_M tile rows at a time, so programs running together share B's columns
    (Triton's matmul tutorial, "L2 cache optimizations"). Used by every GEMM kernel here (ops/matmul/fp8.py too)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def k_walk(a_ptrs, b_ptrs, offs_k, K, stride_ak, stride_bk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
           FP8: tl.constexpr):
    """Σ_k A B over K into an fp32 (BLOCK_M, BLOCK_N) accumulator, from the first K-slab's pointers. With EVEN_K
    (K a multiple of BLOCK_K) no slab is ragged and no load is masked; otherwise masked lanes load 0, so a ragged
    last slab adds nothing. FP8 (ops/matmul/fp8.py): tl.dot on the 8-bit operands as loaded, each slab's partial
    sum added into the fp32 accumulator (max_num_imprecise_acc=BLOCK_K: on sm_90 wgmma accumulates fp8 products
    below fp32, and Triton's default never promotes); else at INPUT_PRECISION, upcast first with UPCAST_DOT."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if FP8:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            if UPCAST_DOT:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def store_tile(c_ptr, acc, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile (pid_m, pid_n) of C in C's dtype; rows and columns past M and N (the wrapped ones) are not stored."""
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak,
    stride_bk, stride_bn,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)  # grouped ordering of the tiles

    # -- rows of A and columns of B this tile reads, wrapped modulo M and N (as Triton's matmul tutorial
    #    does): a ragged edge tile re-reads valid rows instead of masking every load; its extra results are
    #    never stored. 64-bit: a 65k-token x 128k-vocab C is 8.4e9 elements, past int32; the K walk
    #    advances the pointers themselves
    offs_m = (pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)

    # -- pointers to the first K-slab of A (BLOCK_M, BLOCK_K) and B (BLOCK_K, BLOCK_N)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    acc = k_walk(a_ptrs, b_ptrs, offs_k, K, stride_ak, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                 INPUT_PRECISION, UPCAST_DOT, False)
    store_tile(c_ptr, acc, pid_m, pid_n, M, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)  # fp32 when emulating bf16


def _check_block(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= 16")


def matmul_launch(
    M: int, N: int, K: int, *, block_m: int, block_n: int, block_k: int, group_m: int,
    num_warps: int, num_stages: int,
) -> dict:
    """Dispatch geometry for an (M, K) @ (K, N) product: one program per C tile."""
    for name, size in (("M", M), ("N", N), ("K", K)):
        if size < 1:
            raise ValueError(f"{name}={size} must be >= 1")
    for name, block in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        _check_block(name, block)
    if group_m < 1:
        raise ValueError(f"group_m={group_m} must be >= 1")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps={num_warps} must be a power of two")
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    n_programs = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    return {
        "grid": [n_programs],
        "block_m": block_m, "block_n": block_n, "block_k": block_k, "group_m": group_m,
        "even_k": K % block_k == 0,  # the K loop's loads carry no mask
        "num_warps": num_warps, "num_stages": num_stages,
    }


# --- autotuning (tile=auto / workgroup=auto): CUDA only ---------------------------------------
# do_bench needs a GPU driver; under Triton's interpreter `auto` runs the given configuration
# (ops/autotune.py AUTO_CPU_NOTE). Configurations are pruned by the shared memory the
# device reports, by the formula the config check reads too (config.py `smem_bytes`).

# (block_m, block_n, block_k, warps, stages): Triton's matmul tutorial's CUDA set, wide to narrow
MATMUL_SPACE = [
    (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
    (128, 256, 32, 8, 4), (128, 128, 32, 4, 4), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (64, 64, 64, 4, 3),
]


_TUNERS: dict = {}
LAST_AUTOTUNE: dict[str, dict] = {}  # "matmul" -> the configuration the autotuner chose at its last launch
# The tuner's key: the sizes and A's and B's strides. dA = dC @ Bᵀ and dB = Aᵀ @ dC run this kernel on transposed
# views (TritonMatmul), so at M = N = K only their strides tell them from the forward: without them the backward
# reused the forward's choice, tuned for row-major operands.
TUNE_KEY = ["M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn"]


def _tuner(space, smem: int, itemsize: int):
    key = (tuple(space), smem, itemsize)
    if key not in _TUNERS:
        configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm}, num_warps=w,
                                 num_stages=st)
                   for bm, bn, bk, gm, w, st in space if matmul_smem_bytes(bm, bn, bk, st, itemsize) <= smem]
        if not configs:
            raise ValueError(f"no matmul autotune configuration fits {smem} B of shared memory")
        even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_matmul_kernel)
        _TUNERS[key] = triton.autotune(configs=configs, key=TUNE_KEY)(even_k)
    return _TUNERS[key]


def _space(tile: tuple[int, int, int, int, int, int], tune_tiles: bool):
    """Every (blocks, GROUP_M, warps, stages) when tiles are tuned; else the fixed blocks with warps x stages."""
    if tune_tiles:
        return [(bm, bn, bk, tile[3], w, st) for bm, bn, bk, w, st in MATMUL_SPACE]
    return [(*tile[:4], w, st) for w in (4, 8) for st in (2, 3, 4)]


def kernel_args(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple:
    """_matmul_kernel's arguments up to its strides, in order: the pointers, M, N, K, then A's, B's and C's strides."""
    (M, K), N = a.shape, b.shape[1]
    return (a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))


def triton_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    block_m: int = 64,
    block_n: int = 64,
    block_k: int = 32,
    group_m: int = 8,
    num_warps: int = 4,
    num_stages: int = 2,
    input_precision: str = "ieee",
    emulate_bf16: bool | None = None,
    autotune: str | None = None,
) -> torch.Tensor:
    """a (M, K) @ b (K, N) -> (M, N) in a's dtype; any strides.

    input_precision is tl.dot's: "ieee" for true fp32, "tf32" for TF32 tensor cores
    (16-bit inputs ignore it). emulate_bf16: None = upcast bf16 dot operands only
    under the interpreter; False/True force it off/on. autotune: None = the given tile;
    "tile" = blocks, warps and stages jointly; "workgroup" = warps and stages at the given
    blocks; on CUDA only (elsewhere the given configuration runs).
    """
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"expected 2-D a (M, K) and b (K, N), got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dims differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"dtype mismatch: a is {a.dtype}, b is {b.dtype}")
    if a.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {a.dtype} not supported; choose one of {SUPPORTED_DTYPES}")
    if a.device != b.device:
        raise ValueError(f"device mismatch: a is on {a.device}, b is on {b.device}")
    if input_precision not in INPUT_PRECISIONS:
        raise ValueError(f"input_precision={input_precision!r}; choose one of {INPUT_PRECISIONS}")

    (M, K), N = a.shape, b.shape[1]
    launch = matmul_launch(
        M, N, K, block_m=block_m, block_n=block_n, block_k=block_k, group_m=group_m,
        num_warps=num_warps, num_stages=num_stages,
    )
    upcast = use_bf16_emulation(a.dtype, emulate_bf16)
    c = torch.empty((M, N), device=a.device, dtype=torch.float32 if upcast else a.dtype)
    args = kernel_args(a, b, c)
    smem = None
    if autotune:  # the device's (or a compile target's) shared-memory limit: ops/autotune.py
        smem = autotune_smem(a)
    if smem is not None:
        tile = (block_m, block_n, block_k, group_m, num_warps, num_stages)
        tuner = _tuner(_space(tile, autotune == "tile"), smem, a.element_size())
        tuner[lambda m: (triton.cdiv(M, m["BLOCK_M"]) * triton.cdiv(N, m["BLOCK_N"]),)](
            *args, INPUT_PRECISION=input_precision, UPCAST_DOT=upcast)
        LAST_AUTOTUNE["matmul"] = chosen_config(tuner)
    else:
        _matmul_kernel[tuple(launch["grid"])](
            *args,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, EVEN_K=launch["even_k"],
            INPUT_PRECISION=input_precision, UPCAST_DOT=upcast,
            num_warps=num_warps, num_stages=num_stages,
        )
    return c.to(a.dtype)


class TritonMatmul(torch.autograd.Function):
    """C = A @ B with both gradients from the same kernel on transposed views.

    dA = dC @ Bᵀ and dB = Aᵀ @ dC: `.t()` only swaps strides, and the kernel takes any
    strides, so neither transpose is copied.
    """

    @staticmethod
    def forward(ctx, a, b, tile):
        ctx.save_for_backward(a, b)
        ctx.tile = tile
        return triton_matmul(a, b, **tile)  # (M, N)

    @staticmethod
    @once_differentiable
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        da = db = None
        if ctx.needs_input_grad[0]:
            da = triton_matmul(dc, b.t(), **ctx.tile)  # (M, N) @ (N, K) -> (M, K)
        if ctx.needs_input_grad[1]:
            db = triton_matmul(a.t(), dc, **ctx.tile)  # (K, M) @ (M, N) -> (K, N)
        return da, db, None


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    block_m: int = 64,
    block_n: int = 64,
    block_k: int = 32,
    group_m: int = 8,
    num_warps: int = 4,
    num_stages: int = 2,
    input_precision: str = "ieee",
    autotune: str | None = None,
) -> torch.Tensor:
    """Differentiable a (M, K) @ b (K, N) -> (M, N) in a's dtype; forward and backward share the tiles
    (and, with autotune, the tuner: its key holds the sizes and strides, TUNE_KEY, so dA and dB are tuned as their
    own problems)."""
    tile = dict(block_m=block_m, block_n=block_n, block_k=block_k, group_m=group_m,
                num_warps=num_warps, num_stages=num_stages, input_precision=input_precision, autotune=autotune)
    return TritonMatmul.apply(a, b, tile)


def linear(x: torch.Tensor, weight: torch.Tensor, **tile) -> torch.Tensor:
    """x @ weightᵀ as nn.Linear without bias: x (..., in), weight (out, in) -> (..., out).

    Leading dims are flattened into rows for the 2-D kernel; `tile` takes matmul's keywords.
    """
    if weight.ndim != 2:
        raise ValueError(f"expected 2-D weight (out, in), got {tuple(weight.shape)}")
    if x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not end in weight's in-features {weight.shape[1]}")
    rows = x.reshape(-1, x.shape[-1])  # (N, in), a view when x allows it
    out = matmul(rows, weight.t(), **tile)  # (N, in) @ (in, out) -> (N, out)
    return out.reshape(*x.shape[:-1], weight.shape[0])
