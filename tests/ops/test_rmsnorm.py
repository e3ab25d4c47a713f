"""Triton RMSNorm, forward and backward, against fp64 autograd through the reference (the interpreter on CPU)."""

import json

import pytest
import torch

from posttrainllm.ops.rmsnorm import reference
from posttrainllm.ops.rmsnorm.kernels import backward_programs, rmsnorm, rmsnorm_launch
from posttrainllm.ops.rows import MAX_BLOCK_C

EPS = 1e-5
# y and dx are rounded once to the dtype; dW is an fp32 sum rounded once
DTYPE_TOL = [
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 2e-3, 2e-3),
    (torch.bfloat16, 2e-2, 2e-2),
]


def _run(x, weight, dy):
    """(y, dx, dW) of the kernel and of float64 autograd through the reference."""
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = rmsnorm(x, weight, EPS)
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    y64 = reference.rmsnorm(x64, w64, EPS)
    y64.backward(dy.double())
    return (y.detach(), x.grad, weight.grad), (y64.detach(), x64.grad, w64.grad)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_TOL)
@pytest.mark.parametrize("rows, C", [(5, 100), (37, 37), (1, 64)])
def test_matches_reference(rows, C, dtype, atol, rtol, device):
    """C off every power of two (masked lanes), rows off the backward's groups of rows, a single row."""
    x = torch.randn(rows, C, device=device).to(dtype)
    weight = (1 + 0.5 * torch.randn(C, device=device)).to(dtype)
    dy = torch.randn(rows, C, device=device).to(dtype)
    got, want = _run(x, weight, dy)
    assert [t.dtype for t in got] == [dtype] * 3 and got[0].shape == (rows, C)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=atol * max(1.0, w.abs().max().item()), rtol=rtol)


@pytest.mark.parametrize("scale", [1e4, 1e-4])
def test_fp16_rows_far_from_one(scale, device):
    """~1e4: x² (~1e8) overflows fp16 unless upcast; ~1e-4: mean(x²) ~1e-8 << eps, so eps sets the scale."""
    x = (scale * torch.randn(6, 48, device=device)).half()
    weight = torch.ones(48, device=device).half()
    got, want = _run(x, weight, torch.randn(6, 48, device=device).half())
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), w, atol=2e-3 * w.abs().max().item(), rtol=2e-3)
    if scale < 1:  # y ≈ x / sqrt(eps): ~30x smaller than a normalised row
        assert got[0].abs().max() < 0.2


def test_zero_row_stays_finite(device):
    """eps keeps an all-zero row finite: y = 0 exactly, dx = w·dy/sqrt(eps), and it adds nothing to dW."""
    x = torch.randn(3, 20, device=device)
    x[1] = 0.0
    weight = 1 + 0.5 * torch.randn(20, device=device)
    dy = torch.randn(3, 20, device=device)
    (y, dx, dw), (_, dx64, dw64) = _run(x, weight, dy)
    assert torch.equal(y[1], torch.zeros(20, device=device))
    torch.testing.assert_close(dx[1], weight * dy[1] / EPS ** 0.5, atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(dx.double(), dx64, atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(dw.double(), dw64, atol=1e-5, rtol=1e-5)


def test_strided_rows_stride_zero_dy_and_another_weight_dtype(device):
    """x rows of a wider buffer, dy of .sum() (an expanded, stride-0 view), a bf16 x with an fp32 weight (dW in the
    weight's dtype); x needs no grad of its own either."""
    wide = torch.randn(7, 64, device=device)
    x = wide[:, :40]  # (7, 40), row stride 64
    weight = (1 + 0.5 * torch.randn(40, device=device)).requires_grad_()
    rmsnorm(x, weight, EPS).sum().backward()
    w64 = weight.detach().double().requires_grad_()
    reference.rmsnorm(x.double(), w64, EPS).sum().backward()
    torch.testing.assert_close(weight.grad.double(), w64.grad, atol=1e-5, rtol=1e-5)

    xb, w32 = x.bfloat16().requires_grad_(), weight.detach().clone().requires_grad_()
    y = rmsnorm(xb, w32, EPS)
    y.backward(torch.ones_like(y))
    assert y.dtype == xb.grad.dtype == torch.bfloat16 and w32.grad.dtype == torch.float32
    torch.testing.assert_close(y.double(), reference.rmsnorm(xb.double(), w32.double(), EPS), atol=3e-2, rtol=1e-2)


def test_launch_geometry():
    """One forward program per row; the backward's P programs take groups of rows, none of them empty."""
    launch = rmsnorm_launch(37, 100, num_warps=4)
    assert launch == {"grid": [37], "block_c": 128, "blocks_per_row": 1, "num_warps": 4, "backward_grid": [4],
                      "rows_per_program": 10, "dw_partials": [4, 100]}
    json.dumps(launch)
    assert backward_programs(5, None) == (3, 2)  # 4 programs of 2 rows would leave one empty
    assert backward_programs(1, 132) == (1, 1)
    assert backward_programs(16384, 132) == (132, 125)  # an H200's SMs, one group of rows each
    assert rmsnorm_launch(1, 1, num_warps=1)["block_c"] == 1


@pytest.mark.parametrize("x_shape, w_shape, kwargs, match", [
    ((2, 3, 4), (4,), {}, "2-D x"),
    ((2, 4), (5,), {}, "does not match x's C=4"),
    ((2, 4), (4,), {"eps": 0.0}, "eps=0.0 must be > 0"),
    ((2, MAX_BLOCK_C + 1), (MAX_BLOCK_C + 1,), {}, "a row must fit one program"),
    ((2, 4), (4,), {"dtype": torch.float64}, "dtype torch.float64 not supported"),
])
def test_rejects_bad_input(x_shape, w_shape, kwargs, match):
    dtype = kwargs.get("dtype", torch.float32)
    with pytest.raises(ValueError, match=match):
        rmsnorm(torch.randn(x_shape, dtype=dtype), torch.randn(w_shape, dtype=dtype), kwargs.get("eps", EPS))
