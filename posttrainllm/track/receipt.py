"""The receipt: everything needed to trace a number back, as JSON on disk and as an MLflow run.

`build` gathers what the stages wrote in a point's folder, plus the provenance
(git revision, device fingerprint, library versions). `log_to_mlflow` is the only
code in the project that logs to MLflow (store.py opens the store): one run per point,
nested under one run per sweep. The JSON file is written first, so a receipt made where
MLflow is absent (a GPU node) or unreachable can be imported later.

A run counts as logged only when complete: its `receipt.logged` tag is written after
everything else and the run is terminated (FINISHED, or FAILED when the point's verdict is
not a pass). A retry replaces an incomplete run of the same receipt. The sweep's run is
RUNNING while some of its points have no complete run, FINISHED when all do, FAILED as soon
as one point failed.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from posttrainllm import rules
from posttrainllm.measure import device as devices
from posttrainllm.track import derived, records, store
from posttrainllm.track.derived import quality_failures, verdict  # what a receipt's figures say
from posttrainllm.track.provenance import git_revision, project_root
from posttrainllm.track.found import (HEADS_SCHEMA, RECEIPT_FAMILY, RECEIPT_NAME, SCHEMA,  # noqa: F401
                                      is_receipt, receipt_files)
from posttrainllm.config import DIMENSIONS, LabConfig, point_config
from posttrainllm.files import point_dir, read_json, write_json

EXPERIMENT = "posttrainllm"
ARTIFACTS = ("receipt.json", "metrics.json", "parity.json", "kernel.json", "microbench.json", "timings.csv",
             "curve.csv",
             "time_vs_size.png", "memory_vs_size.png", "roofline.png", "bench_train.json", "config.yaml")


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{project_root().resolve() / 'mlflow.db'}"


def artifact_location(uri: str) -> str | None:
    """Artifacts beside a sqlite store (mlartifacts/ next to mlflow.db), not in ./mlruns of whatever cwd."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()
    return None  # a tracking server decides


def _read_record(kind: type[records.Record], out: Path) -> dict[str, Any] | None:
    """A stage's record in the point's folder as the receipt keeps it (its dict), None where the stage did not run;
    read through its one reader (track/records.py), which checks its schema version."""
    record = kind.read_optional(out / kind.FILE)
    return None if record is None else record.to_dict()


