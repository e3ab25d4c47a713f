"""Draft heads end to end on a tiny base: `posttrainllm experimental train-heads` -> base, heads, decode, receipt."""

import json

import pytest
import torch

from posttrainllm.lab.configure import load
from posttrainllm.model.heads import MedusaHeads, self_distillation_loss

# 120 base steps, not fewer: at 40 the base's greedy continuations are all spaces, which any head guesses, so trained
# and untrained heads alike accepted every draft and the comparison between them said nothing
TINY = ["device=cpu", "architecture.d_model=64", "architecture.mlp_hidden=128", "architecture.head_dim=16",
        "heads.base.steps=120", "heads.base.warmup_steps=4", "heads.base.batch_size=8", "heads.base.seq_len=48",
        "heads.base.eval_batches=2", "heads.base.max_seq_len=64", "heads.prompt_len=16", "heads.continuation_len=24",
        "heads.train_prompts=16", "heads.steps=30", "heads.batch_size=8", "heads.lr=3e-3", "heads.eval_prompts=3",
        "heads.new_tokens=16", "heads.warmup_prompts=0", "heads.base.threads=1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, mlflow_uri):
    """One CLI run with K = 2 on the tiny base (MLflow: the session's store), then its files."""
    import os

    from posttrainllm import cli

    out = tmp_path_factory.mktemp("heads")
    os.environ["MLFLOW_TRACKING_URI"] = mlflow_uri
    try:
        code = cli.main(["experimental", "train-heads", "heads=k2", f"heads.out_dir={out}",
                         f"run.out_dir={out / 'runs'}", *TINY])
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI")
    return code, out


def test_the_command_runs_base_heads_decode_and_writes_a_receipt(run, capsys):
    code, out = run
    assert code == 0
    receipt = json.loads((out / "k2" / "receipt.json").read_text())
    assert receipt["schema"] == "posttrainllm.track.receipt.heads/1" and receipt["verdict"] == "pass"
    base = receipt["base"]
    assert base["heldout_loss"] < base["heldout_loss_before"]  # the base learned something
    variants = receipt["decode"]["variants"]
    assert set(variants) == {"greedy", "spec_k0", "untrained", "trained"}
    assert variants["spec_k0"]["mean_accepted_length"] == 1.0  # the K = 0 control
    assert variants["trained"]["mean_accepted_length"] > variants["untrained"]["mean_accepted_length"]  # held out
    for name, k in (("spec_k0", 0), ("untrained", 2), ("trained", 2)):  # Σ (accepted + 1) = the tokens after each
        emitted = round(variants[name]["mean_accepted_length"] * variants[name]["steps"])  # prompt's first, plus
        assert 3 * 15 <= emitted <= 3 * (15 + k)  # the last step's overshoot (at most K a prompt)
    assert len(variants["trained"]["acceptance_rate_per_head"]) == 2
    for entry in variants.values():
        assert entry["tokens"] == 3 * 16 and entry["decode_tokens_per_s"] > 0
        assert entry["itl_ms"]["p20"] <= entry["itl_ms"]["median"] <= entry["itl_ms"]["p80"]
    assert receipt["decode"]["mismatches"]["count"] == 0 and receipt["decode"]["lossless"]
    assert "measured" in receipt["decode"]["speedup"]["trained"] and receipt["decode"]["speedup"]["why"]
    metrics = json.loads((out / "k2" / "metrics.json").read_text())
    assert "decode.trained.mean_accepted_length" in metrics and "heads.head2.top5" in metrics
    assert receipt["decode"]["cached_attention"] == {
        "path": "reference", "backend": "posttrainllm.ops.decode_attention.reference.chunk_attention",
        "triton_interpreted": False, "timed": True}
    # every rule the receipt applies is cited by id, with its parameters (posttrainllm/rules.py)
    from posttrainllm import rules
    from posttrainllm.track import derived

    assert base["heldout_loss_rule"] == {"id": "heldout_loss", "eval_batches": 2}
    near_tie = load(TINY).heads.near_tie
    assert receipt["decode"]["mismatches"]["rule"] == rules.cite("lossless_decoding", near_tie=near_tie)
    assert {rid for rid, _ in derived.cited_rules(receipt)} == {
        "heldout_loss", "head_accuracy", "inter_token_latency", "accepted_length", "lossless_decoding",
        "trainer_sampler_gap", "decode_speedup"}
    assert dict(derived.cited_rules(receipt))["heldout_loss"].startswith("mean cross-entropy (nats/byte) over 2 ")
    cache = {name: v["peak_memory"]["kv_cache_bytes"] for name, v in variants.items()}
    per_position = 2 * 2 * 4 * 16 * 4  # K and V, 2 layers, 4 KV heads, head_dim 16, fp32
    assert cache == {"greedy": (16 + 16) * per_position, "spec_k0": (16 + 16 + 1) * per_position,
                     "untrained": (16 + 16 + 3) * per_position, "trained": (16 + 16 + 3) * per_position}
    # the trainer-sampler gap on the trained base: the reference decode scored by every attention path's forward
    gap = receipt["decode"]["trainer_sampler_gap"]
    assert set(gap["pairs"]) == {"reference -> reference", "reference -> sdpa", "reference -> triton"}
    assert gap["batches"] == [{"prompts": 3, "prompt_len": 16}, {"prompts": 3, "prompt_len": 9}]
    assert all(p["tokens"] == 2 * 3 * 16 and p["max_abs"] < 1e-3 for p in gap["pairs"].values())
    from posttrainllm.lab.heads import table  # what the command printed

    assert "trainer-sampler gap, decode reference -> triton: max |d log p|" in table(receipt)


def test_each_stage_is_stamped_and_the_receipt_records_the_stamps_before_it(run):
    _, out = run
    receipt = json.loads((out / "k2" / "receipt.json").read_text())
    made = {"train_base": json.loads((out / "base" / "stamps" / "train_base.json").read_text()),
            "train_heads": json.loads((out / "k2" / "stamps" / "train_heads.json").read_text())}
    assert receipt["stamps"] == made
    decode = json.loads((out / "k2" / "stamps" / "decode.json").read_text())
    assert decode["point"] == "heads-k2" and "posttrainllm/track/receipt.py" in decode["sources"]
    assert "heads.base.steps" in made["train_base"]["config_keys"] and "heads.steps" not in made["train_base"]["config_keys"]


def test_the_receipt_is_an_mlflow_run(run, mlflow_uri):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("posttrainllm").experiment_id],
                              filter_string="tags.role = 'heads'")
    assert any(r.data.tags["point"] == "heads-k2" and r.info.status == "FINISHED" for r in runs)


