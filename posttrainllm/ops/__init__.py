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


USER_BF16_INTERPRETER_REASON = (
    "a user path's Triton kernels under the interpreter, computed as ours are there: bf16 tl.dot operands upcast "
    "to fp32 (exact) and fp32 -> bf16 casts rounded to nearest even, as on the GPU, by the interpreter's dot and "
    "cast patched in the path's worker (the interpreter computes a bf16 dot on raw bf16 bits, "
    "triton-lang/triton#11584, and truncates the cast). Other arithmetic on bf16 values is still the "
    "interpreter's, on raw bits: a kernel that adds or multiplies bf16 values without upcasting them fails here"
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


_BF16_PATCHED: bool | None = None  # decided once: whether this process's Triton is interpreted, and so patched


def emulate_bf16_in_interpreter() -> bool:
    """Patch Triton's interpreter in this process so that a kernel written for the GPU computes its bf16 dots and
    casts as the GPU does (USER_BF16_INTERPRETER_REASON): the worker of a user path calls it once Triton is loaded
    there, since a user's kernel has no emulate_bf16 switch of ours. Idempotent; False where Triton is not
    interpreted (nothing to patch)."""
    global _BF16_PATCHED
    if _BF16_PATCHED is not None:
        return _BF16_PATCHED
    if not is_interpreted():
        _BF16_PATCHED = False
        return False
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def to_fp32(handle: interpreter.TensorHandle) -> np.ndarray:
        if handle.dtype.scalar != tl.bfloat16:
            return handle.data
        bits = np.ascontiguousarray(handle.data).view(np.int16)  # bf16 is held as its uint16 bits
        return torch.from_numpy(bits.copy()).view(torch.bfloat16).float().numpy()

    builder = interpreter.InterpreterBuilder
    dot, cast = builder.create_dot, builder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar) or d.dtype.scalar == tl.bfloat16:
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(to_fp32(a), to_fp32(b), dtype=d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32).copy())
            return interpreter.TensorHandle(values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
                                            tl.bfloat16)
        return cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl
    _BF16_PATCHED = True
    return True
