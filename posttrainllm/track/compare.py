"""Compare two sets of receipts: did a path get faster or slower, did a verdict change?

    posttrainllm compare BASE NEW [--across-devices] [--out FILE] [compare.KEY=VALUE ...]

BASE and NEW are what `posttrainllm replay` takes (point folders, receipt.json files, sweeps'
runs/, MLflow run ids; replay.load). Points are paired by name (two single points are paired
whatever their names); a draft-heads receipt in a sweep's folder is named and left out. For every path both timed, in both modes (forward, forward + backward), from the raw
samples of timings.csv:

* judged relative to the reference timed in the same run: rel = (median(path) / median(reference)
  in NEW) / (the same in BASE), so a machine that is uniformly slower in one run gives no verdict
  while a path whose own time changed against its run's reference is still found; new/base, the
  absolute ratio of medians, is shown beside it;
* a percentile bootstrap interval of rel (the path's and the reference's samples of both runs
  resampled, `compare.bootstrap` times, seeded: the same receipts give the same interval);
* a two-sided Mann-Whitney U test on the path's log-times less the log of its run's reference
  median (normal approximation with the tie and continuity corrections, written out in
  `mann_whitney`: scipy is not a dependency);
* slower when the interval lies above 1 + threshold and p < alpha; faster when it lies below
  1 / (1 + threshold) (the same distance in log-ratio) and p < alpha; else no measurable
  difference (thresholds: conf/config.yaml `compare:`; default 5 % and p < 0.01);
* the reference's own rows say how the machine's speed changed (its absolute new/base, with the
  same interval and test), and are never a regression; a path with no reference timed in both
  runs is not judged.

Beside them: each path's parity verdict in both, its worst error ratio new / base, and the loss
drift of each trained variant. Timings are compared only between receipts of the same device
fingerprint (`--across-devices` overrides it); parity is compared always. Both sides are
verified first (replay.verify): a receipt that does not add up is not compared.

A regression is a path that got slower, or a parity or drift verdict that went from pass to fail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from posttrainllm.config import CompareConfig
from posttrainllm.track.replay import MODES, Stored, raw_samples, timed_entries

FINGERPRINT_IGNORES = ()  # every field of the stored fingerprint counts (device, name, threads, versions)


def mann_whitney(x: list[float] | np.ndarray, y: list[float] | np.ndarray) -> tuple[float, float]:
    """Two-sided Mann-Whitney U test: (U of x, p) by the normal approximation.

    U_x = R_x - n_x (n_x + 1) / 2, with R_x the sum of x's ranks in the pooled sample (ties get
    their average rank). Under H0, mean n_x n_y / 2 and variance
    n_x n_y / 12 * ((n + 1) - sum(t^3 - t) / (n (n - 1))) over tie groups of size t.
    z = (|U_x - mean| - 1/2) / sd (continuity); p = erfc(z / sqrt 2), at most 1. scipy's
    mannwhitneyu(method="asymptotic") gives the same p.
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    nx, ny = len(x), len(y)
    n = nx + ny
    values, inverse, counts = np.unique(np.concatenate([x, y]), return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - counts + (counts + 1) / 2)[inverse]  # 1-based average ranks
    u = ranks[:nx].sum() - nx * (nx + 1) / 2
    ties = float((counts.astype(float) ** 3 - counts).sum())
    variance = nx * ny / 12 * ((n + 1) - ties / (n * (n - 1))) if n > 1 else 0.0
    if variance <= 0:  # all values equal: nothing to tell apart
        return float(u), 1.0
    z = max(abs(u - nx * ny / 2) - 0.5, 0.0) / math.sqrt(variance)
    return float(u), min(1.0, math.erfc(z / math.sqrt(2)))


