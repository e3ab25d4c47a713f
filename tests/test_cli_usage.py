"""The CLI forgives: a mistyped command, `--key value`, `--help`, Ctrl-C and the wrong folder each get one line."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from posttrainllm import cli
from posttrainllm.config import PROJECT_ROOT


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A folder that is a project root (it holds dvc.yaml and conf/), as the working directory."""
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "conf").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("typed, closest", [("bnch", "bench"), ("reprot", "report"), ("experimental train-head",
                                                                                      "experimental train-heads")])
def test_an_unknown_command_is_named_with_the_closest_and_every_command(project, capsys, typed, closest):
    assert cli.main([*typed.split(), "op=attention"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"unknown command {typed!r}: did you mean {closest}" in err
    assert all(name in err for name in cli.COMMAND_NAMES)
    assert len(err.splitlines()) == 2 and "usage" not in err  # not the whole help


@pytest.mark.parametrize("args, write", [
    (["--op", "attention"], "write op=attention"),
    (["--op=attention"], "write op=attention"),
    (["tile=b16", "--precision", "bf16"], "write precision=bf16"),
    (["--op.only", "[triton]"], "write op.only=[triton]"),
    (["--tile"], "write tile=VALUE"),
])
def test_dashed_overrides_are_refused_with_the_key_value_to_write(project, capsys, args, write):
    assert cli.main(["bench", *args]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert write in err and len(err.splitlines()) == 1
    assert not (project / "runs").exists()


def test_hydra_flags_and_grid_are_not_dashed_overrides():
    assert cli._dashed_override("bench", ["--grid", "-m", "op=matmul,rmsnorm", "--cfg", "job", "-p", "op"]) is None


@pytest.mark.parametrize("command, does", [
    ("bench", "One point: each path of the op"), ("bench-train", "What bench does, then the end-to-end training"),
    ("sweep", "Plan a sweep"), ("compile", "Every Triton kernel"), ("experimental train-heads", "Medusa draft heads")])
def test_help_says_what_the_command_does_then_the_config(project, capsys, command, does):
    assert cli.main([*command.split(), "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"posttrainllm {command}: {does}")
    intro, _, config = out.partition("== Config ==")
    assert "Common overrides" in intro and f"Example:\n  posttrainllm {command}" in intro
    assert config  # then Hydra's own help: the whole config
    if command == "bench":  # the groups' options, read from conf/
        assert "|attention|attention_noncausal|" in intro and "precision=bf16|" in intro


def test_in_a_subfolder_of_the_project_a_command_refuses_and_names_the_root(project, capsys):
    (project / "kernels").mkdir()
    os.chdir(project / "kernels")
    assert cli.main(["bench", "op=rmsnorm"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"run it from the project root, {project}" in err and len(err.splitlines()) == 1
    assert not (project / "kernels" / "runs").exists()
    assert cli.main(["bench", "--help"]) == 0  # inspecting writes nothing: allowed anywhere


def test_a_conf_folder_alone_above_is_no_project(tmp_path):
    (tmp_path / "home" / "conf").mkdir(parents=True)  # a home folder's own conf/, not a clone of the lab
    (tmp_path / "home" / "work").mkdir()
    assert cli._project_root(tmp_path / "home" / "work") is None
    (tmp_path / "home" / "dvc.yaml").write_text("stages: {}\n")
    assert cli._project_root(tmp_path / "home" / "work") == tmp_path / "home"


def test_outside_any_project_a_command_says_where_it_writes(tmp_path, monkeypatch, calibration, capsys):
    from posttrainllm.lab.stages import reference as reference_stage

    def stop(*args, **kwargs):  # the line came before anything was written; nothing more is needed here
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(reference_stage, "run_reference", stop)
    assert cli._project_root(tmp_path) is None
    _calibrated(tmp_path / "mine", calibration)
    assert cli.main(["bench", "op=rmsnorm", "device=cpu", "run.log_mlflow=false", "run.out_dir=mine"]) == 130
    assert f"{tmp_path} is no project root (no dvc.yaml and conf/ here or above): writing mine/ here" in (
        capsys.readouterr().out)
    _calibrated(tmp_path / "runs" / "bench", calibration)  # said once: a folder that has its runs/ already is the
    # user's choice
    assert cli.main(["bench", "op=rmsnorm", "device=cpu"]) == 130
    assert "no project root" not in capsys.readouterr().out


def test_ctrl_c_in_process_is_one_line_exit_130_and_no_receipt(project, monkeypatch, calibration, capsys):
    from posttrainllm.lab.stages import kernel as kernel_stage

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(kernel_stage, "run_kernel", interrupted)
    _calibrated(project / "runs" / "bench", calibration)
    assert cli.main(["bench", "op=rmsnorm", "device=cpu", "run.name=cut", "run.log_mlflow=false"]) == 130
    err = capsys.readouterr().err
    assert err.splitlines() == ["posttrainllm: interrupted (Ctrl-C): the point in progress has no receipt; its "
                                "finished points keep theirs"]
    assert (project / "runs/bench/cut/reference.pt").exists()
    assert not (project / "runs/bench/cut/receipt.json").exists()


def _calibrated(folder, calibration):
    """folder/calibration.json: this CPU's from the session, which the CLI reuses (same fingerprint), so a command
    reaches its stages without a 12 s calibration of its own."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(calibration, folder / "calibration.json")


def _worker_of(parent: int) -> bool:
    """Whether `parent` has a user path's worker process (Linux: read from /proc)."""
    from pathlib import Path

    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (b"posttrainllm.lab.isolation.worker" in (proc / "cmdline").read_bytes()
                    and int((proc / "stat").read_text().rpartition(")")[2].split()[1]) == parent):
                return True
        except (OSError, ValueError, IndexError):
            continue
    return False


def _as_a_shell_starts_it() -> None:
    """A terminal's command: SIGINT unblocked and at its default, whatever signal state the tests before left this
    process in (under the full suite a bench started from here ignored the Ctrl-C: exit 0, or still running 120 s
    later)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_state() -> str:
    with open("/proc/self/status") as status_file:
        status = status_file.read()
    return " ".join(line for line in status.splitlines() if line.startswith(("SigBlk", "SigIgn")))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the worker process through /proc")
def test_ctrl_c_with_a_user_worker_running_prints_no_traceback(project, calibration):
    """A terminal's Ctrl-C reaches the whole process group: the lab, its user path's worker, the compile child."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    _calibrated(project / "runs" / "bench", calibration)
    assert cli.main(["new-impl", "op=rmsnorm", "k/mine.py"]) == 0
    with (project / "k" / "mine.py").open("a") as mine:  # its calls last until the Ctrl-C, whatever the load
        mine.write("\n\nimport time\n_unhurried = rmsnorm\n\n\ndef rmsnorm(x, weight, eps):\n"
                   "    time.sleep(60)\n    return _unhurried(x, weight, eps)\n")
    bench = subprocess.Popen(
        [sys.executable, "-m", "posttrainllm", "bench", "op=rmsnorm", "device=cpu", "parity.seeds=[0]",
         "shape.seq_len=16", "shape.edge_seq_lens=[]", "shape.curve=[8,16]", "bench.min_time_s=0",
         "op.user_impls=[k/mine.py:rmsnorm]", "op.only=[rmsnorm]", "run.name=cut", "run.log_mlflow=false"],
        cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=_as_a_shell_starts_it)
    # the kernel stage started the path's worker, whose first call sleeps: the Ctrl-C comes mid-call however slowly
    # this test process sees it (under the full suite's load a 6 s bench three times ran to its end, exit 0)
    while not _worker_of(bench.pid) and bench.poll() is None:
        time.sleep(0.05)
    assert bench.poll() is None, f"the bench ended before its user path's worker was seen: {bench.communicate()}"
    os.killpg(bench.pid, signal.SIGINT)
    out, err = bench.communicate(timeout=120)
    assert bench.returncode == 130, (err[-2000:], out[-3000:], f"this test process: {_signal_state()}")
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("posttrainllm: interrupted")
    assert not (project / "runs/bench/cut/receipt.json").exists()
