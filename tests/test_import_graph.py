"""No import circles in the package, counting the imports inside functions: every module's imports, read with `ast`
(module level, function level, relative ones), form a graph with no cycle. An import under `if TYPE_CHECKING:`
never runs and is not an edge; a package's own `__init__` is its own module (importing `a.b` is an edge to `a.b`)."""

import ast
from pathlib import Path

import networkx as nx

from posttrainllm.config import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "posttrainllm"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node, except what sits under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    for node in ast.iter_child_nodes(tree):
        test = node.test if isinstance(node, ast.If) else None
        if test is not None and ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
                                 or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")):
            for other in node.orelse:
                yield other
                yield from _runtime_nodes(other)
            continue
        yield node
        yield from _runtime_nodes(node)


def import_graph() -> nx.DiGraph:
    """module -> the package's modules it imports, each edge with the line of its first import."""
    files = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from . import x, from ..y import z
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]  # a name or a submodule
            else:
                continue
            for target in targets:
                while target and target not in files:  # `a.b.func` is module `a.b`
                    target = target.rpartition(".")[0]
                if target and target != name and not graph.has_edge(name, target):
                    graph.add_edge(name, target, line=node.lineno)
    return graph


def _described(graph: nx.DiGraph, cycle: list[tuple[str, str]]) -> str:
    return " -> ".join(f"{a} (line {graph.edges[a, b]['line']})" for a, b in cycle) + f" -> {cycle[0][0]}"


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    cycles = [_described(graph, list(zip(c, [*c[1:], c[0]]))) for c in nx.simple_cycles(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles, key=len)[:10])


def test_the_graph_sees_function_level_and_relative_imports_and_skips_type_checking(tmp_path, monkeypatch):
    """The reader itself, on a planted package: a cycle through a function-level import is found and named."""
    import sys

    package = tmp_path / "posttrainllm"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text("def f():\n    from posttrainllm.sub import b\n")
    (package / "sub" / "b.py").write_text("from . import c\n")
    (package / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                          "    from posttrainllm.sub import b\nfrom .a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "PROJECT_ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    graph = import_graph()
    assert set(graph.successors("posttrainllm.sub.c")) == {"posttrainllm.sub.a"}  # not b: a type-checking import
    cycles = [_described(graph, list(zip(c, [*c[1:], c[0]]))) for c in nx.simple_cycles(graph)]
    assert len(cycles) == 1 and "posttrainllm.sub.a (line 2)" in cycles[0] and "posttrainllm.sub.b (line 1)" in (
        cycles[0])
