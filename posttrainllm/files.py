"""Where a point's files live, and how JSON is read and written: shared by every layer."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from posttrainllm.config import PROJECT_ROOT, LabConfig


def shown(path: Path) -> str:
    """A path as a receipt shows it: relative to the project when inside it, else absolute."""
    path = path.resolve()
    return path.relative_to(PROJECT_ROOT).as_posix() if path.is_relative_to(PROJECT_ROOT) else str(path)


def point_dir(cfg: LabConfig) -> Path:
    return Path(cfg.run.out_dir) / cfg.run.name


def write_json(path: Path, data: Any) -> None:
    """Whole or not at all: written beside the target, then renamed over it (an interrupt leaves no half file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(partial, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())
