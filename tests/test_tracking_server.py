"""Receipts on a team's tracking server: a real `mlflow server` on 127.0.0.1, a sweep over HTTP, read back,
replayed by run id; the server killed in the middle of a sweep loses nothing, and `receipt import` adds
exactly what is missing."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from posttrainllm import cli
from posttrainllm.track import receipt, store

QUICK = ["device=cpu", "parity.seeds=[0]", "shape.edge_seq_lens=[37]", "bench.reps=3", "bench.min_time_s=0",
         "shape.curve=[64,128]"]


class Server:
    """`mlflow server` (one worker, no job runner: ready in ~10 s here) with its store in a folder."""

    def __init__(self, folder: Path):
        self.folder = folder
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 90.0) -> None:
        mlflow = Path(sys.executable).parent / "mlflow"
        self.process = subprocess.Popen(
            [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}",
             "--artifacts-destination", str(self.folder / "artifacts")],
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            stdout=subprocess.DEVNULL, stderr=open(self.folder / "server.log", "a"), start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.folder / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.25)
        raise RuntimeError(f"mlflow server not ready in {timeout_s} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the server and the workers it started
            self.process.wait(timeout=30)
        self.process = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("mlflow-server"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def workdir(tmp_path, monkeypatch, calibration, server):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    (tmp_path / "runs" / "bench").mkdir(parents=True)
    shutil.copy(calibration, tmp_path / "runs" / "bench" / "calibration.json")
    store._opened.clear()  # a store opened against an earlier server process is not reused
    return tmp_path


def _runs(uri: str, filter_string: str = "") -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(receipt.EXPERIMENT)
    return client.search_runs([experiment.experiment_id], filter_string=filter_string, max_results=100)


def test_a_sweep_over_http_survives_the_server_going_away_and_is_read_back(workdir, server, tmp_path, monkeypatch,
                                                                          capsys):
    """Two points logged over HTTP; the server dies after the first: the second keeps its JSON and the
    command exits 3 with one line; once the server is back, `receipt import` adds exactly the missing run.
    Then both runs are read back (params, metrics, artifacts), replayed and compared by run id."""
    from mlflow.tracking import MlflowClient

    logged = []
    log = receipt.log_to_mlflow

    def log_then_kill(*args, **kwargs):
        if logged:  # the server goes away after the first point's run is complete
            server.stop()
        run_id = log(*args, **kwargs)
        logged.append(run_id)
        return run_id

    monkeypatch.setattr(receipt, "log_to_mlflow", log_then_kill)
    started = time.monotonic()
    # sdpa alone beside the reference: the Triton path through the interpreter is not what is tested here
    assert cli.main(["bench", "-m", *QUICK, "op.only=[sdpa]", "precision=fp32,fp16", "run.out_dir=runs/http"]) == 3
    assert time.monotonic() - started < 90  # bounded HTTP retries: not MLflow's ~250 s default
    captured = capsys.readouterr()
    assert captured.out.count(f"({server.uri})") == 1  # the first point's line names the server it logged to
    lines = [line for line in captured.err.splitlines() if "tracking server unreachable" in line]
    assert len(lines) == 1 and f"({server.uri}:" in lines[0] and "posttrainllm receipt import runs/http/" in lines[0]
    folders = sorted(p for p in (workdir / "runs/http").iterdir() if p.is_dir())
    assert len(folders) == 2 and all((p / "receipt.json").exists() for p in folders)  # both kept as JSON
    assert len(logged) == 1

    server.start()  # the same store, back again
    store._opened.clear()
    monkeypatch.setattr(receipt, "log_to_mlflow", log)
    assert cli.main(["receipt", "import", str(workdir / "runs/http")]) == 0
    ids = {receipt._tags(json.loads((p / "receipt.json").read_text()))["receipt.id"] for p in folders}
    runs = [r for r in _runs(server.uri, "tags.`receipt.logged` = 'true'") if r.data.tags["receipt.id"] in ids]
    assert sorted(r.data.tags["receipt.id"] for r in runs) == sorted(ids)  # one complete run each, none twice
    assert logged[0] in {r.info.run_id for r in runs}  # the run logged before the outage is kept, not redone
    assert cli.main(["receipt", "import", str(workdir / "runs/http")]) == 0  # again: nothing added
    assert len([r for r in _runs(server.uri) if r.data.tags.get("receipt.id") in ids]) == 2

    client = MlflowClient(tracking_uri=server.uri)
    assert all(r.info.status == "FINISHED" for r in runs)
    for run in runs:
        stored = json.loads((workdir / "runs/http" / run.data.tags["point"] / "receipt.json").read_text())
        assert run.data.params["precision.name"] == stored["config"]["precision"]["name"]
        assert run.data.metrics["bench.sdpa.median_ms"] == receipt.significant(  # logged to its significance
            "bench.sdpa.median_ms", stored["microbench"]["paths"]["sdpa"]["median_ms"])
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"receipt.json", "timings.csv", "parity.json", "curve.csv"} <= artifacts
        fetched = client.download_artifacts(run.info.run_id, "receipt.json", str(tmp_path / "fetched"))
        assert json.loads(Path(fetched).read_text()) == stored  # the same content, over HTTP
    capsys.readouterr()
    # replay by run id: the artifacts come back over HTTP and add up; compare takes run ids too
    assert cli.main(["replay", runs[0].info.run_id, "--out", str(tmp_path / "replayed")]) == 0
    out = capsys.readouterr().out
    assert f"replay of mlflow run {runs[0].info.run_id} ({server.uri})" in out and "verified: ok" in out
    assert cli.main(["compare", runs[0].info.run_id, runs[0].info.run_id, "--out", str(tmp_path / "c.md")]) == 0
    assert cli.main(["replay", "0" * 32]) == 2
    assert f"cannot replay mlflow run {'0' * 32} ({server.uri})" in capsys.readouterr().err
