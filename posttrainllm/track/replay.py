"""Replay a receipt: its tables, verdicts, timing summaries and plots again, from what was stored only.

    posttrainllm replay TARGET [--out DIR]

TARGET is a point's folder, its receipt.json, a folder of point folders (a sweep's runs/, a
gpu-check OUTDIR), or an MLflow run id (a point's run, or a sweep's run: its points), whose
artifacts are downloaded to a temporary folder first. In a folder, receipts are found as import
finds them (track/receipt.py `is_receipt`, `receipt_files`: a point is a folder with a receipt at its
top, told by its schema; a stamp or an inputs file named receipt.json is not one); a draft-heads
receipt among them is named and left out.
Nothing is measured: no kernel is launched and no timing loop runs; the plots are drawn again
from curve.csv and the microbench's roofline into DIR (default runs/replay/<point>/), and the
point's own folder is only read.

Replay also checks that the receipt adds up (`verify`), and names what does not:

* every timing summary (median, p20/p80, min, IQR, CV, reps, noisy) recomputed from the raw
  samples in timings.csv (measure.timing.summarize, the function that made them; the receipt's
  microbench entries hold summaries only, Timing.summary() drops the samples), and every speedup
  and band verdict against the reference recomputed from those summaries;
* every parity verdict from the stored errors and the stored contract: the allowance
  (error_multiple * baseline error + floor_rel * max|oracle|, per tensor and for the worst row),
  the output's verdict, the path's, the point's; the contract in the parity report must be the
  config's; with parity.json beside the receipt, every case, not only the worst;
* the loss drifts from the stored losses, and their verdicts from the contract's train_loss_drift;
* the crossover sizes from curve.csv; metrics.json from the receipt;
* every user path timed from outside: its timing seeds recorded per mode, well-formed, none shared
  (rule timing_seed, lab/isolation/outside.py: drawn at run time, never in a source).

The stored revision and device are shown next to this checkout's and this machine's.
"""

from __future__ import annotations

import csv
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrainllm.files import read_json
from posttrainllm.track.failures import CANNOT_RUN_HERE
from posttrainllm.track.records import ParityRecord
from posttrainllm.measure.timing import summarize

RUN_ID = re.compile(r"[0-9a-f]{32}")
MODES = ("forward", "forward_backward")
SUMMARY_KEYS = ("median_ms", "p20_ms", "p80_ms", "min_ms", "iqr_ms", "cv")
REL_TOL = 1e-9  # floats in JSON and CSV round-trip exactly; this only absorbs summation order


class ReplayError(ValueError):
    """A target that cannot be replayed (missing, not a receipt, unknown run): one line."""


@dataclass
class Stored:
    """One receipt as stored: its point name, the folder of its files, where it came from."""

    name: str
    folder: Path
    receipt: dict[str, Any]
    source: str


# --- finding receipts ---------------------------------------------------------------------


def _read(path: Path, source: str) -> Stored:
    from posttrainllm.track.receipt import check, is_receipt

    if path.name == "receipt.json" and not is_receipt(path):
        raise ReplayError(f"{path}: not a receipt (a file the pipeline writes for itself: a stage's stamp or "
                          "inputs file)")
    receipt, why = check(path)
    if why is not None:
        raise ReplayError(f"{path}: {why}")
    return Stored(receipt["point"], path.parent, receipt, source)


def _read_folder(target: str, path: Path) -> tuple[list[Stored], list[str]]:
    from posttrainllm.track.receipt import HEADS_SCHEMA, SCHEMA, check, receipt_files

    found = receipt_files(path)
    if not found:
        raise ReplayError(f"{target}: no receipt.json in this folder or below it")
    stored, others = [], []
    for file in found:
        receipt, why = check(file, (SCHEMA, HEADS_SCHEMA))
        if why is not None:
            raise ReplayError(f"{file}: {why}")
        if receipt["schema"] == HEADS_SCHEMA:
            others.append(f"{file.parent}: a draft-heads receipt ({HEADS_SCHEMA}), not a point's")
        else:
            stored.append(Stored(receipt["point"], file.parent, receipt, str(file.parent)))
    if not stored:
        raise ReplayError(f"{target}: no point receipt here, only {'; '.join(others)}")
    return stored, others


