"""The sweep report: failing points first, the peer found by kind, the time split from the stamps."""

import pandas as pd
import pytest

from posttrainllm.track import derived, report


def _receipt(point, verdict="pass", drift="pass", stamps=None):
    return {
        "point": point, "sweep": {"changes": {}}, "config": {"op": {"name": "attention"}},
        "kernel": {"paths": {"sdpa": {"kind": "peer"}, "triton": {"kind": "triton"}}},
        "parity": {"verdict": verdict, "first_failure": None if verdict == "pass" else "triton: S128/out: bad",
                   "paths": {"sdpa": {"verdict": "pass", "worst": {}}, "triton": {"verdict": verdict, "worst": {}}}},
        "microbench": {"paths": {"reference": {"valid": True, "median_ms": 2.0},
                                 "sdpa": {"valid": True, "median_ms": 1.0, "speedup_vs_reference": 2.0,
                                          "vs_reference": "faster",
                                          "forward_backward": {"median_ms": 3.0, "speedup_vs_reference": 1.5}}},
                       "curve": {"crossover_vs_reference": {"sdpa": 64}}},
        "bench_train": {"impls": {}, "drift": {"sdpa": 0.0}, "drift_verdict": {"sdpa": drift}},
        "stamps": stamps or {},
    }


def test_failing_points_come_first_with_their_first_failure():
    frame = report.sweep_frame({"baseline": _receipt("baseline"), "precision-fp16": _receipt("precision-fp16", "fail"),
                                "tile-b16": _receipt("tile-b16", drift="fail")})
    assert list(frame["point"]) == ["precision-fp16", "tile-b16", "baseline"]
    assert list(frame["verdict"]) == ["FAIL", "FAIL", "pass"]
    assert frame.loc[0, "first_failure"] == "triton: S128/out: bad"
    assert frame.loc[2, "peer"] == "sdpa" and frame.loc[2, "peer_fb_speedup"] == 1.5


def test_time_split_comes_from_the_stamps():
    stamps = {"reference": {"created_at": "2026-01-01T00:00:10+00:00", "timing": {"stage_s": 1.0, "process_s": 4.0}},
              "kernel": {"created_at": "2026-01-01T00:00:20+00:00", "timing": {"stage_s": 6.0, "process_s": 9.0}}}
    times = report.stage_times({"a": _receipt("a", stamps=stamps), "b": _receipt("b")})
    assert times["per_stage_s"] == {"reference": 4.0, "kernel": 9.0}
    assert times["wall_s"] == 14.0  # from 00:00:06 (10 s - 4 s) to 00:00:20
    assert "reference 4 s" in report.stage_times_text({"a": _receipt("a", stamps=stamps)})


def _worst_case(name, **overrides):
    """A failing point whose names, failure and numbers are as wide as they come."""
    receipt = _receipt(name, "fail", **overrides)
    receipt["parity"]["first_failure"] = "triton: S4231-large_logits/grad_q: max_abs_err 3.1e-02 > allowed 1.0e-03 " * 3
    receipt["parity"]["paths"].update({"sdpa_efficient": {"verdict": "fail", "worst": {}},
                                       "sdpa_math": {"verdict": "fail", "worst": {}}})
    receipt["kernel"]["paths"]["sdpa_efficient"] = {"kind": "peer"}
    receipt["microbench"]["paths"]["sdpa_efficient"] = {"valid": True, "median_ms": 0.001, "speedup_vs_reference": 2000.0,
                                                        "forward_backward": {"median_ms": 1e-3,
                                                                             "speedup_vs_reference": 12345.678}}
    receipt["bench_train"]["amdahl"] = {"variants": {"sdpa_efficient": {"valid": True, "predicted_speedup": 1234.5,
                                                                        "measured_speedup": 0.5}}}
    return receipt


def test_the_default_table_fits_a_terminal_whatever_the_names():
    receipts = {"baseline": _receipt("baseline"), "x" * 80: _worst_case("x" * 80)}
    table = report.summary_table(receipts)
    assert max(len(line) for line in table.splitlines()) <= report.TERMINAL_WIDTH, table
    header, failing, passing = table.splitlines()[:3]
    assert header.split() == ["point", "verdict", "first_failure", "parity", "best_peer", "peer_x", "peer_fb_x",
                              "ours_x", "ours_fb_x", "user", "e2e_path", "share", "e2e_pred", "e2e_meas", "flags"]
    assert failing.startswith("x" * 17 + "... FAIL") and "triton: S4231" in failing
    assert " triton:fail,sdpa_... " in failing  # ours first, then the other paths that failed, clipped
    # the numbers are never clipped: the text gives way
    assert "2000.00" in failing and "12345.68" in failing and "1234.50" in failing
    assert passing.split()[:5] == ["baseline", "pass", "-", "triton:pass", "sdpa"]