def _parity_summary(report: dict[str, Any] | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {"verdict": report["verdict"], "precision": report["precision"], "contract": report["contract"],
            "lse_contract": report.get("lse_contract"), "first_failure": report.get("first_failure"),
            "headline": report.get("headline"), "cannot_run_here": report.get("cannot_run_here"),
            "inputs": report.get("inputs"), "quantization": report.get("quantization"),
            "rule": report["rule"], "notes": report["notes"], "backward_rule": report.get("backward_rule"),
            "invariance": report.get("invariance"),
            "paths": {name: {k: p.get(k) for k in ("verdict", "failed_cases", "violations", "worst", "emulation",
                                                   "backward", "gradients", "error", "cannot_run_here",
                                                   "determinism", "batch_invariance", "properties")}
                      for name, p in report["paths"].items()}}


def build(cfg: LabConfig, *, sweep: dict[str, Any] | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """Assemble the receipt of one point from its folder; write receipt.json and metrics.json.

    `overrides`: the command line's (`posttrainllm bench`, whose folder name holds only a hash of long ones); a
    sweep point's are its params.yaml entry (None here: `sweep.changes` and `config` say what it is).

    The stages' stamps (runs/<point>/stamps/, written by the DVC stages) are checked first:
    stages that ran different versions of a source file they shared (this process's modules
    included), or timed stages on different devices, raise stamp.StampMismatch (one line
    naming both stages and the file) before anything is written. Every stamp goes into the
    receipt under "stamps"; a folder without stamps (`posttrainllm bench`) is not checked.
    """
    from posttrainllm.track import stamp

    out = point_dir(cfg)
    stamps = stamp.read_stamps(out, exclude=("receipt",))
    if stamps:
        stamp.check_consistent({**stamps, "receipt": {"sources": stamp.loaded_sources()}}, out / stamp.STAMPS)
    device = devices.resolve(cfg.device.name)
    parity_report = _read_record(records.ParityRecord, out)
    receipt = {
        "schema": SCHEMA,
        "point": cfg.run.name,
        "sweep": sweep,
        "overrides": overrides,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "provenance": {**git_revision(), "machine": devices.fingerprint(device),
                       "triton_interpreted": devices.triton_interpreted()},
        "config": point_config(cfg),
        "kernel": _read_record(records.KernelRecord, out),
        "parity": _parity_summary(parity_report),
        "microbench": _read_record(records.MicrobenchRecord, out),
        "bench_train": _read_record(records.BenchTrainRecord, out),
        "stamps": stamps,
    }
    receipt["integrity"] = {"rule": rules.cite("integrity"),
                            "problems": integrity_problems(cfg, out, stamps, parity_report, receipt["microbench"])}
    withhold_speed(receipt)
    # the user paths' identities (spec, file, sha256, distribution, version), where a reader looks for them
    receipt["user_impls"] = {name: entry["user"] for name, entry in ((receipt["kernel"] or {}).get("paths")
                                                                     or {}).items() if entry.get("user")}
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


def record(cfg: LabConfig, *, sweep: dict[str, Any] | None = None,
           overrides: list[str] | None = None) -> tuple[dict[str, Any], str | None]:
    """The receipt stage: the JSON receipt always; the MLflow run when asked for and MLflow is installed.

    Raises store.TrackingFailed (its `receipt` set) when MLflow could not be written: the JSON
    receipt is on disk by then, and the error's line names the command that logs it later.
    """
    receipt = build(cfg, sweep=sweep, overrides=overrides)
    if not cfg.run.log_mlflow:
        return receipt, None
    if not mlflow_available():
        print("posttrainllm: mlflow is not installed here; receipt kept as JSON only "
              f"({point_dir(cfg) / 'receipt.json'})")
        return receipt, None
    try:
        return receipt, log_to_mlflow(receipt, point_dir(cfg))
    except store.TrackingFailed as exc:
        exc.receipt = receipt
        raise


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
        for prop, held in ((p.get("properties") or {}).items()):  # bitwise (lab/invariance.py): 1 holds, 0 not
            if held.get("holds") is not None:
                flat[f"parity.{name}.{prop}"] = float(held["holds"])
    quantization = parity_report.get("quantization") or {}
    for key in ("sqnr_db", "row_min_sqnr_db"):  # the lowest over cases (a near-exact case's may be +inf)
        if quantization.get(key) is not None and math.isfinite(quantization[key]):
            flat[f"parity.quantization.{key}"] = quantization[key]
    bench = receipt.get("microbench") or {"paths": {}}
    for name, entry in bench["paths"].items():
        if not entry["valid"]:
            continue  # interpreter timings and failed paths carry no speed
        for key in ("median_ms", "p20_ms", "p80_ms", "min_ms", "iqr_ms", "cv", "gflops_per_s", "gbytes_per_s",
                    "speedup_vs_reference"):
            if key in entry:
                flat[f"bench.{name}.{key}"] = entry[key]
        for key in ("median_ms", "p20_ms", "p80_ms", "gflops_per_s", "speedup_vs_reference"):
            if key in entry.get("forward_backward", {}):
                flat[f"bench.{name}.fwd_bwd.{key}"] = entry["forward_backward"][key]
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
        if (train.get("noise") or {}).get("band") is not None:
            flat["train.noise_band"] = train["noise"]["band"]
    return flat


FILTER_GROUPS = ("tile", "workgroup")  # a kernel's knobs: every value a parameter (a few each)
FILTER_VALUES = ("precision.dtype", "op.only", "op.user_impls", "bench.threads")


def run_params(receipt: dict[str, Any]) -> dict[str, str]:
    """The MLflow run's parameters, at most MAX_PARAMS, in this order: the shape (the microbench's problem), the
    point's dimensions by name, and the few values a person filters by (FILTER_GROUPS, FILTER_VALUES); the whole
    config is its config.yaml artifact."""
    config = receipt["config"]
    flat: dict[str, str] = {}
    problem = (receipt.get("microbench") or {}).get("problem")
    if problem:  # the shape first: what the point's figures are of
        flat["shape"] = str(problem)
    for dimension in DIMENSIONS:
        group = config.get(dimension)
        if isinstance(group, dict) and "name" in group:
            flat[f"{dimension}.name"] = str(group["name"])
        elif isinstance(group, str):
            flat[dimension] = group
    _flatten("", {group: config[group] for group in FILTER_GROUPS if isinstance(config.get(group), dict)}, flat)
    for key in FILTER_VALUES:
        group, _, name = key.partition(".")
        value = (config.get(group) or {}).get(name) if isinstance(config.get(group), dict) else None
        if value not in (None, [], ""):
            flat[key] = str(value)
    return dict(list(flat.items())[:MAX_PARAMS])


MAX_PARAMS = 30  # a run's parameters a person reads: the shape, the dimensions, the kernel's knobs


def headline_metrics(receipt: dict[str, Any]) -> dict[str, float]:
    """The MLflow run's metrics, a handful per path that make sense as default columns (track/derived.py: the
    numbers every view shows): parity pass, forward and forward+backward median and speedup against the
    reference, a roofline fraction that is a result (<= 1), training loss drift and tokens/s; and the point's
    best-peer, ours-against-it and end-to-end figures. Every other number is in the metrics.json artifact."""
    fields = derived.point_fields(receipt)
    flat: dict[str, float] = {}
    for name, f in fields["paths"].items():
        if f["verdict"] in ("pass", "fail"):
            flat[f"parity.{name}.pass"] = float(f["verdict"] == "pass")
        for key, value in (("median_ms", f["fwd_ms"]), ("fwd_bwd.median_ms", f["fb_ms"]),
                           ("speedup_vs_reference", f["fwd_x"]), ("fwd_bwd.speedup_vs_reference", f["fb_x"]),
                           ("roofline_fraction", None if f["roofline_flag"] else f["roofline_fraction"])):
            if value is not None:
                flat[f"bench.{name}.{key}"] = value
    train = receipt.get("bench_train") or {}
    for name, drift in (train.get("drift") or {}).items():
        flat[f"train.{name}.loss_drift"] = drift
    for name, entry in (train.get("impls") or {}).items():
        if entry.get("timing_valid", True) and entry.get("tokens_per_s") is not None:
            flat[f"train.{name}.tokens_per_s"] = entry["tokens_per_s"]
    for key, value in ((POINT_METRICS["peer_x"], fields["peer_x"]), (POINT_METRICS["peer_fb_x"], fields["peer_fb_x"]),
                       (POINT_METRICS["ours_x"], fields["ours_x"]), (POINT_METRICS["ours_fb_x"], fields["ours_fb_x"]),
                       (POINT_METRICS["e2e_pred"], fields["e2e_pred"]), (POINT_METRICS["e2e_meas"], fields["e2e_meas"]),
                       (POINT_METRICS["e2e_share"], fields["e2e_share"])):
        if isinstance(value, (int, float)):
            flat[key] = value
    return {key: significant(key, value) for key, value in flat.items()}


# the point's figures (derived.point_fields) as MLflow metrics, each named by what it is
POINT_METRICS = {"peer_x": "best_peer.fwd_speedup_vs_reference", "peer_fb_x": "best_peer.fwd_bwd_speedup_vs_reference",
                 "ours_x": "triton.fwd_speedup_vs_best_peer", "ours_fb_x": "triton.fwd_bwd_speedup_vs_best_peer",
                 "e2e_pred": "step.predicted_speedup", "e2e_meas": "step.measured_speedup",
                 "e2e_share": "step.op_share"}
SIGNIFICANT = 3  # digits a metric keeps: a CPU median's p20-p80 band is never narrower than 0.1%


def significant(key: str, value: float) -> float:
    """A metric rounded to SIGNIFICANT digits (a pass flag and a drift of exactly 0 stay as they are)."""
    if not value or not math.isfinite(value) or key.endswith(".pass"):
        return value
    return round(value, SIGNIFICANT - 1 - math.floor(math.log10(abs(value))))


def _flatten(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    else:
        out[prefix] = str(value)




def integrity_problems(cfg: LabConfig, out: Path, stamps: dict[str, Any], parity_report: dict[str, Any] | None,
                       microbench: dict[str, Any] | None) -> list[str]:
    """Rule "integrity"'s findings for one point, one line each (none: [])"""
    from posttrainllm.track import stamp

    problems = stamp.check_outputs(stamps, out)
    for key, contract in (("contract", cfg.precision.contract), ("lse_contract", cfg.precision.lse_contract)):
        judged, config = (parity_report or {}).get(key), json.loads(json.dumps(asdict(contract)))  # as JSON holds it
        if judged is not None and judged != config:
            changed = sorted(k for k in set(judged) | set(config) if judged.get(k) != config.get(k))
            problems.append(f"parity judged by another {key} than the config's (differs in {', '.join(changed)})")
    problem = ((microbench or {}).get("calibration") or {}).get("problem")
    if problem:
        problems.append(problem)
    return problems


def withhold_speed(receipt: dict[str, Any]) -> None:
    """A path that failed the quality gate gets no speed, as one that failed parity: its microbench entry in the
    receipt is marked invalid with the reason (its raw timings stay in microbench.json and timings.csv)."""
    paths = (receipt.get("microbench") or {}).get("paths") or {}
    problems = (receipt.get("integrity") or {}).get("problems") or []
    for name in paths if problems else ():
        paths[name] = {**paths[name], "valid": False, "reason": f"the receipt's integrity ({problems[0]}): no speed"}
    for name, why in quality_failures(receipt).items():
        if name in paths:
            paths[name] = {**paths[name], "valid": False,
                           "reason": f"failed the quality gate ({why}): no speed"}


def _tags(receipt: dict[str, Any]) -> dict[str, str]:
    prov, machine = receipt["provenance"], receipt["provenance"]["machine"]
    tags = {
        "git.revision": prov["revision"], "git.dirty": str(prov["dirty"]),
        "device": machine["device"], "device.name": machine["device_name"], "threads": str(machine["threads"]),
        "torch": machine["torch"], "triton": machine["triton"], "python": machine["python"],
        "triton.interpreted": str(prov["triton_interpreted"]), "point": receipt["point"],
        "parity.verdict": (receipt["parity"] or {}).get("verdict", "missing"),
        "verdict": verdict(receipt),
        "receipt.schema": receipt["schema"],
        "receipt.id": hashlib.sha256(json.dumps(receipt, sort_keys=True).encode()).hexdigest()[:16],
    }
    for name, identity in (receipt.get("user_impls") or {}).items():  # a user path's identity, searchable
        for key in ("spec", "file", "sha256", "distribution", "version"):
            if identity.get(key):
                tags[f"user.{name}.{key}"] = str(identity[key])
    fields = derived.point_fields(receipt)  # the figures as every view shows them
    tags["best_peer"] = fields["best_peer"] or "none"
    tags["best_peer.rule"] = rules.text("best_peer")  # a view: the text
    tags["step.effect"] = step_effect(receipt, fields)
    if fields["e2e_sentence"]:
        tags["step.sentence"] = fields["e2e_sentence"][:5000]
    if fields["e2e_path"]:
        tags["step.path"] = fields["e2e_path"]
    tags["flags"] = ",".join(dict.fromkeys(f["figure"] for f in fields["flags"])) or "none"
    if fields["flags"]:  # each with its path and reason, as the report prints them
        tags["flags.reasons"] = "\n".join(f"{f['figure']}: {f['path']}: {f['reason']}" for f in fields["flags"])[:5000]
    if receipt["sweep"]:
        tags["sweep"] = receipt["sweep"]["name"]
        tags["sweep.id"] = receipt["sweep"]["id"]
        tags["sweep.changes"] = ",".join(f"{k}={v}" for k, v in receipt["sweep"]["changes"].items()) or "baseline"
        for dimension, value in receipt["sweep"]["changes"].items():  # filterable: tags.`change.precision` = 'fp16'
            tags[f"change.{dimension}"] = str(value)
    return tags


def step_effect(receipt: dict[str, Any], fields: dict[str, Any]) -> str:
    """The point's end-to-end effect in a table cell: the row's path, Amdahl's prediction and the measured step
    speedup, never a number inside the baseline's run-to-run band (model/amdahl.py measured_text)."""
    from posttrainllm.model import amdahl

    if not fields["e2e_path"]:
        return "no step figure for this row's paths (step.sentence says why)"
    band = ((receipt.get("bench_train") or {}).get("noise") or {}).get("band")
    measured = ((((receipt.get("bench_train") or {}).get("amdahl") or {}).get("variants") or {})
                .get(fields["e2e_path"]) or {}).get("measured_speedup")
    said = amdahl.measured_text(measured, band) or "-"
    return (f"{fields['e2e_path']}: predicted {fields['e2e_pred']:.2f}x, measured {said}"
            + (f" (band +-{(band - 1) * 100:.1f}%)" if band and "band" not in said else ""))


LOGGED_TAG = "receipt.logged"  # written after everything else: a run without it is an interrupted write
TERMINAL = ("FINISHED", "FAILED")


def _complete(run: Any) -> bool:
    """A run counts as logged only with its completion tag and a terminal status."""
    return run.data.tags.get(LOGGED_TAG) == "true" and run.info.status in TERMINAL


def _sweep_parent(client: Any, experiment_id: str, sweep: dict[str, Any]) -> str:
    """The run that stands for one sweep plan: found by its id, created (RUNNING) on first use."""
    found = client.search_runs([experiment_id], filter_string=f"tags.`sweep.id` = '{sweep['id']}' and "
                               "tags.role = 'sweep'", max_results=1, order_by=["attributes.start_time ASC"])
    if found:
        return found[0].info.run_id
    tags = {"sweep": sweep["name"], "sweep.id": sweep["id"], "role": "sweep"}
    if sweep.get("points") is not None:
        tags["sweep.points"] = ",".join(sweep["points"])[:5000]
    return client.create_run(experiment_id, run_name=f"sweep {sweep['name']} {sweep['id'][:8]}",
                             tags=tags).info.run_id


def sweep_status(client: Any, experiment_id: str, parent_id: str, points: list[str] | None) -> tuple[str, dict]:
    """The sweep's true state from its children: FAILED when a point's latest complete run failed,
    FINISHED when every point has a complete run, RUNNING while some are missing.

    Receipts from before the sweep listed its points (no `points`) count as all there.
    """
    children = client.search_runs([experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'",
                                  max_results=5000, order_by=["attributes.start_time DESC"])
    latest: dict[str, Any] = {}
    for run in children:
        if _complete(run):
            latest.setdefault(run.data.tags.get("point", run.info.run_id), run)
    failed = sorted(name for name, run in latest.items() if run.info.status == "FAILED")
    missing = [name for name in points if name not in latest] if points is not None else []
    status = "FAILED" if failed else "RUNNING" if missing else "FINISHED"
    expected = len(points) if points is not None else len(latest)
    tags = {"sweep.progress": f"{expected - len(missing)}/{expected} points logged",
            "sweep.failed": ",".join(failed)[:5000] or "none"}
    return status, tags


def _update_sweep(client: Any, experiment_id: str, parent_id: str, sweep: dict[str, Any]) -> None:
    status, tags = sweep_status(client, experiment_id, parent_id, sweep.get("points"))
    run = client.get_run(parent_id)
    for key, value in tags.items():
        if run.data.tags.get(key) != value:
            client.set_tag(parent_id, key, value)
    if status == run.info.status:
        return
    if status in TERMINAL:
        client.set_terminated(parent_id, status)
    else:
        client.update_run(parent_id, status=status)


def _write_run(client: Any, experiment_id: str, receipt: dict[str, Any], folder: Path, tags: dict[str, str]) -> str:
    """Create the run and fill it; the completion tag and the terminal status come last."""
    from mlflow.entities import Metric, Param

    from posttrainllm.track.failures import TRACEBACKS

    run_id = client.create_run(experiment_id, run_name=receipt["point"], tags=tags).info.run_id
    params = run_params(receipt)
    now = int(dt.datetime.now().timestamp() * 1000)
    values = [Metric(k, float(v), now, 0) for k, v in headline_metrics(receipt).items()]
    train = receipt.get("bench_train")
    for name, entry in (train or {}).get("impls", {}).items():
        values += [Metric(f"train.{name}.loss", loss, now, step) for step, loss in enumerate(entry["losses"])]
    param_list = [Param(k, v[:6000]) for k, v in params.items()]
    for i in range(0, max(len(param_list), len(values)), 100):
        client.log_batch(run_id, metrics=values[i:i + 100], params=param_list[i:i + 100])
    for name in ARTIFACTS:
        if (folder / name).exists():
            client.log_artifact(run_id, str(folder / name))
    if (folder / TRACEBACKS).is_dir():  # the full tracebacks of the paths that raised (track/failures.py)
        client.log_artifacts(run_id, str(folder / TRACEBACKS), TRACEBACKS)
    client.set_tag(run_id, LOGGED_TAG, "true")
    client.set_terminated(run_id, "FINISHED" if tags["verdict"] == "pass" else "FAILED")
    return run_id


def log_to_mlflow(receipt: dict[str, Any], folder: Path, uri: str | None = None) -> str:
    """One complete MLflow run for the receipt (nested under its sweep's run); returns the run id.

    A run of the same receipt left incomplete by an interrupted write (no completion tag, or
    not terminated) is deleted and the receipt logged anew; a complete one is reused. The
    sweep's run is then set to the sweep's state. On a sqlite store this all happens under
    the store's lock. Raises store.TrackingFailed when the store cannot be written.
    """
    uri = uri or tracking_uri()
    try:
        return _log(receipt, folder, uri)
    except store.tracking_errors() as exc:
        raise store.TrackingFailed(uri, store.short_reason(exc), unreachable=store.unreachable(exc),
                                   folder=folder) from exc


def _log(receipt: dict[str, Any], folder: Path, uri: str) -> str:
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    client, experiment_id = store.open_store(uri, EXPERIMENT, artifact_location(uri))
    tags = _tags(receipt)
    with store.lock(uri):
        run_id = _logged_before(client, experiment_id, tags["receipt.id"])
        parent_id = _sweep_parent(client, experiment_id, receipt["sweep"]) if receipt["sweep"] else None
        if run_id is None:
            if parent_id:
                tags[MLFLOW_PARENT_RUN_ID] = parent_id
            run_id = _write_run(client, experiment_id, receipt, folder, tags)
        if parent_id:
            _update_sweep(client, experiment_id, parent_id, receipt["sweep"])
            _sweep_table(client, parent_id, receipt, folder)
    return run_id


SWEEP_TABLE = "sweep_table.md"


def _sweep_table(client: Any, parent_id: str, receipt: dict[str, Any], folder: Path) -> None:
    """The sweep's run holds the sweep's table: `posttrainllm report`'s summary of the points logged so far (this
    receipt and its sweep's other points' receipts beside its folder), as the run's description (its page opens on
    it) and as the artifact SWEEP_TABLE, with every point's step sentence."""
    from posttrainllm.track import report

    found = {}
    for point in receipt["sweep"].get("points") or []:
        path = folder.parent / point / "receipt.json"
        if point != receipt["point"] and path.is_file():
            try:
                found[point] = read_json(path)
            except (OSError, ValueError):  # a sibling's damaged receipt: its own import names it
                continue
    found[receipt["point"]] = receipt
    found = {name: found[name] for name in (receipt["sweep"].get("points") or []) if name in found} or found
    frame = report.formatted(report.summary_frame(found))
    table = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns),
             *("| " + " | ".join(row) + " |" for row in frame.itertuples(index=False))]
    text = "\n".join([f"Sweep {receipt['sweep']['name']}: {len(found)} of "
                      f"{len(receipt['sweep'].get('points') or found)} points (`posttrainllm report`'s table)", "",
                      *table, "", *(f"- {line}" for line in report.step_lines(found))]) + "\n"
    client.set_tag(parent_id, "mlflow.note.content", text[:50000])
    client.log_text(parent_id, text, SWEEP_TABLE)


def _logged_before(client: Any, experiment_id: str, receipt_id: str) -> str | None:
    """The complete run of this receipt, when there is one: the same receipt logged twice stays one run.
    Runs of it that an interrupted write left incomplete are deleted: replaced, never counted as logged."""
    found = client.search_runs([experiment_id], filter_string=f"tags.`receipt.id` = '{receipt_id}'",
                               max_results=100, order_by=["attributes.start_time ASC"])
    done = [run for run in found if _complete(run)]
    if done:
        return done[0].info.run_id
    for run in found:
        client.delete_run(run.info.run_id)
    return None


def logged_run(receipt: dict[str, Any], uri: str | None = None) -> str | None:
    """The id of the receipt's complete MLflow run, or None; raises store.TrackingFailed when the store cannot
    be read (a launcher's parent checks what its jobs logged this way)."""
    uri = uri or tracking_uri()
    try:
        client, experiment_id = store.open_store(uri, EXPERIMENT, artifact_location(uri))
        found = client.search_runs([experiment_id], filter_string=f"tags.`receipt.id` = '{_tags(receipt)['receipt.id']}'",
                                   max_results=100)
    except store.tracking_errors() as exc:
        raise store.TrackingFailed(uri, store.short_reason(exc), unreachable=store.unreachable(exc)) from exc
    return next((run.info.run_id for run in found if _complete(run)), None)


class InvalidReceipts(ValueError):
    """Receipts that cannot be logged: (path, what is wrong) for each, out of `total` found."""

    def __init__(self, problems: list[tuple[Path, str]], total: int):
        self.problems, self.total = problems, total
        super().__init__("; ".join(f"{path}: {why}" for path, why in problems))


def check(path: Path, schemas: tuple[str, ...] = (SCHEMA,)) -> tuple[dict[str, Any] | None, str | None]:
    """Read one receipt.json and check it is one of `schemas` and holds everything logging needs:
    (receipt, None) or (None, why). A point's receipt by default; import takes draft-heads receipts too."""
    try:
        receipt = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}; truncated?)"
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"unreadable ({exc})"
    if not isinstance(receipt, dict):
        return None, f"not a receipt (a JSON {type(receipt).__name__}, not an object)"
    if receipt.get("schema") not in schemas:
        return None, f"schema {receipt.get('schema')!r}, expected {' or '.join(map(repr, schemas))}"
    heads = receipt["schema"] == HEADS_SCHEMA
    needed = ("point", "created_at", "provenance", "config", *(("base", "heads", "decode", "verdict") if heads
                                                               else ("sweep",)))
    missing = [key for key in needed if key not in receipt]
    if missing:
        return None, f"missing {', '.join(missing)}"
    try:
        _flatten("", receipt["config"], {})
        if heads:
            _heads_tags(receipt)
            heads_metrics(receipt)
            [float(loss) for loss in [*receipt["base"]["losses_every_50"], *receipt["heads"]["losses"]]]
            return receipt, None
        _tags(receipt)
        metrics(receipt)
        if receipt["sweep"]:
            str(receipt["sweep"]["id"])
        for entry in ((receipt.get("bench_train") or {}).get("impls") or {}).values():
            [float(loss) for loss in entry["losses"]]
    except KeyError as exc:
        return None, f"incomplete: no {exc.args[0]!r} field"
    except (TypeError, AttributeError, ValueError, IndexError) as exc:
        return None, f"malformed: {type(exc).__name__}: {exc}"
    return receipt, None


