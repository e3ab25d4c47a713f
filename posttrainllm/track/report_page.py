"""The sweep report as one static HTML page (runs/report.html), to open from disk.

The page is self-contained but for the files it links: each point's plots and receipt.json, named by
paths relative to the page's folder (the sweep's runs/), so the folder can be moved or archived whole.
No script, no stylesheet or font from elsewhere, no server. Its order is the terminal's: the summary
table with failing points first, then one section per point (its verdict, first failure, parity per
path, plots and receipt).
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pandas as pd

from posttrainllm.track import derived, report

PLOTS = ("time_vs_size.png", "memory_vs_size.png", "roofline.png")  # what the microbench stage draws

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 12.5px; }
body { max-width: 1280px; box-sizing: border-box; }
th, td { border: 1px solid #ccc; padding: 1px 4px; text-align: left; vertical-align: top; }
th { white-space: nowrap; font-size: 12px; font-weight: 600; }
td { white-space: nowrap; }
td.text { white-space: normal; overflow-wrap: anywhere; min-width: 5em; max-width: 18em; }
tr.fail td { background: #fde2e2; }
.wide { overflow-x: auto; max-width: 100%; }
img { max-width: 32%; min-width: 320px; margin: 0 0.5% 0.5em 0; border: 1px solid #eee; vertical-align: top; }
section { border-top: 2px solid #888; margin-top: 1.5em; }
"""


def _e(value: Any) -> str:
    return html.escape("-" if value is None else str(value))


def _href(*parts: str) -> str:
    """A relative link from the page to a file in a point's folder."""
    return "/".join(quote(part) for part in parts)


def _table(frame: pd.DataFrame, *, link_points: bool = False) -> str:
    """A formatted frame (strings) as an HTML table; rows of failing points marked."""
    head = "".join(f"<th>{_e(c)}</th>" for c in frame.columns)
    rows = []
    for row in frame.to_dict("records"):
        cells = []
        for column, value in row.items():
            text = _e(value)
            if link_points and column == "point":
                text = f'<a href="#{_e(_anchor(value))}">{text}</a>'
            wraps = (column in PROSE or len(str(value)) > WRAP_AT) and not _number(value)  # numbers never wrap
            cells.append(f'<td class="text">{text}</td>' if wraps else f"<td>{text}</td>")
        marked = ' class="fail"' if row.get("verdict") == "FAIL" else ""
        rows.append(f"<tr{marked}>{''.join(cells)}</tr>")
    # a table wider than the page scrolls inside its own box: the page itself keeps to PAGE_WIDTH
    return f'<div class="wide"><table><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>'


PAGE_WIDTH = 1280  # px: the page fits a laptop's screen (tests/test_report_html.py measures it in Chromium)
WRAP_AT = 24  # characters past which a text cell may wrap
PROSE = ("note", "first_failure", "parity", "flags", "change", "failed cases", "why")  # columns that always may


def _number(value: Any) -> bool:
    return bool(re.fullmatch(r"[-+0-9.e%x ]+|[-0-9.e]+-[-0-9.e]+", str(value)))


def _anchor(point: str) -> str:
    return f"point-{point}"


def parity_rows(receipt: dict[str, Any]) -> pd.DataFrame:
    """One row per path: its verdict, its tensor nearest (or furthest past) its bound (derived.py), what failed."""
    rows = []
    fields = derived.path_fields(receipt)
    for name, entry in ((receipt.get("parity") or {}).get("paths") or {}).items():
        f = fields[name]
        failed = entry.get("failed_cases") or []
        rows.append({
            "path": name,
            "verdict": entry.get("verdict", "-"),
            "worst err/allowed": f"{f['worst_ratio']:.3f} ({f['worst_tensor']}, {f['worst_case'] or '-'})"
                                 if f["worst_ratio"] is not None else "-",
            "failed cases": "; ".join(failed[:3]) + (f"; and {len(failed) - 3} more" if len(failed) > 3 else "")
                            or "-",
            "note": "; ".join(filter(None, ["bf16 emulated" if entry.get("emulation") else "",
                                            report.backward_note(entry.get("backward")),
                                            report.raised_note(entry)])) or "-",
        })
    return pd.DataFrame(rows, columns=["path", "verdict", "worst err/allowed", "failed cases", "note"])


def path_rows(receipt: dict[str, Any]) -> pd.DataFrame:
    """The console's per-path table (report.path_frame: the same derived fields), with each path's peak memory
    and roofline fraction; a fraction above 100% is shown as not a result (track/derived.py)."""
    frame = report.path_frame(receipt)
    fields = derived.path_fields(receipt)
    frame.insert(len(frame.columns) - 1, "peak_MB", [report._fmt(None if fields[p]["peak_bytes"] is None else
                                                                 fields[p]["peak_bytes"] / 1e6, ".2f")
                                                     for p in frame["path"]])
    frame.insert(len(frame.columns) - 1, "roofline", [
        "-" if (f := fields[p]["roofline_fraction"]) is None else f"{f:.0%}: not a result" if f > 1 else f"{f:.0%}"
        for p in frame["path"]])
    return frame


