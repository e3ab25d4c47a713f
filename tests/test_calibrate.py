"""calibrate: the method (formulas, size choice within a budget, skips) on a fake device; one tiny real run."""

import json

import pytest
import torch

from posttrainllm.measure import calibrate as cal
from posttrainllm.measure.timing import summarize

# fp8 at 2.25x bf16: both measured medians, so their ratio need not be the datasheets' 2x.
FAKE_GEMM_FLOPS_PER_S = {torch.float32: 100e9, torch.bfloat16: 400e9, torch.float16: 1e9,
                         torch.float8_e4m3fn: 900e9}
FAKE_COPY_BYTES_PER_S = 20e9


@pytest.fixture
def fake_device(monkeypatch):
    """GEMMs on meta tensors (no work) and a `measure` whose time follows a known rate model."""

    def operands(n, dtype_name, device):
        dtype = torch.float32 if dtype_name == "tf32" else getattr(torch, dtype_name)
        return torch.empty(n, n, dtype=dtype, device="meta"), torch.empty(n, n, dtype=dtype, device="meta")

    def scaled_mm(a, b, *, scale_a, scale_b, out_dtype):
        """What the calibration must pass _scaled_mm; C in A's dtype, so `measure` knows the fp8 rate."""
        assert a.dtype == b.dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16
        assert b.stride() == (1, b.shape[0])  # column-major, as _scaled_mm asks
        assert scale_a.dtype == scale_b.dtype == torch.float32 and scale_a.numel() == scale_b.numel() == 1
        return torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device="meta")

    def measure(fn, *, device, warmup, reps, min_time_s, max_reps, **_):
        out = fn()
        if out.dim() == 2:  # a GEMM: (n, n)
            seconds = 2 * out.shape[0] ** 3 / FAKE_GEMM_FLOPS_PER_S[out.dtype]
        else:  # the copy: read + write of the buffer
            seconds = 2 * out.numel() * out.element_size() / FAKE_COPY_BYTES_PER_S
        n = max(reps, min(max_reps, int(min_time_s / seconds) + 1))
        return summarize([seconds * 1e3] * n, threads=1)

    monkeypatch.setattr(cal, "_operands", operands)
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(cal, "measure", measure)
    monkeypatch.setattr(cal, "COPY_BYTES", {"cpu": 2**20, "cuda": 2**20})


def test_rates_follow_the_formulas(fake_device):
    result = cal.calibrate("cpu", budget_s=6.0)
    peaks, method = result["peaks"], result["method"]
    # flops = 2 n^3 at the chosen n, divided by the (known) median seconds: the model's rate back.
    assert peaks["gemm_flops_per_s"]["float32"] == pytest.approx(100e9)
    assert peaks["gemm_flops_per_s"]["bfloat16"] == pytest.approx(400e9)
    # bytes = 2 x 1 MiB per copy.
    assert result["measurements"]["copy"]["bytes"] == 2 * 2**20
    assert peaks["copy_bytes_per_s"] == pytest.approx(FAKE_COPY_BYTES_PER_S)
    gemm = result["measurements"]["gemm"]["float32"]
    assert gemm["flops"] == 2 * gemm["n"] ** 3
    assert method["formulas"] == cal.FORMULAS and method["statistic"].startswith("median")


def test_sizes_climb_to_the_target_when_cheap_and_stop_when_not(fake_device):
    result = cal.calibrate("cpu", budget_s=6.5)  # each GEMM dtype gets 6.5 x 0.8 / 3 = 1.73 s
    sizes = result["method"]["gemm_sizes"]
    assert sizes["float32"] == sizes["bfloat16"] == cal.GEMM_SIZES["cpu"][-1]
    # fp16 at 1 GFLOP/s, one call: 4.2 ms at 128, 33.6 ms at 256, 268 ms at 512, 2.15 s at 1024.
    # After probing 128 and 256 (2 calls each: 75 ms), 512 needs 2 probe + 4 timed calls = 1.61 s:
    # 1.69 s fits 1.73 s. 1024 would need 12.9 s: the climb stops at 512.
    assert sizes["float16"] == 512
    assert "not the target" in result["measurements"]["gemm"]["float16"]["note"]
    assert result["peaks"]["gemm_flops_per_s"]["float16"] == pytest.approx(1e9)


def test_a_dtype_too_slow_for_its_share_is_skipped_with_the_reason(fake_device):
    # Share = 0.06 x 0.8 / 3 = 16 ms; fp16 at n=128 is 4.2 ms per call, 4 calls = 16.8 ms.
    result = cal.calibrate("cpu", budget_s=0.06)
    assert "float16" not in result["peaks"]["gemm_flops_per_s"]
    reason = result["method"]["skipped"]["float16"]
    assert "1 GFLOP/s" in reason and "n=128" in reason


