"""op=layernorm through the generic stages, planted bugs in the Triton source, costs, config and bench-train's model.

Planted bugs mutate one line of posttrainllm/ops/layernorm/kernels.py (imported from a copy, as tests/test_parity.py
does); the test first checks that line exists exactly once.
"""

import dataclasses
import json

import pytest
from conftest import kernel_and_parity, kernel_mutant
import torch

from posttrainllm.config import ConfigError
from posttrainllm.lab.stages import common as stage_common, kernel as kernel_stage, parity as parity_stage
from posttrainllm.lab.configure import load
from posttrainllm.ops.registry import get_op
from posttrainllm.ops.layernorm import definition, reference

# one seed, 16 rows of C=64: the point, a single row, 37x37 (C off every block of 16: the last one masked), and
# the rows of ~1e4, at 32 + N(0, 1), of ~1e-4 and constant
QUICK = ["op=layernorm", "device=cpu", "parity.seeds=[0]", "shape.seq_len=16", "shape.edge_seq_lens=[37]",
         "tile=b16", "architecture.d_model=64"]
CASES = {"16x64-seed0", "1x64-seed0", "37x37-seed0", "16x64-large", "16x64-offset", "16x64-small", "16x64-constant"}
GRADS = {"grad_x", "grad_weight", "grad_bias"}
pytestmark = pytest.mark.usefixtures("without_compile_child")


def test_every_path_passes_on_every_case_fp32(tmp_path, shared_reference):
    report = kernel_and_parity(shared_reference([*QUICK, "precision=fp32"], tmp_path), tmp_path)
    assert report["verdict"] == "pass", report["first_failure"]
    assert set(report["paths"]) == {"torch", "triton"} and set(report["cases"]) == CASES
    assert set(report["paths"]["triton"]["worst"]) == {"out", *GRADS}
    assert report["paths"]["triton"]["launched"] == {"_layernorm_forward_kernel": 14,
                                                     "_layernorm_backward_dx_kernel": 7,
                                                     "_layernorm_backward_dwdb_kernel": 7}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_triton_path_passes_in_16_bits(precision, tmp_path, shared_reference):
    """The kernel in fp16, and in bf16 as the interpreter allows (y and dx stored in fp32 and rounded by PyTorch:
    ops/layernorm/kernels.py). torch's own F.layer_norm is left out: on the CPU its fp16 and bf16 backward misses the
    contract (grad_weight, grad_bias; the report of the change that added this op)."""
    report = kernel_and_parity(shared_reference([*QUICK, f"precision={precision}", "op.only=[triton]"], tmp_path),
                               tmp_path)
    assert set(report["paths"]) == {"triton"}
    assert report["verdict"] == "pass", report["first_failure"]
    assert set(report["paths"]["triton"]["worst"]) == {"out", *GRADS}


PLANTED = {
    # the variance of x itself, not of x − mean: right only where a row's mean is 0
    "variance without the mean": ("        d = tl.where(mask, x - mean, 0.0)", "        d = tl.where(mask, x, 0.0)"),
    # the masked lanes counted in the variance: (0 − mean)² adds where C is off the block
    "padding in the variance": ("        d = tl.where(mask, x - mean, 0.0)", "        d = x - mean"),
    # eps outside the root: 1/(sqrt(var) + eps), where var ~1e-8 is no longer >> eps
    "eps outside the root": ("rstd = 1.0 / tl.sqrt(sq / n_cols + eps)", "rstd = 1.0 / (tl.sqrt(sq / n_cols) + eps)"),
    # dx without the mean of g: the gradient of the mean's subtraction dropped
    "dx without mean(g)": ("dx = rstd * (dy * w - mean_g - x_hat * mean_gx)", "dx = rstd * (dy * w - x_hat * mean_gx)"),
    # the bias's gradient dropped (zeros)
    "no bias gradient": ("    tl.store(db_ptr + offs, db, mask=col_mask)",
                         "    tl.store(db_ptr + offs, db * 0.0, mask=col_mask)"),
    # the weight's gradient dropped (zeros)
    "no weight gradient": ("    tl.store(dw_ptr + offs, dw, mask=col_mask)",
                           "    tl.store(dw_ptr + offs, dw * 0.0, mask=col_mask)"),
}
# Per bug: the case and output that must fail
PLANTED_CAUGHT = {
    "variance without the mean": ("16x64-offset", "out"),
    "padding in the variance": ("37x37-seed0", "out"),
    "eps outside the root": ("16x64-small", "out"),
    "dx without mean(g)": ("16x64-seed0", "grad_x"),
    "no bias gradient": ("16x64-seed0", "grad_bias"),
    "no weight gradient": ("16x64-seed0", "grad_weight"),
}


@pytest.mark.usefixtures("without_invariance_reruns")
@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bug_is_caught(bug, tmp_path, monkeypatch, shared_reference):
    (tmp_path / "mutant_layernorm").mkdir()  # the copy's folder: kernel_mutant writes mutant_<module>.py
    mutant = kernel_mutant(tmp_path, "layernorm/kernels", *PLANTED[bug])

    def fn(x, cfg):
        return {"out": mutant.layernorm(x["x"], x["weight"], x["bias"], cfg.op.eps, block_c=cfg.tile.block_n,
                                        num_warps=cfg.workgroup.num_warps)}

    monkeypatch.setitem(definition.IMPLS, "triton", dataclasses.replace(definition.IMPLS["triton"], fn=fn))
    cfg = shared_reference([*QUICK, "precision=fp32"], tmp_path)
    kernel_stage.run_kernel(cfg, tmp_path)
    with pytest.raises(stage_common.ContractBroken, match="triton broke the fp32 contract"):
        parity_stage.run_parity(cfg, tmp_path)
    report = json.loads((tmp_path / "parity.json").read_text())
    triton = report["paths"]["triton"]
    assert triton["verdict"] == "fail" and report["paths"]["torch"]["verdict"] == "pass"
    case, caught_by = PLANTED_CAUGHT[bug]
    assert any(f.startswith(f"{case}/{caught_by}:") for f in triton["failed_cases"]), triton["failed_cases"]


