"""What DVC's stage scripts share: load a point from params.yaml, run one stage, stamp it, map errors to exit codes.

`stamped` runs one stage and writes its stamp (track/stamp.py); `execute` adds the exit codes. The
point stages (`run_stage`) and the heads stages (lab/heads.py) both go through them.

Exit codes: 0 done, including a point whose contract broke or a lossy speculative decode (a
verdict, recorded in its report: the sweep runs on, and `posttrainllm report` exits 1 on a broken
contract); 2 bad config, a point that does not fit in memory, stages whose stamps disagree
about the code they shared, or a stage that ran code its inputs file does not list (DVC would
not rerun it on that code); 3 the receipt's MLflow run could not be logged (its JSON is kept).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from posttrainllm.measure import device as devices
from posttrainllm.config import ConfigError, LabConfig
from posttrainllm.files import point_dir, read_json
from posttrainllm.lab.reads import POINT_STAGES, outside_sources  # a point's stages, in DVC's order; its user files

PARAMS = Path("params.yaml")
RUNS = "runs"
CALIBRATION = Path(RUNS) / "calibration.json"
HEADS_BASE = Path(RUNS) / "heads" / "base"  # dvc.yaml's train_base writes the draft-heads base here
READS_KEY = "reads"  # a microbench's inputs file: {file: sha256} of what an earlier stage wrote, before any point stage
INPUTS = Path(RUNS) / "inputs"  # runs/inputs/<point>/<stage>.json: what DVC reruns a point stage on (lab/sweep.py)
# The files each point stage writes in runs/<point>/ (dvc.yaml's outs less stamps and plots; tests/test_dvc_deps.py
# checks): their sha256 goes into the stage's stamp, and the receipt refuses a file changed since (stamp.check_outputs)
STAGE_OUTPUTS = {"reference": ("reference.pt",), "kernel": ("kernel.pt", "kernel.json", "tracebacks"),  # a folder:
                 # not hashed (only files are), so a traceback's text is evidence to read, not a figure the receipt uses
                 "parity": ("parity.json",),
                 "microbench": ("microbench.json", "timings.csv", "curve.csv"), "bench_train": ("bench_train.json",)}
TIMED_STAGES = ("microbench", "bench_train")  # they run timing loops: approval on a GPU (lab/approval.py)


def sweep_id(points: dict[str, Any]) -> str:
    """A stable id for a sweep plan: the hash of its points' resolved configs."""
    return hashlib.sha256(json.dumps(points, sort_keys=True).encode()).hexdigest()[:16]


def load_point(point: str, params_path: Path = PARAMS) -> tuple[LabConfig, dict[str, Any]]:
    """A point's validated config (writing to runs/<point>/) and its sweep identity."""
    import yaml

    params = yaml.safe_load(params_path.read_text())
    points = params.get("points") or {}
    if point not in points:
        raise ConfigError(f"unknown point {point!r}: params.yaml has {', '.join(points) or 'no points'}")
    from posttrainllm.lab.configure import validate  # the ops' rules: not for the light device stage

    cfg = validate({**points[point]["config"], "run": {"name": point, "out_dir": RUNS}})
    sweep = {"name": params["sweep"]["name"], "id": sweep_id(points), "changes": points[point]["changes"],
             "points": list(points)}  # the sweep's run is FINISHED only when all of them are logged
    return cfg, sweep


def _stage(name: str) -> Callable[[LabConfig, dict[str, Any]], Any]:
    """The stage's work: its own module (lab/stages/<name>.py) alone is imported, so its process loads no other's."""
    import importlib

    module = importlib.import_module(f"posttrainllm.lab.stages.{name}")
    table: dict[str, Callable[[LabConfig, dict[str, Any]], Any]] = {
        "reference": lambda cfg, _: module.run_reference(cfg, point_dir(cfg)),
        "kernel": lambda cfg, _: module.run_kernel(cfg, point_dir(cfg)),
        "parity": lambda cfg, _: _parity(module, cfg),
        "microbench": lambda cfg, _: module.run_microbench(cfg, point_dir(cfg), *calibration(cfg.run.name)),
        "bench_train": lambda cfg, _: module.run_bench_train(cfg, point_dir(cfg), quality_base=HEADS_BASE),
        "receipt": lambda cfg, sweep: module.run_receipt(cfg, sweep),
    }
    return table[name]


