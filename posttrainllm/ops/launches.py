"""Counting the Triton kernel launches made while a block is open: the guards' evidence that a path ran its kernels.

Here, beneath the lab (ops: Triton kernels and their launchers), because both sides of a user path's process
boundary count with it: the lab's guards (lab/isolation/guards.py) around every call, and a user path's worker process
(lab/isolation/worker.py) around the calls it makes, whose counts the lab then adds with `record_launches`.

Counting Triton launches (`count_triton_launches`), two mechanisms, each firing in one mode:
- Compiled (GPU): Triton's launch hook, `triton.knobs.runtime.launch_enter_hook`. Every compiled
  launch calls it with the kernel's metadata (its "name") before it runs. Triton >= 3.5 (triton-lang/
  triton#7866; torch 2.11's triton 3.6 and this venv's 3.9) makes it a HookChain (`.add` / `.remove`);
  triton 3.4 has a plain attribute there (None or one callable), and triton <= 3.3 has it on
  `triton.compiler.CompiledKernel`: there we chain ours in front of whatever hook was set, and put
  that one back when done.
- Interpreter (TRITON_INTERPRET=1, CPU): the interpreter never calls that hook (checked on
  triton 3.9: `InterpretedFunction.run` goes straight to its GridExecutor). We wrap
  `InterpretedFunction.run` at class level and count each call that is not a warmup.
Both are installed whichever mode is active; each launch goes through exactly one of them,
so nothing is counted twice. The first active counter installs them and the last one to
exit removes them (nested and overlapping counters each see every launch made while they
are open); exceptions inside the block restore everything the same way.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass
class LaunchCount:
    """Triton kernel launches seen while a `count_triton_launches` block was open."""

    total: int = 0
    by_kernel: Counter = field(default_factory=Counter)

    def add(self, name: str) -> None:
        self.total += 1
        self.by_kernel[name] += 1


_lock = threading.RLock()
_active: list[LaunchCount] = []
_installed: dict[str, Any] = {}


def _record(name: str) -> None:
    with _lock:
        for counter in _active:
            counter.add(name)


def _launch_enter_hook(metadata: Any) -> None:
    """Compiled launches: metadata is Triton's LazyDict; read its plain data, not the lazy extras."""
    data = getattr(metadata, "data", None)
    name = data.get("name") if isinstance(data, dict) else None
    _record(str(name) if name is not None else "<unknown>")


def _hook_owner() -> Any:
    """The object whose `launch_enter_hook` compiled launches call: triton.knobs.runtime (>= 3.4), else
    CompiledKernel (<= 3.3)."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.runtime, "launch_enter_hook"):
        return knobs.runtime
    from triton.compiler.compiler import CompiledKernel

    return CompiledKernel


def _install() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    original_run = InterpretedFunction.run

    def counted_run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            _record(getattr(self.fn, "__name__", "<unknown>"))
        return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = counted_run
    _installed.update(cls=InterpretedFunction, run=original_run)
    owner = _hook_owner()
    hook = owner.launch_enter_hook
    if hasattr(hook, "add") and hasattr(hook, "remove"):  # a HookChain (triton >= 3.5)
        hook.add(_launch_enter_hook)
        _installed.update(chain=hook)
    else:  # one hook or None (triton <= 3.4): ours first, then the one that was there
        def chained(metadata: Any, _previous: Any = hook) -> None:
            _launch_enter_hook(metadata)
            if _previous is not None:
                _previous(metadata)

        owner.launch_enter_hook = chained
        _installed.update(owner=owner, previous=hook)


def _uninstall() -> None:
    cls, run = _installed.pop("cls"), _installed.pop("run")
    cls.run = run
    if "chain" in _installed:
        _installed.pop("chain").remove(_launch_enter_hook)
    else:
        _installed.pop("owner").launch_enter_hook = _installed.pop("previous")


@contextlib.contextmanager
def count_triton_launches() -> Iterator[LaunchCount]:
    """Count Triton kernel launches (total and by kernel name) made inside the block."""
    counter = LaunchCount()
    with _lock:
        if not _active:
            _install()
        _active.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _active.remove(counter)
            if not _active:
                _uninstall()


def record_launches(by_kernel: dict[str, int]) -> None:
    """Add launches made elsewhere (a user path's worker process) to every counter open here."""
    for name, count in by_kernel.items():
        for _ in range(int(count)):
            _record(str(name))
