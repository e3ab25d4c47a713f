"""Speed taken from outside: a user path is timed by the lab's clock over a batch its worker computes.

A user path runs in a worker process of its own (opdefs/worker.py); the microbench (stages.run_microbench) and
the curve (stages._curve) never call `measure()` on it. Instead, per batch:

1. the lab draws N >= 4 distinct input sets (values drawn as the point's inputs are, each from a seed of its
   own, distinct buffers; forward + backward: each with its upstream gradient) and places them in the worker
   before any clock starts;
2. its own clock (time.perf_counter; on CUDA after a device-wide synchronize) spans one request: "compute
   them all", answered with the worker's per-call times and a checksum of every output, read before the answer;
3. it subtracts the span of the same request calling nothing (the worker's loop and checksums over the last
   results: median of NULLS), so what is left is the path's compute;
4. after the clock, it fetches every output (and gradient), requires each to match its checksum (a result still
   being written after the answer does not), and checks each against the float64 oracle of its set
   (parity.check_output with the reference math on those inputs; forward + backward: the gradients too).

Fresh sets each batch: a result stored from an earlier call, keyed on anything but the values, is wrong here where
the allocator hands the set new addresses; where it hands back an earlier set's, the refill after the last batch
(REFILL_RULE: new values in the same buffers) makes such a result wrong whatever the allocator does. N grows until
a batch computes for ~BATCH_ROUND_TRIPS empty round trips (at most BATCH_MAX, and at most bench.max_reps over
BATCHES_MIN batches, never under BATCH_MIN); at least BATCHES_MIN batches. The worker's per-call times are the
Timing's samples (its distribution), each batch's scaled up to the lab's compute span where they sum to less
(AGREEMENT_RULE). A path that skips work, detects the timing loop, returns a stored result or one finished later
loses its speed (a wrong output, a changed checksum); work hidden outside the worker's per-call clock is counted by
the lab's; a patched clock is named by the worker (opdefs/worker.py `_tampered`).
A user path's memory is its worker's (MEMORY_RULE), counted inside it and from outside.
Not covered: no L2 flush between the calls of a batch (distinct sets are what keeps the cache honest).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from posttrainllm.lab import oracle, parity
from posttrainllm.measure.timing import Timing, summarize
from posttrainllm.opdefs import Case, Impl, OpDef
from posttrainllm.opdefs.base import point_dtype
from posttrainllm.opdefs import worker as workers

BATCH_MIN, BATCH_MAX = 4, 64
BATCH_ROUND_TRIPS = 20  # a batch computes for at least this many empty round trips, when N <= BATCH_MAX allows
NULLS, PINGS = 5, 9  # repetitions of the null batch and of the empty call (their median is taken)
BATCHES_MIN = 3  # timed batches at least: the agreement rule reads the least disturbed one
SET_SEED = 7_919  # set k of a point's timing draws its inputs from case.seed + SET_SEED * (k + 1) + SEED_OFFSET
SEED_OFFSET = 2 * 104_729  # away from the parity cases' seeds and the timed-result check's (stages.FRESH_SEED)
FORWARD, FORWARD_BACKWARD = "forward", "forward_backward"
AGREEMENT_RULE = ("the samples are the worker's per-call times (its own clock, bound before the user's module is "
                  "imported), each batch's scaled up to the lab's span (time.perf_counter, after a device synchronize) "
                  f"less the median span of the same loop calling nothing ({NULLS} runs) where they sum to less: the "
                  "lab's clock bounds the total, so work hidden outside the worker's per-call clock (a thread, a "
                  "result finished later) is counted; `cleanest_batch.worker_over_lab` records how far they agreed")
REFILL_RULE = ("after the last batch, new values (another seed) are copied in place into its first set's buffers "
               "in the worker and that set computed again: a result stored by the buffers' address or identity "
               "fails the oracle check there and the path gets no speed")
MEMORY_RULE = ("a user path's peak memory is one forward call's in its worker: the larger of the sum of what torch's "
               "allocator (the profiler's events; CUDA: max_memory_allocated) and Python's tracemalloc (NumPy's "
               "buffers) counted in the worker, and the growth of its resident set read by the lab from outside "
               "(/proc/<pid>/status VmHWM after clear_refs); a peak below the bytes of the outputs it returned "
               "cannot be true (memory taken where neither count sees it, or outputs that are not its own): "
               "named, and no speed")
RULE = ("a user path is timed from outside its worker: batches of N >= 4 distinct input sets (fresh each batch) "
        "placed in the worker before the clock, computed in one request the lab's clock spans, every output "
        "fetched after the clock, matched to its checksum and checked against the float64 oracle of its set; "
        + REFILL_RULE + "; " + AGREEMENT_RULE)


@dataclass
class UserTiming:
    """One mode of a user path, timed from outside: its Timing (None when refused), why not, and the figures."""

    timing: Timing | None
    refused: str | None
    report: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Set:
    inputs: dict[str, torch.Tensor]
    args: list[Any]
    kwargs: dict[str, Any]
    tensors: list[torch.Tensor]
    names: list[str | None]  # the input each natural tensor argument is (None: none of them)
    grad_out: torch.Tensor | None
    case: Case


def _draw(op: OpDef, cfg: Any, case: Case, seed: int, backward: bool, device: str) -> _Set:
    """One input set as the point's are drawn, and the natural call the path's adapter makes of it."""
    drawn = dataclasses.replace(case, seed=seed)
    inputs = op.make_inputs(drawn, point_dtype(cfg), device)
    seen: list[tuple[tuple, dict]] = []

    def record(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append((args, kwargs))
        return torch.empty(0)

    op.adapt(record)(inputs, cfg)
    args, kwargs, tensors = workers._split(*seen[0])
    names = [next((n for n, x in inputs.items() if x is t), None) for t in tensors]
    grad_out = None
    if backward:
        with torch.no_grad():
            grad_out = oracle.upstream_gradient(drawn, op.reference.fn(inputs, cfg)["out"])
    return _Set(inputs, args, kwargs, tensors, names, grad_out, drawn)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _round_trip_s(request: Callable[[], Any], device: str, times: int) -> float:
    spans = []
    for _ in range(times):
        _sync(device)
        start = time.perf_counter()
        request()
        spans.append(time.perf_counter() - start)
    return statistics.median(spans)


def _check(op: OpDef, cfg: Any, impl: Impl, s: _Set, got: dict[str, Any], backward: bool) -> str | None:
    """Every output the set returned against the float64 oracle of that set: None, or the first failure."""
    truth = oracle.reference_outputs(op, cfg, oracle.cast_floats(s.inputs, torch.float64), s.case,
                                     s.grad_out.double() if backward else None)
    baseline = oracle.reference_outputs(op, cfg, s.inputs, s.case, s.grad_out if backward else None)
    contract = oracle.contract_for(cfg)
    wanted = ["out", *(op.gradient_names() if backward else [])]
    wanted += [name for name in got if name not in wanted and name in truth]  # returned extras (a logsumexp)
    for name in wanted:
        value = got.get(name)
        if not isinstance(value, torch.Tensor):
            return f"{name}: missing" if value is None else f"{name}: a {type(value).__name__}, not a tensor"
        check = parity.check_output(value.detach().cpu(), truth[name].detach().cpu(), baseline[name].detach().cpu(),
                                    contract(name))
        if check["verdict"] != "pass":
            return f"{name}: {check['reason']}"
    return None


def _same_checksums(got: list[float | None], sent: list[float | None]) -> bool:
    same = lambda a, b: a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))  # noqa: E731
    return len(got) == len(sent) and all(same(a, b) for a, b in zip(got, sent))


def _outputs(op: OpDef, cfg: Any, s: _Set, answer: dict[str, Any]) -> dict[str, Any]:
    """A set's answer in the registry's dict form: the adapter on the natural result, plus grad_<input>."""
    result = workers._rebuild(answer["result"], answer["outputs"])
    got = dict(op.adapt(lambda *a, **k: result)(s.inputs, cfg))
    for name, grad in zip(s.names, answer.get("grads") or []):
        if name is not None and grad is not None:
            got[f"grad_{name}"] = grad
    return got


def _refill_check(op: OpDef, cfg: Any, impl: Impl, worker: Any, new: _Set, backward: bool) -> str | None:
    """REFILL_RULE: the last batch's first set refilled in place with `new`'s values and computed again in the
    worker; None if its outputs are `new`'s, else why no speed."""
    done = worker.request({"op": "refill", "tensors": [t.detach() for t in new.tensors],
                           "grad_out": new.grad_out if backward else None})
    if done.get("tampered"):
        return f"new values in its timed buffers: its call changed its worker ({'; '.join(done['tampered'])}): no speed"
    got = worker.request({"op": "fetch"})["results"][0]
    failed = _check(op, cfg, impl, new, _outputs(op, cfg, new, got), backward)
    return (f"new values in its timed buffers (refilled in place after the last batch): {failed} (a result stored "
            "by the buffers' address or identity?): no speed") if failed else None


