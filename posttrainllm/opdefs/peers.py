"""The peers users reach for instead of writing a kernel, built in and opt-in (`op.peers=[compiled]`).

    compiled    the op's readable reference under `torch.compile` (inductor): what a user gets for free.
                Every op has it.

One compiled function per input signature (shapes, dtypes, whether they need gradients), each compiled for
static sizes on its first call: a point's cases and curve sizes are many shapes, and one torch.compile object
would reach dynamo's recompile limit (8) and then run the reference eagerly under the peer's name. The kernel
stage times the main case's first call apart as `compile_s` (kernel.json), the microbench's `first_call_ms`
is the same for the timed shape, and its warm-up absorbs the compile before any timed call. Inductor's on-disk
cache (its default) makes a second process's compile of the same graph quicker.
"""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace
from typing import Any, Callable

import torch

from posttrainllm.config import LabConfig
from posttrainllm.opdefs.base import Case, Impl, Tensors

COMPILED = "compiled"
_COMPILED: dict[tuple, Callable[..., Any]] = {}


_PLAIN: dict[int, tuple[LabConfig, SimpleNamespace]] = {}


def _plain(value: Any) -> Any:
    """A dataclass tree as SimpleNamespaces, read with object.__getattribute__: what the compiled reference sees.

    The DVC stages record config reads by replacing the config classes' __getattribute__ (track/stamp.py), which
    dynamo cannot trace (it recursed); the plain copy is read outside the recording, once per config object."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return SimpleNamespace(**{f.name: _plain(object.__getattribute__(value, f.name))
                                  for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def plain_config(cfg: LabConfig) -> SimpleNamespace:
    if id(cfg) not in _PLAIN or _PLAIN[id(cfg)][0] is not cfg:
        _PLAIN[id(cfg)] = (cfg, _plain(cfg))
    return _PLAIN[id(cfg)][1]


def _signature(x: Tensors) -> tuple:
    return tuple((name, tuple(t.shape), t.dtype, t.device.type, t.requires_grad) for name, t in sorted(x.items()))


def compiled(op_name: str, reference: Callable[[Tensors, LabConfig], Tensors], make_inputs: Callable[..., Tensors],
             backend: str) -> Callable[[LabConfig], Impl]:
    """The `compiled` peer of an op: its reference function under torch.compile, one per input signature."""

    def fn(x: Tensors, cfg: LabConfig) -> Tensors:
        key = (op_name, _signature(x))
        if key not in _COMPILED:
            _COMPILED[key] = torch.compile(reference, dynamic=False)
        return _COMPILED[key](x, plain_config(cfg))

    def make(cfg: LabConfig) -> Impl:
        return Impl(COMPILED, "peer", fn, train=False, backend=f"torch.compile({backend})",
                    geometry=first_call_geometry(fn, make_inputs, f"torch.compile({backend})"))

    return make


def first_call_geometry(fn: Callable[[Tensors, LabConfig], Tensors], make_inputs: Callable[..., Tensors],
                        backend: str) -> Callable[[Case, LabConfig], dict[str, Any]]:
    """A compiled path's geometry: its backend and the seconds of its first call on the point's case (the
    compile, reported apart from every timed call)."""

    def geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
        device = "cuda" if cfg.device.name == "cuda" or (cfg.device.name == "auto" and torch.cuda.is_available()) \
            else "cpu"
        x = make_inputs(case, getattr(torch, cfg.precision.dtype), device)
        start = time.perf_counter()
        with torch.no_grad():
            fn(x, cfg)
        if device == "cuda":
            torch.cuda.synchronize()
        return {"backend": backend, "compile_s": round(time.perf_counter() - start, 3),
                "compile_note": "the first call at the point's shape (forward): compile included; never timed"}

    return geometry
