"""The reference's answers a path is checked against: its outputs, extra outputs and input gradients for a case,
in float64 (the oracle) or in the point's precision (the baseline), and the upstream gradient dO every backward
of a case is fed. The parity stage (lab/stages.py) and the timing from outside (lab/outside.py) both use them."""

from __future__ import annotations

from typing import Any, Callable

import torch

from posttrainllm.config import LabConfig
from posttrainllm.opdefs import Case, OpDef, Tensors
from posttrainllm.opdefs.base import leaves_of


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
