"""The package's layers: imports point downward only, and importing the lab does not fix Triton's mode."""

import ast
import os
import subprocess
import sys

from posttrainllm.config import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "posttrainllm"
# top to bottom; a module may import its own layer and the layers below it (DESIGN.md "Layers"); rules: the table
# of the lab's rules (posttrainllm/rules.py), which every layer reads and which imports nothing of the package
LAYERS = ["cli", "lab", "track", "model", "measure", "ops", "files", "config", "rules"]
# Upward imports still to remove; this set only shrinks
PENDING: set[str] = set()


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "cli"


def _imports(path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("posttrainllm"):
            found.add(node.module if node.module != "posttrainllm" else f"posttrainllm.{node.names[0].name}")
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("posttrainllm")}
    return found


def upward_imports() -> list[str]:
    bad = []
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PROJECT_ROOT).with_suffix("").parts)
        if _layer(module) not in LAYERS or module.endswith("__main__"):
            continue
        for target in _imports(path):
            if _layer(target) in LAYERS and LAYERS.index(_layer(target)) < LAYERS.index(_layer(module)):
                bad.append(f"{module} -> {target}")
    return sorted(bad)


def test_imports_point_downward_only():
    assert [line for line in upward_imports() if line not in PENDING] == []
    assert PENDING <= set(upward_imports()), "a pending upward import is gone: drop it from PENDING"


def test_the_stages_do_not_import_triton_before_the_device_is_prepared():
    """TRITON_INTERPRET=1 is read when triton first loads; a stage that imports it early gets GPU-mode kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    stages = ", ".join(f"posttrainllm.lab.stages.{s}" for s in ("common", "reference", "kernel", "parity",
                                                                 "microbench", "bench_train", "receipt"))
    code = (f"import sys, importlib, posttrainllm.lab.pipeline, {stages}, posttrainllm.ops.registry as r\n"
            "for name in r.OP_PACKAGES: importlib.import_module(f'posttrainllm.ops.{name}.reference')\n"
            "print('triton' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          cwd=PROJECT_ROOT)
    assert done.stdout.strip() == "False"
