"""A user path runs in a worker process of its own (lab/isolation/worker.py) and is timed from outside it (lab/isolation/outside.py).

Each user file here is written as a user would write it, honest or not; the stages run on tiny problems on the CPU.
"""

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import parity_report

from posttrainllm.lab.stages import (bench_train as bench_train_stage, kernel as kernel_stage,
                                     microbench as microbench_stage, reference as reference_stage)
from posttrainllm.lab.configure import load
from posttrainllm.lab.isolation import outside, worker as workers

MATMUL = ["op=matmul", "device=cpu", "parity.seeds=[0]", "shape.ops.matmul.edge=[[41,77,33]]", "shape.ops.matmul.m=64",
          "shape.ops.matmul.n=64",
          "shape.ops.matmul.k=64", "shape.curve=[16,32]", "shape.ops.matmul.curve=[16,32]", "bench.reps=3",
          "bench.min_time_s=0",
          "bench.warmup=1", "bench.max_reps=12", "run.log_mlflow=false"]
ATTENTION = ["device=cpu", "parity.seeds=[0]", "architecture=gqa", "tile=b16", "shape.seq_len=32",
             "shape.edge_seq_lens=[]", "shape.curve=[16,32]", "bench.reps=3", "bench.min_time_s=0", "bench.warmup=1",
             "bench.max_reps=12", "run.log_mlflow=false"]
MINE = "op.only=[matmul]"  # the user path and the reference alone, where no built-in path is asserted on
CALIBRATION = {"peaks": {"gemm_flops_per_s": {"float32": 1e11}, "copy_bytes_per_s": 1e10}}


@pytest.fixture(autouse=True)
def _fresh_workers():
    """Each test starts its user paths' workers afresh (a stage process would)."""
    workers.close_all()
    yield
    workers.close_all()


def _point(tmp_path: Path, name: str, source: str, attr: str, base: list[str]):
    path = tmp_path / name
    path.write_text(source)
    cfg = load([*base, f"op.user_impls=[{path}:{attr}]", f"run.out_dir={tmp_path}", "run.name=p"])
    return cfg, tmp_path / "p"


HONEST = '''
import os
from pathlib import Path

with open(Path(__file__).with_suffix(".pid"), "a") as f:  # every process it was imported in
    f.write(f"{os.getpid()}\\n")


def matmul(a, b):
    return (a.float() @ b.float()).to(a.dtype)
'''


def test_an_honest_path_runs_in_another_process_passes_and_gets_a_speed_from_outside(tmp_path):
    cfg, out = _point(tmp_path, "honest.py", HONEST, "matmul", [*MATMUL, MINE, "train.steps=2",
                                                                     "train.warmup_steps=1"])
    report = parity_report(cfg, out)
    path = report["paths"]["matmul"]
    assert path["verdict"] == "pass" and path["backward"] == "own"
    assert {"out", "grad_a", "grad_b"} <= set(path["worst"])  # its own gradients, through the worker's graph
    pids = [int(line) for line in (tmp_path / "honest.pid").read_text().split()]  # its worker; the compile child's
    assert os.getpid() not in pids
    assert not [m for m in __import__("sys").modules if m.startswith("posttrainllm_user_")]  # never imported here
    kernel = json.loads((out / "kernel.json").read_text())["paths"]["matmul"]
    assert kernel["worker_start_s"] > 0

    micro = microbench_stage.run_microbench(cfg, out, CALIBRATION)
    entry = micro["paths"]["matmul"]
    assert entry["valid"], entry.get("reason")
    pids = [int(line) for line in (tmp_path / "honest.pid").read_text().split()]  # each stage's worker: its own
    assert entry["worker_start_s"] > 0 and entry["outside"]["forward"]["worker_pid"] in pids
    assert not workers.alive()  # the stage's workers ended with it
    forward = entry["outside"]["forward"]
    assert forward["batch_size"] >= 4 and forward["batches"] >= 5
    assert entry["reps"] == forward["batches"]  # one sample per batch: (span - null) / N
    assert forward["calls"] == forward["batch_size"] * forward["batches"] <= max(cfg.bench.max_reps, 5 * 4)
    assert entry["forward_backward"]["median_ms"] > 0
    assert forward["rule"] == outside.timing_rule() and forward["timing_seeds"]["rule"] == "timing_seed"  # by id
    memory = entry["memory"]  # its worker's, counted inside it and from outside (rule outside_memory)
    assert memory["method_rule"] == "outside_memory"
    assert memory["output_bytes"] == 64 * 64 * 4 and memory["peak_bytes"] >= memory["output_bytes"]
    assert memory["allocator_bytes"] >= memory["output_bytes"] and memory["resident_bytes"] is not None
    curve = (out / "curve.csv").read_text()
    assert any(line.startswith("matmul,matmul,user,") and ",True," in line for line in curve.splitlines())

    train = bench_train_stage.run_bench_train(cfg, out)
    assert train["drift_verdict"]["matmul"] == "pass"
    note = train["user_paths"]
    assert "includes its round trips" in note["note"]
    assert note["matmul"]["calls_per_step"]["call"] > 0 and note["matmul"]["calls_per_step"]["backward"] > 0
    assert note["matmul"]["round_trip_ms"] > 0


