"""The prepared GPU check: its plan (what the H200 run measures), and its CPU dry run: receipts as JSON, no
MLflow, big tensors removed, curves in both modes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from posttrainllm.config import PROJECT_ROOT

from posttrainllm.lab.configure import load, validate
from posttrainllm.lab import sweep
from posttrainllm.ops.registry import get_op


FP8 = "op-matmul_tile-b128_precision-fp8"


@pytest.fixture(scope="module")
def gpu_plan():
    """The gpu_check sweep's plan (a Hydra compose per point: seconds), made once for the tests that read it."""
    return sweep.plan(load(["sweep=gpu_check"]).sweep)


def test_the_gpu_plan_is_the_issues_run_one_dimension_at_a_time(gpu_plan, monkeypatch):
    """bf16 attention at head dim 128, causal then non-causal, S from 1k to 16k, forward and forward+backward;
    bf16 matmul at 4096³ and 8192³, then at 128x128x64 tiles, then fp8 there (forward only, against
    torch._scaled_mm); tile=auto last. The most important points first."""
    points = gpu_plan["points"]
    assert list(points) == ["baseline", "op-matmul", "op-matmul_tile-b128", FP8, "op-attention_noncausal",
                            "tile-auto"]
    seen = []  # the planner's rule holds: each point one change from the baseline or from an earlier point
    for spec in points.values():
        changes = spec["changes"]
        assert len(changes) <= 1 or any(set(s.items()) < set(changes.items()) and len(changes) == len(s) + 1
                                        for s in seen)
        seen.append(changes)
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
    # fp8: per-tensor scaled e4m3 at M=N=K = 4096 and 8192 on a fixed Hopper-sized tile, against torch._scaled_mm
    # (where it runs: probed on the device, absent here), every path forward-only in the microbench, trained by the fp8 recipe
    from posttrainllm.lab import approval
    from posttrainllm.ops.matmul import definition as matmul_op

    fp8 = labs[FP8]
    assert (fp8.op.name, fp8.precision.name, fp8.precision.quantize.recipe) == ("matmul", "fp8",
                                                                                 "float8_e4m3fn:tensor")
    sizes = matmul_op.Sizes.of(fp8)
    assert (sizes.m, sizes.n, sizes.k) == (4096, 4096, 4096)
    assert get_op("matmul").curve_sizes(fp8) == [4096, 8192]
    assert (fp8.tile.block_m, fp8.tile.block_n, fp8.tile.block_k) == (128, 128, 64) and not fp8.tile.autotune
    assert labs["op-matmul_tile-b128"].tile == fp8.tile and labs["op-matmul_tile-b128"].precision.name == "bf16"
    monkeypatch.setitem(matmul_op._SCALED_MM_PROBES, ("cuda", fp8.precision.quantize.recipe, "bfloat16"), None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # an H200: the Triton fp8 GEMM runs from sm_89
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    paths = get_op("matmul").paths(fp8)
    assert list(paths) == ["reference", "scaled_mm", "triton"] and paths["scaled_mm"].fn is matmul_op._scaled_mm
    assert {impl.backward for impl in paths.values()} == {"none"}
    trained = approval.estimate([fp8], train=True).train_steps  # the fp8 recipe per path, and the bf16 baseline
    assert trained == (len(get_op("matmul").train_impls(fp8)) + 1) * fp8.train.steps


@pytest.mark.slow
def test_dry_run_writes_importable_receipts(tmp_path, monkeypatch, mlflow_uri, calibration, capsys):
    out = tmp_path / "gpu"
    out.mkdir()
    shutil.copy(calibration, out / "calibration.json")  # this CPU's, reused (same fingerprint): no 12 s calibration
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([str(PROJECT_ROOT / "scripts" / "gpu-check.sh"), str(out), "--dry-run", "--no-train"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "rough_s" in done.stdout  # the per-point estimate, printed before anything runs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sweep"] == "smoke" and summary["skipped"] == [] and summary["complete"] is True
    # the smoke sweep's points, then the GPU check's fp8 point on the smoke baseline (tiny, CPU)
    assert {p: s["status"] for p, s in summary["points"].items()} == {"baseline": "pass", "precision-fp16": "pass",
                                                                      FP8: "pass"}
    assert all(s["estimated_s"] > 0 for s in summary["points"].values())
    assert summary["peaks"]["copy_bytes_per_s"] > 0
    assert done.stdout.index(f"  {FP8} ") < done.stdout.index("baseline: pass")  # estimated before anything runs
    fp8 = json.loads((out / FP8 / "receipt.json").read_text())
    assert fp8["sweep"]["changes"] == {"op": "matmul", "tile": "b128", "precision": "fp8"}
    assert (fp8["config"]["precision"]["name"], fp8["config"]["device"]["name"]) == ("fp8", "cpu")
    assert fp8["parity"]["verdict"] == "pass" and fp8["parity"]["quantization"]
    assert {name: path["verdict"] for name, path in fp8["parity"]["paths"].items()} == {"scaled_mm": "pass",
                                                                                       "triton": "pass"}
    assert fp8["kernel"]["paths"]["triton"]["launched"]["_fp8_matmul_kernel"] > 0  # through the interpreter
    assert not (out / FP8 / "reference.pt").exists() and not (out / FP8 / "kernel.pt").exists()
    bench = fp8["microbench"]
    assert [name for name, path in bench["paths"].items() if path["valid"]] == ["reference", "scaled_mm"]
    assert bench["paths"]["scaled_mm"]["forward_backward"]["valid"] is False  # forward-only
    assert "interpreter" in bench["paths"]["triton"]["reason"] and "bf16_matmul" in bench["describe"]
    curve = pd.read_csv(out / FP8 / "curve.csv")  # forward only, though bench.curve_backward is on
    assert set(curve["mode"]) == {"forward"} and set(curve["impl"]) == {"reference", "scaled_mm"}
    assert (curve["check"] == "pass").all() and sorted(set(curve["x_value"])) == [32, 64]
    assert [(c["x_name"], c["mode"]) for c in bench["curve"]["crossovers"]] == [("size", "forward")]
    for point in ("baseline", "precision-fp16"):
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
        # the compile report beside the measured times: here every Triton time is the interpreter's, so none
        rows = {r["kernel"]: r for r in summary["points"][point]["counters"]}
        assert {"_attn_fwd_kernel", "_attn_bwd_dkdv", "_attn_bwd_dq"} <= set(rows)
        assert all(r["registers"] > 0 and r["target"] == "sm90" and r["measured_ms"] is None
                   and "interpreter" in r["why_not"] for r in rows.values())
        stored = receipt["microbench"]["curve"]
        assert [(c["x_name"], c["mode"]) for c in stored["crossovers"]] == [("seq_len", "forward"),
                                                                              ("seq_len", "forward_backward")]

    from posttrainllm import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    assert cli.main(["receipt", "import", str(out)]) == 0
    assert "3 receipts in" in capsys.readouterr().out


@pytest.mark.slow
def test_budget_skips_whole_points(tmp_path, calibration):
    from posttrainllm.lab import gpucheck

    shutil.copy(calibration, tmp_path / "calibration.json")  # reused: the budget, not the calibration, is tested

    assert gpucheck.main([str(tmp_path), "--dry-run", "--no-train", "--budget-s", "0"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["points"] == {} and summary["skipped"] == ["baseline", "precision-fp16", FP8]


def test_sdpa_backends_are_probed_at_the_kernel_stages_lengths_on_cuda(gpu_plan):
    """On the GPU a backend is probed at every length the kernel stage runs (S=1, S=1000 are off every tile), so
    one that refuses an edge length is absent, not a failed path; the CPU keeps its one small probe."""
    from posttrainllm.ops.attention.definition import _probe_lengths

    lab = validate(gpu_plan["points"]["baseline"]["config"])
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
