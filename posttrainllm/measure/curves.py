"""Measured curves over problem size: time and memory of every path, in long format.

One row per (impl, x, mode): the warmed timing (timing.measure) and the peak memory the call
allocates (memory.peak_bytes), next to the op's cost model at that size. The caller (the
microbench stage) builds the problem at each x from the op's module and checks each path's
output there first: a size whose check did not pass is recorded, never timed. An op may have
more than one axis (MoE: tokens, and experts at fixed active parameters): each row names its own.

Columns
    op, impl, kind, x_name, x_value   what was measured
    mode                              "forward", or "forward_backward" (forward, then backward of out)
    check                             "pass", or why the path's output at this x was not trusted
    median, p20, p80, unit            the timing, in `unit` (ms)
    noisy, reps, threads              timing.NOISY_RULE, timed calls, CPU intra-op threads
    valid, reason                     False (with the reason) when unchecked, failed, or raised at this x
    peak_bytes                        memory.peak_bytes of one call [B]
    flops                             the op's FLOPs at this x in this mode (its module writes the formula)
    minimal_bytes                     inputs read once + outputs written once [B] (the op's floor)
    bytes                             this path's own traffic at this x in this mode [B] (OpDef.costs_of: its
                                      kind's model; the floor where it declares none; empty where the
                                      model has no backward)
    path_flops                        the FLOPs this path executes at this x in this mode (its model)
    working_set                       the bytes live at once in its forward [B] (the cache is compared with it)
    cost_model                        which model gave bytes and path_flops ("floor": none declared)
    device, revision                  where, and which source revision
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pandas as pd
import torch

from posttrainllm.measure.memory import peak_bytes
from posttrainllm.measure.timing import measure

UNIT = "ms"
COLUMNS = ["op", "impl", "kind", "x_name", "x_value", "mode", "check", "median", "p20", "p80", "unit", "noisy", "reps",
           "threads", "valid", "reason", "peak_bytes", "flops", "bytes", "minimal_bytes", "device", "revision",
           "path_flops", "working_set", "cost_model"]
BASELINE = "reference"
FORWARD, FORWARD_BACKWARD = "forward", "forward_backward"


def measure_row(call: Callable[[], object], *, device: str, settings: dict[str, Any], check: str,
                labels: dict[str, Any], memory: bool = True) -> dict[str, Any]:
    """One (impl, x) row: timed and its memory measured only when `check` is "pass"."""
    row: dict[str, Any] = dict(labels, unit=UNIT, check=check, threads=torch.get_num_threads())
    blank = dict(median=math.nan, p20=math.nan, p80=math.nan, noisy=True, reps=0, valid=False, peak_bytes=None)
    if check != "pass":
        return {**row, **blank, "reason": f"not timed: {check}"}
    try:
        timing = measure(call, device=device, **settings)
        mem = peak_bytes(call, device, warmup=0)["peak_bytes"] if memory else None  # warm: just timed
    except Exception as exc:  # a path that fails at one size is recorded, not fatal
        return {**row, **blank, "reason": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    return {**row, "median": timing.median_ms, "p20": timing.p20_ms, "p80": timing.p80_ms, "noisy": timing.noisy,
            "reps": len(timing.samples_ms), "threads": timing.threads, "valid": True, "peak_bytes": mem, "reason": ""}


def frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=COLUMNS)
    df["peak_bytes"] = df["peak_bytes"].astype("Int64")
    return df


def with_mode(df: pd.DataFrame) -> pd.DataFrame:
    """A curve with its `mode` column: a curve.csv written before curves had modes timed the forward only."""
    return df if "mode" in df else df.assign(mode=FORWARD)


def select(df: pd.DataFrame, *, x_name: str, mode: str) -> pd.DataFrame:
    """The rows of one axis in one mode: what `crossover` takes."""
    df = with_mode(df)
    return df[(df["x_name"] == x_name) & (df["mode"] == mode)]


def series(df: pd.DataFrame) -> list[tuple[str, str]]:
    """The (x_name, mode) pairs a curve holds, in the order they first appear."""
    return list(dict.fromkeys(zip(with_mode(df)["x_name"], with_mode(df)["mode"])))


def crossover(df: pd.DataFrame, *, baseline: str = BASELINE, impl: str) -> int | None:
    """The smallest x from which `impl` is measurably faster than `baseline` at every larger x; None if never.

    Measurably faster: impl's p80 below the baseline's p20 (the spread bands do not overlap);
    overlapping bands are "no measurable difference", which is not a win. Only x values where
    both have a valid timing count. Give one axis in one mode (`select`).
    """
    if df["x_name"].nunique() > 1 or ("op" in df and df["op"].nunique() > 1) or with_mode(df)["mode"].nunique() > 1:
        raise ValueError("crossover: give one op's curve (one x_name, one mode)")
    valid = df[df["valid"].astype(bool)] if "valid" in df else df

    def bands(name: str) -> pd.DataFrame:
        rows = valid[valid["impl"] == name]
        if rows.empty:
            raise ValueError(f"crossover: no valid rows for impl {name!r}; have {sorted(valid['impl'].unique())}")
        return rows.groupby("x_value")[["p20", "p80"]].median()

    both = bands(baseline).add_suffix("_base").join(bands(impl).add_suffix("_impl"), how="inner").sort_index()
    answer = None
    for x, row in reversed(list(both.iterrows())):
        if not row["p80_impl"] < row["p20_base"]:
            break
        answer = int(x)
    return answer


def crossovers(df: pd.DataFrame, impls: list[str], *, baseline: str = BASELINE) -> list[dict[str, Any]]:
    """Each (axis, mode) of a curve: its x values and every impl's crossover with the baseline.

    [{"x_name", "mode", "x_values", "vs_reference": {impl: x or None}}]. An impl (or the baseline) with no
    valid timing on an axis in a mode (every size unchecked, failed or raised) has None: never measurably faster.
    """
    df = with_mode(df)
    out = []
    for x_name, mode in series(df):
        rows = select(df, x_name=x_name, mode=mode)
        valid = set(rows[rows["valid"].astype(bool)]["impl"])
        out.append({"x_name": x_name, "mode": mode, "x_values": sorted(int(x) for x in rows["x_value"].unique()),
                    "vs_reference": {impl: crossover(rows, baseline=baseline, impl=impl)
                                     if {impl, baseline} <= valid else None for impl in impls}})
    return out
