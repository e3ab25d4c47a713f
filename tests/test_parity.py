"""The parity stage must catch broken kernels: bugs planted in the real Triton source, and bad outputs.

Each planted bug is a one-line textual mutation of posttrainllm/ops/*.py, imported
from a copy; the test first checks the line it mutates exists exactly once, so a
refactor cannot turn a planted bug into a silent no-op.
"""

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from posttrainllm.lab import parity
from posttrainllm.opdefs import registry as paths
from posttrainllm.lab import stages
from posttrainllm.opdefs.registry import Impl
from posttrainllm.config import PROJECT_ROOT, Contract, load

OPS = PROJECT_ROOT / "posttrainllm" / "ops"


def _mutant(tmp_path: Path, module: str, original: str, planted: str):
    source = (OPS / f"{module}.py").read_text()
    assert source.count(original) == 1, f"mutation target not found once in {module}.py: {original!r}"
    path = tmp_path / f"mutant_{module}.py"
    path.write_text(source.replace(original, planted))
    spec = importlib.util.spec_from_file_location(f"mutant_{module}_{tmp_path.name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_stages(cfg, out: Path, monkeypatch, op: str, impl: Impl | None = None) -> dict:
    """reference -> kernel -> parity with the Triton path replaced by `impl`; returns parity.json."""
    if impl is not None:
        monkeypatch.setitem(paths.IMPLS[op], "triton", impl)
    stages.run_reference(cfg, out)
    stages.run_kernel(cfg, out)
    try:
        stages.run_parity(cfg, out)
    except stages.ContractBroken:
        pass
    return json.loads((out / "parity.json").read_text())


def _attention_impl(fn) -> Impl:
    def run(x, cfg):
        out, lse = fn(x["q"], x["k"], x["v"], causal=cfg.op.causal, block_q=cfg.tile.block_q,
                      block_kv=cfg.tile.block_kv)
        return {"out": out, "lse": lse}
    return dataclasses.replace(paths.IMPLS["attention"]["triton"], run=run)


ATTENTION = ["device=cpu", "parity.seeds=[0]", "shape.edge_seq_lens=[37]"]


def test_correct_kernels_pass_and_stage_writes_report(tmp_path, monkeypatch):
    report = _run_stages(load(ATTENTION), tmp_path, monkeypatch, "attention")
    assert report["verdict"] == "pass"
    assert set(report["paths"]) == {"sdpa", "triton"}
    worst = report["paths"]["triton"]["worst"]
    assert {"out", "lse"} <= set(worst)
    assert worst["out"]["max_abs_err"] <= worst["out"]["allowed_abs_err"]


PLANTED_ATTENTION_BUGS = {
    "missing softmax scale": ("qk = qk * qk_scale", "qk = qk * LOG2_E"),
    "off-by-one causal mask": ("offs_q[:, None] >= offs_kv[None, :]", "offs_q[:, None] + 1 >= offs_kv[None, :]"),
    "no online-softmax rescale": ("acc = acc * alpha[:, None]", "acc = acc"),
    "rescale by the wrong factor": ("alpha = tl.math.exp2(m_i - m_new)", "alpha = tl.math.exp2(m_new - m_i)"),
}


@pytest.mark.parametrize("bug", PLANTED_ATTENTION_BUGS)
def test_planted_attention_bug_is_caught(bug, tmp_path, monkeypatch):
    original, planted = PLANTED_ATTENTION_BUGS[bug]
    mutant = _mutant(tmp_path, "attention", original, planted)
    cfg = load(ATTENTION)
    with pytest.raises(stages.ContractBroken, match="triton broke the fp32 contract"):
        monkeypatch.setitem(paths.IMPLS["attention"], "triton", _attention_impl(mutant.triton_attention))
        stages.run_reference(cfg, tmp_path)
        stages.run_kernel(cfg, tmp_path)
        stages.run_parity(cfg, tmp_path)
    report = json.loads((tmp_path / "parity.json").read_text())  # written before the stage failed
    assert report["paths"]["triton"]["verdict"] == "fail"
    assert report["paths"]["sdpa"]["verdict"] == "pass"


def test_all_zero_output_is_caught(tmp_path, monkeypatch):
    zeros = dataclasses.replace(paths.IMPLS["attention"]["triton"], run=lambda x, cfg: {"out": torch.zeros_like(x["q"])})
    report = _run_stages(load(ATTENTION), tmp_path, monkeypatch, "attention", zeros)
    assert report["paths"]["triton"]["verdict"] == "fail"


def test_kernel_that_raises_fails_parity_without_stopping_others(tmp_path, monkeypatch):
    def boom(x, cfg):
        raise RuntimeError("out of shared memory")
    report = _run_stages(load(ATTENTION), tmp_path, monkeypatch, "attention",
                         dataclasses.replace(paths.IMPLS["attention"]["triton"], run=boom))
    assert report["paths"]["triton"]["verdict"] == "fail"
    assert "did not run: RuntimeError: out of shared memory" in report["paths"]["triton"]["failed_cases"][0]
    assert report["paths"]["sdpa"]["verdict"] == "pass"


def test_matmul_dropping_the_ragged_k_slab_is_caught_only_by_the_edge_shape(tmp_path, monkeypatch):
    mutant = _mutant(tmp_path, "matmul", "for k in range(0, tl.cdiv(K, BLOCK_K)):", "for k in range(0, K // BLOCK_K):")

    def run(x, cfg):
        return {"out": mutant.triton_matmul(x["a"], x["b"], block_m=32, block_n=32, block_k=32)}
    impl = dataclasses.replace(paths.IMPLS["matmul"]["triton"], run=run)
    cfg = load(["op=matmul", "device=cpu", "parity.seeds=[0]", "shape.m=64", "shape.n=64", "shape.k=64",
                "shape.edge_mnk=[[41,77,33]]"])
    report = _run_stages(cfg, tmp_path, monkeypatch, "matmul", impl)
    failed = report["paths"]["triton"]["failed_cases"]
    assert report["paths"]["triton"]["verdict"] == "fail"
    assert len(failed) == 1 and failed[0].startswith("41x77x33-seed0/out")


def test_interpreter_bf16_as_shipped_is_caught(tmp_path, monkeypatch):
    from posttrainllm.ops import is_interpreted
    from posttrainllm.ops.attention import triton_attention

    if not is_interpreted():
        pytest.skip("the bf16 defect is the interpreter's")
    as_shipped = _attention_impl(lambda *a, **kw: triton_attention(*a, emulate_bf16=False, **kw))
    report = _run_stages(load([*ATTENTION, "precision=bf16"]), tmp_path, monkeypatch, "attention", as_shipped)
    assert report["paths"]["triton"]["verdict"] == "fail"


def test_bf16_emulation_is_stated_in_the_report(tmp_path, monkeypatch):
    from posttrainllm.ops import is_interpreted

    report = _run_stages(load([*ATTENTION, "precision=bf16"]), tmp_path, monkeypatch, "attention")
    assert report["verdict"] == "pass"
    if is_interpreted():
        assert "triton-lang/triton#11584" in report["paths"]["triton"]["emulation"]
    assert report["paths"]["sdpa"]["emulation"] is None


# --- the rule itself, on numbers worked by hand ------------------------------------------

CONTRACT = Contract(error_multiple=4.0, floor_rel=1e-3, atol=0.05, rtol=0.0, max_mismatch=0.25,
                    train_loss_drift=1.0)


def test_error_metrics_on_known_numbers():
    oracle = torch.tensor([1.0, -2.0, 4.0, 0.0], dtype=torch.float64)
    got = parity.error_metrics(torch.tensor([1.0, -2.1, 4.0, 0.01]), oracle, CONTRACT)
    assert got["max_abs_err"] == pytest.approx(0.1, rel=1e-6)
    assert got["max_rel_err"] == pytest.approx(0.01 / 0.004, rel=1e-5)  # denominator floor 1e-3 * 4
    assert got["mismatch_frac"] == 0.25  # only |-2.1 - -2| > 0.05
    assert got["oracle_max_abs"] == 4.0


def test_bound_is_a_multiple_of_the_baseline_error_plus_a_floor():
    oracle = torch.tensor([1.0, -2.0, 4.0, 0.0], dtype=torch.float64)
    baseline = oracle + torch.tensor([0.0, 0.02, 0.0, 0.0], dtype=torch.float64)
    inside = parity.check_output(oracle + 0.08, oracle, baseline, CONTRACT)  # allowed 4*0.02 + 1e-3*4 = 0.084
    assert inside["allowed_abs_err"] == pytest.approx(0.084)
    assert inside["error_ratio"] == pytest.approx(4.0)
    outside = parity.check_output(oracle + 0.09, oracle, baseline, CONTRACT)
    assert inside["verdict"] == "fail"  # 0.08 > atol: every element mismatches
    assert "mismatch_frac 1 > 0.25" in inside["reason"]
    assert outside["verdict"] == "fail" and "max_abs_err 0.09 > allowed 0.084" in outside["reason"]


def test_non_finite_and_wrong_shape_fail():
    oracle = torch.ones(3, dtype=torch.float64)
    assert parity.check_output(torch.tensor([1.0, float("nan"), 1.0]), oracle, oracle, CONTRACT)["verdict"] == "fail"
    assert "shape" in parity.check_output(torch.ones(4), oracle, oracle, CONTRACT)["reason"]


# --- gradients: dQ, dK, dV and the matmul's dA, dB against float64 autograd -------------------

def _flash_impl(fn) -> Impl:
    """The Triton path with a (mutant) differentiable flash attention."""
    def differentiable(x, cfg):
        return fn(x["q"], x["k"], x["v"], causal=cfg.op.causal, block_q=cfg.tile.block_q, block_kv=cfg.tile.block_kv)
    return dataclasses.replace(paths.IMPLS["attention"]["triton"], differentiable=differentiable)


GQA = [*ATTENTION, "architecture=gqa", "tile=b16", "shape.seq_len=64"]

PLANTED_BACKWARD_BUGS = {
    "missing D = rowsum(dO∘O) in dK/dV": ("dsT = pT * (dpT - Di[None, :])", "dsT = pT * dpT", "grad_k"),
    "missing D = rowsum(dO∘O) in dQ": ("ds = p * (dp - Di[:, None])", "ds = p * dp", "grad_q"),
    "dK/dV accumulated for the wrong query heads": ("off_h = off_hkv * KV_GROUP + g", "off_h = off_hkv * KV_GROUP",
                                                    "grad_k"),
    "diagonal causal block skipped in dK/dV": ("lo = start_kv * BLOCK_KV", "lo = (start_kv + 1) * BLOCK_KV", "grad_k"),
}


def test_gradients_are_checked_for_every_path(tmp_path, monkeypatch):
    report = _run_stages(load(GQA), tmp_path, monkeypatch, "attention")
    assert report["verdict"] == "pass"
    for path in ("sdpa", "triton"):
        assert {"grad_q", "grad_k", "grad_v"} <= set(report["paths"][path]["worst"])


@pytest.mark.parametrize("bug", PLANTED_BACKWARD_BUGS)
def test_planted_backward_bug_is_caught(bug, tmp_path, monkeypatch):
    original, planted, gradient = PLANTED_BACKWARD_BUGS[bug]
    mutant = _mutant(tmp_path, "attention", original, planted)
    report = _run_stages(load(GQA), tmp_path, monkeypatch, "attention", _flash_impl(mutant.flash_attention))
    triton = report["paths"]["triton"]
    assert triton["verdict"] == "fail"
    assert any(f"/{gradient}:" in failure for failure in triton["failed_cases"])
    assert not any("/out:" in failure for failure in triton["failed_cases"])  # the forward is untouched


def test_matmul_gradients_are_checked(tmp_path, monkeypatch):
    cfg = load(["op=matmul", "device=cpu", "parity.seeds=[0]", "shape.edge_mnk=[[41,77,33]]"])
    report = _run_stages(cfg, tmp_path, monkeypatch, "matmul")
    assert report["verdict"] == "pass"
    assert {"out", "grad_a", "grad_b"} <= set(report["paths"]["triton"]["worst"])


def test_exactly_zero_oracle_gradient_uses_the_forward_scale():
    oracle = {"out": torch.full((2,), 3.0, dtype=torch.float64), "grad_q": torch.zeros(2, dtype=torch.float64)}
    got = {"grad_q": torch.tensor([2e-7, 0.0])}
    contract = Contract(error_multiple=8.0, floor_rel=1e-6)
    result = parity.check_path([got], [oracle], [{"grad_q": torch.zeros(2)}], ["S1"], contract)
    assert result["verdict"] == "pass"
    assert result["worst"]["grad_q"]["allowed_abs_err"] == pytest.approx(3e-6)
