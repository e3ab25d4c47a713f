"""An installed distribution offers a path by entry point (group posttrainllm.impls, `<op>.<name>`): a wheel built
here, installed with pip into a folder, named `entry:<name>` in a bench run in another process; its identity is
the receipt's, and an entry point that is not there, or is another op's, is one line and exit 2."""

import base64
import hashlib
import json
import os
import shutil
import sys
import zipfile

import pytest

from posttrainllm import cli
from posttrainllm.config import PROJECT_ROOT

from conftest import run_command

DIST, VERSION = "tiny-kernels", "0.1.0"
OPS_SOURCE = '"""A matmul from outside the lab."""\n\n\ndef matmul(a, b):\n    return a @ b\n'
QUICK = ["device=cpu", "parity.seeds=[0]", "tile=b16", "shape.m=32", "shape.n=32", "shape.k=32", "shape.edge_mnk=[]",
         "shape.curve=[16,32]", "bench.warmup=1", "bench.reps=2", "bench.min_time_s=0", "run.log_mlflow=false"]


def _wheel(folder):
    """tiny_kernels-0.1.0-py3-none-any.whl, written by hand (no build backend, no index): the package, its
    metadata, the entry point `matmul.tiny = tiny_kernels.ops:matmul` and a RECORD of them all."""
    info = f"tiny_kernels-{VERSION}.dist-info"
    files = {
        "tiny_kernels/__init__.py": "",
        "tiny_kernels/ops.py": OPS_SOURCE,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {DIST}\nVersion: {VERSION}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": "[posttrainllm.impls]\nmatmul.tiny = tiny_kernels.ops:matmul\n",
    }

    def digest(text):
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},sha256={digest(text)},{len(text.encode())}\n" for path, text in files.items())
    files[f"{info}/RECORD"] = record + f"{info}/RECORD,,\n"
    wheel = folder / f"tiny_kernels-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The wheel installed by pip into a folder of its own (offline: no index, no dependencies)."""
    folder = tmp_path_factory.mktemp("tiny_kernels")
    run_command([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                 "--disable-pip-version-check", "--target", folder / "site", _wheel(folder)], folder, os.environ)
    return folder / "site"


def test_an_entry_point_is_a_path_with_its_distribution_in_the_receipt(site, tmp_path, calibration):
    (tmp_path / "runs").mkdir()
    shutil.copy(calibration, tmp_path / "runs" / "calibration.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(PROJECT_ROOT)])}
    done = run_command([sys.executable, "-m", "posttrainllm", "bench", "op=matmul", "op.user_impls=[entry:tiny]",
                        "run.out_dir=runs", "run.name=tiny", *QUICK], tmp_path, env, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    receipt = json.loads((tmp_path / "runs" / "tiny" / "receipt.json").read_text())
    installed = site / "tiny_kernels" / "ops.py"
    assert receipt["user_impls"]["tiny"] == {
        "spec": "entry:tiny", "op": "matmul", "name": "tiny", "source": "entry_point",
        "entry_point": "matmul.tiny = tiny_kernels.ops:matmul", "distribution": DIST, "version": VERSION,
        "file": str(installed.resolve()), "sha256": hashlib.sha256(OPS_SOURCE.encode()).hexdigest()}
    assert installed.read_text() == OPS_SOURCE  # the hash is of the file that ran
    parity = json.loads((tmp_path / "runs" / "tiny" / "parity.json").read_text())["paths"]["tiny"]
    assert parity["verdict"] == "pass" and parity["backward"] == "own", parity
    assert {"out", "grad_a", "grad_b"} <= {case["output"] for case in parity["cases"]}


@pytest.mark.parametrize("args, says", [
    (["op=matmul", "op.user_impls=[entry:nope]"],
     "op.user_impls: 'entry:nope': no installed entry point 'matmul.nope' in group posttrainllm.impls "
     "(installed for matmul: tiny)"),
    (["op=attention", "op.user_impls=[entry:tiny]"],
     "op.user_impls: 'entry:tiny': the entry point 'tiny' is declared for matmul, not for op attention"),
])
def test_an_entry_point_not_there_or_of_another_op_is_refused(site, tmp_path, monkeypatch, capsys, args, says):
    monkeypatch.syspath_prepend(str(site))  # installed, as for the run above; refused before any stage runs
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", *args, "device=cpu", "run.log_mlflow=false"]) == 2
    err = capsys.readouterr().err
    assert err == f"posttrainllm: config error: {says}\n"
    assert not (tmp_path / "runs").exists()
