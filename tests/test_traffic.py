"""Per-path byte models (ops/attention/definition.py path_costs) against the traffic eager PyTorch moves (measure/traffic.py).

The readable reference and SDPA's math backend are eager code: every aten op they run, forward and backward, reads
its inputs and writes its outputs, and the counter sums those bytes. Their models must give that sum; the fused
paths' model must sit below the reference's by the factor the two formulas predict (~2·S/D).
"""

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from posttrainllm.config import LabConfig, itemsize
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


# --- the row ops and the cross-entropy: each path's own model in its op's definition -----------------------

from posttrainllm.ops.add_rmsnorm import definition as add_rmsnorm  # noqa: E402
from posttrainllm.ops.add_rmsnorm import reference as add_rmsnorm_reference  # noqa: E402
from posttrainllm.ops.cross_entropy import definition as cross_entropy  # noqa: E402
from posttrainllm.ops.cross_entropy import reference as cross_entropy_reference  # noqa: E402
from posttrainllm.ops.layernorm import definition as layernorm  # noqa: E402
from posttrainllm.ops.layernorm import reference as layernorm_reference  # noqa: E402
from posttrainllm.ops.rmsnorm import definition as rmsnorm  # noqa: E402
from posttrainllm.ops.rmsnorm import reference as rmsnorm_reference  # noqa: E402
from posttrainllm.ops.softmax import definition as softmax  # noqa: E402
from posttrainllm.ops.softmax import reference as softmax_reference  # noqa: E402

EPS = 1e-5


def _op_cfg(op: str, dtype: str) -> LabConfig:
    cfg = load([f"op={op}", "device=cpu"])
    return dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, dtype=dtype))


def _counted_traffic(fn, shapes: list[tuple[int, ...]], dtype: torch.dtype, extra=()) -> tuple[int, int]:
    """(forward, forward + backward) bytes of `fn(*inputs, *extra)` on standard-normal inputs of `shapes`, every
    output given a gradient."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]
    with counted() as forward:
        out = fn(*xs, *extra)
    outs = out if isinstance(out, tuple) else (out,)
    grads = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
    with counted() as backward:
        torch.autograd.backward(outs, grads)
    return forward.total, forward.total + backward.total


# op module, its reference called on the inputs, the inputs' shapes of a (rows, C) case, the case's dims
ROW_OPS = {
    "softmax": (softmax, softmax_reference.softmax, lambda r, c: [(r, c)], lambda r, c: dict(rows=r, cols=c)),
    "rmsnorm": (rmsnorm, lambda x, w: rmsnorm_reference.rmsnorm(x, w, EPS), lambda r, c: [(r, c), (c,)],
                lambda r, c: dict(rows=r, hidden=c)),
    "layernorm": (layernorm, lambda x, w, b: layernorm_reference.layernorm(x, w, b, EPS),
                  lambda r, c: [(r, c), (c,), (c,)], lambda r, c: dict(rows=r, hidden=c)),
    "add_rmsnorm": (add_rmsnorm, lambda x, r, w: add_rmsnorm_reference.add_rmsnorm(x, r, w, EPS),
                    lambda r, c: [(r, c), (r, c), (c,)], lambda r, c: dict(rows=r, hidden=c)),
}


def _row_mismatch(name: str, model, dtype: str, shapes=((6, 40), (17, 3), (1, 129))) -> list[str]:
    """Where `model` (a path_costs entry) is not the counted traffic of the op's reference: one line per miss."""
    module, fn, input_shapes, dims = ROW_OPS[name]
    cfg, misses = _op_cfg(name, dtype), []
    for rows, cols in shapes:
        costs = model(Case("t", 0, dims(rows, cols), True), cfg)
        counted_bytes = _counted_traffic(fn, input_shapes(rows, cols), getattr(torch, dtype))
        if (costs.bytes, costs.train_bytes) != counted_bytes:
            misses.append(f"{name} {dtype} {rows}x{cols}: model {(costs.bytes, costs.train_bytes)}, "
                          f"counted {counted_bytes}")
    return misses


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", list(ROW_OPS))
def test_row_reference_model_is_the_counted_traffic(name, dtype):
    module = ROW_OPS[name][0]
    assert module.IMPLS["reference"].cost_model == "materialised"
    assert _row_mismatch(name, module.PATH_COSTS["materialised"], dtype) == []


