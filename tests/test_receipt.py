"""The receipt's MLflow side under faults: nothing lost, nothing hangs.

One test per fault found by fault injection: an interrupted write, an unreachable server,
concurrent writers on a fresh store, a half-bad import folder, the sweep run's state, the
experiment's kind (the UI's landing page).
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

pytest.importorskip("mlflow")

from posttrainllm import cli  # noqa: E402
from posttrainllm.track import receipt as receipts  # noqa: E402
from posttrainllm.track import store  # noqa: E402

UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused


def small_receipt(point: str, *, verdict: str = "pass", sweep: dict | None = None) -> dict:
    """A receipt with everything logging reads, made without running any stage."""
    return {
        "schema": receipts.SCHEMA, "point": point, "sweep": sweep,
        "created_at": "2026-01-01T00:00:00+00:00",
        "provenance": {"revision": "0" * 40, "dirty": False, "triton_interpreted": True,
                       "machine": {"device": "cpu", "device_name": "test cpu", "threads": 1, "torch": "2.13.0",
                                   "triton": "3.9.0", "python": "3.11"}},
        "config": {"op": {"name": "attention"}, "tile": {"block_q": 64}, "nonce": uuid.uuid4().hex},
        "kernel": None,
        "parity": {"verdict": verdict, "precision": "fp32", "contract": {}, "rule": "", "notes": [],
                   "paths": {"sdpa": {"verdict": verdict, "failed_cases": [], "emulation": None,
                                      "worst": {"out": {"max_abs_err": 1e-7, "mismatch_frac": 0.0}}}}},
        "microbench": None, "bench_train": None,
    }


def write_receipt(folder, data) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "receipt.json").write_text(json.dumps(data))


def client_of(uri):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return client, client.get_experiment_by_name(receipts.EXPERIMENT).experiment_id


def runs_of(uri, point):
    client, experiment_id = client_of(uri)
    return client.search_runs([experiment_id], filter_string=f"tags.point = '{point}'")


# --- 1. an interrupted write is completed by the retry, never counted as logged --------------------


@pytest.mark.parametrize("interruption", ["killed after create_run", "error while logging"])
def test_interrupted_write_is_replaced_by_one_complete_run(tmp_path, mlflow_uri, monkeypatch, interruption):
    from mlflow.tracking import MlflowClient

    point = f"interrupted-{uuid.uuid4().hex[:8]}"
    data = small_receipt(point)
    receipts.log_to_mlflow(small_receipt("warm-up"), tmp_path, mlflow_uri)  # the store and experiment exist
    client, experiment_id = client_of(mlflow_uri)
    if interruption == "killed after create_run":  # what a kill right after the run's creation leaves
        client.create_run(experiment_id, run_name=point, tags=receipts._tags(data))
    else:
        def dies(*args, **kwargs):
            raise KeyboardInterrupt("killed while logging artifacts")

        monkeypatch.setattr(MlflowClient, "log_artifact", dies)
        (tmp_path / "parity.json").write_text("{}")
        with pytest.raises(KeyboardInterrupt):
            receipts.log_to_mlflow(data, tmp_path, mlflow_uri)
        monkeypatch.undo()
    [left] = runs_of(mlflow_uri, point)
    assert left.info.status == "RUNNING" and receipts.LOGGED_TAG not in left.data.tags

    run_id = receipts.log_to_mlflow(data, tmp_path, mlflow_uri)  # the retry

    [run] = runs_of(mlflow_uri, point)
    assert run.info.run_id == run_id != left.info.run_id
    assert run.info.status == "FINISHED" and run.data.tags[receipts.LOGGED_TAG] == "true"
    assert run.data.params["tile.block_q"] == "64" and run.data.metrics["parity.sdpa.pass"] == 1.0
    assert receipts.log_to_mlflow(data, tmp_path, mlflow_uri) == run_id  # complete: reused, not logged twice


# --- 2. an unreachable server: bounded, one line, exit 3, the table still printed -----------------------


@pytest.fixture
def unreachable(monkeypatch):
    """MLFLOW_TRACKING_URI on a port nothing listens on, with this project's HTTP defaults."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", UNREACHABLE)
    for key in store.HTTP_DEFAULTS:
        monkeypatch.delenv(key, raising=False)  # restored after the test (configure_http sets them)
    timed = {}
    log = receipts.log_to_mlflow

    def timed_log(*args, **kwargs):
        start = time.perf_counter()
        try:
            return log(*args, **kwargs)
        finally:
            timed["s"] = time.perf_counter() - start

    monkeypatch.setattr(receipts, "log_to_mlflow", timed_log)
    return timed


