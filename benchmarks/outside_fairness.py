"""How an honest outside path reads against the in-process paths it copies (docs/timing.md "Outside paths").

    python benchmarks/outside_fairness.py [ROUNDS] [hydra overrides ...]

In one process, round after round (so a load that comes and goes on a shared machine hits both sides alike): the
reference and the built-in `sdpa` timed in-process as the microbench times them (runner.InProcess.time), then two user
paths timed from outside their workers as the microbench times them (outside.time_user_path): the unedited
`new-impl` template (the reference's math) and `examples/torch_attention.py:sdpa_attention` (SDPA). Prints per
round and as medians over rounds: template / reference and sdpa_attention / sdpa (forward, forward + backward;
1.00 is fair, above 1 the outside path reads slower), and what is left per call: the batch's null over N and the
worker's own per-call times against the lab's samples (their difference: the time per call the lab counts that
the worker's per-call clock does not, which the null does not remove), and the worker's minor page faults per
call (outside.HEAP_RULE). Figures recorded in docs/timing.md.
"""

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
from posttrainllm.ops.registry import get_op  # noqa: E402
from posttrainllm.lab.isolation import worker as workers  # noqa: E402

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
sets = rooms.input_sets(op, case, torch.float32, device, bench.input_sets)
with torch.no_grad():
    grad_outs = [upstream_gradient(c, op.reference.fn(x, cfg)["out"]) for c, x in sets]
print(f"attention fp32 {op.problem(case)} threads {torch.get_num_threads()} rounds {rounds} {' '.join(overrides)}")
pairs = [("template", "reference"), ("sdpa_attention", "sdpa")]
ratios = {(u, m): [] for u, _ in pairs for m in ("forward", "forward_backward")}
left = []
for r in range(rounds):
    inside = {}
    for name in ("reference", "sdpa"):
        mine = [rooms.fresh(x, device) for _, x in sets]
        timed = runner.runner_for(paths[name]).time(op, cfg, case, mine, [g.clone() for g in grad_outs], device,
                                                    settings)
        forward, train = timed.forward, timed.train
        inside[name] = {"forward": forward.median_ms, "forward_backward": train.median_ms}
    line = []
    for user, peer in pairs:
        for mode in ("forward", "forward_backward"):
            timed = outside.time_user_path(op, cfg, case, paths[user], mode, device, settings)
            if timed.timing is None:
                line.append(f"{user} {mode}: refused ({timed.refused[:120]})")
                continue
            ratio = timed.timing.median_ms / inside[peer][mode]
            ratios[(user, mode)].append(ratio)
            rep = timed.report
            left.append((rep["null_batch_ms"] / rep["batch_size"], rep.get("worker_over_lab"),
                         (rep["lab_total_ms"] - rep["worker_total_ms"]) / rep["calls"], rep.get("faults_per_call")))
            line.append(f"{user}/{peer} {mode} {timed.timing.median_ms:.3f}/{inside[peer][mode]:.3f} ms = {ratio:.2f}x"
                        f" (N {rep['batch_size']})")
    workers.close_all()
    print(f"round {r + 1}: " + "; ".join(line), flush=True)
print("median over rounds (outside / in-process; 1.00 is fair):")
for (user, mode), values in ratios.items():
    if values:
        print(f"  {user} {mode}: {statistics.median(values):.3f}x (rounds {', '.join(f'{v:.2f}' for v in values)})")
print(f"per call: null / N median {statistics.median(x[0] for x in left) * 1e3:.1f} us (subtracted); "
      f"worker's own per-call sum / lab's samples median "
      f"{statistics.median([x[1] for x in left if x[1] is not None] or [float('nan')]):.3f}; "
      f"left in the lab's sample beyond the worker's own per-call clock median "
      f"{statistics.median(x[2] for x in left) * 1e3:.1f} us; the worker's minor page faults per call median "
      f"{statistics.median([x[3] for x in left if x[3] is not None] or [float('nan')]):.2f} (HEAP_RULE)")
