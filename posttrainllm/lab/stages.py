"""The stages of one point, in order: reference -> kernel -> parity -> microbench -> bench-train -> receipt.

Each stage reads the config and the files earlier stages wrote in the point's
folder, and writes its own files there. None talks to MLflow but the receipt.
DVC runs them one process per stage (pipelines/*.py); `posttrainllm bench` runs
the same functions in one process. Every stage is generic over the op: what is
op-specific comes from its package in posttrainllm/ops/<op>/.

A path that breaks its contract is a result, not a crash: parity records the
verdict and the first failing case, and from then on the path gets no speed,
throughput, roofline, curve or training time anywhere. The stage still writes
its report and raises `ContractBroken` so an interactive command can exit 1;
the DVC entry point records it and lets the sweep run on.

A path that raises is located (track/failures.py: the innermost frame of its own code, its traceback in
tracebacks/<path>.txt); one whose failure says this machine lacks what it needs (a GPU driver, CUDA, a gap of
Triton's interpreter) gets the verdict "cannot run here": no speed either, and never a broken contract. The
parity stage's headline counts the paths that broke the contract and names those apart.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
import shutil
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from posttrainllm.config import ConfigError, LabConfig
from posttrainllm.files import read_json, write_json
from posttrainllm.lab import parity, runner
from posttrainllm.lab.isolation import guards, rooms
from posttrainllm.measure import calibrate, roofline
from posttrainllm.measure import device as devices
from posttrainllm.measure.timing import NOISY_RULE, Timing
from posttrainllm.ops.registry import (NO_BACKWARD, REFERENCE, Case, Impl, OpDef, Tensors, case_config, get_op,
                                       replaced_library)
from posttrainllm.lab.oracle import (backward, cast_floats, contract_for, each, gradients, named, reference_outputs,
                                     upstream_gradient, upstream_gradients)  # noqa: F401 (the first: tests use it)
from posttrainllm.lab.oracle import GRADIENT_BASELINE_RULE, worst_gradient_baseline  # noqa: F401 (stages.<name>)
from posttrainllm.lab.oracle import judge_path as _check_path
from posttrainllm.ops.registry import op_for  # the point's op: a built-in, or one made from op.file (op=problem)
from posttrainllm.lab.runner import closed_after  # a stage's workers end with it
from posttrainllm.ops.base import point_dtype as _dtype
from posttrainllm.track import failures
from posttrainllm.track.provenance import git_revision

INTERPRETER_NOT_SPEED = "Triton ran through its interpreter (TRITON_INTERPRET=1): a correctness run, not kernel speed"
FAILED_PARITY = "failed parity: no speed number"
FORWARD_ONLY = "forward-only: not trained (no backward to train with)"  # bench-train's skip of such a path
# "faster" needs non-overlapping spread bands: p80 of one below p20 of the other
BAND_RULE = "faster: p80 < other's p20; slower: p20 > other's p80; else no measurable difference"


class ContractBroken(RuntimeError):
    """A path broke its numerical contract; the stage's report is already written."""


class DidNotRun(RuntimeError):
    """A path's forward call raised (its message: "<Type>: <first line>"; the exception is its __cause__), its
    backward raised what this machine cannot run (track/failures.py), or its forward returned no dict of tensors."""


def _to_cpu(tensors: Tensors) -> Tensors:
    return {k: v.detach().cpu() for k, v in tensors.items()}


def _interpreted(impl: Impl) -> bool:
    return impl.kind == "triton" and devices.triton_interpreted()


UPSTREAM_GRADIENT = "upstream gradient dO"  # how a guard names the gradient fed to a backward


# --- reference ---------------------------------------------------------------------------


def check_memory(cfg: LabConfig, device: str) -> dict[str, Any]:
    """Refuse, before anything is allocated or written, a point whose reference stage would not fit.

    The op estimates the peak of its float64 oracle (one chunk at a time) plus its tensors; the point
    may use parity.memory_fraction of the memory available now. ConfigError names both numbers.
    """
    op = op_for(cfg)
    need = max(op.reference_bytes(case, cfg) for case in op.cases(cfg))
    available = devices.available_memory_bytes(device)
    budget = None if available is None else int(available * cfg.parity.memory_fraction)
    if budget is not None and need > budget:
        raise ConfigError(f"this point's reference stage needs ~{need / 2**30:.1f} GiB (float64 oracle of "
                          f"{op.problem(next(c for c in op.cases(cfg) if c.main))}), over its budget of "
                          f"{budget / 2**30:.1f} GiB (parity.memory_fraction={cfg.parity.memory_fraction:g} of "
                          f"{available / 2**30:.1f} GiB available on {device}): use a smaller shape")
    return {"estimated_bytes": need, "budget_bytes": budget}


def run_reference(cfg: LabConfig, out: Path) -> None:
    """Inputs for every case, the fp64 oracle on them, and the same math in the point's precision.

    Forward outputs and, for one upstream gradient dO per case, the input gradients
    (float64 autograd through the reference math is the gradient oracle). Outputs that are
    fp32 in every precision (the logsumexp) get their baseline from fp32 math on the same inputs.

    Quantized precisions (precision.quantize): the op's make_inputs quantizes once per case, so every path,
    the oracle and the baseline see the same quantized inputs; the record also keeps the float64 math on the
    unquantized inputs (the same case without its recipe), which parity measures the quantization against.
    A forward-only point reference (the fp8 paths) gets no gradient oracle.
    """
    op = op_for(cfg)
    device = devices.prepare(cfg.device.name, cfg.bench.threads)
    check_memory(cfg, device)
    point_cfg = cfg
    with_gradients = runner.paths(op, cfg)[REFERENCE].backward != NO_BACKWARD
    records = []
    with devices.fp32_matmuls(tf32=cfg.precision.allow_tf32):
        for case in op.cases(cfg):
            cfg = case_config(case, point_cfg)  # the case's own op options (Case.options), if any
            inputs = op.make_inputs(case, _dtype(cfg), device)
            inputs64 = cast_floats(inputs, torch.float64)
            with torch.no_grad():
                forward = op.reference.fn(inputs, cfg)
            out_names = set(forward)
            grad_out = upstream_gradients(op, case, forward)
            oracle = reference_outputs(op, cfg, inputs64, case, each(grad_out, torch.Tensor.double)
                                       if with_gradients else None)
            baseline = reference_outputs(op, cfg, inputs, case, grad_out if with_gradients else None)
            if with_gradients:
                worst_gradient_baseline(op, cfg, inputs, case, grad_out, oracle, baseline)
            # outputs that are fp32 in every precision (the logsumexp): their baseline is fp32 math
            extras32 = reference_outputs(op, cfg, cast_floats(inputs, torch.float32), case)
            baseline.update({k: v for k, v in extras32.items() if k not in out_names})
            records.append({"case": asdict(case), "inputs": _to_cpu(inputs),
                            "grad_out": each(grad_out, torch.Tensor.cpu),
                            "oracle": _to_cpu(oracle), "baseline": _to_cpu(baseline),
                            "input_checks": op.input_checks(case, inputs, cfg) if op.input_checks else None})
            if case.quantize:  # the quantization's own error is measured against this (parity: "quantization")
                plain = op.make_inputs(dataclasses.replace(case, quantize=""), _dtype(cfg), device)
                exact = reference_outputs(op, cfg, cast_floats(plain, torch.float64), case)
                records[-1]["unquantized"] = _to_cpu({k: v for k, v in exact.items() if k in out_names})
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"op": op.name, "dtype": cfg.precision.dtype, "records": records}, out / "reference.pt")


