"""op=rmsnorm through the generic stages, planted bugs in the Triton source, costs, curve, config and the model hook.

Planted bugs mutate one line of posttrainllm/ops/rmsnorm/kernels.py (imported from a copy, as tests/test_parity.py
does); the test first checks that line exists exactly once.
"""

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import kernel_and_parity, kernel_mutant
import torch

from posttrainllm.config import ConfigError
from posttrainllm.lab.stages import common as stage_common, kernel as kernel_stage, parity as parity_stage
from posttrainllm.lab.configure import load
from posttrainllm.model.train import Variant, bench_train
from posttrainllm.model.transformer import ModelConfig
from posttrainllm.ops.registry import get_op
from posttrainllm.ops.rmsnorm import definition as rmsnorm

# one seed, 16 rows of C=128: the point, a single row, 37x37 (C and rows off every power of two), and the rows
# of ~1e4, of ~1e-4 and of zeros
QUICK = ["op=rmsnorm", "device=cpu", "parity.seeds=[0]", "shape.seq_len=16", "shape.edge_seq_lens=[37]"]
CASES = {"16x128-seed0", "1x128-seed0", "37x37-seed0", "16x128-large", "16x128-small", "16x128-zero_rows"}
# no test here reads kernel.json's compile section (tests/test_compile.py does): the kernel stage runs without its child
pytestmark = pytest.mark.usefixtures("without_compile_child")


def test_every_path_passes_on_every_case(tmp_path, shared_reference):
    report = kernel_and_parity(shared_reference([*QUICK, "precision=fp32"], tmp_path), tmp_path)
    assert report["verdict"] == "pass", report["first_failure"]
    assert set(report["paths"]) == {"torch", "triton"} and set(report["cases"]) == CASES
    assert set(report["paths"]["triton"]["worst"]) == {"out", "grad_x", "grad_weight"}
    assert report["paths"]["triton"]["launched"] == {"_rmsnorm_backward_kernel": 6, "_rmsnorm_forward_kernel": 12}


def test_our_triton_paths_promises_are_judged_and_one_that_breaks_fails(tmp_path, shared_reference, monkeypatch):
    """RMSNorm's Triton path promises determinism and batch invariance (its Impl): both judged where it holds;
    noise far below the contract's tolerance breaks the determinism it promises, and parity fails it."""
    cfg = shared_reference([*QUICK, "precision=fp32", "op.only=[triton]"], tmp_path / "ok")
    held = kernel_and_parity(cfg, tmp_path / "ok")["paths"]["triton"]
    assert held["verdict"] == "pass"
    judged = {"holds": True, "judged": True, "by": ["promised by the path"], "verdict": "pass"}
    assert held["properties"] == {"deterministic": judged, "batch_invariant": judged}
    honest = rmsnorm.IMPLS["triton"]

    def noisy(x, c):
        out = honest.fn(x, c)["out"]
        return {"out": out + 1e-7 * out.detach().abs().max() * torch.randn_like(out)}

    monkeypatch.setitem(rmsnorm.IMPLS, "triton", dataclasses.replace(honest, fn=noisy))
    broken = kernel_and_parity(shared_reference([*QUICK, "precision=fp32", "op.only=[triton]"], tmp_path / "noisy"),
                               tmp_path / "noisy")["paths"]["triton"]
    assert broken["verdict"] == "fail"
    assert broken["failed_cases"][0].startswith("deterministic (promised by the path): out run 2 differs from run 1")


