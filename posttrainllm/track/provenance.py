"""Where a number came from: the project folder and its git revision."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any


def project_root() -> Path:
    """DVC's root when run by DVC, else the working directory (the default MLflow store and git live there)."""
    return Path(os.environ.get("DVC_ROOT") or Path.cwd())


def git_revision(root: Path | None = None) -> dict[str, Any]:
    """HEAD and whether the tree differs from it (dvc.lock excluded: `dvc repro` rewrites it as it goes)."""
    root = project_root() if root is None else root

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    revision = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--", ".", ":(exclude)dvc.lock") if revision else None
    return {"revision": revision or "unknown", "dirty": bool(status) if status is not None else None}
