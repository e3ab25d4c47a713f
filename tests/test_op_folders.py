"""One op, one folder: nothing outside posttrainllm/ops/<op>/ names that op (DESIGN.md "Layers").

Every module of the package is read with `ast`: its identifiers (names, attributes, arguments, functions,
classes, imported modules and aliases), each split into words ([A-Za-z0-9_]+), and its string literals (docstrings
aside: prose, as comments are): a string that is an op's name, or names it as a module path, a file path or an
override (`ops.<op>`, `ops/<op>`, `op=<op>`, an op's sizes `shape.ops.<op>.<key>`), or in a config key's part that
starts with it (`shape.<op>_curve`, as op sizes were once spelled in the root config). An op's name so found outside that op's folder is a finding;
ops/registry.py, the one list of ops, is the exception; so are the model's own words that equal an op's name, as
strings in its slot table (model/slots.py VOCABULARY, whose docstring says why), and only there. KNOWN_DEBT lists the findings of today's code: it
only shrinks (a finding not in it fails, and so does an entry that is no longer found).
"""

import ast
import dataclasses
import re

from posttrainllm.config import PROJECT_ROOT
from posttrainllm.model import slots
from posttrainllm.ops import registry
from posttrainllm.ops.base import OpDef

PACKAGE = PROJECT_ROOT / "posttrainllm"
OPS_DIR = PACKAGE / "ops"
EXEMPT = {"posttrainllm/ops/registry.py"}  # the one list of op packages
# The model's slot table may spell its own layer words that equal an op's name ("attention", "rope", "moe"), as strings
SLOT_TABLE = "posttrainllm/model/slots.py"

# (file, op): names of an op outside its folder found today, to be moved into it (issue 37 item 1). This list only
# shrinks: test_the_known_debt_only_shrinks fails on an entry no longer found.


def _debt(file: str, ops: str) -> set[tuple[str, str]]:
    return {(file, op) for op in ops.split()}


KNOWN_DEBT: set[tuple[str, str]] = {
    # ops that share code or math with another (attention's with decode_attention's, moe's with swiglu's and
    # matmul's, a softmax argument), or say so
    *_debt("posttrainllm/ops/attention/definition.py", "softmax"),
    *_debt("posttrainllm/ops/attention/reference.py", "softmax"),
    *_debt("posttrainllm/ops/decode_attention/definition.py", "attention softmax"),
    *_debt("posttrainllm/ops/decode_attention/reference.py", "attention softmax"),
    *_debt("posttrainllm/ops/moe/fp8.py", "matmul"),
    *_debt("posttrainllm/ops/moe/reference.py", "swiglu"),
    *_debt("posttrainllm/ops/softmax/definition.py", "attention"),
}


# An op whose name is an ordinary word of the lab (a record's "problem", a case's problem) is named only where
# code compares with it (`cfg.op.name == "problem"`) or writes it as a module, file or override
ORDINARY_WORDS = {"problem"}
# OpDef's fields are the lab's vocabulary, not op names (its `problem`: how a case's problem reads)
FIELDS = {f.name for f in dataclasses.fields(OpDef)}


def op_names() -> set[str]:
    """The registry's ops by name and by package (op=problem's too: its folder is ops/problem/)."""
    return set(registry.OPS) | set(registry.OP_PACKAGES) | {registry.PROBLEM}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                       str):
                found.add(id(first.value))
    return found