def load(target: str) -> tuple[list[Stored], list[str]]:
    """The point receipts a TARGET names (module docstring), and one line for each other receipt a folder
    holds (a draft-heads receipt), left out; ReplayError when there is no point receipt."""
    path = Path(target)
    if path.is_file():
        return [_read(path, str(path))], []
    if path.is_dir():
        return _read_folder(target, path)
    if RUN_ID.fullmatch(target):
        return _read_run(target), []
    raise ReplayError(f"{target}: not a point folder, a receipt.json, a folder of points, or an MLflow run id "
                      "(32 hex digits)")


def _read_run(run_id: str) -> list[Stored]:
    """An MLflow run's artifacts, downloaded to a temporary folder: one point, or each point of a sweep's run."""
    from posttrainllm.track import store
    from posttrainllm.track.receipt import LOGGED_TAG, tracking_uri

    uri = tracking_uri()
    store.configure_http()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one line per problem, no bars
    try:
        import mlflow
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        raise ReplayError(f"{run_id}: mlflow is not installed here (pip install -e '.[track]')") from exc
    store.quiet_loggers()
    client = MlflowClient(tracking_uri=uri)
    try:
        run = client.get_run(run_id)
        runs = [run]
        if run.data.tags.get("role") == "sweep":
            children = client.search_runs([run.info.experiment_id], max_results=5000,
                                          filter_string=f"tags.`mlflow.parentRunId` = '{run_id}'",
                                          order_by=["attributes.start_time DESC"])
            latest: dict[str, Any] = {}
            for child in children:  # the latest complete run of each point
                if child.data.tags.get(LOGGED_TAG) == "true":
                    latest.setdefault(child.data.tags.get("point", child.info.run_id), child)
            runs = [latest[name] for name in sorted(latest)]
        into = Path(tempfile.mkdtemp(prefix=f"posttrainllm-replay-{run_id[:8]}-"))
        stored = []
        for one in runs:
            folder = into / one.info.run_id
            mlflow.artifacts.download_artifacts(run_id=one.info.run_id, artifact_path="", dst_path=str(folder),
                                                tracking_uri=uri)
            if not (folder / "receipt.json").exists():
                raise ReplayError(f"mlflow run {one.info.run_id}: no receipt.json among its artifacts")
            stored.append(_read(folder / "receipt.json", f"mlflow run {one.info.run_id} ({uri})"))
    except store.tracking_errors() as exc:
        raise ReplayError(f"mlflow run {run_id} ({uri}): {store.short_reason(exc)}") from exc
    if not stored:
        raise ReplayError(f"mlflow run {run_id}: a sweep's run with no complete point run under it")
    return stored


# --- raw samples ------------------------------------------------------------------------------


