"""A failure is evidence: `dvc repro` of a sweep with one broken point keeps every point's receipt and run.

A planted fp16-only bug in the Triton attention (its output scaled by 1.01 in fp16 only) breaks one
point of a three-point sweep. The sweep must run to the end: three receipts, three MLflow runs, the
failing one tagged with its verdict and first failing case, no speed for the failed path anywhere,
and `posttrainllm report` listing the failure first and exiting 1.
"""

import json
import sys

import pytest
from conftest import run_command

pytestmark = pytest.mark.slow

ORIGINAL = "return o.to(q.dtype), lse"
PLANTED = "return (o * (1.01 if q.dtype == torch.float16 else 1.0)).to(q.dtype), lse"
SWEEP = """name: failing
grid: false
baseline: {op: attention, precision: fp32, tile: b64, workgroup: w4s2, architecture: mha, shape: tiny, device: cpu}
vary:
  precision: [fp16, bf16]
points: {}
overrides: [train.steps=3, train.warmup_steps=1, train.interpreted_steps=2, bench.reps=3, bench.min_time_s=0.0,
            "parity.seeds=[0]", "shape.edge_seq_lens=[37]", "shape.curve=[64,128]"]
"""


@pytest.fixture(scope="module")
def broken_sweep(project_copy):
    def plant(root):
        kernel = root / "posttrainllm" / "ops" / "attention.py"
        source = kernel.read_text()
        assert source.count(ORIGINAL) == 1, "the planted bug's target line moved"
        kernel.write_text(source.replace(ORIGINAL, PLANTED))
        (root / "conf" / "sweep" / "failing.yaml").write_text(SWEEP)

    root, env = project_copy("failing", sweep="failing", edit=plant)
    repro = run_command(["dvc", "repro"], root, env, check=False)
    report = run_command([sys.executable, "-m", "posttrainllm", "report"], root, env, check=False)
    return root, repro, report


def test_the_sweep_runs_to_the_end_and_keeps_every_receipt(broken_sweep):
    root, repro, _ = broken_sweep
    assert repro.returncode == 0, repro.stderr[-3000:]
    receipts = {p: json.loads((root / "runs" / p / "receipt.json").read_text())
                for p in ("baseline", "precision-fp16", "precision-bf16")}
    assert receipts["baseline"]["parity"]["verdict"] == "pass"
    assert receipts["precision-bf16"]["parity"]["verdict"] == "pass"
    failed = receipts["precision-fp16"]
    assert failed["parity"]["verdict"] == "fail"
    assert failed["parity"]["first_failure"].startswith("triton: ")
    assert "recorded, sweep continues" in repro.stderr


def test_the_failed_path_has_no_speed_anywhere(broken_sweep):
    root, _, _ = broken_sweep
    point = root / "runs" / "precision-fp16"
    receipt = json.loads((point / "receipt.json").read_text())
    assert receipt["microbench"]["paths"]["triton"] == {"valid": False, "reason": "failed parity: no speed number"}
    assert "triton" not in receipt["bench_train"]["impls"]
    assert receipt["bench_train"]["skipped"] == {"triton": "failed parity: no speed number"}
    assert ",triton," not in (point / "curve.csv").read_text()
    assert "triton" not in (point / "timings.csv").read_text()
    metrics = json.loads((point / "metrics.json").read_text())
    assert metrics["parity.triton.pass"] == 0.0
    assert not any(k.startswith(("bench.triton.", "train.triton.", "curve.triton.")) for k in metrics)


def test_every_point_has_an_mlflow_run_tagged_with_its_verdict(broken_sweep, mlflow_uri):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("posttrainllm")
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.sweep = 'failing'")
    points = {r.data.tags.get("point"): r for r in runs if r.data.tags.get("role") != "sweep"}
    assert set(points) == {"baseline", "precision-fp16", "precision-bf16"}
    assert points["precision-fp16"].data.tags["parity.verdict"] == "fail"
    assert points["precision-fp16"].info.status == "FAILED"
    assert points["baseline"].info.status == "FINISHED"
    assert not any(k.startswith("bench.triton.") for k in points["precision-fp16"].data.metrics)


def test_report_shows_the_failure_first_and_exits_1(broken_sweep):
    _, _, report = broken_sweep
    assert report.returncode == 1
    rows = [line for line in report.stdout.splitlines() if line.strip().startswith(("baseline", "precision-"))]
    assert rows[0].strip().startswith("precision-fp16") and "FAIL" in rows[0]
