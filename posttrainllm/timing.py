"""Warmed timing with repetitions.

CUDA: CUDA events around each call, with the L2 cache flushed before it (a write
over a buffer larger than L2), so a small problem does not time a warm cache.
CPU: `time.perf_counter` around each call, at a fixed thread count.
Both: `warmup` untimed calls, then at least `reps` timed calls and more until
`min_time_s` has been spent (at most `max_reps`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

L2_FLUSH_BYTES = 256 * 1024 * 1024  # larger than any current GPU's L2 (H100/H200: 50 MB)


@dataclass
class Timing:
    samples_ms: list[float]
    median_ms: float
    p20_ms: float
    p80_ms: float
    min_ms: float
    cv: float  # standard deviation / mean of the samples

    def summary(self) -> dict[str, float | int]:
        out = asdict(self)
        out["reps"] = len(out.pop("samples_ms"))
        return out


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples_ms: list[float]) -> Timing:
    ordered = sorted(samples_ms)
    mean = statistics.fmean(ordered)
    cv = statistics.pstdev(ordered) / mean if len(ordered) > 1 and mean > 0 else 0.0
    return Timing(samples_ms=list(samples_ms), median_ms=statistics.median(ordered), p20_ms=_quantile(ordered, 0.2),
                  p80_ms=_quantile(ordered, 0.8), min_ms=ordered[0], cv=cv)


def measure(fn: Callable[[], object], *, device: str, warmup: int, reps: int, min_time_s: float,
            max_reps: int) -> Timing:
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    if device == "cuda":
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        spent = 0.0
        while len(samples) < max_reps and (len(samples) < reps or spent < min_time_s):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
            spent += samples[-1] / 1e3
    else:
        spent = 0.0
        while len(samples) < max_reps and (len(samples) < reps or spent < min_time_s):
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
            samples.append(elapsed * 1e3)
            spent += elapsed
    return summarize(samples)
