"""Every view tells one story: the terminal tables, report.html and the MLflow run read the same derived fields
(track/derived.py), so a best peer, a verdict's deciding tensor and a flag are the same thing everywhere; and the
bench console locates a planted wrong weight gradient."""

import copy

import pandas as pd
import pytest

from posttrainllm.track import derived, report, report_page
from test_report import _receipt

WEIGHT_GRAD_BUG = '''"""RMSNorm whose forward and input gradient are right, its weight gradient summed over only
the first half of the rows (a planted bug: a reduction that stops early)."""
import torch


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        xhat, dy = x.float() * rstd, dy.float()
        dxhat = dy * weight.float()
        dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
        half = max(1, x.shape[0] // 2)
        dw = (dy * xhat)[:half].sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None


def rmsnorm(x, weight, eps):
    return _Norm.apply(x, weight, eps)
'''

ROUNDED_FIRST = '''import torch


def rmsnorm(x, weight, eps):  # normalised in fp32, rounded to x's dtype, then scaled by the weight in x's dtype
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight
'''


def _told_apart():
    """A point whose views could disagree: the first registered peer (sdpa) is not the fastest; our kernel passes
    its forward but fails a gradient on the elementwise count; a noisy reference; a roofline fraction above 1; an
    end-to-end measurement far from its prediction."""
    receipt = copy.deepcopy(_receipt("precision-fp16", verdict="fail"))
    receipt["schema"] = "posttrainllm.track.receipt/1"
    receipt["created_at"] = "2026-01-01T00:00:00+00:00"
    receipt["provenance"] = {"revision": "0" * 40, "dirty": False, "triton_interpreted": False,
                             "machine": {"device": "cuda", "device_name": "test gpu", "threads": 1, "torch": "2",
                                         "triton": "3", "python": "3.11"}}
    receipt["config"] = {"op": {"name": "attention"}, "precision": {"name": "fp16", "dtype": "float16"},
                         "tile": {"name": "b64", "block_q": 64}, "train": {"steps": 4}}
    receipt["sweep"] = {"name": "views", "id": "views-test", "changes": {"precision": "fp16"}}
    receipt["kernel"]["paths"]["sdpa_math"] = {"kind": "peer"}
    micro = receipt["microbench"]["paths"]
    micro["reference"].update(p20_ms=1.5, p80_ms=3.5, noisy=True, reps=50,
                              forward_backward={"median_ms": 6.0, "p20_ms": 5.9, "p80_ms": 6.1, "noisy": False})
    micro["sdpa"].update(p20_ms=0.99, p80_ms=1.01, noisy=False,
                         roofline={"fraction_of_attainable": 0.4, "classification": "compute-bound"})
    micro["sdpa_math"] = {"valid": True, "median_ms": 0.25, "p20_ms": 0.24, "p80_ms": 0.26, "noisy": False,
                          "speedup_vs_reference": 8.0, "memory": {"peak_bytes": 1000},
                          "roofline": {"fraction_of_attainable": 7.3, "attainable_flops_per_s": 2.1e9,
                                       "classification": "compute-bound"},
                          "forward_backward": {"median_ms": 1.0, "p20_ms": 0.95, "p80_ms": 1.05, "noisy": False,
                                               "speedup_vs_reference": 6.0}}
    micro["triton"] = {"valid": False, "reason": "failed parity: no speed"}
    worst = {"max_abs_err": 1e-4, "allowed_abs_err": 1e-3, "bound_ratio": 0.1, "case": "S128-seed0",
             "verdict": "pass"}
    receipt["parity"]["contract"] = {"error_multiple": 8.0}
    receipt["parity"]["first_failure"] = "triton: S128-seed0/grad_q: mismatch_frac 0.004 > 0.001"
    receipt["parity"]["paths"]["triton"] = {
        "verdict": "fail", "violations": [],
        "failed_cases": ["S128-seed0/grad_q: mismatch_frac 0.004 > 0.001"],
        "worst": {"out": worst, "grad_q": {**worst, "bound_ratio": 0.5, "error_ratio": 2.1, "verdict": "fail"}}}
    receipt["parity"]["paths"]["sdpa_math"] = {"verdict": "pass", "worst": {"out": worst}}
    receipt["bench_train"].update(noise={"band": 1.05}, amdahl={"variants": {"sdpa": {
        "valid": True, "predicted_speedup": 1.03, "measured_speedup": 0.58, "reading": "the op is 10% of the step"}}})
    return receipt


