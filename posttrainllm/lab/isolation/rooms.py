"""Every path in its own room: what one path does to tensors or to torch's state never reaches another.

- Fresh tensors: each path gets its own copy of a case's inputs and of its upstream gradient, on every device
  (on a CPU `.to(device)` would hand every path the very same tensor), so a path that writes into them changes
  no other path's inputs, and the guards see the write (lab/isolation/guards.py).
- Input sets: the timed repetitions rotate over several distinct sets of inputs, each drawn like the point's
  (the case at other seeds) in buffers of its own, so a result stored for inputs seen before is never the
  answer to the next repetition.
- Torch's state: the thread count, grad mode, anomaly detection, default dtype and the `torch.backends`
  flags are read before and after every timed region; a change is named (the path gets no speed) and put
  back, so the next path starts where the lab set it.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

import torch

from posttrainllm.measure import timing
from posttrainllm.ops.registry import Case, OpDef, Tensors

INPUT_SET_SEED = 7_919  # case.seed + i * INPUT_SET_SEED: the i-th timed set (i = 0: the case's own; rule rotation)


def fresh(tensors: Tensors, device: str) -> Tensors:
    """A copy of every tensor on `device`, sharing no storage with the originals."""
    return {name: x.to(device, copy=True) for name, x in tensors.items()}


def input_sets(op: OpDef, case: Case, dtype: torch.dtype, device: str, n: int) -> list[tuple[Case, Tensors]]:
    """`n` distinct input sets drawn like the case's (the first is the case's own), each in buffers of its own."""
    cases = [case if i == 0 else dataclasses.replace(case, seed=case.seed + i * INPUT_SET_SEED) for i in range(n)]
    return [(c, op.make_inputs(c, dtype, device)) for c in cases]


TIMED_SETS_MAX_BYTES = 256 * 2**20  # the extra sets a CPU point draws (timed_input_sets) hold at most this much


def timed_input_sets(op: OpDef, case: Case, dtype: torch.dtype, device: str, bench: Any) -> list[tuple[Case, Tensors]]:
    """The distinct input sets an in-process path's timed calls rotate over (rule rotation): bench.input_sets, and
    on a CPU as many as a batch has calls at most (measure/timing.py batch_size), within TIMED_SETS_MAX_BYTES, so a
    batch reads as many distinct sets as an outside batch does (each fresh: lab/isolation/outside.py; what the
    count costs a call is measured in docs/timing.md). On CUDA the L2 is flushed before every call, so the count
    does not change what a call reads."""
    if device == "cuda":
        return input_sets(op, case, dtype, device, bench.input_sets)
    one = op.make_inputs(case, dtype, device)
    set_bytes = max(sum(x.numel() * x.element_size() for x in one.values()), 1)
    wanted = min(timing.BATCH_MAX, bench.max_reps // timing.BATCHES_MIN, TIMED_SETS_MAX_BYTES // set_bytes)
    return input_sets(op, case, dtype, device, max(bench.input_sets, wanted))


def rotating(calls: list[Callable[[], Any]]) -> Callable[[], Any]:
    """One callable that runs `calls` in turn, one per call: each timed repetition gets the next input set."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def _backend_flags() -> dict[str, Any]:
    """The process-wide `torch.backends` switches a path could flip to change another path's speed or numbers."""
    backends = torch.backends
    flags = {"cudnn.enabled": backends.cudnn.enabled, "cudnn.benchmark": backends.cudnn.benchmark,
             "cudnn.deterministic": backends.cudnn.deterministic, "mkldnn.enabled": backends.mkldnn.enabled,
             "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}
    # its fp32_precision, not torch.get_float32_matmul_precision(): that legacy getter raises once the new API has
    # set a backend's precision (measure/device.py fp32_matmuls does)
    cuda_matmul = backends.cuda.matmul
    for name in ("fp32_precision", "allow_fp16_reduced_precision_reduction",
                 "allow_bf16_reduced_precision_reduction"):
        if hasattr(cuda_matmul, name):
            flags[f"cuda.matmul.{name}"] = getattr(cuda_matmul, name)
    for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled"):
        if hasattr(backends.cuda, name):
            flags[f"cuda.{name}"] = getattr(backends.cuda, name)()
    return flags


def torch_state() -> dict[str, Any]:
    """What a timed region runs under and no path may change: threads, grad mode, anomaly detection, default
    dtype, backends flags."""
    return {"threads": torch.get_num_threads(), "grad_enabled": torch.is_grad_enabled(),
            "anomaly_detection": torch.is_anomaly_enabled(), "default_dtype": str(torch.get_default_dtype()),
            **_backend_flags()}


def restore(state: dict[str, Any]) -> None:
    """Put back the parts of torch's state that `torch_state` read (the backends flags too)."""
    torch.set_num_threads(state["threads"])
    torch.set_grad_enabled(state["grad_enabled"])
    torch.autograd.set_detect_anomaly(state["anomaly_detection"])
    torch.set_default_dtype(getattr(torch, state["default_dtype"].removeprefix("torch.")))
    backends = torch.backends
    backends.cudnn.enabled, backends.cudnn.benchmark = state["cudnn.enabled"], state["cudnn.benchmark"]
    backends.cudnn.deterministic, backends.mkldnn.enabled = state["cudnn.deterministic"], state["mkldnn.enabled"]
    torch.use_deterministic_algorithms(state["deterministic_algorithms"])
    for key, value in state.items():
        if key.startswith("cuda.matmul."):
            setattr(backends.cuda.matmul, key.removeprefix("cuda.matmul."), value)
        elif key.startswith("cuda.") and key.endswith("_sdp_enabled"):
            getattr(backends.cuda, "enable_" + key.removeprefix("cuda.").removesuffix("_enabled"))(value)


def state_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Each part of torch's state that differs, as "threads 1 -> 2"."""
    return [f"{key} {before[key]} -> {after.get(key)}" for key in before if after.get(key) != before[key]]


class StateGuard:
    """Around one timed region: `changed` names what the region changed of torch's state (then put back)."""

    def __enter__(self) -> "StateGuard":
        self.before = torch_state()
        self.changed: list[str] = []
        return self

    def __exit__(self, *exc: Any) -> None:
        self.changed = state_changes(self.before, torch_state())
        if self.changed:
            restore(self.before)

    @property
    def reason(self) -> str | None:
        """Why the guarded region gets no speed (what it changed, put back), or None."""
        return (f"changed torch's state while timed ({'; '.join(self.changed)}): put back, no speed"
                if self.changed else None)
