"""`posttrainllm` console script: subcommands dispatched to Hydra apps over conf/.

    posttrainllm bench [--grid] [-m] [overrides...]   one point (or a Hydra multirun), printed as a table
    posttrainllm bench-train [overrides...]           the end-to-end training step of one point
    posttrainllm sweep [sweep=NAME] [overrides...]    plan a sweep into params.yaml for `dvc repro`
    posttrainllm compile [overrides...]               every Triton kernel of the point compiled for compile.targets
                                                      (sm90 by default; no GPU needed): registers, spills, shared
                                                      memory, occupancy, tensor cores; exit 1 if one would not launch
    posttrainllm report [--wide] [--write-docs] [FOLDER ...]
                                                      the receipts of params.yaml's points, or of every point under the
                                                      FOLDERs, one row each (--wide: every column); writes report.md
                                                      and report.html (paths, plots) in runs/ or the FOLDERs' parent;
                                                      --write-docs: the README's headline and docs/measured.md too
    posttrainllm progress                             where `dvc repro` of the planned sweep stands: each point's
                                                      stages done, and the time left estimated from the stamps
    posttrainllm dvc-yaml [--check]                   dvc.yaml's deps and params from what each stage declares it
                                                      reads (posttrainllm/lab/reads.py); --check: exit 1 if they differ
    posttrainllm ui [--port N] [--host HOST]          the MLflow UI on the project's runs, and their addresses
    posttrainllm receipt import FOLDER                log receipt JSON made elsewhere (a GPU node) into MLflow
    posttrainllm experimental train-heads [overrides...]   Medusa draft heads on a frozen base: base (cached)
                                                      -> heads -> decode measurement (lossless), a table
    posttrainllm replay TARGET [--out DIR]            a stored receipt's tables and plots again, checked; runs nothing
    posttrainllm compare BASE NEW [--across-devices] [--out FILE] [compare.KEY=VALUE ...]
                                                      timings and verdicts of two revisions; exit 1 on a regression
    posttrainllm new-impl op=OP FILE.py [--name NAME] [op.KEY=VALUE ...]
                                                      a kernel of your own to start from (the op's signature, contract
                                                      and readable math) and the command for its receipt
    posttrainllm explain POINT                        one point's contract, memory traffic per path and end-to-end
                                                      effect, from its receipt alone (a folder, receipt.json, a name)

Every subcommand keeps Hydra's full override syntax (`--cfg job`, `--help`, `-m`).
Overrides are checked before anything runs or is written: a bad one prints one
line naming the valid choices and exits with 2. On a GPU, bench and bench-train run
timing loops only with approval (run.approve=true or POSTTRAINLLM_APPROVE=1; lab/approval.py):
without it they print the device time they would take and exit with 2.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import hydra
from omegaconf import DictConfig

from posttrainllm.config import CONF_DIR, DIMENSIONS, ConfigError, LabConfig

from posttrainllm.lab.configure import check_train_rules, load, validate
from posttrainllm.track.failures import TRACEBACKS

EXIT_CONTRACT, EXIT_CONFIG = 1, 2
EXIT_UNTRACKED = 3  # the receipt JSON was written, MLflow was not (server unreachable, store failed)
STAGE_FILES = ("reference.pt", "kernel.pt", "kernel.json", "parity.json", "microbench.json", "timings.csv",
               "curve.csv", "time_vs_size.png", "memory_vs_size.png", "roofline.png", "bench_train.json",
               "receipt.json", "metrics.json", "config.yaml")
_broken: list[str] = []  # points whose contract broke in this invocation (a multirun keeps going)
_unfit: list[str] = []  # points with a kernel that would not launch on a compile target (or no compile report)
_untracked: list[str] = []  # points whose receipt could not be logged to MLflow (JSON kept)
_cannot_run: list[str] = []  # points with paths this machine cannot run, none broken (never a broken contract)


def _fail_config(exc: ConfigError) -> None:
    print(f"posttrainllm: config error: {exc}", file=sys.stderr)
    raise SystemExit(EXIT_CONFIG)


POINT_NAME_MAX = 63  # characters in a point folder's name made from its overrides, however many there are


def _folder_safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=,-]", "_", text)  # what run.name allows


def point_name(overrides: list[str], exclude: list[str], default: str) -> str:
    """A point's folder name from its overrides, those of the `exclude` keys (run.*) left out: all of them, sorted
    and joined as Hydra's override_dirname, where that fits in POINT_NAME_MAX characters (`precision=bf16,tile=b16`);
    else the dimensions' choices among them that fit (or `default`), then `-` and 8 hex digits of the sha256 of
    them all (`op=attention-1f0c9a2e`). The receipt's `overrides` holds them whole."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = [o for o in OverridesParser.create().parse_overrides(overrides) if o.key_or_group not in exclude]
    lines = sorted(o.input_line for o in parsed)
    whole = _folder_safe(",".join(lines))
    if len(whole) <= POINT_NAME_MAX:
        return whole or default
    digest = "-" + hashlib.sha256("\n".join(lines).encode()).hexdigest()[:8]
    kept: list[str] = []
    for choice in (_folder_safe(o.input_line) for d in DIMENSIONS for o in parsed if o.key_or_group == d):
        if len(",".join([*kept, choice]) + digest) > POINT_NAME_MAX:
            break
        kept.append(choice)
    return (",".join(kept) or default) + digest


def _point(cfg: DictConfig, default_name: str) -> LabConfig:
    """Validate the composed config; name the point after its overrides (point_name) unless run.name was set."""
    from hydra.core.hydra_config import HydraConfig

    try:
        lab = validate(cfg)
    except ConfigError as exc:
        _fail_config(exc)
    if lab.run.name == "bench":  # not set: name the point after its overrides (run.* excluded)
        hydra = HydraConfig.get()
        lab.run.name = point_name(list(hydra.overrides.task), list(hydra.job.config.override_dirname.exclude_keys),
                                  default_name)
    return lab


def _fresh_point_dir(lab: LabConfig) -> Path:
    """The point's folder, emptied of an earlier run's stage files so the receipt mixes no two runs."""
    from posttrainllm.files import point_dir

    out = point_dir(lab)
    for name in STAGE_FILES:
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "stamps", ignore_errors=True)  # a DVC run's stamps do not describe this run
    shutil.rmtree(out / TRACEBACKS, ignore_errors=True)  # nor an earlier run's tracebacks
    out.mkdir(parents=True, exist_ok=True)
    return out


