"""op=moe through the generic stages, planted bugs in the Triton source, the router's own check, and the MoE model.

Planted bugs mutate one line of posttrainllm/ops/moe/kernels.py (imported from a copy, as tests/test_parity.py
does); the test first checks that line exists exactly once.
"""

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import kernel_and_parity, kernel_mutant, parity_report
import torch

from posttrainllm.config import ConfigError

from posttrainllm.lab.configure import load
from posttrainllm.lab.stages import (common as stage_common, kernel as kernel_stage, microbench as microbench_stage,
                                     parity as parity_stage)
from posttrainllm.model.train import Variant, bench_train
from posttrainllm.model.transformer import ModelConfig, MoEMLP, Transformer, moe_aux_loss
from posttrainllm.ops.registry import get_op
from posttrainllm.ops.moe import definition as moe
from posttrainllm.ops.moe import reference

# one seed, no edge sizes: the point's 24 tokens, every token on expert 0, an empty expert, top-k = E
QUICK = ["op=moe", "device=cpu", "parity.seeds=[0]", "shape.ops.moe.tokens=24", "shape.ops.moe.edge=[]"]
# no test here reads kernel.json's compile section (tests/test_compile.py does): the kernel stage runs without its child
pytestmark = pytest.mark.usefixtures("without_compile_child")


def _mutant(tmp_path: Path, original: str, planted: str):
    return kernel_mutant(tmp_path, "moe", original, planted)


_parity = parity_report


def test_every_path_passes_and_the_router_is_checked_apart(tmp_path, shared_reference):
    report = kernel_and_parity(shared_reference([*QUICK, "precision=fp32"], tmp_path), tmp_path)
    assert report["verdict"] == "pass", report["first_failure"]
    assert set(report["paths"]) == {"sparse", "grouped_mm", "triton"}
    worst = report["paths"]["triton"]["worst"]
    # a gradient for every floating-point input; none for the integer expert ids
    assert {"out", "grad_x", "grad_w_gate", "grad_w_up", "grad_w_down", "grad_route_weight"} == set(worst)
    cases = report["inputs"]["cases"]
    assert report["inputs"]["verdict"] == "pass" and set(cases) == set(report["cases"])
    assert cases["T24-one_expert"]["tokens_per_expert"] == [24, 24, 0, 0]  # every token: expert 0, then 1
    assert cases["T24-empty_expert"]["tokens_per_expert"][-1] == 0
    assert cases["T24-top4"]["tokens_per_expert"] == [24] * 4
    # the weight and routing-weight gradients' exemption from the elementwise count, from config, with its reason
    exempt = ["grad_w_gate", "grad_w_up", "grad_w_down", "grad_route_weight"]
    reason = load(QUICK).op.max_error_only.reason
    assert report["max_error_only"] == {"outputs": exempt, "reason": reason} and "measured" in reason
    assert any(note.startswith(", ".join(exempt)) and note.endswith(reason) for note in report["notes"])


def test_without_the_config_exemption_the_bf16_peers_miss_the_elementwise_count(tmp_path):
    """op.max_error_only is what the bf16 peers need: torch's own bf16 math (as the baseline) misses the count on
    d route_weight; our Triton path passes (it rounds its intermediates to bf16 as the GPU does, but sums
    d route_weight's partials in fp32 from the fp32 dOut W_downᵀ). Under a precision it does not list, it is off."""
    report = _parity(load([*QUICK, "precision=bf16", "op.max_error_only.outputs=[]",
                           "op.max_error_only.precisions=[]"]), tmp_path)
    assert "max_error_only" not in report
    for path in ("sparse", "grouped_mm"):
        failed = report["paths"][path]["failed_cases"]
        assert failed and all("/grad_route_weight: mismatch_frac" in f for f in failed)
    assert report["paths"]["triton"]["verdict"] == "pass"
    assert load([*QUICK, "op.max_error_only.precisions=[bf16]"]).op.max_error_only.outputs_for("fp32") == []


