"""Kernels from outside (op.user_impls): code nobody here wrote, through the same stages as every path.

The example kernels live in examples/ (a Triton attention in the tutorial's style, a PyTorch function); the
planted-bug twin is a copy of the Triton example with its online-softmax rescale dropped. Cheats are written
here as a user would write them: a stored result for inputs seen before, a result of the wrong form.
"""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import parity_report

from posttrainllm.config import PROJECT_ROOT, ConfigError
from posttrainllm.lab.stages import (bench_train as bench_train_stage, common as stage_common, kernel as kernel_stage,
                                     microbench as microbench_stage, parity as parity_stage,
                                     reference as reference_stage)
from posttrainllm.lab.configure import load
from posttrainllm.ops.registry import get_op
from posttrainllm.track.report import point_table

EXAMPLES = PROJECT_ROOT / "examples"
ATTENTION = ["device=cpu", "parity.seeds=[0]", "shape.edge_seq_lens=[37]", "architecture=gqa"]
MATMUL = ["op=matmul", "device=cpu", "parity.seeds=[0]", "shape.ops.matmul.edge=[[41,77,33]]", "shape.ops.matmul.m=64",
          "shape.ops.matmul.n=64",
          "shape.ops.matmul.k=64", "shape.curve=[32,64]", "shape.ops.matmul.curve=[32,64]"]
MINE = "op.only=[matmul]"  # the user path and the reference alone, where no built-in path is asserted on