def test_the_readable_math_is_torch_s_in_float64_and_centres_before_squaring():
    x = torch.randn(5, 37, dtype=torch.float64) + 1e3
    w, b = torch.randn(37, dtype=torch.float64), torch.randn(37, dtype=torch.float64)
    torch.testing.assert_close(reference.layernorm(x, w, b, 1e-5),
                               torch.nn.functional.layer_norm(x, (37,), w, b, 1e-5), rtol=1e-12, atol=1e-12)
    constant = torch.full((2, 8), 3.0)
    assert torch.equal(reference.layernorm(constant, torch.ones(8), torch.arange(8.0), 1e-5),
                       torch.arange(8.0).expand(2, 8))  # var = 0: y = bias


def test_costs_cases_and_config_rules():
    cfg = load(QUICK)
    op = get_op("layernorm")
    case = next(c for c in op.cases(cfg) if c.main)
    assert case.dims == {"rows": 16, "hidden": 64}  # shape.batch · shape.seq_len tokens of d_model
    costs = op.costs(case, cfg)
    assert costs.flops == 8 * 16 * 64 and costs.train_flops == 8 * 16 * 64 * 3.125
    assert costs.bytes == (2 * 16 * 64 + 2 * 64) * 4 + 8 * 16
    assert op.curve_case(load([*QUICK, "shape.batch=2"]), 64).dims == {"rows": 64, "hidden": 64}
    offset = op.make_inputs(next(c for c in op.cases(cfg) if c.inputs == "offset"), torch.float32, "cpu")["x"]
    assert (offset.mean(dim=-1) - definition.OFFSET).abs().max() < 1
    constant = op.make_inputs(next(c for c in op.cases(cfg) if c.inputs == "constant"), torch.float32, "cpu")["x"]
    assert (constant == constant[:, :1]).all() and constant[:, 0].unique().numel() == 16
    with pytest.raises(ConfigError, match=r"tile=auto: op=layernorm has no autotuner; choose a fixed tile "
                                          r"\(b16, b32, b64, b128"):
        load([*QUICK, "tile=auto"])
    with pytest.raises(ValueError, match="unknown layernorm input kind 'huge': valid are normal, large, offset"):
        op.make_inputs(dataclasses.replace(case, inputs="huge"), torch.float32, "cpu")


def test_a_bad_block_is_refused_with_the_valid_choices():
    from posttrainllm.ops.layernorm.kernels import layernorm_launch

    with pytest.raises(ValueError, match="block_c=24 must be a power of two >= 16"):
        layernorm_launch(4, 64, block_c=24, num_warps=4)
    with pytest.raises(ConfigError, match="b16, b32, b64, b128"):
        load([*QUICK, "tile=auto"])


def test_the_model_hook_makes_every_norm_a_layernorm():
    """The hook: the rows of x (..., C) through the path, the model's weight, a zero bias, eps op.eps only."""
    cfg = load(QUICK)
    op = get_op("layernorm")
    assert op.model_overrides(load([*QUICK, "op.eps=1e-6"])) == {"norm_eps": 1e-6}
    norm = op.model_hook.fill(op.impls["reference"], cfg)
    x, w = torch.randn(2, 3, 64), 1 + torch.randn(64) * 0.1
    torch.testing.assert_close(norm(x, w, cfg.op.eps), torch.nn.functional.layer_norm(x, (64,), w, None, 1e-5))
    with pytest.raises(ValueError, match="norm eps=0.001 is not op.eps=1e-05"):
        norm(x, w, 1e-3)
    assert "LayerNorm" in op.model_problem(cfg) and "zero bias" in op.model_problem(cfg)


def test_the_model_trains_a_layernorm_transformer_with_each_path():
    """Reference, torch and Triton LayerNorm in every norm of the same model: the same losses (drift ~0), every norm
    through the hook in the model's norm range; the loss differs from the RMSNorm model's (another model)."""
    from posttrainllm.model.train import Variant, bench_train
    from posttrainllm.model.transformer import ModelConfig

    cfg = load(["op=layernorm", "device=cpu"])
    op = get_op("layernorm")
    config = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, mlp_hidden=64, max_seq_len=8,
                         **op.model_overrides(cfg))
    hooks = {name: op.model_hook.fill(op.impls[name], cfg) for name in op.impls}
    calls = []
    triton_norm = hooks["triton"]
    hooks["triton"] = lambda x, weight, eps: calls.append(x.shape) or triton_norm(x, weight, eps)
    variants = [Variant("reference", {"norm": hooks["reference"]}), Variant("torch", {"norm": hooks["torch"]}),
                Variant("triton", {"norm": hooks["triton"]}, interpreted=True, steps=1), Variant("rmsnorm model")]
    result = bench_train(config, variants=variants, steps=2, warmup_steps=0, batch_size=2, seq_len=8, lr=3e-3,
                         seed=0, precision="fp32", device="cpu")
    assert result["drift"]["torch"] < 1e-5 and result["drift"]["triton"] < 1e-5
    assert result["max_step_drift"]["rmsnorm model"] > 1e-4  # the model's own norms: another model, other losses
    assert calls == [(2, 8, 32)] * 3  # the Triton variant's one step: (B, T, C) through the hook, 3 norms
    assert result["impls"]["reference"]["profile"]["norm"]["calls"] == 3  # the model's norm slot's range
