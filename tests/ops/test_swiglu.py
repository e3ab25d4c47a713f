"""Triton SwiGLU forward and backward against fp64 autograd through the reference (interpreter on CPU)."""

import json

import pytest
import torch

from posttrainllm.ops.swiglu import reference
from posttrainllm.ops.swiglu.kernels import swiglu, swiglu_launch, triton_swiglu_backward, triton_swiglu_forward

# One rounding of an fp32 result to the output's dtype (the oracle's fp64 values rounded by the test's atol/rtol).
DTYPE_TOL = [
    (torch.float32, 1e-6, 1e-6),
    (torch.float16, 1e-3, 1e-3),
    (torch.bfloat16, 8e-3, 8e-3),
]
BLOCKS = dict(block_rows=16, block_f=32)


def _leaves(rows, ffn, dtype, gate_scale=1.0, up_scale=1.0):
    gate = (torch.randn(rows, ffn) * gate_scale).to(dtype).requires_grad_()
    up = (torch.randn(rows, ffn) * up_scale).to(dtype).requires_grad_()
    return gate, up


def _oracle(gate, up, dh):
    """Float64 autograd through reference.swiglu: (out, d_gate, d_up)."""
    g64, u64 = (t.detach().double().requires_grad_() for t in (gate, up))
    out = reference.swiglu(g64, u64)
    out.backward(dh.double())
    return out.detach(), g64.grad, u64.grad


def _check(gate, up, dh, atol, rtol, **blocks):
    out = swiglu(gate, up, **(blocks or BLOCKS))
    assert out.shape == gate.shape and out.dtype == gate.dtype
    out.backward(dh)
    want, d_gate, d_up = _oracle(gate, up, dh)
    assert gate.grad.dtype == up.grad.dtype == gate.dtype
    for got, ref in ((out, want), (gate.grad, d_gate), (up.grad, d_up)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.detach().double(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_TOL)
@pytest.mark.parametrize("rows, ffn", [(41, 100), (1, 37), (19, 1)])
def test_matches_reference_off_every_block(rows, ffn, dtype, atol, rtol):
    gate, up = _leaves(rows, ffn, dtype)
    _check(gate, up, torch.randn(rows, ffn).to(dtype), atol, rtol)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy e^100
@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_TOL)
def test_saturated_gate_gives_no_nan(dtype, atol, rtol):
    """|gate| up to 100: e^(−g) overflows fp32 (and fp16) to inf; σ = 1 / (1 + inf) = 0, silu = −0, no NaN."""
    gate, up = _leaves(8, 40, dtype, gate_scale=15.0)
    with torch.no_grad():
        gate[:, 0], gate[:, 1] = 100.0, -100.0
    _check(gate, up, torch.randn(8, 40).to(dtype), atol, rtol)
    assert gate.grad[:, 1].abs().max() == 0  # silu'(−100) underflows: the saturated gate passes no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_values_keep_their_relative_precision(dtype):
    """gate, up ~ 1e-10: silu's linear regime (out ≈ gate·up/2, ~1e-20), judged relative to its own scale."""
    gate, up = _leaves(8, 40, dtype, gate_scale=1e-10, up_scale=1e-10)
    dh = torch.randn(8, 40).to(dtype)
    out = swiglu(gate, up, **BLOCKS)
    out.backward(dh)
    want, d_gate, d_up = _oracle(gate, up, dh)
    rtol = 1e-6 if dtype == torch.float32 else 8e-3
    for got, ref in ((out, want), (gate.grad, d_gate), (up.grad, d_up)):
        scale = ref.abs().max()
        assert scale > 0
        torch.testing.assert_close(got.detach().double() / scale, ref / scale, atol=rtol, rtol=rtol)


def test_any_strides_and_a_broadcast_upstream_gradient():
    """Transposed and sliced inputs, and `.sum()`'s stride-0 dh (every row and column the same 1)."""
    gate = torch.randn(40, 33).t().requires_grad_()  # (33, 40), column-major
    base = torch.randn(33, 80, requires_grad=True)
    up = base[:, ::2]  # (33, 40), column stride 2
    swiglu(gate, up, **BLOCKS).sum().backward()
    _, d_gate, d_up = _oracle(gate, up, torch.ones(33, 40))
    torch.testing.assert_close(gate.grad.double(), d_gate, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(base.grad[:, ::2].double(), d_up, atol=1e-6, rtol=1e-6)
    assert base.grad[:, 1::2].abs().max() == 0


def test_only_a_needed_gradient_is_returned():
    gate = torch.randn(5, 37, requires_grad=True)
    up = torch.randn(5, 37)
    swiglu(gate, up, **BLOCKS).backward(torch.ones(5, 37))
    assert up.grad is None
    torch.testing.assert_close(gate.grad.double(), _oracle(gate, up, torch.ones(5, 37))[1], atol=1e-6, rtol=1e-6)


def test_launchers_directly_and_the_launch_geometry():
    gate, up, dh = torch.randn(41, 100), torch.randn(41, 100), torch.randn(41, 100)
    torch.testing.assert_close(triton_swiglu_forward(gate, up, **BLOCKS), torch.nn.functional.silu(gate) * up)
    d_gate, d_up = triton_swiglu_backward(gate, up, dh, **BLOCKS)
    _, want_gate, want_up = _oracle(gate, up, dh)
    torch.testing.assert_close(d_gate.double(), want_gate, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(d_up.double(), want_up, atol=1e-6, rtol=1e-6)
    launch = swiglu_launch(41, 100, block_rows=16, block_f=32, num_warps=4)
    assert launch == {"grid": [3, 4], "block_rows": 16, "block_f": 32, "num_warps": 4, "programs": 12}
    json.dumps(launch)


@pytest.mark.parametrize(
    "gate, up, kwargs, match",
    [
        (torch.randn(2, 3, 4), torch.randn(2, 3, 4), {}, "expected 2-D gate"),
        (torch.randn(4, 8), torch.randn(4, 9), {}, "shape mismatch"),
        (torch.randn(4, 8), torch.randn(4, 8, dtype=torch.float16), {}, "dtype mismatch"),
        (torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64), {}, "not supported"),
        (torch.randn(0, 8), torch.randn(0, 8), {}, "rows=0 must be >= 1"),
        (torch.randn(4, 8), torch.randn(4, 8), {"block_f": 24}, "block_f=24 must be a power of two"),
        (torch.randn(4, 8), torch.randn(4, 8), {"num_warps": 3}, "num_warps=3 must be a power of two"),
    ],
)
def test_rejects_bad_input(gate, up, kwargs, match):
    with pytest.raises(ValueError, match=match):
        swiglu(gate, up, **kwargs)