PLANTED = {
    "eps outside the root": ("rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)",
                             "rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols) + eps"),
    "dx without its mean term": ("dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols))",
                                 "dx = rstd * g"),
    "one dW partial dropped": ("dw = dw_partial.sum(dim=0)", "dw = dw_partial[1:].sum(dim=0)"),
    # fp16 only: in fp32 the line is the same kernel, and under bf16 the interpreter's arithmetic on raw bf16 bits
    # (ops/__init__.py) would fail it for another reason
    "x² in x's dtype": (
        "    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)",
        "    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)"),
}
# Per bug: the case and output that must fail, and outputs the bug leaves alone. Measured margins (the named
# case's worst row: error / its allowance; fp32 / bf16 / fp16):
#   eps outside the root    16x128-small out x1.2e7 / x1.5e3 / x1.3e4: mean(x²) ~1e-8 << eps, so rsqrt(mean) + eps
#                           scales the row ~30x up. On normal rows it moves y by ~eps/2 relative, under 16-bit
#                           rounding (fp32 catches it there too); the zero rows give inf (rsqrt(0)) and NaN
#   dx without mean term    16x128-seed0 grad_x x6.4e3 / x3.2 / x24 (37x37: bf16 x14). With a random dy the mean
#                           term is ~1/sqrt(C) of g, so small C shows it best; out and grad_weight untouched
#   one dW partial dropped  16x128-seed0 grad_weight x3.5e4 / x13 / x100 (4 programs under the interpreter: a
#                           quarter of the rows' dy·x̂ missing; the single row's only partial: dW = 0)
#   x² in x's dtype (fp16)  16x128-large out x500: x² ~1e8 overflows fp16, rstd = 0, y = 0
PLANTED_CAUGHT = {
    "eps outside the root": ("16x128-small", "out", ()),
    "dx without its mean term": ("16x128-seed0", "grad_x", ("out", "grad_weight")),
    "one dW partial dropped": ("16x128-seed0", "grad_weight", ("out", "grad_x")),
    "x² in x's dtype": ("16x128-large", "out", ()),
}
BUG_PRECISIONS = [(bug, precision) for bug in PLANTED for precision in ("fp32", "bf16", "fp16")
                  if bug != "x² in x's dtype" or precision == "fp16"]


@pytest.mark.usefixtures("without_invariance_reruns")
@pytest.mark.parametrize("bug, precision", BUG_PRECISIONS)
def test_planted_bug_is_caught(bug, precision, tmp_path, monkeypatch, shared_reference):
    """Under every precision's contract (bf16 through the interpreter's emulation, ops/__init__.py)."""
    mutant = kernel_mutant(tmp_path, "rmsnorm", *PLANTED[bug])

    def fn(x, cfg):
        return {"out": mutant.rmsnorm(x["x"], x["weight"], cfg.op.eps)}

    monkeypatch.setitem(rmsnorm.IMPLS, "triton", dataclasses.replace(rmsnorm.IMPLS["triton"], fn=fn))
    cfg = shared_reference([*QUICK, f"precision={precision}"], tmp_path)
    kernel_stage.run_kernel(cfg, tmp_path)
    with pytest.raises(stage_common.ContractBroken, match=f"triton broke the {precision} contract"):
        parity_stage.run_parity(cfg, tmp_path)
    report = json.loads((tmp_path / "parity.json").read_text())
    triton = report["paths"]["triton"]
    assert triton["verdict"] == "fail" and report["paths"]["torch"]["verdict"] == "pass"
    case, caught_by, untouched = PLANTED_CAUGHT[bug]
    assert any(f.startswith(f"{case}/{caught_by}:") for f in triton["failed_cases"]), triton["failed_cases"]
    assert not any(f"/{name}:" in failure for name in untouched for failure in triton["failed_cases"])


