"""The parity stage must catch broken kernels: bugs planted in the real Triton source, and bad outputs.

Each planted bug is a one-line textual mutation of posttrainllm/ops/*.py, imported
from a copy; the test first checks the line it mutates exists exactly once, so a
refactor cannot turn a planted bug into a silent no-op.
"""

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import kernel_and_parity, kernel_mutant, parity_report
import torch

from posttrainllm.config import Contract

from posttrainllm.lab.configure import load
from posttrainllm.lab import parity
from posttrainllm.lab.stages import (common as stage_common, kernel as kernel_stage, parity as parity_stage,
                                     reference as reference_stage)
from posttrainllm.ops.attention import definition as attention
from posttrainllm.ops.matmul import definition as matmul
from posttrainllm.ops.base import Impl

REGISTRY = {"attention": attention.IMPLS, "matmul": matmul.IMPLS}

# no test here reads kernel.json's compile section (tests/test_compile.py does): the kernel stage runs without its child
pytestmark = pytest.mark.usefixtures("without_compile_child")


def _mutant(tmp_path: Path, module: str, original: str, planted: str):
    return kernel_mutant(tmp_path, module, original, planted)


def _run_stages(cfg, out: Path, monkeypatch, op: str, impl: Impl | None = None, name: str = "triton",
                shared: bool = False) -> dict:
    """reference -> kernel -> parity with the registry's `name` path replaced by `impl`; returns parity.json.
    shared: the reference is in `out` already (shared_reference): kernel -> parity."""
    if impl is not None:
        monkeypatch.setitem(REGISTRY[op], name, impl)
    return kernel_and_parity(cfg, out) if shared else parity_report(cfg, out)


def _flash_impl(module) -> Impl:
    """The Triton path running a (mutant) copy of posttrainllm/ops/attention/kernels.py, forward and backward."""
    def fn(x, cfg):
        out, lse = module.flash_attention_with_lse(x["q"], x["k"], x["v"], causal=cfg.op.causal,
                                                   sm_scale=cfg.op.sm_scale, block_q=cfg.tile.block_q,
                                                   block_kv=cfg.tile.block_kv)
        return {"out": out, "lse": lse}
    return dataclasses.replace(attention.IMPLS["triton"], fn=fn)


ATTENTION = ["device=cpu", "parity.seeds=[0]", "shape.edge_seq_lens=[37]"]
PRECISIONS = ["fp32", "bf16", "fp16"]
# the planted forward bugs' point: one head (the grid's head axis; no bug here is about heads, GQA's below) and
# bench-train's problem folded into the point's own (train: 1 sequence of 128), so 6 cases of a quarter the programs
ONE_HEAD = [*ATTENTION, "architecture.n_heads=1", "architecture.n_kv_heads=1", "train.batch_size=1",
            "train.seq_len=128"]


@pytest.fixture(scope="module")
def honest_report(tmp_path_factory):
    """precision -> parity.json of the registry's own paths at ATTENTION (every case: the point's shape, S=37,
    the adversarial inputs, the sm_scale case, bench-train's shape), one run per precision for the module."""
    reports: dict[str, dict] = {}

    def get(precision: str) -> dict:
        if precision not in reports:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(kernel_stage, "_start_compile", lambda op, cfg, out: None)
                reports[precision] = parity_report(load([*ATTENTION, f"precision={precision}"]),
                                                   tmp_path_factory.mktemp(f"honest_{precision}"))
        return reports[precision]

    return get


def test_correct_kernels_pass_and_stage_writes_report(honest_report):
    report = honest_report("fp32")
    assert report["verdict"] == "pass" and report["first_failure"] is None
    assert set(report["paths"]) == {"sdpa", "sdpa_flash", "sdpa_math", "triton"}  # the SDPA backends CPU has
    worst = report["paths"]["triton"]["worst"]
    assert {"out", "lse", "grad_q", "grad_k", "grad_v"} <= set(worst)
    assert worst["out"]["max_abs_err"] <= worst["out"]["allowed_abs_err"]
    assert "lse" not in report["paths"]["sdpa"]["worst"]  # SDPA does not return a logsumexp: not asked of it
    # adversarial inputs are cases too: large logits, logits growing along the sequence, near one-hot rows
    assert {"S128-large_logits", "S128-growing_logits", "S128-near_one_hot"} <= set(report["cases"])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_adversarial_inputs_pass_for_correct_kernels(precision, honest_report):
    report = honest_report(precision)
    assert {"S128-large_logits", "S128-growing_logits", "S128-near_one_hot"} <= set(report["cases"])
    assert report["verdict"] == "pass", report["first_failure"]


