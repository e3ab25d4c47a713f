"""Triton flash-attention forward against the fp64 reference (runs under the interpreter on CPU)."""

import json
import math

import pytest
import torch
import triton
import triton.language as tl

from posttrainllm.ops.attention import kernels as attention
from posttrainllm.ops.attention import reference
from posttrainllm.ops import is_interpreted
from posttrainllm.ops.attention.kernels import attention_launch, triton_attention

# O: 16-bit outputs are off by their own rounding (and P's, on the GPU); L is fp32 throughout.
DTYPE_TOL = [
    (torch.float32, 1e-4, 1e-4),
    (torch.float16, 2e-3, 2e-3),
    (torch.bfloat16, 2e-2, 2e-2),
]
LSE_ATOL = 1e-4

# (B, H, Hkv, S, D, block_q, block_kv): MHA, GQA, MQA; S ragged against both blocks.
SHAPES = [
    (2, 2, 2, 37, 16, 16, 32),
    (1, 4, 2, 100, 64, 32, 16),
    (1, 4, 1, 100, 128, 32, 32),
    (1, 2, 2, 64, 32, 32, 32),
]


def _inputs(B, H, Hkv, S, D, dtype, device):
    q = torch.randn(B, H, S, D, dtype=dtype, device=device)
    k = torch.randn(B, Hkv, S, D, dtype=dtype, device=device)
    v = torch.randn(B, Hkv, S, D, dtype=dtype, device=device)
    return q, k, v


def _oracle(q, k, v, **kw):
    q, k, v = q.double(), k.double(), v.double()
    return reference.attention(q, k, v, **kw), reference.attention_logsumexp(q, k, **kw)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_TOL)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("B, H, Hkv, S, D, block_q, block_kv", SHAPES)
def test_matches_reference(B, H, Hkv, S, D, block_q, block_kv, causal, dtype, atol, rtol, device):
    q, k, v = _inputs(B, H, Hkv, S, D, dtype, device)
    o, lse = triton_attention(q, k, v, causal=causal, block_q=block_q, block_kv=block_kv)
    ref_o, ref_lse = _oracle(q, k, v, causal=causal)
    assert o.shape == q.shape and o.dtype == dtype
    assert lse.shape == (B, H, S) and lse.dtype == torch.float32
    torch.testing.assert_close(o.double(), ref_o, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=LSE_ATOL, rtol=0)


def test_head_dim_not_power_of_two(device):
    q, k, v = _inputs(1, 2, 1, 37, 24, torch.float32, device)
    o, lse = triton_attention(q, k, v, block_q=16, block_kv=16)
    ref_o, ref_lse = _oracle(q, k, v)
    torch.testing.assert_close(o.double(), ref_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=LSE_ATOL, rtol=0)


def test_strided_inputs_and_custom_scale(device):
    # (B, S, H, D) buffers viewed as (B, H, S, D), as a fused QKV projection leaves them
    q = torch.randn(1, 50, 4, 32, device=device).transpose(1, 2)
    k = torch.randn(1, 50, 2, 32, device=device).transpose(1, 2)
    v = torch.randn(1, 50, 2, 32, device=device).transpose(1, 2)
    o, lse = triton_attention(q, k, v, sm_scale=0.3, block_q=32, block_kv=32)
    ref_o, ref_lse = _oracle(q, k, v, sm_scale=0.3)
    torch.testing.assert_close(o.double(), ref_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=LSE_ATOL, rtol=0)


@pytest.mark.skipif(not is_interpreted(), reason="documents Triton's interpreter")
def test_interpreter_bf16_is_wrong_without_emulation(device):
    q, k, v = _inputs(1, 2, 2, 37, 32, torch.bfloat16, device)
    o, lse = triton_attention(q, k, v, block_q=32, block_kv=32, emulate_bf16=False)
    ref_o, ref_lse = _oracle(q, k, v)
    o_err = (o.double() - ref_o).abs().nan_to_num(nan=math.inf).max().item()
    lse_err = (lse.double() - ref_lse).abs().nan_to_num(nan=math.inf).max().item()
    assert o_err > 1 and lse_err > 1e3, f"interpreter bf16 looks fixed (O err {o_err}, L err {lse_err})"


