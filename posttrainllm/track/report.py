"""Readable tables of receipts (pandas), for the terminal and for the README."""

from __future__ import annotations

from typing import Any

import pandas as pd

from posttrainllm.model import amdahl as band_rule


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else value if isinstance(value, str) else format(value, spec)


def _measured(train: dict[str, Any], check: dict[str, Any]) -> float | str | None:
    """A measured end-to-end speedup as printed: the number, or "n.c." inside the baseline's own run-to-run band
    (bench_train.json noise.band): no speedup is ever printed inside it."""
    measured = check.get("measured_speedup") if check.get("valid") else None
    band = (train.get("noise") or {}).get("band")
    return "n.c." if measured is not None and band_rule.within_band(measured, band) else measured


def held(path: dict[str, Any]) -> str:
    """A path's bitwise properties (parity.json "properties", lab/invariance.py) in a few characters: det:y bi:n
    (deterministic, batch-invariant: y holds, n does not, - not measured); "-" where none were measured."""
    props = path.get("properties") or {}
    mark = {True: "y", False: "n", None: "-"}
    return " ".join(f"{short}:{mark[(props.get(prop) or {}).get('holds')]}" for short, prop in
                    (("det", "deterministic"), ("bi", "batch_invariant"))) if props else "-"


def point_table(receipt: dict[str, Any]) -> str:
    """One row per path: parity verdict and worst error, then timing and throughput where valid."""
    parity = (receipt.get("parity") or {}).get("paths", {})
    bench = (receipt.get("microbench") or {}).get("paths", {})
    rows = []
    for name in dict.fromkeys([*bench, *parity]):
        p, b = parity.get(name, {}), bench.get(name, {})
        worst = p.get("worst", {}).get("out", {})
        valid = b.get("valid", False)
        note = "; ".join(filter(None, [
            "bf16 emulated (see receipt)" if p.get("emulation") else "",
            backward_note(p.get("backward")),
            raised_note(p),
            "interpreted: not speed" if b.get("reason", "").startswith("Triton ran through") else
            "" if p.get("cannot_run_here") else b.get("reason", ""),
        ]))
        rows.append({
            "path": name,
            "parity": p.get("verdict", "baseline" if name == "reference" else "-"),
            "max_abs_err": _fmt(worst.get("max_abs_err"), ".2e"),
            "allowed": _fmt(worst.get("allowed_abs_err"), ".2e"),
            "bitwise": held(p),  # deterministic, batch-invariant (lab/invariance.py): y, n, - not measured
            "median_ms": _fmt(b.get("median_ms") if valid else None, ".3f"),
            "p20-p80_ms": f"{b['p20_ms']:.3f}-{b['p80_ms']:.3f}" if valid else "-",
            "GFLOP/s": _fmt(b.get("gflops_per_s") if valid else None, ".2f"),
            "GB/s": _fmt(b.get("gbytes_per_s") if valid else None, ".2f"),
            "speedup": _fmt(b.get("speedup_vs_reference"), ".2f"),
            "note": note,
        })
    machine = receipt["provenance"]["machine"]
    apart = (receipt.get("parity") or {}).get("cannot_run_here") or {}
    head = (f"point {receipt['point']}: {(receipt.get('microbench') or {}).get('problem', '')} "
            f"{receipt['config']['precision']['name']} on {machine['device_name']} ({machine['threads']} threads), "
            f"parity {(receipt.get('parity') or {}).get('verdict', 'missing')}"
            + (f" ({len(apart)} cannot run here, apart: {', '.join(apart)})" if apart else ""))
    lines = [head, pd.DataFrame(rows).to_string(index=False)]
    quantization = (receipt.get("parity") or {}).get("quantization")
    if quantization:  # a quantized precision: the quantization's own error, apart from the paths'
        lines.append(f"quantization {quantization['recipe']}: SQNR {_fmt(quantization['sqnr_db'], '.1f')} dB, worst "
                     f"row {_fmt(quantization['row_min_sqnr_db'], '.1f')} dB (min {quantization['min_sqnr_db']:g} / "
                     f"{quantization['min_row_sqnr_db']:g} dB): {quantization['verdict']}")
    summary = ((receipt.get("microbench") or {}).get("describe") or {}).get("summary")
    if summary:  # the op's own line about the point (fp8 matmul: the bf16 GEMM beside it)
        lines.append(summary)
    return "\n".join(lines)


