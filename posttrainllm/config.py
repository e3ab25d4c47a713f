"""Config: the structured schema every composed Hydra config is checked against.

`conf/` is the source of truth for values; this file says what a valid value is.
Hydra composes the YAML; `validate` merges it into the dataclasses below (an
unknown or typo'd key is refused there) and `__post_init__` checks the bounds.
Every failure becomes a `ConfigError` with one line that names the valid choices
or the violated bound.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = PROJECT_ROOT / "conf"

# The sweep dimensions, in the order a point's name and the planner use them.
DIMENSIONS = ("op", "precision", "tile", "workgroup", "architecture", "shape", "device")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A config the lab refuses; the message is one line, fit to print as is."""


def group_options(group: str) -> list[str]:
    """The options of one config group: the YAML files in conf/<group>/."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def next_power_of_two(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _positive(where: str, **values: int | float) -> None:
    for key, value in values.items():
        _require(value > 0, f"{where}.{key}={value}: must be > 0")


@dataclass
class OpConfig:
    name: str = "attention"
    causal: bool = True

    def __post_init__(self) -> None:
        valid = group_options("op")
        _require(self.name in valid, f"op.name={self.name!r}: valid choices are {', '.join(valid)}")


@dataclass
class Contract:
    """The numerical contract of one precision (see conf/precision/*.yaml for the why)."""

    error_multiple: float = 8.0
    floor_rel: float = 1e-6
    atol: float = 1e-5
    rtol: float = 1e-5
    max_mismatch: float = 0.0
    train_loss_drift: float = 1e-4
    # Per-row rule (posttrainllm/lab/parity.py): floors of each row's allowance, in units of the
    # whole tensor's max|oracle|, for forward outputs and for gradients ("grad_*").
    row_floor_rel: float = 1e-6
    grad_row_floor_rel: float = 1e-5

    def __post_init__(self) -> None:
        _positive("precision.contract", error_multiple=self.error_multiple, floor_rel=self.floor_rel,
                  train_loss_drift=self.train_loss_drift, row_floor_rel=self.row_floor_rel,
                  grad_row_floor_rel=self.grad_row_floor_rel)
        _require(self.atol >= 0 and self.rtol >= 0,
                 f"precision.contract: atol={self.atol} and rtol={self.rtol} must be >= 0")
        _require(0.0 <= self.max_mismatch < 1.0,
                 f"precision.contract.max_mismatch={self.max_mismatch}: must be in [0, 1)")


@dataclass
class PrecisionConfig:
    name: str = "fp32"
    dtype: str = "float32"
    dot_precision: str = "ieee"
    allow_tf32: bool = False
    contract: Contract = field(default_factory=Contract)
    # The flash kernel's row logsumexp is fp32 in every precision: it gets an fp32-level contract
    # of its own, judged against the reference logsumexp computed in fp32 (see conf/precision/*.yaml).
    lse_contract: Contract = field(default_factory=lambda: Contract(floor_rel=1e-5, row_floor_rel=1e-5,
                                                                    grad_row_floor_rel=1e-5))

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"precision.dtype={self.dtype!r}: valid choices are {', '.join(DTYPES)}")
        _require(self.dot_precision in ("ieee", "tf32"),
                 f"precision.dot_precision={self.dot_precision!r}: valid choices are ieee, tf32")


@dataclass
class TileConfig:
    name: str = "b32"
    block_m: int = 32
    block_n: int = 32
    block_k: int = 32
    block_q: int = 32
    block_kv: int = 32

    def __post_init__(self) -> None:
        for key in ("block_m", "block_n", "block_k", "block_q", "block_kv"):
            value = getattr(self, key)
            _require(_power_of_two(value) and value >= 16,
                     f"tile.{key}={value}: must be a power of two >= 16 (tl.dot needs 16 on the GPU)")


@dataclass
class WorkgroupConfig:
    name: str = "w4s2"
    num_warps: int = 4
    num_stages: int = 2
    group_m: int = 8

    def __post_init__(self) -> None:
        _require(self.num_warps in (1, 2, 4, 8, 16),
                 f"workgroup.num_warps={self.num_warps}: valid choices are 1, 2, 4, 8, 16")
        _require(1 <= self.num_stages <= 8, f"workgroup.num_stages={self.num_stages}: must be in [1, 8]")
        _require(self.group_m >= 1, f"workgroup.group_m={self.group_m}: must be >= 1")


@dataclass
class ArchitectureConfig:
    name: str = "mha"
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 4
    head_dim: int = 32
    mlp: str = "dense"
    mlp_hidden: int = 384

    def __post_init__(self) -> None:
        _positive("architecture", d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                  n_kv_heads=self.n_kv_heads, head_dim=self.head_dim, mlp_hidden=self.mlp_hidden)
        _require(self.n_heads % self.n_kv_heads == 0,
                 f"architecture.n_kv_heads={self.n_kv_heads}: must divide n_heads={self.n_heads}")
        _require(_power_of_two(self.head_dim) and 16 <= self.head_dim <= 128,
                 f"architecture.head_dim={self.head_dim}: must be a power of two in [16, 128]")
        _require(self.mlp == "dense", f"architecture.mlp={self.mlp!r}: valid choices are dense")


@dataclass
class ShapeConfig:
    name: str = "tiny"
    batch: int = 1
    seq_len: int = 128
    m: int = 128
    n: int = 128
    k: int = 128
    curve: list[int] = field(default_factory=lambda: [64, 128, 256, 512])
    edge_seq_lens: list[int] = field(default_factory=lambda: [1, 37, 100])
    edge_mnk: list[list[int]] = field(default_factory=lambda: [[1, 1, 1], [41, 77, 33]])

    def __post_init__(self) -> None:
        _positive("shape", batch=self.batch, seq_len=self.seq_len, m=self.m, n=self.n, k=self.k)
        _require(len(self.curve) >= 2 and min(self.curve) > 0,
                 f"shape.curve={list(self.curve)}: give at least two sizes > 0")
        for s in self.edge_seq_lens:
            _require(s > 0, f"shape.edge_seq_lens: {s} must be > 0")
        for mnk in self.edge_mnk:
            _require(len(mnk) == 3 and min(mnk) > 0, f"shape.edge_mnk: {list(mnk)} must be three sizes > 0")


@dataclass
class DeviceConfig:
    name: str = "auto"
    smem_bytes: int = 232448

    def __post_init__(self) -> None:
        _require(self.name in ("auto", "cpu", "cuda"), f"device.name={self.name!r}: valid choices are auto, cpu, cuda")
        _positive("device", smem_bytes=self.smem_bytes)


@dataclass
class RunConfig:
    name: str = "bench"
    out_dir: str = "runs/bench"
    log_mlflow: bool = True

    def __post_init__(self) -> None:
        _require(re.fullmatch(r"[A-Za-z0-9._=,-]+", self.name) is not None,
                 f"run.name={self.name!r}: use letters, digits and . _ = , - only")


@dataclass
class ParityConfig:
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    # The reference stage's estimated peak (float64 oracle + inputs) may use at most this fraction of
    # the memory available when it starts (MemAvailable on CPU, free memory on CUDA); 0 < x <= 1.
    memory_fraction: float = 0.5

    def __post_init__(self) -> None:
        _require(len(self.seeds) >= 1, "parity.seeds: give at least one seed")
        _require(0 < self.memory_fraction <= 1, f"parity.memory_fraction={self.memory_fraction}: must be in (0, 1]")


@dataclass
class BenchConfig:
    warmup: int = 3
    reps: int = 10
    min_time_s: float = 0.2
    max_reps: int = 200
    threads: int = 0

    def __post_init__(self) -> None:
        _require(self.warmup >= 0, f"bench.warmup={self.warmup}: must be >= 0")
        _require(self.reps >= 1, f"bench.reps={self.reps}: must be >= 1")
        _require(self.max_reps >= self.reps, f"bench.max_reps={self.max_reps}: must be >= bench.reps={self.reps}")
        _require(self.min_time_s >= 0, f"bench.min_time_s={self.min_time_s}: must be >= 0")
        _require(self.threads >= 0, f"bench.threads={self.threads}: must be >= 0 (0 keeps torch's default)")


@dataclass
class TrainConfig:
    impls: list[str] = field(default_factory=list)  # the op's implementations to train; [] = all (the op checks)
    steps: int = 12
    warmup_steps: int = 3
    batch_size: int = 4
    seq_len: int = 64
    lr: float = 3e-3
    seed: int = 0
    interpreted_steps: int = 3


    def __post_init__(self) -> None:
        _positive("train", steps=self.steps, batch_size=self.batch_size, seq_len=self.seq_len, lr=self.lr,
                  interpreted_steps=self.interpreted_steps)
        _require(0 <= self.warmup_steps < self.steps,
                 f"train.warmup_steps={self.warmup_steps}: must be in [0, train.steps={self.steps})")


@dataclass
class SweepConfig:
    name: str = "default"
    grid: bool = False
    baseline: dict[str, str] = field(default_factory=dict)
    vary: dict[str, list[str]] = field(default_factory=dict)
    points: dict[str, dict[str, str]] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)


@dataclass
class LabConfig:
    """One point of the lab: a choice from each dimension plus how to run it."""

    op: OpConfig = field(default_factory=OpConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    tile: TileConfig = field(default_factory=TileConfig)
    workgroup: WorkgroupConfig = field(default_factory=WorkgroupConfig)
    architecture: ArchitectureConfig = field(default_factory=ArchitectureConfig)
    shape: ShapeConfig = field(default_factory=ShapeConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    run: RunConfig = field(default_factory=RunConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sweep: SweepConfig | None = None



def itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def _one_line(exc: BaseException) -> str:
    """OmegaConf/Hydra messages span lines (full_key, object_type...): keep the first."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def validate(cfg: DictConfig | dict[str, Any]) -> LabConfig:
    """Merge a composed config into the schema; raise ConfigError with one line on any violation."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(LabConfig), cfg)
        lab = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        cause = exc.__cause__ if isinstance(exc.__cause__, ConfigError) else None
        if cause is not None:
            raise cause from None
        where = f" (at {key})" if key else ""
        raise ConfigError(f"{_one_line(exc)}{where}") from None
    _check_op_rules(lab)
    return lab


def _check_op_rules(cfg: LabConfig) -> None:
    """The op's own rules (a tile that does not fit its problem, train.impls it does not have).

    They live with the op (posttrainllm/opdefs/<op>.py), the one place that knows it; this is the
    single call from the config layer up into the op modules, made lazily so config stays importable alone.
    """
    from posttrainllm.opdefs import get_op

    op = get_op(cfg.op.name)
    op.check_config(cfg)
    impls = list(cfg.train.impls)
    for impl in impls:
        _require(impl in op.impls, f"train.impls: unknown {cfg.op.name} implementation {impl!r}: valid choices are "
                                   f"{', '.join(op.impls)}")
    _require(not impls or impls[0] == "reference",
             f"train.impls={impls}: the first must be 'reference' (drift is measured against it)")


def to_plain(cfg: LabConfig | DictConfig) -> dict[str, Any]:
    """The config as plain dicts and lists (for params.yaml, receipts and MLflow params)."""
    node = OmegaConf.structured(cfg) if isinstance(cfg, LabConfig) else cfg
    return OmegaConf.to_container(node, resolve=True)


def point_config(cfg: LabConfig) -> dict[str, Any]:
    """What defines a point: everything but the sweep plan and where to write."""
    plain = to_plain(cfg)
    plain.pop("sweep", None)
    plain.pop("run", None)
    return plain


def check_group_choices(overrides: list[str]) -> None:
    """Refuse `group=option` overrides whose option has no YAML file, naming the valid ones.

    Handles Hydra's sweep syntax too (`precision=bf16,fp16`): every value is checked.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        raise ConfigError(f"malformed override: {_one_line(exc)}") from None
    groups = set(DIMENSIONS) | {"sweep"}
    for override in parsed:
        name = override.key_or_group.split("@")[0]
        if name not in groups or override.is_delete():
            continue
        values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.get_value_element_as_str()]
        valid = group_options(name)
        for value in values:
            _require(value in valid, f"unknown {name} {value!r}: valid choices are {', '.join(valid)}")


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose conf/config.yaml with Hydra overrides (no sweep syntax); errors are one line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    overrides = list(overrides)
    check_group_choices(overrides)
    try:
        if GlobalHydra.instance().is_initialized():  # inside a @hydra.main app: same conf/ search path
            return hydra_compose(config_name="config", overrides=overrides)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return hydra_compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as exc:
        unknown = re.match(r"Could not override '([^']+)'", str(exc))
        if unknown:
            raise ConfigError(_unknown_key_message(unknown.group(1))) from None
        message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise ConfigError(f"bad override: {message}") from None


def _unknown_key_message(key: str) -> str:
    """`tile.blok_m` -> 'unknown key tile.blok_m: valid keys of tile are block_k, ...'."""
    node: Any = OmegaConf.structured(LabConfig)
    path: list[str] = []
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            break
        node, path = node.get(part), path + [part]
    if not isinstance(node, DictConfig):
        return f"unknown key {key}"
    where = f"of {'.'.join(path)} " if path else ""
    return f"unknown key {key}: valid keys {where}are {', '.join(sorted(node.keys()))}"


def load(overrides: list[str] | tuple[str, ...] = ()) -> LabConfig:
    """Compose and validate: the one way a point's config is built from conf/."""
    return validate(compose(overrides))