def bootstrap_ratio(base: list[float], new: list[float], *, resamples: int, confidence: float,
                    seed: int) -> tuple[float, float]:
    """Percentile interval of median(new) / median(base), both resampled with replacement."""
    rng = np.random.default_rng(seed)
    b, w = np.asarray(base, dtype=float), np.asarray(new, dtype=float)
    ratios = (np.median(w[rng.integers(0, len(w), (resamples, len(w)))], axis=1)
              / np.median(b[rng.integers(0, len(b), (resamples, len(b)))], axis=1))
    tail = (1 - confidence) / 2
    lo, hi = np.quantile(ratios, [tail, 1 - tail])
    return float(lo), float(hi)


def _medians(rng: np.random.Generator, samples: list[float], resamples: int) -> np.ndarray:
    x = np.asarray(samples, dtype=float)
    return np.median(x[rng.integers(0, len(x), (resamples, len(x)))], axis=1)


def bootstrap_relative(base: list[float], base_ref: list[float], new: list[float], new_ref: list[float], *,
                       resamples: int, confidence: float, seed: int) -> tuple[float, float]:
    """Percentile interval of (median(new) / median(new_ref)) / (median(base) / median(base_ref)): each of the four
    sample sets resampled with replacement, on its own."""
    rng = np.random.default_rng(seed)
    ratios = ((_medians(rng, new, resamples) / _medians(rng, new_ref, resamples))
              / (_medians(rng, base, resamples) / _medians(rng, base_ref, resamples)))
    tail = (1 - confidence) / 2
    lo, hi = np.quantile(ratios, [tail, 1 - tail])
    return float(lo), float(hi)


def timing_verdict(lo: float, hi: float, p: float, cfg: CompareConfig) -> str:
    if p < cfg.alpha and lo > 1 + cfg.threshold:
        return "slower"
    if p < cfg.alpha and hi < 1 / (1 + cfg.threshold):
        return "faster"
    return "no measurable difference"


def compare_samples(base: list[float], new: list[float], cfg: CompareConfig) -> dict[str, Any]:
    lo, hi = bootstrap_ratio(base, new, resamples=cfg.bootstrap, confidence=cfg.confidence, seed=cfg.seed)
    _, p = mann_whitney(np.log(base), np.log(new))
    return {"ratio": float(np.median(new) / np.median(base)), "ci_low": lo, "ci_high": hi, "p": p,
            "n_base": len(base), "n_new": len(new), "verdict": timing_verdict(lo, hi, p, cfg)}


def compare_relative(base: list[float], base_ref: list[float], new: list[float], new_ref: list[float],
                     cfg: CompareConfig) -> dict[str, Any]:
    """A path's time relative to the reference timed in the same run, NEW against BASE (module docstring)."""
    scale_base, scale_new = float(np.median(base_ref)), float(np.median(new_ref))
    lo, hi = bootstrap_relative(base, base_ref, new, new_ref, resamples=cfg.bootstrap, confidence=cfg.confidence,
                                seed=cfg.seed)
    _, p = mann_whitney(np.log(base) - math.log(scale_base), np.log(new) - math.log(scale_new))
    relative = float((np.median(new) / scale_new) / (np.median(base) / scale_base))
    return {"ratio": float(np.median(new) / np.median(base)), "relative": relative, "ci_low": lo, "ci_high": hi,
            "p": p, "n_base": len(base), "n_new": len(new), "verdict": timing_verdict(lo, hi, p, cfg)}


def fingerprint_difference(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    ma, mb = a["provenance"]["machine"], b["provenance"]["machine"]
    return [f"{k}: {ma.get(k)} vs {mb.get(k)}" for k in sorted(set(ma) | set(mb))
            if k not in FINGERPRINT_IGNORES and ma.get(k) != mb.get(k)]


@dataclass
class Comparison:
    rows: list[dict[str, Any]] = field(default_factory=list)  # one per (point, path, what)
    only_base: list[str] = field(default_factory=list)
    only_new: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["regression"]]


def _worst_error(path: dict[str, Any]) -> tuple[str, float] | None:
    worst = {k: v for k, v in path.get("worst", {}).items() if "max_abs_err" in v}
    if not worst:
        return None
    output = "out" if "out" in worst else sorted(worst)[0]
    return output, worst[output]["max_abs_err"]


