"""The planner: one dimension at a time around a baseline, a grid only when asked, params.yaml in sync."""

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from posttrainllm import cli
from posttrainllm.lab import reads, sweep
from posttrainllm.config import PROJECT_ROOT, ConfigError, SweepConfig
from posttrainllm.lab.configure import load

BASELINE = {"op": "attention", "precision": "fp32", "tile": "b32", "workgroup": "w4s2",
            "architecture": "mha", "shape": "tiny", "device": "cpu"}


def _sweep(**fields) -> SweepConfig:
    return SweepConfig(**{"name": "t", "baseline": dict(BASELINE), **fields})


def test_each_point_changes_exactly_one_dimension():
    params = sweep.plan(load().sweep)
    points = params["points"]
    assert "baseline" in points and points["baseline"]["changes"] == {}
    base = points["baseline"]["config"]
    for name, point in points.items():
        if name == "baseline":
            continue
        (dimension, option), = point["changes"].items()
        assert name == f"{dimension}-{option}"
        # the baseline's own key overrides (sweep.baseline_overrides: op.peers) are not a dimension's change
        base_op = {k: v for k, v in base["op"].items() if k != "peers"}
        # a point holds its own op's sizes only (shape.ops.<op>): they come with the op, not a change of shape
        assert set(point["config"]["shape"]["ops"]) <= {point["config"]["op"]["name"]}
        shared = lambda config: {k: v for k, v in config["shape"].items() if k != "ops"}  # noqa: E731
        config = {**point["config"], "op": {k: v for k, v in point["config"]["op"].items() if k != "peers"},
                  "shape": shared(point["config"])}
        differing = {d for d in ("op", "precision", "tile", "workgroup", "architecture", "shape", "device")
                     if config[d] != {**base, "op": base_op, "shape": shared(base)}[d]}
        assert differing == {dimension}


def test_default_sweep_covers_every_dimension_the_user_named():
    changed = {d for p in sweep.plan(load().sweep)["points"].values() for d in p["changes"]}
    assert {"precision", "tile", "workgroup", "architecture"} <= changed


def test_value_equal_to_baseline_is_not_a_new_point():
    points = sweep.point_changes(_sweep(vary={"precision": ["fp32", "bf16"]}))
    assert list(points) == ["baseline", "precision-bf16"]


def test_point_changing_two_dimensions_is_refused():
    with pytest.raises(ConfigError, match="changes precision and tile at once.*sweep.grid=true"):
        sweep.point_changes(_sweep(points={"both": {"precision": "bf16", "tile": "b16"}}))


def test_a_named_point_may_change_one_dimension_from_an_earlier_point():
    """op-matmul, then its precision (fp8 is matmul's alone), then its tile: each one change from the one before."""
    chain = {"mm-fp8": {"op": "matmul", "precision": "fp8"}, "mm-fp8-b64": {"op": "matmul", "precision": "fp8",
                                                                          "tile": "b64"}}
    points = sweep.point_changes(_sweep(vary={"op": ["matmul"]}, points=chain))
    assert list(points) == ["baseline", "op-matmul", "mm-fp8", "mm-fp8-b64"]
    assert points["mm-fp8-b64"] == {"op": "matmul", "precision": "fp8", "tile": "b64"}
    with pytest.raises(ConfigError, match="mm-fp8-b64 changes op and precision and tile at once: .* from the "
                                          "baseline or from an earlier point"):
        sweep.point_changes(_sweep(vary={"op": ["matmul"]}, points={"mm-fp8-b64": chain["mm-fp8-b64"]}))


def test_grid_must_be_asked_for():
    points = sweep.point_changes(_sweep(grid=True, vary={"precision": ["bf16"], "tile": ["b16"]}))
    assert points["precision-bf16_tile-b16"] == {"precision": "bf16", "tile": "b16"}
    assert len(points) == 4
    assert sweep.point_changes(_sweep(grid=True, points={"both": {"precision": "bf16", "tile": "b16"}}))["both"]


