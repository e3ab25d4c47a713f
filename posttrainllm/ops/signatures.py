"""The docs' table of each op's natural signature, rendered from its `SIGNATURE` (OpDef.signature): one source.

    python -m posttrainllm.ops.signatures      rewrites the table in docs/bring-your-own-kernel.md

The table sits between two markers in that page; tests/test_new_impl.py fails when it differs from this rendering.
"""

from __future__ import annotations

import sys
from pathlib import Path

from posttrainllm.config import PROJECT_ROOT
from posttrainllm.ops.registry import OPS

DOC = PROJECT_ROOT / "docs" / "bring-your-own-kernel.md"
BEGIN = "<!-- signatures: generated from each op's SIGNATURE by `python -m posttrainllm.ops.signatures` -->"
END = "<!-- end of signatures -->"


def table() -> str:
    """One row per op: the call (up to the first ';') as code, then the shapes and the math."""
    rows = ["| op | signature | shapes and math |", "|---|---|---|"]
    for op in OPS.values():
        call, _, rest = op.signature.partition(";")
        rows.append(f"| `{op.name}` | `{call.strip()}` | {rest.strip()} |")
    return "\n".join(rows)


def documented(doc: Path = DOC) -> str:
    """The table as the page has it, between the markers."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{doc}: no signature table between {BEGIN!r} and {END!r}")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def write(doc: Path = DOC) -> bool:
    """Rewrite the page's table from the ops; True when it changed."""
    documented(doc)  # the markers are there
    text = doc.read_text()
    before, rest = text.split(BEGIN, 1)
    new = f"{before}{BEGIN}\n{table()}\n{END}{rest.split(END, 1)[1]}"
    doc.write_text(new)
    return new != text


if __name__ == "__main__":
    changed = write()
    print(f"{DOC}: {'table rewritten' if changed else 'table already current'}")
    sys.exit(0)
