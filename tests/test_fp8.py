"""precision=fp8 / fp8_rowwise for op=matmul: the scaling recipe, the quantized contract, the paths, planted bugs
(op=moe's: tests/test_fp8_moe.py).

The kernel's bugs are one-line mutations of posttrainllm/ops/matmul/fp8.py; saturating instead of scaling is one of
the quantization helper in posttrainllm/ops/quantize.py, caught by the quantization's own SQNR (the paths, which
all see the same badly quantized inputs, still pass).
"""

import dataclasses

import pytest
import torch
from conftest import kernel_and_parity, kernel_mutant, parity_report

from posttrainllm import cli
from posttrainllm.config import ConfigError, Contract
from posttrainllm.lab import parity
from posttrainllm.lab.stages import microbench as microbench_stage
from posttrainllm.lab.configure import load
from posttrainllm.ops.registry import OPS
from posttrainllm.ops.matmul import definition as matmul
from posttrainllm.ops.base import Case
from posttrainllm.ops import quantize as reference

SMALL = ["op=matmul", "device=cpu", "parity.seeds=[0]", "tile=b32", "shape.ops.matmul.m=64", "shape.ops.matmul.n=64",
         "shape.ops.matmul.k=64",
         "shape.ops.matmul.edge=[[41,77,33]]"]
# no test here reads kernel.json's compile section (tests/test_compile.py does): the kernel stage runs without its child
pytestmark = pytest.mark.usefixtures("without_compile_child")


# --- the scaling recipe (posttrainllm/ops/quantize.py) -----------------------------------------


def test_fp8_scale_maps_each_groups_amax_to_448_and_dequantizes_within_e4m3s_rounding():
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(3)) * torch.arange(1, 6).reshape(5, 1)
    for dim, shape in ((None, ()), (1, (5, 1)), (0, (1, 7))):
        scale = reference.fp8_scale(x, dim)
        assert scale.dtype == torch.float32 and tuple(scale.shape) == shape
        q = reference.quantize_fp8(x, scale)
        assert q.dtype == torch.float8_e4m3fn
        amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
        assert torch.equal(q.float().abs().amax() if dim is None else q.float().abs().amax(dim=dim, keepdim=True),
                           torch.full_like(amax, 448.0))  # every group's largest value lands on the format's max
        back = reference.dequantize_fp8(q, scale, torch.float64)
        normal = (x / scale).abs() >= 2 ** -6  # e4m3's normal range: 3 mantissa bits, half an ulp = 2^-4 relative
        assert ((back - x.double()).abs() <= 2 ** -4 * x.double().abs())[normal].all()


def test_an_all_zero_group_gets_a_finite_scale_and_zeros():
    x = torch.zeros(3, 4)
    x[0] = 1.0
    scale = reference.fp8_scale(x, 1)
    q = reference.quantize_fp8(x, scale)
    assert torch.isfinite(scale).all() and torch.equal(q[1:].float(), torch.zeros(2, 4))
    assert reference.fp8_scale(torch.tensor([57344.0]), None, torch.float8_e5m2).item() == 1.0  # e5m2's max


# --- config: the precision is global; the recipe's own bounds -----------------------------------


@pytest.mark.parametrize("op", [name for name in OPS if name not in ("matmul", "moe")])
def test_other_ops_under_fp8_are_refused_in_one_line(op):
    with pytest.raises(ConfigError) as err:
        load([f"op={op}", "precision=fp8"])
    assert str(err.value) == (f"precision fp8 is supported by op=matmul, op=moe only: op={op} has no float8_e4m3fn "
                              "inputs or paths")


