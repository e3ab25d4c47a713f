"""Approval for fresh device loops: GPU time is scarce, so timing loops on a GPU start only when asked.

Before a command that would run timing loops on a GPU (`bench`, `bench-train`, `experimental train-heads`, the timed DVC
stages, the prepared GPU check) does any work, it estimates the device time the loops will take
from the config, and refuses (exit 2, one line with the estimate) unless approval is given:
`run.approve=true`, or the environment variable POSTTRAINLLM_APPROVE=1 (what `dvc repro` and a
batch job use). The CPU needs no approval: its loops cost nothing scarce.

The estimate is a floor, from config alone (nothing is run to make it):
    loops   = points x timed paths x (2 modes on the point's shape + one per curve size)
    seconds = loops x max(bench.min_time_s, bench.reps x call_s)  +  points x timed paths x train.steps x step_s
where a timing loop runs at least `bench.reps` calls and until `bench.min_time_s` is spent
(posttrainllm/measure/timing.py), and call_s / step_s are a nominal 1 ms call and 50 ms
training step (a loop can take longer: at most `bench.max_reps` calls).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from posttrainllm.config import LabConfig
from posttrainllm.measure import device as devices
from posttrainllm.opdefs import get_op

ENV = "POSTTRAINLLM_APPROVE"
NOMINAL_CALL_S = 1e-3
NOMINAL_STEP_S = 50e-3


class NotApproved(RuntimeError):
    """Timing loops on a GPU without approval; the message is the one line to print."""


@dataclass
class Estimate:
    points: int
    loops: int  # timing loops of the microbench (point's shape, both modes, and every curve size)
    train_steps: int  # training steps of bench-train, every variant
    seconds: float

    def line(self) -> str:
        train = f" + {self.train_steps} training steps" if self.train_steps else ""
        return (f"{self.points} point(s): {self.loops} timing loops{train}, at least ~{self.seconds:.0f} s "
                "of device time")


def estimate(labs: list[LabConfig], *, train: bool, microbench: bool = True, heads: bool = False) -> Estimate:
    """The device time the timing loops of these points will take, at least (module docstring).

    heads (`experimental train-heads`): the base's and the heads' training steps (the base's even when it
    will be reused: a ceiling there), and the decode measurement, plain and speculative, over
    (eval_prompts + warmup_prompts) prompts of new_tokens tokens, one nominal call per token.
    """
    loops, steps, seconds = 0, 0, 0.0
    for lab in labs:
        if heads:
            h = lab.heads
            steps += h.base.steps + h.steps
            loops += 2
            seconds += (h.base.steps + h.steps) * NOMINAL_STEP_S
            seconds += 2 * (h.eval_prompts + h.warmup_prompts) * h.new_tokens * NOMINAL_CALL_S
            continue
        op = get_op(lab.op.name)
        paths = len(op.paths(lab))  # every path passes parity at best; Triton included on a GPU
        if microbench:
            n = paths * (2 + len(op.curve_sizes(lab)))
            loops += n
            seconds += n * max(lab.bench.min_time_s, lab.bench.reps * NOMINAL_CALL_S)
        if train:
            s = len(op.train_impls(lab)) * lab.train.steps
            steps += s
            seconds += s * NOMINAL_STEP_S
    return Estimate(points=len(labs), loops=loops, train_steps=steps, seconds=seconds)


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
