"""Triton kernels, one op family per module (matmul, attention), and reference.py: the readable math.

Importing this package does not import triton: reference.py's users (the reference stage) must not
fix Triton's mode before the device is prepared (TRITON_INTERPRET=1 is read when triton first loads).

Shared here: how a kernel learns that it runs under Triton's interpreter
(`TRITON_INTERPRET=1`, the CPU path), and the one numerical emulation the kernels
apply there, so that receipts can state it.
"""

from __future__ import annotations

import os
from typing import Any

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


_FAST_PATCHING: bool | None = None  # decided once, as _BF16_PATCHED

LANGUAGE_PATCHING_REASON = (
    "Triton's interpreter (3.9) patches triton.language at every launch and again at every call of a nested "
    "@triton.jit function, listing each module's members with inspect.getmembers every time (~1.4 ms a patch); "
    "here a nested call whose modules the launch has patched skips that, and a launch patches from each module's "
    "builtins listed once: the same functions are put in place, so the kernels compute the same bits")


def fast_language_patching_in_interpreter() -> bool:
    """Under Triton's interpreter, its patching of triton.language made cheaper (LANGUAGE_PATCHING_REASON):

    - a launch patches the modules its kernel sees and restores them when it ends; a nested @triton.jit function
      whose modules that launch already patched calls straight through, and one that sees another module (tl.core,
      for triton.language's own helpers) patches it as the interpreter does;
    - each module's builtins are listed once, not with inspect.getmembers at every patch (a module's members do
      not change; a name already patched when listed, by a patch the interpreter never restores, stays patched).

    Every process that interprets Triton calls it once it has decided to (measure/device.py `prepare`, a user path's
    worker, the tests). Idempotent; False where Triton is not interpreted or its interpreter lacks what this
    relies on."""
    global _FAST_PATCHING
    if _FAST_PATCHING is not None:
        return _FAST_PATCHING
    if not is_interpreted():
        _FAST_PATCHING = False
        return False
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang, scope_type = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    patch_builtin, patch_attr = getattr(interpreter, "_patch_builtin", None), getattr(interpreter, "_patch_attr", None)
    if None in (patch_lang, scope_type, patch_builtin, patch_attr) or not hasattr(scope_type, "restore"):
        _FAST_PATCHING = False
        return False
    patched: list[set[int]] = []  # per running launch: the language modules patched while it runs
    builtins: dict[int, list[tuple[str, Any]]] = {}  # per module: its builtin members, listed once

    def fast_patch_lang(fn: Any) -> Any:
        langs = {id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)}
        if patched and langs <= patched[-1]:  # a nested call whose modules are patched: nothing to do
            return scope_type()
        scope = patch_lang(fn)
        if patched:  # a nested call seeing another module: patched as the interpreter does (it never restores it)
            patched[-1] |= langs
            return scope
        patched.append(langs)  # a launch: its scope is restored when the launch ends, and so is our record
        restore = scope.restore

        def restore_and_forget() -> None:
            try:
                restore()
            finally:
                patched.pop()

        scope.restore = restore_and_forget
        return scope

    def listed_patch_builtin(pkg: Any, builder: Any, scope: Any) -> None:
        members = builtins.get(id(pkg))
        if members is None:
            members = builtins[id(pkg)] = [(name, member) for name, member in inspect.getmembers(pkg)
                                           if tl.core.is_builtin(member)]
        for name, member in members:
            patch_attr(pkg, name, member, builder, scope)

    fast_patch_lang.__wrapped__ = patch_lang  # the interpreter's own, for the tests' comparison
    listed_patch_builtin.__wrapped__ = patch_builtin
    interpreter._patch_lang, interpreter._patch_builtin = fast_patch_lang, listed_patch_builtin
    _FAST_PATCHING = True
    return True


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