def raised_note(path: dict[str, Any]) -> str:
    """A path that raised: where (the innermost frame of its own code) and, if this machine cannot run it, why and
    what would (track/failures.py); its traceback's file is in parity.json."""
    error = path.get("error")
    if not error:
        return ""
    where = error.get("where")
    raised = f"raised {error['type']}" + (f" at {where['file']}:{where['line']}" if where else "")
    gap = path.get("cannot_run_here")
    return f"cannot run here: {gap['reason']}, runs on {gap['runs_on']} ({raised})" if gap else raised


def backward_note(backward: str | None) -> str:
    """parity.json's "backward" of a path, when its gradients are not its own (own or absent: nothing to say)."""
    if backward in (None, "own"):
        return ""
    return "forward-only" if backward == "none" else f"gradients not checked: {backward}'s backward"


def train_table(receipt: dict[str, Any]) -> str:
    """One row per bench-train variant: speed where valid, the loss curve's ends (at its own last step), drift,
    Amdahl; then a row per path not trained (failed parity, forward-only, ...) with why. "-" where nothing applies."""
    train = receipt.get("bench_train")
    if not train:
        return f"point {receipt['point']}: no bench-train result"
    amdahl = train.get("amdahl", {}).get("variants", {})
    quality = (train.get("quality") or {}).get("variants") or {}  # a quantized precision's gate, per path
    rows = []
    for name, entry in train["impls"].items():
        valid = entry.get("timing_valid", True) and (quality.get(name) or {}).get("verdict", "pass") == "pass"
        check = amdahl.get(name, {})
        rows.append({
            "variant": name,
            "warm_ms/step": _fmt(entry["warm_ms_per_step"] if valid else None, ".1f"),
            "tokens/s": _fmt(entry["tokens_per_s"] if valid else None, ".0f"),
            "peak_MB": _fmt(entry["peak_mem_bytes"] / 1e6 if entry.get("peak_mem_bytes") else None, ".1f"),
            "steps": len(entry["losses"]),  # fewer for Triton through its interpreter (train.interpreted_steps)
            "loss[0]": f"{entry['losses'][0]:.4f}",
            "loss[last]": f"{entry['losses'][-1]:.4f}",
            "drift": _fmt(train["drift"].get(name), ".2e"),
            "verdict": train.get("drift_verdict", {}).get(name, "baseline"),
            **({"quality": (quality.get(name) or {}).get("verdict", "baseline"),
                "heldout_gap": _fmt((quality.get(name) or {}).get("heldout_gap"), ".4f"),
                "greedy_agree": _fmt(((quality.get(name) or {}).get("greedy") or {}).get("agreement"), ".3f")}
               if quality else {}),
            "predicted": _fmt(check.get("predicted_speedup"), ".2f"),
            "measured": (band_rule.measured_text(check.get("measured_speedup"),
                                              (train.get("noise") or {}).get("band"))
                         if valid and check.get("valid") else None) or "-",
            "note": check.get("reading") or ("" if valid else "failed the quality gate: no speed"
                                             if entry.get("timing_valid", True) else "interpreted: not speed"),
        })
    rows += [{**dict.fromkeys(rows[0], "-"), "variant": name, "note": why}
             for name, why in (train.get("skipped") or {}).items()]
    fraction = train.get("amdahl", {}).get("fraction")
    band = (train.get("noise") or {}).get("band")
    head = (f"point {receipt['point']}: bench-train {receipt['config']['architecture']['name']} "
            f"{train['precision']} on {train['device']}, {train['tokens_per_step']} tokens/step, "
            f"drift limit {train['drift_limit']:g}"
            + (f", {train['amdahl']['op']} is {fraction:.0%} of the baseline step" if fraction is not None else "")
            + (f", run-to-run band +-{(band - 1) * 100:.1f}% (the baseline against itself: a measured speedup "
               "inside it is no measurable change)" if band is not None else ""))
    return head + "\n" + pd.DataFrame(rows).to_string(index=False)


