"""Every path in its own room (lab/isolation/rooms.py): a path's writes reach no other path, its timing rotates over distinct
inputs, what it does to torch's state is named and put back, and a stored backward loses its speed.

The order test writes paths as users have (unsloth's RMSNorm backward writes its result into the incoming
gradient), runs them in every order and asserts the honest path's verdict never depends on it.
"""

import itertools
import json
from pathlib import Path

import pytest
import torch
from conftest import parity_report

from posttrainllm.lab import runner
from posttrainllm.lab.stages import microbench as microbench_stage
from posttrainllm.lab import oracle
from posttrainllm.lab.isolation import rooms
from posttrainllm.lab.configure import load
from posttrainllm.ops.registry import Impl, get_op

RMSNORM = ["op=rmsnorm", "device=cpu", "parity.seeds=[0]", "run.log_mlflow=false"]
SETTINGS = dict(warmup=1, reps=8, min_time_s=0.0, max_reps=8)

HONEST = '''
import torch

def rmsnorm(x, weight, eps):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
'''

# the backward writes into the upstream gradient it is handed (unsloth's RMSNorm, Liger's with in_place=True)
GRAD_INPLACE = '''
import torch

class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + ctx.eps)).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
            y = (x_.float() * torch.rsqrt(x_.float().pow(2).mean(-1, keepdim=True) + ctx.eps)).to(x.dtype) * w_
            dx, dw = torch.autograd.grad(y, (x_, w_), dy)
        dy.copy_(dx)  # the result goes into the incoming gradient's buffer
        return dy, dw, None

def rmsnorm(x, weight, eps):
    return _Norm.apply(x, weight, eps)
'''

# writes into its input x on the forward (Liger's RoPE on one-token cases)
INPUT_INPLACE = '''
import torch

def rmsnorm(x, weight, eps):
    y = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    x.mul_(3.0)
    return y
'''