def import_folder(folder: Path, uri: str | None = None,
                  on_logged: Callable[[Path, str], None] | None = None) -> list[tuple[Path, str]]:
    """Log every receipt in `folder` (receipt_files; made where MLflow was absent) into the MLflow store.

    Points' receipts and draft-heads receipts both. Every receipt is checked first: if any is bad,
    none is logged (InvalidReceipts names each bad file and what is wrong). Each receipt's sibling
    files (parity.json, timings.csv, ...) become its artifacts. Receipts already logged completely
    (same receipt.id) are not logged twice; an incomplete run of one is replaced. `on_logged(path,
    run_id)` is called as each is logged, so a failure part way still shows what got in.
    """
    found = receipt_files(folder)
    checked = [(path, *check(path, (SCHEMA, HEADS_SCHEMA))) for path in found]
    problems = [(path, why) for path, _, why in checked if why is not None]
    if problems:
        raise InvalidReceipts(problems, len(found))
    logged: list[tuple[Path, str]] = []
    for path, receipt, _ in checked:
        log = log_heads_to_mlflow if receipt["schema"] == HEADS_SCHEMA else log_to_mlflow
        try:
            run_id = log(receipt, path.parent, uri)
        except store.TrackingFailed as exc:
            raise store.TrackingFailed(
                exc.uri, exc.reason, unreachable=exc.unreachable, folder=folder,
                kept=f"{len(logged)} of {len(found)} receipts logged, all kept under {folder}",
                then="log the rest with") from exc
        logged.append((path, run_id))
        if on_logged:
            on_logged(path, run_id)
    return logged


