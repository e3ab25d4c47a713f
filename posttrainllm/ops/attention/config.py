"""The attention op's own config: its keys (`Config`: causal, sm_scale), and its tiles against the problem and the
device's shared memory.

Shared memory per program is written once, here (`smem_bytes`, on the kernel's padded head dim `block_d`): the
config check refuses a tile over device.smem_bytes, the launcher's autotuner prunes its candidates by it
(kernels.py), and the compile report shows it for the point (OpDef.smem_bytes). Importing it never imports triton.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrainllm.config import ConfigError, LabConfig, OpConfig, itemsize, next_power_of_two, require
from posttrainllm.ops.base import check_smem


@dataclass
class Config(OpConfig):
    """op=attention's keys (conf/op/attention.yaml; attention_noncausal.yaml: the same op, causal false)."""

    name: str = "attention"
    causal: bool = True  # the causal mask: query i sees keys j <= i
    # the softmax scale every path gets (a user path's sm_scale); null: 1/sqrt(head_dim). Parity also checks a case
    # at another scale (definition.py), so a path that ignores it fails
    sm_scale: float | None = None

    def __post_init__(self) -> None:
        require(self.sm_scale is None or self.sm_scale > 0,
                f"op.sm_scale={self.sm_scale}: must be > 0, or null (1/sqrt(head_dim))")


def block_d(head_dim: int) -> int:
    """The head dim as the kernels tile it: the next power of two, at least 16 (tl.dot needs K >= 16)."""
    return max(16, next_power_of_two(head_dim))


def smem_bytes(block_q: int, block_kv: int, block_d: int, num_stages: int, itemsize: int) -> int:
    """Shared memory per program, estimated: the resident block plus a pipelined (K, V) pair per stage,
    (block_q + 2·block_kv·num_stages)·block_d·itemsize."""
    return (block_q + 2 * block_kv * num_stages) * block_d * itemsize


def point_smem_bytes(cfg: LabConfig) -> int:
    """`smem_bytes` of the point's forward tile, workgroup, head dim and dtype."""
    return smem_bytes(cfg.tile.block_q, cfg.tile.block_kv, block_d(cfg.architecture.head_dim),
                      cfg.workgroup.num_stages, itemsize(cfg.precision.dtype))


def check_config(cfg: LabConfig) -> None:
    """A block larger than the sequence, or Q + (K, V) per pipeline stage over the shared memory, is refused."""
    tile, shape = cfg.tile, cfg.shape
    bound = max(16, next_power_of_two(shape.seq_len))
    for block in ("block_q", "block_kv", "dkdv_block_q", "dkdv_block_kv", "dq_block_q", "dq_block_kv"):
        if getattr(tile, block) is None:
            continue
        if getattr(tile, block) > bound:
            raise ConfigError(f"tile.{block}={getattr(tile, block)} does not fit shape.seq_len={shape.seq_len}: "
                              f"use a block <= {bound}")
    check_smem(cfg, point_smem_bytes(cfg))
