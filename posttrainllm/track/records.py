"""The typed records the point stages write: one dataclass per stage output, with a schema version.

Each record is written by `write(path)` and read by `read(path)`, and nowhere else: a stage builds its
record and writes it; every reader (the later stages, the receipt, replay) loads it through `read`, which
checks the file's `schema_version` against the class's SCHEMA_VERSION and fails with one line (RecordError,
a ConfigError: exit 2 in a DVC stage) on a missing file, another version, or keys the record does not have.

The JSON is the stage's result as before, plus a `schema_version` key: the receipt and the views read the
same keys. A rule is stored by its id (posttrainllm/rules.py `cite`), never as its text. Where a part's shape
is settled it is a typed part (a Part dataclass: each path's entry, KernelPath, ParityPath, MicrobenchPath, its
timings a TimingSummary; each trained variant's, TrainImpl, and its Amdahl check), read and written by the
field's type (a part, a dict or list of parts, a part or None) and checked as the record is: a key it does not
name, or one it needs that is missing, is one line naming the record and the entry (`paths['sdpa']`). Where a
part still grows (the compile report, the curve, the trainer's figures) it is a plain dict, until it settles.
Optional fields (None) are left out of the file, as the stages always left them out; a group of keys that come
together (a timing's summary with its median, None included) is written with its partner (`written_with`). The
files hold the same keys and values as when the entries were dicts; an entry's keys come in its fields' order,
the order a passing or timed path's entry always had (tests/test_records.py reads and writes the stages' files
byte for byte). reference.pt (tensors, torch.save) carries the version the same way.

This module sits in track/, below the lab: the stages (lab/stages/) read through it, by attribute; the receipt
(track/receipt.py) and replay read the same records as dicts (`to_dict`). Bump a record's SCHEMA_VERSION when a
field, its own or a part's, changes meaning or goes away.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from posttrainllm.config import ConfigError
from posttrainllm.rules import Cited
from posttrainllm.files import read_json, write_json

VERSION_KEY = "schema_version"
OPTIONAL = {"optional": True}  # a field's metadata: left out of the file when None

P = TypeVar("P", bound="Part")
R = TypeVar("R", bound="Record")


class RecordError(ConfigError):
    """A stage record that cannot be read: missing, of another schema version, or of another shape (one line)."""


def written_with(partner: str) -> dict[str, Any]:
    """A field's metadata: written, None included, exactly when the field `partner` is (a group of keys that come
    together: a timing's summary with its median); its absence then is a missing key."""
    return {"with": partner}


@dataclass(kw_only=True)
class Part:
    """A record's nested part (a path's entry, say): written into its record's file as a plain object, read back
    with its keys checked as the record's own are, and named by where it sits (`paths['sdpa']`)."""

    REST: ClassVar[str | None] = None  # the dict field that takes keys the part does not name (None: refused)

    def to_dict(self) -> dict[str, Any]:
        """The part as the file holds it: its fields, nested parts as plain objects, optional Nones left out."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == self.REST:
                out.update(_plain(value))
            elif _written(self, f):
                out[f.name] = _plain(value)
        return out

    @classmethod
    def from_dict(cls: type[P], data: dict[str, Any], where: str = "", at: str = "", stage: str = "") -> P:
        """The part from its dict; `where` names the record (its file), `at` the part's place in it."""
        return cls(**_fields_of(cls, data, where or f"the {cls.__name__}", at, stage))


def _written(part: Part, f: dataclasses.Field) -> bool:
    if "with" in f.metadata:
        return getattr(part, f.metadata["with"]) is not None
    return not (f.metadata.get("optional") and getattr(part, f.name) is None)


def _plain(value: Any) -> Any:
    """`value` as JSON holds it: parts as their dicts, inside dicts and lists too."""
    if isinstance(value, Part):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _holds_part(hint: Any) -> bool:
    return (isinstance(hint, type) and issubclass(hint, Part)) or any(_holds_part(a) for a in typing.get_args(hint))


def _load(value: Any, hint: Any, where: str, at: str, stage: str) -> Any:
    """`value` read as `hint` says: a part, a dict or list of parts, a part or None; anything else as it is."""
    if not _holds_part(hint):
        return value
    if isinstance(hint, type):  # a Part
        return hint.from_dict(value, where, at, stage)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]  # X | None: the one kind of part it may be
        return _load(value, inner, where, at, stage)
    kind = dict if origin is dict else list
    if not isinstance(value, kind):
        raise RecordError(f"{where}: {at} is {type(value).__name__}, not a {kind.__name__}")
    if origin is dict:
        return {k: _load(v, args[1], where, f"{at}[{k!r}]", stage) for k, v in value.items()}
    return [_load(v, args[0], where, f"{at}[{i}]", stage) for i, v in enumerate(value)]