def _load_reference(out: Path) -> dict[str, Any]:
    return torch.load(out / "reference.pt", weights_only=True)


# --- kernel ------------------------------------------------------------------------------


@closed_after
def run_kernel(cfg: LabConfig, out: Path) -> dict[str, Any]:
    """Every optimized path on the reference's inputs, guarded; records its dispatch geometry.

    Guarded: a path must leave its inputs unchanged, return no storage of theirs, and a
    Triton path must launch a Triton kernel (guards.py); what it broke is recorded and
    parity fails it. A path that raises is recorded with its error rather than stopping the others:
    "error" ("<Type>: <message> (at file:line: text)") and "failure" (track/failures.py: type, message, the
    innermost frame of its own code, what this machine lacks where that is why, and its traceback's file,
    tracebacks/<path>.txt).
    """
    from posttrainllm.lab import invariance  # the kernel and parity stages' alone (lab/sweep.py STAGE_SOURCES)

    op = op_for(cfg)
    device = devices.prepare(cfg.device.name, cfg.bench.threads)
    shutil.rmtree(out / failures.TRACEBACKS, ignore_errors=True)  # an earlier run's: none of them describe this one
    (out / failures.TRACEBACKS).mkdir(parents=True)  # a DVC out of this stage: there even when no path raised
    ref = _load_reference(out)
    main_case = Case(**ref["records"][0]["case"])
    outputs: dict[str, list[Tensors] | None] = {}
    report: dict[str, Any] = {"device": device, "triton_interpreted": devices.triton_interpreted(), "paths": {}}
    # in a child process, beside this stage's own work, where one of ours is Triton; for paths whose kernels are
    # known only by their launches (a worker's), once their calls here showed some (a PyTorch loop starts no compiler)
    compiling = _start_compile(op, cfg, out) if any(i.kind == "triton" for i in runner.optimized(op, cfg)) else None
    by_launch: list[str] = []  # the paths whose kernels are known by their launches
    with devices.fp32_matmuls(tf32=cfg.precision.allow_tf32):
        for impl in runner.optimized(op, cfg):
            run = runner.runner_for(impl)
            if run.kernels_known_by_launch:
                by_launch.append(impl.name)
            try:  # tile=auto runs the autotuner here: a failure is this path's, recorded, not the point's
                geometry = op.geometry(impl, main_case, cfg)
            except Exception as exc:
                geometry = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
            entry: dict[str, Any] = {"kind": impl.kind, "backend": impl.backend, "problem": op.problem(main_case),
                                     "geometry": geometry, "emulation": run.emulation(cfg), "violations": [],
                                     **run.identity()}
            launched: Counter = Counter()
            raised: list[dict[str, Any]] = []  # its located failures (track/failures.py), the first recorded
            try:
                backward = run.declared_backward(ref["records"][0], cfg, device)
                entry["backward"] = backward
                impl = dataclasses.replace(impl, backward=backward)
                run = runner.runner_for(impl)
                results = []
                for record in ref["records"]:
                    got, violations = _run_case(run, record, case_config(Case(**record["case"]), cfg), device,
                                                launched, raised)
                    results.append(got)
                    entry["violations"] += [f"{record['case']['name']}: {v}" for v in violations]
                outputs[impl.name] = results
                # bitwise: the main case again (determinism) and its rows in other batches (lab/invariance.py)
                entry["invariance"] = invariance.measure(op, impl, ref["records"][0], results[0],
                                                         case_config(main_case, cfg), device)
            except Exception as exc:  # a kernel that cannot run is a failed path, reported, not a crash
                outputs[impl.name] = None
                cause = exc.__cause__ if isinstance(exc, DidNotRun) else exc
                if cause is None:  # it returned no dict of tensors
                    entry["error"] = str(exc)
                else:
                    raised.insert(0, run.describe(cause))
                    entry["error"] = failures.line(raised[0])
            if raised:
                entry["failure"] = _recorded_failure(raised[0], out, impl.name)
            entry["launched"] = dict(sorted(launched.items()))  # Triton launches by kernel name, all cases
            entry["emulation"] = run.emulation(cfg, launched)  # known once it ran: the Triton kernels it launched
            entry.update(run.evidence())  # what it recorded of its calls (compiled: dynamo's graphs; a worker's start)
            report["paths"][impl.name] = entry
    if compiling is None and any(report["paths"][name]["launched"] for name in by_launch):
        compiling = _start_compile(op, cfg, out)
    if compiling is not None:  # every Triton kernel of the paths compiled for compile.targets (lab/compile.py)
        from posttrainllm.lab import compile as compile_lab

        report["compile"] = compile_lab.finish(*compiling)
        compile_lab.register_kernel_files(report["compile"])  # the stamp hashes the user paths' kernel files
    elif by_launch:
        from posttrainllm.lab import compile as compile_lab

        report["compile"] = {"targets": list(cfg.compile.targets), "rule": compile_lab.RULE, "paths": {},
                             "rows": [], "note": NOTHING_TO_COMPILE}
    replaced = replaced_library()
    if replaced:  # the peers call what was bound when the lab started (ops/base.py LIBRARY), not these
        report["library_replaced"] = {"functions": replaced, "note": LIBRARY_REPLACED_NOTE}
    torch.save(outputs, out / "kernel.pt")
    write_json(out / "kernel.json", report)
    return report


NOTHING_TO_COMPILE = ("no path launched a Triton kernel in this stage's calls (the worker counts a user path's "
                      "launches): nothing to compile")


def _start_compile(op: OpDef, cfg: LabConfig, out: Path) -> tuple[Any, Path, list[str], float] | None:
    """The compile child (lab/compile.py) when a path may launch Triton kernels (ours, a user's), else None.
    Imported here: only the kernel stage depends on it (lab/sweep.py STAGE_SOURCES)."""
    from posttrainllm.lab import compile as compile_lab

    if not any(runner.runner_for(impl).may_launch_triton for impl in runner.optimized(op, cfg)):
        return None
    result = out / "compile.json"
    result.unlink(missing_ok=True)
    targets = list(cfg.compile.targets)
    started = time.perf_counter()
    return compile_lab.start(cfg, targets, result), result, targets, started
def _recorded_failure(failure: dict[str, Any], out: Path, name: str) -> dict[str, Any]:
    """A located failure as kernel.json and the verdict keep it: its traceback's text goes to its own file
    (tracebacks/<path>.txt, beside the receipt), named in its place."""
    where = failures.write_traceback(out, name, failure, "raised")
    return {**{k: v for k, v in failure.items() if k != "traceback"}, "traceback": where}


LIBRARY_REPLACED_NOTE = ("code in this process replaced these torch functions after the lab started; the peers and "
                         "the reference call the functions bound at start, so their names in this receipt hold")