# --- draft heads: `posttrainllm experimental train-heads` (posttrainllm/lab/heads.py) -------------------

HEADS_ARTIFACTS = ("receipt.json", "heads.json", "decode.json")


def build_heads(cfg: LabConfig, folder: Path, base_report: dict[str, Any], heads_report: dict[str, Any],
                decode_report: dict[str, Any] | None, stamps: dict[str, dict[str, Any]] | None = None
                ) -> dict[str, Any]:
    """The heads receipt: config, provenance, the base's summary, the heads' and the decode measurement's reports,
    and the stamps of the stages before it (lab/heads.py `stamps`, already checked against each other)."""
    base = {k: v for k, v in base_report.items() if k != "losses"}
    base["losses_every_50"] = base_report["losses"][::50]
    receipt = {
        "schema": HEADS_SCHEMA,
        "point": f"heads-{cfg.heads.name}",
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "provenance": {**git_revision(), "machine": devices.fingerprint(devices.resolve(cfg.device.name))},
        "config": {"architecture": OmegaConf.to_container(OmegaConf.structured(cfg.architecture)),
                   "heads": OmegaConf.to_container(OmegaConf.structured(cfg.heads)),
                   "device": cfg.device.name, "bench.threads": cfg.bench.threads},
        "base": base, "heads": heads_report, "decode": decode_report,
        "verdict": "pass" if decode_report is not None and decode_report["lossless"] else "fail",
        "stamps": stamps or {},
    }
    write_json(folder / "receipt.json", receipt)
    write_json(folder / "metrics.json", heads_metrics(receipt))
    return receipt


