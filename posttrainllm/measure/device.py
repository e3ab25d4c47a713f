"""Which device a point runs on, how Triton runs there, and the fingerprint of the machine.

On a machine without CUDA, Triton kernels run through Triton's interpreter
(TRITON_INTERPRET=1): numerically meaningful, never a speed. The variable must be
set before any `@triton.jit` kernel is defined, so `prepare` runs before the ops
modules are imported (they are imported lazily, inside the stage functions).
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from typing import Any, Iterator

import torch


def resolve(name: str) -> str:
    """auto -> cuda when torch sees a GPU, else cpu."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        from posttrainllm.config import ConfigError

        raise ConfigError("device=cuda but torch sees no CUDA device: valid choices here are auto, cpu")
    return name


def prepare(name: str, threads: int = 0) -> str:
    """Resolve the device, route Triton through its interpreter off-GPU, fix the CPU thread count."""
    device = resolve(name)
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if threads:
        torch.set_num_threads(threads)
    return device


def triton_interpreted() -> bool:
    try:
        import triton

        return bool(triton.knobs.runtime.interpret)
    except (ImportError, AttributeError):
        return os.environ.get("TRITON_INTERPRET") == "1"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fingerprint(device: str) -> dict[str, Any]:
    """What a timing depends on: the device, its software, and the thread count.

    DVC stages that time things depend on this (runs/device.json), so a cached
    timing is never restored on another device.
    """
    import triton

    info: dict[str, Any] = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else _cpu_name(),
        "cpu_name": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "platform": sys.platform,
        "triton_interpreted": device != "cuda",
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(cuda=torch.version.cuda, capability=f"{props.major}.{props.minor}",
                    sm_count=props.multi_processor_count, memory_bytes=props.total_memory)
    return info


@contextlib.contextmanager
def fp32_matmuls(*, tf32: bool) -> Iterator[None]:
    """Pin how torch's CUDA fp32 matmuls and convolutions run, then restore the caller's setting.

    tf32=True lets them use TF32 tensor cores (10-bit mantissa); False forces IEEE fp32, so a
    process-wide TF32 setting cannot leak into an fp32 point. No effect on the CPU.
    torch >= 2.9 spells this `fp32_precision` (the old `allow_tf32` flags warn there).
    """
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision"):
        saved = (matmul.fp32_precision, conv.conv.fp32_precision)
        matmul.fp32_precision = conv.conv.fp32_precision = "tf32" if tf32 else "ieee"
    else:
        saved = (matmul.allow_tf32, conv.allow_tf32)
        matmul.allow_tf32 = conv.allow_tf32 = tf32
    try:
        yield
    finally:
        if hasattr(matmul, "fp32_precision"):
            matmul.fp32_precision, conv.conv.fp32_precision = saved
        else:
            matmul.allow_tf32, conv.allow_tf32 = saved
