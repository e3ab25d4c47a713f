"""op=problem's own keys (conf/op/problem.yaml): the problem file in KernelBench's format and how the lab sizes and
checks it (definition.py, docs/bring-your-own-op.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrainllm.config import OpConfig, require


@dataclass
class Config(OpConfig):
    name: str = "problem"
    file: str | None = None  # the problem file: Model, get_inputs, get_init_inputs, module-level int sizes
    # its size constants set before get_inputs/get_init_inputs run (op.sizes.batch_size=64); {}: the file's,
    # shrunk on a CPU point until one call fits budget_mib
    sizes: dict[str, Any] = field(default_factory=dict)
    x_name: str | None = None  # the size constant the curve runs over; null: batch_size, else the largest
    input_kinds: list[str] = field(default_factory=lambda: ["signed", "large", "tiny", "zero_row"])  # lab cases
    budget_mib: float = 8.0  # one call's inputs, parameters and output (fp32) when the lab shrinks the sizes

    def __post_init__(self) -> None:
        require(self.budget_mib > 0, f"op.budget_mib={self.budget_mib}: must be > 0")