QUICK = ["device=cpu", "parity.seeds=[0]", "shape.edge_seq_lens=[37]", "bench.reps=3", "bench.min_time_s=0",
         "shape.curve=[64,128]"]


def test_unreachable_server_fails_fast_with_one_line_and_exit_3(tmp_path, monkeypatch, calibration, unreachable,
                                                                capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "bench").mkdir(parents=True)
    shutil.copy(calibration, tmp_path / "runs" / "bench" / "calibration.json")

    # sdpa alone beside the reference: the Triton path through the interpreter is not what is tested here
    assert cli.main(["bench", *QUICK, "op.only=[sdpa]", "run.name=offline-server"]) == cli.EXIT_UNTRACKED == 3

    assert unreachable["s"] < 30, f"MLflow took {unreachable['s']:.0f} s to give up"
    out, err = capsys.readouterr()
    assert "parity pass" in out  # the point's table is still printed
    lines = [line for line in err.splitlines() if "unreachable" in line]
    assert len(lines) == 1 and lines[0].startswith(f"posttrainllm: tracking server unreachable ({UNREACHABLE}: ")
    assert "receipt kept at runs/bench/offline-server/receipt.json" in lines[0]
    assert lines[0].endswith("log it later with: posttrainllm receipt import runs/bench/offline-server")
    assert "Traceback" not in err
    assert json.loads((tmp_path / "runs/bench/offline-server/receipt.json").read_text())["point"] == "offline-server"


def test_dvc_receipt_stage_exits_3_on_an_unreachable_server(tmp_path, monkeypatch, unreachable, capsys):
    from posttrainllm.lab.pipeline import run_stage

    monkeypatch.chdir(tmp_path)
    assert cli.main(["sweep", "sweep=smoke"]) == 0

    assert run_stage("receipt", ["baseline"]) == 3

    progress = ("posttrainllm: receipt baseline (1/2) ",)  # the stage's progress lines
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith(progress)]
    assert len(lines) == 1 and lines[0].startswith(f"posttrainllm: tracking server unreachable ({UNREACHABLE}")
    assert lines[0].endswith("posttrainllm receipt import runs/baseline")
    written = json.loads((tmp_path / "runs/baseline/receipt.json").read_text())
    assert written["sweep"]["points"] == ["baseline", "precision-fp16"]  # the sweep knows all its points


# --- 3. several writers on a store that does not exist yet ---------------------------------------------


WRITER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from posttrainllm.track import receipt
    import mlflow  # imported before the start signal, so the writers reach the store together
    data = json.loads(sys.argv[1])
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.01)
    print(receipt.log_to_mlflow(data, Path(sys.argv[3]), sys.argv[4]))
