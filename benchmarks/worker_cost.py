"""What a user path's worker process costs: its start, an empty round trip, one proxied call (docs/timing.md)."""

import os, statistics, time, torch
os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)
from posttrainllm.lab.isolation import worker
from posttrainllm.ops.registry import get_op
from posttrainllm.lab.isolation.user import resolve
u = resolve("examples/torch_attention.py:sdpa_attention", get_op("attention"))
starts = []
for _ in range(3):
    worker.close_all()
    starts.append(worker.worker_for(u).start_s)
w = worker.worker_for(u)
pings = []
for _ in range(200):
    t = time.perf_counter(); w.request({"op": "ping"}); pings.append(time.perf_counter() - t)
nat = worker.remote(u)
q = torch.randn(1, 4, 128, 64); k = torch.randn(1, 2, 128, 64); v = torch.randn(1, 2, 128, 64)
calls = []
for _ in range(50):
    t = time.perf_counter(); nat(q, k, v, causal=True, sm_scale=0.125); calls.append(time.perf_counter() - t)
inproc = []
import torch.nn.functional as F
for _ in range(50):
    t = time.perf_counter(); F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True); inproc.append(time.perf_counter() - t)
print("worker start s:", [round(s, 2) for s in starts])
print("empty round trip ms: median %.4f p20 %.4f" % (statistics.median(pings) * 1e3, sorted(pings)[40] * 1e3))
print("proxy call (attention 1x4x128x64 fp32, no grad) ms median %.3f; same call in-process %.3f" % (statistics.median(calls) * 1e3, statistics.median(inproc) * 1e3))
