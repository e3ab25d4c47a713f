"""Config: the structured schema every composed Hydra config is checked against.

`conf/` is the source of truth for values; this file says what a valid value is.
Hydra composes the YAML; `validate` merges it into the dataclasses below (an
unknown or typo'd key is refused there) and `__post_init__` checks the bounds.
The `op` node's schema is the chosen op's: OpConfig holds the keys every op has,
and an op's own keys are its subclass of it (posttrainllm/ops/<op>/config.py),
picked by op.name in lab/configure.py (this file imports no op).
Every failure becomes a `ConfigError` with one line that names the valid choices
or the violated bound.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, ClassVar, TypeVar

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = PROJECT_ROOT / "conf"

# The sweep dimensions, in the order a point's name and the planner use them.
DIMENSIONS = ("op", "precision", "tile", "workgroup", "architecture", "shape", "device", "heads")
DTYPES = ("float32", "bfloat16", "float16")
# The 8-bit float formats of a quantized precision (precision.quantize): e4m3 (3 mantissa bits, max 448) for the
# forward operands, e5m2 (2 mantissa bits, max 57344: range for gradients) where a recipe quantizes gradients
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
SCALINGS = ("tensor", "row")  # one scale per tensor; rowwise: A's per row, B's per column (the output's rows, cols)
# The bitwise properties a path may declare and a point may require (parity.require; lab/invariance.py)
PROPERTIES = ("deterministic", "batch_invariant")


class ConfigError(ValueError):
    """A config the lab refuses; the message is one line, fit to print as is."""


def group_options(group: str) -> list[str]:
    """The options of one config group: the YAML files in conf/<group>/."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def next_power_of_two(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _positive(where: str, **values: int | float) -> None:
    for key, value in values.items():
        require(value > 0, f"{where}.{key}={value}: must be > 0")


@dataclass
class MaxErrorOnlyConfig:
    """Outputs parity holds to the max-error rules alone (tensor-wide and per row), without the elementwise
    atol/rtol count, under the listed precisions only: where the plain reference math in that precision itself
    misses the count (measured; the op's YAML says so in `reason`, which parity.json and the receipt carry)."""

    outputs: list[str] = field(default_factory=list)  # checked against the op's outputs (_check_op_rules)
    precisions: list[str] = field(default_factory=list)
    reason: str = ""

    def __post_init__(self) -> None:
        valid = group_options("precision")
        for name in self.precisions:
            require(name in valid, f"op.max_error_only.precisions: unknown precision {name!r}: valid choices are "
                                    f"{', '.join(valid)}")
        if self.outputs or self.precisions:
            require(bool(self.outputs) and bool(self.precisions) and bool(self.reason.strip()),
                     "op.max_error_only: give outputs, precisions and the reason (measured) together")

    def outputs_for(self, precision: str) -> list[str]:
        """The exempt outputs under `precision` (none where it is not listed)."""
        return list(self.outputs) if precision in self.precisions else []


@dataclass
class OpConfig:
    """The keys every op has. An op with keys of its own declares a subclass of this, `Config` in
    posttrainllm/ops/<op>/config.py (its defaults and its own `__post_init__` checks); a point's `op` node is merged
    into the chosen op's class (validate_schema's `op_schemas`, by op.name: lab/configure.py), so a key of another
    op is refused naming the chosen op's keys."""

    name: str = MISSING  # the op (ops/registry.py); conf/op/<option>.yaml sets it
    max_error_only: MaxErrorOnlyConfig = field(default_factory=MaxErrorOnlyConfig)
    # Built-in peers beyond the registry's (`compiled`: the reference under torch.compile; an op's own, such as
    # FlexAttention): opt-in, as each compiles (seconds per shape on a CPU)
    peers: list[str] = field(default_factory=list)
    # Kernels from outside, `[name=]file.py:attr`, `[name=]module:attr` or `[name=]entry:<name>` (lab/isolation/user.py)
    user_impls: list[str] = field(default_factory=list)
    # Run only these paths (built-in, peer or user, by name) and the reference, the speed baseline; []: every path
    # (ops/base.py OpDef.paths, the one place paths are listed)
    only: list[str] = field(default_factory=list)

