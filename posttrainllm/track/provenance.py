"""Where a number came from: the project folder and its git revision."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any


def project_root() -> Path:
    """DVC's root when run by DVC, else the working directory (the default MLflow store lives there)."""
    return Path(os.environ.get("DVC_ROOT") or Path.cwd())


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_root() -> Path:
    """The repository of the code that runs: the package's own checkout when it is one, wherever the
    command runs from; else (an installed copy, e.g. on a GPU node) DVC's root or the working directory."""
    from posttrainllm.config import PROJECT_ROOT

    top = _git(PROJECT_ROOT, "rev-parse", "--show-toplevel")
    if top and Path(top).resolve() == PROJECT_ROOT.resolve():  # not a checkout merely enclosing site-packages
        return PROJECT_ROOT
    return project_root()


def git_revision(root: Path | None = None) -> dict[str, Any]:
    """HEAD and whether the tree differs from it (dvc.lock excluded: `dvc repro` rewrites it as it goes)."""
    root = code_root() if root is None else root
    revision = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--", ".", ":(exclude)dvc.lock") if revision else None
    return {"revision": revision or "unknown", "dirty": bool(status) if status is not None else None}
