"""DVC stage 'microbench': warmed timing, memory and roofline of every path that passed parity, then the
measured curve over the op's axes (microbench.json, timings.csv, curve.csv, plots).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from posttrainllm import rules
from posttrainllm.config import LabConfig
from posttrainllm.lab import parity, runner
from posttrainllm.lab.isolation import rooms
from posttrainllm.measure import calibrate, roofline
from posttrainllm.measure import device as devices
from posttrainllm.measure.timing import NOISY, Timing, measure
from posttrainllm.ops.registry import NO_BACKWARD, REFERENCE, Case, Impl, OpDef, Tensors
from posttrainllm.lab.oracle import cast_floats, each, gradients, reference_outputs, upstream_gradients
from posttrainllm.ops.registry import op_for  # the point's op: a built-in, or one made from op.file (op=problem)
from posttrainllm.lab.runner import closed_after  # a stage's workers end with it
from posttrainllm.ops.base import point_dtype as _dtype
from posttrainllm.track.provenance import git_revision
from posttrainllm.track.records import ForwardBackward, MicrobenchPath, MicrobenchRecord
from posttrainllm.lab.stages.common import (FAILED_PARITY, INTERPRETER_NOT_SPEED, check_path, runs_interpreted, to_cpu,
                                            backward_note, parity_paths, passed_parity, refusals,
                                            on_same_cpus, worst_gradient_baseline)


def compare(a: Timing | dict[str, Any], b: Timing | dict[str, Any]) -> str:
    """Is `a` faster than `b`? Only when their spread bands do not overlap (rule "band")."""
    a_p20, a_p80 = (a.p20_ms, a.p80_ms) if isinstance(a, Timing) else (a["p20_ms"], a["p80_ms"])
    b_p20, b_p80 = (b.p20_ms, b.p80_ms) if isinstance(b, Timing) else (b["p20_ms"], b["p80_ms"])
    if a_p80 < b_p20:
        return "faster"
    if a_p20 > b_p80:
        return "slower"
    return "no measurable difference"


FRESH_SEED = 104_729  # added to a case's seed for the refreshed inputs of the timed-result check


def roofline_floor_s(flops: float, calibration: dict[str, Any], peak_flops: float | None = None) -> float:
    """The least time the calibrated device allows a call: its FLOPs at `peak_flops`, the fastest GEMM peak among the
    formats at least as precise as the point's (calibrate.floor_peak); where none is calibrated (None), the best GEMM
    peak of any dtype (rule "impossible": why not the bytes at the copy bandwidth)."""
    best = peak_flops or max([v for v in (calibration["peaks"].get("gemm_flops_per_s") or {}).values() if v] or [0.0])
    return flops / best if best else 0.0


def impossible(median_ms: float, flops: float, calibration: dict[str, Any], peak_flops: float | None,
               fraction: float, what: str = "forward") -> str | None:
    """Rule "impossible" on one median: None, or why it cannot be this many FLOPs' time."""
    floor_s = roofline_floor_s(flops, calibration, peak_flops)
    if floor_s and median_ms / 1e3 < fraction * floor_s:
        return (f"impossible: {what} median {median_ms:.4g} ms is under {fraction:g} x the roofline's "
                f"minimum {floor_s * 1e3:.4g} ms ({flops:.4g} FLOP at the calibrated GEMM peak): no speed")
    return None


def _timed_result_check(op: OpDef, cfg: LabConfig, case: Case, impl: Impl, inputs: Tensors,
                        grad_out: torch.Tensor | None = None) -> str | None:
    """Rule "timed_result": None if the path computed what was timed, else why not. With `grad_out`, the forward +
    backward: every output and gradient against the oracle's, as the parity stage checks them."""
    saved = {name: x.clone() for name, x in inputs.items()}
    fresh = op.make_inputs(dataclasses.replace(case, seed=case.seed + FRESH_SEED), _dtype(cfg), str(
        next(iter(inputs.values())).device.type))
    try:
        for label, values in (("the timed inputs", None), ("new values in the same buffers", fresh)):
            if values is not None:
                for name, x in inputs.items():
                    x.copy_(values[name])
            reason = (_check_forward(op, cfg, case, impl, inputs) if grad_out is None else
                      _check_forward_backward(op, cfg, case, impl, inputs, grad_out))
            if reason:
                what = "forward" if grad_out is None else "forward + backward"
                return f"timed result check failed on {label} ({what}): {reason} (a stored result?): no speed"
    except Exception as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"timed result check raised {type(exc).__name__}: {message}"
    finally:
        for name, x in inputs.items():
            x.copy_(saved[name])
    return None