def test_the_summary_names_the_best_peer_and_our_path():
    receipt = _receipt("baseline")
    micro = receipt["microbench"]["paths"]
    micro["sdpa_flash"] = {"valid": True, "median_ms": 0.5, "speedup_vs_reference": 4.0,
                           "forward_backward": {"median_ms": 1.0, "speedup_vs_reference": 3.0}}
    micro["sdpa"]["forward_backward"]["median_ms"] = 2.0
    micro["triton"] = {"valid": True, "median_ms": 0.25, "forward_backward": {"median_ms": 2.0}}
    receipt["kernel"]["paths"]["sdpa_flash"] = {"kind": "peer"}
    receipt["bench_train"]["amdahl"] = {"variants": {"sdpa": {"valid": True, "predicted_speedup": 1.1,
                                                              "measured_speedup": 1.2},
                                                     "triton": {"valid": True, "predicted_speedup": 1.3,
                                                                "measured_speedup": 1.25}}}
    row = report.summary_frame({"baseline": receipt}).iloc[0]
    assert row["best_peer"] == "sdpa_flash" and (row["peer_x"], row["peer_fb_x"]) == (4.0, 3.0)
    assert (row["ours_x"], row["ours_fb_x"]) == (2.0, 0.5)  # 0.5 / 0.25 forward; 1.0 / 2.0 forward+backward
    assert (row["e2e_path"], row["e2e_pred"], row["e2e_meas"]) == ("triton", 1.3, 1.25)  # ours where it is valid
    receipt["bench_train"]["amdahl"]["variants"]["triton"] = {"valid": False}
    # one row, one path: sdpa was trained but the row names sdpa_flash, so sdpa's step figures stay out of it.
    # Planted bug: falling back to any trained variant puts sdpa's 1.1x/1.2x in sdpa_flash's row.
    receipt["bench_train"]["amdahl"]["variants"]["sdpa"]["sentence"] = "attention is 10% of the step ..."
    row = report.summary_frame({"baseline": receipt}).iloc[0]
    assert row["e2e_path"] == "-" and pd.isna(row["e2e_pred"]) and pd.isna(row["e2e_meas"])
    said = derived.point_fields(receipt)["e2e_sentence"]
    assert said == ("the best peer sdpa_flash was not trained by bench-train, so this row has no step figure; "
                    "sdpa, trained instead: attention is 10% of the step ...")
    receipt["bench_train"]["amdahl"]["variants"]["sdpa_flash"] = {"valid": True, "predicted_speedup": 1.05,
                                                                  "measured_speedup": 1.07}
    row = report.summary_frame({"baseline": receipt}).iloc[0]
    assert (row["e2e_path"], row["e2e_pred"], row["e2e_meas"]) == ("sdpa_flash", 1.05, 1.07)  # else the peer's


def _plan(root, receipts):
    import json

    import yaml

    points = {name: {"changes": {}, "overrides": [], "config": {"op": {"name": "attention"}}} for name in receipts}
    (root / "params.yaml").write_text(yaml.safe_dump({"sweep": {"name": "smoke", "grid": False}, "points": points}))
    for name, receipt in receipts.items():
        (root / "runs" / name).mkdir(parents=True)
        (root / "runs" / name / "receipt.json").write_text(json.dumps(receipt))


def test_report_prints_the_summary_and_wide_prints_every_column(tmp_path, monkeypatch, capsys):
    from posttrainllm import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'none' / 'mlflow.db'}")  # no store
    _plan(tmp_path, {"baseline": _receipt("baseline"), "x" * 80: _worst_case("x" * 80)})
    assert cli.main(["report"]) == 1  # a point failed
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= report.TERMINAL_WIDTH, out
    assert out.splitlines()[0].split()[:3] == ["point", "verdict", "first_failure"] and "peer_noisy" not in out
    assert "MLflow runs" not in out and not (tmp_path / "none").exists()  # nothing started, nothing created
    assert cli.main(["report", "--wide"]) == 1
    wide = capsys.readouterr().out
    columns = list(report.sweep_frame({"baseline": _receipt("baseline")}).columns)
    assert wide.splitlines()[0].split() == columns and "x" * 80 in wide
    assert (tmp_path / "runs" / "report.md").read_text().startswith("| " + " | ".join(columns) + " |")