@dataclass
class Contract:
    """The numerical contract of one precision (see conf/precision/*.yaml for the why)."""

    error_multiple: float = 8.0
    floor_rel: float = 1e-6
    atol: float = 1e-5
    rtol: float = 1e-5
    # the elementwise tolerance's part that scales with the tensor (x max|oracle|): rounding a long sum
    # (a matmul over K) leaves an absolute error on every element, near-zero ones included
    atol_rel: float = 0.0
    max_mismatch: float = 0.0
    train_loss_drift: float = 1e-4
    # Per-row rule (posttrainllm/lab/parity.py): floors of each row's allowance, in units of the
    # whole tensor's max|oracle|, for forward outputs and for gradients ("grad_*").
    row_floor_rel: float = 1e-6
    grad_row_floor_rel: float = 1e-5
    # Signal-to-noise floor of each checked output against the oracle, in dB: 10·log10(Σ oracle² / Σ err²) must
    # be at least this (lab/parity.py); None = off. A quantized precision's (conf/precision/fp8*.yaml: why)
    min_sqnr_db: float | None = None

    def __post_init__(self) -> None:
        _positive("precision.contract", error_multiple=self.error_multiple, floor_rel=self.floor_rel,
                  train_loss_drift=self.train_loss_drift, row_floor_rel=self.row_floor_rel,
                  grad_row_floor_rel=self.grad_row_floor_rel)
        require(self.min_sqnr_db is None or self.min_sqnr_db > 0,
                 f"precision.contract.min_sqnr_db={self.min_sqnr_db}: must be > 0 dB, or null (off)")
        require(self.atol >= 0 and self.rtol >= 0 and self.atol_rel >= 0,
                 f"precision.contract: atol={self.atol}, rtol={self.rtol} and atol_rel={self.atol_rel} must be >= 0")
        require(0.0 <= self.max_mismatch < 1.0,
                 f"precision.contract.max_mismatch={self.max_mismatch}: must be in [0, 1)")


@dataclass
class QualityConfig:
    """bench-train's quality gate of a quantized precision (conf/precision/fp8*.yaml: the numbers and why): what the
    model outputs when its linear layers run in fp8, against the same model in bf16 (posttrainllm/model/quality.py).
    A path that fails it gets no speed in the report, as a parity failure does."""

    heldout_frac: float = 0.1  # the corpus's tail held out of training (the draft-heads base holds out the same)
    heldout_batches: int = 8  # batches of the tail the held-out loss averages (train.batch_size x train.seq_len)
    max_heldout_loss_gap: float = 0.05  # held-out loss, fp8-trained minus bf16-trained, nats/byte
    prompts: int = 8  # held-out prompts the draft-heads base decodes greedily, with fp8 and with bf16 linear layers
    prompt_len: int = 32
    new_tokens: int = 32
    min_greedy_agreement: float = 0.9  # the fraction of generated tokens equal at the same position
    reason: str = ""

    def __post_init__(self) -> None:
        require(0 < self.heldout_frac < 1, f"precision.quantize.quality.heldout_frac={self.heldout_frac}: must be in "
                                           "(0, 1)")
        require(0 <= self.min_greedy_agreement <= 1,
                f"precision.quantize.quality.min_greedy_agreement={self.min_greedy_agreement}: must be in [0, 1]")
        _positive("precision.quantize.quality", heldout_batches=self.heldout_batches,
                  max_heldout_loss_gap=self.max_heldout_loss_gap, prompts=self.prompts, prompt_len=self.prompt_len,
                  new_tokens=self.new_tokens)


@dataclass
class QuantizeFloors:
    """An op's own floors on the quantization's error (QuantizeConfig.op_floors), where its quantized math is more than
    one fp8 GEMM and its output's SQNR sits lower for it (op=moe: two GEMMs chained, h quantized again between them;
    the numbers and why: conf/precision/fp8*.yaml)."""

    min_sqnr_db: float = 20.0
    min_row_sqnr_db: float = 20.0
    reason: str = ""

    def __post_init__(self) -> None:
        _positive("precision.quantize.op_floors", min_sqnr_db=self.min_sqnr_db, min_row_sqnr_db=self.min_row_sqnr_db)


