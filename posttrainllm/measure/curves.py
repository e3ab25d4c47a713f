"""Measured curves over problem size: time and memory of every path, in long format.

One row per (impl, x): the warmed timing (timing.measure) and the peak memory the call
allocates (memory.peak_bytes), next to the cost model (costs.py) at that size.

    attention: x_name = "seq_len", S = x; batch, heads, kv_heads, head_dim from the point
    matmul:    x_name = "size",    M = N = K = x

Columns
    op, impl, kind, x_name, x_value   what was measured
    median, p20, p80, unit            the timing, in `unit` (ms)
    noisy, reps, threads              timing.NOISY_RULE, timed calls, CPU intra-op threads
    valid, reason                     False (with the reason) when the path raised at this x
    peak_bytes                        memory.peak_bytes of one call [B]
    flops                             costs.py: attention 4·B·H·S²·D (x0.5 causal), matmul 2·M·N·K
    minimal_bytes                     costs.py: inputs read once + outputs written once [B]
    bytes                             the traffic a roofline uses for this row [B]; today = minimal_bytes
    device, revision                  where, and which source revision (given by the caller)

Triton through its interpreter is never a speed: such paths are left out of the curve
entirely, and `skipped_impls` (also `df.attrs["skipped"]`) says why.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch

from posttrainllm.opdefs import costs
from posttrainllm.opdefs import registry as paths
from posttrainllm.measure import device as devices
from posttrainllm.config import LabConfig, itemsize
from posttrainllm.measure.memory import peak_bytes
from posttrainllm.opdefs.registry import REFERENCE, Case
from posttrainllm.lab.stages import INTERPRETER_NOT_SPEED
from posttrainllm.measure.timing import measure

X_NAMES = {"attention": "seq_len", "matmul": "size"}
UNIT = "ms"
COLUMNS = ["op", "impl", "kind", "x_name", "x_value", "median", "p20", "p80", "unit", "noisy", "reps", "threads",
           "valid", "reason", "peak_bytes", "flops", "bytes", "minimal_bytes", "device", "revision"]


def case_at(cfg: LabConfig, x: int) -> Case:
    """The point's problem with its curve axis set to x (first parity seed)."""
    seed = cfg.parity.seeds[0]
    if cfg.op.name == "attention":
        arch = cfg.architecture
        dims = dict(batch=cfg.shape.batch, heads=arch.n_heads, kv_heads=arch.n_kv_heads, head_dim=arch.head_dim,
                    seq_len=x)
        return Case(f"S{x}-seed{seed}", seed, dims, True)
    return Case(f"{x}x{x}x{x}-seed{seed}", seed, dict(m=x, n=x, k=x), True)


def cost_at(cfg: LabConfig, case: Case) -> tuple[int, int]:
    """(flops, minimal bytes) from costs.py."""
    d, size = case.dims, itemsize(cfg.precision.dtype)
    if cfg.op.name == "attention":
        return (costs.attention_flops(d["batch"], d["heads"], d["seq_len"], d["head_dim"], cfg.op.causal),
                costs.attention_bytes(d["batch"], d["heads"], d["kv_heads"], d["seq_len"], d["head_dim"], size))
    return costs.matmul_flops(d["m"], d["n"], d["k"]), costs.matmul_bytes(d["m"], d["n"], d["k"], size)


def skipped_impls(cfg: LabConfig, impls: list[str] | None = None) -> dict[str, str]:
    """Paths that get no curve here, with why: Triton under the interpreter."""
    names = impls if impls is not None else list(paths.IMPLS[cfg.op.name])
    if not devices.triton_interpreted():
        return {}
    return {name: INTERPRETER_NOT_SPEED for name in names if paths.IMPLS[cfg.op.name][name].kind == "triton"}


