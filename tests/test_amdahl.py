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


def test_the_noise_band_is_the_baseline_against_itself():
    # warm steps (after 2 warm-up) 10, 10, 11, 11: the machine slowed by 10 % (drift 1.1); the second copy,
    # interleaved, slowed alike (10.5, 10.5, 11.5, 11.5): its ratios 11 / 10.5, 1.05 and 11.5 / 11: the band is theirs
    band = amdahl.noise_band([50.0, 20.0, 10.0, 10.0, 11.0, 11.0], [40.0, 30.0, 10.5, 10.5, 11.5, 11.5], 2)
    assert band["halves_ms_per_step"] == [10.0, 11.0] and band["drift"] == pytest.approx(1.1)
    assert band["repeat_ms_per_step"] == 11.0
    assert band["ratios"] == {"repeat": pytest.approx(11 / 10.5), "repeat_first_half": pytest.approx(1.05),
                              "repeat_second_half": pytest.approx(11.5 / 11)}
    assert band["band"] == pytest.approx(1.05)  # the drift, which cancels in a speedup, is not in it
    # a copy that ran 20 % faster in one half widens it, either way round, though the medians agree
    uneven = amdahl.noise_band([10.0, 10.0, 10.0, 10.0], [8.0, 8.0, 12.0, 12.0], 0)
    assert uneven["band"] == pytest.approx(1.25) and uneven["ratios"]["repeat"] == pytest.approx(1.0)
    assert amdahl.noise_band([10.0, 10.0, 10.0, 10.0], [8.0, 8.0, 8.0, 8.0], 0)["band"] == pytest.approx(1.25)
    # no second copy (one variant): the halves are all there is
    assert amdahl.noise_band([10.0, 10.0, 11.0, 11.0], None, 0)["ratios"] == {"halves": pytest.approx(1.1)}
    assert amdahl.noise_band([10.0], None, 0)["band"] is None  # nothing to measure it from
    assert band["rule"] == "noise_band"  # by id: its text is posttrainllm/rules.py's, explain prints it


def test_a_measured_speedup_inside_the_band_is_no_measurable_change():
    train = {**_train(10.0, 9.5), "noise": {"band": 1.08}}  # measured 1.053x, inside +-8 %
    entry = amdahl.check(train, MICRO, profiled_range="attention", model_problem=MICRO["problem"])["variants"]["sdpa"]
    assert entry["measured_change"] == "no measurable change"
    assert amdahl.measured_text(entry["measured_speedup"], 1.08) == "no measurable change (band +-8.0%)"
    # the reading (predicted 1.33x) names no measured number inside the band
    assert entry["reading"].startswith("measured: no measurable change (inside the baseline's +-8.0% run-to-run "
                                       "band), below the predicted 1.33x")
    assert "1.05x" not in entry["reading"]
    outside = amdahl.check({**_train(10.0, 7.5), "noise": {"band": 1.08}}, MICRO, profiled_range="attention",
                           model_problem=MICRO["problem"])["variants"]["sdpa"]
    assert outside["measured_change"] == "faster" and amdahl.measured_text(outside["measured_speedup"], 1.08) == "1.33x"
    slower = amdahl.check({**_train(10.0, 12.0), "noise": {"band": 1.08}}, MICRO, profiled_range="attention",
                          model_problem=MICRO["problem"])["variants"]["sdpa"]
    assert slower["measured_change"] == "slower"
    # no band recorded (an older receipt): the number, as before
    assert amdahl.measured_text(1.053, None) == "1.05x"


def test_the_report_prints_no_speedup_inside_the_band():
    from posttrainllm.track import report

    train = {**_train(10.0, 9.5), "noise": {"band": 1.08}, "drift": {"sdpa": 1e-6}, "drift_verdict": {"sdpa": "pass"},
             "precision": "fp32", "device": "cpu", "tokens_per_step": 256, "drift_limit": 1e-3}
    for entry in train["impls"].values():
        entry.update(losses=[3.0, 2.0], tokens_per_s=1.0, peak_mem_bytes=None)
    train["amdahl"] = amdahl.check(train, MICRO, profiled_range="attention", model_problem=MICRO["problem"])
    receipt = {"point": "p", "config": {"architecture": {"name": "gqa"}}, "bench_train": train,
               "kernel": {"paths": {"sdpa": {"kind": "peer"}}},  # sdpa the best peer: the row's step is its own
               "microbench": {"paths": {"sdpa": {"valid": True, "median_ms": 1.0}}}}
    table = report.train_table(receipt)
    assert "no measurable change (band +-8.0%)" in table and "1.05" not in table
    assert "run-to-run band +-8.0%" in table
    # the summary's e2e_meas and the wide table's amdahl_meas read the same: "n.c.", no number
    from posttrainllm.track import derived

    assert derived.point_fields(receipt)["e2e_meas"] == "n.c."
    from posttrainllm import rules
    from posttrainllm.track import explain

    cited = {**receipt, "bench_train": {**train, "noise": {"band": 1.08, "rule": rules.cite("noise_band")}}}
    assert f"band rule: {rules.RULES['noise_band'].text}" in explain.end_to_end(cited)
    assert ("noise_band", rules.RULES["noise_band"].text) in derived.cited_rules(cited)
    old = {**receipt, "bench_train": {**train, "noise": {"band": 1.08, "rule": "s > band (prose, an older receipt)"}}}
    assert "band rule: s > band (prose, an older receipt)" in explain.end_to_end(old)
    assert derived.point_fields({**receipt, "bench_train": {**train, "noise": {"band": 1.01}}})["e2e_meas"] == \
        pytest.approx(10.0 / 9.5)