def test_a_planted_wrong_model_is_caught():
    """A reference model that leaves out a term (rmsnorm's per-column reads: C) or stops scaling with the vocabulary
    (the cross-entropy's N·V) is not the counted traffic."""
    right = rmsnorm.PATH_COSTS["materialised"]

    def no_columns(case, cfg):
        costs = right(case, cfg)
        return dataclasses.replace(costs, bytes=costs.bytes - 4 * case.dims["hidden"])

    assert len(_row_mismatch("rmsnorm", no_columns, "float32")) == 3
    ce_right = cross_entropy.PATH_COSTS["materialised"]

    def fixed_vocab(case, cfg):
        return ce_right(dataclasses.replace(case, dims={**case.dims, "vocab": 16}), cfg)

    assert _ce_mismatch(ce_right, "float32") == []
    assert len(_ce_mismatch(fixed_vocab, "float32")) == 3  # no shape there has V = 16


@pytest.mark.parametrize("name", list(ROW_OPS))
def test_row_reference_moves_more_than_the_kernel_by_the_factor_the_models_give(name):
    """At rows = 4096, C = 1024 (fp32): the reference's passes over (rows, C) in fp32 against the kernel's one read
    of each input and one write of each output. Forward, the factor is the count of the reference's (rows, C) passes
    over the kernel's: softmax 8/2, rmsnorm 7/2, layernorm 12/2, add_rmsnorm 10/4 (the per-row and per-column terms
    are < 0.2% here); forward + backward the reference sits further above still."""
    module, dims = ROW_OPS[name][0], ROW_OPS[name][3]
    cfg, case = _op_cfg(name, "float32"), Case("t", 0, dims(4096, 1024), True)
    ref = module.OP.costs_of(module.IMPLS["reference"], case, cfg)
    mine = module.OP.costs_of(module.IMPLS["triton"], case, cfg)
    factor = {"softmax": 8 / 2, "rmsnorm": 7 / 2, "layernorm": 12 / 2, "add_rmsnorm": 10 / 4}[name]
    assert ref.bytes / mine.bytes == pytest.approx(factor, rel=2e-3)
    assert mine.model != FLOOR and mine.bytes == module.OP.costs(case, cfg).bytes  # its forward reaches the floor
    assert ref.train_bytes / mine.train_bytes > factor
    assert ref.live_bytes > mine.live_bytes and ref.flops == mine.flops  # same math, lower intensity
    for costs in (ref, mine):  # the receipt's record names each figure's formula
        record = costs.record()
        assert record["model"] == costs.model and record["bytes_formula"] and record["train_bytes_formula"]
        assert record["working_set_formula"] and record["train_flops_per_byte"] is not None


@pytest.mark.parametrize("name", [*ROW_OPS, "cross_entropy"])
def test_a_path_without_a_model_is_placed_at_the_floor_and_says_so(name):
    """A user's path and the compiled peer declare no model: the floor, saying so (attention's convention); a
    name the op does not model is refused with the valid ones."""
    module = cross_entropy if name == "cross_entropy" else ROW_OPS[name][0]
    cfg = _op_cfg(name, "float32")
    case = module.OP.cases(cfg)[0]
    compiled_peer = module.OP.optional_peers["compiled"](cfg)
    for impl in (Impl("mine", "user", module.IMPLS["reference"].fn), compiled_peer):
        costs = module.OP.costs_of(impl, case, cfg)
        assert costs.model == FLOOR and costs.note == FLOOR_NOTE
        assert costs.bytes == module.OP.costs(case, cfg).bytes and costs.train_bytes is None
    with pytest.raises(ValueError, match="valid choices are materialised"):
        module.OP.costs_of(Impl("mine", "user", module.IMPLS["reference"].fn, cost_model="magic"), case, cfg)


def _ce_case(tokens: int, d_model: int, vocab: int) -> Case:
    return Case("t", 0, dict(tokens=tokens, d_model=d_model, vocab=vocab), True)


