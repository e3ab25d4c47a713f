"""Amdahl's check: does a kernel's microbenchmark speedup survive a real training step?

If an op takes the fraction f of a step and a kernel makes that op s times faster,
the step can at best become

    predicted = 1 / ((1 - f) + f / s)

times faster. bench-train measures the real end-to-end speedup; when the two disagree
by more than DISAGREEMENT, `reading` names the likely reasons from the numbers at hand, and
`sentence` always says, in one line, the op's share, the prediction, the measurement and why
they agree or differ.

A measured speedup is only a change when it lies outside the run-to-run band of the
baseline's own step time (`noise_band`: the baseline against itself, its warm steps' two
halves and a second copy of it trained interleaved with the variants); inside it, bench-train
and the report say "no measurable change" and print no speedup (`measured_text`).
"""

from __future__ import annotations

import statistics
from typing import Any

from posttrainllm import rules

NO_CHANGE = "no measurable change"

DISAGREEMENT = 0.15  # |measured / predicted - 1| above this needs a reading
OVERHEAD_US_PER_CALL = 50.0  # per-call op time below which launch/dispatch overhead dominates


def noise_band(step_ms: list[float], repeat_step_ms: list[float] | None, warmup_steps: int) -> dict[str, Any]:
    """How far the baseline's warm ms/step moves against itself.

    With a second copy of the baseline (trained interleaved with the variants, step by step, so over the same
    minutes as them): the ratio of the copy's warm median to the first's, over all warm steps and over each half of
    them. A speed change of the machine hits the two copies (and every variant) alike and cancels in these ratios,
    as it does in a measured speedup; the first copy's halves against each other (that change itself) are
    recorded, not part of the band. Without a copy (one variant): the first copy's second half against its first.
    band = the widest ratio either way (>= 1): a measured speedup s is a change only when s > band or s < 1 / band."""
    warm = step_ms[warmup_steps:] or step_ms
    out: dict[str, Any] = {"ratios": {}}
    half = len(warm) // 2
    if len(warm) >= 2:
        out["halves_ms_per_step"] = [statistics.median(warm[:half]), statistics.median(warm[half:])]
        out["drift"] = out["halves_ms_per_step"][1] / out["halves_ms_per_step"][0]
    if repeat_step_ms:
        again = repeat_step_ms[warmup_steps:] or repeat_step_ms
        out["repeat_step_ms"] = list(repeat_step_ms)
        out["repeat_ms_per_step"] = statistics.median(again)
        out["ratios"]["repeat"] = out["repeat_ms_per_step"] / statistics.median(warm)
        if len(warm) >= 2 and len(again) == len(warm):  # the same steps, the same minutes
            out["ratios"]["repeat_first_half"] = statistics.median(again[:half]) / statistics.median(warm[:half])
            out["ratios"]["repeat_second_half"] = statistics.median(again[half:]) / statistics.median(warm[half:])
    elif "drift" in out:
        out["ratios"]["halves"] = out["drift"]
    out["band"] = max((max(r, 1 / r) for r in out["ratios"].values()), default=None)
    out["rule"] = rules.cite("noise_band")
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


BACKWARD_GAP = 1.25  # forward speedup over forward+backward speedup above which the backward is named
IN_MODEL_GAP = 0.8  # the op's own speedup inside the model under this fraction of the microbench's: a copy or shape