def _foreign_names(tree: ast.AST) -> set[str]:
    """The names a module binds to other libraries (torch, F, np, triton, tl) and its aliases of their modules: their
    attributes are the library's names (torch's matmul, F.cross_entropy), not an op's."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if not a.name.startswith("posttrainllm")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not (node.module or "").startswith(
                "posttrainllm"):
            names |= {a.asname or a.name for a in node.names}
    for node in ast.walk(tree):  # a local alias of one of theirs (backends = torch.backends)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) and _root(node.value) in names:
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def words(source: str, ops: set[str], own_words: frozenset[str] = frozenset()) -> set[str]:
    """The ops a module names: its identifiers' words, and its string literals naming one (not its docstrings or
    comments; a word of prose such as "the problem's size" is not a name; nor a string that is one of `own_words`,
    the slot table's own vocabulary)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    foreign = _foreign_names(tree)
    texts: list[str] = []
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):  # x == "op", x in ("op", ...)
            for side in [node.left, *node.comparators]:
                values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                named |= {v.value for v in values if isinstance(v, ast.Constant) and v.value in ops}
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs and \
                node.value not in own_words:
            named |= {op for op in ops if (node.value.strip() == op and op not in ORDINARY_WORDS)
                      or re.search(rf"(ops[./]|op=|op\.name=){op}(?![A-Za-z0-9_])", node.value)
                      or re.search(rf"[A-Za-z0-9_]\.{op}_[A-Za-z0-9_]", node.value)}
        elif isinstance(node, ast.Name):
            texts.append(node.id)
        elif isinstance(node, ast.Attribute) and node.attr not in FIELDS and _root(node) not in foreign:
            texts.append(node.attr)
        elif isinstance(node, ast.arg):
            texts.append(node.arg)
        elif isinstance(node, ast.keyword) and node.arg and node.arg not in FIELDS:
            texts.append(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            texts.append(node.name)
        elif isinstance(node, ast.ImportFrom):
            texts += [node.module or "", *(a.name for a in node.names), *(a.asname or "" for a in node.names)]
        elif isinstance(node, ast.Import):
            texts += [*(a.name for a in node.names), *(a.asname or "" for a in node.names)]
    return named | (ops - ORDINARY_WORDS) & {w for text in texts for w in re.findall(r"[A-Za-z0-9_]+", text)}


def findings() -> set[tuple[str, str]]:
    """(file, op) for every module outside `op`'s folder that names it."""
    ops = op_names()
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PROJECT_ROOT).as_posix()
        if name in EXEMPT or "__pycache__" in path.parts:
            continue
        home = path.relative_to(OPS_DIR).parts[0] if path.is_relative_to(OPS_DIR) else None
        own_words = frozenset(slots.VOCABULARY) if name == SLOT_TABLE else frozenset()
        for op in words(path.read_text(), ops, own_words):
            if op != home:
                found.add((name, op))
    return found


def test_no_op_is_named_outside_its_folder():
    new = sorted(findings() - KNOWN_DEBT)
    assert not new, "an op named outside its folder (move it into posttrainllm/ops/<op>/): " + ", ".join(
        f"{file}: {op}" for file, op in new)


def test_the_known_debt_only_shrinks():
    paid = sorted(KNOWN_DEBT - findings())
    assert not paid, "no longer found, drop from KNOWN_DEBT: " + ", ".join(f"{file}: {op}" for file, op in paid)


def test_the_check_sees_identifiers_and_strings_but_not_docstrings():
    source = ('"""attention in a docstring is prose."""\n'
              "import posttrainllm.ops.rope.kernels as k\n"
              "def f(moe):\n    return {'op': 'matmul'}, config.op.swiglu, decode_attention_x, 'a problem', "
              "'x/ops/rmsnorm/kernels.py', 'op=softmax', OpDef(problem=describe).problem, {'problem': 1}\n")
    assert words(source, op_names()) == {"rope", "moe", "matmul", "swiglu", "rmsnorm", "softmax"}
    assert words("if cfg.op.name == 'problem': problem = 1", op_names()) == {"problem"}
    assert words("x = op in ('attention', 'cross_entropy')", op_names()) == {"attention", "cross_entropy"}
    assert words("import torch\nimport torch.nn.functional as F\ny = F.cross_entropy(torch.backends.cuda.matmul)",
                 op_names()) == set()  # a library's names
    assert words("y = variant.moe", op_names()) == {"moe"}
    # an op's sizes as a config key: under shape.ops.<op>, or a root key that starts with the op's name
    assert words("x = ['shape.ops.moe.tokens=8', 'shape.matmul_curve=[32,64]', 'config.shape.cross_entropy_vocab']",
                 op_names()) == {"moe", "matmul", "cross_entropy"}
    assert words("x = 'torch.softmax', 'rope theta', 'decode_attention_x'[:3]", op_names()) == set()


def test_the_slot_table_spells_its_own_words_and_nothing_else():
    """The slot table's exemption is narrow: its vocabulary as strings, in that module only; an identifier there, or
    another op's name, is still a finding."""
    own = frozenset(slots.VOCABULARY)
    assert words("ATTENTION, ROPE, MOE = 'attention', 'rope', 'moe'", op_names(), own) == set()
    assert words("import posttrainllm.ops.rope.reference as rope\nX = 'rmsnorm'", op_names(), own) == {"rope",
                                                                                                           "rmsnorm"}
    assert words("X = 'attention'", op_names()) == {"attention"}  # elsewhere, the same string names the op
    assert {op for file, op in findings() if file == SLOT_TABLE} == set()
    assert own & op_names() == {"attention", "rope", "moe"}  # the words slots.py's docstring gives its reasons for
