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


def test_time_vs_size_names_the_paths_it_does_not_draw():
    """Triton through its interpreter is never on the curve: the plot says so, and a path with no valid size is
    named with its rows' reason. Planted bug: dropping _name_omitted leaves the figure silent."""
    from posttrainllm.track.plots import time_vs_size_figure

    frame = pd.concat([curve(), pd.DataFrame([dict(op="attention", impl="mine", x_name="seq_len", x_value=64,
                                                   median=math.nan, p20=math.nan, p80=math.nan, unit="ms",
                                                   valid=False, noisy=False, device="cpu",
                                                   reason="impossible time")])])
    fig = time_vs_size_figure(frame, omitted={"triton": "Triton ran through its interpreter: not speed"})
    said = " ".join(text.get_text() for text in fig.texts)
    assert "not drawn: triton: Triton ran through its interpreter: not speed" in said
    assert "not drawn: mine: impossible time" in said and "sdpa" not in said  # sdpa has valid sizes: drawn


def test_the_roofline_draws_the_points_roof_and_no_marker_hides_another():
    """An fp32 point: one compute roof (fp32's), the memory roof; two paths at the same place are two rings of
    different sizes. Planted bugs: drawing every dtype's roof, or equal marker sizes, fail here."""
    from posttrainllm.track.plots import roofline_figure

    peaks = {"gemm_flops_per_s": {"float32": 100e9, "bfloat16": 450e9, "float16": 120e9}, "copy_bytes_per_s": 30e9}
    points = [{"label": "sdpa", "intensity_flops_per_byte": 11.4, "achieved_flops_per_s": 43e9},
              {"label": "sdpa_flash", "intensity_flops_per_byte": 11.4, "achieved_flops_per_s": 42e9},
              {"label": "reference", "intensity_flops_per_byte": 3.1, "achieved_flops_per_s": 33e9}]
    ax = roofline_figure(points, peaks, dtype="float32").axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert [label for label in labels if "GFLOP/s" in label and ":" in label and label.startswith("float")] == [
        "float32: 100 GFLOP/s"]
    sizes = {line.get_label().split(":")[0]: line.get_markersize() for line in ax.get_lines()
             if line.get_marker() not in (None, "None", "")}
    assert sizes["sdpa"] != sizes["sdpa_flash"] and sizes["reference"] == sizes["sdpa"]
    # a precision without a calibrated peak: every dtype's roof, as before
    every = roofline_figure(points, peaks, dtype="float8_e4m3fn").axes[0].get_legend_handles_labels()[1]
    assert sum(label.startswith(("float32", "bfloat16", "float16")) for label in every) == 3
