"""One way to call a path (lab/runner.py): the stages call every path through its runner and never branch on where
a path came from; each runner records what its path needs, and an unknown runner is refused."""

import ast

import pytest

from posttrainllm.config import PROJECT_ROOT
from posttrainllm.lab import runner
from posttrainllm.lab.configure import load
from posttrainllm.ops.registry import get_op
from posttrainllm.ops.base import IN_PROCESS, ISOLATED, Impl

# the lab's stage code: every module of lab/ but the runner and the isolation it drives, and the stage scripts
STAGE_MODULES = sorted({*(PROJECT_ROOT / "posttrainllm" / "lab").glob("*.py"), *(PROJECT_ROOT / "pipelines").glob("*.py")}
                       - {PROJECT_ROOT / "posttrainllm" / "lab" / "runner.py"})
ORIGIN_ATTRIBUTES = {"user", "runner", "user_path"}  # Impl.user, Impl.runner, a function's attribute
ORIGIN_NAMES = {"USER_KIND", "ISOLATED", "IN_PROCESS", "InProcess", "Isolated"}
ORIGIN_STRINGS = {"user", "isolated", "in_process"}


def origin_branches(source: str, name: str = "<source>") -> list[str]:
    """Where `source` asks where a path came from: an Impl's origin fields read (impl.user, .source, .runner), the
    runners' or the origin constants' names, `isinstance` on a runner, a record's "user" key, a kind compared with
    "user", or the isolation's timing called directly (`outside`, the worker) instead of through a runner."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and (node.attr in ORIGIN_ATTRIBUTES or (  # impl.source: the path's
                node.attr == "source" and "impl" in ast.unparse(node.value))) and not (
                isinstance(node.value, ast.Name) and node.value.id == "runner"):
            found.append(f"{where}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in ORIGIN_NAMES:
            found.append(f"{where}: {node.id}")
        elif isinstance(node, ast.Constant) and node.value in ORIGIN_STRINGS:
            found.append(f"{where}: {node.value!r}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{where}: imports {n}" for n in names if n and n.split(".")[-1] in {"outside", "worker"}]
    return found


def test_no_stage_branches_on_where_a_path_came_from():
    found = [hit for path in STAGE_MODULES
             for hit in origin_branches(path.read_text(), path.relative_to(PROJECT_ROOT).as_posix())]
    assert found == []


@pytest.mark.parametrize("planted", [
    "if impl.user is not None:\n    pass",
    "x = [i for i in paths if i.kind == 'user']",
    "entry.get('user') and entry['launched']",
    "if impl.runner == ISOLATED:\n    pass",
    "from posttrainllm.lab.isolation import outside",
    "fn = impl.fn.user_path",
    "if impl.source is None:\n    pass",
    "if isinstance(run, Isolated):\n    pass",
])
def test_the_origin_check_finds_a_planted_branch(planted):
    assert origin_branches(planted)


def test_each_path_has_the_runner_it_needs(tmp_path):
    spec = tmp_path / "mine.py"
    spec.write_text("import torch\n\ndef rms(x, w, *, eps):\n    return torch.nn.functional.rms_norm(x, x.shape[-1:], w, eps)\n")
    cfg = load(["op=rmsnorm", "device=cpu", f"op.user_impls=[{spec}:rms]"])
    paths = runner.paths(get_op("rmsnorm"), cfg)
    assert paths["rms"].runner == ISOLATED and paths["rms"].source.name == "rms"
    assert {impl.runner for name, impl in paths.items() if name != "rms"} == {IN_PROCESS}
    isolated, in_process = runner.runner_for(paths["rms"]), runner.runner_for(paths["reference"])
    assert isinstance(isolated, runner.Isolated) and type(in_process) is runner.InProcess
    assert isolated.identity() == {"user": paths["rms"].user} and in_process.identity() == {}
    assert isolated.kernels_known_by_launch and isolated.may_launch_triton
    assert not in_process.kernels_known_by_launch and not in_process.may_launch_triton
    with pytest.raises(Exception, match="user_impls"):  # the registry alone cannot make a path from outside
        get_op("rmsnorm").paths(cfg)


def test_an_unknown_runner_is_refused_with_the_valid_choices():
    impl = Impl("odd", "peer", lambda x, cfg: x, runner="remote")
    with pytest.raises(ValueError, match="valid choices are in_process, isolated"):
        runner.runner_for(impl)