@pytest.mark.parametrize("fields, message", [
    ({"vary": {"colour": ["red"]}}, "unknown dimension 'colour': valid dimensions are op, precision"),
    ({"vary": {"precision": ["fp4"]}}, "sweep.vary.precision: unknown precision 'fp4'"),
    ({"baseline": {**BASELINE, "tile": "b7"}}, "sweep.baseline: unknown tile 'b7'"),
])
def test_bad_sweep_names_the_valid_choices(fields, message):
    with pytest.raises(ConfigError, match=message):
        sweep.point_changes(_sweep(**fields))


def test_point_whose_config_is_invalid_is_refused_by_name():
    bad = _sweep(vary={"tile": ["b64"]}, overrides=["shape.seq_len=20"])
    with pytest.raises(ConfigError, match="sweep point baseline: .*does not fit|sweep point tile-b64: .*does not fit"):
        sweep.plan(bad)


def test_committed_params_yaml_is_in_sync_with_conf():
    committed = (PROJECT_ROOT / "params.yaml").read_text()
    params = yaml.safe_load(committed)
    cfg = load([f"sweep={params['sweep']['name']}"])
    assert committed == sweep.render(sweep.plan(cfg.sweep)), (
        "params.yaml is stale: run `posttrainllm sweep` and commit it")


@pytest.mark.parametrize("name", ["dvc.lock", "params.yaml", "dvc.yaml"])
def test_files_dvc_reads_or_writes_are_not_git_ignored(name):
    # DVC refuses to write a git-ignored dvc.lock, so `dvc repro` would fail on every machine.
    if not (PROJECT_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "check-ignore", "-q", name], cwd=PROJECT_ROOT)
    assert done.returncode == 1, f"{name} is git-ignored (git check-ignore exit {done.returncode})"


def test_sweep_command_writes_params(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["sweep", "sweep=smoke"]) == 0
    params = yaml.safe_load(Path("params.yaml").read_text())
    assert list(params["points"]) == ["baseline", "precision-fp16"]
    assert "train.steps=4" in params["points"]["baseline"]["overrides"]
    assert params["points"]["baseline"]["config"]["train"]["steps"] == 4
    assert "2 points" in capsys.readouterr().out


def test_multirun_over_two_dimensions_is_refused_without_grid(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "-m", "precision=fp32,fp16", "tile=b16,b32"]) == 2
    assert "sweeps precision and tile at once" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_sweep_passes_its_own_keys_and_refuses_point_keys():
    sweep.refuse_point_overrides(["sweep=smoke", "sweep.grid=true", "+sweep.points.x={tile: b16}",
                                  "sweep.overrides=[\"train.steps=5\"]", "hydra.verbose=true"], "smoke")
    with pytest.raises(ConfigError, match=r"does not pass tile.block_q=32 train.steps=5 to its points: .*"
                                          r"conf/sweep/smoke.yaml .*'sweep.overrides=\[\"tile.block_q=32\", "
                                          r"\"train.steps=5\"\]'"):
        sweep.refuse_point_overrides(["sweep=smoke", "tile.block_q=32", "train.steps=5"], "smoke")


def test_read_points_reads_the_committed_plan_and_refuses_a_broken_one(tmp_path):
    assert "baseline" in sweep.read_points(PROJECT_ROOT / "params.yaml")["points"]
    (tmp_path / "params.yaml").write_text("sweep: {name: x}\npoints: [baseline]\n")
    with pytest.raises(ConfigError, match="not a sweep plan"):
        sweep.read_points(tmp_path / "params.yaml")


def _kernels(stage: str, op: str, tile: str = "b32", workgroup: str = "w4s2") -> list[str]:
    point = {"config": {"op": {"name": op}, "tile": {"name": tile}, "workgroup": {"name": workgroup}}}
    return sorted(s for s in reads.point_stage_deps(stage, point)["sources"] if s.startswith("posttrainllm/ops"))