@pytest.mark.parametrize("overrides, message", [
    (["precision=fp8_rowwise", "tile=b16"], "tile.block_k=16 under precision fp8_rowwise: tl.dot on fp8 operands"),
    (["precision=fp8", "tile=auto"], "tile/workgroup=auto under precision fp8: the fp8 kernel has no autotuner"),
    (["precision=fp8", "op.peers=[compiled]"], "op.peers=['compiled'] under precision fp8"),
    (["precision=fp8", "precision.quantize.format=float8_e5m2"], "op=matmul's fp8 paths take float8_e4m3fn"),
    (["precision=fp8", "precision.quantize.scaling=block"],
     "precision.quantize.scaling='block': valid choices are tensor, row"),
    (["precision=fp8", "precision.contract.min_sqnr_db=0"], "precision.contract.min_sqnr_db=0.0: must be > 0 dB"),
])
def test_a_bad_fp8_matmul_config_is_refused_naming_the_bound(overrides, message):
    with pytest.raises(ConfigError) as err:
        load(["op=matmul", *overrides])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_cli_refuses_fp8_for_another_op(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "op=rmsnorm", "precision=fp8_rowwise"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("posttrainllm: config error: precision fp8_rowwise is supported by op=matmul, op=moe only: "
                   "op=rmsnorm has no float8_e4m3fn inputs or paths")
    assert list(tmp_path.iterdir()) == []


# --- the contract: SQNR floor of a path, and the quantization's own report -----------------------


def test_min_sqnr_db_fails_a_scaled_output_and_is_off_by_default():
    oracle = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    scaled = oracle * 1.02  # SQNR = 20·log10(1 / 0.02) = 33.98 dB
    assert parity.sqnr_db(oracle, scaled) == pytest.approx(33.979, abs=1e-3)
    assert parity.sqnr_db(oracle, oracle) == float("inf")
    loose = Contract(floor_rel=0.1, atol=1.0, rtol=1.0)
    assert "sqnr_db" not in parity.check_output(scaled, oracle, oracle, loose)
    assert parity.check_output(scaled, oracle, oracle, dataclasses.replace(loose, min_sqnr_db=30))["verdict"] == "pass"
    check = parity.check_output(scaled, oracle, oracle, dataclasses.replace(loose, min_sqnr_db=40))
    assert check["verdict"] == "fail" and check["reason"] == "sqnr 34.0 dB < min_sqnr_db 40 dB"
    assert check["bound_ratio"] == pytest.approx(10 ** ((40 - 33.979) / 20), rel=1e-3)


def test_quantization_check_names_the_worst_row():
    exact = torch.randn(4, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    quantized = exact * 1.001
    quantized[2] *= 1.5  # one row off by half: ~6 dB
    result = parity.quantization_check([("c", {"out": quantized}, {"out": exact})], min_sqnr_db=20,
                                       min_row_sqnr_db=20)
    entry = result["cases"][0]
    assert result["verdict"] == "fail" and entry["worst_row"] == (2,) and entry["row_min_sqnr_db"] < 7
    assert result["failed_cases"][0].startswith("c/out: ") and "row (2,): sqnr 6.0 dB < min_row_sqnr_db 20" in \
        result["failed_cases"][0]


@pytest.mark.parametrize("precision, scaling", [("fp8", "tensor"), ("fp8_rowwise", "row")])
def test_fp8_paths_pass_forward_only_with_the_quantization_reported_apart(precision, scaling, tmp_path,
                                                                          shared_reference):
    report = kernel_and_parity(shared_reference([*SMALL, f"precision={precision}"], tmp_path), tmp_path)
    assert report["verdict"] == "pass", report["first_failure"]
    assert set(report["paths"]) == {"scaled_mm", "triton"}  # torch._scaled_mm runs on this CPU
    for path in report["paths"].values():
        assert path["backward"] == "none" and {c["output"] for c in path["cases"]} == {"out"}
        assert all(c["sqnr_db"] > 50 for c in path["cases"])  # bf16 output rounding only, against the oracle
    judged = {"holds": True, "judged": True, "by": ["promised by the path"], "verdict": "pass"}
    assert report["paths"]["triton"]["properties"]["deterministic"] == judged  # its Impl's promise (no atomics)
    quantization = report["quantization"]
    grads = "float8_e5m2" if scaling == "tensor" else "float8_e4m3fn"  # bench-train's dY: each recipe's, as torchao's
    assert quantization["recipe"] == f"float8_e4m3fn:{scaling}" and quantization["grad_format"] == grads
    assert quantization["verdict"] == "pass" and 25 < quantization["row_min_sqnr_db"] < quantization["sqnr_db"] < 35
    records = torch.load(tmp_path / "reference.pt", weights_only=True)["records"]
    inputs = records[0]["inputs"]
    assert inputs["a"].dtype == torch.float8_e4m3fn and inputs["b"].dtype == torch.float8_e4m3fn
    assert tuple(inputs["a_scale"].shape) == (() if scaling == "tensor" else (64, 1))
    assert set(records[0]["oracle"]) == {"out"} and set(records[0]["unquantized"]) == {"out"}  # no gradient oracle


# --- planted bugs -----------------------------------------------------------------------------------

PLANTED_KERNEL_BUGS = {
    "a scale not applied": ("fp8", "acc = acc * a_s * b_s", "acc = acc * b_s"),
    "a scale applied twice": ("fp8_rowwise", "acc = acc * a_s * b_s", "acc = acc * a_s * a_s * b_s"),
    "rows scaled by the next row's scale": ("fp8_rowwise", "a_s = tl.load(a_scale_ptr + offs_m)[:, None]",
                                            "a_s = tl.load(a_scale_ptr + (offs_m + 1) % M)[:, None]"),
}


@pytest.mark.usefixtures("without_invariance_reruns")
@pytest.mark.parametrize("bug", PLANTED_KERNEL_BUGS)
def test_planted_fp8_kernel_bug_is_caught(bug, tmp_path, monkeypatch, shared_reference):
    precision, original, planted = PLANTED_KERNEL_BUGS[bug]
    mutant = kernel_mutant(tmp_path, "fp8_matmul", original, planted)

    def fn(x, cfg):
        return {"out": mutant.fp8_matmul(x["a"], x["a_scale"], x["b"], x["b_scale"], block_m=32, block_n=32,
                                         block_k=32)}
    monkeypatch.setitem(matmul.FP8_IMPLS, "triton", dataclasses.replace(matmul.FP8_IMPLS["triton"], fn=fn))
    out = tmp_path / "point"
    report = kernel_and_parity(shared_reference([*SMALL, f"precision={precision}"], out), out)
    assert report["paths"]["triton"]["verdict"] == "fail"
    assert report["paths"]["scaled_mm"]["verdict"] == "pass" and report["quantization"]["verdict"] == "pass"
    failed = report["paths"]["triton"]["failed_cases"][0]
    if "next row" in bug:  # the per-row rule: most rows fail, each by its neighbour's amax ratio
        assert "rows fail" in failed
    else:
        assert "sqnr" in failed and "max_abs_err" in failed


def test_saturating_instead_of_scaling_is_caught_by_the_quantization_sqnr(tmp_path, monkeypatch):
    mutant = kernel_mutant(tmp_path, "quantize",
                           "return (x.float() * scale.reciprocal()).clamp(-fp8_max, fp8_max).to(fp8_dtype)",
                           "return x.float().clamp(-fp8_max, fp8_max).to(fp8_dtype)")
    monkeypatch.setattr(reference, "quantize_fp8", mutant.quantize_fp8)
    report = parity_report(load([*SMALL, "precision=fp8"]), tmp_path / "point")
    assert report["verdict"] == "fail" and report["first_failure"].startswith("quantization: ")
    assert report["quantization"]["sqnr_db"] < 1  # the dequantized operands are amax/448 of the true ones
    assert all(p["verdict"] == "pass" for p in report["paths"].values())  # every path saw the same inputs


# --- the peer's absence, the costs ---------------------------------------------------------------


def test_a_refusing_scaled_mm_is_absent_and_named(monkeypatch):
    cfg = load(["op=matmul", "precision=fp8", "device=cpu"])
    assert matmul.scaled_mm_refusal(cfg) is None and "scaled_mm" in matmul.OP.paths(cfg)

    def refuse(*args, **kwargs):
        raise RuntimeError("no fp8 GEMM on this device\nsecond line")
    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    monkeypatch.setattr(matmul, "_SCALED_MM_PROBES", {})
    assert matmul.scaled_mm_refusal(cfg) == "RuntimeError: no fp8 GEMM on this device"
    assert list(matmul.OP.paths(cfg)) == ["reference", "triton"]


@pytest.mark.parametrize("precision", ["fp8", "fp8_rowwise"])
def test_b_comes_k_major_once_per_case_so_no_timed_call_lays_it_out(precision, monkeypatch):
    """make_inputs gives B_q column-major (K-major): torch._scaled_mm gets the inputs' own A and B (no copy in the
    call), and both fast paths give the same numbers as on a row-major B."""
    cfg = load([*SMALL, f"precision={precision}"])
    case = next(c for c in matmul.OP.cases(cfg) if c.main)
    x = matmul.OP.make_inputs(case, torch.bfloat16, "cpu")
    assert x["b"].stride() == (1, 64) and x["a"].is_contiguous()
    handed = []
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **kw: handed.append((a, b)) or scaled_mm(a, b, **kw))
    row_major = dict(x, b=x["b"].contiguous())
    for name in ("scaled_mm", "triton"):
        fn = matmul.FP8_IMPLS[name].fn
        assert torch.equal(fn(x, cfg)["out"], fn(row_major, cfg)["out"]), name
    (a, b), _ = handed
    assert a.data_ptr() == x["a"].data_ptr() and b.data_ptr() == x["b"].data_ptr() and b.stride() == x["b"].stride()


def test_the_triton_fp8_gemm_is_absent_below_sm_89_and_runs_interpreted_on_a_cpu(monkeypatch):
    """tl.dot on e4m3 needs fp8 tensor cores (compute capability 8.9): below, the path is absent with the reason, as
    a refusing torch._scaled_mm is; on the CPU Triton's interpreter runs it."""
    cpu = load(["op=matmul", "precision=fp8", "device=cpu"])
    assert matmul.triton_fp8_refusal(cpu) is None and "triton" in matmul.OP.paths(cpu)
    cuda = load(["op=matmul", "precision=fp8", "device=cuda"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(matmul, "scaled_mm_refusal", lambda cfg: None)  # no probe on a device this machine lacks
    for capability, runs in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert ("triton" in matmul.OP.paths(cuda)) == runs, capability
        if not runs:
            why = matmul.unavailable(cuda)["triton"]
            assert why == (f"tl.dot on float8_e4m3fn needs compute capability >= 8.9 (fp8 tensor cores: Ada, "
                           f"Hopper); this device is sm_{capability[0]}{capability[1]}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert matmul.unavailable(cuda) == {"triton": "no CUDA device"}


def test_fp8_costs_count_one_byte_operands_and_the_scales():
    cfg = load(["op=matmul", "precision=fp8_rowwise", "device=cpu"])
    costs = matmul.OP.costs(Case("c", 0, dict(m=8, n=4, k=16), True, quantize="float8_e4m3fn:row"), cfg)
    assert (costs.flops, costs.bytes) == (2 * 8 * 4 * 16, (8 * 16 + 16 * 4) * 1 + 8 * 4 * 2 + (8 + 4) * 4)


def test_an_fp8_points_roofline_is_drawn_against_the_fp8_peak_or_none(tmp_path):
    cfg = load([*SMALL, "precision=fp8", f"run.out_dir={tmp_path}", "run.name=p", "bench.reps=3",
                "bench.min_time_s=0", "shape.curve=[32,64]", "shape.ops.matmul.curve=[32,64]"])
    out = tmp_path / "p"
    parity_report(cfg, out)
    bf16 = {"float32": 1e11, "bfloat16": 4e11}
    for flops, peak in ((bf16, None), ({**bf16, "float8_e4m3fn": 9e11}, 9e11)):  # not measured: no roof, not bf16's
        (out / "roofline.png").unlink(missing_ok=True)
        micro = microbench_stage.run_microbench(cfg, out, {"peaks": {"gemm_flops_per_s": flops, "copy_bytes_per_s": 1e10}})
        assert micro["peaks"]["gemm_flops_per_s"] == peak
        assert (micro["paths"]["scaled_mm"]["roofline"] is None) == (peak is None)
        assert (out / "roofline.png").stat().st_size > 0  # drawn either way: a DVC out of the microbench stage


def test_an_fp8_points_stages_depend_on_both_kernel_modules_and_the_quality_base():
    """ops/matmul/fp8.py imports ops/matmul/kernels.py (its grouped tile and launch): a stage that runs it loads both,
    so an edit to either reruns it. bench_train reads no heads key: the DVC stage takes the draft-heads base from
    the train_base stage's folder (dvc.yaml lists it), not from heads.out_dir, which no point carries."""
    from posttrainllm.config import point_config
    from posttrainllm.lab.reads import point_stage_deps as stage_deps

    point = {"config": point_config(load(["op=matmul", "precision=fp8", "tile=b32"]))}
    for stage in ("kernel", "microbench", "bench_train"):
        sources = stage_deps(stage, point)["sources"]
        assert {"posttrainllm/ops/matmul/fp8.py", "posttrainllm/ops/matmul/kernels.py"} <= set(sources), stage
    assert not [key for key in stage_deps("bench_train", point)["params"] if key.startswith("config.heads")]
