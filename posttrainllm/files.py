"""Where a point's files live, and how JSON is read and written: shared by every layer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posttrainllm.config import LabConfig


# Files of user paths loaded in this process ({shown path: sha256}; opdefs/user.py fills it): the stage
# stamps hash them beside the package's own modules (track/stamp.py)
USER_SOURCES: dict[str, str] = {}


def point_dir(cfg: LabConfig) -> Path:
    return Path(cfg.run.out_dir) / cfg.run.name


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())
