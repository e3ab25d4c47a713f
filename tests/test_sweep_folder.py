"""A sweep's own runs/ folder, as `dvc repro` leaves it (stamps included), read by replay, compare and import.

The folder is made by the real stage code: `posttrainllm sweep sweep=smoke` (shrunk), then every stage of
every point through pipelines' `run_stage`, as `dvc repro` runs `python pipelines/<stage>.py POINT`, with
MLflow absent (a GPU node: receipts as JSON only). Each point leaves `stamps/<stage>.json`, among them
`stamps/receipt.json`, the receipt stage's stamp, which is not a receipt; the `inputs` stage leaves
`runs/inputs/<point>/<stage>.json`, `receipt.json` among them, which is not one either. Beside the points, a draft-heads
receipt (`runs/heads/k1/`, receipt.build_heads from small reports: the heads stages train a model) with its
stamps, as the heads stages leave it.
"""

import json
import shutil
import uuid

from pathlib import Path

import pytest

import posttrainllm
from posttrainllm import cli
from posttrainllm.lab.sweep import write_inputs
from posttrainllm.track import receipt as receipts

POINTS = ("baseline", "precision-fp16")
STAGES = ("reference", "kernel", "parity", "microbench", "bench_train", "receipt")
# the smoke sweep, smaller still: both points' six stages take ~30 s on 2 shared cores
SMALL = ("sweep.overrides=['train.steps=2','train.warmup_steps=1','train.interpreted_steps=1','train.seq_len=16',"
         "'train.batch_size=1','bench.reps=3','bench.min_time_s=0.0','parity.seeds=[0]','shape.seq_len=64',"
         "'shape.curve=[32,64]','shape.edge_seq_lens=[37]']")


def _heads_receipt(runs):
    """runs/heads/k1/: receipt.json and metrics.json as the decode stage writes them, and the heads stages' stamps."""
    from posttrainllm.lab.configure import load
    from posttrainllm.track import stamp

    cfg = load(["heads=k1", "device=cpu", f"heads.out_dir={runs / 'heads'}"])
    folder = runs / "heads" / "k1"
    base = {"heldout_loss": 2.5, "final_train_loss": 2.4, "train_s": 1.0, "losses": [3.0 - i / 100 for i in range(60)]}
    heads = {"num_heads": 1, "losses": [4.0, 3.5], "heldout_accuracy": [{"top1": 0.5}]}
    stamp.write_stage_stamp("train_base", cfg, None, folder=runs / "heads" / "base", point="heads-base")
    stamp.write_stage_stamp("train_heads", cfg, None, folder=folder, point="heads-k1")
    receipts.build_heads(cfg, folder, base, heads, None, stamp.read_stamps(folder))
    stamp.write_stage_stamp("decode", cfg, None, folder=folder, point="heads-k1")  # after the receipt, as in dvc


@pytest.fixture(scope="module")
def runs(sweep_runs):
    """The sweep's runs/ folder: built once a session (conftest.py sweep_runs) for this file and test_report_html."""
    return sweep_runs


def build_runs(root: Path, calibration: Path) -> Path:
    """root/runs/ of the shrunk smoke sweep, every stage of every point run as `dvc repro` runs it."""
    from posttrainllm.lab.pipeline import run_stage

    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setattr(receipts, "mlflow_available", lambda: False)  # JSON only, to be imported later
        assert cli.main(["sweep", "sweep=smoke", SMALL]) == 0
        (root / "runs").mkdir()
        shutil.copy(calibration, root / "runs" / "calibration.json")
        for point in POINTS:
            for stage in STAGES:
                assert run_stage(stage, [point]) == 0, f"{stage}@{point}"
        _heads_receipt(root / "runs")
        # the inputs stage's files, as dvc.yaml's `inputs` stage writes them (the sources hashed in this checkout)
        assert write_inputs(Path("params.yaml"), root / "runs" / "inputs", Path(posttrainllm.__file__).parents[1]) == 0
    runs = root / "runs"
    for point in POINTS:  # the shape `dvc repro` leaves
        assert (runs / point / "stamps" / "receipt.json").exists() and (runs / point / "receipt.json").exists()
        assert (runs / "inputs" / point / "receipt.json").exists()
    return runs


