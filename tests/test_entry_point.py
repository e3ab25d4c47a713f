"""An installed distribution offers a path by entry point (group posttrainllm.impls, `<op>.<name>`): a wheel built
here, installed with pip into a folder, named `entry:<name>` in a bench run in another process; its identity is
the receipt's, and an entry point that is not there, or is another op's, is one line and exit 2."""

import hashlib
import json
import os
import shutil
import sys

import pytest

from posttrainllm import cli
from posttrainllm.config import PROJECT_ROOT

from conftest import install_wheel, run_command

DIST, VERSION = "tiny-kernels", "0.1.0"
OPS_SOURCE = '"""A matmul from outside the lab."""\n\n\ndef matmul(a, b):\n    return a @ b\n'
QUICK = ["device=cpu", "parity.seeds=[0]", "tile=b16", "shape.ops.matmul.m=32", "shape.ops.matmul.n=32",
         "shape.ops.matmul.k=32", "shape.ops.matmul.edge=[]",
         "shape.curve=[16,32]", "bench.warmup=1", "bench.reps=2", "bench.min_time_s=0", "bench.max_reps=12",
         "run.log_mlflow=false"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """tiny_kernels-0.1.0, with the entry point `matmul.tiny = tiny_kernels.ops:matmul`, installed into a folder."""
    return install_wheel(tmp_path_factory.mktemp("tiny_kernels"), DIST, VERSION,
                         {"tiny_kernels/__init__.py": "", "tiny_kernels/ops.py": OPS_SOURCE},
                         "[posttrainllm.impls]\nmatmul.tiny = tiny_kernels.ops:matmul\n")


def test_an_entry_point_is_a_path_with_its_distribution_in_the_receipt(site, tmp_path, calibration):
    (tmp_path / "runs").mkdir()
    shutil.copy(calibration, tmp_path / "runs" / "calibration.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(PROJECT_ROOT)])}
    done = run_command([sys.executable, "-m", "posttrainllm", "bench", "op=matmul", "op.user_impls=[entry:tiny]",
                        "op.only=[tiny]", "run.out_dir=runs", "run.name=tiny", *QUICK], tmp_path, env, check=False)
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
