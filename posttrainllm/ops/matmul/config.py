"""The matmul op's sizes (shape.ops.matmul) and its own config rules: its tiles against the problem and the device's
shared memory.

Shared memory per program is written once, here (`smem_bytes`): the config check refuses a tile over
device.smem_bytes, the launcher's autotuner prunes its candidates by it (kernels.py), and the compile report shows
it for the point (OpDef.smem_bytes). Importing it never imports triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from posttrainllm.config import ConfigError, LabConfig, OpSizes, itemsize, next_power_of_two, require
from posttrainllm.ops.base import check_fp8_config, check_smem


@dataclass
class Sizes(OpSizes):
    """(m, k) @ (k, n); parity adds the `edge` problems [M, N, K] (sizes off every block); the curve's M=N=K."""

    op_name: ClassVar[str] = "matmul"
    m: int = 128
    n: int = 128
    k: int = 128
    edge: list[list[int]] = field(default_factory=lambda: [[1, 1, 1], [41, 77, 33]])  # [M, N, K] per case
    curve: list[int] | None = None  # M=N=K of the microbench curve; null: shape.curve

    def __post_init__(self) -> None:
        self.require_positive("m", "n", "k")
        self.require_triples("edge", "")
        require(self.curve is None or (len(self.curve) >= 2 and min(self.curve) > 0),
                f"{self.key('curve')}={self.curve}: give at least two sizes > 0, or null (use shape.curve)")


def smem_bytes(block_m: int, block_n: int, block_k: int, num_stages: int, itemsize: int) -> int:
    """(BLOCK_M·BLOCK_K + BLOCK_K·BLOCK_N)·itemsize·num_stages: the A and B slabs in flight (1 byte under fp8)."""
    return (block_m * block_k + block_k * block_n) * itemsize * num_stages


def point_smem_bytes(cfg: LabConfig) -> int:
    """`smem_bytes` of the point's tile and workgroup, on its operands' dtype (fp8's under a quantized precision)."""
    operand = cfg.precision.quantize.format if cfg.precision.quantize is not None else cfg.precision.dtype
    return smem_bytes(cfg.tile.block_m, cfg.tile.block_n, cfg.tile.block_k, cfg.workgroup.num_stages,
                      itemsize(operand))


def check_config(cfg: LabConfig) -> None:
    """A block larger than its dimension, or A and B tiles per pipeline stage over the shared memory, is refused."""
    tile, sizes = cfg.tile, Sizes.of(cfg)
    if cfg.precision.quantize is not None:
        check_fp8_config(cfg, "reference, scaled_mm, triton")
    for block, dim in (("block_m", "m"), ("block_n", "n"), ("block_k", "k")):
        bound = max(16, next_power_of_two(getattr(sizes, dim)))
        if getattr(tile, block) > bound:
            raise ConfigError(f"tile.{block}={getattr(tile, block)} does not fit {sizes.key(dim)}="
                              f"{getattr(sizes, dim)}: use a block <= {bound}")
    check_smem(cfg, point_smem_bytes(cfg))
