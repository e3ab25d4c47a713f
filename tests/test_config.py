"""Config validation: every bad input ends in one line naming the valid choices, exit code 2."""

import pytest

from posttrainllm import cli
from posttrainllm.config import ConfigError
from posttrainllm.lab.configure import load


def test_default_config_is_valid():
    cfg = load()
    assert (cfg.op.name, cfg.precision.name, cfg.tile.name) == ("attention", "fp32", "b64")
    assert cfg.precision.contract.error_multiple > 0


@pytest.mark.parametrize("overrides, message", [
    (["precision=fp64"], "unknown precision 'fp64': valid choices are bf16, fp16, fp32, fp8, fp8_rowwise, tf32"),
    (["tile=b48"], "valid choices are auto, b128, b16, b32, b64"),
    (["architecture=mixtral"], "valid choices are gpu_gqa, gpu_mha, gpu_moe, gqa, hd64, mha, moe, mqa"),
    (["tile.block_q=48"], "tile.block_q=48: must be a power of two >= 16"),
    (["tile.block_m=8"], "tile.block_m=8: must be a power of two >= 16"),
    (["tile=b64", "shape.seq_len=20"], "tile.block_q=64 does not fit shape.seq_len=20: use a block <= 32"),
    (["op=matmul", "tile=b64", "shape.k=10"], "tile.block_k=32 does not fit shape.k=10: use a block <= 16"),
    (["shape.batch=-1"], "shape.batch=-1: must be > 0"),
    (["shape.seq_len=0"], "shape.seq_len=0: must be > 0"),
    (["tile.blok_m=32"], "unknown key tile.blok_m: valid keys of tile are block_k, block_kv, block_m"),
    (["tiel.block_m=32"], "unknown key tiel.block_m: valid keys are architecture, bench"),
    (["architecture.n_kv_heads=3"], "architecture.n_kv_heads=3: must divide n_heads=4"),
    (["architecture.head_dim=256"], "must be a power of two in [16, 128]"),
    (["train.steps=many"], "could not be converted to Integer"),
    (["train.impls=[sdpa]"], "the first must be 'reference'"),
    (["op=matmul", "train.impls=[reference,cublas]"],
     "train.impls: unknown matmul implementation 'cublas': valid choices are reference, torch, triton"),
    (["workgroup.num_warps=3"], "valid choices are 1, 2, 4, 8, 16"),
    (["precision.contract.floor_rel=-1"], "precision.contract.floor_rel=-1.0: must be > 0"),
    (["tile=b64", "workgroup=w8s3", "architecture=hd64", "shape.seq_len=128", "device.smem_bytes=65536"],
     # (BLOCK_Q + 2·BLOCK_KV·stages)·D·4 B = (64 + 2·64·3)·64·4
     "needs 114688 B of shared memory per program, over device.smem_bytes=65536"),
    (["precision="], "unknown precision ''"),
    (["op=decode_attention", "op.kv_split_blocks=0"], "op.kv_split_blocks=0: must be >= 1 KV block a piece, or null"),
])
def test_bad_config_is_refused_with_a_named_bound(overrides, message):
    with pytest.raises(ConfigError) as err:
        load(overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("args", [
    ["bench", "precision=fp64"],
    ["bench", "tile.block_q=33"],
    ["bench", "-m", "precision=fp32,fp4"],
    ["bench-train", "architecture.n_kv_heads=3"],
    ["sweep", "sweep.vary.tile=[b99]"],
    ["bench", "foo==="],
])
def test_cli_bad_override_exits_2_with_one_line_and_touches_nothing(args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    recorded = tmp_path / "runs" / "bench" / "bench" / "receipt.json"
    recorded.parent.mkdir(parents=True)
    recorded.write_text('{"kept": true}')
    (tmp_path / "params.yaml").write_text("points: {}\n")
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("posttrainllm: config error: ") and "\n" not in err and "Traceback" not in err
    assert recorded.read_text() == '{"kept": true}'
    assert (tmp_path / "params.yaml").read_text() == "points: {}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml", "runs"]


def test_cli_without_a_command_prints_usage(capsys):
    assert cli.main([]) == 2
    assert "posttrainllm bench" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    (["op=moe", "op.max_error_only.outputs=[grad_w_gate,grad_w_gat]"],
     "op.max_error_only.outputs: unknown moe output 'grad_w_gat': valid choices are out, grad_x, grad_w_gate, "
     "grad_w_up, grad_w_down, grad_route_weight"),
    (["op=matmul", "op.max_error_only.outputs=[lse]", "op.max_error_only.precisions=[bf16]",  # empty in matmul.yaml
      "op.max_error_only.reason=measured"], "unknown matmul output 'lse': valid choices are out, grad_a, grad_b"),
    (["op=moe", "op.max_error_only.precisions=[fp32,fp4]"],
     "op.max_error_only.precisions: unknown precision 'fp4': valid choices are bf16, fp16, fp32, fp8, fp8_rowwise, "
     "tf32"),
    (["op=moe", "op.max_error_only.reason="], "op.max_error_only: give outputs, precisions and the reason"),
])
def test_a_bad_max_error_only_override_is_refused_naming_the_valid_outputs(overrides, message):
    """The exemption from the elementwise count lives in config (conf/op/moe.yaml): a typo cannot widen or void it."""
    with pytest.raises(ConfigError) as err:
        load(overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("op, overrides, kernel_name", [
    ("attention", ["tile=b64", "workgroup=w8s3", "architecture=hd64", "shape.seq_len=128"], "attention_smem_bytes"),
    ("matmul", ["op=matmul", "tile=b64", "workgroup=w8s3"], "matmul_smem_bytes"),
])
def test_shared_memory_per_program_is_one_formula_read_by_kernel_check_and_compile_report(op, overrides, kernel_name):
    """ops/<op>/config.py `smem_bytes`: the autotuner's pruning (kernels.py), the config check's refusal and the
    compile report's estimate (OpDef.smem_bytes) are the same function at the same point."""
    import importlib

    from posttrainllm.ops.registry import get_op

    config = importlib.import_module(f"posttrainllm.ops.{op}.config")
    kernels = importlib.import_module(f"posttrainllm.ops.{op}.kernels")
    assert getattr(kernels, kernel_name) is config.smem_bytes
    cfg = load(overrides)
    needed = get_op(op).smem_bytes(cfg)
    assert needed == config.point_smem_bytes(cfg) > 0
    load([*overrides, f"device.smem_bytes={needed}"])  # exactly enough passes ...
    with pytest.raises(ConfigError, match=rf"needs {needed} B of shared memory per program, over "
                                          rf"device.smem_bytes={needed - 1}$"):
        load([*overrides, f"device.smem_bytes={needed - 1}"])  # ... one byte less is refused