def test_cpu_fp8_is_skipped_with_the_reason_and_leaves_the_others_their_shares(fake_device):
    # On the CPU _scaled_mm runs (the fake here) but has no fast kernel: skipped before its first timed call,
    # its share not taken from the others (the climb above still ends fp16 at 512 on a 6.5 x 0.8 / 3 s share).
    result = cal.calibrate("cpu", budget_s=6.5)
    assert cal.FP8 in cal.GEMM_DTYPES["cpu"] and cal.FP8 not in result["peaks"]["gemm_flops_per_s"]
    assert "no fast kernel" in result["method"]["skipped"][cal.FP8]
    assert result["method"]["gemm_sizes"]["float16"] == 512


def test_fp8_is_timed_with_scaled_mm_where_it_has_a_kernel(fake_device, monkeypatch):
    monkeypatch.setattr(cal, "NO_FAST_KERNEL", {})  # as on a GPU
    result = cal.calibrate("cpu", budget_s=6.5)
    gemm = result["measurements"]["gemm"][cal.FP8]
    assert gemm["flops"] == 2 * gemm["n"] ** 3 and gemm["n"] == cal.GEMM_SIZES["cpu"][-1]
    assert result["peaks"]["gemm_flops_per_s"][cal.FP8] == pytest.approx(900e9)
    assert cal.FP8 not in result["method"]["skipped"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fp8_refused_by_scaled_mm_is_skipped_with_its_reason(fake_device, monkeypatch, device):
    def refuses(*args, **kwargs):
        raise RuntimeError("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or "
                           "8.9, or ROCm MI300+\n(a second line)")

    monkeypatch.setattr(torch, "_scaled_mm", refuses)
    monkeypatch.setattr(cal, "NO_FAST_KERNEL", {})
    reason = cal._unsupported(cal.FP8, device)
    assert reason.startswith(f"torch._scaled_mm refused e4m3 operands on {device}: RuntimeError: ")
    assert "compute capability >= 9.0" in reason and "\n" not in reason
    if device == "cpu":  # the whole calibration: skipped, never failed; the others measured on their shares
        result = cal.calibrate("cpu", budget_s=6.5)
        assert result["method"]["skipped"] == {cal.FP8: reason}
        assert set(result["peaks"]["gemm_flops_per_s"]) == {"float32", "bfloat16", "float16"}
        assert result["method"]["gemm_sizes"]["float16"] == 512
    monkeypatch.delattr(torch, "_scaled_mm")
    assert cal._unsupported(cal.FP8, device) == "torch._scaled_mm is not in this PyTorch"


CALIBRATION = {"peaks": {"gemm_flops_per_s": {"float32": 100e9, "bfloat16": 400e9, "float8_e4m3fn": 900e9},
                         "copy_bytes_per_s": 20e9}}


def test_peak_for_a_quantized_precision_is_its_formats_peak():
    assert cal.peak_for(CALIBRATION, "bfloat16", False, "float8_e4m3fn") == (900e9, 20e9)
    assert cal.peak_for(CALIBRATION, "bfloat16", False) == (400e9, 20e9)  # unquantized: its dtype's
    without = {"peaks": {**CALIBRATION["peaks"], "gemm_flops_per_s": {"float32": 100e9, "bfloat16": 400e9}}}
    assert cal.peak_for(without, "bfloat16", False, "float8_e4m3fn") == (None, 20e9)  # not bf16's
    assert cal.peak_for(CALIBRATION, "bfloat16", False, "float8_e5m2") == (None, 20e9)  # e5m2: not measured


def test_an_fp8_path_at_the_fp8_peak_is_not_refused_as_impossible(fake_device, monkeypatch):
    from posttrainllm.lab.stages import microbench as microbench_stage

    monkeypatch.setattr(cal, "NO_FAST_KERNEL", {})
    calibration = cal.calibrate("cpu", budget_s=6.5)  # fp8 measured at 900 GFLOP/s, bf16 at 400
    flops, fraction = 2 * 4096**3, 0.5  # bench.impossible_below
    peak, _ = cal.peak_for(calibration, "bfloat16", False, "float8_e4m3fn")
    floor_s = microbench_stage.roofline_floor_s(flops, calibration, peak)
    assert floor_s == pytest.approx(flops / 900e9)

    def check(rate):
        return microbench_stage.impossible(flops / rate * 1e3, flops, calibration, peak, fraction)

    # At the fp8 peak: 2.25x the bf16 peak, which a floor at the bf16 peak would have refused.
    assert check(900e9) is None
    assert check(2.2 * 900e9).startswith("impossible")  # over 2x the best peak still is


def test_a_kept_calibration_without_fp8_is_measured_again(fake_device, tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    old = cal.calibrate("cpu", budget_s=0.5)
    old["measurements"]["gemm"].pop(cal.FP8)  # as written before FP8 was in GEMM_DTYPES
    path.write_text(json.dumps(old))
    monkeypatch.setattr(cal, "calibrate", lambda device, budget_s: {"fresh": True})
    assert cal.load_or_measure(path, "cpu") == {"fresh": True}
    path.write_text(json.dumps({**old, "measurements": {"gemm": {**old["measurements"]["gemm"], cal.FP8: {}}}}))
    assert "fresh" not in cal.load_or_measure(path, "cpu")


def test_real_cpu_calibration_is_well_formed():
    result = cal.calibrate("cpu", budget_s=1.0)
    assert result["fingerprint"]["device"] == "cpu"
    assert result["method"]["threads"] == torch.get_num_threads()
    flops = result["peaks"]["gemm_flops_per_s"]
    assert "float32" in flops and all(v > 0 for v in flops.values())
    assert set(flops) | set(result["method"]["skipped"]) == set(cal.GEMM_DTYPES["cpu"])
    assert cal.FP8 in result["method"]["skipped"]  # refused by this build, or no fast kernel: one line either way
    assert "\n" not in result["method"]["skipped"][cal.FP8]
    assert result["peaks"]["copy_bytes_per_s"] > 0
    assert result["measurements"]["copy"]["size_bytes"] == cal.COPY_BYTES["cpu"]


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="valid choices are cpu, cuda"):
        cal.calibrate("tpu")


@pytest.mark.parametrize("name, variant, bf16, bandwidth", [
    ("NVIDIA H200", "H200 SXM", 989.5e12, 4.8e12),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.5e12, 3.35e12),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.5e12, 2.0e12),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5e12, 3.9e12),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5e12, 4.8e12),
])
def test_published_peaks_are_dense_and_labelled(name, variant, bf16, bandwidth):
    peaks = cal.published_peaks(name)
    assert peaks["variant"] == variant and peaks["dense"]
    assert "published" in peaks["source"] and "not measured" in peaks["source"]
    assert peaks["gemm_flops_per_s"]["bfloat16"] == pytest.approx(bf16)
    assert peaks["gemm_flops_per_s"]["tf32"] == pytest.approx(bf16 / 2, rel=1e-3)
    # fp8 dense is twice bf16 dense, keyed as the calibration measures it.
    assert peaks["gemm_flops_per_s"][cal.FP8] == pytest.approx(2 * bf16, rel=1e-3)  # the sheets round
    assert peaks["copy_bytes_per_s"] == pytest.approx(bandwidth)


