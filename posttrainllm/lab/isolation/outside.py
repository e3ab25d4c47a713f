"""Speed taken from outside: a user path is timed by the lab's clock over a batch its worker computes.

A user path runs in a worker process of its own (lab/isolation/worker.py); the microbench (stages.run_microbench) and
the curve (stages._curve) never call `measure()` on it. Instead, per batch:

1. the lab draws N >= 4 distinct input sets (values drawn as the point's inputs are, from a base seed it draws at
   run time: rule timing_seed; forward + backward: each with its upstream gradient) and places them in the worker
   before any clock starts;
2. its own clock (time.perf_counter; on CUDA after a device-wide synchronize) spans one request: "compute them
   all", answered with a checksum of every output, read before the answer;
3. right after, it times the same request calling nothing, in the path's worker and in a clean twin handed the
   same outputs (rule outside_null); the batch's sample is (span - the smaller null) / N, the figure the median
   over the batches (rule outside_agreement);
4. after the clock, it asks what the calls changed of the worker (a request of its own), fetches every output (and
   gradient), requires each to match its checksum and checks each against the float64 oracle of its set.

N comes from two warm-up batches timed and checked the same way (rule outside_warmup). The worker's heap stays
mapped (rule outside_heap), as a long-running lab process's does, and each call's results are copied out and freed
before the next call, as the in-process loop frees them (rule outside_keep). Fresh sets each batch, and the refill
after the last batch (rule outside_refill), make a stored result wrong. Each span leaves out what the worker and
the lab's thread waited on a run queue (rule outside_run_queue); a batch not above its null is unreadable, never a
sample (rule outside_unreadable). A path's processes and threads are watched (rules outside_process,
outside_thread), and so are stops of the lab itself (rule lab_stopped). Every set is judged by the parity stage's
own rules (oracle.judge_path). A user path's memory is its worker's (rule outside_memory), counted inside it and
from outside. The rules' text is the package's table (posttrainllm/rules.py, docs/rules.md); a report cites them
by id.
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from posttrainllm import rules
from posttrainllm.lab import oracle
from posttrainllm.measure.timing import BATCH_MAX, BATCHES_MIN, Timing, schedstat, summarize
from posttrainllm.ops.registry import Case, Impl, OpDef
from posttrainllm.ops.base import point_dtype
from posttrainllm.lab.isolation import worker as workers
from posttrainllm.measure import device as devices

BATCH_MIN = 4  # calls in a batch at least (at most: timing.BATCH_MAX)
WARMUPS = 2  # warm-up batches (rule outside_warmup)
BATCH_OVER_NULL = 20  # a batch computes for at least this many null spans, when N <= BATCH_MAX allows
PINGS = 9  # repetitions of the empty call (recorded: round_trip_ms; no figure depends on it)
SET_SEED = 7_919  # set k of a path's timing draws its inputs from a base seed drawn at run time + SET_SEED * (k + 1)
SEED_OFFSET = 2 * 104_729  # the memory call's set: away from the parity cases' seeds and stages.FRESH_SEED
UNREADABLE_MAX = 3 * BATCHES_MIN  # rule outside_unreadable
OTHER_THREADS_SHARE = 0.02  # rule outside_run_queue: the worker's other threads may run this share of a span
COLD_CALLS = 5  # a batch's first calls, recorded against the rest: they start cold (docs/timing.md, "Sixth pass")
IDLE_CPU_S = 0.05  # rule outside_process: CPU seconds a path's children may use over its timing (startup, a pool)
FORWARD, FORWARD_BACKWARD = "forward", "forward_backward"


def timing_rule() -> rules.Cited:
    """How a mode's report cites the way it was timed (rule outside_timing and its parts), with this code's
    constants."""
    return rules.cite("outside_timing", batch_min=BATCH_MIN, warmups=WARMUPS, wake_ms=workers.WAKE_S * 1e3,
                      mmap_max_mib=workers.MMAP_THRESHOLD_MAX / 2**20, other_threads_share=OTHER_THREADS_SHARE,
                      batches_min=BATCHES_MIN, unreadable_max=UNREADABLE_MAX, idle_cpu_s=IDLE_CPU_S)


_CONTINUED = [0]


def _on_continue(signum: int, frame: Any) -> None:
    _CONTINUED[0] += 1


def continued() -> int:
    """Rule lab_stopped: how many times this lab process has been continued after a stop (0 where it was never stopped,
    or the handler could not be set: imported off the main thread)."""
    return _CONTINUED[0]


if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGCONT"):
    signal.signal(signal.SIGCONT, _on_continue)


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
    grad_out: oracle.Upstream | None
    case: Case
    # the upstream gradient as the worker backpropagates it: grad_out, or (more differentiable outputs) a list in
    # the order of the natural call's results
    worker_grad_out: torch.Tensor | list[torch.Tensor] | None = None


def _draw(op: OpDef, cfg: Any, case: Case, seed: int, backward: bool, device: str) -> _Set:
    """One input set as the point's are drawn, and the natural call the path's adapter makes of it."""
    drawn = dataclasses.replace(case, seed=seed)
    inputs = op.make_inputs(drawn, point_dtype(cfg), device)
    seen: list[tuple[tuple, dict]] = []
    probes = tuple(torch.empty(0) for _ in op.differentiable_outputs)  # one natural result per differentiable output

    def record(*args: Any, **kwargs: Any) -> Any:
        seen.append((args, kwargs))
        return probes if len(probes) > 1 else probes[0]

    mapped = op.adapt(record)(inputs, cfg)
    args, kwargs, tensors = workers.split_call(*seen[0])
    names = [next((n for n, x in inputs.items() if x is t), None) for t in tensors]
    grad_out = None
    if backward:
        with torch.no_grad():
            grad_out = oracle.upstream_gradients(op, drawn, op.reference.fn(inputs, cfg))
    natural = grad_out
    if isinstance(grad_out, dict):  # the natural results' order: which output the adapter made of each
        natural = [grad_out[next(n for n, v in mapped.items() if v is p)] for p in probes]
    return _Set(inputs, args, kwargs, tensors, names, grad_out, drawn, natural)


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
    """Every output the set returned against the float64 oracle of that set, by the parity stage's own rules
    (oracle.judge_path: the gradient row floors, the rows' shapes, the gradient baselines, the fallback scale), as
    the built-in paths' timed results are judged: None, or the first failure."""
    inputs = {name: x for name, x in s.inputs.items()}
    truth = oracle.reference_outputs(op, cfg, oracle.cast_floats(inputs, torch.float64), s.case,
                                     oracle.each(s.grad_out, torch.Tensor.double) if backward else None)
    baseline = oracle.reference_outputs(op, cfg, inputs, s.case, s.grad_out if backward else None)
    if backward:
        oracle.worst_gradient_baseline(op, cfg, inputs, s.case, s.grad_out, truth, baseline)
    wanted = ["out", *(op.gradient_names() if backward else [])]
    wanted += [name for name in got if name not in wanted and name in truth]  # returned extras (a logsumexp)
    for name in wanted:
        value = got.get(name)
        if not isinstance(value, torch.Tensor):
            return f"{name}: missing" if value is None else f"{name}: a {type(value).__name__}, not a tensor"
    cpu = lambda d: {k: v.detach().cpu() for k, v in d.items() if isinstance(v, torch.Tensor)}  # noqa: E731
    record = {"case": dataclasses.asdict(s.case), "oracle": cpu(truth), "baseline": cpu(baseline)}
    result = oracle.judge_path(op, impl, cfg, [record], [cpu({k: got[k] for k in wanted})], forward=not backward)
    return None if result["verdict"] == "pass" else result["failed_cases"][0].removeprefix(f"{s.case.name}/")


def _same_checksums(got: list[float | None], sent: list[float | None]) -> bool:
    same = lambda a, b: a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))  # noqa: E731
    return len(got) == len(sent) and all(same(a, b) for a, b in zip(got, sent))


