"""The numerical contract: is an optimized path the same function as the reference?

Every output is compared with the float64 oracle (the reference math on the same
inputs, upcast). The allowed error is relative to what the plain reference math
makes in the point's own precision (the "baseline"), so the bound is precision- and
magnitude-aware. An output passes a case when it is finite, its baseline is finite,
and it passes both rules below.

Tensor-wide rule
    max|err| <= error_multiple · max|baseline − oracle| + floor_rel · max|oracle|
    and the fraction of elements outside |err| <= atol + atol_rel·max|oracle| + rtol·|oracle| is at most max_mismatch.
A wrong scale, a shifted mask, a missing rescale or an all-zero output miss it by orders
of magnitude. But one number for the whole tensor is set by its largest rows: at bf16,
causal, S=4096, row 0 of attention is ~3.3 while the last rows are ~0.06-0.09, so the
tensor-wide allowance (0.12) swallows a zeroed last row (error 0.091) or a last row that
skipped its final 64-key block (error 0.0075).

Per-row rule
    A row is the last `row_ndim` dims (default 1: attention out (B, H, S, D) has a row per
    (b, h, s), a matmul (M, N) one per m; row_ndim=0 makes each element a row, as for the
    logsumexp (B, H, S)). Row r is judged against its own baseline error and magnitude:
        err_r <= error_multiple · base_r + floor_rel · max|oracle_r| + row_floor · max|oracle|
    with err_r = max|cand_r − oracle_r|, base_r = max|baseline_r − oracle_r|, and
    row_floor = contract.grad_row_floor_rel for gradients (outputs named "grad_*") and
    contract.row_floor_rel otherwise. The worst row (largest err_r / allowed_r) is reported
    with its index, error and allowance, and a failing row is named in the reason.

Why the row floor, and why two
    The row's own terms fail a row whose oracle is (near) zero on noise alone, so each row
    also gets a floor in units of the tensor's max|oracle| (its contributors' scale):
    - Forward rows (out, lse, matmul C) are weighted sums whose error scales with the row
      itself; beyond that they only carry fp32 accumulator noise. row_floor_rel is tiny
      (1e-6 fp32, 1e-5 bf16/fp16), far under the 2.3e-3·max|oracle| of a dropped tail block.
    - Gradient rows cancel: Σ_j dS_ij = 0, so dQ of a query that sees one key is exactly 0
      and dQ of an early query is a small difference of large terms. A flash backward
      forms D = rowsum(dO∘O) from the stored, rounded O, and that error stays in a
      cancelling dQ row whatever its size: measured up to 1.3e-3·max|dQ| (bf16),
      3.4e-4 (fp16), 7e-7 (fp32) beyond the row's own bound, and up to 90x the row's own
      baseline error (the reference's softmax backward has no such term). grad_row_floor_rel is therefore the tensor-wide floor_rel in
      bf16/fp16 (so the per-row rule for gradients is never looser than the tensor-wide
      one) and 1e-5 in fp32 (dP = dO·Vᵀ is ~10x dQ's scale).
    Measured (clean path's worst row, as a fraction of its row allowance; damage as a multiple):
    SDPA against the reference in fp32/bf16/fp16, causal and not, MHA and GQA, S up to 4096
    (bf16, H=2, D=128), forward and dQ/dK/dV; the Triton kernels (interpreter) at S from 1 to
    1024 with the logsumexp; a flash-backward emulation over 80 seeds; matmul and its gradients:
        clean worst: bf16 0.38 (grads) / 0.14 (out); fp16 0.36 / 0.19; fp32 0.32 / 0.17; matmul <= 0.10
        bf16 S=4096: zeroed last row x22-28, dropped 64-key tail x2.5-5 (tensor-wide: x0.07-0.8, passes)
        fp16 x170-200 / x20-58; fp32 x2.5e4 / x2e3 and more.
    error_multiple is shared with the tensor-wide rule: clean rows err <= 2.6x their own
    baseline on forward outputs; a zeroed or truncated long-sequence row errs 24-290x.

An oracle that is exactly zero everywhere (dQ when every query sees a single key) has no
magnitude of its own: the floors then use `fallback_scale`, the case's forward output's.

Quantized precisions (fp8: conf/precision/fp8*.yaml)
    Every path sees the same quantized inputs (made once per case), and the oracle is the float64
    math on those: the rules above judge what a path adds to the quantization, not the quantization.
    The contract's `min_sqnr_db` adds a floor on each output's signal-to-quantization-noise ratio
        SQNR = 10·log10(Σ oracle² / Σ (candidate − oracle)²)  (dB; torchao's fp8 tests ask > 20 dB)
    and the quantization's own error is judged apart (`quantization_check`): each case's oracle on the
    quantized inputs against the same float64 math on the unquantized ones, per tensor and per row.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from posttrainllm import rules
from posttrainllm.config import Contract

RELATIVE_DENOMINATOR_FLOOR = 1e-3  # max_rel_err divides by max(|oracle_i|, 1e-3·max|oracle|)
DEFAULT_ROW_NDIM = {"lse": 0}  # per output name; every other output: 1 (the last dim is the row)
GRADIENT_PREFIX = "grad_"  # outputs named so are gradients and take contract.grad_row_floor_rel



def error_metrics(candidate: torch.Tensor, oracle: torch.Tensor, contract: Contract) -> dict[str, float]:
    """Max abs error, max relative error and mismatch fraction of `candidate` against the fp64 `oracle`."""
    oracle = oracle.double()
    err = _abs_err(candidate, oracle)
    scale = oracle.abs().max().item() if oracle.numel() else 0.0
    denominator = oracle.abs().clamp_min(RELATIVE_DENOMINATOR_FLOOR * scale or 1e-30)
    outside = err > contract.atol + contract.atol_rel * scale + contract.rtol * oracle.abs()
    return {
        "max_abs_err": err.max().item() if err.numel() else 0.0,
        "max_rel_err": (err / denominator).max().item() if err.numel() else 0.0,
        "mismatch_frac": outside.double().mean().item() if err.numel() else 0.0,
        "oracle_max_abs": scale,
        "finite": bool(torch.isfinite(candidate).all()),
    }


def _abs_err(candidate: torch.Tensor, oracle: torch.Tensor) -> torch.Tensor:
    """|candidate − oracle| in float64, with +inf wherever the candidate is not finite (NaN included)."""
    err = (candidate.double() - oracle.double()).abs()
    return torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))


def _rows(x: torch.Tensor, row_ndim: int) -> torch.Tensor:
    """(n_rows, row_len) of a non-empty x: the last `row_ndim` dims form a row (all of them if row_ndim >= ndim)."""
    return x.reshape(math.prod(x.shape[:max(x.dim() - row_ndim, 0)]), -1)


def row_check(candidate: torch.Tensor, oracle: torch.Tensor, baseline: torch.Tensor, contract: Contract, *,
              tensor_scale: float, row_ndim: int = 1, gradient: bool = False) -> dict[str, Any]:
    """The per-row rule (module docstring). Returns the worst row and how many rows fail.

    tensor_scale: the floor's unit, max|oracle| of the whole tensor (or the fallback scale).
    """
    if row_ndim < 0:
        raise ValueError(f"row_ndim={row_ndim} must be >= 0")
    if not oracle.numel():
        return {"row_ndim": row_ndim, "rows": 0, "rows_failed": 0, "worst_row": None}
    lead = tuple(oracle.shape[:max(oracle.dim() - row_ndim, 0)])
    err = _rows(_abs_err(candidate, oracle), row_ndim).amax(dim=1)
    base = _rows(_abs_err(baseline, oracle), row_ndim).amax(dim=1)
    scale = _rows(oracle.double().abs(), row_ndim).amax(dim=1)
    row_floor = contract.grad_row_floor_rel if gradient else contract.row_floor_rel
    allowed = contract.error_multiple * base + contract.floor_rel * scale + row_floor * tensor_scale
    # err / allowed, with 0/0 = 0 (an exact row of an exactly-zero tensor), x/0 = inf and inf/inf = inf
    ratio = torch.where(allowed > 0, err / allowed.clamp_min(1e-300), torch.where(err > 0, float("inf"), 0.0))
    ratio = torch.where(ratio.isnan(), float("inf"), ratio)
    worst = int(ratio.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), lead)) if lead else ()
    return {
        "row_ndim": row_ndim,
        "rows": int(err.numel()),
        "rows_failed": int((err > allowed).sum()),
        "worst_row": {
            "index": index,
            "max_abs_err": err[worst].item(),
            "baseline_max_abs_err": base[worst].item(),
            "oracle_max_abs": scale[worst].item(),
            "allowed_abs_err": allowed[worst].item(),
            "ratio": ratio[worst].item(),
        },
    }


def sqnr_db(signal: torch.Tensor, approx: torch.Tensor) -> float:
    """10·log10(Σ signal² / Σ (approx − signal)²) in float64: +inf for an exact approx, −inf for a non-finite
    one (or any error on an all-zero signal)."""
    return float(row_sqnr_db(signal.reshape(1, -1), approx.reshape(1, -1), row_ndim=1)[0]) if signal.numel() \
        else float("inf")


def row_sqnr_db(signal: torch.Tensor, approx: torch.Tensor, row_ndim: int = 1) -> torch.Tensor:
    """The SQNR (sqnr_db) of each row of a non-empty tensor, the last `row_ndim` dims, flattened: (n_rows,)."""
    noise = _rows(_abs_err(approx, signal).pow(2), row_ndim).sum(dim=1)
    power = _rows(signal.double().pow(2), row_ndim).sum(dim=1)
    db = 10 * torch.log10(power / noise)  # x/0 = +inf (exact), 0/x = -inf, inf noise: -inf
    db = torch.where(db.isnan(), float("-inf"), db)  # inf/inf: a non-finite signal
    return torch.where(noise == 0, float("inf"), db)  # 0/0: an exact all-zero row


def check_output(candidate: torch.Tensor, oracle: torch.Tensor, baseline: torch.Tensor,
                 contract: Contract, *, fallback_scale: float = 0.0, row_ndim: int = 1,
                 gradient: bool = False) -> dict[str, Any]:
    """One output of one path on one case, against the contract: the tensor-wide and the per-row rule.

    An oracle that is exactly zero (dQ when every query sees a single key, say) has no
    magnitude of its own: the floors then use `fallback_scale`, the case's forward output's.
    `gradient` picks the gradient row floor (contract.grad_row_floor_rel).
    The result's "bound_ratio" is the larger of the two rules' error / allowance (<= 1 passes them).
    """
    if candidate.shape != oracle.shape:
        return {"verdict": "fail", "reason": f"shape {tuple(candidate.shape)} != oracle {tuple(oracle.shape)}",
                "bound_ratio": float("inf")}
    if baseline.shape != oracle.shape:
        return {"verdict": "fail", "reason": f"baseline shape {tuple(baseline.shape)} != oracle {tuple(oracle.shape)}",
                "bound_ratio": float("inf")}
    got = error_metrics(candidate, oracle, contract)
    base = error_metrics(baseline, oracle, contract)
    scale = got["oracle_max_abs"] or fallback_scale
    allowed = contract.error_multiple * base["max_abs_err"] + contract.floor_rel * scale
    rows = row_check(candidate, oracle, baseline, contract, tensor_scale=scale, row_ndim=row_ndim, gradient=gradient)
    reasons = []
    if not got["finite"]:
        reasons.append("non-finite values")
    if not base["finite"]:
        reasons.append("the baseline has non-finite values: no bound to judge by")
    if got["max_abs_err"] > allowed:
        reasons.append(f"max_abs_err {got['max_abs_err']:.3g} > allowed {allowed:.3g}")
    if got["mismatch_frac"] > contract.max_mismatch:
        reasons.append(f"mismatch_frac {got['mismatch_frac']:.3g} > {contract.max_mismatch:.3g}")
    worst = rows["worst_row"]
    if rows["rows_failed"]:
        reasons.append(f"row {worst['index']}: max_abs_err {worst['max_abs_err']:.3g} > row allowed "
                       f"{worst['allowed_abs_err']:.3g} (row baseline err {worst['baseline_max_abs_err']:.3g}, "
                       f"row max|oracle| {worst['oracle_max_abs']:.3g}; {rows['rows_failed']} of {rows['rows']} rows fail)")
    tensor_ratio = _ratio(got["max_abs_err"], allowed)
    sqnr = {}
    if contract.min_sqnr_db is not None:  # as a ratio: the noise amplitude over the floor's (<= 1 passes)
        sqnr = {"sqnr_db": sqnr_db(oracle, candidate), "min_sqnr_db": contract.min_sqnr_db}
        if not sqnr["sqnr_db"] >= contract.min_sqnr_db:
            reasons.append(f"sqnr {sqnr['sqnr_db']:.1f} dB < min_sqnr_db {contract.min_sqnr_db:g} dB")
        tensor_ratio = max(tensor_ratio, 10 ** ((contract.min_sqnr_db - sqnr["sqnr_db"]) / 20))
    return {
        **got, **sqnr,
        "baseline_max_abs_err": base["max_abs_err"],
        "allowed_abs_err": allowed,
        "error_ratio": got["max_abs_err"] / base["max_abs_err"] if base["max_abs_err"] > 0 else None,
        **rows,
        "bound_ratio": max(tensor_ratio, worst["ratio"] if worst else 0.0),
        "verdict": "fail" if reasons else "pass",
        "reason": "; ".join(reasons),
    }


def _ratio(err: float, allowed: float) -> float:
    if allowed > 0:
        return err / allowed
    return float("inf") if err > 0 else 0.0


def check_path(outputs: list[dict[str, torch.Tensor]] | None, oracles: list[dict[str, torch.Tensor]],
               baselines: list[dict[str, torch.Tensor]], case_names: list[str],
               contract_for: Callable[[str], Contract], expected: list[str],
               row_ndim: dict[str, int] | None = None) -> dict[str, Any]:
    """Every case and every expected output of one path; the path passes only if all of them do.

    outputs: one dict of tensors per case (None: the path did not run). oracles, baselines and
    case_names are aligned per case. expected: the output names the path must produce; a missing
    one fails, and so does a missing case (or a surplus result). contract_for(name) is the
    contract of each output (the logsumexp has its own). row_ndim: per output name, the trailing
    dims that form a row (default 1; "lse" 0). Outputs a path produces beyond `expected` are not
    checked and are listed under "unchecked_outputs".

    Per output name, `worst` keeps the case with the largest bound_ratio.
    """
    if not len(oracles) == len(baselines) == len(case_names):
        raise ValueError(f"{len(oracles)} oracles, {len(baselines)} baselines, {len(case_names)} case names: "
                         "one of each per case")
    ndims = {**DEFAULT_ROW_NDIM, **(row_ndim or {})}
    contracts = {name: contract_for(name) for name in expected}
    results: list[dict[str, Any]] = []
    worst: dict[str, tuple[float, dict[str, Any]]] = {}
    unchecked: set[str] = set()

    def fail(case: str, output: str, reason: str) -> None:
        results.append({"case": case, "output": output, "verdict": "fail", "reason": reason})

    missing = "no result: the path did not run" if outputs is None else "no result for this case"
    outputs = outputs or []
    if len(outputs) > len(case_names):
        fail("*", "*", f"{len(outputs)} results for {len(case_names)} cases: cannot tell which is which")
    for i, (name, oracle, baseline) in enumerate(zip(case_names, oracles, baselines)):
        if i >= len(outputs):
            fail(name, "*", missing)
            continue
        got = outputs[i] or {}
        unchecked |= set(got) - set(expected)
        fallback_scale = oracle["out"].abs().max().item() if "out" in oracle and oracle["out"].numel() else 0.0
        for key in expected:
            if got.get(key) is None:
                fail(name, key, "missing output: the path did not produce it")
                continue
            if key not in oracle or key not in baseline:
                fail(name, key, "no oracle or baseline for this output: cannot judge it")
                continue
            check = check_output(got[key], oracle[key], baseline[key], contracts[key],
                                 fallback_scale=fallback_scale, row_ndim=ndims.get(key, 1),
                                 gradient=key.startswith(GRADIENT_PREFIX))
            results.append({"case": name, "output": key, **check})
            if key not in worst or check["bound_ratio"] > worst[key][0]:
                worst[key] = (check["bound_ratio"], {"case": name, **check})
    failed = [r for r in results if r["verdict"] != "pass"]
    return {
        "verdict": "fail" if failed or not results else "pass",
        "failed_cases": [f"{r['case']}/{r['output']}: {r['reason']}" for r in failed],
        "worst": {key: entry for key, (_, entry) in worst.items()},
        "cases": results,
        "unchecked_outputs": sorted(unchecked),
    }


def quantization_check(cases: list[tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor]]], *,
                       min_sqnr_db: float, min_row_sqnr_db: float,
                       row_ndim: dict[str, int] | None = None) -> dict[str, Any]:
    """Rule "quantization_error" over every case: (case name, its oracle on the quantized inputs, the same math on the
    unquantized ones), for every output the latter has. Per case and output: the SQNR, the worst row's (its index)
    and the verdict; overall the lowest of each and the failures, named."""
    ndims = {**DEFAULT_ROW_NDIM, **(row_ndim or {})}
    results, failed = [], []
    for case, quantized, exact in cases:
        for output, want in exact.items():
            got = quantized.get(output)
            if got is None or got.shape != want.shape or not want.numel():
                failed.append(f"{case}/{output}: no quantized result of the unquantized shape {tuple(want.shape)}")
                continue
            ndim = ndims.get(output, 1)
            rows = row_sqnr_db(want, got, ndim)
            worst = int(rows.argmin())
            lead = tuple(want.shape[:max(want.dim() - ndim, 0)])
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), lead)) if lead else ()
            entry = {"case": case, "output": output, "sqnr_db": sqnr_db(want, got),
                     "row_min_sqnr_db": rows[worst].item(), "worst_row": index, "rows": int(rows.numel())}
            reasons = []
            if not entry["sqnr_db"] >= min_sqnr_db:
                reasons.append(f"sqnr {entry['sqnr_db']:.1f} dB < min_sqnr_db {min_sqnr_db:g} dB")
            if not entry["row_min_sqnr_db"] >= min_row_sqnr_db:
                reasons.append(f"row {index}: sqnr {entry['row_min_sqnr_db']:.1f} dB < min_row_sqnr_db "
                               f"{min_row_sqnr_db:g} dB")
            entry.update(verdict="fail" if reasons else "pass", reason="; ".join(reasons))
            results.append(entry)
            if reasons:
                failed.append(f"{case}/{output}: {entry['reason']}")
    return {
        "verdict": "fail" if failed or not results else "pass",
        "rule": rules.cite("quantization_error"), "min_sqnr_db": min_sqnr_db, "min_row_sqnr_db": min_row_sqnr_db,
        "sqnr_db": min((r["sqnr_db"] for r in results), default=None),  # the lowest over cases
        "row_min_sqnr_db": min((r["row_min_sqnr_db"] for r in results), default=None),
        "failed_cases": failed,
        "cases": results,
    }
