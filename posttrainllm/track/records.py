"""The typed records the point stages write: one dataclass per stage output, with a schema version.

Each record is written by `write(path)` and read by `read(path)`, and nowhere else: a stage builds its
record and writes it; every reader (the later stages, the receipt, replay) loads it through `read`, which
checks the file's `schema_version` against the class's SCHEMA_VERSION and fails with one line (RecordError,
a ConfigError: exit 2 in a DVC stage) on a missing file, another version, or keys the record does not have.

The JSON is the stage's result as before, plus a `schema_version` key: the receipt and the views read the
same keys. A rule is stored by its id (posttrainllm/rules.py `cite`), never as its text. Where a part's shape
is settled it is a field; where it still grows (a path's entry, the trainer's figures) it is a plain dict,
until it settles. Optional parts (None) are left out of the file, as the stages
always left them out. reference.pt (tensors, torch.save) carries the version the same way.

This module sits in track/, below the lab: the stages (lab/stages/) and the receipt (track/receipt.py) both
read through it. Bump a record's SCHEMA_VERSION when a field changes meaning or goes away.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from posttrainllm.config import ConfigError
from posttrainllm.rules import Cited
from posttrainllm.files import read_json, write_json

VERSION_KEY = "schema_version"
OPTIONAL = {"optional": True}  # a field's metadata: left out of the file when None

R = TypeVar("R", bound="Record")


class RecordError(ConfigError):
    """A stage record that cannot be read: missing, of another schema version, or of another shape (one line)."""


@dataclass(kw_only=True)
class Record:
    """What every stage record shares: its JSON form, its one writer and its one reader."""

    SCHEMA_VERSION: ClassVar[int] = 1
    FILE: ClassVar[str] = ""  # its name in the point's folder
    STAGE: ClassVar[str] = ""  # the DVC stage that writes it
    REST: ClassVar[str | None] = None  # the dict field that takes keys the record does not name (None: refused)

    def to_dict(self) -> dict[str, Any]:
        """The record as its file holds it: `schema_version` first, then the fields (optional Nones left out)."""
        out: dict[str, Any] = {VERSION_KEY: self.SCHEMA_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == self.REST:
                out.update(value)
            elif not (f.metadata.get("optional") and value is None):
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls: type[R], data: dict[str, Any], where: str = "") -> R:
        """The record from its dict (`schema_version` optional here: a stage's own result has none yet)."""
        where = where or f"the {cls.STAGE} record"
        version = data.get(VERSION_KEY, cls.SCHEMA_VERSION)
        if version != cls.SCHEMA_VERSION:
            raise RecordError(f"{where}: schema_version {version}, but this code reads {cls.__name__} version "
                              f"{cls.SCHEMA_VERSION}: rerun the {cls.STAGE} stage (dvc repro {cls.STAGE}@<point>)")
        names = [f.name for f in dataclasses.fields(cls) if f.name != cls.REST]
        values = {k: v for k, v in data.items() if k in names}
        unknown = [k for k in data if k not in names and k != VERSION_KEY]
        if unknown and cls.REST is None:
            raise RecordError(f"{where}: {cls.__name__} has no {', '.join(map(repr, unknown))} (its keys: "
                              f"{', '.join(names)})")
        if cls.REST is not None:
            values[cls.REST] = {k: data[k] for k in unknown}
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in values and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise RecordError(f"{where}: {cls.__name__} lacks {', '.join(missing)}: rerun the {cls.STAGE} stage")
        return cls(**values)

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
class KernelRecord(Record):
    """kernel.json: every optimized path run on the reference's inputs, guarded (lab/stages/kernel.py)."""

    SCHEMA_VERSION: ClassVar[int] = 2  # 2: compile's rules by id (posttrainllm/rules.py)
    FILE: ClassVar[str] = "kernel.json"
    STAGE: ClassVar[str] = "kernel"

    device: str
    triton_interpreted: bool
    paths: dict[str, dict[str, Any]]  # per path: kind, backend, geometry, violations, launched, invariance, error
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
    paths: dict[str, dict[str, Any]]  # per path: verdict, failed_cases, worst, cases, violations, ...
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
    paths: dict[str, dict[str, Any]]  # per path: valid and its reason, or its timing, memory, costs, roofline
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


@dataclass(kw_only=True)
class BenchTrainRecord(Record):
    """bench_train.json: the model trained with each path swapped in (lab/stages/bench_train.py). The trainer's
    own figures (model/train.py bench_train: losses, timings, config, ...) are still growing: `trainer` holds
    them, written at the top level beside the fields."""

    SCHEMA_VERSION: ClassVar[int] = 2  # 2: the noise band's rule by id (noise.rule, posttrainllm/rules.py)
    FILE: ClassVar[str] = "bench_train.json"
    STAGE: ClassVar[str] = "bench_train"
    REST: ClassVar[str | None] = "trainer"

    impls: dict[str, dict[str, Any]]
    skipped: dict[str, str]
    drift: dict[str, float]
    drift_verdict: dict[str, str]
    drift_limit: float | None = field(default=None, metadata=OPTIONAL)
    not_trained: str | None = field(default=None, metadata=OPTIONAL)  # the op has no model hook: why
    amdahl: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
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
