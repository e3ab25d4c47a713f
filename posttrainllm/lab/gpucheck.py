"""The prepared GPU check: one run, no network, no MLflow, no DVC, receipts as JSON.

    python -m posttrainllm.lab.gpucheck OUTDIR [--dry-run] [--budget-s 420] [--no-train]

Calibrates the device, then runs every point of the `gpu` sweep (conf/sweep/gpu.yaml:
GPU-sized shapes, one dimension at a time) through the same stage functions as
`dvc repro`: reference, kernel, parity, microbench and, for attention points,
bench-train. Each point's receipt and evidence land in OUTDIR/<point>/; the big
tensors (reference.pt, kernel.pt) are deleted once parity has read them. Points
that would start after `budget_s` are listed as skipped, never half-run. Bring the
folder back and run `posttrainllm receipt import OUTDIR` where MLflow lives.

--dry-run runs the `smoke` sweep on the CPU with tiny shapes: what the tests run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from posttrainllm.measure import calibrate
from posttrainllm.track import receipt
from posttrainllm.lab import approval, stages
from posttrainllm.lab import sweep
from posttrainllm.measure import device as devices
from posttrainllm.config import ConfigError, load, validate
from posttrainllm.files import point_dir, write_json
from posttrainllm.lab.pipeline import sweep_id

BIG_FILES = ("reference.pt", "kernel.pt")


def run_point(cfg: Any, calibration: dict[str, Any], sweep_info: dict[str, Any], *, train: bool) -> str:
    """One point through the stages; returns its status. A broken contract is a result, not a crash."""
    out = point_dir(cfg)
    status = "pass"
    try:
        stages.run_reference(cfg, out)
        stages.run_kernel(cfg, out)
        try:
            stages.run_parity(cfg, out)
        except stages.ContractBroken as exc:
            status = f"contract broken: {exc}"
        stages.run_microbench(cfg, out, calibration)
        if train:
            stages.run_bench_train(cfg, out)
    except stages.ContractBroken as exc:
        status = f"contract broken: {exc}"
    except Exception as exc:  # e.g. out of memory at one point: record it, keep the others
        status = f"error: {type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        for name in BIG_FILES:
            (out / name).unlink(missing_ok=True)
    receipt.build(cfg, sweep=sweep_info)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrainllm.lab.gpucheck", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for calibration.json, summary.json and <point>/ receipts")
    parser.add_argument("--dry-run", action="store_true", help="the smoke sweep on the CPU (tiny shapes)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no point after this many seconds")
    parser.add_argument("--no-train", action="store_true", help="skip bench-train")
    parser.add_argument("--approve", action="store_true", help="approve the GPU timing loops (lab/approval.py); "
                        "scripts/gpu-check.sh passes it")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    name = "smoke" if args.dry_run else "gpu"
    try:
        plan = sweep.plan(load([f"sweep={name}"]).sweep)
        device = devices.prepare("cpu" if args.dry_run else "cuda", load().bench.threads)
        labs = [validate({**spec["config"], "run": {"name": point, "approve": args.approve}})
                for point, spec in plan["points"].items()]
        found = approval.estimate(labs, train=not args.no_train)
        print(f"posttrainllm gpucheck: {name} sweep on {device}: {found.line()}", flush=True)
        if device == "cuda" and not (args.approve or approval.approved()):
            raise approval.NotApproved(f"not approved: these timing loops need --approve or {approval.ENV}=1")
    except (ConfigError, approval.NotApproved) as exc:
        print(f"posttrainllm gpucheck: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    calibration = calibrate.load_or_measure(args.out / "calibration.json", device)
    summary: dict[str, Any] = {"sweep": name, "device": devices.fingerprint(device), "peaks": calibration["peaks"],
                               "published": calibration.get("published"), "points": {}, "skipped": []}
    info = {"name": name, "id": sweep_id(plan["points"])}
    for point, spec in plan["points"].items():
        elapsed = time.perf_counter() - started
        if elapsed > args.budget_s:
            summary["skipped"].append(point)
            continue
        cfg = validate({**spec["config"], "run": {"name": point, "out_dir": str(args.out), "log_mlflow": False}})
        t0 = time.perf_counter()
        status = run_point(cfg, calibration, {**info, "changes": spec["changes"]}, train=not args.no_train)
        summary["points"][point] = {"status": status, "seconds": time.perf_counter() - t0}
        print(f"{point}: {status} ({time.perf_counter() - t0:.1f} s)", flush=True)
    summary["seconds"] = time.perf_counter() - started
    write_json(args.out / "summary.json", summary)
    print(f"{len(summary['points'])} points in {summary['seconds']:.0f} s, skipped: {summary['skipped'] or 'none'}")
    return 0 if all(p["status"] == "pass" for p in summary["points"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
