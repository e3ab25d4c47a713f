"""DVC stage 'parity': each path against the oracle under the point's contract, and the bitwise properties
the kernel stage measured, judged (parity.json); raises ContractBroken after writing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from posttrainllm import rules
from posttrainllm.config import LabConfig
from posttrainllm.lab import parity, runner
from posttrainllm.ops.registry import Impl
from posttrainllm.ops.registry import op_for  # the point's op: a built-in, or one made from op.file (op=problem)
from posttrainllm.lab.runner import closed_after  # a stage's workers end with it
from posttrainllm.track import failures
from posttrainllm.track.records import KernelPath, KernelRecord, ParityPath, ParityRecord
from posttrainllm.lab.stages.common import (ADVERSARIAL_NOTE, ContractBroken, check_path,
                                            load_reference, backward_note)


@closed_after
def run_parity(cfg: LabConfig, out: Path) -> dict[str, Any]:
    """Each path against the oracle under the point's contract, and the bitwise properties the kernel stage measured
    (lab/invariance.py), judged where a path promises them or parity.require requires them. Raises ContractBroken
    after writing."""
    from posttrainllm.lab import invariance

    op = op_for(cfg)
    ref = load_reference(out)
    kernel_outputs = torch.load(out / "kernel.pt", weights_only=True)
    kernel_report = KernelRecord.read(out / KernelRecord.FILE)
    records = ref.records
    case_names = [r["case"]["name"] for r in records]
    report: dict[str, Any] = {"precision": cfg.precision.name, "contract": asdict(cfg.precision.contract),
                              "lse_contract": asdict(cfg.precision.lse_contract),
                              "rule": rules.cite("parity_contract"), "backward_rule": rules.cite("backward"),
                              "cases": case_names, "paths": {}, "notes": []}
    if any(r["case"]["inputs"] != "normal" for r in records):
        report["notes"].append(ADVERSARIAL_NOTE)
    if op.gradient_baselines:
        report["gradient_baseline_rule"] = rules.cite("gradient_baseline")
    exempt = cfg.op.max_error_only.outputs_for(cfg.precision.name)
    if exempt:  # config (conf/op/<op>.yaml op.max_error_only), with its measured reason
        report["max_error_only"] = {"outputs": exempt, "reason": cfg.op.max_error_only.reason}
        report["notes"].append(f"{', '.join(exempt)}: max-error rules only, no elementwise atol/rtol "
                               f"count (op.max_error_only): {cfg.op.max_error_only.reason}")
    report["invariance"] = {"required": list(cfg.parity.require), "determinism_rule": invariance.DETERMINISM,
                            "batch_rule": rules.cite("batch_invariance"), "properties_rule": rules.cite("properties")}
    if kernel_report.device != "cuda":
        report["invariance"]["note"] = invariance.INTERPRETED_NOTE
    if cfg.precision.allow_tf32 and kernel_report.device != "cuda":
        report["notes"].append("tf32 requested, but CPU torch and Triton's interpreter compute true fp32 here")
    for impl in runner.optimized(op, cfg):
        outputs = kernel_outputs.get(impl.name)
        entry = kernel_report.paths.get(impl.name) or _not_run(impl)
        impl = dataclasses.replace(impl, backward=entry.backward or impl.backward)  # as its result declared
        gap = (entry.failure or {}).get("cannot_run_here")
        if outputs is None and gap:  # not wrong: this machine lacks what it needs (track/failures.py CANNOT_RUN)
            checked = {"verdict": failures.CANNOT_RUN_HERE, "cannot_run_here": gap, "failed_cases": [], "worst": {},
                       "cases": []}
        elif outputs is None:
            checked = {"verdict": "fail", "failed_cases": [f"did not run: {entry.error}"], "worst": {}, "cases": []}
        else:
            checked = check_path(op, impl, cfg, records, outputs)
        # its error: what it raised, located, and its traceback's file (kernel stage); its violations: the guards'
        # and output checks', per case
        result = ParityPath(**checked, error=entry.failure or None, violations=list(entry.violations),
                            emulation=entry.emulation, backward=impl.backward, launched=entry.launched,
                            **runner.runner_for(impl).identity())
        if result.violations:
            result.verdict = "fail"
            result.failed_cases = result.violations + result.failed_cases
            result.cannot_run_here = None  # what it broke before it could not run is its own
        if outputs is not None:  # bitwise: measured by the kernel stage, judged where promised or required
            measured = entry.invariance or {}
            result.determinism = measured.get("determinism")
            result.batch_invariance = measured.get("batch_invariance")
            result.properties, broke = invariance.judge(measured, invariance.promises_of(impl, entry.promises),
                                                        list(cfg.parity.require))
            if broke:
                result.verdict = "fail"
                result.failed_cases = result.failed_cases + broke
        if not impl.checks_gradients:  # a borrowed backward is never a pass of this path's gradients
            result.gradients = backward_note(impl)
        report["paths"][impl.name] = result
    quantized = [(r["case"]["name"], r["oracle"], r["unquantized"]) for r in records if r.get("unquantized")]
    if quantized:  # the quantization itself (precision.quantize), apart from what any path adds to it
        q = cfg.precision.quantize
        report["quantization"] = {"recipe": q.recipe, "grad_format": q.grad_format, "reason": q.reason,
                                  **parity.quantization_check(quantized, min_sqnr_db=q.min_sqnr_db,
                                                              min_row_sqnr_db=q.min_row_sqnr_db,
                                                              row_ndim=op.row_ndim)}
    checks = {r["case"]["name"]: r["input_checks"] for r in records if r.get("input_checks") is not None}
    if checks:  # the inputs themselves (MoE: the routing every path ran on), checked once by the reference stage
        failed = [f"{case}: {c['reason']}" for case, c in checks.items() if c["verdict"] != "pass"]
        report["inputs"] = {"verdict": "fail" if failed else "pass", "failed_cases": failed, "cases": checks}
    broken = {name: p.failed_cases for name, p in report["paths"].items() if p.verdict == "fail"}
    if report.get("inputs", {}).get("verdict") == "fail":  # a broken router: every path ran on its routing
        broken = {"inputs": report["inputs"]["failed_cases"], **broken}
    if report.get("quantization", {}).get("verdict") == "fail":  # every path ran on the badly quantized inputs
        broken = {"quantization": report["quantization"]["failed_cases"], **broken}
    apart = {name: p.cannot_run_here for name, p in report["paths"].items()
             if p.verdict == failures.CANNOT_RUN_HERE}
    if apart:  # never a broken contract: no speed, and named apart
        report["cannot_run_here"] = apart
    report["verdict"] = "fail" if broken else "pass"
    first = next(iter(broken), None)
    report["first_failure"] = f"{first}: {broken[first][0]}" if first else None
    report["headline"] = parity_headline(cfg.precision.name, broken, apart)
    record = ParityRecord(**report)
    record.write(out / ParityRecord.FILE)
    if broken:
        raise ContractBroken(report["headline"])
    return record.to_dict()


def _not_run(impl: Impl) -> KernelPath:
    """A path kernel.json does not have (the kernel stage ran with other paths): it did not run."""
    return KernelPath(kind=impl.kind, backend=impl.backend, problem="", geometry={}, emulation=None, violations=[],
                      launched={}, error="not run by the kernel stage")


def parity_headline(precision: str, broken: dict[str, list[str]], apart: dict[str, dict[str, str]]) -> str:
    """The point's parity in one console line: how many broke the contract, each with its own first failure, then,
    apart, how many cannot run here, each with the reason and what would run it ("" when every path passed)."""
    parts = []
    if len(broken) == 1:
        (name, cases), = broken.items()
        parts.append(f"{name} broke the {precision} contract ({cases[0]})")
    elif broken:
        parts.append(f"{len(broken)} broke the {precision} contract: "
                     + "; ".join(f"{name} ({cases[0]})" for name, cases in broken.items()))
    if apart:
        parts.append(f"{len(apart)} cannot run here (not a broken contract): "
                     + "; ".join(f"{name} ({gap['reason']}; runs on {gap['runs_on']})" for name, gap in apart.items()))
    return "; apart from those, ".join(parts)