@dataclass
class QuantizeConfig:
    """A quantized precision's recipe (conf/precision/fp8*.yaml): the operands' 8-bit format and scaling, the
    gradients' format, and the floor on the quantization's own error (each case's oracle on the quantized inputs
    against the same math on the unquantized ones, lab/parity.py `quantization_check`)."""

    format: str = "float8_e4m3fn"  # the forward operands'
    scaling: str = "tensor"  # tensor | row (A's scale per row of A, B's per column of B)
    grad_format: str = "float8_e5m2"  # the gradients' in a training recipe (not checked by a forward-only op)
    min_sqnr_db: float = 20.0  # the quantization's SQNR, per tensor
    min_row_sqnr_db: float = 20.0  # ... and of its worst row
    reason: str = ""  # why these floors (parity.json carries it)
    # {op: floors}: an op's own, in place of the three above for its points (for_op; lab/configure.py validate)
    op_floors: dict[str, QuantizeFloors] = field(default_factory=dict)
    quality: QualityConfig = field(default_factory=QualityConfig)  # bench-train's gate on what the model outputs

    def __post_init__(self) -> None:
        for key in ("format", "grad_format"):
            value = getattr(self, key)
            require(value in FP8_DTYPES,
                     f"precision.quantize.{key}={value!r}: valid choices are {', '.join(FP8_DTYPES)}")
        require(self.scaling in SCALINGS,
                 f"precision.quantize.scaling={self.scaling!r}: valid choices are {', '.join(SCALINGS)}")
        _positive("precision.quantize", min_sqnr_db=self.min_sqnr_db, min_row_sqnr_db=self.min_row_sqnr_db)

    @property
    def recipe(self) -> str:
        """'<format>:<scaling>', what a quantized case carries to its op's make_inputs (ops/base.py Case)."""
        return f"{self.format}:{self.scaling}"

    def for_op(self, op: str) -> QuantizeConfig:
        """The recipe as op `op`'s points are judged: its op_floors entry, if any, in place of min_sqnr_db,
        min_row_sqnr_db and their reason (what parity reads and reports)."""
        floors = self.op_floors.get(op)
        if floors is None:
            return self
        return replace(self, min_sqnr_db=floors.min_sqnr_db, min_row_sqnr_db=floors.min_row_sqnr_db,
                       reason=floors.reason)


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
    # A quantized precision (fp8): the operands every path sees are quantized once per case by the op's make_inputs;
    # `dtype` is then the unquantized values' and the output's. None: not quantized
    quantize: QuantizeConfig | None = None

    def __post_init__(self) -> None:
        require(self.dtype in DTYPES, f"precision.dtype={self.dtype!r}: valid choices are {', '.join(DTYPES)}")
        require(self.dot_precision in ("ieee", "tf32"),
                 f"precision.dot_precision={self.dot_precision!r}: valid choices are ieee, tf32")


AUTO = "auto"  # tile/workgroup option: autotune on CUDA; elsewhere the option's fixed values run, and say so


@dataclass
class TileConfig:
    name: str = "b32"
    block_m: int = 32
    block_n: int = 32
    block_k: int = 32
    block_q: int = 32
    block_kv: int = 32
    # The attention backward's own blocks (dK/dV kernel, dQ kernel); null = the forward's block_q, block_kv
    dkdv_block_q: int | None = None
    dkdv_block_kv: int | None = None
    dq_block_q: int | None = None
    dq_block_kv: int | None = None

    def __post_init__(self) -> None:
        for key in ("block_m", "block_n", "block_k", "block_q", "block_kv", "dkdv_block_q", "dkdv_block_kv",
                    "dq_block_q", "dq_block_kv"):
            value = getattr(self, key)
            if value is None:
                continue
            require(power_of_two(value) and value >= 16,
                     f"tile.{key}={value}: must be a power of two >= 16 (tl.dot needs 16 on the GPU)")

    @property
    def autotune(self) -> bool:
        return self.name == AUTO


@dataclass
class WorkgroupConfig:
    name: str = "w4s2"
    num_warps: int = 4
    num_stages: int = 2
    group_m: int = 8

    def __post_init__(self) -> None:
        require(self.num_warps in (1, 2, 4, 8, 16),
                 f"workgroup.num_warps={self.num_warps}: valid choices are 1, 2, 4, 8, 16")
        require(1 <= self.num_stages <= 8, f"workgroup.num_stages={self.num_stages}: must be in [1, 8]")
        require(self.group_m >= 1, f"workgroup.group_m={self.group_m}: must be >= 1")

    @property
    def autotune(self) -> bool:
        return self.name == AUTO