def time_user_path(op: OpDef, cfg: Any, case: Case, impl: Impl, mode: str, device: str,
                   settings: dict[str, Any]) -> UserTiming:
    """A user path at `case` in `mode` (forward, forward_backward), timed from outside its worker (module doc)."""
    backward = mode == FORWARD_BACKWARD
    user = impl.fn.user_path
    report: dict[str, Any] = {"mode": mode, "rule": RULE}
    try:
        worker = workers.worker_for(user)
    except Exception as exc:
        return UserTiming(None, f"its worker did not start: {type(exc).__name__}: {exc}", report)
    report["worker_start_s"] = worker.start_s
    report["worker_pid"] = worker.pid
    if worker.tampered:  # no kernel needs to: a timer, the lab's functions or torch's switches replaced at import
        return UserTiming(None, f"its import changed its worker ({'; '.join(worker.tampered)}): no speed", report)
    counter = iter(range(1_000_000))

    def draw(n: int) -> list[_Set]:
        return [_draw(op, cfg, case, case.seed + SET_SEED * (next(counter) + 1) + SEED_OFFSET, backward, device)
                for _ in range(n)]

    def put(sets: list[_Set], key: str) -> None:
        flags = [[bool(backward and t.is_floating_point() and name not in op.nondiff_inputs)
                  for t, name in zip(s.tensors, s.names)] for s in sets]
        worker.request({"op": "put", "key": key,
                        "sets": [{"args": s.args, "kwargs": s.kwargs, "tensors": [t.detach() for t in s.tensors],
                                  "flags": f} for s, f in zip(sets, flags)],
                        "grad_outs": [s.grad_out for s in sets] if backward else None})

    try:
        round_trip = _round_trip_s(lambda: worker.request({"op": "ping"}), device, PINGS)
        warm = draw(BATCH_MIN)
        put(warm, "warmup")
        per_call = max(statistics.median(worker.request({"op": "run", "key": "warmup"})["samples_s"]), 1e-9)
        # bench.max_reps caps a user path's timed calls too: the batch shrinks to fit it over BATCHES_MIN batches
        n = min(BATCH_MAX, max(BATCH_MIN, math.ceil(settings["max_reps"] / BATCHES_MIN)),
                max(BATCH_MIN, math.ceil(BATCH_ROUND_TRIPS * round_trip / per_call)))
        samples: list[float] = []
        batches: list[tuple[float, float]] = []  # per batch: (the lab's compute span, the worker's sum)
        null = None
        threads = None
        while len(batches) < BATCHES_MIN or (len(samples) < settings["max_reps"] and (
                len(samples) < settings["reps"] or sum(b[0] for b in batches) < settings["min_time_s"])):
            sets = draw(n)
            put(sets, "timed")
            _sync(device)
            start = time.perf_counter()
            done = worker.request({"op": "run", "key": "timed"})
            span = time.perf_counter() - start
            if done.get("tampered"):  # its calls changed the worker's torch switches, clocks or the lab's code
                report.update(batch_size=n, batches=len(batches) + 1)
                return UserTiming(None, f"timed batch {len(batches) + 1}: its calls changed its worker "
                                        f"({'; '.join(done['tampered'])}): no speed", report)
            if null is None:  # the same loop and checksums calling nothing: what is not the path's compute
                null = _round_trip_s(lambda: worker.request({"op": "run", "null": True}), device, NULLS)
            answer = worker.request({"op": "fetch"})  # every output, after the clock
            threads = answer["threads"]
            batches.append((span - null, sum(done["samples_s"])))
            # the lab's clock bounds the batch: where the worker's calls sum to less than the lab saw, they are scaled
            # up to it (work hidden outside the worker's per-call clock is still counted); its clock gives the shape
            scale = max(1.0, batches[-1][0] / batches[-1][1]) if batches[-1][1] > 0 else 1.0
            samples += [x * scale for x in done["samples_s"]]
            for k, (s, got) in enumerate(zip(sets, answer["results"])):
                if not _same_checksums(workers.checksums(got), done["checksums"][k]):
                    failed = "its outputs changed after the batch was answered (a result computed later?)"
                else:
                    failed = _check(op, cfg, impl, s, _outputs(op, cfg, s, got), backward)
                if failed:
                    report.update(batch_size=n, batches=len(batches))
                    return UserTiming(None, f"timed batch {len(batches)}, set {k + 1} of {n}: {failed} (an output "
                                      "not computed from its inputs: a stored or skipped result?): no speed", report)
        refused = _refill_check(op, cfg, impl, worker, draw(1)[0], backward)
        if refused:
            report.update(batch_size=n, batches=len(batches))
            return UserTiming(None, refused, report)
    except Exception as exc:
        text = str(exc).strip()
        return UserTiming(None, f"timed batch raised {type(exc).__name__}"
                                + (f": {text.splitlines()[0]}" if text else ""), report)
    lab_s, worker_s = min(batches)  # the batch the lab saw least time in: the one least disturbed
    report.update(batch_size=n, batches=len(batches), round_trip_ms=round_trip * 1e3, null_batch_ms=null * 1e3,
                  worker_total_ms=sum(w for _, w in batches) * 1e3, lab_total_ms=sum(b for b, _ in batches) * 1e3,
                  cleanest_batch={"lab_ms": lab_s * 1e3, "worker_ms": worker_s * 1e3,
                                  "worker_over_lab": worker_s / lab_s if lab_s > 0 else None})
    timing = summarize([s * 1e3 for s in samples], threads=threads, flushed=False)
    return UserTiming(timing, None, report)