PLANTED_ATTENTION_BUGS = {
    "missing softmax scale": ("qk_scale = sm_scale * LOG2_E  # forward", "qk_scale = LOG2_E  # forward"),
    "off-by-one causal mask": ("offs_q[:, None] >= offs_kv[None, :]", "offs_q[:, None] + 1 >= offs_kv[None, :]"),
    "no online-softmax rescale": ("acc = acc * alpha[:, None]", "acc = acc"),
    "rescale by the wrong factor": ("alpha = tl.math.exp2(m_i - m_new)", "alpha = tl.math.exp2(m_new - m_i)"),
    # the causal split: the masked phase's score mask dropped (loads stay masked), and the unmasked phase
    # running one KV block into the diagonal (S=128 is a multiple of every block here: its loads stay in bounds)
    "diagonal block's mask dropped": ('qk = tl.where(_visible(offs_q, offs_kv, S, CAUSAL), qk, float("-inf"))',
                                      "qk = qk"),
    "off-diagonal loop one block too far": ("diag_lo = (start_q * BLOCK_Q) // BLOCK_KV * BLOCK_KV",
                                            "diag_lo = (start_q * BLOCK_Q) // BLOCK_KV * BLOCK_KV + BLOCK_KV"),
}
# bugs whose mutant reads past a ragged sequence's end (the interpreter does not bounds-check): no edge lengths
IN_BOUNDS_ONLY = {"off-diagonal loop one block too far"}


@pytest.mark.usefixtures("without_invariance_reruns")
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("bug", PLANTED_ATTENTION_BUGS)
def test_planted_attention_bug_is_caught(bug, precision, tmp_path, monkeypatch, shared_reference):
    """Under every precision's contract, the loosest (bf16) included."""
    original, planted = PLANTED_ATTENTION_BUGS[bug]
    mutant = _mutant(tmp_path, "attention", original, planted)
    args = [*ONE_HEAD, f"precision={precision}", *(["shape.edge_seq_lens=[]"] if bug in IN_BOUNDS_ONLY else [])]
    cfg = shared_reference(args, tmp_path)
    monkeypatch.setitem(attention.IMPLS, "triton", _flash_impl(mutant))
    kernel_stage.run_kernel(cfg, tmp_path)
    with pytest.raises(stage_common.ContractBroken, match=f"triton broke the {precision} contract"):
        parity_stage.run_parity(cfg, tmp_path)
    report = json.loads((tmp_path / "parity.json").read_text())  # written before the stage raised
    assert report["paths"]["triton"]["verdict"] == "fail"
    assert report["paths"]["sdpa"]["verdict"] == "pass"
    assert report["first_failure"].startswith("triton: ")


def test_all_zero_output_is_caught(tmp_path, monkeypatch):
    zeros = dataclasses.replace(attention.IMPLS["sdpa"], fn=lambda x, cfg: {"out": torch.zeros_like(x["q"])})
    report = _run_stages(load([*ATTENTION, "op.only=[sdpa]"]), tmp_path, monkeypatch, "attention", zeros, name="sdpa")
    assert report["paths"]["sdpa"]["verdict"] == "fail"


def test_a_path_that_omits_a_declared_output_fails(tmp_path, monkeypatch):
    triton = attention.IMPLS["triton"]
    no_lse = dataclasses.replace(triton, fn=lambda x, cfg: {"out": triton.fn(x, cfg)["out"]})
    report = _run_stages(load([*ONE_HEAD, "op.only=[triton]"]), tmp_path, monkeypatch, "attention", no_lse)
    assert report["paths"]["triton"]["verdict"] == "fail"
    assert any("lse" in f for f in report["paths"]["triton"]["failed_cases"])


def test_a_path_that_changes_its_input_fails(tmp_path, monkeypatch):
    sdpa = attention.IMPLS["sdpa"]

    def scribbles(x, cfg):
        out = sdpa.fn(x, cfg)
        x["q"].data.mul_(1.0 + 1e-3)  # right answer, then damage the caller's tensor
        return out
    report = _run_stages(load([*ATTENTION, "op.only=[sdpa]"]), tmp_path, monkeypatch, "attention",
                         dataclasses.replace(sdpa, fn=scribbles), name="sdpa")
    assert report["paths"]["sdpa"]["verdict"] == "fail"
    assert any("changed input q" in f for f in report["paths"]["sdpa"]["failed_cases"])


def test_a_path_that_returns_its_input_storage_fails(tmp_path, monkeypatch):
    """A matmul by the identity that hands back A itself is numerically right and still wrong."""
    cfg = load(["op=matmul", "device=cpu", "parity.seeds=[0]", "shape.ops.matmul.edge=[]", "shape.ops.matmul.n=128",
                "shape.ops.matmul.k=128",
                "op.only=[torch]"])
    identity = dataclasses.replace(matmul.IMPLS["torch"], fn=lambda x, cfg: {"out": x["a"].view_as(x["a"])})
    original = matmul.OP.make_inputs

    def with_identity_b(case, dtype, device):
        x = original(case, dtype, device)
        return {"a": x["a"], "b": torch.eye(x["b"].shape[0], dtype=dtype, device=device)}
    monkeypatch.setattr(matmul.OP, "make_inputs", with_identity_b)
    report = _run_stages(cfg, tmp_path, monkeypatch, "matmul", identity, name="torch")
    assert report["paths"]["torch"]["verdict"] == "fail"
    assert any("shares storage with input a" in f for f in report["paths"]["torch"]["failed_cases"])


