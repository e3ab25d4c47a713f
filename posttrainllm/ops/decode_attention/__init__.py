"""The decode_attention op: reference.py (readable math), kernels.py (Triton, loaded lazily), definition.py (its OpDef)."""

from posttrainllm.ops.decode_attention.definition import OP

__all__ = ["OP"]
