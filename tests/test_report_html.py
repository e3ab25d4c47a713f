"""`posttrainllm report` on a real sweep folder: a terminal-wide table, every column on request, and
runs/report.html, a static page whose every image and link resolves from disk (checked by parsing it,
and where Chromium is installed, by loading it in a headless browser)."""

import contextlib
import io
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from urllib.parse import unquote, urlsplit

import pytest

from posttrainllm import cli
from posttrainllm.track import report, report_page
from test_report import _receipt
from test_sweep_folder import POINTS, runs  # noqa: F401  (the fixture: a real sweep's runs/, built once here)


@pytest.fixture(scope="module")
def reported(runs, tmp_path_factory):  # noqa: F811
    """`posttrainllm report` and `--wide` in the sweep's folder, with no MLflow store: (stdout, wide stdout, runs)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(runs.parent)
        patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path_factory.mktemp('nostore') / 'mlflow.db'}")
        printed = []
        for args in (["report"], ["report", "--wide"]):
            with contextlib.redirect_stdout(io.StringIO()) as out:
                assert cli.main(args) == 0
            printed.append(out.getvalue())
    return printed[0], printed[1], runs


class Page(HTMLParser):
    """The page's images, links, element ids and tags."""

    def __init__(self):
        super().__init__()
        self.images, self.links, self.ids, self.tags = [], [], set(), []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if tag == "img":
            self.images.append(attrs["src"])
        if tag == "a":
            self.links.append(attrs["href"])
        if "id" in attrs:
            self.ids.add(attrs["id"])


def test_the_default_report_fits_160_columns_and_wide_has_every_column(reported):
    out, wide, runs = reported
    widths = [len(line) for line in out.splitlines()]
    assert max(widths) <= report.TERMINAL_WIDTH, out
    rows = [line for line in out.splitlines() if line.startswith(tuple(f"{p} " for p in POINTS))]  # not "p: flag"
    assert [row.split()[0] for row in rows] == ["baseline", "precision-fp16"], out
    assert all(" triton:pass " in row for row in rows) and "written: runs/report.md" in out
    receipts = {p: json.loads((runs / p / "receipt.json").read_text()) for p in POINTS}
    flags = report.summary_frame(receipts).set_index("point")["flags"]
    for point in POINTS:  # every figure in a point's flags column is said below the table, with its reason
        said = {line.split(": ")[1] for line in out.splitlines() if line.startswith(f"{point}: ")}
        assert said == set(flags[point].split(",")) - {"-"}, out
    columns = list(report.sweep_frame(receipts).columns)
    assert wide.splitlines()[0].split() == columns and max(len(line) for line in wide.splitlines()) > 300
    assert (runs / "report.md").read_text().startswith("| " + " | ".join(columns) + " |")  # every column


def test_the_page_names_only_files_that_exist_and_pngs_that_read(reported):
    import matplotlib.image

    _, _, runs = reported
    text = (runs / "report.html").read_text()
    page = Page()
    page.feed(text)
    # nothing from elsewhere (url(#id): an inline figure's own clip path)
    assert not re.search(r"https?://|//cdn|<script|<link|@import|url\((?!#)", text)
    assert "script" not in page.tags and "iframe" not in page.tags
    expected = {f"{p}/{plot}" for p in POINTS for plot in report_page.PLOTS}
    assert set(page.images) == expected and all((runs / p / plot).is_file() for p in POINTS for plot in report_page.PLOTS)
    for src in page.images:
        image = matplotlib.image.imread(runs / unquote(src))  # a PNG that a reader can decode
        assert image.ndim == 3 and min(image.shape[:2]) > 50
    for href in page.links:
        parts = urlsplit(href)
        assert not parts.scheme and not parts.netloc, href
        if parts.path:
            assert (runs / unquote(parts.path)).is_file(), href
        else:
            assert parts.fragment in page.ids, href
    assert {f"{p}/receipt.json" for p in POINTS} <= set(page.links) and "report.md" in page.links
    for point in POINTS:  # parity verdicts per path, in the point's section
        section = text[text.index(f'id="point-{point}"'):]
        assert all(f"<td>{path}</td><td>pass</td>" in section for path in ("sdpa", "triton"))
        # its per-path table (the console's columns) and bench-train's table with the loss curves drawn inline
        assert all(f"<th>{column}</th>" in section for column in ("decided_by", "fwd+bwd_band", "roofline"))
        assert "<h3>Bench-train</h3>" in section and "<th>predicted</th>" in section and "<svg " in section