@dataclass
class ArchitectureConfig:
    name: str = "mha"
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 4
    head_dim: int = 32
    # each block's MLP: one of the model's MLP kinds (model/slots.py MLP_KINDS, the model's words, which this layer
    # cannot import: lab/configure.py checks it): a dense SwiGLU of width mlp_hidden, or n_experts routed SwiGLU
    # experts of width expert_hidden, top_k per token, with a load-balancing loss (Switch / Mixtral) weighted by
    # router_aux_coef. An op's bench-train point may train another kind than `mlp` says (OpDef.model_problem)
    mlp: str = "dense"
    mlp_hidden: int = 384
    n_experts: int = 4
    top_k: int = 2
    expert_hidden: int = 192
    router_aux_coef: float = 0.01

    def __post_init__(self) -> None:
        _positive("architecture", d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                  n_kv_heads=self.n_kv_heads, head_dim=self.head_dim, mlp_hidden=self.mlp_hidden,
                  n_experts=self.n_experts, top_k=self.top_k, expert_hidden=self.expert_hidden)
        require(self.top_k <= self.n_experts,
                 f"architecture.top_k={self.top_k}: must be <= n_experts={self.n_experts}")
        require(self.router_aux_coef >= 0, f"architecture.router_aux_coef={self.router_aux_coef}: must be >= 0")
        require(self.n_heads % self.n_kv_heads == 0,
                 f"architecture.n_kv_heads={self.n_kv_heads}: must divide n_heads={self.n_heads}")
        require(power_of_two(self.head_dim) and 16 <= self.head_dim <= 128,
                 f"architecture.head_dim={self.head_dim}: must be a power of two in [16, 128]")


SizesT = TypeVar("SizesT", bound="OpSizes")


@dataclass
class OpSizes:
    """The base of an op's sizes: `Sizes` in posttrainllm/ops/<op>/config.py, its keys with defaults and its own
    `__post_init__` checks, `op_name` the op whose node of shape.ops it is. A shape option gives every op's sizes
    under `ops.<op>` (conf/shape/*.yaml); validate_schema merges each into its op's class (`sizes_schemas`, given by
    lab/configure.py), so an unknown key names the op's keys, and the validated LabConfig holds them typed. An op
    reads its own through `of(cfg)`, the one place they are taken from a config."""

    op_name: ClassVar[str] = ""

    def key(self, name: str) -> str:
        """The dotted key of one of its sizes, as a message names it: shape.ops.<op>.<name>."""
        return f"shape.ops.{self.op_name}.{name}"

    def require_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            require(value > 0, f"{self.key(name)}={value}: must be > 0")

    def require_sizes(self, name: str, least: int, what: str = "sizes") -> None:
        """Its list `name` holds at least `least` (1 or 2) of `what`, each > 0."""
        values = list(getattr(self, name))
        require(len(values) >= least and min(values) > 0,
                f"{self.key(name)}={values}: give at least {('one', 'two')[least - 1]} {what} > 0")

    def require_triples(self, name: str, dims: str) -> None:
        """Each entry of its list `name` is three sizes > 0 (`dims`: what they are, "[T, d, f]")."""
        for entry in getattr(self, name):
            require(len(entry) == 3 and min(entry) > 0, f"{self.key(name)}: {list(entry)} must be three sizes "
                                                        f"{dims + ' ' if dims else ''}> 0")

    @classmethod
    def of(cls: type[SizesT], cfg: LabConfig) -> SizesT:
        """The point's sizes of this op: its node of shape.ops, or the defaults where the config has none (one
        built by hand, not validated)."""
        found = cfg.shape.ops.get(cls.op_name)
        if found is None:
            return cls()
        return found if isinstance(found, cls) else cls(**found)


@dataclass
class ShapeConfig:
    """The problem sizes of a shape option (conf/shape/*.yaml): the keys ops share, and each op's own under
    `ops.<op>` (its OpSizes subclass; override as shape.ops.<op>.<key>=VALUE)."""

    name: str = "tiny"
    batch: int = 1
    seq_len: int = 128
    curve: list[int] = field(default_factory=lambda: [64, 128, 256, 512])
    edge_seq_lens: list[int] = field(default_factory=lambda: [1, 37, 100])
    # Each op's sizes by op name: plain mappings as composed, each the op's OpSizes once validated (every op that
    # declares sizes has its node, at its defaults where the shape option gives none)
    ops: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _positive("shape", batch=self.batch, seq_len=self.seq_len)
        require(len(self.curve) >= 2 and min(self.curve) > 0,
                 f"shape.curve={list(self.curve)}: give at least two sizes > 0")
        for s in self.edge_seq_lens:
            require(s > 0, f"shape.edge_seq_lens: {s} must be > 0")


