"""Decode attention (a query chunk against a KV cache) against the fp64 reference, under the interpreter on CPU."""

import pytest
import torch
import torch.nn.functional as F

from posttrainllm.ops.attention import reference as attention_reference
from posttrainllm.ops.decode_attention import reference as decode_attention_reference
from posttrainllm.ops.decode_attention.kernels import (check_addressable, decode_attention, decode_attention_launch,
                                                       triton_decode_attention)

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
    want = decode_attention_reference.chunk_attention(q.double(), k.double(), v.double())
    got = triton_decode_attention(q, k, v, block_q=64, block_kv=64)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_TOL)
def test_16_bit_within_their_rounding(dtype, atol, rtol, device):
    q, k, v = _inputs(1, 4, 2, 4, 100, 32, dtype, device)
    want = decode_attention_reference.chunk_attention(q.double(), k.double(), v.double())
    got = triton_decode_attention(q, k, v, block_q=16, block_kv=32)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("splits", [1, 2, 5, 40])
def test_any_number_of_cache_pieces_gives_the_same_answer(splits, device):
    """Pieces past the last key (splits > KV blocks) are empty: the combine weights them 0, never NaN."""
    q, k, v = _inputs(1, 4, 2, 4, 300, 32, torch.float32, device)
    got = triton_decode_attention(q, k, v, block_kv=16, num_splits=splits)
    torch.testing.assert_close(got, decode_attention_reference.chunk_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_the_mask_is_bottom_right_and_sdpa_is_causal_is_top_left(device):
    """The reason the SDPA peer takes an explicit mask: with Sq != Sk, is_causal lets query i see only j <= i."""
    q, k, v = _inputs(1, 2, 2, 4, 10, 16, torch.float64, device)
    mask = decode_attention_reference.chunk_causal_mask(4, 10)
    assert mask.tolist()[0] == [False] * 7 + [True] * 3 and not mask[-1].any()  # query 0 sees keys 0..6
    want = decode_attention_reference.chunk_attention(q, k, v)
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.allclose(top_left, want)
    explicit = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask)
    torch.testing.assert_close(explicit, want)
    # and Sq == Sk is ordinary causal attention
    q2 = torch.randn(1, 2, 10, 16, dtype=torch.float64)
    torch.testing.assert_close(decode_attention_reference.chunk_attention(q2, k, v), attention_reference.attention(q2, k, v, causal=True))


def test_a_planted_top_left_mask_is_caught(device):
    """The same check, aimed at a kernel that aligned its mask top-left, fails."""
    q, k, v = _inputs(1, 2, 2, 4, 100, 16, torch.float64, device)
    wrong = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(wrong, decode_attention_reference.chunk_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_backward_is_the_reference_math(device):
    q, k, v = (t.requires_grad_() for t in _inputs(1, 4, 2, 4, 50, 16, torch.float32, device))
    decode_attention(q, k, v, block_kv=16).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    decode_attention_reference.chunk_attention(q, k, v).sum().backward()
    for a, b in zip(got, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, b)


def test_the_batch_invariant_mode_fixes_the_pieces_by_the_cache_alone(monkeypatch):
    """By default the piece count fills the device, so on a GPU it follows the batch; with split_blocks it follows
    the cache length alone (the batch-invariant mode, op.kv_split_blocks)."""
    import types

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # an H200's 132 SMs
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: types.SimpleNamespace(multi_processor_count=132))
    pieces = lambda batch, **kw: decode_attention_launch(batch, 8, 2, 1, 1000, 64, **kw)["num_splits"]  # noqa: E731
    assert pieces(1) != pieces(64)  # the default: a row's reduction order depends on its batch
    assert pieces(1, split_blocks=4) == pieces(64, split_blocks=4) == 4  # 16 KV blocks, 4 a piece
    assert decode_attention_launch(1, 8, 2, 1, 1000, 64, split_blocks=4)["split_rule"] == (
        "4 KV blocks a piece (batch-invariant)")
    with pytest.raises(ValueError, match="give one or neither"):
        decode_attention_launch(1, 8, 2, 1, 1000, 64, split_blocks=4, num_splits=2)
    with pytest.raises(ValueError, match="must be >= 1"):
        decode_attention_launch(1, 8, 2, 1, 1000, 64, split_blocks=0)


