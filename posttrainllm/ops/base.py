"""What an op declares, once, so that every stage can stay generic over it.

An op module (attention.py, matmul.py) builds one `OpDef`:

    impls         the registry: reference first, then peers and ours. One `Impl.fn` per
                  path is the function parity checks, the microbench times and the model
                  trains: there is no second function under the same name.
    cases         the parity cases (the point's shape, edge shapes, adversarial inputs)
    make_inputs   the inputs of a case, from its seed
    oracle_extra  outputs the float64 reference checks beyond "out" (attention: the logsumexp)
    costs         forward FLOPs and minimal bytes, with the backward's FLOP multiple
    curve_case    the problem at one size of the measured curve (x_name: its axis)
    extra_curves  more curve axes, if any (MoE: experts at fixed active parameters)
    model_hook    the model slot a path fills in bench-train, and the path as that slot's function
    check_config  the op's own config rules (a tile that does not fit its problem)

Adding an op is adding a folder ops/<op>/ and one line in ops/registry.py; the stages,
microbench, curves, bench-train, receipt and report never test an op's name.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from posttrainllm.config import ConfigError, LabConfig

Tensors = dict[str, torch.Tensor]
REFERENCE = "reference"

# PyTorch's functions the built-in peers call, bound when the lab starts: code that replaces torch's attribute later
# (SageAttention's README does so for SDPA at import) changes no peer, and `replaced_library` names what it replaced
LIBRARY: dict[str, Callable[..., Any]] = {
    "torch.nn.functional.scaled_dot_product_attention": torch.nn.functional.scaled_dot_product_attention,
    "torch.nn.functional.rms_norm": torch.nn.functional.rms_norm,
    "torch.matmul": torch.matmul,
}


def replaced_library() -> list[str]:
    """The LIBRARY functions whose torch attribute is now another object than the one the peers call."""
    replaced = []
    for dotted, bound in LIBRARY.items():
        owner, _, attr = dotted.rpartition(".")
        module = torch
        for part in owner.split(".")[1:]:
            module = getattr(module, part)
        if getattr(module, attr, None) is not bound:
            replaced.append(dotted)
    return replaced
OWN_BACKWARD, NO_BACKWARD = "own", "none"  # Impl.backward: its own, none (forward-only), or another path's name
IN_PROCESS, ISOLATED = "in_process", "isolated"  # Impl.runner: how the lab calls a path (lab/runner.py)


@dataclass(frozen=True)
class Case:
    """One parity case: a problem size, a seed and an input kind. `main` marks the point's own shape."""

    name: str
    seed: int
    dims: dict[str, int]
    main: bool
    inputs: str = "normal"  # normal | an op's adversarial kinds (large_logits, growing_logits, near_one_hot)
    # A quantized precision's recipe, '<fp8 format>:<scaling>' (config.QuantizeConfig.recipe), or '' (none): the
    # op's make_inputs then quantizes the operands once (every path sees the same), and the same case with ''
    # gives the unquantized inputs the quantization's own error is measured against (lab/stages.py)
    quantize: str = ""
    # The op options this case runs under instead of the point's (cfg.op fields: attention's sm_scale and causal,
    # cross-entropy's label_smoothing), so that a path which ignores one fails parity; {}: the point's own
    # (case_config). The main case and the curve's have none: what is timed is the point's configuration.
    options: dict[str, Any] = field(default_factory=dict)


_CASE_CONFIGS: dict[tuple, tuple[LabConfig, LabConfig]] = {}


def case_config(case: Case, cfg: LabConfig) -> LabConfig:
    """The config a case's calls get: the point's, with the case's options (Case.options) over cfg.op.

    Copies, not dataclasses.replace: a stage recording its config reads (track/stamp.py) sees only the op's
    fields read, as for the point's own config. One copy per (config, options), so a compiled path sees one."""
    if not case.options:
        return cfg
    key = (id(cfg), tuple(sorted(case.options.items())))
    if key not in _CASE_CONFIGS or _CASE_CONFIGS[key][0] is not cfg:
        op = copy.copy(cfg.op)
        for name, value in case.options.items():
            setattr(op, name, value)
        made = copy.copy(cfg)
        made.op = op
        _CASE_CONFIGS[key] = (cfg, made)
    return _CASE_CONFIGS[key][1]


