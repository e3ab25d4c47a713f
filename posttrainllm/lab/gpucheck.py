"""The prepared GPU check: one run, no network, no MLflow, no DVC, receipts as JSON.

    python -m posttrainllm.lab.gpucheck OUTDIR [--dry-run] [--budget-s 450] [--train] [--sweep gpu_check]

Calibrates the device, then runs every point of the `gpu_check` sweep (conf/sweep/gpu_check.yaml)
through the same stage functions as `dvc repro`: reference, kernel, parity, microbench (and,
with --train, bench-train). In order: bf16 attention at head dim 128, causal; bf16 matmul
(cuBLAS as the peer); the same at 128x128x64 tiles; fp8 matmul at those tiles (per-tensor scaled
e4m3, torch._scaled_mm as the peer, forward only); the attention non-causal; then tile=auto
(Triton's autotuner). Each curve runs S = 1k..16k (M=N=K = 4096, 8192 for matmul), forward and
forward + backward (forward only for fp8), against every peer the device has. Each point's receipt
and evidence land in OUTDIR/<point>/; the big tensors (reference.pt, kernel.pt) are deleted once
parity has read them. Beside them, counters.json (and summary.json, and the console) puts each Triton kernel's
compile counters (registers, spills, shared memory, tensor cores, async copies) beside its path's measured
median (COUNTERS_NOTE). Where the machine has Nsight Compute (`ncu`), each point's Triton paths then run once more
under it (`--profile-point`: forward and backward at the main case), and counters.json gets the measured registers,
achieved occupancy, DRAM throughput and duration of each kernel beside its static counters (measure/ncu.py).

Before anything runs it prints each point's rough device time (lab/approval.py: ROUGH_*, not yet
measured on a GPU) and starts no point that, by that estimate, would end after `--budget-s`
seconds from the start: such points are listed as skipped, never half-run. summary.json holds each
point's estimate next to the seconds it took. Bring the folder back and run
`posttrainllm receipt import OUTDIR` where MLflow lives.

bench-train is off by default: by the rough estimate the six points end at ~7 minutes (416 s) on an H200
with every SDPA backend, and training adds ~1 minute (ROUGH_TRAIN_S and 50 ms steps, guessed), which
leaves no margin for an estimate that is off; the issue's run does not ask for it. --train adds it
(the fp8 point trains with the fp8 recipe against bf16 and runs its quality gate, which decodes with the
draft-heads base: trained first where heads.out_dir has none).

--dry-run runs the `smoke` sweep on the CPU with tiny shapes, its curves timed in both modes as
on the GPU, and the GPU sweep's quantized point (fp8) on the smoke sweep's baseline: its changes
(op, tile, precision) with the smoke sweep's shape, device and overrides, so its paths (reference,
torch._scaled_mm, the Triton fp8 GEMM through the interpreter) run too: what the tests run.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from posttrainllm.measure import calibrate, ncu
from posttrainllm.track import receipt
from posttrainllm.lab import approval, heads
from posttrainllm.lab.stages import bench_train as bench_train_stage, kernel as kernel_stage, \
    microbench as microbench_stage, parity as parity_stage, reference as reference_stage
from posttrainllm.lab.stages.common import ContractBroken
from posttrainllm.lab import sweep
from posttrainllm.measure import device as devices
from posttrainllm.config import ConfigError, LabConfig, SweepConfig
from posttrainllm.lab.configure import load, validate
from posttrainllm.files import point_dir, write_json
from posttrainllm.lab.pipeline import sweep_id

BIG_FILES = ("reference.pt", "kernel.pt")
NCU_LAUNCHES = 64  # launches profiled per point (an autotuned point launches each candidate many times)
NCU_TIMEOUT_S = 90  # the GPU session allows 10 minutes a command: a hung profile must not take the rest
NCU_ROUGH_S = 30.0  # a point's profiling run, guessed (a process, its kernels from Triton's cache): not measured


COUNTERS_NOTE = ("static counters (`posttrainllm compile`: the cubin built for the first compile target from the "
                 "launch's own specialization) beside the path's measured median of that direction (forward: the "
                 "forward; backward: forward + backward, every kernel of both): where a kernel spills or leaves "
                 "tensor cores unused, the time says what it cost")


def counters(built: dict[str, Any]) -> list[dict[str, Any]]:
    """The compile report beside the measured times: one row per Triton kernel a path launched, on the first
    compile target, with that path's measured median (COUNTERS_NOTE), or why it has none."""
    section = (built.get("kernel") or {}).get("compile") or {}
    first = (section.get("targets") or [None])[0]
    paths = (built.get("microbench") or {}).get("paths") or {}
    rows = []
    for row in section.get("rows") or []:
        if row.get("target") != first:
            continue
        timed = paths.get(row["path"]) or {}
        mode = timed if row["direction"] == "forward" else (timed.get("forward_backward") or {})
        rows.append({**{key: row.get(key) for key in ("path", "kernel", "direction", "target", "registers",
                                                       "spill_bytes", "shared_bytes", "ctas_per_sm",
                                                       "tensor_cores", "async_copy", "fits")},
                     "measured_ms": mode.get("median_ms") if timed.get("valid") and mode.get("median_ms") else None,
                     "why_not": None if timed.get("valid") and mode.get("median_ms") else (
                         mode.get("reason") or timed.get("reason") or "not timed")})
    return rows