MEDDLER = '''
import time

import torch
import torch.nn.functional as F

_sdpa = F.scaled_dot_product_attention


def _slow_sdpa(*args, **kwargs):  # every other path that uses SDPA would look 50 ms slower
    time.sleep(0.05)
    return _sdpa(*args, **kwargs)


_copy = torch.Tensor.copy_


def _slow_copy(self, *args, **kwargs):
    time.sleep(0.05)
    return _copy(self, *args, **kwargs)


F.scaled_dot_product_attention = _slow_sdpa
torch.Tensor.copy_ = _slow_copy
time.perf_counter = lambda: 0.0  # a clock that says every call took no time
torch.set_num_threads(2)
torch.autograd.set_detect_anomaly(True)


def attention(q, k, v, *, causal, sm_scale):  # in float64: its verdict does not hang on its 2 threads' sums
    out = _sdpa(q.double(), k.double(), v.double(), is_causal=causal, scale=sm_scale, enable_gqa=True)
    return out.to(q.dtype)
'''


def test_what_a_path_does_to_torch_and_time_at_import_stays_in_its_worker(tmp_path):
    # the SDPA peers are the ones its import would slow: they stay; our Triton attention is not asserted on
    cfg, out = _point(tmp_path, "meddler.py", MEDDLER, "attention",
                      [*ATTENTION, "op.only=[attention,sdpa,sdpa_flash,sdpa_math]"])
    torch.set_num_threads(cfg.bench.threads)  # what every stage sets (measure/device.py prepare)
    before = (F.scaled_dot_product_attention, torch.Tensor.copy_, time.perf_counter, torch.get_num_threads(),
              torch.is_anomaly_enabled())
    report = parity_report(cfg, out)
    assert report["paths"]["attention"]["verdict"] == "pass"
    micro = microbench_stage.run_microbench(cfg, out, CALIBRATION)
    after = (F.scaled_dot_product_attention, torch.Tensor.copy_, time.perf_counter, torch.get_num_threads(),
             torch.is_anomaly_enabled())
    assert after == before
    assert all(micro["paths"][name]["valid"] for name in micro["paths"] if name.startswith("sdpa"))
    assert "library_replaced" not in json.loads((out / "kernel.json").read_text())  # the lab's SDPA is its own
    mine = micro["paths"]["attention"]
    # what its import changed of its own process is named, and a path that needs to do so gets no speed
    assert not mine["valid"] and mine["reason"].startswith("its import changed its worker (")
    assert "threads 1 -> 2" in mine["reason"] and "replaced time.perf_counter" in mine["reason"]


def test_an_exception_and_a_crash_in_user_code_are_that_paths_failures(tmp_path):
    cfg, out = _point(tmp_path, "bad.py", "def matmul(a, b):\n    raise ValueError('no kernel for this shape')\n",
                      "matmul", MATMUL)
    report = parity_report(cfg, out)
    bad = str(tmp_path / "bad.py")
    assert report["paths"]["matmul"]["failed_cases"] == [
        f"did not run: ValueError: no kernel for this shape (at {bad}:2: raise ValueError('no kernel for this shape'))"]
    assert report["paths"]["matmul"]["error"]["where"]["line"] == 2  # the worker located it in the user's file
    assert report["paths"]["triton"]["verdict"] == "pass"

    workers.close_all()
    cfg, out = _point(tmp_path, "crash.py", "import os\n\ndef matmul(a, b):\n    os._exit(3)\n", "matmul", MATMUL)
    report = parity_report(cfg, out)
    failed = report["paths"]["matmul"]["failed_cases"]
    assert len(failed) == 1 and failed[0].startswith("did not run: WorkerDied: the worker process of user path "
                                                     "'matmul' died during its call (exit code 3)"), failed
    assert report["paths"]["matmul"]["error"]["where"] is None  # no traceback: the process ended without answering
    assert report["paths"]["triton"]["verdict"] == "pass" and report["paths"]["torch"]["verdict"] == "pass"


