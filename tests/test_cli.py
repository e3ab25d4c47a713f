"""`posttrainllm bench` and `bench-train` in-process: the table, the receipt, MLflow, exit codes."""

import contextlib
import dataclasses
import io
import json
import re
import shutil

import pytest

from posttrainllm import cli
from posttrainllm.ops.attention import definition as attention


@pytest.fixture
def workdir(tmp_path, monkeypatch, mlflow_uri, calibration):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    (tmp_path / "runs" / "bench").mkdir(parents=True)
    shutil.copy(calibration, tmp_path / "runs" / "bench" / "calibration.json")
    return tmp_path


QUICK = ["device=cpu", "parity.seeds=[0]", "shape.edge_seq_lens=[37]", "bench.reps=3", "bench.min_time_s=0",
         "shape.curve=[64,128]"]
# where the Triton path (through the interpreter here: most of a point's time) is not what a test is about
SDPA_ONLY = "op.only=[sdpa]"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, mlflow_uri, calibration):
    """One `bench-train` of QUICK, logged to MLflow, that the table, receipt and drift tests all read (each point
    runs the Triton path through the interpreter: most of its time): (folder, stdout)."""
    root = tmp_path_factory.mktemp("trained")
    (root / "runs" / "bench").mkdir(parents=True)
    shutil.copy(calibration, root / "runs" / "bench" / "calibration.json")
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as out:
        patch.chdir(root)
        patch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
        # the smoke sweep's training size (a quarter of the default's tokens): its Triton steps are interpreted
        code = cli.main(["bench-train", *QUICK, "train.steps=3", "train.warmup_steps=1", "train.batch_size=2",
                         "train.seq_len=32", "run.name=cli-bench"])
    assert code == 0, out.getvalue()[-3000:]
    return root / "runs/bench/cli-bench", out.getvalue()


def test_bench_prints_table_and_logs_a_receipt(trained, mlflow_uri):
    from mlflow.tracking import MlflowClient

    folder, out = trained
    assert "parity pass" in out and "interpreted: not speed" in out
    # where the loop's time went, each part and the total (the start-up: this test process's age, so any figure)
    times = re.fullmatch(r"times: (.+); (\d+\.\d) s in all",
                         next(line for line in out.splitlines() if line.startswith("times: ")))
    parts = {name: float(s) for name, s in (part.rsplit(" ", 2)[:2] for part in times[1].split(", "))}
    assert list(parts)[-7:] == ["calibration", "reference", "kernel", "parity", "microbench", "bench-train", "receipt"]
    assert abs(sum(parts.values()) - float(times[2])) < 0.1 * len(parts) and parts["kernel"] > 0
    receipt = json.loads((folder / "receipt.json").read_text())
    assert receipt["kernel"]["paths"]["triton"]["geometry"]["grid"] == [2, 4]  # ceil(S=128 / BLOCK_Q=64) x B*H
    assert receipt["microbench"]["paths"]["triton"]["valid"] is False
    assert "speedup_vs_reference" not in receipt["microbench"]["paths"]["triton"]
    assert receipt["microbench"]["paths"]["sdpa"]["valid"] is True
    runs = MlflowClient(tracking_uri=mlflow_uri).search_runs(
        [MlflowClient(tracking_uri=mlflow_uri).get_experiment_by_name("posttrainllm").experiment_id],
        filter_string="tags.point = 'cli-bench'")
    assert len(runs) == 1 and runs[0].data.params["tile.block_q"] == "64"


def test_broken_path_gets_no_speed_and_exit_1(workdir, monkeypatch, capsys):
    sdpa = attention.IMPLS["sdpa"]
    halved = dataclasses.replace(sdpa, fn=lambda x, cfg: {"out": sdpa.fn(x, cfg)["out"] * 0.5})
    monkeypatch.setitem(attention.IMPLS, "sdpa", halved)
    assert cli.main(["bench-train", *QUICK, SDPA_ONLY, "train.steps=2", "train.warmup_steps=1", "run.name=broken",
                     "run.log_mlflow=false"]) == 1
    captured = capsys.readouterr()
    assert "contract broken: broken: sdpa broke the fp32 contract" in captured.err
    receipt = json.loads((workdir / "runs/bench/broken/receipt.json").read_text())
    assert receipt["parity"]["paths"]["sdpa"]["verdict"] == "fail"
    assert receipt["microbench"]["paths"]["sdpa"] == {"valid": False, "reason": "failed parity: no speed number"}
    assert "sdpa" not in receipt["microbench"]["curve"]["crossover_vs_reference"]
    assert receipt["microbench"]["curve"]["skipped"]["sdpa"] == "failed parity: no speed number"
    # bench-train does not train a path that failed parity: no step time, no tokens/s, no loss for it
    assert "sdpa" not in receipt["bench_train"]["impls"]
    assert receipt["bench_train"]["skipped"] == {"sdpa": "failed parity: no speed number"}
    metrics = json.loads((workdir / "runs/bench/broken/metrics.json").read_text())
    assert metrics["parity.sdpa.pass"] == 0.0
    assert not any(k.startswith(("bench.sdpa.", "train.sdpa.", "curve.sdpa.")) for k in metrics)
    curve = (workdir / "runs/bench/broken/curve.csv").read_text()
    assert ",sdpa," not in curve


