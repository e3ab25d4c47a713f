"""op=swiglu through the generic stages, planted bugs in the Triton source, its costs and curve, and the model hook.

Planted bugs mutate one line of posttrainllm/ops/swiglu/kernels.py (imported from a copy, as tests/test_parity.py
does); the test first checks that line exists exactly once.
"""

import dataclasses
import json

import pytest
from conftest import kernel_and_parity, kernel_mutant
import torch

from posttrainllm.config import itemsize
from posttrainllm.lab.stages import common as stage_common, kernel as kernel_stage, parity as parity_stage
from posttrainllm.lab.configure import load
from posttrainllm.measure.roofline import MEMORY, roofline
from posttrainllm.model.train import Variant, bench_train
from posttrainllm.model.transformer import ModelConfig, SwiGLU, Transformer
from posttrainllm.ops.registry import get_op
from posttrainllm.ops.swiglu import definition as swiglu

# one seed; the point's 128 rows at F=384 (b32: 4 x 12 programs), a single row, 37 x 37, large gate, tiny values
QUICK = ["op=swiglu", "device=cpu", "parity.seeds=[0]", "shape.edge_seq_lens=[37]"]
CASES = ["R128-F384-seed0", "R1-F384-seed0", "R37-F37-seed0", "R128-F384-large_gate", "R128-F384-tiny"]
# the interpreter's numpy e^100 (the large_gate case's extremes) warns, and so does the planted inf / inf
# no test here reads kernel.json's compile section (tests/test_compile.py does): the kernel stage runs without its child
pytestmark = [pytest.mark.usefixtures("without_compile_child"),
              pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_every_case_passes_for_the_correct_kernel(precision, tmp_path, shared_reference):
    cfg = shared_reference([*QUICK, f"precision={precision}"], tmp_path)
    report = kernel_and_parity(cfg, tmp_path)
    assert report["verdict"] == "pass", report["first_failure"]
    assert set(report["cases"]) == set(CASES)
    assert set(report["paths"]["triton"]["worst"]) == {"out", "grad_gate", "grad_up"}
    kernel = json.loads((tmp_path / "kernel.json").read_text())["paths"]["triton"]
    # per case: the forward call, then the gradients' call (its own forward, then the backward kernel)
    assert kernel["launched"] == {"_swiglu_forward_kernel": 10, "_swiglu_backward_kernel": 5}
    assert kernel["geometry"]["grid"] == [128 // cfg.tile.block_m, 384 // cfg.tile.block_n]  # rows, F blocks


PLANTED = {
    # the words: silu instead of the silu derivative in the backward
    "silu instead of the silu derivative": (
        "    d_gate = dh * u * sig * (1.0 + g * (1.0 - sig))\n", "    d_gate = dh * u * silu\n"),
    "sigmoid of up instead of gate": ("    h = g * tl.sigmoid(g) * u\n", "    h = g * tl.sigmoid(u) * u\n"),
    # e^g / (1 + e^g): inf / inf = NaN once e^g overflows (g > 88.7 in fp32): only the large_gate case holds such g
    "sigmoid as exp(g) / (1 + exp(g))": (
        "    h = g * tl.sigmoid(g) * u\n", "    h = g * (tl.exp(g) / (1.0 + tl.exp(g))) * u\n"),
}
# Per bug: the output that must fail, the outputs that must not (the bug leaves them alone), and the only cases
# that may fail (None: any). Measured margins (error / allowance of the caught output, the smallest over the cases
# that catch it; fp32 / bf16 / fp16):
#   silu for silu'        grad_gate x4.1e5 / x19 / x198 (bf16's smallest: the single row);
#                         in large_gate x6.8e6 / x1354 / x1e4
#   sigmoid(up)           out x6.0e5 / x42 / x458; the tiny case alone passes in fp32 and bf16 (σ(±6e-10) = 1/2 either
#                         way) and catches it in fp16 only (x140: its "tiny" is 0.088)
#   exp(g) / (1 + exp(g)) out non-finite in R128-F384-large_gate alone; every other case at 0.1 of its allowance
PLANTED_OUTPUTS = {
    "silu instead of the silu derivative": ("grad_gate", ("out", "grad_up"), None),
    "sigmoid of up instead of gate": ("out", ("grad_gate", "grad_up"), None),
    "sigmoid as exp(g) / (1 + exp(g))": ("out", ("grad_gate", "grad_up"), ["R128-F384-large_gate"]),
}


@pytest.mark.usefixtures("without_invariance_reruns")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bug_is_caught(bug, precision, tmp_path, monkeypatch, shared_reference):
    """Under every precision's contract (bf16 through the interpreter's emulation, ops/__init__.py)."""
    mutant = kernel_mutant(tmp_path, "swiglu", *PLANTED[bug])

    def fn(x, cfg):
        return {"out": mutant.swiglu(x["gate"], x["up"], block_rows=cfg.tile.block_m, block_f=cfg.tile.block_n)}

    monkeypatch.setitem(swiglu.IMPLS, "triton", dataclasses.replace(swiglu.IMPLS["triton"], fn=fn))
    cfg = shared_reference([*QUICK, f"precision={precision}"], tmp_path)
    kernel_stage.run_kernel(cfg, tmp_path)
    with pytest.raises(stage_common.ContractBroken, match=f"triton broke the {precision} contract"):
        parity_stage.run_parity(cfg, tmp_path)
    triton = json.loads((tmp_path / "parity.json").read_text())["paths"]["triton"]
    assert triton["verdict"] == "fail"
    caught_by, untouched, only_cases = PLANTED_OUTPUTS[bug]
    assert any(f"/{caught_by}:" in failure for failure in triton["failed_cases"])
    assert not any(f"/{name}:" in failure for name in untouched for failure in triton["failed_cases"])
    if only_cases is not None:
        assert {failure.split("/")[0] for failure in triton["failed_cases"]} == set(only_cases)


def test_cases_inputs_costs_and_curve():
    cfg = load(["op=swiglu", "precision=bf16"])
    op = get_op("swiglu")
    cases = op.cases(cfg)
    main = next(c for c in cases if c.main)
    assert main.dims == {"rows": 128, "ffn": 384}  # shape.batch · shape.seq_len, architecture.mlp_hidden
    assert [c.dims for c in cases if c.seed == 1] == [{"rows": 128, "ffn": 384}, {"rows": 1, "ffn": 384},
                                                     {"rows": 1, "ffn": 1}, {"rows": 37, "ffn": 37},
                                                     {"rows": 100, "ffn": 100}]
    assert [c.inputs for c in cases if not c.inputs == "normal"] == ["large_gate", "tiny"]

    large = op.make_inputs(next(c for c in cases if c.inputs == "large_gate"), torch.float16, "cpu")
    assert large["gate"][:2, 0].tolist() == [100.0, -100.0] and large["gate"].abs().max() == 100
    assert (large["gate"].abs() > 30).float().mean() > 0.03  # a saturated share beyond ±30, not just the extremes
    tiny_case = next(c for c in cases if c.inputs == "tiny")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        tiny = op.make_inputs(tiny_case, dtype, "cpu")
        assert tiny["gate"].abs().max() < 1 and (tiny["gate"] * tiny["up"]).abs().max() > torch.finfo(dtype).tiny
    with pytest.raises(ValueError, match="unknown swiglu input kind 'huge': valid are normal, large_gate, tiny"):
        op.make_inputs(dataclasses.replace(main, inputs="huge"), torch.float32, "cpu")

    costs = op.costs(main, cfg)
    assert costs.flops == 5 * 128 * 384 and costs.bytes == 3 * 128 * 384 * itemsize("bfloat16")
    assert costs.backward_multiple == pytest.approx(11 / 5)
    # elementwise: below any ridge (this CPU's ~14 FLOP/B; an H200's ~200 bf16 FLOP/B)
    assert roofline(costs.flops, costs.bytes, 1e-3, peak_flops=100e9, peak_bytes_per_s=7.7e9)["roof"] == MEMORY
    assert op.x_name == "rows" and op.curve_sizes(cfg) == [64, 128, 256, 512]
    assert op.curve_case(cfg, 64).dims == {"rows": 64, "ffn": 384}
    assert op.problem(main) == "rows=128 F=384"
    assert op.model_problem(cfg) == "rows=256 F=384 (each layer's dense MLP gate)"  # train 4 x 64 tokens
    assert set(op.paths(load(["op=swiglu", "op.peers=[compiled]"]))) == {"reference", "triton", "compiled"}
    assert op.model_overrides(load(["op=swiglu", "architecture=moe"])) == {"mlp": "dense"}
    assert op.model_overrides(cfg) == {}


def test_the_model_trains_with_the_triton_gate_in_every_dense_mlp():
    """The hook reshapes (B, T, F) to rows and back; the Triton gate trains the same losses as the reference,
    inside the swiglu profiler range."""
    config = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, mlp_hidden=48, max_seq_len=16)
    model = Transformer(config, seed=0)
    assert any(isinstance(m, SwiGLU) for m in model.modules())
    cfg = load(["op=swiglu", "tile=b16"])
    hooks = {name: swiglu.OP.model_hook.fill(swiglu.IMPLS[name], cfg) for name in ("reference", "triton")}
    gate, up = torch.randn(2, 3, 48), torch.randn(2, 3, 48)
    torch.testing.assert_close(hooks["triton"](gate, up), torch.nn.functional.silu(gate) * up)
    variants = [Variant("reference", {"mlp_activation": hooks["reference"]}),
                Variant("triton", {"mlp_activation": hooks["triton"]}, interpreted=True, steps=1)]
    result = bench_train(config, variants=variants, steps=2, warmup_steps=0, batch_size=2, seq_len=16, lr=3e-3,
                         seed=0, precision="fp32", device="cpu")
    assert result["drift"]["triton"] < 1e-5
    profile = result["impls"]["reference"]["profile"]["mlp_activation"]  # the interpreted variant is not profiled
    assert profile["calls"] == 1 and profile["fraction"] > 0
