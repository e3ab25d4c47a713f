"""`posttrainllm replay TARGET`: tables, verdicts and plots from a stored receipt, nothing run, and checked."""

import dataclasses
import hashlib
import json
import os
import re
import shutil
import types

import pytest

from posttrainllm import cli
from posttrainllm.measure.timing import BATCHES_MIN
from posttrainllm.track import replay

# train.*: the parity case at the shape bench-train trains (ops/attention/definition.py train_case) at the smoke sweep's size
QUICK = ["device=cpu", "parity.seeds=[0]", "shape.edge_seq_lens=[37]", "bench.reps=3", "bench.min_time_s=0",
         "shape.curve=[64,128]", "bench.curve_backward=true", "train.batch_size=2", "train.seq_len=32",
         "run.log_mlflow=false"]


@pytest.fixture(scope="module")
def point(tmp_path_factory, calibration):
    """One real point folder (bench, no MLflow)."""
    root = tmp_path_factory.mktemp("replay")
    (root / "runs" / "bench").mkdir(parents=True)
    shutil.copy(calibration, root / "runs" / "bench" / "calibration.json")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert cli.main(["bench", *QUICK, "run.name=stored"]) == 0
    finally:
        os.chdir(cwd)
    return root / "runs" / "bench" / "stored"


def _hashes(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def nothing_may_run(monkeypatch):
    """Every way to launch a kernel or start a timing loop raises."""
    import torch
    import triton.runtime.jit

    from posttrainllm.measure import calibrate, curves, timing
    from posttrainllm.ops.registry import OPS

    def forbidden(*args, **kwargs):
        raise AssertionError("replay launched a kernel or a timer")

    for name in ("measure", "_clock_ms", "_cuda_event_ms", "l2_flush"):
        monkeypatch.setattr(timing, name, forbidden)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=forbidden))
    monkeypatch.setattr(curves, "measure_row", forbidden)
    monkeypatch.setattr(calibrate, "calibrate", forbidden)
    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", forbidden)
    monkeypatch.setattr(torch.cuda, "Event", forbidden)
    for op in OPS.values():
        for name, impl in list(op.impls.items()):
            monkeypatch.setitem(op.impls, name, dataclasses.replace(impl, fn=forbidden))