def _run_case(run: runner.InProcess, record: dict[str, Any], cfg: LabConfig, device: str, launched: Counter,
              raised: list[dict[str, Any]]) -> tuple[Tensors, list[str]]:
    """One case: the forward call, then (a backward of its own) the gradients' call, each guarded on its own
    (inputs unchanged, no aliasing, the path's kernels of that direction launched); the outputs' form (tensor,
    shape, dtype, device) against the reference's. Outputs of the wrong form are dropped (parity: missing).
    A forward that raises is DidNotRun, its exception the cause; a backward that raises is a violation, located
    (its failure joins `raised`), or DidNotRun where this machine cannot run it (track/failures.py)."""
    impl = run.impl
    inputs = rooms.fresh(record["inputs"], device)  # this path's own copy: its writes reach no other path
    grad_out = each(record["grad_out"], lambda g: g.to(device, copy=True))
    triton = impl.kind == "triton"
    errors: list[BaseException] = []
    got, violations = guards.run_guarded(lambda: run.forward(inputs, cfg), inputs, expect_triton=triton,
                                         kernels=impl.kernels.get("forward", ()), launched=launched, errors=errors)
    if got is None:  # the forward raised or returned no dict: the path did not run (run_kernel records why)
        raise DidNotRun(violations[0].removeprefix("raised ")) from (errors[0] if errors else None)
    got = dict(got)
    wrong = guards.output_violations(got, {k: v for k, v in record["baseline"].items() if k in got}, device)
    violations += wrong
    if wrong:
        got = {k: v for k, v in got.items() if isinstance(v, torch.Tensor) and not any(f"output {k} " in w
                                                                                      for w in wrong)}
    if impl.checks_gradients:
        grads, broken = guards.run_guarded(
            lambda: gradients(lambda x: run.forward(x, cfg), inputs, grad_out), inputs,
            expect_triton=triton, kernels=impl.kernels.get("backward", ()), launched=launched,
            unchanged=named(grad_out, UPSTREAM_GRADIENT), errors=errors)
        if errors:  # the backward raised: located
            failure = run.describe(errors[0])
            if failure.get("cannot_run_here"):  # not the path's error: it cannot run here, forward included
                raise DidNotRun(f"backward raised {failures.line(failure)}") from errors[0]
            broken = [f"raised {failures.line(failure)}" if v.startswith("raised ") else v for v in broken]
            raised.append(failure)
        got.update(grads or {})
        violations += [f"backward {v}" for v in broken]
    return _to_cpu(got), violations


# --- parity ------------------------------------------------------------------------------


@closed_after
def run_parity(cfg: LabConfig, out: Path) -> dict[str, Any]:
    """Each path against the oracle under the point's contract, and the bitwise properties the kernel stage measured
    (lab/invariance.py), judged where a path promises them or parity.require requires them. Raises ContractBroken
    after writing."""
    from posttrainllm.lab import invariance

    op = op_for(cfg)
    ref = _load_reference(out)
    kernel_outputs = torch.load(out / "kernel.pt", weights_only=True)
    kernel_report = read_json(out / "kernel.json")
    records = ref["records"]
    case_names = [r["case"]["name"] for r in records]
    report: dict[str, Any] = {"precision": cfg.precision.name, "contract": asdict(cfg.precision.contract),
                              "lse_contract": asdict(cfg.precision.lse_contract),
                              "rule": parity.RULE + "; forward and backward calls each: inputs unchanged, no aliasing, "
                                      "a Triton path launched the kernels it names for that direction",
                              "backward_rule": BACKWARD_RULE,
                              "cases": case_names, "paths": {}, "notes": []}
    if any(r["case"]["inputs"] != "normal" for r in records):
        report["notes"].append(ADVERSARIAL_NOTE)
    if op.gradient_baselines:
        report["gradient_baseline_rule"] = GRADIENT_BASELINE_RULE
    exempt = cfg.op.max_error_only.outputs_for(cfg.precision.name)
    if exempt:  # config (conf/op/<op>.yaml op.max_error_only), with its measured reason
        report["max_error_only"] = {"outputs": exempt, "reason": cfg.op.max_error_only.reason}
        report["notes"].append(f"{', '.join(exempt)}: max-error rules only, no elementwise atol/rtol "
                               f"count (op.max_error_only): {cfg.op.max_error_only.reason}")
    report["invariance"] = {"required": list(cfg.parity.require), "determinism_rule": invariance.DETERMINISM_RULE,
                            "batch_rule": invariance.BATCH_RULE, "properties_rule": invariance.PROPERTIES_RULE}
    if kernel_report["device"] != "cuda":
        report["invariance"]["note"] = invariance.INTERPRETED_NOTE
    if cfg.precision.allow_tf32 and kernel_report["device"] != "cuda":
        report["notes"].append("tf32 requested, but CPU torch and Triton's interpreter compute true fp32 here")
    for impl in runner.optimized(op, cfg):
        outputs = kernel_outputs.get(impl.name)
        entry = kernel_report["paths"].get(impl.name, {"error": "not run by the kernel stage"})
        impl = dataclasses.replace(impl, backward=entry.get("backward", impl.backward))  # as its result declared
        gap = (entry.get("failure") or {}).get("cannot_run_here")
        if outputs is None and gap:  # not wrong: this machine lacks what it needs (track/failures.py CANNOT_RUN)
            result = {"verdict": failures.CANNOT_RUN_HERE, "cannot_run_here": gap, "failed_cases": [], "worst": {},
                      "cases": []}
        elif outputs is None:
            result = {"verdict": "fail", "failed_cases": [f"did not run: {entry.get('error')}"], "worst": {},
                      "cases": []}
        else:
            result = _check_path(op, impl, cfg, records, outputs)
        if entry.get("failure"):  # what it raised, located, and its traceback's file (kernel stage)
            result["error"] = entry["failure"]
        result["violations"] = entry.get("violations") or []  # the guards' and output checks', per case
        if result["violations"]:
            result["verdict"] = "fail"
            result["failed_cases"] = result["violations"] + result["failed_cases"]
            result.pop("cannot_run_here", None)  # what it broke before it could not run is its own
        result["emulation"] = entry.get("emulation")
        result["backward"] = impl.backward
        result["launched"] = entry.get("launched", {})
        if outputs is not None:  # bitwise: measured by the kernel stage, judged where promised or required
            measured = entry.get("invariance") or {}
            result["determinism"] = measured.get("determinism")
            result["batch_invariance"] = measured.get("batch_invariance")
            result["properties"], broke = invariance.judge(measured, invariance.promises_of(impl, entry),
                                                           list(cfg.parity.require))
            if broke:
                result["verdict"] = "fail"
                result["failed_cases"] = result["failed_cases"] + broke
        result.update(runner.runner_for(impl).identity())
        if not impl.checks_gradients:  # a borrowed backward is never a pass of this path's gradients
            result["gradients"] = backward_note(impl)
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
    broken = {name: p["failed_cases"] for name, p in report["paths"].items() if p["verdict"] == "fail"}
    if report.get("inputs", {}).get("verdict") == "fail":  # a broken router: every path ran on its routing
        broken = {"inputs": report["inputs"]["failed_cases"], **broken}
    if report.get("quantization", {}).get("verdict") == "fail":  # every path ran on the badly quantized inputs
        broken = {"quantization": report["quantization"]["failed_cases"], **broken}
    apart = {name: p["cannot_run_here"] for name, p in report["paths"].items()
             if p["verdict"] == failures.CANNOT_RUN_HERE}
    if apart:  # never a broken contract: no speed, and named apart
        report["cannot_run_here"] = apart
    report["verdict"] = "fail" if broken else "pass"
    first = next(iter(broken), None)
    report["first_failure"] = f"{first}: {broken[first][0]}" if first else None
    report["headline"] = parity_headline(cfg.precision.name, broken, apart)
    write_json(out / "parity.json", report)
    if broken:
        raise ContractBroken(report["headline"])
    return report


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


