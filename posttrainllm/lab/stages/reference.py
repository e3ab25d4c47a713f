"""DVC stage 'reference': inputs for every case, the float64 oracle on them and the same math in the point's
precision (reference.pt); a point that would not fit is refused before anything is written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from posttrainllm.config import ConfigError, LabConfig
from posttrainllm.lab import runner
from posttrainllm.measure import device as devices
from posttrainllm.ops.registry import NO_BACKWARD, REFERENCE, case_config
from posttrainllm.lab.oracle import cast_floats, each, reference_outputs, upstream_gradients
from posttrainllm.ops.registry import op_for  # the point's op: a built-in, or one made from op.file (op=problem)
from posttrainllm.ops.base import point_dtype as _dtype
from posttrainllm.track.records import ReferenceRecord
from posttrainllm.lab.stages.common import to_cpu, worst_gradient_baseline


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
            records.append({"case": asdict(case), "inputs": to_cpu(inputs),
                            "grad_out": each(grad_out, torch.Tensor.cpu),
                            "oracle": to_cpu(oracle), "baseline": to_cpu(baseline),
                            "input_checks": op.input_checks(case, inputs, cfg) if op.input_checks else None})
            if case.quantize:  # the quantization's own error is measured against this (parity: "quantization")
                plain = op.make_inputs(dataclasses.replace(case, quantize=""), _dtype(cfg), device)
                exact = reference_outputs(op, cfg, cast_floats(plain, torch.float64), case)
                records[-1]["unquantized"] = to_cpu({k: v for k, v in exact.items() if k in out_names})
    out.mkdir(parents=True, exist_ok=True)
    ReferenceRecord(op=op.name, dtype=cfg.precision.dtype, records=records).write(out / ReferenceRecord.FILE)
