"""DVC stage 'kernel': every optimized path on the reference's inputs, guarded (kernel.pt, kernel.json,
tracebacks/), with its launch geometry, bitwise invariance measured, and its compile report.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from posttrainllm import rules
from posttrainllm.config import LabConfig
from posttrainllm.lab import runner
from posttrainllm.lab.isolation import guards, rooms
from posttrainllm.measure import device as devices
from posttrainllm.ops.registry import Case, OpDef, Tensors, case_config, replaced_library
from posttrainllm.lab.oracle import each, gradients, named
from posttrainllm.ops.registry import op_for  # the point's op: a built-in, or one made from op.file (op=problem)
from posttrainllm.lab.runner import closed_after  # a stage's workers end with it
from posttrainllm.track import failures
from posttrainllm.track.records import KernelPath, KernelRecord
from posttrainllm.lab.stages.common import load_reference, to_cpu


class DidNotRun(RuntimeError):
    """A path's forward call raised (its message: "<Type>: <first line>"; the exception is its __cause__), its
    backward raised what this machine cannot run (track/failures.py), or its forward returned no dict of tensors."""


UPSTREAM_GRADIENT = "upstream gradient dO"  # how a guard names the gradient fed to a backward


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
    from posttrainllm.lab import invariance  # the kernel and parity stages' alone (its `loads` in lab/reads.py)

    op = op_for(cfg)
    device = devices.prepare(cfg.device.name, cfg.bench.threads)
    shutil.rmtree(out / failures.TRACEBACKS, ignore_errors=True)  # an earlier run's: none of them describe this one
    (out / failures.TRACEBACKS).mkdir(parents=True)  # a DVC out of this stage: there even when no path raised
    ref = load_reference(out)
    main_case = Case(**ref.records[0]["case"])
    outputs: dict[str, list[Tensors] | None] = {}
    paths: dict[str, KernelPath] = {}
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
            entry = KernelPath(kind=impl.kind, backend=impl.backend, problem=op.problem(main_case), geometry=geometry,
                               emulation=run.emulation(cfg), violations=[], launched={}, **run.identity())
            launched: Counter = Counter()
            raised: list[dict[str, Any]] = []  # its located failures (track/failures.py), the first recorded
            try:
                backward = run.declared_backward(ref.records[0], cfg, device)
                entry.backward = backward
                impl = dataclasses.replace(impl, backward=backward)
                run = runner.runner_for(impl)
                results = []
                for record in ref.records:
                    got, violations = _run_case(run, record, case_config(Case(**record["case"]), cfg), device,
                                                launched, raised)
                    results.append(got)
                    entry.violations += [f"{record['case']['name']}: {v}" for v in violations]
                outputs[impl.name] = results
                # bitwise: the main case again (determinism) and its rows in other batches (lab/invariance.py)
                entry.invariance = invariance.measure(op, impl, ref.records[0], results[0],
                                                         case_config(main_case, cfg), device)
            except Exception as exc:  # a kernel that cannot run is a failed path, reported, not a crash
                outputs[impl.name] = None
                cause = exc.__cause__ if isinstance(exc, DidNotRun) else exc
                if cause is None:  # it returned no dict of tensors
                    entry.error = str(exc)
                else:
                    raised.insert(0, run.describe(cause))
                    entry.error = failures.line(raised[0])
            if raised:
                entry.failure = _recorded_failure(raised[0], out, impl.name)
            entry.launched = dict(sorted(launched.items()))  # Triton launches by kernel name, all cases
            entry.emulation = run.emulation(cfg, launched)  # known once it ran: the Triton kernels it launched
            # what it recorded of its calls (compiled: dynamo's graphs; a worker's start)
            paths[impl.name] = dataclasses.replace(entry, **run.evidence())
    if compiling is None and any(paths[name].launched for name in by_launch):
        compiling = _start_compile(op, cfg, out)
    compiled = None
    if compiling is not None:  # every Triton kernel of the paths compiled for compile.targets (lab/compile.py)
        from posttrainllm.lab import compile as compile_lab

        compiled = compile_lab.finish(*compiling)  # its kernel files go into the stamp (lab/reads.py)
    elif by_launch:
        compiled = {"targets": list(cfg.compile.targets), "rule": rules.cite("compile_counters"), "paths": {},
                    "rows": [], "note": NOTHING_TO_COMPILE}
    replaced = replaced_library()
    # the peers call what was bound when the lab started (ops/base.py LIBRARY), not these
    library_replaced = {"functions": replaced, "note": LIBRARY_REPLACED_NOTE} if replaced else None
    torch.save(outputs, out / "kernel.pt")
    record = KernelRecord(device=device, triton_interpreted=devices.triton_interpreted(), paths=paths,
                          compile=compiled, library_replaced=library_replaced)
    record.write(out / KernelRecord.FILE)
    return record.to_dict()


NOTHING_TO_COMPILE = ("no path launched a Triton kernel in this stage's calls (the worker counts a user path's "
                      "launches): nothing to compile")


def _start_compile(op: OpDef, cfg: LabConfig, out: Path) -> tuple[Any, Path, list[str], float] | None:
    """The compile child (lab/compile.py) when a path may launch Triton kernels (ours, a user's), else None.
    Imported here: only the kernel stage depends on it (its `loads` in lab/reads.py)."""
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
    return to_cpu(got), violations
