"""Matmul as a lab op: C = A @ B, A (M, K), B (K, N) -> C (M, N).

Paths (one function each: checked, timed and trained as every projection of the model):
    reference   posttrainllm.ops.matmul.reference.matmul: a @ b
    torch       torch.matmul (BLAS on CPU, cuBLAS on CUDA): on CPU the same call as the reference,
                so their curves must agree within noise (a useful null check of the timer)
    triton      posttrainllm.ops.matmul.kernels: our tiled, GROUP_M-swizzled kernel, forward and backward
    compiled    (opt-in, op.peers) the reference under torch.compile
    user paths  op.user_impls, in the natural signature SIGNATURE (lab/isolation/user.py)

Under a quantized precision (precision=fp8, fp8_rowwise: precision.quantize) the inputs are A_q, a_scale, B_q,
b_scale, quantized once per case by posttrainllm.ops.quantize (make_inputs), and the paths are forward-only
(gradients of a quantized GEMM are a recipe's: e5m2 dY with its own scaling):
    reference   posttrainllm.ops.matmul.reference.fp8_matmul: dequantize, then the product (float64: the oracle)
    scaled_mm   torch._scaled_mm, where it runs on the point's device and scaling (scaled_mm_refusal; absent
                otherwise, named in microbench.json's describe.unavailable)
    triton      posttrainllm.ops.matmul.fp8: tl.dot on the e4m3 operands, fp32 accumulator, scales in the epilogue;
                on CUDA from compute capability 8.9 (triton_fp8_refusal: absent below, named as scaled_mm is),
                and through Triton's interpreter on the CPU
and the microbench times beside them the bf16 GEMM of the same unquantized operands (describe: what fp8 buys).
Both fast paths want B K-major (column-major (K, N)): make_inputs lays it out so once per case, outside every
timed call.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from posttrainllm.config import LabConfig, itemsize
from posttrainllm.ops.base import (LIBRARY, NO_BACKWARD, REFERENCE, BatchAxis, Case, Costs, Impl, ModelHook, OpDef,
                                   Tensors, seeded_randn)
from posttrainllm.ops.autotune import AUTO_CPU_NOTE  # loaded with the definitions: no triton
from posttrainllm.ops.peers import compiled
import posttrainllm.ops.matmul.config as op_config
from posttrainllm.ops.matmul.config import Sizes
import posttrainllm.ops.matmul.reference as matmul_reference
from posttrainllm.ops import quantize

_MATMUL = LIBRARY["torch.matmul"]  # bound at start (base.LIBRARY)


def _reference(x: Tensors, cfg: LabConfig) -> Tensors:
    if "a_scale" in x:  # a quantized point's inputs: dequantize, then the product (bf16 out; float64 stays float64)
        return {"out": matmul_reference.fp8_matmul(*_fp8_args(x), out_dtype=getattr(torch, cfg.precision.dtype))}
    return {"out": matmul_reference.matmul(x["a"], x["b"])}


def _torch(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": _MATMUL(x["a"], x["b"])}


def _autotune(cfg: LabConfig) -> str | None:
    """tile=auto tunes blocks, warps and stages jointly; workgroup=auto warps and stages alone."""
    return "tile" if cfg.tile.autotune else "workgroup" if cfg.workgroup.autotune else None


def _triton(x: Tensors, cfg: LabConfig) -> Tensors:
    from posttrainllm.ops.matmul.kernels import matmul

    t, w = cfg.tile, cfg.workgroup
    return {"out": matmul(x["a"], x["b"], block_m=t.block_m, block_n=t.block_n, block_k=t.block_k,
                          group_m=w.group_m, num_warps=w.num_warps, num_stages=w.num_stages,
                          input_precision=cfg.precision.dot_precision, autotune=_autotune(cfg))}


def _triton_geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
    """The launch geometry; with tile/workgroup=auto, what the autotuner chose for the forward (CUDA: the
    path runs once on the case's inputs), or that the fixed configuration ran (elsewhere)."""
    from posttrainllm.ops.matmul.kernels import LAST_AUTOTUNE, matmul_launch

    t, w, d = cfg.tile, cfg.workgroup, case.dims
    geometry = matmul_launch(d["m"], d["n"], d["k"], block_m=t.block_m, block_n=t.block_n, block_k=t.block_k,
                             group_m=w.group_m, num_warps=w.num_warps, num_stages=w.num_stages)
    mode = _autotune(cfg)
    if mode is None:
        return geometry
    on_cuda = cfg.device.name == "cuda" or (cfg.device.name == "auto" and torch.cuda.is_available())
    if not on_cuda:
        return {**geometry, "autotune": {"mode": mode, "chosen": None, "note": AUTO_CPU_NOTE}}
    LAST_AUTOTUNE.clear()
    with torch.no_grad():
        _triton(_make_inputs(case, getattr(torch, cfg.precision.dtype), "cuda"), cfg)
    return {**geometry, "autotune": {"mode": mode, "chosen": dict(LAST_AUTOTUNE),
                                     "note": "chosen by triton.autotune on this device (smem-pruned)"}}


IMPLS = {
    REFERENCE: Impl(REFERENCE, "reference", _reference, backend="posttrainllm.ops.matmul.reference.matmul",
                    cost_model="blas"),
    "torch": Impl("torch", "peer", _torch, backend="torch.matmul", cost_model="blas"),
    "triton": Impl("triton", "triton", _triton, geometry=_triton_geometry, backend="posttrainllm.ops.matmul.matmul",
                   kernels={"forward": ("_matmul_kernel",), "backward": ("_matmul_kernel",)},
                   promises=("deterministic",),  # no atomics: every sum in one order (lab/invariance.py checks)
                   cost_model="tiled"),
}


# --- fp8 (precision.quantize): forward-only paths on operands quantized once per case --------------------


def _fp8_args(x: Tensors) -> tuple[torch.Tensor, ...]:
    return x["a"], x["a_scale"], x["b"], x["b_scale"]


SCALED_MM_ALIGN = 16  # cuBLASLt's fp8 GEMM: torch._scaled_mm on CUDA refuses a dim of A or B off a multiple of 16
_SCALED_MM_PROBES: dict[tuple, str | None] = {}


def _pad(x: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    """x (R, C) with `rows` rows and `cols` columns of `value` appended (fp8 through its bytes: 0x00 is +0.0)."""
    if not rows and not cols:
        return x
    if x.element_size() == 1:
        return torch.nn.functional.pad(x.view(torch.uint8), (0, cols, 0, rows)).view(x.dtype)
    return torch.nn.functional.pad(x, (0, cols, 0, rows), value=value)


def _scaled_mm(x: Tensors, cfg: LabConfig) -> Tensors:
    """torch._scaled_mm with A row-major and B column-major, as it asks, and the point's output dtype. The op's inputs
    come so (make_inputs), so the call copies neither; a B in another layout (a caller's) is laid out here. A dim off
    a multiple of 16 is zero-padded (A's rows and K, B's K and columns; scales by ones) and C cut back: what a caller
    of it on CUDA must do (torchao pads the same way); the padded rows and columns of C are never returned. No timed
    shape of conf/shape is off 16: only parity's edge cases pad."""
    a, a_scale, b, b_scale = _fp8_args(x)
    (m, k), n = a.shape, b.shape[1]
    pm, pk, pn = (-m) % SCALED_MM_ALIGN, (-k) % SCALED_MM_ALIGN, (-n) % SCALED_MM_ALIGN
    if a_scale.dim() == 2:  # rowwise: (M, 1) and (1, N) follow A's rows and B's columns
        a_scale, b_scale = _pad(a_scale, pm, 0, 1.0), _pad(b_scale, 0, pn, 1.0)
    b = _pad(b, pk, pn).t().contiguous().t()  # (K, N) column-major: no copy when it already is
    c = torch._scaled_mm(_pad(a, pm, pk).contiguous(), b, scale_a=a_scale, scale_b=b_scale,
                         out_dtype=getattr(torch, cfg.precision.dtype))
    return {"out": c[:m, :n].contiguous() if pm or pn else c}


def scaled_mm_refusal(cfg: LabConfig) -> str | None:
    """None if torch._scaled_mm runs the point's recipe (its scaling, e4m3 operands, the output dtype) on its
    device, on a small aligned problem; else why not, one line (the path is then absent, not failed)."""
    if not hasattr(torch, "_scaled_mm"):
        return "torch._scaled_mm is not in this PyTorch"
    device = _device(cfg)
    key = (device, cfg.precision.quantize.recipe, cfg.precision.dtype)
    if key not in _SCALED_MM_PROBES:
        if device == "cuda" and not torch.cuda.is_available():
            _SCALED_MM_PROBES[key] = "no CUDA device"
        else:
            try:
                case = Case("probe", 0, dict(m=32, n=32, k=32), True, quantize=cfg.precision.quantize.recipe)
                x = _make_inputs(case, getattr(torch, cfg.precision.dtype), device)
                _scaled_mm(x, cfg)
                _SCALED_MM_PROBES[key] = None
            except Exception as exc:  # a refusal (device capability, scaling, dtype) is this path's absence
                _SCALED_MM_PROBES[key] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}" \
                    if str(exc).strip() else type(exc).__name__
    return _SCALED_MM_PROBES[key]


FP8_DOT_CAPABILITY = (8, 9)  # fp8 tensor cores (tl.dot on e4m3 operands): Ada (sm_89), Hopper (sm_90) and later


def triton_fp8_refusal(cfg: LabConfig) -> str | None:
    """None where the Triton fp8 GEMM runs: a CUDA device of compute capability 8.9 or more, or the CPU, through
    Triton's interpreter (which emulates the fp8 loads and tl.dot); else why not, one line (the path is then
    absent, not failed)."""
    if _device(cfg) != "cuda":
        return None
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < FP8_DOT_CAPABILITY:
        return (f"tl.dot on float8_e4m3fn needs compute capability >= {'.'.join(map(str, FP8_DOT_CAPABILITY))} (fp8 "
                f"tensor cores: Ada, Hopper); this device is sm_{major}{minor}")
    return None


def unavailable(cfg: LabConfig) -> dict[str, str]:
    """The fp8 paths absent from this point, each with its reason (microbench.json's describe.unavailable)."""
    refusals = {"scaled_mm": scaled_mm_refusal(cfg), "triton": triton_fp8_refusal(cfg)}
    return {name: why for name, why in refusals.items() if why is not None}


def _triton_fp8(x: Tensors, cfg: LabConfig) -> Tensors:
    from posttrainllm.ops.matmul.fp8 import fp8_matmul

    t, w = cfg.tile, cfg.workgroup
    return {"out": fp8_matmul(*_fp8_args(x), block_m=t.block_m, block_n=t.block_n, block_k=t.block_k,
                              group_m=w.group_m, num_warps=w.num_warps, num_stages=w.num_stages)}


def _triton_fp8_geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
    from posttrainllm.ops.matmul.kernels import matmul_launch

    t, w, d = cfg.tile, cfg.workgroup, case.dims
    return {**matmul_launch(d["m"], d["n"], d["k"], block_m=t.block_m, block_n=t.block_n, block_k=t.block_k,
                            group_m=w.group_m, num_warps=w.num_warps, num_stages=w.num_stages),
            "recipe": case.quantize, "epilogue": "acc * a_scale * b_scale, then bf16"}


FP8_IMPLS = {
    REFERENCE: Impl(REFERENCE, "reference", _reference, backward=NO_BACKWARD,
                    backend="posttrainllm.ops.matmul.reference.fp8_matmul (dequantize, then the product)"),
    "scaled_mm": Impl("scaled_mm", "peer", _scaled_mm, backward=NO_BACKWARD,
                      backend="torch._scaled_mm (B column-major; dims zero-padded to multiples of 16)"),
    "triton": Impl("triton", "triton", _triton_fp8, geometry=_triton_fp8_geometry, backward=NO_BACKWARD,
                   backend="posttrainllm.ops.matmul.fp8.fp8_matmul", kernels={"forward": ("_fp8_matmul_kernel",)},
                   promises=("deterministic",)),  # no atomics (batch invariance is not measured under fp8: its scales)
}


# torch._scaled_mm on a CPU with per-tensor scales: 66-168 ms for one 128³ product (0.01-0.03 GFLOP/s; rowwise scales:
# 0.25 ms), measured 2026-12-01 on the 2-core machine, torch 2.13. One training step of the tiny model took 9.7 s and
# its greedy decode minutes, so on a CPU bench-train trains it only rowwise; parity checks its forward either way
SCALED_MM_CPU_TRAIN = ("torch._scaled_mm with per-tensor scales has no fast CPU kernel (0.01-0.03 GFLOP/s at 128³, "
                       "measured): not trained on a CPU; parity checks its forward, and bench-train trains it on a GPU")


def _impls_for(cfg: LabConfig) -> dict[str, Impl]:
    """The registry for this point: under fp8 the quantized paths (scaled_mm and triton only where they run), else
    IMPLS."""
    if cfg.precision.quantize is None:
        return IMPLS
    absent = unavailable(cfg)
    found = {name: impl for name, impl in FP8_IMPLS.items() if name not in absent}
    if "scaled_mm" in found and _device(cfg) == "cpu" and cfg.precision.quantize.scaling == "tensor":
        found["scaled_mm"] = dataclasses.replace(found["scaled_mm"], train_refusal=SCALED_MM_CPU_TRAIN)
    return found


def _device(cfg: LabConfig) -> str:
    return cfg.device.name if cfg.device.name != "auto" else "cuda" if torch.cuda.is_available() else "cpu"


def _recipe(cfg: LabConfig) -> str:
    return cfg.precision.quantize.recipe if cfg.precision.quantize is not None else ""


def _cases(cfg: LabConfig) -> list[Case]:
    """The point's shape, then sizes off every block (and 1x1x1), once per seed."""
    sizes, recipe = Sizes.of(cfg), _recipe(cfg)
    out = []
    for seed in cfg.parity.seeds:
        out.append(Case(f"{sizes.m}x{sizes.n}x{sizes.k}-seed{seed}", seed, dict(m=sizes.m, n=sizes.n, k=sizes.k),
                        True, quantize=recipe))
        out += [Case(f"{m}x{n}x{k}-seed{seed}", seed, dict(m=m, n=n, k=k), False, quantize=recipe)
                for m, n, k in sizes.edge]
    return out


def _make_inputs(case: Case, dtype: torch.dtype, device: str) -> Tensors:
    """Standard-normal A and B drawn in fp32 from the case's seed, cast to the point's dtype.

    A quantized case (Case.quantize '<fp8 format>:<scaling>') quantizes them, in the reference math: A_q, its
    scale (one, or one per row of A: (M, 1)), B_q and its scale (one, or one per column of B: (1, N)). B_q is laid
    out K-major, column-major (K, N), here, once per case and outside every timed call: the layout torch._scaled_mm
    (cuBLASLt) asks of B, and the one Hopper's fp8 wgmma reads (K-major operands only, unlike its 16-bit form); the
    Triton kernel takes any strides. The same values: only their order in memory."""
    randn, d = seeded_randn(case.seed, dtype, device), case.dims
    a, b = randn(d["m"], d["k"]), randn(d["k"], d["n"])
    if not case.quantize:
        return {"a": a, "b": b}
    fmt, scaling = case.quantize.split(":")
    fp8 = getattr(torch, fmt)
    a_scale = quantize.fp8_scale(a, None if scaling == "tensor" else 1, fp8)  # () or (M, 1)
    b_scale = quantize.fp8_scale(b, None if scaling == "tensor" else 0, fp8)  # () or (1, N)
    return {"a": quantize.quantize_fp8(a, a_scale, fp8), "a_scale": a_scale,
            "b": quantize.quantize_fp8(b, b_scale, fp8).t().contiguous().t(), "b_scale": b_scale}


def _problem(case: Case) -> str:
    d = case.dims
    return f"M={d['m']} N={d['n']} K={d['k']}"


def _costs(case: Case, cfg: LabConfig) -> Costs:
    """(M, K) @ (K, N): M·N dot products of length K -> 2·M·N·K FLOPs. Backward: dA = dC Bᵀ and
    dB = Aᵀ dC, each 2·M·N·K -> 2x the forward. Bytes: read A and B, write C, once each (a quantized case:
    1-byte A and B, their fp32 scales, C in the point's dtype; its paths are forward-only)."""
    d, size = case.dims, itemsize(cfg.precision.dtype)
    if case.quantize:
        fmt, scaling = case.quantize.split(":")
        scales = 2 if scaling == "tensor" else d["m"] + d["n"]
        return Costs(2 * d["m"] * d["n"] * d["k"],
                     (d["m"] * d["k"] + d["k"] * d["n"]) * itemsize(fmt) + d["m"] * d["n"] * size + scales * 4, 2.0,
                     "2*M*N*K", "(M*K + K*N)*1 + M*N*itemsize + scales*4 (scales: 2, or M + N rowwise)",
                     "backward = 2 x forward (dA and dB, 2*M*N*K each); not timed: the fp8 paths are forward-only")
    return Costs(2 * d["m"] * d["n"] * d["k"], (d["m"] * d["k"] + d["k"] * d["n"] + d["m"] * d["n"]) * size, 2.0,
                 "2*M*N*K", "(M*K + K*N + M*N)*itemsize", "backward = 2 x forward (dA and dB, 2*M*N*K each)")


def _tiled_gemm_bytes(m: int, n: int, k: int, block_m: int, block_n: int, size: int) -> int:
    """One (M, K) @ (K, N) by output tiles of block_m x block_n: each tile streams its rows of A and its columns
    of B, so A is read ceil(N/block_n) times, B ceil(M/block_m) times, C written once:
    (M·K·⌈N/BN⌉ + K·N·⌈M/BM⌉ + M·N)·itemsize."""
    return (m * k * -(-n // block_n) + k * n * -(-m // block_m) + m * n) * size


def _tiled(case: Case, cfg: LabConfig) -> Costs:
    """Our Triton GEMM: the floor's FLOPs, its bytes per tile (_tiled_gemm_bytes); the backward runs the same
    kernel on dA = dC Bᵀ ((M, N) @ (N, K)) and dB = Aᵀ dC ((K, M) @ (M, N)) at the same tiles."""
    floor, d, t = _costs(case, cfg), case.dims, cfg.tile
    if case.quantize:  # the fp8 kernel: forward-only; its 1-byte operands are not modelled per tile here
        return dataclasses.replace(floor, model="floor", note="fp8: the floor (1-byte operands, scales), not tiled")
    size = itemsize(cfg.precision.dtype)
    m, n, k, bm, bn = d["m"], d["n"], d["k"], t.block_m, t.block_n
    forward = _tiled_gemm_bytes(m, n, k, bm, bn, size)
    backward = _tiled_gemm_bytes(m, k, n, bm, bn, size) + _tiled_gemm_bytes(k, n, m, bm, bn, size)
    return dataclasses.replace(
        floor, bytes=forward, bytes_formula="(M*K*ceil(N/BN) + K*N*ceil(M/BM) + M*N)*itemsize",
        train_bytes=forward + backward, train_bytes_formula="forward + the same per tile of dA (M, K) = dC (M, N) "
        "@ Bt (N, K) and dB (K, N) = At (K, M) @ dC (M, N)",
        working_set=floor.bytes, working_set_formula="(M*K + K*N + M*N)*itemsize (A, B, C)", model="tiled",
        note=f"output tiles BM={bm} x BN={bn} (tile.{t.name}): A re-read per column of tiles, B per row")


def _blas(case: Case, cfg: LabConfig) -> Costs:
    """torch.matmul (the reference's a @ b too): a BLAS kernel that blocks for the caches on its own terms, so no
    per-tile count of ours applies: the floor, said as such, with A, B and C as its working set; backward: the
    two GEMMs of the gradients at their floors."""
    floor, d = _costs(case, cfg), case.dims
    if case.quantize:
        return dataclasses.replace(floor, model="floor", note="fp8: the floor")
    size = itemsize(cfg.precision.dtype)
    backward = (d["m"] * d["n"] + d["n"] * d["k"] + d["m"] * d["k"]) * size * 2
    return dataclasses.replace(floor, train_bytes=floor.bytes + backward,
                               train_bytes_formula="forward + 2*(M*N + N*K + M*K)*itemsize (dA, dB at their floor)",
                               working_set=floor.bytes, working_set_formula="(M*K + K*N + M*N)*itemsize",
                               model="blas", note="BLAS blocks for the caches itself: its re-reads are not modelled; "
                                                  "the floor (A, B read once, C written once)")


PATH_COSTS = {"tiled": _tiled, "blas": _blas}


def _curve_case(cfg: LabConfig, x: int) -> Case:
    seed = cfg.parity.seeds[0]
    return Case(f"{x}x{x}x{x}-seed{seed}", seed, dict(m=x, n=x, k=x), True, quantize=_recipe(cfg))


def _fill(impl: Impl, cfg: LabConfig) -> Callable[..., torch.Tensor]:
    """Every projection x @ Wᵀ of the model runs `impl.fn` on (rows of x, Wᵀ).

    Autocast does not reach a custom autograd.Function, so 16-bit autocast casts both operands
    here, as F.linear under autocast would."""

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
        rows = x.reshape(-1, x.shape[-1])  # (N, in)
        out = impl.fn({"a": rows, "b": weight.t()}, cfg)["out"]  # (N, in) @ (in, out) -> (N, out)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    if cfg.precision.quantize is not None:
        return _fp8_linear(impl, cfg)
    return linear


def _fp8_linear(impl: Impl, cfg: LabConfig) -> Any:
    """Every projection trained with the fp8 recipe (ops/quantize.py fp8_linear): its forward GEMM and both backward
    GEMMs are `impl`'s scaled GEMM, on operands quantized afresh each call (x and W e4m3, dY the recipe's
    grad_format). Under the bf16 autocast of bench-train, x and W arrive cast to bf16 as F.linear's would."""
    q = cfg.precision.quantize

    def gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
        return impl.fn({"a": a, "a_scale": a_scale, "b": b, "b_scale": b_scale}, cfg)["out"]

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
        return quantize.fp8_linear(x, weight, gemm, rowwise=q.scaling == "row", grad_dtype=getattr(torch, q.grad_format))

    return linear


def _model_problem(cfg: LabConfig) -> str:
    arch, train = cfg.architecture, cfg.train
    return f"M={train.batch_size * train.seq_len} N={arch.mlp_hidden} K={arch.d_model} (MLP up)"


def _describe(case: Case, inputs: Tensors, cfg: LabConfig, measure: Callable[..., Any]) -> dict[str, Any]:
    """Under fp8, what it buys: the bf16 GEMM of the same unquantized operands (torch.matmul, not a path: its
    inputs are not the point's), timed as the paths are, with the bytes and FLOP/B of each; else nothing."""
    if not case.quantize:
        return {}
    d, bench, device = case.dims, cfg.bench, inputs["a"].device.type
    plain = _make_inputs(dataclasses.replace(case, quantize=""), getattr(torch, cfg.precision.dtype), device)
    with torch.no_grad():
        timing = measure(lambda: torch.matmul(plain["a"], plain["b"]), device=device, warmup=bench.warmup,
                         reps=bench.reps, min_time_s=bench.min_time_s, max_reps=bench.max_reps)
    fp8 = _costs(case, cfg)
    bf16_bytes = (d["m"] * d["k"] + d["k"] * d["n"] + d["m"] * d["n"]) * itemsize(cfg.precision.dtype)
    seconds = timing.median_ms / 1e3
    line = (f"beside fp8: torch.matmul in {cfg.precision.dtype} on the unquantized operands {timing.median_ms:.3f} ms "
            f"(p20-p80 {timing.p20_ms:.3f}-{timing.p80_ms:.3f}), {fp8.flops / seconds / 1e9:.2f} GFLOP/s; "
            f"{bf16_bytes} B moved against fp8's {fp8.bytes} B ({bf16_bytes / fp8.bytes:.2f}x)")
    return {
        "bf16_matmul": {"backend": f"torch.matmul on the unquantized operands in {cfg.precision.dtype}",
                        **timing.summary(), "bytes": bf16_bytes, "flops_per_byte": fp8.flops / bf16_bytes,
                        "gflops_per_s": fp8.flops / seconds / 1e9, "gbytes_per_s": bf16_bytes / seconds / 1e9},
        "fp8_bytes": fp8.bytes, "fp8_flops_per_byte": fp8.flops / fp8.bytes,
        "unavailable": unavailable(cfg),
        "summary": line,
    }


def _reference_bytes(case: Case, cfg: LabConfig) -> int:
    """A, B, C and both gradients, in float64 and in the point's precision: ~4 copies of each."""
    d = case.dims
    return 4 * (d["m"] * d["k"] + d["k"] * d["n"] + d["m"] * d["n"]) * 8 * 2


SIGNATURE = "fn(a, b) -> c; a (M, K), b (K, N), c (M, N) in a's dtype"

TEMPLATE = '''
import torch


def {name}(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """C = A @ B.   a: (M, K), b: (K, N) -> (M, N) in a's dtype.

    The lab checks it against float64 math, per element and per row of C, forward and both gradients
    (autograd through this function, or your own torch.autograd.Function); no autograd history: forward-only.
    """
    return (a.float() @ b.float()).to(a.dtype)  # fp32 accumulation, as a tensor-core GEMM does
'''


def _adapt(fn: Any) -> Any:
    def path(x: Tensors, cfg: LabConfig) -> Tensors:
        return {"out": fn(x["a"], x["b"])}

    path.__name__ = getattr(fn, "__name__", "user")
    return path


OP = OpDef(
    name="matmul", x_name="size", input_names=("a", "b"), impls=IMPLS, cases=_cases, make_inputs=_make_inputs,
    problem=_problem, costs=_costs, path_costs=PATH_COSTS, curve_case=_curve_case, model_hook=ModelHook("linear", _fill),
    model_problem=_model_problem,
    check_config=op_config.check_config, smem_bytes=op_config.point_smem_bytes,
    reference_bytes=_reference_bytes,
    curve_sizes=lambda cfg: list(Sizes.of(cfg).curve or cfg.shape.curve),
    optional_peers={"compiled": compiled("matmul", _reference, _make_inputs, "posttrainllm.ops.matmul.reference.matmul")},
    signature=SIGNATURE, adapt=_adapt, template=TEMPLATE,
    point_impls=_impls_for, reserved_names=("scaled_mm",), describe=_describe, quantizes=True, trains_quantized=True,
    batch_axis=BatchAxis("a row of A", {"a": 0}, {"out": 0}, note="grad_b sums over the rows of A: not a row's"),
)
