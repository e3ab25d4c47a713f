"""The matmul op: reference.py (readable math), kernels.py (Triton, loaded lazily), definition.py (its OpDef)."""

from posttrainllm.ops.matmul.definition import OP

__all__ = ["OP"]