def test_a_router_that_disagrees_with_the_float64_router_fails(tmp_path, monkeypatch):
    """The recorded routing is checked exactly: one token sent to another expert breaks the contract."""
    original = moe.OP.make_inputs

    def misrouted(case, dtype, device):
        x = original(case, dtype, device)
        idx = x["route_idx"].clone()
        idx[0, 0] = (idx[0, 0] + 1) % case.dims["experts"]  # token 0 to the next expert
        return {**x, "route_idx": idx}

    monkeypatch.setattr(moe.OP, "make_inputs", misrouted)
    # top-1: no slot collision and the path still runs; one path (op.only): the routing check is the reference's
    cfg = load([*QUICK, "shape.ops.moe.top_k=1", "op.only=[sparse]"])
    report = _parity(cfg, tmp_path)
    assert report["inputs"]["verdict"] == "fail" and report["verdict"] == "fail"
    assert report["first_failure"].startswith("inputs: ") and "recorded route_idx" in report["first_failure"]


PLANTED = {
    "wrong expert id for one row block": (
        "    expert = tl.load(block_expert_ptr + block)\n",
        "    expert = tl.load(block_expert_ptr + block) + (block == 1)\n"),  # block 1 holds expert <= 1 here
    "dropped padding mask": ("    valid = offs < n_valid", "    valid = offs < BLOCK_M"),
    "routing weight not applied": ("    acc = acc * weight[:, None]\n", "    acc = acc\n"),
    "gradients into the wrong expert": (
        "    dw_off = expert * stride_we", "    dw_off = ((expert + 1) % tl.num_programs(0)) * stride_we"),
}
# Per bug: an output that must fail, and outputs that must not (the bug leaves them alone). Measured margins
# (largest error / allowance over the 4 QUICK cases; fp32 / bf16 / fp16):
#   wrong expert id        x4e5 / x65 / x514 (every output). In T24-one_expert `out` passes under bf16 and fp16:
#                          expert 1's routing weight there is ~e^-10, so its wrong output moves `out` by ~1e-4,
#                          under the bf16/fp16 bounds (0.13 / 0.012); grad_route_weight (x44 / x438) catches it
#   dropped padding mask   non-finite dW (padding rows carry the NaN routing weight); the forward is untouched
#   weight not applied     out x7.8e5 / x105 / x1.1e3
#   dW to wrong expert     x4.6e5 / x125 / x1e3, on dW_gate/up/down alone, by the max-error rules (conf/op/moe.yaml
#                          exempts them from the elementwise count)
PLANTED_OUTPUTS = {
    "wrong expert id for one row block": ("out", ()),
    "dropped padding mask": ("grad_w_up", ("out", "grad_x")),
    "routing weight not applied": ("out", ()),
    "gradients into the wrong expert": ("grad_w_gate", ("out", "grad_x", "grad_route_weight")),
}


@pytest.mark.usefixtures("without_invariance_reruns")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bug_is_caught(bug, precision, tmp_path, monkeypatch, shared_reference):
    """Under every precision's contract (bf16 through the interpreter's emulation, ops/__init__.py)."""
    mutant = _mutant(tmp_path, *PLANTED[bug])

    def fn(x, cfg):
        t = cfg.tile
        return {"out": mutant.moe(*(x[name] for name in moe.EXPERTS), block_m=t.block_m, block_n=t.block_n,
                                  block_k=t.block_k)}

    monkeypatch.setitem(moe.IMPLS, "triton", dataclasses.replace(moe.IMPLS["triton"], fn=fn))
    cfg = shared_reference([*QUICK, f"precision={precision}"], tmp_path)
    kernel_stage.run_kernel(cfg, tmp_path)
    with pytest.raises(stage_common.ContractBroken, match=f"triton broke the {precision} contract"):
        parity_stage.run_parity(cfg, tmp_path)
    report = json.loads((tmp_path / "parity.json").read_text())
    triton = report["paths"]["triton"]
    assert triton["verdict"] == "fail"
    assert report["paths"]["sparse"]["verdict"] == "pass" and report["inputs"]["verdict"] == "pass"
    caught_by, untouched = PLANTED_OUTPUTS[bug]
    assert any(f"/{caught_by}:" in failure for failure in triton["failed_cases"])
    assert not any(f"/{name}:" in failure for name in untouched for failure in triton["failed_cases"])