def _fields_of(cls: type[Part], data: Any, where: str, at: str, stage: str) -> dict[str, Any]:
    """`data`'s values for `cls`'s fields, each read as its type says; one line (RecordError) on a key `cls` does not
    name (unless it has a REST field), a key it needs that is missing, or an object that is not one."""
    place = f"{where}: {at}" if at else where
    if not isinstance(data, dict):
        raise RecordError(f"{place}: {cls.__name__} is {type(data).__name__}, not an object")
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields if f.name != cls.REST]
    hints = _hints(cls)
    values = {k: _load(v, hints[k], where, f"{at}.{k}" if at else k, stage) for k, v in data.items() if k in names}
    unknown = [k for k in data if k not in names and (at or k != VERSION_KEY)]
    if unknown and cls.REST is None:
        raise RecordError(f"{place}: {cls.__name__} has no {', '.join(map(repr, unknown))} (its keys: "
                          f"{', '.join(names)})")
    if cls.REST is not None:
        values[cls.REST] = {k: data[k] for k in unknown}
    missing = [f.name for f in fields if f.name not in values and (
        (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        or ("with" in f.metadata and values.get(f.metadata["with"]) is not None))]
    if missing:
        rerun = f": rerun the {stage} stage" if stage else ""
        raise RecordError(f"{place}: {cls.__name__} lacks {', '.join(missing)}{rerun}")
    return values


@dataclass(kw_only=True)
class Record(Part):
    """What every stage record shares: its JSON form, its one writer and its one reader."""

    SCHEMA_VERSION: ClassVar[int] = 1
    FILE: ClassVar[str] = ""  # its name in the point's folder
    STAGE: ClassVar[str] = ""  # the DVC stage that writes it

    def to_dict(self) -> dict[str, Any]:
        """The record as its file holds it: `schema_version` first, then the fields (optional Nones left out)."""
        return {VERSION_KEY: self.SCHEMA_VERSION, **super().to_dict()}

    @classmethod
    def from_dict(cls: type[R], data: dict[str, Any], where: str = "", at: str = "", stage: str = "") -> R:
        """The record from its dict (`schema_version` optional here: a stage's own result has none yet)."""
        where = where or f"the {cls.STAGE} record"
        version = data.get(VERSION_KEY, cls.SCHEMA_VERSION)
        if version != cls.SCHEMA_VERSION:
            raise RecordError(f"{where}: schema_version {version}, but this code reads {cls.__name__} version "
                              f"{cls.SCHEMA_VERSION}: rerun the {cls.STAGE} stage (dvc repro {cls.STAGE}@<point>)")
        return cls(**_fields_of(cls, data, where, "", cls.STAGE))

    def write(self, path: Path) -> None:
        """The one writer: the file whole or not at all (files.write_json)."""
        write_json(path, self.to_dict())

    @classmethod
    def read(cls: type[R], path: Path) -> R:
        """The one reader: the file checked (its version and keys) into the record."""
        if not path.is_file():
            raise RecordError(f"{path}: no {cls.FILE} here: run the {cls.STAGE} stage first")
        data = read_json(path)
        if not isinstance(data, dict) or VERSION_KEY not in data:
            raise RecordError(f"{path}: no {VERSION_KEY} (written before records were versioned): rerun the "
                              f"{cls.STAGE} stage")
        return cls.from_dict(data, str(path))

    @classmethod
    def read_optional(cls: type[R], path: Path) -> R | None:
        """`read`, or None where the stage has not run (a point without bench-train, say)."""
        return cls.read(path) if path.exists() else None


@dataclass(kw_only=True)
class KernelPath(Part):
    """One path's entry in kernel.json: how it ran on the reference's inputs (lab/stages/kernel.py run_kernel)."""

    kind: str
    backend: str
    problem: str
    geometry: dict[str, Any]  # the op's launch geometry, or {"error": ...} where it could not be had
    emulation: str | None  # what stands in for the device's arithmetic (a Triton path interpreted), None: nothing
    violations: list[str]  # the guards' and output checks', per case
    user: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # a user path's identity
    backward: str | None = field(default=None, metadata=OPTIONAL)  # "own", "none" or the path it borrows
    invariance: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # lab/invariance.py measure
    error: str | None = field(default=None, metadata=OPTIONAL)  # it did not run: why, in one line
    failure: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # track/failures.py, located
    launched: dict[str, int]  # Triton launches by kernel name, all cases
    evidence: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # a compiled peer's graphs
    worker_start_s: float | None = field(default=None, metadata=written_with("user"))  # a user path's worker
    promises: list[str] | None = field(default=None, metadata=written_with("user"))  # as its worker read them


@dataclass(kw_only=True)
class ParityPath(Part):
    """One path's entry in parity.json: its verdict under the contract and what decided it (lab/stages/parity.py)."""

    verdict: str  # pass, fail, or track/failures.py CANNOT_RUN_HERE
    failed_cases: list[str]
    cases: list[dict[str, Any]]  # per case and output: lab/parity.py check_output
    worst: dict[str, dict[str, Any]]  # per output: its case nearest (or furthest past) its bound
    unchecked_outputs: list[str] | None = field(default=None, metadata=OPTIONAL)
    cannot_run_here: dict[str, str] | None = field(default=None, metadata=OPTIONAL)  # reason, runs_on
    error: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # kernel.json's failure
    violations: list[str]
    emulation: str | None
    backward: str
    launched: dict[str, int]
    determinism: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # measured where it ran
    batch_invariance: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    properties: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # judged (lab/invariance.py judge)
    user: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # a user path's identity
    gradients: str | None = field(default=None, metadata=OPTIONAL)  # why its gradients are not its own to check


TIMED = written_with("median_ms")  # a timed path's figures: written, None included, with its median


@dataclass(kw_only=True)
class TimingSummary(Part):
    """A timing's summary (measure/timing.py Timing.summary): its median and the figures written with it, or none of
    them (not timed). A path's forward timing (MicrobenchPath) and its forward + backward (ForwardBackward) share it."""

    median_ms: float | None = field(default=None, metadata=OPTIONAL)
    p20_ms: float | None = field(default=None, metadata=TIMED)
    p80_ms: float | None = field(default=None, metadata=TIMED)
    min_ms: float | None = field(default=None, metadata=TIMED)
    cv: float | None = field(default=None, metadata=TIMED)
    iqr_ms: float | None = field(default=None, metadata=TIMED)
    noisy: bool | None = field(default=None, metadata=TIMED)
    threads: int | None = field(default=None, metadata=TIMED)
    flushed: bool | None = field(default=None, metadata=TIMED)
    other_streams: str | None = field(default=None, metadata=TIMED)
    batched: bool | None = field(default=None, metadata=TIMED)
    batch_size: int | None = field(default=None, metadata=TIMED)
    run_queue_share: float | None = field(default=None, metadata=TIMED)
    reps: int | None = field(default=None, metadata=TIMED)
    timing_rule: Cited | None = field(default=None, metadata=OPTIONAL)  # rule batch_mean, where batched


@dataclass(kw_only=True)
class ForwardBackward(TimingSummary):
    """A timed path's forward + backward in microbench.json: its timing, rate, roofline and speedup, or not valid
    and why (a forward-only path); no `valid` key where it was timed (lab/stages/microbench.py run_microbench)."""

    valid: bool | None = field(default=None, metadata=OPTIONAL)  # False: not timed (then only the reason)
    reason: str | None = field(default=None, metadata=OPTIONAL)
    gflops_per_s: float | None = field(default=None, metadata=TIMED)  # the op's training FLOPs over the median
    roofline: dict[str, Any] | None = field(default=None, metadata=TIMED)  # None: no calibrated peak or bytes
    speedup_vs_reference: float | None = field(default=None, metadata=OPTIONAL)
    vs_reference: str | None = field(default=None, metadata=OPTIONAL)  # rule band


@dataclass(kw_only=True)
class PathVerdict(Part):
    """What a microbench path's entry begins with: its first call's time, whether it has a speed, and why not."""

    first_call_ms: float | None = field(default=None, metadata=OPTIONAL)
    valid: bool
    reason: str | None = field(default=None, metadata=OPTIONAL)  # why no speed


@dataclass(kw_only=True)
class MicrobenchPath(TimingSummary, PathVerdict):
    """One path's entry in microbench.json: valid and its timing (a TimingSummary), memory, costs and roofline, or
    not valid and the reason (lab/stages/microbench.py run_microbench). Its keys: PathVerdict's, then the timing's,
    then its own (a dataclass's fields come from its last base first)."""

    gflops_per_s: float | None = field(default=None, metadata=TIMED)
    gbytes_per_s: float | None = field(default=None, metadata=TIMED)
    memory: dict[str, Any] | None = field(default=None, metadata=TIMED)
    costs: dict[str, Any] | None = field(default=None, metadata=TIMED)  # its own cost model (CostModel.record)
    roofline: dict[str, Any] | None = field(default=None, metadata=TIMED)  # None: no calibrated peak
    backward: str | None = field(default=None, metadata=TIMED)
    worker_start_s: float | None = field(default=None, metadata=written_with("outside"))
    outside: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # a user path's timing from outside
    forward_backward: ForwardBackward | None = field(default=None, metadata=TIMED)
    speedup_vs_reference: float | None = field(default=None, metadata=OPTIONAL)
    vs_reference: str | None = field(default=None, metadata=OPTIONAL)  # rule band
    evidence: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # a compiled peer's graphs


@dataclass(kw_only=True)
class KernelRecord(Record):
    """kernel.json: every optimized path run on the reference's inputs, guarded (lab/stages/kernel.py)."""

    SCHEMA_VERSION: ClassVar[int] = 2  # 2: compile's rules by id (posttrainllm/rules.py)
    FILE: ClassVar[str] = "kernel.json"
    STAGE: ClassVar[str] = "kernel"

    device: str
    triton_interpreted: bool
    paths: dict[str, KernelPath]
    compile: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # lab/compile.py's report
    library_replaced: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)


