"""Bring your own op: a problem file in KernelBench's format is an op (op=problem op.file=PATH, ops/problem/definition.py).

The problem files (tests/problems/) are written as KernelBench's authors write theirs (module-level sizes,
`torch.rand` inputs, `get_init_inputs`), each naming the published problem it follows; their ModelNews
(tests/problems/new/) are written as a kernel author would: an honest one, and ones that return zeros, ignore
eps, or hand back the previous call's values. The honest one for each file is the lab's own template
(`posttrainllm new-impl op=problem op.file=...`), so the template is held to its own contract here too.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import parity_report

from posttrainllm import cli
from posttrainllm.config import PROJECT_ROOT, ConfigError
from posttrainllm.lab.stages import bench_train as bench_train_stage, microbench as microbench_stage
from posttrainllm.lab.configure import load
from posttrainllm.ops.registry import op_for
from posttrainllm.ops.problem.definition import template

PROBLEMS = PROJECT_ROOT / "tests" / "problems"
NEW = PROBLEMS / "new"
BAD = PROBLEMS / "bad"
FILES = ["relu", "softmax", "rmsnorm", "matmul", "cross_entropy", "gemm_swish_clamp"]
POINT = ["op=problem", "device=cpu", "parity.seeds=[0,1]"]

# Wrong ModelNews made from the honest template (renamed _Honest) by subclassing it, as one would write them by hand
ZEROS = '''

class ModelNew(_Honest):
    """Zeros of the right shape, dtype and autograd history."""

    def forward(self, *args):
        return super().forward(*args) * 0
'''
REUSE = '''

class ModelNew(_Honest):
    """The first call's values at every later call, with the current call's gradients (only the values are stale)."""

    def forward(self, *args):
        out = super().forward(*args)
        if not hasattr(self, "kept"):
            self.kept = out.detach().clone()
        return out + (self.kept - out).detach()
'''


def _point(name: str, *more: str) -> list[str]:
    return [*POINT, f"op.file={PROBLEMS / f'{name}.py'}", *more]


def _honest(tmp_path: Path, name: str) -> Path:
    """The lab's template for the problem (new-impl's body), as a file."""
    op = op_for(load(_point(name)))
    path = tmp_path / f"{name}_template.py"
    path.write_text(op.template.format(name="ModelNew"))
    return path


@pytest.mark.parametrize("name", FILES)
def test_an_honest_model_new_passes_and_zeros_or_a_reused_result_fail(name, tmp_path):
    honest = _honest(tmp_path, name)
    zeros, reuse = tmp_path / f"{name}_zeros.py", tmp_path / f"{name}_reuse.py"
    base = honest.read_text().replace("class ModelNew(", "class _Honest(").replace("super(ModelNew,", "super(_Honest,")
    zeros.write_text(base + ZEROS)
    reuse.write_text(base + REUSE)
    specs = f'op.user_impls=["honest={honest}:ModelNew","zeros={zeros}:ModelNew","reuse={reuse}:ModelNew"]'
    report = parity_report(load(_point(name, specs)), tmp_path / "point")
    paths = report["paths"]
    assert paths["honest"]["verdict"] == "pass", paths["honest"]["failed_cases"]
    assert paths["zeros"]["verdict"] == "fail"
    assert any(f.startswith("file-seed0/out:") for f in paths["zeros"]["failed_cases"])
    assert paths["reuse"]["verdict"] == "fail"  # its first call is right; every later case sees its values
    assert any(f.startswith("file-seed1/out:") for f in paths["reuse"]["failed_cases"])
    assert not any(f.startswith("file-seed0/out:") for f in paths["reuse"]["failed_cases"])


def test_a_model_new_that_ignores_eps_fails_on_the_labs_cases_where_the_files_cannot_tell(tmp_path):
    """In bf16, eps=1e-5 against mean(x²) ~ 1/3 of the file's torch.rand inputs is far below rounding: only the
    lab's tiny rows (mean(x²) ~ 1e-8 << eps) and its zero rows (0/0 without eps) tell the two apart."""
    specs = f'op.user_impls=["noeps={NEW / "rmsnorm_no_eps.py"}:ModelNew","honest={NEW / "rmsnorm_honest.py"}:ModelNew"]'
    report = parity_report(load(_point("rmsnorm", "precision=bf16", specs)), tmp_path / "a")
    assert report["paths"]["honest"]["verdict"] == "pass", report["paths"]["honest"]["failed_cases"]
    failed = report["paths"]["noeps"]["failed_cases"]
    assert report["paths"]["noeps"]["verdict"] == "fail" and any(f.startswith("lab-tiny/out:") for f in failed)
    assert {f.split("/")[0] for f in failed} <= {"lab-tiny", "lab-zero_row"}, failed