def test_heads_learn_and_the_base_stays_frozen(run):
    _, out = run
    heads = json.loads((out / "k2" / "heads.json").read_text())
    assert heads["losses"][-1] < heads["losses"][0]
    assert heads["heldout_accuracy"][0]["top5"] >= heads["heldout_accuracy"][0]["top1"]
    cfg = load([*TINY, "heads=k2", f"heads.out_dir={out}"])
    from posttrainllm.lab import heads as lab

    base, _ = lab.load_base(cfg, "cpu")
    assert lab._base_digest(base) == heads["base_digest"]  # after training, bit for bit the base it started from


def test_a_second_k_reuses_the_base_and_other_settings_refuse_it(run, capsys):
    from posttrainllm.config import ConfigError
    from posttrainllm.lab import heads as lab

    _, out = run
    mtime = (out / "base" / "base.pt").stat().st_mtime_ns
    cfg = load([*TINY, "heads=k1", f"heads.out_dir={out}"])
    assert lab.ensure_base(cfg)[1] is False and (out / "base" / "base.pt").stat().st_mtime_ns == mtime
    other = load([*TINY, "heads=k1", f"heads.out_dir={out}", "heads.base.steps=121"])
    with pytest.raises(ConfigError, match="trained with other settings"):
        lab.load_base(other, "cpu")