@dataclass
class DeviceConfig:
    name: str = "auto"
    smem_bytes: int = 232448

    def __post_init__(self) -> None:
        require(self.name in ("auto", "cpu", "cuda"), f"device.name={self.name!r}: valid choices are auto, cpu, cuda")
        _positive("device", smem_bytes=self.smem_bytes)


@dataclass
class RunConfig:
    name: str = "bench"
    out_dir: str = "runs/bench"
    log_mlflow: bool = True
    # On a GPU, commands that run timing loops refuse to start without approval (lab/approval.py):
    # run.approve=true, or the environment variable POSTTRAINLLM_APPROVE=1. The CPU needs none.
    approve: bool = False

    def __post_init__(self) -> None:
        require(re.fullmatch(r"[A-Za-z0-9._=,-]+", self.name) is not None,
                 f"run.name={self.name!r}: use letters, digits and . _ = , - only")


@dataclass
class ParityConfig:
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    # The reference stage's estimated peak (float64 oracle + inputs) may use at most this fraction of
    # the memory available when it starts (MemAvailable on CPU, free memory on CUDA); 0 < x <= 1.
    memory_fraction: float = 0.5
    # Bitwise properties every path must have (lab/invariance.py): a path lacking one fails parity with its first
    # differing row. [] judges only what a path declares (Impl.promises, a user function's `promises`)
    require: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        require(len(self.seeds) >= 1, "parity.seeds: give at least one seed")
        for name in self.require:
            require(name in PROPERTIES, f"parity.require: unknown property {name!r}: valid choices are "
                                        f"{', '.join(PROPERTIES)}")
        require(0 < self.memory_fraction <= 1, f"parity.memory_fraction={self.memory_fraction}: must be in (0, 1]")


@dataclass
class BenchConfig:
    warmup: int = 3
    reps: int = 10
    min_time_s: float = 0.2
    max_reps: int = 320  # conf/config.yaml: why 320
    threads: int = 0
    # The curve times forward + backward too at each size (curve.csv's mode column); off by default: the
    # point's own shape is always timed both ways, and the CPU sweep stays quick
    curve_backward: bool = False
    # A median under this fraction of the roofline's minimum time (FLOPs at the best calibrated GEMM peak)
    # is refused as impossible (conf/config.yaml: why not 1, and why not the bytes roof)
    impossible_below: float = 0.5
    # Distinct input sets the timed repetitions rotate over (lab/isolation/rooms.py): a stored result is never the answer
    input_sets: int = 4

    def __post_init__(self) -> None:
        require(0 < self.impossible_below <= 1, f"bench.impossible_below={self.impossible_below}: must be in (0, 1]")
        require(self.input_sets >= 4, f"bench.input_sets={self.input_sets}: must be >= 4 (timed repetitions rotate "
                                      "over distinct inputs, so a result stored for one set cannot answer the next)")
        require(self.warmup >= 0, f"bench.warmup={self.warmup}: must be >= 0")
        require(self.reps >= 1, f"bench.reps={self.reps}: must be >= 1")
        require(self.max_reps >= self.reps, f"bench.max_reps={self.max_reps}: must be >= bench.reps={self.reps}")
        require(self.min_time_s >= 0, f"bench.min_time_s={self.min_time_s}: must be >= 0")
        require(self.threads >= 0, f"bench.threads={self.threads}: must be >= 0 (0 keeps torch's default)")


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
        require(0 <= self.warmup_steps < self.steps,
                 f"train.warmup_steps={self.warmup_steps}: must be in [0, train.steps={self.steps})")


@dataclass
class CompareConfig:
    """`posttrainllm compare` (track/compare.py): when a timing counts as faster or slower."""

    threshold: float = 0.05  # the ratio's interval must clear 1 + threshold (or 1 / (1 + threshold))
    alpha: float = 0.01  # and the Mann-Whitney p on log-times must be below this
    confidence: float = 0.95  # of the bootstrap interval of median(new) / median(base)
    bootstrap: int = 2000  # resamples
    seed: int = 0  # of the resampling: the same receipts give the same interval

    def __post_init__(self) -> None:
        require(self.threshold >= 0, f"compare.threshold={self.threshold}: must be >= 0")
        require(0 < self.alpha < 1, f"compare.alpha={self.alpha}: must be in (0, 1)")
        require(0 < self.confidence < 1, f"compare.confidence={self.confidence}: must be in (0, 1)")
        require(self.bootstrap >= 100, f"compare.bootstrap={self.bootstrap}: must be >= 100")


