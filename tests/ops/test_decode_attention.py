"""Decode attention (a query chunk against a KV cache) against the fp64 reference, under the interpreter on CPU."""

import pytest
import torch
import torch.nn.functional as F

from posttrainllm.ops import reference
from posttrainllm.ops.decode_attention import decode_attention, decode_attention_launch, triton_decode_attention

DTYPE_TOL = [(torch.float32, 1e-5, 1e-5), (torch.float16, 2e-3, 2e-3), (torch.bfloat16, 2e-2, 2e-2)]
# (Sq, Sk): decode (Sq = 1) and verification chunks against empty-ish, ragged and long caches
PAIRS = [(sq, sk) for sq in (1, 4, 17) for sk in (1, 100, 1000) if sq <= sk] + [(17, 17)]


def _inputs(B, H, Hkv, Sq, Sk, D, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Sq, D, generator=gen)
    k, v = torch.randn(B, Hkv, Sk, D, generator=gen), torch.randn(B, Hkv, Sk, D, generator=gen)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


# every (Sq, Sk) pair with GQA; MHA and MQA at a decode step and at the longest chunk and cache
LAYOUTS = [(sq, sk, 4, 2) for sq, sk in PAIRS] + [(sq, sk, 4, kv) for sq, sk in ((1, 100), (17, 1000)) for kv in (4, 1)]


@pytest.mark.parametrize("sq, sk, heads, kv_heads", LAYOUTS)
def test_fp32_matches_the_fp64_reference(sq, sk, heads, kv_heads, device):
    q, k, v = _inputs(2, heads, kv_heads, sq, sk, 32, torch.float32, device)
    want = reference.chunk_attention(q.double(), k.double(), v.double())
    got = triton_decode_attention(q, k, v, block_q=64, block_kv=64)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_TOL)
def test_16_bit_within_their_rounding(dtype, atol, rtol, device):
    q, k, v = _inputs(1, 4, 2, 4, 100, 32, dtype, device)
    want = reference.chunk_attention(q.double(), k.double(), v.double())
    got = triton_decode_attention(q, k, v, block_q=16, block_kv=32)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("splits", [1, 2, 5, 40])
def test_any_number_of_cache_pieces_gives_the_same_answer(splits, device):
    """Pieces past the last key (splits > KV blocks) are empty: the combine weights them 0, never NaN."""
    q, k, v = _inputs(1, 4, 2, 4, 300, 32, torch.float32, device)
    got = triton_decode_attention(q, k, v, block_kv=16, num_splits=splits)
    torch.testing.assert_close(got, reference.chunk_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_the_mask_is_bottom_right_and_sdpa_is_causal_is_top_left(device):
    """The reason the SDPA peer takes an explicit mask: with Sq != Sk, is_causal lets query i see only j <= i."""
    q, k, v = _inputs(1, 2, 2, 4, 10, 16, torch.float64, device)
    mask = reference.chunk_causal_mask(4, 10)
    assert mask.tolist()[0] == [False] * 7 + [True] * 3 and not mask[-1].any()  # query 0 sees keys 0..6
    want = reference.chunk_attention(q, k, v)
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.allclose(top_left, want)
    explicit = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask)
    torch.testing.assert_close(explicit, want)
    # and Sq == Sk is ordinary causal attention
    q2 = torch.randn(1, 2, 10, 16, dtype=torch.float64)
    torch.testing.assert_close(reference.chunk_attention(q2, k, v), reference.attention(q2, k, v, causal=True))


def test_a_planted_top_left_mask_is_caught(device):
    """The same check, aimed at a kernel that aligned its mask top-left, fails."""
    q, k, v = _inputs(1, 2, 2, 4, 100, 16, torch.float64, device)
    wrong = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(wrong, reference.chunk_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_backward_is_the_reference_math(device):
    q, k, v = (t.requires_grad_() for t in _inputs(1, 4, 2, 4, 50, 16, torch.float32, device))
    decode_attention(q, k, v, block_kv=16).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    reference.chunk_attention(q, k, v).sum().backward()
    for a, b in zip(got, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, b)


def test_launch_geometry_serves_a_gqa_group_per_program():
    launch = decode_attention_launch(1, 8, 2, 1, 1000, 64, block_q=64, block_kv=64, num_splits=4)
    assert launch["rows_per_kv_head"] == 4 and launch["block_q"] == 16  # 4 rows padded to tl.dot's 16
    assert launch["grid"] == [1, 2, 4] and launch["kv_per_split"] == 256  # 16 KV blocks in 4 pieces of 4


@pytest.mark.parametrize("shapes, says", [
    (((1, 2, 5, 16), (1, 2, 4, 16)), "1 <= Sq <= Sk"),
    (((1, 3, 1, 16), (1, 2, 4, 16)), "not a multiple"),
    (((1, 2, 1, 16), (1, 2, 4, 32)), "disagree"),
])
def test_bad_shapes_are_refused(shapes, says):
    q, k = torch.zeros(shapes[0]), torch.zeros(shapes[1])
    with pytest.raises(ValueError, match=says):
        triton_decode_attention(q, k, k.clone())


def test_the_op_passes_its_parity_cases_and_states_its_bytes():
    """The lab op: every implementation on the op's own cases, in fp32, against the float64 reference."""
    from posttrainllm.config import load
    from posttrainllm.opdefs import get_op

    cfg = load(["op=decode_attention", "device=cpu", "parity.seeds=[0]", "shape.decode_kv_lens=[1,100]",
                "shape.decode_kv_len=200"])
    op = get_op("decode_attention")
    cases = op.cases(cfg)
    assert {(c.dims["q_len"], c.dims["kv_len"]) for c in cases} >= {(1, 1), (1, 100), (4, 100), (17, 100)}
    assert {c.dims["kv_heads"] for c in cases} == {1, 2, 4}  # MHA, GQA, MQA
    for case in cases:
        x = op.make_inputs(case, torch.float32, "cpu")
        want = op.reference.fn({k: t.double() for k, t in x.items()}, cfg)["out"]
        for impl in op.optimized(cfg):
            torch.testing.assert_close(impl.fn(x, cfg)["out"].double(), want, atol=2e-5, rtol=1e-5,
                                       msg=lambda m: f"{impl.name} {case.name}: {m}")
    costs = op.costs(next(c for c in cases if c.main), cfg)
    assert costs.bytes == (2 * 1 * 4 * 200 * 32 + 2 * 1 * 4 * 1 * 32) * 4  # KV cache + Q and O, fp32


def test_backward_honours_a_custom_scale(device):
    """sm_scale != 1/sqrt(D): the gradients are those of the scaled math (float64 autograd of the reference)."""
    q, k, v = (t.requires_grad_() for t in _inputs(1, 4, 2, 4, 50, 16, torch.float32, device))
    do = torch.randn(1, 4, 4, 16, device=device)
    out = decode_attention(q, k, v, sm_scale=0.5, block_kv=16)
    out.backward(do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = reference.chunk_attention(q64, k64, v64, sm_scale=0.5)
    torch.testing.assert_close(out.detach().double(), want.detach(), atol=1e-5, rtol=1e-5)
    want.backward(do.double())
    for name, got, ref in zip("qkv", (q.grad, k.grad, v.grad), (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"d{name}: {m}")
