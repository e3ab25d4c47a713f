"""The lab's ops: the one list of op packages (posttrainllm/ops/<op>/, see base.py for what an op declares).

Adding an op = its folder + one line in OP_PACKAGES. `get_op(name)` is a built-in op by name, `op_for(cfg)` a
point's op (a built-in, or op=problem's, made from its file). An unknown name is a ConfigError naming the choices.
Importing this module imports the op definitions, never their Triton kernels (loaded when a path first runs).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from posttrainllm.config import ConfigError, LabConfig
from posttrainllm.ops.base import (NO_BACKWARD, OWN_BACKWARD, REFERENCE, Case, Costs, Impl, ModelHook, OpDef,
                                   Tensors, case_config, replaced_library)

# The op packages, one line per op: each exposes OP (its OpDef)
OP_PACKAGES = (
    "attention",
    "matmul",
    "decode_attention",
    "moe",
    "rmsnorm",
    "rope",
    "swiglu",
    "cross_entropy",
    "softmax",
    "layernorm",
    "add_rmsnorm",
)

OPS: dict[str, OpDef] = {}
for _package in OP_PACKAGES:
    _op = importlib.import_module(f"posttrainllm.ops.{_package}").OP
    OPS[_op.name] = _op


def get_op(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        raise ConfigError(f"unknown op {name!r}: valid choices are {', '.join(OPS)}") from None


def model_defaults() -> dict[str, Callable[..., Any]]:
    """The model's default math by slot, as the ops declare it (OpDef.model_defaults): one op per slot."""
    found: dict[str, Callable[..., Any]] = {}
    owner: dict[str, str] = {}
    for op in OPS.values():
        for slot, fn in op.model_defaults.items():
            if slot in found:
                raise ValueError(f"the model's {slot!r} default is declared by both {owner[slot]} and {op.name}")
            found[slot], owner[slot] = fn, op.name
    return found


PROBLEM = "problem"  # op=problem: an op made from a problem file at config time (ops/problem/, op.file)


def op_for(cfg: LabConfig) -> OpDef:
    """The op of a point: a built-in by op.name, or (op=problem) the one made from op.file at the point's sizes."""
    if cfg.op.name == PROBLEM:
        from posttrainllm.ops.problem import problem_op

        return problem_op(cfg)
    return get_op(cfg.op.name)


__all__ = ["NO_BACKWARD", "OPS", "OP_PACKAGES", "OWN_BACKWARD", "REFERENCE", "Case", "Costs", "Impl", "ModelHook",
           "OpDef", "Tensors", "case_config", "get_op", "model_defaults", "op_for", "replaced_library"]
