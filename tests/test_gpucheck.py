"""The prepared GPU check: its plan (what the H200 run measures), and its CPU dry run: receipts as JSON, no
MLflow, big tensors removed, curves in both modes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from posttrainllm.config import PROJECT_ROOT

from posttrainllm.lab.configure import load, validate
from posttrainllm.lab import sweep
from posttrainllm.opdefs import get_op


def test_the_gpu_plan_is_the_issues_run_one_dimension_at_a_time():
    """bf16 attention at head dim 128, causal then non-causal, S from 1k to 16k, forward and forward+backward;
    bf16 matmul at 4096³ and 8192³; tile=auto last. The most important points first."""
    points = sweep.plan(load(["sweep=gpu_check"]).sweep)["points"]
    assert list(points) == ["baseline", "op-matmul", "op-attention_noncausal", "tile-auto"]
    assert all(len(spec["changes"]) <= 1 for spec in points.values())  # the planner's rule holds
    labs = {name: validate(spec["config"]) for name, spec in points.items()}
    for lab in labs.values():
        assert (lab.precision.dtype, lab.device.name, lab.bench.curve_backward) == ("bfloat16", "cuda", True)
    attention = {name: lab for name, lab in labs.items() if lab.op.name == "attention"}
    assert {name: lab.op.causal for name, lab in attention.items()} == {
        "baseline": True, "op-attention_noncausal": False, "tile-auto": True}
    for lab in attention.values():
        assert lab.architecture.head_dim == 128 and lab.architecture.n_heads == lab.architecture.n_kv_heads
        assert get_op("attention").curve_sizes(lab) == [1024, 2048, 4096, 8192, 16384]
    matmul = labs["op-matmul"]
    assert get_op("matmul").curve_sizes(matmul) == [4096, 8192] and "torch" in get_op("matmul").paths(matmul)
    assert labs["tile-auto"].tile.autotune and not labs["baseline"].tile.autotune


@pytest.mark.slow
def test_dry_run_writes_importable_receipts(tmp_path, monkeypatch, mlflow_uri, capsys):
    out = tmp_path / "gpu"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([str(PROJECT_ROOT / "scripts" / "gpu-check.sh"), str(out), "--dry-run", "--no-train"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "rough_s" in done.stdout  # the per-point estimate, printed before anything runs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sweep"] == "smoke" and summary["skipped"] == [] and summary["complete"] is True
    assert {p: s["status"] for p, s in summary["points"].items()} == {"baseline": "pass", "precision-fp16": "pass"}
    assert all(s["estimated_s"] > 0 for s in summary["points"].values())
    assert summary["peaks"]["copy_bytes_per_s"] > 0
    for point in summary["points"]:
        folder = out / point
        receipt = json.loads((folder / "receipt.json").read_text())
        assert receipt["parity"]["verdict"] == "pass" and receipt["sweep"]["name"] == "smoke"
        assert not (folder / "reference.pt").exists() and not (folder / "kernel.pt").exists()
        assert (folder / "roofline.png").exists() and (folder / "time_vs_size.png").exists()
        # every timed path over every size, in both modes, checked first; a crossover per mode
        curve = pd.read_csv(folder / "curve.csv")
        timed = set(curve["impl"])
        assert "reference" in timed and "sdpa" in timed
        for mode in ("forward", "forward_backward"):
            rows = curve[curve["mode"] == mode]
            assert set(rows["impl"]) == timed and sorted(set(rows["x_value"])) == [64, 128, 256, 512]
            assert rows["valid"].all() and (rows["check"] == "pass").all()
        backward, forward = (curve[curve["mode"] == m].set_index(["impl", "x_value"]) for m in
                             ("forward_backward", "forward"))
        assert (backward["flops"] > forward["flops"]).all()  # forward + backward: 3.5x the forward FLOPs
        stored = receipt["microbench"]["curve"]
        assert [(c["x_name"], c["mode"]) for c in stored["crossovers"]] == [("seq_len", "forward"),
                                                                              ("seq_len", "forward_backward")]

    from posttrainllm import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    assert cli.main(["receipt", "import", str(out)]) == 0
    assert "2 receipts in" in capsys.readouterr().out


@pytest.mark.slow
def test_budget_skips_whole_points(tmp_path):
    from posttrainllm.lab import gpucheck

    assert gpucheck.main([str(tmp_path), "--dry-run", "--no-train", "--budget-s", "0"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["points"] == {} and summary["skipped"] == ["baseline", "precision-fp16"]


def test_sdpa_backends_are_probed_at_the_kernel_stages_lengths_on_cuda():
    """On the GPU a backend is probed at every length the kernel stage runs (S=1, S=1000 are off every tile), so
    one that refuses an edge length is absent, not a failed path; the CPU keeps its one small probe."""
    from posttrainllm.opdefs.attention import _probe_lengths

    lab = validate(sweep.plan(load(["sweep=gpu_check"]).sweep)["points"]["baseline"]["config"])
    assert _probe_lengths(lab, "cuda") == (1, 64, 1000, 4096)
    assert _probe_lengths(lab, "cpu") == (64,)


def test_gpu_wheels_install_and_import_as_gpu_check_does(tmp_path):
    """scripts/gpu-wheels.sh --offline: hydra-core, omegaconf and antlr4 repacked from this environment, then
    installed with gpu-check.sh's pip flags into a folder and imported from there with posttrainllm.lab.gpucheck."""
    import importlib.metadata as md

    for name in ("hydra-core", "omegaconf", "antlr4-python3-runtime"):
        try:
            if md.distribution(name).files is None:
                pytest.skip(f"{name} is installed without a RECORD: nothing to repack offline")
        except md.PackageNotFoundError:
            pytest.skip(f"{name} is not installed here")
    out = tmp_path / "whl"
    done = subprocess.run(["bash", str(PROJECT_ROOT / "scripts" / "gpu-wheels.sh"), str(out), "--offline"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name.split("-")[0] for p in out.glob("*.whl")) == ["antlr4_python3_runtime", "hydra_core",
                                                                       "omegaconf"]
    assert "installs and imports as scripts/gpu-check.sh does" in done.stdout