@pytest.mark.parametrize("args", [["--wid"], ["--wide", "--wide"], ["-x"], ["runs", "--wid"]])
def test_a_bad_report_flag_is_one_line_and_exit_2(args, tmp_path, monkeypatch, capsys):
    from posttrainllm import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["report", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("usage: posttrainllm report [--wide]")
    assert list(tmp_path.iterdir()) == []


def test_the_train_table_lists_every_path_and_shows_no_nan():
    """An interpreted variant trains fewer steps (its losses at its own last step); a forward-only path and one
    that failed parity are rows with why, not gaps; no NaN anywhere."""
    entry = {"warm_ms_per_step": 10.0, "tokens_per_s": 100.0, "peak_mem_bytes": None, "timing_valid": True}
    train = {"impls": {"reference": {**entry, "losses": [5.5, 5.0, 4.5, 4.0, 3.5, 3.0, 2.5, 2.0]},
                       "triton": {**entry, "losses": [5.5, 5.0, 4.5], "timing_valid": False}},
             "skipped": {"mine": "forward-only: not trained (no backward to train with)",
                         "sdpa": "failed parity: no speed number"},
             "drift": {"triton": 1e-6}, "drift_verdict": {"triton": "pass"}, "amdahl": {"variants": {}},
             "precision": "fp32", "device": "cpu", "tokens_per_step": 256, "drift_limit": 1e-4}
    table = report.train_table({"point": "p", "config": {"architecture": {"name": "mha"}}, "bench_train": train})
    assert "NaN" not in table and "None" not in table, table
    rows = {line.split()[0]: line for line in table.splitlines()[2:-1]}
    assert list(rows) == ["reference", "triton", "mine", "sdpa"]
    assert table.splitlines()[-1].startswith("step: the op's share of the step was not profiled; no trained path")
    assert table.splitlines()[1].split()[:7] == ["variant", "warm_ms/step", "tokens/s", "peak_MB", "steps", "loss[0]",
                                                 "loss[last]"]
    assert rows["reference"].split()[4:6] == ["8", "5.5000"] and "2.0000" in rows["reference"]
    assert rows["triton"].split()[1:7] == ["-", "-", "-", "3", "5.5000", "4.5000"]
    assert rows["mine"].rstrip().endswith("forward-only: not trained (no backward to train with)")
    assert rows["sdpa"].rstrip().endswith("failed parity: no speed number") and "5.5000" not in rows["sdpa"]


def test_any_folder_of_points_is_a_report(tmp_path, monkeypatch, capsys):
    """`posttrainllm report FOLDER ...`: every point under the folders (a sweep's, a bench's, several), no
    params.yaml needed; the page and report.md in their common parent; a draft-heads receipt is not a point."""
    import json

    from posttrainllm import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'none' / 'mlflow.db'}")
    for folder, receipt in (("runs/baseline", _receipt("baseline")), ("runs/bench/mine", _receipt("mine", "fail"))):
        (tmp_path / folder).mkdir(parents=True)
        receipt = {**receipt, "schema": "posttrainllm.track.receipt/1"}
        (tmp_path / folder / "receipt.json").write_text(json.dumps(receipt))
    (tmp_path / "runs/heads/k1").mkdir(parents=True)
    (tmp_path / "runs/heads/k1/receipt.json").write_text(json.dumps({"schema": "posttrainllm.track.receipt.heads/1"}))
    assert cli.main(["report", "runs/bench"]) == 1  # its one point failed
    out = capsys.readouterr().out
    assert [line.split()[:2] for line in out.splitlines()[1:2]] == [["mine", "FAIL"]]
    assert (tmp_path / "runs/bench/report.html").is_file() and not (tmp_path / "runs/report.html").exists()
    assert cli.main(["report", "runs/bench", "runs/baseline"]) == 1
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()[1:3]] == ["bench/mine", "baseline"]
    assert 'href="bench/mine/receipt.json"' in (tmp_path / "runs/report.html").read_text()
    assert cli.main(["report", "runs/heads"]) == 1
    assert capsys.readouterr().err.strip() == "posttrainllm: no receipts under runs/heads"
    assert cli.main(["report", "runs/nowhere"]) == 2
    assert "no folder runs/nowhere" in capsys.readouterr().err
    decode = {"variants": {"greedy": {"decode_tokens_per_s": 1000.0},
                           "trained": {"decode_tokens_per_s": 2300.0, "mean_accepted_length": 3.3,
                                       "acceptance_rate_per_head": [0.83, 0.77]}},
              "speedup": {"trained": {"measured": 2.3, "predicted": 2.4}}}
    (tmp_path / "runs/heads/k2").mkdir(parents=True)
    (tmp_path / "runs/heads/k2/receipt.json").write_text(json.dumps(
        {"schema": "posttrainllm.track.receipt.heads/1", "verdict": "pass", "decode": decode}))
    assert cli.main(["report", "runs"]) == 1  # the draft heads beside the points, in the table and on the page
    out = capsys.readouterr().out
    assert ["heads/k2", "pass", "trained", "3.30", "0.83,0.77", "2300", "2.30", "2.40"] in [
        line.split() for line in out.splitlines()], out
    page = (tmp_path / "runs/report.html").read_text()
    assert "<h2>Draft heads</h2>" in page and 'href="heads/k2/receipt.json"' in page


