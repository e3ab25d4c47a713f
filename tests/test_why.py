"""Why, from the receipt alone: a real (shrunk) sweep's receipts carry each path's own traffic, its place on the
roofline, and the step the op lives in (conftest.py sweep_runs: every stage of two attention points)."""

import json

import pytest

from posttrainllm import rules
from posttrainllm.track import derived


@pytest.fixture(scope="module")
def baseline(sweep_runs):
    return json.loads((sweep_runs / "baseline" / "receipt.json").read_text())


def test_each_attention_path_is_placed_with_its_own_traffic(baseline):
    """The reference's (S, S) traffic against the fused paths': more bytes by at least min(S, block_q)/D (the
    factor the two models give, tests/test_traffic.py), so a lower intensity on the roofline; the floor stays
    the top-level figure, and a path's costs name their model and formula."""
    micro = baseline["microbench"]
    paths = micro["paths"]
    ref = paths["reference"]["costs"]
    assert ref["model"] == "materialised" and "P = B*H*S^2" in ref["bytes_formula"]
    assert ref["bytes"] >= 64 / 32 * micro["bytes"]  # S/D over the floor (shape.seq_len=64, head_dim 32)
    fused = [name for name, entry in paths.items() if entry.get("valid") and entry["costs"]["model"] == "fused"]
    assert "sdpa" in fused
    for name in fused:
        mine = paths[name]["costs"]
        assert ref["bytes"] >= min(64, 32) / 32 * mine["bytes"] and ref["bytes"] > mine["bytes"]
        assert ref["train_bytes"] > mine["train_bytes"]
        assert paths["reference"]["roofline"]["intensity_flops_per_byte"] < paths[name]["roofline"][
            "intensity_flops_per_byte"]
        assert paths[name]["roofline"]["peak_used"]["source"] in ("calibration", "remeasured")


def test_the_curve_carries_each_paths_bytes_per_mode(sweep_runs):
    import pandas as pd

    curve = pd.read_csv(sweep_runs / "baseline" / "curve.csv")
    ref = curve[(curve["impl"] == "reference") & (curve["mode"] == "forward")].set_index("x_value")
    sdpa = curve[(curve["impl"] == "sdpa") & (curve["mode"] == "forward")].set_index("x_value")
    assert (ref["cost_model"] == "materialised").all() and (sdpa["cost_model"] == "fused").all()
    assert (ref["bytes"] > sdpa["bytes"]).all() and (ref["minimal_bytes"] == sdpa["minimal_bytes"]).all()
    assert (ref["working_set"] > sdpa["working_set"]).all() and (ref["path_flops"] >= ref["flops"]).all()


def test_every_point_says_what_its_op_does_to_the_training_step(sweep_runs):
    """Each point's receipt gives the op's share of the measured step, Amdahl's prediction, the measurement and
    the sentence, agreeing or not; the console (bench, report) and report.html print it."""
    from posttrainllm.track import report, report_page

    receipts = {name: json.loads((sweep_runs / name / "receipt.json").read_text())
                for name in ("baseline", "precision-fp16")}
    for name, receipt in receipts.items():
        fields = derived.point_fields(receipt)
        assert 0 < fields["e2e_share"] < 1, name
        sentence = fields["e2e_sentence"]
        assert f"attention is {fields['e2e_share']:.0%} of the measured training step" in sentence, name
        assert "Amdahl 1/((1-f) + f/s) predicts" in sentence and "measured" in sentence, name
        # every verdict amdahl.sentence can give; which one a run gets depends on its timings (noise included)
        verdicts = (": they agree", "they do not agree by the band", "measured below predicted",
                    "measured above predicted")
        assert any(verdict in sentence for verdict in verdicts), (name, sentence)
        assert report.point_table(receipt).splitlines()[-1] == f"step: {sentence}"
    summary = report.summary_table(receipts)
    for name, receipt in receipts.items():  # the row's own path (ours, else the best peer), or why it has none
        fields = derived.point_fields(receipt)
        said = (f"{fields['e2e_path']}: attention is" if fields["e2e_path"] else
                f"the best peer {fields['best_peer']} was not trained by bench-train")
        assert f"step: {name}: {said}" in summary, summary
    page = report_page.sweep_page(receipts, sweep_runs)
    assert "<h3>The training step</h3><p>" + report_page.html.escape(
        derived.point_fields(receipts["baseline"])["e2e_sentence"])[:40] in page


