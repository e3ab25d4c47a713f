"""Readable tables of receipts (pandas), for the terminal and for the README."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from posttrainllm import rules
from posttrainllm.model import amdahl as band_rule
from posttrainllm.measure import sass
from posttrainllm.track import derived

TERMINAL_WIDTH = 160  # the widest line of a default table (the bench's and the report's), whatever the names


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else value if isinstance(value, str) else format(value, spec)


def fill(text: str, width: int = TERMINAL_WIDTH) -> str:
    """A long line of prose wrapped to `width`, its words (paths, file:line) never broken."""
    import textwrap

    return textwrap.fill(text, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)


def held(path: dict[str, Any]) -> str:
    """A path's bitwise properties (parity.json "properties", lab/invariance.py) in a few characters: det:y bi:n
    (deterministic, batch-invariant: y holds, n does not, - not measured); "-" where none were measured."""
    props = path.get("properties") or {}
    mark = {True: "y", False: "n", None: "-"}
    return " ".join(f"{short}:{mark[(props.get(prop) or {}).get('holds')]}" for short, prop in
                    (("det", "deterministic"), ("bi", "batch_invariant"))) if props else "-"


def _band(band: tuple[float, float] | None) -> str:
    return f"{band[0]:.3f}-{band[1]:.3f}" if band else "-"


def path_frame(receipt: dict[str, Any]) -> pd.DataFrame:
    """One row per path (derived.path_fields): its verdict, the tensor and the rule that decided it, its first
    failing case and how many cases (rows) failed, forward and forward+backward median and p20-p80 band in ms,
    each one's speedup against the reference, and a note (flags, refusals, borrowed gradients). The bands are
    p20-p80 in ms; the speedups (x) are the reference's median / the path's."""
    parity = (receipt.get("parity") or {}).get("paths", {})
    rows = []
    for name, f in derived.path_fields(receipt).items():
        p = parity.get(name, {})
        decided = f["decided_by"] if f["verdict"] != "pass" or f.get("bound_ratio") is None else \
            f"{f['decided_by']} {f['bound_ratio']:.2f}"
        rows.append({
            "path": name, "verdict": f["verdict"], "decided_by": decided, "rule": f["rule"],
            "first_fail": f["first_case"], "bitwise": held(p),  # det(erministic), bi (batch-invariant): y/n/-
            "failed": "-" if not f["failed"] else f"{f['failed']}" + (f" ({f['rows']})" if f["rows"] else ""),
            "fwd_ms": _fmt(f["fwd_ms"], ".3f"), "fwd_band": _band(f["fwd_band"]),
            "fwd+bwd_ms": _fmt(f["fb_ms"], ".3f"), "fwd+bwd_band": _band(f["fb_band"]),
            "fwd_x": _shown(f["fwd_x"], f["fwd_measurable"]), "fwd+bwd_x": _shown(f["fb_x"], f["fb_measurable"]),
            "note": "; ".join(filter(None, [
                "bf16 emulated" if p.get("emulation") else "",
                backward_note(p.get("backward")),
                "noisy" if f["fwd_noisy"] or f["fb_noisy"] else "",
                "roofline >100%" if f["roofline_flag"] else "",
                "interpreted: not speed" if (f["refused"] or "").startswith("Triton ran through") else
                "" if p.get("cannot_run_here") or f["verdict"] == "fail" else (f["refused"] or ""),
            ])) or "-",
        })
    return pd.DataFrame(rows)


NOT_MEASURABLE = "n.c."  # a speedup whose p20-p80 bands overlap the other's: no measurable change, no number


def _shown(speedup: float | None, measurable: bool) -> str:
    """A speedup as the console prints it: its number where the two bands are apart, else NOT_MEASURABLE."""
    return "-" if speedup is None else f"{speedup:.2f}" if measurable else NOT_MEASURABLE


PATH_LEGEND = ("decided_by: a failing path's first failing tensor (or guard) and the rule it failed; a passing "
               "path's tensor nearest its bound, at that fraction of it.\n  failed: cases (rows failed/rows). "
               "band: p20-p80 ms. x: the reference's median / the path's ('n.c.': the bands overlap, no "
               "measurable change).")
PATH_NUMBERS = ("failed", "fwd_ms", "fwd_band", "fwd+bwd_ms", "fwd+bwd_band", "fwd_x", "fwd+bwd_x")


def path_lines(receipt: dict[str, Any]) -> list[str]:
    """Under the path table, one line per path that needs one: why a failing rule failed (its allowed value) and
    a hint where the math suggests one; why a path cannot run here; every flag, with its reason; then the
    end-to-end prediction's flag, when its measurement misses it beyond the stated band."""
    parity = (receipt.get("parity") or {}).get("paths", {})
    lines = []
    for name, f in derived.path_fields(receipt).items():
        if f["verdict"] == "fail" and f["why"]:
            lines.append(f"{name}: {f['why']}" + (f". hint: {f['hint']}" if f["hint"] else ""))
        elif parity.get(name, {}).get("error"):  # raised: located; cannot run here: why and what would
            lines.append(f"{name}: {raised_note(parity[name])}")
        lines += [f"{name}: {flag}" for flag in f["flags"]]
    e2e = derived.point_fields(receipt)["e2e_flag"]
    return lines + ([e2e] if e2e else [])