def _outputs(op: OpDef, cfg: Any, s: _Set, answer: dict[str, Any]) -> dict[str, Any]:
    """A set's answer in the registry's dict form: the adapter on the natural result, plus grad_<input>."""
    result = workers.rebuild_result(answer["result"], answer["outputs"])
    got = dict(op.adapt(lambda *a, **k: result)(s.inputs, cfg))
    for name, grad in zip(s.names, answer.get("grads") or []):
        if name is not None and grad is not None:
            got[f"grad_{name}"] = grad
    return got


def _refill_check(op: OpDef, cfg: Any, impl: Impl, worker: Any, new: _Set, backward: bool) -> str | None:
    """Rule outside_refill: the last batch's first set refilled in place with `new`'s values and computed again in the
    worker; None if its outputs are `new`'s, else why no speed."""
    worker.request({"op": "refill", "tensors": [t.detach() for t in new.tensors],
                    "grad_out": new.worker_grad_out if backward else None})
    tampered = worker.request({"op": "scan"})["tampered"]
    if tampered:
        return f"new values in its timed buffers: its call changed its worker ({'; '.join(tampered)}): no speed"
    got = worker.request({"op": "fetch"})["results"][0]
    failed = _check(op, cfg, impl, new, _outputs(op, cfg, new, got), backward)
    return (f"new values in its timed buffers (refilled in place after the last batch): {failed} (a result stored "
            "by the buffers' address or identity?): no speed") if failed else None


