"""What several of a point's stages share: the verdict exceptions' base (ContractBroken), the parity
record's readers (which paths passed, why the others get no speed, the paths as parity recorded them),
the per-case parity check over an op's cases, and the gradient baseline's rule.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from posttrainllm.config import LabConfig
from posttrainllm.lab import parity, runner
from posttrainllm.measure import device as devices
from posttrainllm.ops.registry import NO_BACKWARD, REFERENCE, Case, Impl, OpDef, Tensors
from posttrainllm.lab.oracle import worst_gradient_baseline  # noqa: F401 (the stages')
from posttrainllm.lab.oracle import judge_path as check_path  # noqa: F401 (parity's, the timed checks')
from posttrainllm.track import failures
from posttrainllm.track.records import ParityRecord, ReferenceRecord


F = TypeVar("F", bound=Callable[..., Any])


def on_same_cpus(stage: F) -> F:
    """A timed stage (`stage(cfg, ...)`) run on bench.threads CPUs fixed for its length (rule same_cpus,
    measure/device.py `same_cpus`): every path it times, in process or in a worker, runs on the same CPUs."""

    @functools.wraps(stage)
    def pinned(cfg: LabConfig, *args: Any, **kwargs: Any) -> Any:
        with devices.same_cpus(cfg.bench.threads):
            return stage(cfg, *args, **kwargs)

    return pinned  # type: ignore[return-value]


INTERPRETER_NOT_SPEED = "Triton ran through its interpreter (TRITON_INTERPRET=1): a correctness run, not kernel speed"


FAILED_PARITY = "failed parity: no speed number"


class ContractBroken(RuntimeError):
    """A path broke its numerical contract; the stage's report is already written."""


def to_cpu(tensors: Tensors) -> Tensors:
    return {k: v.detach().cpu() for k, v in tensors.items()}


def runs_interpreted(impl: Impl) -> bool:
    return impl.kind == "triton" and devices.triton_interpreted()


def load_reference(out: Path) -> ReferenceRecord:
    return ReferenceRecord.read(out / ReferenceRecord.FILE)


def refusals(out: Path) -> dict[str, str]:
    """Why each path that did not pass parity gets no speed: FAILED_PARITY, or that it cannot run here and why
    (none where no parity stage ran: a curve of the paths it is given)."""
    found: dict[str, str] = {}
    record = ParityRecord.read_optional(out / ParityRecord.FILE)
    for name, p in (record.paths if record else {}).items():
        if p.verdict == failures.CANNOT_RUN_HERE:
            gap = p.cannot_run_here
            found[name] = f"{failures.CANNOT_RUN_HERE}: {gap['reason']} (runs on {gap['runs_on']}): no speed"
        elif p.verdict != "pass":
            found[name] = FAILED_PARITY
    return found


ADVERSARIAL_NOTE = ("adversarial-input cases (large, growing and near one-hot logits) are held to the max-error "
                    "rules, per tensor and per row, not to the elementwise atol/rtol count: at their magnitudes "
                    "(scores to ±40, gradients to ~26) the plain reference math in the same precision is itself "
                    "outside atol/rtol on up to 26% of elements (bf16/fp16) and 0.05% (fp32). Input kinds in "
                    "the op's forward_only_inputs (attention: near_one_hot) check the forward outputs only")


def backward_note(impl: Impl) -> str:
    """Why a path's gradients are not checked as its own (Impl.backward)."""
    if impl.backward == NO_BACKWARD:
        return "none: a forward-only path (no gradients, no forward+backward time, no training)"
    return f"not checked: the backward is borrowed from the {impl.backward!r} path's math, not this path's"


def passed_parity(out: Path) -> dict[str, bool]:
    """Which paths may carry speed numbers: the reference, and every path whose parity verdict is pass."""
    verdicts = {name: p.verdict == "pass" for name, p in ParityRecord.read(out / ParityRecord.FILE).paths.items()}
    return {REFERENCE: True, **verdicts}


def parity_paths(op: OpDef, cfg: LabConfig, out: Path) -> dict[str, Impl]:
    """The point's paths with each one's backward as parity.json recorded it (a user path's result may declare
    it forward-only) and, for a path that launched Triton kernels (a user's), kind "triton" when interpreted."""
    record = ParityRecord.read_optional(out / ParityRecord.FILE)
    recorded = record.paths if record else {}
    paths = {}
    for name, impl in runner.paths(op, cfg).items():
        entry = recorded.get(name)
        if entry is not None:  # the reference has none: parity does not judge it
            impl = dataclasses.replace(impl, backward=entry.backward)
            if impl.kind != "triton" and entry.launched:
                impl = dataclasses.replace(impl, kind="triton")  # it runs Triton: interpreted, it is not speed
        paths[name] = impl
    return paths
