"""`posttrainllm ui` and the addresses it prints: the runs table and the latest sweep's run of a real store."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

from posttrainllm import cli
from posttrainllm.track import receipt, ui

pytest.importorskip("mlflow")


def _small(point, sweep=None):
    """A receipt with nothing measured: enough to be logged."""
    return {"schema": receipt.SCHEMA, "point": point, "sweep": sweep, "created_at": "2026-01-01T00:00:00+00:00",
            "provenance": {"revision": "0" * 40, "dirty": False, "triton_interpreted": True,
                           "machine": {"device": "cpu", "device_name": "cpu", "threads": 1, "torch": "-",
                                       "triton": "-", "python": "-"}},
            "config": {"tile": {"block_q": 64}}, "kernel": None, "microbench": None, "bench_train": None,
            "parity": {"verdict": "pass", "precision": "fp32", "contract": {}, "rule": "", "notes": [], "paths": {}}}


def _sweep(name):
    return {"name": name, "id": uuid.uuid4().hex[:16], "changes": {}, "points": ["a"]}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A sqlite store of its own with two sweeps logged, one after the other: (uri, experiment id, the second
    sweep's run id)."""
    from mlflow.tracking import MlflowClient

    folder = tmp_path_factory.mktemp("ui-store")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    receipt.log_to_mlflow(_small("a", _sweep("first")), folder, uri)
    time.sleep(0.01)  # start times differ
    point = receipt.log_to_mlflow(_small("a", _sweep("second")), folder, uri)
    client = MlflowClient(uri)
    parent = client.get_run(point).data.tags["mlflow.parentRunId"]
    return uri, client.get_experiment_by_name(receipt.EXPERIMENT).experiment_id, parent


def test_the_addresses_are_the_runs_table_and_the_latest_sweeps_run(store, tmp_path):
    uri, experiment, parent = store
    found = ui.addresses(uri, "http://127.0.0.1:5123")
    assert found.runs_table == (f"http://127.0.0.1:5123/#/experiments/{experiment}/runs?viewStateShareKey="
                                "posttrainllm-answer&workflowType=machine_learning")
    assert found.sweep_run == (f"http://127.0.0.1:5123/#/experiments/{experiment}/runs/{parent}"
                               "?workflowType=machine_learning")
    assert found.sweep.startswith("second ")
    missing = tmp_path / "none" / "mlflow.db"
    assert ui.addresses(f"sqlite:///{missing}", "http://x") is None and not missing.parent.exists()  # not created


def test_report_prints_the_runs_table_when_the_store_exists(store, tmp_path, monkeypatch, capsys):
    from test_report import _plan, _receipt

    uri, experiment, _ = store
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    _plan(tmp_path, {"baseline": _receipt("baseline")})
    assert cli.main(["report"]) == 0
    runs_table = (f"http://127.0.0.1:5000/#/experiments/{experiment}/runs?viewStateShareKey=posttrainllm-answer"
                  "&workflowType=machine_learning")
    assert f"MLflow runs: {runs_table}  (serve it: posttrainllm ui)" in capsys.readouterr().out


@pytest.mark.parametrize("args, says", [
    (["--port"], "usage: posttrainllm ui [--port N] [--host HOST]"),
    (["--wide"], "usage: posttrainllm ui [--port N] [--host HOST]"),
    (["--port", "http"], "posttrainllm: ui: --port http: a port number, 1 to 65535"),
    (["--port", "70000"], "posttrainllm: ui: --port 70000: a port number, 1 to 65535"),
])
def test_a_bad_ui_flag_is_one_line_and_exit_2(args, says, capsys):
    assert cli.main(["ui", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith(says)


def test_ui_without_a_store_starts_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert cli.main(["ui"]) == 1
    assert "no MLflow store yet" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def _free_port():
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", 0))
        except OSError as exc:
            pytest.skip(f"cannot bind a port on 127.0.0.1 here: {exc}")
        return s.getsockname()[1]


def _get(url):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=5) as answer:
        return answer.status, answer.read()


def test_ui_serves_the_store_until_it_is_stopped(store, tmp_path):
    uri, experiment, parent = store
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    with open(log, "w") as err:
        served = subprocess.Popen([sys.executable, "-m", "posttrainllm", "ui", "--port", str(port)],
                                  env={**os.environ, "MLFLOW_TRACKING_URI": uri},
                                  stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        lines = []
        while not any(line.startswith("latest sweep") for line in lines):  # printed once it answers
            line = served.stdout.readline()
            assert line, f"ui exited {served.poll()}: {''.join(lines)}{log.read_text()[-3000:]}"
            lines.append(line)
        assert f"runs table: {ui.runs_table_url(base, experiment)}\n" in lines
        assert any(f"{base}/#/experiments/{experiment}/runs/{parent}?" in line for line in lines)
        assert _get(f"{base}/health")[0] == 200 and _get(f"{base}/")[0] == 200  # the UI's page
        status, body = _get(f"{base}/ajax-api/2.0/mlflow/experiments/get?experiment_id={experiment}")
        assert status == 200 and json.loads(body)["experiment"]["name"] == receipt.EXPERIMENT  # our store
    finally:
        served.terminate()  # SIGTERM, as a supervisor would: the server and its worker go too
        code = served.wait(timeout=30)
    assert code == 0
    with pytest.raises(OSError):  # nothing left answering on the port
        _get(f"{base}/health")
