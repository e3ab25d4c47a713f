"""The stages of one point, in order: reference -> kernel -> parity -> microbench -> bench-train -> receipt.

Each stage reads the config and the files earlier stages wrote in the point's
folder, and writes its own files there. None talks to MLflow but the receipt.
DVC runs them one process per stage (pipelines/*.py); `posttrainllm bench` runs
the same functions in one process.
"""

from __future__ import annotations

import csv
import functools
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from posttrainllm.measure import calibrate
from posttrainllm.opdefs import costs
from posttrainllm.lab import parity
from posttrainllm.opdefs import registry as paths
from posttrainllm.measure import roofline
from posttrainllm.measure import device as devices
from posttrainllm.config import LabConfig, itemsize
from posttrainllm.files import point_dir, read_json, write_json
from posttrainllm.measure.memory import peak_bytes
from posttrainllm.opdefs.registry import REFERENCE, Case
from posttrainllm.track.provenance import git_revision
from posttrainllm.measure.timing import NOISY_RULE, measure

INTERPRETER_NOT_SPEED = "Triton ran through its interpreter (TRITON_INTERPRET=1): a correctness run, not kernel speed"


class ContractBroken(RuntimeError):
    """A path broke its numerical contract; the stage's report is already written."""


def _dtype(cfg: LabConfig) -> torch.dtype:
    return getattr(torch, cfg.precision.dtype)


def _to_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in tensors.items()}


def _emulation(impl: paths.Impl, cfg: LabConfig) -> str | None:
    if impl.kind != "triton":
        return None
    from posttrainllm.ops import interpreter_emulation

    return interpreter_emulation(_dtype(cfg))


# --- reference ---------------------------------------------------------------------------


def run_reference(cfg: LabConfig, out: Path) -> None:
    """Inputs for every case, the fp64 oracle on them, and the same math in the point's precision.

    Forward outputs and, for one upstream gradient dO per case, the input gradients
    (float64 autograd through the reference math is the gradient oracle).
    """
    device = devices.prepare(cfg.device.name, cfg.bench.threads)
    records = []
    reference = paths.IMPLS[cfg.op.name][REFERENCE]
    with paths.precision_context(cfg):
        for case in paths.cases(cfg):
            inputs = paths.make_inputs(case, cfg.op.name, _dtype(cfg), device)
            inputs64 = {k: v.double() for k, v in inputs.items()}
            oracle = reference.run(inputs64, cfg)
            baseline = reference.run(inputs, cfg)
            grad_out = paths.upstream_gradient(case, baseline["out"])
            oracle.update(paths.gradients(reference, inputs64, grad_out.double(), cfg))
            baseline.update(paths.gradients(reference, inputs, grad_out, cfg))
            records.append({"case": asdict(case), "inputs": _to_cpu(inputs), "grad_out": grad_out.cpu(),
                            "oracle": _to_cpu(oracle), "baseline": _to_cpu(baseline)})
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"op": cfg.op.name, "dtype": cfg.precision.dtype, "records": records}, out / "reference.pt")


def _load_reference(out: Path) -> dict[str, Any]:
    return torch.load(out / "reference.pt", weights_only=True)


# --- kernel ------------------------------------------------------------------------------


