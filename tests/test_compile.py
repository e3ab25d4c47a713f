"""The counter, not the story: kernels compiled for a GPU here, their counters read from the cubin (lab/compile.py).

Each compile runs in a child process (Triton in its compiler mode); compiles are cached by Triton, so the fixtures
below share them across tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrainllm.config import ConfigError, SweepConfig, compose
from posttrainllm.lab import compile as compiling
from posttrainllm.lab import sweep
from posttrainllm.lab.configure import validate
from posttrainllm.measure import sass

ROOT = Path(__file__).resolve().parents[1]
EXPLOITS = ROOT / "tests" / "exploits"


def _lab(*overrides: str):
    return validate(compose(list(overrides)))


def _rows(report, path="triton", target="sm90"):
    return [r for r in report["rows"] if r["path"] == path and r["target"] == target]


@pytest.fixture(scope="module")
def fp32_matmul():
    """matmul at fp32 (an `ieee` dot), compiled as launched and without the launch's specialization."""
    lab = _lab("op=matmul", "precision=fp32")
    return compiling.compile_point(lab, ["sm90"]), compiling.compile_point(lab, ["sm90"], specialized=False)


def test_an_ieee_fp32_dot_uses_no_tensor_cores_and_the_launch_is_specialized(fp32_matmul):
    report, _ = fp32_matmul
    rows = _rows(report)
    assert {r["direction"] for r in rows} == {"forward", "backward"} and len(rows) == 3  # C, then dA and dB
    assert all(r["tensor_cores"] == "none" and r["fits"] for r in rows), rows
    # the unit strides are constants and the pointers 16-divisible, as a GPU launch of these tensors gets them
    forward = next(r for r in rows if r["direction"] == "forward")
    assert forward["constexprs"]["stride_ak"] == 1 and forward["specialization"]["a_ptr"] == "16-divisible"
    assert all(set(r["global_loads"]) == {"128"} and r["async_copy"] == "cp.async" for r in rows), rows
    assert report["paths"]["torch"]["note"] == compiling.NOT_TRITON
    # the op's one shared-memory formula at the point's tile (ops/matmul/config.py), beside what each kernel holds
    from posttrainllm.ops.matmul.config import point_smem_bytes

    assert report["smem_bytes"] == {"per_program": point_smem_bytes(_lab("op=matmul", "precision=fp32")),
                                    "rule": "shared_memory"}


def test_without_the_launch_specialization_the_same_kernel_loads_scalars(fp32_matmul):
    """The guard: what a compile that ignores the launch gets (strides as i32, no divisibility): 32-bit scalar
    reads. Ours must not regress to it (the test above: 128-bit reads only)."""
    _, plain = fp32_matmul
    forward = next(r for r in _rows(plain) if r["direction"] == "forward")
    assert forward["global_loads"].get("32", 0) > 0 and "128" not in forward["global_loads"], forward


def test_bf16_compiles_to_warpgroup_mma_with_cp_async_and_128_bit_loads():
    report = compiling.compile_point(_lab("op=attention", "precision=bf16"), ["sm90"])
    rows = _rows(report)
    kernels = {r["kernel"]: r for r in rows}
    assert set(kernels) == {"_attn_fwd_kernel", "_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq"}
    assert kernels["_attn_fwd_kernel"]["direction"] == "forward" and kernels["_attn_bwd_dq"]["direction"] == "backward"
    for name in ("_attn_fwd_kernel", "_attn_bwd_dkdv", "_attn_bwd_dq"):
        assert kernels[name]["tensor_cores"] == "wgmma" and kernels[name]["async_copy"] == "cp.async", kernels[name]
    assert all(r["registers"] > 0 and r["ctas_per_sm"] >= 1 and r["source_sha256"] for r in rows)
    assert kernels["_attn_fwd_kernel"]["file"] == "posttrainllm/ops/attention/kernels.py"


