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
    noisy, reps, threads              rule "noisy", timed calls, CPU intra-op threads
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

from posttrainllm import rules
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
        timing = measure(call, device=device, batched=True, **settings)
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


# --- the regime, read from the measured curve ------------------------------------------------------------------

# Log-log slopes closer than this are one slope: a segment whose time slope is within it of the FLOPs' (or the
# bytes') slope follows that; FLOPs and bytes slopes within it of each other cannot be told apart by time alone.
SLOPE_TOLERANCE = 0.25
# A time slope under this fraction of the slower-growing of FLOPs and bytes: a fixed cost sets the time.
OVERHEAD_SLOPE_FRACTION = 0.5
COMPUTE, MEMORY, EITHER, OVERHEAD, CACHE, BEYOND = ("compute-bound", "memory-bound", "compute or memory",
                                                    "overhead-bound", "leaves the cache", "beyond the model")
# the regime rule as a result cites it (its text, with these labels: posttrainllm/rules.py)
REGIME = rules.cite("regime", overhead_fraction=OVERHEAD_SLOPE_FRACTION, slope_tolerance=SLOPE_TOLERANCE)


def _slope(a: float, b: float, xa: float, xb: float) -> float | None:
    if not (a > 0 and b > 0 and xa > 0 and xb > 0) or xa == xb:
        return None
    return math.log(b / a) / math.log(xb / xa)


def _predicted(flops: float, nbytes: float, working_set: float, ridge: float | None,
               cache_bytes: int | None) -> str | None:
    if cache_bytes is not None and working_set <= cache_bytes:
        return COMPUTE
    if ridge is None or not nbytes:
        return None
    return COMPUTE if flops / nbytes >= ridge else MEMORY


def cache_crossing(x: list[float], working_set: list[float], cache_bytes: int | None) -> float | None:
    """The size where the working set passes `cache_bytes`, interpolated on log-log axes between the two measured
    sizes around it; None where it stays on one side (or the cache is unknown)."""
    if cache_bytes is None:
        return None
    for (x1, w1), (x2, w2) in zip(zip(x, working_set), list(zip(x, working_set))[1:]):
        if w1 <= cache_bytes < w2:
            slope = _slope(w1, w2, x1, x2)
            return float(x1 * (cache_bytes / w1) ** (1 / slope)) if slope else float(x2)
    return None


def cache_levels(device: str) -> dict[str, int]:
    """{level: bytes} of the data caches a working set can leave: on a CPU every unified or data level of cpu0
    (Linux sysfs: L1, L2, L3), on a GPU its L2 alone; {} where unknown."""
    if device == "cuda":
        import torch

        size = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", None)
        return {"L2": int(size)} if size else {}
    from pathlib import Path

    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    found: dict[str, int] = {}
    for entry in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            kind, level, text = ((entry / name).read_text().strip() for name in ("type", "level", "size"))
        except OSError:
            continue
        if kind in ("Data", "Unified"):
            found[f"L{level}"] = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
    return found


