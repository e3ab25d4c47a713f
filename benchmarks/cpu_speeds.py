"""Whether this machine's CPUs run at one speed (rule same_cpus, docs/timing.md "Fifth pass").

    python benchmarks/cpu_speeds.py [ROUNDS]

One thread, moved between the CPUs this process may use, round after round: each CPU times the same 256x256 fp32
matmul (200 of them, the thread's CPU clock), so a round compares the CPUs a few milliseconds apart. Prints each
CPU's median and range, and per round each CPU's time over the first CPU's. On a virtual machine two vCPUs can
differ for minutes (another guest on one's host core); then two paths timed on different CPUs compare the CPUs.
"""

import os
import statistics
import sys
import time

import torch

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
torch.set_num_threads(1)
a = torch.randn(256, 256)
cpus = sorted(os.sched_getaffinity(0))


def per_matmul_ms() -> float:
    start = time.thread_time()
    for _ in range(200):
        a @ a
    return (time.thread_time() - start) / 200 * 1e3


times: dict[int, list[float]] = {c: [] for c in cpus}
try:
    for _ in range(rounds):
        for c in cpus:
            os.sched_setaffinity(0, {c})
            per_matmul_ms()  # the first on a CPU after the move warms its caches
            times[c].append(per_matmul_ms())
finally:
    os.sched_setaffinity(0, set(cpus))
for c in cpus:
    v = times[c]
    print(f"cpu {c}: median {statistics.median(v):.4f} ms, range {min(v):.4f}-{max(v):.4f} ms per 256x256 matmul")
for c in cpus[1:]:
    print(f"cpu {c} / cpu {cpus[0]} per round: {', '.join(f'{x / y:.2f}' for x, y in zip(times[c], times[cpus[0]]))}")