def sentence(*, op: str, fraction: float, speedup: float, forward_speedup: float | None, predicted: float,
             measured: float, band: float | None, in_model_speedup: float | None = None,
             microbench_problem: str = "", model_problem: str = "") -> str:
    """The end-to-end answer in one plain sentence, always (agree or not): the op's share of the measured step, the
    op speedup Amdahl is given, its prediction, the measurement with its band, and why the two agree or differ.

    Reasons a difference is given, each from the numbers at hand: noise (the measurement inside the baseline's own
    band, or the band wider than the gap), the op's share (under 20%: no op speedup gives more than 1/(1 − f)), a
    backward the forward speed does not carry (forward speedup > BACKWARD_GAP × forward+backward's), a copy the
    swap adds or the model's other shape (the op inside the model sped up < IN_MODEL_GAP × the microbench's).

    Within DISAGREEMENT of each other the two agree only where the band reads them alike too: a prediction inside
    the band (no measurable change) beside a measurement outside it is said to be outside, never "less than its
    band"."""
    share = f"{op} is {fraction:.0%} of the measured training step"
    given = f"the op {speedup:.2f}x faster (forward+backward microbench)"
    pred = f"Amdahl 1/((1-f) + f/s) predicts {predicted:.2f}x"
    band_text = f" (run-to-run band +-{(band - 1) * 100:.1f}%)" if band else ""
    meas = (f"measured: {NO_CHANGE}{band_text}" if within_band(measured, band)
            else f"measured {measured:.2f}x{band_text}")
    head = f"{share}; with {given}, {pred}; {meas}"
    if not disagrees(predicted, measured, band):
        if within_band(predicted, band) and within_band(measured, band):
            why = (f"they agree: at {fraction:.0%} of the step even a {speedup:.2f}x op moves the step less than "
                   "its own run-to-run band")
        elif within_band(predicted, band):  # within 15%, yet only the measurement is a change by the band's rule
            why = (f"within {DISAGREEMENT:.0%} of each other, yet they do not agree by the band: the predicted "
                   f"{predicted:.2f}x lies inside the +-{(band - 1) * 100:.1f}% run-to-run band, the measured "
                   f"{measured:.2f}x outside it; at {fraction:.0%} of the step a {speedup:.2f}x op cannot move the "
                   "step that far, so something else changed or the band understates the step's noise (rerun)")
        elif within_band(measured, band):
            why = (f"they agree within {DISAGREEMENT:.0%}, yet the step shows no measurable change: at {fraction:.0%} "
                   f"of the step no speedup of the op gives more than {1 / (1 - fraction):.2f}x")
        else:
            why = f"they agree (within {DISAGREEMENT:.0%})"
        return f"{head}: {why}"
    reasons = []
    if within_band(measured, band):
        reasons.append("noise: the measured change is inside the baseline's own band")
    elif band and abs(measured - predicted) <= band - 1:
        reasons.append(f"noise: the gap is within the +-{(band - 1) * 100:.1f}% band")
    if fraction < 0.2:
        reasons.append(f"the op's share: at {fraction:.0%} no speedup of it gives more than {1 / (1 - fraction):.2f}x")
    if forward_speedup is not None and forward_speedup > BACKWARD_GAP * speedup:
        reasons.append(f"a backward the forward speed does not carry: forward {forward_speedup:.2f}x, forward+"
                       f"backward {speedup:.2f}x")
    if in_model_speedup is not None and in_model_speedup < IN_MODEL_GAP * speedup:
        reasons.append(f"inside the model the op ran {in_model_speedup:.2f}x faster, not {speedup:.2f}x: a copy or "
                       "cast the swap adds" + (f", or the model's shape ({model_problem}, microbench "
                                               f"{microbench_problem})" if model_problem != microbench_problem
                                               else ""))
    elif microbench_problem and model_problem and microbench_problem != model_problem:
        reasons.append(f"the model's shape ({model_problem}) is not the microbench's ({microbench_problem})")
    if measured > predicted and not within_band(measured, band):
        reasons.append("the step sped up more than the op can explain: something else changed (rerun)")
    direction = "below" if measured < predicted else "above"
    return f"{head}: measured {direction} predicted, " + ("; ".join(reasons) if reasons else
                                                          "no reason found in the numbers; rerun to rule out noise")


def _op_us_per_call(profile: dict[str, Any] | None, op: str) -> float | None:
    entry = (profile or {}).get(op)
    if not entry or not entry.get("calls"):
        return None
    return (entry["forward_us"] + entry["backward_us"]) / entry["calls"]


def check(train: dict[str, Any], microbench: dict[str, Any], *, profiled_range: str,
          model_problem: str) -> dict[str, Any]:
    """Predicted vs measured end-to-end speedup for every trained variant but the baseline.

    f comes from the baseline variant's profiled step (`profiled_range`: the model slot the op fills,
    model/slots.py; its forward ranges plus the backward nodes they created); s is the microbench's forward+backward
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
        forward = (micro.get(name) or {}).get("speedup_vs_reference")
        base_us, own_us = _op_us_per_call(profile, profiled_range), _op_us_per_call(run.get("profile"), profiled_range)
        in_model = base_us / own_us if base_us and own_us else None
        out["variants"][name] = {
            "valid": True, "microbench_speedup": s, "predicted_speedup": predicted, "measured_speedup": measured,
            "measured_change": (None if band is None else NO_CHANGE if within_band(measured, band)
                                else "faster" if measured > 1 else "slower"),
            "reading": reading(fraction=fraction, speedup=s, predicted=predicted, measured=measured,
                               op_profile=op_profile, microbench_problem=microbench["problem"],
                               model_problem=model_problem, band=band),
            "forward_speedup": forward, "in_model_op_speedup": in_model,
            "sentence": sentence(op=profiled_range, fraction=fraction, speedup=s, forward_speedup=forward,
                                 predicted=predicted, measured=measured, band=band, in_model_speedup=in_model,
                                 microbench_problem=microbench["problem"], model_problem=model_problem),
        }
    return out