def test_the_views_agree_on_the_best_peer_the_deciding_tensor_and_the_flags(tmp_path, mlflow_uri):
    MlflowClient = pytest.importorskip("mlflow.tracking").MlflowClient

    from posttrainllm.track import receipt as receipts

    told = _told_apart()
    receipts_ = {"precision-fp16": told, "baseline": _receipt("baseline")}
    fields = derived.point_fields(told)
    assert fields["best_peer"] == "sdpa_math"  # the fastest valid peer, not the first registered one
    figures = {f["figure"] for f in fields["flags"]}
    # one row, one path: the trained sdpa's end-to-end figure (and its flag) is not in sdpa_math's row
    assert figures == {"peer_x", "roofline"}, fields["flags"]
    # the default table, --wide (and report.md), the page and the MLflow run
    summary = report.summary_frame(receipts_).set_index("point").loc["precision-fp16"]
    wide = report.sweep_frame(receipts_).set_index("point").loc["precision-fp16"]
    assert summary["best_peer"] == wide["peer"] == "sdpa_math" and summary["peer_x"] == wide["peer_speedup"] == 8.0
    assert summary["flags"] == wide["flags"] == report.flag_names(fields)
    assert summary["e2e_path"] == "-" and wide["e2e_path"] is None
    assert pd.isna(summary["e2e_meas"]) and pd.isna(wide["amdahl_meas"])
    lines = report.flag_lines(receipts_)
    assert any("roofline 730% of attainable, not a result" in line and "calibration" in line for line in lines)
    assert any(line.startswith("precision-fp16: peer_x: reference: forward noisy: p20-p80 1.5-3.5") for line in lines)
    page = report_page.sweep_page(receipts_, tmp_path)
    assert "sdpa_math" in page and "730%: not a result" in page
    assert "the best peer sdpa_math was not trained by bench-train, so this row has no step figure; sdpa was " \
        "trained instead" in page
    # the console: the gradient decided the failing verdict, beside a passing forward
    console = report.point_table(told)
    [row] = [line for line in console.splitlines() if line.startswith("triton ")]
    assert row.split()[:4] == ["triton", "fail", "grad_q", "elementwise"], row
    assert "triton: grad_q failed the elementwise count rule on S128-seed0: mismatch_frac 0.004 > 0.001 (its " \
           "worst error is 2.1x the reference math's in the same precision, limit 8x)" in console
    table = console.splitlines()[1:2 + len(fields["paths"])]  # the header and one row per path
    assert max(len(line) for line in table) <= report.TERMINAL_WIDTH
    # MLflow: the same best peer and flags as tags; no roofline fraction above 1 as a metric
    run_id = receipts.log_to_mlflow(told, tmp_path, mlflow_uri)
    run = MlflowClient(tracking_uri=mlflow_uri).get_run(run_id)
    assert run.data.tags["best_peer"] == "sdpa_math" and run.data.tags["flags"] == summary["flags"]
    assert "roofline 730% of attainable" in run.data.tags["flags.reasons"]
    assert run.data.metrics["best_peer.fwd_speedup_vs_reference"] == 8.0 and run.data.metrics["parity.triton.pass"] == 0.0
    assert "bench.sdpa_math.roofline_fraction" not in run.data.metrics
    assert run.data.metrics["bench.sdpa.roofline_fraction"] == 0.4
    # MLflow opens on the answer: the point's dimensions and filter values as parameters, not the whole config
    assert run.data.params == {"op.name": "attention", "precision.name": "fp16", "precision.dtype": "float16",
                               "tile.name": "b64", "tile.block_q": "64"}
    assert run.info.run_name == "precision-fp16" and run.data.tags["change.precision"] == "fp16"
    assert len(run.data.metrics) <= 6 * 4 + 6  # a handful per path, not every number (metrics.json has them)


