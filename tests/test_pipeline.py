"""The whole pipeline: `dvc repro` of a small sweep in a copy of the project, receipts read back from MLflow.

The copy carries a planted fp16-only bug in the Triton attention (its output scaled by 1.01 in fp16 only),
so one point of the smoke sweep breaks its contract. A failure is evidence: the sweep must run to the end,
every point keeps its receipt and MLflow run (the failing one tagged with its verdict and first failing
case), the failed path has no speed anywhere, and `posttrainllm report` lists it first and exits 1.
"""

import json

import sys

import pytest
import yaml
from conftest import run_command, short_calibration

from posttrainllm.track.stamp import file_sha256

pytestmark = pytest.mark.slow


ORIGINAL = "return o.to(q.dtype), lse"
PLANTED = "return (o * (1.01 if q.dtype == torch.float16 else 1.0)).to(q.dtype), lse"


@pytest.fixture(scope="module")
def project(project_copy):
    """A committed copy of the project, the fp16-only bug planted, the smoke sweep planned and reproduced."""
    def plant(root):
        kernel = root / "posttrainllm" / "ops" / "attention" / "kernels.py"
        source = kernel.read_text()
        assert source.count(ORIGINAL) == 1, "the planted bug's target line moved"
        kernel.write_text(source.replace(ORIGINAL, PLANTED))
        # the draft heads small and the base a sixth of its steps (600: a third of this module's time; 200 steps
        # 40 s of it): no test here reads the heads' figures, and the quality-gate test below holds on a 100-step
        # base too
        heads = root / "conf" / "heads" / "k3.yaml"
        config = yaml.safe_load(heads.read_text())
        config.update(steps=20, train_prompts=8, continuation_len=24, eval_prompts=1, new_tokens=16, warmup_prompts=0)
        config["base"].update(steps=100, threads=1)  # one thread: the other test worker holds the second core
        heads.write_text(yaml.safe_dump(config, sort_keys=False))
        short_calibration(root)  # no test here judges the peaks
        # attention's cases shorter (S=128 and 100 were half of each kernel stage): the planted bug fails at any length
        sweep = root / "conf" / "sweep" / "smoke.yaml"
        plan = yaml.safe_load(sweep.read_text())
        plan["overrides"] += ["shape.seq_len=64", "shape.edge_seq_lens=[1,37]"]
        sweep.write_text(yaml.safe_dump(plan, sort_keys=False))

    root, env = project_copy("project", sweep="smoke", edit=plant)
    repro = run_command(["dvc", "repro"], root, env)  # exit 0: a broken contract is recorded, not fatal
    return root, env, repro


def test_every_stage_of_every_point_ran(project):
    root, _, repro = project
    for point in ("baseline", "precision-fp16"):
        for stage in ("reference", "kernel", "parity", "microbench", "bench_train", "receipt"):
            assert f"'{stage}@{point}'" in repro.stdout
        receipt = json.loads((root / "runs" / point / "receipt.json").read_text())
        assert receipt["parity"]["verdict"] == ("fail" if point == "precision-fp16" else "pass")
        assert receipt["sweep"]["name"] == "smoke"
        assert receipt["bench_train"]["impls"]["sdpa"]["losses"]
        assert set(receipt["stamps"]) == {"reference", "kernel", "parity", "microbench", "bench_train"}
        assert (root / "runs" / point / "stamps" / "receipt.json").exists()
        # what the receipt combined is what each stage wrote (rule "integrity"), checked on what DVC left
        assert receipt["integrity"]["problems"] == []
        assert set(receipt["stamps"]["microbench"]["outputs"]) == {"microbench.json", "timings.csv", "curve.csv"}
        calibration = file_sha256(root / "runs" / "calibration.json")
        inputs = json.loads((root / "runs" / "inputs" / point / "microbench.json").read_text())
        assert inputs["reads"] == {"runs/calibration.json": calibration}
        assert receipt["microbench"]["calibration"] == {"sha256": calibration, "problem": None}
        # the raising paths' tracebacks are the kernel stage's DVC out (restored with its other outs) and the
        # receipt's dep: a folder, empty here, since no path raised
        lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
        kernel_outs = {out["path"]: out for out in lock[f"kernel@{point}"]["outs"]}
        assert kernel_outs[f"runs/{point}/tracebacks"]["nfiles"] == 0
        assert f"runs/{point}/tracebacks" in {dep["path"] for dep in lock[f"receipt@{point}"]["deps"]}


def test_the_kernel_stage_compiled_the_triton_kernels_for_sm90(project):
    """What dvc repro left: each point's receipt holds its Triton kernels compiled for the first compile target."""
    root, _, _ = project
    for point in ("baseline", "precision-fp16"):
        receipt = json.loads((root / "runs" / point / "receipt.json").read_text())
        section = receipt["kernel"]["compile"]
        assert section["targets"] == ["sm90"] and not section.get("error"), section.get("error")
        rows = [r for r in section["rows"] if r["path"] == "triton"]
        assert {r["kernel"] for r in rows} >= {"_attn_fwd_kernel", "_attn_bwd_dkdv", "_attn_bwd_dq"}
        assert all(r["fits"] and r["registers"] > 0 for r in rows), rows