def heads_metrics(receipt: dict[str, Any]) -> dict[str, float]:
    """The heads receipt's numbers, flat: base and head losses, per-head accuracy, per-variant decode figures."""
    flat: dict[str, float] = {"base.heldout_loss": receipt["base"]["heldout_loss"],
                              "base.final_train_loss": receipt["base"]["final_train_loss"],
                              "base.train_s": receipt["base"]["train_s"]}
    heads = receipt["heads"]
    if heads.get("losses"):
        flat["heads.final_loss"] = heads["losses"][-1]
    for k, acc in enumerate(heads.get("heldout_accuracy") or [], start=1):
        flat.update({f"heads.head{k}.{name}": value for name, value in acc.items()})
    decode = receipt.get("decode") or {}
    for name, entry in (decode.get("variants") or {}).items():
        for key in ("tokens_per_s", "decode_tokens_per_s", "mean_accepted_length"):
            if key in entry:
                flat[f"decode.{name}.{key}"] = entry[key]
        for key in ("ttft_ms", "itl_ms"):  # absent when the timings are not speed (interpreted Triton)
            flat.update({f"decode.{name}.{key}.{q}": v for q, v in (entry.get(key) or {}).items()})
        flat[f"decode.{name}.peak_bytes"] = entry["peak_memory"]["peak_bytes"]
        if "kv_cache_bytes" in entry["peak_memory"]:
            flat[f"decode.{name}.kv_cache_bytes"] = entry["peak_memory"]["kv_cache_bytes"]
        for k, rate in enumerate(entry.get("acceptance_rate_per_head") or [], start=1):
            flat[f"decode.{name}.accept_rate.head{k}"] = rate
    for name, entry in (decode.get("speedup") or {}).items():
        if isinstance(entry, dict):
            flat.update({f"decode.{name}.speedup.{k}": v for k, v in entry.items()})
    if decode:
        flat["decode.mismatches"] = decode["mismatches"]["count"]
        flat["decode.near_ties"] = decode["mismatches"]["near_ties"]
    return flat


