"""The reference's answers a path is checked against: its outputs, extra outputs and input gradients for a case,
in float64 (the oracle) or in the point's precision (the baseline), and the upstream gradient dO every backward
of a case is fed. The parity stage (lab/stages/) and the timing from outside (lab/isolation/outside.py) both use them."""

from __future__ import annotations

from typing import Any, Callable

import torch

from posttrainllm.config import LabConfig
from posttrainllm.opdefs import Case, OpDef, Tensors
from posttrainllm.opdefs.base import leaves_of


def upstream_gradient(case: Case, out: torch.Tensor) -> torch.Tensor:
    """The dO fed to every backward of a case: standard normal from the case's seed, in out's dtype."""
    gen = torch.Generator().manual_seed(case.seed + 1_000_003)
    return torch.randn(out.shape, generator=gen, dtype=torch.float32).to(device=out.device, dtype=out.dtype)


def cast_floats(inputs: Tensors, dtype: torch.dtype) -> Tensors:
    """The floating-point inputs in `dtype`; integer inputs (ids, indices) as they are."""
    return {name: x.to(dtype) if x.is_floating_point() else x for name, x in inputs.items()}


def gradients(fn: Callable[[Tensors], Tensors], inputs: Tensors, grad_out: torch.Tensor) -> Tensors:
    """d(out · grad_out)/d(input) for every floating-point input: "grad_q", "grad_k", ... (the backward to check)."""
    leaves = leaves_of(inputs)
    wrt = {name: x for name, x in leaves.items() if x.requires_grad}
    out = fn(leaves)["out"]
    grads = torch.autograd.grad(out, list(wrt.values()), grad_out, allow_unused=True)
    return {f"grad_{name}": g for name, g in zip(wrt, grads) if g is not None}  # a missing one fails parity


def contract_for(cfg: LabConfig) -> Callable[[str], Any]:
    """Each output's contract: the logsumexp is fp32 in every precision and has its own."""
    return lambda output: cfg.precision.lse_contract if output == "lse" else cfg.precision.contract


def reference_outputs(op: OpDef, cfg: LabConfig, inputs: Tensors, case: Case,
                      grad_out: torch.Tensor | None = None,
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
            got.update(gradients(fn, piece, grad_out[chunk[op.output_follows["out"]]]))
        for name, value in got.items():
            index = chunk[op.output_follows[name]]
            if name not in result:
                shape = list(value.shape)
                for dim, (sl, size) in enumerate(zip(index, inputs[op.output_follows[name]].shape)):
                    shape[dim] = size
                result[name] = value.new_zeros(shape)
            result[name][index] = value.detach()
    return result
