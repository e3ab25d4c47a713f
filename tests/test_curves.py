"""curves: crossover on synthetic curves (bands, not bare medians); rows that are timed only when checked."""

import math

import pandas as pd
import pytest
import torch

from posttrainllm.measure.curves import COLUMNS, crossover, crossovers, frame, measure_row, select

QUICK = dict(warmup=1, reps=3, min_time_s=0.0, max_reps=3)


def synthetic(reference: list[float], fast: list[float], xs=(64, 128, 256, 512, 1024), spread=0.05) -> pd.DataFrame:
    """Medians with a ±spread band (p20, p80) around each."""
    rows = [dict(op="attention", impl=impl, x_name="seq_len", x_value=x, median=ms, p20=ms * (1 - spread),
                 p80=ms * (1 + spread), valid=True)
            for impl, medians in (("reference", reference), ("fast", fast)) for x, ms in zip(xs, medians)]
    return pd.DataFrame(rows)


@pytest.mark.parametrize("reference, fast, expected", [
    ([1, 2, 4, 8, 16], [0.5, 1, 2, 4, 8], 64),  # always faster: from the first x
    ([1, 2, 4, 8, 16], [2, 4, 8, 16, 32], None),  # never faster
    ([1, 2, 4, 8, 16], [3, 3, 3, 5, 6], 256),  # slower at 64 and 128, faster from the 3rd point on
    ([1, 2, 4, 8, 16], [0.5, 3, 3, 9, 6], 1024),  # non-monotone: faster, slower, faster, slower, faster
    ([1, 2, 4, 8, 16], [0.5, 1, 2, 4, 16], None),  # a tie at the last x is not a win
    ([1, 2, 4, 8, 16], [0.5, 1, 2, 4, 15.5], None),  # median below, but the bands overlap: no measurable win
])
def test_crossover(reference, fast, expected):
    assert crossover(synthetic(reference, fast), baseline="reference", impl="fast") == expected


def test_the_same_call_timed_twice_has_no_crossover():
    """a @ b against torch.matmul is one call: medians that differ by noise must not make a crossover."""
    ref = [1.00, 2.00, 4.00, 8.00]
    same = [0.98, 1.97, 3.95, 7.90]  # 1-2% below, inside the ±5% bands
    assert crossover(synthetic(ref, same, xs=(64, 128, 256, 512)), impl="fast") is None


def test_crossover_uses_only_x_where_both_are_valid():
    df = synthetic([1, 2, 4, 8, 16], [3, 3, 3, 5, 6])
    df.loc[(df.impl == "fast") & (df.x_value == 256), ["median", "p20", "p80", "valid"]] = [math.nan] * 3 + [False]
    assert crossover(df, impl="fast") == 512
    df.loc[(df.impl == "reference") & (df.x_value == 1024), "valid"] = False
    assert crossover(df, impl="fast") == 512  # 1024 drops out; 512 is still the first win that holds


def test_crossover_refuses_mixed_curves_and_unknown_impls():
    mixed = pd.concat([synthetic([1], [2], xs=[64]), synthetic([1], [2], xs=[64]).assign(x_name="size")])
    with pytest.raises(ValueError, match="one op"):
        crossover(mixed, impl="fast")
    with pytest.raises(ValueError, match="no valid rows for impl 'sdpa'"):
        crossover(synthetic([1], [2], xs=[64]), impl="sdpa")


def test_crossover_per_axis_and_mode():
    """Forward and forward+backward cross at different sizes; a second axis has its own; a curve.csv written
    before modes existed reads as forward."""
    forward = synthetic([1, 2, 4, 8, 16], [3, 3, 3, 5, 6]).assign(mode="forward")  # from 256
    backward = synthetic([1, 2, 4, 8, 16], [0.5, 1, 2, 4, 8]).assign(mode="forward_backward")  # from 64
    experts = synthetic([1, 2, 4, 8], [2, 1, 1, 1], xs=(2, 4, 8, 16)).assign(mode="forward", x_name="experts")
    df = pd.concat([forward, backward, experts])
    with pytest.raises(ValueError, match="one mode"):
        crossover(df[df.x_name == "seq_len"], impl="fast")
    assert crossover(select(df, x_name="seq_len", mode="forward_backward"), impl="fast") == 64
    found = {(c["x_name"], c["mode"]): c for c in crossovers(df, ["fast"])}
    assert {k: c["vs_reference"] for k, c in found.items()} == {
        ("seq_len", "forward"): {"fast": 256}, ("seq_len", "forward_backward"): {"fast": 64},
        ("experts", "forward"): {"fast": 4}}
    assert found[("experts", "forward")]["x_values"] == [2, 4, 8, 16]
    old = synthetic([1, 2, 4, 8, 16], [3, 3, 3, 5, 6])  # no mode column
    assert [(c["mode"], c["vs_reference"]) for c in crossovers(old, ["fast"])] == [("forward", {"fast": 256})]


def test_a_path_with_no_valid_size_has_no_crossover():
    df = synthetic([1, 2, 4, 8, 16], [0.5, 1, 2, 4, 8]).assign(mode="forward")
    df.loc[df.impl == "fast", "valid"] = False  # every size failed its check (or raised)
    assert crossovers(df, ["fast"])[0]["vs_reference"] == {"fast": None}


LABELS = dict(op="matmul", impl="torch", kind="peer", x_name="size", x_value=32, mode="forward", flops=2 * 32 ** 3,
              bytes=1, minimal_bytes=1, device="cpu", revision="r")


def test_checked_row_is_timed_with_memory():
    a = torch.randn(32, 32)
    row = measure_row(lambda: a @ a, device="cpu", settings=QUICK, check="pass", labels=LABELS)
    assert row["valid"] and row["reps"] == 3 and row["p20"] <= row["median"] <= row["p80"]
    assert row["peak_bytes"] >= 32 * 32 * 4 and row["check"] == "pass"
    df = frame([row])
    assert list(df.columns) == COLUMNS


def test_unchecked_or_failed_row_gets_no_time():
    calls = []
    row = measure_row(lambda: calls.append(1), device="cpu", settings=QUICK,
                      check="failed parity: max_abs_err 1 > allowed 1e-6", labels=LABELS)
    assert calls == []  # never called, never timed
    assert not row["valid"] and math.isnan(row["median"]) and row["peak_bytes"] is None
    assert "not timed: failed parity" in row["reason"]


def test_a_path_that_raises_at_one_size_is_recorded():
    def broken():
        raise RuntimeError("no kernel for this shape")

    row = measure_row(broken, device="cpu", settings=QUICK, check="pass", labels=LABELS)
    assert not row["valid"] and "no kernel for this shape" in row["reason"]