@dataclass(kw_only=True)
class ParityRecord(Record):
    """parity.json: each path against the oracle under the point's contract (lab/stages/parity.py)."""

    SCHEMA_VERSION: ClassVar[int] = 2  # 2: rules by id (posttrainllm/rules.py)
    FILE: ClassVar[str] = "parity.json"
    STAGE: ClassVar[str] = "parity"

    precision: str
    contract: dict[str, Any]
    lse_contract: dict[str, Any] | None
    rule: Cited
    backward_rule: Cited
    cases: list[str]
    paths: dict[str, ParityPath]
    notes: list[str]
    gradient_baseline_rule: Cited | None = field(default=None, metadata=OPTIONAL)
    max_error_only: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    invariance: dict[str, Any]
    quantization: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    inputs: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # the inputs' own checks (MoE routing)
    cannot_run_here: dict[str, dict[str, str]] | None = field(default=None, metadata=OPTIONAL)
    verdict: str
    first_failure: str | None
    headline: str


@dataclass(kw_only=True)
class MicrobenchRecord(Record):
    """microbench.json: the timed paths at the point's shape, and the curve (lab/stages/microbench.py)."""

    # 2: rules by id (posttrainllm/rules.py); cost_models is cost_model_rule. 3: a user path's timing from outside
    # cites its rules by id (outside.<mode>.rule, timing_seeds.rule; memory.method is memory.method_rule). 4: every
    # timing a median of batch means (rule batch_mean: timing_rule, batched, batch_size; timings.csv holds batch means)
    SCHEMA_VERSION: ClassVar[int] = 4
    FILE: ClassVar[str] = "microbench.json"
    STAGE: ClassVar[str] = "microbench"

    device: str
    threads: int
    case: str
    problem: str
    flops: float
    bytes: float
    train_flops: float
    flops_formula: str
    bytes_formula: str
    backward_formula: str
    noisy_rule: Cited
    band_rule: Cited
    roofline_rule: Cited
    peaks: dict[str, Any]
    paths: dict[str, MicrobenchPath]
    timed_result_rule: Cited
    impossible_rule: Cited
    rotation_rule: Cited
    state_rule: Cited
    calibration: dict[str, Any]
    above_roof_rule: Cited
    last_level_cache_bytes: int | None
    cost_model_rule: Cited
    notes: list[str] | None = field(default=None, metadata=OPTIONAL)
    describe: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # the op's own (MoE: the routing)
    curve: dict[str, Any]
    cpus: list[int] | None = field(default=None, metadata=OPTIONAL)  # rule same_cpus: where every path was timed
    cpus_rule: Cited | None = field(default=None, metadata=OPTIONAL)


