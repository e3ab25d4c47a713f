"""Bitwise where you can: is a path deterministic, and does a row get the same bits whatever else is in its batch?

Parity (lab/parity.py) asks whether a path is the same function as the float64 math, within a tolerance. These
two checks ask for equality, bit for bit, where a tolerance hides what matters to post-training (the trainer and
the sampler computing the "same" log-probabilities with other batch sizes and reduction orders):

Determinism (rule "determinism", posttrainllm/rules.py)
    The point's main case runs again twice, each time on the same values in fresh buffers, forward and (its own
    backward) gradients: with the kernel stage's own run, 3 runs. Each output and gradient of runs 2 and 3 is
    compared bitwise with run 1's: equal or not, the max |difference| and the first row that differs.
Batch invariance (rule "batch_invariance")
    The op says what one row is and which dim of each input and output is its batch (OpDef.batch_axis). The main
    case's first and last rows are computed alone (a batch of one each), in the main case's batch (run 1), and in
    two other batches (sizes N+1 and N+2, the rows at other positions, every other row a companion drawn from
    another seed). Each of those rows' forward outputs is compared bitwise with its own in the main batch: the
    forward is what a sampler and a trainer both compute (the gradients' bits are determinism's to check, and
    running backward in every batch would triple the cost). An op with no forward output of a row's own
    (cross-entropy's loss is a mean) compares its batched inputs' gradients instead; an op whose math depends on
    the batch's size (BatchAxis.fixed_size) keeps the main size and moves the rows.
Declared and required (rule "properties")
    A path promises properties (Impl.promises; a user path as its function's `promises` attribute, read in its
    worker); a point requires them (parity.require). A promised or required property that does not hold fails
    the path's parity with its first differing row; one neither promised nor required is reported, never judged.

Run at the parity cases' sizes (the main case), not the curve's. On a CPU these are properties of the code as it
runs there: Triton's interpreter and PyTorch's CPU kernels (INTERPRETED_NOTE); a GPU runs the same checks.
User paths are called through their worker (lab/isolation/worker.py): their code never runs in the lab's process.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch

from posttrainllm import rules
from posttrainllm.config import PROPERTIES, LabConfig
from posttrainllm.lab.isolation import rooms
from posttrainllm.ops.registry import Case, Impl, OpDef, Tensors

DETERMINISTIC, BATCH_INVARIANT = PROPERTIES
RUNS = 3  # the kernel stage's run and two more
DETERMINISM = rules.cite("determinism", runs=RUNS)  # the rule as a result cites it
COMPANION_SEED = 524_287  # companions draw from case.seed + this (away from parity's, timing's and rooms' seeds)
INTERPRETED_NOTE = ("on a CPU, determinism and batch invariance are properties of the code under Triton's interpreter "
                    "and PyTorch's CPU kernels, not of a GPU's")
MEASURE = {DETERMINISTIC: "determinism", BATCH_INVARIANT: "batch_invariance"}  # where each property is measured


# --- bitwise comparison ------------------------------------------------------------------------------------------


def _differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: True where the two tensors' bits differ (NaNs of the same bits are equal)."""
    a, b = a.detach().contiguous(), b.detach().contiguous()
    if a.dim() == 0:
        a, b = a.reshape(1), b.reshape(1)
    size = a.element_size()
    return (a.view(torch.uint8).reshape(*a.shape, size) != b.view(torch.uint8).reshape(*b.shape, size)).any(-1)


