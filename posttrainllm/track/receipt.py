"""The receipt: everything needed to trace a number back, as JSON on disk and as an MLflow run.

`build` gathers what the stages wrote in a point's folder, plus the provenance
(git revision, device fingerprint, library versions). `log_to_mlflow` is the only
code in the project that talks to MLflow: one run per point, nested under one run
per sweep. The JSON file is written first, so a receipt made where MLflow is
absent (a GPU node, say) can be imported later.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from posttrainllm.measure import device as devices
from posttrainllm.track.provenance import git_revision, project_root
from posttrainllm.config import LabConfig, point_config
from posttrainllm.files import point_dir, read_json, write_json

SCHEMA = "posttrainllm.track.receipt/1"
EXPERIMENT = "posttrainllm"
ARTIFACTS = ("receipt.json", "parity.json", "kernel.json", "microbench.json", "timings.csv", "curve.csv",
             "time_vs_size.png", "memory_vs_size.png", "roofline.png", "bench_train.json", "config.yaml")


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{project_root().resolve() / 'mlflow.db'}"


def artifact_location(uri: str) -> str | None:
    """Artifacts beside a sqlite store (mlartifacts/ next to mlflow.db), not in ./mlruns of whatever cwd."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()
    return None  # a tracking server decides


def _read_optional(path: Path) -> Any:
    return read_json(path) if path.exists() else None