def raw_samples(folder: Path) -> dict[tuple[str, str], list[float]] | None:
    """timings.csv as {(impl, mode): samples in rep order}; None when the file is not there."""
    path = folder / "timings.csv"
    if not path.exists():
        return None
    samples: dict[tuple[str, str], list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            samples.setdefault((row["impl"], row["mode"]), []).append((int(row["rep"]), float(row["ms"])))
    return {key: [ms for _, ms in sorted(rows)] for key, rows in samples.items()}


def timed_entries(receipt: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """The valid timing summaries of the microbench: {(impl, mode): summary}."""
    entries = {}
    for name, entry in ((receipt.get("microbench") or {}).get("paths") or {}).items():
        if entry.get("valid"):
            entries[name, "forward"] = entry
            if entry["forward_backward"].get("valid", True):  # a forward-only path has no forward + backward
                entries[name, "forward_backward"] = entry["forward_backward"]
    return entries


# --- verification -----------------------------------------------------------------------------


def _close(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    a, b = float(a), float(b)
    if math.isinf(a) or math.isinf(b) or math.isnan(a) or math.isnan(b):
        return a == b or (math.isnan(a) and math.isnan(b))
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-15)


def _band(a: dict[str, Any], b: dict[str, Any]) -> str:
    """Rule "band" (posttrainllm/lab/stages/microbench.py compare), from two stored summaries."""
    if a["p80_ms"] < b["p20_ms"]:
        return "faster"
    if a["p20_ms"] > b["p80_ms"]:
        return "slower"
    return "no measurable difference"


def verify_timings(receipt: dict[str, Any], folder: Path) -> list[str]:
    bench = receipt.get("microbench")
    entries = timed_entries(receipt)
    if not bench or not entries:
        return []
    samples = raw_samples(folder)
    if samples is None:
        return [f"timings.csv (the raw samples) is not beside the receipt in {folder}: its "
                f"{len(entries)} timing summaries cannot be checked"]
    problems = [f"timings.csv has samples of {impl}/{mode}, which the receipt gives no valid timing"
                for impl, mode in sorted(set(samples) - set(entries))]
    for (impl, mode), stored in entries.items():
        if (impl, mode) not in samples:
            problems.append(f"microbench {impl}/{mode}: no raw samples in timings.csv")
            continue
        again = summarize(samples[impl, mode]).summary()
        if stored.get("reps") != again["reps"]:
            problems.append(f"microbench {impl}/{mode}: reps={stored.get('reps')} stored, "
                            f"{again['reps']} samples in timings.csv")
        for key in SUMMARY_KEYS:
            if not _close(stored.get(key), again[key]):
                problems.append(f"microbench {impl}/{mode}: {key}={stored.get(key)!r} stored, "
                                f"{again[key]!r} from the raw samples")
        if stored.get("noisy") != again["noisy"]:
            problems.append(f"microbench {impl}/{mode}: noisy={stored.get('noisy')} stored, "
                            f"{again['noisy']} from the raw samples")
        ms = stored.get("median_ms")
        flops = bench.get("flops") if mode == "forward" else bench.get("train_flops")
        if ms and flops and "gflops_per_s" in stored and not _close(stored["gflops_per_s"], flops / (ms / 1e3) / 1e9):
            problems.append(f"microbench {impl}/{mode}: gflops_per_s={stored['gflops_per_s']!r} does not follow "
                            f"from flops={flops} and median_ms={ms!r}")
    reference = {mode: entries.get(("reference", mode)) for mode in MODES}
    for (impl, mode), stored in entries.items():
        ref = reference[mode]
        if impl == "reference" or ref is None:
            continue
        if "speedup_vs_reference" in stored and not _close(stored["speedup_vs_reference"],
                                                           ref["median_ms"] / stored["median_ms"]):
            problems.append(f"microbench {impl}/{mode}: speedup_vs_reference={stored['speedup_vs_reference']!r} "
                            f"is not reference median / its median = {ref['median_ms'] / stored['median_ms']!r}")
        if "vs_reference" in stored and stored["vs_reference"] != _band(stored, ref):
            problems.append(f"microbench {impl}/{mode}: vs_reference={stored['vs_reference']!r}, but its p20-p80 "
                            f"band against the reference's says {_band(stored, ref)!r}")
    return problems


SEED_BITS = 48  # lab/isolation/outside.py seeds_drawn: a base seed of this many random bits


def verify_timing_seeds(receipt: dict[str, Any]) -> list[str]:
    """Rule timing_seed (lab/isolation/outside.py), from what was stored: every user path timed from outside with a
    speed has its timing's base seed recorded per mode, a whole number of SEED_BITS bits, and no two (path, mode)
    timings of the receipt share one (each was drawn at run time; a seed fixed in source repeats)."""
    problems, seen = [], {}
    for name, entry in ((receipt.get("microbench") or {}).get("paths") or {}).items():
        for mode, report in ((entry or {}).get("outside") or {}).items():
            timed = entry.get("valid") if mode == "forward" else (entry.get("forward_backward") or {}).get("median_ms")
            seeds = (report or {}).get("timing_seeds") or {}
            base = seeds.get("base")
            if base is None:
                if timed:
                    problems.append(f"microbench {name}/{mode}: timed from outside with no timing seed recorded")
                continue
            if not isinstance(base, int) or isinstance(base, bool) or not 0 <= base < 2 ** SEED_BITS:
                problems.append(f"microbench {name}/{mode}: timing seed {base!r} is not a {SEED_BITS}-bit number")
                continue
            if base in seen:
                problems.append(f"microbench {name}/{mode}: timing seed {base} is also {seen[base]}'s: seeds are "
                                "drawn at run time per path and mode, and do not repeat")
            seen.setdefault(base, f"{name}/{mode}")
    return problems


def _output_problems(where: str, output: str, entry: dict[str, Any], contract: dict[str, Any]) -> list[str]:
    """One stored output check (a case's or the worst) against the contract: allowances, then the verdict."""
    if "max_abs_err" not in entry:  # a missing output or case: its verdict is fail by construction
        return [] if entry.get("verdict") == "fail" else [f"{where}/{output}: no errors stored, yet verdict "
                                                          f"{entry.get('verdict')!r}"]
    problems = []
    scale = entry.get("oracle_max_abs") or 0.0
    allowed = entry.get("allowed_abs_err")
    if scale > 0:  # with a zero oracle the floor used the case's forward scale, which is not stored
        expected = contract["error_multiple"] * entry["baseline_max_abs_err"] + contract["floor_rel"] * scale
        if not _close(allowed, expected):
            problems.append(f"{where}/{output}: allowed_abs_err={allowed!r} stored, the contract gives "
                            f"{expected!r} (error_multiple {contract['error_multiple']} x baseline "
                            f"{entry['baseline_max_abs_err']!r} + floor_rel {contract['floor_rel']} x {scale!r})")
            allowed = expected
    row = entry.get("worst_row")
    row_ok = True
    if row:
        floor = contract["grad_row_floor_rel"] if output.startswith("grad_") else contract["row_floor_rel"]
        row_allowed = row["allowed_abs_err"]
        if scale > 0:
            expected = (contract["error_multiple"] * row["baseline_max_abs_err"]
                        + contract["floor_rel"] * row["oracle_max_abs"] + floor * scale)
            if not _close(row_allowed, expected):
                problems.append(f"{where}/{output}: worst row's allowed_abs_err={row_allowed!r} stored, the contract "
                                f"gives {expected!r}")
                row_allowed = expected
        row_ok = row["max_abs_err"] <= row_allowed
        if row_ok != (entry.get("rows_failed", 0) == 0):
            problems.append(f"{where}/{output}: rows_failed={entry.get('rows_failed')} but the worst row errs "
                            f"{row['max_abs_err']!r} against {row_allowed!r} allowed")
    ok = (entry.get("finite", True) and entry["max_abs_err"] <= allowed
          and entry.get("mismatch_frac", 0.0) <= contract["max_mismatch"] and row_ok
          and entry.get("rows_failed", 0) == 0)
    if entry.get("verdict") != ("pass" if ok else "fail"):
        problems.append(f"{where}/{output}: verdict {entry.get('verdict')!r} stored, but max_abs_err "
                        f"{entry['max_abs_err']!r} against allowed {allowed!r} (mismatch_frac "
                        f"{entry.get('mismatch_frac')!r}, max_mismatch {contract['max_mismatch']}) says "
                        f"{'pass' if ok else 'fail'!r}")
    return problems


def _failed_cases_problems(name: str, path: dict[str, Any], cases: list[dict[str, Any]]) -> list[str]:
    """The receipt's failed_cases of a path against what parity.json's cases give again.

    failed_cases is the path's violations (a guard or an output check: a write into an input, a wrong dtype,
    a raise; lab/stages/parity.py run_parity), then one line per failing case and output, "<case>/<output>: <reason>",
    in the cases' order. Those lines are recomputed; the violations are what the guards saw, not a figure to
    recompute: they only have to be listed first (the path's own "violations" where the receipt stores them,
    else whatever precedes the recomputed lines), and they make the verdict a fail (checked by the caller).
    """
    derived = [f"{c['case']}/{c['output']}: {c.get('reason', '')}" for c in cases if c["verdict"] != "pass"]
    stored = list(path["failed_cases"])
    violations = path.get("violations")
    if violations is None:  # a receipt from before violations were stored apart
        violations = stored[:max(len(stored) - len(derived), 0)]
    if stored == [*violations, *derived]:
        return []
    return [f"parity {name}: {len(derived)} failing cases in parity.json (and {len(violations)} guard "
            f"violation(s)), but the receipt lists {len(stored)} failed cases that are not those"]


def verify_parity(receipt: dict[str, Any], folder: Path) -> list[str]:
    parity = receipt.get("parity")
    if not parity:
        return []
    problems = []
    configured = (receipt.get("config") or {}).get("precision", {})
    for key in ("contract", "lse_contract"):
        if key in configured and parity.get(key) is not None and parity[key] != configured[key]:
            problems.append(f"parity.{key} differs from the config's precision.{key}")

    def contract(output: str) -> dict[str, Any]:
        return parity["lse_contract"] if output == "lse" and parity.get("lse_contract") else parity["contract"]

    stored = ParityRecord.read_optional(folder / ParityRecord.FILE)
    full = None if stored is None else stored.to_dict()
    verdicts = {}
    for name, path in parity["paths"].items():
        for output, worst in path["worst"].items():
            problems += _output_problems(f"parity {name} worst ({worst.get('case')})", output, worst, contract(output))
        cases = ((full or {}).get("paths", {}).get(name) or {}).get("cases")
        failed_cases = list(path["failed_cases"])
        if cases is not None:
            for case in cases:
                problems += _output_problems(f"parity {name} {case['case']}", case["output"], case,
                                             contract(case["output"]) if case["case"] != "*" else parity["contract"])
            problems += _failed_cases_problems(name, path, cases)
        ok = not failed_cases and all(w.get("verdict") == "pass" for w in path["worst"].values())
        # a path this machine could not run (track/failures.py) has nothing checked, and nothing failed
        apart = ok and not path["worst"] and path.get("cannot_run_here")
        verdicts[name] = CANNOT_RUN_HERE if apart else "pass" if ok else "fail"
        if path["verdict"] != verdicts[name]:
            problems.append(f"parity {name}: verdict {path['verdict']!r} stored, its failed cases and worst "
                            f"outputs say {verdicts[name]!r}")
    point = "fail" if "fail" in verdicts.values() else "pass"  # a path that cannot run here breaks no contract
    if parity["verdict"] != point:
        problems.append(f"parity: point verdict {parity['verdict']!r} stored, its paths say {point!r}")
    return problems


def verify_train(receipt: dict[str, Any]) -> list[str]:
    train = receipt.get("bench_train")
    if not train:
        return []
    problems = []
    limit = receipt["config"]["precision"]["contract"]["train_loss_drift"]
    baseline = train["impls"][train["baseline"]]["losses"]
    for name, drift in train["drift"].items():
        losses = train["impls"][name]["losses"]
        again = abs(losses[-1] - baseline[len(losses) - 1])
        if not _close(drift, again):
            problems.append(f"bench_train {name}: drift {drift!r} stored, its losses give {again!r}")
        verdict = "pass" if drift <= limit else "fail"
        if (train.get("drift_verdict") or {}).get(name) != verdict:
            problems.append(f"bench_train {name}: drift verdict {(train.get('drift_verdict') or {}).get(name)!r} "
                            f"stored, drift {drift!r} against train_loss_drift {limit} says {verdict!r}")
    noise = train.get("noise")
    if noise and noise.get("band") is not None:  # the run-to-run band, from the baseline's stored step times
        from posttrainllm.model.amdahl import noise_band

        again = noise_band(train["impls"][train["baseline"]]["step_ms"], noise.get("repeat_step_ms"),
                           train["config"]["warmup_steps"])["band"]
        if not _close(noise["band"], again):
            problems.append(f"bench_train: noise band {noise['band']!r} stored, the baseline's step times give "
                            f"{again!r}")
    return problems


def verify_curve(receipt: dict[str, Any], folder: Path) -> list[str]:
    """The stored crossovers, every axis and mode, recomputed from curve.csv (curves.crossovers). A receipt from
    before curves had modes stores the forward crossovers of its x_name only; its curve.csv is read as forward."""
    import pandas as pd

    from posttrainllm.measure import curves

    curve = (receipt.get("microbench") or {}).get("curve") or {}
    headline = curve.get("crossover_vs_reference") or {}
    stored = curve.get("crossovers") or ([{"x_name": curve.get("x_name"), "mode": curves.FORWARD,
                                           "vs_reference": headline}] if headline else [])
    if not stored:
        return []
    if not (folder / "curve.csv").exists():
        return [f"curve.csv is not beside the receipt in {folder}: its crossovers cannot be checked"]
    frame = pd.read_csv(folder / "curve.csv")
    problems = []
    impls = sorted({name for entry in stored for name in entry["vs_reference"]})
    again = {(c["x_name"], c["mode"]): c["vs_reference"] for c in curves.crossovers(frame, impls)}
    if curve.get("crossovers") and headline:
        stored = [*stored, {"x_name": curve.get("x_name"), "mode": curves.FORWARD, "vs_reference": headline}]
    for entry in stored:
        where = f"{entry['x_name']}/{entry['mode']}"
        found = again.get((entry["x_name"], entry["mode"]))
        if found is None:
            problems.append(f"curve {where}: stored, but curve.csv has no such rows")
            continue
        for name, x in entry["vs_reference"].items():
            if x != found.get(name):
                problems.append(f"curve {name} ({where}): crossover {x!r} stored, curve.csv gives {found.get(name)!r}")
    return problems


def verify_metrics(receipt: dict[str, Any], folder: Path) -> list[str]:
    from posttrainllm.track.receipt import metrics

    if not (folder / "metrics.json").exists():
        return []
    stored, again = read_json(folder / "metrics.json"), metrics(receipt)
    differ = sorted(k for k in set(stored) | set(again) if not _close(stored.get(k), again.get(k)))
    return [f"metrics.json differs from the receipt at {', '.join(differ[:5])}"
            f"{f' and {len(differ) - 5} more' if len(differ) > 5 else ''}"] if differ else []


def verify(stored: Stored) -> list[str]:
    """Everything that does not add up in one receipt (empty: it does). Each item is one line."""
    receipt, folder = stored.receipt, stored.folder
    try:
        return (verify_timings(receipt, folder) + verify_timing_seeds(receipt) + verify_parity(receipt, folder)
                + verify_train(receipt)
                + verify_curve(receipt, folder) + verify_metrics(receipt, folder))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:  # truncated below the top level
        what = f"no {exc.args[0]!r} field" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        return [f"incomplete or malformed receipt ({what})"]


# --- rendering --------------------------------------------------------------------------------


def provenance_text(receipt: dict[str, Any]) -> str:
    """The stored revision and device next to this checkout's and this machine's."""
    from posttrainllm.measure import device as devices
    from posttrainllm.track.provenance import git_revision

    prov, machine = receipt["provenance"], receipt["provenance"]["machine"]
    here, now = git_revision(), devices.machine_fingerprint()
    rev = lambda r: f"{r['revision'][:12]}{' (dirty)' if r.get('dirty') else ''}"  # noqa: E731
    lines = [f"  revision  stored {rev(prov):<22} here {rev(here)}"]
    differ = sorted(k for k in set(machine) | set(now) if machine.get(k) != now.get(k))
    lines.append(f"  device    stored {machine['device']} {machine['device_name']} ({machine['threads']} threads)   "
                 f"here {now['device']} {now['device_name']} ({now['threads']} threads)"
                 + (f"   differs: {', '.join(differ)}" if differ else "   same fingerprint"))
    return "\n".join(lines)


def parity_table(receipt: dict[str, Any]) -> str:
    import pandas as pd

    rows = []
    for name, path in ((receipt.get("parity") or {}).get("paths") or {}).items():
        for output, worst in path["worst"].items():
            rows.append({"path": name, "output": output, "worst case": worst.get("case", "-"),
                         "max_abs_err": f"{worst['max_abs_err']:.2e}" if "max_abs_err" in worst else "-",
                         "allowed": f"{worst['allowed_abs_err']:.2e}" if "allowed_abs_err" in worst else "-",
                         "err/bound": f"{worst['bound_ratio']:.3f}" if "bound_ratio" in worst else "-",
                         "verdict": worst.get("verdict", "-"), "path verdict": path["verdict"]})
    return pd.DataFrame(rows).to_string(index=False) if rows else "(no parity report)"


def render_plots(stored: Stored, out: Path) -> list[Path]:
    """time_vs_size, memory_vs_size (from curve.csv) and the roofline (from the microbench), into `out`."""
    import pandas as pd

    from posttrainllm.track import plots

    written = []
    bench = stored.receipt.get("microbench") or {}
    curve = bench.get("curve") or {}
    if (stored.folder / "curve.csv").exists():  # as the microbench drew them: its regimes, the paths it skipped
        frame = pd.read_csv(stored.folder / "curve.csv")
        regimes = curve.get("regimes") if "mode" in frame.columns else None  # a curve from before modes: none
        draws = ((lambda df, path: plots.time_vs_size(df, path, regimes=regimes, omitted=curve.get("skipped")),
                  "time_vs_size.png"),
                 (plots.memory_vs_size, "memory_vs_size.png"))
        for draw, name in draws:
            try:
                written.append(draw(frame, out / name))
            except ValueError:  # no valid rows: nothing to draw, as when it was measured
                pass
    lines = [{"label": name, **entry["roofline"]} for name, entry in (bench.get("paths") or {}).items()
             if entry.get("valid") and entry.get("roofline")]
    if lines and bench.get("peaks", {}).get("gemm_flops_per_s"):  # the peak the point was held to: its own roof
        written.append(plots.roofline_plot(lines, bench["peaks"], out / "roofline.png",
                                           title=f"{bench.get('op', '')} {bench.get('problem', '')}".strip()))
    return written


def render(stored: Stored, out: Path) -> str:
    """The replay of one receipt as text (its plots written under `out`)."""
    from posttrainllm.track import report

    receipt = stored.receipt
    parts = [f"replay of {stored.source}"]
    try:
        parts += [provenance_text(receipt), report.point_table(receipt), "parity (worst case per output):",
                  parity_table(receipt)]
        entries = timed_entries(receipt)
        samples = raw_samples(stored.folder) or {}
        if entries:
            parts.append("timings: " + ", ".join(f"{impl}/{mode} {len(samples.get((impl, mode), []))} samples"
                                                  for impl, mode in entries))
        if receipt.get("bench_train"):
            parts.append(report.train_table(receipt))
        plots = render_plots(stored, out)
        if plots:
            parts.append("plots: " + ", ".join(str(p) for p in plots))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:  # verify() names what is wrong
        what = f"no {exc.args[0]!r} field" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        parts.append(f"(the rest cannot be rendered: incomplete or malformed receipt, {what})")
    return "\n".join(parts)
