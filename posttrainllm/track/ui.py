"""The MLflow UI on the project's store: the addresses to open, and the server that answers them.

MLflow 3.17's UI opens an experiment on its GenAI overview unless the URL asks for the runs table
(`?workflowType=machine_learning`; store.py, scripts/check-mlflow-ui.sh), so every address here
carries it. The lookups only read the store: a store that does not exist yet is not created, an
experiment that is not there is not made. The server is `mlflow ui` with one worker and MLflow's
job execution off, on 127.0.0.1 unless told otherwise, in a process group of its own that `stop` ends.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from posttrainllm.track import store
from posttrainllm.track.receipt import EXPERIMENT, artifact_location

HOST, PORT = "127.0.0.1", 5000  # MLflow's own default port
# No job runner (a UI over receipts needs none) and one worker: the server starts in about a third of the default's
# time (docs/measured.md)
SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


@dataclass
class Addresses:
    runs_table: str  # the experiment's runs, as a table
    sweep_run: str | None  # the latest sweep's run (tag role=sweep): its points are its child runs
    sweep: str | None  # that sweep's name and the first characters of its id


def base_url(host: str, port: int) -> str:
    return f"http://{host}:{port}"


def runs_table_url(base: str, experiment_id: str) -> str:
    """The runs table, opened on the experiment's view (store.VIEW: the points grouped by sweep, its columns). The
    share key must be on the `/runs` route: the bare experiment route redirects there and drops it."""
    return (f"{base}/#/experiments/{experiment_id}/runs?viewStateShareKey={store.VIEW_KEY}"
            "&workflowType=machine_learning")


def run_url(base: str, experiment_id: str, run_id: str) -> str:
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def store_exists(uri: str) -> bool:
    """A sqlite store exists once its file does; any other store (a server) is taken to exist."""
    path = store.sqlite_path(uri)
    return path is None or path.is_file()


def addresses(uri: str, base: str) -> Addresses | None:
    """The runs table and the latest sweep's run of the project's experiment in `uri`, served at `base`;
    None when the store or the experiment does not exist (nothing logged yet). Raises what MLflow raises
    when the store cannot be read (store.tracking_errors())."""
    if not store_exists(uri):
        return None
    store.configure_http()
    from mlflow.tracking import MlflowClient

    store.quiet_loggers()
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None or experiment.lifecycle_stage != "active":
        return None
    eid = experiment.experiment_id
    sweeps = client.search_runs([eid], filter_string="tags.role = 'sweep'", max_results=1,
                                order_by=["attributes.start_time DESC"])
    if not sweeps:
        return Addresses(runs_table_url(base, eid), None, None)
    tags = sweeps[0].data.tags
    return Addresses(runs_table_url(base, eid), run_url(base, eid, sweeps[0].info.run_id),
                     f"{tags.get('sweep', '?')} {tags.get('sweep.id', '')[:8]}".strip())


MOVED = ("MLflow records absolute artifact locations (a sqlite store has no relative one), so this store's "
         "artifacts are still read from {recorded}: rebuild the copy's runs from its receipts (rm -r mlflow.db "
         "mlartifacts && posttrainllm receipt import runs; docs/results.md)")


def moved_artifacts(uri: str) -> str | None:
    """For a sqlite store copied from elsewhere: the artifact location it still records (not the mlartifacts/
    beside it), or None. Only reads the store."""
    expected = artifact_location(uri)
    if expected is None or not store_exists(uri):
        return None
    from mlflow.tracking import MlflowClient

    store.quiet_loggers()
    experiment = MlflowClient(tracking_uri=uri).get_experiment_by_name(EXPERIMENT)
    recorded = experiment.artifact_location if experiment is not None else None
    return recorded if recorded and recorded.rstrip("/") != expected.rstrip("/") else None


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def start(uri: str, host: str, port: int, **popen: object) -> subprocess.Popen:
    """`mlflow ui` on the store, in a session of its own: `stop` ends it and the workers it starts."""
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", host, "--port", str(port),
               "--workers", "1", "--uvicorn-opts", "--no-access-log"]  # not a line per request (the readiness polls)
    artifacts = artifact_location(uri)
    if artifacts:  # new experiments' artifacts beside the store, as the receipts' (not ./mlartifacts of the cwd)
        command += ["--default-artifact-root", artifacts]
    return subprocess.Popen(command, env={**os.environ, **SERVER_ENV}, start_new_session=True, **popen)


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local server: never through a proxy


def wait_ready(server: subprocess.Popen, base: str, timeout_s: float) -> bool:
    """Whether the server answers /health within timeout_s (False as soon as it exits)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            return False
        try:
            with _DIRECT.open(f"{base}/health", timeout=2) as answer:
                if answer.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def stop(server: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM to the server's own process group (it and the workers it started), SIGKILL to what lingers."""
    import signal

    group = server.pid  # start_new_session: the group's id is the server's pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            server.poll()  # reap the server itself, so the group empties
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                server.wait()
                return
            time.sleep(0.1)
    server.wait()
