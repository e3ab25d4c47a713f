"""Config validation: every bad input ends in one line naming the valid choices, exit code 2."""

import dataclasses

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
    (["op=matmul", "tile=b64",
      "shape.ops.matmul.k=10"], "tile.block_k=32 does not fit shape.ops.matmul.k=10: use a block <= 16"),
    (["shape.batch=-1"], "shape.batch=-1: must be > 0"),
    (["shape.seq_len=0"], "shape.seq_len=0: must be > 0"),
    (["tile.blok_m=32"], "unknown key tile.blok_m: valid keys of tile are block_k, block_kv, block_m"),
    (["tiel.block_m=32"], "unknown key tiel.block_m: valid keys are architecture, bench"),
    (["architecture.n_kv_heads=3"], "architecture.n_kv_heads=3: must divide n_heads=4"),
    (["architecture.head_dim=256"], "must be a power of two in [16, 128]"),
    # the model's MLP kinds (model/slots.py MLP_KINDS), checked by lab/configure.py
    (["architecture.mlp=sparse"], "architecture.mlp='sparse': valid choices are dense, moe"),
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



# --- the op node: the keys every op has (config.OpConfig) and the chosen op's own (ops/<op>/config.py) ---------------


@pytest.mark.parametrize("overrides, message", [
    (["op=softmax", "op.eps=1e-3"],  # rmsnorm's key, not softmax's
     "unknown key op.eps: valid keys of op (op.name=softmax) are max_error_only, name, only, peers, user_impls"),
    (["op.blok=1"], "unknown key op.blok: valid keys of op (op.name=attention) are causal, max_error_only, name, "
                    "only, peers, sm_scale, user_impls"),
    (["op=decode_attention", "op.causal=false"],  # attention's: decode attention's mask is always bottom-right
     "unknown key op.causal: valid keys of op (op.name=decode_attention) are kv_split_blocks, max_error_only, name, "
     "only, peers, sm_scale, user_impls"),
    (["op.max_error_only.outputz=[out]"], "unknown key op.max_error_only.outputz: valid keys of op.max_error_only are "
                                          "outputs, precisions, reason"),
    (["op=rmsnorm", "op.eps=0"], "op.eps=0.0: must be > 0 (it keeps an all-zero row finite)"),
    (["op=layernorm", "op.eps=-1"], "op.eps=-1.0: must be > 0"),
    (["op=add_rmsnorm", "op.eps=0"], "op.eps=0.0: must be > 0"),
    (["op.sm_scale=0"], "op.sm_scale=0.0: must be > 0, or null (1/sqrt(head_dim))"),
    (["op=decode_attention", "op.sm_scale=-1"], "op.sm_scale=-1.0: must be > 0, or null"),
    (["op=cross_entropy", "op.label_smoothing=1.5"], "op.label_smoothing=1.5: must be in [0, 1]"),
    (["op=cross_entropy", "op.chunk_size=0"], "op.chunk_size=0: must be >= 1"),
    (["op=cross_entropy", "op.block_v=24"], "op.block_v=24: must be a power of two in [16, 65536]"),
    (["op=problem", "op.budget_mib=0"], "op.budget_mib=0.0: must be > 0"),
    (["op.name=attn"], "op.name='attn': valid choices are attention, matmul, decode_attention"),
])
def test_an_op_key_is_checked_against_the_chosen_ops_own_schema(overrides, message):
    """A key of another op, or of none, is refused naming the chosen op and its keys; a bad value of an op's own key
    names the op's rule (ops/<op>/config.py Config.__post_init__)."""
    with pytest.raises(ConfigError) as err:
        load(overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_planned_config_with_another_ops_key_is_refused_naming_the_ops_keys():
    """params.yaml's points are validated from plain dicts (the stages, the sweep): the same schema and message."""
    from posttrainllm.config import point_config
    from posttrainllm.lab.configure import validate, validate_schema

    config = point_config(load(["op=softmax"]))
    assert validate(config).op.name == "softmax"
    config["op"]["causal"] = True
    for check in (validate, validate_schema):
        with pytest.raises(ConfigError, match=r"^unknown key op.causal: valid keys of op \(op.name=softmax\) are "
                                              r"max_error_only, name, only, peers, user_impls$"):
            check(config)


def _schema_keys(name):
    from posttrainllm.ops.registry import op_config

    return {f.name for f in dataclasses.fields(op_config(name))}


def test_each_op_yaml_lists_its_ops_keys_and_no_other():
    """conf/op/<option>.yaml sets the keys every op has and some of its op's own (the others keep the defaults of
    ops/<op>/config.py), none of another op's."""
    import yaml

    from posttrainllm.config import CONF_DIR, OpConfig, group_options

    generic = {f.name for f in dataclasses.fields(OpConfig)}
    for option in group_options("op"):
        written = yaml.safe_load((CONF_DIR / "op" / f"{option}.yaml").read_text())
        assert generic <= set(written) <= _schema_keys(written["name"]), option


def test_a_path_called_outside_a_point_of_its_op_gets_its_ops_defaults():
    """The draft heads decode at a point of another op (lab/heads.py): the decode paths read their own op's keys."""
    from posttrainllm.ops.registry import op_config, with_op_defaults

    cfg = load(["op.sm_scale=0.5"])
    decode = with_op_defaults(cfg, "decode_attention")
    assert type(decode.op) is op_config("decode_attention") and decode.op == op_config("decode_attention")()
    assert (decode.op.sm_scale, decode.op.kv_split_blocks) == (None, None) and decode.tile is cfg.tile
    assert cfg.op.sm_scale == 0.5 and cfg.op.name == "attention"  # the point's own, untouched


@pytest.mark.parametrize("option, own", [
    ("attention", {"causal", "sm_scale"}), ("attention_noncausal", {"causal", "sm_scale"}),
    ("decode_attention", {"sm_scale", "kv_split_blocks"}), ("rmsnorm", {"eps"}), ("layernorm", {"eps"}),
    ("add_rmsnorm", {"eps"}), ("cross_entropy", {"ignore_index", "label_smoothing", "chunk_size", "block_v"}),
    ("matmul", set()), ("moe", set()), ("rope", set()), ("swiglu", set()), ("softmax", set()),
])
def test_a_points_config_holds_its_ops_keys_and_reads_back_the_same(option, own):
    """params.yaml, the receipt and the MLflow params are written from point_config: each point's op node holds the
    generic keys and its op's own, and validating it again gives the same config."""
    from posttrainllm.config import point_config
    from posttrainllm.lab.configure import validate

    cfg = load([f"op={option}"])
    plain = point_config(cfg)
    assert set(plain["op"]) == {"name", "max_error_only", "peers", "user_impls", "only"} | own
    again = validate(plain)
    assert type(again.op) is type(cfg.op) and again.op == cfg.op and point_config(again) == plain


def test_a_problem_points_config_holds_the_problem_keys():
    from posttrainllm.config import point_config

    cfg = load(["op=problem", "op.file=tests/problems/softmax.py", "op.sizes.batch_size=4"])
    assert point_config(cfg)["op"]["sizes"] == {"batch_size": 4}
    assert set(point_config(cfg)["op"]) == _schema_keys("problem")