@dataclass
class BaseTrainConfig:
    """The frozen base the heads ride on: the `architecture` model trained on the corpus's head."""

    steps: int = 600
    warmup_steps: int = 30         # linear warmup, then cosine decay to lr/10
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    seed: int = 0
    heldout_frac: float = 0.1      # the corpus's tail, never trained on: held-out loss and every prompt
    eval_batches: int = 8          # held-out loss = mean over this many batches of the tail
    max_seq_len: int = 256         # RoPE table: prompt + generated tokens (+ K + 1 when verifying) must fit
    threads: int = 1               # CPU threads it trains with (0: every CPU this process may use): nothing here
                                   # is timed against anything, unlike bench.threads; recorded in base.json

    def __post_init__(self) -> None:
        _positive("heads.base", steps=self.steps, batch_size=self.batch_size, seq_len=self.seq_len, lr=self.lr,
                  eval_batches=self.eval_batches, max_seq_len=self.max_seq_len)
        require(0 <= self.warmup_steps < self.steps,
                 f"heads.base.warmup_steps={self.warmup_steps}: must be in [0, heads.base.steps={self.steps})")
        require(0 < self.heldout_frac < 0.5, f"heads.base.heldout_frac={self.heldout_frac}: must be in (0, 0.5)")
        require(self.threads >= 0, f"heads.base.threads={self.threads}: must be >= 0 (0: every usable CPU)")
        require(self.seq_len <= self.max_seq_len,
                 f"heads.base.seq_len={self.seq_len}: must be <= heads.base.max_seq_len={self.max_seq_len}")


@dataclass
class HeadsConfig:
    """Medusa-style draft heads on the frozen base (posttrainllm/lab/heads.py), and the decode measurement."""

    name: str = "k3"
    num_heads: int = 3             # K: head k (1..K) predicts token t+k+1 from the base's last hidden state at t
    out_dir: str = "runs/heads"    # base/ (shared by every K) and <name>/ (heads, decode, receipt)
    base: BaseTrainConfig = field(default_factory=BaseTrainConfig)
    # self-distillation: the base's own greedy continuations of held-out prompts
    steps: int = 300
    batch_size: int = 16
    lr: float = 1e-3
    loss_decay: float = 0.8        # head k's loss weight: loss_decay ** k (Medusa-1)
    seed: int = 0
    train_prompts: int = 64
    prompt_len: int = 32
    continuation_len: int = 96
    # the decode measurement: the same prompts, plain greedy vs speculative
    eval_prompts: int = 8
    new_tokens: int = 64
    warmup_prompts: int = 1        # untimed runs first (allocator, lazy init)
    # what attends in cached decoding and verification (the model's cached_attention slot): a path of the op whose
    # paths fill that slot (lab/configure.py check_heads_rules names them)
    cached_attention: str = "reference"
    near_tie: float = 1e-3         # a mismatch whose top-2 logit gap is below this is named a near-tie (still a failure)
    # opt-in tree verification (the trained_tree variant): widths [w_1..w_D], D <= K, each >= 1: the top-w_d of
    # head d under every depth-(d-1) candidate (posttrainllm/model/decode.py candidate_tree); empty: off
    tree: list[int] = field(default_factory=list)

    def tree_size(self) -> int:
        """Entries of one tree verification: the root (the base's token) and every candidate (0: no tree)."""
        size, level = (1, 1) if self.tree else (0, 1)
        for width in self.tree:
            level *= width
            size += level
        return size

    def __post_init__(self) -> None:
        require(0 <= self.num_heads <= 8, f"heads.num_heads={self.num_heads}: must be in [0, 8]")
        tree = list(self.tree)
        require(len(tree) <= self.num_heads,
                 f"heads.tree={tree}: one width per head, so at most heads.num_heads={self.num_heads} widths")
        require(all(isinstance(w, int) and w >= 1 for w in tree),
                 f"heads.tree={tree}: every width (top-w of a head) must be an int >= 1")
        _positive("heads", steps=self.steps, batch_size=self.batch_size, lr=self.lr, loss_decay=self.loss_decay,
                  train_prompts=self.train_prompts, prompt_len=self.prompt_len,
                  continuation_len=self.continuation_len, eval_prompts=self.eval_prompts, new_tokens=self.new_tokens)
        require(self.warmup_prompts >= 0, f"heads.warmup_prompts={self.warmup_prompts}: must be >= 0")
        longest = self.prompt_len + max(self.continuation_len, self.new_tokens + self.num_heads + 1)
        require(longest <= self.base.max_seq_len,
                 f"heads: prompt_len + generated tokens + K + 1 = {longest} exceeds heads.base.max_seq_len="
                 f"{self.base.max_seq_len}")
        if tree:
            longest = self.prompt_len + self.new_tokens + self.tree_size()
            require(longest <= self.base.max_seq_len,
                     f"heads: prompt_len + new_tokens + tree entries = {longest} exceeds heads.base.max_seq_len="
                     f"{self.base.max_seq_len}")


