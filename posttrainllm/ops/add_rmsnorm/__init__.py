"""op=add_rmsnorm: the pre-norm block's h = x + r; y = rmsnorm(h) · weight, both returned (definition.py: OP)."""

from posttrainllm.ops.add_rmsnorm.definition import OP

__all__ = ["OP"]
