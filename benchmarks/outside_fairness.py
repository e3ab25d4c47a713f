"""How an honest outside path reads against the in-process paths it copies (docs/timing.md "Outside paths").

    python benchmarks/outside_fairness.py [ROUNDS] [hydra overrides ...]

In one process, round after round, and within a round A/B/A for each pair and mode: the in-process peer timed as the
microbench times it (measure(), rotating over rooms.timed_input_sets, batch means: rule batch_mean), then the user path timed from outside its worker
as the microbench times it (outside.time_user_path), then the peer again. The user paths: the unedited `new-impl`
template (the reference's math) against the reference, and `examples/torch_attention.py:sdpa_attention` against the
built-in `sdpa`. A shared machine changes speed for seconds at a time (measured: the same loop 0.26 or 0.47 ms a
call, seconds apart); a ratio is taken against the peer's geometric mean over its two timings around the path's, and
a round whose two peer timings differ by over 15% is marked (the machine changed speed within it).

Prints per round (with os.getloadavg()) and as medians over rounds: outside / in-process (forward, forward +
backward; 1.00 is fair, above 1 the outside path reads slower); the same path's math loaded in this process and
timed in-process, against the peer (what the copy itself costs, not the method); the path from outside against
that same math in process (the method alone, the copy's own cost out); and what is left per call: the
batch's null over N, the lab's sample beyond the worker's own per-call clock, the share of the spans waited on a
run queue (subtracted), the unreadable batches, the worker's minor page faults per call, and how much slower a
batch's first calls ran than the rest (the worker's own clock). Figures recorded in docs/timing.md.
"""

import dataclasses
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
rounds = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 5
overrides = [a for a in sys.argv[1:] if not a.isdigit()]

import torch  # noqa: E402

from posttrainllm.lab import runner  # noqa: E402
from posttrainllm.lab.isolation import outside, rooms  # noqa: E402
from posttrainllm.lab.configure import load  # noqa: E402
from posttrainllm.lab.oracle import upstream_gradient  # noqa: E402
from posttrainllm.measure import device as devices  # noqa: E402
from posttrainllm.measure.timing import measure  # noqa: E402
from posttrainllm.ops.registry import get_op  # noqa: E402
from posttrainllm.lab.isolation import worker as workers  # noqa: E402

FLIP = 0.15  # a round whose two peer timings differ by more: the machine changed speed within it

folder = Path(tempfile.mkdtemp(prefix="outside-fairness-"))
subprocess.run([sys.executable, "-m", "posttrainllm", "new-impl", "op=attention", str(folder / "template.py")],
               check=True, capture_output=True, cwd=folder)
template, sdpa_file = folder / "template.py", ROOT / "examples" / "torch_attention.py"
specs = [f'"template={template}:attention"', f'"sdpa_attention={sdpa_file}:sdpa_attention"']
cfg = load(["op=attention", "precision=fp32", "device=cpu", "run.log_mlflow=false", f"op.user_impls=[{','.join(specs)}]",
            *overrides])
op = get_op(cfg.op.name)
device = devices.prepare(cfg.device.name, cfg.bench.threads)
case = next(c for c in op.cases(cfg) if c.main)
paths = runner.paths(op, cfg)
bench = cfg.bench
settings = dict(warmup=bench.warmup, reps=bench.reps, min_time_s=bench.min_time_s, max_reps=bench.max_reps)
sets = rooms.timed_input_sets(op, case, torch.float32, device, bench)
with torch.no_grad():
    grad_outs = [upstream_gradient(c, op.reference.fn(x, cfg)["out"]) for c, x in sets]
pairs = [("template", "reference"), ("sdpa_attention", "sdpa")]
# each user path's math loaded in this process, timed in-process like its peer (what the copy itself costs)
here = {user: dataclasses.replace(paths[peer], fn=runner.runner_for(paths[user]).loaded_here(op)) for user, peer in pairs}


def in_process(impl, mode: str) -> float:
    """The path timed as the microbench's InProcess runner times it (runner.InProcess.time): its median ms."""
    run = runner.InProcess(impl)
    mine = [rooms.fresh(x, device) for _, x in sets]
    if mode == "forward":
        with torch.no_grad():
            return measure(rooms.rotating([lambda x=x: run.forward(x, cfg) for x in mine]), device=device,
                           batched=True, **settings).median_ms
    calls = [run.forward_backward(x, g.clone(), cfg) for x, g in zip(mine, grad_outs)]
    return measure(rooms.rotating(calls), device=device, batched=True, **settings).median_ms