def _counters_table(rows: list[dict[str, Any]]) -> str:
    import pandas as pd

    if not rows:
        return "  (no Triton kernel compiled)"
    frame = pd.DataFrame(rows)
    frame["measured_ms"] = [f"{ms:.4g}" if ms is not None else (why or "")[:40]
                            for ms, why in zip(frame["measured_ms"], frame["why_not"])]
    return frame.drop(columns=["why_not"]).to_string(index=False)


def run_point(cfg: Any, calibration: dict[str, Any], sweep_info: dict[str, Any], *, train: bool) -> str:
    """One point through the stages; returns its status. A broken contract is a result, not a crash."""
    out = point_dir(cfg)
    status = "pass"
    try:
        reference_stage.run_reference(cfg, out)
        kernel_stage.run_kernel(cfg, out)
        try:
            parity_stage.run_parity(cfg, out)
        except ContractBroken as exc:
            status = f"contract broken: {exc}"
        microbench_stage.run_microbench(cfg, out, calibration)
        if train:
            heads.ensure_quality_base(cfg)  # a quantized point's quality gate decodes with it
            bench_train_stage.run_bench_train(cfg, out)
    except ContractBroken as exc:
        status = f"contract broken: {exc}"
    except Exception as exc:  # e.g. out of memory at one point: record it, keep the others
        status = f"error: {type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        for name in BIG_FILES:
            (out / name).unlink(missing_ok=True)
    built = receipt.build(cfg, sweep=sweep_info)
    write_json(out / "counters.json", {"note": COUNTERS_NOTE, "rows": counters(built)})
    return status


