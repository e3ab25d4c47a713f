"""The cross_entropy op's own keys (conf/op/cross_entropy.yaml: why these values): the loss's options and the fused
path's geometry; and its sizes (shape.ops.cross_entropy; conf/shape/*.yaml: the values and why)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from posttrainllm.config import OpConfig, OpSizes, power_of_two, require


@dataclass
class Config(OpConfig):
    name: str = "cross_entropy"
    ignore_index: int = -100  # targets equal to it contribute nothing; the mean divides by the others' count
    label_smoothing: float = 0.0  # ε in [0, 1]: the target distribution is (1 − ε)·one_hot + ε/V
    # tokens per chunk of the fused path, (chunk_size, V) fp32 logits alive at once; conf/op/cross_entropy.yaml takes
    # it from the shape (shape.ops.cross_entropy.chunk_size), so that a GPU shape gets a GPU-sized chunk
    chunk_size: int = 16
    block_v: int = 256  # the fused kernel's vocabulary block (a power of two >= 16)

    def __post_init__(self) -> None:
        require(0.0 <= self.label_smoothing <= 1.0, f"op.label_smoothing={self.label_smoothing}: must be in [0, 1]")
        require(self.chunk_size >= 1, f"op.chunk_size={self.chunk_size}: must be >= 1")
        require(power_of_two(self.block_v) and 16 <= self.block_v <= 65536,
                f"op.block_v={self.block_v}: must be a power of two in [16, 65536]")


@dataclass
class Sizes(OpSizes):
    """`tokens` hidden states of width `d_model` (N, C) against a vocabulary of `vocab` (V)."""

    op_name: ClassVar[str] = "cross_entropy"
    tokens: int = 64
    d_model: int = 64
    vocab: int = 2048
    edge: list[list[int]] = field(default_factory=lambda: [[1, 64, 1000], [37, 40, 1000]])  # [N, C, V] per case
    curve: list[int] = field(default_factory=lambda: [16, 64, 256, 1024])  # tokens
    vocab_curve: list[int] = field(default_factory=lambda: [1024, 4096, 16384, 32768])  # V at `tokens` tokens
    chunk_size: int = 16  # the fused path's tokens per chunk at these sizes (op.chunk_size's default)

    def __post_init__(self) -> None:
        self.require_positive("tokens", "d_model", "vocab", "chunk_size")
        self.require_sizes("curve", 2)
        self.require_sizes("vocab_curve", 2)
        self.require_triples("edge", "[N, C, V]")