@dataclass(kw_only=True)
class TrainImpl(Part):
    """One variant's entry in bench_train.json's impls: how the model trained with it swapped in (model/train.py
    _Trainer.finish; its units in model/train.py's docstring)."""

    losses: list[float]  # the training loss at every step it trained
    step_ms: list[float]  # wall time of every step
    warm_ms_per_step: float  # the median of step_ms after the warmup steps
    step_ms_p20: float
    step_ms_p80: float
    noisy: bool
    tokens_per_s: float
    peak_mem_bytes: int | None  # None: not measured here (Triton through its interpreter, on CPU)
    final_loss_finite: bool
    timing_valid: bool  # False: Triton through its interpreter, the losses real, the step times not speed
    profile: dict[str, Any] | None  # one profiled step: step_us, clock and each slot's share; None where not speed
    moe_routing: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # an MoE model's routing
    heldout_loss: dict[str, float] | None = field(default=None, metadata=OPTIONAL)  # steps -> held-out loss


CHECKED = written_with("microbench_speedup")  # a variant's Amdahl figures: written with its microbench speedup


@dataclass(kw_only=True)
class AmdahlVariant(Part):
    """One variant's entry in bench_train.json's amdahl: predicted against measured, or not valid and why
    (model/amdahl.py check)."""

    valid: bool
    reason: str | None = field(default=None, metadata=OPTIONAL)  # why no valid speed
    microbench_speedup: float | None = field(default=None, metadata=OPTIONAL)  # s, over the baseline's
    predicted_speedup: float | None = field(default=None, metadata=CHECKED)  # Amdahl: 1/((1-f) + f/s)
    measured_speedup: float | None = field(default=None, metadata=CHECKED)  # the baseline's warm ms/step over its own
    measured_change: str | None = field(default=None, metadata=CHECKED)  # against the band; None: no band
    reading: str | None = field(default=None, metadata=CHECKED)  # why measured and predicted differ ("" when agreed)
    forward_speedup: float | None = field(default=None, metadata=CHECKED)
    in_model_op_speedup: float | None = field(default=None, metadata=CHECKED)  # the op's own time inside the model
    sentence: str | None = field(default=None, metadata=CHECKED)


