"""Per-path byte models (ops/attention/definition.py path_costs) against the traffic eager PyTorch moves (measure/traffic.py).

The readable reference and SDPA's math backend are eager code: every aten op they run, forward and backward, reads
its inputs and writes its outputs, and the counter sums those bytes. Their models must give that sum; the fused
paths' model must sit below the reference's by the factor the two formulas predict (~2·S/D).
"""

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from posttrainllm.config import LabConfig
from posttrainllm.lab.configure import load
from posttrainllm.measure.traffic import counted
from posttrainllm.ops.attention import definition as attention
from posttrainllm.ops.base import FLOOR, FLOOR_NOTE, Case, Impl
from posttrainllm.ops.attention import reference as attention_reference
from posttrainllm.ops.decode_attention import reference as decode_attention_reference


def _cfg(dtype: str, causal: bool) -> LabConfig:
    cfg = load(["device=cpu"])
    return dataclasses.replace(cfg, op=dataclasses.replace(cfg.op, causal=causal),
                               precision=dataclasses.replace(cfg.precision, dtype=dtype))


def _case(heads: int, kv_heads: int, seq_len: int, head_dim: int) -> Case:
    return Case("t", 0, dict(batch=2, heads=heads, kv_heads=kv_heads, seq_len=seq_len, head_dim=head_dim), True)


def _count(fn, case: Case, dtype: torch.dtype):
    d = case.dims
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(d["batch"], d["heads"], d["seq_len"], d["head_dim"], generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(d["batch"], d["kv_heads"], d["seq_len"], d["head_dim"], generator=gen).to(dtype)
            .requires_grad_() for _ in range(2))
    grad = torch.randn(q.shape, generator=gen).to(dtype)
    with counted() as forward:
        out = fn(q, k, v)
    with counted() as backward:
        out.backward(grad)
    return forward.total, forward.total + backward.total


SHAPES = [(4, 4, 64, 16), (4, 2, 48, 8), (2, 1, 33, 16)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_model_is_the_counted_traffic(dtype, causal, shape):
    cfg, case = _cfg(dtype, causal), _case(*shape)
    costs = attention.OP.costs_of(attention.IMPLS["reference"], case, cfg)
    forward, train = _count(lambda q, k, v: attention_reference.attention(q, k, v, causal=causal), case, getattr(torch, dtype))
    assert costs.model == "materialised"
    assert (costs.bytes, costs.train_bytes) == (forward, train)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_math_backend_model_is_the_counted_traffic(dtype, causal, shape):
    cfg, case = _cfg(dtype, causal), _case(*shape)
    gqa = shape[0] != shape[1]

    def math(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    costs = attention.PATH_COSTS["math"](case, cfg)
    forward, train = _count(math, case, getattr(torch, dtype))
    assert (costs.bytes, costs.train_bytes) == (forward, train)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_len,head_dim", [(128, 32), (512, 32), (256, 64), (64, 16)])
def test_reference_moves_more_than_the_fused_paths_by_the_factor_the_models_give(causal, seq_len, head_dim):
    """Forward, the reference moves ≥ 6·P·s (its (S, S) passes) against the floor's 4·N·s: ≥ 1.5·S/D times the
    floor. A fused kernel re-reads K and V once per query tile, 2·N·s·(1 + ceil(S/block_q)) in all, which keeps the
    reference ≥ min(S, block_q)/D times above it: the factor asserted, per fused path at its own tile."""
    cfg, case = _cfg("float32", causal), _case(4, 4, seq_len, head_dim)
    ref = attention.OP.costs_of(attention.IMPLS["reference"], case, cfg)
    floor = attention.OP.costs(case, cfg)
    assert ref.bytes >= seq_len / head_dim * floor.bytes
    for impl in (attention.IMPLS["triton"], attention.IMPLS["sdpa"]):
        fused = attention.OP.costs_of(impl, case, cfg)
        block_q = attention._triton_tile(cfg)["block_q"] if impl.name == "triton" else \
            attention._sdpa_tile(case, cfg)[0]["block_q"]
        assert fused.model == "fused"
        assert fused.bytes >= floor.bytes
        assert ref.bytes >= min(seq_len, block_q) / head_dim * fused.bytes, impl.name
        assert ref.train_bytes > fused.train_bytes and ref.live_bytes > fused.live_bytes, impl.name
        assert ref.flops / ref.bytes < fused.flops / fused.bytes  # the reference sits at a lower intensity


def test_fused_traffic_is_a_function_of_the_tile():
    """Halving block_q doubles the tiles that re-read K and V: the forward's K/V term grows, Q and O's does not."""
    cfg, case = _cfg("float32", False), _case(4, 4, 256, 32)
    big = attention._fused(case, cfg, dict.fromkeys(attention._triton_tile(cfg), 64), "test")
    small = attention._fused(case, cfg, dict.fromkeys(attention._triton_tile(cfg), 32), "test")
    n = 2 * 4 * 256 * 32
    kv = lambda c: c.bytes - 4 * 2 * n - 4 * 2 * 4 * 256  # noqa: E731  (K/V re-reads alone)
    assert kv(small) == 2 * kv(big)
    assert kv(big) == 4 * 2 * 2 * 4 * 32 * (256 // 64) * 256  # s * 2 * B*H*D * tiles * S


def test_a_path_without_a_model_is_placed_with_the_floor_and_says_so():
    cfg, case = _cfg("float32", True), _case(4, 4, 64, 16)
    user = Impl("mine", "user", attention.IMPLS["reference"].fn)
    costs = attention.OP.costs_of(user, case, cfg)
    assert costs.model == FLOOR and costs.note == FLOOR_NOTE
    assert costs.bytes == attention.OP.costs(case, cfg).bytes
    with pytest.raises(ValueError, match="valid choices are materialised"):
        attention.OP.costs_of(dataclasses.replace(user, cost_model="magic"), case, cfg)


@pytest.mark.parametrize("heads,kv_heads,q_len,kv_len", [(4, 4, 1, 100), (4, 2, 1, 100), (4, 2, 4, 100)])
def test_decode_reference_model_is_the_counted_traffic(heads, kv_heads, q_len, kv_len):
    """The decode reference copies the cache to H heads and reads it again: its forward bytes are the count's,
    and at Sq = 1 several times the split kernel's (which reads each K/V piece once per row block)."""
    from posttrainllm.ops.decode_attention import definition as decode_attention

    cfg = load(["op=decode_attention", "device=cpu"])
    case = Case("t", 0, dict(batch=2, heads=heads, kv_heads=kv_heads, head_dim=16, q_len=q_len, kv_len=kv_len), True)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, q_len, 16, generator=gen)
    k, v = (torch.randn(2, kv_heads, kv_len, 16, generator=gen) for _ in range(2))
    with counted() as forward:
        decode_attention_reference.chunk_attention(q, k, v)
    costs = decode_attention.OP.costs_of(decode_attention.IMPLS["reference"], case, cfg)
    assert costs.model == "materialised" and costs.bytes == forward.total
    split = decode_attention.OP.costs_of(decode_attention.IMPLS["triton"], case, cfg)
    assert split.model == "split" and costs.bytes > 2 * split.bytes