def test_every_valid_variant_gets_the_step_sentence_when_they_agree():
    """Agreeing figures still get their sentence (it was a reading only past 15%): share, prediction, measurement."""
    entry = amdahl.check(_train(10.0, 7.5), MICRO, profiled_range="attention",
                         model_problem=MICRO["problem"])["variants"]["sdpa"]
    text = entry["sentence"]
    assert text.startswith("attention is 50% of the measured training step")
    assert "the op 2.00x faster (forward+backward microbench)" in text and "predicts 1.33x" in text
    assert "measured 1.33x" in text and text.endswith("they agree (within 15%)")


def test_inside_the_band_the_sentence_says_the_share_explains_it():
    train = {**_train(10.0, 9.9, fraction=0.05), "noise": {"band": 1.05}}
    text = amdahl.check(train, MICRO, profiled_range="attention", model_problem=MICRO["problem"])["variants"][
        "sdpa"]["sentence"]
    assert "measured: no measurable change (run-to-run band +-5.0%)" in text
    assert "they agree: at 5% of the step even a 2.00x op moves the step less than its own run-to-run band" in text


def test_a_difference_is_explained_by_the_backward_and_a_copy_the_swap_adds():
    """Forward 5x but forward+backward 2x (MICRO); inside the model the op's own time per call fell only 1.25x
    (its profile): both are named. Planted bug: a sentence built only from f and s names neither."""
    train = _train(10.0, 10.0)
    train["impls"]["sdpa"]["profile"] = {"attention": {"calls": 2, "forward_us": 80.0, "backward_us": 80.0,
                                                       "fraction": 0.4}}
    entry = amdahl.check(train, MICRO, profiled_range="attention", model_problem=MICRO["problem"])["variants"]["sdpa"]
    assert entry["in_model_op_speedup"] == pytest.approx(1.25)
    text = entry["sentence"]
    assert "measured below predicted" in text
    assert "a backward the forward speed does not carry: forward 5.00x, forward+backward 2.00x" in text
    assert "inside the model the op ran 1.25x faster, not 2.00x: a copy or cast the swap adds" in text
    assert "the op's share" not in text  # 50%: not the reason


def test_a_small_share_is_the_reason_it_does_not_show():
    """50x on an op of 10% of the step predicts 1.11x, within 15% of an unchanged step: they agree, and the
    sentence says the share is why nothing shows."""
    train = {**_train(10.0, 10.0, fraction=0.1), "noise": {"band": 1.02}}
    text = amdahl.check(train, {**MICRO, "paths": {**MICRO["paths"], "sdpa": {
        "valid": True, "speedup_vs_reference": 50.0, "forward_backward": {"speedup_vs_reference": 50.0}}}},
        profiled_range="attention", model_problem=MICRO["problem"])["variants"]["sdpa"]["sentence"]
    assert "predicts 1.11x" in text and "measured: no measurable change" in text
    assert text.endswith("they agree within 15%, yet the step shows no measurable change: at 10% of the step no "
                         "speedup of the op gives more than 1.11x")


def test_a_measurement_outside_the_band_is_never_read_as_inside_it():
    """op-matmul's case: 1.02x predicted (inside the +-2.3% band), 1.07x measured (outside), 5% apart. The 15% rule
    alone said "they agree: ... less than its own run-to-run band"; the sentence must say the measurement lies
    outside the band. Planted bug: the old branch (predicted inside the band is enough) fails this."""
    text = amdahl.sentence(op="matmul", fraction=0.1, speedup=1.2, forward_speedup=None,
                           predicted=amdahl.predicted_speedup(0.1, 1.2), measured=1.07, band=1.023)
    assert "measured 1.07x (run-to-run band +-2.3%)" in text
    assert "less than its own run-to-run band" not in text
    assert "the predicted 1.02x lies inside the +-2.3% run-to-run band, the measured 1.07x outside it" in text
    # both inside: the share explains it; both outside: plain agreement
    inside = amdahl.sentence(op="matmul", fraction=0.1, speedup=1.2, forward_speedup=None, predicted=1.017,
                             measured=1.01, band=1.023)
    assert inside.endswith("moves the step less than its own run-to-run band")
    assert amdahl.sentence(op="matmul", fraction=0.5, speedup=2.0, forward_speedup=None, predicted=1.33,
                           measured=1.30, band=1.023).endswith("they agree (within 15%)")
