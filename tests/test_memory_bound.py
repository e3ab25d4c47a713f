"""Memory is checked before allocation, and the float64 oracle is computed in pieces that fit."""

import dataclasses

import pytest
import torch

from posttrainllm import cli
from posttrainllm.config import ConfigError
from posttrainllm.lab.configure import load
from posttrainllm.lab.stages import reference as reference_stage
from posttrainllm.lab import oracle
from posttrainllm.measure import device as stage_devices
from posttrainllm.ops.registry import get_op


def test_a_point_that_cannot_fit_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = cli.main(["bench", "device=cpu", "shape.seq_len=100000000", "run.log_mlflow=false"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "GiB" in err and "parity.memory_fraction" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_the_budget_is_a_fraction_of_what_is_available(monkeypatch):
    cfg = load(["device=cpu", "shape.seq_len=4096", "tile=b64"])
    need = get_op("attention").reference_bytes(next(c for c in get_op("attention").cases(cfg) if c.main), cfg)
    monkeypatch.setattr(stage_devices, "available_memory_bytes", lambda device: 4 * need)
    assert reference_stage.check_memory(cfg, "cpu")["estimated_bytes"] == need  # 4x need at fraction 0.5: fits
    monkeypatch.setattr(stage_devices, "available_memory_bytes", lambda device: int(1.5 * need))
    with pytest.raises(ConfigError, match="over its budget"):
        reference_stage.check_memory(cfg, "cpu")


@pytest.mark.parametrize("arch", ["mha", "gqa", "mqa"])
def test_the_oracle_in_pieces_equals_the_oracle_in_one(arch):
    """Per (batch, kv head) pieces give the same outputs, logsumexp and gradients as one whole computation."""
    cfg = load(["device=cpu", f"architecture={arch}", "shape.batch=2", "shape.seq_len=40", "tile=b16"])
    op = get_op("attention")
    case = next(c for c in op.cases(cfg) if c.main)
    x = {k: v.double() for k, v in op.make_inputs(case, torch.float32, "cpu").items()}
    grad_out = oracle.upstream_gradient(case, op.reference.fn(x, cfg)["out"])
    pieces = oracle.reference_outputs(op, cfg, x, case, grad_out)
    whole = oracle.reference_outputs(dataclasses.replace(op, oracle_chunks=lambda case: [{}]), cfg, x, case, grad_out)
    assert len(op.oracle_chunks(case)) == 2 * cfg.architecture.n_kv_heads
    assert set(pieces) == set(whole) == {"out", "lse", "grad_q", "grad_k", "grad_v"}
    for name in whole:
        torch.testing.assert_close(pieces[name], whole[name], rtol=1e-12, atol=1e-12)