def test_a_triton_path_that_launches_no_kernel_fails(tmp_path, monkeypatch):
    """The 'triton' path must run Triton: a path that quietly calls SDPA is caught."""
    sdpa = attention.IMPLS["sdpa"]
    fake = dataclasses.replace(attention.IMPLS["triton"], outputs=("out",), fn=sdpa.fn)
    report = _run_stages(load([*ATTENTION, "op.only=[triton]"]), tmp_path, monkeypatch, "attention", fake)
    assert report["paths"]["triton"]["verdict"] == "fail"
    assert any("launched no Triton kernel" in f for f in report["paths"]["triton"]["failed_cases"])


def test_kernel_that_raises_fails_parity_without_stopping_others(tmp_path, monkeypatch):
    def boom(x, cfg):
        raise RuntimeError("out of shared memory")
    report = _run_stages(load(ATTENTION), tmp_path, monkeypatch, "attention",
                         dataclasses.replace(attention.IMPLS["triton"], fn=boom))
    assert report["paths"]["triton"]["verdict"] == "fail"
    assert "did not run: RuntimeError: out of shared memory" in report["paths"]["triton"]["failed_cases"][0]
    assert report["paths"]["sdpa"]["verdict"] == "pass"


PLANTED_MATMUL_BUGS = {
    "the ragged K slab dropped": ("for k in range(0, tl.cdiv(K, BLOCK_K)):", "for k in range(0, K // BLOCK_K):"),
    # the ragged path (EVEN_K false) lets one element past K into the last slab; the even path never masks
    "the ragged K mask off by one": ("k_left = K - k * BLOCK_K", "k_left = K - k * BLOCK_K + 1"),
}


@pytest.mark.usefixtures("without_invariance_reruns")
@pytest.mark.parametrize("bug", PLANTED_MATMUL_BUGS)
def test_planted_matmul_bug_is_caught_only_by_the_edge_shape(bug, tmp_path, monkeypatch, shared_reference):
    mutant = _mutant(tmp_path, "matmul", *PLANTED_MATMUL_BUGS[bug])

    def fn(x, cfg):
        return {"out": mutant.matmul(x["a"], x["b"], block_m=32, block_n=32, block_k=32)}
    impl = dataclasses.replace(matmul.IMPLS["triton"], fn=fn)
    cfg = shared_reference(["op=matmul", "device=cpu", "parity.seeds=[0]", "shape.ops.matmul.m=64",
                            "shape.ops.matmul.n=64",
                                           "shape.ops.matmul.k=64", "shape.ops.matmul.edge=[[41,77,33]]"], tmp_path)
    report = _run_stages(cfg, tmp_path, monkeypatch, "matmul", impl, shared=True)
    failed = report["paths"]["triton"]["failed_cases"]
    assert report["paths"]["triton"]["verdict"] == "fail"
    assert failed and all(f.startswith("41x77x33-seed0/") for f in failed)  # the forward and both gradients



def test_interpreter_bf16_as_shipped_is_caught(tmp_path, monkeypatch):
    from posttrainllm.ops import is_interpreted
    from posttrainllm.ops.attention.kernels import triton_attention

    if not is_interpreted():
        pytest.skip("the bf16 defect is the interpreter's")

    def as_shipped(x, cfg):
        out, lse = triton_attention(x["q"], x["k"], x["v"], causal=cfg.op.causal, emulate_bf16=False,
                                    block_q=cfg.tile.block_q, block_kv=cfg.tile.block_kv)
        return {"out": out, "lse": lse}
    impl = dataclasses.replace(attention.IMPLS["triton"], fn=as_shipped)
    report = _run_stages(load([*ONE_HEAD, "precision=bf16", "op.only=[triton]"]), tmp_path, monkeypatch, "attention",
                         impl)
    assert report["paths"]["triton"]["verdict"] == "fail"


def test_bf16_emulation_is_stated_in_the_report(honest_report):
    from posttrainllm.ops import is_interpreted

    report = honest_report("bf16")
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

# two query heads on one K/V head (the GQA group the wrong-query-heads bug needs), four 16-row blocks, and
# bench-train's problem folded into the point's own (train: 1 sequence of 64)
GQA = [*ATTENTION, "architecture=gqa", "architecture.n_heads=2", "architecture.n_kv_heads=1", "tile=b16",
       "shape.seq_len=64", "train.batch_size=1"]