def _resident_bytes(pid: int, key: str) -> int | None:
    """VmRSS or VmHWM of a process, from /proc (None where there is none: not Linux)."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None


def user_memory(op: OpDef, cfg: Any, case: Case, impl: Impl, device: str) -> tuple[dict[str, Any], str | None]:
    """MEMORY_RULE for a user path at `case`: its memory entry, and why the figure cannot be true (None if it can)."""
    worker = workers.worker_for(impl.fn.user_path)
    drawn = _draw(op, cfg, case, case.seed + SEED_OFFSET - SET_SEED, False, device)
    worker.request({"op": "put", "key": "memory", "grad_outs": None,
                    "sets": [{"args": drawn.args, "kwargs": drawn.kwargs, "flags": [False] * len(drawn.tensors),
                              "tensors": [t.detach() for t in drawn.tensors]}]})
    before = _resident_bytes(worker.pid, "VmRSS")
    try:  # "5" resets the peak resident set (VmHWM) to the current one (Linux >= 4.0)
        with open(f"/proc/{worker.pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        before = None
    worker.request({"op": "memory", "key": "memory", "device": device, "plain": True})
    after = _resident_bytes(worker.pid, "VmHWM") if before is not None else None
    resident = max(0, after - before) if after is not None else None
    answer = worker.request({"op": "memory", "key": "memory", "device": device})
    counted = answer["allocator"]["peak_bytes"] + answer["tracemalloc_bytes"]
    outputs = sum(o.numel() * o.element_size() for o in answer["outputs"])
    peak = max(counted, resident or 0)
    entry = {"peak_bytes": peak, "method": MEMORY_RULE, "allocator_bytes": answer["allocator"]["peak_bytes"],
             "tracemalloc_bytes": answer["tracemalloc_bytes"], "resident_bytes": resident, "output_bytes": outputs}
    problem = (f"its peak memory {peak} B (allocator {entry['allocator_bytes']} B, tracemalloc "
               f"{entry['tracemalloc_bytes']} B, resident growth {resident} B) is below the {outputs} B of the "
               "outputs it returned: a figure that cannot be true (MEMORY_RULE): no speed") if peak < outputs else None
    return entry, problem


@dataclass
class UserTimes:
    """Both modes of a user path at the point's case, for run_microbench."""

    forward: Timing | None
    train: Timing | None
    refused: str | None
    entry: dict[str, Any]