def _write(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / name
    path.write_text(source)
    return str(path)


def test_a_triton_kernel_from_outside_is_judged_and_not_timed_under_the_interpreter(tmp_path):
    spec = f"{EXAMPLES / 'triton_attention.py'}:attention"
    small = ["shape.seq_len=64", "train.batch_size=1", "op.only=[attention]"]  # a smaller interpreted grid per case
    report = parity_report(load([*ATTENTION, *small, f"op.user_impls=[{spec}]"]), tmp_path)
    path = report["paths"]["attention"]
    assert path["verdict"] == "pass", path["failed_cases"]
    assert path["backward"] == "own" and {"out", "grad_q", "grad_k", "grad_v"} <= set(path["worst"])
    assert path["launched"] == {"_attn_fwd": len(report["cases"]) * 2}  # forward and backward calls, every case
    assert path["user"]["sha256"] == hashlib.sha256((EXAMPLES / "triton_attention.py").read_bytes()).hexdigest()
    kernel = json.loads((tmp_path / "kernel.json").read_text())
    assert kernel["paths"]["attention"]["kind"] == "user"
    paths = stage_common.parity_paths(get_op("attention"), load([*ATTENTION, *small, f"op.user_impls=[{spec}]"]), tmp_path)
    assert paths["attention"].kind == "triton"  # it launched Triton: interpreted, the microbench will not time it


def test_the_planted_bug_twin_of_the_example_fails(tmp_path):
    source = (EXAMPLES / "triton_attention.py").read_text()
    original = "acc = acc * alpha[:, None] + tl.dot(p, v)"
    assert source.count(original) == 1
    twin = _write(tmp_path, "twin_attention.py", source.replace(original, "acc = acc + tl.dot(p, v)"))
    report = parity_report(load([*ATTENTION, f'op.user_impls=["twin={twin}:attention"]']), tmp_path)
    assert report["paths"]["twin"]["verdict"] == "fail"
    assert any("/out:" in f for f in report["paths"]["twin"]["failed_cases"])
    assert report["paths"]["triton"]["verdict"] == "pass"  # the point goes on: the other paths are judged


def test_a_pytorch_function_goes_through_every_stage(tmp_path):
    cfg = load([*ATTENTION, f"op.user_impls=[{EXAMPLES / 'torch_attention.py'}:sdpa_attention]",
                "op.only=[sdpa_attention]", f"run.out_dir={tmp_path}", "run.name=p", "train.steps=2",
                "train.warmup_steps=1", "bench.reps=3", "bench.min_time_s=0", "bench.max_reps=12",
                "shape.curve=[32,64]"])
    out = tmp_path / "p"
    parity_report(cfg, out)
    calibration = {"peaks": {"gemm_flops_per_s": {"float32": 1e11}, "copy_bytes_per_s": 1e10}}
    micro = microbench_stage.run_microbench(cfg, out, calibration)
    entry = micro["paths"]["sdpa_attention"]
    assert entry["valid"] and {"median_ms", "reps"} <= set(entry["forward_backward"]) and "first_call_ms" in entry
    assert {r["impl"] for r in __import__("csv").DictReader(open(out / "curve.csv"))} >= {"sdpa_attention"}
    train = bench_train_stage.run_bench_train(cfg, out)
    assert "sdpa_attention" in train["impls"] and train["drift_verdict"]["sdpa_attention"] == "pass"


def test_a_forward_only_result_is_not_an_error(tmp_path):
    """...and bench-train lists it, not trained, in its table (op.only: it and the reference alone)."""
    from posttrainllm.track.report import train_table

    spec = _write(tmp_path, "nograd.py", "import torch\n\ndef matmul(a, b):\n    with torch.no_grad():\n"
                                         "        return a @ b\n")
    cfg = load([*MATMUL, f"op.user_impls=[{spec}:matmul]", "op.only=[matmul]", f"run.out_dir={tmp_path}",
                "run.name=p", "bench.reps=3", "bench.min_time_s=0", "bench.max_reps=12", "train.steps=2",
                "train.warmup_steps=1"])
    out = tmp_path / "p"
    report = parity_report(cfg, out)
    assert report["paths"]["matmul"]["verdict"] == "pass" and report["paths"]["matmul"]["backward"] == "none"
    assert set(report["paths"]["matmul"]["worst"]) == {"out"}
    micro = microbench_stage.run_microbench(cfg, out, {"peaks": {"gemm_flops_per_s": {"float32": 1e11},
                                                       "copy_bytes_per_s": 1e10}})
    assert micro["paths"]["matmul"]["valid"]
    assert micro["paths"]["matmul"]["forward_backward"]["reason"].startswith("none: a forward-only path")
    train = bench_train_stage.run_bench_train(cfg, out)
    assert train["variants"] == ["reference"] and train["skipped"] == {"matmul": bench_train_stage.FORWARD_ONLY}
    table = train_table({"point": "p", "config": {"architecture": {"name": "mha"}}, "bench_train": train})
    row = next(line for line in table.splitlines() if line.lstrip().startswith("matmul"))
    assert row.rstrip().endswith("forward-only: not trained (no backward to train with)") and "NaN" not in table


CACHING = '''
import torch

_seen = {}


def matmul(a, b):
    """Right on every new buffer; for buffers it has seen (without autograd), the stored answer."""
    key = (a.data_ptr(), b.data_ptr())
    if not (a.requires_grad or b.requires_grad) and key in _seen:
        return _seen[key]
    out = a @ b
    if not (a.requires_grad or b.requires_grad):
        _seen[key] = out
    return out
'''


def test_a_stored_result_for_seen_inputs_gets_no_speed(tmp_path):
    """The path runs in its worker, handed fresh buffers per call and fresh input sets per timed batch: where a
    freed buffer's address comes back, its stored answer is wrong for the new values (the timed batch's check);
    where none does, the refill after the last batch (new values in the same buffers) makes it wrong. Either way
    the path gets no speed, whatever the allocator does."""
    spec = _write(tmp_path, "caching.py", CACHING)
    cfg = load([*MATMUL, f"op.user_impls=[{spec}:matmul]", "op.only=[matmul,torch]", f"run.out_dir={tmp_path}",
                "run.name=p", "bench.reps=3", "bench.min_time_s=0", "bench.max_reps=12"])
    out = tmp_path / "p"
    report = parity_report(cfg, out)
    assert report["paths"]["matmul"]["verdict"] == "pass"  # every parity case has buffers of its own
    micro = microbench_stage.run_microbench(cfg, out, {"peaks": {"gemm_flops_per_s": {"float32": 1e11},
                                                       "copy_bytes_per_s": 1e10}})
    entry = micro["paths"]["matmul"]
    assert not entry["valid"], entry
    assert "a stored or skipped result?" in entry["reason"] or "new values in its timed buffers" in entry["reason"]
    assert micro["paths"]["torch"]["valid"]  # the honest peer is timed as before


def test_a_time_under_the_roofline_floor_is_impossible():
    calibration = {"peaks": {"gemm_flops_per_s": {"float32": 1e10, "bfloat16": 1e11}, "copy_bytes_per_s": 1e10}}
    own = microbench_stage.roofline_floor_s(2e9, calibration, peak_flops=1e10)
    assert own == pytest.approx(2e9 / 1e10)  # the point's own precision's peak (fp32), not bf16's
    assert microbench_stage.roofline_floor_s(2e9, calibration) == pytest.approx(2e9 / 1e11)  # none given: the best of any
    fp32 = dict(flops=2e9, calibration=calibration, peak_flops=1e10, fraction=0.5)
    assert microbench_stage.impossible(0.4 * own * 1e3, **fp32).startswith("impossible: forward median")
    assert microbench_stage.impossible(0.6 * own * 1e3, **fp32) is None
    # at 0.4 x the fp32 floor, a floor at bf16's peak (10x higher) would have let it pass
    assert microbench_stage.impossible(0.4 * own * 1e3, **{**fp32, "peak_flops": None}) is None


@pytest.mark.parametrize("body, reason", [
    ("return (a @ b).numpy()", "output out is a ndarray, not a tensor"),
    ("return (a @ b).double()", "output out has dtype torch.float64, expected torch.float32"),
    ("return (a @ b)[:, :-1]", "output out has shape"),
])
def test_an_output_of_the_wrong_form_fails_with_that_reason(body, reason, tmp_path):
    spec = _write(tmp_path, "wrong.py", f"def matmul(a, b):\n    {body}\n")
    report = parity_report(load([*MATMUL, f"op.user_impls=[{spec}:matmul]", MINE]), tmp_path)
    failures = report["paths"]["matmul"]["failed_cases"]
    assert report["paths"]["matmul"]["verdict"] == "fail"
    assert any(reason in f for f in failures), failures


NONE_LT = """import torch


def _scale(a):
    if None < 1:
        return a
    return a


def matmul(a, b):
    return _scale(a) @ b
"""  # raises on line 5, two frames under the call

TRITON_HEAD = """import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


"""
TRITON_CALL = """

def matmul(a, b):
    c = a @ b
    out = torch.empty_like(c)
    _kernel[(triton.cdiv(c.numel(), 64),)](c, out, c.numel(), 1e-6, BLOCK=64)
    return out
"""
TRITON_BAD_OP = """@triton.jit
def _kernel(x_ptr, out_ptr, n, eps, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    y = x + tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    tl.store(out_ptr + offs, y, mask=offs < n)
"""  # a 2-D value stored through 1-D pointers: its line 6 (file line 12) fails under the interpreter and on a GPU
TRITON_SCALAR_TO = TRITON_BAD_OP.replace("y = x + tl.zeros((BLOCK, BLOCK), dtype=tl.float32)",
                                         "y = x * eps.to(tl.float32)")  # right on a GPU; the interpreter's gap
TRITON_LIBDEVICE = TRITON_BAD_OP.replace("y = x + tl.zeros((BLOCK, BLOCK), dtype=tl.float32)",
                                         "y = x * libdevice.rsqrt(x * x)")  # the interpreter has no libdevice


def _triton(tmp_path: Path, name: str, kernel: str) -> str:
    return _write(tmp_path, name, TRITON_HEAD + kernel + TRITON_CALL)


def test_a_path_that_raises_is_located_in_its_own_file_and_the_point_goes_on(tmp_path):
    """The verdict names the exception, the innermost frame in the user's own file (file:line and that line's text)
    and the traceback's file beside the receipt; kernel.json and the receipt keep the same."""
    spec = _write(tmp_path, "raises.py", NONE_LT)
    report = parity_report(load([*MATMUL, f"op.user_impls=[{spec}:matmul]"]), tmp_path)
    path = report["paths"]["matmul"]
    assert path["verdict"] == "fail"
    assert path["failed_cases"] == [f"did not run: TypeError: '<' not supported between instances of 'NoneType' and "
                                    f"'int' (at {spec}:5: if None < 1:)"]
    error = path["error"]
    assert error["where"] == {"file": spec, "line": 5, "text": "if None < 1:", "function": "_scale"}
    assert error["type"] == "TypeError" and "cannot_run_here" not in error
    assert error["traceback"] == "tracebacks/matmul.txt"
    text = (tmp_path / error["traceback"]).read_text()
    assert f"located: {spec}:5: if None < 1: (in _scale)" in text
    assert 'in _scale\n    if None < 1:' in text and "posttrainllm/lab/isolation/worker.py" in text  # the worker's traceback
    kernel = json.loads((tmp_path / "kernel.json").read_text())["paths"]["matmul"]
    assert kernel["failure"] == error and kernel["error"] == path["failed_cases"][0].removeprefix("did not run: ")
    assert report["paths"]["triton"]["verdict"] == "pass" and "error" not in report["paths"]["triton"]
    assert report["headline"].startswith("matmul broke the fp32 contract (did not run: TypeError: ")


def test_plain_python_calling_to_on_a_float_is_the_paths_own_error(tmp_path):
    """The message Liger-Kernel 0.8.5's RMSNorm raises under the interpreter, raised by plain Python: no interpreter
    in its traceback, so not the interpreter's gap but the path's error."""
    spec = _write(tmp_path, "raises.py", "def matmul(a, b):\n    eps = 1e-6\n    return a @ b * eps.to(a.dtype)\n")
    report = parity_report(load([*MATMUL, f"op.user_impls=[{spec}:matmul]", MINE]), tmp_path)
    assert report["paths"]["matmul"]["verdict"] == "fail"
    assert report["paths"]["matmul"]["failed_cases"] == [
        f"did not run: AttributeError: 'float' object has no attribute 'to' (at {spec}:3: "
        "return a @ b * eps.to(a.dtype))"]


def test_a_triton_kernel_failing_under_the_interpreter_is_located_at_its_own_line(tmp_path):
    spec = _triton(tmp_path, "bad_op.py", TRITON_BAD_OP)
    report = parity_report(load([*MATMUL, f"op.user_impls=[{spec}:matmul]", MINE]), tmp_path)
    path = report["paths"]["matmul"]
    assert path["verdict"] == "fail"  # a bad op is the kernel's error on every machine
    assert path["error"]["type"] == "InterpreterError" and "Expected pointer argument" in path["error"]["message"]
    assert path["error"]["where"] == {"file": spec, "line": 12, "text": "tl.store(out_ptr + offs, y, mask=offs < n)",
                                      "function": "_kernel"}
    assert f"(at {spec}:12: tl.store(out_ptr + offs, y, mask=offs < n))" in path["failed_cases"][0]
    assert (tmp_path / "tracebacks" / "matmul.txt").is_file()


def test_an_import_that_fails_is_the_paths_failure_located_at_its_line(tmp_path):
    spec = _write(tmp_path, "noimport.py", "import torch\nimport no_such_module_here\n\ndef matmul(a, b):\n"
                                            "    return a @ b\n")
    report = parity_report(load([*MATMUL, f"op.user_impls=[{spec}:matmul]", MINE]), tmp_path)
    path = report["paths"]["matmul"]
    assert path["verdict"] == "fail"
    assert path["failed_cases"] == [f"did not run: ModuleNotFoundError: No module named 'no_such_module_here' "
                                    f"(at {spec}:2: import no_such_module_here)"]
    assert path["error"]["where"]["function"] == "<module>"


@pytest.mark.parametrize("source, pattern", [
    ("import triton\n\ntriton.runtime.driver.active.get_current_device()\n", "triton_no_driver"),
    ("raise RuntimeError('No device were detected')\n", "no_device"),  # as FlagGems 5.0.2 does without a device
    ("import torch\n\nwith torch.cuda.device(0):\n    pass\n", "torch_without_cuda"),
])
def test_an_import_that_needs_a_gpu_cannot_run_here_and_breaks_no_contract(source, pattern, tmp_path):
    spec = _write(tmp_path, "needs_gpu.py", source + "\n\ndef matmul(a, b):\n    return a @ b\n")
    cfg = load([*MATMUL, f"op.user_impls=[{spec}:matmul]", MINE])
    reference_stage.run_reference(cfg, tmp_path)
    kernel_stage.run_kernel(cfg, tmp_path)
    report = parity_stage.run_parity(cfg, tmp_path)  # no ContractBroken: nothing broke
    path = report["paths"]["matmul"]
    assert path["verdict"] == "cannot run here" and path["failed_cases"] == []
    assert path["cannot_run_here"]["pattern"] == pattern and "GPU" in path["cannot_run_here"]["runs_on"]
    assert path["error"]["where"]["file"] == spec and (tmp_path / path["error"]["traceback"]).is_file()
    assert report["verdict"] == "pass" and report["first_failure"] is None
    assert report["headline"].startswith("1 cannot run here (not a broken contract): matmul (")
    assert stage_common.refusals(tmp_path) == {"matmul": f"cannot run here: {path['cannot_run_here']['reason']} (runs on "
                                                   f"{path['cannot_run_here']['runs_on']}): no speed"}
    receipt = {"point": "p", "parity": report, "microbench": {"paths": {}}, "config": {"precision": {"name": "fp32"}},
               "provenance": {"machine": {"device_name": "cpu", "threads": 1}}}
    table = point_table(receipt)
    assert "parity pass (1 cannot run here, apart: matmul)" in table
    assert f"cannot run here: {path['cannot_run_here']['reason']}" in table and f"at {spec}:" in table


def test_the_headline_counts_broken_paths_and_those_that_cannot_run_here_apart(tmp_path):
    """One path computes the wrong product, one raises at a call, two meet gaps of Triton's interpreter: two broke
    the contract, each with its own first failure; the other two are named apart, with the reason."""
    wrong = _write(tmp_path, "wrong.py", "def matmul(a, b):\n    return a @ b * 1.01\n")
    raises = _write(tmp_path, "raises.py", NONE_LT)
    scalar = _triton(tmp_path, "scalar_to.py", TRITON_SCALAR_TO)
    libdev = _triton(tmp_path, "libdev.py", TRITON_LIBDEVICE)
    specs = [f"wrong={wrong}:matmul", f"raises={raises}:matmul", f"scalar={scalar}:matmul", f"libdev={libdev}:matmul"]
    cfg = load([*MATMUL, "op.user_impls=[" + ",".join(f'"{s}"' for s in specs) + "]"])
    reference_stage.run_reference(cfg, tmp_path)
    kernel_stage.run_kernel(cfg, tmp_path)
    with pytest.raises(stage_common.ContractBroken) as caught:
        parity_stage.run_parity(cfg, tmp_path)
    report = json.loads((tmp_path / "parity.json").read_text())
    verdicts = {name: p["verdict"] for name, p in report["paths"].items()}
    assert verdicts == {"torch": "pass", "triton": "pass", "wrong": "fail", "raises": "fail",
                        "scalar": "cannot run here", "libdev": "cannot run here"}
    assert report["paths"]["scalar"]["cannot_run_here"]["pattern"] == "interpreter_scalar_to"
    assert report["paths"]["scalar"]["error"]["where"]["text"] == "y = x * eps.to(tl.float32)"
    assert report["paths"]["libdev"]["cannot_run_here"]["pattern"] == "interpreter_libdevice"
    assert set(report["cannot_run_here"]) == {"scalar", "libdev"}
    line = str(caught.value)
    assert line == report["headline"]
    broken, apart = line.split("; apart from those, ")
    assert broken.startswith("2 broke the fp32 contract: wrong (") and "; raises (did not run: TypeError: " in broken
    assert "/out: max_abs_err" in broken.split("; raises (")[0]  # each with its own first failure
    assert apart.startswith("2 cannot run here (not a broken contract): scalar (Triton's interpreter passes a scalar")
    assert "; libdev (Triton's interpreter has no libdevice" in apart and apart.count("runs on a GPU") == 2


TRITON_MATMUL = """import torch
import triton
import triton.language as tl


@triton.jit
def _mm(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * K + ks[None, :], mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(b_ptr + ks[:, None] * N + rn[None, :], mask=(ks[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


def matmul(a, b):
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty(M, N, dtype=a.dtype)
    with torch.no_grad():
        _mm[(triton.cdiv(M, 32), triton.cdiv(N, 32))](a.contiguous(), b.contiguous(), c, M, N, K, BM=32, BN=32, BK=32)
    return c
"""  # written for the GPU: bf16 operands straight into tl.dot, the fp32 accumulator cast to bf16 on store


def test_a_users_bf16_triton_kernel_is_computed_as_ours_under_the_interpreter(tmp_path):
    """Triton's interpreter computes a bf16 dot on the raw bits (an error of ~1e11 here); the path's worker patches
    its dot and cast as our kernels emulate them, and the receipt says so."""
    from posttrainllm.ops import USER_BF16_INTERPRETER_REASON

    spec = _write(tmp_path, "mm.py", TRITON_MATMUL)
    report = parity_report(load([*MATMUL, "precision=bf16", f"op.user_impls=[{spec}:matmul]", MINE]), tmp_path)
    path = report["paths"]["matmul"]
    assert path["verdict"] == "pass", path["failed_cases"]
    assert path["emulation"] == USER_BF16_INTERPRETER_REASON and path["launched"]
    assert path["backward"] == "none"  # computed without autograd history: forward-only


@pytest.mark.parametrize("spec, message", [
    ("examples/nope.py:attention", "no file examples/nope.py"),
    ("examples/torch_attention.py:nope", "no attribute 'nope' in"),
    ("examples/torch_attention.py", "expected [name=]file.py:attr"),
    ("triton=examples/torch_attention.py:sdpa_attention", "the name 'triton' is taken by a built-in path"),
    ("sdpa_cudnn=examples/torch_attention.py:sdpa_attention", "is taken by a built-in path"),
    ("no_such_module_here:attention", "no module 'no_such_module_here' is importable"),
    ("entry:nope", "no installed entry point 'attention.nope'"),
    ("9x=examples/torch_attention.py:sdpa_attention", "must start with a letter"),
])
def test_bad_specs_are_one_line_config_errors(spec, message):
    with pytest.raises(ConfigError) as caught:
        load(["device=cpu", f'op.user_impls=["{spec}"]'])  # quoted: a name= needs quotes in Hydra's grammar
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_cli_refuses_a_bad_spec_before_writing_anything(tmp_path):
    done = subprocess.run([sys.executable, "-m", "posttrainllm", "bench", "op=attention",
                           "op.user_impls=[examples/nope.py:attention]", f"run.out_dir={tmp_path / 'runs'}",
                           "run.log_mlflow=false"], capture_output=True, text=True, cwd=PROJECT_ROOT)
    assert done.returncode == 2
    assert "no file examples/nope.py" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_a_duplicate_user_name_and_an_unknown_peer_are_refused():
    spec = "examples/torch_attention.py:sdpa_attention"
    with pytest.raises(ConfigError, match="taken by another user path"):
        load(["device=cpu", f"op.user_impls=[{spec},{spec}]"])
    with pytest.raises(ConfigError, match="op.peers: unknown matmul peer 'flex': valid choices are compiled"):
        load(["op=matmul", "device=cpu", "op.peers=[flex]"])


def test_the_compiled_peer_is_checked_and_its_compile_time_kept_apart(tmp_path):
    report = parity_report(load([*MATMUL, "op.peers=[compiled]", "op.only=[compiled]"]), tmp_path)
    assert report["paths"]["compiled"]["verdict"] == "pass" and report["paths"]["compiled"]["backward"] == "own"
    geometry = json.loads((tmp_path / "kernel.json").read_text())["paths"]["compiled"]["geometry"]
    assert geometry["backend"] == "torch.compile(posttrainllm.ops.matmul.reference.matmul)"
    assert isinstance(geometry["compile_s"], float)  # recorded apart from the timed calls (its value is not judged)


def test_flex_attention_is_forward_only_on_the_cpu():
    cfg = load(["device=cpu", "op.peers=[flex]"])
    flex = get_op("attention").paths(cfg)["flex"]
    assert flex.backward == "none" and "does not support backward on CPU" in flex.backend
    q, k, v = (torch.randn(1, 4, 64, 32) for _ in range(3))
    out = flex.fn({"q": q, "k": k, "v": v}, cfg)["out"]
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-6)
    leaves = {name: x.requires_grad_() for name, x in {"q": q, "k": k, "v": v}.items()}
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):  # PyTorch 2.13's reason
        flex.fn(leaves, cfg)