MEMO = '''
_stored = {}


def matmul(a, b):
    """Right the first time it sees a shape (without autograd); then that answer for any inputs of the shape."""
    if a.requires_grad or b.requires_grad:
        return a @ b
    key = (tuple(a.shape), tuple(b.shape))
    if key not in _stored:
        _stored[key] = a @ b
    return _stored[key]
'''


def test_a_memoizing_path_passes_parity_and_gets_no_speed(tmp_path):
    cfg, out = _point(tmp_path, "memo.py", MEMO, "matmul", [*MATMUL, MINE])
    assert parity_report(cfg, out)["paths"]["matmul"]["verdict"] == "pass"  # one call per shape there
    entry = microbench_stage.run_microbench(cfg, out, CALIBRATION)["paths"]["matmul"]
    assert not entry["valid"]
    # its stage's worker is fresh: the warm-up's first set stores, the second gets the stored answer (checked)
    assert entry["reason"].startswith("warm-up batch 1, set 2 of ") and "a stored or skipped result?" in entry["reason"]
    assert "median_ms" not in entry


NUMPY = '''
import numpy as np
import torch


def matmul(a, b):  # in NumPy: torch's allocator never sees its buffers
    return torch.from_numpy(np.matmul(a.detach().numpy(), b.detach().numpy()))
'''

HELD = '''
import torch

_pools = {}  # per output shape, a ring of slots allocated the first time it is seen
_calls = [0]


def matmul(a, b):  # forward-only (no autograd history): computed honestly, into memory no call allocates
    n = a.shape[0] * b.shape[1]
    if n not in _pools:
        _pools[n] = bytearray(128 * n * a.element_size())
    pool = _pools[n]
    _calls[0] += 1
    out = torch.frombuffer(pool, dtype=a.dtype, count=n, offset=_calls[0] % 128 * n * a.element_size())
    with torch.no_grad():
        return torch.matmul(a, b, out=out.view(a.shape[0], b.shape[1]))
'''


def test_memory_outside_torch_is_counted_and_outputs_held_from_import_are_named(tmp_path):
    """NumPy's buffers count (tracemalloc, the resident set); a peak below the outputs' own bytes is not a figure."""
    cfg, out = _point(tmp_path, "numpy_mm.py", NUMPY, "matmul", [*MATMUL, MINE])
    assert parity_report(cfg, out)["paths"]["matmul"]["verdict"] == "pass"
    entry = microbench_stage.run_microbench(cfg, out, CALIBRATION)["paths"]["matmul"]
    assert entry["valid"], entry.get("reason")
    assert entry["memory"]["allocator_bytes"] < entry["memory"]["output_bytes"] <= entry["memory"]["peak_bytes"]

    workers.close_all()
    (tmp_path / "held").mkdir()
    # 256 KB outputs: far above what the interpreter's own objects and a few resident pages add to a call
    cfg, out = _point(tmp_path / "held", "held.py", HELD, "matmul", [*MATMUL, MINE, "shape.ops.matmul.m=256",
                                                                      "shape.ops.matmul.n=256"])
    assert parity_report(cfg, out)["paths"]["matmul"]["verdict"] == "pass"
    entry = microbench_stage.run_microbench(cfg, out, CALIBRATION)["paths"]["matmul"]
    assert not entry["valid"] and "median_ms" not in entry, entry["memory"]
    assert "is below the 262144 B of the outputs it returned: a figure that cannot be true" in entry["reason"]


SLOW_CLOCK = '''
import sys

_worker = sys.modules["__main__"]  # the worker's own module: a path that goes looking for its clock
_real = _worker._clock
_worker._clock = lambda: _real() / 10  # its per-call times read 10x faster than they are


def matmul(a, b):
    return a @ b
'''