# The forward alone, recorded and compiled in Triton's compiler mode (a child: this process runs the interpreter)
FORWARD_B128_D128 = """
import json, torch
from posttrainllm.lab.compile import compile_launches, recording
from posttrainllm.ops.attention.kernels import triton_attention
q = torch.randn(1, 2, 256, 128, dtype=torch.bfloat16)
with recording() as launches:
    for warps in (4, 8):
        triton_attention(q, q, q, block_q=128, block_kv=64, num_warps=warps, num_stages=2, emulate_bf16=False)
print("ROWS", json.dumps(compile_launches("triton", launches, ["sm90"])))
"""


def test_the_register_rule_agrees_with_the_counters_on_the_forward_at_128_queries_and_head_dim_128():
    """The GPU sweep's tile-b128 forward (bf16, D 128): on 4 warps 255 registers and a spill on sm90, on 8 none. The
    launcher runs the warps it is given; the autotune spaces' register rule (ops/attention/kernels.py tile_words against
    REGISTER_BUDGET) must say the same: over the budget on 4 warps, within it on 8 (conf/sweep/gpu.yaml's b128 point
    runs on w8s3 for this)."""
    from posttrainllm.ops.attention import kernels as attention

    done = subprocess.run([sys.executable, "-c", FORWARD_B128_D128], env={**os.environ, "TRITON_INTERPRET": "0"},
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("ROWS "))[5:])
    spills = {row["num_warps"]: row["spill_bytes"] for row in rows if row["kernel"] == "_attn_fwd_kernel"}
    assert spills[4] > 0 and spills[8] == 0, rows
    assert all(row["tensor_cores"] == "wgmma" and row["async_copy"] == "cp.async" for row in rows), rows
    budget = attention.REGISTER_BUDGET["tensor_cores"]
    assert [attention.tile_words("forward", 128, 64, 128, warps, 2) > budget for warps in (4, 8)] == [True, False]


def test_fp8_on_sm80_is_refused_in_one_line():
    report = compiling.compile_point(_lab("op=matmul", "precision=fp8"), ["sm90", "sm80"])
    (hopper,) = _rows(report, target="sm90")
    (ampere,) = _rows(report, target="sm80")
    assert hopper["tensor_cores"] == "wgmma" and hopper["fits"]
    assert not ampere["fits"] and "\n" not in ampere["reason"] and "fp8e4nv" in ampere["reason"], ampere
    assert ampere["reason"].startswith("does not compile for sm80")
    assert any("_fp8_matmul_kernel (forward, sm80)" in line for line in compiling.not_fitting(report))


def test_a_tile_that_overflows_shared_memory_does_not_fit_and_the_planner_refuses_its_point():
    """At 7 stages and head_dim 64 the forward's own estimate fits (config validation passes: 131 KB), but the
    backward's dK/dV kernel at 128-wide tiles needs more than sm90's 227 KB per block: only the compile says so."""
    plan = sweep.plan(SweepConfig(name="fit", baseline={"op": "attention", "precision": "bf16", "tile": "b32",
                                                        "architecture": "hd64"},
                                  vary={"tile": ["b128"]}, overrides=["workgroup.num_stages=7"]))
    said: list[str] = []
    sweep.refuse_unfit(plan, said.append)
    assert list(plan["points"]) == ["baseline"], said
    refused = plan["refused"]["tile-b128"]
    assert refused["target"] == "sm90" and refused["changes"] == {"tile": "b128"}
    assert any("_attn_bwd_dkdv (backward, sm90)" in r and "B of shared memory per block; sm90 allows 232448 B" in r
               for r in refused["reasons"]), refused
    assert "tile-b128" in sweep.render(plan)


def test_a_user_triton_kernel_is_compiled_and_a_user_path_without_one_says_so():
    lab = _lab("op=rmsnorm", "precision=fp16",
               f'op.user_impls=["mine={EXPLOITS / "rmsnorm_honest_triton.py"}:rmsnorm",'
               f'"plain={EXPLOITS / "rmsnorm_honest_plain.py"}:rmsnorm"]')
    report = compiling.compile_point(lab, ["sm90"])
    (row,) = _rows(report, path="mine")
    assert row["kernel"] == "_rmsnorm_row" and row["fits"] and row["file"].endswith("rmsnorm_honest_triton.py")
    assert report["paths"]["plain"]["note"] == compiling.NOT_TRITON