def test_multirun_over_one_dimension_names_each_point(workdir, capsys):
    assert cli.main(["bench", "-m", *QUICK, SDPA_ONLY, "precision=fp32,fp16", "run.log_mlflow=false"]) == 0
    names = sorted(p.name for p in (workdir / "runs/bench").iterdir() if p.is_dir())
    # QUICK's overrides are too long for a name: the dimensions' choices, then a hash of them all
    assert [n.rpartition("-")[0] for n in names] == ["precision=fp16,device=cpu", "precision=fp32,device=cpu"]
    for name in names:
        receipt = json.loads((workdir / "runs/bench" / name / "receipt.json").read_text())
        assert {*QUICK, f"precision={receipt['config']['precision']['name']}"} <= set(receipt["overrides"])


def test_op_only_runs_the_named_paths_and_the_reference(workdir, capsys):
    assert cli.main(["bench", *QUICK, "op.only=[sdpa]", "run.name=only", "run.log_mlflow=false"]) == 0
    point = workdir / "runs/bench/only"
    assert set(json.loads((point / "parity.json").read_text())["paths"]) == {"sdpa"}
    assert set(json.loads((point / "microbench.json").read_text())["paths"]) == {"reference", "sdpa"}
    receipt = json.loads((point / "receipt.json").read_text())
    assert set(receipt["kernel"]["paths"]) == {"sdpa"}
    assert receipt["config"]["op"]["only"] == ["sdpa"] and receipt["microbench"]["paths"]["sdpa"]["valid"]


