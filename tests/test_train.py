import json
import math

import pytest
import torch
import torch.nn.functional as F

from posttrainllm.ops.attention import reference
from posttrainllm.model.corpus import load_corpus
from posttrainllm.config import LabConfig
from posttrainllm.model.transformer import ModelConfig
from posttrainllm.model.train import ORDER, Variant, _precision_mode, _resident_bytes, _Trainer, bench_train
from posttrainllm.ops.registry import get_op, op_config

TINY = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
RUN = dict(steps=30, warmup_steps=5, batch_size=4, seq_len=32, lr=3e-3, seed=0)


def attention_variants(names: list[str]) -> list[Variant]:
    """Variants from the attention registry, swapped in by the op's own model hook (as bench-train does)."""
    op = get_op("attention")
    cfg = LabConfig(op=op_config("attention")())
    return [Variant(name, {op.model_hook.slot: op.model_hook.fill(op.impls[name], cfg)}) for name in names]


def sdpa_repeat_kv(q, k, v):
    """A third implementation handed in as a plain function."""
    k, v = reference.repeat_kv(k, q.shape[1]), reference.repeat_kv(v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def fp32_result(corpus):
    variants = [*attention_variants(["reference", "sdpa"]), Variant("sdpa_repeat_kv", {"attention": sdpa_repeat_kv})]
    return bench_train(TINY, variants=variants, precision="fp32", device="cpu", corpus=corpus, **RUN)


def test_result_has_every_field_and_is_json(fp32_result, corpus):
    r = json.loads(json.dumps(fp32_result))
    assert set(r["impls"]) == {"reference", "sdpa", "sdpa_repeat_kv"}
    for name, res in r["impls"].items():
        assert len(res["losses"]) == len(res["step_ms"]) == RUN["steps"]
        assert all(isinstance(x, float) and math.isfinite(x) for x in res["losses"])
        assert all(ms > 0 for ms in res["step_ms"])
        assert res["step_ms_p20"] <= res["warm_ms_per_step"] <= res["step_ms_p80"]
        assert res["tokens_per_s"] == pytest.approx(4 * 32 / (res["warm_ms_per_step"] / 1e3))
        assert res["peak_mem_bytes"] > 0  # CPU: one step's allocations replayed (see notes)
    assert set(r["drift"]) == {"sdpa", "sdpa_repeat_kv"}
    assert r["baseline"] == "reference"
    assert r["variants"] == ["reference", "sdpa", "sdpa_repeat_kv"] and r["skipped"] == {}
    assert r["tokens_per_step"] == 4 * 32
    assert r["n_params"] > 0
    assert r["corpus"] == {"source": corpus.source, "sha256": corpus.sha256, "n_bytes": corpus.n_bytes}
    assert r["device"] == "cpu" and r["precision"] == "fp32"
    assert r["threads"] == torch.get_num_threads()
    assert any("peak_mem_bytes" in note for note in r["notes"])


def test_fp32_drift_is_small(fp32_result):
    for name, drift in fp32_result["drift"].items():
        assert drift < 1e-4, name
        assert fp32_result["max_step_drift"][name] < 1e-4, name


def test_same_weights_and_batches_give_the_same_first_loss(fp32_result):
    first = {name: res["losses"][0] for name, res in fp32_result["impls"].items()}
    assert max(first.values()) - min(first.values()) < 1e-5
    assert abs(first["reference"] - math.log(256)) < 0.1


def test_loss_goes_down_on_the_real_corpus(fp32_result):
    losses = fp32_result["impls"]["reference"]["losses"]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5  # ~5.5 (uniform over bytes) -> ~3.3


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_path_runs_and_stays_near_fp32(precision, fp32_result, corpus):
    run = {**RUN, "steps": 6, "warmup_steps": 1}
    r = bench_train(TINY, variants=attention_variants(["reference", "sdpa"]), precision=precision, device="cpu", corpus=corpus, **run)
    assert r["precision"] == precision
    assert any("autocast" in note for note in r["notes"])
    losses = r["impls"]["reference"]["losses"]
    fp32_losses = fp32_result["impls"]["reference"]["losses"][:6]
    assert max(abs(a - b) for a, b in zip(losses, fp32_losses)) < 5e-2
    assert r["drift"]["sdpa"] < 5e-2


def test_tf32_on_cpu_is_fp32_and_says_so(fp32_result, corpus):
    run = {**RUN, "steps": 3, "warmup_steps": 1}
    r = bench_train(TINY, variants=attention_variants(["reference"]), precision="tf32", device="cpu", corpus=corpus, **run)
    assert r["drift"] == {}
    assert any("identical to fp32" in note for note in r["notes"])
    torch.testing.assert_close(
        r["impls"]["reference"]["losses"], fp32_result["impls"]["reference"]["losses"][:3], atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("precision,inside", [("tf32", "tf32"), ("fp32", "ieee")])
def test_cuda_precision_mode_pins_and_restores_the_matmul_flag(precision, inside):
    # The flags are plain settings, so this runs without a GPU.
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("torch < 2.9 has only allow_tf32")
    before = matmul.fp32_precision
    with _precision_mode(precision, torch.device("cuda")):
        assert matmul.fp32_precision == inside
    assert matmul.fp32_precision == before
    with _precision_mode(precision, torch.device("cpu")):
        assert matmul.fp32_precision == before


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(variants=[]), "at least one variant"),
        (dict(variants=attention_variants(["reference", "reference"])), "duplicate names"),
        (dict(precision="fp8"), "precision"),
        (dict(warmup_steps=30), "warmup_steps"),
        (dict(seq_len=65), "max_seq_len"),
    ],
)
def test_bad_arguments_raise(kw, match, corpus):
    args = {**RUN, "variants": attention_variants(["reference", "sdpa"]), "precision": "fp32", "device": "cpu", "corpus": corpus, **kw}
    with pytest.raises(ValueError, match=match):
        bench_train(TINY, **args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
def test_bench_train_on_cuda(precision, corpus):
    flag = "fp32_precision" if hasattr(torch.backends.cuda.matmul, "fp32_precision") else "allow_tf32"
    before = getattr(torch.backends.cuda.matmul, flag)
    r = bench_train(TINY, variants=attention_variants(["reference", "sdpa"]), precision=precision, device="cuda", corpus=corpus, **RUN)
    assert getattr(torch.backends.cuda.matmul, flag) == before  # restored
    for res in r["impls"].values():
        assert res["peak_mem_bytes"] > 0
        assert sum(res["losses"][-5:]) / 5 < res["losses"][0] - 1.5
    assert r["drift"]["sdpa"] < (1e-3 if precision == "fp32" else 5e-2)


def test_profiled_step_splits_time_between_the_model_s_slots(fp32_result):
    from posttrainllm.model.slots import SLOTS

    for name, res in fp32_result["impls"].items():
        prof = res["profile"]
        assert set(prof) == {"step_us", "clock", *SLOTS}  # one entry per slot of the model, by its name
        assert prof["attention"]["calls"] == TINY.n_layers
        assert prof["linear"]["calls"] == 7 * TINY.n_layers + 1  # q, k, v, o, gate, up, down per layer + head
        for slot in ("attention", "linear"):
            assert prof[slot]["forward_us"] > 0 and prof[slot]["backward_us"] > 0, (name, slot)
        assert prof["experts"]["calls"] == prof["cached_attention"]["calls"] == 0  # a dense model, no cache
        assert 0 < prof["attention"]["fraction"] + prof["linear"]["fraction"] < 1


def test_the_baseline_is_repeated_for_its_run_to_run_band(fp32_result):
    """The band comes from the baseline's own step times (a second copy of it interleaved with the variants, over
    all warm steps and each half; the first copy's halves recorded as drift), recorded with them: what it is made of
    is checked here, never how wide it came out."""
    from posttrainllm.model import amdahl

    noise = fp32_result["noise"]
    assert len(noise["repeat_step_ms"]) == RUN["steps"] and all(ms > 0 for ms in noise["repeat_step_ms"])
    again = amdahl.noise_band(fp32_result["impls"]["reference"]["step_ms"], noise["repeat_step_ms"],
                              RUN["warmup_steps"])
    assert again["band"] == noise["band"] >= 1.0
    assert set(noise["ratios"]) == {"repeat", "repeat_first_half", "repeat_second_half"} and noise["drift"] > 0
    check = amdahl.check(fp32_result, {"problem": "x", "paths": {"reference": {"valid": True}, "sdpa": {
        "valid": True, "forward_backward": {"speedup_vs_reference": 1.0}}}}, profiled_range="attention",
        model_problem="x")
    assert check["band"] == noise["band"] and check["variants"]["sdpa"]["measured_change"] in (
        "no measurable change", "faster", "slower")


def logged_attention(name: str, log: list[str]):
    """An attention that records, in one list shared by every variant, that `name`'s model called it."""
    def attention(q, k, v):
        log.append(name)
        return sdpa_repeat_kv(q, k, v)
    return attention


def test_variants_train_interleaved_step_by_step(corpus):
    """Step k of every variant (the baseline's timing-only copy last in the round) runs before step k+1 of any; a
    variant with fewer steps leaves the round; then each finishes alone: its peak-memory step, its profiled step."""
    log: list[str] = []
    variants = [Variant("a", {"attention": logged_attention("a", log)}),
                Variant("b", {"attention": logged_attention("b", log)}, steps=2)]
    r = bench_train(TINY, variants=variants, precision="fp32", device="cpu", corpus=corpus,
                    **{**RUN, "steps": 3, "warmup_steps": 1})
    forwards = log[::TINY.n_layers]  # one attention call per layer per forward
    assert log == [name for name in forwards for _ in range(TINY.n_layers)]
    assert forwards == ["a", "b", "a",  # step 1: a, b, a's repeat
                        "a", "b", "a",  # step 2
                        "a", "a",  # step 3: b trained its 2 steps and left the round
                        "a", "a", "b", "b"]  # a's then b's peak-memory and profiled steps; the repeat has none
    assert r["order"] == ORDER == "interleaved by step"
    assert len(r["impls"]["a"]["losses"]) == 3 and len(r["impls"]["b"]["losses"]) == 2
    assert len(r["noise"]["repeat_step_ms"]) == 3


def test_interleaving_leaves_each_variant_s_losses_bit_identical(fp32_result, corpus):
    """Training is deterministic (the model's init forks the RNG; no dropout): a variant trained alone has the very
    losses it has interleaved with the others."""
    by_name = {v.name: v for v in [*attention_variants(["reference", "sdpa"]),
                                   Variant("sdpa_repeat_kv", {"attention": sdpa_repeat_kv})]}
    for name, variant in by_name.items():
        alone = bench_train(TINY, variants=[variant], precision="fp32", device="cpu", corpus=corpus, **RUN)
        assert alone["impls"][name]["losses"] == fp32_result["impls"][name]["losses"], name
    short = Variant("sdpa", by_name["sdpa"].fills, steps=7)  # leaves the round early: still its own losses
    mixed = bench_train(TINY, variants=[by_name["reference"], short], precision="fp32", device="cpu", corpus=corpus,
                        **RUN)
    assert mixed["impls"]["sdpa"]["losses"] == fp32_result["impls"]["sdpa"]["losses"][:7]
    assert mixed["impls"]["reference"]["losses"] == fp32_result["impls"]["reference"]["losses"]


def test_a_trainer_keeps_its_parameters_buffers_and_adam_state_resident(corpus):
    """What CUDA's peak memory adds back to the extra step's rise: the trainer's own resident bytes."""
    batches = [(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))]
    trainer = _Trainer(TINY, Variant("reference"), batches, 3e-3, 0, "fp32", torch.device("cpu"), 0)
    model = trainer.model
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert _resident_bytes(model, trainer.optimizer, torch.device("cpu")) == params + buffers  # no Adam state yet
    trainer.step(0)
    adam_steps = 4 * len(list(model.parameters()))  # AdamW's per-parameter step count: a 0-d fp32 tensor
    assert _resident_bytes(model, trainer.optimizer, torch.device("cpu")) == 3 * params + buffers + adam_steps
    assert _resident_bytes(model, trainer.optimizer, torch.device("cuda")) == 0  # nothing of it on another device


def test_a_trainer_refuses_a_step_out_of_order(corpus):
    batches = [(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))] * 2
    trainer = _Trainer(TINY, Variant("reference"), batches, 3e-3, 0, "fp32", torch.device("cpu"), 0)
    with pytest.raises(ValueError, match="reference: step 1 out of order"):
        trainer.step(1)
    trainer.step(0)
    trainer.step(1)
    with pytest.raises(ValueError, match="step 2 out of order"):
        trainer.step(2)