def minor_faults(pid: int) -> int | None:
    """A process's minor page faults so far (/proc/<pid>/stat field 10; None where there is none): rule outside_heap's
    witness, read by the lab from outside the worker."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return None


def _process_cpu_ns(pid: int) -> int | None:
    """The CPU time of every thread a process has run, ended ones included, in ns: its process CPU clock
    (clock_getcpuclockid, read from outside: MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)), None where the kernel
    does not give it. Exact, where the utime + stime of /proc/<pid>/stat are clock ticks (10 ms each)."""
    try:
        return time.clock_gettime_ns(((~pid) << 3) | 2)
    except (OSError, OverflowError, AttributeError):
        return None


def _scheduled(pid: int) -> dict[str, Any]:
    """Rule outside_run_queue's readings now: the worker's main thread's and the lab's calling thread's (run,
    waited) ns, and the ns the worker's other threads have run (rule outside_thread): those that ended included,
    from the process's CPU clock less its main thread's, else its live threads' alone."""
    main = schedstat(f"/proc/{pid}/task/{pid}/schedstat")
    process = _process_cpu_ns(pid)
    if process is not None and main is not None:
        others = max(process - main[0], 0)
    else:
        others = 0
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                if tid != str(pid):
                    others += (schedstat(f"/proc/{pid}/task/{tid}/schedstat") or (0, 0))[0]
        except OSError:
            pass
    return {"worker": main, "others_ran": others,
            "lab": schedstat(f"/proc/self/task/{threading.get_native_id()}/schedstat")}


def _waited_s(before: dict[str, Any], after: dict[str, Any], span: float) -> float:
    """Rule outside_run_queue: the seconds of a span the worker's main thread and the lab's thread spent runnable
    but not running (another process had the core), never more than leaves the span at what the two ran on a core;
    0 where the kernel does not say or the worker's other threads ran over OTHER_THREADS_SHARE of the span (work
    beside the main thread: the wall span stands)."""
    if before["worker"] is None or after["worker"] is None:
        return 0.0
    if (after["others_ran"] - before["others_ran"]) / 1e9 > OTHER_THREADS_SHARE * span:
        return 0.0
    ran, waited = (after["worker"][0] - before["worker"][0]) / 1e9, (after["worker"][1] - before["worker"][1]) / 1e9
    if before.get("lab") is not None and after.get("lab") is not None:  # the lab's own wait: reading the answer late
        ran += (after["lab"][0] - before["lab"][0]) / 1e9
        waited += (after["lab"][1] - before["lab"][1]) / 1e9
    return min(max(waited, 0.0), max(span - ran, 0.0))


