"""Provenance that does not lie, and measurement that does not chatter or wait.

- the git revision is the project's own, wherever a command runs from;
- a Hydra multirun writes nothing a clean checkout would show (`git status --porcelain`);
- the device stage's fingerprint is the same JSON without importing torch;
- CPU memory and step profiles print no Kineto `USDT: profiler_start/stop` lines.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from posttrainllm import cli
from posttrainllm.config import PROJECT_ROOT
from posttrainllm.measure import device, memory
from posttrainllm.track.provenance import git_revision

GIT = ["git", "-c", "user.email=test@example.invalid", "-c", "user.name=test", "-c", "commit.gpgsign=false"]


def _git(cwd, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def _project_revision() -> str:
    if shutil.which("git") is None or not (PROJECT_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    return _git(PROJECT_ROOT, "rev-parse", "HEAD")


@pytest.fixture
def other_repo(tmp_path):
    """An unrelated git repository with one commit and the project's .gitignore."""
    shutil.copy(PROJECT_ROOT / ".gitignore", tmp_path / ".gitignore")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".gitignore")
    _git(tmp_path, "commit", "-qm", "other")
    return tmp_path


@pytest.mark.parametrize("where", ["outside any repository", "inside another repository"])
def test_revision_is_the_projects_wherever_the_command_runs(where, tmp_path, other_repo, monkeypatch):
    project = _project_revision()
    monkeypatch.delenv("DVC_ROOT", raising=False)
    cwd = other_repo if where == "inside another repository" else tmp_path / "elsewhere"
    cwd.mkdir(exist_ok=True)
    monkeypatch.chdir(cwd)
    if where == "inside another repository":
        assert _git(cwd, "rev-parse", "HEAD") != project
    else:
        monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # the tmp folder is in no repository
    assert git_revision()["revision"] == project


def _no_point(cfg) -> None:
    """The bench job, minus the work: what is left is what Hydra itself writes."""


def test_hydra_multirun_leaves_git_status_unchanged(other_repo, monkeypatch):
    monkeypatch.chdir(other_repo)
    monkeypatch.setitem(cli.COMMANDS, "bench", _no_point)
    before = _git(other_repo, "status", "--porcelain", "--untracked-files=all")
    assert cli.main(["bench", "-m", "precision=fp32,fp16", "device=cpu", "run.log_mlflow=false"]) == 0
    assert _git(other_repo, "status", "--porcelain", "--untracked-files=all") == before == ""
    assert (other_repo / "runs" / "bench" / "multirun.yaml").exists()  # under the ignored runs/, with the points


def _in_a_fresh_process(code: str, **popen) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=PROJECT_ROOT, **popen)
    return json.loads(done.stdout)


LIGHT = ("import json, sys; from posttrainllm.measure import device; fp = device.machine_fingerprint(); "
         "print(json.dumps({'json': json.dumps(fp), 'torch_imported': 'torch' in sys.modules}))")
TORCH = ("import json; from posttrainllm.measure import device; "
         "print(json.dumps({'json': json.dumps(device.fingerprint(device.resolve('auto')))}))")


@pytest.mark.parametrize("cpus", ["all", "one"])
def test_device_stage_fingerprint_is_torchs_own_without_importing_torch(cpus):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_", "KMP_", "GOMP_"))}
    first = min(os.sched_getaffinity(0))
    pin = (lambda: os.sched_setaffinity(0, {first})) if cpus == "one" else None  # torch's default follows it
    light = _in_a_fresh_process(LIGHT, env=env, preexec_fn=pin)
    assert light["json"] == _in_a_fresh_process(TORCH, env=env, preexec_fn=pin)["json"]  # same fields, order, values
    if device._fingerprint_from_files() is not None:  # Linux x86-64, no GPU: the quick path applies
        assert light["torch_imported"] is False


def test_thread_settings_make_the_fingerprint_ask_torch():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    light = _in_a_fresh_process(LIGHT, env=env)
    assert json.loads(light["json"])["threads"] == 1 and light["torch_imported"] is True


def _step_with_ranges() -> None:
    from torch.profiler import record_function

    x = torch.randn(64, 64, requires_grad=True)
    with record_function("posttrainllm::linear"):
        y = x @ x
    with record_function("posttrainllm::attention"):
        z = torch.softmax(y, -1)
    z.sum().backward()


def test_cpu_profiles_print_no_kineto_lines(capfd):
    from posttrainllm.model.train import profile_step

    capfd.readouterr()
    assert memory.peak_bytes(lambda: torch.ones(1 << 20).sum(), "cpu")["peak_bytes"] >= 4 << 20
    profile = profile_step(_step_with_ranges, cuda=False)
    assert profile["step_us"] > 0 and profile["linear"]["calls"] == 1 and profile["linear"]["backward_us"] > 0
    out, err = capfd.readouterr()
    assert "USDT" not in err + out and "profiler_start" not in err + out


def test_cpu_peak_is_the_same_without_kineto():
    from posttrainllm.ops.attention import reference

    q, k, v = (torch.randn(1, 4, 256, 32) for _ in range(3))
    calls = {"naive attention": lambda: reference.attention(q, k, v, causal=True),
             "temporary": lambda: torch.ones(1 << 20).sum()}
    for name, fn in calls.items():
        fn()
        with torch.no_grad():
            assert (memory.peak_live_bytes(memory.allocation_events(fn))
                    == memory.peak_live_bytes(memory._kineto_allocation_events(fn))), name
