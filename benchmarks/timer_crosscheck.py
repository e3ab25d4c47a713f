"""Cross-check our timer (posttrainllm.timing.measure) against independent timers on the same calls.

    CPU:  torch.utils.benchmark.Timer(...).blocked_autorange()  (median of block means)
    CUDA: the same, plus triton.testing.do_bench(return_mode="median")  (it flushes L2 too)

Calls: a 512x512 fp32 matmul and causal SDPA at B=1, H=4, S=512, D=64. Prints a table and
writes JSON with each timer's median [ms] and the ratio ours / theirs (1.0 = agreement).
A benchmark, not a test: the numbers are recorded, never asserted.

    python benchmarks/timer_crosscheck.py [--device auto|cpu|cuda] [--threads N] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils.benchmark as tbench

from posttrainllm.measure import device as devices
from posttrainllm.measure.timing import measure


def calls(device: str) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(512, 512, generator=gen).to(device) for _ in range(2))
    q, k, v = (torch.randn(1, 4, 512, 64, generator=gen).to(device) for _ in range(3))  # (B, H, S, D)
    return {
        "matmul_512_fp32": lambda: a @ b,
        "sdpa_causal_S512_fp32": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }


def crosscheck(device: str, min_time_s: float = 0.5) -> dict:
    threads = torch.get_num_threads()
    results = {}
    for name, fn in calls(device).items():
        with torch.no_grad():
            ours = measure(fn, device=device, warmup=3, reps=10, min_time_s=min_time_s, max_reps=1000)
            # Timer defaults to 1 thread: give it ours, so both time the same thing.
            theirs = tbench.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads).blocked_autorange(
                min_run_time=min_time_s)
            entry = {"ours_ms": ours.summary(),
                     "torch_timer_ms": {"median": theirs.median * 1e3, "iqr": theirs.iqr * 1e3,
                                        "blocks": len(theirs.times), "calls_per_block": theirs.number_per_run},
                     "ratio_ours_over_torch_timer": ours.median_ms / (theirs.median * 1e3)}
            if device == "cuda":
                from triton.testing import do_bench

                bench_ms = do_bench(fn, warmup=25, rep=int(min_time_s * 1e3), return_mode="median")
                entry["triton_do_bench_ms"] = {"median": bench_ms}
                entry["ratio_ours_over_do_bench"] = ours.median_ms / bench_ms
        results[name] = entry
    return {"fingerprint": devices.fingerprint(device), "threads": threads, "min_time_s": min_time_s,
            "note": "ours: per-call samples (L2 flushed before each on CUDA); torch Timer: median of block means "
                    "(calls back to back, warm caches)", "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (0 keeps torch's default)")
    parser.add_argument("--min-time-s", type=float, default=0.5)
    parser.add_argument("--out", default="runs/timer_crosscheck.json")
    args = parser.parse_args()
    device = devices.prepare(args.device, args.threads)
    report = crosscheck(device, args.min_time_s)
    print(f"device={device} threads={report['threads']}")
    for name, entry in report["results"].items():
        line = (f"{name:24s} ours {entry['ours_ms']['median_ms']:.4f} ms (noisy={entry['ours_ms']['noisy']})  "
                f"torch Timer {entry['torch_timer_ms']['median']:.4f} ms  ratio {entry['ratio_ours_over_torch_timer']:.3f}")
        if "triton_do_bench_ms" in entry:
            line += (f"  do_bench {entry['triton_do_bench_ms']['median']:.4f} ms  "
                     f"ratio {entry['ratio_ours_over_do_bench']:.3f}")
        print(line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