def test_a_model_new_given_other_weights_than_models_fails(tmp_path):
    specs = (f'op.user_impls=["honest={NEW / "gemm_swish_clamp_honest.py"}:ModelNew",'
             f'"own={NEW / "gemm_swish_clamp_own_weights.py"}:ModelNew"]')
    report = parity_report(load(_point("gemm_swish_clamp", specs)), tmp_path)
    assert report["paths"]["honest"]["verdict"] == "pass", report["paths"]["honest"]["failed_cases"]
    assert {"grad_gemm.weight", "grad_gemm.bias", "grad_x"} <= set(report["paths"]["honest"]["worst"])
    assert report["paths"]["own"]["verdict"] == "fail"  # its layer is named apart: it never gets Model's weights


def test_a_gradient_convention_at_zero_is_caught_by_the_labs_zero_row(tmp_path):
    """torch.clamp(x, min=0) is ReLU's forward but passes the gradient at x == 0, where ReLU's is 0: the file's
    torch.rand inputs never hit 0, the lab's zero-row case does."""
    clamp = tmp_path / "relu_clamp.py"
    clamp.write_text((NEW / "relu_honest.py").read_text().replace(
        "torch.where(x > 0, x, torch.zeros_like(x))", "torch.clamp(x, min=0.0)"))
    specs = f'op.user_impls=["clamp={clamp}:ModelNew","honest={NEW / "relu_honest.py"}:ModelNew"]'
    report = parity_report(load(_point("relu", specs)), tmp_path / "p")
    assert report["paths"]["honest"]["verdict"] == "pass"
    assert report["paths"]["clamp"]["failed_cases"] == [f for f in report["paths"]["clamp"]["failed_cases"]
                                                       if f.startswith("lab-zero_row/grad_x:")] != []


def test_sizes_shrink_by_one_factor_keeping_ratios_and_op_sizes_override_them():
    op = op_for(load(_point("gemm_swish_clamp")))
    record = op.describe(None, None, None)
    written, used = record["sizes_written"], record["sizes_used"]
    assert written == {"batch_size": 1024, "in_features": 8192, "out_features": 8192}
    factor = written["batch_size"] // used["batch_size"]
    assert factor > 1 and all(used[k] * factor == v for k, v in written.items())
    assert f"divided by {factor}" in record["sizes_how"]
    case = next(c for c in op.cases(load(_point("gemm_swish_clamp"))) if c.main)
    x = op.make_inputs(case, torch.float32, "cpu")
    assert sum(t.numel() * 4 for t in x.values()) + used["batch_size"] * used["out_features"] * 4 <= 8 * 2**20
    given = op_for(load(_point("gemm_swish_clamp", "op.sizes.batch_size=8", "op.sizes.in_features=32",
                               "op.sizes.out_features=16"))).describe(None, None, None)
    assert given["sizes_used"] == {"batch_size": 8, "in_features": 32, "out_features": 16}
    assert "op.sizes" in given["sizes_how"]


def test_the_labs_cases_sit_beside_the_files_with_fresh_parameters_and_say_where_they_came_from():
    cfg = load(_point("gemm_swish_clamp"))
    op = op_for(cfg)
    cases = {c.name: c for c in op.cases(cfg)}
    assert set(cases) == {"file-seed0", "file-seed1", "lab-signed", "lab-large", "lab-tiny", "lab-zero_row"}
    record = op.describe(None, None, None)
    assert record["cases_from_file"] == ["file-seed0", "file-seed1"]
    assert record["cases_from_lab"] == ["lab-signed", "lab-large", "lab-tiny", "lab-zero_row"]
    file0 = op.make_inputs(cases["file-seed0"], torch.float32, "cpu")
    signed = op.make_inputs(cases["lab-signed"], torch.float32, "cpu")
    zero = op.make_inputs(cases["lab-zero_row"], torch.float32, "cpu")
    assert file0["x"].min() >= 0 and signed["x"].min() < 0  # torch.rand's draws are all positive; the lab's not
    assert not torch.equal(file0["gemm.weight"], signed["gemm.weight"])  # fresh parameters
    assert signed["gemm.bias"].std() > 0
    assert torch.count_nonzero(zero["x"][0]) == 0 and torch.count_nonzero(zero["x"][1]) > 0
    again = op.make_inputs(cases["file-seed0"], torch.float32, "cpu")
    assert torch.equal(again["x"], file0["x"])  # the lab's seeds: the same case draws the same inputs
    assert not torch.equal(op.make_inputs(cases["file-seed1"], torch.float32, "cpu")["x"], file0["x"])