def softmax_scale(cfg: LabConfig, head_dim: int) -> float:
    """The attention ops' softmax scale: op.sm_scale, or 1/sqrt(head_dim) where it is null."""
    return cfg.op.sm_scale if cfg.op.sm_scale is not None else 1.0 / math.sqrt(head_dim)


@dataclass(frozen=True)
class Impl:
    """One implementation of an op.

    fn: inputs -> outputs ("out", plus what `outputs` names), differentiable in the inputs.
    outputs: the forward outputs this path produces; parity requires every one (and, with its own
        backward, a gradient for every input), so a path that drops one fails.
    kind: reference | peer (PyTorch's own fast path) | triton (ours).
    backward: whose math the gradients are. "own": this path's backward, checked by parity like its
        forward. Another path's name: a borrowed backward (the decode kernel recomputes the reference's),
        so its gradients are that path's and parity shows them as not checked. "none": forward-only.
    kernels: the path's own Triton kernels per direction ({"forward": (...), "backward": (...)}); the
        kernel stage's guard requires each named kernel to launch in the call of that direction.
    """

    name: str
    kind: str
    fn: Callable[[Tensors, LabConfig], Tensors]
    outputs: tuple[str, ...] = ("out",)
    geometry: Callable[[Case, LabConfig], dict[str, Any]] | None = None
    backend: str = ""  # what runs, in words: "torch.nn.functional.scaled_dot_product_attention", ...
    # trained by default in bench-train (train.impls=[]); False for peers that only pin another path's
    # backend (the model trains the generic path), so the end-to-end step is not repeated per backend
    train: bool = True
    # why bench-train does not train this path on this point's device, recorded as skipped (None: it does)
    train_refusal: str | None = None
    backward: str = OWN_BACKWARD
    kernels: dict[str, tuple[str, ...]] = field(default_factory=dict)
    user: dict[str, Any] | None = None  # a user path's identity (lab/isolation/user.py): spec, file, sha256, ...
    # how the lab calls it (lab/runner.py): IN_PROCESS (`fn` here), or ISOLATED (a path from outside, in a worker
    # process of its own; `source` is what its runner reaches the worker through: lab/isolation/user.py UserPath)
    runner: str = IN_PROCESS
    source: Any = None
    # what the path records of its own calls, for the stages to keep (the compiled peer: dynamo's graphs and
    # recompiles per input signature, ops/peers.py); None: nothing
    evidence: Callable[[], dict[str, Any]] | None = None
    # the bitwise properties this path promises (config.PROPERTIES: deterministic, batch_invariant): parity fails it
    # where one does not hold (lab/invariance.py); a user path declares them as its function's `promises`
    promises: tuple[str, ...] = ()
    # the op's cost model of this kind of path (a key of OpDef.path_costs: attention's "materialised", "fused"...);
    # None: none declared, the path is placed with the op's floor and its receipt says so (OpDef.costs_of)
    cost_model: str | None = None

    @property
    def checks_gradients(self) -> bool:
        """Parity checks this path's gradients only when they are its own."""
        return self.backward == OWN_BACKWARD


@dataclass(frozen=True)
class BatchAxis:
    """What one row of an op is and where its batch axis lies, for the batch-invariance check (lab/invariance.py).

    row: one row, in words (attention: "one sequence of one batch entry"; matmul: "a row of A").
    inputs: the batched inputs and the dim each is batched along; every other input is shared by the rows.
    outputs: the forward outputs compared per row, and their batch dim. {}: none is a row's (a mean loss), so the
        gradients of the batched inputs are compared along their input's dim (a shared input's gradient sums over
        the batch: never a row's).
    fixed_size: the op's math depends on the batch's size (a mean over tokens): the other batches keep the main
        case's size and move the rows among other companions; no row runs alone.
    note: what is not compared, and why.
    """

    row: str
    inputs: dict[str, int]
    outputs: dict[str, int]
    fixed_size: bool = False
    note: str = ""


FLOOR = "floor"  # Costs.model of an op's `costs`: inputs read once, outputs written once
FLOOR_NOTE = ("the op's floor (inputs read once, outputs written once), not a model of this path: it declares "
              "none (Impl.cost_model)")