def test_in_the_batch_invariant_mode_a_row_has_the_same_bits_in_any_batch(device):
    q, k, v = _inputs(3, 4, 2, 1, 300, 32, torch.float32, device)
    together = triton_decode_attention(q, k, v, block_kv=16, split_blocks=3)  # 19 KV blocks: 7 pieces
    torch.testing.assert_close(together, decode_attention_reference.chunk_attention(q, k, v), atol=1e-5, rtol=1e-5)
    for row in range(3):
        alone = triton_decode_attention(q[row:row + 1], k[row:row + 1], v[row:row + 1], block_kv=16, split_blocks=3)
        assert torch.equal(alone[0], together[row])


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
    from posttrainllm.lab.configure import load
    from posttrainllm.ops.registry import get_op

    cfg = load(["op=decode_attention", "device=cpu", "parity.seeds=[0]", "shape.ops.decode_attention.kv_lens=[1,100]",
                "shape.ops.decode_attention.kv_len=200"])
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
    want = decode_attention_reference.chunk_attention(q64, k64, v64, sm_scale=0.5)
    torch.testing.assert_close(out.detach().double(), want.detach(), atol=1e-5, rtol=1e-5)
    want.backward(do.double())
    for name, got, ref in zip("qkv", (q.grad, k.grad, v.grad), (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5, msg=lambda m: f"d{name}: {m}")


def test_batch_and_head_bases_past_2_31_elements(device):
    """Views into one buffer whose batch stride (2^30 + 64, itself a 32-bit value) puts batch 2 past 2^31
    elements: 32-bit bases wrap (here, onto untouched memory inside the buffer: wrong rows, not a crash).
    8 GiB of fp16 are reserved; only the pages of the views are touched."""
    B, H, Hkv, Sq, Sk, D = 3, 4, 2, 4, 100, 16
    batch_stride, start = 2**30 + 64, 2**31  # a wrapped base (off by -2^32 elements) still lands in the buffer
    try:
        buf = torch.empty(start + 2 * batch_stride + 2**14, dtype=torch.float16, device=device)
    except (RuntimeError, MemoryError) as exc:
        pytest.skip(f"no room for the 8 GiB buffer: {exc}")

    def view(shape, offset):
        return buf.as_strided(shape, (batch_stride, shape[2] * shape[3], shape[3], 1), start + offset)

    k, v, q = view((B, Hkv, Sk, D), 0), view((B, Hkv, Sk, D), 4096), view((B, H, Sq, D), 8192)
    for t, x in zip((q, k, v), _inputs(B, H, Hkv, Sq, Sk, D, torch.float16, device)):
        t.copy_(x)
    assert 2 * k.stride(0) >= 2**31 > k.stride(0)
    got = triton_decode_attention(q, k, v, block_kv=32)
    want = decode_attention_reference.chunk_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=2e-3)


def test_a_slice_past_32_bit_offsets_is_refused_before_launch():
    """Meta tensors: shapes past 2^31 elements in all are addressable (64-bit bases); one (batch, head) slice
    whose offsets reach 2^31 is not, and is refused before anything is allocated or launched."""
    q = torch.empty(64, 32, 1, 128, device="meta")
    k = torch.empty(64, 8, 2**20, 128, device="meta")  # 2^36 elements, each slice 2^27
    check_addressable(q, k, k)
    launch = decode_attention_launch(512, 32, 8, 17, 2**20, 128, num_splits=64)
    assert 512 * 32 * 17 * launch["num_splits"] * 128 > 2**31  # the fp32 partials, indexed in 64 bits
    long = torch.empty(1, 1, 2**24, 128, device="meta")  # offsets up to 2^31 - 1: the last one that fits
    check_addressable(q[:1, :1], long, long)
    longer = torch.empty(1, 1, 2**24 + 1, 128, device="meta")
    with pytest.raises(ValueError, match=r"k: offsets inside one \(batch, head\) slice reach 2147483775 >= 2\^31"):
        triton_decode_attention(q[:1, :1], longer, longer)
    strided = torch.empty(1, 1, 2**20, 128, device="meta").as_strided((1, 1, 2**20, 128), (0, 0, 2**12, 1))
    with pytest.raises(ValueError, match="v: offsets"):
        check_addressable(q[:1, :1], long, strided)


@pytest.mark.parametrize("args, kwargs, says", [
    ((65536, 8, 1, 1, 100, 64), {}, "axis 1 \\(batch x kv heads\\) = 65536 exceeds CUDA's 65535"),
    ((1, 8, 1, 1, 100, 64), {"num_splits": 65536}, "axis 2 \\(cache pieces\\) = 65536"),
    ((2**15, 2**11, 1, 2**5, 2**6, 64), {"num_splits": 1}, "combine's axis 0 .* = 2147483648 exceeds"),
])
def test_a_grid_past_cuda_limits_is_refused(args, kwargs, says):
    with pytest.raises(ValueError, match=says):
        decode_attention_launch(*args, **kwargs)