def _ce_mismatch(model, dtype: str, shapes=((6, 8, 3), (5, 9, 17), (16, 4, 40))) -> list[str]:
    cfg, misses = _op_cfg("cross_entropy", dtype), []
    for n, c, v in shapes:
        costs = model(_ce_case(n, c, v), cfg)
        targets = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1))
        counted_bytes = _counted_traffic(cross_entropy_reference.linear_cross_entropy, [(n, c), (v, c)],
                                         getattr(torch, dtype), extra=(targets,))
        if (costs.bytes, costs.train_bytes) != counted_bytes:
            misses.append(f"{n}x{c}x{v}: model {(costs.bytes, costs.train_bytes)}, counted {counted_bytes}")
    return misses


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cross_entropy_reference_model_is_the_counted_traffic(dtype):
    assert cross_entropy.IMPLS["reference"].cost_model == "materialised"
    assert _ce_mismatch(cross_entropy.PATH_COSTS["materialised"], dtype) == []


def test_cross_entropy_reference_moves_more_than_the_chunked_kernel_by_the_factor_the_models_give():
    """N = 2048 tokens, C = 256, V = 32768, fp32, chunks of 1024 rows (K = 2): the reference moves the (N, V) logits
    4 times forward (16·N·V) where the chunked kernel writes and reads each chunk's once (8·N·V) and re-reads W per
    chunk (4·K·V·C): the forward factor is (16·N·V + 4·(N·C + V·C)) / (8·N·V + 4·(N·C + K·V·C)) ~ 1.8, and both
    grow with V while the kernel's working set holds one chunk's logits, not N·V."""
    cfg = _op_cfg("cross_entropy", "float32")
    cfg = dataclasses.replace(cfg, op=dataclasses.replace(cfg.op, chunk_size=1024))
    n, c, v, k = 2048, 256, 32768, 2
    case = _ce_case(n, c, v)
    ref = cross_entropy.OP.costs_of(cross_entropy.IMPLS["reference"], case, cfg)
    fused = cross_entropy.OP.costs_of(cross_entropy.IMPLS["triton"], case, cfg)
    assert fused.model == "chunked" and f"K = ceil(N/chunk_size) = {k}" in fused.bytes_formula
    expected = (16 * n * v + 4 * (n * c + v * c) + 8 * n + 8) / (8 * n * v + 4 * (n * c + k * v * c) + 16 * n + 4)
    assert ref.bytes / fused.bytes == pytest.approx(expected) and expected > 1.8
    assert ref.train_bytes > fused.train_bytes
    # the (N, V) logits and log-probabilities against one chunk's logits and the (N,) losses and targets
    assert ref.live_bytes - fused.live_bytes == 2 * 4 * n * v - 4 * 1024 * v - 12 * n
    wider = _ce_case(n, c, 2 * v)  # every model scales with V
    for impl in (cross_entropy.IMPLS["reference"], cross_entropy.IMPLS["triton"]):
        costs, twice = (cross_entropy.OP.costs_of(impl, x, cfg) for x in (case, wider))
        assert twice.bytes > 1.9 * costs.bytes and twice.train_bytes > 1.9 * costs.train_bytes


def test_chunked_traffic_is_a_function_of_the_chunk():
    """Halving chunk_size doubles the chunks that re-read W: forward, s·V·C more per extra chunk, nothing else."""
    cfg = _op_cfg("cross_entropy", "bfloat16")
    case = _ce_case(64, 32, 100)
    big, small = (cross_entropy.PATH_COSTS["chunked"](case, dataclasses.replace(cfg, op=dataclasses.replace(
        cfg.op, chunk_size=size))) for size in (32, 16))
    assert small.bytes - big.bytes == 2 * (4 - 2) * 100 * 32  # K 2 -> 4, W (V·C) in bf16 per chunk
    assert small.train_bytes > big.train_bytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens,d_model,ffn,experts,top_k", [(6, 8, 12, 4, 2), (5, 3, 7, 6, 1), (9, 4, 4, 2, 2)])