def read_regime(x: list[float], seconds: list[float], flops: list[float], nbytes: list[float],
                working_set: list[float], *, cache_bytes: int | None = None,
                ridge: float | None = None, caches: dict[str, int] | None = None) -> dict[str, Any]:
    """Rule "regime" over one path's curve (sizes ascending): its segments, each with the measured and predicted
    slopes and regimes and whether they agree, and the size where the working set passes the cache (`cache_bytes`,
    the last-level; `caches`: every level, {name: bytes}, each crossing named per segment)."""
    if len(x) != len(set(x)) or list(x) != sorted(x):
        raise ValueError("read_regime: give distinct sizes in ascending order")
    crossing = cache_crossing(x, working_set, cache_bytes)
    levels = dict(caches or {})
    segments = []
    for i in range(len(x) - 1):
        time_slope = _slope(seconds[i], seconds[i + 1], x[i], x[i + 1])
        flop_slope = _slope(flops[i], flops[i + 1], x[i], x[i + 1])
        byte_slope = _slope(nbytes[i], nbytes[i + 1], x[i], x[i + 1])
        passes = [name for name, size in levels.items() if working_set[i] <= size < working_set[i + 1]]
        leaves = bool(passes) or (cache_bytes is not None and working_set[i] <= cache_bytes < working_set[i + 1])
        predicted = _predicted(flops[i + 1], nbytes[i + 1], working_set[i + 1], ridge, cache_bytes)
        if None in (time_slope, flop_slope, byte_slope):
            measured = None
        elif time_slope < OVERHEAD_SLOPE_FRACTION * min(flop_slope, byte_slope):
            measured = OVERHEAD
        elif time_slope > max(flop_slope, byte_slope) + SLOPE_TOLERANCE:
            measured = CACHE if leaves else BEYOND
        elif abs(flop_slope - byte_slope) <= SLOPE_TOLERANCE:
            measured = EITHER
        else:
            measured = COMPUTE if abs(time_slope - flop_slope) <= abs(time_slope - byte_slope) else MEMORY
        agree = (None if measured is None or predicted is None else
                 measured == predicted or (measured == EITHER and predicted in (COMPUTE, MEMORY)))
        segments.append({"x_from": x[i], "x_to": x[i + 1], "time_slope": time_slope, "flops_slope": flop_slope,
                         "bytes_slope": byte_slope, "measured": measured, "predicted": predicted, "agree": agree,
                         "working_set_bytes": [working_set[i], working_set[i + 1]], "leaves_cache": leaves,
                         "passes": passes})
    return {"segments": segments, "cache_crossing_x": crossing, "cache_bytes": cache_bytes,
            "cache_crossings": {name: cache_crossing(x, working_set, size) for name, size in levels.items()}}


def regimes(df: pd.DataFrame, *, cache_bytes: int | None = None, ridge: float | None = None,
            caches: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """read_regime for every path, axis and mode of a curve with valid timings at two sizes or more: its cost
    model's FLOPs (path_flops, else flops), bytes and working set per size from the curve's own columns."""
    df = with_mode(df)
    out = []
    for x_name, mode in series(df):
        rows = select(df, x_name=x_name, mode=mode)
        rows = rows[rows["valid"].astype(bool)] if "valid" in rows else rows
        for impl in dict.fromkeys(rows["impl"]):
            mine = rows[rows["impl"] == impl].sort_values("x_value").drop_duplicates("x_value")
            if len(mine) < 2 or mine["bytes"].isna().any():
                continue
            flops = mine["path_flops"] if "path_flops" in mine and mine["path_flops"].notna().all() else mine["flops"]
            live = mine["working_set"] if "working_set" in mine and mine["working_set"].notna().all() \
                else mine["bytes"]
            read = read_regime([float(v) for v in mine["x_value"]], [float(v) / 1e3 for v in mine["median"]],
                               [float(v) for v in flops], [float(v) for v in mine["bytes"]],
                               [float(v) for v in live], cache_bytes=cache_bytes, ridge=ridge, caches=caches)
            out.append({"impl": impl, "x_name": x_name, "mode": mode,
                        "cost_model": str(mine["cost_model"].iloc[0]) if "cost_model" in mine else None, **read})
    return out


def regime_text(entry: dict[str, Any]) -> str:
    """One path's regimes in a line: each segment's slopes and measured / predicted regime."""
    parts = []
    for seg in entry["segments"]:
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        verdict = "" if seg["agree"] is None else " (agrees)" if seg["agree"] else " (differs)"
        passes = f" (working set passes {', '.join(seg['passes'])})" if seg.get("passes") else ""
        parts.append(f"{seg['x_from']:g}-{seg['x_to']:g}: time slope {fmt(seg['time_slope'])} against FLOPs "
                     f"{fmt(seg['flops_slope'])}, bytes {fmt(seg['bytes_slope'])}: {seg['measured'] or '-'}, "
                     f"predicted {seg['predicted'] or '-'}{verdict}{passes}")
    crossing = entry.get("cache_crossing_x")
    where = (f"; working set passes the {entry['cache_bytes'] / 2**20:.3g} MiB cache at {entry['x_name']} ~ "
             f"{crossing:.3g}" if crossing else "")
    return f"{entry['impl']} ({entry['mode']}, {entry.get('cost_model') or 'floor'} model): " + "; ".join(parts) + where