def test_a_wrong_weight_gradient_fails_on_its_own_row_with_the_rule_and_a_hint(tmp_path):
    """Two user RMSNorms at bf16 whose forward is right: one sums its weight gradient over half the rows (a
    planted bug), one rounds x̂ to bf16 before the weight's product and sum (gpt-fast's style). Each row reads
    fail, decided by grad_weight, never by the passing forward; the first fails the worst-error rule far past
    any rounding, the second only the elementwise count, told to accumulate in fp32."""
    from conftest import parity_report

    from posttrainllm.lab.configure import load

    (tmp_path / "halfsum.py").write_text(WEIGHT_GRAD_BUG)
    (tmp_path / "rounded.py").write_text(ROUNDED_FIRST)
    cfg = load(["op=rmsnorm", "device=cpu", "precision=bf16", "parity.seeds=[0]", "shape.seq_len=16",
                "shape.edge_seq_lens=[37]", "op.only=[halfsum,rounded]",
                f'op.user_impls=["halfsum={tmp_path}/halfsum.py:rmsnorm","rounded={tmp_path}/rounded.py:rmsnorm"]'])
    parity = parity_report(cfg, tmp_path / "point")
    assert all(parity["paths"][name]["worst"]["out"]["verdict"] == "pass" for name in ("halfsum", "rounded"))
    receipt = {"point": "p", "parity": parity, "microbench": {"paths": {}},
               "config": {"precision": {"name": "bf16"}},
               "provenance": {"machine": {"device_name": "cpu", "threads": 1}}}
    console = report.point_table(receipt).splitlines()
    rows = {line.split()[0]: line.split() for line in console[2:4]}
    assert rows["halfsum"][:4] == ["halfsum", "fail", "grad_weight", "worst"], console
    assert rows["rounded"][:5] == ["rounded", "fail", "grad_weight", "elementwise", "count"], console
    [wrong] = [line for line in console if line.startswith("halfsum: grad_weight failed the worst error rule on ")]
    assert "> allowed" in wrong and "reference math's error in the same precision is beyond any rounding" in wrong
    [rounded] = [line for line in console if line.startswith("rounded: grad_weight failed the elementwise count")]
    assert "mismatch_frac" in rounded and "the reference math's in the same precision, limit 8x" in rounded
    assert rounded.endswith(f"hint: {derived.WEIGHT_HINT}"), rounded


def test_a_weight_gradient_that_misses_only_the_count_is_told_to_accumulate_in_fp32():
    contract = {"error_multiple": 8.0}
    near = {"verdict": "fail", "failed_cases": ["S37-seed0/grad_weight: mismatch_frac 0.004 > 0.001"], "violations": [],
            "worst": {"grad_weight": {"bound_ratio": 0.6, "error_ratio": 2.1, "case": "S37-seed0"}}}
    decided = derived._decision(near, contract)
    assert (decided["decided_by"], decided["rule"], decided["hint"]) == ("grad_weight", "elementwise count",
                                                                         derived.WEIGHT_HINT)
    assert "2.1x the reference math's in the same precision, limit 8x" in decided["why"]
    guard = {"verdict": "fail", "failed_cases": ["S37-seed0: wrote into its input x"], "worst": {},
             "violations": ["S37-seed0: wrote into its input x"]}
    decided = derived._decision(guard, contract)
    assert (decided["decided_by"], decided["rule"], decided["first_case"]) == ("guard", "guard", "S37-seed0")
    assert decided["hint"] is None and decided["why"].startswith("the path failed the guard rule on S37-seed0")


def test_a_copied_store_says_where_its_artifacts_still_are(tmp_path, mlflow_uri):
    """MLflow records absolute artifact locations: a copy of the store names the original's mlartifacts/, and
    `posttrainllm ui` says how to rebuild it (docs/results.md)."""
    import shutil

    pytest.importorskip("mlflow")
    from posttrainllm.track import receipt as receipts
    from posttrainllm.track import store, ui

    receipts.log_to_mlflow(_told_apart(), tmp_path, mlflow_uri)  # the store and its experiment exist
    assert ui.moved_artifacts(mlflow_uri) is None  # its artifacts are beside it
    copy = tmp_path / "copied"
    copy.mkdir()
    shutil.copy(store.sqlite_path(mlflow_uri), copy / "mlflow.db")
    moved = ui.moved_artifacts(f"sqlite:///{copy / 'mlflow.db'}")
    assert moved == receipts.artifact_location(mlflow_uri) != receipts.artifact_location(f"sqlite:///{copy}/mlflow.db")
    assert "posttrainllm receipt import runs" in ui.MOVED.format(recorded=moved)