def _train_section(receipt: dict[str, Any]) -> str:
    """bench-train: its line, the loss curves (inline SVG) and the table the console prints (report.train_frame:
    speed, loss ends, drift, predicted against measured end-to-end speedup, and why a path was not trained)."""
    if not (receipt.get("bench_train") or {}).get("impls"):
        return ""
    from posttrainllm.track import plots

    return (f"<h3>Bench-train</h3><p>{_e(report.train_head(receipt))}</p>"
            f'{_table(report.train_frame(receipt).astype(str))}'
            f"<figure>{plots.loss_curves_svg(receipt['bench_train'], prefix=_anchor(receipt['point']) + '-loss-')}"
            "</figure>")


def _rules_section(*receipts: dict[str, Any]) -> str:
    """The rules the receipts' results cite by id, each once, with its text from the package's table
    (docs/rules.md)."""
    cited = list(dict.fromkeys(pair for receipt in receipts for pair in derived.cited_rules(receipt)))
    if not cited:
        return ""
    items = "".join(f"<li><code>{_e(rid)}</code>: {_e(said)}</li>" for rid, said in cited)
    return f"<details><summary>Rules ({len(cited)}, by id)</summary><ul>{items}</ul></details>"


def _point_section(name: str, receipt: dict[str, Any], runs: Path) -> str:
    failed = report.point_failed(receipt)
    parity = receipt.get("parity") or {}
    changes = ", ".join(f"{k}={v}" for k, v in ((receipt.get("sweep") or {}).get("changes") or {}).items())
    machine = (receipt.get("provenance") or {}).get("machine") or {}
    facts = [
        f"<b>{'FAIL' if failed else 'pass'}</b>",
        f"changes: {_e(changes or 'none (the baseline)')}",
        f"{_e(((receipt.get('config') or {}).get('op') or {}).get('name'))} "
        f"{_e((receipt.get('microbench') or {}).get('problem', ''))} on {_e(machine.get('device_name'))}",
        f'<a href="{_href(name, "receipt.json")}">receipt.json</a>',
    ]
    if parity.get("first_failure"):
        facts.insert(1, f"first failure: <code>{_e(parity['first_failure'])}</code>")
    plots = [plot for plot in PLOTS if (runs / name / plot).is_file()]
    lines = report.path_lines(receipt)  # why each failing rule failed, and every flag with its reason
    step = derived.point_fields(receipt)["e2e_sentence"]
    images = "".join(f'<a href="{_href(name, plot)}"><img src="{_href(name, plot)}" alt="{_e(name)}: {_e(plot)}">'
                     f"</a>" for plot in plots)
    return (f'<section id="{_e(_anchor(name))}"><h2>{_e(name)}</h2><p>{" · ".join(facts)}</p>'
            + (f"<h3>Paths</h3>{_table(path_rows(receipt).astype(str))}<p>{_e(report.PATH_LEGEND)}</p>"
               if receipt.get("parity") or receipt.get("microbench") else "")
            + (f"<h3>Failures and flags</h3><ul>{''.join(f'<li>{_e(line)}</li>' for line in lines)}</ul>"
               if lines else "")
            + f"<h3>The training step</h3><p>{_e(step)}</p>"
            + f"<h3>Parity per path</h3>{_table(parity_rows(receipt).astype(str))}"
            + _train_section(receipt)
            + _rules_section(receipt)
            + (f"<h3>Plots</h3><p>{images}</p>" if plots else "<p>No plots in this point's folder.</p>")
            + "</section>")


def sweep_page(receipts: dict[str, dict[str, Any]], runs: Path, *, sweep: str = "",
               heads: dict[str, dict[str, Any]] | None = None) -> str:
    """The page for `runs/report.html`: `runs` is the folder it is written to (the points' folders are in it)."""
    summary = report.formatted(report.summary_frame(receipts))  # failing points first
    failed = sum(report.point_failed(r) for r in receipts.values())
    title = f"posttrainllm sweep {sweep}: {len(receipts)} points, {failed} failed".replace("  ", " ")
    wide = report.formatted(report.sweep_frame(receipts))
    legend = f"<p>{_e(' '.join(line.strip() for line in report.SUMMARY_LEGEND))}</p>"
    body = [
        f"<h1>{_e(title)}</h1>",
        "<h2>Summary</h2>", _table(summary, link_points=True), legend,
        f'<details><summary>Every column (as <a href="report.md">report.md</a>)</summary>'
        f'{_table(wide)}</details>',
        *(_point_section(name, receipts[name], runs) for name in summary["point"]),
    ]
    if heads:  # the draft heads' receipts (runs/heads/<K>/): acceptance and decode speed, lossless or not
        body += ['<section id="draft-heads"><h2>Draft heads</h2>', _table(report.heads_frame(heads)),
                 f"<p>{_e(report.HEADS_LEGEND)}. Each receipt: "
                 + " · ".join(f'<a href="{_href(*name.split("/"), "receipt.json")}">{_e(name)}</a>' for name in heads)
                 + "</p>" + _rules_section(*heads.values()) + "</section>"]
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{STYLE}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")
