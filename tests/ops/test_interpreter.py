"""The interpreter's nested calls without its re-patching (ops/__init__.py `fast_language_patching_in_interpreter`):
the same bits as the interpreter's own way, one patch per launch, and triton.language restored after a launch that
raised."""

import contextlib

import pytest
import torch
import triton
import triton.language as tl

from posttrainllm.ops import fast_language_patching_in_interpreter, is_interpreted
from posttrainllm.ops.attention.kernels import flash_attention_with_lse

pytestmark = pytest.mark.skipif(not is_interpreted(), reason="the fast path is for Triton's interpreter only")


@triton.jit
def _scaled(x, scale):
    return x * scale


@triton.jit
def _row_sum(ptr, offs, n):
    return tl.sum(tl.load(ptr + offs, mask=offs < n, other=0.0), axis=0)


@triton.jit
def _nested_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr, FAIL: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    blocks = tl.cdiv(n, BLOCK)  # triton.language's own helper: its globals see tl.core, not tl
    total = _row_sum(x_ptr, offs, n)
    for _ in range(3):
        total = _scaled(total, scale)
    if FAIL:
        tl.static_assert(BLOCK < 0, "planted failure inside a launch")
    tl.store(out_ptr + pid, total + blocks)


def _run(x: torch.Tensor, fail: bool = False) -> torch.Tensor:
    out = torch.empty(4)
    _nested_kernel[(4,)](x, out, x.numel(), 1.5, BLOCK=16, FAIL=fail)
    return out


@contextlib.contextmanager
def _interpreters_own_patching():
    from triton.runtime import interpreter

    fast = interpreter._patch_lang, interpreter._patch_builtin
    interpreter._patch_lang, interpreter._patch_builtin = (function.__wrapped__ for function in fast)
    try:
        yield
    finally:
        interpreter._patch_lang, interpreter._patch_builtin = fast


def _attention(q, k, v):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = flash_attention_with_lse(q, k, v, causal=True, sm_scale=0.3, block_q=16, block_kv=16)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    return [out.detach(), lse, q.grad, k.grad, v.grad]


def test_the_fast_path_is_installed_and_computes_the_same_bits_as_the_interpreters_own():
    assert fast_language_patching_in_interpreter() is True
    x = torch.randn(60)
    q, k, v = torch.randn(3, 1, 2, 40, 16).unbind(0)
    fast = [_run(x), *_attention(q, k, v)]
    with _interpreters_own_patching():
        own = [_run(x), *_attention(q, k, v)]
    assert all(torch.equal(a, b) for a, b in zip(fast, own, strict=True))
    assert torch.allclose(fast[0], torch.stack([x[i * 16:(i + 1) * 16].sum() * 1.5 ** 3 + 4 for i in range(4)]))


def test_a_launch_patches_the_language_once_not_at_every_nested_call(monkeypatch):
    from triton.runtime import interpreter

    patched, own = [], interpreter._patch_lang_core  # called once per module each time the language is patched

    def counting(lang, scope):
        patched.append(lang.__name__)
        return own(lang, scope)

    monkeypatch.setattr(interpreter, "_patch_lang_core", counting)
    _run(torch.randn(60))
    fast = list(patched)
    patched.clear()
    with _interpreters_own_patching():
        _run(torch.randn(60))
    # the launch's modules (tl), then once tl.cdiv's (tl.core and tl), which the launch had not patched; the
    # interpreter's own way patches again at every nested call of each of the 4 programs
    assert fast[0] == "triton.language" and "triton.language.core" in fast and len(fast) <= 3, fast
    assert len(patched) > 4 * 5, patched


def test_each_modules_members_are_listed_once_not_at_every_launch(monkeypatch):
    import inspect

    _run(torch.randn(60))  # lists the modules' builtins, if no launch of this process has yet
    listed, own = [], inspect.getmembers

    def counting(obj, *args):
        listed.append(getattr(obj, "__name__", obj))
        return own(obj, *args)

    monkeypatch.setattr(inspect, "getmembers", counting)
    for _ in range(3):
        _run(torch.randn(60))
    assert listed == [], listed
    with _interpreters_own_patching():
        _run(torch.randn(60))
    assert len(listed) >= 4, listed  # the interpreter's own way lists tl, tl.tensor, tl.math, ... at every patch


def test_a_launch_that_raises_leaves_triton_language_as_it_was():
    before = tl.program_id
    with pytest.raises(Exception, match="planted failure"):
        _run(torch.randn(60), fail=True)
    assert tl.program_id is before
    x = torch.randn(60)
    fast = _run(x)  # the next launch patches again: nothing is left half-recorded
    with _interpreters_own_patching():
        assert torch.equal(fast, _run(x))