def test_receipt_files_are_the_points_not_their_stamps(runs, tmp_path):
    found = receipts.receipt_files(runs)
    assert found == [runs / "baseline" / "receipt.json", runs / "heads" / "k1" / "receipt.json",
                     runs / "precision-fp16" / "receipt.json"]
    assert receipts.receipt_files(runs / "baseline") == [runs / "baseline" / "receipt.json"]  # a point itself
    # a point whose receipt.json is gone does not offer its receipt stage's stamp instead
    shutil.copytree(runs / "baseline", tmp_path / "baseline", ignore=shutil.ignore_patterns("receipt.json"))
    assert (tmp_path / "baseline" / "stamps").is_dir() and receipts.receipt_files(tmp_path) == []
    # nor is a point's subfolder searched: a nested receipt.json belongs to that point, not beside it
    shutil.copytree(runs / "baseline", tmp_path / "nested" / "outer")
    shutil.copytree(runs / "precision-fp16", tmp_path / "nested" / "outer" / "inner")
    assert receipts.receipt_files(tmp_path / "nested") == [tmp_path / "nested" / "outer" / "receipt.json"]


def test_a_receipt_is_told_by_its_content_not_its_name(runs, tmp_path):
    # the inputs stage's receipt.json (what DVC reruns the receipt stage on) names its stage, no receipt schema
    assert receipts.receipt_files(runs / "inputs") == []
    assert not receipts.is_receipt(runs / "inputs" / "baseline" / "receipt.json")
    assert not receipts.is_receipt(runs / "baseline" / "stamps" / "receipt.json")
    assert receipts.is_receipt(runs / "baseline" / "receipt.json")
    assert receipts.is_receipt(runs / "heads" / "k1" / "receipt.json")
    # a stamp copied out of its stamps/ folder is still a stamp
    shutil.copy(runs / "baseline" / "stamps" / "receipt.json", tmp_path / "receipt.json")
    assert receipts.receipt_files(tmp_path) == []
    # damaged receipts stay receipts, so their readers name what is wrong
    for name, text in (("truncated", '{"schema": "posttrainllm.track.rec'), ("cut", '{"point": "baseline"}'),
                       ("list", "[1, 2]")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "receipt.json").write_text(text)
        assert receipts.is_receipt(tmp_path / name / "receipt.json"), name
    # another tool's receipt.json, with a schema of its own, is not ours
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "receipt.json").write_text('{"schema": "shop.receipt/2", "total": 3}')
    assert not receipts.is_receipt(tmp_path / "other" / "receipt.json")


