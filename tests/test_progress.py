"""Where a sweep stands (track/progress.py): stages done by their stamps' inputs hash, the time left from stamps."""

import datetime as dt
import json
import os

import pytest
import yaml

from posttrainllm import cli
from posttrainllm.track import progress, stamp

STAGES = ("reference", "kernel")


def plan(tmp_path, ops: dict[str, str]):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"sweep": {"name": "t"},
                                      "points": {p: {"config": {"op": {"name": op}}} for p, op in ops.items()}}))
    runs = tmp_path / "runs"
    for point in ops:
        for stage in STAGES:
            inputs = runs / "inputs" / point / f"{stage}.json"
            inputs.parent.mkdir(parents=True, exist_ok=True)
            inputs.write_text(json.dumps({"point": point, "stage": stage}))
    return params, runs


def stamp_stage(runs, point, stage, seconds, *, current=True, created=None):
    inputs = runs / "inputs" / point / f"{stage}.json"
    made = {"stage": stage, "point": point, "timing": {"stage_s": seconds - 1, "process_s": seconds},
            "created_at": (created or dt.datetime.now(dt.timezone.utc)).isoformat(timespec="seconds"),
            stamp.INPUTS_KEY: stamp.file_sha256(inputs) if current else "0" * 64}
    path = runs / point / "stamps" / f"{stage}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(made))


def test_a_stage_is_done_while_its_inputs_file_keeps_the_hash_its_stamp_names(tmp_path):
    params, runs = plan(tmp_path, {"a": "attention", "b": "attention"})
    stamp_stage(runs, "a", "reference", 4.0)
    stamp_stage(runs, "a", "kernel", 6.0)
    stamp_stage(runs, "b", "reference", 5.0, current=False)  # ran on inputs the last inputs stage replaced
    got = progress.read_progress(params, runs, STAGES)
    assert got.done == {("a", "reference"), ("a", "kernel")}
    assert got.points_done() == ["a"]
    assert got.pending() == [("b", "reference"), ("b", "kernel")]
    (runs / "inputs" / "a" / "kernel.json").write_text("{}")  # an edit: DVC reruns a's kernel
    assert progress.read_progress(params, runs, STAGES).points_done() == []


def test_the_time_left_comes_from_the_stamps_own_point_then_same_op_then_any(tmp_path):
    params, runs = plan(tmp_path, {"a": "attention", "b": "attention", "c": "attention", "m": "matmul"})
    old = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)
    stamp_stage(runs, "a", "reference", 10.0, created=old)
    stamp_stage(runs, "b", "reference", 20.0, created=old)
    stamp_stage(runs, "c", "reference", 99.0, current=False, created=old)  # its own last run: the estimate
    stamp_stage(runs, "m", "kernel", 7.0, current=False, created=old)
    got = progress.read_progress(params, runs, STAGES)
    assert got.estimate_s[("c", "reference")] == 99.0
    assert got.estimate_s[("m", "reference")] == 20.0  # no matmul reference stamp: the median of 10, 20, 99
    assert got.estimate_s[("m", "kernel")] == 7.0
    assert got.estimate_s[("a", "kernel")] == 7.0  # attention has no kernel stamp but matmul's
    assert got.left_s() == pytest.approx(99 + 20 + 7 * 4)
    assert got.unestimated() == 0
    assert got.line() == "0/4 points done, 2/8 stages; about 2 min left (from the stamps)"


def test_no_estimate_is_guessed_for_a_stage_no_stamp_has(tmp_path):
    params, runs = plan(tmp_path, {"a": "attention", "b": "matmul"})
    assert progress.read_progress(params, runs, STAGES).line() == \
        "0/2 points done, 0/4 stages; no estimate yet (none of the stages left has a stamp to go by)"
    stamp_stage(runs, "a", "reference", 30.0)
    got = progress.read_progress(params, runs, STAGES)
    assert got.unestimated() == 2  # the two kernel stages
    assert got.line() == "0/2 points done, 1/4 stages; at least 30 s left (from the stamps; 2 stage(s) not yet estimated)"


def test_a_stamp_names_its_inputs_hash_and_progress_code_is_not_a_source(tmp_path):
    inputs = tmp_path / "kernel.json"
    inputs.write_text('{"sources": {}}')
    made = stamp.stage_stamp("kernel", "a", {}, [], inputs=inputs)
    assert made[stamp.INPUTS_KEY] == stamp.file_sha256(inputs)
    assert "posttrainllm/track/progress.py" not in made["sources"]  # loaded by this test's import
    assert "posttrainllm/track/stamp.py" in made["sources"]
    assert stamp.INPUTS_KEY not in stamp.stage_stamp("train_base", "heads-base", {}, [])


def test_the_progress_command_shows_each_point_and_refuses_what_it_cannot_read(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["progress"]) == 2
    assert "posttrainllm sweep sweep=default" in capsys.readouterr().err
    params, runs = plan(tmp_path, {"a": "attention", "b": "attention"})
    os.replace(params, tmp_path / "params.yaml")
    assert cli.main(["progress", "extra"]) == 2
    assert "takes no arguments" in capsys.readouterr().err
    from posttrainllm.lab import pipeline

    monkeypatch.setattr(pipeline, "POINT_STAGES", STAGES)
    stamp_stage(runs, "a", "reference", 4.0)
    stamp_stage(runs, "a", "kernel", 4.0)
    assert cli.main(["progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["a", "reference", "kernel"]
    assert out[1].split() == ["b", ".........", "......"]
    assert out[2].startswith("1/2 points done, 2/4 stages; about")
