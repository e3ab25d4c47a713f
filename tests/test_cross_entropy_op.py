"""op=cross_entropy through the generic stages, planted bugs in the Triton source, the memory the microbench
measures, and the model's fused loss.

Planted bugs mutate one line of posttrainllm/ops/cross_entropy/kernels.py (imported from a copy, as tests/test_parity.py
does); the test first checks that line exists exactly once. Each precision's run checks every bug at once, one
path per mutant, so the reference stage runs once.
"""

import dataclasses
import json

import pytest
from conftest import kernel_and_parity, kernel_mutant, parity_report
import torch
import torch.nn.functional as F

from posttrainllm.config import ConfigError
from posttrainllm.lab import runner
from posttrainllm.lab.stages import common as stage_common, kernel as kernel_stage, parity as parity_stage
from posttrainllm.lab import oracle
from posttrainllm.lab.configure import load
from posttrainllm.measure.memory import peak_bytes
from posttrainllm.model.train import Variant, bench_train
from posttrainllm.model.transformer import ModelConfig, Transformer
from posttrainllm.ops.registry import get_op
from posttrainllm.ops.cross_entropy import definition as cross_entropy

# one seed, no edge sizes: 32 tokens in two chunks of 16, V = 1000 off the 512 block; the point's case, a wholly
# ignored chunk, logits of ~1e5
QUICK = ["op=cross_entropy", "device=cpu", "parity.seeds=[0]", "shape.ops.cross_entropy.tokens=32",
         "shape.ops.cross_entropy.d_model=32",
         "shape.ops.cross_entropy.vocab=1000", "shape.ops.cross_entropy.edge=[]", "op.block_v=512"]
CASES = ["N32-V1000-seed0", "N32-V1000-ignored_chunk", "N32-V1000-large_logits",
         "N32-C32-V1000-smoothed",  # another label smoothing than the point's, with ignored rows
         "N256-C128-V256-train"]  # bench-train's lm_head and loss: train.batch_size x train.seq_len tokens
# no test here reads kernel.json's compile section (tests/test_compile.py does): the kernel stage runs without its child
pytestmark = pytest.mark.usefixtures("without_compile_child")

PLANTED = {
    # the words: each chunk's loss divided by the chunk's size, not the batch's count of non-ignored tokens
    "a chunk's loss divided by the wrong count": (
        "            V, scale, ignore_index, label_smoothing,\n",
        "            V, 1.0 / (end - start), ignore_index, label_smoothing,\n"),
    "no max subtraction": ("        block_max = tl.max(x, 0)\n", "        block_max = tl.max(x, 0) * 0.0\n"),
    "the target's one-hot left out of the gradient": (
        "            grad = tl.where(offs == target, grad - (1.0 - label_smoothing), grad)  # − (1 − ε)·one_hot\n",
        "            grad = grad\n"),
}
SMOOTHING_BUG = ("        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - sum_x / V)\n",
                 "        loss = (1.0 - label_smoothing) * loss + label_smoothing * lse\n")
# Per bug: the failures it must cause, as "case/output", and no other. Measured smallest error / allowance over them
# (fp32 / bf16 / fp16): wrong count x3.6e4 / x7 / x53 (32 tokens in 2 chunks: the loss off 2x; in the ignored case
# the 13 valid targets, all in chunk 2, divided by 16); no max subtraction: non-finite, on the large_logits case alone (exp(1e5) = inf; logits ~N(0, 1) never
# overflow); one-hot left out: grad_h and grad_weight x1.5e5 / x34 / x235, the loss untouched. Clean: <= 0.1.
EXPECTED = {
    "a chunk's loss divided by the wrong count": {f"{case}/{out}" for case in CASES
                                                  for out in ("out", "grad_h", "grad_weight")},
    "no max subtraction": {f"N32-V1000-large_logits/{out}" for out in ("out", "grad_h", "grad_weight")},
    "the target's one-hot left out of the gradient": {f"{case}/{out}" for case in CASES
                                                      for out in ("grad_h", "grad_weight")},
}


def _mutant_path(tmp_path, name, original, planted):
    folder = tmp_path / name.replace(" ", "_").replace("'", "")
    folder.mkdir()
    mutant = kernel_mutant(folder, "cross_entropy", original, planted)

    def fn(x, cfg):
        return {"out": mutant.fused_linear_cross_entropy(
            x["h"], x["weight"], x["targets"], ignore_index=cfg.op.ignore_index,
            label_smoothing=cfg.op.label_smoothing, chunk_size=cfg.op.chunk_size, block_v=cfg.op.block_v)}

    return dataclasses.replace(cross_entropy.IMPLS["triton"], name=name, fn=fn)


def _failures(path: dict) -> set[str]:
    return {failure.split(":")[0] for failure in path["failed_cases"]}


