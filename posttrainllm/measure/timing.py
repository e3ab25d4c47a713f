"""Warmed timing with repetitions.

CUDA: CUDA events around each call, with the L2 cache flushed before it (a write
over a buffer larger than L2), so a small problem does not time a warm cache; the
events sit inside a device-wide synchronisation, whose wall time cross-checks them
(rule "other_streams", posttrainllm/rules.py: work a call launches on another stream is named, never missed).
CPU: `time.perf_counter` around each call, at a fixed thread count (recorded).
Both: `warmup` untimed calls, then at least `reps` timed calls and more until
`min_time_s` has been spent (at most `max_reps`).

Batched (`batched=True`, how the lab times every path it compares: rule "batch_mean"): a sample is the mean per
call over a batch of N consecutive calls, the figure the median over at least BATCHES_MIN batches: the statistic
the outside timing takes of a user path (lab/isolation/outside.py), so an in-process peer and an outside path are
read alike. N is sized from the last warm-up call so that BATCHES_MIN batches fill `min_time_s`. On the CPU one
span of wall clock covers the batch, less what the calling thread waited runnable on a run queue in it (the
kernel's schedstat), as an outside span is (rule "outside_run_queue"); on CUDA each call keeps its events and its
flush outside them, and the batch's sample is their mean.

The flush and the clock are parameters, so a test can watch the method without a
GPU: `flush` runs once before every timed call and outside the timed region.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from posttrainllm import rules

L2_FLUSH_BYTES = 256 * 1024 * 1024  # larger than any current GPU's L2 (H100/H200: 50 MB)

# A measurement is `noisy` (its median is not fit to compare with another's) when its
# middle 60 % spreads wider than this fraction of the median: (p80 - p20) / median > 0.20,
# or when there are too few samples to say anything about the spread.
# The CV (std / mean) is recorded but is not part of the rule: one preempted call on a shared
# core moves it a lot while the median does not move (measured here: a 4.6 us matmul with
# (p80 - p20) / median = 0.017 had CV 0.70 in one run and 0.01 in the next).
NOISY_SPREAD = 0.20
NOISY_MIN_SAMPLES = 3
NOISY = rules.cite("noisy", min_samples=NOISY_MIN_SAMPLES, spread=NOISY_SPREAD)  # the rule as a result cites it
BATCHES_MIN = 5  # rule batch_mean: a batched figure is the median of at least this many batch means
BATCH_MAX = 64  # calls in one batch at most
BATCH_MEAN = rules.cite("batch_mean", batches_min=BATCHES_MIN, batch_max=BATCH_MAX)


class _Auto:
    """Marker for "pick the device's default" (None means "no flush")."""

    def __repr__(self) -> str:
        return "AUTO"


AUTO = _Auto()


@dataclass
class Timing:
    samples_ms: list[float]
    median_ms: float
    p20_ms: float
    p80_ms: float
    min_ms: float
    cv: float  # standard deviation / mean of the samples
    iqr_ms: float = 0.0  # p75 - p25
    noisy: bool = False  # rule "noisy" (NOISY)
    threads: int | None = None  # torch.get_num_threads() while measuring (CPU intra-op threads)
    flushed: bool = False  # a cache flush ran before every timed call
    other_streams: str | None = None  # CUDA: why the events missed work on another stream (rule other_streams)
    batched: bool = False  # rule batch_mean: a sample is a batch's mean per call
    batch_size: int = 1  # calls per sample
    run_queue_share: float | None = None  # share of the batches' spans waited on a run queue (subtracted)

    def summary(self) -> dict[str, float | int | bool | None]:
        out = asdict(self)
        out["reps"] = len(out.pop("samples_ms"))
        if self.batched:
            out["timing_rule"] = BATCH_MEAN
        return out


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def is_noisy(n: int, median: float, p20: float, p80: float) -> bool:
    """The rule "noisy" on a summary's numbers."""
    if n < NOISY_MIN_SAMPLES:
        return True
    return (p80 - p20) / median > NOISY_SPREAD if median > 0 else True