def _check_forward(op: OpDef, cfg: LabConfig, case: Case, impl: Impl, inputs: Tensors) -> str | None:
    oracle = reference_outputs(op, cfg, cast_floats(inputs, torch.float64), case)["out"].cpu()
    baseline = reference_outputs(op, cfg, inputs, case)["out"].cpu()
    with torch.no_grad():
        got = impl.fn(inputs, cfg)["out"]
    check = parity.check_output(got.detach().cpu(), oracle, baseline, cfg.precision.contract)
    return None if check["verdict"] == "pass" else check["reason"]


def _check_forward_backward(op: OpDef, cfg: LabConfig, case: Case, impl: Impl, inputs: Tensors,
                            grad_out: torch.Tensor) -> str | None:
    oracle = reference_outputs(op, cfg, cast_floats(inputs, torch.float64), case, each(grad_out, torch.Tensor.double))
    baseline = reference_outputs(op, cfg, inputs, case, grad_out)
    worst_gradient_baseline(op, cfg, inputs, case, grad_out, oracle, baseline)
    with torch.no_grad():
        got = dict(impl.fn(inputs, cfg))
    got.update(gradients(lambda x: impl.fn(x, cfg), inputs, grad_out))
    record = {"case": asdict(case), "oracle": to_cpu(oracle), "baseline": to_cpu(baseline)}
    result = check_path(op, impl, cfg, [record], [to_cpu({k: v for k, v in got.items()
                                                            if isinstance(v, torch.Tensor)})])
    return None if result["verdict"] == "pass" else result["failed_cases"][0]