def microbench_times(op: OpDef, cfg: Any, case: Case, impl: Impl, device: str, settings: dict[str, Any],
                     with_backward: bool) -> UserTimes:
    """The microbench's forward and (with_backward) forward + backward times of a user path, from outside."""
    forward = time_user_path(op, cfg, case, impl, FORWARD, device, settings)
    train = (time_user_path(op, cfg, case, impl, FORWARD_BACKWARD, device, settings)
             if with_backward and forward.refused is None else None)
    refused = forward.refused or (train.refused if train else None)
    if refused and train is not None and train.refused:
        refused = f"forward + backward: {refused}"
    entry = {"worker_start_s": forward.report.get("worker_start_s"),
             "outside": {FORWARD: forward.report, **({FORWARD_BACKWARD: train.report} if train else {})}}
    return UserTimes(forward.timing, train.timing if train else None, refused, entry)


def curve_row(op: OpDef, cfg: Any, case: Case, impl: Impl, mode: str, device: str, settings: dict[str, Any],
              check: str, labels: dict[str, Any]) -> dict[str, Any]:
    """One curve row of a user path (curves.measure_row's columns), timed from outside its worker."""
    from posttrainllm.measure.curves import UNIT

    row: dict[str, Any] = dict(labels, unit=UNIT, check=check, threads=torch.get_num_threads())
    blank = dict(median=math.nan, p20=math.nan, p80=math.nan, noisy=True, reps=0, valid=False, peak_bytes=None)
    if check != "pass":
        return {**row, **blank, "reason": f"not timed: {check}"}
    timed = time_user_path(op, cfg, case, impl, mode, device, settings)
    if timed.timing is None:
        return {**row, **blank, "reason": timed.refused}
    t = timed.timing
    return {**row, "median": t.median_ms, "p20": t.p20_ms, "p80": t.p80_ms, "noisy": t.noisy,
            "reps": len(t.samples_ms), "threads": t.threads, "valid": True, "peak_bytes": None, "reason": ""}


