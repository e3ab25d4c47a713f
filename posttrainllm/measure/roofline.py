"""Where a measured call sits on the device's roofline (Williams, Waterman & Patterson, 2009).

    arithmetic intensity  I = flops / bytes                       [FLOP/B]
    ridge point           R = peak_flops / peak_bytes_per_s       [FLOP/B]
    attainable            A = min(peak_flops, peak_bytes_per_s · I)   [FLOP/s]
      (peak_flops: the fastest of the formats at least as precise as the point's, `widest_flops`)
    achieved              P = flops / seconds                     [FLOP/s]
    fraction              P / A

Classification (the rule, in order):
  1. "overhead-bound" when seconds < OVERHEAD_DOMINATES_BELOW · overhead_s (the fixed
     launch/dispatch cost is at least half of the time), or when fraction < LOW_FRACTION
     (neither roof explains the time: launch/dispatch, Python, synchronisation, traffic
     beyond the byte model, or too little parallel work);
  2. else "compute-bound" when I >= R (at the ridge both roofs meet; we call it compute);
  3. else "memory-bound".

`flops` and `bytes` come from costs.py (bytes = the minimal traffic), and the peaks from
calibrate.py (measured) or calibrate.published_peaks (datasheet): the caller says which.

A working set that fits the last-level cache (`cache_bytes`) is not bound by the DRAM copy roof: its
attainable rate is the FLOP peak alone, and the result says so. A fraction above 1 cannot be a result:
above the FLOP peak, the calibration or the timing is wrong; above the copy roof with a working set larger
than the cache, the byte model or the calibration is. `above_roof` names which (rule "above_roof"), and the
microbench gives such a path no speed.
"""

from __future__ import annotations

from typing import Any

from posttrainllm import rules

# One kernel launch (CUDA) or one eager op dispatch (PyTorch on CPU) costs a few microseconds.
DEFAULT_OVERHEAD_S = 10e-6
# Below this multiple of overhead_s, the fixed cost is at least 1/OVERHEAD_DOMINATES_BELOW of the time.
OVERHEAD_DOMINATES_BELOW = 2.0
# Under 5 % of the attainable rate, neither the compute nor the memory roof explains the time.
LOW_FRACTION = 0.05

COMPUTE, MEMORY, OVERHEAD = "compute-bound", "memory-bound", "overhead-bound"
# the classification rule as a result cites it (its text: posttrainllm/rules.py)
CLASSIFICATION = rules.cite("roofline_class", overhead_multiple=OVERHEAD_DOMINATES_BELOW, low_fraction=LOW_FRACTION)


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _seconds(value: float) -> str:
    for factor, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if value >= factor:
            return f"{value / factor:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def roofline(flops: float, nbytes: float, seconds: float, *, peak_flops: float, peak_bytes_per_s: float,
             overhead_s: float = DEFAULT_OVERHEAD_S, cache_bytes: int | None = None,
             widest_flops: float | None = None, working_set_bytes: int | None = None) -> dict[str, Any]:
    """One measured call against the roofline; every rate in base units (FLOP/s, B/s). cache_bytes: the
    device's last-level cache (None: unknown, the copy roof always applies). widest_flops: the fastest peak among
    formats at least as precise as the point's (calibrate.floor_peak): a call that computed wider may reach it, so
    only a rate above it too is above the FLOP roof. working_set_bytes: what is live at once (the path's cost
    model), compared with the cache; None: nbytes (a call's traffic is then taken as its working set)."""
    for name, value in (("flops", flops), ("nbytes", nbytes), ("seconds", seconds), ("peak_flops", peak_flops),
                        ("peak_bytes_per_s", peak_bytes_per_s)):
        if not value > 0:
            raise ValueError(f"roofline: {name}={value} must be > 0")
    if overhead_s < 0:
        raise ValueError(f"roofline: overhead_s={overhead_s} must be >= 0")
    intensity = flops / nbytes  # FLOP/B
    # the FLOP roof: a call that computed in a wider format (SDPA on a CPU computes fp16 in fp32) may reach that
    # format's peak, so the fastest of the formats at least as precise bounds it, not the point's own format alone
    ceiling = max(peak_flops, widest_flops or 0.0)
    ridge = ceiling / peak_bytes_per_s  # FLOP/B
    live = nbytes if working_set_bytes is None else working_set_bytes  # [B]
    resident = cache_bytes is not None and live <= cache_bytes  # the DRAM roof does not bind a cached set
    memory_roof = float("inf") if resident else peak_bytes_per_s * intensity  # FLOP/s
    attainable = min(ceiling, memory_roof)  # FLOP/s
    achieved = flops / seconds  # FLOP/s
    fraction = achieved / attainable
    above = None
    if achieved > ceiling:
        above = (f"achieved {_si(achieved, 'FLOP/s')} is {achieved / ceiling:.2f}x the calibrated FLOP peak "
                 f"{_si(ceiling, 'FLOP/s')}: the calibration or the timing is wrong")
    elif achieved > memory_roof:
        above = (f"achieved {_si(nbytes / seconds, 'B/s')} is {fraction:.2f}x the DRAM copy roof "
                 f"{_si(peak_bytes_per_s, 'B/s')} with a working set of {_si(live, 'B')}"
                 + (f" over the {_si(cache_bytes, 'B')} last-level cache" if cache_bytes else
                    " (last-level cache unknown)") + ": the byte model or the calibration is wrong")
    roof = COMPUTE if intensity >= ridge else MEMORY
    side = (f"I={intensity:.3g} FLOP/B {'>=' if roof == COMPUTE else '<'} ridge {ridge:.3g} FLOP/B")
    rate = f"achieved {_si(achieved, 'FLOP/s')} = {fraction:.1%} of attainable {_si(attainable, 'FLOP/s')}"
    if seconds < OVERHEAD_DOMINATES_BELOW * overhead_s:
        classification = OVERHEAD
        why = (f"{_seconds(seconds)} < {OVERHEAD_DOMINATES_BELOW:g} x overhead {_seconds(overhead_s)}: "
               f"fixed launch/dispatch cost dominates ({rate}; {side})")
    elif fraction < LOW_FRACTION:
        classification = OVERHEAD
        why = (f"{rate} < {LOW_FRACTION:.0%}: neither roof explains the time ({side}, "
               f"would be {roof}); overhead or traffic beyond the byte model")
    else:
        classification = roof
        why = f"{side}; {rate}"
    if resident:
        why += f"; working set {_si(live, 'B')} fits the {_si(cache_bytes, 'B')} last-level cache: no DRAM roof"
    return {
        "classification": classification,
        "why": why,
        "above_roof": above,  # None, or why this fraction above 1 cannot be a result (rule "above_roof")
        "cache_resident": resident,
        "working_set_bytes": live,
        "roof": roof,  # which roof applies by intensity alone, whatever the classification
        "intensity_flops_per_byte": intensity,
        "ridge_flops_per_byte": ridge,
        "attainable_flops_per_s": attainable,
        "achieved_flops_per_s": achieved,
        "achieved_bytes_per_s": nbytes / seconds,
        "fraction_of_attainable": fraction,
        "flops": flops,
        "bytes": nbytes,
        "seconds": seconds,
        "peak_flops_per_s": peak_flops,  # the point's own format's
        "ceiling_flops_per_s": ceiling,  # the FLOP roof: the fastest format at least as precise
        "peak_bytes_per_s": peak_bytes_per_s,
        "overhead_s": overhead_s,
        "rule": CLASSIFICATION,
    }
