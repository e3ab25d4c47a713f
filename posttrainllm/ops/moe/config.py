"""The moe op's sizes (shape.ops.moe; conf/shape/*.yaml: the values and why)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from posttrainllm.config import OpSizes, require


@dataclass
class Sizes(OpSizes):
    """`tokens` tokens of width `d_model` through `experts` SwiGLU experts of width `ffn`, `top_k` per token."""

    op_name: ClassVar[str] = "moe"
    tokens: int = 64
    d_model: int = 64
    ffn: int = 96
    experts: int = 4
    top_k: int = 2
    curve: list[int] = field(default_factory=lambda: [1, 16, 64, 256])  # tokens: 1 is the decode regime
    # experts E at fixed active parameters (tokens, d_model, ffn, top_k fixed): the dense reference grows with E
    expert_curve: list[int] = field(default_factory=lambda: [2, 4, 8, 16])
    edge: list[list[int]] = field(default_factory=lambda: [[1, 64, 96], [37, 40, 72]])  # [T, d, f] per case

    def __post_init__(self) -> None:
        self.require_positive("tokens", "d_model", "ffn", "experts", "top_k")
        require(self.top_k <= self.experts,
                f"{self.key('top_k')}={self.top_k}: must be <= {self.key('experts')}={self.experts}")
        self.require_sizes("curve", 2, "token counts")
        require(len(self.expert_curve) >= 2 and min(self.expert_curve) >= self.top_k,
                f"{self.key('expert_curve')}={list(self.expert_curve)}: give at least two expert counts >= "
                f"{self.key('top_k')}={self.top_k}")
        self.require_triples("edge", "[T, d, f]")
