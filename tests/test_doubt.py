"""A path above the calibrated FLOP peak: the peak is doubted (remeasured at the path's own size and dtype) before a
speed is refused (rule "local_peak", lab/stages/microbench.py _placed), on this CPU's real GEMMs."""

import torch

from posttrainllm.lab.stages.microbench import _placed
from posttrainllm.measure import device as devices
from posttrainllm.measure.timing import measure

N = 128
FLOPS = 2 * N**3


def _place(seconds, calibrated_peak, local):
    calibration = {"peaks": {"gemm_flops_per_s": {"float32": calibrated_peak}, "copy_bytes_per_s": 10e9},
                   "method": {"gemm_sizes": {"float32": 1024}}}
    return _placed(FLOPS, 3 * N * N * 4, seconds, 3 * N * N * 4, calibration=calibration,
                   peak_flops=calibrated_peak, peak_bandwidth=10e9, cache_bytes=32 * 2**20,
                   floor_flops=calibrated_peak, precision=("float32", False, None), device="cpu", local=local)


def test_a_matmul_above_a_peak_calibrated_at_another_size_gets_the_peak_of_its_own_size():
    """torch's own 128^3 matmul, timed here, against a calibration whose peak is a tenth of what it reaches (as
    the n=1024 peak was below the 128^3 rate on the CPU): remeasured, it is within its roof. Planted bug: without
    the remeasure (peak_used 'calibration'), above_roof is set and the microbench refuses the path."""
    devices.prepare("cpu", 1)
    a, b = torch.randn(N, N), torch.randn(N, N)
    seconds = measure(lambda: a @ b, device="cpu", warmup=2, reps=10, min_time_s=0.0, max_reps=10).median_ms / 1e3
    achieved = FLOPS / seconds
    local = {}
    roof = _place(seconds, achieved / 10, local)
    assert roof["peak_used"]["source"] == "remeasured" and roof["peak_used"]["n"] == N
    assert roof["above_roof"] is None and roof["fraction_of_attainable"] <= 1.0
    assert roof["peak_used"]["calibrated_flops_per_s"] == achieved / 10
    assert "remeasured at its own size (a 128^3 float32 GEMM" in roof["peak_used"]["why"]
    assert list(local) == [N]  # measured once per size


def test_a_time_no_gemm_of_its_size_reaches_is_still_refused():
    """A 'matmul' 1000x faster than any GEMM of its size: remeasured, still above: no speed, and why says so."""
    devices.prepare("cpu", 1)
    roof = _place(1e-9, 1e9, {})
    assert roof["above_roof"] is not None and roof["peak_used"]["why"].endswith("still above it: no speed")


def test_a_path_within_the_calibrated_peak_is_not_remeasured():
    local = {}
    roof = _place(FLOPS / 1e9, 10e9, local)  # 1 GFLOP/s against 10
    assert roof["peak_used"]["source"] == "calibration" and local == {}
