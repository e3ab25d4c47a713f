"""The one way the lab calls a path: a runner per path, in this process or in an isolated worker.

Every path of a point (the reference, the peers, ours, a user's) is an `Impl` of the op's registry, and the
Impl says which runner it needs (`Impl.runner`): IN_PROCESS (the registry's function, called here) or ISOLATED
(a path from outside, op.user_impls: its code runs only in a worker process of its own, lab/isolation/). The
stages take the point's paths from `paths`, get each one's runner from `runner_for`, and call every path
through the same methods; none of them asks where a path came from.

    forward(inputs, cfg)               one call in the registry's dict form (outputs, differentiable)
    forward_backward(inputs, dO, cfg)  a training-shaped call, for timing
    identity()                         what the path's records carry of where it came from (kernel.json,
                                       parity.json, the receipt): {} for the registry's, {"user": ...}
    describe(exc)                      a failure located in the path's own code (track/failures.py)
    emulation(cfg, launched)           how it computes here unlike on the GPU (ops/__init__.py), given the
                                       Triton launches its calls made
    kernels_known_by_launch            its Triton kernels are known only from the launches counted as it ran
    may_launch_triton                  whether the kernel stage starts the compile child for it up front
    declared_backward(record, cfg, d)  the backward its result declares ("none" when its output has no
                                       autograd history)
    evidence()                         what the path recorded of its calls (compiled: dynamo's graphs; a
                                       worker: its start and the promises its function declares)
    time(...), curve_row(...)          the microbench's figures and one curve row (outside its worker for an
                                       isolated path: lab/isolation/outside.py)
    before_training(), training_note() what bench-train records of the path's calls beside its steps
    loaded_here(op)                    the path's function loaded into this process (the compile child)
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from posttrainllm.config import LabConfig
from posttrainllm.lab.isolation import outside, rooms
from posttrainllm.lab.isolation.worker import closed_after  # noqa: F401 (a stage's workers end with it)
from posttrainllm.lab.isolation.outside import continued  # noqa: F401 (rule lab_stopped: the lab's stops)
from posttrainllm.lab.isolation.user import user_paths
from posttrainllm.lab.oracle import Upstream, backward
from posttrainllm.measure.memory import peak_bytes
from posttrainllm.measure.timing import Timing, measure
from posttrainllm.ops.registry import NO_BACKWARD, REFERENCE, Case, Impl, OpDef, Tensors
from posttrainllm.ops.base import IN_PROCESS, ISOLATED, leaves_of, point_dtype
from posttrainllm.track import failures


def paths(op: OpDef, cfg: LabConfig) -> dict[str, Impl]:
    """The point's paths (OpDef.paths), the paths from outside included (lab/isolation/user.py)."""
    return op.paths(cfg, user_paths)


def outside_files(op: OpDef, cfg: LabConfig) -> dict[str, str]:
    """{file: sha256} of the point's paths from outside (each Impl's source, as resolved): the stamps of the stages
    that run them hash them (lab/reads.py `outside_sources`)."""
    return {impl.source.identity["file"]: impl.source.identity["sha256"] for impl in paths(op, cfg).values()
            if impl.source is not None}


def optimized(op: OpDef, cfg: LabConfig) -> list[Impl]:
    """The paths checked against the reference (everything but the reference itself)."""
    return [impl for name, impl in paths(op, cfg).items() if name != REFERENCE]


def train_impls(op: OpDef, cfg: LabConfig) -> list[str]:
    """The implementations bench-train runs (OpDef.train_impls), the paths from outside included."""
    return op.train_impls(cfg, user_paths)


def first_call_ms(call: Callable[[], Any], device: str) -> float:
    """One untimed-region call before the warm-up, timed on its own: a compiled peer's compile, a cold cache."""
    start = time.perf_counter()
    call()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


@dataclass
class Timed:
    """A path's microbench figures at the point's shape: forward and forward + backward (None: not timed), the
    peak memory of one forward, the first call's ms, why its figures are no speed (None: they may be), and what
    its runner records beside them."""

    forward: Timing | None
    train: Timing | None
    memory: dict[str, Any]
    first_call_ms: float
    refused: str | None
    entry: dict[str, Any] = field(default_factory=dict)