def point_table(receipt: dict[str, Any], width: int = TERMINAL_WIDTH) -> str:
    """The bench's console: a head line, one row per path (path_frame) within `width` columns (the note clipped
    and then given in full below), then path_lines, one line each."""
    machine = receipt["provenance"]["machine"]
    apart = (receipt.get("parity") or {}).get("cannot_run_here") or {}
    head = (f"point {receipt['point']}: {(receipt.get('microbench') or {}).get('problem', '')} "
            f"{receipt['config']['precision']['name']} on {machine['device_name']} ({machine['threads']} threads), "
            f"parity {(receipt.get('parity') or {}).get('verdict', 'missing')}"
            + (f" ({len(apart)} cannot run here, apart: {', '.join(apart)})" if apart else ""))
    frame = path_frame(receipt)
    if frame.empty:
        return head
    for column, most in (("path", 16), ("verdict", 15), ("decided_by", 20), ("first_fail", 24)):
        frame[column] = frame[column].map(lambda text, w=most: _clip(text, w))
    table = _aligned(frame, PATH_NUMBERS)
    excess = max(map(len, table.splitlines())) - width
    clipped = []
    if excess > 0:  # the notes give way; a clipped one is said in full under the table
        most = max(len("note"), int(frame["note"].map(len).max()) - excess)
        clipped = [f"{path}: {note}" for path, note in zip(frame["path"], frame["note"]) if len(note) > most]
        frame["note"] = frame["note"].map(lambda text: _clip(text, most))
        table = _aligned(frame, PATH_NUMBERS)
    lines = [head, table, PATH_LEGEND, *clipped]
    lines += path_lines(receipt)  # one line each, unwrapped: a file:line in it stays whole
    lines.append(step_line(receipt))
    quantization = (receipt.get("parity") or {}).get("quantization")
    if quantization:  # a quantized precision: the quantization's own error, apart from the paths'
        lines.append(f"quantization {quantization['recipe']}: SQNR {_fmt(quantization['sqnr_db'], '.1f')} dB, worst "
                     f"row {_fmt(quantization['row_min_sqnr_db'], '.1f')} dB (min {quantization['min_sqnr_db']:g} / "
                     f"{quantization['min_row_sqnr_db']:g} dB): {quantization['verdict']}")
    summary = ((receipt.get("microbench") or {}).get("describe") or {}).get("summary")
    if summary:  # the op's own line about the point (fp8 matmul: the bf16 GEMM beside it)
        lines.append(summary)
    return "\n".join(lines)


