"""op=softmax through the generic stages, planted bugs in the Triton source, costs, config and bench-train's refusal.

Planted bugs mutate one line of posttrainllm/ops/softmax/kernels.py (imported from a copy, as tests/test_parity.py does);
the test first checks that line exists exactly once.
"""

import dataclasses
import json

import pytest
from conftest import kernel_and_parity, kernel_mutant
import torch

from posttrainllm.config import ConfigError
from posttrainllm.lab.stages import (bench_train as bench_train_stage, common as stage_common, kernel as kernel_stage,
                                     parity as parity_stage)
from posttrainllm.lab.configure import load
from posttrainllm.ops.registry import get_op
from posttrainllm.ops.softmax import definition as softmax
from posttrainllm.ops.softmax import reference

# one seed, 16 rows of C=16: the point, a single row, 37x37 (C off every block: the last one masked), and the
# logits of ~1e4, of ~1e-4 and the constant rows
QUICK = ["op=softmax", "device=cpu", "parity.seeds=[0]", "shape.seq_len=16", "shape.edge_seq_lens=[37]",
         "tile=b16"]
CASES = {"16x16-seed0", "1x16-seed0", "37x37-seed0", "16x16-large", "16x16-tiny", "16x16-constant"}
pytestmark = pytest.mark.usefixtures("without_compile_child")


def test_every_path_passes_on_every_case(tmp_path, shared_reference):
    report = kernel_and_parity(shared_reference([*QUICK, "precision=fp32"], tmp_path), tmp_path)
    assert report["verdict"] == "pass", report["first_failure"]
    assert set(report["paths"]) == {"torch", "triton"} and set(report["cases"]) == CASES
    assert set(report["paths"]["triton"]["worst"]) == {"out", "grad_x"}
    assert report["paths"]["triton"]["launched"] == {"_softmax_backward_kernel": 6, "_softmax_forward_kernel": 12}


PLANTED = {
    # the running sum not rescaled when the max grows: right only where a row's first block holds its max
    "sum not rescaled": ("l = l * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)",
                         "l = l + tl.sum(tl.exp(x - m_new), axis=0)"),
    # the max not subtracted: exp(x) overflows on the ~1e4 logits (inf / inf = NaN)
    "max not subtracted": ("(tl.exp(x - m) / l)", "(tl.exp(x) / (l * tl.exp(m)))"),
    # the masked lanes loaded as 0, not −inf: exp(0 − m) adds to the sum where C is off the block
    "padding counted": ("        x = tl.load(x_row + offs, mask=offs < n_cols, other=float(\"-inf\")).to(tl.float32)",
                        "        x = tl.load(x_row + offs, mask=offs < n_cols, other=0.0).to(tl.float32)"),
    # the backward without the row's dot: dx = y · dy
    "dx without its dot": ("(y * (dy - dot)).to(dx_ptr.dtype.element_ty)", "(y * dy).to(dx_ptr.dtype.element_ty)"),
}
# Per bug: the case and output that must fail
PLANTED_CAUGHT = {
    "sum not rescaled": ("37x37-seed0", "out"),
    "max not subtracted": ("16x16-large", "out"),
    "padding counted": ("37x37-seed0", "out"),
    "dx without its dot": ("16x16-seed0", "grad_x"),
}


@pytest.mark.usefixtures("without_invariance_reruns")
@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bug_is_caught(bug, tmp_path, monkeypatch, shared_reference):
    mutant = kernel_mutant(tmp_path, "softmax", *PLANTED[bug])

    def fn(x, cfg):
        return {"out": mutant.softmax(x["x"], block_c=cfg.tile.block_n, num_warps=cfg.workgroup.num_warps)}

    monkeypatch.setitem(softmax.IMPLS, "triton", dataclasses.replace(softmax.IMPLS["triton"], fn=fn))
    cfg = shared_reference([*QUICK, "precision=fp32"], tmp_path)
    kernel_stage.run_kernel(cfg, tmp_path)
    with pytest.raises(stage_common.ContractBroken, match="triton broke the fp32 contract"):
        parity_stage.run_parity(cfg, tmp_path)
    report = json.loads((tmp_path / "parity.json").read_text())
    triton = report["paths"]["triton"]
    assert triton["verdict"] == "fail" and report["paths"]["torch"]["verdict"] == "pass"
    case, caught_by = PLANTED_CAUGHT[bug]
    assert any(f.startswith(f"{case}/{caught_by}:") for f in triton["failed_cases"]), triton["failed_cases"]


def test_the_closed_form_backward_is_the_gradient_baseline_and_the_readable_math_is_exact():
    """On a nearly one-hot row the closed form dx = y·(dy − Σ y·dy) rounds the top entry's dx to 0 in fp32 where
    autograd through the readable math keeps it: the contract's baseline is the worse of the two (a fused softmax's
    backward is the closed form), while the forward is the readable math alone."""
    x = torch.tensor([[0.0, -38.0, -1e4]])  # y ≈ (1, 3e-17, 0)
    dy = torch.tensor([[1.0, 0.5, 0.0]])
    exact = torch.func.vjp(lambda t: reference.softmax(t), x.double())[1](dy.double())[0]
    readable = torch.func.vjp(lambda t: reference.softmax(t), x)[1](dy)[0]
    leaf = x.clone().requires_grad_()
    softmax._closed_form({"x": leaf}, load(QUICK))["out"].backward(dy)
    assert exact[0, 0] != 0 and readable[0, 0] != 0 and leaf.grad[0, 0] == 0
    assert [name for name, _ in softmax.OP.gradient_baselines] == ["y*(dy - sum(y*dy))"]
    torch.testing.assert_close(reference.softmax(x.double()), torch.softmax(x.double(), dim=-1), rtol=0, atol=1e-30)


def test_costs_cases_and_config_rules():
    cfg = load(QUICK)
    op = get_op("softmax")
    case = next(c for c in op.cases(cfg) if c.main)
    assert case.dims == {"rows": 16, "cols": 16}  # shape.batch · shape.seq_len rows of shape.seq_len keys
    costs = op.costs(case, cfg)
    assert costs.flops == 5 * 16 * 16 and costs.train_flops == 5 * 16 * 16 * 1.8
    assert costs.bytes == 2 * 16 * 16 * 4 and op.costs(case, load([*QUICK, "precision=bf16"])).bytes == 2 * 16 * 16 * 2
    assert op.curve_case(load([*QUICK, "shape.batch=2"]), 64).dims == {"rows": 128, "cols": 64}
    assert op.x_name == "seq_len"
    constant = op.make_inputs(next(c for c in op.cases(cfg) if c.inputs == "constant"), torch.float32, "cpu")["x"]
    assert (constant == constant[:, :1]).all() and constant[:, 0].unique().numel() == 16
    with pytest.raises(ConfigError, match="tile=auto: op=softmax has no autotuner; choose a fixed tile"):
        load([*QUICK, "tile=auto"])
    with pytest.raises(ValueError, match="unknown softmax input kind 'huge': valid are normal, large, tiny"):
        op.make_inputs(dataclasses.replace(case, inputs="huge"), torch.float32, "cpu")


def test_bench_train_trains_nothing_and_says_why(tmp_path):
    """No layer of the lab's transformer is a softmax of its own: the record names the reason for every path."""
    cfg = load(["op=softmax", "device=cpu"])
    result = bench_train_stage.run_bench_train(cfg, tmp_path)
    assert result["not_trained"] == softmax.NO_MODEL
    assert set(result["skipped"]) == {"reference", "torch", "triton"}
    assert json.loads((tmp_path / "bench_train.json").read_text())["not_trained"] == softmax.NO_MODEL
