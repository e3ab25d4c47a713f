"""`posttrainllm new-impl`: the file it writes passes parity as it is, for every op; bad input writes nothing."""

import ast
import json
import shutil

import pytest

from posttrainllm import cli
from posttrainllm.ops.registry import OPS

QUICK = ["device=cpu", "parity.seeds=[0]", "bench.warmup=1", "bench.reps=2", "bench.min_time_s=0",
         "bench.max_reps=12", "run.log_mlflow=false"]
# per op, the smallest problem its checks accept: few cases, one curve size
SMALL = {
    "attention": ["tile=b16", "shape.seq_len=32", "shape.edge_seq_lens=[]", "shape.curve=[16,32]"],
    "matmul": ["tile=b16", "shape.ops.matmul.m=32", "shape.ops.matmul.n=32", "shape.ops.matmul.k=32",
               "shape.ops.matmul.edge=[]", "shape.curve=[16,32]"],
    "decode_attention": ["tile=b16", "shape.ops.decode_attention.q_lens=[1,4]",
                         "shape.ops.decode_attention.kv_lens=[17]",
                         "shape.ops.decode_attention.kv_len=32", "shape.curve=[16,32]"],
    "moe": ["tile=b16", "shape.ops.moe.tokens=8", "shape.ops.moe.d_model=32", "shape.ops.moe.ffn=32",
            "shape.ops.moe.edge=[]",
            "shape.ops.moe.curve=[1,8]", "shape.ops.moe.expert_curve=[2,4]"],
    "rmsnorm": ["shape.seq_len=16", "shape.edge_seq_lens=[]", "shape.curve=[8,16]"],
    "rope": ["tile=b16", "shape.seq_len=32", "shape.edge_seq_lens=[]", "shape.curve=[16,32]"],
    "swiglu": ["tile=b16", "shape.seq_len=32", "shape.edge_seq_lens=[]", "shape.curve=[16,32]"],
    "softmax": ["tile=b16", "shape.seq_len=16", "shape.edge_seq_lens=[]", "shape.curve=[8,16]"],
    "layernorm": ["tile=b16", "shape.seq_len=16", "shape.edge_seq_lens=[]", "shape.curve=[8,16]"],
    "add_rmsnorm": ["tile=b16", "shape.seq_len=16", "shape.edge_seq_lens=[]", "shape.curve=[8,16]"],
    "cross_entropy": ["shape.ops.cross_entropy.tokens=8", "shape.ops.cross_entropy.d_model=16",
                      "shape.ops.cross_entropy.vocab=300", "shape.ops.cross_entropy.edge=[]",
                      "shape.ops.cross_entropy.curve=[4,8]", "shape.ops.cross_entropy.vocab_curve=[100,300]"],
}


@pytest.fixture
def workdir(tmp_path, monkeypatch, calibration):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    shutil.copy(calibration, tmp_path / "runs" / "calibration.json")
    return tmp_path


def test_every_op_has_a_template():
    assert set(SMALL) == set(OPS)
    for op in OPS.values():
        assert op.signature and "{name}" in op.template, op.name


@pytest.mark.parametrize("op", sorted(OPS))
def test_the_written_file_passes_parity_with_its_own_gradients(workdir, op, capsys):
    assert cli.main(["new-impl", f"op={op}", "kernels/mine.py"]) == 0
    command = f"posttrainllm bench op={op} 'op.user_impls=[kernels/mine.py:{op}]' 'op.only=[{op}]'"
    assert command in capsys.readouterr().out
    source = (workdir / "kernels" / "mine.py").read_text()
    module = ast.parse(source)
    doc = ast.get_docstring(module)
    assert command in doc and OPS[op].signature.split(";")[0] in " ".join(doc.split())
    assert [node.name for node in module.body if isinstance(node, ast.FunctionDef)] == [op]

    assert cli.main(["bench", f"op={op}", f"op.user_impls=[kernels/mine.py:{op}]", f"op.only=[{op}]",
                     "run.out_dir=runs", "run.name=mine", *QUICK, *SMALL[op]]) == 0
    parity = json.loads((workdir / "runs" / "mine" / "parity.json").read_text())
    assert set(parity["paths"]) == {op}  # op.only: the reference is the baseline, no built-in path ran
    mine = parity["paths"][op]
    assert mine["verdict"] == "pass" and mine["backward"] == "own", mine
    checked = {case["output"] for case in mine["cases"]}
    assert set(OPS[op].gradient_names()) <= checked and "out" in checked
    receipt = json.loads((workdir / "runs" / "mine" / "receipt.json").read_text())
    assert receipt["user_impls"][op]["source"] == "file"
    assert receipt["user_impls"][op]["file"].endswith("kernels/mine.py")