def record_heads(receipt: dict[str, Any], folder: Path, *, log_mlflow: bool = True,
                 uri: str | None = None) -> str | None:
    """The heads receipt as one MLflow run (tag role=heads; loss curves as stepped metrics); None if not logged.

    Raises store.TrackingFailed when the store cannot be written (the JSON receipt is on disk by then).
    """
    if not log_mlflow or not mlflow_available():
        return None
    return log_heads_to_mlflow(receipt, folder, uri)


def log_heads_to_mlflow(receipt: dict[str, Any], folder: Path, uri: str | None = None) -> str:
    """The heads receipt's complete MLflow run: one already logged is reused, an incomplete one replaced (as
    log_to_mlflow does). Raises store.TrackingFailed when the store cannot be written."""
    uri = uri or tracking_uri()
    try:
        return _log_heads(receipt, folder, uri)
    except store.tracking_errors() as exc:
        raise store.TrackingFailed(uri, store.short_reason(exc), unreachable=store.unreachable(exc),
                                   folder=folder) from exc


def _heads_tags(receipt: dict[str, Any]) -> dict[str, str]:
    machine = receipt["provenance"]["machine"]
    return {"role": "heads", "point": receipt["point"], "verdict": receipt["verdict"],
            "git.revision": receipt["provenance"]["revision"], "git.dirty": str(receipt["provenance"]["dirty"]),
            "device": machine["device"], "threads": str(machine["threads"]), "receipt.schema": receipt["schema"],
            "receipt.id": hashlib.sha256(json.dumps(receipt, sort_keys=True).encode()).hexdigest()[:16]}


