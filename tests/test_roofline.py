"""roofline: hand-computed points for every class and the boundaries.

A toy device: peak 100 GFLOP/s, 10 GB/s -> ridge 10 FLOP/B.
"""

import pytest

from posttrainllm.measure.roofline import COMPUTE, LOW_FRACTION, MEMORY, OVERHEAD, OVERHEAD_DOMINATES_BELOW, roofline

PEAKS = dict(peak_flops=100e9, peak_bytes_per_s=10e9)


def test_compute_bound():
    # 1 GFLOP over 10 MB: I = 100 FLOP/B > ridge 10; attainable 100 GFLOP/s; in 20 ms -> 50 GFLOP/s = 50 %.
    r = roofline(1e9, 10e6, 0.020, **PEAKS)
    assert r["intensity_flops_per_byte"] == pytest.approx(100.0)
    assert r["ridge_flops_per_byte"] == pytest.approx(10.0)
    assert r["attainable_flops_per_s"] == pytest.approx(100e9)
    assert r["achieved_flops_per_s"] == pytest.approx(50e9)
    assert r["achieved_bytes_per_s"] == pytest.approx(0.5e9)
    assert r["fraction_of_attainable"] == pytest.approx(0.5)
    assert r["classification"] == COMPUTE and r["roof"] == COMPUTE
    assert "100 FLOP/B >= ridge 10 FLOP/B" in r["why"] and "50.0%" in r["why"]


def test_memory_bound():
    # 10 MFLOP over 10 MB: I = 1 FLOP/B < 10; attainable = 10 GB/s x 1 = 10 GFLOP/s; in 2 ms -> 5 GFLOP/s = 50 %.
    r = roofline(10e6, 10e6, 0.002, **PEAKS)
    assert r["intensity_flops_per_byte"] == pytest.approx(1.0)
    assert r["attainable_flops_per_s"] == pytest.approx(10e9)
    assert r["achieved_flops_per_s"] == pytest.approx(5e9)
    assert r["fraction_of_attainable"] == pytest.approx(0.5)
    assert r["classification"] == MEMORY
    assert "1 FLOP/B < ridge 10 FLOP/B" in r["why"]


def test_overhead_bound_by_time():
    # A fast enough rate (80 %), but 8 us < 2 x 10 us of overhead.
    r = roofline(64e3, 64e3, 8e-6, **PEAKS)  # I = 1, attainable 10 GFLOP/s, achieved 8 GFLOP/s
    assert r["fraction_of_attainable"] == pytest.approx(0.8)
    assert r["classification"] == OVERHEAD and r["roof"] == MEMORY
    assert "overhead" in r["why"] and "8 us" in r["why"]


def test_overhead_bound_by_low_fraction():
    # Compute side (I = 100), but 1 GFLOP in 1 s = 1 GFLOP/s = 1 % of 100 GFLOP/s.
    r = roofline(1e9, 10e6, 1.0, **PEAKS)
    assert r["fraction_of_attainable"] == pytest.approx(0.01)
    assert r["classification"] == OVERHEAD and r["roof"] == COMPUTE
    assert "neither roof" in r["why"]


def test_boundaries():
    # Exactly at the ridge (I = 10): both roofs give 100 GFLOP/s; classified compute.
    r = roofline(100e6, 10e6, 0.002, **PEAKS)
    assert r["intensity_flops_per_byte"] == pytest.approx(r["ridge_flops_per_byte"])
    assert r["attainable_flops_per_s"] == pytest.approx(100e9)
    assert r["classification"] == COMPUTE
    # Just under the ridge: memory.
    assert roofline(99e6, 10e6, 0.002, **PEAKS)["classification"] == MEMORY
    # Exactly LOW_FRACTION of attainable is not "low": 1 GFLOP at 5 GFLOP/s = 0.2 s.
    r = roofline(1e9, 10e6, 1e9 / (LOW_FRACTION * 100e9), **PEAKS)
    assert r["fraction_of_attainable"] == pytest.approx(LOW_FRACTION)
    assert r["classification"] == COMPUTE
    # Exactly the time threshold is not overhead-bound; just below it is.
    overhead = 10e-6
    r = roofline(200e3, 200e3, OVERHEAD_DOMINATES_BELOW * overhead, **PEAKS, overhead_s=overhead)
    assert r["classification"] == MEMORY
    r = roofline(200e3, 200e3, 0.99 * OVERHEAD_DOMINATES_BELOW * overhead, **PEAKS, overhead_s=overhead)
    assert r["classification"] == OVERHEAD
    # overhead_s=0 switches the time rule off.
    assert roofline(1e3, 1e3, 1e-7, **PEAKS, overhead_s=0.0)["classification"] == MEMORY


