"""The `compiled` peer is compiled code, or it is not `compiled`.

Dynamo's cache and recompile limit belong to a function's code object: one torch.compile wrapper per input
signature around the same reference ran it eagerly, under the peer's name, from the ninth signature on. The
limit is lowered here (recompile_limit=2) so that a few small signatures go past it quickly.
"""

import csv
import json

import pytest
import torch
from conftest import parity_report
from torch._dynamo.utils import counters

from posttrainllm.config import LabConfig
from posttrainllm.lab.stages import microbench as microbench_stage
from posttrainllm.lab.configure import load
from posttrainllm.ops.registry import get_op
from posttrainllm.ops import peers

MATMUL = ["op=matmul", "device=cpu", "parity.seeds=[0]", "shape.ops.matmul.edge=[[41,77,33]]", "shape.ops.matmul.m=64",
          "shape.ops.matmul.n=64",
          "shape.ops.matmul.k=64", "shape.curve=[32,64]", "shape.ops.matmul.curve=[32,64]", "op.peers=[compiled]"]


def _toy(x, cfg):
    return {"out": x["a"] * 2.0 + 1.0}


def _toy_peer():
    return peers.compiled("toy", _toy, None, "toy")(LabConfig())


@torch._dynamo.config.patch(recompile_limit=2)
def test_past_the_recompile_limit_every_signature_is_compiled():
    """Each new signature is a new graph (dynamo's own counter), never the reference run eagerly."""
    peer = _toy_peer()
    for n in range(1, 5):  # twice the limit
        graphs = counters["stats"]["unique_graphs"]
        x = torch.randn(n + 100)
        out = peer.fn({"a": x}, LabConfig())["out"]
        assert counters["stats"]["unique_graphs"] == graphs + 1, f"signature {n} ran eagerly"
        torch.testing.assert_close(out, x * 2.0 + 1.0)
    signatures = peer.evidence()["signatures"]
    assert all(s["graphs"] == 1 and s["recompiles"] == 0 for label, s in signatures.items() if "a(10" in label)


def test_a_call_that_would_run_eagerly_is_named_never_returned(monkeypatch):
    x = {"a": torch.randn(7)}
    monkeypatch.setattr(peers, "_compile", lambda fn: fn)  # dynamo silently not applied: the old failure, made sure
    with pytest.raises(peers.NotCompiled, match="no compiled code for a\\(7,\\).*it ran eagerly"):
        _toy_peer().fn(x, LabConfig())
    monkeypatch.undo()
    with torch.compiler.set_stance("force_eager"), pytest.raises(peers.NotCompiled, match="stance 'force_eager'"):
        _toy_peer().fn({"a": torch.randn(9)}, LabConfig())

    def broken(x, cfg):
        torch._dynamo.graph_break()
        return {"out": x["a"] + 1.0}

    with pytest.raises(peers.NotCompiled, match="a graph break"):
        peers.compiled("broken", broken, None, "broken")(LabConfig()).fn({"a": torch.randn(5)}, LabConfig())


@torch._dynamo.config.patch(recompile_limit=2)
def test_a_size_that_ran_eagerly_gets_no_compiled_time(tmp_path, monkeypatch):
    """A matmul point with more signatures than the (lowered) limit: each is compiled and recorded; one curve size
    made to run eagerly gets no time, its reason in curve.csv, while the others are timed."""
    real = peers._compile

    def eager_at_32(fn):  # dynamo skips the 32x32 problem: the reference runs eagerly there
        compiled = real(fn)

        def call(x, cfg):
            return fn(x, cfg) if x["a"].shape == (32, 32) else compiled(x, cfg)

        return call

    monkeypatch.setattr(peers, "_compile", eager_at_32)
    cfg = load([*MATMUL, "bench.reps=3", "bench.min_time_s=0", "bench.warmup=1"])
    report = parity_report(cfg, tmp_path)
    assert report["paths"]["compiled"]["verdict"] == "pass", report["paths"]["compiled"]["failed_cases"]
    kernel = json.loads((tmp_path / "kernel.json").read_text())["paths"]["compiled"]
    assert kernel["evidence"]["signatures"] and all(s["graphs"] >= 1 for s in kernel["evidence"]["signatures"].values())
    calibration = {"peaks": {"gemm_flops_per_s": {"float32": 1e11}, "copy_bytes_per_s": 1e10}}
    micro = microbench_stage.run_microbench(cfg, tmp_path, calibration)
    assert micro["paths"]["compiled"]["valid"] and micro["paths"]["compiled"]["forward_backward"]["median_ms"] > 0
    seen = micro["paths"]["compiled"]["evidence"]["signatures"]
    compiled = {label: s for label, s in seen.items() if "a(32, 32)" not in label}
    assert len(compiled) > 2 and all(s["graphs"] == 1 and "not_compiled" not in s for s in compiled.values())
    assert all(s["graphs"] == 0 and "it ran eagerly" in s["not_compiled"] for label, s in seen.items()
               if "a(32, 32)" in label)
    rows = {(r["impl"], r["x_value"]): r for r in csv.DictReader(open(tmp_path / "curve.csv"))}
    assert rows[("compiled", "64")]["valid"] == "True" and rows[("compiled", "64")]["check"] == "pass"
    eager = rows[("compiled", "32")]
    assert eager["valid"] == "False" and eager["median"] == "" and "it ran eagerly" in eager["check"]


def test_every_op_reference_compiles_as_one_graph():
    """fullgraph=True refuses a graph break: each op's reference must be one graph at its point's main case."""
    for name in ("matmul", "rmsnorm", "swiglu", "rope", "cross_entropy", "attention", "decode_attention", "moe"):
        op = get_op(name)
        cfg = load([f"op={name}", "device=cpu", "shape=tiny", "op.peers=[compiled]"])
        case = next(c for c in op.cases(cfg) if c.main)
        x = op.make_inputs(case, torch.float32, "cpu")
        with torch.no_grad():
            got = op.paths(cfg)["compiled"].fn(x, cfg)["out"]
            torch.testing.assert_close(got, op.reference.fn(x, cfg)["out"], atol=1e-4, rtol=1e-4)
