"""The lab's ops: the one list of op packages (posttrainllm/ops/<op>/, see base.py for what an op declares).

Adding an op = its folder + one line in OP_PACKAGES. `get_op(name)` is a built-in op by name, `op_for(cfg)` a
point's op (a built-in, or op=problem's, made from its file), `op_config(name)` the schema of its `op` config node
(its package's config.py `Config`, where it has keys of its own). An unknown name is a ConfigError naming the choices.
Importing this module imports the op definitions, never their Triton kernels (loaded when a path first runs).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
from typing import Any, Callable

from posttrainllm.config import ConfigError, LabConfig, OpConfig, OpSizes
from posttrainllm.ops.base import (NO_BACKWARD, OWN_BACKWARD, REFERENCE, Case, Costs, Impl, ModelHook, OpDef,
                                   Tensors, case_config, replaced_library)

# The op packages, one line per op: each exposes OP (its OpDef); config.py its Config, if it has keys of its own,
# and its Sizes, if it has sizes of its own (shape.ops.<op>)
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


def _declared(package: str, name: str) -> Any:
    """posttrainllm/ops/<package>/config.py's `name`, or None where it has no config.py or no such name."""
    module = f"posttrainllm.ops.{package}.config"
    if importlib.util.find_spec(module) is None:
        return None
    return getattr(importlib.import_module(module), name, None)


def _config_class(package: str) -> type[OpConfig]:
    """posttrainllm/ops/<package>/config.py's `Config`: the op's own keys, defaults and checks (an OpConfig
    subclass); OpConfig, the keys every op has, where the op declares none."""
    return _declared(package, "Config") or OpConfig


OPS: dict[str, OpDef] = {}
OP_CONFIGS: dict[str, type[OpConfig]] = {}
# The ops' sizes (config.py `Sizes`, an OpSizes subclass): the schema of each node of shape.ops, by op name
OP_SIZES: dict[str, type[OpSizes]] = {}
for _package in OP_PACKAGES:
    _op = importlib.import_module(f"posttrainllm.ops.{_package}").OP
    OPS[_op.name] = _op
    OP_CONFIGS[_op.name] = _config_class(_package)
    _sizes = _declared(_package, "Sizes")
    if _sizes is not None:
        if _sizes.op_name != _op.name:
            raise ValueError(f"posttrainllm/ops/{_package}/config.py Sizes.op_name={_sizes.op_name!r}: must be its "
                             f"op's name, {_op.name!r}")
        OP_SIZES[_op.name] = _sizes


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


def slot_op(slot: str) -> OpDef:
    """The op whose paths fill model slot `slot` where the lab picks one outside a point (the draft heads' decoding,
    lab/heads.py): the op that declares the slot's default math (OpDef.model_defaults, one op per slot), whose model
    hook fills that slot too (ModelHook.fills). A slot no op declares, or one its op's paths do not fill, is refused."""
    owners = [op for op in OPS.values() if slot in op.model_defaults]
    if not owners:
        declared = sorted({name for op in OPS.values() for name in op.model_defaults})
        raise ValueError(f"no op declares the model's {slot!r} default (OpDef.model_defaults): declared are "
                         f"{', '.join(declared)}")
    op = owners[0]
    if op.model_hook is None or slot not in op.model_hook.fills:
        raise ValueError(f"op {op.name} declares the model's {slot!r} default, but its model hook does not fill that "
                         f"slot (ModelHook.also)")
    return op


PROBLEM = "problem"  # op=problem: an op made from a problem file at config time (ops/problem/, op.file)


def op_config(name: str) -> type[OpConfig]:
    """The schema of op `name`'s config node (the `op` of a point): its keys, defaults and checks."""
    if name == PROBLEM:  # loaded with the op itself, only where a point is one
        return _config_class(PROBLEM)
    if name not in OP_CONFIGS:
        raise ConfigError(f"op.name={name!r}: valid choices are {', '.join([*OP_CONFIGS, PROBLEM])}")
    return OP_CONFIGS[name]


# Each op's config at its defaults, made once: a stage recording its config reads (track/stamp.py) sees none here
_OP_DEFAULTS = {name: cls(name=name) for name, cls in OP_CONFIGS.items()}


def with_op_defaults(cfg: LabConfig, name: str) -> LabConfig:
    """`cfg` with op `name`'s config at its defaults: for a path of op `name` called outside a point of that op
    (the draft heads' decoding, lab/heads.py). Copies, as ops/base.py case_config makes them (no field read)."""
    made = copy.copy(cfg)
    made.op = copy.deepcopy(_OP_DEFAULTS[name])
    return made


def op_for(cfg: LabConfig) -> OpDef:
    """The op of a point: a built-in by op.name, or (op=problem) the one made from op.file at the point's sizes."""
    if cfg.op.name == PROBLEM:
        from posttrainllm.ops.problem import problem_op

        return problem_op(cfg)
    return get_op(cfg.op.name)


__all__ = ["NO_BACKWARD", "OPS", "OP_CONFIGS", "OP_PACKAGES", "OP_SIZES", "OWN_BACKWARD", "REFERENCE", "Case", "Costs",
           "Impl", "ModelHook", "OpDef", "Tensors", "case_config", "get_op", "model_defaults", "op_config", "op_for",
           "replaced_library", "slot_op", "with_op_defaults"]