def test_peer_vs_baseline_compares_only_the_same_op_at_the_same_problem():
    """decode_attention has a peer named `sdpa` too: a name is no reason to divide another op's time (another
    shape) by the baseline's. Planted bug: matching on the peer's name alone gives the decode point 4.00."""
    def point(name, op, problem, ms):
        receipt = _receipt(name)
        receipt["config"]["op"]["name"] = op
        receipt["microbench"]["problem"] = problem
        receipt["microbench"]["paths"]["sdpa"]["median_ms"] = ms
        return receipt

    attention = "B=1 H=4 Hkv=4 S=128 D=32"
    frame = report.sweep_frame({"baseline": point("baseline", "attention", attention, 1.0),
                                "precision-fp16": point("precision-fp16", "attention", attention, 0.5),
                                "architecture-gqa": point("architecture-gqa", "attention", "B=1 H=4 Hkv=2 S=128 D=32",
                                                          0.8),
                                "op-decode_attention": point("op-decode_attention", "decode_attention",
                                                             "B=1 H=4 Hkv=4 Sq=1 Sk=1024 D=32", 0.25)})
    ratio = dict(zip(frame["point"], frame["peer_vs_baseline"]))
    assert ratio["baseline"] == 1.0 and ratio["precision-fp16"] == 2.0
    assert ratio["architecture-gqa"] != ratio["architecture-gqa"]  # NaN: another shape
    assert ratio["op-decode_attention"] != ratio["op-decode_attention"]  # NaN: another op
    assert "-" == report.formatted(frame).set_index("point").loc["op-decode_attention", "peer_vs_baseline"]


def test_console_speedups_follow_the_measurable_rule_and_name_the_users_paths():
    """A speedup whose p20-p80 bands overlap the other path's is printed 'n.c.', never as a number, in the point's
    path table and the sweep's summary; the summary carries the user's own path with its verdict and speedup.
    Planted bugs: printing the ratio regardless of the bands, or leaving user paths out, fail here."""
    receipt = _receipt("baseline")
    micro = receipt["microbench"]["paths"]
    micro["sdpa"].update(vs_reference="no measurable difference", p20_ms=0.9, p80_ms=1.1)
    micro["mine"] = {"valid": True, "median_ms": 0.5, "p20_ms": 0.45, "p80_ms": 0.55, "speedup_vs_reference": 4.0,
                     "vs_reference": "faster"}
    receipt["parity"]["paths"]["mine"] = {"verdict": "pass", "worst": {}}
    receipt["kernel"]["paths"]["mine"] = {"kind": "user", "user": {"spec": "mine=k.py:attention"}}
    receipt["user_impls"] = {"mine": {"spec": "mine=k.py:attention"}}
    frame = report.path_frame(receipt).set_index("path")
    assert frame.loc["sdpa", "fwd_x"] == "n.c." and frame.loc["mine", "fwd_x"] == "4.00"
    row = report.summary_frame({"baseline": receipt}).iloc[0]
    assert row["peer_x"] == "n.c." and row["peer_fb_x"] == 1.5  # no forward+backward band verdict: the number
    assert row["user"] == "mine:pass 4.00x"
    assert "mine:pass 4.00x" in report.summary_table({"baseline": receipt})
    wide = report.sweep_frame({"baseline": receipt}).iloc[0]
    assert wide["peer_speedup"] == 2.0 and wide["user"] == "mine:pass 4.00x"  # --wide keeps every number
