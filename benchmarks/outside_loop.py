"""Does the worker's batch loop itself cost an outside path time its null does not remove? (docs/timing.md)

    PYTHONPATH=. python benchmarks/outside_loop.py [hydra overrides ...]

In this one process, no worker and no pipe: examples/torch_attention.py's sdpa_attention timed (a) as the
microbench times an in-process path (measure(), batched, rotating over the 40 sets) and (b) by the worker's own
batch loop over the same 40 sets (_Server.put, _Server.run and its null, called directly): its per-call clock and
(span - null) / N. Eight rounds, interleaved. (span - null) / N over (a) is what the loop leaves in a sample; the
rest of an outside path's gap to its in-process peer is the worker process's."""
import os, statistics, sys, importlib.util
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
from posttrainllm.lab.configure import load
from posttrainllm.lab.isolation import outside, worker as W
from posttrainllm.measure import device as devices
from posttrainllm.measure.timing import measure
from posttrainllm.ops.registry import get_op
cfg = load(["op=attention", "precision=fp32", "device=cpu", "run.log_mlflow=false"] + sys.argv[1:])
op = get_op(cfg.op.name); device = devices.prepare("cpu", cfg.bench.threads)
case = next(c for c in op.cases(cfg) if c.main)
spec = importlib.util.spec_from_file_location("ta", "examples/torch_attention.py"); ta = importlib.util.module_from_spec(spec); spec.loader.exec_module(ta)
fn = ta.sdpa_attention
N = 40
b = cfg.bench
settings = dict(warmup=b.warmup, reps=b.reps, min_time_s=b.min_time_s, max_reps=b.max_reps)
srv = W._Server(); srv.fn = fn
res = {"measure": [], "loop": [], "loop_span": []}
import time
for rnd in range(8):
    sets = [outside._draw(op, cfg, case, 1000 + 7919 * (rnd * N + i), False, "cpu") for i in range(N)]
    calls = [W._join(s.args, s.kwargs, s.tensors) for s in sets]
    it = iter(range(10**9))
    with torch.no_grad():
        t = measure(lambda: (lambda a, k: fn(*a, **k))(*calls[next(it) % N]), device="cpu", batched=True, **settings)
    res["measure"].append(t.median_ms)
    srv.put({"key": "timed", "sets": [{"args": s.args, "kwargs": s.kwargs, "tensors": [x.detach() for x in s.tensors], "flags": [False] * len(s.tensors)} for s in sets], "grad_outs": None})
    t0 = time.perf_counter()
    out = srv.run({"key": "timed"})
    span = time.perf_counter() - t0
    t0 = time.perf_counter(); srv.run({"null": True}); null = time.perf_counter() - t0
    res["loop"].append(statistics.median(out["samples_s"]) * 1e3)
    res["loop_span"].append((span - null) / N * 1e3)
for k, v in res.items():
    print(k, [f"{x:.3f}" for x in v], "median", f"{statistics.median(v):.3f}")
print("loop per-call median / measure:", f"{statistics.median(a / b for a, b in zip(res['loop'], res['measure'])):.3f}",
      "(span-null)/N / measure:", f"{statistics.median(a / b for a, b in zip(res['loop_span'], res['measure'])):.3f}")
