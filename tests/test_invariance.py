"""Bitwise where you can (lab/invariance.py): determinism and batch invariance, measured per path, judged where a
path promises them or parity.require requires them. The planted paths (tests/planted/) pass parity's allclose."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import parity_report

from posttrainllm.config import ConfigError
from posttrainllm.lab import invariance
from posttrainllm.lab.configure import load
from posttrainllm.lab.oracle import upstream_gradient
from posttrainllm.lab.reads import point_stage_deps as stage_deps
from posttrainllm.ops.registry import case_config, get_op
from posttrainllm.track import receipt as receipts
from posttrainllm.track.report import held

PLANTED = Path(__file__).parent / "planted"
MATMUL = ["op=matmul", "device=cpu", "parity.seeds=[0]", "shape.ops.matmul.edge=[[41,77,33]]", "shape.ops.matmul.m=64",
          "shape.ops.matmul.n=64",
          "shape.ops.matmul.k=64", "shape.curve=[32,64]", "shape.ops.matmul.curve=[32,64]"]


def _point(tmp_path: Path, source: Path, *overrides: str, promises: str = "") -> dict:
    """reference -> kernel -> parity of a matmul point with one user path (and the reference): parity.json."""
    path = tmp_path / source.name
    path.write_text(source.read_text() + (f"\n\nmatmul.promises = {promises}\n" if promises else ""))
    cfg = load([*MATMUL, f"op.user_impls=[{path}:matmul]", "op.only=[matmul]", *overrides])
    return parity_report(cfg, tmp_path / "point")


def test_noise_far_below_the_tolerance_passes_allclose_and_is_reported_not_deterministic(tmp_path):
    report = _point(tmp_path, PLANTED / "noisy_matmul.py")
    path = report["paths"]["matmul"]
    assert path["verdict"] == "pass"  # allclose holds, and nothing asked for bits
    assert path["properties"]["deterministic"] == {"holds": False, "judged": False}
    out = path["determinism"]["outputs"]["out"]
    assert out["bitwise_equal"] is False and out["run"] == 2 and out["first_differing_row"] == [0]
    assert 0 < out["max_abs_diff"] < 1e-4
    assert path["determinism"]["runs"] == 3 and set(path["determinism"]["outputs"]) == {"out", "grad_a", "grad_b"}
    assert report["invariance"]["required"] == [] and "interpreter" in report["invariance"]["note"]


@pytest.mark.parametrize("how", ["promised", "required"])
def test_a_path_lacking_determinism_it_promises_or_is_required_to_have_fails_with_the_first_differing_row(how,
                                                                                                          tmp_path):
    if how == "promised":  # the function's own attribute, read in its worker
        report = _point(tmp_path, PLANTED / "noisy_matmul.py", promises="('deterministic',)")
        by = "promised by the path"
    else:
        report = _point(tmp_path, PLANTED / "noisy_matmul.py", "parity.require=[deterministic]")
        by = "required by parity.require"
    path = report["paths"]["matmul"]
    assert path["verdict"] == "fail" and report["verdict"] == "fail"
    assert path["failed_cases"] == [f"deterministic ({by}): out run 2 differs from run 1 at row [0], max |diff| "
                                    f"{path['determinism']['outputs']['out']['max_abs_diff']:.3g}"]
    assert report["first_failure"].startswith("matmul: deterministic")
    assert path["properties"]["deterministic"]["verdict"] == "fail"


def test_a_reduction_order_chosen_from_the_batch_size_fails_the_batch_invariance_it_is_required_to_have(tmp_path):
    report = _point(tmp_path, PLANTED / "batch_order_matmul.py", "parity.require=[deterministic,batch_invariant]")
    path = report["paths"]["matmul"]
    assert path["determinism"]["bitwise_equal"] is True  # the same bits on every run ...
    batch = path["batch_invariance"]
    assert batch["batch_sizes"] == [1, 64, 65, 66] and batch["rows"] == [0, 63]
    first = batch["outputs"]["out"]["first_differing_row"]  # ... but not alone (1 row: odd, split at K/2)
    assert first == {"row": 0, "batch": "alone (row 0, size 1)", "batch_size": 1, "position": 0, "index": [0]}
    assert path["verdict"] == "fail"
    assert path["failed_cases"][0].startswith("batch_invariant (required by parity.require): out row [0] in the "
                                              "batch 'alone (row 0, size 1)' (size 1, at 0) differs")
    assert path["properties"] == {
        "deterministic": {"holds": True, "judged": True, "by": ["required by parity.require"], "verdict": "pass"},
        "batch_invariant": {"holds": False, "judged": True, "by": ["required by parity.require"], "verdict": "fail"}}
    assert "not a row's" in batch["note"]  # grad_b sums over the rows: not compared
    assert set(batch["outputs"]) == {"out"}  # the forward's rows (the gradients' bits: determinism)
    summary = receipts._parity_summary(report)  # the receipt names it, and its row
    assert summary["paths"]["matmul"]["batch_invariance"]["outputs"]["out"]["first_differing_row"]["row"] == 0
    assert held(summary["paths"]["matmul"]) == "det:y bi:n"


def test_a_promise_of_an_unknown_property_fails_naming_the_valid_ones():
    verdicts, failures = invariance.judge({}, ["bitwise"], [])
    assert failures == ["promises: unknown property 'bitwise': valid choices are deterministic, batch_invariant"]
    assert verdicts["deterministic"] == {"holds": None, "judged": False}


def test_a_required_property_that_was_not_measured_fails_and_says_why():
    measured = {"determinism": {"measured": False, "reason": "raised RuntimeError: boom"}}
    _, failures = invariance.judge(measured, [], ["deterministic"])
    assert failures == ["deterministic (required by parity.require): not shown: raised RuntimeError: boom"]


def test_parity_require_names_the_valid_choices_and_is_a_parity_param():
    with pytest.raises(ConfigError, match="parity.require: unknown property 'fast': valid choices are "
                                          "deterministic, batch_invariant"):
        load([*MATMUL, "parity.require=[fast]"])
    from omegaconf import OmegaConf

    from posttrainllm.config import compose

    point = {"config": OmegaConf.to_container(compose(MATMUL), resolve=True)}
    assert "config.parity.require" in stage_deps("parity", point)["params"]


def test_compare_names_the_first_differing_row_and_its_largest_difference():
    a = torch.zeros(2, 3, 4)
    b = a.clone()
    b[1, 2, 0] = 1e-30
    b[1, 2, 3] = -2.0
    got = invariance.compare(a, b)
    assert got == {"bitwise_equal": False, "max_abs_diff": 2.0, "first_differing_row": [1, 2]}
    assert invariance.compare(a, b, row_ndim=0)["first_differing_row"] == [1, 2, 0]
    assert invariance.compare(torch.tensor(-0.0), torch.tensor(0.0))["bitwise_equal"] is False  # bits, not values
    nan = torch.tensor([math.nan, 1.0])
    assert invariance.compare(nan, nan.clone())["bitwise_equal"] is True  # the same NaN bits
    assert invariance.compare(a, a[0])["reason"] == "(3, 4) torch.float32 against (2, 3, 4) torch.float32"


@pytest.mark.parametrize("n, fixed, sizes", [(1, False, [2, 3]), (64, False, [1, 1, 65, 66]), (64, True, [64, 64]),
                                             (2, True, [2])])
def test_the_other_batches_move_the_rows_among_companions(n, fixed, sizes):
    targets, layouts = invariance.batch_layouts(n, fixed)
    assert targets == sorted({0, n - 1}) and [len(layout) for _, layout in layouts] == sizes
    for _, layout in layouts:
        where = [i for i, (src, _) in enumerate(layout) if src == "main"]
        rows = [row for src, row in layout if src == "main"]
        if len(layout) > 1:  # every batch of more than one row puts a row somewhere else than the main batch did
            assert where != rows
        assert sorted(rows) == (targets if len(layout) > 1 else rows)


@pytest.mark.parametrize("op_name, path, holds, sizes", [
    ("rmsnorm", "torch", True, [1, 2, 3, 4]),  # a token's norm owns its row: the same bits in any batch
    ("matmul", "torch", False, [1, 2, 3, 4]),  # CPU BLAS: one row alone is a matrix-vector product, other bits
    ("cross_entropy", "torch", True, [4]),  # a mean: its tokens' grad_h, moved within batches of the main size
])
def test_batch_invariance_of_pytorchs_own_paths_on_this_cpu(op_name, path, holds, sizes):
    dims = {"rmsnorm": ["shape.batch=1", "shape.seq_len=2"],
            "matmul": ["shape.ops.matmul.m=2", "shape.ops.matmul.n=64", "shape.ops.matmul.k=64", "tile=b16"],
            "cross_entropy": ["shape.ops.cross_entropy.tokens=4", "shape.ops.cross_entropy.d_model=32",
                              "shape.ops.cross_entropy.vocab=96"]}[op_name]
    cfg = load([f"op={op_name}", "device=cpu", "parity.seeds=[0]", *dims])
    op = get_op(op_name)
    case = op.cases(cfg)[0]
    inputs = op.make_inputs(case, torch.float32, "cpu")
    impl = op.paths(cfg)[path]
    grad_out = upstream_gradient(case, op.reference.fn(inputs, cfg)["out"].detach())
    main = invariance.run_once(impl, inputs, grad_out, case_config(case, cfg), "cpu")
    got = invariance.batch_invariance(op, impl, case, inputs, grad_out, main, case_config(case, cfg), "cpu")
    assert got["bitwise_equal"] is holds and got["batch_sizes"] == sizes
    assert set(got["outputs"]) == ({"grad_h"} if op_name == "cross_entropy" else {"out"})
