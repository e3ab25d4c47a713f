"""A failed path located, and "cannot run here" told apart from "wrong" (posttrainllm/track/failures.py).

The user paths' cases, through their workers, are in test_user_impls.py; here: whose frame is whose, each pattern
of CANNOT_RUN on the message it names, and a built-in path that raises, located in posttrainllm.
"""

import dataclasses

import pytest
import torch
from conftest import parity_report

from posttrainllm.config import PROJECT_ROOT
from posttrainllm.lab import parity
from posttrainllm.track import failures
from posttrainllm.lab.configure import load
from posttrainllm.ops.matmul import definition as matmul

MATMUL = ["op=matmul", "device=cpu", "parity.seeds=[0]", "shape.ops.matmul.edge=[]", "shape.ops.matmul.m=64",
          "shape.ops.matmul.n=64",
          "shape.ops.matmul.k=64"]


def test_whose_frame_is_whose():
    assert failures.kind(parity.__file__) == failures.LAB
    assert failures.kind(torch.__file__) == failures.LIBRARY
    assert failures.kind(dataclasses.__file__) == failures.LIBRARY  # the standard library
    assert failures.kind("<frozen importlib._bootstrap>") == failures.LIBRARY
    assert failures.kind(__file__) == failures.USER  # a file of the project's outside the package: a user's
    assert failures.kind("/tmp/anywhere/kernel.py") == failures.USER
    assert failures.shown(__file__) == "tests/test_failures.py"
    assert failures.shown(str(PROJECT_ROOT / "posttrainllm" / "cli.py")) == "posttrainllm/cli.py"


def _raise_in_lab():
    parity.row_check(torch.zeros(1), torch.zeros(1), torch.zeros(1), None, tensor_scale=1.0, row_ndim=-1)


def test_the_innermost_frame_of_the_paths_own_code():
    try:
        _raise_in_lab()
    except ValueError as exc:
        mine, lab = failures.locate(exc, user=True), failures.locate(exc, user=False)
    line = _raise_in_lab.__code__.co_firstlineno + 1
    assert mine == {"file": "tests/test_failures.py", "line": line, "text": "parity.row_check(torch.zeros(1), "
                    "torch.zeros(1), torch.zeros(1), None, tensor_scale=1.0, row_ndim=-1)", "function": "_raise_in_lab"}
    assert lab["file"] == "posttrainllm/lab/parity.py" and lab["function"] == "row_check"
    assert lab["text"] == 'raise ValueError(f"row_ndim={row_ndim} must be >= 0")'


def test_the_root_cause_is_read_first():
    """Triton's interpreter re-raises a kernel's error from its own frame: the kernel's line is the cause's."""
    def kernel():
        return None < 1

    try:
        try:
            kernel()
        except TypeError as inner:
            raise RuntimeError(repr(inner)) from inner
    except RuntimeError as exc:
        where = failures.locate(exc, user=True)
    assert where["function"] == "kernel" and where["text"] == "return None < 1"


INTERPRETER = '  File "/venv/lib/python3.11/site-packages/triton/runtime/interpreter.py", line 1511, in __call__\n'


@pytest.mark.parametrize("traceback, pattern", [
    ("RuntimeError: 0 active drivers ([]). There should only be one.\n", "triton_no_driver"),
    ("AssertionError: Torch not compiled with CUDA enabled\n", "torch_without_cuda"),
    ("RuntimeError: PyTorch was compiled without CUDA support\n", "torch_without_cuda"),
    ("RuntimeError: No CUDA GPUs are available\n", "no_cuda_device"),
    ("RuntimeError: No device were detected\n", "no_device"),
    (INTERPRETER + "AttributeError: 'float' object has no attribute 'to'\n", "interpreter_scalar_to"),
    ("AttributeError: 'float' object has no attribute 'to'\n", None),  # plain Python: the path's own error
    ("RuntimeError: 10 active drivers\n", None),
    ("ValueError: Expected pointer argument to have shape\n" + INTERPRETER, None),  # a bad op: wrong everywhere
])
def test_each_pattern_on_the_message_it_names(traceback, pattern):
    gap = failures.classify({"type": "X", "message": "", "where": None, "traceback": traceback})
    assert (gap or {}).get("pattern") == pattern
    if gap:
        assert gap["reason"] and gap["runs_on"].startswith("a ")


def test_libdevice_returning_none_only_where_the_kernel_calls_libdevice(tmp_path):
    text = INTERPRETER + "TypeError: cannot convert None of type <class 'NoneType'> to tensor\n"
    uses, plain = tmp_path / "uses.py", tmp_path / "plain.py"
    uses.write_text("from triton.language.extra import libdevice\n")
    plain.write_text("x = None\n")
    where = {"line": 1, "text": "", "function": "k"}
    for file, pattern in ((uses, "interpreter_libdevice"), (plain, None)):
        gap = failures.classify({"type": "InterpreterError", "message": "", "traceback": text,
                                 "where": {**where, "file": str(file)}})
        assert (gap or {}).get("pattern") == pattern


def test_a_builtin_path_that_raises_is_located_in_posttrainllm(tmp_path, monkeypatch):
    def broken(x, cfg):  # this test's file is no user path's: the innermost posttrainllm frame is the path's
        parity.row_check(x["a"], x["a"], x["a"], None, tensor_scale=1.0, row_ndim=-1)

    monkeypatch.setitem(matmul.IMPLS, "torch", dataclasses.replace(matmul.IMPLS["torch"], fn=broken))
    report = parity_report(load(MATMUL), tmp_path)
    path = report["paths"]["torch"]
    assert path["verdict"] == "fail"
    assert path["error"]["where"]["file"] == "posttrainllm/lab/parity.py"
    assert path["failed_cases"] == ["did not run: ValueError: row_ndim=-1 must be >= 0 (at posttrainllm/lab/parity.py:"
                                    f"{path['error']['where']['line']}: raise ValueError(f\"row_ndim={{row_ndim}} must "
                                    "be >= 0\"))"]
    text = (tmp_path / "tracebacks" / "torch.txt").read_text()
    assert text.startswith("path torch: raised: ValueError: row_ndim=-1 must be >= 0\nlocated: posttrainllm/lab/")
    assert "in broken" in text