def test_flops_come_from_the_flop_counter_and_bytes_are_a_stated_floor():
    cfg = load(_point("matmul", "op.sizes.N=64"))
    op = op_for(cfg)
    case = next(c for c in op.cases(cfg) if c.main)
    costs = op.costs(case, cfg)
    assert costs.flops == 2 * 64 ** 3 and costs.backward_multiple == 2.0  # dA and dB: two more matmuls
    assert costs.bytes == 3 * 64 * 64 * 4 and "floor" in costs.bytes_formula
    relu = op_for(load(_point("relu", "op.sizes.batch_size=4", "op.sizes.dim=32")))
    counted = relu.costs(next(c for c in relu.cases(cfg) if c.main), cfg)
    assert counted.flops == 4 * 32 and "counted 0" in counted.flops_formula  # elementwise: a floor, said so
    assert op.curve_axes[0].x_name == "N" and op.curve_sizes(cfg) == [16, 32, 64]


def test_bench_train_records_every_path_as_not_trained_with_why(tmp_path):
    cfg = load(_point("relu", "op.sizes.batch_size=4", "op.sizes.dim=32",
                      f'op.user_impls=["honest={NEW / "relu_honest.py"}:ModelNew"]'))
    parity_report(cfg, tmp_path)
    train = bench_train_stage.run_bench_train(cfg, tmp_path)
    assert set(train["skipped"]) == {"reference", "honest"} and train["impls"] == {}
    assert "no model hook" in train["not_trained"] and train["skipped"]["honest"] == train["not_trained"]
    assert json.loads((tmp_path / "bench_train.json").read_text())["not_trained"] == train["not_trained"]


@pytest.mark.parametrize("overrides, says", [
    ([f"op.file={BAD / 'no_model.py'}"], "no_model.py: no class Model"),
    ([f"op.file={BAD / 'inputs_raise.py'}"], "inputs_raise.py: get_inputs() raised RuntimeError: shape"),
    ([f"op.file={BAD / 'output_not_tensor.py'}"], "output_not_tensor.py: Model's forward returns a dict, not a tensor"),
    ([f"op.file={BAD / 'size_not_int.py'}"], "a size it reads is not an int: batch_size = 16.0"),
    ([f"op.file={PROBLEMS / 'rmsnorm.py'}", f"op.user_impls=[{NEW / 'rmsnorm_other_signature.py'}:ModelNew]"],
     "ModelNew.forward(x, eps) in "),
    ([f"op.file={PROBLEMS / 'rmsnorm.py'}", "op.sizes.features=1.5"], "op.sizes.features=1.5: a size is a positive int"),
    ([f"op.file={PROBLEMS / 'rmsnorm.py'}", "op.sizes.eps=3"],
     "op.sizes.eps: no size constant eps; its sizes are batch_size, features, dim1, dim2"),
    ([f"op.file={PROBLEMS / 'rmsnorm.py'}", "op.x_name=eps"], "op.x_name='eps'"),
    ([], "op=problem needs op.file=PATH"),
    ([f"op.file={PROBLEMS / 'nope.py'}"], "nope.py: no such file"),
])
def test_a_bad_problem_file_is_one_config_error_line_naming_it(overrides, says):
    with pytest.raises(ConfigError) as caught:
        load(["op=problem", "device=cpu", *overrides])
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_the_cli_exits_2_with_one_line_and_writes_nothing(tmp_path):
    done = subprocess.run([sys.executable, "-m", "posttrainllm", "bench", "op=problem",
                           "op.file=tests/problems/bad/inputs_raise.py", f"run.out_dir={tmp_path / 'runs'}",
                           "run.log_mlflow=false"], capture_output=True, text=True, cwd=PROJECT_ROOT)
    assert done.returncode == 2
    assert done.stderr.strip() == ("posttrainllm: config error: op.file=tests/problems/bad/inputs_raise.py: "
                                   "get_inputs() raised RuntimeError: shape '[16, 3, -1]' is invalid for input of "
                                   "size 1024")
    assert not (tmp_path / "runs").exists()


