"""Fresh device loops need approval on a GPU (lab/approval.py); the GPU is faked by the resolved device."""

import pytest

from posttrainllm import cli
from posttrainllm.lab.configure import load
from posttrainllm.lab import approval, gpucheck, pipeline, sweep
from posttrainllm.measure import device as devices
from posttrainllm.ops.registry import get_op

SMALL = ["parity.seeds=[0]", "bench.reps=3", "bench.min_time_s=0.5", "shape.curve=[64,128]"]


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """`auto` (and `cuda`) resolve to a GPU; nothing may start: the stages and the commands' jobs raise."""
    import importlib

    monkeypatch.setattr(devices, "resolve", lambda name: "cuda" if name in ("auto", "cuda") else name)
    monkeypatch.setattr(devices, "check_available", lambda name: None)

    def forbidden(*args, **kwargs):
        raise AssertionError("work started before approval")

    for stage in ("reference", "kernel", "parity", "microbench", "bench_train"):
        monkeypatch.setattr(importlib.import_module(f"posttrainllm.lab.stages.{stage}"), f"run_{stage}", forbidden)
    monkeypatch.delenv(approval.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_cpu_needs_no_approval():
    lab = load(["device=cpu"])
    assert approval.check([lab], train=True, what="bench") is None


def test_bench_on_a_gpu_refuses_without_approval_and_states_the_estimate(gpu, monkeypatch, capsys):
    assert cli.main(["bench", "device=auto", *SMALL]) == 2
    err = capsys.readouterr().err.strip()
    op, lab = get_op("attention"), load(["device=auto", *SMALL])
    paths = len(op.paths(lab))  # the registry as it stands for this point (the SDPA backends that run here)
    trained = len(op.train_impls(lab))  # backend-pinned peers are timed, not trained
    loops = paths * (2 + 2)  # forward and forward+backward on the point's shape, and two curve sizes
    assert err == (f"posttrainllm: not approved: posttrainllm bench would run timing loops on the GPU: 1 point(s): "
                   f"{loops} timing loops, at least ~{loops * 0.5:.0f} s of device time; approve with "
                   "run.approve=true or POSTTRAINLLM_APPROVE=1")
    assert not (gpu / "runs").exists()  # nothing written
    # a multirun counts every point; bench-train its training steps too
    assert cli.main(["bench-train", "-m", "device=auto", *SMALL, "precision=fp32,fp16", "train.steps=4",
                     "train.warmup_steps=1"]) == 2
    assert f"2 point(s): {2 * loops} timing loops + {2 * trained * 4} training steps" in capsys.readouterr().err
    # a --grid multirun launches the product of its sweeps (2 x 2 points here), not their sum
    assert cli.main(["bench", "-m", "--grid", "device=auto", *SMALL, "precision=fp32,fp16", "tile=b32,b64"]) == 2
    assert f"4 point(s): {4 * loops} timing loops" in capsys.readouterr().err
    # experimental train-heads: the base's and the heads' training steps, and the decode measurement
    assert cli.main(["experimental", "train-heads", "device=auto"]) == 2
    assert "posttrainllm experimental train-heads would run timing loops on the GPU: 1 point(s): 2 timing loops + " \
           in capsys.readouterr().err
    # the CPU, named explicitly, needs none (the job itself is replaced: nothing may run here)
    ran = []
    monkeypatch.setitem(cli.COMMANDS, "bench", lambda cfg: ran.append(cfg))
    assert cli.main(["bench", "device=cpu", *SMALL]) == 0 and len(ran) == 1


@pytest.mark.parametrize("how", ["override", "environment"])
def test_approval_lets_the_command_start_and_prints_the_estimate(gpu, monkeypatch, capsys, how):
    ran = []
    monkeypatch.setitem(cli.COMMANDS, "bench", lambda cfg: ran.append(cfg))
    args = ["bench", "device=auto", *SMALL]
    if how == "override":
        args.append("run.approve=true")
    else:
        monkeypatch.setenv(approval.ENV, "1")
    assert cli.main(args) == 0 and len(ran) == 1
    assert "posttrainllm: approved: 1 point(s):" in capsys.readouterr().err


def test_inspecting_the_config_needs_no_approval(gpu, capsys):
    assert cli.main(["bench", "device=auto", "--cfg", "job"]) == 0
    assert "approve: false" in capsys.readouterr().out


def test_a_timed_dvc_stage_refuses_without_approval(gpu, monkeypatch, capsys):
    sweep.write_params(sweep.plan(load(["sweep=default"]).sweep), pipeline.PARAMS)  # device: auto
    point = next(iter(sweep.read_points(pipeline.PARAMS)["points"]))
    assert pipeline.run_stage("microbench", [point]) == 2
    err = capsys.readouterr().err
    assert f"not approved: stage microbench {point} would run timing loops on the GPU" in err
    assert "POSTTRAINLLM_APPROVE=1" in err and not (gpu / "runs").exists()
    cfg, _ = pipeline.load_point(point)
    assert pipeline._approved("bench_train", point, cfg) is False
    assert "training steps" in capsys.readouterr().err
    monkeypatch.setenv(approval.ENV, "1")
    assert pipeline._approved("microbench", point, cfg) is True
    assert "approved: microbench" in capsys.readouterr().err


def test_the_prepared_gpu_check_prints_its_estimate_and_needs_approve(gpu, monkeypatch, capsys):
    monkeypatch.setattr(devices, "prepare", lambda name, threads=0: name)
    assert gpucheck.main([str(gpu / "out"), "--no-train"]) == 2
    captured = capsys.readouterr()
    assert "posttrainllm gpucheck: gpu_check sweep on cuda:" in captured.out and "timing loops" in captured.out
    # a rough estimate per point, in the order they run
    table = [line.split()[0] for line in captured.out.splitlines()[2:]]
    assert table == ["(calibrate)", "baseline", "op-matmul", "op-matmul_tile-b128", "op-matmul_tile-b128_precision-fp8",
                     "op-attention_noncausal", "tile-auto"]
    assert "not approved: these timing loops need --approve or POSTTRAINLLM_APPROVE=1" in captured.err
    assert not (gpu / "out").exists()


def test_loops_count_every_curve_axis_and_mode_and_the_rough_estimate_follows_the_config():
    moe = get_op("moe")
    lab = load(["op=moe", "device=cpu"])
    sizes = sum(len(axis.sizes(lab)) for axis in moe.curve_axes)  # tokens, and experts at fixed active params
    assert sizes == 4 + 4  # shape.ops.moe.curve and expert_curve
    assert approval.estimate([lab], train=False).loops == len(moe.paths(lab)) * (2 + sizes)
    both = load(["op=moe", "device=cpu", "bench.curve_backward=true"])
    assert approval.estimate([both], train=False).loops == len(moe.paths(lab)) * (2 + 2 * sizes)
    assert approval.rough_seconds(both, train=False) > approval.rough_seconds(lab, train=False)
    # the autotuner's compile-and-time pass, and bench-train, are counted
    plain, auto = load(["tile=b64"]), load(["tile=auto"])
    assert approval.rough_seconds(auto, train=False) - approval.rough_seconds(plain, train=False) == pytest.approx(
        approval.ROUGH_AUTOTUNE_S)
    assert approval.rough_seconds(plain, train=True) > approval.rough_seconds(plain, train=False)
    # a bigger size costs more: the call time comes from the op's FLOPs at that size
    big = load(["tile=b64", "shape.curve=[64,128,256,16384]"])  # plain's curve: [64,128,256,512]
    assert approval.rough_seconds(big, train=False) > approval.rough_seconds(plain, train=False)
    found = approval.estimate([plain], train=False)
    assert [p.rough_s for p in found.per_point] == [approval.rough_seconds(plain, train=False)]


def test_forward_only_paths_are_counted_forward_only_and_trained_by_the_recipe():
    """fp8's paths (reference, scaled_mm, triton) have no backward: one loop per size, not two, even with
    bench.curve_backward; one more for the bf16 GEMM its microbench times beside them; bench-train trains each
    path by the fp8 recipe and the bf16 baseline."""
    fp8 = load(["op=matmul", "precision=fp8", "tile=b32", "device=cpu", "bench.curve_backward=true"])
    paths = get_op("matmul").paths(fp8)
    assert list(paths) == ["reference", "scaled_mm", "triton"]  # torch._scaled_mm runs on this CPU
    found = approval.estimate([fp8], train=True)
    assert (found.loops, found.train_steps) == (3 * (1 + len(fp8.shape.curve)) + 1, 4 * fp8.train.steps)
    # the same point in bf16 times both modes everywhere: the fp8 point's rough time holds fewer loops
    bf16 = load(["op=matmul", "precision=bf16", "tile=b32", "device=cpu", "bench.curve_backward=true"])
    assert approval.estimate([bf16], train=False).loops == 3 * (2 + 2 * len(bf16.shape.curve))
    assert approval.rough_seconds(fp8, train=False) < approval.rough_seconds(bf16, train=False)


@pytest.mark.parametrize("stage", ["train_base", "train_heads", "decode"])
def test_a_heads_dvc_stage_on_a_gpu_refuses_without_approval(gpu, stage, capsys):
    from posttrainllm.lab import heads

    assert heads.run_stage(stage, ["heads=k1"]) == 2
    err = capsys.readouterr().err
    assert f"not approved: stage {stage} heads-k1 would run timing loops on the GPU" in err
    assert "POSTTRAINLLM_APPROVE=1" in err and not (gpu / "runs").exists()  # nothing run, nothing written
