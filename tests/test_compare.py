"""`posttrainllm compare BASE NEW`: median ratios with bootstrap intervals, the U test, verdicts, exit codes.

Timing samples are measured once; every other side is a copy of them, edited (planted): two timing runs on a
shared machine never decide a pass or a fail here.
"""

import csv
import json
import math
import os
import random
import shutil

import pytest

from posttrainllm import cli
from posttrainllm.config import CompareConfig
from posttrainllm.lab.stages import microbench as microbench_stage
from posttrainllm.measure import roofline
from posttrainllm.measure.timing import summarize
from posttrainllm.track import compare, replay
from posttrainllm.track import receipt as receipts

# 20 samples per loop: with 3, the U test cannot reach p < 0.01 whatever the difference
QUICK = ["device=cpu", "parity.seeds=[0]", "shape.edge_seq_lens=[37]", "bench.reps=20", "bench.max_reps=20",
         "bench.min_time_s=0", "shape.curve=[64,128]", "run.log_mlflow=false",
         # every path but Triton's: through the interpreter here it is never timed, and it costs most of the point
         "op.only=[sdpa,sdpa_flash,sdpa_math]"]
PLANTED = 10.0  # sdpa's samples x10 in the slow copy (the sleep planted here before made it ~10x)
DRIFT = 1.03  # every path's samples x1.03: a drift within the default 5 % threshold
MACHINE = 1.8  # every path's samples x1.8: a machine uniformly slower in one run
DOUBLED = 2.0  # sdpa's samples x2, the reference's not: a path that really doubled its time