# Lengths where the causal split matters: a query block whose diagonal spans several KV blocks
# (block_q > block_kv), one KV block holding several query blocks' diagonals (block_q < block_kv),
# S a multiple of both (no ragged tail: the unmasked phase covers all but the diagonal), and S below one block.
SPLIT_SHAPES = [
    (1, 2, 1, 128, 32, 64, 16),
    (1, 2, 2, 80, 32, 16, 64),
    (1, 1, 1, 128, 32, 32, 32),
    (1, 2, 2, 9, 32, 64, 64),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("B, H, Hkv, S, D, block_q, block_kv", SPLIT_SHAPES)
def test_causal_split_and_ragged_tail(B, H, Hkv, S, D, block_q, block_kv, causal, device):
    q, k, v = _inputs(B, H, Hkv, S, D, torch.float32, device)
    o, lse = triton_attention(q, k, v, causal=causal, block_q=block_q, block_kv=block_kv)
    ref_o, ref_lse = _oracle(q, k, v, causal=causal)
    torch.testing.assert_close(o.double(), ref_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=LSE_ATOL, rtol=0)


def test_non_positive_scale_is_refused():
    q = torch.randn(1, 1, 16, 16)
    with pytest.raises(ValueError, match="sm_scale=-0.5 must be > 0"):
        triton_attention(q, q, q, sm_scale=-0.5)


def test_autotune_off_gpu_runs_the_given_configuration(device):
    """`auto` cannot time configurations under the interpreter: the launcher runs the blocks it was given."""
    from posttrainllm.ops.attention import kernels as attention

    if device != "cpu":
        pytest.skip("CPU behaviour")
    q, k, v = _inputs(1, 2, 2, 37, 16, torch.float32, device)
    attention.LAST_AUTOTUNE.clear()
    o, _ = triton_attention(q, k, v, block_q=16, block_kv=16, autotune="tile")
    torch.testing.assert_close(o.double(), _oracle(q, k, v)[0], atol=1e-4, rtol=1e-4)
    assert attention.LAST_AUTOTUNE == {}


def test_launch_geometry():
    launch = attention_launch(2, 4, 100, 24, block_q=32, block_kv=16, num_warps=4, num_stages=2)
    assert launch == {
        "grid": [4, 8], "block_q": 32, "block_kv": 16, "block_d": 32, "num_warps": 4, "num_stages": 2,
    }
    json.dumps(launch)


@pytest.mark.parametrize(
    "q_shape, kv_shape, kwargs, match",
    [
        ((1, 4, 16, 16), (1, 3, 16, 16), {}, "not a multiple of Hkv=3"),
        ((1, 2, 16, 16), (1, 2, 16, 32), {}, "head dim mismatch"),
        ((1, 2, 16, 16), (1, 2, 32, 16), {}, "sequence mismatch"),
        ((1, 2, 16, 16), (2, 2, 16, 16), {}, "batch mismatch"),
        ((2, 16, 16), (2, 16, 16), {}, "4-D"),
        ((1, 2, 16, 16), (1, 2, 16, 16), {"block_q": 48}, "block_q=48 must be a power of two"),
        ((1, 2, 16, 16), (1, 2, 16, 16), {"block_kv": 8}, "block_kv=8 must be a power of two >= 16"),
    ],
)
def test_rejects_bad_input(q_shape, kv_shape, kwargs, match):
    q, k = torch.randn(q_shape), torch.randn(kv_shape)
    with pytest.raises(ValueError, match=match):
        triton_attention(q, k, k.clone(), **kwargs)


def test_rejects_mixed_dtypes():
    q = torch.randn(1, 2, 16, 16)
    with pytest.raises(ValueError, match="dtype mismatch"):
        triton_attention(q, q.half(), q)


# --- launch order and grid ------------------------------------------------------------------

@triton.jit
def _record_schedule(OUT, S, BH, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    """OUT[rank] = (block, pair) that the kernels' _schedule gives the program of launch rank `rank`."""
    block, bh = attention._schedule(S, BH, BLOCK, REVERSE)
    rank = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.store(OUT + 2 * rank, block)
    tl.store(OUT + 2 * rank + 1, bh)


def _launch_order(S, block, bh, reverse, grid, device):
    out = torch.full((grid[0] * grid[1], 2), -1, dtype=torch.int32, device=device)
    _record_schedule[tuple(grid)](out, S, bh, BLOCK=block, REVERSE=reverse)
    return [tuple(row) for row in out.tolist()]


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("S, block, bh", [(100, 32, 6), (37, 16, 1), (64, 16, 3)])
def test_heavy_blocks_of_every_head_launch_first(S, block, bh, flat, device):
    """Causal: query block b sees b + 1 KV blocks (forward, dQ), KV block b is seen by n - b query blocks
    (dK/dV). In launch order, each (block, pair) comes exactly once and the work never grows, across heads."""
    n = triton.cdiv(S, block)
    grid = [n * bh, 1] if flat else attention.launch_grid(n, bh)
    for reverse, work in ((True, lambda b: b + 1), (False, lambda b: n - b)):
        order = _launch_order(S, block, bh, reverse, grid, device)
        assert sorted(order) == [(b, h) for b in range(n) for h in range(bh)]
        works = [work(b) for b, _ in order]
        assert works == sorted(works, reverse=True)
        assert {h for _, h in order[:bh]} == set(range(bh)) and works[0] == n  # the heaviest block of every head


def test_grid_folds_past_axis_1_and_refuses_past_axis_0():
    assert attention.launch_grid(3, 65535) == [3, 65535]
    assert attention.launch_grid(3, 65536) == [3 * 65536, 1]
    assert attention_launch(65536, 2, 128, 64, block_q=64, block_kv=64, num_warps=4, num_stages=2)["grid"] == [
        2 * 131072, 1]
    with pytest.raises(ValueError, match="exceed CUDA's 2147483647"):
        attention.launch_grid(2**16, 2**15)


@pytest.mark.parametrize("causal", [True, False])
def test_a_folded_grid_gives_the_same_attention(causal, monkeypatch, device):
    """The (blocks·pairs, 1) grid, forced at a small size: forward and gradients still match, at an odd length."""
    monkeypatch.setattr(attention, "MAX_GRID_Y", 1)
    assert attention.attention_launch(2, 3, 37, 16, block_q=16, block_kv=16, num_warps=4, num_stages=2)[
        "grid"] == [18, 1]
    q, k, v = (t.requires_grad_() for t in _inputs(2, 3, 1, 37, 16, torch.float32, device))
    o, lse = attention.flash_attention_with_lse(q, k, v, causal=causal, block_q=16, block_kv=16)
    ref_o, ref_lse = _oracle(q.detach(), k.detach(), v.detach(), causal=causal)
    torch.testing.assert_close(o.detach().double(), ref_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=LSE_ATOL, rtol=0)
    do = torch.randn_like(o)
    o.backward(do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference.attention(q64, k64, v64, causal=causal).backward(do.double())
    for got, want in zip((q.grad, k.grad, v.grad), (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_autotune_keys_on_the_problem_size():
    """tile=auto: the tuner's key holds the sequence length and the (batch, head) pairs, and every key names an
    argument of its kernel (Triton's autotuner silently drops a key it cannot find among the arguments)."""
    for kernel, space in ((attention._attn_fwd_kernel, attention.FWD_SPACE),
                          (attention._attn_bwd_dkdv, attention.DKDV_SPACE),
                          (attention._attn_bwd_dq, attention.DQ_SPACE)):
        tuner = attention._tuner(kernel, space, smem=232448, block_d=64, itemsize=2, tensor_cores=True,
                                 tune_tiles=True)
        assert {"S", "BH"} <= set(tuner.keys), kernel
        assert set(tuner.keys) <= set(kernel.arg_names), kernel


SPACES = {"forward": attention.FWD_SPACE, "dkdv": attention.DKDV_SPACE, "dq": attention.DQ_SPACE}


def test_the_register_rule_prunes_the_spaces_at_head_dim_128_and_keeps_them_at_32():
    """tile=auto: at D 128 (bf16, wgmma) the candidates whose tiles spill on sm90 are dropped (128 queries on 4
    warps; dK/dV's 32x128 on 4 warps and 64-key steps of 64 queries); at D 32 every candidate stays (none spills);
    fp32 `ieee` dots (FMA) keep the ones that fit, or the cheapest with their streamed block halved until they do."""
    fit = attention.fitting_space
    assert fit("forward", attention.FWD_SPACE, 128, 2, True, True) == [(64, 64, 4), (64, 128, 4), (128, 64, 8),
                                                                        (128, 128, 8)]
    assert fit("dkdv", attention.DKDV_SPACE, 128, 2, True, True) == [(32, 64, 4), (32, 128, 8)]
    assert fit("dq", attention.DQ_SPACE, 128, 2, True, True) == [(64, 32, 4), (64, 64, 4), (128, 32, 8),
                                                                  (128, 64, 8)]
    for itemsize in (2, 4):  # bf16 and tf32 at D 32: the space as it is
        assert all(fit(kernel, space, 32, itemsize, True, True) == space for kernel, space in SPACES.items())
    assert fit("forward", attention.FWD_SPACE, 32, 4, False, True) == [(64, 64, 4), (128, 64, 8)]
    assert fit("dkdv", attention.DKDV_SPACE, 32, 4, False, True) == [(16, 64, 4), (16, 128, 8)]  # 32-query steps
    for block_d in (16, 32, 64, 128, 256):  # every space keeps a choice, each candidate's blocks >= 16
        for tensor_cores, itemsize in ((True, 2), (True, 4), (False, 4)):
            for kernel, space in SPACES.items():
                kept = fit(kernel, space, block_d, itemsize, tensor_cores, True)
                assert len(kept) >= 2 and min(b for entry in kept for b in entry[:2]) >= 16, (kernel, block_d)
    # workgroup=auto tunes warps and stages at the point's blocks: 128 queries keep their 8 warps, never smaller blocks
    assert fit("forward", attention._space((128, 64, 4), False, attention.FWD_SPACE), 128, 2, True, False) == [
        (128, 64, 8)]
    assert len(attention._configs("forward", [(128, 64, 4), (128, 64, 8)], attention.STAGES, 232448, 128, 2, True,
                                  False)) == 2  # one per stage count
    assert attention.uses_tensor_cores(torch.float32, "tf32") and not attention.uses_tensor_cores(torch.float32, "ieee")
