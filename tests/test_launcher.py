"""A multirun's points as parallel jobs through a Hydra launcher plugin (hydra-submitit-launcher, local mode:
conf/hydra/launcher/parallel.yaml): each job its own process and receipt folder, one MLflow run per point."""

import json
import shutil

import pytest

from posttrainllm import cli
from posttrainllm.lab.configure import load
from posttrainllm.track import receipt

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[track]'")

QUICK = ["device=cpu", "parity.seeds=[0]", "shape.edge_seq_lens=[37]", "bench.reps=3", "bench.min_time_s=0",
         "shape.curve=[64,128]"]


def test_parallel_jobs_each_leave_their_receipt_and_one_mlflow_run(tmp_path, monkeypatch, mlflow_uri, calibration,
                                                                   capsys):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    out = tmp_path / "runs" / "launched"
    out.mkdir(parents=True)
    shutil.copy(calibration, out / "calibration.json")
    # two points in two processes; the second's contract is impossibly tight, so it fails there, not here
    args = ["bench", "-m", "hydra/launcher=parallel", *QUICK, "op.only=[sdpa]", "run.out_dir=runs/launched",
            "precision.contract.error_multiple=8,1e-9"]
    assert cli.main(args) == 1
    captured = capsys.readouterr()
    assert "posttrainllm: 2 point(s) from the launcher's jobs" in captured.out
    assert "contract broken: " in captured.err
    folders = sorted(p.parent for p in out.glob("*/receipt.json"))
    assert len(folders) == 2
    broken = [f for f in folders if f.name in captured.err]  # the folder the line names (its overrides hashed)
    assert len(broken) == 1
    assert any("error_multiple=1e-09" in o for o in json.loads((broken[0] / "receipt.json").read_text())["overrides"])
    jobs = sorted(p for p in (out / ".submitit").iterdir() if p.name.isdigit())
    assert len(jobs) == 2 and all(list(job.glob("*_result.pkl")) for job in jobs)  # two submitit jobs, both done
    pids = {json.loads((f / "receipt.json").read_text())["point"] for f in folders}
    assert len(pids) == 2
    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name(receipt.EXPERIMENT).experiment_id
    for folder in folders:
        stored = json.loads((folder / "receipt.json").read_text())
        runs = client.search_runs([experiment], filter_string=f"tags.`receipt.id` = '{receipt._tags(stored)['receipt.id']}'")
        assert len(runs) == 1 and runs[0].data.tags["receipt.logged"] == "true"  # none lost, none twice
        assert runs[0].info.status == ("FINISHED" if stored["parity"]["verdict"] == "pass" else "FAILED")
    # the parent checks what its jobs logged: a receipt missing from the store (here: another, empty store)
    # is reported with its import command and makes the command exit 3, as a job run in-process would
    cli._untracked.clear()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'other.db'}")
    cli._collect_launched([load(["run.out_dir=runs/launched"])], started=0)
    assert len(cli._untracked) == 2 and all("posttrainllm receipt import" in line for line in cli._untracked)
    cli._untracked.clear()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    cli._collect_launched([load(["run.out_dir=runs/launched"])], started=0)
    assert cli._untracked == []