def test_the_sweep_says_where_it_stands_and_the_progress_command_agrees(project):
    root, env, repro = project
    started = [line for line in repro.stderr.splitlines() if line.startswith("posttrainllm: ") and "... [sweep: " in line]
    assert len(started) == 12  # every point stage said so when it started
    assert started[0].endswith("[sweep: 0/2 points done, 0/12 stages; no estimate yet (none of the stages left "
                               "has a stamp to go by)]")
    assert "1/12 stages; at least" in started[1]  # estimated from the first stage's stamp, the others not yet
    shown = run_command([sys.executable, "-m", "posttrainllm", "progress"], root, env).stdout.splitlines()
    assert shown[-1] == "2/2 points done, 12/12 stages"
    assert shown[0].split() == ["baseline", "reference", "kernel", "parity", "microbench", "bench_train", "receipt"]


def test_receipts_are_in_mlflow_nested_under_one_sweep_run(project, mlflow_uri):
    from mlflow.tracking import MlflowClient

    root, env, _ = project
    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("posttrainllm")
    head = run_command(["git", "rev-parse", "HEAD"], root, env).stdout.strip()
    runs = client.search_runs([experiment.experiment_id],
                              filter_string=f"tags.sweep = 'smoke' and tags.`git.revision` = '{head}'")
    children = {r.data.tags["point"]: r for r in runs}
    assert set(children) == {"baseline", "precision-fp16"}
    parent_ids = {r.data.tags["mlflow.parentRunId"] for r in runs}
    assert len(parent_ids) == 1
    assert client.get_run(parent_ids.pop()).data.tags["role"] == "sweep"
    assert children["baseline"].info.status == "FINISHED" and children["precision-fp16"].info.status == "FAILED"
    assert children["precision-fp16"].data.tags["parity.verdict"] == "fail"
    for point, run in children.items():
        tags, metrics, params = run.data.tags, run.data.metrics, run.data.params
        assert tags["git.dirty"] == "False"
        assert tags["device"] == "cpu" and tags["triton.interpreted"] == "True"
        assert params["precision.name"] == ("fp16" if point == "precision-fp16" else "fp32")
        assert metrics["parity.triton.pass"] == (0.0 if point == "precision-fp16" else 1.0)
        assert metrics["parity.sdpa.pass"] == 1.0
        assert metrics["bench.sdpa.median_ms"] > 0 and metrics["bench.sdpa.speedup_vs_reference"] > 0
        assert not any(k.startswith("bench.triton.") for k in metrics), "interpreter timings are not speed"
        assert "train.sdpa.loss_drift" in metrics
        history = client.get_metric_history(run.info.run_id, "train.sdpa.loss")
        assert len(history) == 4
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"receipt.json", "timings.csv", "parity.json", "config.yaml"} <= artifacts


def test_editing_kernel_code_reruns_kernel_and_later_stages_but_not_reference(project):
    root, env, _ = project
    kernel_file = root / "posttrainllm" / "ops" / "attention" / "kernels.py"
    original = kernel_file.read_text()
    try:
        kernel_file.write_text(original + "\n# edited\n")
        dry = run_command(["dvc", "repro", "--dry"], root, env).stdout
    finally:
        kernel_file.write_text(original)
    for point in ("baseline", "precision-fp16"):
        assert f"Running stage 'kernel@{point}'" in dry
        assert f"Running stage 'reference@{point}'" not in dry
    assert "Running stage 'device'" in dry  # always re-fingerprinted; unchanged output stops it there


def test_unknown_point_is_refused(project):
    root, env, _ = project
    done = run_command(["python", "pipelines/reference.py", "precision-fp8"], root, env, check=False)
    assert done.returncode == 2
    assert "unknown point 'precision-fp8': params.yaml has baseline, precision-fp16" in done.stderr


def test_plots_render_offline_and_report_is_written(project):
    root, env, _ = project
    run_command(["dvc", "plots", "show"], root, env)
    page = (root / "dvc_plots" / "index.html").read_text()
    for name in ("time_vs_size", "memory_vs_size", "roofline"):
        assert f"runs_baseline_{name}.png" in page
    assert "https://" not in page  # no CDN: PNGs render offline
    report = run_command([sys.executable, "-m", "posttrainllm", "report"], root, env, check=False)
    assert report.returncode == 1  # a point failed: `dvc repro && posttrainllm report` fails a CI job
    rows = [line.strip() for line in report.stdout.splitlines() if line.strip().startswith(("baseline", "precision-"))]
    assert rows[0].startswith("precision-fp16") and "FAIL" in rows[0] and "triton:fail" in rows[0]
    assert rows[1].startswith("baseline") and "triton:pass" in rows[1]  # our path's verdict (--wide: every path's)
    assert max(len(line) for line in report.stdout.splitlines()) <= 160
    assert (root / "runs" / "report.md").read_text().startswith("| point | verdict | first_failure | change |")
    assert 'src="baseline/roofline.png"' in (root / "runs" / "report.html").read_text()