def test_costs_curve_and_config_rules():
    cfg = load(QUICK)
    op = get_op("moe")
    case = next(c for c in op.cases(cfg) if c.main)
    costs = op.costs(case, cfg)
    assert costs.flops == 2 * 24 * 2 * 3 * 64 * 96  # 2*T*k*3*d*f
    assert costs.bytes == (2 * 24 * 64 + 4 * 3 * 64 * 96) * 4 + 24 * 2 * (8 + 4)
    assert op.curve_sizes(cfg) == [1, 16, 64, 256] and op.curve_case(cfg, 1).dims["tokens"] == 1
    assert op.expected_outputs(op.impls["triton"])[-1] == "grad_route_weight"
    with pytest.raises(ConfigError, match="grouped_mm needs multiples of 8"):
        load(["op=moe", "precision=bf16", "shape.ops.moe.d_model=36"])
    with pytest.raises(ConfigError, match=r"^shape\.ops\.moe\.top_k=5: must be <= shape\.ops\.moe\.experts=4$"):
        load(["op=moe", "shape.ops.moe.top_k=5"])
    with pytest.raises(ConfigError, match="valid choices are dense, moe"):
        load(["architecture.mlp=sparse"])


def test_moe_model_trains_with_each_expert_path_and_counts_its_routing():
    """Dense reference, sparse and Triton experts in the same MoE model: same losses, the moe profiler range,
    no assignment dropped, and the load-balancing loss in the step."""
    config = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, mlp="moe", n_experts=4, top_k=2,
                         expert_hidden=48, max_seq_len=16)
    model = Transformer(config, seed=0)
    assert isinstance(model.blocks[0].mlp, MoEMLP)
    _, loss = model(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
    assert torch.isfinite(loss) and moe_aux_loss(model) > 0

    cfg = load(["op=moe", "tile=b16"])
    hooks = {name: moe.OP.model_hook.fill(moe.IMPLS[name], cfg) for name in ("reference", "sparse", "triton")}
    variants = [Variant("reference", {"experts": hooks["reference"]}), Variant("sparse", {"experts": hooks["sparse"]}),
                Variant("triton", {"experts": hooks["triton"]}, interpreted=True, steps=1)]
    result = bench_train(config, variants=variants, steps=2, warmup_steps=0, batch_size=2, seq_len=16, lr=3e-3,
                         seed=0, precision="fp32", device="cpu")
    assert result["drift"]["sparse"] < 1e-5 and result["drift"]["triton"] < 1e-5
    reference_run = result["impls"]["reference"]
    assert reference_run["profile"]["experts"]["calls"] == 1 and reference_run["profile"]["experts"]["fraction"] > 0
    routing = reference_run["moe_routing"]
    assert routing["dropped"] == [0] and routing["dropped_counted_over_steps"] == 2
    assert routing["assignments"] == [2 * 16 * 2] and sum(routing["tokens_per_expert"][0]) == 64
    per_step = routing["tokens_per_expert_per_step"]  # (steps, layers, E): every trained step's histogram
    assert len(per_step) == 2 and per_step[-1] == routing["tokens_per_expert"]
    assert all(sum(layer) == 64 and len(layer) == 4 for hist in per_step for layer in hist)
    balance = routing["load_balance_loss_per_step"]  # ~1 balanced, at most E/k = 2 (each f_e <= 1/k)
    assert len(balance) == 2 and all(0.0 < b[0] <= 2.0 for b in balance)
    assert len(result["impls"]["triton"]["moe_routing"]["tokens_per_expert_per_step"]) == 1


def test_op_moe_trains_an_moe_model_on_a_dense_architecture():
    assert moe.OP.model_overrides(load(["op=moe"])) == {"mlp": "moe", "expert_hidden": 192}
    assert moe.OP.model_overrides(load(["op=moe", "architecture=moe"])) == {}
    x = torch.randn(3, 8, dtype=torch.float64)
    idx, weight = reference.moe_router(x, torch.randn(8, 4, dtype=torch.float64), 2)
    assert torch.allclose(weight.sum(-1), torch.ones(3, dtype=torch.float64))


def test_the_expert_curve_holds_active_parameters_and_checks_each_size_before_timing(tmp_path, monkeypatch):
    """A second curve over E at fixed tokens, d, f and top-k (dense FLOPs grow with E, active ones do not), in the
    same curve.csv; a path wrong at one E only is not timed there, and is timed at the others."""
    import pandas as pd

    cfg = load([*QUICK, "bench.warmup=0", "bench.reps=1", "bench.min_time_s=0", "shape.ops.moe.curve=[1,24]",
                "shape.ops.moe.expert_curve=[2,8]"])
    op = get_op("moe")
    axis = next(a for a in op.curve_axes if a.x_name == "experts")
    cases = [axis.case(cfg, x) for x in axis.sizes(cfg)]
    assert [c.dims["experts"] for c in cases] == [2, 8]
    assert {(c.dims["tokens"], c.dims["d_model"], c.dims["ffn"], c.dims["top_k"]) for c in cases} == {(24, 64, 96, 2)}
    assert len({op.costs(c, cfg).flops for c in cases}) == 1  # active FLOPs: 2*T*k*3*d*f, whatever E
    with pytest.raises(ConfigError, match="shape.ops.moe.expert_curve=\\[1, 8\\]: give at least two expert counts >= "):
        load(["op=moe", "shape.ops.moe.expert_curve=[1,8]"])  # top-2 of 1 expert

    sparse = moe.IMPLS["sparse"]

    def wrong_with_eight_experts(x, cfg):
        out = sparse.fn(x, cfg)["out"]
        return {"out": out + 1.0 if x["w_gate"].shape[0] == 8 else out}

    monkeypatch.setitem(moe.IMPLS, "sparse", dataclasses.replace(sparse, fn=wrong_with_eight_experts))
    report = microbench_stage._curve(cfg, op, tmp_path, "cpu", ["reference", "sparse"],
                           {"peaks": {"gemm_flops_per_s": {}, "copy_bytes_per_s": 1e10}}, None)
    rows = pd.read_csv(tmp_path / "curve.csv").set_index(["impl", "x_name", "x_value"])
    assert rows.loc[("sparse", "experts", 8), "check"].startswith("failed parity")
    assert not rows.loc[("sparse", "experts", 8), "valid"] and pd.isna(rows.loc[("sparse", "experts", 8), "median"])
    assert rows.loc[("sparse", "experts", 2), "valid"] and rows.loc[("reference", "experts", 8), "valid"]
    assert rows.loc[("sparse", "tokens", 24), "valid"]  # the tokens curve runs with the point's E=4
    assert report["unchecked_or_failed"] == ["sparse@experts=8"]
    assert [(c["x_name"], c["mode"], c["x_values"]) for c in report["crossovers"]] == [
        ("tokens", "forward", [1, 24]), ("experts", "forward", [2, 8])]


def test_gpu_moe_trains_the_expert_layer_the_gpu_parity_point_checks():
    """architecture=gpu_moe (Qwen3-30B-A3B's block, 16 of its 128 experts) and shape=gpu's op=moe point share
    the expert geometry, so the layer bench-train times on the GPU is the one parity checked."""
    cfg = load(["op=moe", "architecture=gpu_moe", "shape=gpu", "device=cuda", "precision=bf16"])
    arch, sizes = cfg.architecture, moe.Sizes.of(cfg)
    assert (arch.d_model, arch.expert_hidden, arch.n_experts, arch.top_k) == \
        (sizes.d_model, sizes.ffn, sizes.experts, sizes.top_k) == (2048, 768, 16, 8)
    assert moe.OP.model_overrides(cfg) == {}  # an MoE architecture is trained as it is
