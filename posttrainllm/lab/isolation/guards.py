"""Guards around one call of a path: it must not change its inputs, alias them, or skip its kernels.

A parity check compares numbers, so it cannot see a path that (a) writes into its inputs
(the next path, or the oracle, then reads corrupted data), (b) returns an input, or a view
of one, as its output (so a later in-place op on the output corrupts the input), or (c)
falls back to torch instead of launching its Triton kernels (its numbers then pass parity
and its timings describe the wrong code). `run_guarded` checks all three around one call;
the kernel stage guards the forward call and, separately, the backward call (the gradients),
each against the kernels the path names for that direction (`Impl.kernels`): any one launch
is not proof, since a path launching only a helper kernel would pass.

Counting Triton launches: ops/launches.py (`count_triton_launches`; a user path's worker counts its
own and the lab adds them, `record_launches`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch

from posttrainllm.ops.launches import LaunchCount, count_triton_launches, record_launches  # noqa: F401 (re-exported)


def _same_bits(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Bitwise equality (so NaN == NaN and -0.0 != 0.0), shape and dtype included."""
    if before.shape != after.shape or before.dtype != after.dtype:
        return False
    if before.numel() == 0:
        return True
    return torch.equal(_bytes(before), _bytes(after))


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.detach().contiguous().reshape(-1).view(torch.uint8)


def _storage_span(x: torch.Tensor) -> tuple[torch.device, int, int] | None:
    """(device, first byte, end byte) of the memory x's storage owns; None when it owns none."""
    storage = x.untyped_storage()
    if storage.nbytes() == 0:
        return None
    start = storage.data_ptr()
    return x.device, start, start + storage.nbytes()


def _overlap(a: tuple[torch.device, int, int] | None, b: tuple[torch.device, int, int] | None) -> bool:
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def output_violations(outputs: dict[str, Any], expected: dict[str, torch.Tensor], device: str) -> list[str]:
    """What is wrong with the outputs' form against the reference's (`expected`: same names, the reference's
    tensors in the point's precision): not a tensor, another shape, dtype or device. Checked before any number."""
    found = []
    for name, want in expected.items():
        got = outputs.get(name)
        if got is None:
            continue  # a missing output is parity's to report
        if not isinstance(got, torch.Tensor):
            found.append(f"output {name} is a {type(got).__name__}, not a tensor")
        elif tuple(got.shape) != tuple(want.shape):
            found.append(f"output {name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        elif got.dtype != want.dtype:
            found.append(f"output {name} has dtype {got.dtype}, expected {want.dtype}")
        elif got.device.type != device:
            found.append(f"output {name} is on {got.device.type}, expected {device}")
    return found


def run_guarded(fn: Callable[[], dict[str, torch.Tensor]], inputs: dict[str, torch.Tensor], *,
                expect_triton: bool, kernels: tuple[str, ...] = (),
                launched: Counter | None = None, unchanged: dict[str, torch.Tensor] | None = None,
                errors: list[BaseException] | None = None) -> tuple[dict[str, torch.Tensor] | None, list[str]]:
    """Call fn() once and return (its outputs, violations).

    Violations: "changed input q" (bitwise, NaN-aware, shape and dtype too), "output out shares
    storage with input a" (any overlap of their storages: the input itself, a view like `.t()`,
    a slice), with expect_triton "launched no Triton kernel", and for each name in `kernels` that
    did not launch, "launched no <name> (a kernel the path names)". If fn raises (or returns no
    dict), the outputs are None and the first violation says so ("raised <Type>: <message>");
    the inputs are still checked, the launches are not. `launched`, if given, gains the call's
    Triton launches by kernel name. `unchanged`: more tensors the call is handed (the upstream gradient of a
    backward) that it must leave unchanged ("changed <name>"); an output may share their storage (autograd
    passes a gradient through unchanged where the math is the identity). `errors`, if given, gains the exception
    fn raised (the kernel stage locates it: track/failures.py).
    """
    snapshot = {name: x.detach().clone() for name, x in inputs.items()}
    others = {name: (x, x.detach().clone()) for name, x in (unchanged or {}).items()}
    violations: list[str] = []
    outputs: dict[str, torch.Tensor] | None = None
    with count_triton_launches() as launches:
        try:
            outputs = fn()
        except Exception as exc:  # a path that cannot run is reported, not a crash
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            violations.append(f"raised {type(exc).__name__}" + (f": {message}" if message else ""))
            if errors is not None:
                errors.append(exc)
    if launched is not None:
        launched.update(launches.by_kernel)
    for name, x in inputs.items():
        if not _same_bits(snapshot[name], x):
            violations.append(f"changed input {name}")
    violations += [f"changed {name}" for name, (x, before) in others.items() if not _same_bits(before, x)]
    if outputs is not None and not isinstance(outputs, dict):
        violations.append(f"returned {type(outputs).__name__}, not a dict of tensors")
        outputs = None
    if outputs is not None:
        spans = {name: _storage_span(x) for name, x in inputs.items()}
        for out_name, out in outputs.items():
            if isinstance(out, torch.Tensor) and out.device.type != "meta":
                out_span = _storage_span(out)
                violations += [f"output {out_name} shares storage with input {in_name}"
                               for in_name, span in spans.items() if _overlap(out_span, span)]
        if expect_triton and launches.total == 0:
            violations.append("launched no Triton kernel")
        else:
            violations += [f"launched no {name} (a kernel the path names)" for name in kernels
                           if not launches.by_kernel.get(name)]
    return outputs, violations