COMPILE_TARGETS = ("sm80", "sm90", "sm100")  # measure/sass.py TARGETS


@dataclass
class CompileConfig:
    # GPU architectures every Triton kernel of a point is compiled for (lab/compile.py); the first is the one the
    # kernel stage, the sweep planner and the report read
    targets: list[str] = field(default_factory=lambda: ["sm90"])

    def __post_init__(self) -> None:
        unknown = [t for t in self.targets if t not in COMPILE_TARGETS]
        require(bool(self.targets) and not unknown, f"compile.targets={list(self.targets)}: "
                f"{'unknown ' + ', '.join(map(str, unknown)) if unknown else 'empty'}; choose from "
                f"{', '.join(COMPILE_TARGETS)}")


@dataclass
class SweepConfig:
    name: str = "default"
    grid: bool = False
    baseline: dict[str, str] = field(default_factory=dict)
    vary: dict[str, list[str]] = field(default_factory=dict)
    points: dict[str, dict[str, str]] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    # Key overrides of the baseline point alone (the default sweep: the peers users reach for, op.peers): the
    # points that change a dimension start from the baseline's group choices, not from these
    baseline_overrides: list[str] = field(default_factory=list)
    # Compile every point's Triton kernels for its first compile target when planning, and refuse (leave out of
    # the plan, with the kernel, the bytes and the limit) a point with a kernel that would not launch there
    check_fit: bool = False
    # A folder of problem files (KernelBench's format, op=problem): each *.py in it is one more point,
    # problem-<stem>, the baseline's choices with op=problem op.file=<it>; null: none
    problems: str | None = None


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
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    sweep: SweepConfig | None = None



def itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}[dtype]


def _one_line(exc: BaseException) -> str:
    """OmegaConf/Hydra messages span lines (full_key, object_type...): keep the first."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def schema(op_schema: type[OpConfig] = OpConfig, op_name: str | None = None,
           sizes_schemas: dict[str, type[OpSizes]] | None = None) -> DictConfig:
    """LabConfig as an OmegaConf schema, its `op` node `op_schema`'s: the chosen op's own keys and defaults; its
    shape.ops node each op's sizes (`sizes_schemas`: op name -> its OpSizes subclass), at their defaults."""
    node = OmegaConf.structured(LabConfig)
    node.op = OmegaConf.structured(op_schema)
    if op_name is not None:
        node.op.name = op_name
    node.shape.ops = {name: OmegaConf.structured(cls) for name, cls in (sizes_schemas or {}).items()}
    return node


def validate_schema(cfg: DictConfig | dict[str, Any], op_schemas: Callable[[str], type[OpConfig]],
                    sizes_schemas: dict[str, type[OpSizes]] | None = None) -> LabConfig:
    """Merge a composed config into the schema, its `op` node into the chosen op's config class (`op_schemas`:
    op.name -> that OpConfig subclass) and each node of shape.ops into its op's sizes (`sizes_schemas`); raise
    ConfigError with one line on any violation.

    The schema's own rules only: the op's rules (a tile that does not fit its problem, its paths) are
    checked by posttrainllm.lab.configure, the layer that knows both and gives `op_schemas` and `sizes_schemas`;
    use its `load`/`validate`/`validate_schema`."""
    op = cfg.get("op") if isinstance(cfg, (dict, DictConfig)) else None
    name = op.get("name") if isinstance(op, (dict, DictConfig)) else None
    # no op.name, or not a string: the generic schema, whose merge names what is wrong
    node = schema(op_schemas(name), name, sizes_schemas) if isinstance(name, str) else schema(
        sizes_schemas=sizes_schemas)
    _check_sized_ops(cfg, node)
    try:
        return OmegaConf.to_object(OmegaConf.merge(node, cfg))
    except ConfigError:
        raise
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        cause = exc.__cause__ if isinstance(exc.__cause__, ConfigError) else None
        if cause is not None:
            raise cause from None
        if isinstance(exc, ConfigKeyError) and key and re.match(r"Key '[^']*' not in ", str(exc)):
            raise ConfigError(_unknown_key_message(key, node)) from None
        where = f" (at {key})" if key else ""
        raise ConfigError(f"{_one_line(exc)}{where}") from None


