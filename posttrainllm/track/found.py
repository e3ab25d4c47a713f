"""Where receipts are: a receipt.json known by what it holds (`is_receipt`) and found under folders
(`receipt_files`); the one rule the report, import, replay and compare find receipts by (track/receipt.py
re-exports these names)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from posttrainllm.track.stamp import STAMPS

SCHEMA = "posttrainllm.track.receipt/1"
HEADS_SCHEMA = "posttrainllm.track.receipt.heads/1"  # a draft-heads receipt (build_heads): no point, no sweep
RECEIPT_NAME = "receipt.json"
RECEIPT_FAMILY = "posttrainllm.track.receipt"  # every receipt's schema starts so (SCHEMA, HEADS_SCHEMA, later ones)


def is_receipt(path: Path) -> bool:
    """Whether `path` is a receipt, by what it is: the one rule import, replay and compare find receipts by.

    Only a file named receipt.json is looked at (what a point's receipt stage writes), and its content
    decides: a receipt names its schema (RECEIPT_FAMILY). A file the pipeline writes for itself under that
    name, a stage's stamp (runs/<point>/stamps/receipt.json) or a stage's inputs file
    (runs/inputs/<point>/receipt.json), is a JSON object that names its stage and no receipt schema: not a
    receipt. One that cannot be read as a JSON object, or that names no schema and no stage (a receipt whose
    schema was cut), stays a receipt, so the reader names what is wrong with it instead of skipping it.
    """
    if path.name != RECEIPT_NAME or not path.is_file():
        return False
    try:
        content = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return True  # damaged or truncated: named as a bad receipt by `check`
    if not isinstance(content, dict):
        return True
    schema = content.get("schema")
    if schema is not None:
        return isinstance(schema, str) and schema.startswith(RECEIPT_FAMILY)
    return "stage" not in content


def receipt_files(folder: Path) -> list[Path]:
    """The receipts in `folder`, sorted (`is_receipt` tells a receipt from the pipeline's own files).

    A point is a folder with a receipt at its top level: `folder` itself, or any folder below it
    (a sweep's runs/<point>/, runs/bench/<name>/, runs/heads/<K name>/, a gpu-check OUTDIR/<point>/).
    Nothing inside a point is searched, and no stamps/ folder is: a point whose receipt.json is gone
    does not offer its receipt stage's stamp instead. runs/inputs/<point>/receipt.json (what DVC reruns
    the receipt stage on) is not a receipt either, by its content.
    """
    found = []
    for where, subfolders, files in os.walk(folder):
        here = Path(where)
        if here.name == STAMPS:
            subfolders.clear()
            continue
        subfolders.sort()
        if RECEIPT_NAME in files and is_receipt(here / RECEIPT_NAME):
            found.append(here / RECEIPT_NAME)
            subfolders.clear()
    return sorted(found)