def summarize(samples_ms: list[float], *, threads: int | None = None, flushed: bool = False, batched: bool = False,
              batch_size: int = 1, run_queue_share: float | None = None) -> Timing:
    ordered = sorted(samples_ms)
    mean = statistics.fmean(ordered)
    cv = statistics.pstdev(ordered) / mean if len(ordered) > 1 and mean > 0 else 0.0
    median, p20, p80 = statistics.median(ordered), _quantile(ordered, 0.2), _quantile(ordered, 0.8)
    return Timing(samples_ms=list(samples_ms), median_ms=median, p20_ms=p20, p80_ms=p80, min_ms=ordered[0], cv=cv,
                  iqr_ms=_quantile(ordered, 0.75) - _quantile(ordered, 0.25),
                  noisy=is_noisy(len(ordered), median, p20, p80), threads=threads, flushed=flushed, batched=batched,
                  batch_size=batch_size, run_queue_share=run_queue_share)


def l2_flush(device: str) -> Callable[[], None] | None:
    """CUDA: a callable that overwrites a buffer larger than L2 (the buffer is held by the closure).
    Other devices: None (no flush)."""
    if device != "cuda":
        return None
    buffer = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    return buffer.zero_


def _cuda_event_ms(fn: Callable[[], object], walls: list[float] | None = None) -> float:
    """CUDA events on the current stream around one call, inside a device-wide synchronisation whose wall time
    goes to `walls`: work the call launched on another stream is outside the events but inside the wall time."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()  # every stream of the device, not only the events'
    if walls is not None:
        walls.append((time.perf_counter() - t0) * 1e3)
    return start.elapsed_time(end)


# The events time the current stream; the synchronised wall clock times every stream (plus a synchronisation's
# cost, some microseconds). A wall median beyond the events' by more than both slacks is work on another stream.
STREAM_SLACK = 0.5  # fraction of the events' median
STREAM_SLACK_MS = 0.05  # and the synchronisation's own cost (both: rule "other_streams")


def other_streams(event_ms: list[float], wall_ms: list[float]) -> str | None:
    """Rule "other_streams" on one measurement's samples: None, or the reason it timed less than the device did."""
    if not event_ms or not wall_ms:
        return None
    events, wall = statistics.median(event_ms), statistics.median(wall_ms)
    if wall > (1 + STREAM_SLACK) * events + STREAM_SLACK_MS:
        return (f"work outside the timed stream: the device-wide wall clock's median {wall:.4g} ms is over "
                f"(1 + {STREAM_SLACK:g}) x the events' {events:.4g} ms + {STREAM_SLACK_MS:g} ms: no speed")
    return None


def _clock_ms(clock: Callable[[], float], sync: Callable[[], None]) -> Callable[[Callable[[], object]], float]:
    """Wall-clock timing of one call with a seconds clock; `sync` drains queued device work on both sides."""

    def time_one(fn: Callable[[], object]) -> float:
        sync()
        t0 = clock()
        fn()
        sync()
        return (clock() - t0) * 1e3

    return time_one


def _no_sync() -> None:
    return None


def schedstat(path: str) -> tuple[int, int] | None:
    """(ns run, ns waited runnable on a run queue) of one thread, from the kernel (proc(5) schedstat), or None."""
    try:
        with open(path) as f:
            ran, waited = f.read().split()[:2]
        return int(ran), int(waited)
    except (OSError, ValueError):
        return None


def this_thread_schedstat() -> tuple[int, int] | None:
    """The calling thread's schedstat (run, waited) ns."""
    return schedstat(f"/proc/self/task/{threading.get_native_id()}/schedstat")


