"""The figures a person reads, derived once from a receipt: every view reads them here.

The terminal tables (`posttrainllm bench`, `report`, `report --wide`), runs/report.html and the MLflow run
all show a point through `point_fields` and `path_fields`, so a best peer, a verdict's deciding tensor or a
flag is one thing everywhere:

- the best peer, by rule "best_peer" (posttrainllm/rules.py);
- each path's verdict with the tensor and the rule that decided it, its first failing case, how many cases
  (and rows) failed, the failing rule's own line (with its allowed value) and a hint where the math has one;
- forward and forward+backward time with their p20-p80 bands, and the speedups against the reference;
- flags, each with its reason, wherever a figure must not be read as a result: a noisy band (rule "noisy"), a
  roofline fraction above 100% of attainable (the calibration or the timing is wrong), an end-to-end
  prediction its measurement misses beyond the stated band (model/amdahl.py), a speed the bench refused.
"""

from __future__ import annotations

import re
from typing import Any

from posttrainllm import rules
from posttrainllm.measure import timing
from posttrainllm.model import amdahl

ABOVE_ROOF = "not a result (above 100%, the calibration or the timing is wrong)"
# how a failed case's reason (lab/parity.py check_output, lab/stages.py) names the rule that failed it
RULES = (("non-finite", "non-finite"), ("mismatch_frac", "elementwise count"), ("row ", "row worst error"),
         ("max_abs_err", "worst error"), ("sqnr", "SQNR"), ("shape", "shape"),
         ("missing output", "missing output"), ("no result", "did not run"), ("did not run", "did not run"))
# a weight (or routing-weight) gradient: the input is shared by every row, its gradient a sum over the rows
WEIGHT_GRADIENT = re.compile(r"^grad_(w|weight|b|bias|route_weight)(_|$)")
WEIGHT_HINT = ("a weight gradient is a sum over rows: accumulate it in fp32 and round once, at the end (the "
               "reference math does; op.max_error_only exempts a sum from the count only where the reference "
               "itself misses it, conf/op/moe.yaml)")
BEYOND_ROUNDING = 8.0  # times the contract's error_multiple: past it no accumulation order explains a tensor
NONFINITE_HINT = "an overflow or a division by zero: compute in fp32 and cast at the end"


def _timing(entry: dict[str, Any] | None) -> dict[str, Any] | None:
    return entry if entry and entry.get("median_ms") else None


def _noisy_reason(timed: dict[str, Any] | None, what: str) -> str | None:
    """Why a timing's band is too wide to compare (rule "noisy"), or None when it is not noisy."""
    if not timed or not timed.get("noisy"):
        return None
    median, p20, p80, reps = timed["median_ms"], timed.get("p20_ms"), timed.get("p80_ms"), timed.get("reps")
    if p20 is None or p80 is None or reps is not None and reps < timing.NOISY_MIN_SAMPLES:
        return f"{what} noisy: {reps} reps (under {timing.NOISY_MIN_SAMPLES})"
    return (f"{what} noisy: p20-p80 {p20:.3g}-{p80:.3g} ms spreads {(p80 - p20) / median:.0%} of its median "
            f"{median:.3g} ms (over {timing.NOISY_SPREAD:.0%})")


def best_peer(receipt: dict[str, Any]) -> str | None:
    """Rule "best_peer": the peer with the lowest valid forward median, or None."""
    micro = (receipt.get("microbench") or {}).get("paths") or {}
    kinds = (receipt.get("kernel") or {}).get("paths") or {}
    timed = {name: micro[name]["median_ms"] for name, entry in kinds.items()
             if entry.get("kind") == "peer" and (micro.get(name) or {}).get("valid") and _timing(micro.get(name))}
    return min(timed, key=timed.get) if timed else None


def _failure(text: str) -> tuple[str, str, str]:
    """A failed case's line, "case/output: reason", as (case, output, reason); "-" where it names none."""
    head, _, reason = text.partition(": ")
    if not reason:
        return "-", "-", text
    if head == "did not run":
        return "-", "-", text
    case, slash, output = head.rpartition("/")
    return (case, output, reason) if slash else (head, "-", reason)


