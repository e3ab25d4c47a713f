"""plots: the files are written, are PNG, and are not empty canvases."""

import math

import pandas as pd
import pytest

from posttrainllm.track.plots import roofline_plot, time_vs_size
from posttrainllm.measure.roofline import roofline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 10_000  # axes, lines, labels: far more than a blank image


def curve() -> pd.DataFrame:
    rows = []
    for impl, scale in (("reference", 1.0), ("sdpa", 0.25)):
        for i, x in enumerate((64, 128, 256, 512)):
            median = scale * (x / 64) ** 2 * 0.1
            rows.append(dict(op="attention", impl=impl, x_name="seq_len", x_value=x, median=median,
                             p20=median * 0.9, p80=median * 1.2, unit="ms", valid=True, noisy=i == 2, device="cpu"))
    rows.append(dict(op="attention", impl="sdpa", x_name="seq_len", x_value=1024, median=math.nan, p20=math.nan,
                     p80=math.nan, unit="ms", valid=False, noisy=True, device="cpu"))
    return pd.DataFrame(rows)


def test_time_vs_size(tmp_path):
    path = time_vs_size(curve(), tmp_path / "plots" / "time.png")
    assert path == tmp_path / "plots" / "time.png"
    _check_png(path)


def test_time_vs_size_without_valid_rows(tmp_path):
    with pytest.raises(ValueError, match="no valid rows"):
        time_vs_size(curve().assign(valid=False), tmp_path / "t.png")


def test_roofline_plot(tmp_path):
    peaks = {"gemm_flops_per_s": {"float32": 100e9, "bfloat16": 450e9}, "copy_bytes_per_s": 30e9}
    points = [{"label": "sdpa S=512", **roofline(67e6, 1e6, 2e-3, peak_flops=100e9, peak_bytes_per_s=30e9)},
              {"label": "matmul 1024", **roofline(2.1e9, 12.6e6, 0.02, peak_flops=100e9, peak_bytes_per_s=30e9)}]
    path = roofline_plot(points, peaks, tmp_path / "roofline.png")
    _check_png(path)
    # A single scalar compute peak works too.
    _check_png(roofline_plot(points, {"gemm_flops_per_s": 100e9, "copy_bytes_per_s": 30e9}, tmp_path / "r2.png"))