def _asleep(pid: int, timeout_s: float = 0.05) -> bool:
    """Whether the worker's main thread is asleep (waiting for the lab's next request), waiting up to `timeout_s`
    for it: a wait on the run queue is credited when the thread next runs, so one begun after its last answer
    would otherwise be credited to the next span (rule outside_run_queue)."""
    deadline = time.perf_counter() + timeout_s
    while True:
        try:
            with open(f"/proc/{pid}/task/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("S", "D"):
                    return True
        except (OSError, IndexError):
            return False
        if time.perf_counter() >= deadline:
            return False
        time.sleep(0.0001)


def _span(worker: Any, device: str, message: dict[str, Any]) -> tuple[float, float, dict[str, Any], int | None]:
    """One request on the lab's clock: (its span, the part of it waited on a run queue (rule outside_run_queue),
    the answer, the worker's minor page faults in it (rule outside_heap)). The kernel's readings are taken next to
    the clock's, the worker asleep before them."""
    asleep = _asleep(worker.pid)
    faults, before = minor_faults(worker.pid), _scheduled(worker.pid)
    _sync(device)
    start = time.perf_counter()
    answer = worker.request(message)
    span = time.perf_counter() - start
    after, faulted = _scheduled(worker.pid), minor_faults(worker.pid)
    waited = _waited_s(before, after, span) if asleep else 0.0
    return span, waited, answer, (faulted - faults if None not in (faults, faulted) else None)


def _null_s(worker: Any, device: str) -> float:
    """The lab's span of one request that runs the batch loop and its checksums over the last results, calling
    nothing, less what it waited on a run queue."""
    span, waited, _, _ = _span(worker, device, {"op": "run", "null": True})
    return span - waited


def _batch(worker: Any, device: str, sets: list[_Set]) -> tuple[float, float, float, dict[str, Any]]:
    """One placed batch computed under the lab's clock: (its span less what it waited on a run queue, the path's
    worker's null after it, the clean twin's null over the same outputs, the run's answer with the seconds waited
    and the worker's minor faults in the span)."""
    span, waited, done, faults = _span(worker, device, {"op": "run", "key": "timed"})
    own = _null_s(worker, device)
    answer = worker.request({"op": "fetch"})
    twin = workers.twin()
    twin.request({"op": "twin", "answers": answer["results"], "inputs": [[t.detach() for t in s.tensors] for s in sets],
                  "backward": any(a.get("grads") for a in answer["results"])})
    clean = _null_s(twin, device)
    return span - waited, own, clean, {**done, **answer, "run_checksums": done["checksums"], "faults": faults,
                                       "waited_s": waited, "span_s": span}


def seeds_drawn() -> list[int]:
    """Rule timing_seed: a fresh base seed per user path and mode, from the operating system's randomness."""
    return [secrets.randbits(48)]


def time_user_path(op: OpDef, cfg: Any, case: Case, impl: Impl, mode: str, device: str,
                   settings: dict[str, Any]) -> UserTiming:
    """A user path at `case` in `mode` (forward, forward_backward), timed from outside its worker (module doc)."""
    backward = mode == FORWARD_BACKWARD
    user = impl.source
    report: dict[str, Any] = {"mode": mode, "rule": timing_rule()}
    try:
        worker = workers.worker_for(user)
    except Exception as exc:
        return UserTiming(None, f"its worker did not start: {type(exc).__name__}: {exc}", report)
    report["worker_start_s"] = worker.start_s
    report["worker_pid"] = worker.pid
    if worker.tampered:  # no kernel needs to: a timer, the lab's functions or torch's switches replaced at import
        return UserTiming(None, f"its import changed its worker ({'; '.join(worker.tampered)}): no speed", report)
    cpus = _pin_workers(worker)
    report["cpus"] = sorted(cpus) if cpus is not None else None
    base = seeds_drawn()[0]  # drawn now, by the lab: no source holds it; recorded after the timing
    counter = iter(range(1_000_000))

    def draw(n: int) -> list[_Set]:
        return [_draw(op, cfg, case, base + SET_SEED * (next(counter) + 1), backward, device) for _ in range(n)]

    def put(sets: list[_Set], key: str) -> None:
        flags = [[bool(backward and t.is_floating_point() and name not in op.nondiff_inputs)
                  for t, name in zip(s.tensors, s.names)] for s in sets]
        worker.request({"op": "put", "key": key,
                        "sets": [{"args": s.args, "kwargs": s.kwargs, "tensors": [t.detach() for t in s.tensors],
                                  "flags": f} for s, f in zip(sets, flags)],
                        "grad_outs": [s.worker_grad_out for s in sets] if backward else None})

    def checked(sets: list[_Set], answer: dict[str, Any], what: str) -> str | None:
        """Why a computed batch earns nothing (its calls changed the worker, an output changed after the answer,
        one is wrong), else None."""
        scan = worker.request({"op": "scan"})["tampered"]  # after the clock: the span holds no scan
        if scan:
            return f"{what}: its calls changed its worker ({'; '.join(scan)}): no speed"
        for k, (s, got) in enumerate(zip(sets, answer["results"])):
            if not _same_checksums(workers.checksums(got), answer["run_checksums"][k]):
                failed = "its outputs changed after the batch was answered (a result computed later?)"
            else:
                failed = _check(op, cfg, impl, s, _outputs(op, cfg, s, got), backward)
            if failed:
                return (f"{what}, set {k + 1} of {len(sets)}: {failed} (an output not computed from its inputs: a "
                        "stored or skipped result?): no speed")
        return None

    def refuse(why: str, **figures: Any) -> UserTiming:
        report.update(figures)
        return UserTiming(None, why, report)

    try:
        stray, before = _strays(worker)
        if stray:
            return refuse(stray)
        round_trip = _round_trip_s(lambda: worker.request({"op": "ping"}), device, PINGS)  # recorded, never used
        warm_spent = 0.0
        for k in range(WARMUPS):  # batches like the timed ones, on the lab's clock, every output checked; the last sizes N
            warm = draw(BATCH_MIN)
            put(warm, "timed")
            span, own, clean, answer = _batch(worker, device, warm)
            warm_spent += span
            failed = checked(warm, answer, f"warm-up batch {k + 1}")
            if failed:
                return refuse(failed, batch_size=BATCH_MIN, batches=0)
        null = min(own, clean)
        per_call = max((span - null) / BATCH_MIN, 1e-9)
        # N: the batch computes for BATCH_OVER_NULL nulls, within [BATCH_MIN, BATCH_MAX] and bench.max_reps's share
        n = min(BATCH_MAX, max(BATCH_MIN, math.ceil(settings["max_reps"] / BATCHES_MIN)),
                max(BATCH_MIN, math.ceil(BATCH_OVER_NULL * null / per_call)))
        samples: list[float] = []
        nulls: list[tuple[float, float]] = []
        worker_s: list[float] = []
        faults: list[float] = []  # rule outside_heap: the worker's minor page faults per call in each span
        waits: list[float] = []  # rule outside_run_queue: the share of each span waited on a run queue (subtracted)
        starts: list[float] = []  # each batch's first COLD_CALLS calls over the rest, by the worker's own clock
        spent, calls, unreadable = 0.0, 0, 0
        while len(samples) < BATCHES_MIN or (calls + n <= settings["max_reps"] and (
                calls < settings["reps"] or spent < settings["min_time_s"])):
            sets = draw(n)
            put(sets, "timed")
            span, own, clean, answer = _batch(worker, device, sets)
            failed = checked(sets, answer, f"timed batch {len(samples) + unreadable + 1}")
            if failed:
                return refuse(failed, batch_size=n, batches=len(samples) + unreadable + 1)
            null = min(own, clean)  # rule outside_null: a null slowed by the path's own process is not subtracted
            spent += span
            calls += n
            if span <= null:  # rule outside_unreadable: counted, never a sample
                unreadable += 1
                if unreadable > UNREADABLE_MAX:
                    return refuse(f"{unreadable} of {unreadable + len(samples)} batches did not stand above their "
                                  "null (the load on the cores moved the spans more than the calls took; "
                                  f"{rules.named('outside_unreadable')}): the machine was too loaded to time it, "
                                  "no speed",
                                  batch_size=n, batches=len(samples), unreadable_batches=unreadable)
                continue
            samples.append((span - null) / n)
            nulls.append((own, clean))
            worker_s.append(sum(answer["samples_s"]))
            faults.append(answer["faults"] / n if answer["faults"] is not None else math.nan)
            waits.append(answer["waited_s"] / answer["span_s"] if answer["span_s"] > 0 else 0.0)
            own = answer["samples_s"]
            if len(own) > 2 * COLD_CALLS and statistics.median(own[COLD_CALLS:]) > 0:
                starts.append(statistics.fmean(own[:COLD_CALLS]) / statistics.median(own[COLD_CALLS:]))
        threads = answer["threads"]
        refused = (_refill_check(op, cfg, impl, worker, draw(1)[0], backward)
                   or _strays(worker, before, spans_s=spent + warm_spent)[0] or _moved(worker, cpus))
        if refused:
            return refuse(refused, batch_size=n, batches=len(samples))
    except Exception as exc:
        text = str(exc).strip()
        return UserTiming(None, f"timed batch raised {type(exc).__name__}"
                                + (f": {text.splitlines()[0]}" if text else ""), report)
    lab_s = sum(samples) * n
    report.update(batch_size=n, batches=len(samples), unreadable_batches=unreadable, calls=n * len(samples), round_trip_ms=round_trip * 1e3,
                  null_batch_ms=statistics.median(min(a, b) for a, b in nulls) * 1e3,
                  own_null_ms=statistics.median(a for a, _ in nulls) * 1e3,
                  clean_null_ms=statistics.median(b for _, b in nulls) * 1e3,
                  lab_total_ms=lab_s * 1e3, worker_total_ms=sum(worker_s) * 1e3,
                  worker_over_lab=sum(worker_s) / lab_s if lab_s > 0 else None,
                  faults_per_call=statistics.median(faults), heap_kept=worker.heap_kept,
                  run_queue_share=statistics.median(waits),
                  first_calls_over_rest=statistics.median(starts) if starts else None,
                  # after the timing: replay checks them
                  timing_seeds={"base": base, "rule": rules.cite("timing_seed")})
    # rule batch_mean's statistic, its batches timed from outside
    timing = summarize([s * 1e3 for s in samples], threads=threads, flushed=False, batched=True, batch_size=n)
    return UserTiming(timing, None, report)


def _pin_workers(worker: Any) -> set[int] | None:
    """Rule same_cpus: the path's worker and the clean twin pinned to the CPUs this lab process may run on now (a
    timed stage's, pinned: lab/stages/common.py on_same_cpus), every thread of each; those CPUs (None off Linux)."""
    own = devices.own_cpus()
    if own is None:
        return None
    cpus = set(own)
    for process in (worker, workers.twin()):
        devices.pin(process.pid, cpus)
    return cpus


def _moved(worker: Any, cpus: set[int] | None) -> str | None:
    """Rule same_cpus: why no speed where a thread of the path's worker may now run on other CPUs than the lab
    pinned it to (a faster one, on a machine whose CPUs differ), else None."""
    if cpus is None:
        return None
    found = devices.affinities(worker.pid)
    if found and found != {frozenset(cpus)}:
        return (f"its worker's threads moved to CPUs {sorted(sorted(a) for a in found)} from {sorted(cpus)}, where "
                f"the lab times every path ({rules.named('same_cpus')}): no speed")
    return None


def _strays(worker: Any, since: dict[Any, float] | None = None,
            spans_s: float = 0.0) -> tuple[str | None, dict[Any, float]]:
    """Rules outside_process and outside_thread: (why no speed or None, each child process's CPU seconds now, and under
    "threads" the seconds the worker's threads other than its main one have run). Refused: a process the path's
    worker left orphaned (adopted by the zygote; ended), or, `since` an earlier look, its children's CPU time grown
    by over IDLE_CPU_S (a pool waiting for work uses none), or at one lab thread its other threads' by over
    OTHER_THREADS_SHARE of the timed spans `spans_s` (capped at IDLE_CPU_S)."""
    now: dict[Any, float] = {pid: workers.cpu_s([pid]) for pid in workers.descendants_of(worker.pid)}
    now["threads"] = _scheduled(worker.pid)["others_ran"] / 1e9
    adopted = workers.strays()
    if adopted:
        workers.end_strays()
        return (f"processes it started and left (pids {', '.join(map(str, adopted))}) were running beside its worker: "
                "they could compute outside the timed span or take the cores the lab times others on "
                f"({rules.named('outside_process')}); ended: no speed"), now
    if since is not None:
        children = [pid for pid in now if pid != "threads"]
        used = sum(now[pid] - since.get(pid, 0.0) for pid in children)
        if used > IDLE_CPU_S:
            return (f"processes beside its worker (pids {', '.join(map(str, children))}) used {used:.3f} s of CPU "
                    f"while it was timed ({rules.named('outside_process')}): no speed"), now
        threads, allowed = now["threads"] - since.get("threads", 0.0), min(IDLE_CPU_S, OTHER_THREADS_SHARE * spans_s)
        if worker.threads == 1 and threads > allowed:
            return (f"threads beside its worker's main thread used {threads * 1e3:.1f} ms of CPU while it was timed "
                    f"(allowed {allowed * 1e3:.1f} ms at one lab thread; {rules.named('outside_thread')}): "
                    "no speed"), now
    return None, now


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
    """Rule outside_memory for a user path at `case`: its memory entry, and why the figure cannot be true (None if
    it can)."""
    worker = workers.worker_for(impl.source)
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
    entry = {"peak_bytes": peak, "method_rule": rules.cite("outside_memory"),
             "allocator_bytes": answer["allocator"]["peak_bytes"],
             "tracemalloc_bytes": answer["tracemalloc_bytes"], "resident_bytes": resident, "output_bytes": outputs}
    problem = ((f"its peak memory {peak} B (allocator {entry['allocator_bytes']} B, tracemalloc "
               f"{entry['tracemalloc_bytes']} B, resident growth {resident} B) is below the {outputs} B of the "
               f"outputs it returned: a figure that cannot be true ({rules.named('outside_memory')}): no speed")
               if peak < outputs else None)
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
    worker = workers.started(impl.source)
    return worker.start_s if worker is not None else None


def promises(impl: Impl) -> list[str] | None:
    """The properties a user path's function promises (its `promises` attribute, lab/invariance.py), as its worker
    read them at load; None where its worker never started."""
    worker = workers.started(impl.source)
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
        if impl.source is None:
            continue
        try:
            calls[name] = dict(workers.worker_for(impl.source).calls)
        except Exception:
            continue
    return calls


def train_note(paths: dict[str, Impl], before: dict[str, dict[str, int]], steps: int,
               device: str) -> dict[str, Any]:
    """bench_train.json's `user_paths`: per user path its worker's start, calls per step and empty round trip."""
    notes: dict[str, Any] = {"note": TRAIN_NOTE}
    for name, calls in before.items():
        worker = workers.worker_for(paths[name].source)
        made = {kind: (worker.calls[kind] - calls[kind]) / steps for kind in calls}
        round_trip = _round_trip_s(lambda: worker.request({"op": "ping"}), device, PINGS)
        notes[name] = {"worker_start_s": worker.start_s, "calls_per_step": made, "round_trip_ms": round_trip * 1e3,
                       "round_trips_ms_per_step_at_least": sum(made.values()) * round_trip * 1e3}
    return notes
