"""The prepared GPU check in its CPU dry-run mode: receipts as JSON, no MLflow, big tensors removed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrainllm.config import PROJECT_ROOT

pytestmark = pytest.mark.slow


def test_dry_run_writes_importable_receipts(tmp_path, monkeypatch, mlflow_uri, capsys):
    out = tmp_path / "gpu"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([str(PROJECT_ROOT / "scripts" / "gpu-check.sh"), str(out), "--dry-run", "--no-train"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sweep"] == "smoke" and summary["skipped"] == []
    assert {p: s["status"] for p, s in summary["points"].items()} == {"baseline": "pass", "precision-fp16": "pass"}
    assert summary["peaks"]["copy_bytes_per_s"] > 0
    for point in summary["points"]:
        folder = out / point
        receipt = json.loads((folder / "receipt.json").read_text())
        assert receipt["parity"]["verdict"] == "pass" and receipt["sweep"]["name"] == "smoke"
        assert not (folder / "reference.pt").exists() and not (folder / "kernel.pt").exists()
        assert (folder / "curve.csv").exists() and (folder / "roofline.png").exists()

    from posttrainllm import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    assert cli.main(["receipt", "import", str(out)]) == 0
    assert "2 receipts in" in capsys.readouterr().out


def test_budget_skips_whole_points(tmp_path):
    from posttrainllm.lab import gpucheck

    assert gpucheck.main([str(tmp_path), "--dry-run", "--no-train", "--budget-s", "0"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["points"] == {} and summary["skipped"] == ["baseline", "precision-fp16"]
