"""Triton kernels, one op family per module (matmul, attention), and reference.py: the readable math.

Importing this package does not import triton: reference.py's users (the reference stage) must not
fix Triton's mode before the device is prepared (TRITON_INTERPRET=1 is read when triton first loads).

Shared here: how a kernel learns that it runs under Triton's interpreter
(`TRITON_INTERPRET=1`, the CPU path), and the one numerical emulation the kernels
apply there, so that receipts can state it.
"""

from __future__ import annotations

import os

import torch

BF16_INTERPRETER_REASON = (
    "bf16 tl.dot operands upcast to fp32 and output rounded to bf16 by PyTorch: "
    "Triton's interpreter computes on raw bf16 bits (triton-lang/triton#11584). The MoE kernels also round "
    "each intermediate they store or cast (h, y, g, u, dg, du, dX rows, dW) to bf16 in-kernel "
    "(round-to-nearest-even on the fp32 bits), as the GPU does; only the dots' accumulation order differs. "
    "Not so attention: P (forward) and dS (backward) stay fp32 into their dots here where the GPU casts them to "
    "bf16, so its bf16 checks on the CPU judge a slightly more exact kernel than the GPU's"
)


FP8_INTERPRETER_REASON = (
    "fp8: tl.dot runs on the e4m3 operands as loaded (exact here against their upcast product) and the scales in "
    "fp32, as on the GPU; the fp32 output is rounded to bf16 by PyTorch (matmul) or on the bits in-kernel (MoE's "
    "unpermute): the interpreter's fp32 -> bf16 cast truncates. MoE's h is quantized to e4m3 in PyTorch between "
    "its launches, on the GPU too"
)


def is_interpreted() -> bool:
    """True when Triton kernels run through the interpreter instead of a GPU compiler."""
    import triton  # not at module level: TRITON_INTERPRET must be set before triton is first imported

    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:
        return os.environ.get("TRITON_INTERPRET") == "1"


def interpreter_emulation(dtype: torch.dtype, quantized: bool = False) -> str | None:
    """Why the kernels compute differently from the GPU for `dtype` (operands quantized to fp8 with `quantized`)
    here, or None if they don't."""
    if quantized and is_interpreted():
        return FP8_INTERPRETER_REASON
    if dtype == torch.bfloat16 and is_interpreted():
        return BF16_INTERPRETER_REASON
    return None


def use_bf16_emulation(dtype: torch.dtype, emulate_bf16: bool | None) -> bool:
    """Resolve a launcher's `emulate_bf16` switch: None = automatic, False/True force it (bf16 only)."""
    if emulate_bf16 is None:
        return interpreter_emulation(dtype) is not None
    return emulate_bf16 and dtype == torch.bfloat16
