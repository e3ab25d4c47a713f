"""The README's headline table and docs/measured.md's latest sweep, written from a receipt set, never by hand.

`posttrainllm report --write-docs [FOLDER ...]` reads the receipts (a sweep's runs/ by default), takes the
headline's figures from them (`figures`: every figure from a receipt, with the revision, the date and the machine
the receipts name), keeps them in docs/headline.json, and rewrites the blocks between BEGIN and END in README.md
and docs/measured.md with `readme_block` and `measured_block` of those figures. A test renders the blocks from
docs/headline.json and compares them with the two files, so an edit by hand (or a stale file) fails it.

The sweep's one stated duration is the receipts' own: from the first point stage's start to the last point
stage's end, from the stages' stamps (report.stage_times); DVC's own start-up and the once-per-machine stages
are outside it, and the draft heads, which leave no point receipt, too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posttrainllm.track import derived, report

COMMAND = "posttrainllm report --write-docs"
FIGURES = Path("docs/headline.json")
README = Path("README.md")
MEASURED = Path("docs/measured.md")
BEGIN = "<!-- headline: begin; written by `posttrainllm report --write-docs` from receipts, do not edit by hand -->"
END = "<!-- headline: end -->"


def _si(value: float | None) -> str:
    if value is None:
        return "-"
    for factor, prefix in ((2**20, "Mi"), (2**10, "Ki")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}B"
    return f"{value:.0f} B"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _op(receipt: dict[str, Any]) -> str | None:
    return ((receipt.get("config") or {}).get("op") or {}).get("name")


def _point(receipts: dict[str, dict[str, Any]], name: str | None = None, op: str | None = None
           ) -> tuple[str, dict[str, Any]] | tuple[None, None]:
    """The receipt named `name`, else the first whose op is `op` and that changes nothing else."""
    if name in receipts:
        return name, receipts[name]
    for key, receipt in receipts.items():
        changes = (receipt.get("sweep") or {}).get("changes") or {}
        if op and _op(receipt) == op and set(changes) <= {"op"}:
            return key, receipt
    return None, None


def _path(receipt: dict[str, Any], path: str) -> dict[str, Any]:
    return derived.path_fields(receipt).get(path) or {}


def _costs(receipt: dict[str, Any], path: str) -> int | None:
    entry = (((receipt.get("microbench") or {}).get("paths") or {}).get(path) or {})
    return (entry.get("costs") or {}).get("bytes")


def _compile_s(entry: dict[str, Any]) -> float | None:
    """A compiled peer's first call at the timed shape (its compile, never timed): the first signature its
    microbench process compiled (opdefs/peers.py evidence), None where it has no evidence."""
    signatures = (entry.get("evidence") or {}).get("signatures") or {}
    return next((s.get("first_call_s") for s in signatures.values() if isinstance(s, dict)), None)


def figures(receipts: dict[str, dict[str, Any]], command: str = COMMAND) -> dict[str, Any]:
    """The headline's figures, each read from a receipt (None where the receipt set has none), with what they came
    from: the revision(s), the newest receipt's date, the machine and the sweep's duration."""
    stamps = report.stage_times(receipts)
    newest = max((r.get("created_at") or "" for r in receipts.values()), default="")
    revisions = sorted({((r.get("provenance") or {}).get("revision") or "unknown")[:7]
                        + ("+dirty" if (r.get("provenance") or {}).get("dirty") else "") for r in receipts.values()})
    machine = next(iter(receipts.values()), {}).get("provenance", {}).get("machine") or {}
    out: dict[str, Any] = {
        "command": command, "revisions": revisions, "date": newest,
        "machine": {"device_name": machine.get("device_name"), "threads": machine.get("threads")},
        "flagged": sum(len(derived.point_fields(r)["flags"]) for r in receipts.values()),
        "points": len(receipts), "names": list(receipts), "failed": sorted(n for n, r in receipts.items() if report.point_failed(r)),
        "sweep_s": stamps["wall_s"], "point_stages_s": stamps["stages_total_s"] or None,
    }
    name, base = _point(receipts, "baseline")
    if base:
        sdpa, ref = _path(base, "sdpa"), _path(base, "reference")
        micro = base.get("microbench") or {}
        fields = derived.point_fields(base)
        out["baseline"] = {
            "point": name, "problem": micro.get("problem"),
            "precision": ((base.get("config") or {}).get("precision") or {}).get("name"),
            "sdpa_x": sdpa.get("fwd_x"), "sdpa_fb_x": sdpa.get("fb_x"),
            "reference_bytes": _costs(base, "reference"), "sdpa_bytes": _costs(base, "sdpa"),
            "floor_bytes": micro.get("bytes"), "reference_ms": ref.get("fwd_ms"),
            "peers": {peer: {"fwd_ms": _path(base, peer).get("fwd_ms"), "fb_x": _path(base, peer).get("fb_x"),
                             "compile_s": _compile_s(((micro.get("paths") or {}).get(peer) or {}))}
                      for peer in ("compiled", "flex") if _path(base, peer)},
            "step": fields["e2e_sentence"], "step_path": fields["e2e_path"],
        }
    out["other_ops"] = []  # per op beside the baseline's: its first point that changes only the op
    seen = {_op(base) if base else None}
    for key, receipt in receipts.items():
        op = _op(receipt)
        if op in seen or not set((receipt.get("sweep") or {}).get("changes") or {}) <= {"op"}:
            continue
        seen.add(op)
        fields = derived.point_fields(receipt)
        out["other_ops"].append({"op": op, "point": key, "problem": (receipt.get("microbench") or {}).get("problem"),
                                 "peer": fields["best_peer"], "peer_x": fields["peer_x"]})
    out["summary"] = summary_markdown(receipts)
    out["steps"] = report.step_lines(receipts)
    return out


def summary_markdown(receipts: dict[str, dict[str, Any]]) -> list[str]:
    """report.summary_frame as markdown rows (the default table of `posttrainllm report`), one string each."""
    frame = report.formatted(report.summary_frame(receipts))
    return ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns),
            *("| " + " | ".join(row) + " |" for row in frame.itertuples(index=False))]


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "not stamped (points run by `posttrainllm bench`, not `dvc repro`)"
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s" if seconds >= 60 else f"{seconds:.0f} s"


def source_line(figs: dict[str, Any]) -> str:
    machine = figs["machine"]
    failed = figs["failed"]
    return (f"Written by `{figs['command']}` from {figs['points']} receipts ({', '.join(figs['names'])}) of revision "
            f"{', '.join(figs['revisions'])}, the newest of {figs['date']}, on {machine['device_name']} "
            f"({machine['threads']} thread{'' if machine['threads'] == 1 else 's'}); "
            + (f"{len(failed)} failed: {', '.join(failed)}." if failed else f"all {figs['points']} points passed.")
            + (f" {figs['flagged']} of their figures are flagged, not to be read as results (noisy bands, a step "
               "missing its prediction, a roofline above 100%): `posttrainllm report` prints each with its reason."
               if figs["flagged"] else " No figure is flagged."))


def table_rows(figs: dict[str, Any]) -> list[str]:
    rows = [f"| the sweep, from the first point stage's start to the last's end | {_duration(figs['sweep_s'])} |"]
    base = figs.get("baseline")
    if base:
        where = f"{base['point']}, {base['problem']} {base['precision']}"
        rows.append(f"| SDPA vs the readable attention ({where}) | {_x(base['sdpa_x'])} forward, "
                    f"{_x(base['sdpa_fb_x'])} forward + backward; the readable math moves "
                    f"{_si(base['reference_bytes'])} forward (its (S, S) scores and probabilities), SDPA's fused "
                    f"kernel {_si(base['sdpa_bytes'])}, the floor {_si(base['floor_bytes'])} |")
        peers = []
        for peer, said in (("compiled", "torch.compile"), ("flex", "FlexAttention")):
            entry = base["peers"].get(peer)
            if not entry or entry["fwd_ms"] is None:
                continue
            first = (f"its first call, the compile, {entry['compile_s']:.2g} s" if entry.get("compile_s") is not None
                     else "its compile not recorded")
            peers.append(f"{said} {entry['fwd_ms']:.2f} ms forward ({first}; "
                         + (f"{_x(entry['fb_x'])} the reference forward + backward)" if entry["fb_x"] is not None
                            else "forward-only)"))
        if peers:
            rows.append(f"| the peers users reach for, same point | {', '.join(peers)}, reference "
                        f"{base['reference_ms']:.2f} ms |" if base["reference_ms"] is not None else
                        f"| the peers users reach for, same point | {', '.join(peers)} |")
        rows.append(f"| attention in a training step; Amdahl | {base['step']} |")
    for other in figs.get("other_ops", []):
        rows.append(f"| op={other['op']} ({other['point']}, {other['problem']}) | "
                    + (f"{other['peer']} {_x(other['peer_x'])} the reference forward |" if other["peer"] else
                       "no peer with a speed |"))
    return rows


def readme_block(figs: dict[str, Any]) -> str:
    """The README's headline: where the figures come from, then the table."""
    return "\n".join([BEGIN, "", source_line(figs), "", "| | measured |", "|---|---|", *table_rows(figs), "", END])