def _record(lab: LabConfig) -> dict[str, Any]:
    """The receipt, with the command line's overrides; never raises for MLflow: a failed write prints one line and
    counts toward exit 3."""
    from hydra.core.hydra_config import HydraConfig

    from posttrainllm.track import receipt, store

    try:
        done, run_id = receipt.record(lab, overrides=list(HydraConfig.get().overrides.task))
    except store.TrackingFailed as exc:
        print(exc.line(), file=sys.stderr)
        _untracked.append(exc.line())
        return exc.receipt
    if run_id:
        print(f"receipt: {receipt.point_dir(lab) / 'receipt.json'}  mlflow run {run_id} ({receipt.tracking_uri()})")
    else:
        print(f"receipt: {receipt.point_dir(lab) / 'receipt.json'}")
    return done


class _StageTimes:
    """Wall seconds of each part of a point's run, printed under its table: where the author's loop goes. The
    first point of a process also shows the process's start-up (Python, the imports, Hydra's config)."""

    first = True

    def __init__(self) -> None:
        from posttrainllm.track.stamp import process_seconds

        started = process_seconds() if _StageTimes.first else None
        _StageTimes.first = False
        self.seconds: dict[str, float] = {} if started is None else {"start-up (imports and config)": started}

    def run(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        began = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - began

    def line(self) -> str:
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items())
        return f"times: {parts}; {sum(self.seconds.values()):.1f} s in all"


def _run_point(cfg: DictConfig, *, train: bool) -> None:
    """reference -> kernel -> parity -> microbench (-> bench-train) -> receipt, in this process."""
    from posttrainllm.measure import calibrate
    from posttrainllm.track import report
    from posttrainllm.lab.stages import bench_train as bench_train_stage, kernel as kernel_stage, \
        microbench as microbench_stage, parity as parity_stage, reference as reference_stage
    from posttrainllm.lab.stages.common import ContractBroken
    from posttrainllm.measure import device as devices

    times = _StageTimes()
    lab = _point(cfg, "train" if train else "bench")
    device = devices.prepare(lab.device.name, lab.bench.threads)
    try:
        reference_stage.check_memory(lab, device)  # before the point's folder is touched
    except ConfigError as exc:
        _fail_config(exc)
    if train:
        from posttrainllm.lab import heads

        heads.ensure_quality_base(lab)  # a quantized precision's quality gate decodes with it
    out = _fresh_point_dir(lab)
    # read before any user code runs (the kernel stage's compile child, parity's workers): a file they rewrote
    # would decide which speeds are possible (docs/timing.md: what the receipt combines is what was written)
    calibration = times.run("calibration", calibrate.load_or_measure, Path(lab.run.out_dir) / "calibration.json",
                            devices.resolve(lab.device.name))
    times.run("reference", reference_stage.run_reference, lab, out)
    times.run("kernel", kernel_stage.run_kernel, lab, out)
    try:
        parity = times.run("parity", parity_stage.run_parity, lab, out)
        if parity["headline"]:  # nothing broke, yet some path cannot run here: named apart
            _cannot_run.append(f"{lab.run.name}: {parity['headline']}")
    except ContractBroken as exc:  # its line counts what broke and, apart, what cannot run here
        _broken.append(f"{lab.run.name}: {exc}")
    times.run("microbench", microbench_stage.run_microbench, lab, out, calibration)  # a broken path gets no timing
    if train:
        try:
            times.run("bench-train", bench_train_stage.run_bench_train, lab, out)  # Amdahl needs the microbench's speedups
        except ContractBroken as exc:
            _broken.append(f"{lab.run.name}: {exc}")
    receipt = times.run("receipt", _record, lab)
    print(report.point_table(receipt))
    if train:
        print(report.train_table(receipt))
    print(times.line())


def bench_point(cfg: DictConfig) -> None:
    """One point: parity and microbench, then a table."""
    _run_point(cfg, train=False)


def bench_train_point(cfg: DictConfig) -> None:
    """One point end to end: parity, microbench and the training step with each implementation swapped in."""
    _run_point(cfg, train=True)


def plan_sweep(cfg: DictConfig) -> None:
    """Write the sweep's points to params.yaml and list them.

    Only `sweep=NAME` and `sweep.*` overrides shape the plan; any other key=value would not
    reach params.yaml, so it is refused (exit 2, with how to apply it) before anything is written.
    """
    from hydra.core.hydra_config import HydraConfig

    from posttrainllm.lab import sweep
    from posttrainllm.lab.pipeline import PARAMS

    try:
        lab = validate(cfg)
        sweep.refuse_point_overrides(list(HydraConfig.get().overrides.task), lab.sweep.name)
        params = sweep.plan(lab.sweep)
    except ConfigError as exc:
        _fail_config(exc)
    if any(point["config"]["op"].get("user_impls") for point in params["points"].values()):
        print(f"sweep {lab.sweep.name!r}: listing the Triton kernel files its user paths launch (their DVC inputs)")
        try:
            sweep.find_kernel_files(params)
        except ConfigError as exc:
            _fail_config(exc)
    if lab.sweep.check_fit:  # before any GPU time: a kernel that would not launch leaves its point out
        print(f"sweep {lab.sweep.name!r}: compiling each point's Triton kernels (sweep.check_fit)")
        sweep.refuse_unfit(params)
    sweep.write_params(params, PARAMS)
    print(f"{PARAMS}: sweep {params['sweep']['name']!r}, {len(params['points'])} points")
    for name, refused in params.get("refused", {}).items():
        print(f"  refused {name}: {'; '.join(refused['reasons'])}", file=sys.stderr)
    for name, point in params["points"].items():
        changes = ", ".join(f"{k}={v}" for k, v in point["changes"].items()) or "(baseline)"
        print(f"  {name:<24} {changes}")
    print("run them with: dvc repro")


def compile_point(cfg: DictConfig) -> None:
    """Every Triton kernel the point's paths launch, compiled for compile.targets: compile.json and a table."""
    from posttrainllm.files import point_dir, write_json
    from posttrainllm.lab import compile as compiling

    lab = _point(cfg, "compile")
    out = point_dir(lab)
    out.mkdir(parents=True, exist_ok=True)
    report = compiling.compile_point(lab)
    write_json(out / "compile.json", report)
    print(compiling.table(report))
    print(f"compile: {out / 'compile.json'} ({report.get('seconds', 0):.0f} s)")
    if compiling.not_fitting(report) or report.get("error"):
        _unfit.append(lab.run.name)