def worker_start_s(impl: Impl) -> float | None:
    """Seconds its worker took to start in this process (spawn + import torch + the user's module), if started."""
    worker = workers.started(impl.fn.user_path)
    return worker.start_s if worker is not None else None


def promises(impl: Impl) -> list[str] | None:
    """The properties a user path's function promises (its `promises` attribute, lab/invariance.py), as its worker
    read them at load; None where its worker never started."""
    worker = workers.started(impl.fn.user_path)
    return list(worker.promises) if worker is not None else None


TRAIN_NOTE = ("a user path's step time includes its round trips to its worker process: every forward call sends its "
              "inputs and returns its outputs through pipes, every backward its gradients; not subtracted (a call "
              "carries activations, so its round trip is longer than the empty one measured here); "
              "calls_per_step x round_trip_ms is a lower bound of that share of the step")


def start_workers(paths: dict[str, Impl]) -> dict[str, dict[str, int]]:
    """Start the user paths' workers before any training clock (a start is never in a step) and say how many calls
    each has made so far; the paths whose worker could not start are left to fail in training."""
    calls = {}
    for name, impl in paths.items():
        if impl.user is None:
            continue
        try:
            calls[name] = dict(workers.worker_for(impl.fn.user_path).calls)
        except Exception:
            continue
    return calls


def train_note(paths: dict[str, Impl], before: dict[str, dict[str, int]], steps: int,
               device: str) -> dict[str, Any]:
    """bench_train.json's `user_paths`: per user path its worker's start, calls per step and empty round trip."""
    notes: dict[str, Any] = {"note": TRAIN_NOTE}
    for name, calls in before.items():
        worker = workers.worker_for(paths[name].fn.user_path)
        made = {kind: (worker.calls[kind] - calls[kind]) / steps for kind in calls}
        round_trip = _round_trip_s(lambda: worker.request({"op": "ping"}), device, PINGS)
        notes[name] = {"worker_start_s": worker.start_s, "calls_per_step": made, "round_trip_ms": round_trip * 1e3,
                       "round_trips_ms_per_step_at_least": sum(made.values()) * round_trip * 1e3}
    return notes
