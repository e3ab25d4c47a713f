"""Amdahl's check: does a kernel's microbenchmark speedup survive a real training step?

If an op takes the fraction f of a step and a kernel makes that op s times faster,
the step can at best become

    predicted = 1 / ((1 - f) + f / s)

times faster. bench-train measures the real end-to-end speedup; when the two disagree
by more than DISAGREEMENT, `reading` names the likely reasons from the numbers at hand.
"""

from __future__ import annotations

from typing import Any

DISAGREEMENT = 0.15  # |measured / predicted - 1| above this needs a reading
BACKWARD_DOMINATES = 0.5  # backward share of the op's time above which a forward-only microbench misleads
OVERHEAD_US_PER_CALL = 50.0  # per-call op time below which launch/dispatch overhead dominates


def predicted_speedup(fraction: float, speedup: float) -> float:
    return 1.0 / ((1.0 - fraction) + fraction / speedup)


def reading(*, fraction: float, speedup: float, predicted: float, measured: float, op_profile: dict[str, Any],
            microbench_problem: str, model_problem: str) -> str:
    """One line on why predicted and measured disagree (empty when they agree)."""
    if abs(measured / predicted - 1.0) <= DISAGREEMENT:
        return ""
    reasons = []
    if microbench_problem != model_problem:
        reasons.append(f"the model's shape ({model_problem}) differs from the microbench's ({microbench_problem})")
    op_us = op_profile["forward_us"] + op_profile["backward_us"]
    if op_us and op_profile["backward_us"] / op_us > BACKWARD_DOMINATES:
        reasons.append(f"the backward is {op_profile['backward_us'] / op_us:.0%} of the op's time in training "
                       "but the microbench times the forward only")
    calls = max(op_profile["calls"], 1)
    if op_us / calls < OVERHEAD_US_PER_CALL:
        reasons.append(f"{op_us / calls:.0f} us per call: launch/dispatch overhead, not the kernel, sets the time")
    if fraction < 0.2:
        reasons.append(f"the op is only {fraction:.0%} of the step, so no speedup of it can give more than "
                       f"{1 / (1 - fraction):.2f}x")
    direction = "below" if measured < predicted else "above"
    return (f"measured {measured:.2f}x is {direction} the predicted {predicted:.2f}x: "
            + ("; ".join(reasons) if reasons else "no reason found in the profile; rerun to rule out noise"))


def check(train: dict[str, Any], microbench: dict[str, Any], *, op: str, model_problem: str) -> dict[str, Any]:
    """Predicted vs measured end-to-end speedup for every non-baseline variant of a bench-train result.

    f comes from the baseline variant's profiled step; s is the microbench speedup of the
    variant's implementation of `op` over the baseline variant's implementation.
    """
    baseline = train["baseline"]
    base_run = train["impls"][baseline]
    key = "attention" if op == "attention" else "linear"
    base_impl = train["variants"][baseline][key]
    micro = microbench["paths"]

    def micro_speedup(impl: str) -> float | None:
        if impl == "reference":
            return 1.0
        entry = micro.get(impl, {})
        return entry.get("speedup_vs_reference") if entry.get("valid") else None

    fraction = base_run["profile"]["attention" if op == "attention" else "matmul"]["fraction"]
    out: dict[str, Any] = {"op": op, "fraction": fraction, "baseline": baseline, "variants": {}}
    for name, variant in train["variants"].items():
        if name == baseline:
            continue
        s_impl, s_base = micro_speedup(variant[key]), micro_speedup(base_impl)
        run = train["impls"][name]
        if s_impl is None or s_base is None or not run.get("timing_valid", True) or not base_run.get(
                "timing_valid", True):
            out["variants"][name] = {"valid": False, "reason": "no valid speed for this implementation here "
                                                              "(Triton through its interpreter, or failed parity)"}
            continue
        s = s_impl / s_base
        predicted = predicted_speedup(fraction, s)
        measured = base_run["warm_ms_per_step"] / run["warm_ms_per_step"]
        out["variants"][name] = {
            "valid": True, "microbench_speedup": s, "predicted_speedup": predicted, "measured_speedup": measured,
            "reading": reading(fraction=fraction, speedup=s, predicted=predicted, measured=measured,
                               op_profile=base_run["profile"]["attention" if op == "attention" else "matmul"],
                               microbench_problem=microbench["problem"], model_problem=model_problem),
        }
    return out