def test_every_path_passes_with_a_gradient_for_h_and_weight(tmp_path, shared_reference):
    """The point's cases pass for torch and ours, with gradients for h and weight and none for the int64 targets."""
    report = kernel_and_parity(shared_reference([*QUICK, "precision=fp32"], tmp_path), tmp_path)
    assert report["verdict"] == "pass", report["first_failure"]
    assert set(report["paths"]) == {"torch", "triton"} and report["cases"] == CASES
    assert set(report["paths"]["triton"]["worst"]) == {"out", "grad_h", "grad_weight"}
    assert report["paths"]["triton"]["worst"]["out"]["row_ndim"] == 0  # the 0-dim loss is one row


@pytest.mark.usefixtures("without_invariance_reruns")
def test_label_smoothing_is_checked_on_every_case_and_the_torch_peer_steps_aside(tmp_path, monkeypatch):
    """A bug in the smoothing term alone (the Σx part dropped) sits in a branch the default label_smoothing=0 never
    runs (HAS_SMOOTHING is a constexpr); a point with label_smoothing > 0 fails it on every case."""
    monkeypatch.setitem(cross_entropy.IMPLS, "smoothing bug", _mutant_path(tmp_path, "smoothing bug", *SMOOTHING_BUG))
    cfg = load([*QUICK, "op.label_smoothing=0.1"])
    report = parity_report(cfg, tmp_path)
    assert set(report["paths"]) == {"triton", "smoothing bug"}  # torch's chunked path refuses smoothing
    assert report["paths"]["triton"]["verdict"] == "pass"
    assert _failures(report["paths"]["smoothing bug"]) == {f"{case}/out" for case in CASES}
    assert "refuses smoothing" in cross_entropy.torch_refusal(cfg)


@pytest.mark.usefixtures("without_invariance_reruns")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_planted_bugs_are_caught(precision, tmp_path, monkeypatch, shared_reference):
    """Under every precision's contract the clean path passes (its GEMMs in the inputs' dtype at bf16 and fp16) and
    each mutant fails exactly the cases and outputs its bug touches."""
    for name, (original, planted) in PLANTED.items():
        monkeypatch.setitem(cross_entropy.IMPLS, name, _mutant_path(tmp_path, name, original, planted))
    out = tmp_path / "point"
    cfg = shared_reference([*QUICK, f"precision={precision}"], out)
    kernel_stage.run_kernel(cfg, out)
    with pytest.raises(stage_common.ContractBroken, match=f"broke the {precision} contract"):
        parity_stage.run_parity(cfg, out)
    report = json.loads((out / "parity.json").read_text())
    assert report["paths"]["torch"]["verdict"] == report["paths"]["triton"]["verdict"] == "pass"
    for name in PLANTED:
        assert _failures(report["paths"][name]) == EXPECTED[name], name


# Peak bytes (CPU allocator events: deterministic) at N=64, C=32, V=32768, chunk_size 8, block_v 8192, fp32; measured
# 2026-12 with tests/test_cross_entropy_op.py's calls (forward under no_grad / forward + backward):
#   reference 16,777,224 / 25,165,828   (the logits and the log-probabilities, 2*N*V*4 = 16,777,216)
#   torch        131,976 /  8,404,996   (F.linear_cross_entropy, chunked)
#   triton     1,048,836 /  5,251,328   (one (8, V) chunk; + grad_weight V*C*4 in training)
# At C=64 the training figures are 25,165,828 / 16,809,988 / 9,453,824; in bf16 (C=32) 29,368,324 / 8,537,036 /
# 6,303,748 (ours: an fp32 grad_weight and its bf16 cast, no fp32 copy of the weight: it took 9,446,656 with one;
# tests/ops/test_cross_entropy.py). Triton's interpreter holds a launch's arguments until a later one: the reused
# chunk buffer keeps that from counting twice.
def test_the_memory_the_microbench_measures_reflects_the_logits():
    """The microbench's calls at a 32k vocabulary: peak_bytes of the forward (under no_grad, as microbench measures
    it) and of the training call (runner.InProcess.forward_backward). The reference holds the (N, V) logits and
    log-probabilities; ours one (chunk, V) block (and grad_weight in training): at most half, in both."""
    cfg = load(["op=cross_entropy", "device=cpu", "shape.ops.cross_entropy.vocab=32768",
                "shape.ops.cross_entropy.d_model=32",
                "op.chunk_size=8", "op.block_v=8192"])
    op = get_op("cross_entropy")
    case = next(c for c in op.cases(cfg) if c.main)
    inputs = op.make_inputs(case, torch.float32, "cpu")
    grad_out = oracle.upstream_gradient(case, op.reference.fn(inputs, cfg)["out"])
    peaks = {}
    for name in ("reference", "triton"):
        impl = op.impls[name]
        with torch.no_grad():
            peaks[name, "forward"] = peak_bytes(lambda: impl.fn(inputs, cfg), "cpu", warmup=0)["peak_bytes"]
        peaks[name, "train"] = peak_bytes(runner.runner_for(impl).forward_backward(inputs, grad_out, cfg), "cpu",
                                          warmup=0)["peak_bytes"]
    logits = op.describe(case, inputs, cfg)["logits_bytes"]
    assert logits == 64 * 32768 * 4 and peaks["reference", "forward"] >= 2 * logits
    assert peaks["triton", "forward"] < logits / 4
    for mode in ("forward", "train"):
        assert peaks["triton", mode] <= peaks["reference", mode] / 2, peaks