@pytest.mark.parametrize("name, file, kernels", [("plain", "rmsnorm_honest_plain.py", []),
                                                  ("mine", "rmsnorm_honest_triton.py", ["_rmsnorm_row"])])
def test_the_kernel_stage_compiles_user_paths_once_they_launched_triton(tmp_path, name, file, kernels):
    """With user paths alone (op.only), the kernel stage starts the compile child only where their calls launched
    Triton: a PyTorch path's loop starts no compiler, and its receipt says why there are no rows."""
    from posttrainllm.lab.stages import kernel as kernel_stage, reference as reference_stage
    from posttrainllm.lab.configure import load

    cfg = load(["op=rmsnorm", "device=cpu", "parity.seeds=[0]", "shape.seq_len=16", "shape.edge_seq_lens=[]",
                f'op.user_impls=["{name}={EXPLOITS / file}:rmsnorm"]', f"op.only=[{name}]",
                f"run.out_dir={tmp_path}", f"run.name={name}"])
    reference_stage.run_reference(cfg, tmp_path / name)
    report = kernel_stage.run_kernel(cfg, tmp_path / name)["compile"]
    assert [row["kernel"] for row in report["rows"]] == kernels
    assert report.get("note") == (None if kernels else kernel_stage.NOTHING_TO_COMPILE)


def test_the_cli_writes_compile_json_and_refuses_an_unknown_target(tmp_path, monkeypatch, capsys):
    from posttrainllm import cli

    monkeypatch.chdir(ROOT)  # in-process: the compile itself runs in its child process either way
    run = ["compile", "op=rope", f"run.out_dir={tmp_path}", "run.name=r"]
    assert cli.main(run) == 0, capsys.readouterr().err[-2000:]
    report = json.loads((tmp_path / "r" / "compile.json").read_text())
    assert report["rows"] and all(r["fits"] for r in report["rows"]) and "registers" in capsys.readouterr().out
    assert cli.main([*run, "compile.targets=[sm70]"]) == 2
    assert "choose from sm80, sm90, sm100" in capsys.readouterr().err


def test_the_config_offers_exactly_the_targets_with_limits():
    from posttrainllm.config import COMPILE_TARGETS

    assert set(COMPILE_TARGETS) == set(sass.TARGETS)


def test_an_unknown_target_is_a_config_error():
    with pytest.raises(ConfigError, match="choose from sm80, sm90, sm100"):
        _lab("compile.targets=[sm75]")
    with pytest.raises(ConfigError, match="empty"):
        _lab("compile.targets=[]")


@pytest.mark.parametrize("registers, shared, warps, ctas", [
    (64, 0, 4, 8),  # registers: 64 x 32 = 2048 per warp, 32 warps of 65536: 8 blocks of 4 (warps alone allow 16)
    (255, 0, 8, 1),  # 255 -> 8192 per warp: 8 warps per SM, one block of 8
    (96, 100 * 1024, 4, 2),  # shared: 228 KB / (100 KB + 1 KB) = 2
    (32, 0, 1, 32),  # the per-SM block limit
])
def test_occupancy_follows_the_calculator(registers, shared, warps, ctas):
    assert sass.occupancy(registers, shared, warps, sass.TARGETS["sm90"]) == ctas


def test_a_block_over_the_limits_does_not_fit():
    hopper = sass.TARGETS["sm90"]
    assert sass.fit(255, 227 * 1024, 8, hopper) is None
    assert "allows 232448 B" in sass.fit(128, 228 * 1024, 4, hopper)
    assert "registers" in sass.fit(255, 0, 16, hopper)  # 16 warps x 8192 > 65536


# A user's autotuned GEMM: its first candidate fits sm90, its second stages 8 slabs of (64x128 + 128x64) fp16,
# 256 KB of shared memory, past sm90's 227 KB per block. Written to a test folder, not tests/exploits (a corpus
# test_exploits runs).
AUTOTUNED_USER_GEMM = '''
import torch
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({"BLOCK_K": 32}, num_warps=4, num_stages=2),
                          triton.Config({"BLOCK_K": 128}, num_warps=4, num_stages=8)], key=["K"])
@triton.jit
def _gemm(a, b, c, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + rk
        x = tl.load(a + rm[:, None] * K + ks[None, :], mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
        y = tl.load(b + ks[:, None] * N + rn[None, :], mask=(ks[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(x, y, acc)
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(c.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(a, b):
    a, b = a.contiguous(), b.contiguous()
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    _gemm[lambda meta: (triton.cdiv(M, 64), triton.cdiv(N, 64))](a, b, c, M, N, K, BLOCK_M=64, BLOCK_N=64)
    return c
'''


