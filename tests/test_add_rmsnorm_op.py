"""op=add_rmsnorm through the generic stages: both outputs (y and h) and the upstream gradient of each, planted bugs in
the Triton source and in a path's outputs, costs, config and the model hook bench-train trains.

Planted bugs mutate one line of posttrainllm/ops/add_rmsnorm/kernels.py (imported from a copy, as
tests/test_parity.py does); the test first checks that line exists exactly once.
"""

import dataclasses
import json

import pytest
from conftest import kernel_and_parity, kernel_mutant
import torch

from posttrainllm.config import ConfigError
from posttrainllm.lab import oracle
from posttrainllm.lab.stages import common as stage_common, kernel as kernel_stage, parity as parity_stage
from posttrainllm.lab.configure import load
from posttrainllm.ops.registry import get_op
from posttrainllm.ops.add_rmsnorm import definition, reference

# one seed, 16 rows of C=64: the point, a single row, 37x37 (C off every block of 16), and the rows of ~1e4, of
# ~1e-4 and where r = −x
QUICK = ["op=add_rmsnorm", "device=cpu", "parity.seeds=[0]", "shape.seq_len=16", "shape.edge_seq_lens=[37]",
         "tile=b16", "architecture.d_model=64"]
CASES = {"16x64-seed0", "1x64-seed0", "37x37-seed0", "16x64-large", "16x64-small", "16x64-cancel"}
CHECKED = {"out", "h", "grad_x", "grad_residual", "grad_weight"}
pytestmark = pytest.mark.usefixtures("without_compile_child")


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_every_path_passes_on_every_case(precision, tmp_path, shared_reference):
    report = kernel_and_parity(shared_reference([*QUICK, f"precision={precision}"], tmp_path), tmp_path)
    assert report["verdict"] == "pass", report["first_failure"]
    assert set(report["paths"]) == {"torch", "triton"} and set(report["cases"]) == CASES
    for path in ("torch", "triton"):
        assert set(report["paths"][path]["worst"]) == CHECKED
    assert report["paths"]["triton"]["launched"] == {"_add_rmsnorm_forward_kernel": 12,
                                                     "_add_rmsnorm_backward_dx_kernel": 6,
                                                     "_add_rmsnorm_backward_dw_kernel": 6}


def test_the_triton_path_passes_in_bf16_as_the_interpreter_allows(tmp_path, shared_reference):
    """y, h, dx and dr stored in fp32 and rounded by PyTorch under the interpreter (ops/add_rmsnorm/kernels.py)."""
    report = kernel_and_parity(shared_reference([*QUICK, "precision=bf16", "op.only=[triton]"], tmp_path), tmp_path)
    assert report["verdict"] == "pass", report["first_failure"]
    assert set(report["paths"]["triton"]["worst"]) == CHECKED


def test_each_differentiable_output_gets_its_own_seeded_upstream_gradient():
    """out's dO is the one every op has always had (bit for bit); h's another draw of the same seed."""
    cfg = load(QUICK)
    op = get_op("add_rmsnorm")
    case = next(c for c in op.cases(cfg) if c.main)
    forward = op.reference.fn(op.make_inputs(case, torch.float32, "cpu"), cfg)
    grads = oracle.upstream_gradients(op, case, forward)
    assert set(grads) == {"out", "h"}
    assert torch.equal(grads["out"], oracle.upstream_gradient(case, forward["out"]))
    assert not torch.equal(grads["out"], grads["h"]) and grads["h"].shape == forward["h"].shape
    assert torch.equal(grads["h"], oracle.upstream_gradients(op, case, forward)["h"])  # seeded
    one = get_op("rmsnorm")  # one differentiable output: the tensor itself, as before
    single = oracle.upstream_gradients(one, case, {"out": forward["out"]})
    assert isinstance(single, torch.Tensor) and torch.equal(single, grads["out"])


