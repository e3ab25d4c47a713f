import math

import pytest
import torch
import torch.nn.functional as F

from posttrainllm.ops.attention import reference
from posttrainllm.config import LabConfig
from posttrainllm.model.transformer import ModelConfig, Transformer
from posttrainllm.ops.registry import get_op, op_config
from posttrainllm.ops.rope.reference import rope as apply_rope, rope_tables


def attention_hook(name: str):
    """The model's attention call for a registry implementation: what bench-train swaps in."""
    op = get_op("attention")
    return op.model_hook.fill(op.impls[name], LabConfig(op=op_config("attention")()))


IMPLS = {"reference": None, "sdpa": attention_hook("sdpa")}  # None: the model's default, the reference math

# (name, config kwargs): MHA, GQA, MQA, and a head_dim that is not d_model // n_heads.
SHAPES = [
    ("mha", dict(n_heads=4, n_kv_heads=4)),
    ("gqa", dict(n_heads=4, n_kv_heads=2)),
    ("mqa", dict(n_heads=4, n_kv_heads=1)),
    ("gqa_hd24", dict(n_heads=4, n_kv_heads=2, head_dim=24)),
]


def tiny(**kw) -> ModelConfig:
    base = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    return ModelConfig(**{**base, **kw})


def tokens(B=4, T=32, seed=0):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name,kw", SHAPES, ids=[s[0] for s in SHAPES])
def test_reference_and_sdpa_agree_in_fp32(name, kw):
    model = Transformer(tiny(**kw), seed=1)
    idx, targets = tokens(), tokens(seed=1)
    logits_ref, loss_ref = model(idx, targets)
    assert logits_ref.shape == (4, 32, 256) and loss_ref.shape == ()
    loss_ref.backward()
    grads_ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    model.swap("attention", attention_hook("sdpa"))
    logits_sdpa, loss_sdpa = model(idx, targets)
    loss_sdpa.backward()
    torch.testing.assert_close(logits_sdpa, logits_ref, atol=1e-5, rtol=1e-5)
    for g_sdpa, g_ref in zip((p.grad for p in model.parameters()), grads_ref):
        torch.testing.assert_close(g_sdpa, g_ref, atol=1e-5, rtol=1e-4)


def test_head_dim_sets_projection_shapes():
    model = Transformer(tiny(head_dim=24), seed=0)
    attn = model.blocks[0].attn
    assert attn.q_proj.weight.shape == (4 * 24, 64)
    assert attn.k_proj.weight.shape == (2 * 24, 64)
    assert attn.o_proj.weight.shape == (64, 4 * 24)
    assert model.rope_cos.shape == (64, 12)


def test_sdpa_gqa_low_precision_branch_matches_reference():
    # bf16 with n_kv_heads < n_heads takes the enable_gqa=True route.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 33, 16, generator=g).bfloat16()
    k = torch.randn(2, 2, 33, 16, generator=g).bfloat16()
    v = torch.randn(2, 2, 33, 16, generator=g).bfloat16()
    want = reference.attention(q.double(), k.double(), v.double(), causal=True)
    torch.testing.assert_close(attention_hook("sdpa")(q, k, v).double(), want, atol=2e-2, rtol=2e-2)


def test_rope_score_depends_only_on_offset():
    T, hs = 16, 8
    cos, sin = rope_tables(T, hs, 10000.0)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(hs, generator=g, dtype=torch.float64).float()
    k = torch.randn(hs, generator=g, dtype=torch.float64).float()
    q_rot = apply_rope(q.expand(1, 1, T, hs), cos, sin)[0, 0]  # (T, hs): q placed at every position
    k_rot = apply_rope(k.expand(1, 1, T, hs), cos, sin)[0, 0]  # (T, hs)
    scores = q_rot @ k_rot.T  # (T, T): scores[m, n] = q at m · k at n
    for offset in range(-3, 4):
        diag = torch.diagonal(scores, offset)
        torch.testing.assert_close(diag, diag[0].expand_as(diag), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(scores[5, 3], scores[5, 4])
    torch.testing.assert_close(q_rot[0], q)  # position 0 is not rotated
    torch.testing.assert_close(q_rot.norm(dim=-1), q.norm().expand(T))  # rotations keep length


@pytest.mark.parametrize("impl", ["reference", "sdpa"])
def test_causal_future_tokens_do_not_change_earlier_logits(impl):
    model = Transformer(tiny(), seed=0, fills={"attention": IMPLS[impl]} if IMPLS[impl] else {})
    idx = tokens(B=2, T=20)
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 256
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], atol=0, rtol=0)
    assert (a[:, 12:] - b[:, 12:]).abs().amax() > 1e-4


def test_init_is_deterministic_and_leaves_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b, c = Transformer(tiny(), seed=3), Transformer(tiny(), seed=3), Transformer(tiny(), seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), name
    assert "rope_cos" not in a.state_dict()


