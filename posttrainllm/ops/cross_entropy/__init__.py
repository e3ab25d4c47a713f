"""The cross_entropy op: reference.py (readable math), kernels.py (Triton, loaded lazily), definition.py (its OpDef)."""

from posttrainllm.ops.cross_entropy.definition import OP

__all__ = ["OP"]
