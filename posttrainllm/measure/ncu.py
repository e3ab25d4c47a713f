"""Nsight Compute's measured counters of the Triton kernels a point launches, beside the compile report's static ones.

`posttrainllm compile` reads registers, spills and shared memory from the cubin, on any machine. On a GPU, Nsight
Compute (`ncu`) measures what the launch did: the registers the driver gave each thread, the achieved occupancy
(active warps against the SM's peak) and the DRAM throughput (against the device's peak), per launch. The GPU check
(lab/gpucheck.py) runs each point's Triton paths once under `ncu` where the machine has it, and puts the measured
counters beside the static ones (counters.json), so the two can be compared: a kernel whose static registers allow
two blocks per SM and whose achieved occupancy says one is a finding.

`ncu --csv` writes one row per (launch, metric): "ID", ..., "Kernel Name", ..., "Metric Name", "Metric Unit",
"Metric Value" (values may carry thousands separators). Not yet run on a GPU here: no figure of it is measured.
"""

from __future__ import annotations

import csv
import glob
import io
import re
import shutil
import statistics
from pathlib import Path
from typing import Any

METRICS = {  # the counters.json key -> Nsight Compute's metric
    "ncu_registers": "launch__registers_per_thread",
    "ncu_achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "ncu_dram_throughput_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "ncu_duration_us": "gpu__time_duration.sum",
}
TO_MICROSECONDS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
                   "second": 1e6, "s": 1e6}
PLACES = ("/usr/local/cuda/bin/ncu", "/usr/local/cuda-*/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu")
NOT_FOUND = f"ncu not found on this machine (PATH, {', '.join(PLACES)}): static counters only"


def find() -> str | None:
    """The `ncu` executable: on PATH, else where CUDA toolkits and Nsight Compute install it; None where none is."""
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in PLACES:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def command(ncu: str, log: Path, kernels: list[str], argv: list[str], launch_count: int) -> list[str]:
    """`ncu` profiling only `kernels` (by name, at most `launch_count` launches) of the process `argv` starts."""
    names = "|".join(re.escape(name) for name in sorted(set(kernels)))
    return [ncu, "--csv", "--log-file", str(log), "--target-processes", "all",
            "--metrics", ",".join(METRICS.values()), "--kernel-name", f"regex:^({names})",
            "--launch-count", str(launch_count), *argv]


def _number(value: str) -> float | None:
    try:
        return float(value.replace(",", ""))
    except ValueError:  # "n/a", ""
        return None


def parse(text: str) -> list[dict[str, Any]]:
    """One dict per profiled launch: its kernel name and each METRICS value (durations in microseconds); the
    lines before the CSV header (==PROF== and the program's own output) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    wanted = {metric: key for key, metric in METRICS.items()}
    launches: dict[str, dict[str, Any]] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        key = wanted.get(row.get("Metric Name", ""))
        if key is None:
            continue
        launch = launches.setdefault(row["ID"], {"kernel": row["Kernel Name"]})
        value = _number(row.get("Metric Value", ""))
        if value is not None and key == "ncu_duration_us":
            value *= TO_MICROSECONDS.get(row.get("Metric Unit", "").strip(), float("nan"))
        launch[key] = value
    return list(launches.values())


def per_kernel(launches: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each kernel's launches: how many, and the median of each counter over them."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for launch in launches:
        grouped.setdefault(launch["kernel"], []).append(launch)
    out = {}
    for kernel, rows in grouped.items():
        values = {key: [r[key] for r in rows if r.get(key) is not None] for key in METRICS}
        out[kernel] = {"ncu_launches": len(rows),
                       **{key: statistics.median(v) if v else None for key, v in values.items()}}
    return out


def beside(rows: list[dict[str, Any]], measured: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The compile report's rows with the measured counters of the kernel of the same name (Nsight Compute names a
    Triton kernel by its function); a kernel ncu did not see gets none."""
    return [{**row, **measured.get(row.get("kernel"), {})} for row in rows]
