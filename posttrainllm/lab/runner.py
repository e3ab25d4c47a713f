"""The one way the lab calls a path: the point's paths, each with the runner it needs.

Every path of a point (the reference, the peers, ours, a user's) is an `Impl` of the op's registry; the paths
from outside (op.user_impls) are made here, since they run in a worker process the lab starts
(lab/isolation/). The stages take the point's paths from `paths` and never ask where one came from.
"""

from __future__ import annotations

from posttrainllm.config import LabConfig
from posttrainllm.opdefs import REFERENCE, Impl, OpDef
from posttrainllm.lab.isolation.user import user_paths


def paths(op: OpDef, cfg: LabConfig) -> dict[str, Impl]:
    """The point's paths (OpDef.paths), the paths from outside included."""
    return op.paths(cfg, user_paths)


def optimized(op: OpDef, cfg: LabConfig) -> list[Impl]:
    """The paths checked against the reference (everything but the reference itself)."""
    return [impl for name, impl in paths(op, cfg).items() if name != REFERENCE]


def train_impls(op: OpDef, cfg: LabConfig) -> list[str]:
    """The implementations bench-train runs (OpDef.train_impls), the paths from outside included."""
    return op.train_impls(cfg, user_paths)
