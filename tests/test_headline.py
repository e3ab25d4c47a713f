"""The README's headline and docs/measured.md's latest sweep are what `posttrainllm report --write-docs` renders
from receipts (track/headline.py): never by hand, never stale."""

import copy
import json
from pathlib import Path

import pytest

from posttrainllm.config import PROJECT_ROOT
from posttrainllm.track import headline
from test_report import _plan, _receipt


def test_the_readme_and_measured_md_are_what_the_command_renders_from_its_figures():
    """docs/headline.json is written by the command beside the two blocks; an edit by hand to either block (or a
    figure changed in one place only) fails here. Planted bug: a digit changed in the README's table fails it."""
    figs = json.loads((PROJECT_ROOT / headline.FIGURES).read_text())
    readme = (PROJECT_ROOT / headline.README).read_text()
    measured = (PROJECT_ROOT / headline.MEASURED).read_text()
    assert headline.current_block(readme) == headline.readme_block(figs)
    assert headline.current_block(measured) == headline.measured_block(figs)
    assert figs["command"].startswith(headline.COMMAND) and figs["revisions"] and figs["date"]


def _sweep():
    """A baseline (attention, with per-path bytes, the compiled peer and a trained step), a decode point and a
    matmul point, as the receipts hold them."""
    stamps = {"reference": {"created_at": "2026-01-01T00:00:10+00:00", "timing": {"process_s": 4.0}},
              "kernel": {"created_at": "2026-01-01T00:02:20+00:00", "timing": {"process_s": 9.0}}}
    base = _receipt("baseline", stamps=stamps)
    base.update(created_at="2026-01-01T00:03:00+00:00",
                provenance={"revision": "abcdef0123", "dirty": False,
                            "machine": {"device_name": "Test CPU", "threads": 2}},
                config={"op": {"name": "attention"}, "precision": {"name": "fp32"}})
    micro = base["microbench"]
    micro.update(problem="B1 H4 S128 D32", bytes=262144)
    micro["paths"]["reference"]["costs"] = {"bytes": 2684354}
    micro["paths"]["sdpa"]["costs"] = {"bytes": 460800}
    micro["paths"]["compiled"] = {"valid": True, "median_ms": 1.8, "speedup_vs_reference": 1.11,
                                  "evidence": {"signatures": {"q(1, 4, 128, 32) grad mode off": {"first_call_s": 3.1},
                                                              "q(1, 4, 64, 32)": {"first_call_s": 9.0}}},
                                  "forward_backward": {"median_ms": 4.0, "speedup_vs_reference": 0.7}}
    base["kernel"]["paths"]["compiled"] = {"kind": "peer"}
    base["bench_train"]["amdahl"] = {"fraction": 0.11, "variants": {"sdpa": {
        "valid": True, "predicted_speedup": 1.02, "measured_speedup": 1.04,
        "sentence": "attention is 11% of the measured training step; they agree"}}}
    decode = copy.deepcopy(_receipt("op-decode_attention"))
    decode.update(sweep={"changes": {"op": "decode_attention"}}, config={"op": {"name": "decode_attention"}})
    decode["microbench"]["problem"] = "B1 Hq4 C1024"
    decode["microbench"]["paths"]["sdpa"]["speedup_vs_reference"] = 2.58
    matmul = copy.deepcopy(_receipt("op-matmul"))
    matmul.update(sweep={"changes": {"op": "matmul"}}, config={"op": {"name": "matmul"}})
    matmul["kernel"]["paths"] = {"torch": {"kind": "peer"}}
    matmul["microbench"]["problem"] = "M128 N128 K128"
    matmul["microbench"]["paths"] = {"reference": {"valid": True, "median_ms": 1.0},
                                     "torch": {"valid": True, "median_ms": 0.98, "speedup_vs_reference": 1.02}}
    for receipt in (decode, matmul):
        receipt.update(provenance=base["provenance"], created_at="2026-01-01T00:02:00+00:00")
    return {"baseline": base, "op-decode_attention": decode, "op-matmul": matmul}


