"""op=layernorm: y = (x − mean(x)) / sqrt(var(x) + eps) · weight + bias over the last dim (definition.py: OP)."""

from posttrainllm.ops.layernorm.definition import OP

__all__ = ["OP"]