def test_costs_curve_and_config_rules():
    cfg = load(QUICK)
    op = get_op("rmsnorm")
    case = next(c for c in op.cases(cfg) if c.main)
    assert case.dims == {"rows": 16, "hidden": 128}  # shape.batch · shape.seq_len rows of architecture.d_model
    costs = op.costs(case, cfg)
    assert costs.flops == 4 * 16 * 128 and costs.train_flops == 4 * 16 * 128 * 3.25
    assert costs.bytes == (2 * 16 * 128 + 128) * 4 + 4 * 16  # x, y, weight; rstd in fp32
    assert op.costs(case, load([*QUICK, "precision=bf16"])).bytes == (2 * 16 * 128 + 128) * 2 + 4 * 16
    assert op.curve_sizes(load([*QUICK, "shape.batch=2"])) == [128, 256, 512, 1024]  # B·T at shape.curve's T
    assert op.curve_case(cfg, 64).dims == {"rows": 64, "hidden": 128} and op.x_name == "rows"
    # a size met twice runs once: a single-row point, an edge size equal to the point's
    assert [c.name for c in op.cases(load([*QUICK, "shape.seq_len=1"]))][:2] == ["1x128-seed0", "37x37-seed0"]
    same = op.cases(load([*QUICK, "shape.seq_len=37", "architecture.d_model=37", "parity.seeds=[0,1]"]))
    assert [(c.name, c.main) for c in same][:4] == [("37x37-seed0", True), ("1x37-seed0", False),
                                                    ("37x37-seed1", True), ("1x37-seed1", False)]
    with pytest.raises(ConfigError, match="op.eps=0.0: must be > 0"):
        load([*QUICK, "op.eps=0"])
    with pytest.raises(ConfigError, match="architecture.d_model=65537: an rmsnorm row must fit one program"):
        load([*QUICK, "architecture.d_model=65537"])
    with pytest.raises(ConfigError, match="shape.edge_seq_lens=70000"):
        load([*QUICK, "shape.edge_seq_lens=[70000]"])
    load([*QUICK, "architecture.d_model=65536"])  # the largest row one program holds (ops/rows.py MAX_BLOCK_C)


def test_the_eps_trained_is_the_eps_checked():
    """conf/op/rmsnorm.yaml's eps is the model's default norm_eps; bench-train builds its model with op.eps, and the
    hook refuses a model whose eps is another."""
    cfg = load(QUICK)
    assert cfg.op.eps == ModelConfig().norm_eps == 1e-5
    assert rmsnorm.OP.model_overrides(load([*QUICK, "op.eps=1e-6"])) == {"norm_eps": 1e-6}
    hook = rmsnorm.OP.model_hook.fill(rmsnorm.IMPLS["reference"], cfg)
    x, weight = torch.randn(2, 3, 8), torch.rand(8) + 0.5
    from posttrainllm.model.slots import defaults

    torch.testing.assert_close(hook(x, weight, 1e-5), defaults()["norm"](x, weight, 1e-5))  # (B, T, C) in and out
    with pytest.raises(ValueError, match="eps=1e-06 is not op.eps=1e-05"):
        hook(x, weight, 1e-6)


def test_the_model_trains_with_each_path_and_profiles_its_norms():
    """Reference, torch and Triton RMSNorm in the same model: the same losses, every norm in the norm slot's range."""
    cfg = load(["op=rmsnorm", "device=cpu"])
    config = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, mlp_hidden=64, max_seq_len=8,
                         **rmsnorm.OP.model_overrides(cfg))
    hooks = {name: rmsnorm.OP.model_hook.fill(rmsnorm.IMPLS[name], cfg) for name in rmsnorm.IMPLS}
    calls = []
    triton_norm = hooks["triton"]
    hooks["triton"] = lambda x, weight, eps: calls.append(x.shape) or triton_norm(x, weight, eps)
    variants = [Variant("reference", {"norm": hooks["reference"]}), Variant("torch", {"norm": hooks["torch"]}),
                Variant("triton", {"norm": hooks["triton"]}, interpreted=True, steps=1)]
    result = bench_train(config, variants=variants, steps=2, warmup_steps=0, batch_size=2, seq_len=8, lr=3e-3,
                         seed=0, precision="fp32", device="cpu")
    assert result["drift"]["torch"] < 1e-5 and result["drift"]["triton"] < 1e-5
    assert calls == [(2, 8, 32)] * 3  # the Triton variant's one step: (B, T, C) through the hook, 3 norms
    profile = result["impls"]["reference"]["profile"]["norm"]
    assert profile["calls"] == 3 and profile["fraction"] > 0  # 2 per block + the final norm
