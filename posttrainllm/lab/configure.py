"""A point's config, whole: the schema's rules (config.py, the op node the chosen op's and each op's sizes its own:
ops/<op>/config.py), the model's words it names (model/slots.py), then the op's own rules (ops/<op>/definition.py).

config.py knows the schema and imports nothing above itself; the op's keys (its config class, picked here by
op.name) and rules (a tile that does not fit its problem, the paths it has, the user paths `op.user_impls` names)
live with the op. This layer knows both, so `load` and `validate` here are the one way a point's config is built:
a bad value is one ConfigError line, raised before any stage writes anything.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from posttrainllm import config
from posttrainllm.config import LabConfig, compose, require
from posttrainllm.model.slots import CACHED_ATTENTION, MLP_KINDS
from posttrainllm.ops.registry import OP_SIZES, OPS, op_config, op_for, slot_op
from posttrainllm.lab.isolation.user import user_paths  # the paths from outside: a spec read, nothing run


def validate(cfg: DictConfig | dict[str, Any]) -> LabConfig:
    """The schema (an fp8 precision's floors as the op's own, QuantizeConfig.for_op), the model's words it names, then
    the op's rules and the heads' choice of decode path; ConfigError with one line."""
    lab = validate_schema(cfg)
    check_model_rules(lab)
    if lab.precision.quantize is not None:  # the op's own quantization floors, where the precision names some
        lab.precision.quantize = lab.precision.quantize.for_op(lab.op.name)
    check_op_rules(lab)
    check_heads_rules(lab)
    return lab


def validate_schema(cfg: DictConfig | dict[str, Any]) -> LabConfig:
    """The schema's rules alone (config.validate_schema), the op node merged into the chosen op's config class
    (ops/<op>/config.py, by op.name): a key another op has, or none has, is refused naming this op's keys; and each
    node of shape.ops into its op's sizes (ops/<op>/config.py Sizes): an op without sizes, or a key its sizes do not
    have, is refused naming the valid ones, and a bad value by the op's own check."""
    return config.validate_schema(cfg, op_config, OP_SIZES)


def load(overrides: list[str] | tuple[str, ...] = ()) -> LabConfig:
    """Compose conf/ with the overrides and validate: the one way a point's config is built."""
    return validate(compose(overrides))


def check_model_rules(cfg: LabConfig) -> None:
    """architecture.mlp is one of the model's MLP kinds (model/slots.py MLP_KINDS: its words, not the schema's)."""
    require(cfg.architecture.mlp in MLP_KINDS,
            f"architecture.mlp={cfg.architecture.mlp!r}: valid choices are {', '.join(MLP_KINDS)}")


def check_heads_rules(cfg: LabConfig) -> None:
    """heads.cached_attention names a built-in path of the op that fills the model's cached_attention slot
    (registry.slot_op: its registry, the one list of them)."""
    paths = slot_op(CACHED_ATTENTION).impls
    require(cfg.heads.cached_attention in paths, f"heads.cached_attention={cfg.heads.cached_attention!r}: valid "
                                                 f"choices are {', '.join(paths)}")


def check_precision_rules(cfg: LabConfig) -> None:
    """A quantized precision (precision.quantize: fp8) runs only for the ops whose inputs and paths know its recipe
    (OpDef.quantizes): the precision dimension is global, so another op is refused by name, before anything runs."""
    if cfg.precision.quantize is None:
        return
    supported = [name for name, op in OPS.items() if op.quantizes]
    require(op_for(cfg).quantizes,
            f"precision {cfg.precision.name} is supported by {', '.join(f'op={name}' for name in supported)} only: "
            f"op={cfg.op.name} has no {cfg.precision.quantize.format} inputs or paths")


def check_train_rules(cfg: LabConfig) -> None:
    """bench-train under a quantized precision trains by the precision's training recipe, which only some ops carry
    (OpDef.trains_quantized): an op whose fp8 paths are forward-only is refused by name (the CLI before anything
    runs, the bench-train stage again)."""
    if cfg.precision.quantize is None:
        return
    trained = " and ".join(f"op={name}" for name, op in OPS.items() if op.trains_quantized)
    require(op_for(cfg).trains_quantized,
            f"bench-train under precision {cfg.precision.name}: op={cfg.op.name}'s fp8 paths are forward-only (the fp8 "
            f"training recipe covers {trained}'s linear layers only); `posttrainllm bench` checks and times them")


def check_op_rules(cfg: LabConfig) -> None:
    """The op's own rules: its check_config, the paths this point has (built-in, optional peers and user
    paths, each loaded here so a bad spec fails now), and the outputs and paths other keys name."""
    op = op_for(cfg)
    check_precision_rules(cfg)
    op.check_config(cfg)
    paths = op.paths(cfg, user_paths)
    outputs = list(dict.fromkeys(name for impl in op.impls.values() for name in op.expected_outputs(impl)))
    for name in cfg.op.max_error_only.outputs:
        require(name in outputs, f"op.max_error_only.outputs: unknown {cfg.op.name} output {name!r}: valid choices "
                                 f"are {', '.join(outputs)}")
    impls = list(cfg.train.impls)
    for impl in impls:
        require(impl in paths, f"train.impls: unknown {cfg.op.name} implementation {impl!r}: valid choices are "
                               f"{', '.join(paths)}" + (f" (op.only={list(cfg.op.only)})" if cfg.op.only else ""))
    require(not impls or impls[0] == "reference",
            f"train.impls={impls}: the first must be 'reference' (drift is measured against it)")