def test_initial_loss_is_near_uniform():
    _, loss = Transformer(tiny(), seed=0)(tokens(), tokens(seed=1))
    assert abs(loss.item() - math.log(256)) < 0.1


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(n_heads=4, n_kv_heads=3), "multiple of n_kv_heads"),
        (dict(n_heads=4, n_kv_heads=8), "n_kv_heads=8 must be <="),
        (dict(n_heads=4, n_kv_heads=0), "n_kv_heads must be a positive int"),
        (dict(d_model=60, n_heads=8, n_kv_heads=2), "set head_dim"),
        (dict(head_dim=7), "even"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(mlp_hidden=-1), "mlp_hidden"),
    ],
)
def test_bad_config_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kw)


def test_sequence_longer_than_max_seq_len_raises():
    with pytest.raises(ValueError, match="max_seq_len"):
        Transformer(tiny(max_seq_len=16))(tokens(T=17))


def test_attention_is_the_function_handed_in():
    calls = []

    def spy(q, k, v):
        calls.append(q.shape)
        return reference.attention(q, k, v, causal=True)

    model = Transformer(tiny(), seed=0, fills={"attention": spy})
    logits, _ = model(tokens(T=8))
    assert calls == [(4, 4, 8, 16)] * 2  # one call per layer, q: (B, nh, T, hs)
    model.swap("attention", reference.attention)
    torch.testing.assert_close(model(tokens(T=8))[0], logits, atol=0, rtol=0)


def test_bf16_autocast_forward_runs_and_tracks_fp32():
    model = Transformer(tiny(), seed=0, fills={"attention": attention_hook("sdpa")})
    idx, targets = tokens(), tokens(seed=1)
    with torch.no_grad():
        _, loss32 = model(idx, targets)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits16, loss16 = model(idx, targets)
    assert logits16.dtype == torch.bfloat16 and loss16.dtype == torch.float32
    assert abs(loss16.item() - loss32.item()) < 2e-2


def test_the_trained_function_is_the_registry_function(monkeypatch):
    """bench-train's model calls the registry's Impl.fn itself: patching it changes what the model computes."""
    op = get_op("attention")
    calls = []
    sdpa = op.impls["sdpa"]

    def counted(x, cfg):
        calls.append(x["q"].shape)
        return sdpa.fn(x, cfg)

    import dataclasses
    hook = op.model_hook.fill(dataclasses.replace(sdpa, fn=counted), LabConfig(op=op_config("attention")()))
    Transformer(tiny(), seed=0, fills={op.model_hook.slot: hook})(tokens(T=8))
    assert len(calls) == 2  # one per layer


def test_every_slot_of_the_block_is_one_that_the_model_calls():
    """norm, rope, the MLP activation and the fused head + loss: each slot is called, and the readable default twin
    of each gives the model's own loss (a slot the model ignored, or called twice as often, is caught)."""
    import torch.nn.functional as F

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_hidden=48,
                      max_seq_len=16)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model = Transformer(cfg, seed=0)
    _, want = model(idx, idx)
    calls = {"norm": 0, "rope": 0, "mlp_activation": 0, "loss": 0}

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    for slot in ("norm", "rope", "mlp_activation"):
        model.swap(slot, counted(slot, model.slot(slot)))  # the default, counted
    model.swap("loss", counted("loss", lambda h, w, y: F.cross_entropy((h @ w.t()).float(), y)))
    logits, got = model(idx, idx)
    assert logits is None  # the fused loss makes no logits
    torch.testing.assert_close(got, want)
    assert calls == {"norm": 2 * 2 + 1, "rope": 2 * 2, "mlp_activation": 2, "loss": 1}


def test_a_swap_names_a_slot_of_this_model():
    """An unknown slot (an op's name is not one) is refused with the valid ones; a slot this architecture does not
    call (the experts of a dense model) is refused rather than swapped into nothing."""
    model = Transformer(tiny(), seed=0)
    with pytest.raises(ValueError, match=r"unknown model slot 'matmul': valid choices are attention, .*linear"):
        model.swap("matmul", torch.nn.functional.linear)
    with pytest.raises(ValueError, match="calls no experts slot"):
        model.swap("experts", lambda *args: None)
    moe = Transformer(tiny(mlp="moe"), seed=0)
    with pytest.raises(ValueError, match="calls no mlp_activation slot"):
        moe.swap("mlp_activation", lambda gate, up: gate)


def test_the_model_knows_its_defaults_from_the_ops_and_every_hook_fills_a_slot(monkeypatch):
    """Each op-declared default is the op's readable math, one op per slot, covering every slot the model does not
    default itself; every op with a model hook fills one of the model's slots; a slot declared twice is refused."""
    import dataclasses

    from posttrainllm.model import slots
    from posttrainllm.ops import registry
    from posttrainllm.ops.rmsnorm import reference as rmsnorm_reference

    assert slots.defaults()["norm"] is rmsnorm_reference.rmsnorm and slots.defaults()["linear"] is F.linear
    assert set(slots.defaults()) == {*slots.SLOTS, slots.ROPE_TABLES}
    for op in registry.OPS.values():
        assert (op.model_hook is None) == (op.no_model is not None), op.name
        assert op.model_hook is None or op.model_hook.slot in slots.SLOTS, op.name
    monkeypatch.setitem(registry.OPS, "other", dataclasses.replace(registry.OPS["rmsnorm"], name="other"))
    with pytest.raises(ValueError, match="'norm' default is declared by both rmsnorm and other"):
        registry.model_defaults()
