"""The rmsnorm op's own key (conf/op/rmsnorm.yaml): its epsilon, inside the root: x / sqrt(mean(x²) + eps)."""

from __future__ import annotations

from dataclasses import dataclass

from posttrainllm.ops.rows import NormConfig


@dataclass
class Config(NormConfig):
    name: str = "rmsnorm"
