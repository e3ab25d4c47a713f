"""Readable tables of receipts (pandas), for the terminal and for the README."""

from __future__ import annotations

from typing import Any

import pandas as pd


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def point_table(receipt: dict[str, Any]) -> str:
    """One row per path: parity verdict and worst error, then timing and throughput where valid."""
    parity = (receipt.get("parity") or {}).get("paths", {})
    bench = (receipt.get("microbench") or {}).get("paths", {})
    rows = []
    for name in dict.fromkeys([*bench, *parity]):
        p, b = parity.get(name, {}), bench.get(name, {})
        worst = p.get("worst", {}).get("out", {})
        valid = b.get("valid", False)
        note = "; ".join(filter(None, [
            "bf16 emulated (see receipt)" if p.get("emulation") else "",
            "interpreted: not speed" if b.get("reason", "").startswith("Triton ran through") else b.get("reason", ""),
        ]))
        rows.append({
            "path": name,
            "parity": p.get("verdict", "baseline" if name == "reference" else "-"),
            "max_abs_err": _fmt(worst.get("max_abs_err"), ".2e"),
            "allowed": _fmt(worst.get("allowed_abs_err"), ".2e"),
            "median_ms": _fmt(b.get("median_ms") if valid else None, ".3f"),
            "p20-p80_ms": f"{b['p20_ms']:.3f}-{b['p80_ms']:.3f}" if valid else "-",
            "GFLOP/s": _fmt(b.get("gflops_per_s") if valid else None, ".2f"),
            "GB/s": _fmt(b.get("gbytes_per_s") if valid else None, ".2f"),
            "speedup": _fmt(b.get("speedup_vs_reference"), ".2f"),
            "note": note,
        })
    machine = receipt["provenance"]["machine"]
    head = (f"point {receipt['point']}: {(receipt.get('microbench') or {}).get('problem', '')} "
            f"{receipt['config']['precision']['name']} on {machine['device_name']} ({machine['threads']} threads), "
            f"parity {(receipt.get('parity') or {}).get('verdict', 'missing')}")
    return head + "\n" + pd.DataFrame(rows).to_string(index=False)


def train_table(receipt: dict[str, Any]) -> str:
    """One row per bench-train variant: speed where valid, the loss curve's ends, drift, Amdahl."""
    train = receipt.get("bench_train")
    if not train:
        return f"point {receipt['point']}: no bench-train result"
    amdahl = train.get("amdahl", {}).get("variants", {})
    rows = []
    for name, entry in train["impls"].items():
        valid = entry.get("timing_valid", True)
        check = amdahl.get(name, {})
        rows.append({
            "variant": name,
            "warm_ms/step": _fmt(entry["warm_ms_per_step"] if valid else None, ".1f"),
            "tokens/s": _fmt(entry["tokens_per_s"] if valid else None, ".0f"),
            "loss[0]": f"{entry['losses'][0]:.4f}",
            f"loss[{len(entry['losses']) - 1}]": f"{entry['losses'][-1]:.4f}",
            "drift": _fmt(train["drift"].get(name), ".2e"),
            "verdict": train.get("drift_verdict", {}).get(name, "baseline"),
            "predicted": _fmt(check.get("predicted_speedup"), ".2f"),
            "measured": _fmt(check.get("measured_speedup"), ".2f"),
            "note": check.get("reading") or ("" if valid else "interpreted: not speed"),
        })
    fraction = train.get("amdahl", {}).get("fraction")
    head = (f"point {receipt['point']}: bench-train {receipt['config']['architecture']['name']} "
            f"{train['precision']} on {train['device']}, {train['tokens_per_step']} tokens/step, "
            f"drift limit {train['drift_limit']:g}"
            + (f", {train['amdahl']['op']} is {fraction:.0%} of the baseline step" if fraction is not None else ""))
    return head + "\n" + pd.DataFrame(rows).to_string(index=False)


def _peer(receipt: dict[str, Any]) -> str:
    """PyTorch's own optimized path for the point's op: the one a user would otherwise pick."""
    return "sdpa" if receipt["config"]["op"]["name"] == "attention" else "torch"


def sweep_frame(receipts: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per point: what it changes, parity verdicts, valid timings and bench-train, vs the baseline."""
    rows = []
    for name, receipt in receipts.items():
        parity = (receipt.get("parity") or {}).get("paths", {})
        bench = (receipt.get("microbench") or {}).get("paths", {})
        train = receipt.get("bench_train") or {"impls": {}, "drift": {}}
        peer = _peer(receipt)
        triton_out = parity.get("triton", {}).get("worst", {}).get("out", {})
        rows.append({
            "point": name,
            "change": ",".join(f"{k}={v}" for k, v in (receipt["sweep"] or {}).get("changes", {}).items()) or "-",
            "parity": ",".join(f"{p}:{v['verdict']}" for p, v in parity.items()),
            "triton_err/allowed": (triton_out["max_abs_err"] / triton_out["allowed_abs_err"]
                                   if triton_out.get("allowed_abs_err") else None),
            "ref_ms": bench.get("reference", {}).get("median_ms"),
            "peer": peer,
            "peer_ms": bench.get(peer, {}).get("median_ms") if bench.get(peer, {}).get("valid") else None,
            "peer_speedup": bench.get(peer, {}).get("speedup_vs_reference"),
            "train_ref_ms": train["impls"].get("reference", {}).get("warm_ms_per_step"),
            "train_sdpa_ms": train["impls"].get("sdpa", {}).get("warm_ms_per_step"),
            "sdpa_drift": train["drift"].get("sdpa"),
        })
    return pd.DataFrame(rows)


def sweep_table(receipts: dict[str, dict[str, Any]]) -> str:
    frame = sweep_frame(receipts)
    formats = {"triton_err/allowed": ".3f", "ref_ms": ".3f", "peer_ms": ".3f", "peer_speedup": ".2f",
               "train_ref_ms": ".1f", "train_sdpa_ms": ".1f", "sdpa_drift": ".1e"}
    for column, spec in formats.items():
        frame[column] = frame[column].map(lambda v, s=spec: _fmt(None if pd.isna(v) else v, s))
    return frame.to_string(index=False)