def _rule(reason: str) -> str:
    return next((rule for marker, rule in RULES if reason.startswith(marker)), "failed")


def _hint(output: str, rule: str, worst: dict[str, Any], multiple: float | None) -> str | None:
    """What the math suggests for a failing rule: a tensor whose error is far past what rounding gives
    (BEYOND_ROUNDING times the contract's own multiple of the reference math's error) is a wrong result; a weight
    gradient nearer its bound is a sum's rounding."""
    if rule == "non-finite":
        return NONFINITE_HINT
    if rule not in ("elementwise count", "worst error", "row worst error"):
        return None
    ratio = worst.get("error_ratio")
    if ratio is not None and multiple and ratio > BEYOND_ROUNDING * multiple:
        return (f"{ratio:.3g}x the reference math's error in the same precision is beyond any rounding (limit "
                f"{multiple:g}x): a wrong result (which rows or columns does it cover?), not a precision")
    return WEIGHT_HINT if WEIGHT_GRADIENT.match(output) else None


def _nearest(worst: dict[str, Any]) -> dict[str, Any]:
    """The tensor nearest its bound (or furthest past it): bound_ratio, the larger of the tensor-wide and the
    per-row rule's error / allowance (lab/parity.py), its output and case."""
    ratios = {k: w["bound_ratio"] for k, w in worst.items() if w.get("bound_ratio") is not None}
    if not ratios:
        return {"worst_tensor": None, "worst_ratio": None, "worst_case": None}
    output = max(ratios, key=ratios.get)
    return {"worst_tensor": output, "worst_ratio": ratios[output], "worst_case": worst[output].get("case")}


def _decision(entry: dict[str, Any], contract: dict[str, Any]) -> dict[str, Any]:
    """What decided a path's verdict: the first failure (a guard's, or a tensor's rule) for a failing path, the
    tensor nearest its bound for a passing one (_nearest, given for both)."""
    return {**_nearest(entry.get("worst") or {}), **_decided(entry, contract)}


def _decided(entry: dict[str, Any], contract: dict[str, Any]) -> dict[str, Any]:
    verdict = entry.get("verdict", "-")
    worst = entry.get("worst") or {}
    failed = entry.get("failed_cases") or []
    violations = entry.get("violations") or []
    if verdict == "fail" and failed:
        first = failed[0]
        case, output, reason = _failure(first)
        guard = first in violations
        rule = "guard" if guard else _rule(reason)
        clause = reason.split("; ")[0]
        rows = re.search(r"(\d+) of (\d+) rows fail", reason)
        line = (first if rule == "did not run" else
                f"{output if output != '-' else 'the path'} failed the {rule} rule on {case}: {clause}")
        where = (entry.get("error") or {}).get("where")
        if where:
            line += f" (raised at {where['file']}:{where['line']})"
        w = worst.get(output) or {}
        if rule == "elementwise count" and w.get("error_ratio") is not None and contract.get("error_multiple"):
            line += (f" (its worst error is {w['error_ratio']:.1f}x the reference math's in the same precision, "
                     f"limit {contract['error_multiple']:g}x)")
        return {"decided_by": "guard" if guard else output, "rule": rule, "first_case": case,
                "failed": len(failed), "rows": f"{rows.group(1)}/{rows.group(2)}" if rows else None,
                "why": line, "hint": _hint(output, rule, w, contract.get("error_multiple"))}
    if verdict == "pass" and worst:
        nearest = _nearest(worst)
        return {"decided_by": nearest["worst_tensor"] or "-", "rule": "within bound", "first_case": "-",
                "failed": 0, "rows": None, "why": "", "hint": None, "bound_ratio": nearest["worst_ratio"]}
    return {"decided_by": "-", "rule": "-", "first_case": "-", "failed": len(failed), "rows": None, "why": "",
            "hint": None}