# commands that run timing loops: approval on a GPU (lab/approval.py)
TIMED = ("bench", "bench-train", "experimental train-heads")
def train_heads_point(cfg: DictConfig) -> None:
    """Base (reused when its settings match) -> heads -> decode measurement -> receipt, then a table."""
    from posttrainllm.lab import heads
    from posttrainllm.lab.pipeline import stamped
    from posttrainllm.track import store

    lab = _point(cfg, "heads")
    base, trained = heads.ensure_base(lab)
    print(f"base: {'trained' if trained else 'reused'} {heads.base_dir(lab)} (held-out loss "
          f"{base['heldout_loss']:.3f}, {base['train_s']:.0f} s to train)")
    stamped("train_heads", heads.stage_run("train_heads", lab))  # each stage stamped, as under DVC
    decode = heads.stage_run("decode", lab, Path(lab.run.out_dir) / "calibration.json")  # prints the table
    run_id = None
    try:
        _, run_id = stamped("decode", decode, written=(heads.LossyDecoding, store.TrackingFailed))
    except heads.LossyDecoding as exc:
        _broken.append(f"heads-{lab.heads.name}: {exc}")
    except store.TrackingFailed as exc:
        print(exc.line(), file=sys.stderr)
        _untracked.append(exc.line())
    print(f"receipt: {heads.heads_dir(lab) / 'receipt.json'}" + (f"  mlflow run {run_id}" if run_id else ""))


COMMANDS: dict[str, Callable[[DictConfig], None]] = {
    "bench": bench_point,
    "bench-train": bench_train_point,
    "sweep": plan_sweep,
    "compile": compile_point,
    "experimental train-heads": train_heads_point,
}
# every command `main` dispatches (the Hydra apps above and the plain ones), as typed
COMMAND_NAMES = ("bench", "bench-train", "sweep", "compile", "report", "progress", "ui", "receipt", "experimental",
                 "replay", "compare", "new-impl", "explain", "dvc-yaml")

# `COMMAND --help`: what the command does, its common overrides ({op} etc.: the config group's options) and an
# example, printed before Hydra's own help (the config groups and the whole config)
HELP: dict[str, tuple[str, tuple[tuple[str, str], ...], str]] = {
    "bench": (
        "One point: each path of the op (the reference, the built-in paths, your own) checked against float64 "
        "math (parity), then timed forward and forward+backward against the reference (microbench), a table "
        "and a receipt in run.out_dir/<point>/ (runs/bench/ by default).",
        (("op={op}", "the operation"), ("precision={precision}", "dtype and its contract"),
         ("shape={shape}", "problem sizes"), ("tile={tile}", "Triton block sizes"),
         ("'op.user_impls=[FILE.py:FUNCTION]'", "your own path (posttrainllm new-impl writes one)"),
         ("'op.only=[NAME,...]'", "only these paths and the reference"),
         ("'op.peers=[compiled]'", "the opt-in peers (attention: also flex)"),
         ("run.name=NAME", "the point's folder name"), ("-m precision=fp32,bf16", "one point per value")),
        "posttrainllm bench precision=bf16 'op.only=[triton]'"),
    "bench-train": (
        "What bench does, then the end-to-end training step of a small model with each path swapped in: loss "
        "drift against the reference and the measured speedup beside Amdahl's prediction.",
        (("op={op}", "the operation"), ("precision={precision}", "dtype and its contract"),
         ("architecture={architecture}", "the model"), ("train.steps=N", "training steps (drift read at the last)"),
         ("'op.only=[NAME,...]'", "only these paths and the reference")),
        "posttrainllm bench-train architecture=gqa precision=bf16"),
    "sweep": (
        "Plan a sweep (conf/sweep/NAME.yaml: a baseline and one dimension varied at a time) into params.yaml; "
        "`dvc repro` then runs its points and `posttrainllm report` shows them.",
        (("sweep={sweep}", "which sweep"), ("'sweep.overrides=[\"op.only=[triton]\"]'", "applied to every point")),
        "posttrainllm sweep sweep=smoke && dvc repro && posttrainllm report"),
    "compile": (
        "Every Triton kernel the point's paths launch, compiled here for compile.targets (no GPU needed): "
        "registers, spills, shared memory, occupancy, tensor cores; exit 1 if one would not launch.",
        (("op={op}", "the operation"), ("shape={shape}", "problem sizes"), ("tile={tile}", "Triton block sizes"),
         ("'compile.targets=[sm80,sm90]'", "GPU architectures")),
        "posttrainllm compile precision=bf16 shape=gpu device=cpu"),
    "experimental train-heads": (
        "Medusa draft heads on a frozen base: the base (trained once, reused while its settings match), then "
        "the heads, then a lossless decode measurement (accepted length, tokens per second), a table.",
        (("heads={heads}", "how many heads (K)"), ("'heads.tree=[2,2,1]'", "tree verification")),
        "posttrainllm experimental train-heads -m heads=k1,k2,k4"),
}


REPORT_USAGE = ("usage: posttrainllm report [--wide] [--write-docs] [FOLDER ...]   (no FOLDER: params.yaml's points "
                "in runs/; a FOLDER: every point under it, a sweep's runs/, runs/bench, a point; --wide: every column; "
                "writes report.md and report.html in runs/ or in the folders' common parent; --write-docs: also "
                "rewrites the README's headline and docs/measured.md's latest sweep from these receipts, with "
                "docs/headline.json, run in the clone's root)")