def measured_counters(out: Path, sweep_name: str, point: str, rows: list[dict[str, Any]]) -> str:
    """The point's Triton paths run once under Nsight Compute (`--profile-point`), their kernels' measured counters
    put beside the static ones in counters.json (measure/ncu.py); returns one line on what happened. A failure
    (no ncu, no permission for the GPU's counters, a timeout) is that line, never the end of the check."""
    kernels = sorted({row["kernel"] for row in rows if row.get("kernel")})
    if not kernels:
        return "ncu: no Triton kernel to profile"
    tool = ncu.find()
    if tool is None:
        return ncu.NOT_FOUND
    log = out / point / "ncu.csv"
    argv = [sys.executable, "-m", "posttrainllm.lab.gpucheck", str(out), "--sweep", sweep_name,
            "--profile-point", point]
    try:
        done = subprocess.run(ncu.command(tool, log, kernels, argv, NCU_LAUNCHES), capture_output=True, text=True,
                              timeout=NCU_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"ncu: ran past {NCU_TIMEOUT_S} s and was stopped"
    if done.returncode != 0 or not log.exists():
        tail = (done.stderr or done.stdout or "").strip().splitlines()[-1:] or [""]
        return f"ncu: exit {done.returncode}: {tail[0]}"
    measured = ncu.per_kernel(ncu.parse(log.read_text()))
    counters_file = out / point / "counters.json"
    write_json(counters_file, {"note": COUNTERS_NOTE, "ncu": {"tool": tool, "metrics": ncu.METRICS},
                               "rows": ncu.beside(rows, measured)})
    return f"ncu: {len(set(kernels) & set(measured))} of {len(kernels)} kernels measured"


def profile_point(sweep_name: str, point: str) -> int:
    """The `--profile-point` child (run under ncu): each of the point's Triton paths (ours and user paths) once,
    forward then backward, at its main case, on the point's device."""
    from posttrainllm.lab import compile as compiling
    from posttrainllm.lab import runner
    from posttrainllm.ops.registry import op_for

    spec = sweep.plan(load([f"sweep={sweep_name}"]).sweep)["points"][point]
    cfg = validate({**spec["config"], "run": {"name": point, "log_mlflow": False}})
    device = devices.prepare(cfg.device.name, cfg.bench.threads)
    op = op_for(cfg)
    for impl in runner.optimized(op, cfg):
        run = runner.runner_for(impl)
        if not run.may_launch_triton:
            continue
        fn = run.loaded_here(op)
        note = compiling.call_once(op, cfg, impl, fn, device)
        print(f"profiled {impl.name}" + (f" ({note})" if note else ""), flush=True)
    return 0


DRY_RUN_SWEEP = "smoke"
DRY_RUN_BENCH = {"curve_backward": True}  # as the GPU check's sweep sets it
# The rehearsed fp8 point's curve (M=N=K) stays small: torch._scaled_mm on a CPU is a scalar loop (measured on a
# 2-core CPU, one thread, torch 2.13: 17 s a call at 512³, 0.27 s at 128³), and the smoke curve runs to 512. The
# shared curve: the tiny shape gives the matmul no curve of its own (shape.ops.matmul.curve: null)
REHEARSAL_OVERRIDES = ["shape.curve=[32,64]"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posttrainllm.lab.gpucheck", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for calibration.json, summary.json and <point>/ receipts")
    parser.add_argument("--dry-run", action="store_true",
                        help="the smoke sweep on the CPU (tiny shapes), and the GPU sweep's fp8 point")
    parser.add_argument("--sweep", default="gpu_check", help="the sweep to run on the GPU (conf/sweep/)")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="start no point whose rough estimate ends it after this many seconds")
    parser.add_argument("--train", action=argparse.BooleanOptionalAction, default=False,
                        help="bench-train each point too (off by default: no margin left in the 8-minute budget)")
    parser.add_argument("--approve", action="store_true", help="approve the GPU timing loops (lab/approval.py); "
                        "scripts/gpu-check.sh passes it")
    parser.add_argument("--profile-point", metavar="POINT", help=argparse.SUPPRESS)  # the child ncu profiles
    args = parser.parse_args(argv)
    if args.profile_point:
        return profile_point(DRY_RUN_SWEEP if args.dry_run else args.sweep, args.profile_point)
    started = time.perf_counter()
    name = DRY_RUN_SWEEP if args.dry_run else args.sweep
    try:
        planned = load([f"sweep={name}"]).sweep
        plan = sweep.plan(planned)
        if args.dry_run:
            plan["points"].update(_rehearsals(load([f"sweep={args.sweep}"]).sweep, planned))
        configs = {point: _point_config(spec["config"], args.dry_run) for point, spec in plan["points"].items()}
        threads = next(iter(configs.values()))["bench"]["threads"] if configs else load().bench.threads
        device = devices.prepare("cpu" if args.dry_run else "cuda", threads)  # 0: torch's default, every core
        labs = [validate({**config, "run": {"name": point, "approve": args.approve}})
                for point, config in configs.items()]
        found = approval.estimate(labs, train=args.train)
        print(f"posttrainllm gpucheck: {name} sweep on {device}: {found.line()}", flush=True)
        print(_estimate_table(found, args.budget_s), flush=True)
        if device == "cuda" and not (args.approve or approval.approved()):
            raise approval.NotApproved(f"not approved: these timing loops need --approve or {approval.ENV}=1")
    except (ConfigError, approval.NotApproved) as exc:
        print(f"posttrainllm gpucheck: {exc}", file=sys.stderr)
        return 2
    rough = {p.name: p.rough_s for p in found.per_point}
    args.out.mkdir(parents=True, exist_ok=True)
    calibration = calibrate.load_or_measure(args.out / "calibration.json", device)
    summary: dict[str, Any] = {"sweep": name, "device": devices.fingerprint(device), "peaks": calibration["peaks"],
                               "published": calibration.get("published"), "budget_s": args.budget_s,
                               "estimate": "rough: posttrainllm/lab/approval.py ROUGH_*", "points": {},
                               "skipped": []}
    info = {"name": name, "id": sweep_id(plan["points"])}
    for point, spec in plan["points"].items():
        elapsed = time.perf_counter() - started
        if elapsed + rough[point] > args.budget_s:
            summary["skipped"].append(point)
            continue
        cfg = validate({**configs[point], "run": {"name": point, "out_dir": str(args.out), "log_mlflow": False}})
        t0 = time.perf_counter()
        status = run_point(cfg, calibration, {**info, "changes": spec["changes"]}, train=args.train)
        seconds = time.perf_counter() - t0
        found_counters = json_rows(args.out / point / "counters.json")
        measured = None
        if device == "cuda":  # Nsight Compute's counters beside the static ones, while the budget allows
            measured = (measured_counters(args.out, name, point, found_counters)
                        if time.perf_counter() - started + NCU_ROUGH_S <= args.budget_s else "ncu: skipped (budget)")
            found_counters = json_rows(args.out / point / "counters.json")
        summary["points"][point] = {"status": status, "seconds": seconds, "estimated_s": rough[point],
                                    "counters": found_counters, **({"ncu": measured} if measured else {})}
        summary["seconds"] = time.perf_counter() - started
        write_json(args.out / "summary.json", {**summary, "complete": False})  # kept if the run is killed later
        print(f"{point}: {status} ({seconds:.1f} s; estimated {rough[point]:.0f} s)" + (f"; {measured}" if measured
                                                                                         else ""), flush=True)
        print(_counters_table(found_counters), flush=True)
    summary["seconds"] = time.perf_counter() - started
    write_json(args.out / "summary.json", {**summary, "complete": True})
    print(f"{len(summary['points'])} points in {summary['seconds']:.0f} s, skipped: {summary['skipped'] or 'none'}")
    return 0 if all(p["status"] == "pass" for p in summary["points"].values()) else 1