def calibration(point: str) -> tuple[dict[str, Any], str | None]:
    """runs/calibration.json, and why it is not the file the calibrate stage wrote (None where it is, or where no
    inputs stage hashed it: a stage script run by hand). Its peaks decide the impossible-time floor and the
    rooflines, so a file rewritten since (by a user path's worker, say) would decide which speeds are possible."""
    data = CALIBRATION.read_bytes()
    inputs = INPUTS / point / "microbench.json"
    expected = ((json.loads(inputs.read_text()).get(READS_KEY) or {}).get(CALIBRATION.as_posix())
                if inputs.is_file() else None)
    now = hashlib.sha256(data).hexdigest()
    problem = None if expected in (None, now) else (
        f"{CALIBRATION} is not what the calibrate stage wrote (sha256 {now[:12]} now, {expected[:12]} when the "
        "inputs stage hashed it before any point stage ran)")
    return {**json.loads(data), "sha256": now}, problem


def _parity(module: Any, cfg: LabConfig) -> dict[str, Any]:
    """The parity stage (`module`: lab/stages/parity.py); where nothing broke yet some path cannot run here, its
    line (a broken contract's line, ContractBroken, names them too)."""
    report = module.run_parity(cfg, point_dir(cfg))
    if report["headline"]:
        print(f"posttrainllm: parity {cfg.run.name}: {report['headline']}", file=sys.stderr)
    return report


def _approved(stage: str, point: str, cfg: LabConfig) -> bool:
    """A timed stage on a GPU runs only with POSTTRAINLLM_APPROVE=1 (lab/approval.py); else one line, False."""
    from posttrainllm.lab import approval  # the timed stages only (their dvc.yaml deps list it)

    try:
        found = approval.check([cfg], train=stage == "bench_train", microbench=stage == "microbench",
                               what=f"stage {stage} {point}")
    except approval.NotApproved as exc:
        print(f"posttrainllm: not approved: {exc}", file=sys.stderr)
        return False
    if found:
        print(f"posttrainllm: approved: {stage} {point}: {found.line()}", file=sys.stderr)
    return True


@dataclass
class StageRun:
    """One stage, set up: its config, the point its stamp names, where the stamp goes, and the work itself."""

    cfg: LabConfig
    point: str  # the stamp's point: a sweep point, or heads-base / heads-<K name> (lab/heads.py)
    folder: Path  # the stamp goes to folder/stamps/<stage>.json
    work: Callable[[], Any]
    label: str = ""  # shown in the progress lines (default: the point)
    inputs: Path | None = None  # what DVC reruns the stage on (a point stage's runs/inputs file), checked at the end
    progress: str = ""  # where the sweep stands (track/progress.py), shown when the stage starts
    outputs: tuple[Path, ...] = ()  # the files it writes (STAGE_OUTPUTS), hashed into its stamp
    outside: Callable[[], dict[str, str]] | None = None  # once it ran: {file: sha256} it ran from outside the package


def stamped(stage: str, run: StageRun, *, written: tuple[type[Exception], ...] = ()) -> Any:
    """run.work() with the config keys it reads recorded, then its stamp (track/stamp.py); its result.

    The stamp is checked against run.inputs, where given: a file loaded or a key read that the inputs
    file does not list is refused (StampMismatch), since DVC would not rerun the stage when it changes.
    An exception of a `written` type was raised after the stage had written its files (a broken
    contract, a lossy decode, an MLflow failure): it is stamped too, then re-raised.
    """
    from posttrainllm.track import stamp

    cfg = run.cfg
    started = time.perf_counter()
    raised: Exception | None = None
    result = None
    with stamp.recording(stage, cfg) as reads:  # the config keys read, from here to the stage's end
        devices.prepare(cfg.device.name, cfg.bench.threads)
        try:
            result = run.work()
        except written as exc:
            raised = exc
    timing = {"stage_s": time.perf_counter() - started, "process_s": stamp.process_seconds()}
    made = stamp.write_stage_stamp(stage, cfg, reads, timing, folder=run.folder, point=run.point, inputs=run.inputs,
                                   outputs=run.outputs, outside=run.outside() if run.outside else None)
    if run.inputs is not None and run.inputs.is_file():  # absent when the script is run without DVC's inputs stage
        stamp.check_inputs(json.loads(made.read_text()), json.loads(run.inputs.read_text()), run.inputs)
    print(f"posttrainllm: {stage} {run.label or run.point} done in {timing['stage_s']:.1f} s", file=sys.stderr,
          flush=True)
    if raised is not None:
        raise raised
    return result