def _log_heads(receipt: dict[str, Any], folder: Path, uri: str) -> str:
    from mlflow.entities import Metric, Param

    client, experiment_id = store.open_store(uri, EXPERIMENT, artifact_location(uri))
    tags = _heads_tags(receipt)
    with store.lock(uri):
        logged = _logged_before(client, experiment_id, tags["receipt.id"])
        if logged is not None:
            return logged
        run_id = client.create_run(experiment_id, run_name=receipt["point"], tags=tags).info.run_id
        params: dict[str, str] = {}
        _flatten("", receipt["config"], params)
        now = int(dt.datetime.now().timestamp() * 1000)
        values = [Metric(k, float(v), now, 0) for k, v in heads_metrics(receipt).items()]
        values += [Metric("base.loss", loss, now, step * 50)
                   for step, loss in enumerate(receipt["base"]["losses_every_50"])]
        values += [Metric("heads.loss", loss, now, step) for step, loss in enumerate(receipt["heads"]["losses"])]
        param_list = [Param(k, v[:6000]) for k, v in params.items()]
        for i in range(0, max(len(param_list), len(values)), 100):
            client.log_batch(run_id, metrics=values[i:i + 100], params=param_list[i:i + 100])
        for name in HEADS_ARTIFACTS:
            if (folder / name).exists():
                client.log_artifact(run_id, str(folder / name))
        client.set_tag(run_id, LOGGED_TAG, "true")
        client.set_terminated(run_id, "FINISHED" if receipt["verdict"] == "pass" else "FAILED")
    return run_id