def measured_block(figs: dict[str, Any]) -> str:
    """docs/measured.md's latest sweep: the same headline, every point's summary row and step sentence."""
    return "\n".join([BEGIN, "", "## The latest sweep", "", source_line(figs), "", "| | measured |", "|---|---|",
                      *table_rows(figs), "", "Every point (`posttrainllm report`'s default table; its legend: "
                      "[results.md](results.md)):", "", *figs["summary"], "", "The step, per point:", "",
                      *(f"- {line}" for line in figs["steps"]), "", END])


def replace_block(text: str, block: str, where: Path) -> str:
    """`text` with its BEGIN..END block replaced by `block`; a file without exactly one block is an error."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{where} has no single headline block ({BEGIN!r} ... {END!r}): add one where the "
                         "headline goes")
    head, rest = text.split(BEGIN, 1)
    return head + block + rest.split(END, 1)[1]


def current_block(text: str) -> str:
    """The BEGIN..END block of a file's text, markers included."""
    return BEGIN + text.split(BEGIN, 1)[1].split(END, 1)[0] + END


def write_docs(receipts: dict[str, dict[str, Any]], root: Path, command: str = COMMAND) -> list[Path]:
    """Write docs/headline.json, then the README's and docs/measured.md's blocks from it; the files written."""
    figs = json.loads(json.dumps(figures(receipts, command)))  # the figures as the JSON file will hold them
    readme, measured = root / README, root / MEASURED
    texts = {readme: replace_block(readme.read_text(), readme_block(figs), readme),
             measured: replace_block(measured.read_text(), measured_block(figs), measured)}
    (root / FIGURES).write_text(json.dumps(figs, indent=1) + "\n")
    for path, text in texts.items():
        path.write_text(text)
    return [root / FIGURES, readme, measured]
