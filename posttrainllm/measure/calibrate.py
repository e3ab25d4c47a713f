"""The device's own peaks, measured: the roofs a roofline is drawn against.

GEMM rate per dtype: C = A @ B with square (n, n) operands,
    flops = 2·n³ (a multiply-add is 2 FLOPs),   rate = flops / median seconds      [FLOP/s]
fp8 ("float8_e4m3fn"): the same with torch._scaled_mm on e4m3 A and B, per-tensor fp32 scales and
bf16 C (what precision=fp8 runs); where _scaled_mm refuses, skipped with its reason.
Memory bandwidth: dst.copy_(src) over a buffer far larger than the last-level cache,
    bytes = 2·size (read src + write dst),       rate = bytes / median seconds      [B/s]

Sizes: each dtype climbs a size ladder, one warm call per size, and keeps the largest
size whose timed calls still fit its share of the time budget. A dtype without a fast
kernel (fp16 GEMM on many CPUs runs at ~1 GFLOP/s) thus gets a smaller size, or is
skipped with the reason when even the smallest does not fit. Every choice is recorded.

The median is used (as everywhere in the lab), not the best call: the peaks are what a
timed kernel can expect here, on this thread count, with this machine's neighbours.
`published_peaks` gives datasheet numbers for comparison: published, not measured.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import torch

from posttrainllm import rules
from posttrainllm.measure import device as devices
from posttrainllm.measure.timing import measure

DEFAULT_BUDGET_S = 12.0
GEMM_SHARE = 0.8  # of the budget; the rest is the copy's

# (smallest ... target): the target approaches peak; smaller ones are fallbacks for slow dtypes.
GEMM_SIZES = {"cpu": (128, 256, 512, 1024), "cuda": (1024, 2048, 4096, 8192)}
# Per buffer: 4x the 32 MiB L3 of our CPUs; on the GPU 20x the 50 MB L2.
COPY_BYTES = {"cpu": 128 * 2**20, "cuda": 1 * 2**30}
# "tf32" is float32 operands with TF32 tensor-core math allowed; "float32" is IEEE fp32. FP8: e4m3 operands
# through torch._scaled_mm, the peak of a quantized precision (peak_for).
FP8 = "float8_e4m3fn"
GEMM_DTYPES = {"cpu": ("float32", "bfloat16", "float16", FP8), "cuda": ("float32", "tf32", "bfloat16", "float16", FP8)}
# Skipped before the first call, with the reason. On the CPU torch._scaled_mm runs, but through no fast kernel:
# 0.055, 0.065, 0.12, 0.11 GFLOP/s at n=128, 256, 512, 1024 (2-core Xeon, torch 2.13 CPU build; fp32 ran at
# 110 GFLOP/s, bf16 1.4 TFLOP/s). The time rule below would still measure it at n=128 (4 calls: 0.3 s of a 3.2 s
# share), adding ~1.6 s to the calibration for a "peak" the fp8 point's own reference (dequantize, then an fp32
# GEMM) beats ~1000-fold: no roof. Unmeasured, an fp8 point on the CPU gets no FLOP roof (peak_for: None).
NO_FAST_KERNEL = {("cpu", FP8): "torch._scaled_mm has no fast kernel on the CPU (~0.1 GFLOP/s at n=128-1024 on a "
                                "2-core Xeon, torch 2.13): under the fp8 reference's own fp32 GEMM, so no roof"}
MIN_REPS = 3
WARMUP = 1

FORMULAS = {
    "gemm_flops": "2 * n^3 per (n, n) @ (n, n)",
    "gemm_flops_per_s": "2 * n^3 / median_seconds",
    "copy_bytes": "2 * size (read src + write dst)",
    "copy_bytes_per_s": "2 * size / median_seconds",
}


def _operands(n: int, dtype_name: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.float32 if dtype_name == "tf32" else getattr(torch, dtype_name)
    gen = torch.Generator(device=device).manual_seed(0)  # drawn on the device: an 8192² randn on the host is slow
    a = torch.randn(n, n, generator=gen, device=device).to(dtype)
    b = torch.randn(n, n, generator=gen, device=device).to(dtype)
    return a, b


def _gemm(n: int, dtype_name: str, device: str) -> Any:
    """The call to time at size n: a @ b, or for FP8 torch._scaled_mm with B column-major (as it asks), per-tensor
    fp32 scales (ones: a scale's value does not change the work) and bf16 C."""
    a, b = _operands(n, dtype_name, device)
    if dtype_name != FP8:
        return lambda: a @ b
    b = b.t().contiguous().t()
    one = torch.ones((), device=a.device)
    return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def _fp8_refusal(device: str) -> str | None:
    """None if torch._scaled_mm runs e4m3 operands on `device` (a small aligned probe), else why not, one line."""
    if not hasattr(torch, "_scaled_mm"):
        return "torch._scaled_mm is not in this PyTorch"
    try:
        _gemm(16, FP8, device)()
    except Exception as exc:  # a refusal (compute capability under 8.9, a build without fp8 kernels) is a skip
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        return f"torch._scaled_mm refused e4m3 operands on {device}: {type(exc).__name__}{': ' * bool(first)}{first}"
    return None


def _one_call_s(fn: Any, device: str) -> float:
    """Seconds of one warm call (one warmup, one timed): only to size the real measurement."""
    return measure(fn, device=device, warmup=1, reps=1, min_time_s=0.0, max_reps=1, flush=None).median_ms / 1e3


def _unsupported(dtype_name: str, device: str) -> str | None:
    if device == "cuda" and dtype_name == "bfloat16" and not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16 support"
    if dtype_name == FP8:
        return _fp8_refusal(device) or NO_FAST_KERNEL.get((device, FP8))
    return None


def gemm_rate(dtype_name: str, device: str, share_s: float) -> dict[str, Any]:
    """Measure one dtype's GEMM rate within about `share_s` seconds; {'skipped': reason} if it cannot fit.

    Climbs the size ladder with one warm call per size; the rate seen at n predicts the cost
    of the next size (x8 the FLOPs), and the climb stops before that would overrun the share.
    """
    reason = _unsupported(dtype_name, device)
    if reason:
        return {"skipped": reason}
    sizes = GEMM_SIZES[device]
    calls = WARMUP + MIN_REPS
    spent, probes = 0.0, {}  # n -> seconds of one warm call
    with devices.fp32_matmuls(tf32=dtype_name == "tf32"):
        for i, n in enumerate(sizes):
            call = _gemm(n, dtype_name, device)
            probe_s = _one_call_s(call, device)
            spent += 2 * probe_s  # its warmup and timed call
            probes[str(n)] = probe_s
            if i == 0 and calls * probe_s > share_s:
                rate = 2 * n**3 / probe_s
                return {"skipped": f"{dtype_name} GEMM ran at {rate / 1e9:.3g} GFLOP/s at n={n}: {calls} calls "
                                   f"would take {calls * probe_s:.3g} s, over its {share_s:.3g} s share "
                                   "(no fast kernel for this dtype here)", "probe_s": probes}
            if i + 1 < len(sizes):
                next_call_s = probe_s * (sizes[i + 1] / n) ** 3
                if spent + (2 + calls) * next_call_s > share_s:
                    break
        left = max(share_s - spent, calls * probe_s)
        timing = measure(call, device=device, warmup=WARMUP, reps=MIN_REPS, min_time_s=0.5 * left,
                         max_reps=max(MIN_REPS, int(0.8 * left / probe_s)))
    flops = 2 * n**3
    entry: dict[str, Any] = {"n": n, "flops": flops, "flops_per_s": flops / (timing.median_ms / 1e3),
                             "best_flops_per_s": flops / (timing.min_ms / 1e3), **timing.summary(),
                             "probe_s": probes}
    if n != sizes[-1]:
        entry["note"] = f"measured at n={n}, not the target n={sizes[-1]}: the larger sizes did not fit the budget"
    return entry


LOCAL_REPS = 20  # the GEMM at a path's own size: enough calls for its fastest to be the size's roof
LOCAL_PEAK = rules.cite("local_peak", reps=LOCAL_REPS)  # the rule as a result cites it


def local_peak(flops: float, dtype_name: str, device: str) -> dict[str, Any]:
    """Rule "local_peak": the GEMM rate at a path's own size, where the calibration's (at its ladder's largest size
    that fit) may be slower: a 128³ GEMM whose operands sit in the cache runs faster on a CPU than the n=1024 one."""
    n = max(16, round((flops / 2) ** (1 / 3)))
    if dtype_name == FP8 or _unsupported(dtype_name, device):
        return {"n": n, "skipped": _unsupported(dtype_name, device) or "fp8 is not remeasured"}
    with devices.fp32_matmuls(tf32=dtype_name == "tf32"):
        call = _gemm(n, dtype_name, device)
        timing = measure(call, device=device, warmup=WARMUP + 2, reps=LOCAL_REPS, min_time_s=0.0,
                         max_reps=LOCAL_REPS)
    gemm_flops = 2 * n**3
    return {"n": n, "dtype": dtype_name, "flops": gemm_flops, "flops_per_s": gemm_flops / (timing.median_ms / 1e3),
            "best_flops_per_s": gemm_flops / (timing.min_ms / 1e3), **timing.summary(), "rule": LOCAL_PEAK}


def copy_rate(device: str, share_s: float, size_bytes: int | None = None) -> dict[str, Any]:
    """Bandwidth of dst.copy_(src) over `size_bytes` per buffer."""
    size = size_bytes or COPY_BYTES[device]
    src = torch.ones(size // 4, dtype=torch.float32, device=device)  # written once: pages are touched
    dst = torch.empty_like(src)
    per_call = _one_call_s(lambda: dst.copy_(src), device)
    timing = measure(lambda: dst.copy_(src), device=device, warmup=WARMUP, reps=MIN_REPS, min_time_s=0.5 * share_s,
                     max_reps=max(MIN_REPS, int(0.8 * share_s / max(per_call, 1e-9))))
    moved = 2 * src.numel() * src.element_size()
    return {"size_bytes": src.numel() * src.element_size(), "bytes": moved,
            "bytes_per_s": moved / (timing.median_ms / 1e3), "best_bytes_per_s": moved / (timing.min_ms / 1e3),
            **timing.summary()}


def calibrate(device: str, *, budget_s: float = DEFAULT_BUDGET_S) -> dict[str, Any]:
    """Measured peaks of `device` ("cpu" or "cuda") at the current thread count, within about `budget_s`."""
    if device not in GEMM_SIZES:
        raise ValueError(f"calibrate: device={device!r}: valid choices are {', '.join(GEMM_SIZES)}")
    started = time.perf_counter()
    dtypes = GEMM_DTYPES[device]
    unsupported = {name: reason for name in dtypes if (reason := _unsupported(name, device))}
    # The GEMM share is split among the dtypes that are timed: one skipped before its first call leaves its share
    # to the others. So the CPU's three keep theirs (fp8 is skipped there: NO_FAST_KERNEL); on a GPU with fp8 each
    # of five gets 1/5 (1.92 s of the default 12 s, was 2.4 s): at n=8192 still ~50 calls of IEEE fp32 (~16 ms
    # each at an H100's datasheet 67 TFLOP/s) and hundreds of the tensor-core dtypes', within the stage's budget.
    share = budget_s * GEMM_SHARE / max(len(dtypes) - len(unsupported), 1)
    gemm = {name: {"skipped": unsupported[name]} if name in unsupported else gemm_rate(name, device, share)
            for name in dtypes}
    copy = copy_rate(device, budget_s * (1 - GEMM_SHARE))
    fingerprint = devices.fingerprint(device)
    return {
        "fingerprint": fingerprint,
        "peaks": {
            "gemm_flops_per_s": {name: g["flops_per_s"] for name, g in gemm.items() if "flops_per_s" in g},
            "copy_bytes_per_s": copy["bytes_per_s"],
        },
        "method": {
            "gemm_sizes": {name: g["n"] for name, g in gemm.items() if "n" in g},
            "gemm_size_ladder": list(GEMM_SIZES[device]),
            "copy_size_bytes": copy["size_bytes"],
            "reps": {**{name: g["reps"] for name, g in gemm.items() if "reps" in g}, "copy": copy["reps"]},
            "skipped": {name: g["skipped"] for name, g in gemm.items() if "skipped" in g},
            "statistic": "median of the timed calls",
            "threads": torch.get_num_threads(),
            "budget_s": budget_s,
            "elapsed_s": time.perf_counter() - started,
            "formulas": FORMULAS,
            "tf32": "float32 operands with TF32 tensor cores on (device.fp32_matmuls)" if device == "cuda" else None,
        },
        "measurements": {"gemm": gemm, "copy": copy},
        # Datasheet numbers for comparison (None off H100/H200): published, not measured.
        "published": published_peaks(fingerprint["device_name"]) if device == "cuda" else None,
    }


# --- published (datasheet) peaks: for comparison only, never measured here -----------------

# NVIDIA H100 / H200 datasheets. Tensor-core figures there are quoted "with sparsity" (2:4);
# the dense rate is half. float32 is the non-tensor-core (CUDA core) rate. Memory bandwidth is
# HBM's, comparable with our copy's 2·size bytes.
_DATASHEET: dict[str, dict[str, float]] = {
    # name: float32, tf32*, bf16*, fp16*, fp8* [TFLOP/s] (* with sparsity), bandwidth [TB/s]
    "H100 SXM": dict(float32=67, tf32=989, bfloat16=1979, float16=1979, float8=3958, tb_per_s=3.35),
    "H100 PCIe": dict(float32=51, tf32=756, bfloat16=1513, float16=1513, float8=3026, tb_per_s=2.0),
    "H100 NVL": dict(float32=60, tf32=835, bfloat16=1671, float16=1671, float8=3341, tb_per_s=3.9),
    "H200 SXM": dict(float32=67, tf32=989, bfloat16=1979, float16=1979, float8=3958, tb_per_s=4.8),
    "H200 NVL": dict(float32=60, tf32=835, bfloat16=1671, float16=1671, float8=3341, tb_per_s=4.8),
}
_SPARSE = ("tf32", "bfloat16", "float16", "float8")


def _variant(device_name: str) -> str | None:
    name = device_name.upper()
    for chip in ("H200", "H100"):
        if re.search(rf"\b{chip}\b", name):
            if "NVL" in name:
                return f"{chip} NVL"
            if chip == "H100" and "PCIE" in name:
                return "H100 PCIe"
            return f"{chip} SXM"  # torch reports "NVIDIA H100 80GB HBM3" / "NVIDIA H200" for SXM boards
    return None


def published_peaks(device_name: str) -> dict[str, Any] | None:
    """Datasheet peaks (dense) for an H100/H200 name as torch.cuda.get_device_name() gives it; else None.
    Keyed as the calibration's measured peaks: the datasheet's FP8 (e4m3 and e5m2 alike) as FP8."""
    variant = _variant(device_name)
    if variant is None:
        return None
    sheet = _DATASHEET[variant]
    flops = {FP8 if k == "float8" else k: v * 1e12 / (2 if k in _SPARSE else 1)
             for k, v in sheet.items() if k != "tb_per_s"}
    return {
        "source": f"published: NVIDIA {variant} datasheet, not measured",
        "variant": variant,
        "dense": True,
        "note": "tensor-core rates are the datasheet's with-sparsity figures / 2; float32 is the non-tensor rate",
        "gemm_flops_per_s": flops,
        "copy_bytes_per_s": sheet["tb_per_s"] * 1e12,
    }


def load_or_measure(path: Path, device: str, *, budget_s: float = DEFAULT_BUDGET_S) -> dict[str, Any]:
    """The calibration at `path` if it was measured on this device (same fingerprint) for today's dtypes (one
    from before FP8 was measured is not kept), else a fresh one."""
    fingerprint = devices.fingerprint(device)
    if path.exists():
        kept = json.loads(path.read_text())
        if (kept.get("fingerprint") == fingerprint
                and set(kept.get("measurements", {}).get("gemm", {})) == set(GEMM_DTYPES[device])):
            return kept
    measured = calibrate(device, budget_s=budget_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(measured, indent=2) + "\n")
    return measured


# Formats at least as precise as each (a mantissa and a range no smaller): a path may compute a point in any of
# them and still meet its contract (SDPA on a CPU computes fp16 in fp32, faster than the CPU's fp16 GEMM), never
# in a narrower one (that fails the contract), so the impossible-time floor is the fastest of these peaks
AT_LEAST_AS_PRECISE = {
    "float32": ("float32",),
    "tf32": ("tf32", "float32"),
    "float16": ("float16", "tf32", "float32"),
    "bfloat16": ("bfloat16", "float16", "tf32", "float32"),
    "float8_e4m3fn": ("float8_e4m3fn", "bfloat16", "float16", "tf32", "float32"),
    "float8_e5m2": ("float8_e5m2", "float8_e4m3fn", "bfloat16", "float16", "tf32", "float32"),
}


def floor_peak(calibration: dict[str, Any], dtype: str, allow_tf32: bool, quantize: str | None = None) -> float | None:
    """The GEMM peak an impossible-time floor uses: the fastest calibrated peak among the formats at least as precise
    as the point's (AT_LEAST_AS_PRECISE); None where none of them was calibrated."""
    flops = calibration["peaks"]["gemm_flops_per_s"]
    key = quantize or ("tf32" if allow_tf32 and "tf32" in flops else dtype)
    return max([flops[k] for k in AT_LEAST_AS_PRECISE.get(key, (key,)) if flops.get(k)] or [0.0]) or None


def peak_key(calibration: dict[str, Any], dtype: str, allow_tf32: bool, quantize: str | None = None) -> str:
    """The name of the GEMM peak this precision is held to (peak_for's key): the quantized format, tf32, or dtype."""
    return quantize or ("tf32" if allow_tf32 and "tf32" in calibration["peaks"]["gemm_flops_per_s"] else dtype)


def peak_for(calibration: dict[str, Any], dtype: str, allow_tf32: bool,
             quantize: str | None = None) -> tuple[float | None, float]:
    """(peak GEMM FLOP/s for this precision or None if not measured, copy bandwidth B/s).

    A quantized precision (`quantize`: its operands' format, precision.quantize.format) gets that format's peak,
    None where it was not measured: not `dtype`'s, which its fp8 paths may exceed (fp8 is 2x bf16 on an H100)."""
    flops = calibration["peaks"]["gemm_flops_per_s"]
    key = quantize or ("tf32" if allow_tf32 and "tf32" in flops else dtype)
    return flops.get(key), calibration["peaks"]["copy_bytes_per_s"]