def test_an_autotuned_kernel_launches_if_one_candidate_fits_and_is_refused_when_none_does(tmp_path):
    """Each candidate of an autotuned launch is compiled and judged on its own (`fits: false` with the bytes and the
    limit); the kernel launches on the target while one candidate fits (the autotuner scores the others as never
    finishing), and the planner's `not_fitting` names it, with each candidate's reason, once none does."""
    (tmp_path / "gemm.py").write_text(AUTOTUNED_USER_GEMM)
    lab = _lab("op=matmul", "precision=fp16", f'op.user_impls=["mine={tmp_path / "gemm.py"}:matmul"]',
               "op.only=[mine]")
    report = compiling.compile_point(lab, ["sm90"])
    small, large = sorted(_rows(report, path="mine"), key=lambda r: r["constexprs"]["BLOCK_K"])
    assert small["autotune"] == large["autotune"] == {"launch": 1, "candidates": 2}
    assert small["fits"] and small["tensor_cores"] == "wgmma", small
    assert not large["fits"] and large["shared_bytes"] > sass.TARGETS["sm90"].shared_per_block, large
    assert large["reason"] == (f"needs {large['shared_bytes']} B of shared memory per block; sm90 allows 232448 B "
                               "(227 KB)")
    assert compiling.not_fitting(report) == []  # the small candidate launches
    (summary,) = report["autotune"]
    assert (summary["candidates"], summary["fit"], summary["not_fitting"]) == (2, 1, {"64x64x128 w4s8":
                                                                                      large["reason"]})
    assert "1 of 2 autotune candidates launch" in compiling.table(report)
    # without the candidate that fits, the launch has none: refused, each candidate's bytes against the limit
    alone = {**report, "rows": [large]}
    assert compiling.not_fitting(alone, "sm90") == [
        f"mine: _gemm (forward, sm90): none of its 2 autotune candidates launches: 64x64x128 w4s8: {large['reason']}"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: the candidates compile one after another")
def test_candidates_compiled_side_by_side_give_the_rows_one_process_gives(tmp_path):
    """The child compiles a launch's kernels in one forked process per CPU it may use (`compile_workers`): each
    row must get its own kernel's counters, in the order one process gives them (the child inherits the affinity)."""
    (tmp_path / "gemm.py").write_text(AUTOTUNED_USER_GEMM)
    lab = _lab("op=matmul", "precision=fp16", f'op.user_impls=["mine={tmp_path / "gemm.py"}:matmul"]',
               "op.only=[mine]", 'compile.targets=[sm80,sm90]')
    everywhere = os.sched_getaffinity(0)
    side_by_side = compiling.compile_point(lab)
    os.sched_setaffinity(0, {min(everywhere)})
    try:
        one_process = compiling.compile_point(lab)
    finally:
        os.sched_setaffinity(0, everywhere)
    timeless = lambda report: [{k: v for k, v in row.items() if k != "compile_s"} for row in report["rows"]]  # noqa
    assert len(side_by_side["rows"]) == 4 and timeless(side_by_side) == timeless(one_process)
    assert [(r["target"], r["constexprs"]["BLOCK_K"], r["fits"]) for r in side_by_side["rows"]] == [
        ("sm80", 32, True), ("sm80", 128, False), ("sm90", 32, True), ("sm90", 128, False)]


def test_under_auto_our_launchers_offer_the_candidates_a_gpu_of_each_target_would_time():
    """tile=auto on CPU tensors, recorded for a target (as the compile child does, nothing compiled): the launcher's
    own space, pruned by that target's shared memory (fp32 128x256x32 at 4 stages, 192 KB, fits sm90's 227 KB, not
    sm80's 163 KB); outside a compile, the fixed configuration alone, as before."""
    import os
    import subprocess
    import sys

    from posttrainllm.ops.matmul.kernels import MATMUL_SPACE, matmul_smem_bytes

    code = """
import json, torch
from posttrainllm.lab.compile import recording
from posttrainllm.measure.sass import TARGETS
from posttrainllm.ops.autotune import autotune_for_target
from posttrainllm.ops.matmul.kernels import triton_matmul
a, b = torch.empty(128, 128), torch.empty(128, 128)
seen = {}
for name in ("sm80", "sm90", None):
    with recording() as launches:
        if name:
            with autotune_for_target(TARGETS[name].shared_per_block):
                triton_matmul(a, b, autotune="tile")
        else:
            triton_matmul(a, b, autotune="tile")
    seen[str(name)] = [[*(l.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")),
                        l.autotune] for l in launches]
print(json.dumps(seen))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("sm80", "sm90"):
        space = [[bm, bn, bk, w, st] for bm, bn, bk, w, st in MATMUL_SPACE
                 if matmul_smem_bytes(bm, bn, bk, st, 4) <= sass.TARGETS[name].shared_per_block]
        assert [c[:5] for c in seen[name]] == space, name
        assert all(c[5] == {"launch": 1, "candidates": len(space)} for c in seen[name]), seen[name]
    assert len(seen["sm90"]) == len(seen["sm80"]) + 1 and [128, 256, 32, 8, 4] in [c[:5] for c in seen["sm90"]]
    assert seen["None"] == [[64, 64, 32, 4, 2, None]]  # no autotuner here: the launcher's fixed configuration


def test_the_reports_fits_column_counts_a_tuned_launch_as_launching_while_one_candidate_fits():
    from posttrainllm.track.report import compiled

    def row(fits, launch=None, regs=128, spill=0):
        return {"path": "triton", "target": "sm90", "kernel": "k", "direction": "forward", "registers": regs,
                "spill_bytes": spill, "shared_bytes": 1024, "tensor_cores": "wgmma", "fits": fits,
                "reason": "" if fits else "needs more",
                **({"autotune": {"launch": launch, "candidates": 2}} if launch else {})}

    def receipt(*rows):
        return {"kernel": {"compile": {"targets": ["sm90"], "rows": list(rows)}}}

    one_fits = compiled(receipt(row(True), row(False, 1, regs=255, spill=64), row(True, 1)))
    assert one_fits["fits"] is True and one_fits["max_regs"] == 255 and one_fits["spill_B"] == 64
    assert compiled(receipt(row(True), row(False, 1), row(False, 1)))["fits"] is False  # no candidate launches
    assert compiled(receipt(row(False), row(True, 1)))["fits"] is False  # a fixed kernel that does not fit
    for rows in ([row(True), row(False, 1), row(True, 1)], [row(True), row(False, 1), row(False, 1)],
                 [row(False), row(True, 1)]):  # the planner refuses exactly what the report marks as not launching
        assert bool(compiling.not_fitting({"rows": rows})) is not compiled(receipt(*rows))["fits"]


def test_a_cubin_is_disassembled_once_and_an_unreadable_cache_entry_is_read_again(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setattr(sass, "CACHE", tmp_path)
    outputs = {"-res-usage": "Function k:\n REG:40 STACK:8 SHARED:0 LOCAL:0", "-sass": "/*0010*/ HMMA.16816.F32 R0"}
    runs = []

    def cuobjdump(args, **_):
        runs.append(args[1])
        return subprocess.CompletedProcess(args, 0, outputs[args[1]], "")

    monkeypatch.setattr(sass.subprocess, "run", cuobjdump)
    first = sass.disassemble(b"cubin")
    assert first == ({"REG": 40, "STACK": 8, "SHARED": 0, "LOCAL": 0}, {"HMMA.16816.F32": 1}) and len(runs) == 2
    assert sass.disassemble(b"cubin") == first and len(runs) == 2  # read from the cache: no tool run
    assert sass.disassemble(b"another cubin") == first and len(runs) == 4  # its own bytes, its own entry
    for entry in tmp_path.glob("*.json"):
        entry.write_text("{not json")
    assert sass.disassemble(b"cubin") == first and len(runs) == 6  # unreadable: disassembled again