def test_published_peaks_unknown_device():
    assert cal.published_peaks("NVIDIA A100-SXM4-80GB") is None
    assert cal.published_peaks("AMD EPYC") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_calibration_is_well_formed():
    result = cal.calibrate("cuda", budget_s=2.0)
    flops = result["peaks"]["gemm_flops_per_s"]
    assert set(flops) | set(result["method"]["skipped"]) == set(cal.GEMM_DTYPES["cuda"])
    assert all(v > 0 for v in flops.values()) and result["peaks"]["copy_bytes_per_s"] > 0
    if result["published"] is not None:
        assert "not measured" in result["published"]["source"]


def test_the_floor_peak_is_the_fastest_format_at_least_as_precise_as_the_points():
    cpu = {"peaks": {"gemm_flops_per_s": {"float32": 50e9, "bfloat16": 240e9, "float16": 2e9},
                     "copy_bytes_per_s": 8e9}}
    assert cal.floor_peak(cpu, "float32", False) == 50e9  # not bf16's 240: bf16 math fails an fp32 contract
    assert cal.floor_peak(cpu, "float16", False) == 50e9  # SDPA computes fp16 in fp32 on a CPU: fp32's peak binds
    assert cal.floor_peak(cpu, "bfloat16", False) == 240e9
    assert cal.floor_peak(CALIBRATION, "bfloat16", False, "float8_e4m3fn") == 900e9
    assert cal.floor_peak({"peaks": {"gemm_flops_per_s": {}, "copy_bytes_per_s": 1.0}}, "float32", False) is None
