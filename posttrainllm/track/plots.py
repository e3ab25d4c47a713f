"""PNG plots of curves and rooflines (matplotlib's Agg canvas: no display, no pyplot state).

PNG, not HTML: `dvc plots show` renders its vega charts from a CDN, blank offline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

import matplotlib
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

DPI = 120


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", dpi=DPI, bbox_inches="tight")
    return path


LINESTYLES = {"forward": "-", "forward_backward": "--"}


def _facets(valid: pd.DataFrame, *, height: float = 4.4) -> tuple[Figure, list[tuple[Any, str, pd.DataFrame]]]:
    """One subplot per curve axis (x_name), side by side: [(ax, x_name, its rows)]."""
    names = list(dict.fromkeys(valid["x_name"])) if "x_name" in valid else ["x"]
    fig = Figure(figsize=(6.4 * len(names), height))
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    return fig, [(ax, name, valid[valid["x_name"] == name] if "x_name" in valid else valid)
                 for ax, name in zip(axes, names)]


def _lines(rows: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame]]:
    """(impl, mode, its rows sorted by x) per line: a curve.csv without `mode` timed the forward only."""
    rows = rows if "mode" in rows else rows.assign(mode="forward")
    return [(str(impl), str(mode), group.sort_values("x_value"))
            for (impl, mode), group in rows.groupby(["impl", "mode"], sort=False)]


def _log2_x(ax: Any, rows: pd.DataFrame, x_name: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    xs = sorted(rows["x_value"].unique())
    ax.set_xticks(xs, [str(int(x)) for x in xs])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(x_name)
    ax.grid(True, which="both", alpha=0.3)


REGIME_MARK = {"compute-bound": "compute", "memory-bound": "memory", "compute or memory": "c|m",
               "overhead-bound": "overhead", "leaves the cache": "leaves LLC", "beyond the model": "?"}


def omitted_paths(df: pd.DataFrame, omitted: Mapping[str, str] | None = None) -> dict[str, str]:
    """{path: why} for the paths a curve plot does not draw: those not timed on the curve at all (`omitted`: the
    curve's `skipped`, e.g. Triton through its interpreter) and those with no valid size (their rows' reason)."""
    out = dict(omitted or {})
    if "valid" in df:
        for impl, rows in df.groupby("impl", sort=False):
            if not rows["valid"].astype(bool).any() and str(impl) not in out:
                reasons = rows["reason"].dropna().astype(str) if "reason" in rows else pd.Series([], dtype=str)
                out[str(impl)] = reasons.iloc[0] if len(reasons) else "no valid size"
    return out


def _name_omitted(fig: Figure, omitted: Mapping[str, str]) -> None:
    """Under the panels, one line per path not drawn, and why."""
    import textwrap

    if omitted:
        text = "\n".join(textwrap.fill(f"not drawn: {name}: {why}", 110) for name, why in omitted.items())
        fig.text(0.01, -0.02, text, fontsize=7, va="top", ha="left")


def time_vs_size(df: pd.DataFrame, path: str | Path, *, title: str | None = None,
                 regimes: list[dict[str, Any]] | None = None, omitted: Mapping[str, str] | None = None) -> Path:
    """time_vs_size_figure, saved as PNG at `path`."""
    return _save(time_vs_size_figure(df, title=title, regimes=regimes, omitted=omitted), path)


def time_vs_size_figure(df: pd.DataFrame, *, title: str | None = None, regimes: list[dict[str, Any]] | None = None,
                        omitted: Mapping[str, str] | None = None) -> Figure:
    """Median time against x on log-log axes, one line per impl and mode (forward solid, forward + backward
    dashed, one colour per impl), the p20-p80 band shaded; one panel per curve axis (x_name).

    Only valid rows are drawn; noisy points (rule "noisy") are hollow markers. With `regimes`
    (measure/curves.py regimes), each forward segment is labelled with its measured regime (REGIME_MARK) and a
    dotted vertical line marks where a path's working set passes the last-level cache. Every path not drawn is
    named under the panels with why (omitted_paths: `omitted`, the curve's skipped paths, and those with no
    valid size).
    """
    valid = df[df["valid"].astype(bool)] if "valid" in df else df
    if valid.empty:
        raise ValueError("time_vs_size: no valid rows to plot")
    fig, facets = _facets(valid)
    _name_omitted(fig, omitted_paths(df, omitted))
    unit = valid["unit"].iloc[0] if "unit" in valid else "ms"
    op = valid["op"].iloc[0] if "op" in valid else ""
    device = valid["device"].iloc[0] if "device" in valid else ""
    for ax, x_name, rows in facets:
        colours: dict[str, str] = {}
        for impl, mode, line_rows in _lines(rows):
            x, median = line_rows["x_value"].to_numpy(), line_rows["median"].to_numpy()
            (line,) = ax.plot(x, median, marker="o", linestyle=LINESTYLES.get(mode, ":"), color=colours.get(impl),
                              label=impl if mode == "forward" else f"{impl} ({mode})")
            colours.setdefault(impl, line.get_color())
            ax.fill_between(x, line_rows["p20"].to_numpy(), line_rows["p80"].to_numpy(), color=line.get_color(),
                            alpha=0.2, linewidth=0)
            if "noisy" in line_rows:
                noisy = line_rows["noisy"].astype(bool).to_numpy()
                ax.plot(x[noisy], median[noisy], linestyle="none", marker="o", markersize=9,
                        markerfacecolor="white", color=line.get_color())
        for entry in regimes or []:
            if entry["x_name"] != x_name or entry["mode"] != "forward":
                continue
            colour = colours.get(entry["impl"])
            line_rows = rows[(rows["impl"] == entry["impl"]) & (rows["mode"] == "forward")].set_index("x_value")
            for seg in entry["segments"]:
                if seg["measured"] and seg["x_from"] in line_rows.index and seg["x_to"] in line_rows.index:
                    mid_x = (seg["x_from"] * seg["x_to"]) ** 0.5
                    mid_y = (float(line_rows.loc[seg["x_from"], "median"]) * float(line_rows.loc[seg["x_to"],
                                                                                                "median"])) ** 0.5
                    ax.annotate(REGIME_MARK.get(seg["measured"], seg["measured"]), (mid_x, mid_y), fontsize=6,
                                color=colour, textcoords="offset points", xytext=(0, 4), ha="center")
            if entry.get("cache_crossing_x"):
                ax.axvline(entry["cache_crossing_x"], color=colour, linestyle=":", linewidth=1,
                           label=f"{entry['impl']}: working set = LLC ({entry['cache_bytes'] / 2**20:.3g} MiB)")
        _log2_x(ax, rows, x_name)
        ax.set_ylabel(f"median time [{unit}] (band: p20-p80; hollow: noisy)")
        ax.set_title(title or f"{op} on {device}".strip())
        ax.legend(fontsize=8)
    return fig


def _compute_roofs(peaks: Mapping[str, Any]) -> dict[str, float]:
    flops = peaks.get("gemm_flops_per_s", peaks.get("peak_flops"))
    if isinstance(flops, Mapping):
        return {str(k): float(v) for k, v in flops.items()}
    return {"peak": float(flops)}


STACKED = 0.06  # decades apart on both axes under which two markers (7 pt on a ~2-decade axis) overlap


def roofline_plot(points: Iterable[Mapping[str, Any]], peaks: Mapping[str, Any], path: str | Path, *,
                  title: str | None = None, dtype: str | None = None) -> Path:
    """roofline_figure, saved as PNG at `path`."""
    return _save(roofline_figure(points, peaks, title=title, dtype=dtype), path)


def roofline_figure(points: Iterable[Mapping[str, Any]], peaks: Mapping[str, Any], *, title: str | None = None,
                    dtype: str | None = None) -> Figure:
    """The roofline on log-log axes with the measured points labelled.

    points: dicts with "label", "intensity_flops_per_byte" and "achieved_flops_per_s"
        (roofline.roofline's output plus a label).
    peaks: calibrate's {"gemm_flops_per_s": {dtype: FLOP/s} or FLOP/s, "copy_bytes_per_s": B/s};
        one compute roof per dtype, one memory roof.
    dtype: the point's precision; only its roof is drawn where it was calibrated (else every dtype's, and the
        title says the point's own is missing).
    Roof: attainable(I) = min(peak_flops, peak_bytes_per_s · I).
    Markers closer than STACKED decades on both axes are drawn as concentric rings, each a size larger, so no
    path hides another.
    """
    import math

    points = list(points)
    bandwidth = float(peaks.get("copy_bytes_per_s", peaks.get("peak_bytes_per_s")))
    roofs = _compute_roofs(peaks)
    if dtype is not None and dtype in roofs:
        roofs = {dtype: roofs[dtype]}
    intensities = [float(p["intensity_flops_per_byte"]) for p in points]
    ridges = [flops / bandwidth for flops in roofs.values()]
    lo = min(intensities + ridges) / 8
    hi = max(intensities + ridges) * 8
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig = Figure(figsize=(6.4, 4.8))
    ax = fig.add_subplot()
    for name, flops in sorted(roofs.items(), key=lambda kv: kv[1]):
        ax.plot(grid, [min(flops, bandwidth * i) for i in grid], label=f"{name}: {flops / 1e9:.3g} GFLOP/s")
    ax.plot(grid, [bandwidth * i for i in grid], linestyle=":", color="grey",
            label=f"memory: {bandwidth / 1e9:.3g} GB/s")
    markers = "osD^vP*Xh<>p"
    # one marker per path, named in a legend beside the axes: paths of one op share an intensity, so labels
    # written at the points would lie on top of each other
    drawn: list[tuple[float, float]] = []
    for i, point in enumerate(sorted(points, key=lambda p: -float(p["achieved_flops_per_s"]))):
        x, y = float(point["intensity_flops_per_byte"]), float(point["achieved_flops_per_s"])
        under = sum(abs(math.log10(x / x0)) < STACKED and abs(math.log10(y / y0)) < STACKED for x0, y0 in drawn)
        drawn.append((x, y))
        ax.plot([x], [y], marker=markers[i % len(markers)], linestyle="none", markersize=7 + 5 * under, alpha=0.8,
                markerfacecolor="none" if i >= len(markers) or under else None,
                label=f"{point.get('label', '')}: {y / 1e9:.3g} GFLOP/s"
                      + (" (above its roof: not a result)" if (point.get("fraction_of_attainable") or 0) > 1 else ""))
    ax.set_xscale("log")
    ax.set_yscale("log")
    top = max(list(roofs.values()) + [float(p["achieved_flops_per_s"]) for p in points])
    bottom = min([bandwidth * lo] + [float(p["achieved_flops_per_s"]) for p in points])
    ax.set_ylim(bottom / 2, top * 2)
    ax.set_xlabel("arithmetic intensity [FLOP/B]")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title or "roofline")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    return fig


def memory_vs_size(df: pd.DataFrame, path: str | Path, *, title: str | None = None) -> Path:
    """Peak memory of one call against x on log-log axes, one line per impl and mode, next to the byte model;
    one panel per curve axis (x_name).

    A path that materialises the (S, S) scores grows ~4x per doubling of S; a fused one ~2x,
    like the minimal bytes (inputs + outputs) drawn dashed grey. The two measure different things: a call's
    peak counts what it allocates (its inputs exist before it), the line what it must read and write, so a
    fused path's peak may lie below the line.
    """
    valid = df[df["valid"].astype(bool) & df["peak_bytes"].notna()]
    if valid.empty:
        raise ValueError("memory_vs_size: no rows with a peak memory to plot")
    fig, facets = _facets(valid)
    for ax, x_name, rows in facets:
        colours: dict[str, str] = {}
        for impl, mode, line_rows in _lines(rows):
            (line,) = ax.plot(line_rows["x_value"].to_numpy(), line_rows["peak_bytes"].astype(float).to_numpy(),
                              marker="o", linestyle=LINESTYLES.get(mode, ":"), color=colours.get(impl),
                              label=impl if mode == "forward" else f"{impl} ({mode})")
            colours.setdefault(impl, line.get_color())
        model = rows.drop_duplicates("x_value").sort_values("x_value")
        ax.plot(model["x_value"].to_numpy(), model["minimal_bytes"].astype(float).to_numpy(), linestyle="--",
                color="grey", label="inputs + outputs: what a call reads and writes\n(not allocated by it: "
                                    "the peaks count only what it allocates)")
        _log2_x(ax, rows, x_name)
        ax.set_ylabel("peak memory of one call [B]")
        ax.set_title(title or f"{rows['op'].iloc[0]} memory on {rows['device'].iloc[0]}")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, -0.14), ncol=2)  # below: never over a line
    return _save(fig, path)


def loss_curves_svg(train: Mapping[str, Any], prefix: str = "") -> str:
    """bench-train's training loss per step, one line per variant (bench_train.json `impls`), as an inline
    <svg> for report.html: no file, no script, no address of elsewhere (MLflow keeps the same curves as the
    stepped metric train.<variant>.loss). A variant through Triton's interpreter trains fewer steps."""
    import io
    import re

    from matplotlib.backends.backend_svg import FigureCanvasSVG

    fig = Figure(figsize=(6.4, 3.4))
    ax = fig.subplots()
    for name, entry in train["impls"].items():
        losses = entry["losses"]
        ax.plot(range(len(losses)), losses, marker="o" if len(losses) <= 24 else None, markersize=3,
                label=f"{name} ({len(losses)} steps)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    FigureCanvasSVG(fig)
    out = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text as text: a few kB, not glyph outlines
        fig.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None})
    svg = out.getvalue()
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg[svg.index("<svg"):], flags=re.S)  # no RDF namespaces
    svg = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", svg)  # inline SVG in HTML needs no namespace declarations
    return re.sub(r'(id="|href="#|url\(#)', rf"\g<1>{prefix}", svg)  # ids unique among a page's figures
