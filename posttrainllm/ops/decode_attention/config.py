"""The decode_attention op's own keys (conf/op/decode_attention.yaml): its softmax scale and its KV split; and its
sizes (shape.ops.decode_attention; conf/shape/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from posttrainllm.config import OpConfig, OpSizes, require


@dataclass
class Config(OpConfig):
    name: str = "decode_attention"
    # the softmax scale every path gets (a user path's sm_scale); null: 1/sqrt(head_dim). Parity also checks a case
    # at another scale (definition.py), so a path that ignores it fails
    sm_scale: float | None = None
    # the Triton path's KV pieces: null, as many as fill the device (on a GPU the count follows the batch, and a
    # row's bits with it); an int, that many KV blocks a piece whatever the batch: the batch-invariant mode
    kv_split_blocks: int | None = None

    def __post_init__(self) -> None:
        require(self.sm_scale is None or self.sm_scale > 0,
                f"op.sm_scale={self.sm_scale}: must be > 0, or null (1/sqrt(head_dim))")
        require(self.kv_split_blocks is None or self.kv_split_blocks >= 1,
                f"op.kv_split_blocks={self.kv_split_blocks}: must be >= 1 KV block a piece, or null (fill the device)")


@dataclass
class Sizes(OpSizes):
    """A query chunk of Sq rows against a KV cache of Sk keys. Parity runs every pair Sq <= Sk of `q_lens` and
    `kv_lens`; the microbench times one decode step (Sq = 1) against `kv_len` keys, and its curve takes shape.curve
    as the context length Sk."""

    op_name: ClassVar[str] = "decode_attention"
    q_lens: list[int] = field(default_factory=lambda: [1, 4, 17])
    kv_lens: list[int] = field(default_factory=lambda: [1, 100, 1000])
    kv_len: int = 1024

    def __post_init__(self) -> None:
        self.require_positive("kv_len")
        self.require_sizes("q_lens", 1)
        self.require_sizes("kv_lens", 1)
        require(min(self.q_lens) <= max(self.kv_lens),
                f"{self.key('q_lens')}={list(self.q_lens)}: no chunk fits {self.key('kv_lens')}="
                f"{list(self.kv_lens)} (a chunk needs Sq <= Sk)")