def test_a_spec_resolves_again_when_its_file_changes_or_the_directory_does(tmp_path, monkeypatch):
    from posttrainllm.lab.isolation.user import resolve

    op = get_op("matmul")
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "k.py").write_text(f"def matmul(a, b):  # {folder}\n    return a @ b\n")
    monkeypatch.chdir(tmp_path / "a")
    first = resolve("k.py:matmul", op)
    monkeypatch.chdir(tmp_path / "b")
    second = resolve("k.py:matmul", op)
    assert first.file.parent.name == "a" and second.file.parent.name == "b"
    (tmp_path / "b" / "k.py").write_text("def matmul(a, b):  # edited\n    return a @ b\n")
    third = resolve("k.py:matmul", op)
    assert third.identity["sha256"] != second.identity["sha256"]


def test_the_compiled_peer_runs_while_a_dvc_stage_records_config_reads():
    """The DVC stages record config reads by patching the config classes (track/stamp.py): dynamo recursed on them,
    so the compiled peer failed in every DVC stage and ran under `posttrainllm bench`. It sees a plain copy."""
    from posttrainllm.track import stamp

    cfg = load(["device=cpu", "tile=b16", "shape.seq_len=32", "op.peers=[compiled]"])  # reference reads cfg.op.causal
    op = get_op("attention")
    x = op.make_inputs(next(c for c in op.cases(cfg) if c.main), torch.float32, "cpu")
    with stamp.recording("kernel", cfg):
        out = op.paths(cfg)["compiled"].fn(x, cfg)["out"]
    torch.testing.assert_close(out, op.reference.fn(x, cfg)["out"])
