"""Bad input gets one line and exit 2, never a traceback; input is honoured or refused, never ignored."""

import re
import shlex
from pathlib import Path

import pytest
import torch
import yaml

from posttrainllm import cli

NO_CUDA = ("posttrainllm: config error: device=cuda: CUDA is not available here "
           "(torch.cuda.is_available() is False): valid choices here are auto, cpu")


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("args", [
    ["bench", "device=cuda"],
    ["bench-train", "device=cuda"],
    ["bench", "device.name=cuda"],
    ["bench", "-m", "device=cpu,cuda"],  # the second job of a multirun, before the first runs
])
def test_cuda_without_cuda_is_one_line_and_exit_2_with_nothing_written(args, empty_cwd, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this test means "a machine without CUDA"
    assert cli.main([*args, "run.log_mlflow=false"]) == 2
    assert _one_line(capsys.readouterr().err) == NO_CUDA
    assert list(empty_cwd.iterdir()) == []  # no runs/, no point folder, no multirun.yaml


PLAN = {"sweep": {"name": "smoke", "grid": False},
        "points": {"baseline": {"changes": {}, "overrides": [], "config": {"op": {"name": "attention"}}}}}


@pytest.mark.parametrize("params_yaml, says", [
    ("points:\n  baseline: {config: [1, 2\n", r"params\.yaml: not valid YAML at line 3, column 1 \("),
    ("sweep: {name: smoke}\npoints:\n\tbaseline: {}\n", r"params\.yaml: not valid YAML at line 3, column 1 \("),
    ("- just\n- a list\n", r"params\.yaml: not a sweep plan \(it needs the mappings 'sweep' and 'points'\)"),
    ("sweep: {name: smoke}\npoints:\n  baseline: 3\n", r"params\.yaml: point baseline is not a planned point"),
    (None, r"params\.yaml: not found in .*: run from the project root, or plan a sweep"),
])
def test_report_on_a_bad_params_yaml_is_one_line_and_exit_2(params_yaml, says, empty_cwd, capsys):
    if params_yaml is not None:
        (empty_cwd / "params.yaml").write_text(params_yaml)
    assert cli.main(["report"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert re.match(r"posttrainllm: config error: " + says, line), line
    if params_yaml is not None and "not a" not in line and "not found" not in line:
        assert line.endswith("regenerate it with `posttrainllm sweep sweep=NAME` (NAME from conf/sweep/)")
    assert sorted(p.name for p in empty_cwd.iterdir()) == (["params.yaml"] if params_yaml else [])  # no runs/report.md


def test_report_names_an_unreadable_receipt_instead_of_a_traceback(empty_cwd, capsys):
    (empty_cwd / "params.yaml").write_text(yaml.safe_dump(PLAN))
    (empty_cwd / "runs" / "baseline").mkdir(parents=True)
    (empty_cwd / "runs" / "baseline" / "receipt.json").write_text('{"parity": ')  # truncated
    assert cli.main(["report"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "posttrainllm: unreadable receipt runs/baseline/receipt.json (Expecting value" in err
    assert not (empty_cwd / "runs" / "report.md").exists()


@pytest.mark.parametrize("override", ["tile.block_q=32", "train.steps=5", "precision=bf16", "run.name=x"])
def test_sweep_refuses_a_point_override_it_would_drop(override, empty_cwd, capsys):
    assert cli.main(["sweep", "sweep=smoke", override]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"posttrainllm sweep does not pass {override} to its points" in line
    assert "conf/sweep/smoke.yaml under overrides:" in line
    assert not (empty_cwd / "params.yaml").exists()


def test_the_refusals_own_suggestion_applies_the_override_to_every_point(empty_cwd, capsys):
    assert cli.main(["sweep", "sweep=smoke", "tile.block_q=16"]) == 2
    suggested = re.search(r"or pass ('sweep\.overrides=\[.*\]')", capsys.readouterr().err).group(1)
    assert cli.main(["sweep", "sweep=smoke", *shlex.split(suggested)]) == 0  # as the shell would pass it
    points = yaml.safe_load(Path("params.yaml").read_text())["points"]
    assert list(points) == ["baseline", "precision-fp16"]
    for point in points.values():  # smoke's tile is b32: 16 is the override, recorded with the point
        assert point["config"]["tile"]["block_q"] == 16
        assert "tile.block_q=16" in point["overrides"]


def test_sweep_multirun_is_refused_before_anything_is_written(empty_cwd, capsys):
    assert cli.main(["sweep", "-m", "sweep=smoke,default"]) == 2
    assert "a sweep plans one params.yaml" in _one_line(capsys.readouterr().err)
    assert list(empty_cwd.iterdir()) == []


def test_printing_a_cuda_config_needs_no_cuda(empty_cwd, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--cfg", "job", "device=cuda", "shape=gpu"]) == 0  # Hydra prints, runs nothing
    assert yaml.safe_load(capsys.readouterr().out)["device"]["name"] == "cuda"
    assert list(empty_cwd.iterdir()) == []