def edited_copy(point, folder, edit):
    """A copy of `point` whose raw samples are `edit(impl, mode, samples)`, and every number the microbench stage
    derives from them made again as it makes them (lab/stages/microbench.py run_microbench): the summaries
    (measure.timing.summarize), GFLOP/s and GB/s, the roofline, the speedup and band against the reference; then
    metrics.json. So the copy adds up (replay.verify), as a real run that measured those samples would. Its
    curve.csv stays the point's."""
    shutil.copytree(point, folder)
    with open(folder / "timings.csv", newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = reader.fieldnames, list(reader)
    groups = {}
    for row in rows:
        groups.setdefault((row["impl"], row["mode"]), []).append(row)
    for (impl, mode), group in groups.items():
        group.sort(key=lambda row: int(row["rep"]))
        for row, ms in zip(group, edit(impl, mode, [float(row["ms"]) for row in group]), strict=True):
            row["ms"] = repr(ms)
    with open(folder / "timings.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    samples = replay.raw_samples(folder)
    receipt = json.loads((folder / "receipt.json").read_text())
    bench = receipt["microbench"]
    valid = {name: entry for name, entry in bench["paths"].items() if entry["valid"]}
    for name, entry in valid.items():
        for mode, stored, flops in (("forward", entry, bench["flops"]),
                                    ("forward_backward", entry["forward_backward"], bench["train_flops"])):
            again = summarize(samples[name, mode], threads=stored["threads"], flushed=stored["flushed"],
                              batched=stored["batched"], batch_size=stored["batch_size"],
                              run_queue_share=stored["run_queue_share"])
            stored.update(again.summary())
            stored["gflops_per_s"] = flops / (stored["median_ms"] / 1e3) / 1e9
        seconds = entry["median_ms"] / 1e3
        costs = entry["costs"]  # the path's own cost model (lab/stages/microbench.py places each path at its own traffic)
        entry["gbytes_per_s"] = costs["bytes"] / seconds / 1e9
        for place, flops, nbytes, timed in ((entry, costs["flops"], costs["bytes"], entry),
                                            (entry["forward_backward"], costs["train_flops"], costs["train_bytes"],
                                             entry["forward_backward"])):
            if place.get("roofline"):
                peak_used = place["roofline"]["peak_used"]
                place["roofline"] = {**roofline.roofline(
                    flops, nbytes, timed["median_ms"] / 1e3, peak_flops=bench["peaks"]["gemm_flops_per_s"],
                    peak_bytes_per_s=bench["peaks"]["copy_bytes_per_s"], widest_flops=peak_used["flops_per_s"],
                    cache_bytes=bench.get("last_level_cache_bytes"), working_set_bytes=costs["working_set_bytes"]),
                    "peak_used": peak_used}
    reference = valid["reference"]
    for name, entry in valid.items():
        if name == "reference":
            continue
        for stored, ref in ((entry, reference), (entry["forward_backward"], reference["forward_backward"])):
            stored["speedup_vs_reference"] = ref["median_ms"] / stored["median_ms"]
            stored["vs_reference"] = microbench_stage.compare(stored, ref)
    (folder / "receipt.json").write_text(json.dumps(receipt, indent=2))
    (folder / "metrics.json").write_text(json.dumps(receipts.metrics(receipt), indent=2))
    return folder


@pytest.fixture(scope="module")
def points(tmp_path_factory, calibration):
    """One real point, `base`, timed once, and copies of its samples: `rerun` (each path's samples in another
    order: what a rerun that measured the same would store), `slow` (sdpa's samples x PLANTED), `drift` (every
    path's samples x DRIFT)."""
    root = tmp_path_factory.mktemp("compare")
    bench = root / "runs" / "bench"
    bench.mkdir(parents=True)
    shutil.copy(calibration, bench / "calibration.json")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert cli.main(["bench", *QUICK, "run.name=base"]) == 0
    finally:
        os.chdir(cwd)
    base = bench / "base"
    edited_copy(base, bench / "rerun", lambda impl, mode, ms: random.Random(f"{impl}/{mode}").sample(ms, len(ms)))
    edited_copy(base, bench / "slow", lambda impl, mode, ms: [x * PLANTED for x in ms] if impl == "sdpa" else ms)
    edited_copy(base, bench / "drift", lambda impl, mode, ms: [x * DRIFT for x in ms])
    # synthetic samples, so no verdict below rests on how noisy this machine was when `base` was timed: each
    # path's own median, spread +-2 % (deterministic), then scaled
    quiet = edited_copy(base, bench / "quiet", lambda impl, mode, ms: [
        sorted(ms)[len(ms) // 2] * (1 + 0.02 * ((7 * i) % 10 - 4.5) / 4.5) for i in range(len(ms))])
    edited_copy(quiet, bench / "machine", lambda impl, mode, ms: [x * MACHINE for x in ms])
    edited_copy(quiet, bench / "doubled", lambda impl, mode, ms: [x * DOUBLED for x in ms] if impl == "sdpa" else ms)
    edited_copy(quiet, bench / "machine_doubled",
                lambda impl, mode, ms: [x * MACHINE * (DOUBLED if impl == "sdpa" else 1) for x in ms])
    return bench


def timing_rows(printed):
    """The table's timing rows (not the tail's list of regressions)."""
    return [line for line in printed.splitlines() if " time " in line and "regression(s)" not in line]


def test_the_copies_are_what_they_plant_and_add_up(points):
    base, slow = (json.loads((points / name / "receipt.json").read_text())["microbench"]["paths"]
                  for name in ("base", "slow"))
    assert slow["sdpa"]["median_ms"] == pytest.approx(base["sdpa"]["median_ms"] * PLANTED, rel=1e-12)
    assert slow["sdpa"]["speedup_vs_reference"] == pytest.approx(base["sdpa"]["speedup_vs_reference"] / PLANTED)
    assert slow["reference"] == base["reference"]
    assert replay.raw_samples(points / "rerun") != replay.raw_samples(points / "base")  # reordered ...
    rerun = json.loads((points / "rerun" / "receipt.json").read_text())
    assert rerun == json.loads((points / "base" / "receipt.json").read_text())  # ... the same summaries
    for name in ("base", "rerun", "slow", "drift"):
        [stored], _ = replay.load(str(points / name))
        assert replay.verify(stored) == [], name


def test_mann_whitney_matches_the_textbook_normal_approximation():
    # x all below y: U = 0, mean 4.5, var 3*3/12*7 = 5.25, z = (4.5 - 0.5)/sqrt(5.25), p = erfc(z/sqrt 2)
    u, p = compare.mann_whitney([1, 2, 3], [4, 5, 6])
    assert u == 0 and p == pytest.approx(math.erfc(4 / math.sqrt(5.25) / math.sqrt(2)))
    assert p == pytest.approx(0.0809, abs=1e-4)  # scipy.stats.mannwhitneyu(method="asymptotic")
    # ties: x=[1,2,2], y=[2,3,3]: ranks 1,3,3 | 3,5.5,5.5 -> U_x = 7 - 6 = 1; sum(t^3 - t) = 24 (2s) + 6 (3s),
    # var = 9/12 * (7 - 30/30) = 4.5, z = (|1 - 4.5| - 0.5) / sqrt(4.5) = sqrt(2): p = erfc(1)
    u, p = compare.mann_whitney([1, 2, 2], [2, 3, 3])
    assert u == 1 and p == pytest.approx(math.erfc(1.0))
    assert compare.mann_whitney([2.0] * 5, [2.0] * 5) == (12.5, 1.0)  # nothing to tell apart


def test_verdict_needs_both_the_interval_and_p():
    cfg = CompareConfig()
    assert compare.timing_verdict(1.06, 1.2, 0.001, cfg) == "slower"
    assert compare.timing_verdict(1.04, 1.2, 0.001, cfg) == "no measurable difference"  # interval within 5 %
    assert compare.timing_verdict(1.06, 1.2, 0.02, cfg) == "no measurable difference"  # p not small enough
    assert compare.timing_verdict(0.5, 0.94, 0.001, cfg) == "faster"
    assert compare.timing_verdict(0.5, 0.96, 0.001, cfg) == "no measurable difference"  # 0.96 > 1/1.05


def test_a_planted_slowdown_is_a_regression(points, tmp_path, capsys):
    out = tmp_path / "compare.md"
    assert cli.main(["compare", str(points / "base"), str(points / "slow"), "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    rows = timing_rows(printed)
    sdpa = [line for line in rows if " sdpa " in line]
    assert len(sdpa) == 2 and all("slower REGRESSION" in line for line in sdpa), printed  # both modes
    assert " 10.000 " in sdpa[0]
    # the paths not planted have the very same samples: ratio 1, p = 1, at the default 5 % threshold
    others = [line for line in rows if " sdpa " not in line]
    assert others and all(" 1.000 " in line and "no measurable difference" in line for line in others), printed
    assert "parity out" in printed  # parity verdicts beside the timings
    markdown = out.read_text()
    assert "| base | sdpa | time forward |" in markdown and "REGRESSION" in markdown  # a copy: the same point
    assert "regression(s): base/sdpa time forward, base/sdpa time forward_backward" in markdown
    # the other way round it is faster, and nothing regressed
    assert cli.main(["compare", str(points / "slow"), str(points / "base"), "--out", str(out)]) == 0
    rows = [line for line in timing_rows(capsys.readouterr().out) if " sdpa " in line]
    assert len(rows) == 2 and all("faster" in line for line in rows)


def test_identical_reruns_are_not_called_different(points, tmp_path, capsys):
    out = str(tmp_path / "compare.md")
    # the very same samples, and the same samples in another order: ratio 1, p = 1
    for new in ("base", "rerun"):
        assert cli.main(["compare", str(points / "base"), str(points / new), "--out", out]) == 0
        timing = timing_rows(capsys.readouterr().out)
        assert len(timing) >= 4 and all(" 1.000 " in line and "no measurable difference" in line for line in timing)
    # every path 3 % slower, within the 5 % threshold: the interval cannot clear 1.05, whatever p says
    assert cli.main(["compare", str(points / "base"), str(points / "drift"), "--out", out]) == 0
    printed = capsys.readouterr().out
    timing = timing_rows(printed)
    assert len(timing) >= 4, printed
    assert all(" 1.030 " in line and "no measurable difference" in line for line in timing), printed


def test_parity_pass_to_fail_is_a_regression_and_timings_need_the_same_device(points, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(points / "base", broken)
    receipt = json.loads((broken / "receipt.json").read_text())
    receipt["provenance"]["machine"]["device_name"] = "Another CPU"
    (broken / "receipt.json").write_text(json.dumps(receipt))
    out = str(tmp_path / "compare.md")
    assert cli.main(["compare", str(points / "base"), str(broken), "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "timings not compared: device fingerprints differ (device_name:" in printed
    assert " time " not in printed and "parity out" in printed
    assert cli.main(["compare", str(points / "base"), str(broken), "--out", out, "--across-devices"]) == 0
    assert "timings compared across devices" in capsys.readouterr().out
    # a verdict that went from pass to fail (its error now above its allowance, consistently stored)
    worst = receipt["parity"]["paths"]["sdpa"]["worst"]["out"]
    worst.update(max_abs_err=worst["allowed_abs_err"] * 3, verdict="fail", reason="planted")
    receipt["parity"]["paths"]["sdpa"].update(verdict="fail", failed_cases=["S128/out: planted"])
    receipt["parity"]["verdict"] = "fail"
    (broken / "receipt.json").write_text(json.dumps(receipt))
    (broken / "parity.json").unlink()
    (broken / "metrics.json").unlink()
    assert cli.main(["compare", str(points / "base"), str(broken), "--out", out]) == 1
    row = [line for line in capsys.readouterr().out.splitlines() if " sdpa " in line and "parity" in line][0]
    assert "pass -> fail REGRESSION" in row


def test_compare_refuses_bad_input(points, tmp_path, capsys):
    assert cli.main(["compare", str(points / "base")]) == 2
    assert "usage: posttrainllm compare BASE NEW" in capsys.readouterr().err
    assert cli.main(["compare", str(points / "base"), str(tmp_path / "nope")]) == 2
    assert "cannot compare" in capsys.readouterr().err
    assert cli.main(["compare", str(points / "base"), str(points / "rerun"), "compare.alpha=2"]) == 2
    assert "compare.alpha=2.0: must be in (0, 1)" in capsys.readouterr().err
    tampered = tmp_path / "tampered"
    shutil.copytree(points / "rerun", tampered)
    receipt = json.loads((tampered / "receipt.json").read_text())
    receipt["microbench"]["paths"]["sdpa"]["median_ms"] /= 2  # a faster number than its samples say
    (tampered / "receipt.json").write_text(json.dumps(receipt))
    assert cli.main(["compare", str(points / "base"), str(tampered)]) == 2
    err = capsys.readouterr().err
    assert "microbench sdpa/forward: median_ms=" in err and "not compared" in err


def _row(rows, path, mode):
    [line] = [line for line in rows if line.split()[1] == path and line.split()[3] == mode]
    return line


def test_a_uniformly_slower_machine_is_no_verdict(points, tmp_path, capsys):
    out = str(tmp_path / "compare.md")
    assert cli.main(["compare", str(points / "quiet"), str(points / "machine"), "--out", out]) == 0
    printed = capsys.readouterr().out
    rows = timing_rows(printed)
    assert len(rows) >= 4, printed
    for mode in ("forward", "forward_backward"):
        reference = _row(rows, "reference", mode)
        assert f"machine speed changed by x{MACHINE:.2f} (the reference: not judged)" in reference
        assert "REGRESSION" not in reference and " 1.800 " in reference
    paths = [line for line in rows if line.split()[1] != "reference"]
    assert paths and all(" 1.800 " in line and " 1.000 " in line and "no measurable difference" in line
                          for line in paths), printed
    assert "judged relative to the reference timed in the same run" in printed and "0 regression(s)" in printed
    # the absolute rule this replaces would have called all of them slower: the samples do differ
    [base], _ = replay.load(str(points / "quiet"))
    [machine], _ = replay.load(str(points / "machine"))
    sdpa = compare.compare_samples(replay.raw_samples(base.folder)["sdpa", "forward"],
                                   replay.raw_samples(machine.folder)["sdpa", "forward"], CompareConfig())
    assert sdpa["verdict"] == "slower"


@pytest.mark.parametrize("new", ["doubled", "machine_doubled"])
def test_a_path_that_doubled_against_its_reference_is_found(points, tmp_path, capsys, new):
    out = tmp_path / "compare.md"
    assert cli.main(["compare", str(points / "quiet"), str(points / new), "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    rows = timing_rows(printed)
    for mode in ("forward", "forward_backward"):
        sdpa = _row(rows, "sdpa", mode)
        assert " 2.000 " in sdpa and "slower REGRESSION" in sdpa, printed
        assert "REGRESSION" not in _row(rows, "reference", mode)
    assert "regression(s): base/sdpa time forward, base/sdpa time forward_backward" in printed  # copies of `base`
    others = [line for line in rows if line.split()[1] not in ("sdpa", "reference")]
    assert others and all("no measurable difference" in line for line in others), printed


def test_the_relative_interval_and_test(points):
    """compare_relative on made-up samples: a uniform factor cancels, a path's own change does not."""
    rng = random.Random(0)
    base = [1.0 + rng.random() / 10 for _ in range(20)]
    ref = [2.0 + rng.random() / 10 for _ in range(20)]
    cfg = CompareConfig()
    same = compare.compare_relative(base, ref, [x * 3 for x in base], [x * 3 for x in ref], cfg)
    assert same["relative"] == pytest.approx(1.0) and same["ratio"] == pytest.approx(3.0)
    assert same["p"] > 0.5 and same["verdict"] == "no measurable difference"  # equal up to rounding in log
    assert same["ci_low"] < 1.0 < same["ci_high"]
    slower = compare.compare_relative(base, ref, [x * 2 for x in base], ref, cfg)
    assert slower["relative"] == pytest.approx(2.0) and slower["verdict"] == "slower" and slower["ci_low"] > 1.05
    # the reference alone got faster in the new run: the path, unchanged in ms, is slower relative to it
    relative = compare.compare_relative(base, ref, base, [x / 2 for x in ref], cfg)
    assert relative["relative"] == pytest.approx(2.0) and relative["verdict"] == "slower"