def step_line(receipt: dict[str, Any]) -> str:
    """The point's end-to-end answer in one line (derived.point_fields e2e_sentence, model/amdahl.py sentence): the
    op's share of the measured step, Amdahl's prediction, the measured effect with its band, why they agree or
    differ; or why the step was not measured."""
    return f"step: {derived.point_fields(receipt)['e2e_sentence']}"


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
    """train_head, then train_frame as text (the bench-train console; "-" where nothing applies)."""
    if not receipt.get("bench_train"):
        return f"point {receipt['point']}: no bench-train result"
    if receipt["bench_train"].get("not_trained"):  # an op with no model hook (op=problem): skipped, and why
        skipped = receipt["bench_train"].get("skipped") or {}
        return (f"point {receipt['point']}: bench-train trained nothing: {receipt['bench_train']['not_trained']} "
                f"(skipped: {', '.join(skipped) or 'none'})")
    variants = ((receipt["bench_train"].get("amdahl") or {}).get("variants") or {})
    steps = [f"step ({name}): {check['sentence']}" for name, check in variants.items() if check.get("sentence")]
    return "\n".join([train_head(receipt), train_frame(receipt).to_string(index=False),
                      *(steps or [step_line(receipt)])])


def train_frame(receipt: dict[str, Any]) -> pd.DataFrame:
    """One row per bench-train variant: speed where valid, the loss curve's ends (at its own last step), drift,
    Amdahl; then a row per path not trained (failed parity, forward-only, ...) with why. "-" where nothing applies."""
    train = receipt["bench_train"]
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
    return pd.DataFrame(rows)


def train_head(receipt: dict[str, Any]) -> str:
    """bench-train's one line about the point: model, precision, device, tokens per step, the drift limit, the
    op's share of the step and the baseline's own run-to-run band."""
    train = receipt["bench_train"]
    fraction = train.get("amdahl", {}).get("fraction")
    band = (train.get("noise") or {}).get("band")
    head = (f"point {receipt['point']}: bench-train {receipt['config']['architecture']['name']} "
            f"{train['precision']} on {train['device']}, {train['tokens_per_step']} tokens/step, "
            f"drift limit {train['drift_limit']:g}"
            + (f", {train['amdahl']['op']} is {fraction:.0%} of the baseline step" if fraction is not None else "")
            + (f", run-to-run band +-{(band - 1) * 100:.1f}% (the baseline against itself: a measured speedup "
               "inside it is no measurable change)" if band is not None else "")
            + (f"; the op in the model: {train['model_problem']}" if train.get("model_problem") else ""))
    return head


def _crossover(curve: dict[str, Any], mode: str, peer: str | None) -> Any:
    """The peer's crossover along the curve's own x_name in `mode` (None where that mode was not timed)."""
    found = [c for c in curve.get("crossovers") or [] if c["x_name"] == curve.get("x_name") and c["mode"] == mode]
    return found[0]["vs_reference"].get(peer) if found else None


def compiled(receipt: dict[str, Any], path: str = "triton") -> dict[str, Any]:
    """`path`'s kernels on the first compile target (kernel.json's `compile`, lab/compile.py): the most registers,
    the spill bytes, the most shared memory, the tensor-core instructions and whether every kernel launches. Under
    an autotuner every candidate counts in the registers, spills and shared memory (any may be the one it picks),
    while a tuned launch launches when one of its candidates fits (measure/sass.py `every_launch_fits`)."""
    section = (receipt.get("kernel") or {}).get("compile") or {}
    target = (section.get("targets") or [None])[0]
    rows = [r for r in section.get("rows", []) if r.get("path") == path and r.get("target") == target]
    counted = [r for r in rows if "registers" in r]
    if not rows:
        return {}
    fits = sass.every_launch_fits(rows)
    return {"target": target, "kernels": len(rows),
            "max_regs": max((r["registers"] for r in counted), default=None),
            "spill_B": sum(r["spill_bytes"] for r in counted) if counted else None,
            "smem_KB": max((r["shared_bytes"] for r in counted), default=0) / 1024 if counted else None,
            "tensor_cores": ",".join(sorted({r["tensor_cores"] for r in counted})) or "-",
            "fits": fits}


