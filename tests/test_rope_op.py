"""op=rope through the generic stages: fp32 tables as constants, planted bugs in the Triton source, costs and
curve, the user template, and the model hook in bench-train.

Planted bugs mutate one line of posttrainllm/ops/rope/kernels.py (imported from a copy, tests/conftest.py kernel_mutant);
the mutation first checks that line exists exactly once.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import kernel_and_parity, kernel_mutant

from posttrainllm.lab.configure import load
from posttrainllm.model.train import Variant, bench_train
from posttrainllm.model.transformer import ModelConfig
from posttrainllm.ops.registry import get_op
from posttrainllm.ops.rope import definition as rope
from posttrainllm.ops.rope import reference

# one seed; the tiny shape's T = 128 over two blocks of tile b64, chunks of 1, 37 and 100 rows at position 128,
# head dims 8, 34 and 64, and T = 1 and 37 at position 10_000
QUICK = ["op=rope", "device=cpu", "parity.seeds=[0]"]
# no test here reads kernel.json's compile section (tests/test_compile.py does): the kernel stage runs without its child
pytestmark = pytest.mark.usefixtures("without_compile_child")


def test_every_path_passes_on_fp32_tables_with_no_gradient_asked_of_them(tmp_path, shared_reference):
    report = kernel_and_parity(shared_reference([*QUICK, "precision=bf16"], tmp_path), tmp_path)
    assert report["verdict"] == "pass", report["first_failure"]
    assert report["cases"] == ["T128-seed0", "T1-at128-seed0", "T37-at128-seed0", "T100-at128-seed0", "T37-D8",
                               "T37-D34", "T37-D64", "T1-at10000", "T37-at10000"]
    triton = report["paths"]["triton"]
    assert set(triton["worst"]) == {"out", "grad_x"} and triton["unchecked_outputs"] == []
    # per case: the forward call, then the gradients' call (its forward and its backward)
    assert triton["launched"] == {"_rope_kernel": 3 * len(report["cases"])}
    records = torch.load(tmp_path / "reference.pt", weights_only=True)["records"]
    far = next(r for r in records if r["case"]["name"] == "T37-at10000")
    assert far["inputs"]["x"].dtype == torch.bfloat16
    assert far["inputs"]["cos"].dtype == far["inputs"]["sin"].dtype == torch.float32  # fp32 in every precision
    assert set(far["oracle"]) == {"out", "grad_x"}  # the tables are constants in the oracle too
    angle = 10_000 * 1.0  # pair 0 at position 10_000 (frequency 1)
    assert far["inputs"]["cos"][0, 0].item() == pytest.approx(torch.tensor(angle, dtype=torch.float64).cos().item(),
                                                               abs=1e-7)


PLANTED = {
    "pairs x[i] with x[i + 1]": ("x_rows + (d[None, :] + HALF) * stride_xd", "x_rows + (d[None, :] + 1) * stride_xd"),
    "sin's sign swapped": ("    if INVERSE:  # the backward", "    if not INVERSE:  # the backward"),
    "backward rotates by +angle": ("dy, cos, sin, inverse=True,", "dy, cos, sin, inverse=False,"),
    "angles of the block's rows, not the sequence's": (
        "cos = tl.load(cos_ptr + t[:, None] * stride_ct", "cos = tl.load(cos_ptr + (t[:, None] % BLOCK_T) * stride_ct"),
}
# Per bug: an output that must fail, and outputs that must not (the bug leaves them alone). Measured margins
# (largest error / allowance over the QUICK cases; fp32 / bf16 / fp16):
#   x[i] with x[i + 1]       out x1.1e6 / x65 / x524, grad_x alike
#   sin's sign swapped       out x1.3e6 / x81 / x662, grad_x alike (forward by -angle, backward by +angle)
#   backward by +angle       grad_x x1.2e6 / x70 / x561; out untouched (x0.04 / x0.09 / x0.09)
#   the block's rows' angles out x8.9e5 / x49 / x477, grad_x alike
PLANTED_OUTPUTS = {
    "pairs x[i] with x[i + 1]": ("out", ()),
    "sin's sign swapped": ("out", ()),
    "backward rotates by +angle": ("grad_x", ("out",)),
    "angles of the block's rows, not the sequence's": ("out", ()),  # T128 and T100: rows past the first block
}


@pytest.mark.usefixtures("without_invariance_reruns")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bug_is_caught(bug, precision, tmp_path, monkeypatch, shared_reference):
    """Under every precision's contract (bf16 through the interpreter's emulation, ops/__init__.py)."""
    mutant = kernel_mutant(tmp_path, "rope", *PLANTED[bug])

    def fn(x, cfg):
        return {"out": mutant.rope(x["x"], x["cos"].detach(), x["sin"].detach(), block_t=cfg.tile.block_m)}

    monkeypatch.setitem(rope.IMPLS, "triton", dataclasses.replace(rope.IMPLS["triton"], fn=fn))
    report = kernel_and_parity(shared_reference([*QUICK, f"precision={precision}"], tmp_path), tmp_path)
    triton = report["paths"]["triton"]
    assert report["verdict"] == "fail" and triton["verdict"] == "fail"
    caught_by, untouched = PLANTED_OUTPUTS[bug]
    assert any(f"/{caught_by}:" in failure for failure in triton["failed_cases"])
    assert not any(f"/{name}:" in failure for name in untouched for failure in triton["failed_cases"])


def test_costs_curve_and_problem():
    cfg = load(QUICK)
    op = get_op("rope")
    case = next(c for c in op.cases(cfg) if c.main)
    assert op.problem(case) == "B=1 H=4 T=128 D=32 positions [0, 128)"
    costs = op.costs(case, cfg)
    assert costs.flops == 6 * 1 * 4 * 128 * 16  # 6 per pair, B·H·T·D/2 pairs
    assert costs.bytes == 2 * 4 * 128 * 32 * 4 + 2 * 128 * 16 * 4  # x and y, the fp32 tables once
    assert costs.backward_multiple == 1.0
    bf16 = load([*QUICK, "precision=bf16"])
    assert op.costs(case, bf16).bytes == 2 * 4 * 128 * 32 * 2 + 2 * 128 * 16 * 4  # the tables stay fp32
    assert op.x_name == "seq_len" and op.curve_sizes(cfg) == [64, 128, 256, 512]
    curve = op.curve_case(cfg, 256)
    assert curve.dims == dict(batch=1, heads=4, seq_len=256, head_dim=32, offset=0)
    assert op.gradient_names() == ["grad_x"]
    gqa = load([*QUICK, "architecture=gqa"])
    assert op.model_problem(gqa).endswith(f"(k) T=64 D={gqa.architecture.head_dim}, two calls per layer")


def test_the_user_template_is_the_reference_math():
    namespace: dict = {}
    exec(rope.TEMPLATE.format(name="mine"), namespace)
    path = rope.OP.adapt(namespace["mine"])
    cfg = load(QUICK)
    case = next(c for c in rope.OP.cases(cfg) if c.name == "T37-D34")
    for dtype in (torch.float32, torch.bfloat16):
        x = rope.OP.make_inputs(case, dtype, "cpu")
        assert torch.equal(path(x, cfg)["out"], reference.rope(x["x"], x["cos"], x["sin"]))
    assert path.__name__ == "mine" and rope.OP.signature.startswith("fn(x, cos, sin) -> y")


def test_the_triton_rope_trains_the_model_as_the_reference_does():
    """The hook rotates every q and k of the model (a transposed view of the projection) through `impl.fn`."""
    config = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, mlp_hidden=64, max_seq_len=16)
    cfg = load([*QUICK, "tile=b16"])
    hooks = {name: rope.OP.model_hook.fill(rope.IMPLS[name], cfg) for name in ("reference", "triton")}
    variants = [Variant("reference", {"rope": hooks["reference"]}),
                Variant("triton", {"rope": hooks["triton"]}, interpreted=True, steps=2)]
    result = bench_train(config, variants=variants, steps=2, warmup_steps=0, batch_size=2, seq_len=16, lr=3e-3,
                         seed=0, precision="fp32", device="cpu")
    assert result["drift"]["triton"] < 1e-5
    profile = result["impls"]["reference"]["profile"]["rope"]
    assert profile["calls"] == 1 and profile["fraction"] > 0  # one range per layer, around q's and k's rotations