KERNEL_BUGS = {
    # h stored before the add: the residual stream loses the sublayer's output
    "h before the add": ("        tl.store(h_ptr + row * stride_h + offs, h.to(h_ptr.dtype.element_ty), mask=mask)",
                         "        tl.store(h_ptr + row * stride_h + offs, x.to(h_ptr.dtype.element_ty), mask=mask)"),
    # the backward without h's own upstream gradient: dx = dr = the norm's term only
    "gradient of h ignored": ("total = rstd * (dy * w - (x + r) * rstd * mean_gh) + dh",
                              "total = rstd * (dy * w - (x + r) * rstd * mean_gh)"),
    # eps outside the root: 1/(sqrt(mean(h²)) + eps), where mean(h²) ~1e-8 is no longer >> eps
    "eps outside the root": ("rstd = 1.0 / tl.sqrt(sq / n_cols + eps)", "rstd = 1.0 / (tl.sqrt(sq / n_cols) + eps)"),
    # y normalised from x, not from h = x + r
    "y from x": ("((x + r) * rstd * w)", "(x * rstd * w)"),
    # the weight's gradient dropped (zeros)
    "no weight gradient": ("    tl.store(dw_ptr + offs, dw, mask=col_mask)",
                           "    tl.store(dw_ptr + offs, dw * 0.0, mask=col_mask)"),
}
# Per bug: the case and output that must fail
KERNEL_CAUGHT = {
    "h before the add": ("16x64-seed0", "h"),
    "gradient of h ignored": ("16x64-seed0", "grad_x"),
    "eps outside the root": ("16x64-small", "out"),
    "y from x": ("16x64-seed0", "out"),
    "no weight gradient": ("16x64-seed0", "grad_weight"),
}


def _parity_fails(fn, tmp_path, monkeypatch, shared_reference) -> dict:
    monkeypatch.setitem(definition.IMPLS, "triton", dataclasses.replace(definition.IMPLS["triton"], fn=fn))
    cfg = shared_reference([*QUICK, "precision=fp32"], tmp_path)
    kernel_stage.run_kernel(cfg, tmp_path)
    with pytest.raises(stage_common.ContractBroken, match="triton broke the fp32 contract"):
        parity_stage.run_parity(cfg, tmp_path)
    report = json.loads((tmp_path / "parity.json").read_text())
    assert report["paths"]["triton"]["verdict"] == "fail" and report["paths"]["torch"]["verdict"] == "pass"
    return report["paths"]["triton"]


@pytest.mark.usefixtures("without_invariance_reruns")
@pytest.mark.parametrize("bug", KERNEL_BUGS)
def test_planted_kernel_bug_is_caught(bug, tmp_path, monkeypatch, shared_reference):
    (tmp_path / "mutant_add_rmsnorm").mkdir()  # the copy's folder: kernel_mutant writes mutant_<module>.py
    mutant = kernel_mutant(tmp_path, "add_rmsnorm/kernels", *KERNEL_BUGS[bug])

    def fn(x, cfg):
        y, h = mutant.add_rmsnorm(x["x"], x["residual"], x["weight"], cfg.op.eps, block_c=cfg.tile.block_n,
                                  num_warps=cfg.workgroup.num_warps)
        return {"out": y, "h": h}

    triton = _parity_fails(fn, tmp_path, monkeypatch, shared_reference)
    case, caught_by = KERNEL_CAUGHT[bug]
    assert any(f.startswith(f"{case}/{caught_by}:") for f in triton["failed_cases"]), triton["failed_cases"]


def _kernel(x, cfg):
    from posttrainllm.ops.add_rmsnorm.kernels import add_rmsnorm

    return add_rmsnorm(x["x"], x["residual"], x["weight"], cfg.op.eps, block_c=cfg.tile.block_n)


PATH_BUGS = {
    # h not returned at all: parity requires every declared output
    "h not returned": (lambda x, cfg: {"out": _kernel(x, cfg)[0]}, "h"),
    # h returned cut from the graph: its upstream gradient never reaches x and residual
    "h detached": (lambda x, cfg: {"out": _kernel(x, cfg)[0], "h": _kernel(x, cfg)[1].detach()}, "grad_residual"),
}


@pytest.mark.usefixtures("without_invariance_reruns")
@pytest.mark.parametrize("bug", PATH_BUGS)
def test_a_path_that_drops_h_or_its_gradient_fails(bug, tmp_path, monkeypatch, shared_reference):
    fn, caught_by = PATH_BUGS[bug]
    triton = _parity_fails(fn, tmp_path, monkeypatch, shared_reference)
    assert any(f.startswith(f"16x64-seed0/{caught_by}:") for f in triton["failed_cases"]), triton["failed_cases"]


def test_the_readable_math_is_the_add_then_torch_s_rms_norm_in_float64():
    x, r = torch.randn(5, 37, dtype=torch.float64), torch.randn(5, 37, dtype=torch.float64)
    w = torch.randn(37, dtype=torch.float64)
    y, h = reference.add_rmsnorm(x, r, w, 1e-5)
    assert torch.equal(h, x + r)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x + r, (37,), w, 1e-5), rtol=1e-12, atol=1e-12)


