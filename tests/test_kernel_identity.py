"""The kernel in the receipt: every Triton kernel a user path launches, from an installed distribution behind a
three-line adapter, named with its file, the sha256 of its source, its distribution and version; the kernel stage's
stamp hashes that file and a planned sweep lists it in the inputs of the stages that run the path."""

import hashlib
import os
import shutil

import pytest

from posttrainllm.config import PROJECT_ROOT, point_config
from posttrainllm.lab import compile as compiling
from posttrainllm.lab import reads, sweep
from posttrainllm.lab.configure import load
from posttrainllm.lab.pipeline import POINT_STAGES
from posttrainllm.track import stamp

from conftest import install_wheel

DIST, VERSION = "tiny-triton", "0.2.0"
KERNELS = '''"""silu(gate) * up in one Triton kernel, as a library ships it."""

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate, up):
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    _silu_mul_kernel[(triton.cdiv(gate.numel(), 128),)](gate, up, out, gate.numel(), BLOCK=128)
    return out
'''
ADAPTER = "from tiny_triton.kernels import silu_mul\n\n\ndef swiglu(gate, up):\n    return silu_mul(gate, up)\n"
SMALL = ["device=cpu", "op=swiglu", "parity.seeds=[0]", "tile=b16", "shape.seq_len=32", "shape.edge_seq_lens=[]",
         "shape.curve=[16,32]"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return install_wheel(tmp_path_factory.mktemp("tiny_triton"), DIST, VERSION,
                         {"tiny_triton/__init__.py": "", "tiny_triton/kernels.py": KERNELS})


@pytest.fixture
def adapter(site, tmp_path, monkeypatch):
    """The user's file importing the library's kernel; the library importable here and in every child process."""
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")]))
    path = tmp_path / "adapter.py"
    path.write_text(ADAPTER)
    return path


def _identity(site):
    installed = (site / "tiny_triton" / "kernels.py").resolve()
    source = KERNELS[KERNELS.index("def _silu_mul_kernel"):KERNELS.index("\n\n\ndef silu_mul")] + "\n"  # jit.src
    expected = {"kernel": "_silu_mul_kernel", "file": str(installed), "distribution": DIST, "version": VERSION}
    return installed, expected, source


def test_a_user_paths_installed_kernel_is_named_with_file_source_hash_and_distribution(site, adapter, tmp_path):
    cfg = load([*SMALL, f"op.user_impls=[{adapter}:swiglu]", "op.only=[swiglu]"])
    report = compiling.compile_point(cfg, [])  # the launches recorded, nothing compiled
    installed, expected, source = _identity(site)
    [kernel] = report["paths"]["swiglu"]["kernels"]
    assert {k: kernel[k] for k in expected} == expected
    assert kernel["source_sha256"] == hashlib.sha256(source.encode()).hexdigest()  # the kernel's, not the file's
    assert report["rows"] == []

    found = compiling.kernel_files(report)  # the kernel stage's stamp hashes it (lab/reads.py outside_sources)
    assert found == {str(installed): hashlib.sha256(installed.read_bytes()).hexdigest()}
    assert stamp.stage_sources("kernel", outside=found)[str(installed)] == found[str(installed)]
    assert str(installed) not in stamp.loaded_sources()  # no global: a stage passes what it ran (lab/pipeline.py)


def test_a_planned_point_lists_the_kernel_file_and_an_edit_reruns_the_stages_that_run_it(site, adapter, tmp_path):
    for folder in ("pipelines", "posttrainllm"):
        shutil.copytree(PROJECT_ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    mine = point_config(load([*SMALL, f"op.user_impls=[{adapter}:swiglu]"]))
    params = {"points": {"mine": {"changes": {}, "config": mine},
                         "plain": {"changes": {}, "config": point_config(load(SMALL))}}}
    said = []
    sweep.find_kernel_files(params, say=said.append)
    installed, _, _ = _identity(site)
    assert params["points"]["mine"]["kernel_files"] == [str(installed)]
    assert "kernel_files" not in params["points"]["plain"]  # no user path: no child, nothing listed
    assert str(installed) in said[0]

    def inputs():
        return {stage: sweep.stage_inputs("mine", stage, params["points"]["mine"], tmp_path) for stage in POINT_STAGES}

    before = inputs()
    original = installed.read_text()
    try:
        installed.write_text(original.replace("BLOCK: tl.constexpr", "BLOCK: tl.constexpr,"))  # an edit to the library
        after = inputs()
    finally:
        installed.write_text(original)
    assert {stage for stage in POINT_STAGES if after[stage] != before[stage]} == set(reads.USER_STAGES)


def test_a_kernel_file_the_plan_did_not_list_refuses_the_stamp_and_says_plan_again():
    ran = {"stage": "kernel", "sources": {"posttrainllm/lab/stages/kernel.py": "a", "/site/lib/ops/rope.py": "b"}}
    listed = {"sources": {"posttrainllm/lab/stages/kernel.py": "a"}, "params": {}}
    with pytest.raises(stamp.StampMismatch, match=r"ran with /site/lib/ops/rope.py.*plan the sweep again"):
        stamp.check_inputs(ran, listed, "runs/inputs/mine/kernel.json")
    with pytest.raises(stamp.StampMismatch, match="declare it in posttrainllm/lab/reads.py STAGES"):
        stamp.check_inputs({"stage": "kernel", "sources": {"posttrainllm/new.py": "c"}}, listed, "here")