class InProcess:
    """A path called in the lab's own process: the registry's function (the reference, the peers, ours)."""

    kernels_known_by_launch = False

    def __init__(self, impl: Impl) -> None:
        self.impl = impl

    # -- calls --------------------------------------------------------------------------------------------------
    def forward(self, inputs: Tensors, cfg: LabConfig) -> Tensors:
        return self.impl.fn(inputs, cfg)

    def forward_backward(self, inputs: Tensors, grad_out: Upstream, cfg: LabConfig) -> Callable[[], None]:
        """One training-shaped call: forward, then backward of its differentiable outputs with fixed dOs into fresh
        leaves (oracle.backward)."""
        leaves = leaves_of(inputs)

        def call() -> None:
            for leaf in leaves.values():
                leaf.grad = None
            backward(self.forward(leaves, cfg), grad_out)

        return call

    def loaded_here(self, op: OpDef) -> Callable[[Tensors, LabConfig], Tensors]:
        return self.impl.fn

    # -- what its records say --------------------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        return {}

    def describe(self, exc: BaseException) -> dict[str, Any]:
        return failures.describe(exc, user=False)

    @property
    def may_launch_triton(self) -> bool:
        return self.impl.kind == "triton" or self.kernels_known_by_launch

    def emulation(self, cfg: LabConfig, launched: Counter | None = None) -> str | None:
        from posttrainllm.ops import interpreter_emulation

        if self.impl.kind != "triton":
            return None
        return interpreter_emulation(point_dtype(cfg), quantized=cfg.precision.quantize is not None)

    def declared_backward(self, record: dict[str, Any], cfg: LabConfig, device: str) -> str:
        return self.impl.backward

    def evidence(self) -> dict[str, Any]:
        return {"evidence": self.impl.evidence()} if self.impl.evidence is not None else {}

    # -- timing ---------------------------------------------------------------------------------------------------
    def time(self, op: OpDef, cfg: LabConfig, case: Case, sets: list[Tensors], grad_outs: list[torch.Tensor],
             device: str, settings: dict[str, Any]) -> Timed:
        """The path at the point's shape, in its own buffers (`sets`): forward, forward + backward (with a backward),
        peak memory of one forward, the first call's ms; what it changed of torch's state refuses it
        (rule "torch_state"). The timed repetitions rotate over `sets` (lab/isolation/rooms.py); the first call and
        the memory use the first set."""
        with rooms.StateGuard() as guard:  # from the first call on: a path may change torch's state in any call
            with torch.no_grad():
                first = first_call_ms(lambda: self.forward(sets[0], cfg), device)
                forward = measure(rooms.rotating([lambda x=x: self.forward(x, cfg) for x in sets]), device=device,
                                  batched=True, **settings)
                memory = peak_bytes(lambda: self.forward(sets[0], cfg), device, warmup=0)
            train = None if self.impl.backward == NO_BACKWARD else measure(
                rooms.rotating([self.forward_backward(x, g, cfg) for x, g in zip(sets, grad_outs)]), device=device,
                batched=True, **settings)
        return Timed(forward, train, memory, first, guard.reason)

    def curve_row(self, op: OpDef, cfg: LabConfig, case: Case, mode: str, sets: list[Tensors],
                  grad_outs: list[torch.Tensor], device: str, settings: dict[str, Any], check: str,
                  labels: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        """One curve row (curves.measure_row's columns) in `mode`, rotating over `sets`, and what the calls changed
        of torch's state (None: nothing)."""
        from posttrainllm.measure import curves

        if mode == curves.FORWARD:
            calls = [lambda s=s: self.forward(s, cfg) for s in sets]
        else:
            calls = [self.forward_backward(s, g, cfg) for s, g in zip(sets, grad_outs)]
        with torch.set_grad_enabled(mode != curves.FORWARD), rooms.StateGuard() as guard:
            row = curves.measure_row(rooms.rotating(calls), device=device, settings=settings, check=check,
                                     labels=labels)
        return row, guard.reason

    # -- training -------------------------------------------------------------------------------------------------
    def before_training(self) -> Any:
        return None

    def training_note(self, before: Any, steps: int, device: str) -> dict[str, Any] | None:
        return None


class Isolated(InProcess):
    """A path from outside, in a worker process of its own (lab/isolation/worker.py): `Impl.fn` is the op's
    adapter around the worker's proxy, and `Impl.source` the resolved path (lab/isolation/user.py). Timed from
    outside its worker (lab/isolation/outside.py)."""

    kernels_known_by_launch = True  # the worker counts its launches: known once it ran

    def loaded_here(self, op: OpDef) -> Callable[[Tensors, LabConfig], Tensors]:
        return op.adapt(self.impl.source.load())

    def identity(self) -> dict[str, Any]:
        return {"user": self.impl.user}

    def describe(self, exc: BaseException) -> dict[str, Any]:
        return failures.describe(exc, user=True)

    def emulation(self, cfg: LabConfig, launched: Counter | None = None) -> str | None:
        """Its worker's patched interpreter, where it launched Triton kernels at a bf16 point (ops/__init__.py)."""
        from posttrainllm.ops import USER_BF16_INTERPRETER_REASON, interpreter_emulation

        if launched and cfg.precision.quantize is None:
            return USER_BF16_INTERPRETER_REASON if interpreter_emulation(point_dtype(cfg)) else None
        return super().emulation(cfg, launched)

    def declared_backward(self, record: dict[str, Any], cfg: LabConfig, device: str) -> str:
        """"none" when `out` of a call on inputs that require grad has no autograd history (forward-only, not an
        error), else the Impl's. A call that raises is left to the guarded calls, which record it."""
        if not self.impl.checks_gradients:
            return self.impl.backward
        try:
            out = self.forward(leaves_of(rooms.fresh(record["inputs"], device)), cfg).get("out")
        except Exception:
            return self.impl.backward
        return NO_BACKWARD if isinstance(out, torch.Tensor) and not out.requires_grad else self.impl.backward

    def evidence(self) -> dict[str, Any]:
        # its worker process's start (spawn, import torch, its module), never timed; its function's `promises`
        return {**super().evidence(), "worker_start_s": outside.worker_start_s(self.impl),
                "promises": outside.promises(self.impl)}

    def time(self, op: OpDef, cfg: LabConfig, case: Case, sets: list[Tensors], grad_outs: list[torch.Tensor],
             device: str, settings: dict[str, Any]) -> Timed:
        """Timed from outside its worker (lab/isolation/outside.py); its memory is its worker's (rule
        outside_memory)."""
        timed = outside.microbench_times(op, cfg, case, self.impl, device, settings,
                                         self.impl.backward != NO_BACKWARD)
        with torch.no_grad():
            first = first_call_ms(lambda: self.forward(sets[0], cfg), device)
        memory, untrue = outside.user_memory(op, cfg, case, self.impl, device)
        return Timed(timed.forward, timed.train, memory, first, timed.refused or untrue, timed.entry)

    def curve_row(self, op: OpDef, cfg: LabConfig, case: Case, mode: str, sets: list[Tensors],
                  grad_outs: list[torch.Tensor], device: str, settings: dict[str, Any], check: str,
                  labels: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        return outside.curve_row(op, cfg, case, self.impl, mode, device, settings, check, labels), None

    def before_training(self) -> Any:
        """Its worker started before any training clock (a start is never in a step), and its calls so far."""
        return outside.start_workers({self.impl.name: self.impl}).get(self.impl.name)

    def training_note(self, before: Any, steps: int, device: str) -> dict[str, Any] | None:
        """Its worker's start, calls per step and empty round trip (outside.TRAIN_NOTE); None if it never started."""
        if before is None:
            return None
        return outside.train_note({self.impl.name: self.impl}, {self.impl.name: before}, steps,
                                  device)[self.impl.name]


RUNNERS: dict[str, type[InProcess]] = {IN_PROCESS: InProcess, ISOLATED: Isolated}


def runner_for(impl: Impl) -> InProcess:
    """The runner `impl` needs (Impl.runner); an unknown one is refused with the valid choices."""
    if impl.runner not in RUNNERS:
        raise ValueError(f"path {impl.name!r}: runner {impl.runner!r}: valid choices are {', '.join(RUNNERS)}")
    return RUNNERS[impl.runner](impl)


def training_notes(runs: dict[str, InProcess], before: dict[str, Any], steps: int,
                   device: str) -> dict[str, Any] | None:
    """bench_train.json's `user_paths`: what each path's calls cost beside its steps, where its runner says
    (a worker's start, calls per step and round trip: outside.TRAIN_NOTE); None where none does."""
    notes = {name: note for name, run in runs.items()
             if (note := run.training_note(before[name], steps, device)) is not None}
    return {"note": outside.TRAIN_NOTE, **notes} if notes else None