@dataclass(frozen=True)
class Costs:
    """Forward FLOPs and the bytes one call moves; the backward is `backward_multiple` × forward in FLOPs.

    An op's `costs` is its floor (model FLOOR): the FLOPs of the math and the minimal bytes. A path's own model
    (OpDef.path_costs, named by Impl.cost_model) gives what that path executes and moves: the reference's
    materialised (S, S) scores, a fused kernel's K/V re-read per query tile. train_bytes: forward + backward
    traffic [B] (None: not modelled; the roofline then reads the forward only); working_set: the bytes live at
    once in the forward [B], what the last-level cache is compared with (None: `bytes`)."""

    flops: int
    bytes: int
    backward_multiple: float
    flops_formula: str
    bytes_formula: str
    backward_formula: str
    train_bytes: int | None = None
    train_bytes_formula: str = ""
    working_set: int | None = None
    working_set_formula: str = ""
    model: str = FLOOR
    note: str = ""  # what the model assumes (a tile it does not know), or why it is the floor

    @property
    def train_flops(self) -> float:
        """Forward + backward FLOPs."""
        return self.flops * (1.0 + self.backward_multiple)

    @property
    def live_bytes(self) -> int:
        """The working set, or the forward's bytes where none is modelled."""
        return self.working_set if self.working_set is not None else self.bytes

    def record(self) -> dict[str, Any]:
        """The model as a receipt keeps it: every figure beside its formula."""
        return {"model": self.model, "note": self.note, "flops": self.flops, "flops_formula": self.flops_formula,
                "bytes": self.bytes, "bytes_formula": self.bytes_formula, "train_flops": self.train_flops,
                "backward_formula": self.backward_formula, "train_bytes": self.train_bytes,
                "train_bytes_formula": self.train_bytes_formula, "working_set_bytes": self.live_bytes,
                "working_set_formula": self.working_set_formula or ("= bytes" if self.working_set is None else ""),
                "flops_per_byte": self.flops / self.bytes if self.bytes else None,
                "train_flops_per_byte": self.train_flops / self.train_bytes if self.train_bytes else None}


@dataclass(frozen=True)
class ModelHook:
    """How bench-train swaps one of the op's paths into the model: the model slot it fills (a name of
    model/slots.py SLOTS, the model's own role: its attention, its linear layers, its norm...) and `fill(impl, cfg)`,
    the path as a function of that slot's contract. The slot's profiler range is the op's share of a step.
    `also`: other slots whose contract the same function meets, where the lab fills them with the op's paths outside
    a point of it (registry.slot_op: the draft heads' cached decoding)."""

    slot: str
    fill: Callable[[Impl, LabConfig], Callable[..., Any]]
    also: tuple[str, ...] = ()

    @property
    def fills(self) -> tuple[str, ...]:
        """Every slot a path of the op fills: bench-train's, then `also`."""
        return (self.slot, *self.also)


@dataclass(frozen=True)
class CurveAxis:
    """One axis of the measured curve: its name, its sizes from the config, and the problem at one size."""

    x_name: str
    sizes: Callable[[LabConfig], list[int]]
    case: Callable[[LabConfig, int], Case]


