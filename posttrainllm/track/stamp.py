"""Stamps: what one stage's output of one point was made from.

Each DVC stage of a point leaves `runs/<point>/stamps/<stage>.json` beside its output
(written by lab/pipeline.py `stamped`, declared as an out of the stage in dvc.yaml; the
heads stages write theirs in runs/heads/base/ and runs/heads/<K name>/):

    stage, point, created_at
    revision, dirty    git HEAD and whether the tree differed from it (track/provenance.py)
    device             the device fingerprint the stage ran with (measure/device.py `fingerprint`)
    sources            {repo-relative path: sha256} of every posttrainllm module loaded in the
                       stage's process, plus its pipelines/<stage>.py script and what the stage passes
                       of its own from outside the package: the file of every user path it runs
                       (op.user_impls; absolute when outside the project) and, for the kernel stage, the
                       files of the Triton kernels those paths launch (lab/reads.py `outside_sources`)
    inputs_sha256      a point stage's: the sha256 of runs/inputs/<point>/<stage>.json, the inputs file it
                       ran on (track/progress.py: the stage is done while that file keeps this hash)
    outputs            a point stage's: {file name: sha256} of the files it wrote in runs/<point>/
                       (lab/pipeline.py STAGE_OUTPUTS); the receipt refuses one changed since (`check_outputs`)
    config_keys        the dotted config keys the stage read ("tile.block_q"), `run.*` and
                       `sweep` left out (where to write and the plan, not what is computed);
                       null for a timed stage unless POSTTRAINLLM_RECORD_CONFIG_READS=1 (RECORD_ENV)

The receipt (track/receipt.py `build`) refuses to combine stages whose stamps disagree
about the code they shared, or timed stages from different devices (`check_consistent`),
and records every stamp. A revision alone may differ: DVC keeps a stage whose inputs did
not change across commits. The hashes are taken when the stage ends, as DVC's are. A point
stage refuses its own stamp when it names a file or config key that the stage's inputs file
(runs/inputs/<point>/<stage>.json, what DVC reruns it on) does not list (`check_inputs`): what a
stage reads is declared once (lab/reads.py), and a test (tests/test_dvc_deps.py) checks every
stage's stamps against that declaration's deps and params.

Config reads are recorded without touching the code that reads: `record_config_reads`
replaces `__getattribute__` of the config dataclasses (posttrainllm/config.py) while the
stage runs, and restores it afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import os
import sys
import typing
from pathlib import Path
from typing import Any, Iterator

from posttrainllm import config as config_module
from posttrainllm.config import PROJECT_ROOT, LabConfig

STAMPS = "stamps"  # runs/<point>/stamps/<stage>.json
TIMED_STAGES = ("microbench", "bench_train", "decode")  # their timings are only comparable on one device
NOT_COMPUTED = ("run", "sweep")  # config groups that say where to write and what was planned, not what is computed
# Recording config reads adds a Python call to every config attribute access, also inside timed calls
# (~0.2 us each): the timed stages record only when this is "1" (tests/test_dvc_deps.py sets it).
RECORD_ENV = "POSTTRAINLLM_RECORD_CONFIG_READS"
# Modules a stage loads only to print, never to compute what it writes: left out of its sources, so a change
# to how progress is shown reruns no stage
DISPLAY_ONLY = ("posttrainllm/track/progress.py",)
INPUTS_KEY = "inputs_sha256"
OUTPUTS_KEY = "outputs"


class StampMismatch(RuntimeError):
    """Two stages of one point were made from different code (or timed on different devices).

    The message is one line naming both stages, the file and where the stamps are.
    """


# --- sources -----------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def loaded_sources(root: Path = PROJECT_ROOT) -> dict[str, str]:
    """{path relative to `root`: sha256} of every module of root/posttrainllm/ loaded in this process."""
    root = root.resolve()
    package = root / "posttrainllm"
    found: dict[str, str] = {}
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        if not name:
            continue
        path = Path(name).resolve()
        if path.suffix == ".py" and path.is_relative_to(package) and path.is_file():
            relative = path.relative_to(root).as_posix()
            if relative not in DISPLAY_ONLY:
                found[relative] = file_sha256(path)
    return dict(sorted(found.items()))


def stage_sources(stage: str, root: Path = PROJECT_ROOT, outside: dict[str, str] | None = None) -> dict[str, str]:
    """The loaded posttrainllm modules plus the stage's own script, pipelines/<stage>.py, and `outside`: {file:
    sha256} of what the stage ran from outside the package (its user paths' files, given by the stage's runner:
    lab/reads.py `outside_sources`)."""
    sources = {**loaded_sources(root), **(outside or {})}
    script = root / "pipelines" / f"{stage}.py"
    if script.is_file():
        sources[script.relative_to(root).as_posix()] = file_sha256(script)
    return dict(sorted(sources.items()))


# --- config reads ------------------------------------------------------------------------


def _config_classes() -> tuple[type, ...]:
    """Every dataclass of posttrainllm/config.py (LabConfig and its groups) and their subclasses loaded (an op's
    own config, posttrainllm/ops/<op>/config.py, subclasses OpConfig)."""
    found = [obj for obj in vars(config_module).values() if isinstance(obj, type)
             and dataclasses.is_dataclass(obj) and obj.__module__ == config_module.__name__]
    for cls in found:  # grows as it goes: a subclass's subclasses too
        found += [sub for sub in cls.__subclasses__() if dataclasses.is_dataclass(sub) and sub not in found]
    return tuple(found)


def _paths_by_class() -> dict[type, list[str]]:
    """Where each config class sits in LabConfig's field tree: {TileConfig: ["tile"], Contract: [...], ...}; a
    subclass where its base does (an op's config: ["op"]); an op's sizes under its op's name in shape.ops."""
    found = _declared_paths(LabConfig, "")
    for cls in _config_classes():
        if issubclass(cls, config_module.OpSizes) and cls.op_name:
            found[cls] = [f"shape.ops.{cls.op_name}"]
        base = next((b for b in cls.__mro__[1:] if b in found), None)
        if cls not in found and base is not None:
            found[cls] = list(found[base])
    return found


def _declared_paths(root: type, prefix: str) -> dict[type, list[str]]:
    classes = set(_config_classes())
    found: dict[type, list[str]] = {root: [prefix]} if not prefix else {}
    hints = typing.get_type_hints(root, vars(config_module))
    for f in dataclasses.fields(root):
        for cls in _dataclass_args(hints.get(f.name), classes):
            path = f"{prefix}.{f.name}" if prefix else f.name
            found.setdefault(cls, []).append(path)
            for sub, paths in _declared_paths(cls, path).items():
                found.setdefault(sub, []).extend(paths)
    return found


def _dataclass_args(hint: Any, classes: set[type]) -> list[type]:
    """The config classes in a field's type (`SweepConfig | None` -> [SweepConfig])."""
    if hint in classes:
        return [hint]
    return [arg for arg in typing.get_args(hint) if arg in classes]


def _instance_paths(cfg: Any, prefix: str = "") -> dict[int, str]:
    """id(instance) -> dotted path of every config dataclass instance under `cfg` ("" for cfg itself), those held by
    key in a dict field too (each op's sizes, shape.ops.<op>)."""
    paths = {id(cfg): prefix}
    for f in dataclasses.fields(cfg):
        value = object.__getattribute__(cfg, f.name)
        path = f"{prefix}.{f.name}" if prefix else f.name
        if _is_instance(value):
            paths.update(_instance_paths(value, path))
        elif isinstance(value, dict):
            for key, item in value.items():
                if _is_instance(item):
                    paths.update(_instance_paths(item, f"{path}.{key}"))
    return paths


def _is_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


class ConfigReads:
    """The config fields read while recording, as dotted keys.

    A read of an instance in the recorded config's tree maps to its own path (so two fields
    of one class, such as two Contracts, stay apart; an op's sizes, shape.ops.<op>); a read of a copy made during the
    stage (`dataclasses.replace`) maps to every path its class has in LabConfig (an op's sizes: shape.ops.<op>).
    Reading a group itself (cfg.tile, or cfg.shape.ops: a dict of groups) is not a read of a value; reading its
    fields is.
    """

    def __init__(self, cfg: LabConfig | None = None):
        self._instances = _instance_paths(cfg) if cfg is not None else {}
        self._by_class = _paths_by_class()
        self._raw: set[tuple[str | type, str]] = set()

    def keys(self) -> list[str]:
        keys = set()
        for where, name in self._raw:
            prefixes = [where] if isinstance(where, str) else self._by_class.get(where, [""])
            keys.update(f"{p}.{name}" if p else name for p in prefixes)
        return sorted(k for k in keys if k.split(".")[0] not in NOT_COMPUTED)


@contextlib.contextmanager
def record_config_reads(cfg: LabConfig | None = None) -> Iterator[ConfigReads]:
    """Record every field read of a posttrainllm.config dataclass inside the block (all instances).

    Patches `__getattribute__` of those classes for the duration and restores it, also on an
    exception. It adds a Python call to each config attribute access (well under a microsecond),
    so numbers timed inside the block carry that too.
    """
    reads = ConfigReads(cfg)
    classes = _config_classes()
    raw, instances, leaf = reads._raw, reads._instances, frozenset(classes)
    saved: list[tuple[type, Any]] = []
    try:
        for cls in classes:
            names = frozenset(f.name for f in dataclasses.fields(cls))
            saved.append((cls, cls.__dict__.get("__getattribute__")))
            cls.__getattribute__ = _recording(cls, names, leaf, raw, instances)
        yield reads
    finally:
        for cls, original in saved:
            if original is None:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = original


def _recording(cls: type, names: frozenset[str], groups: frozenset[type], raw: set, instances: dict[int, str]):
    get = object.__getattribute__

    def __getattribute__(self: Any, name: str) -> Any:
        value = get(self, name)
        # a group itself (cfg.tile), or a dict of groups (cfg.shape.ops, each op's sizes), is not a value read
        if name in names and type(value) not in groups and not _holds_groups(value, groups):
            raw.add((instances.get(id(self), cls), name))
        return value

    return __getattribute__


def _holds_groups(value: Any, groups: frozenset[type]) -> bool:
    """A non-empty dict whose every value is a config group: what is read is each group's fields, by their path."""
    return type(value) is dict and bool(value) and all(type(item) in groups for item in value.values())


def records_reads(stage: str) -> bool:
    """Untimed stages always record their config reads; timed ones only under RECORD_ENV=1."""
    return stage not in TIMED_STAGES or os.environ.get(RECORD_ENV) == "1"


@contextlib.contextmanager
def recording(stage: str, cfg: LabConfig) -> Iterator[ConfigReads | None]:
    """`record_config_reads(cfg)` where the stage records its reads (records_reads), else nothing (None)."""
    if not records_reads(stage):
        yield None
        return
    with record_config_reads(cfg) as reads:
        yield reads


# --- the stamp ---------------------------------------------------------------------------


def stamp_path(point_dir: Path, stage: str) -> Path:
    return point_dir / STAMPS / f"{stage}.json"


def process_seconds() -> float | None:
    """Wall seconds since this process started (Python and library imports included), from /proc."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def stage_stamp(stage: str, point: str, device: dict[str, Any], config_keys: list[str] | None,
                root: Path = PROJECT_ROOT, timing: dict[str, float | None] | None = None,
                inputs: Path | None = None, outputs: tuple[Path, ...] = (),
                outside: dict[str, str] | None = None) -> dict[str, Any]:
    """The stamp of a stage that just ran in this process; `timing`: its wall seconds (stage_s, process_s);
    `inputs`: the inputs file it ran on, where it has one; `outputs`: the files it wrote (those present);
    `outside`: the files from outside the package it ran (stage_sources)."""
    from posttrainllm.track.provenance import git_revision

    made = {"stage": stage, "point": point,
            "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            **git_revision(), "device": device, "sources": stage_sources(stage, root, outside)}
    if inputs is not None and inputs.is_file():
        made[INPUTS_KEY] = file_sha256(inputs)
    if outputs:
        made[OUTPUTS_KEY] = {path.name: file_sha256(path) for path in outputs if path.is_file()}
    return {**made, "config_keys": config_keys, "timing": timing}


def write_stage_stamp(stage: str, cfg: LabConfig, reads: ConfigReads | None,
                      timing: dict[str, float | None] | None = None, *, folder: Path | None = None,
                      point: str | None = None, inputs: Path | None = None,
                      outputs: tuple[Path, ...] = (), outside: dict[str, str] | None = None) -> Path:
    """After a stage ran in this process: its stamp, in <folder>/stamps/<stage>.json.

    folder and point default to the sweep point's (runs/<point>/, cfg.run.name); the heads stages
    pass theirs (lab/heads.py). config_keys is None where the reads were not recorded (a timed
    stage, see RECORD_ENV).
    """
    from posttrainllm.files import point_dir
    from posttrainllm.measure import device as devices

    device = devices.fingerprint(devices.resolve(cfg.device.name))
    keys = reads.keys() if reads is not None else None
    return write_stamp(folder if folder is not None else point_dir(cfg),
                       stage_stamp(stage, point or cfg.run.name, device, keys, timing=timing, inputs=inputs,
                                   outputs=outputs, outside=outside))


def write_stamp(point_dir: Path, stamp: dict[str, Any]) -> Path:
    path = stamp_path(point_dir, stamp["stage"])
    path.parent.mkdir(parents=True, exist_ok=True)  # DVC removes a stage's outs before it runs, folders too
    path.write_text(json.dumps(stamp, indent=2) + "\n")
    return path


def read_stamps(point_dir: Path, exclude: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Every stamp in runs/<point>/stamps/, by stage name."""
    folder = point_dir / STAMPS
    stamps = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if path.stem not in exclude:
            stamps[path.stem] = json.loads(path.read_text())
    return stamps


def check_consistent(stamps: dict[str, dict[str, Any]], where: Path | str) -> None:
    """Refuse stamps that disagree about the code they shared or, for timed stages, the device.

    A revision or dirty flag that differs while every shared file hashes the same is fine:
    DVC kept a stage whose inputs did not change. Raises StampMismatch with one line.
    """
    names = list(stamps)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            sa, sb = stamps[a].get("sources") or {}, stamps[b].get("sources") or {}
            for path in sorted(set(sa) & set(sb)):
                if sa[path] != sb[path]:
                    raise StampMismatch(
                        f"stages {a} and {b} ran different versions of {path} "
                        f"({_made(stamps[a])} vs {_made(stamps[b])}; stamps in {where}): "
                        "their outputs do not belong in one receipt; rerun with `dvc repro`")
    timed = [name for name in names if name in TIMED_STAGES]
    for i, a in enumerate(timed):
        for b in timed[i + 1:]:
            if stamps[a].get("device") != stamps[b].get("device"):
                diff = sorted(k for k in set(stamps[a].get("device") or {}) | set(stamps[b].get("device") or {})
                              if (stamps[a].get("device") or {}).get(k) != (stamps[b].get("device") or {}).get(k))
                raise StampMismatch(
                    f"stages {a} and {b} were timed on different devices (differ in {', '.join(diff)}; "
                    f"stamps in {where}): their timings do not belong in one receipt; rerun with `dvc repro`")


def check_outputs(stamps: dict[str, dict[str, Any]], folder: Path) -> list[str]:
    """Each file a stage's stamp hashed when the stage ended that differs now, or is gone: one line each (a stage
    that ran later, or anything else, rewrote it: what the receipt would combine is not what was computed)."""
    changed = []
    for stage, made in stamps.items():
        for name, digest in (made.get(OUTPUTS_KEY) or {}).items():
            path = folder / name
            now = file_sha256(path) if path.is_file() else None
            if now != digest:
                changed.append(f"{name} {'changed' if now else 'is gone'} since the {stage} stage wrote it "
                               f"(sha256 {digest[:12]} then" + (f", {now[:12]} now)" if now else ")"))
    return changed


def check_inputs(stamp: dict[str, Any], inputs: dict[str, Any], where: Path | str) -> None:
    """Refuse a point stage that loaded a file or read a config key its inputs file does not list.

    runs/inputs/<point>/<stage>.json (lab/sweep.py `stage_inputs`) is what DVC reruns the stage on: a file
    or key missing there would leave the stage's output stale when it changes. Raises StampMismatch, one line.
    """
    params = list(inputs.get("params") or {})
    files = sorted(set(stamp.get("sources") or {}) - set(inputs.get("sources") or {}))
    keys = [key for key in stamp.get("config_keys") or []
            if not any(f"config.{key}" == p or f"config.{key}".startswith(p + ".") for p in params)]
    if files or keys:
        missed = ", ".join([*files, *(f"config key {key}" for key in keys)])
        theirs = [f for f in files if not f.startswith(("posttrainllm/", "pipelines/"))]  # a user path's, its kernels'
        fix = ("plan the sweep again (posttrainllm sweep: it lists the files user paths and their Triton kernels run)"
               if theirs and len(theirs) == len(files) and not keys else
               "declare it in posttrainllm/lab/reads.py STAGES")
        raise StampMismatch(
            f"stage {stamp.get('stage')} ran with {missed}, which {where} does not list: DVC would not rerun it "
            f"when that changes; {fix}, then `dvc repro`")


def _made(stamp: dict[str, Any]) -> str:
    revision = str(stamp.get("revision") or "unknown")[:12]
    return f"{revision}{'+dirty' if stamp.get('dirty') else ''} at {stamp.get('created_at', '?')}"
