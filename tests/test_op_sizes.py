"""Each op's sizes live in its own folder (ops/<op>/config.py `Sizes`), under shape.ops.<op> in a shape option: a bad
key, op or value there is one ConfigError line, an override reaches the op, and a point's stages depend on its own
op's sizes only (the planned params, and the config reads its stamps record)."""

import dataclasses

import pytest

from posttrainllm import cli
from posttrainllm.config import ConfigError, OpSizes, point_config
from posttrainllm.lab import reads, sweep
from posttrainllm.lab.configure import load
from posttrainllm.ops.moe.config import Sizes as MoeSizes
from posttrainllm.ops.registry import OP_SIZES, OPS, get_op
from posttrainllm.track.stamp import record_config_reads

SIZED = ", ".join(sorted(OP_SIZES))


def test_every_op_with_sizes_declares_them_in_its_own_folder_with_tiny_defaults():
    """Sizes' defaults are the tiny shape's values, and every shape option gives each op with sizes its node."""
    assert set(OP_SIZES) == {"cross_entropy", "decode_attention", "matmul", "moe"}
    for name, cls in OP_SIZES.items():
        assert issubclass(cls, OpSizes) and cls.op_name == name
        assert cls.__module__ == f"posttrainllm.ops.{name}.config"
    tiny = load(["device=cpu"])
    assert {name: dataclasses.asdict(s) for name, s in tiny.shape.ops.items()} == \
        {name: dataclasses.asdict(cls()) for name, cls in OP_SIZES.items()}
    for option in ("tiny", "gpu", "gpu_check"):
        assert set(load([f"shape={option}"]).shape.ops) == set(OP_SIZES)


