"""Triton flash-attention backward against fp64 autograd through the reference (interpreter on CPU).

gradcheck's finite differences would take minutes in the interpreter; the float64
autograd gradient of reference.attention, fed the same dO, is the oracle instead.
"""

import json

import pytest
import torch

from posttrainllm.ops.attention import reference
from posttrainllm.ops.attention.kernels import (
    attention_backward_launch,
    flash_attention,
    triton_attention,
    triton_attention_backward,
)

# dQ, dK, dV: 16-bit runs round P, dS (fp16 on every device; fp32 under the bf16
# emulation), O, dO and the gradients themselves; fp32 accumulates in fp32 throughout.
DTYPE_TOL = [
    (torch.float32, 1e-4, 1e-4),
    (torch.float16, 5e-3, 5e-3),
    (torch.bfloat16, 2e-2, 2e-2),
]

# (B, H, Hkv, S, D, block_q, block_kv): MHA, GQA, MQA; S ragged against both blocks.
SHAPES = [
    (1, 2, 2, 37, 16, 16, 32),
    (1, 4, 2, 100, 64, 32, 16),
    (1, 4, 1, 100, 128, 32, 32),
    (2, 2, 1, 37, 32, 16, 16),
]


def _inputs(B, H, Hkv, S, D, dtype, device):
    q = torch.randn(B, H, S, D, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, dtype=dtype, device=device, requires_grad=True)
    return q, k, v


def _oracle_grads(q, k, v, do, **kw):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference.attention(q64, k64, v64, **kw).backward(do.double())
    return q64.grad, k64.grad, v64.grad


def _assert_grads_close(q, k, v, ref, atol, rtol):
    for name, got, want in zip("qkv", (q.grad, k.grad, v.grad), ref):
        assert got.shape == want.shape and got.dtype == q.dtype, name
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_TOL)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("B, H, Hkv, S, D, block_q, block_kv", SHAPES)
def test_grads_match_reference(B, H, Hkv, S, D, block_q, block_kv, causal, dtype, atol, rtol, device):
    q, k, v = _inputs(B, H, Hkv, S, D, dtype, device)
    do = torch.randn(B, H, S, D, dtype=dtype, device=device)
    o = flash_attention(q, k, v, causal=causal, block_q=block_q, block_kv=block_kv)
    o.backward(do)
    _assert_grads_close(q, k, v, _oracle_grads(q, k, v, do, causal=causal), atol, rtol)


def test_forward_is_triton_attention(device):
    q, k, v = _inputs(1, 4, 2, 37, 32, torch.float32, device)
    o = flash_attention(q, k, v, block_q=16, block_kv=32)
    o_fwd, _ = triton_attention(q.detach(), k.detach(), v.detach(), block_q=16, block_kv=32)
    assert o.requires_grad and o.grad_fn is not None
    torch.testing.assert_close(o.detach(), o_fwd, atol=0, rtol=0)


def test_head_dim_not_power_of_two_and_custom_scale(device):
    q, k, v = _inputs(1, 2, 1, 37, 24, torch.float32, device)
    do = torch.randn(1, 2, 37, 24, device=device)
    flash_attention(q, k, v, sm_scale=0.3, block_q=16, block_kv=16).backward(do)
    _assert_grads_close(q, k, v, _oracle_grads(q, k, v, do, sm_scale=0.3), 1e-4, 1e-4)


def test_strided_inputs_and_non_contiguous_grad_output(device):
    # (B, S, H, D) buffers viewed as (B, H, S, D), as a fused QKV projection leaves them
    q = torch.randn(1, 50, 4, 32, device=device).transpose(1, 2).requires_grad_()
    k = torch.randn(1, 50, 2, 32, device=device).transpose(1, 2).requires_grad_()
    v = torch.randn(1, 50, 2, 32, device=device).transpose(1, 2).requires_grad_()
    do = torch.randn(1, 32, 50, 4, device=device).permute(0, 3, 2, 1)  # (B, H, S, D), D strided
    assert not do.is_contiguous()
    flash_attention(q, k, v, block_q=32, block_kv=32).backward(do)
    _assert_grads_close(q, k, v, _oracle_grads(q, k, v, do), 1e-4, 1e-4)


def test_broadcast_grad_output_from_sum(device):
    # o.sum() hands the backward an expanded dO whose strides are all 0
    q, k, v = _inputs(1, 2, 2, 37, 16, torch.float32, device)
    flash_attention(q, k, v, causal=False, block_q=16, block_kv=16).sum().backward()
    _assert_grads_close(q, k, v, _oracle_grads(q, k, v, torch.ones(1, 2, 37, 16), causal=False), 1e-4, 1e-4)


def test_only_some_inputs_require_grad(device):
    q, k, v = _inputs(1, 2, 1, 37, 16, torch.float32, device)
    k.requires_grad_(False)
    do = torch.randn(1, 2, 37, 16, device=device)
    flash_attention(q, k, v, block_q=16, block_kv=16).backward(do)
    ref = _oracle_grads(q, k, v, do)
    assert k.grad is None
    torch.testing.assert_close(q.grad.double(), ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v.grad.double(), ref[2], atol=1e-4, rtol=1e-4)