def test_the_headline_figures_come_from_the_receipts():
    """Every figure of the table is the receipt's: SDPA's speedups and bytes, the peers, the step sentence, decode's
    and matmul's peers, and one duration, the stamps' span. Planted bug: the decode row reading the baseline's
    sdpa (1.50x... 2.00x) fails here."""
    figs = headline.figures(_sweep())
    assert figs["sweep_s"] == 134.0 and figs["revisions"] == ["abcdef0"] and figs["date"] == "2026-01-01T00:03:00+00:00"
    rows = "\n".join(headline.table_rows(figs))
    assert "| the sweep, from the first point stage's start to the last's end | 2 min 14 s |" in rows
    assert ("| SDPA vs the readable attention (baseline, B1 H4 S128 D32 fp32) | 2.00x forward, 1.50x forward + "
            "backward; the readable math moves 2.56 MiB forward") in rows
    assert "SDPA's fused kernel 450 KiB, the floor 256 KiB |" in rows
    assert ("torch.compile 1.80 ms forward (its first call, the compile, 3.1 s; 0.70x the reference forward + backward), reference "
            "2.00 ms") in rows
    assert "| attention in a training step; Amdahl | sdpa: attention is 11% of the measured training step" in rows
    assert "| op=decode_attention (op-decode_attention, B1 Hq4 C1024) | sdpa 2.58x the reference forward |" in rows
    assert "| op=matmul (op-matmul, M128 N128 K128) | torch 1.02x the reference forward |" in rows
    assert figs["failed"] == [] and "all 3 points passed. No figure is flagged." in headline.source_line(figs)
    assert "(baseline, op-decode_attention, op-matmul) of revision abcdef0" in headline.source_line(figs)


def test_write_docs_rewrites_only_the_blocks(tmp_path, monkeypatch, capsys):
    """`posttrainllm report --write-docs` in a clone's root: the README's and measured.md's blocks become what the
    figures render, the text around them stays, docs/headline.json holds the figures; a README without the block
    is a one-line error."""
    from posttrainllm import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'none' / 'mlflow.db'}")
    receipts = _sweep()
    _plan(tmp_path, receipts)
    (tmp_path / "docs").mkdir()
    stale = f"{headline.BEGIN}\nby hand: 9.99x\n{headline.END}"
    (tmp_path / "README.md").write_text(f"# lab\n\nbefore\n{stale}\nafter\n")
    (tmp_path / "docs" / "measured.md").write_text(f"# Measured\n{stale}\n## Earlier runs\n")
    assert cli.main(["report", "--write-docs"]) == 0
    assert "written: " in capsys.readouterr().out
    figs = json.loads((tmp_path / "docs" / "headline.json").read_text())
    assert figs == json.loads(json.dumps(headline.figures(receipts, headline.COMMAND)))
    readme = (tmp_path / "README.md").read_text()
    assert readme == f"# lab\n\nbefore\n{headline.readme_block(figs)}\nafter\n" and "9.99x" not in readme
    measured = (tmp_path / "docs" / "measured.md").read_text()
    assert measured.endswith("## Earlier runs\n") and headline.current_block(measured) == headline.measured_block(figs)
    assert "| point | verdict |" in measured and "- step: baseline: sdpa: attention is 11%" in measured
    (tmp_path / "README.md").write_text("# lab\nno block\n")
    assert cli.main(["report", "--write-docs"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "README.md has no single headline block" in err


@pytest.mark.parametrize("text", ["no block", f"{headline.END}\n{headline.BEGIN}",
                                  f"{headline.BEGIN}{headline.END}{headline.BEGIN}{headline.END}"])
def test_a_file_without_one_block_is_refused(text):
    with pytest.raises(ValueError, match="no single headline block"):
        headline.replace_block(text, "x", Path("README.md"))
