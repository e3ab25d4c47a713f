"""The matmul op's own config rules: its tiles against the problem and the device's shared memory.

Shared memory per program is written once, here (`smem_bytes`): the config check refuses a tile over
device.smem_bytes, the launcher's autotuner prunes its candidates by it (kernels.py), and the compile report shows
it for the point (OpDef.smem_bytes). Importing it never imports triton.
"""

from __future__ import annotations

from posttrainllm.config import ConfigError, LabConfig, itemsize, next_power_of_two
from posttrainllm.ops.base import check_fp8_config, check_smem


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
    tile, shape = cfg.tile, cfg.shape
    if cfg.precision.quantize is not None:
        check_fp8_config(cfg, "reference, scaled_mm, triton")
    for block, dim in (("block_m", "m"), ("block_n", "n"), ("block_k", "k")):
        bound = max(16, next_power_of_two(getattr(shape, dim)))
        if getattr(tile, block) > bound:
            raise ConfigError(f"tile.{block}={getattr(tile, block)} does not fit shape.{dim}={getattr(shape, dim)}: "
                              f"use a block <= {bound}")
    check_smem(cfg, point_smem_bytes(cfg))