def refusals(out: Path) -> dict[str, str]:
    """Why each path that did not pass parity gets no speed: FAILED_PARITY, or that it cannot run here and why
    (none where no parity stage ran: a curve of the paths it is given)."""
    found: dict[str, str] = {}
    recorded = read_json(out / "parity.json")["paths"] if (out / "parity.json").exists() else {}
    for name, p in recorded.items():
        if p["verdict"] == failures.CANNOT_RUN_HERE:
            gap = p["cannot_run_here"]
            found[name] = f"{failures.CANNOT_RUN_HERE}: {gap['reason']} (runs on {gap['runs_on']}): no speed"
        elif p["verdict"] != "pass":
            found[name] = FAILED_PARITY
    return found


BACKWARD_RULE = ('each path\'s "backward": "own" (its gradients checked as the forward is), another path\'s name '
                 '(borrowed: its gradients are that path\'s math, shown as not checked, never a pass) or "none" '
                 '(forward-only)')

ADVERSARIAL_NOTE = ("adversarial-input cases (large, growing and near one-hot logits) are held to the max-error "
                    "rules, per tensor and per row, not to the elementwise atol/rtol count: at their magnitudes "
                    "(scores to ±40, gradients to ~26) the plain reference math in the same precision is itself "
                    "outside atol/rtol on up to 26% of elements (bf16/fp16) and 0.05% (fp32). Input kinds in "
                    "the op's forward_only_inputs (attention: near_one_hot) check the forward outputs only")


def backward_note(impl: Impl) -> str:
    """Why a path's gradients are not checked as its own (Impl.backward)."""
    if impl.backward == NO_BACKWARD:
        return "none: a forward-only path (no gradients, no forward+backward time, no training)"
    return f"not checked: the backward is borrowed from the {impl.backward!r} path's math, not this path's"


def passed_parity(out: Path) -> dict[str, bool]:
    """Which paths may carry speed numbers: the reference, and every path whose parity verdict is pass."""
    verdicts = {name: p["verdict"] == "pass" for name, p in read_json(out / "parity.json")["paths"].items()}
    return {REFERENCE: True, **verdicts}


# --- microbench --------------------------------------------------------------------------


def compare(a: Timing | dict[str, Any], b: Timing | dict[str, Any]) -> str:
    """Is `a` faster than `b`? Only when their spread bands do not overlap (BAND_RULE)."""
    a_p20, a_p80 = (a.p20_ms, a.p80_ms) if isinstance(a, Timing) else (a["p20_ms"], a["p80_ms"])
    b_p20, b_p80 = (b.p20_ms, b.p80_ms) if isinstance(b, Timing) else (b["p20_ms"], b["p80_ms"])
    if a_p80 < b_p20:
        return "faster"
    if a_p20 > b_p80:
        return "slower"
    return "no measurable difference"


TIMED_RESULT_RULE = ("after timing, each timed path is called on one of its timed input sets and its outputs checked "
                     "against the float64 oracle; then those buffers are refilled in place with new values (another "
                     "seed) and the check repeated: a path returning a stored result for inputs it has seen fails "
                     "and gets no speed. Forward: the output; forward + backward: every output and gradient, "
                     "under the parity stage's rules")
IMPOSSIBLE_RULE = ("a median under {fraction:g} x the roofline's minimum time (the FLOPs of what was timed, forward "
                   "or forward + backward, at the fastest calibrated GEMM peak among the formats at least as precise "
                   "as the point's: a path may compute wider, never narrower; where none is calibrated here, the "
                   "best of any dtype) is refused as impossible; the bytes roof is not "
                   "used: a working set that fits the caches moves faster than the calibrated DRAM copy bandwidth "
                   "(torch's rms_norm measured at 1.5x it on a 132 KB point)")
FRESH_SEED = 104_729  # added to a case's seed for the refreshed inputs of the timed-result check


def parity_paths(op: OpDef, cfg: LabConfig, out: Path) -> dict[str, Impl]:
    """The point's paths with each one's backward as parity.json recorded it (a user path's result may declare
    it forward-only) and, for a path that launched Triton kernels (a user's), kind "triton" when interpreted."""
    recorded = read_json(out / "parity.json")["paths"] if (out / "parity.json").exists() else {}
    paths = {}
    for name, impl in runner.paths(op, cfg).items():
        entry = recorded.get(name, {})
        impl = dataclasses.replace(impl, backward=entry.get("backward", impl.backward))
        if impl.kind != "triton" and entry.get("launched"):
            impl = dataclasses.replace(impl, kind="triton")  # it runs Triton: interpreted, it is not speed
        paths[name] = impl
    return paths


def roofline_floor_s(flops: float, calibration: dict[str, Any], peak_flops: float | None = None) -> float:
    """The least time the calibrated device allows a call: its FLOPs at `peak_flops`, the fastest GEMM peak among the
    formats at least as precise as the point's (calibrate.floor_peak); where none is calibrated (None), the best GEMM
    peak of any dtype (IMPOSSIBLE_RULE: why not the bytes at the copy bandwidth)."""
    best = peak_flops or max([v for v in (calibration["peaks"].get("gemm_flops_per_s") or {}).values() if v] or [0.0])
    return flops / best if best else 0.0


def impossible(median_ms: float, flops: float, calibration: dict[str, Any], peak_flops: float | None,
               fraction: float, what: str = "forward") -> str | None:
    """IMPOSSIBLE_RULE on one median: None, or why it cannot be this many FLOPs' time."""
    floor_s = roofline_floor_s(flops, calibration, peak_flops)
    if floor_s and median_ms / 1e3 < fraction * floor_s:
        return (f"impossible: {what} median {median_ms:.4g} ms is under {fraction:g} x the roofline's "
                f"minimum {floor_s * 1e3:.4g} ms ({flops:.4g} FLOP at the calibrated GEMM peak): no speed")
    return None


def _timed_result_check(op: OpDef, cfg: LabConfig, case: Case, impl: Impl, inputs: Tensors,
                        grad_out: torch.Tensor | None = None) -> str | None:
    """TIMED_RESULT_RULE: None if the path computed what was timed, else why not. With `grad_out`, the forward +
    backward: every output and gradient against the oracle's, as the parity stage checks them."""
    saved = {name: x.clone() for name, x in inputs.items()}
    fresh = op.make_inputs(dataclasses.replace(case, seed=case.seed + FRESH_SEED), _dtype(cfg), str(
        next(iter(inputs.values())).device.type))
    try:
        for label, values in (("the timed inputs", None), ("new values in the same buffers", fresh)):
            if values is not None:
                for name, x in inputs.items():
                    x.copy_(values[name])
            reason = (_check_forward(op, cfg, case, impl, inputs) if grad_out is None else
                      _check_forward_backward(op, cfg, case, impl, inputs, grad_out))
            if reason:
                what = "forward" if grad_out is None else "forward + backward"
                return f"timed result check failed on {label} ({what}): {reason} (a stored result?): no speed"
    except Exception as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"timed result check raised {type(exc).__name__}: {message}"
    finally:
        for name, x in inputs.items():
            x.copy_(saved[name])
    return None


def _check_forward(op: OpDef, cfg: LabConfig, case: Case, impl: Impl, inputs: Tensors) -> str | None:
    oracle = reference_outputs(op, cfg, cast_floats(inputs, torch.float64), case)["out"].cpu()
    baseline = reference_outputs(op, cfg, inputs, case)["out"].cpu()
    with torch.no_grad():
        got = impl.fn(inputs, cfg)["out"]
    check = parity.check_output(got.detach().cpu(), oracle, baseline, cfg.precision.contract)
    return None if check["verdict"] == "pass" else check["reason"]


