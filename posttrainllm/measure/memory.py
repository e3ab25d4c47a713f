"""Peak memory a call allocates: the evidence that a fused kernel does not materialise (S, S).

peak_bytes = max over the call of (bytes live now - bytes live just before the call).
What already exists (inputs, weights) is not counted; the call's outputs are.

CUDA: PyTorch's caching allocator keeps the statistics:
    torch.cuda.reset_peak_memory_stats(); before = memory_allocated()
    fn(); peak = max_memory_allocated() - before
CPU: no allocator statistics, so the call runs under PyTorch's autograd profiler with
profile_memory=True, which records every allocation and free made through
PyTorch's CPU allocator (size and a timestamp, on any thread). Replaying the
events in time order gives the live bytes after each one; the peak is their max.
It is the legacy (non-Kineto) profiler: the same allocator hook and the same events
as `torch.profiler` (tests/test_memory.py), without Kineto's `USDT: ... profiler_start/stop`
lines on stderr at every call; `torch.profiler` is the fallback where it is gone.
Memory a library allocates outside PyTorch's allocator (BLAS/oneDNN scratch, Python
objects) is not seen on CPU; frees of memory allocated before the call are not
reported by the profiler, so the baseline is the live bytes at the call's start.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

CUDA_METHOD = "torch.cuda.max_memory_allocated() - memory_allocated() before the call (reset_peak_memory_stats first)"
CPU_METHOD = ("PyTorch profiler (profile_memory=True): PyTorch CPU allocator alloc/free events replayed in time "
              "order, peak of the running sum of bytes")


def _walk(nodes: Iterable[Any]) -> Iterable[Any]:
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children)


def allocation_events(fn: Callable[[], object]) -> list[tuple[int, int]]:
    """(time_ns, +bytes allocated / -bytes freed) for every CPU-allocator event during `fn()`, in time order."""
    try:
        from torch.autograd import ProfilerConfig, ProfilerState, _disable_profiler_legacy, _enable_profiler_legacy
        from torch._C._profiler import _ExperimentalConfig
    except ImportError:  # a torch without the legacy profiler
        return _kineto_allocation_events(fn)

    # ProfilerConfig(state, report_input_shapes, profile_memory, with_stack, with_flops, with_modules, experimental)
    _enable_profiler_legacy(ProfilerConfig(ProfilerState.CPU, False, True, False, False, False, _ExperimentalConfig()))
    try:
        fn()
    finally:
        per_thread = _disable_profiler_legacy()  # each thread's records, in the order they happened
    events = [(round(record.start_us() * 1000), int(record.cpu_memory_usage()))
              for records in per_thread for record in records
              if record.kind() == "memory_alloc" and record.cpu_memory_usage() != 0]
    return sorted(events, key=lambda event: event[0])  # stable: a thread's same-time events keep their order


def _kineto_allocation_events(fn: Callable[[], object]) -> list[tuple[int, int]]:
    """allocation_events through torch.profiler (Kineto), which logs `USDT: profiler_start/stop` each call."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # The profiler's event tree (what torch.profiler._memory_profiler reads): allocation
    # events carry their signed size in extra_fields.alloc_size (negative for a free).
    tree = prof.profiler.kineto_results.experimental_event_tree()
    events = [(node.start_time_ns, int(node.extra_fields.alloc_size)) for node in _walk(tree)
              if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu"]
    return sorted(events)


def peak_live_bytes(events: Iterable[tuple[int, int]]) -> int:
    """Max of the running sum of signed sizes (0 if nothing was live above the start)."""
    live = peak = 0
    for _, size in events:
        live += size
        peak = max(peak, live)
    return peak


def peak_bytes(fn: Callable[[], object], device: str, *, warmup: int = 1) -> dict[str, Any]:
    """{"peak_bytes": int, "method": str}: the most memory `fn()` held at once above what existed before.

    `warmup` unmeasured calls first, so one-time lazy allocations (the cuBLAS workspace on a
    stream's first GEMM, kernel caches) are not charged to the call.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"peak_bytes: device={device!r}: valid choices are cpu, cuda")
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del out
        return {"peak_bytes": int(peak), "method": CUDA_METHOD}
    return {"peak_bytes": peak_live_bytes(allocation_events(fn)), "method": CPU_METHOD}
