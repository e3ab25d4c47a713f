"""The cross_entropy op's own keys (conf/op/cross_entropy.yaml: why these values): the loss's options and the fused
path's geometry."""

from __future__ import annotations

from dataclasses import dataclass

from posttrainllm.config import OpConfig, power_of_two, require


@dataclass
class Config(OpConfig):
    name: str = "cross_entropy"
    ignore_index: int = -100  # targets equal to it contribute nothing; the mean divides by the others' count
    label_smoothing: float = 0.0  # ε in [0, 1]: the target distribution is (1 − ε)·one_hot + ε/V
    # tokens per chunk of the fused path, (chunk_size, V) fp32 logits alive at once; conf/op/cross_entropy.yaml takes
    # it from the shape (shape.ce_chunk_size), so that a GPU shape gets a GPU-sized chunk
    chunk_size: int = 16
    block_v: int = 256  # the fused kernel's vocabulary block (a power of two >= 16)

    def __post_init__(self) -> None:
        require(0.0 <= self.label_smoothing <= 1.0, f"op.label_smoothing={self.label_smoothing}: must be in [0, 1]")
        require(self.chunk_size >= 1, f"op.chunk_size={self.chunk_size}: must be >= 1")
        require(power_of_two(self.block_v) and 16 <= self.block_v <= 65536,
                f"op.block_v={self.block_v}: must be a power of two in [16, 65536]")