def _parity_summary(report: dict[str, Any] | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {"verdict": report["verdict"], "precision": report["precision"], "contract": report["contract"],
            "rule": report["rule"], "notes": report["notes"],
            "paths": {name: {k: p[k] for k in ("verdict", "failed_cases", "worst", "emulation")}
                      for name, p in report["paths"].items()}}


def build(cfg: LabConfig, *, sweep: dict[str, Any] | None = None) -> dict[str, Any]:
    """Assemble the receipt of one point from its folder; write receipt.json and metrics.json."""
    out = point_dir(cfg)
    device = devices.resolve(cfg.device.name)
    parity_report = _read_optional(out / "parity.json")
    receipt = {
        "schema": SCHEMA,
        "point": cfg.run.name,
        "sweep": sweep,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "provenance": {**git_revision(), "machine": devices.fingerprint(device),
                       "triton_interpreted": devices.triton_interpreted()},
        "config": point_config(cfg),
        "kernel": _read_optional(out / "kernel.json"),
        "parity": _parity_summary(parity_report),
        "microbench": _read_optional(out / "microbench.json"),
        "bench_train": _read_optional(out / "bench_train.json"),
    }
    write_json(out / "receipt.json", receipt)
    write_json(out / "metrics.json", metrics(receipt))
    (out / "config.yaml").write_text(OmegaConf.to_yaml(receipt["config"]))
    return receipt


def mlflow_available() -> bool:
    try:
        import mlflow  # noqa: F401
    except ImportError:
        return False
    return True


def record(cfg: LabConfig, *, sweep: dict[str, Any] | None = None) -> tuple[dict[str, Any], str | None]:
    """The receipt stage: the JSON receipt always; the MLflow run when asked for and MLflow is installed."""
    receipt = build(cfg, sweep=sweep)
    if not cfg.run.log_mlflow:
        return receipt, None
    if not mlflow_available():
        print("posttrainllm: mlflow is not installed here; receipt kept as JSON only "
              f"({point_dir(cfg) / 'receipt.json'})")
        return receipt, None
    return receipt, log_to_mlflow(receipt, point_dir(cfg))


def metrics(receipt: dict[str, Any]) -> dict[str, float]:
    """The receipt's numbers, flat: parity errors and verdicts, valid timings, throughput, speedups, train."""
    flat: dict[str, float] = {}
    parity_report = receipt.get("parity") or {"paths": {}}
    for name, p in parity_report["paths"].items():
        flat[f"parity.{name}.pass"] = float(p["verdict"] == "pass")
        for output, worst in p["worst"].items():
            for key in ("max_abs_err", "max_rel_err", "mismatch_frac", "allowed_abs_err"):
                if key in worst:
                    flat[f"parity.{name}.{output}.{key}"] = worst[key]
    bench = receipt.get("microbench") or {"paths": {}}
    for name, entry in bench["paths"].items():
        if not entry["valid"]:
            continue  # interpreter timings and failed paths carry no speed
        for key in ("median_ms", "p20_ms", "p80_ms", "min_ms", "iqr_ms", "cv", "gflops_per_s", "gbytes_per_s",
                    "speedup_vs_reference"):
            if key in entry:
                flat[f"bench.{name}.{key}"] = entry[key]
        flat[f"bench.{name}.noisy"] = float(entry["noisy"])
        flat[f"bench.{name}.peak_bytes"] = entry["memory"]["peak_bytes"]
        if entry.get("roofline"):
            flat[f"bench.{name}.roofline_fraction"] = entry["roofline"]["fraction_of_attainable"]
            flat[f"bench.{name}.intensity_flops_per_byte"] = entry["roofline"]["intensity_flops_per_byte"]
    for name, x in bench.get("curve", {}).get("crossover_vs_reference", {}).items():
        if x is not None:
            flat[f"curve.{name}.crossover_x"] = x
    train = receipt.get("bench_train")
    if train:
        for name, entry in train["impls"].items():
            flat[f"train.{name}.final_loss"] = entry["losses"][-1]
            if entry.get("peak_mem_bytes"):
                flat[f"train.{name}.peak_mem_bytes"] = entry["peak_mem_bytes"]
            if entry.get("timing_valid", True):
                flat[f"train.{name}.warm_ms_per_step"] = entry["warm_ms_per_step"]
                flat[f"train.{name}.tokens_per_s"] = entry["tokens_per_s"]
        for name, drift in train["drift"].items():
            flat[f"train.{name}.loss_drift"] = drift
        for name, check in train.get("amdahl", {}).get("variants", {}).items():
            if check["valid"]:
                flat[f"train.{name}.predicted_speedup"] = check["predicted_speedup"]
                flat[f"train.{name}.measured_speedup"] = check["measured_speedup"]
        if train.get("amdahl"):
            flat[f"train.{train['amdahl']['op']}_fraction"] = train["amdahl"]["fraction"]
    return flat


def _flatten(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    else:
        out[prefix] = str(value)


def _tags(receipt: dict[str, Any]) -> dict[str, str]:
    prov, machine = receipt["provenance"], receipt["provenance"]["machine"]
    tags = {
        "git.revision": prov["revision"], "git.dirty": str(prov["dirty"]),
        "device": machine["device"], "device.name": machine["device_name"], "threads": str(machine["threads"]),
        "torch": machine["torch"], "triton": machine["triton"], "python": machine["python"],
        "triton.interpreted": str(prov["triton_interpreted"]), "point": receipt["point"],
        "parity.verdict": (receipt["parity"] or {}).get("verdict", "missing"),
        "receipt.schema": receipt["schema"],
        "receipt.id": hashlib.sha256(json.dumps(receipt, sort_keys=True).encode()).hexdigest()[:16],
    }
    if receipt["sweep"]:
        tags["sweep"] = receipt["sweep"]["name"]
        tags["sweep.changes"] = ",".join(f"{k}={v}" for k, v in receipt["sweep"]["changes"].items()) or "baseline"
    return tags


def _sweep_parent(client: Any, experiment_id: str, sweep: dict[str, Any]) -> str:
    """The run that stands for one sweep plan: found by its id, created on first use."""
    found = client.search_runs([experiment_id], filter_string=f"tags.`sweep.id` = '{sweep['id']}'", max_results=1)
    if found:
        return found[0].info.run_id
    parent = client.create_run(experiment_id, run_name=f"sweep {sweep['name']} {sweep['id'][:8]}",
                               tags={"sweep": sweep["name"], "sweep.id": sweep["id"], "role": "sweep"})
    client.set_terminated(parent.info.run_id)
    return parent.info.run_id


def log_to_mlflow(receipt: dict[str, Any], folder: Path, uri: str | None = None) -> str:
    """One MLflow run for the receipt (nested under its sweep's run); returns the run id."""
    import mlflow
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    uri = uri or tracking_uri()
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(
        EXPERIMENT, artifact_location=artifact_location(uri))
    tags = _tags(receipt)
    found = client.search_runs([experiment_id], filter_string=f"tags.`receipt.id` = '{tags['receipt.id']}'",
                               max_results=1)
    if found:  # the same receipt imported twice stays one run
        return found[0].info.run_id
    if receipt["sweep"]:
        tags[mlflow.utils.mlflow_tags.MLFLOW_PARENT_RUN_ID] = _sweep_parent(client, experiment_id, receipt["sweep"])
    run = client.create_run(experiment_id, run_name=receipt["point"], tags=tags)
    run_id = run.info.run_id
    params: dict[str, str] = {}
    _flatten("", receipt["config"], params)
    now = int(dt.datetime.now().timestamp() * 1000)
    values = [Metric(k, float(v), now, 0) for k, v in metrics(receipt).items()]
    train = receipt.get("bench_train")
    for name, entry in (train or {}).get("impls", {}).items():
        values += [Metric(f"train.{name}.loss", loss, now, step) for step, loss in enumerate(entry["losses"])]
    param_list = [Param(k, v[:6000]) for k, v in params.items()]
    for i in range(0, max(len(param_list), len(values)), 100):
        client.log_batch(run_id, metrics=values[i:i + 100], params=param_list[i:i + 100])
    for name in ARTIFACTS:
        if (folder / name).exists():
            client.log_artifact(run_id, str(folder / name))
    client.set_tag(run_id, "receipt.logged", "true")
    client.set_terminated(run_id, "FINISHED" if tags["parity.verdict"] == "pass" else "FAILED")
    return run_id


def import_folder(folder: Path, uri: str | None = None) -> list[tuple[Path, str]]:
    """Log every receipt.json under `folder` (made where MLflow was absent) into the MLflow store.

    Each receipt's sibling files (parity.json, timings.csv, ...) become its artifacts.
    Receipts already in the store (same receipt.id) are not logged twice.
    """
    found = sorted(folder.rglob("receipt.json"))
    logged = []
    for path in found:
        receipt = read_json(path)
        if receipt.get("schema") != SCHEMA:
            raise ValueError(f"{path}: schema {receipt.get('schema')!r}, expected {SCHEMA!r}")
        logged.append((path, log_to_mlflow(receipt, path.parent, uri)))
    return logged