""")


def test_fresh_store_survives_concurrent_writers(tmp_path):
    uri = f"sqlite:///{tmp_path / 'fresh' / 'mlflow.db'}"
    names = [f"writer-{i}" for i in range(4)]
    sweep = {"name": "concurrent", "id": uuid.uuid4().hex[:16], "changes": {}, "points": names}
    go = tmp_path / "go"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    env.pop("MLFLOW_LOGGING_LEVEL", None)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(small_receipt(name, sweep=sweep)), str(go),
                               str(tmp_path), uri], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for name in names]
    time.sleep(4)  # past the imports
    go.touch()
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]

    for code, out, err in results:
        assert code == 0, err[-3000:]
        assert "already exists" not in err and "Creating initial MLflow database tables" not in err, err
    runs = {r.data.tags["point"]: r for name in names for r in runs_of(uri, name)}
    assert set(runs) == set(names) and all(receipts._complete(r) for r in runs.values())
    assert {r.info.run_id for r in runs.values()} == {out.strip() for _, out, _ in results}
    parents = {r.data.tags["mlflow.parentRunId"] for r in runs.values()}
    assert len(parents) == 1  # one sweep run, not one per racing writer
    client, _ = client_of(uri)
    assert client.get_run(parents.pop()).info.status == "FINISHED"


# --- 4. a folder with one good and one truncated receipt ----------------------------------------------------


def test_import_with_a_truncated_receipt_logs_none_and_names_it(tmp_path, mlflow_uri, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    good = f"good-{uuid.uuid4().hex[:8]}"
    write_receipt(tmp_path / good, small_receipt(good))
    text = json.dumps(small_receipt("bad"), indent=2)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "receipt.json").write_text(text[:len(text) // 2])  # a copy cut short

    assert cli.main(["receipt", "import", str(tmp_path)]) == 2

    out, err = capsys.readouterr()
    assert f"bad receipt {tmp_path / 'bad' / 'receipt.json'}: not valid JSON" in err
    assert "1 of 2 receipts bad; nothing logged" in err
    assert good not in out and runs_of(mlflow_uri, good) == []

    (tmp_path / "bad" / "receipt.json").unlink()  # once the bad one is gone, the good one goes in
    assert cli.main(["receipt", "import", str(tmp_path)]) == 0
    assert f"{tmp_path / good / 'receipt.json'}: mlflow run" in capsys.readouterr().out
    assert len(runs_of(mlflow_uri, good)) == 1


# --- 5. the sweep's run shows the sweep's state ------------------------------------------------------------


def test_sweep_run_is_running_until_all_points_are_logged_then_finished(tmp_path, mlflow_uri):
    sweep = {"name": "states", "id": uuid.uuid4().hex[:16], "changes": {}, "points": ["a", "b"]}
    first = receipts.log_to_mlflow(small_receipt("a", sweep=sweep), tmp_path, mlflow_uri)
    client, _ = client_of(mlflow_uri)
    parent = client.get_run(first).data.tags["mlflow.parentRunId"]
    assert client.get_run(parent).info.status == "RUNNING"
    assert client.get_run(parent).data.tags["sweep.progress"] == "1/2 points logged"

    receipts.log_to_mlflow(small_receipt("b", sweep=sweep), tmp_path, mlflow_uri)

    assert client.get_run(parent).info.status == "FINISHED"
    assert client.get_run(parent).data.tags["sweep.progress"] == "2/2 points logged"


def test_sweep_run_fails_when_a_point_fails(tmp_path, mlflow_uri):
    sweep = {"name": "states", "id": uuid.uuid4().hex[:16], "changes": {}, "points": ["a", "b"]}
    failed = receipts.log_to_mlflow(small_receipt("a", verdict="fail", sweep=sweep), tmp_path, mlflow_uri)
    client, _ = client_of(mlflow_uri)
    run = client.get_run(failed)  # the failing point is logged all the same, with its verdict
    assert run.info.status == "FAILED" and run.data.tags["verdict"] == "fail"
    assert run.data.tags["parity.verdict"] == "fail" and run.data.metrics["parity.sdpa.pass"] == 0.0
    parent = client.get_run(run.data.tags["mlflow.parentRunId"])
    assert parent.info.status == "FAILED" and parent.data.tags["sweep.failed"] == "a"

    receipts.log_to_mlflow(small_receipt("b", sweep=sweep), tmp_path, mlflow_uri)
    assert client.get_run(parent.info.run_id).info.status == "FAILED"


# --- 6. the experiment opens on its runs, not on MLflow 3's GenAI overview ------------------------------------


def test_experiment_is_a_model_training_one(tmp_path, mlflow_uri):
    receipts.log_to_mlflow(small_receipt("kind"), tmp_path, mlflow_uri)
    client, experiment_id = client_of(mlflow_uri)
    assert client.get_experiment(experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"

    legacy = f"legacy-{uuid.uuid4().hex[:8]}"  # made before the tag existed: tagged when next opened
    legacy_id = client.create_experiment(legacy)
    assert "mlflow.experimentKind" not in client.get_experiment(legacy_id).tags
    assert store.open_store(mlflow_uri, legacy, None)[1] == legacy_id
    assert client.get_experiment(legacy_id).tags["mlflow.experimentKind"] == "custom_model_development"


# --- 7. the views open on the answer -------------------------------------------------------------------------


def _answered(point, sweep=None):
    """A receipt with a shape, a best peer, a trained step and knobs enough to pass MAX_PARAMS."""
    receipt = small_receipt(point, sweep=sweep)
    receipt["config"]["tile"] = {f"block_{i}": 64 for i in range(40)}
    receipt["kernel"] = {"paths": {"sdpa": {"kind": "peer"}}}
    receipt["microbench"] = {"problem": "B=1 H=4 S=128 D=32", "paths": {
        "reference": {"valid": True, "median_ms": 0.25194849999},
        "sdpa": {"valid": True, "median_ms": 0.1208195, "speedup_vs_reference": 2.0853297685320666}}}
    receipt["bench_train"] = {"impls": {}, "drift": {"sdpa": 0.0}, "drift_verdict": {"sdpa": "pass"},
                              "noise": {"band": 1.035}, "amdahl": {"fraction": 0.11, "variants": {"sdpa": {
                                  "valid": True, "predicted_speedup": 1.0234567, "measured_speedup": 1.0123,
                                  "sentence": "attention is 11% of the measured training step; ..."}}}}
    return receipt


def test_the_runs_table_opens_on_the_points_answer(tmp_path, mlflow_uri):
    """The experiment carries a saved view (the UI's envelope) whose columns are tags and metrics a point's run
    has: its change, verdict, best peer, the peer's speedup, the step effect; the points grouped by sweep. A point
    run: the shape first, at most MAX_PARAMS params, metrics rounded to SIGNIFICANT digits and named by what they
    are. Planted bugs: a column naming the old `best_peer.speedup` metric, or params without the cap, fail here."""
    sweep = {"name": "view", "id": uuid.uuid4().hex[:16], "changes": {"precision": "fp16"}, "points": ["v"]}
    run_id = receipts.log_to_mlflow(_answered("v", sweep), tmp_path, mlflow_uri)
    client, experiment_id = client_of(mlflow_uri)
    tag = json.loads(client.get_experiment(experiment_id).tags[store.VIEW_TAG])
    assert tag["name"] == store.VIEW_NAME and isinstance(tag["createdAt"], int)
    state = json.loads(tag["state"])
    assert state == store.VIEW and state["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "sweep"}]
    run = client.get_run(run_id)
    for column in state["selectedColumns"]:  # every column but ours (no Triton speed here) is filled in
        kind, name = column.split(".", 1)
        held = run.data.tags if kind == "tags" else run.data.metrics
        assert name.strip("`") in held or name == "`triton.fwd_speedup_vs_best_peer`", column
    assert run.data.tags["sweep.changes"] == "precision=fp16" and run.data.tags["verdict"] == "pass"
    assert run.data.tags["step.effect"] == "sdpa: predicted 1.02x, measured no measurable change (band +-3.5%)"
    assert run.data.metrics["best_peer.fwd_speedup_vs_reference"] == 2.09  # 2.0853... to 3 digits
    assert run.data.metrics["bench.reference.median_ms"] == 0.252
    assert list(receipts.run_params(_answered("v")))[0] == "shape"
    assert len(run.data.params) == receipts.MAX_PARAMS and run.data.params["shape"] == "B=1 H=4 S=128 D=32"
    # an experiment whose view was changed (or is missing) gets it back when next opened
    client.set_experiment_tag(experiment_id, store.VIEW_TAG, "{}")
    store._opened.clear()
    store.open_store(mlflow_uri, receipts.EXPERIMENT, None)
    assert store.view_state(client.get_experiment(experiment_id).tags[store.VIEW_TAG]) == store.VIEW


def test_the_sweep_run_holds_the_sweeps_table(tmp_path, mlflow_uri):
    """The latest sweep's link opens a run whose description (and artifact) is the sweep's table: one row per point
    logged so far, read beside the point's folder, and each point's step sentence."""
    sweep = {"name": "table", "id": uuid.uuid4().hex[:16], "changes": {}, "points": ["p1", "p2"]}
    write_receipt(tmp_path / "p1", _answered("p1", sweep))
    receipts.log_to_mlflow(json.loads((tmp_path / "p1" / "receipt.json").read_text()), tmp_path / "p1", mlflow_uri)
    write_receipt(tmp_path / "p2", _answered("p2", sweep))
    point = receipts.log_to_mlflow(_answered("p2", sweep), tmp_path / "p2", mlflow_uri)
    client, _ = client_of(mlflow_uri)
    parent = client.get_run(client.get_run(point).data.tags["mlflow.parentRunId"])
    note = parent.data.tags["mlflow.note.content"]
    assert note.startswith("Sweep table: 2 of 2 points")
    assert "| point | verdict |" in note and "\n| p1 | pass |" in note and "\n| p2 | pass |" in note
    assert "- step: p1: sdpa: attention is 11% of the measured training step" in note
    local = client.download_artifacts(parent.info.run_id, receipts.SWEEP_TABLE, str(tmp_path))
    assert open(local).read() == note
