"""Counted memory traffic of eager PyTorch code: what each aten op reads and writes, summed.

Under `counted(...)` every aten call that runs (forward, and the backward autograd runs from it) adds

    read   = Σ over its tensor arguments  numel · element_size   [B]
    write  = Σ over its tensor results    numel · element_size   [B]

except views (transpose, expand, reshape of a contiguous tensor: they move nothing; `OpOverload.is_view`, and
NO_TRAFFIC), and with an expanded argument read once (its storage's bytes); an argument the op writes (copy_'s
destination) counts as written. This is the traffic of the code as eager PyTorch runs it, one op after the other,
with no cache between them: the model a byte count of unfused code is checked against (ops/attention/definition.py's
materialised model, tests/test_traffic.py). A fused kernel is one call whose internal
re-reads this cannot see, so it is counted for the readable math, not for a fused path.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class Traffic:
    """Bytes read and written per aten op, and in all."""

    read: int = 0
    written: int = 0
    per_op: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0]))  # calls, read, write

    @property
    def total(self) -> int:
        return self.read + self.written

    def table(self) -> list[tuple[str, int, int, int]]:
        """(op, calls, bytes read, bytes written), the largest traffic first."""
        return sorted(((op, *v) for op, v in self.per_op.items()), key=lambda r: -(r[2] + r[3]))


# aten ops that move no bytes although `is_view` is False: a view autograd does not track as one, and the
# allocations whose tensor argument gives only a size and a dtype
NO_TRAFFIC = frozenset({"_unsafe_view", "new_empty_strided", "new_empty", "empty_like", "empty_strided", "empty",
                        "lift_fresh", "detach"})


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of one tensor argument: numel · element_size, or its storage's where an expanded view (stride 0)
    repeats elements: those are read once."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def _bytes(values: Any, skip: set[int] = frozenset()) -> int:
    leaves, _ = tree_flatten(values)
    return sum(_tensor_bytes(t) for t in leaves if isinstance(t, torch.Tensor) and id(t) not in skip)


class _Counter(TorchDispatchMode):
    def __init__(self, traffic: Traffic) -> None:
        super().__init__()
        self.traffic = traffic

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket.__name__)
        if getattr(func, "is_view", False) or name in NO_TRAFFIC:
            return out
        # an argument the op writes (copy_'s destination, an out=): written, not read (an in-place update that
        # also reads it, add_, is undercounted by its read; the readable references have none)
        given = {**{arg.name: value for arg, value in zip(func._schema.arguments, args)}, **kwargs}
        written_args = [given[arg.name] for arg in func._schema.arguments
                        if arg.alias_info is not None and arg.alias_info.is_write
                        and isinstance(given.get(arg.name), torch.Tensor)]
        skip = {id(t) for t in written_args}
        read = _bytes((args, kwargs), skip)
        written = sum(_tensor_bytes(t) for t in written_args) + _bytes(out, skip)
        entry = self.traffic.per_op[name]
        entry[0] += 1
        entry[1] += read
        entry[2] += written
        self.traffic.read += read
        self.traffic.written += written
        return out


@contextmanager
def counted() -> Iterator[Traffic]:
    """Count the traffic of the aten calls made inside (module docstring)."""
    traffic = Traffic()
    with _Counter(traffic):
        yield traffic
