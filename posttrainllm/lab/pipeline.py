"""What DVC's stage scripts share: load a point from params.yaml, run one stage, map errors to exit codes.

Exit codes: 0 done; 1 a contract broke (its report is written); 2 bad config.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Callable

from posttrainllm.measure import device as devices
from posttrainllm.config import ConfigError, LabConfig, validate

PARAMS = Path("params.yaml")
RUNS = "runs"
CALIBRATION = Path(RUNS) / "calibration.json"


def sweep_id(points: dict[str, Any]) -> str:
    """A stable id for a sweep plan: the hash of its points' resolved configs."""
    return hashlib.sha256(json.dumps(points, sort_keys=True).encode()).hexdigest()[:16]


def load_point(point: str, params_path: Path = PARAMS) -> tuple[LabConfig, dict[str, Any]]:
    """A point's validated config (writing to runs/<point>/) and its sweep identity."""
    import yaml

    params = yaml.safe_load(params_path.read_text())
    points = params.get("points") or {}
    if point not in points:
        raise ConfigError(f"unknown point {point!r}: params.yaml has {', '.join(points) or 'no points'}")
    cfg = validate({**points[point]["config"], "run": {"name": point, "out_dir": RUNS}})
    sweep = {"name": params["sweep"]["name"], "id": sweep_id(points), "changes": points[point]["changes"]}
    return cfg, sweep


def _stage(name: str) -> Callable[[LabConfig, dict[str, Any]], Any]:
    from posttrainllm.track import receipt
    from posttrainllm.lab import stages

    table: dict[str, Callable[[LabConfig, dict[str, Any]], Any]] = {
        "reference": lambda cfg, _: stages.run_reference(cfg, stages.point_dir(cfg)),
        "kernel": lambda cfg, _: stages.run_kernel(cfg, stages.point_dir(cfg)),
        "parity": lambda cfg, _: stages.run_parity(cfg, stages.point_dir(cfg)),
        "microbench": lambda cfg, _: stages.run_microbench(cfg, stages.point_dir(cfg),
                                                           stages.read_json(CALIBRATION)),
        "bench_train": lambda cfg, _: stages.run_bench_train(cfg, stages.point_dir(cfg)),
        "receipt": lambda cfg, sweep: receipt.record(cfg, sweep=sweep),
    }
    return table[name]


def run_stage(stage: str, argv: list[str]) -> int:
    """`python pipelines/<stage>.py POINT`: one stage of one point."""
    from posttrainllm.files import ContractBroken

    if len(argv) != 1:
        print(f"usage: python pipelines/{stage}.py POINT", file=sys.stderr)
        return 2
    try:
        cfg, sweep = load_point(argv[0])
        devices.prepare(cfg.device.name, cfg.bench.threads)
        _stage(stage)(cfg, sweep)
    except ConfigError as exc:
        print(f"posttrainllm: config error: {exc}", file=sys.stderr)
        return 2
    except ContractBroken as exc:
        print(f"posttrainllm: {stage} {argv[0]}: {exc}", file=sys.stderr)
        return 1
    return 0


def write_fingerprint(path: Path) -> int:
    """The device stage: this machine's fingerprint, which every timed stage depends on."""
    from posttrainllm.files import write_json

    fingerprint = devices.fingerprint(devices.resolve("auto"))
    write_json(path, fingerprint)
    return 0


def write_calibration(path: Path) -> int:
    """The calibrate stage: this device's measured peaks (GEMM FLOP/s per dtype, copy bandwidth)."""
    from posttrainllm.measure import calibrate
    from posttrainllm.config import load
    from posttrainllm.files import write_json

    cfg = load()
    device = devices.prepare("auto", cfg.bench.threads)  # timed stages run at the same thread count
    write_json(path, calibrate.calibrate(device))
    return 0