def test_costs_cases_and_config_rules():
    cfg = load(QUICK)
    op = get_op("add_rmsnorm")
    case = next(c for c in op.cases(cfg) if c.main)
    assert case.dims == {"rows": 16, "hidden": 64}
    costs = op.costs(case, cfg)
    assert costs.flops == 6 * 16 * 64 and costs.train_flops == 6 * 16 * 64 * 4
    assert costs.bytes == (4 * 16 * 64 + 64) * 4 + 4 * 16
    assert op.curve_case(load([*QUICK, "shape.batch=2"]), 64).dims == {"rows": 64, "hidden": 64}
    cancel = op.make_inputs(next(c for c in op.cases(cfg) if c.inputs == "cancel"), torch.float32, "cpu")
    h = cancel["x"] + cancel["residual"]
    assert (h[0] == 0).all() and (h[-1] == 0).all() and (h[1:-1] != 0).any()
    with pytest.raises(ConfigError, match=r"tile=auto: op=add_rmsnorm has no autotuner; choose a fixed tile "
                                          r"\(b16, b32, b64, b128"):
        load([*QUICK, "tile=auto"])
    with pytest.raises(ValueError, match="unknown add_rmsnorm input kind 'huge': valid are normal, large, small"):
        op.make_inputs(dataclasses.replace(case, inputs="huge"), torch.float32, "cpu")
    from posttrainllm.ops.add_rmsnorm.kernels import add_rmsnorm_launch

    with pytest.raises(ValueError, match="block_c=8 must be a power of two >= 16"):
        add_rmsnorm_launch(4, 64, block_c=8, num_warps=4)


def test_the_model_hook_fuses_each_block_s_add_and_mlp_norm():
    """The hook: the rows of x and a through the path, (y, h) back in x's shape, eps op.eps only."""
    cfg = load(QUICK)
    op = get_op("add_rmsnorm")
    assert op.model_overrides(load([*QUICK, "op.eps=1e-6"])) == {"norm_eps": 1e-6}
    add_norm = op.model_hook.fill(op.impls["reference"], cfg)
    x, a, w = torch.randn(2, 3, 64), torch.randn(2, 3, 64), 1 + torch.randn(64) * 0.1
    y, h = add_norm(x, a, w, cfg.op.eps)
    assert torch.equal(h, x + a)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x + a, (64,), w, 1e-5))
    with pytest.raises(ValueError, match="norm eps=0.001 is not op.eps=1e-05"):
        add_norm(x, a, w, 1e-3)


def test_the_model_trains_with_each_path_as_the_unfused_model_does():
    """Reference, torch and Triton add + norm in every block: the same losses as the model's own add then RMSNorm
    (the fused op is the same math), the Triton path called once per block."""
    from posttrainllm.model.train import Variant, bench_train
    from posttrainllm.model.transformer import ModelConfig

    cfg = load(["op=add_rmsnorm", "device=cpu"])
    op = get_op("add_rmsnorm")
    config = ModelConfig(d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=16, mlp_hidden=64, max_seq_len=8,
                         **op.model_overrides(cfg))
    hooks = {name: op.model_hook.fill(op.impls[name], cfg) for name in op.impls}
    calls = []
    triton_add_norm = hooks["triton"]
    hooks["triton"] = lambda x, a, w, eps: calls.append(x.shape) or triton_add_norm(x, a, w, eps)
    variants = [Variant("unfused model"), Variant("reference", {"add_norm": hooks["reference"]}),
                Variant("torch", {"add_norm": hooks["torch"]}),
                Variant("triton", {"add_norm": hooks["triton"]}, interpreted=True, steps=1)]
    result = bench_train(config, variants=variants, steps=2, warmup_steps=0, batch_size=2, seq_len=8, lr=3e-3,
                         seed=0, precision="fp32", device="cpu")
    for name in ("reference", "torch", "triton"):
        assert result["max_step_drift"][name] < 1e-5, (name, result["max_step_drift"])
    assert calls == [(2, 8, 32)] * 2  # the Triton variant's one step: one call per block
    profile = result["impls"]["reference"]["profile"]
    assert profile["add_norm"]["calls"] == 2 and profile["norm"]["calls"] == 3  # the fused call in its own slot's range
    unfused = result["impls"]["unfused model"]["profile"]
    assert unfused["add_norm"]["calls"] == 0 and unfused["norm"]["calls"] == 5  # the add, then the norm slot