def test_moe_dense_reference_model_is_the_counted_traffic(dtype, tokens, d_model, ffn, experts, top_k):
    """The dense reference runs every expert on every token: its model is the count, and at the lab's top-k it moves
    more than the floor, which reads only the touched experts' weights."""
    from posttrainllm.ops.moe import definition as moe
    from posttrainllm.ops.moe import reference as moe_reference

    cfg = _op_cfg("moe", dtype)
    case = Case("t", 0, dict(tokens=tokens, d_model=d_model, ffn=ffn, experts=experts, top_k=top_k), True)
    gen = torch.Generator().manual_seed(0)
    route_idx = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    counted_bytes = _counted_traffic(
        lambda x, wg, wu, wd, rw: moe_reference.moe_dense(x, wg, wu, wd, route_idx, rw),
        [(tokens, d_model), (experts, d_model, ffn), (experts, d_model, ffn), (experts, ffn, d_model),
         (tokens, top_k)], getattr(torch, dtype))
    costs = moe.OP.costs_of(moe.IMPLS["reference"], case, cfg)
    assert costs.model == "dense" and (costs.bytes, costs.train_bytes) == counted_bytes
    assert moe.OP.costs_of(moe.IMPLS["triton"], case, cfg).model == "tiled"  # its own model (the section below)


# --- moe: each routed path's own model (ops/moe/costs.py) -------------------------------------------------------
#
# The eager paths (the sparse loop, torch's grouped_mm) run here: their models are the counted traffic, on the
# routing make_inputs makes for the case. The Triton kernels' loads are not countable (the interpreter moves
# tensors in and out with set_ and copy_ of its own, whatever the kernel reads): their tile terms are checked
# against the plan and the grid the kernels run on, and their eager parts (the plan, fp8's quantization of h, the
# route-weight gradient's tail) against the count.

from posttrainllm.ops.moe import costs as moe_costs  # noqa: E402
from posttrainllm.ops.moe import definition as moe  # noqa: E402
from posttrainllm.ops.moe import kernels as moe_kernels  # noqa: E402
from posttrainllm.ops.moe.fp8 import quantize_h  # noqa: E402

# (tokens, d_model, ffn, experts, top_k, routing kind): d and f multiples of 8 (grouped_mm's 16-byte rows at 16
# bits); the second and fourth leave experts untouched (m < E), the third has top_k = E
MOE_SHAPES = [(6, 8, 16, 4, 2, "normal"), (5, 16, 8, 6, 1, "normal"), (9, 8, 8, 2, 2, "normal"),
              (7, 8, 16, 5, 2, "one_expert")]
MOE_EAGER = {"sparse": moe_costs.sparse, "grouped_mm": moe_costs.grouped}


def _moe_case(tokens: int, d_model: int, ffn: int, experts: int, top_k: int, inputs: str = "normal",
              quantize: str = "") -> Case:
    return Case("t", 0, dict(tokens=tokens, d_model=d_model, ffn=ffn, experts=experts, top_k=top_k), True, inputs,
                quantize=quantize)


def _moe_cfg(dtype: str, case: Case, block_m: int = 64, block_n: int = 64) -> LabConfig:
    """op=moe at `dtype`, its shape the case's (grouped_mm_refusal probes the shape's d and f), at a tile."""
    cfg = _op_cfg("moe", dtype)
    d = case.dims
    return dataclasses.replace(
        cfg, shape=dataclasses.replace(cfg.shape, ops={**cfg.shape.ops, "moe": dataclasses.replace(
            moe.Sizes.of(cfg), tokens=d["tokens"], d_model=d["d_model"], ffn=d["ffn"], experts=d["experts"],
            top_k=d["top_k"], expert_curve=[d["top_k"], d["experts"]])}),
        tile=dataclasses.replace(cfg.tile, block_m=block_m, block_n=block_n))


def _moe_counted(path: str, case: Case, cfg: LabConfig) -> tuple[int, int]:
    """(forward as timed, without gradients; forward + backward) bytes of `path` on the case's inputs."""
    x = moe._make_inputs(case, getattr(torch, cfg.precision.dtype), "cpu")
    with torch.no_grad(), counted() as forward:
        moe.IMPLS[path].fn(x, cfg)
    for name in ("x", "w_gate", "w_up", "w_down", "route_weight"):
        x[name].requires_grad_()
    with counted() as train_forward:
        out = moe.IMPLS[path].fn(x, cfg)["out"]
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    with counted() as backward:
        out.backward(grad)
    return forward.total, train_forward.total + backward.total


