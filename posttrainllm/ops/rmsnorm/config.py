"""The rmsnorm op's own key (conf/op/rmsnorm.yaml): its epsilon."""

from __future__ import annotations

from dataclasses import dataclass

from posttrainllm.config import OpConfig, require


@dataclass
class Config(OpConfig):
    name: str = "rmsnorm"
    # the epsilon inside the root, x / sqrt(mean(x²) + eps); bench-train's model takes it as its norm_eps
    eps: float = 1e-5

    def __post_init__(self) -> None:
        require(self.eps > 0, f"op.eps={self.eps}: must be > 0 (it keeps an all-zero row finite)")
