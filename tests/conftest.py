"""Shared test setup.

Without a GPU, Triton kernels run through its interpreter. The mode is fixed when
`@triton.jit` runs, so the variable is set here, before any kernel module is imported.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from posttrainllm.ops import fast_language_patching_in_interpreter

    fast_language_patching_in_interpreter()  # as every stage's `prepare` does (measure/device.py)

# The longest modules first, longest first (pytest-xdist keeps the collection order: pyproject.toml), so the two
# workers start on the two ~150 s DVC-pipeline modules at once and the short ones fill in at the end instead of a
# long one running on alone. Their test time in a full run on 2 cores, 2026-12-02 15:25 (seconds): only an order;
# a stale figure costs balance, never a test.
SLOWEST_FIRST = {"test_dvc_deps.py": 154, "test_pipeline.py": 151, "test_gpucheck.py": 49, "test_parity.py": 46,
                 "test_user_impls.py": 40, "test_compile.py": 40, "test_exploits.py": 38, "test_cli.py": 32,
                 "test_replay.py": 32, "test_moe_op.py": 29, "test_library_contracts.py": 29}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -SLOWEST_FIRST.get(item.path.name, 0))  # stable: the rest stay as collected


WORKER_MODULES = ("posttrainllm.lab.isolation.worker",)  # where the worker lives


@pytest.fixture(scope="module", autouse=True)
def _no_worker_outlives_its_module(request):
    """After each test module: no user path's worker, nor any process one started, is left below this process's
    zygote (lab/isolation/worker.py `alive`); any left is ended and the module fails at teardown, naming them. (A module
    that never imported the worker started none.)"""
    yield
    import sys

    module = next((sys.modules[name] for name in WORKER_MODULES if name in sys.modules), None)
    left = module.alive() if module is not None else []
    if left:
        module.close_all()
        pytest.fail(f"{len(left)} worker process(es) outlived {request.node.name} (pids {', '.join(map(str, left))}): "
                    "a stage, bench or test must end its workers (worker.closed_after, worker.close_all)",
                    pytrace=False)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory) -> str:
    """One sqlite MLflow store for the session (a fresh store costs ~5 s of migrations)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def run_command(args, cwd, env, check=True, timeout=900):
    """A subprocess whose failure shows the tail of its output."""
    import subprocess

    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode:
        raise AssertionError(f"{' '.join(map(str, args))} exited {done.returncode}\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-3000:]}")
    return done


@pytest.fixture(scope="session")
def calibration(tmp_path_factory):
    """One short calibration of this CPU for the session (the CLI reuses it when the fingerprint matches)."""
    import json

    from posttrainllm.measure import calibrate
    from posttrainllm.measure import device as devices

    path = tmp_path_factory.mktemp("calibration") / "calibration.json"
    devices.prepare("cpu", 1)
    path.write_text(json.dumps(calibrate.calibrate("cpu", budget_s=1.0)))
    return path


@pytest.fixture(scope="session")
def sweep_runs(tmp_path_factory, calibration):
    """A real (shrunk) smoke sweep's runs/ folder, every stage of both points run, MLflow absent: built once a
    session (tests/test_sweep_folder.py build_runs) for the files that read it (test_sweep_folder, test_report_html)."""
    from test_sweep_folder import build_runs

    return build_runs(tmp_path_factory.mktemp("sweep"), calibration)


@pytest.fixture(scope="session")
def project_copy(tmp_path_factory, mlflow_uri):
    """make(name, sweep=..., edit=None, env=None) -> (root, env): a committed copy of the working tree as git
    sees it (tracked files and new ones not ignored), `edit(root)` applied, the sweep planned into params.yaml."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from posttrainllm.config import PROJECT_ROOT

    def make(name, *, sweep, edit=None, env=None):
        root = tmp_path_factory.mktemp(name)
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=PROJECT_ROOT, capture_output=True, text=True, check=True).stdout.split("\0")
        for file in filter(None, listed):
            if (PROJECT_ROOT / file).is_file():
                (root / file).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(PROJECT_ROOT / file, root / file)
        if edit is not None:
            edit(root)
        environ = {**os.environ, **(env or {}), "MLFLOW_TRACKING_URI": mlflow_uri, "PYTHONPATH": str(root),
                   "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        environ.pop("DVC_ROOT", None)
        environ.pop("TRITON_INTERPRET", None)  # the stages set it themselves on a machine without CUDA
        git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
        run_command(["git", "init", "-q"], root, environ)
        run_command([sys.executable, "-m", "posttrainllm", "sweep", f"sweep={sweep}"], root, environ)
        run_command([*git, "add", "-A"], root, environ)
        run_command([*git, "commit", "-qm", f"{sweep} sweep"], root, environ)
        return root, environ

    return make


def short_calibration(root) -> None:
    """A project copy's calibrate stage within 1 s of measuring instead of 12 (posttrainllm/measure/calibrate.py
    DEFAULT_BUDGET_S; it measured for ~7 s), as the session's `calibration`: for copies whose tests do not judge the peaks."""
    calibrate = root / "posttrainllm" / "measure" / "calibrate.py"
    source = calibrate.read_text()
    budget = "DEFAULT_BUDGET_S = 12.0"
    assert source.count(budget) == 1, "the calibration budget's line moved"
    calibrate.write_text(source.replace(budget, "DEFAULT_BUDGET_S = 1.0"))


