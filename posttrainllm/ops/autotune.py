"""What every op's launcher that autotunes (tile=auto / workgroup=auto) shares: the shared memory it prunes its
candidates by, the configuration the tuner chose, and the note where no autotuner runs.

Triton's autotuner times every configuration with triton.testing.do_bench, which needs a GPU driver; under the
interpreter there is none, so `auto` resolves to the launcher's fixed configuration there (AUTO_CPU_NOTE says so,
and the receipt records it). Configurations are pruned by the shared memory the device itself reports, not a
constant, or, while lab/compile.py records launches for a compile target (no GPU here), by that target's
(`autotune_for_target`). Each op's launcher holds its own space, its pruning formula and its tuner.

Triton versions (torch 2.11's GPU machine runs triton 3.6; this venv 3.9): the autotuner sets `.best_config` (a
Config: .kwargs, .num_warps, .num_stages) on every run. driver.active.utils.get_device_properties(index)
["max_shared_mem"]: the NVIDIA driver's dict (also "multiprocessor_count", "max_num_regs"); an H100/H200 reports
232448 B (227 KiB, conf/device/cuda.yaml). Importing this module never imports triton.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

AUTO_CPU_NOTE = ("autotune needs a GPU (triton.testing.do_bench and @triton.autotune have no driver under "
                 "Triton's interpreter): fixed configuration used")


def device_smem_bytes(device: torch.device) -> int:
    """Shared memory one program may opt into on `device`, as the device reports it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        from triton.runtime import driver

        return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # an older triton: ask PyTorch
        props = torch.cuda.get_device_properties(index)
        return int(getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block))


_COMPILE_TARGET_SMEM: list[int | None] = [None]  # set by `autotune_for_target` while lab/compile.py records


@contextlib.contextmanager
def autotune_for_target(shared_per_block: int) -> Iterator[None]:
    """While lab/compile.py records launches for a compile target (no GPU here): the launchers take their
    autotuned branch on CPU tensors too, their candidates pruned by the target's per-block shared memory as the
    device's reported limit prunes them on a GPU of that target. The autotuner itself never times anything then:
    the recorder compiles each candidate instead (lab/compile.py `recording`)."""
    _COMPILE_TARGET_SMEM[0] = shared_per_block
    try:
        yield
    finally:
        _COMPILE_TARGET_SMEM[0] = None


def autotune_smem(t: torch.Tensor) -> int | None:
    """The shared memory per block the autotuner prunes its candidates by, for a launch on `t`'s device: the
    device's own on CUDA, the compile target's while lab/compile.py records; None: no autotuner here (elsewhere
    the fixed configuration runs, AUTO_CPU_NOTE)."""
    return device_smem_bytes(t.device) if t.is_cuda else _COMPILE_TARGET_SMEM[0]


def chosen_config(tuner) -> dict | None:
    """The configuration `tuner` chose at its last run (blocks lowercased, warps, stages); None when it chose none
    (lab/compile.py records its candidates instead of running it)."""
    config = getattr(tuner, "best_config", None)
    if config is None:
        return None
    return {**{k.lower(): v for k, v in config.kwargs.items()}, "num_warps": config.num_warps,
            "num_stages": config.num_stages}
