"""curves: crossover on synthetic curves; a tiny real curve for its schema and what it leaves out."""

import math

import pandas as pd
import pytest
import torch

from posttrainllm.opdefs import costs
from posttrainllm.opdefs import registry as paths
from posttrainllm.measure import device as devices
from posttrainllm.config import LabConfig, OpConfig
from posttrainllm.measure.curves import COLUMNS, INTERPRETER_NOT_SPEED, crossover, measure_curve

QUICK = dict(warmup=1, reps=3, min_time_s=0.0, max_reps=3)


def synthetic(reference: list[float], fast: list[float], xs=(64, 128, 256, 512, 1024)) -> pd.DataFrame:
    rows = [dict(op="attention", impl=impl, x_name="seq_len", x_value=x, median=ms, valid=True)
            for impl, medians in (("reference", reference), ("fast", fast)) for x, ms in zip(xs, medians)]
    return pd.DataFrame(rows)


@pytest.mark.parametrize("reference, fast, expected", [
    ([1, 2, 4, 8, 16], [0.5, 1, 2, 4, 8], 64),  # always faster: from the first x
    ([1, 2, 4, 8, 16], [2, 4, 8, 16, 32], None),  # never faster
    ([1, 2, 4, 8, 16], [3, 3, 3, 5, 6], 256),  # slower at 64 and 128, faster from the 3rd point on
    ([1, 2, 4, 8, 16], [0.5, 3, 3, 9, 6], 1024),  # non-monotone: faster, slower, faster, slower, faster
    ([1, 2, 4, 8, 16], [0.5, 1, 2, 4, 16], None),  # a tie at the last x is not a win
])
def test_crossover(reference, fast, expected):
    assert crossover(synthetic(reference, fast), baseline="reference", impl="fast") == expected


def test_crossover_uses_only_x_where_both_are_valid():
    df = synthetic([1, 2, 4, 8, 16], [3, 3, 3, 5, 6])
    df.loc[(df.impl == "fast") & (df.x_value == 256), ["median", "valid"]] = [math.nan, False]
    assert crossover(df, impl="fast") == 512
    df.loc[(df.impl == "reference") & (df.x_value == 1024), "valid"] = False
    assert crossover(df, impl="fast") == 512  # 1024 drops out; 512 is still the first win that holds


def test_crossover_refuses_mixed_curves_and_unknown_impls():
    mixed = pd.concat([synthetic([1], [2], xs=[64]), synthetic([1], [2], xs=[64]).assign(x_name="size")])
    with pytest.raises(ValueError, match="one op"):
        crossover(mixed, impl="fast")
    with pytest.raises(ValueError, match="no valid rows for impl 'sdpa'"):
        crossover(synthetic([1], [2], xs=[64]), impl="sdpa")


def test_tiny_attention_curve(device):
    cfg = LabConfig()  # attention, fp32, B=1, H=4, D=32, causal
    df = measure_curve(cfg, x_values=[128, 64], device=device, revision="rev123", **QUICK)
    assert list(df.columns) == COLUMNS
    assert (df["x_name"] == "seq_len").all() and sorted(df["x_value"].unique()) == [64, 128]
    assert (df["unit"] == "ms").all() and (df["revision"] == "rev123").all() and (df["device"] == device).all()
    assert df["valid"].all() and (df["reps"] == 3).all() and (df["threads"] == torch.get_num_threads()).all()
    assert (df["p20"] <= df["median"]).all() and (df["median"] <= df["p80"]).all()
    if devices.triton_interpreted():
        assert set(df["impl"]) == {"reference", "sdpa"}
        assert df.attrs["skipped"] == {"triton": INTERPRETER_NOT_SPEED}
    else:
        assert set(df["impl"]) == set(paths.IMPLS["attention"]) and df.attrs["skipped"] == {}
    row = df[(df.impl == "sdpa") & (df.x_value == 128)].iloc[0]
    assert row["flops"] == costs.attention_flops(1, 4, 128, 32, causal=True)
    assert row["minimal_bytes"] == costs.attention_bytes(1, 4, 4, 128, 32, 4) == row["bytes"]
    # The naive reference materialises (S, S): it allocates more than the fused path at the same S.
    naive = df[(df.impl == "reference") & (df.x_value == 128)].iloc[0]
    assert naive["peak_bytes"] > row["peak_bytes"] > 0


def test_matmul_curve_records_a_failing_path(monkeypatch, device):
    def broken(x, cfg):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setitem(paths.IMPLS["matmul"], "broken",
                        paths.Impl("broken", "torch", broken, lambda case, cfg: {}, broken))
    cfg = LabConfig(op=OpConfig(name="matmul"))
    df = measure_curve(cfg, x_values=[16, 32], device=device, revision="r", impls=["reference", "broken"],
                       memory=False, **QUICK)
    assert (df["x_name"] == "size").all()
    assert df[df.impl == "reference"]["flops"].tolist() == [2 * 16**3, 2 * 32**3]
    bad = df[df.impl == "broken"]
    assert not bad["valid"].any() and bad["median"].isna().all()
    assert bad["reason"].str.contains("no kernel for this shape").all()
    assert df["peak_bytes"].isna().all()  # memory=False


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="valid choices are reference, torch, triton"):
        measure_curve(LabConfig(op=OpConfig(name="matmul")), x_values=[16], device="cpu", revision="r",
                      impls=["cublas"])
