"""The MLflow store: opened once per process, created under a lock, bounded when it is a server.

* A sqlite store is created or upgraded once, under an `fcntl` lock on `<mlflow.db>.lock`
  beside the database, before any run is logged: MLflow's own table creation races when
  several processes open the same fresh store (`table latest_metrics already exists`).
  `log_to_mlflow` holds the same lock while it finds and writes a run, so two writers
  never both decide that a receipt or a sweep run is missing.
* An `http(s)://` server that does not answer fails within seconds, not minutes: the HTTP
  retry and timeout variables get short defaults unless the user has set them (HTTP_DEFAULTS).
* MLflow's and alembic's INFO lines ("Creating initial MLflow database tables...") are
  silenced at their loggers (WARNING) unless MLFLOW_LOGGING_LEVEL is set.
* The experiment is tagged a model-training one (`mlflow.experimentKind`). MLflow 3.17.2's UI
  picks its page from its own "GenAI / Model training" switch (the URL's `?workflowType=`,
  else the browser's saved choice, GenAI by default), so link the runs table as
  `#/experiments/<id>?workflowType=machine_learning`; scripts/check-mlflow-ui.sh checks it.
* The experiment carries the runs table's view (VIEW: the point's change, verdict, best peer, its speedup, ours
  against it, the step effect), opened by the URL's `viewStateShareKey` (ui.py).

Nothing here imports MLflow at module level: the core runs where MLflow is absent.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shlex
from pathlib import Path
from typing import Any, Iterator

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"  # a model-training experiment (not genai_development)

# The runs table's columns when it opens. MLflow 3.17's UI keeps a person's columns in the browser (local storage)
# and starts a new browser on Source, Models and Dataset; what an experiment can carry is a shared view: the tag
# `mlflow.sharedViewState.<key>` holds its JSON (search facets and UI state: selectedColumns, ...) and the URL's
# `viewStateShareKey=<key>` opens it (the UI's own "Share" button writes the same). Column keys are the UI's:
# "metrics.`name`", "tags.`name`". The metrics and tags named here are the ones receipt.py logs.
VIEW_KEY = "posttrainllm-answer"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
VIEW_COLUMNS = ("tags.`sweep.changes`", "tags.`verdict`", "tags.`best_peer`",
                "metrics.`best_peer.fwd_speedup_vs_reference`", "metrics.`triton.fwd_speedup_vs_best_peer`",
                "tags.`step.effect`")
VIEW = {"searchFilter": "", "groupBy": {"aggregateFunction": "average", "groupByKeys": [{"mode": "tag", "groupByData": "sweep"}]}, "orderByKey": "attributes.start_time", "orderByAsc": False,
        "selectedColumns": list(VIEW_COLUMNS), "columnOrder": list(VIEW_COLUMNS), "runsHiddenMode": "SHOW_ALL"}
VIEW_NAME = "the answer: change, verdict, speedups, step"


def view_tag(now_ms: int | None = None) -> str:
    """VIEW in the UI's saved-view envelope (it lists it under "Views" too): name, times in ms, the state as a
    JSON string."""
    import time

    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    return json.dumps({"name": VIEW_NAME, "createdAt": now_ms, "updatedAt": now_ms,
                       "state": json.dumps(VIEW, sort_keys=True)})


def view_state(tag: str | None) -> dict[str, Any] | None:
    """The state a saved-view tag holds, None where it holds none."""
    try:
        return json.loads(json.loads(tag)["state"]) if tag else None
    except (ValueError, KeyError, TypeError):
        return None

# Short, bounded defaults for a tracking server (MLflow's own: 7 retries, backoff factor 2,
# 120 s timeout, ~250 s before an unreachable server is reported). A refused connection now
# fails in ~3-5 s; a server that accepts but never answers in ~35 s (3 tries x 10 s, measured 34.5 s).
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",  # MLflow reads an int: sleeps 1 s, 2 s between tries
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",  # seconds, per request (connect and read)
}

_opened: dict[tuple[str, str], tuple[Any, str]] = {}  # (uri, experiment) -> (client, its id), once per process


class TrackingFailed(RuntimeError):
    """MLflow could not be written; the receipt JSON is on disk and can be imported later.

    `line()` is the one line a command prints: what failed, where the receipt JSON is, and the
    exact command that logs it later. `receipt` is set by `record` (the caller still prints it).
    """

    def __init__(self, uri: str, reason: str, *, unreachable: bool, folder: Path | None = None,
                 kept: str | None = None, then: str = "log it later with"):
        self.uri, self.reason, self.unreachable = uri, reason, unreachable
        self.folder, self.kept, self.then = folder, kept, then
        self.receipt: dict[str, Any] | None = None
        super().__init__(self.line())

    def line(self) -> str:
        what = "tracking server unreachable" if self.unreachable else "MLflow logging failed"
        line = f"posttrainllm: {what} ({self.uri}: {self.reason})"
        if self.folder is not None:
            kept = self.kept or f"receipt kept at {self.folder / 'receipt.json'}"
            line += f"; {kept}; {self.then}: posttrainllm receipt import {shlex.quote(str(self.folder))}"
        return line


def configure_http() -> dict[str, str]:
    """Set the bounded HTTP defaults where the user has not set them; return what is in effect."""
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in HTTP_DEFAULTS}


def quiet_loggers() -> None:
    """MLflow's and alembic's INFO lines off (WARNING and above stay), unless MLFLOW_LOGGING_LEVEL asks."""
    if os.environ.get("MLFLOW_LOGGING_LEVEL"):
        return
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///` URI, None for any other store."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///").split("?", 1)[0])


@contextlib.contextmanager
def lock(uri: str) -> Iterator[None]:
    """An exclusive lock on `<mlflow.db>.lock` for a sqlite store (released if the process dies)."""
    db = sqlite_path(uri)
    if db is None:  # a server serializes its own writes
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{db}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def unreachable(exc: BaseException) -> bool:
    """Whether an MLflow error means the server could not be reached (refused, timed out, DNS)."""
    import requests

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                                ConnectionError, TimeoutError)):
            return True
        current = current.__cause__ or current.__context__
    text = str(exc)
    return "Max retries exceeded" in text or "Failed to establish a new connection" in text


def tracking_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean 'the store could not be written', not a bug in this code."""
    import requests
    from mlflow.exceptions import MlflowException

    errors: tuple[type[BaseException], ...] = (MlflowException, requests.exceptions.RequestException,
                                               ConnectionError, TimeoutError)
    try:
        import sqlalchemy.exc
    except ImportError:
        return errors
    return (*errors, sqlalchemy.exc.OperationalError)