def run_kernel(cfg: LabConfig, out: Path) -> dict[str, Any]:
    """Every optimized path on the reference's inputs; records its dispatch geometry.

    A path that raises is recorded with its error (parity then fails it) rather
    than stopping the others.
    """
    device = devices.prepare(cfg.device.name, cfg.bench.threads)
    ref = _load_reference(out)
    main_case = Case(**ref["records"][0]["case"])
    outputs: dict[str, list[dict[str, torch.Tensor]] | None] = {}
    report: dict[str, Any] = {"device": device, "triton_interpreted": devices.triton_interpreted(), "paths": {}}
    with paths.precision_context(cfg):
        for impl in paths.optimized(cfg.op.name):
            entry: dict[str, Any] = {"kind": impl.kind, "problem": paths.problem_dims(main_case, cfg.op.name),
                                     "geometry": impl.geometry(main_case, cfg), "emulation": _emulation(impl, cfg)}
            try:
                outputs[impl.name] = [_run_case(impl, rec, cfg, device) for rec in ref["records"]]
            except Exception as exc:  # a kernel that cannot run is a failed path, reported, not a crash
                outputs[impl.name] = None
                entry["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            report["paths"][impl.name] = entry
    torch.save(outputs, out / "kernel.pt")
    write_json(out / "kernel.json", report)
    return report


def _run_case(impl: paths.Impl, record: dict[str, Any], cfg: LabConfig, device: str) -> dict[str, torch.Tensor]:
    """Forward outputs and input gradients (for the reference's dO) of one path on one case."""
    inputs = {k: v.to(device) for k, v in record["inputs"].items()}
    outputs = impl.run(inputs, cfg)
    outputs.update(paths.gradients(impl, inputs, record["grad_out"].to(device), cfg))
    return _to_cpu(outputs)


# --- parity ------------------------------------------------------------------------------


def run_parity(cfg: LabConfig, out: Path) -> dict[str, Any]:
    """Each path against the oracle under the point's contract. Raises ContractBroken after writing."""
    ref = _load_reference(out)
    kernel_outputs = torch.load(out / "kernel.pt", weights_only=True)
    kernel_report = read_json(out / "kernel.json")
    records = ref["records"]
    case_names = [r["case"]["name"] for r in records]
    contract = cfg.precision.contract
    report: dict[str, Any] = {"precision": cfg.precision.name, "contract": asdict(contract),
                              "rule": "max_abs_err <= error_multiple * baseline_max_abs_err + floor_rel * max|oracle|,"
                                      " mismatch_frac <= max_mismatch, all finite",
                              "cases": case_names, "paths": {}, "notes": []}
    if cfg.precision.allow_tf32 and kernel_report["device"] != "cuda":
        report["notes"].append("tf32 requested, but CPU torch and Triton's interpreter compute true fp32 here")
    for name, outputs in kernel_outputs.items():
        entry = kernel_report["paths"][name]
        if outputs is None:
            result = {"verdict": "fail", "failed_cases": [f"did not run: {entry['error']}"], "worst": {}, "cases": []}
        else:
            result = parity.check_path(outputs, [r["oracle"] for r in records], [r["baseline"] for r in records],
                                       case_names, contract)
        result["emulation"] = entry.get("emulation")
        report["paths"][name] = result
    report["verdict"] = "pass" if all(p["verdict"] == "pass" for p in report["paths"].values()) else "fail"
    write_json(out / "parity.json", report)
    broken = [name for name, p in report["paths"].items() if p["verdict"] != "pass"]
    if broken:
        first = report["paths"][broken[0]]["failed_cases"][0]
        raise ContractBroken(f"{', '.join(broken)} broke the {cfg.precision.name} contract ({first})")
    return report


# --- microbench --------------------------------------------------------------------------


def _flops_and_bytes(cfg: LabConfig, case: Case) -> tuple[int, int]:
    d, size = case.dims, itemsize(cfg.precision.dtype)
    if cfg.op.name == "attention":
        return (costs.attention_flops(d["batch"], d["heads"], d["seq_len"], d["head_dim"], cfg.op.causal),
                costs.attention_bytes(d["batch"], d["heads"], d["kv_heads"], d["seq_len"], d["head_dim"], size))
    return costs.matmul_flops(d["m"], d["n"], d["k"]), costs.matmul_bytes(d["m"], d["n"], d["k"], size)


def run_microbench(cfg: LabConfig, out: Path, calibration: dict[str, Any]) -> dict[str, Any]:
    """Warmed timing, memory and roofline of every path that passed parity, then the measured curve.

    On the point's own shape: each path's timing (median, p20/p80, noise flag), achieved
    FLOP/s and GB/s from costs.py's formulas, the peak memory one call allocates, and where
    it sits on the device's roofline (`calibration`'s peaks). Then every valid path over
    `shape.curve` sizes (curve.csv, time_vs_size.png, memory_vs_size.png) with the
    crossover size where each beats the reference. Triton through its interpreter is timed
    once and marked invalid: it gets no throughput, speedup, roofline or curve.
    """
    from posttrainllm.track import plots  # matplotlib: imported by the one stage that draws

    device = devices.prepare(cfg.device.name, cfg.bench.threads)
    verdicts = {name: p["verdict"] for name, p in read_json(out / "parity.json")["paths"].items()}
    case = next(c for c in paths.cases(cfg) if c.main)
    flops, nbytes = _flops_and_bytes(cfg, case)
    inputs = paths.make_inputs(case, cfg.op.name, _dtype(cfg), device)
    peak_flops, peak_bandwidth = calibrate.peak_for(calibration, cfg.precision.dtype,
                                                    cfg.precision.allow_tf32 and device == "cuda")
    report: dict[str, Any] = {"device": device, "threads": torch.get_num_threads(), "case": case.name,
                              "problem": paths.problem_dims(case, cfg.op.name), "flops": flops, "bytes": nbytes,
                              "flops_formula": "attention: 4*B*H*S^2*D (x0.5 causal); matmul: 2*M*N*K",
                              "bytes_formula": "inputs read once + outputs written once",
                              "noisy_rule": NOISY_RULE, "roofline_rule": roofline.RULE,
                              "peaks": {"gemm_flops_per_s": peak_flops, "copy_bytes_per_s": peak_bandwidth},
                              "paths": {}}
    rows = []
    with paths.precision_context(cfg), torch.no_grad():
        for name, impl in paths.IMPLS[cfg.op.name].items():
            if name != REFERENCE and verdicts.get(name) != "pass":
                report["paths"][name] = {"valid": False, "reason": "failed parity: no speed number"}
                continue
            interpreted = impl.kind == "triton" and devices.triton_interpreted()
            bench = cfg.bench
            reps = dict(warmup=0, reps=1, min_time_s=0.0, max_reps=1) if interpreted else dict(
                warmup=bench.warmup, reps=bench.reps, min_time_s=bench.min_time_s, max_reps=bench.max_reps)
            call = functools.partial(impl.run, inputs, cfg)
            timing = measure(call, device=device, **reps)
            entry: dict[str, Any] = {"valid": not interpreted, **timing.summary()}
            if interpreted:
                entry["reason"] = INTERPRETER_NOT_SPEED
            else:
                seconds = timing.median_ms / 1e3
                entry.update(gflops_per_s=flops / seconds / 1e9, gbytes_per_s=nbytes / seconds / 1e9,
                             memory=peak_bytes(call, device, warmup=0))
                entry["roofline"] = roofline.roofline(flops, nbytes, seconds, peak_flops=peak_flops,
                                                      peak_bytes_per_s=peak_bandwidth) if peak_flops else None
            report["paths"][name] = entry
            rows += [{"impl": name, "rep": i, "ms": ms, "valid": not interpreted}
                     for i, ms in enumerate(timing.samples_ms)]
    ref_ms = report["paths"][REFERENCE]["median_ms"]
    timed = [name for name, entry in report["paths"].items() if entry["valid"]]
    for name in timed:
        if name != REFERENCE:
            report["paths"][name]["speedup_vs_reference"] = ref_ms / report["paths"][name]["median_ms"]
    report["curve"] = _curve(cfg, out, device, timed)
    write_json(out / "microbench.json", report)
    with open(out / "timings.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["op", "impl", "rep", "ms", "valid", "device", "threads", "problem"])
        writer.writeheader()
        for row in rows:
            writer.writerow({"op": cfg.op.name, **row, "device": device, "threads": report["threads"],
                             "problem": report["problem"]})
    if any(report["paths"][name].get("roofline") for name in timed):
        plots.roofline_plot([{"label": name, **report["paths"][name]["roofline"]} for name in timed
                             if report["paths"][name].get("roofline")],
                            calibration["peaks"], out / "roofline.png", title=f"{cfg.op.name} {report['problem']}")
    return report


def _curve(cfg: LabConfig, out: Path, device: str, timed: list[str]) -> dict[str, Any]:
    """The timed paths over shape.curve: curve.csv + plots, and each path's crossover with the reference."""
    from posttrainllm.measure import curves
    from posttrainllm.track import plots  # pandas, matplotlib: only this stage needs them

    frame = curves.measure_curve(cfg, x_values=list(cfg.shape.curve), device=device,
                                 revision=git_revision()["revision"], impls=timed)
    frame.to_csv(out / "curve.csv", index=False)
    plots.time_vs_size(frame, out / "time_vs_size.png")
    plots.memory_vs_size(frame, out / "memory_vs_size.png")
    return {"x_name": frame.attrs["x_name"], "x_values": list(cfg.shape.curve), "skipped": frame.attrs["skipped"],
            "crossover_vs_reference": {name: curves.crossover(frame, impl=name) for name in timed
                                       if name != REFERENCE}}


# --- bench-train -------------------------------------------------------------------------


def run_bench_train(cfg: LabConfig, out: Path) -> dict[str, Any]:
    """The model from `architecture`, trained with each implementation of the point's op swapped in.

    Attention points swap the attention (train.attention_impls), matmul points every
    projection's matmul (train.matmul_impls); the first is the baseline. Records the loss
    drift against it (the contract's train_loss_drift) and Amdahl's predicted speedup
    from the microbench next to the measured one.
    """
    from posttrainllm.model import amdahl
    from posttrainllm.model.transformer import ModelConfig
    from posttrainllm.model.train import attention_variants, bench_train, matmul_variants

    device = devices.prepare(cfg.device.name, cfg.bench.threads)
    arch, train, op = cfg.architecture, cfg.train, cfg.op.name
    model_cfg = ModelConfig(vocab_size=256, d_model=arch.d_model, n_layers=arch.n_layers, n_heads=arch.n_heads,
                            n_kv_heads=arch.n_kv_heads, head_dim=arch.head_dim, mlp_hidden=arch.mlp_hidden,
                            max_seq_len=train.seq_len)
    variants = attention_variants(list(train.attention_impls)) if op == "attention" else matmul_variants(
        list(train.matmul_impls))
    t, w = cfg.tile, cfg.workgroup
    workgroup = dict(num_warps=w.num_warps, num_stages=w.num_stages, input_precision=cfg.precision.dot_precision)
    result = bench_train(model_cfg, variants=variants, steps=train.steps, warmup_steps=train.warmup_steps,
                         batch_size=train.batch_size, seq_len=train.seq_len, lr=train.lr, seed=train.seed,
                         precision=cfg.precision.name, device=device,
                         attention_options=dict(block_q=t.block_q, block_kv=t.block_kv, **workgroup),
                         matmul_options=dict(block_m=t.block_m, block_n=t.block_n, block_k=t.block_k,
                                             group_m=w.group_m, **workgroup))
    limit = cfg.precision.contract.train_loss_drift
    result["drift_limit"] = limit
    result["drift_verdict"] = {name: "pass" if drift <= limit else "fail" for name, drift in result["drift"].items()}
    if op == "attention":
        model_problem = (f"B={train.batch_size} H={arch.n_heads} Hkv={arch.n_kv_heads} S={train.seq_len} "
                         f"D={arch.head_dim}")
    else:
        model_problem = f"M={train.batch_size * train.seq_len} N={arch.mlp_hidden} K={arch.d_model} (MLP up)"
    result["amdahl"] = amdahl.check(result, read_json(out / "microbench.json"), op=op, model_problem=model_problem)
    write_json(out / "bench_train.json", result)
    broken = [name for name, verdict in result["drift_verdict"].items() if verdict != "pass"]
    if broken:
        raise ContractBroken(f"loss drift of {', '.join(broken)} exceeds train_loss_drift={limit:g}")
    return result