def _check_forward_backward(op: OpDef, cfg: LabConfig, case: Case, impl: Impl, inputs: Tensors,
                            grad_out: torch.Tensor) -> str | None:
    oracle = reference_outputs(op, cfg, cast_floats(inputs, torch.float64), case, each(grad_out, torch.Tensor.double))
    baseline = reference_outputs(op, cfg, inputs, case, grad_out)
    worst_gradient_baseline(op, cfg, inputs, case, grad_out, oracle, baseline)
    with torch.no_grad():
        got = dict(impl.fn(inputs, cfg))
    got.update(gradients(lambda x: impl.fn(x, cfg), inputs, grad_out))
    record = {"case": asdict(case), "oracle": _to_cpu(oracle), "baseline": _to_cpu(baseline)}
    result = _check_path(op, impl, cfg, [record], [_to_cpu({k: v for k, v in got.items()
                                                            if isinstance(v, torch.Tensor)})])
    return None if result["verdict"] == "pass" else result["failed_cases"][0]


STATE_RULE = ("torch's thread count, grad mode, anomaly detection, default dtype and backends flags are read around "
              "every timed region: a path that changes them is named, gets no speed, and the state is put back")


COST_MODEL_RULE = ("each path is placed on the roofline with its own FLOPs and bytes, from the model the op declares "
                   "for its kind of path (paths.<name>.costs: the formula beside each figure; the reference's "
                   "materialised (S, S) traffic, a fused kernel's re-reads per tile); a path that declares none is "
                   "placed with the op's floor, and its costs say so (model 'floor'). The top-level flops and bytes "
                   "are the floor; gflops_per_s is the floor's FLOPs per second, gbytes_per_s the path's own bytes")


