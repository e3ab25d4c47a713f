"""DVC stage 'receipt': the point's stage files checked against their stamps and combined into receipt.json,
config.yaml and metrics.json, logged as one MLflow run (track/receipt.py `record`)."""

from __future__ import annotations

from typing import Any

from posttrainllm.config import LabConfig


def run_receipt(cfg: LabConfig, sweep: dict[str, Any]) -> Any:
    """The receipt of one sweep point (`sweep`: the sweep's name, id, the point's changes and every point)."""
    from posttrainllm.track import receipt  # MLflow's code: imported by the receipt stage only

    return receipt.record(cfg, sweep=sweep)