def _peer(receipt: dict[str, Any]) -> str | None:
    """PyTorch's own optimized path for the point's op (kind "peer" in its registry): what a user would otherwise pick."""
    paths = (receipt.get("kernel") or {}).get("paths", {})
    return next((name for name, entry in paths.items() if entry.get("kind") == "peer"), None)


def _vs_best_peer(receipt: dict[str, Any], mode: str) -> tuple[str | None, float | None, float | None]:
    """Our kernel against the fastest valid peer (every SDPA backend is one) in `mode` ("forward" or
    "forward_backward"): (best peer, best peer ms / triton ms, triton FLOP/s / calibrated GEMM peak).
    A fraction >= 1 means ours is at least as fast; None where a side has no valid timing."""
    micro = receipt.get("microbench") or {"paths": {}}
    paths = (receipt.get("kernel") or {}).get("paths", {})

    def timing(name: str) -> dict[str, Any] | None:
        entry = micro["paths"].get(name) or {}
        if not entry.get("valid"):
            return None
        timed = entry if mode == "forward" else entry.get("forward_backward")
        return timed if timed and timed.get("median_ms") else None

    peers = {name: t for name, entry in paths.items() if entry.get("kind") == "peer" and (t := timing(name))}
    ours = timing("triton")
    best = min(peers, key=lambda n: peers[n]["median_ms"]) if peers else None
    fraction = peers[best]["median_ms"] / ours["median_ms"] if ours and best else None
    peak = (micro.get("peaks") or {}).get("gemm_flops_per_s")
    of_peak = ours["gflops_per_s"] * 1e9 / peak if ours and peak and ours.get("gflops_per_s") else None
    return best, fraction, of_peak


def _crossover(curve: dict[str, Any], mode: str, peer: str | None) -> Any:
    """The peer's crossover along the curve's own x_name in `mode` (None where that mode was not timed)."""
    found = [c for c in curve.get("crossovers") or [] if c["x_name"] == curve.get("x_name") and c["mode"] == mode]
    return found[0]["vs_reference"].get(peer) if found else None


def compiled(receipt: dict[str, Any], path: str = "triton") -> dict[str, Any]:
    """`path`'s kernels on the first compile target (kernel.json's `compile`, lab/compile.py): the most registers,
    the spill bytes, the most shared memory, the tensor-core instructions and whether every kernel launches."""
    section = (receipt.get("kernel") or {}).get("compile") or {}
    target = (section.get("targets") or [None])[0]
    rows = [r for r in section.get("rows", []) if r.get("path") == path and r.get("target") == target]
    counted = [r for r in rows if "registers" in r]
    if not rows:
        return {}
    return {"target": target, "kernels": len(rows),
            "max_regs": max((r["registers"] for r in counted), default=None),
            "spill_B": sum(r["spill_bytes"] for r in counted) if counted else None,
            "smem_KB": max((r["shared_bytes"] for r in counted), default=0) / 1024 if counted else None,
            "tensor_cores": ",".join(sorted({r["tensor_cores"] for r in counted})) or "-",
            "fits": all(r.get("fits") for r in rows)}


def point_failed(receipt: dict[str, Any]) -> bool:
    """A point failed when a path broke its numerical contract, its loss drift limit or its quality gate."""
    from posttrainllm.track.receipt import verdict

    return verdict(receipt) != "pass"


def _failures_first(frame: pd.DataFrame) -> pd.DataFrame:
    """Failing points first: a failure is evidence, and the first thing a reader must see."""
    return frame.sort_values("verdict", key=lambda v: v != "FAIL", kind="stable").reset_index(drop=True)