def test_refuses_non_positive_inputs():
    with pytest.raises(ValueError, match="seconds"):
        roofline(1.0, 1.0, 0.0, **PEAKS)
    with pytest.raises(ValueError, match="nbytes"):
        roofline(1.0, 0, 1.0, **PEAKS)


def test_a_fraction_above_one_is_named_never_a_result():
    # above the FLOP peak: the calibration or the timing is wrong
    fast = roofline(2e9, 1e6, 1e-2, peak_flops=1e11, peak_bytes_per_s=1e10, cache_bytes=2**25)
    assert fast["fraction_of_attainable"] == pytest.approx(2.0)
    assert "2.00x the calibrated FLOP peak" in fast["above_roof"]
    # above the copy roof with a working set larger than the cache: the byte model or the calibration is wrong
    streaming = roofline(1e6, 1e9, 0.05, peak_flops=1e11, peak_bytes_per_s=1e10, cache_bytes=2**25)
    assert "2.00x the DRAM copy roof" in streaming["above_roof"] and not streaming["cache_resident"]
    # the same rate on a working set that fits the cache: no DRAM roof, a result
    cached = roofline(1e6, 1e6, 5e-5, peak_flops=1e11, peak_bytes_per_s=1e10, cache_bytes=2**25)
    assert cached["cache_resident"] and cached["above_roof"] is None and cached["fraction_of_attainable"] < 1
    unknown = roofline(1e6, 1e6, 5e-5, peak_flops=1e11, peak_bytes_per_s=1e10)  # cache unknown: the copy roof
    assert "last-level cache unknown" in unknown["above_roof"]
    honest = roofline(2e9, 1e6, 4e-2, peak_flops=1e11, peak_bytes_per_s=1e10, cache_bytes=2**25)
    assert honest["above_roof"] is None


def test_a_call_that_computed_wider_is_measured_against_the_wider_formats_roof():
    """SDPA on a CPU computes an fp16 point in fp32, faster than the CPU's fp16 GEMM: 5x the fp16 peak is not above
    the roofline when fp32's is 10x it; past fp32's too, it is named."""
    wide = roofline(5e9, 1e6, 1e-2, peak_flops=1e11, peak_bytes_per_s=1e12, cache_bytes=2**25, widest_flops=1e12)
    assert wide["above_roof"] is None and wide["fraction_of_attainable"] == pytest.approx(0.5)
    assert wide["ceiling_flops_per_s"] == 1e12 and wide["peak_flops_per_s"] == 1e11
    past = roofline(2e10, 1e6, 1e-2, peak_flops=1e11, peak_bytes_per_s=1e12, cache_bytes=2**25, widest_flops=1e12)
    assert "2.00x the calibrated FLOP peak" in past["above_roof"] and past["fraction_of_attainable"] > 1


def test_the_cache_is_compared_with_the_working_set_not_the_traffic():
    """A call that re-reads a small set moves more bytes than the cache holds, yet its set stays resident: no DRAM
    roof. Planted bug: comparing the traffic (nbytes) with the cache makes it memory-capped."""
    common = dict(peak_flops=100e9, peak_bytes_per_s=10e9, cache_bytes=1_000_000)
    rereads = roofline(1e8, 50e6, 0.05, working_set_bytes=500_000, **common)  # I = 2 FLOP/B over a 0.5 MB set
    assert rereads["cache_resident"] and rereads["working_set_bytes"] == 500_000
    assert rereads["attainable_flops_per_s"] == 100e9
    streaming = roofline(1e8, 50e6, 0.05, **common)
    assert not streaming["cache_resident"] and streaming["attainable_flops_per_s"] == pytest.approx(10e9 * 2)