def kernel_mutant(tmp_path, module: str, original: str, planted: str):
    """An op's kernels (posttrainllm/ops/<module>/kernels.py; fp8_<op>: ops/<op>/fp8.py; else ops/<module>.py) with
    one line replaced, imported from a copy: a planted bug in the real source.

    The line must exist exactly once, so a refactor cannot turn a planted bug into a silent no-op.
    """
    import importlib.util

    from posttrainllm.config import PROJECT_ROOT

    ops = PROJECT_ROOT / "posttrainllm" / "ops"
    if module.startswith("fp8_"):
        file = ops / module[len("fp8_"):] / "fp8.py"
    else:  # an op's kernels, or a module the ops share (quantize: fp8's readable math)
        file = ops / module / "kernels.py" if (ops / module).is_dir() else ops / f"{module}.py"
    source = file.read_text()
    assert source.count(original) == 1, f"mutation target not found once in {module}.py: {original!r}"
    path = tmp_path / f"mutant_{module}.py"
    path.write_text(source.replace(original, planted))
    spec = importlib.util.spec_from_file_location(f"mutant_{module}_{tmp_path.name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parity_report(cfg, out) -> dict:
    """reference -> kernel -> parity of one point into `out`; parity.json (written also when a contract broke)."""
    from posttrainllm.lab.stages import reference as reference_stage

    reference_stage.run_reference(cfg, out)
    return kernel_and_parity(cfg, out)


def install_wheel(folder, dist: str, version: str, files: dict, entry_points: str = ""):
    """A wheel of `files` ({path in the wheel: text}) written by hand (no build backend, no index) with its
    metadata, entry points and RECORD, installed by pip into folder/site (offline, no dependencies): that folder,
    for PYTHONPATH."""
    import base64
    import hashlib
    import os
    import sys
    import zipfile

    package = dist.replace("-", "_")
    info = f"{package}-{version}.dist-info"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    if entry_points:
        files[f"{info}/entry_points.txt"] = entry_points

    def digest(text):
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},sha256={digest(text)},{len(text.encode())}\n" for path, text in files.items())
    files[f"{info}/RECORD"] = record + f"{info}/RECORD,,\n"
    wheel = folder / f"{package}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    run_command([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                 "--disable-pip-version-check", "--target", folder / "site", wheel], folder, os.environ)
    return folder / "site"


@pytest.fixture
def without_compile_child(monkeypatch):
    """The kernel stage without its compile child (lab/compile.py: a second process that imports torch and Triton and
    compiles the point's kernels for a GPU, ~4 s of CPU per stage): for tests of what parity concludes, which never read
    kernel.json's `compile` section (tests/test_compile.py runs the stage with it)."""
    from posttrainllm.lab.stages import kernel as kernel_stage

    monkeypatch.setattr(kernel_stage, "_start_compile", lambda op, cfg, out: None)


@pytest.fixture(scope="session")
def shared_reference(tmp_path_factory):
    """(args, out) -> load(args), with the reference stage of that config (inputs, float64 oracle, baseline) copied
    into `out`: run once per session and config, for tests that change a path only (a planted bug: the reference's
    inputs and oracle do not depend on it), never one that patches the inputs or the reference math; then
    `kernel_and_parity(cfg, out)`."""
    import shutil

    from posttrainllm.lab.stages import reference as reference_stage
    from posttrainllm.lab.configure import load

    folders = {}

    def copy_into(args, out):
        if tuple(args) not in folders:
            folders[tuple(args)] = tmp_path_factory.mktemp("reference")
            reference_stage.run_reference(load(list(args)), folders[tuple(args)])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(folders[tuple(args)] / "reference.pt", out / "reference.pt")
        return load(list(args))

    return copy_into


def kernel_and_parity(cfg, out) -> dict:
    """parity_report's kernel -> parity on a reference already in `out` (shared_reference)."""
    import json

    from posttrainllm.lab.stages import common as stage_common, kernel as kernel_stage, parity as parity_stage

    kernel_stage.run_kernel(cfg, out)
    try:
        parity_stage.run_parity(cfg, out)
    except stage_common.ContractBroken:
        pass
    return json.loads((out / "parity.json").read_text())


@pytest.fixture
def without_invariance_reruns(monkeypatch):
    """The kernel stage without its bitwise reruns (lab/invariance.py measure: the main case again and in other
    batches, a third of a planted bug's interpreter time; tests/test_invariance.py tests them), for planted-bug tests:
    parity judges those properties where a path promises them (our Triton paths do) or parity.require asks; here
    no path promises any and the stub refuses a point that requires one, so the verdict comes from the cases alone."""
    from posttrainllm.lab import invariance

    def unmeasured(op, impl, record, first, cfg, device):
        assert not cfg.parity.require, "this point judges invariance"
        return {}

    monkeypatch.setattr(invariance, "measure", unmeasured)
    monkeypatch.setattr(invariance, "promises_of", lambda impl, recorded: [])