def json_rows(path: Path) -> list[dict[str, Any]]:
    import json

    return json.loads(path.read_text())["rows"] if path.exists() else []


def _rehearsals(gpu: SweepConfig, dry: SweepConfig) -> dict[str, Any]:
    """The GPU sweep's quantized points (fp8), planned on the dry-run sweep's baseline: the smoke sweep's
    attention never runs their paths (quantized inputs, forward-only, torch._scaled_mm, the fp8 kernel)."""
    found = {}
    for point, spec in sweep.plan(gpu)["points"].items():
        if spec["config"]["precision"].get("quantize"):
            changes = {d: v for d, v in spec["changes"].items() if v != dry.baseline.get(d)}
            found[point] = sweep.plan_point(dataclasses.replace(dry, overrides=[*dry.overrides, *REHEARSAL_OVERRIDES]),
                                            point, changes)
    return found


def _point_config(config: dict[str, Any], dry_run: bool) -> dict[str, Any]:
    """A planned point's config; the dry run times its curves in both modes, as the GPU check does."""
    return {**config, "bench": {**config["bench"], **DRY_RUN_BENCH}} if dry_run else config


def _estimate_table(found: approval.Estimate, budget_s: float) -> str:
    """Each point's rough device time and when it would end, in the order they run."""
    w = max([28] + [len(p.name) for p in found.per_point])
    lines = [f"  {'point':<{w}} {'loops':>5} {'rough_s':>8} {'ends_by_s':>9}  (rough: lab/approval.py ROUGH_*; "
             f"budget {budget_s:.0f} s)"]
    total = calibrate.DEFAULT_BUDGET_S
    lines.append(f"  {'(calibrate)':<{w}} {'':>5} {total:>8.0f} {total:>9.0f}")
    for p in found.per_point:
        total += p.rough_s
        late = "  over budget: skipped unless earlier points run faster" if total > budget_s else ""
        lines.append(f"  {p.name:<{w}} {p.loops:>5} {p.rough_s:>8.0f} {total:>9.0f}{late}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