@pytest.mark.parametrize("override, message", [
    ("shape.ops.moe.tokns=128", f"unknown key shape.ops.moe.tokns: valid keys of shape.ops.moe are "
                                f"{', '.join(sorted(f.name for f in dataclasses.fields(MoeSizes)))}"),
    ("shape.ops.atention.seq_len=3", f"unknown key shape.ops.atention: valid keys of shape.ops (the ops with sizes) "
                                     f"are {SIZED}"),
    ("shape.ops.attention.seq_len=3", f"unknown key shape.ops.attention: valid keys of shape.ops (the ops with "
                                      f"sizes) are {SIZED}"),  # an op, but one without sizes of its own
    ("shape.ops.moe=5", "shape.ops.moe=5: give the op's sizes by key (valid keys of shape.ops.moe are curve, "),
    ("shape.ops.moe.tokens=abc", "could not be converted to Integer (at shape.ops.moe.tokens)"),
    ("shape.ops.moe.top_k=5", "shape.ops.moe.top_k=5: must be <= shape.ops.moe.experts=4"),
    ("shape.ops.moe.tokens=0", "shape.ops.moe.tokens=0: must be > 0"),
    ("shape.ops.moe.edge=[[1,2]]", "shape.ops.moe.edge: [1, 2] must be three sizes [T, d, f] > 0"),
    ("shape.ops.decode_attention.q_lens=[5]", "shape.ops.decode_attention.q_lens=[5]: no chunk fits "
                                              "shape.ops.decode_attention.kv_lens=[1, 4] (a chunk needs Sq <= Sk)"),
    ("shape.ops.matmul.curve=[8]", "shape.ops.matmul.curve=[8]: give at least two sizes > 0, or null (use "
                                   "shape.curve)"),
    ("shape.ops.cross_entropy.vocab_curve=[]", "shape.ops.cross_entropy.vocab_curve=[]: give at least two sizes > 0"),
])
def test_a_bad_key_op_or_value_under_shape_ops_is_one_line_naming_the_choices(override, message):
    extra = ["shape.ops.decode_attention.kv_lens=[1,4]"] if "decode_attention" in override else []
    with pytest.raises(ConfigError) as refused:
        load(["op=moe", override, *extra])
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_the_cli_refuses_a_bad_size_before_anything_runs(tmp_path, capsys):
    assert cli.main(["bench", "op=moe", "shape.ops.moe.tokns=128", f"run.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("posttrainllm: config error: unknown key shape.ops.moe.tokns: valid keys of shape.ops.moe")
    assert "\n" not in err and not any(tmp_path.iterdir())


def test_an_override_of_an_op_size_reaches_the_op():
    cfg = load(["op=moe", "device=cpu", "shape.ops.moe.tokens=32", "shape.ops.moe.curve=[1,32]"])
    assert MoeSizes.of(cfg).tokens == 32
    moe = get_op("moe")
    main = next(case for case in moe.cases(cfg) if case.main)
    assert main.dims["tokens"] == 32 and main.name.startswith("T32-")
    assert moe.curve_sizes(cfg) == [1, 32]
    assert next(a for a in moe.curve_axes if a.x_name == "experts").case(cfg, 8).dims["tokens"] == 32
    # matmul's sizes moved with it, and a tile is checked against them
    matmul = load(["op=matmul", "device=cpu", "shape.ops.matmul.m=64", "shape.ops.matmul.edge=[]"])
    assert [c.dims for c in get_op("matmul").cases(matmul)] == [dict(m=64, n=128, k=128)] * len(matmul.parity.seeds)
    # the cross-entropy chunk follows its shape's sizes (conf/op/cross_entropy.yaml interpolates them)
    assert load(["op=cross_entropy", "shape.ops.cross_entropy.chunk_size=8"]).op.chunk_size == 8


def test_a_point_holds_its_own_ops_sizes_only():
    plain = point_config(load(["op=moe", "shape.ops.moe.tokens=32"]))
    assert list(plain["shape"]["ops"]) == ["moe"] and plain["shape"]["ops"]["moe"]["tokens"] == 32
    assert point_config(load(["op=attention"]))["shape"]["ops"] == {}


def _stage_params(plan: dict, point: str) -> dict[str, dict]:
    return {stage: sweep.stage_inputs(point, stage, plan[point])["params"] for stage in reads.POINT_STAGES}


def test_an_edit_of_one_ops_sizes_reruns_that_ops_stages_only():
    """The default sweep with shape.ops.moe.tokens changed: every stage of the moe point that reads its sizes gets
    new inputs; the attention baseline's, the other ops' and cross_entropy's (a point planned here) keep theirs."""
    base = load(["sweep=default"]).sweep
    edited = dataclasses.replace(base, overrides=[*base.overrides, "shape.ops.moe.tokens=32"])
    points = {"baseline": {}, "op-matmul": {"op": "matmul"}, "op-decode_attention": {"op": "decode_attention"},
              "op-cross_entropy": {"op": "cross_entropy"}, "op-moe": {"op": "moe"}}
    before = {name: sweep.plan_point(base, name, changes) for name, changes in points.items()}
    after = {name: sweep.plan_point(edited, name, changes) for name, changes in points.items()}
    for name in points:
        if name != "op-moe":
            assert _stage_params(before, name) == _stage_params(after, name), name
    moe_before, moe_after = _stage_params(before, "op-moe"), _stage_params(after, "op-moe")
    changed = {stage for stage in reads.POINT_STAGES if moe_before[stage] != moe_after[stage]}
    assert changed == {"reference", "kernel", "microbench", "receipt"}  # parity and bench_train: d_model, ffn only
    moe_ffn = _stage_params(after | {"op-moe": sweep.plan_point(
        dataclasses.replace(base, overrides=[*base.overrides, "shape.ops.moe.ffn=128"]), "op-moe", {"op": "moe"})},
        "op-moe")
    assert moe_ffn["parity"] != moe_after["parity"]


def test_the_stamps_record_an_ops_sizes_by_their_own_keys():
    """Reading an op's sizes records shape.ops.<op>.<key> for each key read: not shape.ops whole, not another op's."""
    for name in OP_SIZES:
        cfg = load([f"op={name}", "device=cpu"])
        op = OPS[name]
        with record_config_reads(cfg) as recorded:
            op.cases(cfg)
            for axis in op.curve_axes:
                axis.sizes(cfg)
        keys = [key for key in recorded.keys() if key.startswith("shape.ops")]
        assert keys and all(key.startswith(f"shape.ops.{name}.") for key in keys), (name, keys)
    cfg = load(["op=moe", "device=cpu"])
    with record_config_reads(cfg) as recorded:
        get_op("moe").check_config(cfg)
        MoeSizes.of(cfg).d_model
    assert "shape.ops.moe.d_model" in recorded.keys() and "shape.ops" not in recorded.keys()
    attention = load(["op=attention", "device=cpu"])
    with record_config_reads(attention) as recorded:  # an op without sizes reads none
        get_op("attention").cases(attention)
    assert not [key for key in recorded.keys() if key.startswith("shape.ops")]
