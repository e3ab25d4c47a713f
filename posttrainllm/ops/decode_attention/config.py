"""The decode_attention op's own keys (conf/op/decode_attention.yaml): its softmax scale and its KV split."""

from __future__ import annotations

from dataclasses import dataclass

from posttrainllm.config import OpConfig, require


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