def batch_size(per_call_s: float, *, min_time_s: float, max_reps: int) -> int:
    """Rule batch_mean's N: BATCHES_MIN batches fill `min_time_s` at `per_call_s` a call, within [1, BATCH_MAX] and
    so that BATCHES_MIN batches fit in `max_reps` calls."""
    cap = max(1, min(BATCH_MAX, max_reps // BATCHES_MIN))
    if per_call_s <= 0:
        return cap
    return max(1, min(cap, math.ceil(round(min_time_s / BATCHES_MIN / per_call_s, 6))))  # 10.000000000000002: 10


def waited_ms(before: tuple[int, int] | None, after: tuple[int, int] | None, span_ms: float) -> float:
    """Rule outside_run_queue for a thread of the lab's own: the ms of a span it waited runnable, never more than
    leaves the span at what it ran on a core; 0 where the kernel does not say."""
    if before is None or after is None:
        return 0.0
    ran, waited = (after[0] - before[0]) / 1e6, (after[1] - before[1]) / 1e6
    return min(max(waited, 0.0), max(span_ms - ran, 0.0))


def measure(fn: Callable[[], object], *, device: str, warmup: int, reps: int, min_time_s: float, max_reps: int,
            flush: Callable[[], object] | None | _Auto = AUTO, clock: Callable[[], float] | None = None,
            sync: Callable[[], None] | None = None, batched: bool = False,
            run_queue: Callable[[], tuple[int, int] | None] | None | _Auto = AUTO) -> Timing:
    """Time `fn()`; samples in milliseconds (batched: one per batch, its mean per call; module doc).

    flush: called once before every timed call, outside the timed region. AUTO: the L2
        flush on CUDA, nothing elsewhere; None: no flush.
    clock: a seconds clock. None: CUDA events on CUDA, `time.perf_counter` elsewhere.
    sync:  waits for queued device work around a wall-clock timing. None: `torch.cuda.synchronize`
        on CUDA, nothing elsewhere.
    run_queue: batched wall-clock spans: a reading of (ns run, ns waited) of the calling thread, taken around each
        batch, whose wait is subtracted. AUTO: the thread's schedstat, where the clock is the default one on the
        CPU; None: nothing subtracted.
    """
    flush_fn = l2_flush(device) if isinstance(flush, _Auto) else flush
    if sync is None:
        sync = torch.cuda.synchronize if device == "cuda" else _no_sync
    walls: list[float] = []
    events = clock is None and device == "cuda"
    if events:
        time_one = lambda fn: _cuda_event_ms(fn, walls)  # noqa: E731
    else:
        time_one = _clock_ms(clock or time.perf_counter, sync)
    if isinstance(run_queue, _Auto):
        run_queue = this_thread_schedstat if clock is None and device != "cuda" else None
    n = 1
    if batched:  # the warm-up calls timed: the last one sizes the batch
        warm = [time_one(fn) for _ in range(warmup)]
        n = batch_size(warm[-1] / 1e3, min_time_s=min_time_s, max_reps=max_reps) if warm else 1
    else:
        for _ in range(warmup):
            fn()
    sync()
    one_span = batched and not events and flush_fn is None  # the CPU: one wall-clock span over the batch

    def batch() -> None:
        for _ in range(n):
            fn()

    samples: list[float] = []
    per_call: list[float] = []  # CUDA events, one per call (rule other_streams)
    spans, waits = 0.0, 0.0
    calls, spent = 0, 0.0
    while calls + n <= max_reps and (calls < reps or spent < min_time_s or (batched and len(samples) < BATCHES_MIN)):
        if one_span:
            before = run_queue() if run_queue else None
            span = time_one(batch)
            after = run_queue() if run_queue else None
            waited = waited_ms(before, after, span)
            spans, waits = spans + span, waits + waited
            samples.append((span - waited) / n)
        else:
            total = 0.0
            for _ in range(n):
                if flush_fn is not None:
                    flush_fn()
                per_call.append(time_one(fn))
                total += per_call[-1]
            span = total
            samples.append(total / n)
        calls += n
        spent += span / 1e3
    timing = summarize(samples, threads=torch.get_num_threads(), flushed=flush_fn is not None, batched=batched,
                       batch_size=n, run_queue_share=(waits / spans if spans > 0 else 0.0)
                       if one_span and run_queue is not None else None)
    timing.other_streams = other_streams(per_call, walls)
    return timing