@dataclass(kw_only=True)
class Amdahl(Part):
    """bench_train.json's amdahl: the op's share f of the baseline's step and, per variant, the end-to-end speedup
    Amdahl's law predicts from its microbench speedup against the one measured (model/amdahl.py check)."""

    op: str  # the model slot the op fills, whose profiled share f is
    fraction: float | None  # f; None: the slot was not profiled
    baseline: str
    speedup_used: str  # which microbench speedup s is, in words
    band: float | None  # the baseline's run-to-run band (noise.band); None: not speed
    variants: dict[str, AmdahlVariant]  # every trained variant but the baseline


@dataclass(kw_only=True)
class BenchTrainRecord(Record):
    """bench_train.json: the model trained with each path swapped in (lab/stages/bench_train.py). The trainer's
    own figures (model/train.py bench_train: losses, timings, config, ...) are still growing: `trainer` holds
    them, written at the top level beside the fields."""

    SCHEMA_VERSION: ClassVar[int] = 2  # 2: the noise band's rule by id (noise.rule, posttrainllm/rules.py)
    FILE: ClassVar[str] = "bench_train.json"
    STAGE: ClassVar[str] = "bench_train"
    REST: ClassVar[str | None] = "trainer"

    impls: dict[str, TrainImpl]  # per variant, the baseline first
    skipped: dict[str, str]
    drift: dict[str, float]
    drift_verdict: dict[str, str]
    drift_limit: float | None = field(default=None, metadata=OPTIONAL)
    not_trained: str | None = field(default=None, metadata=OPTIONAL)  # the op has no model hook: why
    amdahl: Amdahl | None = field(default=None, metadata=OPTIONAL)
    quality: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)  # a quantized precision's gate
    user_paths: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    model_problem: str | None = field(default=None, metadata=OPTIONAL)  # what the op's hook put into the model
    trainer: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class ReferenceRecord:
    """reference.pt: per case its inputs, upstream gradient, oracle and baseline tensors (lab/stages/reference.py);
    torch.save'd, with the same version check as the JSON records."""

    SCHEMA_VERSION: ClassVar[int] = 1
    FILE: ClassVar[str] = "reference.pt"
    STAGE: ClassVar[str] = "reference"

    op: str
    dtype: str
    records: list[dict[str, Any]]  # per case: case, inputs, grad_out, oracle, baseline, input_checks[, unquantized]

    def write(self, path: Path) -> None:
        import torch

        torch.save({VERSION_KEY: self.SCHEMA_VERSION, "op": self.op, "dtype": self.dtype, "records": self.records},
                   path)

    @classmethod
    def read(cls, path: Path) -> ReferenceRecord:
        import torch

        if not path.is_file():
            raise RecordError(f"{path}: no {cls.FILE} here: run the {cls.STAGE} stage first")
        data = torch.load(path, weights_only=True)
        version = data.get(VERSION_KEY)
        if version != cls.SCHEMA_VERSION:
            raise RecordError(f"{path}: schema_version {version}, but this code reads {cls.__name__} version "
                              f"{cls.SCHEMA_VERSION}: rerun the {cls.STAGE} stage")
        return cls(op=data["op"], dtype=data["dtype"], records=data["records"])
