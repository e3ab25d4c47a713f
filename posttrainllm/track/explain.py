"""`posttrainllm explain POINT`: the user's three mastery questions for one point, answered from its receipt alone.

    1. the numerical contract: the rule, the tolerances and where they come from, and per output how near each
       path came to its bound (parity);
    2. the memory traffic per path: each path's own cost model (bytes forward and forward + backward with their
       formulas, working set against the last-level cache), where it sits on the roofline and with which peak, and
       the regime its measured curve shows per segment (microbench);
    3. the end-to-end effect: the op's share of the measured training step, Amdahl's prediction, the measured
       step speedup with its band, and why they agree or differ (bench-train; track/derived.py).

Nothing is run or recomputed: a figure the receipt does not hold is said to be missing. The receipt names its
rules by id; their text is the package's table (posttrainllm/rules.py), so a receipt copied anywhere reads.
"""

from __future__ import annotations

from typing import Any

from posttrainllm import rules
from posttrainllm.measure import curves
from posttrainllm.track import derived


def _si(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    for factor, prefix in ((2**30, "Gi"), (2**20, "Mi"), (2**10, "Ki")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def contract(receipt: dict[str, Any]) -> list[str]:
    """The contract: the rule, the tolerances (the precision's, from its config) and per output, per path, the worst
    case's error against its allowance."""
    parity = receipt.get("parity") or {}
    if not parity:
        return ["no parity result in this receipt: the contract was not checked"]
    precision = parity.get("precision") or ((receipt.get("config") or {}).get("precision") or {}).get("name")
    tolerances = ", ".join(f"{k}={v}" for k, v in (parity.get("contract") or {}).items() if v is not None)
    lines = [f"verdict: {parity.get('verdict')}" + (f" (first failure: {parity['first_failure']})"
                                                     if parity.get("first_failure") else ""),
             f"rule: {rules.text(parity.get('rule'))}",
             f"tolerances: {tolerances} (precision.contract of precision={precision}, conf/precision/{precision}.yaml: "
             "error_multiple is a multiple of the readable reference math's own error in this precision against "
             "the float64 oracle, so a path is held to what the same math in the same dtype achieves)"]
    if parity.get("lse_contract"):
        lines.append("the logsumexp output has its own fp32 contract: " + ", ".join(
            f"{k}={v}" for k, v in parity["lse_contract"].items() if v is not None))
    outputs: dict[str, list[str]] = {}
    for name, path in (parity.get("paths") or {}).items():
        for output, worst in (path.get("worst") or {}).items():
            if worst.get("max_abs_err") is None:
                continue
            outputs.setdefault(output, []).append(
                f"{name} {_g(worst['max_abs_err'])} of {_g(worst.get('allowed_abs_err'))} allowed "
                f"({_g(worst.get('bound_ratio'))} of its bound, {worst.get('case', '-')})")
    lines += [f"{output}: " + "; ".join(said) for output, said in outputs.items()]
    lines += [f"note: {note}" for note in parity.get("notes") or []]
    return lines


def traffic(receipt: dict[str, Any]) -> list[str]:
    """Per timed path: its cost model and figures, its place on the roofline and the peak used, its regimes."""
    micro = receipt.get("microbench") or {}
    if not micro.get("paths"):
        return ["no microbench result in this receipt: no path was timed"]
    cache = micro.get("last_level_cache_bytes")
    lines = [f"floor (inputs read once, outputs written once): {micro.get('bytes')} B = {micro.get('bytes_formula')}; "
             f"FLOPs {micro.get('flops')} = {micro.get('flops_formula')}; last-level cache {_si(cache, 'B')}"]
    if micro.get("cost_model_rule"):
        lines.append(f"cost models: {rules.text(micro['cost_model_rule'])}")
    forward: dict[str, int] = {}
    for name, entry in micro["paths"].items():
        costs = entry.get("costs")
        if not costs:
            lines.append(f"{name}: no speed here ({entry.get('reason', 'not timed')}): no traffic figure")
            continue
        forward[name] = costs["bytes"]
        roof = entry.get("roofline") or {}
        peak = roof.get("peak_used") or {}
        where = (f"{_g(roof.get('intensity_flops_per_byte'))} FLOP/B against a ridge of "
                 f"{_g(roof.get('ridge_flops_per_byte'))}: {roof.get('classification', '-')}, "
                 f"{_g(roof.get('fraction_of_attainable'))} of attainable (peak: {peak.get('source', '-')}"
                 + (f", {peak['why']}" if peak.get("source") == "remeasured" else "") + ")") if roof else \
            "no roofline (no calibrated peak for this precision)"
        resident = ("fits" if cache and costs["working_set_bytes"] <= cache else "exceeds") if cache else "vs unknown"
        lines.append(
            f"{name} ({costs['model']} model): forward {_si(costs['bytes'], 'B')} = {costs['bytes_formula']}; "
            f"forward+backward {_si(costs.get('train_bytes'), 'B')}"
            + (f" = {costs['train_bytes_formula']}" if costs.get("train_bytes_formula") else "")
            + f"; working set {_si(costs['working_set_bytes'], 'B')} ({resident} the last-level cache); {where}"
            + (f"; {costs['note']}" if costs.get("note") else ""))
    ref = forward.get("reference")
    others = {n: b for n, b in forward.items() if n != "reference" and b}
    if ref and others:
        least = min(others, key=others.get)
        lines.append(f"the reference moves {ref / others[least]:.1f}x the forward bytes of {least}, the path that "
                     "moves the least")
    for entry in (micro.get("curve") or {}).get("regimes") or []:
        lines.append("regime: " + curves.regime_text(entry))
    if (micro.get("curve") or {}).get("regime_rule"):
        lines.append(f"regime rule: {rules.text(micro['curve']['regime_rule'])}")
    return lines


def end_to_end(receipt: dict[str, Any]) -> list[str]:
    fields = derived.point_fields(receipt)
    lines = [fields["e2e_sentence"]]
    variants = (((receipt.get("bench_train") or {}).get("amdahl") or {}).get("variants") or {})
    lines += [f"{name}: {check['sentence']}" for name, check in variants.items()  # each trained path, once
              if check.get("sentence") and name != fields["e2e_path"] and check["sentence"] not in lines[0]]
    noise = (receipt.get("bench_train") or {}).get("noise") or {}
    if noise.get("rule"):
        lines.append(f"band rule: {rules.text(noise['rule'])}")
    return lines


def explain(receipt: dict[str, Any]) -> str:
    """The three answers, one section each, every figure from the receipt."""
    micro = receipt.get("microbench") or {}
    config = receipt.get("config") or {}
    head = (f"explain {receipt.get('point')}: {(config.get('op') or {}).get('name')} {micro.get('problem', '')} "
            f"{(config.get('precision') or {}).get('name', '')} on "
            f"{((receipt.get('provenance') or {}).get('machine') or {}).get('device_name', '-')}")
    sections = [("1. The numerical contract", contract(receipt)),
                ("2. Memory traffic per path", traffic(receipt)),
                ("3. Why a microbenchmark may not move training: the end-to-end effect", end_to_end(receipt))]
    out = [head]
    for title, lines in sections:
        out += ["", title, *(f"  {line}" for line in lines)]
    return "\n".join(out)