def test_the_receipt_reads_each_paths_regime_from_its_curve(baseline):
    """curve.regimes: per path and segment, the time slope beside the FLOPs' and bytes' (from its own model),
    measured and predicted regimes; the reference's bytes grow as S² (its (S, S) tensors), the fused ones' slower."""
    curve = baseline["microbench"]["curve"]
    read = {(e["impl"], e["mode"]): e for e in curve["regimes"]}
    assert curve["regime_rule"] == {"id": "regime", "overhead_fraction": 0.5, "slope_tolerance": 0.25}
    assert "slope = d log(time) / d log(x)" in rules.text(curve["regime_rule"])
    ref, sdpa = read[("reference", "forward")], read[("sdpa", "forward")]
    assert ref["cost_model"] == "materialised" and sdpa["cost_model"] == "fused"
    for entry in (ref, sdpa):
        [segment] = entry["segments"]  # shape.curve=[32, 64]
        assert segment["x_from"] == 32 and segment["x_to"] == 64 and segment["time_slope"] is not None
        assert segment["measured"] is not None and segment["predicted"] is not None
    assert ref["segments"][0]["bytes_slope"] > sdpa["segments"][0]["bytes_slope"]


def test_explain_answers_the_three_questions_from_the_receipt_alone(sweep_runs, tmp_path, capsys):
    """`posttrainllm explain POINT` on the baseline's folder copied away from everything else (no params.yaml, no
    runs/, no store: the receipt alone): the contract with its tolerances and where they come from, each path's
    traffic with its model and formula, and the step sentence."""
    import shutil

    from posttrainllm import cli

    alone = tmp_path / "copied"
    alone.mkdir()
    shutil.copy(sweep_runs / "baseline" / "receipt.json", alone / "receipt.json")
    assert cli.main(["explain", str(alone)]) == 0
    out = capsys.readouterr().out
    assert "1. The numerical contract" in out and "conf/precision/fp32.yaml" in out and "error_multiple=" in out
    assert "2. Memory traffic per path" in out and "reference (materialised model): forward" in out
    assert "sdpa (fused model): forward" in out and "the reference moves" in out and "regime: reference" in out
    assert "3. Why a microbenchmark may not move training" in out and "of the measured training step" in out
    assert cli.main(["explain", str(tmp_path / "nowhere")]) == 2
    assert "no receipt at" in capsys.readouterr().err


def test_every_rule_the_receipt_names_is_an_id_of_the_table(baseline):
    """The stages store rules by id (posttrainllm/rules.py), with the run's values beside a rule's id; every id the
    receipt names is in the table, so each reads as its text."""
    cited = derived.cited_rules(baseline)
    assert {"parity_contract", "backward", "determinism", "batch_invariance", "properties", "noisy", "band",
            "roofline_class", "timed_result", "impossible", "rotation", "torch_state", "above_roof", "cost_model",
            "curve_check", "regime", "integrity"} <= {rid for rid, _ in cited}
    assert not [text for _, text in cited if text.startswith("unknown rule")]
    micro = baseline["microbench"]
    fraction = baseline["config"]["bench"]["impossible_below"]
    assert micro["impossible_rule"] == {"id": "impossible", "fraction": fraction}
    assert rules.text(micro["impossible_rule"]).startswith(f"a median under {fraction:g} x the roofline's")
    assert micro["band_rule"] == "band" and micro["curve"]["check_rule"] == "curve_check"
