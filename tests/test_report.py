"""The sweep report: failing points first, the peer found by kind, the time split from the stamps."""

from posttrainllm.track import report


def _receipt(point, verdict="pass", drift="pass", stamps=None):
    return {
        "point": point, "sweep": {"changes": {}}, "config": {"op": {"name": "attention"}},
        "kernel": {"paths": {"sdpa": {"kind": "peer"}, "triton": {"kind": "triton"}}},
        "parity": {"verdict": verdict, "first_failure": None if verdict == "pass" else "triton: S128/out: bad",
                   "paths": {"sdpa": {"verdict": "pass", "worst": {}}, "triton": {"verdict": verdict, "worst": {}}}},
        "microbench": {"paths": {"reference": {"valid": True, "median_ms": 2.0},
                                 "sdpa": {"valid": True, "median_ms": 1.0, "speedup_vs_reference": 2.0,
                                          "vs_reference": "faster", "forward_backward": {"speedup_vs_reference": 1.5}}},
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
