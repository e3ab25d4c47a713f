"""The peers users reach for instead of writing a kernel, built in and opt-in (`op.peers=[compiled]`).

    compiled    the op's readable reference under `torch.compile` (inductor): what a user gets for free.
                Every op has it.

Compiled code, or not `compiled`. Dynamo keeps its cache and counts its recompiles (limit 8,
torch._dynamo.config.recompile_limit) per *code object*, not per torch.compile wrapper: one wrapper per input
signature around the same function still ran the reference eagerly, under this peer's name, from the ninth
signature on (a point's cases and curve sizes are many shapes). So each input signature (shapes, dtypes, device,
which need gradients, grad mode) gets a fresh copy of the reference with a code object of its own, compiled for
static sizes with fullgraph=True: a graph break or a recompile-limit hit raises instead of running eagerly. After
each call the signature's code object must hold compiled code (dynamo's cache entries) under the default compiler
stance; a call that ran eagerly raises `NotCompiled`, so the stages record the reason in its place (kernel.json's
error, curve.csv's check, microbench.json's reason) and the size gets no `compiled` time. What dynamo did per
signature (graphs, recompiles, the first call's seconds) is the path's `evidence` (kernel.json, microbench.json).

The kernel stage times the main case's first call apart as `compile_s` (kernel.json), the microbench's
`first_call_ms` is the same for the timed shape, and its warm-up absorbs the compile before any timed call.
Inductor's on-disk cache (its default) makes a second process's compile of the same graph quicker.
"""

from __future__ import annotations

import dataclasses
import time
import types
from types import SimpleNamespace
from typing import Any, Callable

import torch

from posttrainllm.config import LabConfig
from posttrainllm.ops.base import Case, Impl, Tensors

COMPILED = "compiled"


class NotCompiled(RuntimeError):
    """A compiled peer's call that would not run compiled code (it would run eagerly): no result, no time."""


@dataclasses.dataclass
class _Compiled:
    """One input signature's own compiled copy of a function, and what dynamo did with it."""

    code: types.CodeType
    call: Callable[..., Any]
    label: str
    first_call_s: float | None = None
    graphs: int = 0  # dynamo's cache entries on the copy's code object: 1, plus one per recompile
    not_compiled: str | None = None  # why its last call raised NotCompiled


_COMPILED: dict[tuple, _Compiled] = {}


def fresh_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with a code object of its own: dynamo's cache and its recompile count start empty for it."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return copy


def _compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Static sizes, one graph: a graph break raises instead of running the rest eagerly."""
    return torch.compile(fn, dynamic=False, fullgraph=True)


def _stance() -> str:
    from torch._dynamo.eval_frame import _stance

    return _stance.stance


def signature_label(x: Tensors) -> str:
    """An input signature in words: 'a(64, 64) b(64, 64) float32 cpu, grad: a b; grad mode on'."""
    shapes = " ".join(f"{name}{tuple(t.shape)}" for name, t in sorted(x.items()))
    dtypes = " ".join(sorted({str(t.dtype).removeprefix("torch.") for t in x.values()}))
    devices = " ".join(sorted({t.device.type for t in x.values()}))
    grads = " ".join(name for name, t in sorted(x.items()) if t.requires_grad) or "none"
    return f"{shapes} {dtypes} {devices}, grad: {grads}; grad mode {'on' if torch.is_grad_enabled() else 'off'}"


def compiled_call(key: tuple, fn: Callable[..., Any], label: str, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` through the signature `key`'s own compiled copy of `fn`; raises NotCompiled rather
    than return a result that dynamo computed eagerly (a recompile-limit hit, a graph break, a frame it skipped,
    a compiler stance that runs eagerly)."""
    entry = _COMPILED.get(key)
    if entry is None:
        copy = fresh_copy(fn)
        entry = _COMPILED[key] = _Compiled(copy.__code__, _compile(copy), label)
    stance = _stance()
    if stance != "default":
        raise _refuse(entry, f"not compiled: torch.compiler stance {stance!r} would run {label} eagerly")
    start = time.perf_counter()
    try:
        out = entry.call(*args, **kwargs)
    except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
        raise _refuse(entry, f"not compiled: dynamo's recompile limit ({torch._dynamo.config.recompile_limit}) "
                             f"hit at {label}: it would run eagerly") from exc
    except torch._dynamo.exc.Unsupported as exc:  # fullgraph=True: a graph break is refused
        fn(*args, **kwargs)  # unless the code itself raises (dynamo reports that as a graph break too): its error
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise _refuse(entry, f"not compiled: a graph break at {label} ({first}): it would run in pieces, "
                             "partly eagerly") from exc
    seconds = time.perf_counter() - start
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entry.graphs = len(_debug_get_cache_entry_list(entry.code))
    if entry.first_call_s is None:
        entry.first_call_s = round(seconds, 3)
    if entry.graphs == 0:
        raise _refuse(entry, f"not compiled: dynamo left no compiled code for {label}: it ran eagerly")
    entry.not_compiled = None
    return out


def _refuse(entry: _Compiled, reason: str) -> NotCompiled:
    entry.not_compiled = reason
    return NotCompiled(reason)


def evidence(prefix: tuple) -> dict[str, Any]:
    """What dynamo did for each input signature this process compiled under `prefix` (an op's peer): its graphs
    (cache entries of the signature's own code object), recompiles (graphs beyond the first: the same signature
    under other guards, e.g. another config), its first call's seconds (the compile, never timed) and, where its
    last call raised NotCompiled, why."""
    return {entry.label: {"graphs": entry.graphs, "recompiles": max(entry.graphs - 1, 0),
                          "first_call_s": entry.first_call_s,
                          **({"not_compiled": entry.not_compiled} if entry.not_compiled else {})}
            for key, entry in _COMPILED.items() if key[:len(prefix)] == prefix}


EVIDENCE_NOTE = ("per input signature (this process): dynamo's graphs for the signature's own code object, its "
                 "recompiles and the first call's seconds; fullgraph=True, and a call that did not run compiled "
                 "code raised NotCompiled (no time)")


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


def input_signature(x: Tensors) -> tuple:
    return (tuple((name, tuple(t.shape), t.dtype, t.device.type, t.requires_grad) for name, t in sorted(x.items())),
            torch.is_grad_enabled())


def compiled(op_name: str, reference: Callable[[Tensors, LabConfig], Tensors], make_inputs: Callable[..., Tensors],
             backend: str) -> Callable[[LabConfig], Impl]:
    """The `compiled` peer of an op: its reference function under torch.compile, a fresh copy per input
    signature (compiled_call)."""

    def fn(x: Tensors, cfg: LabConfig) -> Tensors:
        key = (COMPILED, op_name, input_signature(x))
        return compiled_call(key, reference, signature_label(x), x, plain_config(cfg))

    def make(cfg: LabConfig) -> Impl:
        return Impl(COMPILED, "peer", fn, train=False, backend=f"torch.compile({backend}, fullgraph=True)",
                    geometry=first_call_geometry(fn, make_inputs, f"torch.compile({backend})"),
                    evidence=lambda: {"note": EVIDENCE_NOTE, "signatures": evidence((COMPILED, op_name))})

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
