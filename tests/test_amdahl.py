"""Amdahl's check on hand-worked numbers: the prediction, the readings, invalid timings."""

import pytest

from posttrainllm.model import amdahl


def test_prediction_is_amdahls_law():
    assert amdahl.predicted_speedup(0.5, 2.0) == pytest.approx(1 / (0.5 + 0.25))  # 1.333
    assert amdahl.predicted_speedup(0.1, 1e9) == pytest.approx(1 / 0.9)  # the ceiling 1/(1-f)
    assert amdahl.predicted_speedup(0.3, 1.0) == pytest.approx(1.0)


def _train(base_ms, variant_ms, *, fraction=0.5, forward_us=100.0, backward_us=100.0, calls=2, valid=True):
    profile = {"attention": {"calls": calls, "forward_us": forward_us, "backward_us": backward_us,
                             "fraction": fraction}, "matmul": {"calls": 1, "forward_us": 1, "backward_us": 1,
                                                               "fraction": 0.1}}
    return {
        "baseline": "reference",
        "variants": ["reference", "sdpa"],
        "impls": {"reference": {"warm_ms_per_step": base_ms, "profile": profile, "timing_valid": True},
                  "sdpa": {"warm_ms_per_step": variant_ms, "profile": profile, "timing_valid": valid}},
    }


MICRO = {"problem": "B=4 H=4 Hkv=4 S=64 D=32",
         "paths": {"reference": {"valid": True},
                   # forward alone 5x; forward+backward (what a training step runs) 2x: Amdahl must use the 2x
                   "sdpa": {"valid": True, "speedup_vs_reference": 5.0,
                            "forward_backward": {"speedup_vs_reference": 2.0}}}}


def test_agreement_needs_no_reading():
    check = amdahl.check(_train(10.0, 7.5), MICRO, profiled_range="attention", model_problem="B=4 H=4 Hkv=4 S=64 D=32")
    entry = check["variants"]["sdpa"]
    assert entry["predicted_speedup"] == pytest.approx(4 / 3) and entry["measured_speedup"] == pytest.approx(4 / 3)
    assert entry["reading"] == ""


def test_disagreement_is_read_from_the_numbers():
    train = _train(10.0, 9.9, forward_us=20.0, backward_us=60.0, calls=4)
    check = amdahl.check(train, MICRO, profiled_range="attention", model_problem="B=4 H=4 Hkv=4 S=1024 D=32")
    reading = check["variants"]["sdpa"]["reading"]
    assert reading.startswith("measured 1.01x is below the predicted 1.33x")
    assert "differs from the microbench's (B=4 H=4 Hkv=4 S=64 D=32)" in reading
    assert "20 us per call" in reading


def test_small_fraction_is_named():
    train = _train(10.0, 5.0, fraction=0.1)
    reading = amdahl.check(train, MICRO, profiled_range="attention", model_problem=MICRO["problem"])["variants"]["sdpa"]["reading"]
    assert "measured 2.00x is above the predicted 1.05x" in reading
    assert "only 10% of the step" in reading and "1.11x" in reading


def test_invalid_timings_get_no_prediction():
    micro = {**MICRO, "paths": {**MICRO["paths"], "sdpa": {"valid": False, "reason": "interpreter"}}}
    assert amdahl.check(_train(10.0, 5.0), micro, profiled_range="attention", model_problem="x")["variants"]["sdpa"]["valid"] is False
    assert amdahl.check(_train(10.0, 5.0, valid=False), MICRO, profiled_range="attention",
                        model_problem="x")["variants"]["sdpa"]["valid"] is False