def _check_sized_ops(cfg: DictConfig | dict[str, Any], node: DictConfig) -> None:
    """shape.ops names only ops that declare sizes (the schema's nodes): another name is refused naming them."""
    shape = cfg.get("shape") if isinstance(cfg, (dict, DictConfig)) else None
    ops = shape.get("ops") if isinstance(shape, (dict, DictConfig)) else None
    for name, sizes in ops.items() if isinstance(ops, (dict, DictConfig)) else ():
        require(name in node.shape.ops, _unknown_key_message(f"shape.ops.{name}", node))
        require(isinstance(sizes, (dict, DictConfig, OpSizes)), f"shape.ops.{name}={sizes!r}: give the op's sizes by "
                f"key (valid keys of shape.ops.{name} are {', '.join(sorted(node.shape.ops[name].keys()))})")


def to_plain(cfg: LabConfig | DictConfig) -> dict[str, Any]:
    """The config as plain dicts and lists (for params.yaml, receipts and MLflow params)."""
    node = OmegaConf.structured(cfg) if isinstance(cfg, LabConfig) else cfg
    return OmegaConf.to_container(node, resolve=True)


def point_shape(cfg: LabConfig) -> dict[str, Any]:
    """The point's shape as plain values: the sizes ops share and its own op's (shape.ops.<op>), no other op's, read
    one by one (a stage's stamp records those keys only: track/stamp.py)."""
    shape = cfg.shape
    plain = {f.name: copy.deepcopy(getattr(shape, f.name)) for f in fields(shape) if f.name != "ops"}
    own = shape.ops.get(cfg.op.name)
    plain["ops"] = {cfg.op.name: OmegaConf.to_container(OmegaConf.structured(own))} if own is not None else {}
    return plain


def point_config(cfg: LabConfig) -> dict[str, Any]:
    """What defines a point: everything but the sweep plan, where to write, and how receipts are compared.

    The draft heads are not part of an op point either: they have their own stages (posttrainllm/lab/heads.py);
    nor are other ops' sizes (shape.ops): a point holds its own op's only, so an edit of another's reruns none of
    its stages, and its receipt records what it ran.
    """
    plain = to_plain(cfg)
    plain["shape"] = point_shape(cfg)
    plain.pop("sweep", None)
    plain.pop("run", None)
    plain.pop("compare", None)
    plain.pop("heads", None)
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
            require(value in valid, f"unknown {name} {value!r}: valid choices are {', '.join(valid)}")


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose conf/config.yaml with Hydra overrides (no sweep syntax); errors are one line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    # An op's keys are its schema's (ops/<op>/config.py), which validate_schema merges the op node into and which
    # names the chosen op's keys when one is unknown: Hydra adds an op key rather than refusing it (and
    # op.sizes.NAME=VALUE names a constant of a problem file, a key conf/ cannot list)
    # The same for an op's sizes (shape.ops.<op>.<key>, its ops/<op>/config.py Sizes)
    overrides = [f"++{o}" if o.startswith(("op.", "shape.ops.")) else o for o in overrides]
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


def _unknown_key_message(key: str, node: DictConfig | None = None) -> str:
    """`tile.blok_m` -> 'unknown key tile.blok_m: valid keys of tile are block_k, ...', the keys of `node` (a
    schema, the chosen op's keys in its op node) or, by default, of LabConfig with the keys every op has."""
    node = schema() if node is None else node
    path: list[str] = []
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            break
        node, path = node.get(part), path + [part]
    if not isinstance(node, DictConfig):
        return f"unknown key {key}"
    where = f"of {'.'.join(path)} " if path else ""
    if path == ["op"] and not OmegaConf.is_missing(node, "name"):
        where = f"of op (op.name={node.name}) "
    if path == ["shape", "ops"]:  # its keys are the ops that declare sizes
        return f"unknown key {key}: valid keys of shape.ops (the ops with sizes) are {', '.join(sorted(node.keys()))}"
    return f"unknown key {key}: valid keys {where}are {', '.join(sorted(node.keys()))}"