def test_failing_points_come_first_and_a_missing_plot_is_not_named(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (tmp_path / "good").mkdir()
    fig = plt.figure(figsize=(1, 1))
    fig.savefig(tmp_path / "good" / "roofline.png")
    plt.close(fig)
    receipts = {"good": _receipt("good"), "broken": _receipt("broken", "fail")}
    text = report_page.sweep_page(receipts, tmp_path, sweep="smoke")
    page = Page()
    page.feed(text)
    assert page.images == ["good/roofline.png"]
    assert text.index('id="point-broken"') < text.index('id="point-good"')
    assert '<tr class="fail"><td><a href="#point-broken">broken</a></td><td>FAIL</td>' in text
    assert "first failure: <code>triton: S128/out: bad</code>" in text
    assert "<title>posttrainllm sweep smoke: 2 points, 1 failed</title>" in text
    receipts["good"]["parity"]["first_failure"] = "<script>x</script>"  # text is escaped, never markup
    assert "<script>" not in report_page.sweep_page(receipts, tmp_path)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# counts, once the page has loaded, the images that decoded: in a copy of the page beside it (the same folder)
PROBE = ('<script>window.addEventListener("load", () => { const all = Array.from(document.images); document.title = '
         '"images " + all.filter(i => i.complete && i.naturalWidth > 0).length + " of " + all.length; });</script>')


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (apt-get install -y chromium): the page is checked "
                    "by parsing it only")
def test_the_page_renders_every_image_in_a_headless_browser(reported, tmp_path):
    _, _, runs = reported
    probe = runs / "probe.html"
    probe.write_text((runs / "report.html").read_text().replace("</body>", PROBE + "</body>"))
    try:
        done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                               "--no-first-run", "--disable-background-networking", "--disable-component-update",
                               "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
                               probe.as_uri()], capture_output=True, text=True, timeout=60)
    finally:
        probe.unlink()
    assert f"<title>images {3 * len(POINTS)} of {3 * len(POINTS)}</title>" in done.stdout, done.stderr[-2000:]
    assert all(f'id="point-{point}"' in done.stdout for point in POINTS)


# the page's width and how many tables outside the "every column" details are wider than the window
WIDTH_PROBE = ('<script>window.addEventListener("load", () => { const over = Array.from(document.querySelectorAll('
               '"table")).filter(t => !t.closest("details") && t.getBoundingClientRect().right > window.innerWidth);'
               ' document.title = "width " + document.documentElement.scrollWidth + " over " + over.length; });'
               '</script>')


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (apt-get install -y chromium)")
def test_the_page_fits_1280_pixels(reported, tmp_path):
    """report.html in a 1280 px window: the page never scrolls sideways and every table but the every-column one
    (which scrolls in its own box) fits. Planted bug: cells that never wrap (the old nowrap) make the paths table
    overflow."""
    _, _, runs = reported
    probe = runs / "probe-width.html"
    probe.write_text((runs / "report.html").read_text().replace("</body>", WIDTH_PROBE + "</body>"))
    try:
        done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                               f"--window-size={report_page.PAGE_WIDTH},900", "--disable-background-networking",
                               f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", probe.as_uri()],
                              capture_output=True, text=True, timeout=60)
    finally:
        probe.unlink()
    found = re.search(r"<title>width (\d+) over (\d+)</title>", done.stdout)
    assert found, done.stderr[-2000:]
    assert int(found.group(1)) <= report_page.PAGE_WIDTH and found.group(2) == "0", found.group(0)
