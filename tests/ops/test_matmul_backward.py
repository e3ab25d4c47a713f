"""Triton matmul backward and `linear` against fp64 autograd (runs under the interpreter on CPU)."""

import pytest
import torch

from posttrainllm.ops.matmul import reference
from posttrainllm.ops.matmul import kernels as matmul_module
from posttrainllm.ops.matmul.kernels import linear, matmul

# dA, dB are matmuls themselves: same budgets as the forward, K here being M or N.
DTYPE_TOL = [
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 2e-3, 2e-3),
    (torch.bfloat16, 2e-2, 2e-2),
]
SMALL_BLOCKS = dict(block_m=16, block_n=32, block_k=16, group_m=2)


def _leaf(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)


def _oracle_grads(a, b, dc):
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    reference.matmul(a64, b64).backward(dc.double())
    return a64.grad, b64.grad


@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_TOL)
@pytest.mark.parametrize("M, N, K", [(41, 77, 33), (1, 5, 70)])
def test_grads_match_reference(M, N, K, dtype, atol, rtol, device):
    a, b = _leaf(M, K, dtype=dtype, device=device), _leaf(K, N, dtype=dtype, device=device)
    dc = torch.randn(M, N, dtype=dtype, device=device)
    c = matmul(a, b, **SMALL_BLOCKS)
    assert c.shape == (M, N) and c.dtype == dtype
    c.backward(dc)
    da, db = _oracle_grads(a, b, dc)
    assert a.grad.dtype == b.grad.dtype == dtype
    torch.testing.assert_close(a.grad.double(), da, atol=atol, rtol=rtol)
    torch.testing.assert_close(b.grad.double(), db, atol=atol, rtol=rtol)


def test_backward_runs_on_transposed_views_without_copies(monkeypatch, device):
    calls = []
    real = matmul_module.triton_matmul

    def spy(x, y, **kw):
        calls.append((x, y))
        return real(x, y, **kw)

    monkeypatch.setattr(matmul_module, "triton_matmul", spy)
    a, b = _leaf(41, 33, device=device), _leaf(33, 77, device=device)
    dc = torch.randn(41, 77, device=device)
    matmul(a, b, **SMALL_BLOCKS).backward(dc)
    (_, _), (dc_1, b_t), (a_t, dc_2) = calls  # forward, dA = dC Bᵀ, dB = Aᵀ dC
    assert b_t.data_ptr() == b.data_ptr() and b_t.stride() == (1, 77)
    assert a_t.data_ptr() == a.data_ptr() and a_t.stride() == (1, 33)
    assert dc_1.data_ptr() == dc_2.data_ptr() == dc.data_ptr()


def test_only_the_needed_gradient_is_computed(monkeypatch, device):
    calls = []
    real = matmul_module.triton_matmul
    monkeypatch.setattr(matmul_module, "triton_matmul", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    a, b = _leaf(41, 33, device=device), torch.randn(33, 77, device=device)
    matmul(a, b, **SMALL_BLOCKS).sum().backward()  # sum(): dC is an expanded, stride-0 view
    assert len(calls) == 2 and b.grad is None
    torch.testing.assert_close(a.grad.double(), _oracle_grads(a, b, torch.ones(41, 77))[0], atol=1e-5, rtol=1e-5)


def test_linear_with_3d_input(device):
    x, w = _leaf(2, 7, 33, device=device), _leaf(45, 33, device=device)
    dy = torch.randn(2, 7, 45, device=device)
    y = linear(x, w, **SMALL_BLOCKS)
    assert y.shape == (2, 7, 45)
    y.backward(dy)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    y64 = torch.nn.functional.linear(x64, w64)
    y64.backward(dy.double())
    torch.testing.assert_close(y.detach().double(), y64.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, atol=1e-5, rtol=1e-5)


def test_linear_matches_nn_linear_with_non_contiguous_input(device):
    layer = torch.nn.Linear(33, 20, bias=False, device=device)
    x = torch.randn(3, 33, 5, device=device).transpose(1, 2)  # (3, 5, 33), strided
    torch.testing.assert_close(linear(x, layer.weight, **SMALL_BLOCKS), layer(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "x_shape, w_shape, match",
    [((4, 33), (20, 32), "in-features 32"), ((4, 33), (20, 33, 1), "2-D weight")],
)
def test_linear_rejects_bad_shapes(x_shape, w_shape, match):
    with pytest.raises(ValueError, match=match):
        linear(torch.randn(x_shape), torch.randn(w_shape))


def test_matmul_rejects_bad_input():
    with pytest.raises(ValueError, match="inner dims"):
        matmul(_leaf(8, 16), _leaf(17, 8))
    with pytest.raises(ValueError, match="block_m=24 must be a power of two"):
        matmul(_leaf(16, 16), _leaf(16, 16), block_m=24)


def test_the_autotune_key_names_the_strides_so_da_and_db_tune_as_their_own_problems():
    """tile=auto: dA = dC @ Bᵀ and dB = Aᵀ @ dC run the forward's kernel on transposed views; at M = N = K only their
    strides tell the three apart, so the tuner's key holds them (every key an argument of the kernel: Triton's
    autotuner drops one it cannot find)."""
    tuner = matmul_module._tuner(matmul_module._space((64, 64, 32, 8, 4, 2), True), 232448, 2)
    assert {"M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn"} <= set(tuner.keys)
    assert set(tuner.keys) <= set(tuner.arg_names)
    a, b, dc = (torch.empty(64, 64) for _ in range(3))

    def key(x, y):
        named = dict(zip(tuner.arg_names, matmul_module.kernel_args(x, y, dc)))
        return tuple(named[name] for name in tuner.keys)
    assert len({key(a, b), key(dc, b.t()), key(a.t(), dc)}) == 3  # forward, dA, dB
