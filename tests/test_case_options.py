"""Every argument that matters is checked: a path that ignores one fails parity.

Attention and decode attention have a case at another softmax scale, cross-entropy one at another label smoothing
(with ignored rows), and each has a case at the shape bench-train trains it at (train.batch_size x train.seq_len):
a path right only at the point's defaults, or wrong only at the training shape, fails.
"""

from pathlib import Path

from conftest import parity_report

from posttrainllm.lab.configure import load
from posttrainllm.lab import reads
from posttrainllm.ops.registry import get_op

ATTENTION = ["device=cpu", "parity.seeds=[0]", "shape.edge_seq_lens=[37]", "architecture=gqa"]
CROSS_ENTROPY = ["op=cross_entropy", "device=cpu", "parity.seeds=[0]"]

SDPA = "import torch.nn.functional as F\n\n\n"


def _user(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(body)
    return f'"{name}={path}:{name}"'


def test_an_attention_path_that_ignores_sm_scale_fails(tmp_path):
    honest = _user(tmp_path, "honest", SDPA + "def honest(q, k, v, *, causal, sm_scale):\n    return "
                   "F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale, enable_gqa=True)\n")
    deaf = _user(tmp_path, "deaf", SDPA + "def deaf(q, k, v, *, causal, sm_scale):\n"
                 "    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)\n")
    report = parity_report(load([*ATTENTION, f"op.user_impls=[{honest},{deaf}]"]), tmp_path / "p")
    assert any("sm_scale" in case for case in report["cases"])
    assert report["paths"]["honest"]["verdict"] == "pass", report["paths"]["honest"]["failed_cases"]
    for name in ("triton", "sdpa"):  # our kernel and the peers get the case's scale too
        assert report["paths"][name]["verdict"] == "pass", report["paths"][name]["failed_cases"]
    failed = report["paths"]["deaf"]["failed_cases"]
    assert report["paths"]["deaf"]["verdict"] == "fail" and all("sm_scale" in f for f in failed), failed


def test_an_attention_path_wrong_only_at_the_training_shape_fails(tmp_path):
    """Its dQ is 1% off at S == train.seq_len only, a length none of the point's other cases has."""
    wrong = _user(tmp_path, "wrong", SDPA + "def wrong(q, k, v, *, causal, sm_scale):\n"
                  "    if q.shape[2] == 48:\n"
                  "        q = q.detach() + (q - q.detach()) * 1.01  # the same forward, dQ scaled\n"
                  "    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale,\n"
                  "                                          enable_gqa=True)\n")
    cfg = load([*ATTENTION, "train.seq_len=48", "train.batch_size=2", f"op.user_impls=[{wrong}]", "op.only=[wrong]"])
    report = parity_report(cfg, tmp_path / "p")
    assert "S48-B2-train" in report["cases"]
    failed = report["paths"]["wrong"]["failed_cases"]
    assert report["paths"]["wrong"]["verdict"] == "fail" and failed and all("S48-B2-train" in f for f in failed)
    assert all("grad_q" in f for f in failed), failed


def test_the_noncausal_point_checks_the_causal_training_shape():
    cfg = load(["op=attention_noncausal", "device=cpu"])
    train = [c for c in get_op("attention").cases(cfg) if c.name.endswith("-train")]
    assert len(train) == 1 and train[0].options == {"causal": True}
    assert train[0].dims["batch"] == cfg.train.batch_size and train[0].dims["seq_len"] == cfg.train.seq_len


def test_a_decode_path_that_ignores_sm_scale_fails(tmp_path):
    deaf = _user(tmp_path, "deaf", "from posttrainllm.ops.decode_attention.reference import chunk_attention\n\n\n"
                 "def deaf(q, k, v, *, sm_scale):\n    return chunk_attention(q, k, v)\n")
    cfg = load(["op=decode_attention", "device=cpu", "parity.seeds=[0]", "shape.ops.decode_attention.kv_len=100",
                "shape.ops.decode_attention.q_lens=[1,4]", "shape.ops.decode_attention.kv_lens=[1,100]",
                f"op.user_impls=[{deaf}]"])
    report = parity_report(cfg, tmp_path / "p")
    failed = report["paths"]["deaf"]["failed_cases"]
    assert report["paths"]["deaf"]["verdict"] == "fail" and all("sm_scale" in f for f in failed), failed
    assert report["paths"]["triton"]["verdict"] == "pass", report["paths"]["triton"]["failed_cases"]
    assert "S64-B4-train" in report["cases"]


def test_a_cross_entropy_path_that_ignores_label_smoothing_fails(tmp_path):
    deaf = _user(tmp_path, "deaf", "import torch.nn.functional as F\n\n\n"
                 "def deaf(h, weight, targets, *, ignore_index, label_smoothing):\n"
                 "    return F.cross_entropy(h.float() @ weight.float().t(), targets, ignore_index=ignore_index)\n")
    small = ["shape.ops.cross_entropy.tokens=32", "shape.ops.cross_entropy.d_model=32",
             "shape.ops.cross_entropy.vocab=1000",  # the edges keep theirs
             "train.batch_size=1", "train.seq_len=32"]
    report = parity_report(load([*CROSS_ENTROPY, *small, f"op.user_impls=[{deaf}]"]), tmp_path / "p")
    smoothed = [c for c in report["cases"] if c.endswith("-smoothed")]
    assert smoothed and any(c.endswith("-train") for c in report["cases"])
    failed = report["paths"]["deaf"]["failed_cases"]
    assert report["paths"]["deaf"]["verdict"] == "fail" and all(smoothed[0] in f for f in failed), failed
    for name in ("reference", "triton"):
        assert report["paths"].get(name, {"verdict": "pass"})["verdict"] == "pass", report["paths"][name]


def test_the_training_shape_keys_are_stage_deps():
    for op in ("attention", "decode_attention", "cross_entropy"):  # their READS (ops/<op>/__init__.py) say so
        for stage in ("reference", "microbench"):
            params = reads.point_stage_deps(stage, {"config": {"op": {"name": op}, "tile": {"name": "b64"},
                                                               "workgroup": {"name": "w4"}}})["params"]
            assert {"config.train.batch_size", "config.train.seq_len"} <= set(params) or "config.train" in params