def test_backward_launcher_called_directly(device):
    q, k, v = (t.detach() for t in _inputs(1, 4, 2, 37, 16, torch.float32, device))
    do = torch.randn_like(q)
    o, lse = triton_attention(q, k, v, block_q=16, block_kv=16)
    dq, dk, dv = triton_attention_backward(do, q, k, v, o, lse, causal=True, sm_scale=0.25,
                                           block_q=16, block_kv=16)
    ref = _oracle_grads(q, k, v, do)
    for got, want in zip((dq, dk, dv), ref):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_backward_launch_geometry():
    launch = attention_backward_launch(2, 4, 2, 100, 24, block_q=32, block_kv=16, num_warps=4, num_stages=2)
    assert launch == {
        "preprocess_grid": [4, 8], "dkdv_grid": [7, 4], "dq_grid": [4, 8], "kv_group": 2,
        "dkdv_block_q": 32, "dkdv_block_kv": 16, "dq_block_q": 32, "dq_block_kv": 16,
        "block_d": 32, "num_warps": 4, "num_stages": 2,
    }
    json.dumps(launch)


def test_backward_kernels_take_their_own_blocks():
    """dK/dV: one program per dkdv_block_kv keys; dQ and the preprocess: one per dq_block_q queries."""
    launch = attention_backward_launch(2, 4, 2, 100, 24, block_q=32, block_kv=16, num_warps=4, num_stages=2,
                                       dkdv_block_q=16, dkdv_block_kv=64, dq_block_q=64, dq_block_kv=16)
    assert launch["dkdv_grid"] == [2, 4] and launch["dq_grid"] == [2, 8] and launch["preprocess_grid"] == [2, 8]
    assert (launch["dkdv_block_q"], launch["dkdv_block_kv"], launch["dq_block_q"], launch["dq_block_kv"]) == (
        16, 64, 64, 16)
    with pytest.raises(ValueError, match="dq_block_kv=24 must be a power of two"):
        attention_backward_launch(1, 1, 1, 16, 16, block_q=16, block_kv=16, num_warps=4, num_stages=1,
                                  dq_block_kv=24)


# (S, block_q, block_kv, dkdv (q, kv), dq (q, kv)): lengths off every tile; the dK/dV kernel's diagonal
# spans several query steps (16 < 64) and one (64 > 32); dQ's diagonal several KV steps and one.
OWN_BLOCKS = [
    (100, 32, 32, (16, 64), (64, 16)),
    (77, 16, 16, (64, 32), (16, 32)),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("S, block_q, block_kv, dkdv, dq", OWN_BLOCKS)
def test_grads_with_backward_blocks_of_their_own(S, block_q, block_kv, dkdv, dq, causal, device):
    q, k, v = _inputs(1, 4, 2, S, 32, torch.float32, device)  # GQA
    o = flash_attention(q, k, v, causal=causal, block_q=block_q, block_kv=block_kv, dkdv_block_q=dkdv[0],
                        dkdv_block_kv=dkdv[1], dq_block_q=dq[0], dq_block_kv=dq[1])
    do = torch.randn_like(o)
    o.backward(do)
    _assert_grads_close(q, k, v, _oracle_grads(q, k, v, do, causal=causal), 1e-4, 1e-4)


@pytest.mark.parametrize(
    "q_shape, kv_shape, kwargs, match",
    [
        ((1, 4, 16, 16), (1, 3, 16, 16), {}, "not a multiple of Hkv=3"),
        ((1, 2, 16, 16), (1, 2, 32, 16), {}, "sequence mismatch"),
        ((2, 16, 16), (2, 16, 16), {}, "4-D"),
        ((1, 2, 16, 16), (1, 2, 16, 16), {"block_kv": 8}, "block_kv=8 must be a power of two >= 16"),
        ((1, 2, 16, 16), (1, 2, 16, 16), {"input_precision": "tf32x3"}, "input_precision"),
    ],
)
def test_flash_attention_rejects_bad_input(q_shape, kv_shape, kwargs, match):
    q, k = torch.randn(q_shape, requires_grad=True), torch.randn(kv_shape, requires_grad=True)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, k.clone(), **kwargs)


def test_backward_launcher_rejects_mismatched_grad_output():
    q = torch.randn(1, 2, 16, 16)
    o, lse = triton_attention(q, q, q, block_q=16, block_kv=16)
    with pytest.raises(ValueError, match="must match q"):
        triton_attention_backward(o[:, :, :8], q, q, q, o, lse, causal=True, sm_scale=0.25)


def test_double_backward_is_refused(device):
    q, k, v = _inputs(1, 2, 2, 16, 16, torch.float32, device)
    o = flash_attention(q, k, v, block_q=16, block_kv=16)
    (dq,) = torch.autograd.grad(o.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        dq.sum().backward()