def _placed(flops: float, nbytes: float, seconds: float, working_set: int, *, calibration: dict[str, Any],
            peak_flops: float | None, peak_bandwidth: float, cache_bytes: int | None, floor_flops: float | None,
            precision: tuple, device: str, local: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """One timed call on the roofline at its own FLOPs, bytes and working set (the last-level cache is compared
    with the working set). Above the calibrated FLOP peak, the peak is doubted first (rule "local_peak"):
    remeasured at the path's own size in the point's dtype, and the call placed against the larger; `peak_used`
    says which peak and why. None where the point's dtype has no calibrated peak."""
    if not peak_flops:
        return None
    common = dict(peak_flops=peak_flops, peak_bytes_per_s=peak_bandwidth, cache_bytes=cache_bytes,
                  working_set_bytes=working_set)
    roof = roofline.roofline(flops, nbytes, seconds, widest_flops=floor_flops, **common)
    calibrated = {"source": "calibration", "flops_per_s": roof["ceiling_flops_per_s"],
                  "n": (calibration.get("method") or {}).get("gemm_sizes"),
                  "why": "the calibrated GEMM peak (the fastest of the formats at least as precise as the point's)"}
    if roof["achieved_flops_per_s"] <= roof["ceiling_flops_per_s"]:
        return {**roof, "peak_used": calibrated}
    dtype = "tf32" if precision[1] else precision[0]
    n = max(16, round((flops / 2) ** (1 / 3)))
    if n not in local:
        local[n] = calibrate.local_peak(flops, dtype, device)
    remeasured = local[n]
    if not remeasured.get("best_flops_per_s"):
        return {**roof, "peak_used": {**calibrated, "remeasured": remeasured}}
    widest = max(floor_flops or 0.0, remeasured["best_flops_per_s"])
    again = roofline.roofline(flops, nbytes, seconds, widest_flops=widest, **common)
    return {**again, "peak_used": {
        "source": "remeasured" if widest > roof["ceiling_flops_per_s"] else "calibration",
        "flops_per_s": again["ceiling_flops_per_s"], "n": remeasured["n"], "dtype": dtype,
        "why": (f"the path ran at {roof['achieved_flops_per_s'] / 1e9:.3g} GFLOP/s, above the calibrated "
                f"{roof['ceiling_flops_per_s'] / 1e9:.3g}: the peak was remeasured at its own size (a {remeasured['n']}"
                f"^3 {dtype} GEMM, fastest of {remeasured['reps']} calls: {remeasured['best_flops_per_s'] / 1e9:.3g} "
                "GFLOP/s)" + ("" if again["above_roof"] is None else "; still above it: no speed")),
        "calibrated_flops_per_s": roof["ceiling_flops_per_s"], "remeasured": remeasured}}


@on_same_cpus
@closed_after
def run_microbench(cfg: LabConfig, out: Path, calibration: dict[str, Any],
                   calibration_problem: str | None = None) -> dict[str, Any]:
    """Warmed timing, memory and roofline of every path that passed parity, then the measured curve.

    On the point's own shape each path is timed twice: the forward (the outputs every path
    returns; nothing extra), and forward + backward (what a training step runs), each with
    its achieved FLOP/s from the op's formulas (the backward's multiple written beside it),
    the peak memory of one forward, and the roofline class against `calibration`'s peaks. A
    speedup is a ratio of medians; "faster" is declared only when the spread bands do not
    overlap. Then every valid path over the op's curve axes (`shape.curve`, ...), each size
    parity-checked first, forward and with bench.curve_backward forward + backward too (curve.csv,
    plots, crossovers: _curve). Triton through its interpreter is never timed. `calibration_problem`: why
    `calibration` is not what the calibrate stage wrote (lab/pipeline.py `calibration`): then no path but the
    reference gets a speed, since its peaks decide which speeds are possible.
    """
    from posttrainllm.track import plots  # matplotlib: imported by the one stage that draws

    op = op_for(cfg)
    device = devices.prepare(cfg.device.name, cfg.bench.threads)
    passed = passed_parity(out)
    refused_by_parity = refusals(out)
    case = next(c for c in op.cases(cfg) if c.main)
    costs = op.costs(case, cfg)
    bench = cfg.bench
    # values; every path copies them
    sets = rooms.timed_input_sets(op, case, _dtype(cfg), device, bench)
    with torch.no_grad():
        grad_outs = [upstream_gradients(op, c, op.reference.fn(x, cfg)) for c, x in sets]
    inputs = sets[0][1]
    quantize = cfg.precision.quantize
    precision = (cfg.precision.dtype, cfg.precision.allow_tf32 and device == "cuda",
                 quantize.format if quantize is not None else None)
    peak_flops, peak_bandwidth = calibrate.peak_for(calibration, *precision)
    floor_flops = calibrate.floor_peak(calibration, *precision)  # the peak of rule "impossible"
    report: dict[str, Any] = {"device": device, "threads": torch.get_num_threads(), "case": case.name,
                              "problem": op.problem(case), "flops": costs.flops, "bytes": costs.bytes,
                              "train_flops": costs.train_flops, "flops_formula": costs.flops_formula,
                              "bytes_formula": costs.bytes_formula, "backward_formula": costs.backward_formula,
                              "noisy_rule": NOISY, "band_rule": rules.cite("band"),
                              "roofline_rule": roofline.CLASSIFICATION,
                              "peaks": {"gemm_flops_per_s": peak_flops, "copy_bytes_per_s": peak_bandwidth},
                              "paths": {}}
    settings = dict(warmup=bench.warmup, reps=bench.reps, min_time_s=bench.min_time_s, max_reps=bench.max_reps)
    report["timed_result_rule"] = rules.cite("timed_result")
    report["impossible_rule"] = rules.cite("impossible", fraction=bench.impossible_below)
    report["rotation_rule"] = rules.cite("rotation", n=len(sets), seed_step=rooms.INPUT_SET_SEED)
    report["state_rule"] = rules.cite("torch_state")
    report["cpus"], report["cpus_rule"] = devices.own_cpus(), rules.cite("same_cpus")
    report["calibration"] = {"sha256": calibration.get("sha256"), "problem": calibration_problem}
    report["above_roof_rule"] = rules.cite("above_roof")
    cache_bytes = devices.last_level_cache_bytes(device)
    report["last_level_cache_bytes"] = cache_bytes
    report["cost_model_rule"] = rules.cite("cost_model")
    local_peaks: dict[int, dict[str, Any]] = {}  # calibrate.local_peak per GEMM size, measured at most once here
    rows, timings = [], {}
    with devices.fp32_matmuls(tf32=cfg.precision.allow_tf32):
        for name, impl in parity_paths(op, cfg, out).items():
            if not passed.get(name, False):
                report["paths"][name] = MicrobenchPath(valid=False, reason=refused_by_parity.get(name, FAILED_PARITY))
                continue
            if runs_interpreted(impl):
                report["paths"][name] = MicrobenchPath(valid=False, reason=INTERPRETER_NOT_SPEED)
                continue
            mine = [rooms.fresh(x, device) for _, x in sets]  # this path's own buffers of every input set
            dos = [each(g, torch.Tensor.clone) for g in grad_outs]
            stops = runner.continued()  # rule lab_stopped: the lab stopped and continued while this path is timed
            try:  # a compiled peer that would run eagerly at this shape raises (ops/peers.py NotCompiled)
                timed = runner.runner_for(impl).time(op, cfg, case, mine, dos, device, settings)
            except Exception as exc:
                report["paths"][name] = MicrobenchPath(valid=False,
                                                       reason=f"{type(exc).__name__}: {exc}".splitlines()[0])
                continue
            if runner.continued() != stops:
                stopped = (f"the lab process was stopped and continued while {name} was timed "
                           f"({rules.named('lab_stopped')})")
                if name == REFERENCE:
                    raise RuntimeError(f"{stopped}: every speedup is a ratio to it")
                report["paths"][name] = MicrobenchPath(valid=False, reason=f"{stopped}: no speed", **timed.entry)
                continue
            forward, train, memory, first_call_ms, state = (timed.forward, timed.train, timed.memory,
                                                            timed.first_call_ms, timed.refused)
            refused = None if name == REFERENCE else (
                (calibration_problem and f"{calibration_problem}: its peaks decide the impossible-time floor: no speed")
                or state or forward.other_streams or (train is not None and train.other_streams) or None
                or _timed_result_check(op, cfg, case, impl, mine[0])
                or impossible(forward.median_ms, costs.flops, calibration, floor_flops, bench.impossible_below)
                or (train is not None and (
                    _timed_result_check(op, cfg, case, impl, mine[0], grad_out=dos[0])
                    or impossible(train.median_ms, costs.train_flops, calibration, floor_flops,
                                  bench.impossible_below, "forward + backward"))) or None)
            if refused:  # the path's numbers were right in parity, but what was timed was not that function
                report["paths"][name] = MicrobenchPath(valid=False, reason=refused, first_call_ms=first_call_ms,
                                                       **timed.entry)
                continue
            timings[name] = (forward, train)
            seconds = forward.median_ms / 1e3
            mine_costs = op.costs_of(impl, case, cfg)  # this path's own FLOPs and bytes (Impl.cost_model)
            place = functools.partial(_placed, calibration=calibration, peak_flops=peak_flops,
                                      peak_bandwidth=peak_bandwidth, cache_bytes=cache_bytes, floor_flops=floor_flops,
                                      precision=precision, device=device, local=local_peaks)
            entry = MicrobenchPath(
                first_call_ms=first_call_ms,
                valid=True, **forward.summary(),
                gflops_per_s=costs.flops / seconds / 1e9, gbytes_per_s=mine_costs.bytes / seconds / 1e9,
                memory=memory,
                costs=mine_costs.record(),
                roofline=place(mine_costs.flops, mine_costs.bytes, seconds, mine_costs.live_bytes),
                backward=impl.backward, **timed.entry,
                forward_backward=(
                    ForwardBackward(valid=False, reason=backward_note(impl)) if train is None else
                    ForwardBackward(**train.summary(), gflops_per_s=costs.train_flops / (train.median_ms / 1e3) / 1e9,
                                    roofline=place(mine_costs.train_flops, mine_costs.train_bytes,
                                                   train.median_ms / 1e3, mine_costs.live_bytes)
                                    if mine_costs.train_bytes else None)),
            )
            report["paths"][name] = entry
            above = (entry.roofline or {}).get("above_roof")
            if above and name != REFERENCE:  # a fraction above 1 is not a result (rule "above_roof")
                report["paths"][name] = MicrobenchPath(valid=False, reason=f"above the roofline: {above}: no speed",
                                                       first_call_ms=first_call_ms)
                del timings[name]
                continue
            if above:  # the baseline stays timed (speedups are ratios to it); the figure is named, not a result
                report.setdefault("notes", []).append(f"the reference is above the roofline: {above}")
            for mode, timing in (("forward", forward), ("forward_backward", train)):
                rows += [{"impl": name, "mode": mode, "rep": i, "ms": ms}
                         for i, ms in enumerate(timing.samples_ms if timing else [])]
    if REFERENCE not in timings:  # every speedup is a ratio to it: without it the stage has no result to give
        raise RuntimeError(f"the reference could not be timed: {report['paths'][REFERENCE].reason}")
    ref_forward, ref_train = timings[REFERENCE]
    for name, (forward, train) in timings.items():
        if name == REFERENCE:
            continue
        entry = report["paths"][name]
        entry.speedup_vs_reference = ref_forward.median_ms / forward.median_ms
        entry.vs_reference = compare(forward, ref_forward)
        if train is not None:
            entry.forward_backward.speedup_vs_reference = ref_train.median_ms / train.median_ms
            entry.forward_backward.vs_reference = compare(train, ref_train)
    timed = list(timings)
    if op.describe is not None:  # what the op measures of its own case beyond time (MoE: the routing's histogram)
        report["describe"] = op.describe(case, inputs, cfg, measure)
    ridge = max(peak_flops, floor_flops or 0.0) / peak_bandwidth if peak_flops else None  # FLOP/B
    stops = runner.continued()
    report["curve"] = _curve(cfg, op, out, device, timed, calibration, floor_flops, cache_bytes=cache_bytes,
                             ridge=ridge)
    if runner.continued() != stops:
        raise RuntimeError("the lab process was stopped and continued while it timed the curve "
                           f"({rules.named('lab_stopped')})")
    for name, impl in runner.paths(op, cfg).items():  # after every timed call and curve size (compiled: per signature)
        if impl.evidence is not None and name in report["paths"]:
            report["paths"][name].evidence = impl.evidence()
    record = MicrobenchRecord(**report)
    record.write(out / MicrobenchRecord.FILE)
    with open(out / "timings.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["op", "impl", "mode", "rep", "ms", "device", "threads", "problem"])
        writer.writeheader()
        for row in rows:
            writer.writerow({"op": op.name, **row, "device": device, "threads": report["threads"],
                             "problem": report["problem"]})
    # every timed path at its intensity and achieved rate, against each calibrated dtype's roof; drawn even where
    # the point's own dtype has no calibrated peak (an fp8 point on a CPU: its paths then have no roofline entry)
    lines = [{"label": name, "intensity_flops_per_byte": entry.costs["flops_per_byte"],
              "achieved_flops_per_s": entry.costs["flops"] / (entry.median_ms / 1e3), "model": entry.costs["model"]}
             for name in timed if (entry := report["paths"][name]).gflops_per_s]
    title = f"{op.name} {report['problem']}"
    if not peak_flops:
        title += f"\n(no {cfg.precision.quantize.format if cfg.precision.quantize else cfg.precision.dtype} peak "\
                 "calibrated here: the other dtypes' roofs)"
    plots.roofline_plot(lines, calibration["peaks"], out / "roofline.png", title=title,
                        dtype=calibrate.peak_key(calibration, *precision))  # the point's own roof only
    return record.to_dict()


def _curve(cfg: LabConfig, op: OpDef, out: Path, device: str, timed: list[str], calibration: dict[str, Any],
           floor_flops: float | None, *, cache_bytes: int | None = None, ridge: float | None = None) -> dict[str, Any]:
    """The timed paths over every curve axis of the op (shape.curve; its extra_curves), forward and, with
    bench.curve_backward, forward + backward; each size parity-checked before it is timed: curve.csv + plots,
    and each path's crossover with the reference per axis and mode. Each size's timing rotates over the point's
    number of input sets, and after it the timed-result check and the impossible-time floor apply (a size that
    fails them keeps no time: valid False, the reason).

    The check is the forward output's against the float64 oracle (_check_at); it gates both modes. The
    gradients of the same function are checked by the parity stage on the point's cases, not per size."""
    from posttrainllm.measure import curves
    from posttrainllm.track import plots  # pandas, matplotlib: only this stage needs them

    revision = git_revision()["revision"]
    bench = cfg.bench
    settings = dict(warmup=bench.warmup, reps=bench.reps, min_time_s=bench.min_time_s, max_reps=bench.max_reps)
    modes = [curves.FORWARD, curves.FORWARD_BACKWARD] if bench.curve_backward else [curves.FORWARD]
    paths = parity_paths(op, cfg, out)
    rows = []
    with devices.fp32_matmuls(tf32=cfg.precision.allow_tf32):
        for axis in op.curve_axes:
            for x in sorted(axis.sizes(cfg)):
                case = axis.case(cfg, x)
                costs = op.costs(case, cfg)
                sets = rooms.timed_input_sets(op, case, _dtype(cfg), device, bench)
                with torch.no_grad():
                    checks = _check_at(op, cfg, case, rooms.fresh(sets[0][1], device), timed)
                    grad_outs = ([upstream_gradients(op, c, op.reference.fn(s, cfg)) for c, s in sets]
                                 if curves.FORWARD_BACKWARD in modes else [])
                for name in timed:
                    impl = paths[name]
                    run = runner.runner_for(impl)
                    mine_costs = op.costs_of(impl, case, cfg)  # the path's own traffic at this size
                    labels = dict(op=op.name, impl=name, kind=impl.kind, x_name=axis.x_name, x_value=x,
                                  minimal_bytes=costs.bytes, working_set=mine_costs.live_bytes,
                                  cost_model=mine_costs.model, device=device, revision=revision)
                    mine = [rooms.fresh(s, device) for _, s in sets]  # this path's own buffers
                    dos = [each(g, torch.Tensor.clone) for g in grad_outs]
                    for mode in modes:
                        if mode == curves.FORWARD_BACKWARD and impl.backward == NO_BACKWARD:
                            continue  # a forward-only path has no forward + backward to time
                        if mode == curves.FORWARD:
                            flops = costs.flops
                            modelled = dict(path_flops=mine_costs.flops, bytes=mine_costs.bytes)
                        else:
                            flops = costs.train_flops
                            modelled = dict(path_flops=mine_costs.train_flops, bytes=mine_costs.train_bytes)
                        row, state = run.curve_row(op, cfg, case, mode, mine, dos, device, settings, checks[name],
                                                   dict(labels, mode=mode, flops=flops, **modelled))
                        if row["valid"] and name != REFERENCE:  # what was timed was this function, possibly
                            refused = (
                                state
                                or _timed_result_check(op, cfg, case, impl, mine[0],
                                                       grad_out=None if mode == curves.FORWARD else dos[0])
                                or impossible(row["median"], flops, calibration, floor_flops,
                                              bench.impossible_below, mode))
                            if refused:
                                row.update(median=math.nan, p20=math.nan, p80=math.nan, valid=False, reason=refused)
                        rows.append(row)
                    del mine, dos
                del sets, grad_outs
    frame = curves.frame(rows)
    frame.to_csv(out / "curve.csv", index=False)
    read = curves.regimes(frame, cache_bytes=cache_bytes, ridge=ridge,  # each path's regime per segment
                          caches=curves.cache_levels(device))
    why_not = refusals(out)
    skipped = {name: (INTERPRETER_NOT_SPEED if runs_interpreted(impl) else why_not.get(name, FAILED_PARITY))
               for name, impl in paths.items() if name not in timed}
    plots.time_vs_size(frame, out / "time_vs_size.png", regimes=read, omitted=skipped)
    plots.memory_vs_size(frame, out / "memory_vs_size.png")
    found = curves.crossovers(frame, [name for name in timed if name != REFERENCE])
    headline = next(c for c in found if c["x_name"] == op.x_name and c["mode"] == curves.FORWARD)
    return {"x_name": op.x_name, "x_values": sorted(op.curve_sizes(cfg)), "modes": modes, "skipped": skipped,
            "band_rule": rules.cite("band"), "check_rule": rules.cite("curve_check"),
            "crossover_vs_reference": headline["vs_reference"],  # x_name, forward: what the report shows
            "crossovers": found,  # every axis and mode
            "regimes": read, "regime_rule": curves.REGIME,
            "unchecked_or_failed": sorted({f"{r['impl']}@{r['x_name']}={r['x_value']}" for r in rows
                                           if r["check"] != "pass"})}


def _check_at(op: OpDef, cfg: LabConfig, case: Case, inputs: Tensors, names: list[str]) -> dict[str, str]:
    """Each path's forward output at one curve size against the float64 oracle: "pass", or why not."""
    oracle = reference_outputs(op, cfg, cast_floats(inputs, torch.float64), case)["out"].cpu()
    baseline = reference_outputs(op, cfg, inputs, case)["out"].cpu()
    verdicts = {}
    for name in names:
        if name == REFERENCE:
            verdicts[name] = "pass"  # the in-precision baseline the contract is relative to
            continue
        try:
            got = runner.paths(op, cfg)[name].fn(inputs, cfg)["out"]
            check = parity.check_output(got.cpu(), oracle, baseline, cfg.precision.contract)
            verdicts[name] = "pass" if check["verdict"] == "pass" else f"failed parity: {check['reason']}"
        except Exception as exc:
            verdicts[name] = f"failed: {type(exc).__name__}: {exc}".splitlines()[0]
    return verdicts