def _above_roof(roof: dict[str, Any], timed: dict[str, Any] | None) -> str:
    """A roofline fraction above 1, never a result, and which of the two is wrong: the timing when the path at
    its p80 time (the slow end of its band) would be within the roof, else the calibration (its peak)."""
    fraction = roof["fraction_of_attainable"]
    said = roof.get("above_roof")  # the microbench's own reading, where it gives one
    at_p80 = fraction * timed["median_ms"] / timed["p80_ms"] if timed and timed.get("p80_ms") else None
    which = (said if isinstance(said, str) and said
             else f"the timing: at its band's slow end (p80) it would be {at_p80:.0%}" if at_p80 and at_p80 <= 1
             else f"the calibration: even at its band's slow end (p80) it computes {at_p80:.0%} of the "
                  f"calibrated {roof.get('attainable_flops_per_s', 0) / 1e9:.3g} GFLOP/s" if at_p80 else "")
    return f"roofline {fraction:.0%} of attainable, {ABOVE_ROOF}" + (f": here {which}" if which else "")


NOT_MEASURABLE = "no measurable difference"  # lab/stages.py compare: the p20-p80 bands overlap (rule "band")


def measurable(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool:
    """Whether two timings differ measurably: their p20-p80 bands do not overlap; True where a band is missing
    (nothing to say it does not)."""
    return not (a and b) or a[1] < b[0] or a[0] > b[1]


def _speed(entry: dict[str, Any]) -> dict[str, Any]:
    """A path's forward and forward+backward time and speedup, where valid; its refusal where not."""
    out: dict[str, Any] = {"valid": bool(entry.get("valid")), "refused": None if entry.get("valid") or not entry
                           else entry.get("reason") or "no valid timing"}
    for mode, timed in (("fwd", entry), ("fb", entry.get("forward_backward"))):
        timed = _timing(timed) if entry.get("valid") else None
        out[f"{mode}_ms"] = timed and timed["median_ms"]
        out[f"{mode}_band"] = (timed["p20_ms"], timed["p80_ms"]) if timed and "p20_ms" in timed else None
        out[f"{mode}_x"] = timed and timed.get("speedup_vs_reference")
        out[f"{mode}_measurable"] = not timed or timed.get("vs_reference") != NOT_MEASURABLE
        out[f"{mode}_noisy"] = _noisy_reason(timed, "forward" if mode == "fwd" else "forward+backward")
    roof = (entry.get("roofline") or {}) if entry.get("valid") else {}
    fraction = roof.get("fraction_of_attainable")
    out["roofline_fraction"] = fraction
    out["roofline_flag"] = (_above_roof(roof, _timing(entry)) if fraction is not None and fraction > 1
                            else None)
    out["roofline_class"] = roof.get("classification")
    out["peak_bytes"] = (entry.get("memory") or {}).get("peak_bytes") if entry.get("valid") else None
    return out


def path_fields(receipt: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per path (the microbench's, then parity's): verdict, what decided it, times, speedups, flags."""
    parity = receipt.get("parity") or {}
    contract = parity.get("contract") or {}
    checked = parity.get("paths") or {}
    micro = (receipt.get("microbench") or {}).get("paths") or {}
    kinds = (receipt.get("kernel") or {}).get("paths") or {}
    out = {}
    for name in dict.fromkeys([*micro, *checked]):
        p, b = checked.get(name) or {}, micro.get(name) or {}
        verdict = p.get("verdict") or ("baseline" if name == "reference" else "-")
        fields = {"path": name, "kind": (kinds.get(name) or {}).get("kind", "reference" if name == "reference"
                                                                       else "-"),
                  "verdict": verdict, **_decision(p, contract), **_speed(b)}
        if p.get("cannot_run_here"):
            gap = p["cannot_run_here"]
            fields["why"] = f"cannot run here: {gap.get('reason')}, runs on {gap.get('runs_on')}"
        fields["flags"] = [text for text in (fields["fwd_noisy"], fields["fb_noisy"], fields["roofline_flag"])
                           if text]
        out[name] = fields
    return out


def _e2e(receipt: dict[str, Any], peer: str | None) -> dict[str, Any]:
    """Amdahl's check of a path the point's row names: our Triton path where valid, else the best peer. The path,
    predicted and measured end-to-end speedup, whether the measurement is inside the baseline's own band
    ("n.c."), and the flag when the measurement misses the prediction beyond the stated band. Another trained
    path (bench-train trains `sdpa`, the best peer may be `sdpa_math`) gives the row no figure: its sentence is
    quoted under its own name, and its figures are in its own rows (the train table)."""
    train = receipt.get("bench_train") or {}
    checked = train.get("amdahl") or {}
    variants = checked.get("variants") or {}
    band = (train.get("noise") or {}).get("band")
    name = next((n for n in ("triton", peer) if n and (variants.get(n) or {}).get("valid")), None)
    share = checked.get("fraction")
    if name is None:
        other = next((n for n, v in variants.items() if v.get("valid")), None)
        said = (variants[other].get("sentence") if other else None)
        sentence = (_no_step(receipt, checked) if other is None else
                    f"the best peer {peer} was not trained by bench-train, so this row has no step figure; "
                    + (f"{other}, trained instead: {said}" if said else
                       f"{other} was trained instead (its figures: its own row of the bench-train table)"))
        return {"e2e_path": None, "e2e_pred": None, "e2e_meas": None, "e2e_flag": None, "e2e_share": share,
                "e2e_sentence": sentence}
    check = variants[name]
    pred, meas = check.get("predicted_speedup"), check.get("measured_speedup")
    flag = None
    if pred and meas is not None and amdahl.disagrees(pred, meas, band):
        flag = (f"end-to-end {name}: measured {meas:.2f}x misses the predicted {pred:.2f}x by more than "
                f"{amdahl.DISAGREEMENT:.0%}" + (f" and the baseline's +-{(band - 1) * 100:.1f}% band" if band else "")
                + (f" ({check['reading']})" if check.get("reading") else ""))
    sentence = check.get("sentence") or (  # a receipt from before bench-train wrote its sentence: made from it
        amdahl.sentence(op=checked.get("op", "the op"), fraction=share, speedup=check["microbench_speedup"],
                        forward_speedup=check.get("forward_speedup"), predicted=pred, measured=meas, band=band)
        if share is not None and pred and meas is not None else None)
    return {"e2e_path": name, "e2e_pred": pred,
            "e2e_meas": "n.c." if meas is not None and amdahl.within_band(meas, band) else meas, "e2e_flag": flag,
            "e2e_share": share, "e2e_sentence": f"{name}: {sentence}" if sentence else None}


def _no_step(receipt: dict[str, Any], checked: dict[str, Any]) -> str:
    """Why a point has no end-to-end figure: no bench-train ran, or no trained path had a valid speed."""
    train = receipt.get("bench_train")
    if not train:
        return ("the training step was not measured for this point: no bench-train ran (`posttrainllm bench-train` "
                "with the same overrides, or the sweep's bench_train stage)")
    fraction = checked.get("fraction")
    share = (f"{checked.get('op', 'the op')} is {fraction:.0%} of the measured training step; " if fraction is not None
             else "the op's share of the step was not profiled; ")
    why = sorted({v.get("reason", "") for v in (checked.get("variants") or {}).values() if not v.get("valid")})
    return share + "no trained path has a valid speed here, so Amdahl predicts nothing" + (
        f" ({'; '.join(w for w in why if w)})" if any(why) else "")


def quality_failures(receipt: dict[str, Any]) -> dict[str, str]:
    """{path: why} for the paths that failed bench-train's quality gate (a quantized precision's, model/quality.py)."""
    found = ((receipt.get("bench_train") or {}).get("quality") or {}).get("variants") or {}
    return {name: "; ".join(entry["failed"]) for name, entry in found.items() if entry["verdict"] != "pass"}


def verdict(receipt: dict[str, Any]) -> str:
    """'pass' when parity passed, every training-loss drift is within its limit, every path passed the quality
    gate (a quantized precision's) and the receipt found no integrity problem (rule "integrity"), else 'fail'."""
    parity = (receipt.get("parity") or {}).get("verdict", "missing")
    drift = (receipt.get("bench_train") or {}).get("drift_verdict") or {}
    return ("pass" if parity == "pass" and all(v == "pass" for v in drift.values()) and not quality_failures(receipt)
            and not (receipt.get("integrity") or {}).get("problems") else "fail")


def point_fields(receipt: dict[str, Any]) -> dict[str, Any]:
    """A point's headline: its verdict, the best peer (rule "best_peer") and speedups, ours against it, the
    end-to-end check, and every flag with its path and reason."""
    paths = path_fields(receipt)
    peer = best_peer(receipt)
    best, ours = paths.get(peer) or {}, paths.get("triton") or {}

    def ours_vs(mode: str) -> float | None:
        return best[f"{mode}_ms"] / ours[f"{mode}_ms"] if best.get(f"{mode}_ms") and ours.get(f"{mode}_ms") else None

    peaks = (receipt.get("microbench") or {}).get("peaks") or {}
    gflops = (((receipt.get("microbench") or {}).get("paths") or {}).get("triton") or {}).get("gflops_per_s")
    e2e = _e2e(receipt, peer)
    flags = []  # the headline's figures that are not results, each with its path and reason; then the roofline's
    for figure, mode, names in (("peer_x", "fwd", ("reference", peer)), ("peer_fb_x", "fb", ("reference", peer)),
                                ("ours_x", "fwd", (peer, "triton")), ("ours_fb_x", "fb", (peer, "triton"))):
        shown = point_figure(paths, mode, names)
        flags += [{"figure": figure, "path": name, "reason": paths[name][f"{mode}_noisy"]}
                  for name in names if shown and paths[name][f"{mode}_noisy"]]
    if e2e["e2e_flag"]:
        flags.append({"figure": "e2e_meas", "path": e2e["e2e_path"], "reason": e2e["e2e_flag"]})
    flags += [{"figure": "roofline", "path": name, "reason": fields["roofline_flag"]}
              for name, fields in paths.items() if fields["roofline_flag"]]
    users = (receipt.get("user_impls") or {})
    return {
        "user_paths": {name: paths[name] for name in users if name in paths},
        "peer_measurable": (best.get("fwd_measurable", True), best.get("fb_measurable", True)),
        "ours_measurable": (measurable(best.get("fwd_band"), ours.get("fwd_band")),
                            measurable(best.get("fb_band"), ours.get("fb_band"))),
        "point": receipt.get("point"), "verdict": verdict(receipt),
        "first_failure": (receipt.get("parity") or {}).get("first_failure"),
        "best_peer": peer,
        "peer_x": best.get("fwd_x"), "peer_fb_x": best.get("fb_x"),
        "ours_x": ours_vs("fwd"), "ours_fb_x": ours_vs("fb"),
        "ours_of_peak": gflops * 1e9 / peaks["gemm_flops_per_s"]
        if ours.get("fwd_ms") and gflops and peaks.get("gemm_flops_per_s") else None,
        **e2e, "flags": flags, "paths": paths,
    }


def point_figure(paths: dict[str, dict[str, Any]], mode: str, names: tuple[str | None, ...]) -> bool:
    """Whether a ratio of these paths' `mode` times is shown at all (both timed validly)."""
    return all(name in paths and paths[name][f"{mode}_ms"] for name in names)


def cited_rules(receipt: dict[str, Any]) -> list[tuple[str, str]]:
    """(id, text) of every rule a receipt's stages cite by id (posttrainllm/rules.py), in the order they are stored:
    a point's kernel compile report, parity, microbench (a user path's timing from outside its worker included),
    bench-train and integrity (a path's launch geometry is the op's own words, not a rule's id); a draft-heads
    receipt's base, heads and decode."""
    stored = [(receipt.get("kernel") or {}).get("compile"), receipt.get("parity"), receipt.get("microbench"),
              receipt.get("bench_train"), receipt.get("integrity"),
              receipt.get("base"), receipt.get("heads"), receipt.get("decode")]
    return [(rules.rule_id(cited), rules.text(cited)) for cited in rules.cited_in(stored)]