def _parity_rows(point: str, base: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    bp, np_ = (base.get("parity") or {}).get("paths", {}), (new.get("parity") or {}).get("paths", {})
    for name in sorted(set(bp) & set(np_)):
        was, now = bp[name]["verdict"], np_[name]["verdict"]
        a, b = _worst_error(bp[name]), _worst_error(np_[name])
        ratio = b[1] / a[1] if a and b and a[0] == b[0] and a[1] > 0 else None
        rows.append({"point": point, "path": name, "what": f"parity {a[0] if a else ''}".strip(),
                     "base": was, "new": now, "ratio": ratio, "relative": None, "interval": None, "p": None,
                     "verdict": f"{was} -> {now}" if was != now else was,
                     "regression": was == "pass" and now != "pass"})
    bt, nt = base.get("bench_train") or {}, new.get("bench_train") or {}
    for name in sorted(set(bt.get("drift", {})) & set(nt.get("drift", {}))):
        was, now = bt["drift_verdict"][name], nt["drift_verdict"][name]
        a, b = bt["drift"][name], nt["drift"][name]
        rows.append({"point": point, "path": name, "what": "loss drift", "base": f"{a:.2e}", "new": f"{b:.2e}",
                     "ratio": b / a if a > 0 else None, "relative": None, "interval": None, "p": None,
                     "verdict": f"{was} -> {now}" if was != now else was,
                     "regression": was == "pass" and now != "pass"})
    return rows


REFERENCE = "reference"  # the path every other is judged against, timed in the same run


def _timing_rows(point: str, base: Stored, new: Stored, cfg: CompareConfig) -> list[dict[str, Any]]:
    rows = []
    eb, en = timed_entries(base.receipt), timed_entries(new.receipt)
    sb, sn = raw_samples(base.folder) or {}, raw_samples(new.folder) or {}
    for impl, mode in sorted(set(eb) & set(en), key=lambda k: (k[0] != REFERENCE, k[0], MODES.index(k[1]))):
        if (impl, mode) not in sb or (impl, mode) not in sn:
            continue
        row = {"point": point, "path": impl, "what": f"time {mode}",
               "base": f"{eb[impl, mode]['median_ms']:.4g} ms", "new": f"{en[impl, mode]['median_ms']:.4g} ms",
               "samples": f"{len(sb[impl, mode])}/{len(sn[impl, mode])}", "regression": False}
        if impl == REFERENCE:  # the machine's speed: shown, never judged
            result = compare_samples(sb[impl, mode], sn[impl, mode], cfg)
            change = result["verdict"]
            said = (f"machine speed changed by x{result['ratio']:.2f}" if change != "no measurable difference"
                    else "no measurable difference in machine speed")
            rows.append({**row, "ratio": result["ratio"], "relative": None,
                         "interval": (result["ci_low"], result["ci_high"]), "p": result["p"],
                         "verdict": f"{said} (the reference: not judged)"})
            continue
        ref = (REFERENCE, mode)
        if ref not in sb or ref not in sn or min(*sb[ref], *sn[ref], *sb[impl, mode], *sn[impl, mode]) <= 0:
            ratio = float(np.median(sn[impl, mode]) / np.median(sb[impl, mode]))
            rows.append({**row, "ratio": ratio, "relative": None, "interval": None, "p": None,
                         "verdict": "not judged: no reference timed in both runs to scale it by (or a time <= 0)"})
            continue
        result = compare_relative(sb[impl, mode], sb[ref], sn[impl, mode], sn[ref], cfg)
        rows.append({**row, "ratio": result["ratio"], "relative": result["relative"],
                     "interval": (result["ci_low"], result["ci_high"]), "p": result["p"],
                     "verdict": result["verdict"], "regression": result["verdict"] == "slower"})
    return rows


def pair(base: list[Stored], new: list[Stored]) -> tuple[list[tuple[str, Stored, Stored]], list[str], list[str]]:
    if len(base) == 1 and len(new) == 1:
        name = base[0].name if base[0].name == new[0].name else f"{base[0].name} vs {new[0].name}"
        return [(name, base[0], new[0])], [], []
    by_base, by_new = {s.name: s for s in base}, {s.name: s for s in new}
    shared = [(name, by_base[name], by_new[name]) for name in sorted(set(by_base) & set(by_new))]
    return shared, sorted(set(by_base) - set(by_new)), sorted(set(by_new) - set(by_base))


def compare(base: list[Stored], new: list[Stored], cfg: CompareConfig, *, across_devices: bool = False) -> Comparison:
    pairs, only_base, only_new = pair(base, new)
    result = Comparison(only_base=only_base, only_new=only_new)
    for point, b, n in pairs:
        result.rows += _parity_rows(point, b.receipt, n.receipt)
        differ = fingerprint_difference(b.receipt, n.receipt)
        if differ and not across_devices:
            result.notes.append(f"{point}: timings not compared: device fingerprints differ ({'; '.join(differ)}); "
                                "--across-devices compares them anyway")
            continue
        if differ:
            result.notes.append(f"{point}: timings compared across devices ({'; '.join(differ)})")
        result.rows += _timing_rows(point, b, n, cfg)
    return result


def _frame(result: Comparison) -> Any:
    import pandas as pd

    return pd.DataFrame([{
        "point": r["point"], "path": r["path"], "what": r["what"], "base": r["base"], "new": r["new"],
        "new/base": "-" if r["ratio"] is None else f"{r['ratio']:.3f}",
        "vs reference": "-" if r.get("relative") is None else f"{r['relative']:.3f}",
        "interval": "-" if r["interval"] is None else f"{r['interval'][0]:.3f}-{r['interval'][1]:.3f}",
        "p": "-" if r["p"] is None else f"{r['p']:.2g}",
        "verdict": r["verdict"] + (" REGRESSION" if r["regression"] else ""),
    } for r in result.rows], columns=["point", "path", "what", "base", "new", "new/base", "vs reference", "interval",
                                      "p", "verdict"])


def _tail(result: Comparison, cfg: CompareConfig) -> list[str]:
    lines = list(result.notes)
    if result.only_base:
        lines.append(f"only in base: {', '.join(result.only_base)}")
    if result.only_new:
        lines.append(f"only in new: {', '.join(result.only_new)}")
    lines.append("timings are judged relative to the reference timed in the same run: vs reference = "
                 "(path median / reference median in new) / (the same in base), so a machine uniformly slower in "
                 "one run gives no verdict; new/base is the absolute ratio; the reference's own rows show the "
                 "machine's speed, not judged")
    lines.append(f"rule: slower when the {cfg.confidence:.0%} bootstrap interval of 'vs reference' lies above "
                 f"{1 + cfg.threshold:.3g} and the Mann-Whitney p (log-times over the run's reference median) < "
                 f"{cfg.alpha}; faster when it lies below {1 / (1 + cfg.threshold):.3g} with the same p; parity and "
                 "drift: pass -> fail regresses")
    regressed = result.regressions
    lines.append(f"{len(regressed)} regression(s)" + (": " + ", ".join(f"{r['point']}/{r['path']} {r['what']}"
                                                                       for r in regressed) if regressed else ""))
    return lines


def table(result: Comparison, cfg: CompareConfig) -> str:
    frame = _frame(result)
    body = frame.to_string(index=False) if len(frame) else "(nothing shared to compare)"
    return "\n".join([body, *_tail(result, cfg)])


def markdown(result: Comparison, cfg: CompareConfig, base: str, new: str) -> str:
    frame = _frame(result)
    lines = [f"# compare: `{base}` -> `{new}`", "", "| " + " | ".join(frame.columns) + " |",
             "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines + [""] + [f"- {line}" for line in _tail(result, cfg)]) + "\n"
