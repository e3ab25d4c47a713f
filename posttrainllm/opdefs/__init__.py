"""The lab's ops: one module each (see base.py for what an op declares). Adding an op = one module + one line here."""

from __future__ import annotations

from posttrainllm.config import ConfigError, LabConfig
from posttrainllm.opdefs import (attention, cross_entropy, decode_attention, matmul, moe, rmsnorm, rope, softmax,
                                 swiglu)
from posttrainllm.ops import add_rmsnorm, layernorm  # ops in their own folders (ops/<op>/: reference, kernels, definition)
from posttrainllm.opdefs.base import (NO_BACKWARD, OWN_BACKWARD, REFERENCE, Case, Costs, Impl, ModelHooks, OpDef,
                                      Tensors, case_config, replaced_library)

OPS: dict[str, OpDef] = {op.name: op for op in (attention.OP, matmul.OP, decode_attention.OP, moe.OP, rmsnorm.OP,
                                                rope.OP, swiglu.OP, cross_entropy.OP, softmax.OP, layernorm.OP,
                                                add_rmsnorm.OP)}



def get_op(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        raise ConfigError(f"unknown op {name!r}: valid choices are {', '.join(OPS)}") from None


PROBLEM = "problem"  # op=problem: an op made from a problem file at config time (opdefs/problem.py, op.file)


def op_for(cfg: LabConfig) -> OpDef:
    """The op of a point: a built-in by op.name, or (op=problem) the one made from op.file at the point's sizes."""
    if cfg.op.name == PROBLEM:
        from posttrainllm.opdefs.problem import problem_op

        return problem_op(cfg)
    return get_op(cfg.op.name)


__all__ = ["NO_BACKWARD", "OPS", "OWN_BACKWARD", "REFERENCE", "Case", "Costs", "Impl", "ModelHooks", "OpDef", "Tensors",
           "case_config", "get_op", "op_for", "replaced_library"]
