"""Triton matmul against the fp64 reference (runs under the interpreter on CPU)."""

import json

import pytest
import torch

from posttrainllm.ops.matmul import reference
from posttrainllm.ops import interpreter_emulation, is_interpreted
from posttrainllm.ops.matmul.kernels import matmul_launch, triton_matmul

# fp32 "ieee" is exact fp32 FMA; 16-bit outputs are off by their own rounding.
DTYPE_TOL = [
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 1e-3, 1e-3),
    (torch.bfloat16, 1e-2, 1e-2),
]
SMALL_BLOCKS = dict(block_m=16, block_n=32, block_k=16)


def _inputs(M, N, K, dtype, device):
    return torch.randn(M, K, dtype=dtype, device=device), torch.randn(K, N, dtype=dtype, device=device)


def _oracle(a, b):
    return reference.matmul(a.double(), b.double())


@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_TOL)
@pytest.mark.parametrize("M, N, K", [(41, 77, 33), (16, 16, 16), (1, 5, 70)])
def test_matches_reference(M, N, K, dtype, atol, rtol, device):
    a, b = _inputs(M, N, K, dtype, device)
    c = triton_matmul(a, b, **SMALL_BLOCKS, group_m=2)
    assert c.shape == (M, N) and c.dtype == dtype
    torch.testing.assert_close(c.double(), _oracle(a, b), atol=atol, rtol=rtol)


@pytest.mark.parametrize("group_m", [1, 3, 64])
def test_grouped_ordering_covers_every_tile(group_m, device):
    a, b = _inputs(100, 90, 20, torch.float32, device)
    c = triton_matmul(a, b, **SMALL_BLOCKS, group_m=group_m)
    torch.testing.assert_close(c.double(), _oracle(a, b), atol=1e-5, rtol=1e-5)


def test_non_contiguous_inputs(device):
    a = torch.randn(33, 41, device=device).t()  # (41, 33), column-major
    b = torch.randn(77, 66, device=device)[:, ::2].t()  # (33, 77), strided
    c = triton_matmul(a, b, **SMALL_BLOCKS)
    torch.testing.assert_close(c.double(), _oracle(a, b), atol=1e-5, rtol=1e-5)


def test_tf32_input_precision(device):
    a, b = _inputs(41, 77, 33, torch.float32, device)
    c = triton_matmul(a, b, **SMALL_BLOCKS, input_precision="tf32")
    torch.testing.assert_close(c.double(), _oracle(a, b), atol=5e-2, rtol=1e-2)


@pytest.mark.skipif(not is_interpreted(), reason="documents Triton's interpreter")
def test_interpreter_bf16_is_wrong_without_emulation(device):
    assert "triton-lang/triton#11584" in interpreter_emulation(torch.bfloat16)
    assert interpreter_emulation(torch.float32) is None
    a, b = _inputs(41, 77, 33, torch.bfloat16, device)
    raw = triton_matmul(a, b, **SMALL_BLOCKS, emulate_bf16=False).double()
    err = (raw - _oracle(a, b)).abs().nan_to_num(posinf=float("inf")).max().item()
    assert err > 1e3, f"interpreter bf16 dot looks fixed (max err {err}); revisit the emulation"


def test_launch_geometry():
    launch = matmul_launch(41, 77, 33, block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=3)
    assert launch == {
        "grid": [3 * 3], "block_m": 16, "block_n": 32, "block_k": 16, "group_m": 2, "even_k": False, "num_warps": 4,
        "num_stages": 3,
    }
    json.dumps(launch)


@pytest.mark.parametrize(
    "a_shape, b_shape, kwargs, match",
    [
        ((4, 4, 4), (4, 4), {}, "2-D"),
        ((8, 16), (17, 8), {}, "inner dims"),
        ((16, 16), (16, 16), {"block_m": 24}, "block_m=24 must be a power of two"),
        ((16, 16), (16, 16), {"block_k": 8}, "block_k=8 must be a power of two >= 16"),
        ((16, 16), (16, 16), {"input_precision": "tf32x3"}, "input_precision"),
    ],
)
def test_rejects_bad_input(a_shape, b_shape, kwargs, match):
    with pytest.raises(ValueError, match=match):
        triton_matmul(torch.randn(a_shape), torch.randn(b_shape), **kwargs)


def test_rejects_mixed_dtypes():
    with pytest.raises(ValueError, match="dtype mismatch"):
        triton_matmul(torch.randn(16, 16), torch.randn(16, 16, dtype=torch.float16))


@pytest.mark.parametrize("M, N, K, block_k", [(37, 50, 64, 32), (37, 50, 48, 32), (16, 16, 16, 16)])
def test_even_and_ragged_k_paths(M, N, K, block_k, device):
    """EVEN_K (K a multiple of BLOCK_K: no load masked, edge rows wrap modulo M, N) and the ragged path agree."""
    a = torch.randn(M, K, device=device)
    b = torch.randn(K, N, device=device)
    assert matmul_launch(M, N, K, block_m=16, block_n=32, block_k=block_k, group_m=2, num_warps=4,
                         num_stages=2)["even_k"] == (K % block_k == 0)
    c = triton_matmul(a, b, block_m=16, block_n=32, block_k=block_k, group_m=2)
    torch.testing.assert_close(c.double(), a.double() @ b.double(), atol=1e-4, rtol=1e-4)
