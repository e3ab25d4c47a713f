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


# --- the regime reader on synthetic curves whose regimes and knee are known ---------------------------------


def test_a_cache_knee_is_found_where_the_working_set_passes_the_cache():
    """A streaming path (bytes = working set = 4·x², FLOPs = x²): 100 GB/s while its set fits a 4 MB cache, 10
    GB/s beyond. The segment that crosses x = 1000 (4·1000² B = the cache) grows as x^(2 + log 10 / log 2) and
    reads 'leaves the cache'; the others follow the bytes' slope. Planted bug: a reader blind to the cache calls
    the knee 'beyond the model' and finds no crossing."""
    from posttrainllm.measure import curves

    cache = 4 * 1000**2
    x = [250, 500, 1000, 2000, 4000]
    nbytes = [4 * v**2 for v in x]
    seconds = [b / (100e9 if b <= cache else 10e9) for b in nbytes]
    read = curves.read_regime(x, seconds, [v**2 for v in x], nbytes, nbytes, cache_bytes=cache, ridge=10.0)
    assert read["cache_crossing_x"] == pytest.approx(1000)
    measured = [s["measured"] for s in read["segments"]]
    assert measured == [curves.EITHER, curves.EITHER, curves.CACHE, curves.EITHER]
    knee = read["segments"][2]
    assert knee["leaves_cache"] and knee["time_slope"] == pytest.approx(2 + math.log2(10))
    assert [s["predicted"] for s in read["segments"]] == [curves.COMPUTE, curves.COMPUTE, curves.MEMORY,
                                                          curves.MEMORY]
    assert knee["agree"] is False and read["segments"][3]["agree"] is True


def test_a_fixed_cost_then_the_flops_reads_overhead_then_compute():
    """t = 1 ms + 2·x³ / 1 TFLOP/s: flat (a fixed cost) up to x ~ 500, then x³. FLOPs grow as x³, bytes as x²: the
    two slopes are told apart, and the time follows the FLOPs'."""
    from posttrainllm.measure import curves

    x = [16, 32, 64, 1024, 2048, 4096]
    flops = [2 * v**3 for v in x]
    nbytes = [12 * v**2 for v in x]
    seconds = [1e-3 + f / 1e12 for f in flops]
    read = curves.read_regime(x, seconds, flops, nbytes, [1e12] * len(x), cache_bytes=None, ridge=1.0)
    measured = [s["measured"] for s in read["segments"]]
    assert measured[:2] == [curves.OVERHEAD, curves.OVERHEAD] and measured[-2:] == [curves.COMPUTE, curves.COMPUTE]
    assert read["segments"][-1]["time_slope"] == pytest.approx(3, abs=0.1)
    assert read["segments"][-1]["flops_slope"] == pytest.approx(3) and read["segments"][-1]["bytes_slope"] == 2
    assert read["segments"][-1]["agree"] and read["segments"][0]["agree"] is False
    assert read["cache_crossing_x"] is None  # the cache unknown: no crossing claimed


def test_a_memory_bound_path_follows_its_bytes_not_its_flops():
    from posttrainllm.measure import curves

    x = [1024, 2048, 4096, 8192]
    flops = [v for v in x]  # decode-like: FLOPs and bytes both ∝ x here would be 'either'; bytes ∝ x², FLOPs ∝ x
    nbytes = [v**2 for v in x]
    read = curves.read_regime(x, [b / 1e10 for b in nbytes], flops, nbytes, nbytes, ridge=100.0)
    assert {s["measured"] for s in read["segments"]} == {curves.MEMORY}
    assert all(s["agree"] for s in read["segments"])  # intensity 1/x < ridge: memory predicted


def test_regimes_reads_every_path_of_a_curve_frame():
    from posttrainllm.measure import curves

    rows = []
    for impl, scale in (("reference", 4.0), ("sdpa", 1.0)):
        for x in (64, 128, 256):
            rows.append(dict(op="attention", impl=impl, kind="peer", x_name="seq_len", x_value=x, mode="forward",
                             check="pass", median=scale * x**2 / 1e4, p20=0.0, p80=0.0, unit="ms", noisy=False,
                             reps=5, threads=1, valid=True, reason="", peak_bytes=0, flops=x**2, bytes=scale * x**2,
                             minimal_bytes=x, device="cpu", revision="r", path_flops=x**2, working_set=x,
                             cost_model="m"))
    found = curves.regimes(curves.frame(rows), cache_bytes=None, ridge=1.0)
    assert [(f["impl"], len(f["segments"])) for f in found] == [("reference", 2), ("sdpa", 2)]
    assert "64-128: time slope 2.00 against FLOPs 2.00, bytes 2.00: compute or memory" in curves.regime_text(found[0])


def test_every_cache_level_a_segment_passes_is_named():
    """With L2 and L3 given, the segment where a set of 4·x² bytes passes 1 MiB names L2, the one past 32 MiB L3,
    each crossing at the size its working set equals that level (x = 512 and ~2896)."""
    from posttrainllm.measure import curves

    x = [256, 1024, 4096]
    nbytes = [4 * v**2 for v in x]
    read = curves.read_regime(x, [b / 1e10 for b in nbytes], nbytes, nbytes, nbytes, cache_bytes=32 * 2**20,
                              caches={"L2": 2**20, "L3": 32 * 2**20})
    assert [s["passes"] for s in read["segments"]] == [["L2"], ["L3"]]
    assert read["cache_crossings"]["L2"] == pytest.approx(512)
    assert read["cache_crossings"]["L3"] == pytest.approx(math.sqrt(8 * 2**20))
    assert "(working set passes L2)" in curves.regime_text({**read, "impl": "p", "mode": "forward", "x_name": "x"})


def test_the_cache_levels_are_read_from_this_machine():
    from posttrainllm.measure import curves
    from posttrainllm.measure import device as devices

    levels = curves.cache_levels("cpu")
    if not levels:
        pytest.skip("no cache sizes in /sys/devices/system/cpu/cpu0/cache on this machine")
    assert max(levels.values()) == devices.last_level_cache_bytes("cpu") and "L1" in levels