def _spec(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return f"{name}={path}:rmsnorm"


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    where = tmp_path_factory.mktemp("paths")
    return {"honest": _spec(where, "honest", HONEST), "gradinplace": _spec(where, "gradinplace", GRAD_INPLACE),
            "inputinplace": _spec(where, "inputinplace", INPUT_INPLACE)}


def test_verdicts_do_not_depend_on_the_order_of_the_paths(specs, tmp_path):
    verdicts = {}
    for i, order in enumerate(itertools.permutations(specs)):
        listed = ",".join(json.dumps(specs[name]) for name in order)
        # the user paths and the torch peer at a small shape: the built-in Triton path (interpreted) is not what
        # the order is about, and each of the six orders is a whole point
        report = parity_report(load([*RMSNORM, "shape.seq_len=16", "shape.edge_seq_lens=[37]",
                                     f"op.user_impls=[{listed}]", f"op.only=[torch,{','.join(specs)}]"]),
                               tmp_path / str(i))
        verdicts[order] = {name: (p["verdict"], tuple(p["failed_cases"][:1])) for name, p in report["paths"].items()}
    first = next(iter(verdicts.values()))
    assert all(v == first for v in verdicts.values()), verdicts
    assert first["honest"][0] == "pass" and first["torch"][0] == "pass"
    assert first["gradinplace"][0] == "fail" and "changed upstream gradient dO" in first["gradinplace"][1][0]
    assert first["inputinplace"][0] == "fail" and "changed input x" in first["inputinplace"][1][0]


def _spy(seen: list[int]) -> Impl:
    """A path that records which buffers it was called on and computes the reference math."""
    reference = get_op("rmsnorm").reference

    def fn(x, cfg):
        seen.append(x["x"].data_ptr())
        return reference.fn(x, cfg)

    return Impl("spy", "peer", fn)


def test_timed_repetitions_rotate_over_distinct_input_sets():
    cfg = load(RMSNORM)
    op = get_op("rmsnorm")
    case = next(c for c in op.cases(cfg) if c.main)
    sets = rooms.input_sets(op, case, torch.float32, "cpu", 4)
    assert len({s["x"].data_ptr() for _, s in sets}) == 4
    assert not any(torch.equal(sets[0][1]["x"], s["x"]) for _, s in sets[1:])  # distinct values too
    seen: list[int] = []
    with torch.no_grad():
        upstream = [oracle.upstream_gradient(c, op.reference.fn(s, cfg)["out"]) for c, s in sets]
    mine = [rooms.fresh(s, "cpu") for _, s in sets]
    runner.runner_for(_spy(seen)).time(op, cfg, case, mine, upstream, "cpu", SETTINGS)
    assert len(set(seen)) == 4  # forward and forward + backward each saw every set
    assert not set(seen) & {s["x"].data_ptr() for _, s in sets}  # the path's own copies, not the shared values


def test_a_cpu_point_times_as_many_distinct_sets_as_an_outside_batch_within_its_memory(monkeypatch):
    """Rule rotation: on a CPU the in-process paths rotate over as many sets as a batch has calls at most (an
    outside batch reads that many fresh sets), within rooms.TIMED_SETS_MAX_BYTES; bench.input_sets is the floor."""
    from posttrainllm.measure import timing

    cfg = load(RMSNORM)
    op = get_op("rmsnorm")
    case = next(c for c in op.cases(cfg) if c.main)
    sets = rooms.timed_input_sets(op, case, torch.float32, "cpu", cfg.bench)
    want = min(timing.BATCH_MAX, cfg.bench.max_reps // timing.BATCHES_MIN)
    assert len(sets) == want > cfg.bench.input_sets
    assert len({s["x"].data_ptr() for _, s in sets}) == want and len({c.seed for c, _ in sets}) == want
    one = sum(x.numel() * x.element_size() for x in sets[0][1].values())
    monkeypatch.setattr(rooms, "TIMED_SETS_MAX_BYTES", 6 * one)  # room for six sets
    assert len(rooms.timed_input_sets(op, case, torch.float32, "cpu", cfg.bench)) == 6
    monkeypatch.setattr(rooms, "TIMED_SETS_MAX_BYTES", one)  # room for one: bench.input_sets still holds
    assert len(rooms.timed_input_sets(op, case, torch.float32, "cpu", cfg.bench)) == cfg.bench.input_sets


def test_a_path_that_changes_torch_state_while_timed_is_named_and_the_state_put_back():
    cfg = load(RMSNORM)
    op = get_op("rmsnorm")
    case = next(c for c in op.cases(cfg) if c.main)
    sets = [s for _, s in rooms.input_sets(op, case, torch.float32, "cpu", 4)]
    threads = torch.get_num_threads()

    def greedy(x, cfg):
        torch.set_num_threads(threads + 1)
        torch.autograd.set_detect_anomaly(True)
        return op.reference.fn(x, cfg)

    state = runner.runner_for(Impl("greedy", "peer", greedy, backward="none")).time(
        op, cfg, case, sets, [], "cpu", SETTINGS).refused
    assert state and f"threads {threads} -> {threads + 1}" in state and "anomaly_detection False -> True" in state
    assert torch.get_num_threads() == threads and not torch.is_anomaly_enabled()
    clean = runner.runner_for(Impl("plain", "peer", op.reference.fn, backward="none")).time(
        op, cfg, case, sets, [], "cpu", SETTINGS).refused
    assert clean is None


def test_a_memoized_backward_loses_its_forward_backward_speed():
    """An honest forward with a backward that returns the gradients it computed first, keyed on the shape."""
    cfg = load(RMSNORM)
    op = get_op("rmsnorm")
    case = next(c for c in op.cases(cfg) if c.main)
    stored = {}

    class Memo(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):
            ctx.save_for_backward(x, weight)
            return op.reference.fn({"x": x, "weight": weight}, cfg)["out"]

        @staticmethod
        def backward(ctx, dy):
            x, weight = ctx.saved_tensors
            key = (tuple(x.shape), tuple(dy.shape))
            if key not in stored:
                with torch.enable_grad():
                    leaves = [t.detach().requires_grad_() for t in (x, weight)]
                    out = op.reference.fn({"x": leaves[0], "weight": leaves[1]}, cfg)["out"]
                    stored[key] = torch.autograd.grad(out, leaves, dy)
            return stored[key]

    memo = Impl("memo", "peer", lambda x, cfg: {"out": Memo.apply(x["x"], x["weight"])})
    inputs = op.make_inputs(case, torch.float32, "cpu")
    with torch.no_grad():
        upstream = oracle.upstream_gradient(case, op.reference.fn(inputs, cfg)["out"])
    assert microbench_stage._timed_result_check(op, cfg, case, memo, inputs) is None  # its forward is honest
    reason = microbench_stage._timed_result_check(op, cfg, case, memo, inputs, grad_out=upstream)
    assert reason.startswith("timed result check failed on new values in the same buffers (forward + backward)")
    honest = Impl("plain", "peer", op.reference.fn)
    assert microbench_stage._timed_result_check(op, cfg, case, honest, inputs, grad_out=upstream) is None


def test_too_few_input_sets_is_refused_naming_the_floor():
    from posttrainllm.config import ConfigError

    with pytest.raises(ConfigError, match=r"bench.input_sets=2: must be >= 4"):
        load([*RMSNORM, "bench.input_sets=2"])


def test_a_replaced_torch_function_changes_no_peer_and_is_named(tmp_path, monkeypatch):
    """A module that replaces SDPA at import (SageAttention's README recommends it): the peer keeps its own."""
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **kw: 2 * sdpa(q, k, v, **kw))
    cfg = load(["op=decode_attention", "device=cpu", "parity.seeds=[0]", "tile=b16",
                "shape.ops.decode_attention.q_lens=[1]",
                "shape.ops.decode_attention.kv_lens=[17]", "shape.ops.decode_attention.kv_len=32",
                "op.only=[sdpa]"])  # the peer it is about
    report = parity_report(cfg, tmp_path)
    assert report["paths"]["sdpa"]["verdict"] == "pass", report["paths"]["sdpa"]["failed_cases"][:2]
    kernel = json.loads((tmp_path / "kernel.json").read_text())
    assert kernel["library_replaced"]["functions"] == ["torch.nn.functional.scaled_dot_product_attention"]


def test_the_state_guard_reads_torch_under_the_tf32_switch_the_stages_set():
    """The legacy float32-matmul-precision getter raises once the new API has set a backend's precision
    (measure/device.py fp32_matmuls does, for every stage): the guard must read what it can."""
    from posttrainllm.measure import device as devices

    with devices.fp32_matmuls(tf32=True), rooms.StateGuard() as guard:
        pass
    assert guard.changed == []
