"""The reference's answers a path is checked against: its outputs, extra outputs and input gradients for a case,
in float64 (the oracle) or in the point's precision (the baseline), and the upstream gradient dO every backward
of a case is fed. The parity stage (lab/stages/) and the timing from outside (lab/isolation/outside.py) both use them."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from posttrainllm.config import LabConfig
from posttrainllm.lab import parity
from posttrainllm.ops.registry import Case, OpDef, Tensors
from posttrainllm.ops.base import leaves_of


Upstream = torch.Tensor | Tensors  # dO of "out" alone, or {output: its dO} for an op with more differentiable outputs


def upstream_gradient(case: Case, out: torch.Tensor, index: int = 0) -> torch.Tensor:
    """The dO fed to every backward of a case: standard normal from the case's seed, in out's dtype. `index`: the
    output's place in OpDef.differentiable_outputs (0, "out", draws what it always drew)."""
    gen = torch.Generator().manual_seed(case.seed + 1_000_003 + 7_919 * index)
    return torch.randn(out.shape, generator=gen, dtype=torch.float32).to(device=out.device, dtype=out.dtype)


def upstream_gradients(op: OpDef, case: Case, forward: Tensors) -> Upstream:
    """Every backward's upstream gradient of a case: one seeded dO per output in op.differentiable_outputs. An op
    whose only one is "out" gets the tensor itself, as before; more outputs, {output: dO} (add_rmsnorm: out and h,
    so that a backward ignoring h's gradient fails parity)."""
    names = op.differentiable_outputs
    if names == ("out",):
        return upstream_gradient(case, forward["out"])
    return {name: upstream_gradient(case, forward[name], i) for i, name in enumerate(names)}


def each(grad_out: Upstream, fn: Callable[[torch.Tensor], torch.Tensor]) -> Upstream:
    """`fn` applied to the upstream gradient, or to each output's (.double(), .cpu(), a copy on a device)."""
    return {name: fn(g) for name, g in grad_out.items()} if isinstance(grad_out, dict) else fn(grad_out)


def named(grad_out: Upstream, label: str) -> Tensors:
    """The upstream gradients by name for a guard's `unchanged` (`label`, or `label` of <output>)."""
    if isinstance(grad_out, dict):
        return {f"{label} of {name}": g for name, g in grad_out.items()}
    return {label: grad_out}


def differentiated(outputs: Tensors, grad_out: Upstream) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(outputs, their dO) to backpropagate: "out" always; another output where the path returned it attached to
    the graph (one it did not return, or returned detached, gets no gradient through it, so its inputs' gradients
    miss that term and fail parity)."""
    if not isinstance(grad_out, dict):
        return [outputs["out"]], [grad_out]
    keep = [name for name in grad_out if name == "out" or (isinstance(outputs.get(name), torch.Tensor)
                                                            and outputs[name].requires_grad)]
    return [outputs[name] for name in keep], [grad_out[name] for name in keep]


def backward(outputs: Tensors, grad_out: Upstream) -> None:
    """outputs' backward with their upstream gradients (a forward + backward call: the microbench's)."""
    if not isinstance(grad_out, dict):
        outputs["out"].backward(grad_out)
        return
    torch.autograd.backward(*differentiated(outputs, grad_out))


def cast_floats(inputs: Tensors, dtype: torch.dtype) -> Tensors:
    """The floating-point inputs in `dtype`; integer inputs (ids, indices) as they are."""
    return {name: x.to(dtype) if x.is_floating_point() else x for name, x in inputs.items()}


def gradients(fn: Callable[[Tensors], Tensors], inputs: Tensors, grad_out: Upstream) -> Tensors:
    """d(out · grad_out)/d(input) for every floating-point input: "grad_q", "grad_k", ... (the backward to check).
    With {output: dO}, d(Σ output · dO)/d(input) over the differentiable outputs (_pairs)."""
    leaves = leaves_of(inputs)
    wrt = {name: x for name, x in leaves.items() if x.requires_grad}
    if isinstance(grad_out, dict):
        outs, dos = differentiated(fn(leaves), grad_out)
        grads = torch.autograd.grad(outs, list(wrt.values()), dos, allow_unused=True)
        return {f"grad_{name}": g for name, g in zip(wrt, grads) if g is not None}
    out = fn(leaves)["out"]
    grads = torch.autograd.grad(out, list(wrt.values()), grad_out, allow_unused=True)
    return {f"grad_{name}": g for name, g in zip(wrt, grads) if g is not None}  # a missing one fails parity


def contract_for(cfg: LabConfig) -> Callable[[str], Any]:
    """Each output's contract: the logsumexp is fp32 in every precision and has its own."""
    return lambda output: cfg.precision.lse_contract if output == "lse" else cfg.precision.contract