def test_a_point_stage_depends_on_its_ops_kernel_only_where_it_runs_it():
    common = reads.op_definition_sources()  # every op's definition and readable math, no kernel
    assert {"posttrainllm/ops/__init__.py", "posttrainllm/ops/registry.py",
            "posttrainllm/ops/attention/definition.py", "posttrainllm/ops/moe/reference.py"} <= set(common)
    assert "posttrainllm/ops/launches.py" not in common  # the kernel stage's guards' alone (its `loads`)
    assert not [f for f in common if f.endswith(("/kernels.py", "/fp8.py"))]
    attention, matmul = "posttrainllm/ops/attention/kernels.py", "posttrainllm/ops/matmul/kernels.py"
    for stage in ("reference", "parity", "receipt"):
        assert _kernels(stage, "attention") == common and _kernels(stage, "moe") == common
    for stage in ("kernel", "microbench", "bench_train"):
        base = [*common, *(["posttrainllm/ops/launches.py"] if stage == "kernel" else [])]  # the guards' counter
        assert _kernels(stage, "attention") == sorted([*base, attention])
        assert _kernels(stage, "moe") == sorted([*base, "posttrainllm/ops/moe/kernels.py"])
        assert _kernels(stage, "decode_attention") == sorted([*base, "posttrainllm/ops/decode_attention/kernels.py"])
        # matmul's autotuner asks ops/autotune.py (every definition stage's: a shared module) for the shared memory,
        # not another op's kernels
        assert _kernels(stage, "matmul") == sorted([*base, matmul])
        assert _kernels(stage, "matmul", tile="auto") == _kernels(stage, "matmul", workgroup="auto") == sorted(
            [*base, matmul])
    assert "posttrainllm/ops/autotune.py" in common


def test_stage_deps_name_the_script_each_file_once_and_the_keys_read():
    point = {"config": {"op": {"name": "attention"}, "tile": {"name": "b32"}, "workgroup": {"name": "w4s2"}}}
    deps = reads.point_stage_deps("microbench", point)
    assert deps["sources"][0] == "pipelines/microbench.py" and len(deps["sources"]) == len(set(deps["sources"]))
    assert "config.tile" in deps["params"] and "config.train" not in deps["params"]
    assert reads.point_stage_deps("receipt", point)["params"] == ["changes", "config"]
    with pytest.raises(ValueError, match="unknown point stage 'device': the point stages are reference, kernel"):
        reads.point_stage_deps("device", point)


def test_write_inputs_writes_every_point_stage_of_the_plan(tmp_path):
    sweep.write_inputs(PROJECT_ROOT / "params.yaml", tmp_path / "inputs", PROJECT_ROOT)
    points = sweep.read_points(PROJECT_ROOT / "params.yaml")["points"]
    written = sorted(p.relative_to(tmp_path / "inputs").as_posix() for p in (tmp_path / "inputs").rglob("*.json"))
    assert written == sorted(f"{name}/{stage}.json" for name in points for stage in sweep.POINT_STAGES)
    made = json.loads((tmp_path / "inputs" / "op-matmul" / "microbench.json").read_text())
    assert made["point"] == "op-matmul" and made["stage"] == "microbench"
    assert "posttrainllm/ops/matmul/kernels.py" in made["sources"] and "posttrainllm/ops/attention/kernels.py" not in made["sources"]
    assert "posttrainllm/measure/curves.py" in made["sources"]  # a folder: every .py file under it
    assert made["params"]["config.op"] == points["op-matmul"]["config"]["op"]


def test_an_ops_own_config_reads_are_listed_for_its_points_only():
    moe = {"config": {"op": {"name": "moe"}, "tile": {"name": "b32"}, "workgroup": {"name": "w4s2"}}}
    attention = {"config": {**moe["config"], "op": {"name": "attention"}}}
    probe = ["config.shape.ops.moe.d_model",
             "config.shape.ops.moe.ffn"]  # ops/moe/definition.py probes grouped_mm at that size
    for stage in ("parity", "bench_train"):
        assert reads.point_stage_deps(stage, moe)["params"][-2:] == probe
        assert not set(probe) & set(reads.point_stage_deps(stage, attention)["params"])
    # the kernel stage reads the whole shape (its compile section: the main case), which covers the probe's keys
    assert "config.shape" in reads.point_stage_deps("kernel", moe)["params"]
    assert not set(probe) & set(reads.point_stage_deps("kernel", moe)["params"])
