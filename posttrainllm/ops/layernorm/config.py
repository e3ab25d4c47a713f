"""The layernorm op's own key (conf/op/layernorm.yaml): its epsilon, inside the root: (x - mean(x)) / sqrt(var(x) + eps)."""

from __future__ import annotations

from dataclasses import dataclass

from posttrainllm.ops.rows import NormConfig


@dataclass
class Config(NormConfig):
    name: str = "layernorm"