def measure_curve(cfg: LabConfig, *, x_values: list[int], device: str, revision: str,
                  impls: list[str] | None = None, warmup: int | None = None, reps: int | None = None,
                  min_time_s: float | None = None, max_reps: int | None = None,
                  memory: bool = True) -> pd.DataFrame:
    """Time (and measure the memory of) each path at each x; one row per (impl, x).

    impls: the paths to measure (default: all of the op's; pass only those that passed
        parity: a path that broke its contract gets no speed number). Interpreted Triton is
        always left out. Bench settings default to cfg.bench.
    """
    op = cfg.op.name
    if op not in X_NAMES:
        raise ValueError(f"measure_curve: op={op!r}: valid choices are {', '.join(X_NAMES)}")
    names = impls if impls is not None else list(paths.IMPLS[op])
    unknown = [n for n in names if n not in paths.IMPLS[op]]
    if unknown:
        raise ValueError(f"measure_curve: unknown {op} impl {unknown[0]!r}: valid choices are "
                         f"{', '.join(paths.IMPLS[op])}")
    skipped = skipped_impls(cfg, names)
    bench = cfg.bench
    settings = dict(warmup=bench.warmup if warmup is None else warmup, reps=bench.reps if reps is None else reps,
                    min_time_s=bench.min_time_s if min_time_s is None else min_time_s,
                    max_reps=bench.max_reps if max_reps is None else max_reps)
    dtype = getattr(torch, cfg.precision.dtype)
    rows: list[dict[str, Any]] = []
    with paths.precision_context(cfg), torch.no_grad():
        for x in sorted(x_values):
            case = case_at(cfg, x)
            flops, minimal = cost_at(cfg, case)
            inputs = paths.make_inputs(case, op, dtype, device)
            for name in names:
                if name in skipped:
                    continue
                impl = paths.IMPLS[op][name]
                row: dict[str, Any] = dict(op=op, impl=name, kind=impl.kind, x_name=X_NAMES[op], x_value=x,
                                           unit=UNIT, flops=flops, bytes=minimal, minimal_bytes=minimal,
                                           device=device, revision=revision)

                def call(impl=impl):
                    return impl.run(inputs, cfg)

                try:
                    timing = measure(call, device=device, **settings)
                    mem = peak_bytes(call, device, warmup=0)["peak_bytes"] if memory else None  # warm: just timed
                except Exception as exc:  # a path that fails at one size is recorded, not fatal
                    row.update(median=math.nan, p20=math.nan, p80=math.nan, noisy=True, reps=0,
                               threads=torch.get_num_threads(), valid=False, peak_bytes=None,
                               reason=f"{type(exc).__name__}: {exc}".splitlines()[0])
                else:
                    row.update(median=timing.median_ms, p20=timing.p20_ms, p80=timing.p80_ms, noisy=timing.noisy,
                               reps=len(timing.samples_ms), threads=timing.threads, valid=True, peak_bytes=mem,
                               reason="")
                rows.append(row)
            del inputs
    df = pd.DataFrame(rows, columns=COLUMNS)
    df["peak_bytes"] = df["peak_bytes"].astype("Int64")
    df.attrs["skipped"] = skipped
    df.attrs["x_name"] = X_NAMES[op]
    return df


def crossover(df: pd.DataFrame, *, baseline: str = REFERENCE, impl: str) -> int | None:
    """The smallest x from which `impl`'s median stays below `baseline`'s at every larger x; None if never.

    Only x values where both have a valid median count. Strictly below: a tie is not a win.
    """
    if df["x_name"].nunique() > 1 or ("op" in df and df["op"].nunique() > 1):
        raise ValueError("crossover: give one op's curve (one x_name)")
    valid = df[df["valid"].astype(bool)] if "valid" in df else df

    def medians(name: str) -> pd.Series:
        rows = valid[valid["impl"] == name]
        if rows.empty:
            raise ValueError(f"crossover: no valid rows for impl {name!r}; have {sorted(valid['impl'].unique())}")
        return rows.groupby("x_value")["median"].median()

    both = pd.concat({"base": medians(baseline), "impl": medians(impl)}, axis=1).dropna().sort_index()
    answer = None
    for x, faster in zip(reversed(both.index.tolist()), reversed((both["impl"] < both["base"]).tolist())):
        if not faster:
            break
        answer = int(x)
    return answer