def test_a_worker_clock_that_disagrees_with_the_labs_gets_no_speed(tmp_path):
    cfg, out = _point(tmp_path, "clock.py", SLOW_CLOCK, "matmul", [*MATMUL, MINE])
    assert parity_report(cfg, out)["paths"]["matmul"]["verdict"] == "pass"
    entry = microbench_stage.run_microbench(cfg, out, CALIBRATION)["paths"]["matmul"]
    assert not entry["valid"] and "replaced __main__._clock" in entry["reason"], entry


@pytest.mark.parametrize("body, violation", [
    ("out = a @ b\n    a.add_(1.0)\n    return out", "changed input a"),
    ("return a", "output out shares storage with input a"),
])
def test_writes_into_an_input_and_returning_an_input_are_caught_and_named(tmp_path, body, violation):
    cfg, out = _point(tmp_path, "guarded.py", f"def matmul(a, b):\n    {body}\n", "matmul", [*MATMUL, MINE])
    report = parity_report(cfg, out)
    path = report["paths"]["matmul"]
    assert path["verdict"] == "fail"
    assert any(f.endswith(f": {violation}") for f in path["failed_cases"]), path["failed_cases"]


def test_a_write_into_the_upstream_gradient_reaches_the_labs_buffer():
    from posttrainllm.ops.registry import get_op
    from posttrainllm.lab.isolation.user import resolve

    source = Path(__file__).parent / "_grad_writer.py"
    source.write_text("import torch\n\n\nclass _F(torch.autograd.Function):\n    @staticmethod\n"
                      "    def forward(ctx, a, b):\n        ctx.save_for_backward(a, b)\n        return a @ b\n\n"
                      "    @staticmethod\n    def backward(ctx, g):\n        a, b = ctx.saved_tensors\n"
                      "        ga, gb = g @ b.t(), a.t() @ g\n        g.zero_()\n        return ga, gb\n\n\n"
                      "def matmul(a, b):\n    return _F.apply(a, b)\n")
    try:
        natural = workers.remote(resolve(f"{source}:matmul", get_op("matmul")))
        a, b = torch.randn(4, 3, requires_grad=True), torch.randn(3, 5, requires_grad=True)
        grad = torch.randn(4, 5)
        kept = grad.clone()
        out = natural(a, b)
        assert out.requires_grad
        out.backward(grad)
        torch.testing.assert_close(a.grad, kept @ b.detach().t())  # the gradients are right ...
        assert torch.equal(grad, torch.zeros(4, 5))  # ... and the write into dO is in the lab's own buffer
    finally:
        source.unlink()


PROBE = '''
import json, os, torch
from pathlib import Path

seen = {"mark": os.environ.get("POSTTRAINLLM_TEST_MARK"), "cwd": os.getcwd(), "pid": os.getpid(),
        "parent": os.getppid(), "left": getattr(torch, "_left_by_a_path", None)}
Path(__file__).with_suffix(".json").write_text(json.dumps(seen))
torch._left_by_a_path = __file__  # what no other path's worker may see


def matmul(a, b):
    return a @ b
'''


def test_each_worker_is_forked_clean_with_the_labs_environment_and_folder_of_its_start(tmp_path, monkeypatch):
    """The zygote has imported torch and nothing of any user's: the second path's worker does not see what the
    first one's import did, and takes the environment and working directory the lab has when it starts."""
    from posttrainllm.ops.registry import get_op
    from posttrainllm.lab.isolation.user import resolve

    seen = {}
    for name in ("first", "second"):
        (tmp_path / f"{name}.py").write_text(PROBE)
        if name == "second":
            monkeypatch.setenv("POSTTRAINLLM_TEST_MARK", "set after the first worker started")
            (tmp_path / "elsewhere").mkdir()
            monkeypatch.chdir(tmp_path / "elsewhere")
        started = workers.worker_for(resolve(f"{tmp_path / name}.py:matmul", get_op("matmul")))
        seen[name] = json.loads((tmp_path / f"{name}.json").read_text())
        assert seen[name]["pid"] == started.pid != os.getpid()
    assert seen["first"]["mark"] is None and seen["second"]["mark"] == "set after the first worker started"
    assert seen["second"]["cwd"] == str(tmp_path / "elsewhere")
    assert seen["first"]["left"] is None and seen["second"]["left"] is None
    assert seen["first"]["parent"] == seen["second"]["parent"] != os.getpid()  # the zygote's children, both