def _moe_mismatch(path: str, model, dtype: str) -> list[str]:
    """Where `model` (costs.sparse's signature) is not the counted traffic of `path`: one line per miss."""
    misses = []
    for *dims, inputs in MOE_SHAPES:
        case = _moe_case(*dims, inputs)
        cfg = _moe_cfg(dtype, case)
        costs = model(case, cfg, moe._tokens_per_expert(case, cfg))
        counted_bytes = _moe_counted(path, case, cfg)
        if (costs.bytes, costs.train_bytes) != counted_bytes:
            misses.append(f"{path} {dtype} {dims} {inputs}: model {(costs.bytes, costs.train_bytes)}, "
                          f"counted {counted_bytes}")
    return misses


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("path", list(MOE_EAGER))
def test_moe_eager_routed_model_is_the_counted_traffic(path, dtype):
    """The sparse loop and torch's grouped_mm, forward (as timed, no gradient) and forward + backward: each path's
    declared model gives the bytes the counter sums, on every shape (experts untouched, top-k = E included)."""
    if path == "grouped_mm":
        refusals = {why for *dims, inputs in MOE_SHAPES
                    if (why := moe.grouped_mm_refusal(_moe_cfg(dtype, _moe_case(*dims, inputs))))}
        if refusals:
            pytest.skip(f"grouped_mm does not run here: {refusals.pop()}")
    assert moe.IMPLS[path].cost_model in moe.PATH_COSTS
    assert moe.PATH_COSTS[moe.IMPLS[path].cost_model](_moe_case(*MOE_SHAPES[0]), _op_cfg("moe", dtype)).model \
        == moe.IMPLS[path].cost_model
    assert _moe_mismatch(path, MOE_EAGER[path], dtype) == []


def test_a_planted_wrong_moe_model_is_caught():
    """A sparse model that reads every expert's weights (not the touched ones), and a grouped_mm model that reads only
    the touched experts' (what a grouped GEMM's kernel reads, not what its eager call is counted as moving), each
    miss the count exactly on the shapes with an untouched expert (2 of 4)."""

    def every_expert(case, cfg, counts):
        costs = moe_costs.sparse(case, cfg, counts)
        untouched = sum(1 for n in counts if not n)
        extra = 3 * untouched * case.dims["d_model"] * case.dims["ffn"] * itemsize(cfg.precision.dtype)
        return dataclasses.replace(costs, bytes=costs.bytes + extra, train_bytes=costs.train_bytes + extra)

    def touched_only(case, cfg, counts):
        costs = moe_costs.grouped(case, cfg, counts)
        untouched = sum(1 for n in counts if not n)
        fewer = 3 * untouched * case.dims["d_model"] * case.dims["ffn"] * itemsize(cfg.precision.dtype)
        return dataclasses.replace(costs, bytes=costs.bytes - fewer, train_bytes=costs.train_bytes - fewer)

    assert len(_moe_mismatch("sparse", every_expert, "float32")) == 2
    assert len(_moe_mismatch("grouped_mm", touched_only, "float32")) == 2


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("shape", MOE_SHAPES + [(40, 24, 40, 4, 2, "normal")])
def test_tiled_moe_model_is_the_kernels_plan_and_grid(shape, block_m):
    """The Triton path's model from what its kernels run on: R the row blocks of kernels.plan on the case's routing
    that hold a row, B and P its grid bound and padded rows, Nf and Nd the column tiles of moe_launch's gate/up and
    down grids; the plan's own eager traffic counted. forward = s*(A*d*Nf + A*f*Nd + 3*R*d*f + A*f + 2*A*d + T*d) +
    plan; FLOPs 2*R*BM*3*d*f (each row block in full). The fp8 kernel: the same grid on 1-byte operands, h's
    quantization counted."""
    *dims, inputs = shape
    case = _moe_case(*dims, inputs)
    t, dm, f, n_exp, k = dims
    cfg = _moe_cfg("float32", case, block_m=block_m, block_n=16)
    x = moe._make_inputs(case, torch.float32, "cpu")
    moe_kernels.check_routing(x["route_idx"], n_exp)  # once per routing, as every timed call after the first
    with counted() as planned:
        p = moe_kernels.plan(x["route_idx"], x["route_weight"], n_exp, block_m)
    rows_blocks = int((p.block_rows > 0).sum())
    launch = moe_kernels.moe_launch(t, dm, f, n_exp, k, block_m=block_m, block_n=16, block_k=16, num_warps=4,
                                    num_stages=2)
    (_, nf), (_, nd) = launch["forward"]["gate_up"], launch["forward"]["down"]
    a, s = t * k, 4
    costs = moe.OP.costs_of(moe.IMPLS["triton"], case, cfg)
    assert costs.model == "tiled" and _has_formulas(costs)
    assert costs.bytes == s * (a * dm * nf + a * f * nd + 3 * rows_blocks * dm * f + a * f + 2 * a * dm + t * dm) \
        + planned.total
    assert planned.total == moe_costs.plan_bytes(a, n_exp, p.n_blocks, p.padded_rows, s)
    assert costs.flops == 2 * rows_blocks * block_m * 3 * dm * f
    assert f"R = {rows_blocks} row blocks" in costs.note

    for scaling in ("row", "tensor"):  # fp8: x and the weights in 1 byte, h and y in fp32, out in bf16
        fp8_case = dataclasses.replace(case, quantize=f"float8_e4m3fn:{scaling}")
        fp8_cfg = _moe_cfg("bfloat16", case, block_m=block_m, block_n=16)
        bf16_inputs = moe._make_inputs(case, torch.bfloat16, "cpu")
        p16 = moe_kernels.plan(bf16_inputs["route_idx"], bf16_inputs["route_weight"], n_exp, block_m)
        r16 = int((p16.block_rows > 0).sum())
        h = torch.randn(p16.padded_rows, f)  # (P, f) fp32, as the gate/up kernel stores it
        with counted() as quantized:
            quantize_h(h, p16.inv, scaling == "row")
        fp8 = moe.FP8_IMPLS["triton"]
        got = moe.OP.costs_of(fp8, fp8_case, fp8_cfg)
        scales = 4 * r16 * (2 * f + dm) if scaling == "row" else 0
        assert got.model == "fp8_tiled" and got.bytes == (
            a * dm * nf + a * f * nd + 3 * r16 * dm * f + 4 * a * f + 8 * a * dm + 2 * t * dm + scales
            + quantized.total + moe_costs.plan_bytes(a, n_exp, p16.n_blocks, p16.padded_rows, 2))