def short_reason(exc: BaseException) -> str:
    """The first line of an error, without MLflow's long URL preamble, at most 200 characters."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    for pattern in (r"\[Errno -?\d+\] [^\"')]+", r"Read timed out\.?(?: \(read timeout=[\d.]+\))?",
                    r"Connection to \S+ timed out\.?(?: \(connect timeout=[\d.]+\))?"):
        found = re.search(pattern, text)  # urllib3's reason inside MLflow's "API request ... failed" text
        if found:
            return found.group(0).strip(" .")
    if "Caused by" in text:
        text = text[text.index("Caused by"):].removeprefix("Caused by ").strip("()\"' ")
    return text[:200]


def open_store(uri: str, experiment_name: str, artifact_location: str | None) -> tuple[Any, str]:
    """An MlflowClient on `uri` and the experiment's id: the store created once, under the lock.

    The experiment is created as a model-training one, or tagged so if it exists without the
    tag (an experiment the user tagged otherwise keeps its tag); a deleted one is restored.
    """
    if (uri, experiment_name) in _opened:
        return _opened[uri, experiment_name]
    configure_http()
    from mlflow.tracking import MlflowClient

    quiet_loggers()  # after MLflow's import, which configures its loggers
    with lock(uri):
        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(experiment_name)  # creates/upgrades a sqlite store here
        if experiment is None:
            experiment_id = client.create_experiment(experiment_name, artifact_location=artifact_location,
                                                     tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        else:
            experiment_id = experiment.experiment_id
            if experiment.lifecycle_stage == "deleted":
                client.restore_experiment(experiment_id)
            if EXPERIMENT_KIND_TAG not in experiment.tags:
                client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        if experiment is None or view_state(experiment.tags.get(VIEW_TAG)) != VIEW:  # the table opens on its columns
            client.set_experiment_tag(experiment_id, VIEW_TAG, view_tag())
    _opened[uri, experiment_name] = (client, experiment_id)
    return client, experiment_id