def test_two_runs_draw_and_record_different_timing_seeds_and_parity_stays_reproducible(tmp_path):
    """The timing's input sets come from a seed the lab draws at run time (rule timing_seed), written in
    the record after the timing; parity's cases stay the configuration's: the same errors in both runs."""
    cfg, out = _point(tmp_path, "honest.py", HONEST, "matmul", [*MATMUL, MINE])
    runs = []
    for _ in range(2):
        parity = parity_report(cfg, out)["paths"]["matmul"]
        entry = microbench_stage.run_microbench(cfg, out, CALIBRATION)["paths"]["matmul"]
        assert entry["valid"], entry.get("reason")
        runs.append((parity["worst"], {m: entry["outside"][m]["timing_seeds"]["base"] for m in entry["outside"]}))
    (parity_a, seeds_a), (parity_b, seeds_b) = runs
    assert parity_a == parity_b
    assert set(seeds_a) == {"forward", "forward_backward"}
    assert all(seeds_a[m] != seeds_b[m] for m in seeds_a) and seeds_a["forward"] != seeds_a["forward_backward"]


def test_a_worker_and_every_process_it_started_end_with_it(tmp_path):
    """Its process group and what it left orphaned (double-forked, setsid: adopted by the zygote, a subreaper)."""
    from posttrainllm.ops.registry import get_op
    from posttrainllm.lab.isolation.user import resolve

    source = tmp_path / "forks.py"
    source.write_text(FORKS.replace("PIDS", str(tmp_path / "pids.txt")))
    worker = workers.worker_for(resolve(f"{source}:matmul", get_op("matmul")))
    for _ in range(100):  # the grandchildren write their pids
        pids = [int(p) for p in (tmp_path / "pids.txt").read_text().split()] if (tmp_path / "pids.txt").exists() else []
        if len(pids) == 3:
            break
        time.sleep(0.05)
    assert len(pids) == 3 and worker.pid not in pids
    for _ in range(100):  # a grandchild writes its pid before its parent's exit has handed it to the zygote
        if set(pids) <= set(workers.alive()):
            break
        time.sleep(0.05)
    assert set(pids) <= set(workers.alive())  # the count sees them, and the worker
    assert worker.pid in workers.alive()
    workers.close_all()
    assert workers.alive() == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


FORKS = '''
import os, time

def _child(setsid, double):
    if os.fork() == 0:
        if setsid:
            os.setsid()
        if double and os.fork() != 0:
            os._exit(0)
        with open("PIDS", "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(600)
        os._exit(0)

_child(False, False)  # in its worker's process group
_child(True, False)   # a session of its own, its parent the worker
_child(True, True)    # double-forked into a session of its own: an orphan


def matmul(a, b):
    return a @ b
'''


COMPILE_FORKER = '''
import os, sys, time

if sys.argv[0].endswith(os.path.join("lab", "compile.py")):  # imported in the kernel stage's compile child
    if os.fork() == 0:  # in the compile child: a grandchild holding its stdout and stderr for 20 s
        with open("PIDS", "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(20)
        with open("PIDS", "a") as f:
            f.write("slept out\\n")
        os._exit(0)


def matmul(a, b):
    return a @ b
'''