@dataclass
class OpDef:
    name: str
    x_name: str  # the curve's axis
    input_names: tuple[str, ...]
    impls: dict[str, Impl]
    cases: Callable[[LabConfig], list[Case]]
    make_inputs: Callable[[Case, torch.dtype, str], Tensors]
    problem: Callable[[Case], str]
    costs: Callable[[Case, LabConfig], Costs]
    curve_case: Callable[[LabConfig, int], Case]
    model_hook: ModelHook | None  # None: no slot of the model is this op (`no_model` says why)
    model_problem: Callable[[LabConfig], str]
    check_config: Callable[[LabConfig], None]
    # Shared memory per program of the point's tile, by the op's one formula (ops/<op>/config.py), which its config
    # check and its autotuner's pruning read too; the compile report shows it. None: the op declares none
    smem_bytes: Callable[[LabConfig], int] | None = None
    oracle_extra: Callable[[Tensors, LabConfig], Tensors] = lambda x, cfg: {}
    # The floating outputs a backward flows from, each with its own seeded upstream gradient (lab/oracle.py
    # upstream_gradients): add_rmsnorm's ("out", "h"); ("out",), the default, is the one dO every op had
    differentiable_outputs: tuple[str, ...] = ("out",)
    row_ndim: dict[str, int] = field(default_factory=dict)  # per output: trailing dims that form one parity row
    forward_only_inputs: tuple[str, ...] = ()  # input kinds whose cases check the forward outputs only
    # The float64 oracle in pieces, so long sequences fit: each chunk maps every input to the index of
    # its piece; `output_follows` says which input's index each output (and gradient) takes. One chunk
    # (the whole problem) by default.
    oracle_chunks: Callable[[Case], list[dict[str, tuple]]] = lambda case: [{}]
    output_follows: dict[str, str] = field(default_factory=dict)
    # Peak bytes of the reference stage on one case (one chunk of the oracle at a time), for the memory check
    reference_bytes: Callable[[Case, LabConfig], int] = lambda case, cfg: 0
    # Inputs no gradient is asked for (integer ids such as MoE's route_idx): parity expects no grad_<name>
    nondiff_inputs: tuple[str, ...] = ()
    # Checks of a case's inputs themselves, run once by the reference stage and reported by parity (MoE: the
    # router that made the routing every path runs on): {"verdict": "pass"|"fail", "reason": ..., ...}
    input_checks: Callable[[Case, Tensors, LabConfig], dict[str, Any]] | None = None
    # The microbench curve's sizes (default: shape.curve)
    curve_sizes: Callable[[LabConfig], list[int]] = lambda cfg: list(cfg.shape.curve)
    # More measured curves over other axes (MoE: experts at fixed active parameters), in the same curve.csv
    extra_curves: tuple[CurveAxis, ...] = ()
    # The op's readable math the model runs where nothing is swapped in, by slot (model/slots.py: rmsnorm's for the
    # norm); each slot's default is declared by one op
    model_defaults: dict[str, Callable[..., Any]] = field(default_factory=dict)
    # ModelConfig fields bench-train sets for this op (MoE: an MoE MLP for the expert hook to swap into)
    model_overrides: Callable[[LabConfig], dict[str, Any]] = lambda cfg: {}
    # Extra measurements of the point's own case for the microbench report (MoE: tokens per expert)
    # describe(case, inputs, cfg, measure): what the op measures of its case beyond the paths' times; `measure` is
    # the lab's timer (measure/timing.py `measure`), handed down so that the op times with the paths' own rules
    describe: Callable[..., dict[str, Any]] | None = None
    # Other readable formulations of the reference's backward: (name, fn in the registry's form). Each gradient's
    # baseline is, element by element, whichever of the reference and these errs more against the oracle in the
    # point's precision (attention: P = exp(S − lse) as a flash backward recomputes it, beside torch.softmax)
    gradient_baselines: tuple[tuple[str, Callable[[Tensors, LabConfig], Tensors]], ...] = ()

    # The paths that exist for one point (e.g. only the SDPA backends its device has); None: `impls`
    point_impls: Callable[[LabConfig], dict[str, Impl]] | None = None
    # Built-in peers a point adds by name (op.peers): {name: cfg -> Impl}; `compiled` for every op (peers.py)
    optional_peers: dict[str, Callable[[LabConfig], Impl]] = field(default_factory=dict)
    # Path names no user path may take beyond the registry's (SDPA backends absent on this device, say)
    reserved_names: tuple[str, ...] = ()
    # Outputs checked when a path returns them (a user attention's logsumexp), beyond its declared `outputs`
    optional_outputs: tuple[str, ...] = ()
    # A user path's natural signature, in words (README, `posttrainllm new-impl`), and the adapter from it to
    # the registry's dict form: adapt(fn) -> (inputs, cfg) -> outputs
    signature: str = ""
    adapt: Callable[[Callable[..., Any]], Callable[[Tensors, LabConfig], Tensors]] | None = None
    # The body of `posttrainllm new-impl`'s file: the readable math in the natural signature, correct as it is
    template: str = ""
    # Quantized precisions (precision.quantize: fp8) this op supports: its cases carry the recipe (Case.quantize)
    # and its make_inputs quantizes; the point's paths are the quantized ones (point_impls). Other ops refuse them
    quantizes: bool = False
    # ... and bench-train trains it under them: its model hook carries the precision's training recipe (op=matmul:
    # every linear layer's three GEMMs in fp8, ops/quantize.py fp8_linear). Else its fp8 paths are forward-only and
    # bench-train refuses the point (lab/configure.py check_train_rules)
    trains_quantized: bool = False
    # What a row is and its batch axis (BatchAxis): the batch-invariance check; None: not measured for this op
    batch_axis: BatchAxis | None = None
    # Cost models per kind of path, {name: (case, cfg) -> Costs}: what each kind executes and moves (Impl.cost_model
    # names one); `costs` stays the op's floor, what a path that declares none is placed with
    path_costs: dict[str, Callable[[Case, LabConfig], Costs]] = field(default_factory=dict)
    # How a user path is called in its worker (lab/isolation/worker.py): "function" (the natural signature), or "module"
    # (a problem file's ModelNew: an nn.Module class built there with the call's init inputs, then called with
    # its inputs and the reference's parameters and buffers by name: ops/problem/definition.py)
    user_call: str = "function"
    # The op's own check of a user path's target, read from its file, never run (a ModelNew's signatures)
    check_user: Callable[[Any], None] | None = None
    # Why bench-train trains none of this op's paths (no model hook: a problem file's op); None: it trains them
    no_model: str | None = None
    # The name `posttrainllm new-impl` gives the template's callable (default: the op's name)
    template_name: str = ""

    @property
    def reference(self) -> Impl:
        return self.impls[REFERENCE]

    @property
    def curve_axes(self) -> list[CurveAxis]:
        """Every axis the microbench measures a curve over: x_name (curve_sizes, curve_case) first."""
        return [CurveAxis(self.x_name, self.curve_sizes, self.curve_case), *self.extra_curves]

    def paths(self, cfg: LabConfig,
              outside: Callable[[OpDef, LabConfig, set[str]], dict[str, Impl]] | None = None) -> dict[str, Impl]:
        """The registry as it stands for this point: `impls` (or what `point_impls` makes of it), then the optional
        peers `op.peers` names, then the paths from outside (`op.user_impls`), which `outside(op, cfg, taken)`
        makes: the lab's (lab/runner.py `paths`), since such a path runs in a worker the lab starts; with
        `op.only`, those it names and the reference (the speed baseline)."""
        paths = dict(self.point_impls(cfg) if self.point_impls is not None else self.impls)
        for name in cfg.op.peers:
            if name not in self.optional_peers:
                raise ConfigError(f"op.peers: unknown {self.name} peer {name!r}: valid choices are "
                                  f"{', '.join(self.optional_peers) or 'none'}")
            paths[name] = self.optional_peers[name](cfg)
        if cfg.op.user_impls:
            if outside is None:
                raise ConfigError(f"op.user_impls={list(cfg.op.user_impls)}: a path from outside runs in a worker "
                                  "the lab starts: take the point's paths from posttrainllm.lab.runner.paths")
            paths.update(outside(self, cfg, set(paths) | set(self.impls) | set(self.optional_peers)
                                 | set(self.reserved_names)))
        for name in cfg.op.only:
            if name not in paths:
                raise ConfigError(f"op.only: {name!r} is not a path of this {self.name} point: valid choices are "
                                  f"{', '.join(paths)} (a peer needs op.peers, a kernel of your own op.user_impls)")
        if cfg.op.only:
            paths = {name: impl for name, impl in paths.items() if name == REFERENCE or name in cfg.op.only}
        return paths

    def optimized(self, cfg: LabConfig,
                  outside: Callable[[OpDef, LabConfig, set[str]], dict[str, Impl]] | None = None) -> list[Impl]:
        """The paths checked against the reference (everything but the reference itself)."""
        return [impl for name, impl in self.paths(cfg, outside).items() if name != REFERENCE]

    def costs_of(self, impl: Impl, case: Case, cfg: LabConfig) -> Costs:
        """`impl`'s own cost model at `case` (Impl.cost_model in path_costs); the floor, saying so, where it declares
        none. A name the op does not model is refused with the valid ones."""
        if impl.cost_model is None:
            return dataclasses.replace(self.costs(case, cfg), model=FLOOR, note=FLOOR_NOTE)
        if impl.cost_model not in self.path_costs:
            raise ValueError(f"{self.name} path {impl.name!r}: cost model {impl.cost_model!r} is not one of the "
                             f"op's: valid choices are {', '.join(self.path_costs) or 'none (the floor)'}")
        return self.path_costs[impl.cost_model](case, cfg)

    def gradient_names(self) -> list[str]:
        """grad_<input> for every input a gradient is asked for."""
        return [f"grad_{name}" for name in self.input_names if name not in self.nondiff_inputs]

    def expected_outputs(self, impl: Impl) -> list[str]:
        """What parity requires of `impl`: its declared forward outputs, then, when the backward is its own, a
        gradient per input (a borrowed backward's gradients are another path's; a forward-only path has none)."""
        return [*impl.outputs, *(self.gradient_names() if impl.checks_gradients else [])]

    def train_impls(self, cfg: LabConfig,
                    outside: Callable[[OpDef, LabConfig, set[str]], dict[str, Impl]] | None = None) -> list[str]:
        """The implementations bench-train runs (train.impls, or all): the reference first, the drift baseline."""
        return list(cfg.train.impls) or [name for name, impl in self.paths(cfg, outside).items() if impl.train]

    def geometry(self, impl: Impl, case: Case, cfg: LabConfig) -> dict[str, Any]:
        return impl.geometry(case, cfg) if impl.geometry else {"backend": impl.backend}


