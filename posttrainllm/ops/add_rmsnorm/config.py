"""The add_rmsnorm op's own key (conf/op/add_rmsnorm.yaml): its epsilon, inside the root: h / sqrt(mean(h²) + eps), h = x + r."""

from __future__ import annotations

from dataclasses import dataclass

from posttrainllm.ops.rows import NormConfig


@dataclass
class Config(NormConfig):
    name: str = "add_rmsnorm"