def compare(a: torch.Tensor, b: torch.Tensor, row_ndim: int = 1) -> dict[str, Any]:
    """`b` against `a` bit for bit: equal or not, the max |b − a| (float64; inf where one is not finite and they
    differ) and the index of the first row that differs (a row: the last `row_ndim` dims), None when equal."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"bitwise_equal": False, "max_abs_diff": float("inf"), "first_differing_row": None,
                "reason": f"{tuple(b.shape)} {b.dtype} against {tuple(a.shape)} {a.dtype}"}
    if not a.numel():
        return {"bitwise_equal": True, "max_abs_diff": 0.0, "first_differing_row": None}
    differs = _differing(a, b)
    if not differs.any():
        return {"bitwise_equal": True, "max_abs_diff": 0.0, "first_differing_row": None}
    diff = (a.detach().double() - b.detach().double()).abs()
    diff = torch.where(differs & ~torch.isfinite(diff), float("inf"), torch.where(differs, diff, 0.0))
    lead = tuple(differs.shape[:max(differs.dim() - row_ndim, 0)])
    first = int(differs.reshape(math.prod(lead), -1).any(-1).nonzero()[0, 0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(first), lead)] if lead else []
    return {"bitwise_equal": False, "max_abs_diff": float(diff.max()), "first_differing_row": index}


# --- running a path ----------------------------------------------------------------------------------------------


def run_once(impl: Impl, inputs: Tensors, grad_out: torch.Tensor | None, cfg: LabConfig, device: str) -> Tensors:
    """One call of `impl` on its own copy of `inputs`: its forward outputs and, given grad_out, its gradients, on the
    CPU. The same two calls the kernel stage makes (a forward on plain inputs, then the gradients' call)."""
    from posttrainllm.lab.oracle import each, gradients

    x = rooms.fresh(inputs, device)
    got = {k: v.detach() for k, v in impl.fn(x, cfg).items() if isinstance(v, torch.Tensor)}
    if grad_out is not None:
        got.update(gradients(lambda t: impl.fn(t, cfg), x, each(grad_out, lambda g: g.to(device, copy=True))))
    return {k: v.detach().cpu() for k, v in got.items()}


def _summary(outputs: dict[str, dict[str, Any]]) -> bool:
    return bool(outputs) and all(o["bitwise_equal"] for o in outputs.values())


def determinism(impl: Impl, inputs: Tensors, grad_out: torch.Tensor | None, first: Tensors, cfg: LabConfig,
                device: str, row_ndim: dict[str, int], case: str) -> dict[str, Any]:
    """Rule "determinism": runs 2.. of the main case against run 1 (`first`, the kernel stage's outputs)."""
    outputs: dict[str, dict[str, Any]] = {}
    for run in range(2, RUNS + 1):
        again = run_once(impl, inputs, grad_out, cfg, device)
        for name, want in first.items():
            got = again.get(name)
            check = compare(want, got, row_ndim.get(name, 1)) if got is not None else {
                "bitwise_equal": False, "max_abs_diff": float("inf"), "first_differing_row": None,
                "reason": f"run {run} did not return it"}
            have = outputs.get(name)
            if have is None or (have["bitwise_equal"] and not check["bitwise_equal"]):
                outputs[name] = {**check, "run": None if check["bitwise_equal"] else run}
            elif not check["bitwise_equal"]:
                have["max_abs_diff"] = max(have["max_abs_diff"], check["max_abs_diff"])
    return {"case": case, "runs": RUNS, "bitwise_equal": _summary(outputs),
            "outputs": outputs}


def _layout(n: int, targets: list[int], size: int, positions: list[int]) -> list[tuple[str, int]]:
    """A batch of `size` rows: target row targets[i] at positions[i], every other place a companion row (cycling)."""
    placed = dict(zip(positions, targets))
    companions = iter(range(10**9))
    return [("main", placed[p]) if p in placed else ("companion", next(companions) % n) for p in range(size)]


def batch_layouts(n: int, fixed_size: bool) -> tuple[list[int], list[tuple[str, list[tuple[str, int]]]]]:
    """The target rows (first and last of a main batch of n) and the other batches they run in: (label, layout)."""
    targets = sorted({0, n - 1})
    last = targets[-1]
    if fixed_size:  # the main size only: the rows swapped, then moved inward, among companions
        moves = [("moved", [n - 1 - t for t in targets])]
        if n >= 4:
            moves.append(("inward", [1 + (t != 0) * (n - 3) for t in targets]))
        return targets, [(f"{label} (size {n})", _layout(n, targets, n, pos)) for label, pos in moves
                         if pos != targets and len(set(pos)) == len(pos)]
    layouts = [(f"alone (row {t}, size 1)", [("main", t)]) for t in targets if n > 1]  # n = 1: the main batch
    layouts.append((f"size {n + 1}", _layout(n, targets, n + 1, [1 + t for t in targets[:-1]] + [n])))
    layouts.append((f"size {n + 2}", _layout(n, targets, n + 2, [n + 1 - (t == last) * n for t in targets])))
    return targets, layouts


def _assemble(layout: list[tuple[str, int]], sources: dict[str, Tensors], dims: dict[str, int]) -> Tensors:
    """The inputs of one batch: each batched tensor's rows per `layout`; shared tensors as the main case's."""
    out = {}
    for name, x in sources["main"].items():
        if name not in dims:
            out[name] = x
            continue
        dim = dims[name]
        out[name] = torch.cat([sources[src][name].narrow(dim, i, 1) for src, i in layout], dim)
    return out


def batch_invariance(op: OpDef, impl: Impl, case: Case, inputs: Tensors, grad_out: torch.Tensor | None,
                     main: Tensors, cfg: LabConfig, device: str) -> dict[str, Any]:
    """Rule "batch_invariance" for one path on the main case (`main`: its outputs there, the kernel stage's run 1)."""
    from posttrainllm.ops.base import point_dtype as _dtype

    axis = op.batch_axis
    if axis is None:
        return {"measured": False, "reason": f"op {op.name} declares no batch axis (OpDef.batch_axis)"}
    if case.quantize:
        return {"measured": False, "reason": "not under a quantized precision: a scale computed over the whole "
                                             "tensor makes a row's inputs depend on its batch"}
    dims = {name: d for name, d in axis.inputs.items() if name in inputs}
    n = next(inputs[name].shape[d] for name, d in dims.items())
    companions = op.make_inputs(dataclasses.replace(case, seed=case.seed + COMPANION_SEED), _dtype(cfg), "cpu")
    compared = {k: v for k, v in axis.outputs.items() if k in main}  # the forward's rows: what a sampler reads
    if not axis.outputs and grad_out is not None:  # no forward output is a row's (a mean): the rows' gradients
        compared = {f"grad_{k}": v for k, v in dims.items() if f"grad_{k}" in main}
    backward = grad_out if any(name.startswith("grad_") for name in compared) else None  # out is not batched
    sources = {"main": {k: v.cpu() for k, v in inputs.items()}, "companion": companions}
    targets, layouts = batch_layouts(n, axis.fixed_size)
    outputs = {name: {"bitwise_equal": True, "max_abs_diff": 0.0, "first_differing_row": None} for name in compared}
    sizes = [n]
    for label, layout in layouts:
        got = run_once(impl, _assemble(layout, sources, dims), backward, cfg, device)
        sizes.append(len(layout))
        for name, dim in compared.items():
            for position, (src, row) in enumerate(layout):
                if src != "main" or name not in got:
                    continue
                check = compare(main[name].narrow(dim, row, 1), got[name].narrow(dim, position, 1),
                                op.row_ndim.get(name, 1))
                entry = outputs[name]
                if check["bitwise_equal"]:
                    continue
                entry["max_abs_diff"] = max(entry["max_abs_diff"], check["max_abs_diff"])
                if entry["bitwise_equal"]:
                    within = check["first_differing_row"] or []
                    entry.update(bitwise_equal=False, first_differing_row={
                        "row": row, "batch": label, "batch_size": len(layout), "position": position,
                        "index": [row, *within[1:]] if within else [row]})  # batch dims are dim 0
    return {"measured": True, "row": axis.row, "case": case.name, "rows": targets,
            "batch_sizes": sorted(set(sizes)), "batches": [label for label, _ in layouts],
            "bitwise_equal": _summary(outputs), "outputs": outputs, **({"note": axis.note} if axis.note else {})}


def measure(op: OpDef, impl: Impl, record: dict[str, Any], first: Tensors, cfg: LabConfig,
            device: str) -> dict[str, Any]:
    """Both checks for one path on the main case's record (inputs, dO) and its run-1 outputs `first`; an exception
    in either is recorded as that check's, not raised."""
    case = Case(**record["case"])
    grad_out = record["grad_out"] if impl.checks_gradients else None
    first = {k: v for k, v in first.items() if isinstance(v, torch.Tensor)}
    found: dict[str, Any] = {}
    started = time.perf_counter()
    for key, check in (("determinism", lambda: determinism(impl, record["inputs"], grad_out, first, cfg, device,
                                                           op.row_ndim, case.name)),
                       ("batch_invariance", lambda: batch_invariance(op, impl, case, record["inputs"], grad_out,
                                                                     first, cfg, device))):
        try:
            found[key] = check()
        except Exception as exc:  # the path's, recorded: a judged property it cannot show fails
            found[key] = {"measured": False, "reason": f"raised {type(exc).__name__}: {str(exc).splitlines()[0]}"
                          if str(exc) else f"raised {type(exc).__name__}"}
    found["seconds"] = time.perf_counter() - started  # what the two checks added to the kernel stage
    return found


# --- judging -----------------------------------------------------------------------------------------------------


def _first_difference(measured: dict[str, Any]) -> str:
    """The first output that differs and where, in one line."""
    for name, o in measured.get("outputs", {}).items():
        if o["bitwise_equal"]:
            continue
        where = o.get("first_differing_row")
        if isinstance(where, dict):  # batch invariance
            return (f"{name} row {where['index'] or where['row']} in the batch '{where['batch']}' (size "
                    f"{where['batch_size']}, at {where['position']}) differs from the main batch's, max |diff| "
                    f"{o['max_abs_diff']:.3g}")
        return (f"{name} run {o.get('run')} differs from run 1 at row {where}, max |diff| {o['max_abs_diff']:.3g}"
                + (f" ({o['reason']})" if o.get("reason") else ""))
    return measured.get("reason") or "no output compared"


def judge(measured: dict[str, Any], promised: tuple[str, ...] | list[str] | None,
          required: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Rule "properties": per property, whether it holds, whether it is judged (promised, required) and the failures."""
    promised = list(promised or [])
    failures = [f"promises: unknown property {p!r}: valid choices are {', '.join(PROPERTIES)}"
                for p in promised if p not in PROPERTIES]
    verdicts: dict[str, Any] = {}
    for prop, key in MEASURE.items():
        m = measured.get(key) or {"measured": False, "reason": "not measured: the path did not run"}
        holds = bool(m.get("bitwise_equal")) if m.get("measured", True) else None
        why = [w for w, on in (("promised by the path", prop in promised), ("required by parity.require",
                                                                             prop in required)) if on]
        verdicts[prop] = {"holds": holds, "judged": bool(why), **({"by": why} if why else {})}
        if why and not holds:
            reason = _first_difference(m) if holds is False else f"not shown: {m.get('reason')}"
            verdicts[prop]["verdict"] = "fail"
            failures.append(f"{prop} ({', '.join(why)}): {reason}")
        elif why:
            verdicts[prop]["verdict"] = "pass"
    return verdicts, failures


def promises_of(impl: Impl, recorded: list[str] | None) -> list[str]:
    """What a path promises: as its runner read them when it ran (`recorded`, kernel.json's `promises`: a worker
    reads a user function's), else its Impl.promises."""
    return list(recorded) if recorded is not None else list(impl.promises)
