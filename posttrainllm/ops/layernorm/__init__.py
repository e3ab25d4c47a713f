"""op=layernorm: y = (x − mean(x)) / sqrt(var(x) + eps) · weight + bias over the last dim (definition.py: OP)."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    """OP, from .definition, at first use: definition.py imports the shared types from posttrainllm.opdefs, whose
    registry imports this package, so an eager import here would be circular when this folder is imported first."""
    if name == "OP":
        from posttrainllm.ops.layernorm.definition import OP

        return OP
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["OP"]