def test_new_impl_writes_a_model_new_from_the_files_model(tmp_path, capsys):
    target = tmp_path / "mine.py"
    assert cli.main(["new-impl", "op=problem", f"op.file={PROBLEMS / 'gemm_swish_clamp.py'}", str(target)]) == 0
    text = target.read_text()
    assert "class ModelNew(nn.Module):" in text and "super(ModelNew, self).__init__()" in text
    assert "class Model(" not in text and "def get_inputs" not in text
    assert f"op.file={PROBLEMS / 'gemm_swish_clamp.py'}" in capsys.readouterr().out
    assert template(op_for(load(_point("gemm_swish_clamp"))).problem_file.problem).format(name="ModelNew") \
        in text  # the file's body is the template tested above


def test_an_honest_model_new_gets_a_speed(tmp_path):
    cfg = load(_point("gemm_swish_clamp", f'op.user_impls=["honest={NEW / "gemm_swish_clamp_honest.py"}:ModelNew"]',
                      "op.sizes.batch_size=32", "op.sizes.in_features=64", "op.sizes.out_features=64",
                      "bench.reps=3", "bench.min_time_s=0", "bench.max_reps=12"))
    report = parity_report(cfg, tmp_path)
    assert report["paths"]["honest"]["verdict"] == "pass"
    calibration = {"peaks": {"gemm_flops_per_s": {"float32": 1e11}, "copy_bytes_per_s": 1e10}}
    micro = microbench_stage.run_microbench(cfg, tmp_path, calibration)
    entry = micro["paths"]["honest"]
    assert entry["valid"] and entry["median_ms"] > 0 and entry["forward_backward"]["median_ms"] > 0
    assert micro["describe"]["file"] == "tests/problems/gemm_swish_clamp.py"
    assert {row["x_value"] for row in __import__("csv").DictReader(open(tmp_path / "curve.csv"))} == {"8", "16", "32"}


def test_the_cli_takes_op_sizes_and_the_receipt_records_them(tmp_path):
    done = subprocess.run([sys.executable, "-m", "posttrainllm", "bench", "op=problem", "device=cpu",
                           "op.file=tests/problems/relu.py", "op.sizes.batch_size=8", "op.sizes.dim=24",
                           "parity.seeds=[0]", "bench.reps=3", "bench.min_time_s=0", "bench.max_reps=6",
                           f"run.out_dir={tmp_path / 'runs'}", "run.log_mlflow=false"],
                          capture_output=True, text=True, cwd=PROJECT_ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    receipt = json.loads(next((tmp_path / "runs").glob("*/receipt.json")).read_text())
    record = receipt["microbench"]["describe"]
    assert record["sizes_used"] == {"batch_size": 8, "dim": 24} and record["sizes_written"]["dim"] == 393216
    assert "batch_size=8 dim=24" in done.stdout


def test_a_folder_of_problem_files_is_a_sweep_with_a_point_each():
    from posttrainllm.lab import reads, sweep

    params = sweep.plan(load(["sweep=problems"]).sweep)
    names = [f"problem-{name}" for name in sorted(FILES)]
    assert list(params["points"]) == ["baseline", *names]
    point = params["points"]["problem-relu"]
    assert point["config"]["op"]["name"] == "problem" and point["config"]["op"]["file"] == "tests/problems/relu.py"
    for stage in ("reference", "kernel", "parity", "microbench"):  # an edit to the file reruns what reads it
        assert "tests/problems/relu.py" in reads.point_stage_deps(stage, point)["sources"]
        assert "posttrainllm/ops/problem" in reads.point_stage_deps(stage, point)["sources"]  # its code, every stage
    assert "tests/problems/relu.py" not in reads.point_stage_deps("reference", params["points"]["baseline"])["sources"]
    assert "config.parity.seeds" in reads.point_stage_deps("kernel", point)["params"]  # the cases it is made with
    # no Triton code of its own (ops/problem/__init__.py READS): no kernels.py to depend on
    assert not [s for s in reads.point_stage_deps("kernel", point)["sources"] if s.endswith("kernels.py")]
    with pytest.raises(ConfigError, match="sweep.problems=nowhere: no such folder"):
        sweep.plan(load(["sweep=problems", "sweep.problems=nowhere"]).sweep)