def reference_outputs(op: OpDef, cfg: LabConfig, inputs: Tensors, case: Case,
                      grad_out: Upstream | None = None,
                      formulation: Callable[[Tensors, LabConfig], Tensors] | None = None) -> Tensors:
    """The reference's forward outputs, extra outputs and (given dO) input gradients, computed chunk by
    chunk (op.oracle_chunks) in the inputs' dtype, assembled into whole tensors. `formulation`: another readable
    formulation of the reference (op.gradient_baselines) in its place."""
    fn = lambda x: (formulation or op.reference.fn)(x, cfg)  # noqa: E731
    chunks = op.oracle_chunks(case)
    if chunks == [{}]:
        result = {**fn(inputs), **op.oracle_extra(inputs, cfg)}
        if grad_out is not None:
            result.update(gradients(fn, inputs, grad_out))
        return result
    result: Tensors = {}
    for chunk in chunks:
        piece = {name: x[chunk[name]] for name, x in inputs.items()}
        got = {**fn(piece), **op.oracle_extra(piece, cfg)}
        if grad_out is not None:
            got.update(gradients(fn, piece, {n: g[chunk[op.output_follows[n]]] for n, g in grad_out.items()}
                                 if isinstance(grad_out, dict) else grad_out[chunk[op.output_follows["out"]]]))
        for name, value in got.items():
            index = chunk[op.output_follows[name]]
            if name not in result:
                shape = list(value.shape)
                for dim, (sl, size) in enumerate(zip(index, inputs[op.output_follows[name]].shape)):
                    shape[dim] = size
                result[name] = value.new_zeros(shape)
            result[name][index] = value.detach()
    return result


def worst_gradient_baseline(op: OpDef, cfg: LabConfig, inputs: Tensors, case: Case, grad_out: torch.Tensor,
                            oracle: Tensors, baseline: Tensors) -> None:
    """Each gradient of `baseline` becomes, element by element, the value of whichever readable formulation (the
    reference, op.gradient_baselines) errs more against the oracle: the contract's allowance is relative to the
    readable math's error, and a flash backward's own formulation is readable math too (rule "gradient_baseline")."""
    for _, formulation in op.gradient_baselines:
        other = reference_outputs(op, cfg, inputs, case, grad_out, formulation=formulation)
        for name in [k for k in baseline if k.startswith(parity.GRADIENT_PREFIX) and k in other]:
            mine, theirs, exact = baseline[name], other[name], oracle[name].to(baseline[name].device)
            worse = (theirs.double() - exact).abs() > (mine.double() - exact).abs()
            baseline[name] = torch.where(worse, theirs, mine)




def judge_path(op: OpDef, impl: Any, cfg: LabConfig, records: list[dict[str, Any]], outputs: list[Tensors], *,
               forward: bool = False) -> dict[str, Any]:
    """parity.check_path over every case; adversarial-input cases without the elementwise count (lab/stages.py
    ADVERSARIAL_NOTE). The parity stage, the timed-result checks and the outside timing's checks all judge by it.
    `forward`: the forward outputs alone (no gradients were computed)."""
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
        expected = ([*impl.outputs, *optional] if forward_only or forward
                    else [*op.expected_outputs(impl), *optional])
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