def report_sweep(args: list[str]) -> int:
    """Print the receipts of params.yaml's points (runs/<point>/receipt.json), or of every point under the FOLDERs
    given: a table that fits a terminal (report.TERMINAL_WIDTH), or every column with --wide, then each flagged
    figure with its reason; report.md keeps every column and report.html adds each point's paths, plots and
    parity (in runs/, or the folders' common parent); then the MLflow runs table's address, if there is one."""
    from posttrainllm.track import report, report_page
    from posttrainllm.lab.pipeline import PARAMS, RUNS
    from posttrainllm.files import read_json
    from posttrainllm.lab.sweep import read_points
    from posttrainllm.config import _one_line

    if args in (["-h"], ["--help"]):
        print(REPORT_USAGE)
        return 0
    folders = [arg for arg in args if arg not in ("--wide", "--write-docs")]
    if args.count("--wide") > 1 or args.count("--write-docs") > 1 or any(arg.startswith("-") for arg in folders):
        print(REPORT_USAGE, file=sys.stderr)
        return EXIT_CONFIG
    if folders:  # any folder of points: a sweep's runs/, a bench's folder, several
        absent = [folder for folder in folders if not Path(folder).is_dir()]
        if absent:
            print(f"posttrainllm: report: no folder {absent[0]}: give folders of points (a sweep's runs/, "
                  "runs/bench, a point's folder)", file=sys.stderr)
            return EXIT_CONFIG
        runs, receipts, heads, unreadable = report.read_folders([Path(folder) for folder in folders])
        missing, sweep_name = [], ""
    else:
        try:
            plan = read_points(PARAMS)
        except ConfigError as exc:  # missing, not YAML, not a plan: one line, nothing written
            print(f"posttrainllm: config error: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        runs, receipts, unreadable = Path(RUNS), {}, []
        for name in plan["points"]:
            path = runs / name / "receipt.json"
            if path.exists():
                try:
                    receipts[name] = read_json(path)
                except (OSError, ValueError) as exc:  # a truncated or hand-edited receipt: named, not a traceback
                    unreadable.append(f"{path} ({_one_line(exc)})")
        missing = [name for name in plan["points"] if not (runs / name / "receipt.json").exists()]
        sweep_name = (plan.get("sweep") or {}).get("name", "")
        heads = report.read_folders([runs / "heads"], root=runs)[2] if (runs / "heads").is_dir() else {}
    for line in unreadable:
        print(f"posttrainllm: unreadable receipt {line}: rerun its point (dvc repro)", file=sys.stderr)
    if not receipts:
        print(f"posttrainllm: no receipts under {' '.join(folders)}" if folders else
              "posttrainllm: no receipts yet: run `dvc repro`", file=sys.stderr)
        return EXIT_CONTRACT
    print(report.sweep_table(receipts) if "--wide" in args else report.summary_table(receipts))
    for name, receipt in receipts.items():  # the receipt stage stamps itself after its receipt is written
        own = runs / name / "stamps" / "receipt.json"
        if own.exists() and receipt.get("stamps") is not None:
            receipt["stamps"] = {**receipt["stamps"], "receipt": read_json(own)}
    fit = report.fill  # a long line of prose, wrapped to the table's width
    for line in report.flag_lines(receipts):  # the figures not to read as results, with why (track/derived.py)
        print(fit(line))
    if heads:
        print(report.HEADS_LEGEND, report.heads_frame(heads).to_string(index=False), sep="\n")
    if report.stage_times_text(receipts):
        print(fit(report.stage_times_text(receipts)))
    (runs / "report.md").write_text(report.sweep_markdown(receipts))
    (runs / "report.html").write_text(report_page.sweep_page(receipts, runs, sweep=sweep_name, heads=heads))
    print(f"written: {runs / 'report.md'} (every column), {runs / 'report.html'} (plots and parity per point)")
    if "--write-docs" in args:  # the README's headline and docs/measured.md, from these receipts (track/headline.py)
        from posttrainllm.track import headline

        command = " ".join([headline.COMMAND, *folders])
        try:
            written = headline.write_docs(receipts, Path.cwd(), command=command)
        except (OSError, ValueError) as exc:
            print(f"posttrainllm: report --write-docs: {_one_line(exc)} (run it in the clone's root)", file=sys.stderr)
            return EXIT_CONFIG
        print(f"written: {', '.join(str(path) for path in written)} (from {len(receipts)} receipts)")
    address = _runs_table_address()
    if address:
        print(f"MLflow runs: {address}  (serve it: posttrainllm ui)")
    if missing:
        print(fit(f"no receipt yet for: {', '.join(missing)}"))
    failed = [name for name, r in receipts.items() if report.point_failed(r)]
    if failed:  # so `dvc repro && posttrainllm report` still fails a CI job on a broken contract
        print(f"posttrainllm: {len(failed)} of {len(receipts)} points failed: {', '.join(failed)}", file=sys.stderr)
        return EXIT_CONTRACT
    return 0


def show_progress(args: list[str]) -> int:
    """`posttrainllm progress`: the planned sweep's stages done per point, and the time left (track/progress.py)."""
    from posttrainllm.lab.pipeline import PARAMS, POINT_STAGES, RUNS
    from posttrainllm.track import progress

    if args:
        print(f"posttrainllm: config error: posttrainllm progress takes no arguments (got {' '.join(args)}); "
              "it reads params.yaml and runs/ in this folder", file=sys.stderr)
        return EXIT_CONFIG
    try:
        print(progress.table(progress.read_progress(PARAMS, Path(RUNS), POINT_STAGES)))
    except ConfigError as exc:
        print(f"posttrainllm: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


DVC_YAML_USAGE = "usage: posttrainllm dvc-yaml [--check]"


def write_dvc_yaml(args: list[str]) -> int:
    """`posttrainllm dvc-yaml [--check]`: dvc.yaml's deps and params rewritten from what each stage declares it
    reads (lab/reads.py); --check writes nothing and exits 1 when dvc.yaml differs from the declaration."""
    from posttrainllm.lab import reads

    if args not in ([], ["--check"]):
        print(f"posttrainllm: config error: {DVC_YAML_USAGE} (got {' '.join(args)})", file=sys.stderr)
        return EXIT_CONFIG
    path = Path("dvc.yaml")
    if not path.is_file():
        print(f"posttrainllm: config error: no dvc.yaml in {Path.cwd()}: run from the project root", file=sys.stderr)
        return EXIT_CONFIG
    try:
        same = reads.write_dvc_yaml(path, check=bool(args))
    except ConfigError as exc:
        print(f"posttrainllm: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args and not same:
        print("posttrainllm: dvc.yaml's deps and params differ from posttrainllm/lab/reads.py: run "
              "`posttrainllm dvc-yaml` and commit it", file=sys.stderr)
        return 1
    print("dvc.yaml: deps and params as posttrainllm/lab/reads.py declares them")
    return 0


def _runs_table_address() -> str | None:
    """The runs table's address as `posttrainllm ui` serves it, when the project's local store holds the
    experiment; None otherwise (no store, a tracking server, MLflow absent or the store unreadable)."""
    from posttrainllm.track import receipt, store, ui

    uri = receipt.tracking_uri()
    if store.sqlite_path(uri) is None or not ui.store_exists(uri) or not receipt.mlflow_available():
        return None
    try:
        found = ui.addresses(uri, ui.base_url(ui.HOST, ui.PORT))
    except store.tracking_errors():
        return None
    return found.runs_table if found else None


UI_USAGE = ("usage: posttrainllm ui [--port N] [--host HOST]   (the MLflow UI on the project's store, "
            "127.0.0.1:5000 by default; Ctrl-C stops it)")


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def serve_ui(args: list[str]) -> int:
    """`posttrainllm ui`: `mlflow ui` on the project's store (track/ui.py) until Ctrl-C (or SIGTERM), once it
    answers, the addresses of the runs table and of the latest sweep's run. A tracking server is not served
    again: its own addresses are printed. Refused in one line: a bad flag or port (exit 2), no store yet (1)."""
    import signal

    from posttrainllm.track import receipt, store, ui

    if args in (["-h"], ["--help"]):
        print(UI_USAGE)
        return 0
    options, rest = {"--port": str(ui.PORT), "--host": ui.HOST}, list(args)
    while rest:
        flag = rest.pop(0)
        if flag not in options or not rest or rest[0].startswith("-"):
            print(UI_USAGE, file=sys.stderr)
            return EXIT_CONFIG
        options[flag] = rest.pop(0)
    host, port = options["--host"], options["--port"]
    if not port.isdigit() or not 0 < int(port) < 65536:
        print(f"posttrainllm: ui: --port {port}: a port number, 1 to 65535", file=sys.stderr)
        return EXIT_CONFIG
    uri = receipt.tracking_uri()
    if not receipt.mlflow_available():
        print("posttrainllm: mlflow is not installed here (pip install -e '.[track]')", file=sys.stderr)
        return EXIT_CONFIG
    remote = store.sqlite_path(uri) is None  # a tracking server has its own UI
    base = uri.rstrip("/") if remote else ui.base_url(host, int(port))
    if not ui.store_exists(uri):
        print(f"posttrainllm: no MLflow store yet ({uri}): log a point first (posttrainllm bench, dvc repro)",
              file=sys.stderr)
        return EXIT_CONTRACT
    try:
        found = ui.addresses(uri, base)
    except store.tracking_errors() as exc:
        print(f"posttrainllm: cannot read the MLflow store ({uri}: {store.short_reason(exc)})", file=sys.stderr)
        return EXIT_CONFIG
    if found is None:
        print(f"posttrainllm: no {receipt.EXPERIMENT} experiment in {uri} yet: log a point first", file=sys.stderr)
        return EXIT_CONTRACT
    lines = [f"runs table: {found.runs_table}"] + ([f"latest sweep ({found.sweep}): {found.sweep_run}"]
                                                  if found.sweep_run else [])
    moved = None if remote else ui.moved_artifacts(uri)
    if moved:  # a copied store: its artifacts are where it was copied from
        print(f"posttrainllm: {ui.MOVED.format(recorded=moved)}", file=sys.stderr)
    if remote:
        print(f"the store is a tracking server: its UI is at {base}")
        print("\n".join(lines))
        return 0
    if not ui.port_free(host, int(port)):
        print(f"posttrainllm: ui: port {port} on {host} is taken: choose another (--port N)", file=sys.stderr)
        return EXIT_CONFIG
    print(f"starting the MLflow UI on {uri} (one worker) ...", flush=True)
    previous = signal.signal(signal.SIGTERM, _interrupted)  # a supervisor's stop ends the server too, as Ctrl-C does
    server = None
    try:
        server = ui.start(uri, host, int(port))
        if not ui.wait_ready(server, base, timeout_s=120):
            print(f"posttrainllm: the MLflow UI did not answer at {base} (exit code {server.poll()}; its output "
                  "is above)", file=sys.stderr)
            return EXIT_CONTRACT
        print(f"MLflow UI at {base}, Ctrl-C stops it", *lines, sep="\n", flush=True)
        server.wait()
        print(f"posttrainllm: the MLflow UI stopped (exit code {server.returncode})", file=sys.stderr)
        return EXIT_CONTRACT
    except KeyboardInterrupt:
        return 0
    finally:
        if server is not None:
            ui.stop(server)
        signal.signal(signal.SIGTERM, previous)


def import_receipts(args: list[str]) -> int:
    """`posttrainllm receipt import FOLDER`."""
    from posttrainllm.track import receipt

    if len(args) != 2 or args[0] != "import" or not Path(args[1]).is_dir():
        print("usage: posttrainllm receipt import FOLDER   (a point's folder, or a folder of them: a sweep's runs/, "
              "a gpu-check OUTDIR)", file=sys.stderr)
        return EXIT_CONFIG
    from posttrainllm.track import store

    if not receipt.mlflow_available():
        print("posttrainllm: mlflow is not installed here (pip install -e '.[track]'); nothing imported",
              file=sys.stderr)
        return EXIT_CONFIG
    try:  # every receipt is checked first: one bad file and none is logged
        logged = receipt.import_folder(Path(args[1]), on_logged=lambda path, run_id: print(
            f"{path}: mlflow run {run_id}"))
    except receipt.InvalidReceipts as exc:
        for path, why in exc.problems:
            print(f"posttrainllm: bad receipt {path}: {why}", file=sys.stderr)
        print(f"posttrainllm: {len(exc.problems)} of {exc.total} receipts bad; nothing logged", file=sys.stderr)
        return EXIT_CONFIG
    except store.TrackingFailed as exc:
        print(exc.line(), file=sys.stderr)
        return EXIT_UNTRACKED
    except ValueError as exc:
        print(f"posttrainllm: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"{len(logged)} receipts in {receipt.tracking_uri()}")
    return 0 if logged else EXIT_CONTRACT


def replay_receipts(args: list[str]) -> int:
    """`posttrainllm replay TARGET [--out DIR]`: tables, verdicts and plots from what was stored; nothing runs."""
    from posttrainllm.track import replay

    out = _option(args, "--out")
    if len(args) != 1:
        print("usage: posttrainllm replay TARGET [--out DIR]   (TARGET: a point folder, a receipt.json, a folder "
              "of points, or an MLflow run id)", file=sys.stderr)
        return EXIT_CONFIG
    try:
        stored, others = replay.load(args[0])
    except replay.ReplayError as exc:
        print(f"posttrainllm: cannot replay {exc}", file=sys.stderr)
        return EXIT_CONFIG
    for line in others:
        print(f"not replayed: {line}")
    bad = 0
    for one in stored:
        print(replay.render(one, Path(out) / one.name if out else Path("runs") / "replay" / one.name))
        problems = replay.verify(one)
        for problem in problems:
            print(f"posttrainllm: receipt {one.source} does not add up: {problem}", file=sys.stderr)
        print(f"verified: {'ok' if not problems else f'{len(problems)} problem(s)'}\n")
        bad += bool(problems)
    if bad:
        print(f"posttrainllm: {bad} of {len(stored)} receipts do not add up (tampered or truncated?)", file=sys.stderr)
        return EXIT_CONFIG
    return 0


def compare_receipts(args: list[str]) -> int:
    """`posttrainllm compare BASE NEW`: exit 1 when a path got slower or a verdict went from pass to fail."""
    from posttrainllm.track import compare, replay

    across = "--across-devices" in args
    args = [a for a in args if a != "--across-devices"]
    out = Path(_option(args, "--out") or Path("runs") / "compare.md")
    overrides = [a for a in args if "=" in a and not Path(a).exists()]
    targets = [a for a in args if a not in overrides]
    if len(targets) != 2 or any(not o.startswith("compare.") for o in overrides):
        print("usage: posttrainllm compare BASE NEW [--across-devices] [--out FILE] [compare.KEY=VALUE ...]   "
              "(BASE, NEW: point folders, receipt.json files, folders of points, or MLflow run ids)", file=sys.stderr)
        return EXIT_CONFIG
    try:
        cfg = load(overrides).compare
        (base, base_others), (new, new_others) = (replay.load(target) for target in targets)
    except ConfigError as exc:
        print(f"posttrainllm: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except replay.ReplayError as exc:
        print(f"posttrainllm: cannot compare {exc}", file=sys.stderr)
        return EXIT_CONFIG
    problems = [f"{one.source}: {p}" for one in (*base, *new) for p in replay.verify(one)]
    if problems:
        for problem in problems:
            print(f"posttrainllm: receipt does not add up: {problem}", file=sys.stderr)
        print("posttrainllm: not compared: fix or rerun those points", file=sys.stderr)
        return EXIT_CONFIG
    result = compare.compare(base, new, cfg, across_devices=across)
    result.notes[:0] = [f"not compared: {line}" for line in dict.fromkeys((*base_others, *new_others))]
    print(compare.table(result, cfg))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(compare.markdown(result, cfg, *targets))
    print(f"written: {out}")
    return EXIT_CONTRACT if result.regressions else 0


def _option(args: list[str], flag: str) -> str | None:
    """Remove `flag VALUE` from args (in place) and return VALUE."""
    if flag not in args:
        return None
    i = args.index(flag)
    value = args[i + 1] if i + 1 < len(args) else None
    del args[i:i + 2]
    return value


def _collect_launched(labs: list[LabConfig], started: float) -> None:
    """After a multirun through a Hydra launcher plugin (conf/hydra/launcher/): its jobs ran in other
    processes, so their verdicts are read from the receipts they wrote since `started`; each point's table
    is printed here (the jobs' own output is in the launcher's logs, run.out_dir/.submitit/)."""
    from posttrainllm.files import read_json
    from posttrainllm.track import report

    found = sorted({path for lab in labs for path in Path(lab.run.out_dir).glob("*/receipt.json")
                    if path.stat().st_mtime >= started})
    for path in found:
        stored = read_json(path)
        print(report.point_table(stored))
        if report.point_failed(stored):
            _broken.append(f"{stored['point']}: a contract broke (see {path})")
        if labs[0].run.log_mlflow:  # a job that could not log kept its JSON: say so here, as a job run here would
            _check_logged(stored, path.parent)
    print(f"posttrainllm: {len(found)} point(s) from the launcher's jobs: {', '.join(p.parent.name for p in found)}")


def _check_logged(stored: dict[str, Any], folder: Path) -> None:
    """A launched job's receipt that is not in MLflow goes to `_untracked` (exit 3), with its import command."""
    from posttrainllm.track import receipt, store

    try:
        if receipt.logged_run(stored) is not None:
            return
        line = store.TrackingFailed(receipt.tracking_uri(), "its job did not log this receipt", unreachable=False,
                                    folder=folder).line()
    except store.TrackingFailed as exc:
        exc.folder = folder
        line = exc.line()
    print(line, file=sys.stderr)
    _untracked.append(line)


def _overrides(args: list[str]) -> list[str]:
    """The `key=value` arguments (Hydra's own flags start with '-')."""
    return [a for a in args if "=" in a and not a.startswith("-")]


_INSPECT_FLAGS = ("-c", "--cfg", "-p", "--package", "-i", "--info", "-h", "--help", "--hydra-help")  # Hydra runs no job


def _check_before_running(args: list[str], grid: bool) -> list[LabConfig]:
    """Compose every value of every override once, so a bad one fails before anything is written.

    That includes a device this machine does not have (device=cuda without CUDA): refused
    here with the valid choices, not by a traceback from inside the Hydra job.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from posttrainllm.config import check_group_choices
    from posttrainllm.lab.sweep import refuse_multi_dimension_multirun
    from posttrainllm.measure import device as devices

    overrides = _overrides(args)
    check_group_choices(overrides)
    refuse_multi_dimension_multirun(overrides, grid)
    parsed = OverridesParser.create().parse_overrides(overrides)
    sweeps = {i: list(o.sweep_string_iterator()) for i, o in enumerate(parsed) if o.is_sweep_override()}
    # every job the multirun will launch: the product of the swept values (one dimension without --grid)
    keys = [o.input_line.split("=")[0] for o in parsed]
    composed = [load([f"{keys[i]}={combo[list(sweeps).index(i)]}" if i in sweeps else overrides[i]
                      for i in range(len(parsed))])
                for combo in itertools.product(*sweeps.values())]
    if not any(a.split("=")[0] in _INSPECT_FLAGS for a in args):  # `--cfg job device=cuda` only prints
        for lab in composed:
            devices.check_available(lab.device.name)
    return composed


EXPLAIN_USAGE = ("usage: posttrainllm explain POINT   (a point's folder, its receipt.json, or a point's name under "
                 "runs/: the contract, the memory traffic per path and the end-to-end effect, read from the receipt)")


def explain_point(args: list[str]) -> int:
    """Print track/explain.py's three answers for one point's receipt; nothing is run."""
    from posttrainllm.files import read_json
    from posttrainllm.track.explain import explain

    if args in (["-h"], ["--help"]):
        print(EXPLAIN_USAGE)
        return 0
    if len(args) != 1:
        print(EXPLAIN_USAGE, file=sys.stderr)
        return EXIT_CONFIG
    given = Path(args[0])
    looked = [given, given / "receipt.json", Path("runs") / args[0] / "receipt.json"]
    found = next((path for path in looked if path.is_file()), None)
    if found is None:
        print(f"posttrainllm: explain: no receipt at {', '.join(map(str, looked))}: give a point's folder, its "
              "receipt.json, or the name of a point under runs/", file=sys.stderr)
        return EXIT_CONFIG
    try:
        receipt = read_json(found)
    except (OSError, ValueError) as exc:
        print(f"posttrainllm: explain: unreadable receipt {found} ({str(exc).splitlines()[0] if str(exc) else exc!r})",
              file=sys.stderr)
        return EXIT_CONFIG
    if not isinstance(receipt, dict) or "point" not in receipt:
        print(f"posttrainllm: explain: {found} is not a point's receipt (no 'point')", file=sys.stderr)
        return EXIT_CONFIG
    print(explain(receipt))
    return 0


def new_impl_usage() -> str:
    """new-impl's usage line; the op made from a problem file is named as the registry names it."""
    from posttrainllm.ops.registry import PROBLEM

    return ("usage: posttrainllm new-impl op=OP FILE.py [--name NAME] [op.KEY=VALUE ...]   (writes FILE.py, never "
            "over an existing file: a function NAME, by default the op's name, in the op's natural signature; "
            f"op={PROBLEM} op.file=PROBLEM.py: a class ModelNew)")


def new_impl(args: list[str]) -> int:
    """`posttrainllm new-impl op=OP FILE.py [--name NAME]`: a user path to start from (lab/isolation/user.py).

    The file holds `OpDef.template` (the op's readable math, correct as it is, in its natural signature) under a
    module docstring that states `OpDef.signature` and the command that gives its receipt. The function (and so
    the path's name in the receipt) is the op's name unless --name says otherwise: a Python identifier, never a
    built-in path's name. Nothing is written on bad input (one line, exit 2), nor over an existing file.
    """
    import keyword
    import textwrap

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from posttrainllm.ops.registry import op_for

    def refuse(line: str) -> int:
        print(f"posttrainllm: new-impl: {line}", file=sys.stderr)
        return EXIT_CONFIG

    if args in (["-h"], ["--help"]):
        print(new_impl_usage())
        return 0
    args = list(args)
    name = None
    if "--name" in args:
        at = args.index("--name")
        if at + 1 >= len(args) or args[at + 1].startswith("-"):
            return refuse("--name needs a value: " + new_impl_usage())
        name = args.pop(at + 1)
        args.pop(at)
    choices = [a for a in args if a.startswith("op=")]
    # the op's own keys (op=problem op.file=PATH op.sizes.N=V): passed to the config as the command's overrides
    overrides = [a for a in args if re.match(r"^op\.[A-Za-z_][\w.]*=", a)]
    files = [a for a in args if not a.startswith("op=") and a not in overrides]
    if len(choices) != 1 or len(files) != 1 or files[0].startswith("-"):
        print(new_impl_usage(), file=sys.stderr)
        return EXIT_CONFIG
    choice, target = choices[0].partition("=")[2], Path(files[0])
    try:
        op = op_for(load([f"op={choice}", *overrides]))  # op=attention_noncausal: the attention op, causal=false
    except ConfigError as exc:
        return refuse(f"config error: {exc}")
    name = name or op.template_name or op.name
    taken = sorted({*op.impls, *op.optional_peers, *op.reserved_names})
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name) or keyword.iskeyword(name):
        return refuse(f"--name {name!r}: the function's name must be a Python identifier starting with a letter")
    if name in taken:
        return refuse(f"--name {name!r} is a built-in path of {op.name} (taken: {', '.join(taken)}): choose another")
    if not op.template:
        return refuse(f"op {op.name} declares no template (OpDef.template)")
    if target.suffix != ".py":
        return refuse(f"{target}: the file must end in .py (it is loaded as a Python file)")
    if target.exists():
        return refuse(f"{target} already exists: nothing written (choose another file, or delete it)")
    spec = f"{target.as_posix()}:{name}"
    override = f"op.user_impls=[{spec}]"
    try:  # the command below must hand Hydra this one spec back: no comma, bracket, quote or '=' in the path
        parsed = OverridesParser.create().parse_overrides([override])[0].value()
    except HydraException:
        parsed = None
    if parsed != [spec] or "=" in target.as_posix():
        return refuse(f"{target}: a path a Hydra override can hold unquoted, please (letters, digits, '_', '-', "
                      "'.', '/')")
    command = " ".join(["posttrainllm bench", f"op={choice}", *overrides, f"'{override}'", f"'op.only=[{name}]'"])
    docstring = "\n".join([
        f"A kernel of your own for op {op.name}: `{name}`, in the op's natural signature",
        "", textwrap.fill(op.signature, width=100, initial_indent="    ", subsequent_indent="    "), "",
        "Its receipt (parity against float64 math, the guards, timing against the reference, this file's sha256;",
        "without op.only, beside every built-in path too):", "",
        f"    {command}", "",
        "The body is the readable math, correct as it is: make it fast, keep it right.",
    ])
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("x") as out:  # "x": never over a file that appeared meanwhile
        out.write(f'"""{docstring}\n"""\n{op.template.format(name=name)}')
    print(f"written: {target} ({name}, op {op.name})")
    print(f"its receipt: {command}")
    return 0


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped


def _unknown_command(name: str) -> int:
    """One line naming it and the closest commands, then every command; exit 2."""
    import difflib

    close = difflib.get_close_matches(name, list(dict.fromkeys([*COMMANDS, *COMMAND_NAMES])), n=3, cutoff=0.5)
    hint = f": did you mean {' or '.join(close)}?" if close else ""
    print(f"posttrainllm: unknown command {name!r}{hint}\n  commands: {', '.join(COMMAND_NAMES)} "
          "(posttrainllm --help says what each does)", file=sys.stderr)
    return EXIT_CONFIG


def _dashed_override(command: str, args: list[str]) -> str | None:
    """The line refusing `--key value` or `--key=value` (Hydra takes `key=value`), or None when every dashed
    argument is one of Hydra's own flags (hydra's argument parser) or --grid."""
    from hydra._internal.utils import get_args_parser

    flags = get_args_parser()._option_string_actions
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if not arg.startswith("-") or name in flags or arg == "--grid" or name.lstrip("-")[:1].isdigit():
            continue
        if not eq:
            following = args[i + 1] if i + 1 < len(args) else ""
            value = following if following and not following.startswith("-") and "=" not in following else "VALUE"
        return (f"posttrainllm {command}: overrides are key=value, not {arg}: write {name.lstrip('-')}={value}  "
                f"(posttrainllm {command} --help lists the common ones)")
    return None


def _command_help(command: str) -> str:
    """What the command does, its common overrides (with the config groups' options) and an example."""
    import textwrap

    from posttrainllm.config import group_options

    does, common, example = HELP[command]
    groups = {g: "|".join(group_options(g)) for g in ("op", "precision", "shape", "tile", "architecture", "sweep",
                                                        "heads")}
    lines = [f"posttrainllm {command}: " + textwrap.fill(does, 110, subsequent_indent="  "), "",
             "Common overrides (key=value; any key of the config below):"]
    lines += [f"  {key.format(**groups)}\n      {meaning}" for key, meaning in common]
    lines += ["", "Example:", f"  {example}", "", "Hydra's help: the config groups and the whole config", ""]
    return "\n".join(lines)


def _project_root(start: Path) -> Path | None:
    """The nearest folder from `start` up holding dvc.yaml and conf/, as a clone of this project does (either alone
    is common elsewhere: another DVC project, a home folder's conf/)."""
    return next((d for d in (start, *start.parents) if (d / "dvc.yaml").is_file() and (d / "conf").is_dir()), None)


def _refuse_subfolder(command: str) -> int | None:
    """Commands read and write runs/, params.yaml and mlflow.db where they run: in a subfolder of a project
    (a folder above holds dvc.yaml and conf/) they are refused in one line naming the root (exit 2)."""
    import os

    here = Path.cwd()
    root = _project_root(here)
    if os.environ.get("DVC_ROOT") or root is None or root == here:  # under DVC, DVC chose the folder
        return None
    print(f"posttrainllm {command}: run it from the project root, {root} (here, in {here}, it would read and "
          "write runs/, params.yaml and mlflow.db apart from the project's)", file=sys.stderr)
    return EXIT_CONFIG


def _say_where(command: str, labs: list[LabConfig]) -> None:
    """Outside any project, before a first runs/ is made there: one line saying where the command writes."""
    import os

    here = Path.cwd()
    if _project_root(here) is None and not (here / "runs").exists():
        what = ["params.yaml"] if command == "sweep" else sorted({f"{lab.run.out_dir}/" for lab in labs})
        if command != "sweep" and any(lab.run.log_mlflow for lab in labs) and not os.environ.get(
                "MLFLOW_TRACKING_URI"):
            what.append("mlflow.db")
        print(f"posttrainllm {command}: {here} is no project root (no dvc.yaml and conf/ here or above): writing "
              f"{' and '.join(what)} here")


def main(argv: list[str] | None = None) -> int:
    """The console script: a Ctrl-C anywhere is one line and exit 130 (a point's receipt is written whole or
    not at all, files.write_json; a point without its receipt.json is not a result)."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        print("posttrainllm: interrupted (Ctrl-C): the point in progress has no receipt; its finished points "
              "keep theirs", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(args: list[str]) -> int:
    if args and not args[0].startswith("-") and args[0] not in COMMAND_NAMES:
        return _unknown_command(args[0])
    inspect = any(a.split("=")[0] in _INSPECT_FLAGS for a in args[1:])
    if args[:1] not in ([], ["new-impl"], ["explain"]) and not args[0].startswith("-") and not inspect:
        refused = _refuse_subfolder(" ".join(args[:2]) if args[0] == "experimental" else args[0])
        if refused is not None:
            return refused
    if args[:1] == ["new-impl"]:
        return new_impl(args[1:])
    if args[:1] == ["explain"]:
        return explain_point(args[1:])
    if args and args[0] == "report":
        return report_sweep(args[1:])
    if args[:1] == ["ui"]:
        return serve_ui(args[1:])
    if args[:1] == ["progress"]:
        return show_progress(args[1:])
    if args[:1] == ["dvc-yaml"]:
        return write_dvc_yaml(args[1:])
    if args and args[0] == "receipt":
        return import_receipts(args[1:])
    if args and args[0] == "replay":
        return replay_receipts(args[1:])
    if args and args[0] == "compare":
        return compare_receipts(args[1:])
    if args[:1] == ["experimental"]:  # `experimental SUB`: one command name, the rest as for any other
        args = [" ".join(args[:2]), *args[2:]]
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if args and args[0].startswith("experimental") and args[0] not in COMMANDS:
        return _unknown_command(args[0])
    if not args or args[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        return EXIT_CONFIG
    command, rest = args[0], args[1:]
    dashed = _dashed_override(command, rest)
    if dashed:
        print(dashed, file=sys.stderr)
        return EXIT_CONFIG
    if {"-h", "--help"} & set(rest):
        print(_command_help(command), flush=True)
    grid = "--grid" in rest
    rest = [a for a in rest if a != "--grid"]
    from posttrainllm.lab import approval

    try:
        labs = _check_before_running(rest, grid)
        if command == "bench-train":  # a quantized point trains by the precision's recipe: an op without one is refused
            for lab in labs:
                check_train_rules(lab)
        if command in TIMED and not any(a.split("=")[0] in _INSPECT_FLAGS for a in rest):  # before any work
            found = approval.check(labs, train=command == "bench-train", heads=command.startswith("experimental"),
                                   what=f"posttrainllm {command}")
            if found:
                print(f"posttrainllm: approved: {found.line()}", file=sys.stderr)
    except ConfigError as exc:
        print(f"posttrainllm: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except approval.NotApproved as exc:  # on a GPU without approval: the estimate, one line
        print(f"posttrainllm: not approved: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    _broken.clear()
    _untracked.clear()
    _unfit.clear()
    _cannot_run.clear()
    if command == "sweep" and {"-m", "--multirun"} & set(rest):  # one plan per params.yaml: a multirun keeps the last
        print("posttrainllm: config error: posttrainllm sweep -m: a sweep plans one params.yaml: give one sweep=NAME, "
              "and the options to try under vary: in conf/sweep/<name>.yaml", file=sys.stderr)
        return EXIT_CONFIG
    if not any(a.split("=")[0] in _INSPECT_FLAGS for a in rest):
        _say_where(command, labs)
    app = hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)(COMMANDS[command])
    saved_argv = sys.argv
    # op.sizes.NAME=VALUE names a problem file's constant, a key conf/ cannot list: Hydra adds it (config.compose)
    sys.argv = [f"posttrainllm {command}", *(f"++{a}" if a.startswith("op.sizes.") else a for a in rest)]
    started = time.time()
    try:
        app()
    except SystemExit as exc:  # _fail_config inside a job, or Hydra's own exit
        return exc.code if isinstance(exc.code, int) else EXIT_CONFIG
    finally:
        sys.argv = saved_argv
    if command in ("bench", "bench-train") and any(a.startswith("hydra/launcher=") for a in rest):
        _collect_launched(labs, started)
    for line in _cannot_run:
        print(f"posttrainllm: {line}", file=sys.stderr)
    for line in _broken:
        print(f"posttrainllm: contract broken: {line}", file=sys.stderr)
    if _broken or _unfit:
        return EXIT_CONTRACT
    return EXIT_UNTRACKED if _untracked else 0

