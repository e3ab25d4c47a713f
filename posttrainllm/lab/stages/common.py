"""What several of a point's stages share: the verdict exceptions' base (ContractBroken), the parity
record's readers (which paths passed, why the others get no speed, the paths as parity recorded them),
the per-case parity check over an op's cases, and the gradient baseline's rule.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from posttrainllm.config import LabConfig
from posttrainllm.lab import parity, runner
from posttrainllm.measure import device as devices
from posttrainllm.opdefs import NO_BACKWARD, REFERENCE, Case, Impl, OpDef, Tensors
from posttrainllm.lab.oracle import contract_for, reference_outputs
from posttrainllm.track import failures
from posttrainllm.track.records import ParityRecord, ReferenceRecord


INTERPRETER_NOT_SPEED = "Triton ran through its interpreter (TRITON_INTERPRET=1): a correctness run, not kernel speed"


FAILED_PARITY = "failed parity: no speed number"


class ContractBroken(RuntimeError):
    """A path broke its numerical contract; the stage's report is already written."""


def to_cpu(tensors: Tensors) -> Tensors:
    return {k: v.detach().cpu() for k, v in tensors.items()}


def runs_interpreted(impl: Impl) -> bool:
    return impl.kind == "triton" and devices.triton_interpreted()


def worst_gradient_baseline(op: OpDef, cfg: LabConfig, inputs: Tensors, case: Case, grad_out: torch.Tensor,
                            oracle: Tensors, baseline: Tensors) -> None:
    """Each gradient of `baseline` becomes, element by element, the value of whichever readable formulation (the
    reference, op.gradient_baselines) errs more against the oracle: the contract's allowance is relative to the
    readable math's error, and a flash backward's own formulation is readable math too (GRADIENT_BASELINE_RULE)."""
    for _, formulation in op.gradient_baselines:
        other = reference_outputs(op, cfg, inputs, case, grad_out, formulation=formulation)
        for name in [k for k in baseline if k.startswith(parity.GRADIENT_PREFIX) and k in other]:
            mine, theirs, exact = baseline[name], other[name], oracle[name].to(baseline[name].device)
            worse = (theirs.double() - exact).abs() > (mine.double() - exact).abs()
            baseline[name] = torch.where(worse, theirs, mine)


GRADIENT_BASELINE_RULE = ("each gradient's baseline is, element by element, the larger-error of the op's readable "
                          "formulations in the point's precision (attention: torch.softmax, and P = exp(S - lse) as "
                          "a flash backward recomputes it from the stored logsumexp)")


def load_reference(out: Path) -> ReferenceRecord:
    return ReferenceRecord.read(out / ReferenceRecord.FILE)


def refusals(out: Path) -> dict[str, str]:
    """Why each path that did not pass parity gets no speed: FAILED_PARITY, or that it cannot run here and why
    (none where no parity stage ran: a curve of the paths it is given)."""
    found: dict[str, str] = {}
    record = ParityRecord.read_optional(out / ParityRecord.FILE)
    for name, p in (record.paths if record else {}).items():
        if p["verdict"] == failures.CANNOT_RUN_HERE:
            gap = p["cannot_run_here"]
            found[name] = f"{failures.CANNOT_RUN_HERE}: {gap['reason']} (runs on {gap['runs_on']}): no speed"
        elif p["verdict"] != "pass":
            found[name] = FAILED_PARITY
    return found


ADVERSARIAL_NOTE = ("adversarial-input cases (large, growing and near one-hot logits) are held to the max-error "
                    "rules, per tensor and per row, not to the elementwise atol/rtol count: at their magnitudes "
                    "(scores to ±40, gradients to ~26) the plain reference math in the same precision is itself "
                    "outside atol/rtol on up to 26% of elements (bf16/fp16) and 0.05% (fp32). Input kinds in "
                    "the op's forward_only_inputs (attention: near_one_hot) check the forward outputs only")