def test_replay_renders_from_storage_runs_nothing_and_writes_nothing_there(point, tmp_path, nothing_may_run, capsys):
    before = _hashes(point)
    assert cli.main(["replay", str(point), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"replay of {point}" in out
    assert "revision  stored" in out and "device    stored cpu" in out and "here cpu" in out
    assert re.search(r"^sdpa +pass ", out, re.M) and "interpreted: not speed" in out  # the point table
    assert "grad_q" in out and "lse" in out  # the parity table: every output of every path
    # reps=3 calls, and at least BATCHES_MIN batch means (rule batch_mean)
    assert f"sdpa/forward_backward {BATCHES_MIN} samples" in out and "verified: ok" in out
    assert {p.name for p in (tmp_path / "out" / "stored").iterdir()} == {"time_vs_size.png", "memory_vs_size.png",
                                                                         "roofline.png"}
    assert _hashes(point) == before  # the point's folder is only read
    # the receipt.json itself, and a folder of points (a sweep's runs/), give the same
    assert cli.main(["replay", str(point / "receipt.json"), "--out", str(tmp_path / "out2")]) == 0
    for name in ("stored", "twin"):
        shutil.copytree(point, tmp_path / "runs" / name)
    assert cli.main(["replay", str(tmp_path / "runs"), "--out", str(tmp_path / "out3")]) == 0
    assert capsys.readouterr().out.count("verified: ok") == 3


def _tampered(point, tmp_path, edit=None, csv_edit=None):
    folder = tmp_path / "tampered"
    shutil.copytree(point, folder)
    if edit:
        receipt = json.loads((folder / "receipt.json").read_text())
        edit(receipt)
        (folder / "receipt.json").write_text(json.dumps(receipt))
    if csv_edit:
        (folder / "timings.csv").write_text(csv_edit((folder / "timings.csv").read_text()))
    return folder


def test_a_tampered_timing_summary_is_named(point, tmp_path, capsys):
    def faster(receipt):
        receipt["microbench"]["paths"]["sdpa"]["forward_backward"]["median_ms"] *= 0.5
        receipt["microbench"]["paths"]["sdpa"]["forward_backward"]["speedup_vs_reference"] *= 2

    folder = _tampered(point, tmp_path, faster)
    assert cli.main(["replay", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "does not add up: microbench sdpa/forward_backward: median_ms=" in err
    assert "from the raw samples" in err and "1 of 1 receipts do not add up" in err
    assert "metrics.json differs from the receipt at bench.sdpa.fwd_bwd.median_ms" in err


def test_crossovers_are_checked_per_mode_and_an_old_curve_without_modes_reads_as_forward(point, tmp_path, capsys):
    import pandas as pd

    def moved(receipt):  # the forward + backward crossover of sdpa, moved
        entry = next(c for c in receipt["microbench"]["curve"]["crossovers"] if c["mode"] == "forward_backward")
        entry["vs_reference"]["sdpa"] = 12345

    folder = _tampered(point, tmp_path, moved)
    assert cli.main(["replay", str(folder), "--out", str(tmp_path / "out")]) == 2
    assert "curve sdpa (seq_len/forward_backward): crossover 12345 stored, curve.csv gives" in capsys.readouterr().err
    shutil.rmtree(folder)

    def before_modes(receipt):  # a receipt written before curves had modes: forward crossovers of x_name only
        for key in ("crossovers", "modes"):
            del receipt["microbench"]["curve"][key]

    folder = _tampered(point, tmp_path, before_modes)
    curve = pd.read_csv(folder / "curve.csv")
    assert set(curve["mode"]) == {"forward", "forward_backward"}
    curve[curve["mode"] == "forward"].drop(columns="mode").to_csv(folder / "curve.csv", index=False)
    assert cli.main(["replay", str(folder), "--out", str(tmp_path / "old")]) == 0
    assert "verified: ok" in capsys.readouterr().out
    assert (tmp_path / "old" / "stored" / "time_vs_size.png").exists()


def test_a_dropped_sample_and_a_missing_samples_file_are_named(point, tmp_path, capsys):
    rows = (point / "timings.csv").read_text().splitlines()
    last = rows[-1].split(",")  # op, impl, mode, rep, ms, ...
    reps = sum(1 for row in rows[1:] if row.split(",")[1:3] == last[1:3])  # the batches of rule batch_mean
    drop_last = lambda text: "\n".join(text.splitlines()[:-1]) + "\n"  # noqa: E731
    folder = _tampered(point, tmp_path, csv_edit=drop_last)
    assert cli.main(["replay", str(folder), "--out", str(tmp_path / "out")]) == 2
    assert f"{last[1]}/{last[2]}: reps={reps} stored, {reps - 1} samples in timings.csv" in capsys.readouterr().err
    (folder / "timings.csv").unlink()
    assert cli.main(["replay", str(folder), "--out", str(tmp_path / "out")]) == 2
    assert "timings.csv (the raw samples) is not beside the receipt" in capsys.readouterr().err


def test_a_verdict_that_does_not_follow_from_its_errors_is_named(point, tmp_path, capsys):
    def hide_failure(receipt):  # an error above its allowance, still called a pass
        worst = receipt["parity"]["paths"]["triton"]["worst"]["out"]
        worst["max_abs_err"] = worst["allowed_abs_err"] * 2

    folder = _tampered(point, tmp_path, hide_failure)
    assert cli.main(["replay", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "parity triton worst (" in err and "/out: verdict 'pass' stored, but max_abs_err" in err and "says 'fail'" in err

    def loose_contract(receipt):
        receipt["parity"]["contract"]["error_multiple"] = 80.0

    folder = _tampered(point, tmp_path / "2", loose_contract)
    assert cli.main(["replay", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "parity.contract differs from the config's precision.contract" in err
    assert "allowed_abs_err=" in err and "the contract gives" in err


def test_loss_drift_verdicts_follow_from_the_losses():
    receipt = {"config": {"precision": {"contract": {"train_loss_drift": 1e-4}}},
               "bench_train": {"baseline": "reference", "impls": {"reference": {"losses": [3.0, 2.5]},
                                                                  "sdpa": {"losses": [3.0, 2.5003]}},
                               "drift": {"sdpa": 3e-4}, "drift_verdict": {"sdpa": "pass"}}}
    problems = replay.verify_train(receipt)
    assert problems == ["bench_train sdpa: drift verdict 'pass' stored, drift 0.0003 against train_loss_drift "
                        "0.0001 says 'fail'"]
    receipt["bench_train"]["drift"]["sdpa"] = 1e-5
    assert "drift 1e-05 stored, its losses give" in replay.verify_train(receipt)[0]


def test_a_path_that_cannot_run_here_is_its_own_verdict_and_breaks_no_point(tmp_path):
    """track/failures.py: no case checked and none failed, with the reason it could not run: "cannot run here"; the
    point's verdict is its other paths'. Called a pass, or hiding a failed case, it is named."""
    gap = {"pattern": "triton_no_driver", "reason": "Triton found no GPU driver (0 active drivers)",
           "runs_on": "a GPU with its driver"}
    path = {"verdict": "cannot run here", "failed_cases": [], "worst": {}, "cannot_run_here": gap}
    receipt = {"config": {}, "parity": {"verdict": "pass", "contract": {}, "paths": {"mine": path}}}
    assert replay.verify_parity(receipt, tmp_path) == []
    path["verdict"] = "pass"
    assert replay.verify_parity(receipt, tmp_path) == [
        "parity mine: verdict 'pass' stored, its failed cases and worst outputs say 'cannot run here'"]
    path.update(verdict="cannot run here", failed_cases=["did not run: RuntimeError: wrong"])
    assert "say 'fail'" in replay.verify_parity(receipt, tmp_path)[0]


def test_truncated_receipt_and_bad_targets_get_one_line(point, tmp_path, capsys):
    folder = _tampered(point, tmp_path)
    text = (folder / "receipt.json").read_text()
    (folder / "receipt.json").write_text(text[: len(text) // 2])
    assert cli.main(["replay", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("posttrainllm: cannot replay") and "not valid JSON" in err and "truncated?" in err
    assert len(err.strip().splitlines()) == 1
    receipt = json.loads(text)
    del receipt["microbench"]["paths"]["sdpa"]["forward_backward"]
    (folder / "receipt.json").write_text(json.dumps(receipt))
    assert cli.main(["replay", str(folder), "--out", str(tmp_path / "out")]) == 2
    assert "incomplete or malformed receipt (no 'forward_backward' field)" in capsys.readouterr().err
    assert cli.main(["replay", str(tmp_path / "nowhere")]) == 2
    assert "not a point folder, a receipt.json, a folder of points, or an MLflow run id" in capsys.readouterr().err
    assert cli.main(["replay"]) == 2
    assert "usage: posttrainllm replay TARGET" in capsys.readouterr().err


BAD_PATHS = '''
import torch


def writes_input(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    with torch.no_grad():
        x.data.mul_(2.0)  # writes into its input: a guard violation
    return y.to(x.dtype)


def wrong_dtype(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * weight.float()  # fp32 out
'''


def test_guard_and_dtype_violations_add_up_and_a_cut_one_does_not(tmp_path, calibration, capsys):
    """Paths that break a guard (a write into an input) or an output check (the wrong dtype) fail parity with
    those violations in their failed cases; the untouched receipt adds up, one with a violation or a failing
    case taken out does not."""
    (tmp_path / "runs" / "bench").mkdir(parents=True)
    shutil.copy(calibration, tmp_path / "runs" / "bench" / "calibration.json")
    (tmp_path / "bad_paths.py").write_text(BAD_PATHS)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert cli.main(["bench", "op=rmsnorm", "precision=bf16", "device=cpu", "parity.seeds=[0]", "bench.reps=3",
                         "bench.min_time_s=0", "shape.seq_len=64", "shape.curve=[32,64]", "run.log_mlflow=false",
                         "run.name=bad", "op.user_impls=[bad_paths.py:writes_input,bad_paths.py:wrong_dtype]",
                         "op.only=[writes_input,wrong_dtype]"]) == 1  # the built-in paths are not what is tested
    finally:
        os.chdir(cwd)
    folder = tmp_path / "runs" / "bench" / "bad"
    paths = json.loads((folder / "receipt.json").read_text())["parity"]["paths"]
    assert any("changed input x" in v for v in paths["writes_input"]["violations"]), paths["writes_input"]
    assert any("dtype torch.float32, expected torch.bfloat16" in v for v in paths["wrong_dtype"]["violations"])
    capsys.readouterr()
    assert cli.main(["replay", str(folder), "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert "verified: ok" in out and "does not add up" not in err, err

    def cut_violation(receipt):
        receipt["parity"]["paths"]["wrong_dtype"]["failed_cases"].pop(0)

    def cut_case(receipt):
        receipt["parity"]["paths"]["wrong_dtype"]["failed_cases"].pop()

    for i, cut in enumerate((cut_violation, cut_case)):
        tampered = _tampered(folder, tmp_path / str(i), cut)
        assert cli.main(["replay", str(tampered), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "parity wrong_dtype: " in err and "do not add up (tampered or truncated?)" in err, err


def test_the_noise_band_follows_from_the_baseline_step_times():
    from posttrainllm.model.amdahl import noise_band

    steps, repeat = [9.0, 10.0, 10.0, 11.0, 11.0], [9.0, 10.5, 10.5, 10.5, 10.5]
    receipt = {"config": {"precision": {"contract": {"train_loss_drift": 1e-4}}},
               "bench_train": {"baseline": "reference", "config": {"warmup_steps": 1},
                               "impls": {"reference": {"losses": [3.0, 2.5], "step_ms": steps}},
                               "drift": {}, "drift_verdict": {}, "noise": noise_band(steps, repeat, 1)}}
    # the copy against the first: 10.5 / 10.5 over all warm steps, 10.5 / 10 over the first half
    assert receipt["bench_train"]["noise"]["band"] == pytest.approx(1.05) and replay.verify_train(receipt) == []
    receipt["bench_train"]["noise"]["band"] = 1.0  # narrower than the baseline measured itself
    assert replay.verify_train(receipt) == ["bench_train: noise band 1.0 stored, the baseline's step times give "
                                            f"{noise_band(steps, repeat, 1)['band']!r}"]


def test_outside_timing_seeds_are_checked_recorded_well_formed_and_unshared():
    """Rule timing_seed from the stored receipt alone: a seed per timed mode, 48 bits, none shared."""
    from posttrainllm.track.replay import verify_timing_seeds

    def entry(forward, backward):
        return {"valid": True, "forward_backward": {"median_ms": 1.0},
                "outside": {"forward": {"timing_seeds": {"base": forward}},
                            "forward_backward": {"timing_seeds": {"base": backward}}}}

    good = {"microbench": {"paths": {"a": entry(11, 12), "b": entry(13, 2**48 - 1), "sdpa": {"valid": True}}}}
    assert verify_timing_seeds(good) == []
    shared = {"microbench": {"paths": {"a": entry(11, 12), "b": entry(11, 14)}}}
    assert verify_timing_seeds(shared) == ["microbench b/forward: timing seed 11 is also a/forward's: seeds are drawn "
                                           "at run time per path and mode, and do not repeat"]
    missing = {"microbench": {"paths": {"a": {**entry(11, 12), "outside": {"forward": {"timing_seeds": {}}}}}}}
    assert verify_timing_seeds(missing) == ["microbench a/forward: timed from outside with no timing seed recorded"]
    bad = {"microbench": {"paths": {"a": entry("7", 2**48)}}}
    assert len(verify_timing_seeds(bad)) == 2 and "is not a 48-bit number" in verify_timing_seeds(bad)[1]


def test_replayed_plots_name_what_the_curve_skipped_and_its_regimes(point, tmp_path, monkeypatch):
    """What was seen: the replayed time-vs-size plot dropped the skipped paths (Triton through its interpreter)
    without a word and labelled no regime, unlike the microbench's own; the roofline draws the one peak the point
    was held to (the receipt stores that peak alone)."""
    from posttrainllm.track import plots

    seen = {}
    real_roof, real_time = plots.roofline_figure, plots.time_vs_size_figure

    def roof(*args, **kwargs):
        seen["roof"] = kwargs
        return real_roof(*args, **kwargs)

    def time_plot(*args, **kwargs):
        seen["time"] = kwargs
        return real_time(*args, **kwargs)

    monkeypatch.setattr(plots, "roofline_figure", roof)
    monkeypatch.setattr(plots, "time_vs_size_figure", time_plot)
    receipt = json.loads((point / "receipt.json").read_text())
    [stored], _ = replay.load(str(point))
    replay.render_plots(stored, tmp_path)
    curve = receipt["microbench"]["curve"]
    assert isinstance(receipt["microbench"]["peaks"]["gemm_flops_per_s"], float) and "roof" in seen
    assert seen["time"]["omitted"] == curve["skipped"] and "triton" in curve["skipped"]
    assert seen["time"]["regimes"] == curve["regimes"]