def _has_formulas(costs) -> bool:
    """Every figure of the receipt's record is beside its formula."""
    record = costs.record()
    return all(record[key] for key in ("bytes_formula", "flops_formula", "train_bytes_formula", "working_set_formula"))


def test_tiled_moe_traffic_is_a_function_of_the_tile():
    """Halving BN doubles the column tiles that re-read the gathered rows (x per f tile, h per d tile), nothing else
    of the forward; halving BM changes only the row blocks that re-read the weights (3*s*d*f each) and the plan's
    padded rows. T = 256, d = f = 128, top-2 of 4 experts (every expert some 100+ rows), fp32."""
    case = _moe_case(256, 128, 128, 4, 2)
    a, dm, f, s = 512, 128, 128, 4
    counts = moe._tokens_per_expert(case, _op_cfg("moe", "float32"))
    at = {(bm, bn): moe_costs.tiled(case, _moe_cfg("float32", case, block_m=bm, block_n=bn), counts)
          for bm, bn in ((64, 64), (64, 32), (32, 64))}
    rereads = lambda bn: s * (a * dm * (f // bn) + a * f * (dm // bn))  # noqa: E731
    assert at[64, 32].bytes - at[64, 64].bytes == rereads(32) - rereads(64) == rereads(64)
    blocks = lambda bm: sum(-(-n // bm) for n in counts)  # noqa: E731
    plan = lambda bm: moe_costs.plan_bytes(  # noqa: E731
        a, 4, moe_kernels.row_blocks_max(a, 4, bm), moe_kernels.row_blocks_max(a, 4, bm) * bm, s)
    assert at[32, 64].bytes - at[64, 64].bytes == 3 * s * dm * f * (blocks(32) - blocks(64)) + plan(32) - plan(64)
    assert blocks(32) > blocks(64) and at[32, 64].train_bytes > at[64, 64].train_bytes


def test_tiled_moe_backward_tail_is_the_counted_traffic():
    """The Triton backward's eager part (d route_weight: the (P, Nf) fp32 partials zeroed, summed, gathered back
    through inv) is what the counter sums of a real forward + backward under the interpreter, once the
    interpreter's own set_ and copy_ (its moves in and out of each launch) are left out. fp32: a 16-bit run under
    the interpreter adds casts of its fp32 emulation buffers the GPU does not make."""
    from posttrainllm.ops.moe.kernels import moe as triton_moe

    case = _moe_case(6, 8, 16, 4, 2)
    x = moe._make_inputs(case, torch.float32, "cpu")
    leaves = [x[name].requires_grad_() for name in ("x", "w_gate", "w_up", "w_down", "route_weight")]
    out = triton_moe(*leaves[:4], x["route_idx"], leaves[4], block_m=16, block_n=16, block_k=16)
    grad = torch.ones_like(out)
    with counted() as backward:
        out.backward(grad)
    eager = sum(read + written for op, _, read, written in backward.table() if op not in ("set_", "copy_"))
    p = moe_kernels.plan(x["route_idx"], x["route_weight"], 4, 16)
    assert eager == moe_costs.route_weight_grad_bytes(12, p.padded_rows, 1, 4)


def test_moe_dense_moves_more_than_the_routed_paths_by_the_factor_the_models_give():
    """T = 16384 tokens, d = f = 128, top-2 of E = 8 and 16, fp32: every model's terms that grow with T, the expert
    weights' E*d*f terms left out (< 1% here). The dense reference streams E*T*(12*f + 2*d) through its (E, T, .)
    tensors; the sparse loop copies x and out per expert (3*E*T*d) beside its routed rows' k*T*(7*d + 8*f);
    grouped_mm moves the routed rows only, k*T*(7*d + 8*f) + 5*T*d; the Triton kernels re-read the rows per column
    tile and the weights per row block, A*(d*Nf + f*Nd + f + 2*d) + T*d + 3*R*d*f, with its plan's
    (224 + 2*s)*A + 16*P. Forward, the dense reference moves more than each by that factor, a factor that grows
    with E/k; forward + backward each moves less too (at this T: the sparse loop's (E, d, f) weight gradient per
    touched expert outgrows the reference's at the tiny shape, T = 64, d = 64)."""
    t, dm, f, k, s = 16384, 128, 128, 2, 4
    a = t * k
    factors = {}
    for n_exp in (8, 16):
        case = _moe_case(t, dm, f, n_exp, k)
        cfg = _moe_cfg("float32", case)
        counts = moe._tokens_per_expert(case, cfg)
        assert all(counts)  # every expert touched
        rows_blocks, padded = sum(-(-n // 64) for n in counts), moe_kernels.row_blocks_max(a, n_exp, 64) * 64
        dense = s * (12 * n_exp * t * f + 2 * n_exp * t * dm + 4 * t * n_exp + 3 * t * dm) + t * k * (8 + s)
        routed = {"sparse": 10 * n_exp * a + 48 * a + s * (2 * t * dm + 3 * n_exp * t * dm + n_exp * a + 7 * a * dm
                                                           + 8 * a * f + 2 * a),
                  "grouped_mm": 88 * a + s * (5 * t * dm + 7 * a * dm + 8 * a * f + 3 * a),
                  "triton": s * (a * dm * (f // 64) + a * f * (dm // 64) + a * f + 2 * a * dm + t * dm
                                 + 3 * rows_blocks * dm * f) + (224 + 2 * s) * a + 16 * padded}
        ref = moe.OP.costs_of(moe.IMPLS["reference"], case, cfg)
        for name, per_token in routed.items():
            mine = moe.OP.costs_of(moe.IMPLS[name], case, cfg)
            factors[name, n_exp] = dense / per_token
            assert factors[name, n_exp] > 1.9
            assert ref.bytes / mine.bytes == pytest.approx(factors[name, n_exp], rel=1e-2), (name, n_exp)
            # the routed rows' FLOPs, k/E of the dense reference's; Triton's row blocks computed in full
            assert mine.flops * n_exp == ref.flops * k if name != "triton" else \
                mine.flops == 2 * rows_blocks * 64 * 3 * dm * f
        for name in routed:
            assert moe.OP.costs_of(moe.IMPLS[name], case, cfg).train_bytes < ref.train_bytes, name
    for name in routed:
        assert factors[name, 16] > 1.3 * factors[name, 8], name