def check_path(op: OpDef, impl: Impl, cfg: LabConfig, records: list[dict[str, Any]],
                outputs: list[Tensors]) -> dict[str, Any]:
    """parity.check_path over every case; adversarial-input cases without the elementwise count (ADVERSARIAL_NOTE)."""
    contract = contract_for(cfg)

    def no_elementwise_count(output: str) -> Any:
        return dataclasses.replace(contract(output), atol=float("inf"))

    exempt = cfg.op.max_error_only.outputs_for(cfg.precision.name)

    def op_contract(output: str) -> Any:  # op.max_error_only's outputs: the max-error rules alone
        return no_elementwise_count(output) if output in exempt else contract(output)

    groups: dict[tuple[bool, bool], list[int]] = {}
    for i, record in enumerate(records):
        kind = record["case"]["inputs"]
        groups.setdefault((kind != "normal", kind in op.forward_only_inputs), []).append(i)
    # optional outputs (a user attention's logsumexp) are checked when the path returns them
    returned = set().union(*(set(o or {}) for o in outputs)) if outputs else set()
    optional = [name for name in op.optional_outputs if name in returned and name not in impl.outputs]
    results = []
    for (adversarial, forward_only), index in groups.items():
        expected = [*impl.outputs, *optional] if forward_only else [*op.expected_outputs(impl), *optional]
        results.append(parity.check_path(
            [outputs[i] for i in index] if len(outputs) == len(records) else outputs,
            [records[i]["oracle"] for i in index], [records[i]["baseline"] for i in index],
            [records[i]["case"]["name"] for i in index], no_elementwise_count if adversarial else op_contract,
            expected, op.row_ndim))
    if len(results) == 1:
        return results[0]
    merged = {"verdict": "pass" if all(r["verdict"] == "pass" for r in results) else "fail",
              "failed_cases": [f for r in results for f in r["failed_cases"]],
              "cases": [c for r in results for c in r["cases"]], "worst": {}}
    for r in results:
        for name, entry in r["worst"].items():
            ratio = entry.get("max_abs_err", float("inf")) / max(entry.get("allowed_abs_err", 0.0), 1e-300)
            have = merged["worst"].get(name)
            if have is None or ratio > have.get("max_abs_err", float("inf")) / max(have.get("allowed_abs_err", 0.0),
                                                                                    1e-300):
                merged["worst"][name] = entry
    return merged


def backward_note(impl: Impl) -> str:
    """Why a path's gradients are not checked as its own (Impl.backward)."""
    if impl.backward == NO_BACKWARD:
        return "none: a forward-only path (no gradients, no forward+backward time, no training)"
    return f"not checked: the backward is borrowed from the {impl.backward!r} path's math, not this path's"


def passed_parity(out: Path) -> dict[str, bool]:
    """Which paths may carry speed numbers: the reference, and every path whose parity verdict is pass."""
    verdicts = {name: p["verdict"] == "pass" for name, p in ParityRecord.read(out / ParityRecord.FILE).paths.items()}
    return {REFERENCE: True, **verdicts}


def parity_paths(op: OpDef, cfg: LabConfig, out: Path) -> dict[str, Impl]:
    """The point's paths with each one's backward as parity.json recorded it (a user path's result may declare
    it forward-only) and, for a path that launched Triton kernels (a user's), kind "triton" when interpreted."""
    record = ParityRecord.read_optional(out / ParityRecord.FILE)
    recorded = record.paths if record else {}
    paths = {}
    for name, impl in runner.paths(op, cfg).items():
        entry = recorded.get(name, {})
        impl = dataclasses.replace(impl, backward=entry.get("backward", impl.backward))
        if impl.kind != "triton" and entry.get("launched"):
            impl = dataclasses.replace(impl, kind="triton")  # it runs Triton: interpreted, it is not speed
        paths[name] = impl
    return paths