def test_name_names_the_function_and_the_path(workdir, capsys):
    assert cli.main(["new-impl", "op=attention_noncausal", "flash.py", "--name", "flash"]) == 0
    source = (workdir / "flash.py").read_text()
    assert "def flash(q" in source
    assert "posttrainllm bench op=attention_noncausal 'op.user_impls=[flash.py:flash]' 'op.only=[flash]'" in source


def test_an_existing_file_is_never_overwritten(workdir, capsys):
    (workdir / "mine.py").write_text("# my work\n")
    assert cli.main(["new-impl", "op=matmul", "mine.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mine.py already exists" in err
    assert (workdir / "mine.py").read_text() == "# my work\n"


@pytest.mark.parametrize("args, says", [
    (["op=nope", "k.py"], "unknown op 'nope': valid choices are add_rmsnorm, attention, attention_noncausal, "
                          "cross_entropy, decode_attention, layernorm, matmul, moe, problem, rmsnorm, rope, softmax, "
                          "swiglu"),
    (["op=matmul"], "usage: posttrainllm new-impl op=OP FILE.py"),
    (["k.py"], "usage: posttrainllm new-impl op=OP FILE.py"),
    (["op=matmul", "k.py", "--name"], "--name needs a value"),
    (["op=matmul", "k.py", "--name", "triton"], "'triton' is a built-in path of matmul"),
    (["op=matmul", "k.py", "--name", "def"], "must be a Python identifier"),
    (["op=matmul", "k.txt"], "must end in .py"),
    (["op=matmul", "a,b.py"], "a path a Hydra override can hold unquoted"),
])
def test_bad_input_is_one_line_and_writes_nothing(workdir, capsys, args, says):
    assert cli.main(["new-impl", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err
    assert not list(workdir.glob("*.*")) and not list(workdir.glob("k*"))


def test_help_lists_new_impl(capsys):
    assert cli.main(["--help"]) == 0
    assert "posttrainllm new-impl op=OP FILE.py [--name NAME]" in capsys.readouterr().out  # asked for: stdout


def test_the_docs_signature_table_is_the_ops_signatures():
    from posttrainllm.ops import signatures

    assert signatures.documented() == signatures.table(), (
        "docs/bring-your-own-kernel.md's signature table differs from the ops' SIGNATURE: "
        "regenerate it with `python -m posttrainllm.ops.signatures`")
    for op in OPS.values():  # one row per op, its call as code
        assert f"| `{op.name}` | `{op.signature.partition(';')[0].strip()}` |" in signatures.table()


def test_a_changed_signature_is_caught_and_regenerated(tmp_path, monkeypatch):
    import dataclasses

    from posttrainllm.ops import signatures

    doc = tmp_path / "page.md"
    shutil.copy(signatures.DOC, doc)
    changed = dataclasses.replace(OPS["matmul"], signature="fn(a, b, *, out_dtype) -> c; a (M, K), b (K, N)")
    monkeypatch.setitem(OPS, "matmul", changed)
    assert signatures.documented(doc) != signatures.table()
    assert signatures.write(doc) and signatures.documented(doc) == signatures.table()
    assert "| `matmul` | `fn(a, b, *, out_dtype) -> c` | a (M, K), b (K, N) |" in doc.read_text()
    assert not signatures.write(doc)  # current: nothing to rewrite
    doc.write_text("# no table here\n")
    with pytest.raises(ValueError, match="no signature table"):
        signatures.documented(doc)
