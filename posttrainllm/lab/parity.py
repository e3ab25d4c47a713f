"""The numerical contract: is an optimized path the same function as the reference?

Every output is compared with the float64 oracle (the reference math on the same
inputs, upcast). The allowed error is relative to what the plain reference math
makes in the point's own precision, so the bound is precision- and magnitude-aware:

    allowed = error_multiple · max|baseline − oracle| + floor_rel · max|oracle|

A path passes a case when every output is finite, its max |error| is within
`allowed`, and the fraction of elements outside |err| <= atol + rtol·|oracle|
is at most `max_mismatch`. A wrong scale, a shifted mask, a missing rescale or an
all-zero output miss the bound by orders of magnitude.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrainllm.config import Contract

RELATIVE_DENOMINATOR_FLOOR = 1e-3  # max_rel_err divides by max(|oracle_i|, 1e-3·max|oracle|)


def error_metrics(candidate: torch.Tensor, oracle: torch.Tensor, contract: Contract) -> dict[str, float]:
    """Max abs error, max relative error and mismatch fraction of `candidate` against the fp64 `oracle`."""
    oracle = oracle.double()
    err = (candidate.double() - oracle).abs()
    scale = oracle.abs().max().item() if oracle.numel() else 0.0
    denominator = oracle.abs().clamp_min(RELATIVE_DENOMINATOR_FLOOR * scale or 1e-30)
    finite = bool(torch.isfinite(candidate).all())
    if not finite:
        err = torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))
    outside = err > contract.atol + contract.rtol * oracle.abs()
    return {
        "max_abs_err": err.max().item() if err.numel() else 0.0,
        "max_rel_err": (err / denominator).max().item() if err.numel() else 0.0,
        "mismatch_frac": outside.double().mean().item() if err.numel() else 0.0,
        "oracle_max_abs": scale,
        "finite": finite,
    }


def check_output(candidate: torch.Tensor, oracle: torch.Tensor, baseline: torch.Tensor,
                 contract: Contract, *, fallback_scale: float = 0.0) -> dict[str, Any]:
    """One output of one path on one case, against the contract.

    An oracle that is exactly zero (dQ when every query sees a single key, say) has no
    magnitude of its own: the floor then uses `fallback_scale`, the case's forward output's.
    """
    if candidate.shape != oracle.shape:
        return {"verdict": "fail", "reason": f"shape {tuple(candidate.shape)} != oracle {tuple(oracle.shape)}"}
    got = error_metrics(candidate, oracle, contract)
    base = error_metrics(baseline, oracle, contract)
    scale = got["oracle_max_abs"] or fallback_scale
    allowed = contract.error_multiple * base["max_abs_err"] + contract.floor_rel * scale
    reasons = []
    if not got["finite"]:
        reasons.append("non-finite values")
    if got["max_abs_err"] > allowed:
        reasons.append(f"max_abs_err {got['max_abs_err']:.3g} > allowed {allowed:.3g}")
    if got["mismatch_frac"] > contract.max_mismatch:
        reasons.append(f"mismatch_frac {got['mismatch_frac']:.3g} > {contract.max_mismatch:.3g}")
    return {
        **got,
        "baseline_max_abs_err": base["max_abs_err"],
        "allowed_abs_err": allowed,
        "error_ratio": got["max_abs_err"] / base["max_abs_err"] if base["max_abs_err"] > 0 else None,
        "verdict": "fail" if reasons else "pass",
        "reason": "; ".join(reasons),
    }


def check_path(outputs: list[dict[str, torch.Tensor]], oracles: list[dict[str, torch.Tensor]],
               baselines: list[dict[str, torch.Tensor]], case_names: list[str], contract: Contract) -> dict[str, Any]:
    """Every case and every output the path produces; the path passes only if all of them do.

    Per output name, `worst` keeps the case with the largest max_abs_err / allowed.
    """
    results, worst = [], {}
    for name, got, oracle, baseline in zip(case_names, outputs, oracles, baselines):
        fallback_scale = oracle["out"].abs().max().item() if oracle["out"].numel() else 0.0
        for key, tensor in got.items():
            check = check_output(tensor, oracle[key], baseline[key], contract, fallback_scale=fallback_scale)
            results.append({"case": name, "output": key, **check})
            ratio = check.get("max_abs_err", float("inf")) / max(check.get("allowed_abs_err", 0.0), 1e-300)
            if key not in worst or ratio > worst[key][0]:
                worst[key] = (ratio, {"case": name, **check})
    failed = [r for r in results if r["verdict"] != "pass"]
    return {
        "verdict": "fail" if failed or not results else "pass",
        "failed_cases": [f"{r['case']}/{r['output']}: {r['reason']}" for r in failed],
        "worst": {key: entry for key, (_, entry) in worst.items()},
        "cases": results,
    }