pinned = devices.same_cpus(cfg.bench.threads)  # rule same_cpus: as the microbench stage times, on fixed CPUs
cpus = pinned.__enter__()
print(f"attention fp32 {op.problem(case)} threads {torch.get_num_threads()} rounds {rounds} {' '.join(overrides)}; "
      f"load average {os.getloadavg()[0]:.2f}; CPUs {sorted(cpus) if cpus else 'not pinned'}")
ratios = {(u, m): [] for u, _ in pairs for m in ("forward", "forward_backward")}
steady = {key: [] for key in ratios}  # the rounds where the peer's two timings agree within FLIP
copies = {key: [] for key in ratios}  # the user's math in this process / the peer
method = {key: [] for key in ratios}  # the path from outside / its own math in this process: the method alone
left = []
for r in range(rounds):
    line = []
    for user, peer in pairs:
        for mode in ("forward", "forward_backward"):
            before = in_process(paths[peer], mode)
            timed = outside.time_user_path(op, cfg, case, paths[user], mode, device, settings)
            after = in_process(paths[peer], mode)
            copy = in_process(here[user], mode)
            peer_ms = math.sqrt(before * after)
            copies[(user, mode)].append(copy / peer_ms)
            if timed.timing is None:
                line.append(f"{user} {mode}: refused ({timed.refused[:120]})")
                continue
            ratio = timed.timing.median_ms / peer_ms
            method[(user, mode)].append(timed.timing.median_ms / copy)
            flipped = abs(math.log(after / before)) > math.log(1 + FLIP)
            ratios[(user, mode)].append(ratio)
            if not flipped:
                steady[(user, mode)].append(ratio)
            rep = timed.report
            readable = rep["batches"] * rep["batch_size"]
            left.append((rep["null_batch_ms"] / rep["batch_size"], rep.get("worker_over_lab"),
                         (rep["lab_total_ms"] - rep["worker_total_ms"]) / readable, rep.get("faults_per_call"),
                         rep["run_queue_share"], rep.get("unreadable_batches", 0), rep.get("first_calls_over_rest")))
            line.append(f"{user}/{peer} {mode} {timed.timing.median_ms:.3f}/{peer_ms:.3f} ms = {ratio:.2f}x"
                        f"{' (peer moved %.2f->%.3f)' % (before, after) if flipped else ''} (N {rep['batch_size']})")
    workers.close_all()
    print(f"round {r + 1} (load {os.getloadavg()[0]:.2f}): " + "; ".join(line), flush=True)
print(f"median over rounds (outside / in-process; 1.00 is fair); load average now {os.getloadavg()[0]:.2f}:")
for key, values in ratios.items():
    user, mode = key
    if values:
        held = (f"{statistics.median(steady[key]):.3f}x over {len(steady[key])}" if steady[key] else "none")
        print(f"  {user} {mode}: {statistics.median(values):.3f}x (rounds {', '.join(f'{v:.2f}' for v in values)}); "
              f"the rounds where the peer held its speed: {held}")
    print(f"    its math in this process / the peer: {statistics.median(copies[key]):.3f}x")
    if method[key]:
        print(f"    from outside / its own math in this process (the method alone): {statistics.median(method[key]):.3f}x "
              f"(rounds {', '.join(f'{v:.2f}' for v in method[key])})")
if left:
    med = lambda i: statistics.median([x[i] for x in left if x[i] is not None] or [float("nan")])  # noqa: E731
    print(f"per call: null / N median {med(0) * 1e3:.1f} us (subtracted); worker's own per-call sum / lab's samples "
          f"median {med(1):.3f}; left in the lab's sample beyond the worker's own per-call clock median "
          f"{med(2) * 1e3:.1f} us; run-queue share of the spans (subtracted) median {med(4):.3f}; unreadable batches "
          f"{sum(x[5] for x in left)}; the worker's minor page faults per call median {med(3):.2f} (rule outside_heap); "
          f"a batch's first {outside.COLD_CALLS} calls over the rest, by the worker's clock, median {med(6):.3f}")