def test_a_compile_childs_grandchild_holding_its_output_neither_holds_the_stage_nor_outlives_it(tmp_path):
    """lab/compile.py: the child's output goes to a file and its process group ends with it, so the kernel stage
    returns when the child ends, not when a process it left lets go of a pipe."""
    cfg, out = _point(tmp_path, "forker.py", COMPILE_FORKER.replace("PIDS", str(tmp_path / "pids.txt")), "matmul",
                      MATMUL)  # the built-in Triton paths beside it: the kernel stage starts its compile child
    reference_stage.run_reference(cfg, out)
    kernel_stage.run_kernel(cfg, out)
    lines = (tmp_path / "pids.txt").read_text().split() if (tmp_path / "pids.txt").exists() else []
    assert lines and "slept" not in lines, lines  # it was in the compile child, and did not sleep its 20 s out
    for _ in range(100):
        try:
            os.kill(int(lines[0]), 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the compile child's grandchild {lines[0]} is still running")


def test_a_span_leaves_out_its_run_queue_wait_only_when_no_other_thread_worked():
    """Rule outside_run_queue on the kernel's readings: the worker's wait comes out of the span, never more than the
    span; nothing comes out where the worker's other threads ran, or where the kernel says nothing."""
    from posttrainllm.lab.isolation import outside

    before = {"worker": (0, 0), "others_ran": 0}
    after = {"worker": (4_000_000, 5_000_000), "others_ran": 100_000}
    assert outside._waited_s(before, after, 0.010) == pytest.approx(0.005)  # others: 1% of the span, allowed
    assert outside._waited_s(before, {**after, "worker": (0, 50_000_000)}, 0.010) == 0.010
    assert outside._waited_s(before, {**after, "others_ran": 1_000_000}, 0.010) == 0.0  # 10% of the span: work
    assert outside._waited_s(before, {**after, "worker": None}, 0.010) == 0.0
    # the lab's own wait (reading the answer late) comes out too, never leaving the span under what both ran
    lab_before, lab_after = {**before, "lab": (0, 0)}, {**after, "lab": (500_000, 300_000)}
    assert outside._waited_s(lab_before, lab_after, 0.010) == pytest.approx(0.0053)
    assert outside._waited_s(lab_before, {**lab_after, "lab": (500_000, 9_000_000)}, 0.010) == pytest.approx(0.0055)
    reading = outside._scheduled(os.getpid())  # this process: its main thread's run and wait, as the lab reads them
    assert reading["worker"] is not None and reading["worker"][0] > 0
    assert reading["lab"] is not None and reading["lab"][0] > 0  # the calling thread's own


TEMPLATE_MATH = '''
import torch


def attention(q, k, v, *, causal, sm_scale):
    n_heads, seq_len = q.shape[1], q.shape[2]
    k = k.repeat_interleave(n_heads // k.shape[1], dim=1)
    v = v.repeat_interleave(n_heads // v.shape[1], dim=1)
    scores = (q.float() @ k.float().transpose(-2, -1)) * sm_scale
    if causal:
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype)
'''


def test_a_batchs_kept_results_do_not_fault_its_calls_pages_in(tmp_path):
    """Rule outside_heap: a batch keeps its N results until they are checked; the worker keeps its freed heap mapped
    and touches room for the batch before the clock, so its calls fault no pages in (~50 faults a call at this shape
    without it, where the lab's in-process loop faults none). Counted by the kernel, read from outside."""
    from posttrainllm.lab.isolation import outside
    from posttrainllm.lab import runner
    from posttrainllm.measure import device as devices
    from posttrainllm.ops.registry import get_op

    path = tmp_path / "math.py"
    path.write_text(TEMPLATE_MATH)
    cfg = load(["op=attention", "precision=fp32", "device=cpu", "shape=tiny", "run.log_mlflow=false",
                f"op.user_impls=[{path}:attention]"])
    op, device = get_op("attention"), devices.prepare("cpu", 1)
    case = next(c for c in op.cases(cfg) if c.main)
    settings = dict(warmup=1, reps=40, min_time_s=0.0, max_reps=200)
    timed = outside.time_user_path(op, cfg, case, runner.paths(op, cfg)["attention"], "forward", device, settings)
    assert timed.refused is None, timed.refused
    assert timed.report["heap_kept"] and timed.report["batch_size"] >= 8, timed.report
    assert timed.report["faults_per_call"] < 1.0, timed.report
    assert timed.report["first_calls_over_rest"] > 0, timed.report  # recorded: docs/timing.md, "Sixth pass"


LEAVES_ONE = '''
from posttrainllm.ops.registry import get_op
from posttrainllm.lab.isolation import outside, worker as workers
from posttrainllm.lab.isolation.user import resolve


def test_starts_a_worker_and_leaves_it(tmp_path):
    source = tmp_path / "mm.py"
    source.write_text("def matmul(a, b):\\n    return a @ b\\n")
    assert workers.worker_for(resolve(f"{source}:matmul", get_op("matmul"))).pid in workers.alive()
'''


def test_a_test_module_that_leaves_a_worker_running_fails_the_suite(tmp_path):
    """tests/conftest.py `_no_worker_outlives_its_module`, on a module written to leave one (and on one that ends
    its own): run as a suite of its own."""
    import shutil
    import subprocess
    import sys

    shutil.copy(Path(__file__).parent / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_leaves.py").write_text(LEAVES_ONE)
    (tmp_path / "test_ends.py").write_text(LEAVES_ONE + "    workers.close_all()\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "2 passed, 1 error" in out and "worker process(es) outlived test_leaves.py" in out, out
    assert "outlived test_ends.py" not in out, out


def test_outside_outputs_are_judged_by_the_parity_stages_own_rules():
    """lab/isolation/outside.py `_check` goes through oracle.judge_path, as parity and the built-ins' timed results do: a
    gradient row takes the gradient floor (causal dQ row 0, whose oracle is exactly 0, carries a fused backward's
    rounding of D = rowsum(dO o O) at ~1e-6 x max|dQ|: judged by the forward floor it failed now and then); a
    wrong gradient row still fails, named."""
    from posttrainllm.lab import oracle
    from posttrainllm.lab.isolation import outside
    from posttrainllm.ops.registry import get_op

    cfg = load(["op=attention", "precision=fp32", "device=cpu", "shape=tiny", "run.log_mlflow=false"])
    op = get_op("attention")
    case = next(c for c in op.cases(cfg) if c.main)
    s = outside._draw(op, cfg, case, 123_456_789, True, "cpu")
    truth = oracle.reference_outputs(op, cfg, oracle.cast_floats(s.inputs, torch.float64), s.case, s.grad_out.double())
    got = {name: truth[name].float() for name in ("out", "grad_q", "grad_k", "grad_v")}
    scale = truth["grad_q"].abs().max().item()
    assert truth["grad_q"][:, :, 0].abs().max().item() == 0.0  # causal row 0: exactly zero
    got["grad_q"][0, 0, 0, 0] += 3e-6 * scale  # above the forward row floor (1e-6), under the gradient one (1e-5)
    sdpa = op.paths(cfg)["sdpa"]
    assert outside._check(op, cfg, sdpa, s, got, True) is None
    got["grad_q"][0, 1, 5, 0] += 1e-3 * scale
    failed = outside._check(op, cfg, sdpa, s, got, True)
    assert failed is not None and failed.startswith("grad_q: ") and "row (0, 1, 5)" in failed, failed
    assert outside._check(op, cfg, sdpa, s, {"out": got["out"]}, False) is None


def test_a_batch_not_above_its_null_is_counted_unreadable_never_a_zero_sample(tmp_path, monkeypatch):
    """Rule outside_unreadable: load can move a null above its batch's span (a 64³ matmul read "median 0 ms,
    impossible" so). Such a batch is counted and is no sample; too many and the path gets no speed. The real
    batches of a real worker, with the null of some raised above their span (what the load did)."""
    from posttrainllm.lab.isolation import outside
    from posttrainllm.lab import runner
    from posttrainllm.measure import device as devices
    from posttrainllm.ops.registry import get_op

    path = tmp_path / "mm.py"
    path.write_text("def matmul(a, b):\n    return a @ b\n")
    cfg = load([*MATMUL, f"op.user_impls=[{path}:matmul]"])
    op, device = get_op("matmul"), devices.prepare("cpu", 1)
    case, impl = next(c for c in op.cases(cfg) if c.main), runner.paths(op, cfg)["matmul"]
    settings = dict(warmup=1, reps=3, min_time_s=0.0, max_reps=12)
    real, count = outside._batch, [0]

    def loaded(every: int):
        def batch(*args):
            span, own, clean, answer = real(*args)
            count[0] += 1
            raised = 2 * span if count[0] % every == 0 else None
            return span, raised or own, raised or clean, answer
        return batch

    monkeypatch.setattr(outside, "_batch", loaded(every=2))
    timed = outside.time_user_path(op, cfg, case, impl, "forward", device, settings)
    assert timed.refused is None, timed.refused
    assert timed.report["unreadable_batches"] >= 2 and min(timed.timing.samples_ms) > 0, timed.report
    assert timed.report["batches"] == len(timed.timing.samples_ms) >= outside.BATCHES_MIN

    monkeypatch.setattr(outside, "_batch", loaded(every=1))
    timed = outside.time_user_path(op, cfg, case, impl, "forward", device, settings)
    assert timed.timing is None and "rule outside_unreadable" in timed.refused, timed.refused
    assert timed.report["unreadable_batches"] == outside.UNREADABLE_MAX + 1