def test_the_sweep_runs_on_past_a_broken_contract(project):
    root, _, repro = project
    assert "recorded, sweep continues" in repro.stderr
    failed = json.loads((root / "runs" / "precision-fp16" / "receipt.json").read_text())
    assert failed["parity"]["first_failure"].startswith("triton: ")


def test_the_failed_path_has_no_speed_anywhere(project):
    root, _, _ = project
    point = root / "runs" / "precision-fp16"
    receipt = json.loads((point / "receipt.json").read_text())
    assert receipt["microbench"]["paths"]["triton"] == {"valid": False, "reason": "failed parity: no speed number"}
    assert "triton" not in receipt["bench_train"]["impls"]
    assert receipt["bench_train"]["skipped"] == {"triton": "failed parity: no speed number"}
    assert ",triton," not in (point / "curve.csv").read_text()
    assert "triton" not in (point / "timings.csv").read_text()
    metrics = json.loads((point / "metrics.json").read_text())
    assert not any(k.startswith(("bench.triton.", "train.triton.", "curve.triton.")) for k in metrics)


def test_the_quality_gates_greedy_check_catches_a_scale_bug_on_the_trained_base(project):
    """The base `dvc repro` trained (train_base, 100 steps here): greedy tokens with fp8 linear layers agree with
    bf16 ones above the gate's floor (conf/precision/fp8.yaml), and below it with the scale applied twice."""
    import torch
    import torch.nn.functional as F

    from posttrainllm.lab.configure import load
    from posttrainllm.model import quality
    from posttrainllm.model.corpus import load_corpus, prompts, split_tail
    from posttrainllm.ops.matmul import reference as matmul_reference
    from posttrainllm.ops import quantize

    root, _, _ = project
    gate = load(["op=matmul", "precision=fp8"]).precision.quantize.quality
    base, _ = quality.load_trained_base(root / "runs" / "heads" / "base")
    held = prompts(split_tail(load_corpus(), gate.heldout_frac)[1], gate.prompts, gate.prompt_len, "eval")

    def fp8(gemm):
        return lambda x, w: quantize.fp8_linear(x.to(torch.bfloat16), w.to(torch.bfloat16), gemm, rowwise=False)

    found = quality.greedy_section(base, held, gate.new_tokens, {
        "fp8": fp8(matmul_reference.fp8_matmul),
        "scale twice": fp8(lambda a, a_s, b, b_s: matmul_reference.fp8_matmul(a, a_s * a_s, b, b_s))}, F.linear)["variants"]
    # floor 0.6; at 100 steps measured 1.00 and 0.44 (200 steps: 1.00 and 0.28; 600: 0.80 tensorwise)
    assert found["fp8"]["agreement"] >= gate.min_greedy_agreement
    assert found["scale twice"]["agreement"] < gate.min_greedy_agreement


POINTS = ("baseline", "precision-fp16")


def test_compare_reads_the_sweep_folder_dvc_left(project, tmp_path):
    """runs/ as `dvc repro` leaves it (runs/inputs/<point>/receipt.json, stamps/ included) against itself."""
    root, env, _ = project
    assert (root / "runs" / "inputs" / "baseline" / "receipt.json").exists()  # the file that once looked like a point
    done = run_command([sys.executable, "-m", "posttrainllm", "compare", "runs", "runs", "--out",
                        str(tmp_path / "compare.md")], root, env, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for point in POINTS:
        rows = [line for line in done.stdout.splitlines() if line.strip().startswith(point + " ")]
        assert any(" time forward " in r for r in rows) and any(" parity out " in r for r in rows), done.stdout
    assert "0 regression(s)" in done.stdout and "inputs" not in done.stdout + done.stderr


def test_import_logs_every_point_of_the_sweep_folder(project):
    root, env, _ = project
    done = run_command([sys.executable, "-m", "posttrainllm", "receipt", "import", "runs"], root, env, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    logged = [line.split(": mlflow run ")[0] for line in done.stdout.splitlines() if ": mlflow run " in line]
    assert {f"runs/{point}/receipt.json" for point in POINTS} <= set(logged), done.stdout
    assert not any("/inputs/" in path or "/stamps/" in path for path in logged)
    assert "bad receipt" not in done.stderr


def test_replay_says_each_point_adds_up(project, tmp_path):
    root, env, _ = project
    for point in POINTS:
        done = run_command([sys.executable, "-m", "posttrainllm", "replay", f"runs/{point}/receipt.json", "--out",
                            str(tmp_path / point)], root, env, check=False)
        assert done.returncode == 0 and "verified: ok" in done.stdout, done.stdout + done.stderr
        assert "does not add up" not in done.stderr
        assert json.loads((root / "runs" / point / "receipt.json").read_text())["bench_train"]["noise"]["band"] >= 1