def execute(stage: str, setup: Callable[[], StageRun | None], verdicts: tuple[type[Exception], ...] = ()) -> int:
    """One DVC stage in this process: setup() (None: refused, nothing run), then `stamped`; errors to exit codes.

    `verdicts` are exceptions that record a verdict in the stage's files (exit 0, the pipeline runs on).
    """
    from posttrainllm.track import stamp
    from posttrainllm.track.store import TrackingFailed

    try:
        run = setup()
        if run is None:
            return 2
        where = f" [sweep: {run.progress}]" if run.progress else ""
        print(f"posttrainllm: {stage} {run.label or run.point} ...{where}", file=sys.stderr, flush=True)
        stamped(stage, run, written=(*verdicts, TrackingFailed))
    except ConfigError as exc:
        print(f"posttrainllm: config error: {exc}", file=sys.stderr)
        return 2
    except stamp.StampMismatch as exc:  # a receipt: outputs of different code or devices; nothing written
        print(f"posttrainllm: {stage} {run.point}: {exc}", file=sys.stderr)
        return 2
    except verdicts as exc:  # a verdict, recorded in the stage's report: the sweep runs on
        print(f"posttrainllm: {stage} {run.point}: recorded, sweep continues: {exc}", file=sys.stderr)
        return 0
    except TrackingFailed as exc:  # a receipt: receipt.json written, MLflow not
        print(exc.line(), file=sys.stderr)
        return 3
    return 0


def run_stage(stage: str, argv: list[str]) -> int:
    """`python pipelines/<stage>.py POINT`: one stage of one point, then its stamp.

    The stamp (runs/<point>/stamps/<stage>.json, track/stamp.py) records the revision, the
    device, the hash of every posttrainllm module this process loaded and the config keys the
    stage read; it is written whenever the stage's own files are (also after a broken contract
    or an MLflow failure). The receipt stage refuses stamps that disagree (exit 2, one line).
    """
    from posttrainllm.lab.stages.common import ContractBroken

    if len(argv) != 1:
        print(f"usage: python pipelines/{stage}.py POINT", file=sys.stderr)
        return 2

    def setup() -> StageRun | None:
        cfg, sweep = load_point(argv[0])
        if stage in TIMED_STAGES and not _approved(stage, argv[0], cfg):  # nothing run, nothing written
            return None
        points = sweep.get("points") or [argv[0]]
        where = f" ({points.index(argv[0]) + 1}/{len(points)})" if argv[0] in points else ""
        return StageRun(cfg, argv[0], point_dir(cfg), lambda: _stage(stage)(cfg, sweep), label=argv[0] + where,
                        inputs=INPUTS / argv[0] / f"{stage}.json", progress=sweep_progress(),
                        outputs=tuple(point_dir(cfg) / name for name in STAGE_OUTPUTS.get(stage, ())),
                        outside=lambda: outside_sources(stage, cfg, point_dir(cfg)))

    return execute(stage, setup, verdicts=(ContractBroken,))


def sweep_progress() -> str:
    """One line on where the planned sweep stands, from the stamps (track/progress.py); "" where it cannot
    be read: showing progress never stops a stage."""
    from posttrainllm.track import progress  # display only: left out of the stage's sources (stamp.DISPLAY_ONLY)

    try:
        return progress.read_progress(PARAMS, Path(RUNS), POINT_STAGES).line()
    except (ConfigError, OSError, ValueError, KeyError, TypeError):
        return ""


def write_fingerprint(path: Path) -> int:
    """The device stage: this machine's fingerprint, which every timed stage depends on.

    It runs on every `dvc repro`, so it reads the fingerprint from files where it can
    (devices.machine_fingerprint: the same JSON, without importing torch).
    """
    from posttrainllm.files import write_json

    write_json(path, devices.machine_fingerprint())
    return 0


def write_calibration(path: Path) -> int:
    """The calibrate stage: this device's measured peaks (GEMM FLOP/s per dtype, copy bandwidth)."""
    from posttrainllm.measure import calibrate
    from posttrainllm.lab.configure import load
    from posttrainllm.files import write_json

    cfg = load()
    device = devices.prepare("auto", cfg.bench.threads)  # timed stages run at the same thread count
    write_json(path, calibrate.calibrate(device))
    return 0
