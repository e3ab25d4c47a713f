"""Approval for fresh device loops: GPU time is scarce, so timing loops on a GPU start only when asked.

Before a command that would run timing loops on a GPU (`bench`, `bench-train`, `experimental train-heads`, the timed DVC
stages, the prepared GPU check) does any work, it estimates the device time the loops will take
from the config, and refuses (exit 2, one line with the estimate) unless approval is given:
`run.approve=true`, or the environment variable POSTTRAINLLM_APPROVE=1 (what `dvc repro` and a
batch job use). The CPU needs no approval: its loops cost nothing scarce.

The estimate is a floor, from config alone (nothing is run to make it):
    loops   = points x timed paths x (2 modes on the point's shape + curve sizes x curve modes)
    seconds = loops x max(bench.min_time_s, bench.reps x call_s)  +  points x timed paths x train.steps x step_s
where a timing loop runs at least `bench.reps` calls and until `bench.min_time_s` is spent
(posttrainllm/measure/timing.py), and call_s / step_s are a nominal 1 ms call and 50 ms
training step (a loop can take longer: at most `bench.max_reps` calls). The curve sizes are those of
every curve axis of the op; its modes are forward, and forward + backward with bench.curve_backward.
A forward-only path (Impl.backward "none": fp8's) is timed forward alone; a quantized point's microbench times
one more loop, the bf16 GEMM of its unquantized operands (ops/matmul/definition.py), and its bench-train trains each
path by the fp8 recipe plus a bf16 baseline (its quality gate's decoding is not counted: ~256 tokens).

Each point also gets a rough expectation on a GPU (`PointEstimate.rough_s`, what the prepared GPU
check prints and budgets with), from the op's own FLOP formulas and the ROUGH_* constants below. No
GPU run has measured them yet: they are readings of an H200 made elsewhere (~790 TFLOP/s for an
8192³ bf16 matmul through PyTorch, ~4.3 TB/s device copy) derated for unfused paths, plus guesses of
the fixed costs. Compare them with the
`seconds` each point took (summary.json) after the first run, and correct them here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from posttrainllm.config import LabConfig
from posttrainllm.measure import device as devices
from posttrainllm.ops.registry import NO_BACKWARD, op_for
from posttrainllm.lab.isolation.user import user_paths  # the paths from outside: a spec read, nothing run

ENV = "POSTTRAINLLM_APPROVE"
NOMINAL_CALL_S = 1e-3
NOMINAL_STEP_S = 50e-3

# The rough expectation on a GPU (module docstring): rough, unmeasured; correct them after a first run.
ROUGH_FLOPS_PER_S = 2e14  # a quarter of the H200's measured bf16 GEMM rate: the unfused reference paths, memory-bound
ROUGH_MIN_CALL_S = 2e-5  # a launch-bound call (small sizes)
ROUGH_REP_OVERHEAD_S = 2e-4  # per timed call: the 256 MB L2 flush (~0.1 ms at ~4 TB/s) and the event sync
# reference (float64 oracle of every case, saved: ~1-3 GB at the GPU check's shapes), kernel (every path, saved),
# parity on the CPU (~1.2 s per 8M-element output on one 2-core-machine thread, measured; the GPU check uses every
# core), receipt, Triton JIT compiles
ROUGH_POINT_S = 40.0
ROUGH_CHECK_S = 2.0  # per curve size: the float64 oracle, every path's output compared on the CPU
ROUGH_AUTOTUNE_S = 60.0  # tile/workgroup=auto: ~30 configurations of forward, dK/dV and dQ compiled and timed
ROUGH_TRAIN_S = 15.0  # bench-train's fixed cost per point: model, corpus, profiled steps


class NotApproved(RuntimeError):
    """Timing loops on a GPU without approval; the message is the one line to print."""


@dataclass
class PointEstimate:
    name: str  # run.name
    loops: int
    train_steps: int
    seconds: float  # the floor
    rough_s: float  # the rough expectation on a GPU (ROUGH_*)


@dataclass
class Estimate:
    points: int
    loops: int  # timing loops of the microbench (point's shape, both modes, and every curve size and mode)
    train_steps: int  # training steps of bench-train, every variant
    seconds: float
    per_point: list[PointEstimate] = field(default_factory=list)

    def line(self) -> str:
        train = f" + {self.train_steps} training steps" if self.train_steps else ""
        return (f"{self.points} point(s): {self.loops} timing loops{train}, at least ~{self.seconds:.0f} s "
                "of device time")


def _loop_s(call_s: float, lab: LabConfig) -> float:
    """One timing loop (timing.measure), then one memory call: warmup + n calls, each with the flush."""
    b = lab.bench
    n = min(b.max_reps, max(b.reps, math.ceil(b.min_time_s / call_s)))
    return (b.warmup + n + 1) * (call_s + ROUGH_REP_OVERHEAD_S)


def _call_s(flops: float) -> float:
    return max(ROUGH_MIN_CALL_S, flops / ROUGH_FLOPS_PER_S)


def _timed_paths(lab: LabConfig) -> tuple[int, int, int]:
    """The point's paths timed forward, those timed forward + backward too (not a forward-only path), and the
    extra loops of its own (a quantized point's bf16 GEMM beside its paths)."""
    impls = op_for(lab).paths(lab, user_paths).values()  # every path passes parity at best; Triton included on a GPU
    return len(impls), sum(impl.backward != NO_BACKWARD for impl in impls), int(lab.precision.quantize is not None)


def _trained(lab: LabConfig) -> int:
    """The models bench-train trains: one per path it takes, plus a quantized point's bf16 baseline."""
    return len(op_for(lab).train_impls(lab, user_paths)) + int(lab.precision.quantize is not None)


def rough_seconds(lab: LabConfig, *, train: bool) -> float:
    """The rough expectation of one point on a GPU (module docstring): fixed costs, then every timing loop
    with its call time from the op's FLOPs at that size and mode."""
    op = op_for(lab)
    forward, backward, extra = _timed_paths(lab)
    seconds = ROUGH_POINT_S + (ROUGH_AUTOTUNE_S if lab.tile.autotune or lab.workgroup.autotune else 0.0)
    main = op.costs(next(c for c in op.cases(lab) if c.main), lab)
    seconds += (forward + extra) * _loop_s(_call_s(main.flops), lab)
    seconds += backward * _loop_s(_call_s(main.train_flops), lab)
    for axis in op.curve_axes:
        for x in axis.sizes(lab):
            costs = op.costs(axis.case(lab, x), lab)
            seconds += ROUGH_CHECK_S + forward * _loop_s(_call_s(costs.flops), lab)
            if lab.bench.curve_backward:
                seconds += backward * _loop_s(_call_s(costs.train_flops), lab)
    if train and (backward or extra):  # a quantized point trains its forward-only paths by the fp8 recipe
        seconds += ROUGH_TRAIN_S + _trained(lab) * lab.train.steps * NOMINAL_STEP_S
    return seconds


def estimate(labs: list[LabConfig], *, train: bool, microbench: bool = True, heads: bool = False) -> Estimate:
    """The device time the timing loops of these points will take, at least (module docstring).

    heads (`experimental train-heads`): the base's and the heads' training steps (the base's even when it
    will be reused: a ceiling there), and the decode measurement, plain and speculative, over
    (eval_prompts + warmup_prompts) prompts of new_tokens tokens, one nominal call per token.
    Op points (microbench) also get their rough expectation on a GPU, per point.
    """
    loops, steps, seconds, per_point = 0, 0, 0.0, []
    for lab in labs:
        if heads:
            h = lab.heads
            steps += h.base.steps + h.steps
            loops += 2
            seconds += (h.base.steps + h.steps) * NOMINAL_STEP_S
            seconds += 2 * (h.eval_prompts + h.warmup_prompts) * h.new_tokens * NOMINAL_CALL_S
            continue
        op = op_for(lab)
        forward, backward, extra = _timed_paths(lab)
        n = s = 0
        floor = 0.0
        if microbench:
            sizes = sum(len(axis.sizes(lab)) for axis in op.curve_axes)
            n = forward * (1 + sizes) + backward * (1 + (sizes if lab.bench.curve_backward else 0)) + extra
            floor += n * max(lab.bench.min_time_s, lab.bench.reps * NOMINAL_CALL_S)
        if train and (backward or extra):
            s = _trained(lab) * lab.train.steps
            floor += s * NOMINAL_STEP_S
        loops, steps, seconds = loops + n, steps + s, seconds + floor
        if microbench:
            per_point.append(PointEstimate(lab.run.name, n, s, floor, rough_seconds(lab, train=train)))
    return Estimate(points=len(labs), loops=loops, train_steps=steps, seconds=seconds, per_point=per_point)


def approved(lab: LabConfig | None = None) -> bool:
    return (lab is not None and lab.run.approve) or os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes")


def needs_approval(labs: list[LabConfig]) -> bool:
    """Whether any of these points would time on a GPU."""
    return any(devices.resolve(lab.device.name) == "cuda" for lab in labs)


def check(labs: list[LabConfig], *, train: bool, what: str, microbench: bool = True,
          heads: bool = False) -> Estimate | None:
    """Raise NotApproved when these points would run timing loops on a GPU without approval.

    Returns the estimate when they run on a GPU (approved), None on the CPU.
    """
    if not needs_approval(labs):
        return None
    found = estimate(labs, train=train, microbench=microbench, heads=heads)
    if not all(approved(lab) for lab in labs):
        raise NotApproved(f"{what} would run timing loops on the GPU: {found.line()}; approve with run.approve=true "
                          f"or {ENV}=1")
    return found
