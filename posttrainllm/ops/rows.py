"""The row kernels' launch rules, written once: softmax, rmsnorm, layernorm and add_rmsnorm run one program per
row of a (rows, C) view, walking the row in blocks of BLOCK_C columns (or, rmsnorm, holding it whole).

    row layout     x is 2-D (rows, C); a per-row input (add_rmsnorm's residual, a gradient) has x's shape and a
                   per-column one (weight, bias) is (C,); one supported dtype and x's device throughout
    unit stride    rows may be strided (a stride-0 dY of .sum() too); the columns must be contiguous
    block          a tile's BLOCK_C is a power of two >= 16; a whole row's is C's next power of two, at most
                   MAX_BLOCK_C (one program's registers)
    launch fit     rows, C >= 1; num_warps a power of two
    tile=auto      no row op has an autotuner: the refusal names the fixed tiles

Not imported with triton: the op definitions read it at import, and they must not load triton (ops/base.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrainllm.config import ConfigError, LabConfig, OpConfig, next_power_of_two, require

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_BLOCK = 16  # tl.arange and tl.dot want at least 16 lanes
MAX_BLOCK_C = 65536  # a whole row lives in one program's registers


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_sizes(**sizes: int) -> None:
    """Every named size >= 1."""
    for name, size in sizes.items():
        if size < 1:
            raise ValueError(f"{name}={size} must be >= 1")


def check_block(name: str, value: int) -> None:
    """A tile's block: a power of two >= MIN_BLOCK."""
    if value < MIN_BLOCK or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= {MIN_BLOCK}")


def check_warps(num_warps: int) -> None:
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps={num_warps} must be a power of two")


def whole_row_block(n_cols: int) -> int:
    """BLOCK_C of a program that holds its whole row: C's next power of two, at most MAX_BLOCK_C."""
    block_c = next_power_of_two(n_cols)
    if block_c > MAX_BLOCK_C:
        raise ValueError(f"C={n_cols}: a row must fit one program (BLOCK_C={block_c} > {MAX_BLOCK_C})")
    return block_c


def row_launch(n_rows: int, n_cols: int, *, block_c: int | None, num_warps: int) -> dict[str, Any]:
    """One program per row: the grid, BLOCK_C (a tile's, or None: the whole row's) and the blocks a row walks."""
    check_sizes(rows=n_rows, C=n_cols)
    if block_c is None:
        block_c = whole_row_block(n_cols)
    else:
        check_block("block_c", block_c)
    check_warps(num_warps)
    return {"grid": [n_rows], "block_c": block_c, "blocks_per_row": cdiv(n_cols, block_c), "num_warps": num_warps}


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """Rows may be strided (a stride-0 dY of .sum() too); the columns must be contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_rows(x: torch.Tensor, *, per_row: dict[str, torch.Tensor] | None = None,
               per_column: dict[str, torch.Tensor] | None = None, eps: float | None = None,
               eps_keeps: str = "an all-zero row finite") -> None:
    """x (rows, C); each per-row input x's shape, each per-column one (C,); every one a supported dtype on x's
    device; eps (where given) > 0, what it keeps finite in words."""
    if x.ndim != 2:
        raise ValueError(f"expected 2-D x (rows, C), got {tuple(x.shape)}")
    per_row, per_column = per_row or {}, per_column or {}
    for name, t in per_row.items():
        if t.shape != x.shape:
            raise ValueError(f"{name} {tuple(t.shape)} does not match x {tuple(x.shape)}")
    for name, t in per_column.items():
        if t.shape != (x.shape[1],):
            raise ValueError(f"{name} {tuple(t.shape)} does not match x's C={x.shape[1]}: expected ({x.shape[1]},)")
    for name, t in {"x": x, **per_row, **per_column}.items():
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} not supported; choose one of {SUPPORTED_DTYPES}")
        if t.device != x.device:
            raise ValueError(f"device mismatch: x is on {x.device}, {name} is on {t.device}")
    if eps is not None and not eps > 0:
        raise ValueError(f"eps={eps!r} must be > 0 (it keeps {eps_keeps})")


def check_grads(like_name: str, like: torch.Tensor, **grads: torch.Tensor) -> None:
    """Each upstream gradient has the shape of the (rows, C) tensor `like` it belongs to."""
    for name, t in grads.items():
        if t.shape != like.shape:
            raise ValueError(f"{name} {tuple(t.shape)} does not match {like_name} {tuple(like.shape)}")


def row_outputs(like: torch.Tensor, count: int, upcast: bool) -> list[torch.Tensor]:
    """`count` empty (rows, C) outputs in `like`'s dtype, or fp32 where the bf16 emulation stores them upcast
    (PyTorch rounds them after the kernel)."""
    return [torch.empty(like.shape, device=like.device, dtype=torch.float32 if upcast else like.dtype)
            for _ in range(count)]


def refuse_tile_auto(cfg: LabConfig, op: str) -> None:
    """tile=auto tunes nothing in a row op: BLOCK_C is tile.block_n, chosen by a fixed tile."""
    if cfg.tile.autotune:
        raise ConfigError(f"tile=auto: op={op} has no autotuner; choose a fixed tile (b16, b32, b64, b128: "
                          "tile.block_n is the columns a program loads at once)")


@dataclass
class NormConfig(OpConfig):
    """The one key of a norm op's own (rmsnorm, layernorm, add_rmsnorm: each op's config.py names it and says where
    its epsilon sits): eps inside the root; bench-train's model takes it as its norm_eps."""

    eps: float = 1e-5

    def __post_init__(self) -> None:
        require(self.eps > 0, f"op.eps={self.eps}: must be > 0 (it keeps an all-zero row finite)")