def test_costs_curves_and_config_rules():
    cfg = load(QUICK)
    op = get_op("cross_entropy")
    case = next(c for c in op.cases(cfg) if c.main)
    costs = op.costs(case, cfg)
    n, c, v = 32, 32, 1000
    assert costs.flops == 2 * n * c * v + 4 * n * v
    assert costs.bytes == (n * c + v * c) * 4 + n * 8 + 4  # no logits
    assert costs.train_flops == pytest.approx(2 * n * c * v + 4 * n * v + 4 * n * c * v + 2 * n * v, rel=1e-12)
    assert [a.x_name for a in op.curve_axes] == ["tokens", "vocab"]
    assert [op.curve_case(cfg, x).dims["tokens"] for x in op.curve_sizes(cfg)] == [16, 64, 256, 1024]
    vocab = op.curve_axes[1]
    assert [vocab.case(cfg, x).dims for x in vocab.sizes(cfg)][-1] == dict(tokens=32, d_model=32, vocab=32768)
    assert op.gradient_names() == ["grad_h", "grad_weight"]  # none for the int64 targets
    # fewer tokens than a chunk: all but the last target ignored (every one ignored would be NaN); one token: no case
    few = next(c for c in op.cases(load([*QUICK, "shape.ops.cross_entropy.tokens=8"])) if c.inputs == "ignored_chunk")
    targets = op.make_inputs(few, torch.float32, "cpu")["targets"]
    assert (targets[:-1] == -100).all() and targets[-1] != -100
    one_token = load([*QUICK, "shape.ops.cross_entropy.tokens=1"])
    assert [c.inputs for c in op.cases(one_token)] == ["normal", "large_logits", "normal"]  # + bench-train's shape
    for override, message in [("op.label_smoothing=1.5", "op.label_smoothing=1.5: must be in [0, 1]"),
                              ("op.chunk_size=0", "op.chunk_size=0: must be >= 1"),
                              ("op.block_v=100", "op.block_v=100: must be a power of two"),
                              ("shape.ops.cross_entropy.edge=[[1,2]]",
                               "shape.ops.cross_entropy.edge: [1, 2] must be three sizes")]:
        with pytest.raises(ConfigError, match=message.replace("[", "\\[").replace("]", "\\]")):
            load(["op=cross_entropy", override])


def test_the_gpu_shape_composes_a_gpu_sized_chunk():
    """op.chunk_size comes from the shape (shape.ops.cross_entropy.chunk_size): tiny's 16 for the parity cases, 512 at gpu and
    gpu_check (16 chunks of 8192 tokens, not 512, each re-reading the weight); op.chunk_size given still wins."""
    assert load(["op=cross_entropy", "device=cpu"]).op.chunk_size == 16
    for shape in ("gpu", "gpu_check"):
        cfg = load(["op=cross_entropy", f"shape={shape}", "device=cuda", "precision=bf16"])
        main = next(c for c in cross_entropy.OP.cases(cfg) if c.main)
        assert cfg.op.chunk_size == 512 and main.dims == dict(tokens=8192, d_model=2048, vocab=32768)
        assert cross_entropy.OP.geometry(cross_entropy.IMPLS["triton"], main, cfg)["chunks"] == 16
    assert load(["op=cross_entropy", "shape=gpu", "device=cuda", "op.chunk_size=64"]).op.chunk_size == 64


def test_the_models_fused_loss_equals_its_logits_cross_entropy_and_trains():
    """With the op's defaults (ignore_index -100, no smoothing) every path's hook gives the model's own loss,
    F.cross_entropy of its fp32 logits; bench-train trains the reference and the Triton path to the same losses."""
    config = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, mlp_hidden=64, max_seq_len=16)
    idx, targets = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    model = Transformer(config, seed=0)
    logits, _ = model(idx)
    expected = F.cross_entropy(logits.float().view(32, -1), targets.view(32))
    cfg = load(["op=cross_entropy"])
    hooks = {name: cross_entropy.OP.model_hook.fill(cross_entropy.IMPLS[name], cfg)
             for name in ("reference", "torch", "triton")}
    for name, hook in hooks.items():
        model.swap("loss", hook)
        none, loss = model(idx, targets)
        assert none is None and abs(loss.item() - expected.item()) < 1e-5, name

    variants = [Variant("reference", {"loss": hooks["reference"]}),
                Variant("triton", {"loss": hooks["triton"]}, interpreted=True, steps=2)]
    result = bench_train(config, variants=variants, steps=2, warmup_steps=0, batch_size=2, seq_len=16, lr=3e-3,
                         seed=0, precision="fp32", device="cpu")
    assert result["drift"]["triton"] < 1e-5
    assert result["impls"]["reference"]["profile"]["loss"]["calls"] == 1
