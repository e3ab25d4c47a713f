"""Amdahl's check: does a kernel's microbenchmark speedup survive a real training step?

If an op takes the fraction f of a step and a kernel makes that op s times faster,
the step can at best become

    predicted = 1 / ((1 - f) + f / s)

times faster. bench-train measures the real end-to-end speedup; when the two disagree
by more than DISAGREEMENT, `reading` names the likely reasons from the numbers at hand.

A measured speedup is only a change when it lies outside the run-to-run band of the
baseline's own step time (`noise_band`: the baseline against itself, its warm steps' two
halves and a second repetition of it after every other variant); inside it, bench-train
and the report say "no measurable change" and print no speedup (`measured_text`).
"""

from __future__ import annotations

import statistics
from typing import Any

NO_CHANGE = "no measurable change"

DISAGREEMENT = 0.15  # |measured / predicted - 1| above this needs a reading
OVERHEAD_US_PER_CALL = 50.0  # per-call op time below which launch/dispatch overhead dominates


def noise_band(step_ms: list[float], repeat_step_ms: list[float] | None, warmup_steps: int) -> dict[str, Any]:
    """How far the baseline's warm ms/step moves against itself: the ratio of its warm steps' second half to their
    first half, and of a second repetition's warm median to the first's (after every other variant was trained).
    band = the widest of them either way (>= 1): a measured speedup s is a change only when s > band or
    s < 1 / band."""
    warm = step_ms[warmup_steps:] or step_ms
    out: dict[str, Any] = {"ratios": {}}
    if len(warm) >= 2:
        half = len(warm) // 2
        out["halves_ms_per_step"] = [statistics.median(warm[:half]), statistics.median(warm[half:])]
        out["ratios"]["halves"] = out["halves_ms_per_step"][1] / out["halves_ms_per_step"][0]
    if repeat_step_ms:
        again = repeat_step_ms[warmup_steps:] or repeat_step_ms
        out["repeat_step_ms"] = list(repeat_step_ms)
        out["repeat_ms_per_step"] = statistics.median(again)
        out["ratios"]["repeat"] = out["repeat_ms_per_step"] / statistics.median(warm)
    out["band"] = max((max(r, 1 / r) for r in out["ratios"].values()), default=None)
    out["rule"] = ("a measured end-to-end speedup s is a change only when s > band or s < 1/band; band: the widest "
                   "ratio of the baseline's warm ms/step to itself (halves of its warm steps; a second repetition "
                   "after every other variant)")
    return out


def within_band(measured: float, band: float | None) -> bool:
    return band is not None and 1 / band <= measured <= band


def measured_text(measured: float | None, band: float | None) -> str | None:
    """A measured speedup as bench-train and the report print it: never a number inside the band."""
    if measured is None:
        return None
    if within_band(measured, band):
        return f"{NO_CHANGE} (band +-{(band - 1) * 100:.1f}%)"
    return f"{measured:.2f}x"


def disagrees(predicted: float, measured: float, band: float | None) -> bool:
    """The measured end-to-end speedup misses the predicted one beyond the stated band: more than DISAGREEMENT
    apart, and not both inside the baseline's own run-to-run band."""
    return abs(measured / predicted - 1.0) > DISAGREEMENT and not (within_band(measured, band)
                                                                   and within_band(predicted, band))


def predicted_speedup(fraction: float, speedup: float) -> float:
    return 1.0 / ((1.0 - fraction) + fraction / speedup)


def reading(*, fraction: float, speedup: float, predicted: float, measured: float, op_profile: dict[str, Any],
            microbench_problem: str, model_problem: str, band: float | None = None) -> str:
    """One line on why predicted and measured disagree (empty when they agree, or when both lie inside the band)."""
    if not disagrees(predicted, measured, band):
        return ""
    reasons = []
    if microbench_problem != model_problem:
        reasons.append(f"the model's shape ({model_problem}) differs from the microbench's ({microbench_problem})")
    op_us = op_profile["forward_us"] + op_profile["backward_us"]
    calls = max(op_profile["calls"], 1)
    if op_us / calls < OVERHEAD_US_PER_CALL:
        reasons.append(f"{op_us / calls:.0f} us per call: launch/dispatch overhead, not the kernel, sets the time")
    if fraction < 0.2:
        reasons.append(f"the op is only {fraction:.0%} of the step, so no speedup of it can give more than "
                       f"{1 / (1 - fraction):.2f}x")
    direction = "below" if measured < predicted else "above"
    said = (f"measured: {NO_CHANGE} (inside the baseline's +-{(band - 1) * 100:.1f}% run-to-run band), "
            if within_band(measured, band) else f"measured {measured:.2f}x is ")
    return (f"{said}{direction} the predicted {predicted:.2f}x: "
            + ("; ".join(reasons) if reasons else "no reason found in the profile; rerun to rule out noise"))


def check(train: dict[str, Any], microbench: dict[str, Any], *, profiled_range: str,
          model_problem: str) -> dict[str, Any]:
    """Predicted vs measured end-to-end speedup for every trained variant but the baseline.

    f comes from the baseline variant's profiled step (the op's `profiled_range`, forward
    ranges plus the backward nodes they created); s is the microbench's forward+backward
    speedup of the variant's implementation over the baseline's (a training step runs both).
    Variants are named after the implementations they swap in.
    """
    baseline = train["baseline"]
    base_run = train["impls"][baseline]
    micro = microbench["paths"]

    def train_speedup(impl: str) -> float | None:
        entry = micro.get(impl, {})
        if not entry.get("valid"):
            return None
        return 1.0 if impl == baseline else entry.get("forward_backward", {}).get("speedup_vs_reference")

    profile = base_run.get("profile") or {}
    op_profile = profile.get(profiled_range)
    fraction = op_profile["fraction"] if op_profile else None
    band = (train.get("noise") or {}).get("band")
    out: dict[str, Any] = {"op": profiled_range, "fraction": fraction, "baseline": baseline,
                           "speedup_used": "forward+backward microbench speedup vs the reference", "band": band,
                           "variants": {}}
    for name, run in train["impls"].items():
        if name == baseline:
            continue
        s_impl, s_base = train_speedup(name), train_speedup(baseline)
        if (s_impl is None or s_base is None or fraction is None or not run.get("timing_valid", True)
                or not base_run.get("timing_valid", True)):
            out["variants"][name] = {"valid": False, "reason": "no valid speed for this implementation here "
                                                              "(Triton through its interpreter, or failed parity)"}
            continue
        s = s_impl / s_base
        predicted = predicted_speedup(fraction, s)
        measured = base_run["warm_ms_per_step"] / run["warm_ms_per_step"]
        out["variants"][name] = {
            "valid": True, "microbench_speedup": s, "predicted_speedup": predicted, "measured_speedup": measured,
            "measured_change": (None if band is None else NO_CHANGE if within_band(measured, band)
                                else "faster" if measured > 1 else "slower"),
            "reading": reading(fraction=fraction, speedup=s, predicted=predicted, measured=measured,
                               op_profile=op_profile, microbench_problem=microbench["problem"],
                               model_problem=model_problem, band=band),
        }
    return out