def point_failed(receipt: dict[str, Any]) -> bool:
    """A point failed when a path broke its numerical contract, its loss drift limit or its quality gate."""
    from posttrainllm.track.derived import verdict

    return verdict(receipt) != "pass"


def _failures_first(frame: pd.DataFrame) -> pd.DataFrame:
    """Failing points first: a failure is evidence, and the first thing a reader must see."""
    return frame.sort_values("verdict", key=lambda v: v != "FAIL", kind="stable").reset_index(drop=True)


def sweep_frame(receipts: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per point: what it changes, parity verdicts, valid timings of the best peer (rule "best_peer")
    against the reference and the baseline point, roofline class, crossover, our kernel against that peer, and
    bench-train (drift, Amdahl's predicted vs measured speedup); `flags`: the figures not to read as results."""
    rows = []
    for name, receipt in receipts.items():
        fields = derived.point_fields(receipt)
        parity = (receipt.get("parity") or {}).get("paths", {})
        micro = receipt.get("microbench") or {"paths": {}}
        bench = micro["paths"]
        train = receipt.get("bench_train") or {"impls": {}, "drift": {}}
        peer = fields["best_peer"]
        peer_entry = bench.get(peer, {})
        rows.append({
            "point": name,
            "verdict": "FAIL" if fields["verdict"] != "pass" else "pass",
            "first_failure": fields["first_failure"] or "-",
            "change": ",".join(f"{k}={v}" for k, v in (receipt["sweep"] or {}).get("changes", {}).items()) or "-",
            "parity": ",".join(f"{p}:{v['verdict']}" for p, v in parity.items()),
            "triton_err/allowed": (fields["paths"].get("triton") or {}).get("worst_ratio"),
            "ref_ms": bench.get("reference", {}).get("median_ms"),
            "peer": peer,
            "peer_ms": fields["paths"][peer]["fwd_ms"] if peer else None,
            "peer_speedup": fields["peer_x"],
            "peer_fb_speedup": fields["peer_fb_x"],
            "peer_vs_ref": peer_entry.get("vs_reference"),
            "peer_noisy": peer_entry.get("noisy"),
            "peer_bound": (peer_entry.get("roofline") or {}).get("classification"),
            "crossover": micro.get("curve", {}).get("crossover_vs_reference", {}).get(peer),
            "crossover_fb": _crossover(micro.get("curve", {}), "forward_backward", peer),
            "triton_vs_best": fields["ours_x"],
            "triton_fb_vs_best": fields["ours_fb_x"],
            "triton_of_peak": fields["ours_of_peak"],
            "train_ms": train["impls"].get(train.get("baseline"), {}).get("warm_ms_per_step"),
            "max_drift": max(train["drift"].values()) if train["drift"] else None,
            "user": user_cell(fields),
            "e2e_path": fields["e2e_path"],
            "op_share": fields["e2e_share"],
            "amdahl_pred": fields["e2e_pred"],
            "amdahl_meas": fields["e2e_meas"],
            "flags": flag_names(fields),
            **{f"triton_{key}": value for key, value in compiled(receipt).items()},
        })
    frame = _failures_first(pd.DataFrame(rows))
    baseline = frame[frame["point"] == "baseline"]
    if not baseline.empty and baseline["peer_ms"].notna().all():
        # the same op at the same problem, timed through the same peer: a peer's name alone (decode_attention has
        # an `sdpa` too) is no reason to divide one op's time by another's
        kept = {name: comparable(receipts[name], receipts["baseline"]) for name in receipts}
        same = (frame["peer"] == baseline["peer"].iloc[0]) & frame["point"].map(kept).astype(bool)
        frame["peer_vs_baseline"] = (baseline["peer_ms"].iloc[0] / frame["peer_ms"]).where(same)
    return frame


def comparable(receipt: dict[str, Any], baseline: dict[str, Any]) -> bool:
    """Whether a figure may divide `receipt`'s time by `baseline`'s: the same op at the same problem (shape)."""
    def key(r: dict[str, Any]) -> tuple[Any, Any]:
        return (((r.get("config") or {}).get("op") or {}).get("name"), (r.get("microbench") or {}).get("problem"))

    return key(receipt) == key(baseline) and None not in key(receipt)


SUMMARY_NUMBERS = ("peer_x", "peer_fb_x", "ours_x", "ours_fb_x", "share", "e2e_pred", "e2e_meas")  # summary's numbers
FORMATS = {"triton_err/allowed": ".3f", "ref_ms": ".3f", "peer_ms": ".3f", "peer_speedup": ".2f", "peer_fb_speedup": ".2f",
           "peer_vs_baseline": ".2f", "train_ms": ".1f", "max_drift": ".1e", "amdahl_pred": ".2f",
           "amdahl_meas": ".2f", "triton_vs_best": ".2f", "triton_fb_vs_best": ".2f", "triton_of_peak": ".2f",
           "triton_smem_KB": ".0f", "share": ".0%", "op_share": ".0%",
           **dict.fromkeys(SUMMARY_NUMBERS, ".2f")}


def formatted(frame: pd.DataFrame) -> pd.DataFrame:
    """sweep_frame or summary_frame as strings: numbers in FORMATS, '-' where there is none."""
    frame = frame.copy()
    for column, spec in FORMATS.items():
        if column in frame:
            frame[column] = frame[column].map(lambda v, s=spec: _fmt(None if pd.isna(v) else v, s))
    return frame.astype(object).fillna("-").astype(str)


def sweep_table(receipts: dict[str, dict[str, Any]]) -> str:
    """Every column of sweep_frame (`posttrainllm report --wide`): far wider than a terminal."""
    return formatted(sweep_frame(receipts)).to_string(index=False)


# text columns of the summary, clipped to these widths (first_failure narrower still if a number is unusually wide)
CLIPPED = {"point": 20, "first_failure": 32, "parity": 20, "best_peer": 11, "user": 16, "e2e_path": 8, "flags": 24}
SUMMARY_LEGEND = (
    "best_peer: the peer with the lowest valid forward median. peer_x, peer_fb_x: reference time / best_peer's "
    "(forward; forward+backward).",
    "  ours_x, ours_fb_x: best_peer's time / our Triton kernel's, >= 1 when ours is as fast ('-' where Triton is "
    "interpreted: never speed).",
    "  user: your paths (op.user_impls), each with its verdict and forward speedup over the reference. x 'n.c.': the "
    "two p20-p80 bands overlap.",
    "  share: the op's share of the measured training step. e2e_pred, e2e_meas: the step's speedup with e2e_path, "
    "predicted by Amdahl and measured ('n.c.': inside",
    "  the baseline's own run-to-run band, no measurable change). Speedups are ratios of medians. flags: figures "
    "not to read as results,",
    "  each with its reason below (a noisy band, a measurement missing its prediction, a roofline above 100%).",
)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _our_parity(receipt: dict[str, Any]) -> str:
    """Our Triton path's parity verdict, and every other path that failed: `triton:pass,sdpa_math:fail`."""
    paths = (receipt.get("parity") or {}).get("paths", {})
    ours = [f"triton:{paths['triton']['verdict']}"] if "triton" in paths else []
    return ",".join(ours + [f"{p}:{v['verdict']}" for p, v in paths.items()
                            if p != "triton" and v["verdict"] != "pass"]) or "-"


def summary_frame(receipts: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """The few columns to read first, one row per point (failing points first): its verdict and first failure,
    our path's parity, the best peer's speedup over the reference and ours over that peer (forward;
    forward+backward), the end-to-end training step's predicted and measured speedup, and which of these
    figures are flagged (derived.py: noisy, missed beyond its band, above the roof)."""
    rows = []
    for name, receipt in receipts.items():
        fields = derived.point_fields(receipt)
        rows.append({
            "point": name,
            "verdict": "FAIL" if fields["verdict"] != "pass" else "pass",
            "first_failure": fields["first_failure"] or "-",
            "parity": _our_parity(receipt),
            "best_peer": fields["best_peer"] or "-",
            **{key: fields[key] if fields[key] is None or apart else NOT_MEASURABLE
               for key, apart in zip(("peer_x", "peer_fb_x", "ours_x", "ours_fb_x"),
                                     (*fields["peer_measurable"], *fields["ours_measurable"]))},
            "user": user_cell(fields),
            "e2e_path": fields["e2e_path"] or "-",
            "share": fields["e2e_share"],
            "e2e_pred": fields["e2e_pred"],
            "e2e_meas": fields["e2e_meas"],
            "flags": flag_names(fields),
        })
    return _failures_first(pd.DataFrame(rows))


def user_cell(fields: dict[str, Any]) -> str:
    """The point's own user paths in a cell: `name:verdict` and its forward speedup against the reference
    (NOT_MEASURABLE inside the bands); '-' where the point has none."""
    return ",".join(f"{name}:{f['verdict']}" + (f" {_shown(f['fwd_x'], f['fwd_measurable'])}x"
                                                if f["fwd_x"] is not None and f["fwd_measurable"]
                                                else f" {NOT_MEASURABLE}" if f["fwd_x"] is not None else "")
                    for name, f in fields["user_paths"].items()) or "-"


def step_lines(receipts: dict[str, dict[str, Any]]) -> list[str]:
    """Every point's end-to-end sentence (step_line) as `step: point: ...`, in the summary's order."""
    return [f"step: {name}: {derived.point_fields(receipts[name])['e2e_sentence']}"
            for name in summary_frame(receipts)["point"]]


def flag_names(fields: dict[str, Any]) -> str:
    """derived.point_fields's flagged figures, named short for a table cell (the reasons: flag_lines)."""
    return ",".join(dict.fromkeys(flag["figure"] for flag in fields["flags"])) or "-"


def flag_lines(receipts: dict[str, dict[str, Any]]) -> list[str]:
    """Every flag of the points' figures as `point: figure: path: reason`, failing points first."""
    return [f"{name}: {flag['figure']}: {flag['path']}: {flag['reason']}"
            for name in summary_frame(receipts)["point"]
            for flag in derived.point_fields(receipts[name])["flags"]]


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
            return "\n".join([table, *SUMMARY_LEGEND, *(fill(line, width) for line in step_lines(receipts))])
        clipped["first_failure"] = max(len("first_failure"), clipped["first_failure"] - excess)


def sweep_markdown(receipts: dict[str, dict[str, Any]]) -> str:
    """The same table as GitHub markdown, with the legend a reader needs."""
    frame = formatted(sweep_frame(receipts))
    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(row) + " |" for row in frame.itertuples(index=False)]
    legend = [
        "", "Times are medians in ms on each point's own shape; `peer` is the best of PyTorch's own optimized "
        "paths (the same peer as `best_peer` in the default table).",
        "`triton_vs_best` (`triton_fb_vs_best`): `peer`'s forward (forward + backward) median / our kernel's, "
        ">= 1 when ours is as fast; "
        "`triton_of_peak`: our forward's FLOP/s / the calibrated GEMM peak. Empty where Triton is "
        "interpreted (never speed).",
        "`verdict`: FAIL when a path broke its contract or its loss-drift limit (failing points come first; "
        "`first_failure` names the path and case).",
        "`peer_speedup`: reference forward time / peer forward time; `peer_fb_speedup`: the same for forward + "
        "backward (what Amdahl uses); `peer_vs_ref`: faster/slower only when the p20-p80 bands do not overlap.",
        "Speedups are ratios of medians. `peer_vs_baseline`: the baseline point's peer time / this "
        "point's (the same op, problem and peer only; '-' elsewhere). `peer_bound`: roofline class against the "
        "calibrated peaks.",
        "`crossover`: the smallest size of the curve from which the peer stays measurably faster (bands apart) "
        "than the reference at every larger size; `crossover_fb`: the same for forward + backward (curves timed "
        "with bench.curve_backward). Other curve axes (MoE: experts) are in microbench.json's `crossovers`.",
        "`triton_err/allowed`: the worst of the Triton path's outputs and gradients, as a fraction of its "
        "contract's bound (tensor-wide or per row, the larger). Triton timings through the interpreter are never "
        "shown.",
        f"`peer`: {rules.text('best_peer')}. `flags`: the figures not to read as results (`posttrainllm report` "
        "prints each with its reason).",
        "`amdahl_pred`/`amdahl_meas`: `e2e_path`'s end-to-end step speedup predicted from the microbench and the "
        "op's share of the step (`op_share`), and the measured one.",
        "", "The step, per point (the op's share, Amdahl's prediction, the measured effect, and why):", "",
        *(f"- {line}" for line in step_lines(receipts)),
    ]
    timing = stage_times_text(receipts)
    return "\n".join(lines + legend + (["", f"Time: {timing}"] if timing else [])) + "\n"


def read_folders(folders: list[Path], root: Path | None = None
                 ) -> tuple[Path, dict[str, dict[str, Any]], dict[str, dict[str, Any]], list[str]]:
    """Every receipt under `folders` (receipt.receipt_files): (the page's folder, {the point's folder relative to
    it: receipt}, the same of the draft-heads receipts, unreadable receipts with why). The page's folder is
    `root`, else the receipts' folders' common parent, so its links to each point's files are relative."""
    import os

    from posttrainllm.files import read_json
    from posttrainllm.track.found import HEADS_SCHEMA, SCHEMA, receipt_files

    found = [path.resolve() for folder in folders for path in receipt_files(folder)]
    if not found:
        return root or folders[0], {}, {}, []
    root = root.resolve() if root else Path(os.path.commonpath([path.parent.parent for path in found]))
    receipts: dict[str, dict[str, Any]] = {}
    heads: dict[str, dict[str, Any]] = {}
    unreadable = []
    for path in dict.fromkeys(found):
        try:
            receipt = read_json(path)
        except (OSError, ValueError) as exc:  # a truncated or hand-edited receipt: named, not a traceback
            unreadable.append(f"{path} ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})")
            continue
        schema = receipt.get("schema") if isinstance(receipt, dict) else None
        if schema in (SCHEMA, HEADS_SCHEMA) and (schema == SCHEMA or "decode" in receipt):
            (receipts if schema == SCHEMA else heads)[path.parent.relative_to(root).as_posix()] = receipt
    return root, receipts, heads, unreadable


HEADS_LEGEND = ("draft heads: speedup = decode tokens/s over plain greedy's, measured; predicted from the mean "
                "accepted length and a verification step's cost")


def heads_frame(heads: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """The draft heads (`posttrainllm experimental train-heads`), one row per receipt and decode variant: lossless
    or not, the mean accepted length and each head's acceptance rate, decode tokens/s, and the speedup over plain
    greedy measured and predicted (from the accepted length and the verification's cost)."""
    rows = []
    for name, receipt in heads.items():
        decode = receipt.get("decode") or {}
        speedup = decode.get("speedup") or {}
        for variant, entry in (decode.get("variants") or {}).items():
            rates = entry.get("acceptance_rate_per_head") or []
            rows.append({
                "heads": name, "verdict": receipt.get("verdict", "-"), "variant": variant,
                "accepted": _fmt(entry.get("mean_accepted_length"), ".2f"),
                "acceptance per head": ",".join(f"{r:.2f}" for r in rates) or "-",
                "decode tokens/s": _fmt(entry.get("decode_tokens_per_s"), ".0f"),
                "speedup": _fmt((speedup.get(variant) or {}).get("measured"), ".2f"),
                "predicted": _fmt((speedup.get(variant) or {}).get("predicted"), ".2f"),
            })
    return pd.DataFrame(rows, columns=["heads", "verdict", "variant", "accepted", "acceptance per head",
                                       "decode tokens/s", "speedup", "predicted"])


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