def test_op_only_with_an_unknown_name_names_the_valid_ones(workdir, capsys):
    assert cli.main(["bench", *QUICK, "op.only=[sdpa,trtion]"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "op.only: 'trtion' is not a path of this attention point" in err
    assert "valid choices are reference, sdpa" in err and "triton" in err
    assert [p.name for p in (workdir / "runs/bench").iterdir()] == ["calibration.json"]  # nothing written


def test_many_long_overrides_make_a_short_folder_and_the_receipt_holds_them(workdir, capsys):
    """Five user paths of long specs (the issue: a folder named after every override, over 255 characters)."""
    from posttrainllm.config import PROJECT_ROOT

    example = PROJECT_ROOT / "examples" / "torch_attention.py"
    specs = [f"{name}={example}:sdpa_attention" for name in ("base", "memo", "tiled", "split", "fused")]
    user = "op.user_impls=[" + ",".join(f'"{spec}"' for spec in specs) + "]"  # quoted: Hydra reads `=` in a value so
    assert cli.main(["bench", *QUICK, "op=attention", user, "op.only=[base]", "run.log_mlflow=false"]) == 0
    [folder] = [p for p in (workdir / "runs/bench").iterdir() if p.is_dir()]
    assert len(folder.name) < 64 and folder.name.startswith("op=attention,device=cpu-")
    receipt = json.loads((folder / "receipt.json").read_text())
    assert user in receipt["overrides"] and receipt["config"]["op"]["user_impls"] == specs
    assert receipt["parity"]["paths"]["base"]["verdict"] == "pass" and set(receipt["parity"]["paths"]) == {"base"}


def test_a_point_name_is_short_and_differs_with_its_overrides():
    specs = ",".join(f'"{n}=kernels/attention_{n}_with_a_long_name.py:attention"' for n in ("a", "b", "c", "d", "e"))
    one = ["op=attention", f"op.user_impls=[{specs}]", "run.name=x"]
    other = [*one[:2], "op.only=[a]"]
    exclude = ["run.name"]
    names = {cli.point_name(one, exclude, "bench"), cli.point_name(other, exclude, "bench"),
             cli.point_name(one[1:2], exclude, "bench")}
    assert len(names) == 3 and all(len(n) < 64 for n in names)
    assert cli.point_name(one[1:2], exclude, "bench").startswith("bench-")  # no dimension chosen: the default
    assert cli.point_name(["precision=bf16", "run.name=x"], exclude, "bench") == "precision=bf16"  # short: as is
    assert cli.point_name([], exclude, "train") == "train"


def test_bench_train_reports_drift_within_contract(trained):
    folder, out = trained
    assert "drift limit 0.0001" in out and "reference" in out and "sdpa" in out
    result = json.loads((folder / "bench_train.json").read_text())
    assert result["drift_verdict"] == {"sdpa": "pass", "triton": "pass"}  # triton: through the interpreter on CPU
    assert len(result["impls"]["reference"]["losses"]) == 3


def test_bench_train_drift_beyond_contract_fails(workdir, monkeypatch, capsys):
    from posttrainllm.ops.base import ModelHook

    # parity checks the registry function; here only the model's hook is wrong, so only drift can catch it
    hook = attention.OP.model_hook

    def wrong_scale(impl, cfg):
        right = hook.fill(impl, cfg)
        return (lambda q, k, v: 1.5 * right(q, k, v)) if impl.name == "sdpa" else right

    monkeypatch.setattr(attention.OP, "model_hook", ModelHook(hook.slot, wrong_scale))
    args = ["bench-train", *QUICK, SDPA_ONLY, "train.steps=3", "train.warmup_steps=1", "run.log_mlflow=false"]
    assert cli.main(args) == 1
    assert "loss drift of sdpa exceeds train_loss_drift=0.0001" in capsys.readouterr().err


def test_receipt_import_logs_json_made_without_mlflow_once(workdir, mlflow_uri, capsys):
    from mlflow.tracking import MlflowClient

    assert cli.main(["bench", *QUICK, SDPA_ONLY, "run.name=offline", "run.log_mlflow=false"]) == 0
    folder = workdir / "runs" / "bench"
    assert cli.main(["receipt", "import", str(folder)]) == 0
    assert cli.main(["receipt", "import", str(folder)]) == 0  # a second import adds nothing
    client = MlflowClient(tracking_uri=mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("posttrainllm").experiment_id],
                              filter_string="tags.point = 'offline'")
    assert len(runs) == 1
    assert "parity.json" in {a.path for a in client.list_artifacts(runs[0].info.run_id)}


def test_receipt_import_refuses_a_missing_folder(workdir, capsys):
    assert cli.main(["receipt", "import", str(workdir / "nope")]) == 2
    assert "usage: posttrainllm receipt import FOLDER" in capsys.readouterr().err


def test_a_path_that_cannot_run_here_is_a_line_apart_and_exit_0(workdir, capsys):
    """track/failures.py: an import needing a GPU driver is no broken contract; the console names it apart, located,
    with the traceback's file beside the receipt."""
    kernel = workdir / "needs_gpu.py"
    kernel.write_text("import triton\n\ntriton.runtime.driver.active.get_current_device()\n\n\n"
                      "def matmul(a, b):\n    return a @ b\n")
    assert cli.main(["bench", "op=matmul", "device=cpu", "parity.seeds=[0]", "shape.ops.matmul.edge=[]",
                     "shape.ops.matmul.m=64",
                     "shape.ops.matmul.n=64", "shape.ops.matmul.k=64", "shape.ops.matmul.curve=[32,64]",
                     "bench.reps=3", "bench.min_time_s=0",
                     f"op.user_impls=[{kernel}:matmul]", "op.only=[matmul]", "run.name=apart",
                     "run.log_mlflow=false"]) == 0
    captured = capsys.readouterr()
    assert ("posttrainllm: apart: 1 cannot run here (not a broken contract): matmul (Triton found no GPU driver "
            "(0 active drivers); runs on a GPU with its driver)") in captured.err
    assert "contract broken" not in captured.err
    assert "parity pass (1 cannot run here, apart: matmul)" in captured.out
    assert f"raised RuntimeError at {kernel}:3" in captured.out
    receipt = json.loads((workdir / "runs/bench/apart/receipt.json").read_text())
    mine = receipt["parity"]["paths"]["matmul"]
    assert mine["verdict"] == "cannot run here" and mine["error"]["where"]["line"] == 3
    assert (workdir / "runs/bench/apart" / mine["error"]["traceback"]).is_file()
    assert receipt["kernel"]["paths"]["matmul"]["failure"] == mine["error"]
    assert receipt["microbench"]["paths"]["matmul"]["reason"].startswith("cannot run here: Triton found no GPU driver")
