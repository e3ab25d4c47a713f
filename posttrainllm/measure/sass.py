"""What a compiled kernel's machine code says, read from its cubin with the tools Triton's wheel carries.

`cuobjdump -res-usage` gives the registers per thread, the stack frame (where ptxas spills) and the local and
static shared memory; `cuobjdump -sass` gives the instructions, from which we read whether the kernel uses tensor
cores (Hopper's warpgroup MMA: HGMMA/QGMMA/..., Ampere-style warp MMA: HMMA/IMMA/QMMA, Blackwell's tcgen05: UTC*MMA),
how it copies global memory into shared memory (TMA: UTMALDG/UBLKCP, cp.async: LDGSTS), the widths of its plain
global reads (a kernel compiled without the launch's alignment reads 16-bit scalars: LDG.E.U16) and its spill
traffic (STL/LDL). No driver or GPU is involved: these are the counters Nsight Compute shows as "launch
statistics", static, before the kernel ever runs.

Occupancy follows the CUDA occupancy calculator: registers are allocated per warp in units of 256, shared memory
per block plus 1 KB the runtime reserves, against each target's per-SM limits (`TARGETS`, from the CUDA C++
Programming Guide's table of technical specifications per compute capability).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Target:
    """One GPU architecture a kernel is compiled for, with the per-SM limits that decide occupancy and fit."""

    name: str
    capability: int  # Triton's GPUTarget("cuda", capability, 32)
    shared_per_sm: int  # bytes
    shared_per_block: int  # bytes a block may opt in to (the launch fails above it)
    registers_per_sm: int = 65_536
    max_warps_per_sm: int = 64
    max_ctas_per_sm: int = 32
    reserved_shared_per_cta: int = 1_024  # the runtime's own share of each block's shared memory (cc >= 8.0)


TARGETS = {
    "sm80": Target("sm80", 80, shared_per_sm=167_936, shared_per_block=166_912),  # A100: 164 KB / 163 KB
    "sm90": Target("sm90", 90, shared_per_sm=233_472, shared_per_block=232_448),  # H100/H200: 228 KB / 227 KB
    "sm100": Target("sm100", 100, shared_per_sm=233_472, shared_per_block=232_448),  # B200: 228 KB / 227 KB
}
REGISTER_UNIT = 256  # registers are allocated per warp in units of this many
MAX_REGISTERS = 255  # per thread; ptxas spills past it

WGMMA = ("HGMMA", "QGMMA", "IGMMA", "BGMMA")  # sm90 warpgroup MMA (fp16/bf16/tf32, fp8, int8, binary)
TCGEN05 = ("UTCHMMA", "UTCQMMA", "UTCIMMA", "UTCOMMA", "UTCMMA")  # sm100 tensor-memory MMA
MMA = ("HMMA", "IMMA", "QMMA", "DMMA", "BMMA")  # warp-level mma.sync (sm80 and later)
TMA = ("UTMALDG", "UBLKCP", "UTMAPF")
CP_ASYNC = ("LDGSTS",)

_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")
_RESOURCES = re.compile(r"(REG|STACK|SHARED|LOCAL):(\d+)")


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


# What a cubin's disassembly gave, by the sha256 of the cubin and of the tool: the counters are a function of those
# bytes alone, so a cubin read once (Triton's cache hands the same one back) is not disassembled again (~0.4 s each)
CACHE = Path(os.environ.get("POSTTRAINLLM_CACHE_DIR", Path.home() / ".cache" / "posttrainllm")) / "sass"


@functools.lru_cache(maxsize=None)
def _file_sha256(path: str) -> bytes:
    return hashlib.sha256(Path(path).read_bytes()).digest()


def disassemble(cubin: bytes) -> tuple[dict[str, int], Counter]:
    """(resource usage: REG, STACK, SHARED, LOCAL; instruction histogram by opcode with its modifiers)."""
    tool = _tool("cuobjdump")
    key = hashlib.sha256(cubin + _file_sha256(tool)).hexdigest()
    cached = CACHE / f"{key}.json"
    try:
        known = json.loads(cached.read_text())
        return {k: int(v) for k, v in known["resources"].items()}, Counter(known["instructions"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # not read yet, or an entry that cannot be read: disassembled again
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True)
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True)
    function = next((line for line in usage.stdout.splitlines() if "REG:" in line), "")
    resources = {key: int(value) for key, value in _RESOURCES.findall(function)}
    instructions = Counter(_INSTRUCTION.findall(sass.stdout))
    try:  # written whole or not at all (another process may read it meanwhile)
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=CACHE, suffix=".tmp", delete=False) as f:
            json.dump({"resources": resources, "instructions": instructions}, f)
        os.replace(f.name, cached)
    except OSError:
        pass  # a cache that cannot be written costs time, never a result
    return resources, instructions


def _any(ops: Counter, names: tuple[str, ...]) -> int:
    return sum(count for op, count in ops.items() if op.split(".")[0] in names)


def tensor_cores(ops: Counter) -> str:
    """Which tensor-core instructions the kernel issues: tcgen05, wgmma, mma or none."""
    if _any(ops, TCGEN05):
        return "tcgen05"
    if _any(ops, WGMMA):
        return "wgmma"
    return "mma" if _any(ops, MMA) else "none"


def async_copy(ops: Counter) -> str:
    """How the kernel moves global memory into shared memory asynchronously: tma, cp.async or none."""
    if _any(ops, TMA):
        return "tma"
    return "cp.async" if _any(ops, CP_ASYNC) else "none"


def global_loads(ops: Counter) -> dict[str, int]:
    """Global-memory reads (LDG, and LDGSTS: cp.async into shared memory) by width in bits: an aligned, vectorized
    tile load is 128; 32 or 16 are scalars (a launch compiled without its alignment)."""
    widths: Counter = Counter()
    for op, count in ops.items():
        parts = op.split(".")
        if parts[0] not in ("LDG", "LDGSTS"):
            continue
        bits = next((p for p in parts[1:] if p in ("128", "64", "U8", "S8", "U16", "S16")), "32")
        widths[{"U8": "8", "S8": "8", "U16": "16", "S16": "16"}.get(bits, bits)] += count
    return dict(sorted(widths.items(), key=lambda kv: -int(kv[0])))


def occupancy(registers: int, shared_bytes: int, num_warps: int, target: Target) -> int:
    """Blocks resident per SM that registers, shared memory and warps allow (0: one block does not fit)."""
    per_warp = -(-max(registers, 1) * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = (target.registers_per_sm // per_warp) // num_warps
    by_shared = (target.shared_per_sm // (shared_bytes + target.reserved_shared_per_cta)
                 if shared_bytes else target.max_ctas_per_sm)
    by_warps = target.max_warps_per_sm // num_warps
    return max(0, min(by_registers, by_shared, by_warps, target.max_ctas_per_sm))


def fit(registers: int, shared_bytes: int, num_warps: int, target: Target) -> str | None:
    """None if one block launches on `target`, else why not (the bytes or registers and the limit)."""
    if shared_bytes > target.shared_per_block:
        return (f"needs {shared_bytes} B of shared memory per block; {target.name} allows {target.shared_per_block} "
                f"B ({target.shared_per_block // 1024} KB)")
    per_warp = -(-max(registers, 1) * 32 // REGISTER_UNIT) * REGISTER_UNIT
    if per_warp * num_warps > target.registers_per_sm:
        return (f"{num_warps} warps x {registers} registers need {per_warp * num_warps} registers; an SM of "
                f"{target.name} has {target.registers_per_sm}")
    return None


def counters(cubin: bytes, dynamic_shared: int, num_warps: int, target: Target) -> dict[str, Any]:
    """Every counter of one compiled kernel on `target` (module doc), with `fits` and its reason."""
    resources, ops = disassemble(cubin)
    registers = resources.get("REG", 0)
    shared = dynamic_shared + resources.get("SHARED", 0)
    why = fit(registers, shared, num_warps, target)
    ctas = occupancy(registers, shared, num_warps, target)
    return {"registers": registers, "spill_bytes": resources.get("STACK", 0) + resources.get("LOCAL", 0),
            "spill_stores": _any(ops, ("STL",)), "spill_loads": _any(ops, ("LDL",)),
            "shared_bytes": shared, "ctas_per_sm": ctas if why is None else 0,
            "warps_per_sm": (ctas * num_warps) if why is None else 0,
            "tensor_cores": tensor_cores(ops), "async_copy": async_copy(ops), "global_loads": global_loads(ops),
            "instructions": sum(ops.values()), "fits": why is None, "reason": why or ""}


def tuned_launches(rows: list[dict[str, Any]], target: str | None = None) -> dict[tuple, list[dict[str, Any]]]:
    """compile.json's candidate rows of each autotuned launch, by (path, target, launch), on `target` (default:
    every target)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("autotune") and target in (None, row["target"]):
            groups.setdefault((row["path"], row["target"], row["autotune"]["launch"]), []).append(row)
    return groups


def every_launch_fits(rows: list[dict[str, Any]], target: str | None = None) -> bool:
    """Whether every launch among compile.json's `rows` would start on `target`: a plain launch when its kernel
    fits, an autotuned one when one of its candidates does (the autotuner scores the others as never finishing and
    picks among the rest). lab/compile.py `not_fitting` names the ones that would not."""
    plain = all(row.get("fits", True) for row in rows
                if not row.get("autotune") and target in (None, row["target"]))
    return plain and all(any(row.get("fits", True) for row in candidates)
                         for candidates in tuned_launches(rows, target).values())