def point_dtype(cfg: LabConfig) -> torch.dtype:
    """The point's input dtype (precision.dtype)."""
    return getattr(torch, cfg.precision.dtype)


def leaves_of(inputs: Tensors) -> Tensors:
    """Fresh autograd leaves: floating-point inputs require grad; integer ones (MoE's route_idx) cannot."""
    return {name: x.detach().requires_grad_(x.is_floating_point()) for name, x in inputs.items()}


def seeded_randn(seed: int, dtype: torch.dtype, device: str) -> Callable[..., torch.Tensor]:
    """Standard-normal draws in fp32 from `seed`, cast to `dtype` on `device` (same values on every device)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)

    return randn


def check_smem(cfg: LabConfig, needed: int) -> None:
    """A tile whose programs need more shared memory than the device has (`needed`: the op's formula) is refused."""
    if needed > cfg.device.smem_bytes:
        raise ConfigError(f"tile {cfg.tile.name} with num_stages={cfg.workgroup.num_stages} needs {needed} B of shared "
                          f"memory per program, over device.smem_bytes={cfg.device.smem_bytes}")


def check_fp8_config(cfg: LabConfig, paths: str) -> None:
    """What an op's fp8 paths run (precision.quantize): e4m3 operands, fixed tiles with BLOCK_K >= 32, and the
    registry's paths only (`paths`, named in the refusal)."""
    q, name, op = cfg.precision.quantize, cfg.precision.name, cfg.op.name
    if q.format != "float8_e4m3fn":
        raise ConfigError(f"precision.quantize.format={q.format!r}: op={op}'s fp8 paths take float8_e4m3fn "
                          "operands (e5m2 is the gradients' format, precision.quantize.grad_format)")
    if cfg.tile.block_k < 32:
        raise ConfigError(f"tile.block_k={cfg.tile.block_k} under precision {name}: tl.dot on fp8 operands takes K "
                          "in steps of 32 (use a tile with block_k >= 32)")
    if cfg.tile.autotune or cfg.workgroup.autotune:
        raise ConfigError(f"tile/workgroup=auto under precision {name}: the fp8 kernel has no autotuner yet "
                          "(choose a fixed tile and workgroup)")
    for key, given in (("peers", cfg.op.peers), ("user_impls", cfg.op.user_impls)):
        if given:
            raise ConfigError(f"op.{key}={list(given)} under precision {name}: the fp8 paths are the registry's "
                              f"({paths}); a compiled or user path takes no scales yet")