def sweep_frame(receipts: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per point: what it changes, parity verdicts, valid timings against the baseline point,
    roofline class, crossover, and bench-train (drift, Amdahl's predicted vs measured speedup)."""
    rows = []
    for name, receipt in receipts.items():
        parity = (receipt.get("parity") or {}).get("paths", {})
        micro = receipt.get("microbench") or {"paths": {}}
        bench = micro["paths"]
        train = receipt.get("bench_train") or {"impls": {}, "drift": {}}
        peer = _peer(receipt)
        peer_entry = bench.get(peer, {})
        triton_worst = parity.get("triton", {}).get("worst", {})
        ratios = [w["max_abs_err"] / w["allowed_abs_err"] for w in triton_worst.values() if w.get("allowed_abs_err")]
        amdahl = train.get("amdahl", {}).get("variants", {}).get(peer, {})
        rows.append({
            "point": name,
            "verdict": "FAIL" if point_failed(receipt) else "pass",
            "first_failure": (receipt.get("parity") or {}).get("first_failure") or "-",
            "change": ",".join(f"{k}={v}" for k, v in (receipt["sweep"] or {}).get("changes", {}).items()) or "-",
            "parity": ",".join(f"{p}:{v['verdict']}" for p, v in parity.items()),
            "triton_err/allowed": max(ratios) if ratios else None,
            "ref_ms": bench.get("reference", {}).get("median_ms"),
            "peer": peer,
            "peer_ms": peer_entry.get("median_ms") if peer_entry.get("valid") else None,
            "peer_speedup": peer_entry.get("speedup_vs_reference"),
            "peer_fb_speedup": (peer_entry.get("forward_backward") or {}).get("speedup_vs_reference"),
            "peer_vs_ref": peer_entry.get("vs_reference"),
            "peer_noisy": peer_entry.get("noisy"),
            "peer_bound": (peer_entry.get("roofline") or {}).get("classification"),
            "crossover": micro.get("curve", {}).get("crossover_vs_reference", {}).get(peer),
            "crossover_fb": _crossover(micro.get("curve", {}), "forward_backward", peer),
            "best_peer": _vs_best_peer(receipt, "forward")[0],
            "triton_vs_best": _vs_best_peer(receipt, "forward")[1],
            "triton_fb_vs_best": _vs_best_peer(receipt, "forward_backward")[1],
            "triton_of_peak": _vs_best_peer(receipt, "forward")[2],
            "train_ms": train["impls"].get(train.get("baseline"), {}).get("warm_ms_per_step"),
            "max_drift": max(train["drift"].values()) if train["drift"] else None,
            "amdahl_pred": amdahl.get("predicted_speedup"),
            "amdahl_meas": _measured(train, amdahl),
            **{f"triton_{key}": value for key, value in compiled(receipt).items()},
        })
    frame = _failures_first(pd.DataFrame(rows))
    baseline = frame[frame["point"] == "baseline"]
    if not baseline.empty and baseline["peer_ms"].notna().all():
        same_op = frame["peer"] == baseline["peer"].iloc[0]
        frame["peer_vs_baseline"] = (baseline["peer_ms"].iloc[0] / frame["peer_ms"]).where(same_op)
    return frame


SUMMARY_NUMBERS = ("peer_x", "peer_fb_x", "ours_x", "ours_fb_x", "e2e_pred", "e2e_meas")  # summary_frame's numbers
FORMATS = {"triton_err/allowed": ".3f", "ref_ms": ".3f", "peer_ms": ".3f", "peer_speedup": ".2f", "peer_fb_speedup": ".2f",
           "peer_vs_baseline": ".2f", "train_ms": ".1f", "max_drift": ".1e", "amdahl_pred": ".2f",
           "amdahl_meas": ".2f", "triton_vs_best": ".2f", "triton_fb_vs_best": ".2f", "triton_of_peak": ".2f",
           "triton_smem_KB": ".0f",
           **dict.fromkeys(SUMMARY_NUMBERS, ".2f")}


def formatted(frame: pd.DataFrame) -> pd.DataFrame:
    """sweep_frame or summary_frame as strings: numbers in FORMATS, '-' where there is none."""
    frame = frame.copy()
    for column, spec in FORMATS.items():
        if column in frame:
            frame[column] = frame[column].map(lambda v, s=spec: _fmt(None if pd.isna(v) else v, s))
    return frame.fillna("-").astype(str)


def sweep_table(receipts: dict[str, dict[str, Any]]) -> str:
    """Every column of sweep_frame (`posttrainllm report --wide`): far wider than a terminal."""
    return formatted(sweep_frame(receipts)).to_string(index=False)


TERMINAL_WIDTH = 160  # the default table's widest line, whatever the points' names and failures
# text columns of the summary, clipped to these widths (first_failure narrower still if a number is unusually wide)
CLIPPED = {"point": 20, "first_failure": 32, "parity": 20, "best_peer": 14, "e2e_path": 10}
SUMMARY_LEGEND = (
    "peer_x, peer_fb_x: reference time / the best valid peer's (forward; forward+backward). ours_x, ours_fb_x: "
    "that peer's time / our Triton kernel's,",
    "  >= 1 when ours is as fast ('-' where Triton is interpreted: never speed). e2e_pred, e2e_meas: the training "
    "step's speedup with e2e_path,",
    "  predicted by Amdahl from the microbench and measured ('n.c.': inside the baseline's own run-to-run band, no",
    "  measurable change). Speedups are ratios of medians.",
)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _our_parity(receipt: dict[str, Any]) -> str:
    """Our Triton path's parity verdict, and every other path that failed: `triton:pass,sdpa_math:fail`."""
    paths = (receipt.get("parity") or {}).get("paths", {})
    ours = [f"triton:{paths['triton']['verdict']}"] if "triton" in paths else []
    return ",".join(ours + [f"{p}:{v['verdict']}" for p, v in paths.items()
                            if p != "triton" and v["verdict"] != "pass"]) or "-"


def _e2e(receipt: dict[str, Any]) -> tuple[str | None, float | None, float | None]:
    """Amdahl's check of our Triton path where it is valid, else of the peer: (path, predicted, measured)."""
    variants = ((receipt.get("bench_train") or {}).get("amdahl") or {}).get("variants", {})
    for name in ("triton", _peer(receipt)):
        check = variants.get(name) or {}
        if check.get("valid"):
            return name, check.get("predicted_speedup"), _measured(receipt["bench_train"], check)
    return None, None, None


def summary_frame(receipts: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """The few columns to read first, one row per point (failing points first): its verdict and first failure,
    our path's parity, the fastest valid peer's speedup over the reference and ours over that peer (forward;
    forward+backward), and the end-to-end training step's predicted and measured speedup."""
    rows = []
    for name, receipt in receipts.items():
        best, ours_x, _ = _vs_best_peer(receipt, "forward")
        best_entry = ((receipt.get("microbench") or {}).get("paths") or {}).get(best) or {}
        e2e_path, e2e_pred, e2e_meas = _e2e(receipt)
        rows.append({
            "point": name,
            "verdict": "FAIL" if point_failed(receipt) else "pass",
            "first_failure": (receipt.get("parity") or {}).get("first_failure") or "-",
            "parity": _our_parity(receipt),
            "best_peer": best or "-",
            "peer_x": best_entry.get("speedup_vs_reference"),
            "peer_fb_x": (best_entry.get("forward_backward") or {}).get("speedup_vs_reference"),
            "ours_x": ours_x,
            "ours_fb_x": _vs_best_peer(receipt, "forward_backward")[1],
            "e2e_path": e2e_path or "-",
            "e2e_pred": e2e_pred,
            "e2e_meas": e2e_meas,
        })
    return _failures_first(pd.DataFrame(rows))


def _aligned(frame: pd.DataFrame, numbers: tuple[str, ...]) -> str:
    """A frame of strings as columns one space apart: numbers right-aligned, text left-aligned."""
    widths = {c: max([len(c), *frame[c].map(len)]) for c in frame.columns}
    cell = lambda c, text: text.rjust(widths[c]) if c in numbers else text.ljust(widths[c])  # noqa: E731
    rows = [list(frame.columns), *frame.itertuples(index=False)]
    return "\n".join(" ".join(cell(c, text) for c, text in zip(frame.columns, row)).rstrip() for row in rows)


def summary_table(receipts: dict[str, dict[str, Any]], width: int = TERMINAL_WIDTH) -> str:
    """summary_frame for the terminal, its text clipped so that no line is wider than `width`; then its legend."""
    frame = formatted(summary_frame(receipts))
    clipped = dict(CLIPPED)
    while True:
        shown = frame.copy()
        for column, most in clipped.items():
            shown[column] = shown[column].map(lambda text, w=most: _clip(text, w))
        table = _aligned(shown, SUMMARY_NUMBERS)
        excess = max(map(len, table.splitlines())) - width
        if excess <= 0 or clipped["first_failure"] <= len("first_failure"):
            return table + "\n" + "\n".join(SUMMARY_LEGEND)
        clipped["first_failure"] = max(len("first_failure"), clipped["first_failure"] - excess)


def sweep_markdown(receipts: dict[str, dict[str, Any]]) -> str:
    """The same table as GitHub markdown, with the legend a reader needs."""
    frame = formatted(sweep_frame(receipts))
    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(row) + " |" for row in frame.itertuples(index=False)]
    legend = [
        "", "Times are medians in ms on each point's own shape; `peer` is PyTorch's own optimized path.",
        "`triton_vs_best` (`triton_fb_vs_best`): the fastest valid peer's (`best_peer`, every SDPA backend "
        "counted) forward (forward + backward) median / our kernel's, >= 1 when ours is as fast; "
        "`triton_of_peak`: our forward's FLOP/s / the calibrated GEMM peak. Empty where Triton is "
        "interpreted (never speed).",
        "`verdict`: FAIL when a path broke its contract or its loss-drift limit (failing points come first; "
        "`first_failure` names the path and case).",
        "`peer_speedup`: reference forward time / peer forward time; `peer_fb_speedup`: the same for forward + "
        "backward (what Amdahl uses); `peer_vs_ref`: faster/slower only when the p20-p80 bands do not overlap.",
        "Speedups are ratios of medians. `peer_vs_baseline`: the baseline point's peer time / this "
        "point's (same op only). `peer_bound`: roofline class against the calibrated peaks.",
        "`crossover`: the smallest size of the curve from which the peer stays measurably faster (bands apart) "
        "than the reference at every larger size; `crossover_fb`: the same for forward + backward (curves timed "
        "with bench.curve_backward). Other curve axes (MoE: experts) are in microbench.json's `crossovers`.",
        "`triton_err/allowed`: the worst of the Triton path's outputs and gradients, as a fraction of its "
        "contract's bound. Triton timings through the interpreter are never shown.",
        "`amdahl_pred`/`amdahl_meas`: the end-to-end step speedup predicted from the microbench and the op's "
        "share of the step, and the measured one.",
    ]
    timing = stage_times_text(receipts)
    return "\n".join(lines + legend + (["", f"Time: {timing}"] if timing else [])) + "\n"


def stage_times(receipts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Where the sweep's time went, from the stages' stamps: seconds per stage summed over points
    (each stage's whole process, imports included), and the sweep's wall time from the first stage's
    start to the last stage's end. Points run by `posttrainllm bench` have no stamps and add nothing."""
    import datetime as dt

    per_stage: dict[str, float] = {}
    starts, ends = [], []
    for receipt in receipts.values():
        for stage, stamp in (receipt.get("stamps") or {}).items():
            timing = stamp.get("timing") or {}
            seconds = timing.get("process_s") or timing.get("stage_s")
            if seconds is None:
                continue
            per_stage[stage] = per_stage.get(stage, 0.0) + seconds
            end = dt.datetime.fromisoformat(stamp["created_at"]).timestamp()
            starts.append(end - seconds)
            ends.append(end)
    wall = max(ends) - min(starts) if ends else None
    return {"per_stage_s": per_stage, "stages_total_s": sum(per_stage.values()), "wall_s": wall}


def stage_times_text(receipts: dict[str, dict[str, Any]]) -> str:
    times = stage_times(receipts)
    if not times["per_stage_s"]:
        return ""
    split = ", ".join(f"{stage} {seconds:.0f} s" for stage, seconds in times["per_stage_s"].items())
    wall = f"{times['wall_s']:.0f} s" if times["wall_s"] is not None else "-"
    return (f"point stages: {times['stages_total_s']:.0f} s in all ({split}); from the first stage's start to "
            f"the last's end: {wall} (DVC's own start-up and the device/calibrate stages excluded)")