def _placed(flops: float, nbytes: float, seconds: float, working_set: int, *, calibration: dict[str, Any],
            peak_flops: float | None, peak_bandwidth: float, cache_bytes: int | None, floor_flops: float | None,
            precision: tuple, device: str, local: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """One timed call on the roofline at its own FLOPs, bytes and working set (the last-level cache is compared
    with the working set). Above the calibrated FLOP peak, the peak is doubted first (calibrate.LOCAL_RULE):
    remeasured at the path's own size in the point's dtype, and the call placed against the larger; `peak_used`
    says which peak and why. None where the point's dtype has no calibrated peak."""
    if not peak_flops:
        return None
    common = dict(peak_flops=peak_flops, peak_bytes_per_s=peak_bandwidth, cache_bytes=cache_bytes,
                  working_set_bytes=working_set)
    roof = roofline.roofline(flops, nbytes, seconds, widest_flops=floor_flops, **common)
    calibrated = {"source": "calibration", "flops_per_s": roof["ceiling_flops_per_s"],
                  "n": (calibration.get("method") or {}).get("gemm_sizes"),
                  "why": "the calibrated GEMM peak (the fastest of the formats at least as precise as the point's)"}
    if roof["achieved_flops_per_s"] <= roof["ceiling_flops_per_s"]:
        return {**roof, "peak_used": calibrated}
    dtype = "tf32" if precision[1] else precision[0]
    n = max(16, round((flops / 2) ** (1 / 3)))
    if n not in local:
        local[n] = calibrate.local_peak(flops, dtype, device)
    remeasured = local[n]
    if not remeasured.get("best_flops_per_s"):
        return {**roof, "peak_used": {**calibrated, "remeasured": remeasured}}
    widest = max(floor_flops or 0.0, remeasured["best_flops_per_s"])
    again = roofline.roofline(flops, nbytes, seconds, widest_flops=widest, **common)
    return {**again, "peak_used": {
        "source": "remeasured" if widest > roof["ceiling_flops_per_s"] else "calibration",
        "flops_per_s": again["ceiling_flops_per_s"], "n": remeasured["n"], "dtype": dtype,
        "why": (f"the path ran at {roof['achieved_flops_per_s'] / 1e9:.3g} GFLOP/s, above the calibrated "
                f"{roof['ceiling_flops_per_s'] / 1e9:.3g}: the peak was remeasured at its own size (a {remeasured['n']}"
                f"^3 {dtype} GEMM, fastest of {remeasured['reps']} calls: {remeasured['best_flops_per_s'] / 1e9:.3g} "
                "GFLOP/s)" + ("" if again["above_roof"] is None else "; still above it: no speed")),
        "calibrated_flops_per_s": roof["ceiling_flops_per_s"], "remeasured": remeasured}}


@closed_after
def run_microbench(cfg: LabConfig, out: Path, calibration: dict[str, Any],
                   calibration_problem: str | None = None) -> dict[str, Any]:
    """Warmed timing, memory and roofline of every path that passed parity, then the measured curve.

    On the point's own shape each path is timed twice: the forward (the outputs every path
    returns; nothing extra), and forward + backward (what a training step runs), each with
    its achieved FLOP/s from the op's formulas (the backward's multiple written beside it),
    the peak memory of one forward, and the roofline class against `calibration`'s peaks. A
    speedup is a ratio of medians; "faster" is declared only when the spread bands do not
    overlap. Then every valid path over the op's curve axes (`shape.curve`, ...), each size
    parity-checked first, forward and with bench.curve_backward forward + backward too (curve.csv,
    plots, crossovers: _curve). Triton through its interpreter is never timed. `calibration_problem`: why
    `calibration` is not what the calibrate stage wrote (lab/pipeline.py `calibration`): then no path but the
    reference gets a speed, since its peaks decide which speeds are possible.
    """
    from posttrainllm.track import plots  # matplotlib: imported by the one stage that draws

    op = op_for(cfg)
    device = devices.prepare(cfg.device.name, cfg.bench.threads)
    passed = passed_parity(out)
    refused_by_parity = refusals(out)
    case = next(c for c in op.cases(cfg) if c.main)
    costs = op.costs(case, cfg)
    bench = cfg.bench
    sets = rooms.input_sets(op, case, _dtype(cfg), device, bench.input_sets)  # values; every path copies them
    with torch.no_grad():
        grad_outs = [upstream_gradients(op, c, op.reference.fn(x, cfg)) for c, x in sets]
    inputs = sets[0][1]
    quantize = cfg.precision.quantize
    precision = (cfg.precision.dtype, cfg.precision.allow_tf32 and device == "cuda",
                 quantize.format if quantize is not None else None)
    peak_flops, peak_bandwidth = calibrate.peak_for(calibration, *precision)
    floor_flops = calibrate.floor_peak(calibration, *precision)  # IMPOSSIBLE_RULE's peak
    report: dict[str, Any] = {"device": device, "threads": torch.get_num_threads(), "case": case.name,
                              "problem": op.problem(case), "flops": costs.flops, "bytes": costs.bytes,
                              "train_flops": costs.train_flops, "flops_formula": costs.flops_formula,
                              "bytes_formula": costs.bytes_formula, "backward_formula": costs.backward_formula,
                              "noisy_rule": NOISY_RULE, "band_rule": BAND_RULE, "roofline_rule": roofline.RULE,
                              "peaks": {"gemm_flops_per_s": peak_flops, "copy_bytes_per_s": peak_bandwidth},
                              "paths": {}}
    settings = dict(warmup=bench.warmup, reps=bench.reps, min_time_s=bench.min_time_s, max_reps=bench.max_reps)
    report["timed_result_rule"] = TIMED_RESULT_RULE
    report["impossible_rule"] = IMPOSSIBLE_RULE.format(fraction=bench.impossible_below)
    report["rotation_rule"] = rooms.ROTATION_RULE.format(n=len(sets))
    report["state_rule"] = STATE_RULE
    report["calibration"] = {"sha256": calibration.get("sha256"), "problem": calibration_problem}
    report["above_roof_rule"] = roofline.ABOVE_ROOF_RULE
    cache_bytes = devices.last_level_cache_bytes(device)
    report["last_level_cache_bytes"] = cache_bytes
    report["cost_models"] = COST_MODEL_RULE
    local_peaks: dict[int, dict[str, Any]] = {}  # calibrate.local_peak per GEMM size, measured at most once here
    rows, timings = [], {}
    with devices.fp32_matmuls(tf32=cfg.precision.allow_tf32):
        for name, impl in parity_paths(op, cfg, out).items():
            if not passed.get(name, False):
                report["paths"][name] = {"valid": False, "reason": refused_by_parity.get(name, FAILED_PARITY)}
                continue
            if _interpreted(impl):
                report["paths"][name] = {"valid": False, "reason": INTERPRETER_NOT_SPEED}
                continue
            mine = [rooms.fresh(x, device) for _, x in sets]  # this path's own buffers of every input set
            dos = [each(g, torch.Tensor.clone) for g in grad_outs]
            stops = runner.continued()  # SIGNAL_RULE: the lab stopped and continued while this path is timed
            try:  # a compiled peer that would run eagerly at this shape raises (opdefs/peers.py NotCompiled)
                timed = runner.runner_for(impl).time(op, cfg, case, mine, dos, device, settings)
            except Exception as exc:
                report["paths"][name] = {"valid": False, "reason": f"{type(exc).__name__}: {exc}".splitlines()[0]}
                continue
            if runner.continued() != stops:
                stopped = f"the lab process was stopped and continued while {name} was timed (outside.SIGNAL_RULE)"
                if name == REFERENCE:
                    raise RuntimeError(f"{stopped}: every speedup is a ratio to it")
                report["paths"][name] = {"valid": False, "reason": f"{stopped}: no speed", **timed.entry}
                continue
            forward, train, memory, first_call_ms, state = (timed.forward, timed.train, timed.memory,
                                                            timed.first_call_ms, timed.refused)
            refused = None if name == REFERENCE else (
                (calibration_problem and f"{calibration_problem}: its peaks decide the impossible-time floor: no speed")
                or state or forward.other_streams or (train is not None and train.other_streams) or None
                or _timed_result_check(op, cfg, case, impl, mine[0])
                or impossible(forward.median_ms, costs.flops, calibration, floor_flops, bench.impossible_below)
                or (train is not None and (
                    _timed_result_check(op, cfg, case, impl, mine[0], grad_out=dos[0])
                    or impossible(train.median_ms, costs.train_flops, calibration, floor_flops,
                                  bench.impossible_below, "forward + backward"))) or None)
            if refused:  # the path's numbers were right in parity, but what was timed was not that function
                report["paths"][name] = {"valid": False, "reason": refused, "first_call_ms": first_call_ms,
                                         **timed.entry}
                continue
            timings[name] = (forward, train)
            seconds = forward.median_ms / 1e3
            mine_costs = op.costs_of(impl, case, cfg)  # this path's own FLOPs and bytes (Impl.cost_model)
            place = functools.partial(_placed, calibration=calibration, peak_flops=peak_flops,
                                      peak_bandwidth=peak_bandwidth, cache_bytes=cache_bytes, floor_flops=floor_flops,
                                      precision=precision, device=device, local=local_peaks)
            report["paths"][name] = {
                "first_call_ms": first_call_ms,
                "valid": True, **forward.summary(),
                "gflops_per_s": costs.flops / seconds / 1e9, "gbytes_per_s": mine_costs.bytes / seconds / 1e9,
                "memory": memory,
                "costs": mine_costs.record(),
                "roofline": place(mine_costs.flops, mine_costs.bytes, seconds, mine_costs.live_bytes),
                "backward": impl.backward, **timed.entry,
                "forward_backward": (
                    {"valid": False, "reason": backward_note(impl)} if train is None else
                    {**train.summary(), "gflops_per_s": costs.train_flops / (train.median_ms / 1e3) / 1e9,
                     "roofline": place(mine_costs.train_flops, mine_costs.train_bytes, train.median_ms / 1e3,
                                       mine_costs.live_bytes) if mine_costs.train_bytes else None}),
            }
            above = (report["paths"][name]["roofline"] or {}).get("above_roof")
            if above and name != REFERENCE:  # a fraction above 1 is not a result (roofline.ABOVE_ROOF_RULE)
                report["paths"][name] = {"valid": False, "reason": f"above the roofline: {above}: no speed",
                                         "first_call_ms": first_call_ms}
                del timings[name]
                continue
            if above:  # the baseline stays timed (speedups are ratios to it); the figure is named, not a result
                report.setdefault("notes", []).append(f"the reference is above the roofline: {above}")
            for mode, timing in (("forward", forward), ("forward_backward", train)):
                rows += [{"impl": name, "mode": mode, "rep": i, "ms": ms}
                         for i, ms in enumerate(timing.samples_ms if timing else [])]
    if REFERENCE not in timings:  # every speedup is a ratio to it: without it the stage has no result to give
        raise RuntimeError(f"the reference could not be timed: {report['paths'][REFERENCE].get('reason')}")
    ref_forward, ref_train = timings[REFERENCE]
    for name, (forward, train) in timings.items():
        if name == REFERENCE:
            continue
        entry = report["paths"][name]
        entry["speedup_vs_reference"] = ref_forward.median_ms / forward.median_ms
        entry["vs_reference"] = compare(forward, ref_forward)
        if train is not None:
            entry["forward_backward"]["speedup_vs_reference"] = ref_train.median_ms / train.median_ms
            entry["forward_backward"]["vs_reference"] = compare(train, ref_train)
    timed = list(timings)
    if op.describe is not None:  # what the op measures of its own case beyond time (MoE: the routing's histogram)
        report["describe"] = op.describe(case, inputs, cfg, measure)
    ridge = max(peak_flops, floor_flops or 0.0) / peak_bandwidth if peak_flops else None  # FLOP/B
    stops = runner.continued()
    report["curve"] = _curve(cfg, op, out, device, timed, calibration, floor_flops, cache_bytes=cache_bytes,
                             ridge=ridge)
    if runner.continued() != stops:
        raise RuntimeError("the lab process was stopped and continued while it timed the curve (outside.SIGNAL_RULE)")
    for name, impl in runner.paths(op, cfg).items():  # after every timed call and curve size (compiled: per signature)
        if impl.evidence is not None and name in report["paths"]:
            report["paths"][name]["evidence"] = impl.evidence()
    write_json(out / "microbench.json", report)
    with open(out / "timings.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["op", "impl", "mode", "rep", "ms", "device", "threads", "problem"])
        writer.writeheader()
        for row in rows:
            writer.writerow({"op": op.name, **row, "device": device, "threads": report["threads"],
                             "problem": report["problem"]})
    # every timed path at its intensity and achieved rate, against each calibrated dtype's roof; drawn even where
    # the point's own dtype has no calibrated peak (an fp8 point on a CPU: its paths then have no roofline entry)
    lines = [{"label": name, "intensity_flops_per_byte": entry["costs"]["flops_per_byte"],
              "achieved_flops_per_s": entry["costs"]["flops"] / (entry["median_ms"] / 1e3),
              "model": entry["costs"]["model"]}
             for name in timed if (entry := report["paths"][name]).get("gflops_per_s")]
    title = f"{op.name} {report['problem']}"
    if not peak_flops:
        title += f"\n(no {cfg.precision.quantize.format if cfg.precision.quantize else cfg.precision.dtype} peak "\
                 "calibrated here: the other dtypes' roofs)"
    plots.roofline_plot(lines, calibration["peaks"], out / "roofline.png", title=title,
                        dtype=calibrate.peak_key(calibration, *precision))  # the point's own roof only
    return report


def _curve(cfg: LabConfig, op: OpDef, out: Path, device: str, timed: list[str], calibration: dict[str, Any],
           floor_flops: float | None, *, cache_bytes: int | None = None, ridge: float | None = None) -> dict[str, Any]:
    """The timed paths over every curve axis of the op (shape.curve; its extra_curves), forward and, with
    bench.curve_backward, forward + backward; each size parity-checked before it is timed: curve.csv + plots,
    and each path's crossover with the reference per axis and mode. Each size's timing rotates over the point's
    number of input sets, and after it the timed-result check and the impossible-time floor apply (a size that
    fails them keeps no time: valid False, the reason).

    The check is the forward output's against the float64 oracle (_check_at); it gates both modes. The
    gradients of the same function are checked by the parity stage on the point's cases, not per size."""
    from posttrainllm.measure import curves
    from posttrainllm.track import plots  # pandas, matplotlib: only this stage needs them

    revision = git_revision()["revision"]
    bench = cfg.bench
    settings = dict(warmup=bench.warmup, reps=bench.reps, min_time_s=bench.min_time_s, max_reps=bench.max_reps)
    modes = [curves.FORWARD, curves.FORWARD_BACKWARD] if bench.curve_backward else [curves.FORWARD]
    paths = parity_paths(op, cfg, out)
    rows = []
    with devices.fp32_matmuls(tf32=cfg.precision.allow_tf32):
        for axis in op.curve_axes:
            for x in sorted(axis.sizes(cfg)):
                case = axis.case(cfg, x)
                costs = op.costs(case, cfg)
                sets = rooms.input_sets(op, case, _dtype(cfg), device, bench.input_sets)
                with torch.no_grad():
                    checks = _check_at(op, cfg, case, rooms.fresh(sets[0][1], device), timed)
                    grad_outs = ([upstream_gradients(op, c, op.reference.fn(s, cfg)) for c, s in sets]
                                 if curves.FORWARD_BACKWARD in modes else [])
                for name in timed:
                    impl = paths[name]
                    run = runner.runner_for(impl)
                    mine_costs = op.costs_of(impl, case, cfg)  # the path's own traffic at this size
                    labels = dict(op=op.name, impl=name, kind=impl.kind, x_name=axis.x_name, x_value=x,
                                  minimal_bytes=costs.bytes, working_set=mine_costs.live_bytes,
                                  cost_model=mine_costs.model, device=device, revision=revision)
                    mine = [rooms.fresh(s, device) for _, s in sets]  # this path's own buffers
                    dos = [each(g, torch.Tensor.clone) for g in grad_outs]
                    for mode in modes:
                        if mode == curves.FORWARD_BACKWARD and impl.backward == NO_BACKWARD:
                            continue  # a forward-only path has no forward + backward to time
                        if mode == curves.FORWARD:
                            flops = costs.flops
                            modelled = dict(path_flops=mine_costs.flops, bytes=mine_costs.bytes)
                        else:
                            flops = costs.train_flops
                            modelled = dict(path_flops=mine_costs.train_flops, bytes=mine_costs.train_bytes)
                        row, state = run.curve_row(op, cfg, case, mode, mine, dos, device, settings, checks[name],
                                                   dict(labels, mode=mode, flops=flops, **modelled))
                        if row["valid"] and name != REFERENCE:  # what was timed was this function, possibly
                            refused = (
                                state
                                or _timed_result_check(op, cfg, case, impl, mine[0],
                                                       grad_out=None if mode == curves.FORWARD else dos[0])
                                or impossible(row["median"], flops, calibration, floor_flops,
                                              bench.impossible_below, mode))
                            if refused:
                                row.update(median=math.nan, p20=math.nan, p80=math.nan, valid=False, reason=refused)
                        rows.append(row)
                    del mine, dos
                del sets, grad_outs
    frame = curves.frame(rows)
    frame.to_csv(out / "curve.csv", index=False)
    read = curves.regimes(frame, cache_bytes=cache_bytes, ridge=ridge,  # each path's regime per segment
                          caches=curves.cache_levels(device))
    why_not = refusals(out)
    skipped = {name: (INTERPRETER_NOT_SPEED if _interpreted(impl) else why_not.get(name, FAILED_PARITY))
               for name, impl in paths.items() if name not in timed}
    plots.time_vs_size(frame, out / "time_vs_size.png", regimes=read, omitted=skipped)
    plots.memory_vs_size(frame, out / "memory_vs_size.png")
    found = curves.crossovers(frame, [name for name in timed if name != REFERENCE])
    headline = next(c for c in found if c["x_name"] == op.x_name and c["mode"] == curves.FORWARD)
    return {"x_name": op.x_name, "x_values": sorted(op.curve_sizes(cfg)), "modes": modes, "skipped": skipped,
            "band_rule": BAND_RULE, "check": CURVE_CHECK,
            "crossover_vs_reference": headline["vs_reference"],  # x_name, forward: what the report shows
            "crossovers": found,  # every axis and mode
            "regimes": read, "regime_rule": curves.REGIME_RULE,
            "unchecked_or_failed": sorted({f"{r['impl']}@{r['x_name']}={r['x_value']}" for r in rows
                                           if r["check"] != "pass"})}


CURVE_CHECK = ("each size: every timed path's forward output against the float64 oracle under the point's "
               "contract before timing (a size that fails is timed in no mode); after timing, per mode, the timed-result "
               "check and the impossible-time floor (a size that fails them keeps no time)")


def _check_at(op: OpDef, cfg: LabConfig, case: Case, inputs: Tensors, names: list[str]) -> dict[str, str]:
    """Each path's forward output at one curve size against the float64 oracle: "pass", or why not."""
    oracle = reference_outputs(op, cfg, cast_floats(inputs, torch.float64), case)["out"].cpu()
    baseline = reference_outputs(op, cfg, inputs, case)["out"].cpu()
    verdicts = {}
    for name in names:
        if name == REFERENCE:
            verdicts[name] = "pass"  # the in-precision baseline the contract is relative to
            continue
        try:
            got = runner.paths(op, cfg)[name].fn(inputs, cfg)["out"]
            check = parity.check_output(got.cpu(), oracle, baseline, cfg.precision.contract)
            verdicts[name] = "pass" if check["verdict"] == "pass" else f"failed parity: {check['reason']}"
        except Exception as exc:
            verdicts[name] = f"failed: {type(exc).__name__}: {exc}".splitlines()[0]
    return verdicts


# --- bench-train -------------------------------------------------------------------------


QUANTIZED_BASELINE = "bf16"  # under a quantized precision, bench-train's baseline: the same model, linear layers in bf16
AUTOCAST_OF = {"bfloat16": "bf16", "float16": "fp16"}  # a quantized precision's dtype -> bench-train's autocast


def quality_base_dir(cfg: LabConfig) -> Path:
    """Where the draft-heads base lives (lab/heads.py base_dir): the trained model the quality gate decodes with."""
    return Path(cfg.heads.out_dir) / "base"


@closed_after
def run_bench_train(cfg: LabConfig, out: Path, *, quality_base: Path | None = None) -> dict[str, Any]:
    """The model from `architecture`, trained with each implementation of the point's op swapped in.

    The implementations come from the op's registry (train.impls, or all; the reference
    first, the drift baseline), each swapped in by the op's own model hook: the function
    trained is the function checked and timed. A path that failed parity is not trained
    (recorded as skipped). Records the loss drift against the reference (the contract's
    train_loss_drift) and Amdahl's prediction from the forward+backward microbench speedup. Under a quantized
    precision, the quality gate decodes with the draft-heads base in `quality_base` (a DVC stage: the train_base
    stage's folder; None: under heads.out_dir, `quality_base_dir`).
    """
    from posttrainllm.model import amdahl
    from posttrainllm.model.train import Variant, bench_train
    from posttrainllm.model.transformer import ModelConfig

    op = op_for(cfg)
    if op.no_model is not None:  # no model hook (a problem file's op): nothing is trained, and the record says why
        result = {"impls": {}, "drift": {}, "drift_verdict": {}, "not_trained": op.no_model,
                  "skipped": {name: op.no_model for name in runner.train_impls(op, cfg)}}
        write_json(out / "bench_train.json", result)
        return result
    quantized = cfg.precision.quantize
    device = devices.prepare(cfg.device.name, cfg.bench.threads)
    arch, train = cfg.architecture, cfg.train
    model_fields = dict(vocab_size=256, d_model=arch.d_model, n_layers=arch.n_layers, n_heads=arch.n_heads,
                        n_kv_heads=arch.n_kv_heads, head_dim=arch.head_dim, mlp_hidden=arch.mlp_hidden,
                        mlp=arch.mlp, n_experts=arch.n_experts, top_k=arch.top_k, expert_hidden=arch.expert_hidden,
                        router_aux_coef=arch.router_aux_coef, max_seq_len=train.seq_len)
    model_cfg = ModelConfig(**{**model_fields, **op.model_overrides(cfg)})
    passed = passed_parity(out)
    refused = refusals(out)
    paths = parity_paths(op, cfg, out)
    variants, skipped = [], {}
    if quantized is not None:  # the baseline: the same model with F.linear in bf16 (what the fp8 recipe is against)
        variants.append(Variant(QUANTIZED_BASELINE))
    for name in runner.train_impls(op, cfg):
        if not passed.get(name, False):
            skipped[name] = refused.get(name, FAILED_PARITY)
            continue
        impl = paths[name]
        if impl.train_refusal:
            skipped[name] = impl.train_refusal
            continue
        if impl.backward == NO_BACKWARD and quantized is None:  # a quantized path trains by the recipe's backward
            skipped[name] = FORWARD_ONLY
            continue
        hooks = op.model_hooks(impl, cfg)
        interpreted = _interpreted(impl)
        variants.append(Variant(name, attention=hooks.attention, linear=hooks.linear, moe=hooks.moe, norm=hooks.norm,
                                rope=hooks.rope, swiglu=hooks.swiglu, loss=hooks.loss, add_norm=hooks.add_norm,
                                interpreted=interpreted,
                                steps=min(train.interpreted_steps, train.steps) if interpreted else None))
    trained = {v.name: runner.runner_for(paths[v.name]) for v in variants if v.name in paths}
    before = {name: run.before_training() for name, run in trained.items()}  # before any clock (a worker's start)
    common = dict(variants=variants, steps=train.steps, warmup_steps=train.warmup_steps, batch_size=train.batch_size,
                  seq_len=train.seq_len, lr=train.lr, seed=train.seed, device=device, skipped=skipped)
    if quantized is None:
        result = bench_train(model_cfg, precision=cfg.precision.name, **common)
    else:
        result = _train_quantized(cfg, model_cfg, common, device, quality_base or quality_base_dir(cfg))
    notes = runner.training_notes(trained, before, train.steps, device)  # a worker's round trips per step
    if notes:
        result["user_paths"] = notes
    limit = cfg.precision.contract.train_loss_drift
    result["drift_limit"] = limit
    result["drift_verdict"] = {name: "pass" if drift <= limit else "fail" for name, drift in result["drift"].items()}
    result["amdahl"] = amdahl.check(result, read_json(out / "microbench.json"), profiled_range=op.profiled_range,
                                    model_problem=op.model_problem(cfg))
    result["model_problem"] = op.model_problem(cfg)  # what the op's hook swapped into the model, in words
    write_json(out / "bench_train.json", result)
    broken = [f"loss drift of {name} exceeds train_loss_drift={limit:g}"
              for name, verdict in result["drift_verdict"].items() if verdict != "pass"]
    broken += [f"quality of {name}: {'; '.join(q['failed'])}"
               for name, q in (result.get("quality") or {}).get("variants", {}).items() if q["verdict"] != "pass"]
    if broken:
        raise ContractBroken(", ".join(broken))
    return result


def _train_quantized(cfg: LabConfig, model_cfg: Any, common: dict[str, Any], device: str,
                     folder: Path) -> dict[str, Any]:
    """bench-train under a quantized precision: every variant trained on the corpus's head under the precision's
    16-bit autocast (the bf16 baseline with F.linear, each fp8 path through the recipe, ops/matmul/definition.py), scored
    on its held-out tail; then the draft-heads base decodes held-out prompts with each path's fp8 linear layers
    against bf16 ones (model/quality.py). The `quality` section and its verdicts join the result."""
    from posttrainllm.lab.configure import check_train_rules
    from posttrainllm.model import quality
    from posttrainllm.model.corpus import batch_at, load_corpus, prompts, split_tail
    from posttrainllm.model.train import bench_train

    check_train_rules(cfg)  # an op whose fp8 paths are forward-only (op=moe) has no training recipe: refused
    q, train = cfg.precision.quantize, cfg.train
    gate = q.quality
    try:  # before any training: the gate cannot run without it
        base, identity = quality.load_trained_base(folder)
    except FileNotFoundError:
        raise ConfigError(f"no draft-heads base under {folder}: the quality gate decodes with it; train it with "
                          "`dvc repro train_base` or `posttrainllm experimental train-heads`") from None
    corpus = load_corpus()
    head, tail = split_tail(corpus, gate.heldout_frac)
    try:
        held_prompts = prompts(tail, gate.prompts, gate.prompt_len, "eval").to(device)
    except ValueError as exc:
        raise ConfigError(f"precision.quantize.quality: {exc}") from None
    heldout = [batch_at(tail, i, batch_size=train.batch_size, seq_len=train.seq_len, seed=train.seed + 1)
               for i in range(gate.heldout_batches)]
    result = bench_train(model_cfg, precision=AUTOCAST_OF[cfg.precision.dtype], corpus=head, heldout=heldout,
                         **common)
    result["precision"] = cfg.precision.name
    result["quantize"] = {"recipe": q.recipe, "grad_format": q.grad_format,
                          "trained_on": f"the corpus's first {1 - gate.heldout_frac:.0%} ({head.n_bytes} bytes); "
                                        f"held-out loss over {gate.heldout_batches} batches of the rest"}
    base = base.to(device)
    paths = runner.paths(op_for(cfg), cfg)
    names = [v.name for v in common["variants"][1:]]
    linears = {name: op_for(cfg).model_hooks(paths[name], cfg).linear for name in names}
    interpreted = {name for name in names if _interpreted(paths[name])}
    greedy = quality.greedy_section(base, held_prompts, gate.new_tokens, linears, torch.nn.functional.linear)
    greedy["base"] = identity
    greedy["interpreted"] = sorted(interpreted)
    result["quality"] = quality.gate(result, greedy, gate)
    return result