def test_replay_reads_a_sweep_folder(runs, tmp_path, capsys):
    assert cli.main(["replay", str(runs), "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert out.count("verified: ok") == 2 and "replay of " + str(runs / "baseline") in out
    assert f"not replayed: {runs / 'heads' / 'k1'}: a draft-heads receipt" in out
    assert "stamps" not in err and "does not add up" not in err
    assert {p.name for p in (tmp_path / "out").iterdir()} == set(POINTS)


def test_compare_reads_two_sweep_folders(runs, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(runs, other)  # the same sweep made again elsewhere
    out = tmp_path / "compare.md"
    assert cli.main(["compare", str(runs), str(other), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for point in POINTS:  # paired by name, each point's timings and verdicts
        rows = [line for line in printed.splitlines() if line.strip().startswith(point)]
        assert any(" time forward " in r for r in rows) and any(" parity out " in r for r in rows), printed
    assert "not compared: " in printed and "heads/k1: a draft-heads receipt" in printed
    assert "only in" not in printed and "0 regression(s)" in printed
    assert "0 regression(s)" in out.read_text()


def runs_logged(printed):
    """{receipt.json path: run id} from import's lines."""
    return dict(line.split(": mlflow run ") for line in printed.splitlines() if ": mlflow run " in line)


def test_import_logs_a_sweep_folder_once(runs, mlflow_uri, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    assert cli.main(["receipt", "import", str(runs)]) == 0
    out, err = capsys.readouterr()
    logged = runs_logged(out)
    assert sorted(logged) == [str(runs / "baseline" / "receipt.json"), str(runs / "heads" / "k1" / "receipt.json"),
                              str(runs / "precision-fp16" / "receipt.json")], out + err
    assert "3 receipts in" in out and "bad receipt" not in err
    client = MlflowClient(tracking_uri=mlflow_uri)
    heads = client.get_run(logged[str(runs / "heads" / "k1" / "receipt.json")])
    assert heads.data.tags["role"] == "heads" and heads.data.tags[receipts.LOGGED_TAG] == "true"
    point = client.get_run(logged[str(runs / "baseline" / "receipt.json")])
    assert point.data.tags["point"] == "baseline" and point.data.tags["sweep"] == "smoke"
    assert point.info.status == "FINISHED" and "mlflow.parentRunId" in point.data.tags
    # again: nothing logged twice, the heads receipt included
    assert cli.main(["receipt", "import", str(runs)]) == 0
    assert runs_logged(capsys.readouterr().out) == logged
    # the point folder the receipt stage's exit-3 line names: its receipt only, not its stamp
    assert cli.main(["receipt", "import", str(runs / "baseline")]) == 0
    out = capsys.readouterr().out
    assert f"{runs / 'baseline' / 'receipt.json'}: mlflow run {logged[str(runs / 'baseline' / 'receipt.json')]}" in out
    assert "1 receipts in" in out


def test_a_folder_of_stamps_only_is_named_not_read_as_receipts(runs, tmp_path, mlflow_uri, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    shutil.copytree(runs / "baseline" / "stamps", tmp_path / "left" / "stamps")
    assert cli.main(["replay", str(tmp_path / "left")]) == 2
    assert "no receipt.json in this folder or below it" in capsys.readouterr().err
    assert cli.main(["compare", str(runs), str(tmp_path / "left")]) == 2
    assert "cannot compare" in capsys.readouterr().err
    assert cli.main(["receipt", "import", str(tmp_path / "left")]) == 1
    assert "0 receipts in" in capsys.readouterr().out


def test_a_folder_of_heads_receipts_only_has_no_points_to_replay(runs, tmp_path, capsys):
    shutil.copytree(runs / "heads", tmp_path / "heads")
    assert cli.main(["replay", str(tmp_path / "heads")]) == 2
    err = capsys.readouterr().err
    assert "no point receipt" in err and "a draft-heads receipt" in err


def test_a_bad_heads_receipt_is_named_and_stops_the_import(runs, tmp_path, mlflow_uri, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    folder = tmp_path / "runs"
    shutil.copytree(runs, folder)
    heads = json.loads((folder / "heads" / "k1" / "receipt.json").read_text())
    del heads["base"]
    heads["created_at"] = uuid.uuid4().hex  # not the logged one
    (folder / "heads" / "k1" / "receipt.json").write_text(json.dumps(heads))
    assert cli.main(["receipt", "import", str(folder)]) == 2
    err = capsys.readouterr().err
    assert f"bad receipt {folder / 'heads' / 'k1' / 'receipt.json'}: missing base" in err
    assert "1 of 3 receipts bad; nothing logged" in err


def test_the_inputs_stage_receipt_file_named_directly_is_not_a_receipt(runs, capsys):
    assert cli.main(["replay", str(runs / "inputs" / "baseline" / "receipt.json")]) == 2
    assert "not a receipt (a file the pipeline writes for itself" in capsys.readouterr().err