PLANTED_BACKWARD_BUGS = {
    "missing D = rowsum(dO∘O) in dK/dV": ("dsT = pT * (dpT - Di[None, :])", "dsT = pT * dpT", "grad_k"),
    "missing D = rowsum(dO∘O) in dQ": ("ds = p * (dp - Di[:, None])", "ds = p * dp", "grad_q"),
    "dK/dV accumulated for the wrong query heads": ("g += wrap.to(tl.int32)", "g += 0 * wrap.to(tl.int32)",
                                                    "grad_k"),  # the group's first head, KV_GROUP times
    "diagonal causal block skipped in dK/dV": ("lo = start_kv * BLOCK_KV", "lo = (start_kv + 1) * BLOCK_KV", "grad_k"),
    "dK/dV diagonal mask dropped": ("pT = tl.where(seen, pT, 0.0)", "pT = pT", "grad_v"),
    "dQ diagonal mask dropped": ("p = tl.where(_visible(offs_q, offs_kv, S, CAUSAL), p, 0.0)", "p = p", "grad_q"),
    "dK/dV unmasked phase one query block short": (
        "diag_end, full_end, S, qk_scale, HEAD_DIM, KV_GROUP, BLOCK_Q, PAD_D, False",
        "diag_end, full_end - BLOCK_Q, S, qk_scale, HEAD_DIM, KV_GROUP, BLOCK_Q, PAD_D, False", "grad_k"),
}


def test_gradients_are_checked_for_every_path(tmp_path, monkeypatch, shared_reference):
    report = _run_stages(shared_reference(GQA, tmp_path), tmp_path, monkeypatch, "attention", shared=True)
    assert report["verdict"] == "pass"
    for path in ("sdpa", "triton"):
        assert {"grad_q", "grad_k", "grad_v"} <= set(report["paths"][path]["worst"])


@pytest.mark.usefixtures("without_invariance_reruns")
@pytest.mark.parametrize("bug", PLANTED_BACKWARD_BUGS)
def test_planted_backward_bug_is_caught(bug, tmp_path, monkeypatch, shared_reference):
    original, planted, gradient = PLANTED_BACKWARD_BUGS[bug]
    mutant = _mutant(tmp_path, "attention", original, planted)
    report = _run_stages(shared_reference(GQA, tmp_path), tmp_path, monkeypatch, "attention", _flash_impl(mutant),
                         shared=True)
    triton = report["paths"]["triton"]
    assert triton["verdict"] == "fail"
    assert any(f"/{gradient}:" in failure for failure in triton["failed_cases"])
    assert not any("/out:" in failure for failure in triton["failed_cases"])  # the forward is untouched


def test_matmul_gradients_are_checked(tmp_path, monkeypatch):
    cfg = load(["op=matmul", "device=cpu", "parity.seeds=[0]", "shape.ops.matmul.edge=[[41,77,33]]"])
    report = _run_stages(cfg, tmp_path, monkeypatch, "matmul")
    assert report["verdict"] == "pass"
    assert {"out", "grad_a", "grad_b"} <= set(report["paths"]["triton"]["worst"])


def test_exactly_zero_oracle_gradient_uses_the_forward_scale():
    oracle = {"out": torch.full((2,), 3.0, dtype=torch.float64), "grad_q": torch.zeros(2, dtype=torch.float64)}
    got = {"grad_q": torch.tensor([2e-7, 0.0])}
    contract = Contract(error_multiple=8.0, floor_rel=1e-6)
    result = parity.check_path([got], [oracle], [{"grad_q": torch.zeros(2)}], ["S1"], lambda name: contract,
                               ["grad_q"])
    assert result["verdict"] == "pass"
    assert result["worst"]["grad_q"]["allowed_abs_err"] == pytest.approx(3e-6)


def test_a_geometry_that_raises_is_the_paths_failure_not_the_points(tmp_path, monkeypatch):
    """tile=auto runs the autotuner while the kernel stage reads the geometry: if that raises, the error is recorded
    on the path and the kernel stage still runs every path (the point is not lost)."""
    import json

    from posttrainllm.ops.registry import get_op

    op = get_op("matmul")

    def broken(impl, case, cfg):
        raise RuntimeError("autotune: no config fits")

    monkeypatch.setattr(op, "geometry", broken)
    cfg = load(["device=cpu", "op=matmul", "parity.seeds=[0]"])
    reference_stage.run_reference(cfg, tmp_path)
    report = kernel_stage.run_kernel(cfg, tmp_path)
    assert report["paths"]["triton"]["geometry"] == {"error": "RuntimeError: autotune: no config fits"}
    assert "error" not in report["paths"]["triton"]  # its cases still ran
    assert json.loads((tmp_path / "kernel.json").read_text())["paths"]["triton"]["geometry"]["error"]