def test_the_base_trains_on_heads_base_threads_and_0_is_every_usable_cpu(tmp_path):
    """Untimed, it need not keep bench.threads (1): 0 takes every CPU this process may use."""
    import os

    from posttrainllm.lab import heads as lab

    before = torch.get_num_threads()
    try:
        for threads, want in ((0, len(os.sched_getaffinity(0))), (1, 1)):
            cfg = load([*TINY, f"heads.out_dir={tmp_path / str(threads)}", "heads.base.steps=2",
                        "heads.base.warmup_steps=0", f"heads.base.threads={threads}"])
            torch.set_num_threads(1)  # as the stage runner leaves it (bench.threads)
            assert lab.train_base(cfg)["threads"] == want
    finally:
        torch.set_num_threads(before)


def test_a_base_stamped_with_other_code_is_retrained_and_a_receipt_refuses_it(run, tmp_path):
    import shutil

    from posttrainllm.lab import heads as lab
    from posttrainllm.track import stamp

    _, out = run
    copy = tmp_path / "heads"
    shutil.copytree(out, copy)
    cfg = load([*TINY, "heads=k2", f"heads.out_dir={copy}", "run.log_mlflow=false"])
    path = copy / "base" / "stamps" / "train_base.json"
    made = json.loads(path.read_text())
    made["sources"]["posttrainllm/lab/heads.py"] = "0" * 64  # the base came from another lab/heads.py
    path.write_text(json.dumps(made))
    with pytest.raises(stamp.StampMismatch, match="ran different versions of posttrainllm/lab/heads.py"):
        lab.record(cfg)
    assert (copy / "k2" / "receipt.json").read_text() == (out / "k2" / "receipt.json").read_text()  # not rewritten
    assert lab.ensure_base(cfg)[1] is True  # retrained, stamped anew
    assert json.loads(path.read_text())["sources"]["posttrainllm/lab/heads.py"] != "0" * 64


def test_zero_initialised_heads_start_as_the_base_and_the_loss_weights_decay():
    torch.manual_seed(0)
    weight = torch.randn(256, 32)
    heads = MedusaHeads(weight, 3)
    hidden = torch.randn(2, 5, 32)
    logits = heads(hidden)  # (K, B, T, V)
    assert logits.shape == (3, 2, 5, 256)
    for k in range(3):
        torch.testing.assert_close(logits[k], hidden @ weight.T)
    tokens = torch.randint(0, 256, (2, 5))
    total, per_head = self_distillation_loss(logits, tokens, first_target=0, decay=0.8)
    assert float(total) == pytest.approx(sum(0.8 ** k * ce for k, ce in enumerate(per_head, start=1)), rel=1e-5)


