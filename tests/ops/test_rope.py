"""Triton RoPE forward and backward against fp64 autograd through the reference (runs under the interpreter on CPU)."""

import pytest
import torch

from posttrainllm.model.slots import ROPE_TABLES, defaults
from posttrainllm.ops.rope.reference import rope_tables
from posttrainllm.ops.rope import reference
from posttrainllm.ops.rope.kernels import rope, rope_launch, triton_rope

# fp32: a few fp32 roundings; 16-bit: the output's own rounding (values up to ~4: half an ulp is 8e-3 / 1e-3)
DTYPE_TOL = [
    (torch.float32, 1e-6, 1e-6),
    (torch.float16, 2e-3, 2e-3),
    (torch.bfloat16, 1.6e-2, 1.6e-2),
]


def _tables(T, D, offset=0):
    cos, sin = rope_tables(offset + T, D, 10000.0)  # (offset + T, D/2) fp32
    return cos[offset:], sin[offset:]


def _oracle(x, cos, sin, dy):
    x64 = x.detach().double().requires_grad_()
    y64 = reference.rope(x64, cos.double(), sin.double())
    y64.backward(dy.double())
    return y64.detach(), x64.grad


@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_TOL)
@pytest.mark.parametrize("T, D, offset", [(1, 34, 10_000), (37, 8, 0), (37, 34, 5), (20, 64, 10_000)])
def test_forward_and_backward_match_the_float64_reference(T, D, offset, dtype, atol, rtol, device):
    """Head dims off every block (D/2 = 4, 17, 32), a single row, rows over two blocks, positions past training."""
    cos, sin = (t.to(device) for t in _tables(T, D, offset))
    x = torch.randn(2, 3, T, D, device=device).to(dtype).requires_grad_()
    dy = torch.randn(2, 3, T, D, device=device).to(dtype)
    y = rope(x, cos, sin, block_t=16)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    y.backward(dy)
    y64, dx64 = _oracle(x, cos, sin, dy)
    assert x.grad.dtype == dtype
    torch.testing.assert_close(y.detach().double(), y64, atol=atol, rtol=rtol)
    torch.testing.assert_close(x.grad.double(), dx64, atol=atol, rtol=rtol)


def test_the_models_layout_and_per_entry_tables(device):
    """x as the model hands it (a transposed view of the projection, read without a copy) and tables gathered per
    entry as a tree verification passes them (positions repeat, out of order)."""
    B, T, H, D = 2, 19, 3, 16
    x = torch.randn(B, T, H, D, device=device).transpose(1, 2).requires_grad_()  # (B, H, T, D), not contiguous
    assert not x.is_contiguous()
    cos_all, sin_all = (t.to(device) for t in _tables(64, D))
    depth = torch.tensor([0, 1, 1, 2, 2, 2, 3, 5, 4] + [7] * 10, device=device)  # (T,)
    cos, sin = cos_all[40 + depth], sin_all[40 + depth]  # (T, D/2)
    dy = torch.randn(B, T, H, D, device=device).transpose(1, 2)  # a strided upstream gradient
    y = rope(x, cos, sin, block_t=8)
    y.backward(dy)
    y64, dx64 = _oracle(x, cos, sin, dy)
    torch.testing.assert_close(y.detach().double(), y64, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x.grad.double(), dx64, atol=1e-6, rtol=1e-6)


def test_the_backward_is_the_inverse_rotation_and_keeps_the_tables_constant(device):
    cos, sin = (t.to(device).requires_grad_() for t in _tables(33, 32, 100))
    x = torch.randn(1, 2, 33, 32, device=device, requires_grad=True)
    back = triton_rope(triton_rope(x.detach(), cos.detach(), sin.detach(), block_t=16), cos.detach(), sin.detach(),
                       inverse=True, block_t=16)
    torch.testing.assert_close(back, x.detach(), atol=1e-6, rtol=1e-6)  # R(-a) R(a) = I
    rope(x, cos, sin, block_t=16).sum().backward()  # sum(): dy is an expanded, stride-0 view
    assert x.grad is not None and cos.grad is None and sin.grad is None


def test_the_models_rope_is_the_reference_math():
    """The model's default rope and its tables (model/slots.py, declared by this op) are reference.rope and
    reference.rope_tables themselves; the reference keeps float64 in float64 (the oracle)."""
    assert defaults()["rope"] is reference.rope and defaults()[ROPE_TABLES] is reference.rope_tables
    cos, sin = _tables(9, 16, 3)
    x64 = torch.randn(1, 1, 9, 16, dtype=torch.float64)
    y64 = reference.rope(x64, cos.double(), sin.double())
    assert y64.dtype == torch.float64 and not torch.equal(y64, x64.float().double())
    # a rotation keeps lengths, up to the fp32 tables' own rounding (cos² + sin² = 1 ± 1e-7)
    torch.testing.assert_close(y64.norm(dim=-1), x64.norm(dim=-1), atol=0, rtol=2e-7)


def test_launch_geometry():
    assert rope_launch(2, 3, 37, 34, block_t=16, num_warps=4) == {"grid": [6, 3], "block_t": 16, "block_d": 32,
                                                                  "num_warps": 4}


@pytest.mark.parametrize("call, message", [
    (lambda: triton_rope(torch.randn(2, 5, 6), *_tables(5, 6)), "expected x \\(B, H, T, D\\)"),
    (lambda: triton_rope(torch.randn(1, 1, 5, 7), torch.ones(5, 3), torch.ones(5, 3)), "D=7 must be even"),
    (lambda: triton_rope(torch.randn(1, 1, 5, 8), *_tables(4, 8)), "cos must be \\(T, D/2\\) = \\(5, 4\\)"),
    (lambda: triton_rope(torch.randn(1, 1, 5, 8), *_tables(5, 8), block_t=12), "block_t=12 must be a power of two"),
    (lambda: triton_rope(torch.randn(1, 1, 5, 8).double(), *_tables(5, 8)), "dtype torch.float64 not supported"),
])
def test_bad_arguments_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()
