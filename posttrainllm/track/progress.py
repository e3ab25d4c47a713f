"""Where a sweep stands, read from files alone: the point stages done, and an estimate of the time left.

DVC runs the stages; each point stage leaves a stamp (track/stamp.py) that names the sha256 of the
inputs file it ran on (runs/inputs/<point>/<stage>.json, rewritten by the `inputs` stage at the
start of every `dvc repro`). A stage is done when that file still has that hash: DVC would not
rerun it. A point is done when all its stages are.

The time left is, summed over the stages not done, the seconds a stamp recorded for that stage
(its whole process, imports included): the same point's last run of it, else the median of that
stage over the other points of the same op, else over all points. A stage no stamp estimates is
counted apart, never guessed (the time is then a floor). DVC's own start-up between stages and the stages that
are not a point's (train_base, calibrate) come on top: a repro's pace was not used, since one slow non-point
stage (the base's training) made it read 309 minutes for a 2-minute point on the clean-clone run.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrainllm.track.stamp import INPUTS_KEY, STAMPS, file_sha256


def _seconds(stamp: dict[str, Any]) -> float | None:
    timing = stamp.get("timing") or {}
    return timing.get("process_s") or timing.get("stage_s")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass
class Progress:
    """One sweep's state: `stages` lists (point, stage) in the order DVC runs a point's stages."""

    points: list[str]
    stages: list[tuple[str, str]]
    done: set[tuple[str, str]] = field(default_factory=set)
    estimate_s: dict[tuple[str, str], float] = field(default_factory=dict)  # the stages not done that a stamp estimates

    def points_done(self) -> list[str]:
        return [p for p in self.points if all((p, s) in self.done for q, s in self.stages if q == p)]

    def pending(self) -> list[tuple[str, str]]:
        return [key for key in self.stages if key not in self.done]

    def left_s(self) -> float:
        return sum(self.estimate_s.values())

    def unestimated(self) -> int:
        return sum(1 for key in self.pending() if key not in self.estimate_s)

    def line(self) -> str:
        """'2/12 points done, 14/72 stages; about 6 min left (from the stamps)': "at least" while some stage
        left has no stamp to estimate it by."""
        text = f"{len(self.points_done())}/{len(self.points)} points done, {len(self.done)}/{len(self.stages)} stages"
        pending = self.pending()
        if not pending:
            return text
        left = self.left_s()
        if not self.estimate_s:
            return text + "; no estimate yet (none of the stages left has a stamp to go by)"
        when = f"{left / 60:.0f} min" if left >= 90 else f"{left:.0f} s"
        if self.unestimated():  # a first sweep: DVC runs one stage of every point, then the next stage
            return text + f"; at least {when} left (from the stamps; {self.unestimated()} stage(s) not yet estimated)"
        return text + f"; about {when} left (from the stamps)"


def read_progress(params_path: Path, runs: Path, stages: tuple[str, ...]) -> Progress:
    """The sweep planned in params_path (params.yaml), as its runs/ folder stands; `stages`: a point's
    stages in DVC's order (lab/pipeline.py POINT_STAGES). A ConfigError when params_path is unusable."""
    import yaml

    from posttrainllm.config import ConfigError

    try:
        planned = (yaml.safe_load(params_path.read_text()) or {}).get("points") or {}
    except (OSError, yaml.YAMLError, AttributeError) as exc:
        raise ConfigError(f"{params_path}: no sweep plan to follow ({type(exc).__name__}): plan one with "
                          "`posttrainllm sweep sweep=default`") from None
    ops = {name: ((point.get("config") or {}).get("op") or {}).get("name") for name, point in planned.items()}
    progress = Progress(list(planned), [(p, s) for p in planned for s in stages])
    stamps: dict[tuple[str, str], dict[str, Any]] = {}
    for point, stage in progress.stages:
        inputs = runs / "inputs" / point / f"{stage}.json"
        stamp = _read(runs / point / STAMPS / f"{stage}.json")
        if stamp is not None:
            stamps[(point, stage)] = stamp
        if not inputs.is_file():
            continue
        if stamp is not None and stamp.get(INPUTS_KEY) == file_sha256(inputs):
            progress.done.add((point, stage))

    def median(keys: list[tuple[str, str]]) -> float | None:
        values = [s for k in keys if (s := _seconds(stamps[k])) is not None]
        return statistics.median(values) if values else None

    for point, stage in progress.pending():
        own = _seconds(stamps[(point, stage)]) if (point, stage) in stamps else None
        same_op = [k for k in stamps if k[1] == stage and ops.get(k[0]) == ops[point]]
        estimate = own if own is not None else median(same_op)
        if estimate is None:
            estimate = median([k for k in stamps if k[1] == stage])
        if estimate is not None:
            progress.estimate_s[(point, stage)] = estimate

    return progress


def table(progress: Progress) -> str:
    """One line per point: its stages, done (the stage's name) or not ('.'), then the summary line."""
    width = max(len(p) for p in progress.points) if progress.points else 5
    rows = []
    for point in progress.points:
        marks = " ".join(stage if (point, stage) in progress.done else "." * len(stage)
                         for q, stage in progress.stages if q == point)
        rows.append(f"{point:<{width}}  {marks}")
    return "\n".join([*rows, progress.line()])