@pytest.mark.parametrize("args, says", [
    (["heads=k9"], "unknown heads 'k9': valid choices are k1, k2, k3, k4"),
    (["heads.num_heads=9"], "heads.num_heads=9: must be in [0, 8]"),
    (["heads.new_tokens=500"], "exceeds heads.base.max_seq_len=256"),
    (["heads.cached_attention=flash"], "heads.cached_attention='flash': valid choices are reference, sdpa, triton"),
])
def test_bad_heads_config_is_one_line_and_exit_2(args, says, capsys, tmp_path):
    from posttrainllm import cli

    assert cli.main(["experimental", "train-heads", f"heads.out_dir={tmp_path}", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
    assert not any(tmp_path.iterdir())


def test_the_heads_take_their_attention_paths_by_model_slot_not_by_op_name():
    """The decode attention is the op that declares the cached_attention slot's default math and whose model hook fills
    that slot; the gap's trainers, the attention slot's. A slot no op declares, or one its op does not fill, is
    refused by name."""
    from posttrainllm.model import slots
    from posttrainllm.ops.registry import slot_op

    cached, trained = slot_op(slots.CACHED_ATTENTION), slot_op(slots.ATTENTION)
    assert slots.CACHED_ATTENTION in cached.model_hook.fills and set(cached.impls) == {"reference", "sdpa", "triton"}
    assert trained.model_hook.slot == slots.ATTENTION and trained is not cached
    assert cached.model_defaults[slots.CACHED_ATTENTION] is slots.defaults()[slots.CACHED_ATTENTION]
    with pytest.raises(ValueError, match="no op declares the model's 'linear' default"):
        slot_op(slots.LINEAR)  # the model's own default (F.linear)
    with pytest.raises(ValueError, match="declares the model's 'tree_attention' default, but its model hook does "
                                         "not fill that slot"):
        slot_op(slots.TREE_ATTENTION)  # an arbitrary mask: no path of the op takes one


def test_dvc_runs_the_heads_stages_one_k_at_a_time():
    import yaml

    from posttrainllm.config import PROJECT_ROOT, group_options

    stages = yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text())["stages"]
    assert stages["train_base"]["cmd"] == "python pipelines/train_base.py"
    for name in ("train_heads", "decode"):
        ks = stages[name]["foreach"]
        assert set(ks) <= set(group_options("heads")) and len(ks) >= 2
        assert f"posttrainllm/lab/heads.py" in stages[name]["do"]["deps"]
    assert "runs/heads/base/base.pt" in stages["decode"]["do"]["deps"]


@pytest.mark.parametrize("args, says", [
    (["heads.tree=[2,2,1,1]"], "heads.tree=[2, 2, 1, 1]: one width per head, so at most heads.num_heads=3 widths"),
    (["heads.tree=[2,0,1]"], "heads.tree=[2, 0, 1]: every width (top-w of a head) must be an int >= 1"),
    (["heads.tree=[-1]"], "heads.tree=[-1]: every width (top-w of a head) must be an int >= 1"),
])
def test_a_bad_tree_is_refused_in_one_line(args, says, capsys, tmp_path):
    from posttrainllm import cli

    assert cli.main(["experimental", "train-heads", f"heads.out_dir={tmp_path}", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1
    assert not any(tmp_path.iterdir())


def test_a_tree_adds_the_trained_tree_variant_lossless_and_recorded(run, tmp_path):
    """heads.tree=[2, 1] on the K = 2 run's base and heads (a copy): one more variant, checked token for token
    like the others, with the chain's figures, the tree's verification attention named, and a row in the table."""
    import shutil

    from posttrainllm.lab import heads as lab

    _, out = run
    copy = tmp_path / "heads"
    shutil.copytree(out, copy)
    cfg = load([*TINY, "heads=k2", f"heads.out_dir={copy}", "run.log_mlflow=false", "heads.tree=[2,1]"])
    report = lab.measure_decode(cfg)
    variants = report["variants"]
    assert list(variants) == ["greedy", "spec_k0", "untrained", "trained", "trained_tree"]
    assert report["lossless"] and report["mismatches"]["count"] == 0
    tree = variants["trained_tree"]
    assert tree["tokens"] == 3 * 16
    chain = variants["trained"]["mean_accepted_length"]
    assert tree["mean_accepted_length"] >= chain  # its candidates include the chain's top-1 drafts
    assert len(tree["acceptance_rate_per_head"]) == 2 and tree["verification_attention"].startswith("reference")
    assert tree["peak_memory"]["kv_cache_bytes"] == (16 + 16 + 1 + 2 + 2) * 2 * 2 * 4 * 16 * 4
    assert report["tree"]["entries"] == 5 and "masked_chunk_attention" in report["tree"]["verification_attention"]
    assert {"measured", "predicted"} <= set(report["speedup"]["trained_tree"]) and report["speedup"]["tree_verdict"]
    receipt, _ = lab.record(cfg)
    assert "decode.trained_tree.mean_accepted_length" in json.loads((copy / "k2" / "metrics.json").read_text())
    text = lab.table(receipt)
    assert "trained_tree" in text and "masked_chunk_attention" in text
