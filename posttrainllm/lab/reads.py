"""What each DVC stage reads, declared once: dvc.yaml's deps and params, the inputs files and the stamps' check.

`STAGES` holds one `Reads` per stage of dvc.yaml. A stage's code is its script (pipelines/<stage>.py), the
package modules it loads (`loads`: the ones its code imports inside functions, as Python loads them only when
called) and everything those import when loaded (found by reading the files: `imported_closure`), each op's
definition found through ops/registry.py (`op_definition_sources`), and, for a point, its op's own code and
declarations (ops/<op>/__init__.py `READS`). Nothing here names an op.

From it:
- dvc.yaml: every stage's deps and params (`write_dvc_yaml`, `posttrainllm dvc-yaml [--check]`); a point stage's
  code and config keys go through its inputs file instead;
- runs/inputs/<point>/<stage>.json: a point stage's files and config keys, from the point's config
  (`point_stage_deps`; lab/sweep.py `stage_inputs`): what an edit reruns;
- the stamps: a stage refuses its stamp when it loaded a file its inputs file does not list (track/stamp.py
  `check_inputs`), and a stage that runs a user's path stamps that path's file (`outside_sources`).

Read without importing torch (the inputs stage runs on every `dvc repro`): op declarations are read from the
files, never imported.
"""

from __future__ import annotations

import ast
import functools
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrainllm.config import PROJECT_ROOT, ConfigError

POINT_STAGES = ("reference", "kernel", "parity", "microbench", "bench_train", "receipt")  # a point's, in DVC's order

PACKAGE = "posttrainllm"
OPS = Path(PACKAGE) / "ops"  # root-relative: each op's folder, ops/<op>/


@dataclass(frozen=True)
class Reads:
    """What one DVC stage reads.

    loads      package modules (dotted) or folders (a/b: every .py under it) the stage loads beyond what its script
               imports; what each imports when loaded comes with it (`imported_closure`)
    ops        "definitions": every op's definition and readable math (validating a config applies the ops' rules,
               never a kernel); "kernels": also the point's op's Triton code (the stages that run it)
    files      other files it reads whole (conf/ files)
    params     a point stage: paths in the planned point ("config.tile"); another: {conf file: [keys]}
    upstream   files earlier stages wrote (dvc.yaml deps, after the code)
    runs_paths a point stage that runs or records the point's paths, those from outside (op.user_impls) among
               them: their files and the Triton kernel files they launch are its inputs, and its stamp hashes them
    kernels_of a module whose `slot_op(SLOT)` calls (SLOT a model/slots.py constant) take the ops whose Triton code
               the stage runs (not a point's op: the draft heads' attention), each the op whose definition declares
               that slot's default math (`slot_ops`)
    notes      dvc.yaml's end-of-line comment for an entry of deps or params
    """

    loads: tuple[str, ...] = ()
    ops: str | None = None
    files: tuple[str, ...] = ()
    params: tuple[str, ...] | dict[str, tuple[str, ...]] = ()
    upstream: tuple[str, ...] = ()
    runs_paths: bool = False
    kernels_of: str | None = None
    notes: dict[str, str] = field(default_factory=dict)


# What every point stage's process loads: lab/pipeline.py runs the stage (its config validated, its own module
# imported, its stamp written), and the ops' registry gives the point's op
POINT = ("posttrainllm.lab.configure", "posttrainllm.lab.stages.common",
         "posttrainllm.lab.reads",  # what the stage runs from outside the package, for its stamp
         "posttrainllm/lab/isolation",  # worker, user paths, outside timing, rooms, guards
         "posttrainllm.measure.calibrate", "posttrainllm.measure.roofline",  # the stages' shared notes and limits
         "posttrainllm.track.stamp", "posttrainllm.track.provenance", "posttrainllm.track.store",
         "posttrainllm.track.found")  # where receipts are
TIMED = ("posttrainllm.lab.approval",)  # a GPU times only with approval (POSTTRAINLLM_APPROVE=1)
# What validating a config loads beside the ops (config.load() resolves op.user_impls: read, never run)
CONFIGURE = ("posttrainllm.lab.configure", "posttrainllm.lab.isolation.user")
HEADS = ("posttrainllm.lab.heads", *CONFIGURE, *TIMED, "posttrainllm.track.stamp", "posttrainllm.track.provenance",
         "posttrainllm.track.store")
# The heads stages' config: the options conf/config.yaml picks (a file named conf/<group>/{default}.yaml: heads k3,
# architecture mha, op, tile, ...; device auto, as the scripts pass device=auto); fields no file sets are
# posttrainllm/config.py's defaults
HEADS_K = "conf/heads/{default}.yaml"
HEADS_CONF = {"conf/config.yaml": ("defaults", "bench.threads"), "conf/device/auto.yaml": ("name",)}
HEADS_BASE = ("runs/heads/base/base.pt", "runs/heads/base/base.json")
HEADS_ITEM = ("runs/heads/${item}/heads.pt", "runs/heads/${item}/heads.json")
MODEL = "conf/architecture/{default}.yaml"


@dataclass(frozen=True)
class EveryKey:
    """Every top-level key of a conf/ file (in its order), but these."""

    but: tuple[str, ...] = ()


STAGES: dict[str, Reads] = {
    "device": Reads(),  # the fingerprint, read from files where it can (no torch)
    "calibrate": Reads(loads=(*CONFIGURE, "posttrainllm.measure.calibrate"), ops="definitions",
                       # it composes conf/ (config.load()); the peaks depend on this only
                       params={"conf/config.yaml": ("bench.threads",)}, upstream=("runs/device.json",)),
    "inputs": Reads(loads=("posttrainllm.lab.sweep", "posttrainllm.lab.reads", "posttrainllm.track.stamp"),
                    files=("params.yaml",), upstream=("runs/calibration.json",),
                    notes={"runs/calibration.json": "its sha256 goes to each microbench's inputs: checked before "
                                                    "timing"}),
    "reference": Reads(loads=("posttrainllm.lab.stages.reference", *POINT), ops="definitions",
                       params=("config.op", "config.precision.dtype", "config.precision.allow_tf32",
                               "config.precision.lse_contract",  # op=moe: the router's fp32 check
                               "config.precision.quantize",  # fp8: the recipe each case's inputs are quantized by
                               "config.shape", "config.architecture", "config.device.name", "config.parity",
                               "config.bench.threads")),
    "kernel": Reads(loads=("posttrainllm.lab.stages.kernel", *POINT, "posttrainllm.ops.launches",  # guards count
                           "posttrainllm.lab.compile", "posttrainllm.measure.sass",  # its `compile` section
                           "posttrainllm.lab.invariance"),  # determinism and batch invariance, measured
                    ops="kernels", runs_paths=True, upstream=("runs/${key}/reference.pt",),
                    params=("config.op", "config.precision.dtype", "config.precision.allow_tf32",
                            "config.precision.dot_precision",
                            "config.precision.quantize",  # fp8: the quantized paths, the interpreter's emulation note
                            "config.tile", "config.workgroup", "config.architecture", "config.device.name",
                            "config.bench.threads", "config.compile",
                            "config.shape")),  # the compile section: its targets, the main case's shape
    "parity": Reads(loads=("posttrainllm.lab.stages.parity", *POINT, "posttrainllm.lab.invariance"), ops="definitions",
                    runs_paths=True, upstream=("runs/${key}/reference.pt", "runs/${key}/kernel.pt", "runs/${key}/kernel.json"),
                    params=("config.op",  # op.max_error_only too: outputs without the elementwise count
                            "config.precision", "config.architecture", "config.device.name", "config.bench.threads",
                            "config.parity.require")),  # the bitwise properties every path must have
    "microbench": Reads(loads=("posttrainllm.lab.stages.microbench", *POINT, *TIMED, "posttrainllm/measure",
                               "posttrainllm.track.plots"), ops="kernels", runs_paths=True,
                        upstream=("runs/device.json", "runs/calibration.json", "runs/${key}/parity.json"),
                        params=("config.op", "config.precision", "config.tile", "config.workgroup", "config.shape",
                                "config.architecture", "config.parity", "config.bench", "config.device.name")),
    "bench_train": Reads(loads=("posttrainllm.lab.stages.bench_train", *POINT, *TIMED, "posttrainllm/model"),
                         ops="kernels", runs_paths=True,
                         upstream=("runs/device.json", "runs/${key}/parity.json", "runs/${key}/microbench.json",
                                   "runs/heads/base/base.pt"),
                         params=("config.op", "config.precision", "config.tile", "config.workgroup",
                                 "config.architecture", "config.train", "config.bench.threads", "config.device.name"),
                         notes={"runs/heads/base/base.pt": "a quantized precision's quality gate decodes with it: "
                                                           "every point lists it, so DVC trains the base first"}),
    "receipt": Reads(loads=("posttrainllm.lab.stages.receipt", *POINT,
                            "posttrainllm.track.receipt",  # the point's receipt and MLflow run (`record`)
                            "posttrainllm.track.report", "posttrainllm.measure.sass"),  # the sweep's table
                     ops="definitions", params=("changes", "config"),  # the whole config and what the point changes
                     upstream=("runs/${key}/kernel.json", "runs/${key}/parity.json", "runs/${key}/microbench.json",
                               "runs/${key}/timings.csv", "runs/${key}/curve.csv", "runs/${key}/bench_train.json",
                               "runs/${key}/tracebacks", "runs/${key}/stamps/reference.json",
                               "runs/${key}/stamps/kernel.json", "runs/${key}/stamps/parity.json",
                               "runs/${key}/stamps/microbench.json", "runs/${key}/stamps/bench_train.json"),
                     notes={"runs/${key}/tracebacks": "logged with the MLflow run",
                            "runs/${key}/stamps/reference.json": "checked against each other, and recorded"}),
    # the draft heads (lab/heads.py): base -> heads -> decode
    "train_base": Reads(loads=HEADS, ops="definitions", files=(MODEL,),
                        params={HEADS_K: ("out_dir", "base", "prompt_len", "new_tokens"), **HEADS_CONF},
                        notes={MODEL: "every field read (the base's fingerprint)",
                               HEADS_K: "prompt_len, new_tokens: the sample continuation it records"}),
    "train_heads": Reads(loads=HEADS, ops="definitions", files=(MODEL,), upstream=HEADS_BASE,
                         params={HEADS_K: ("out_dir", "base", "steps", "batch_size", "lr", "loss_decay", "seed",
                                           "train_prompts", "prompt_len", "continuation_len", "eval_prompts",
                                           "new_tokens"),
                                 "conf/heads/${item}.yaml": ("name", "num_heads"), **HEADS_CONF},
                         notes={HEADS_K: "base: its fingerprint (load_base refuses another base)"}),
    "decode": Reads(loads=(*HEADS, "posttrainllm.measure.calibrate", "posttrainllm.measure.memory",
                           "posttrainllm.measure.timing", "posttrainllm.model.amdahl",  # the receipt's band
                           "posttrainllm.model.gap",  # the trainer-sampler gap, every attention path scoring
                           "posttrainllm.track.derived", "posttrainllm.track.receipt", "posttrainllm.track.records"),
                    ops="definitions", kernels_of="posttrainllm.lab.heads", files=(MODEL,),
                    upstream=("runs/device.json", "runs/calibration.json", *HEADS_BASE,
                              "runs/heads/base/stamps/train_base.json", *HEADS_ITEM,
                              "runs/heads/${item}/stamps/train_heads.json"),
                    params={HEADS_K: EveryKey(but=("name", "num_heads")),
                            "conf/heads/${item}.yaml": ("name", "num_heads"),
                            "conf/config.yaml": ("defaults", "bench.threads", "run.log_mlflow"),
                            "conf/device/auto.yaml": ("name",),
                            # the gap's trainers: the default op's paths (their config, copied whole)
                            "conf/op/{default}.yaml": ("name", "causal", "peers", "user_impls", "only"),
                            # the Triton paths' launches (the gap's trainer; heads.cached_attention=triton)
                            "conf/tile/{default}.yaml": ("name", "block_q", "block_kv", "dkdv_block_q",
                                                         "dkdv_block_kv", "dq_block_q", "dq_block_kv"),
                            "conf/workgroup/{default}.yaml": ("name", "num_warps", "num_stages"),
                            "conf/precision/{default}.yaml": ("dot_precision",)},
                    notes={"runs/device.json": "timed: reruns on another machine",
                           "runs/heads/base/stamps/train_base.json": "checked against each other, and recorded",
                           HEADS_K: "every field but name and num_heads (the receipt holds them all)"}),
}
# dvc.yaml's comments on code files, wherever a stage lists them
CODE_NOTES = {"posttrainllm/lab/isolation/user.py": "config.load() resolves op.user_impls (read, never run)",
              "posttrainllm/lab/approval.py": "on a GPU: refused without approval",
              f"{OPS.as_posix()}/${{item.config.op.name}}": "its op's folder (its kernels), named here too: see inputs"}
# The stages that run the op's Triton path: kernel checks it and records its launch geometry; microbench times
# it and bench_train trains it (on a GPU; bench_train also on a CPU, through the interpreter, for a few steps)
KERNEL_STAGES = tuple(stage for stage in POINT_STAGES if STAGES[stage].ops == "kernels")
# The stages whose outputs depend on a user path's code: kernel runs it (and records its identity), parity
# records its identity and judges its outputs, microbench times it, bench_train trains it
USER_STAGES = tuple(stage for stage in POINT_STAGES if STAGES[stage].runs_paths)
# An op's Triton code (ops/<op>/): loaded only by the stages that run its Triton path; fp8.py under a quantized
# precision (it imports its op's kernels.py)
KERNEL_FILES = ("kernels.py", "fp8.py")
# ops/*.py no stage loads but by its `loads`: the docs' signature table (python -m posttrainllm.ops.signatures);
# the launch counter (the kernel stage's guards)
NOT_LOADED = ("signatures.py", "launches.py")


# --- code: what importing a module loads, read from the files ------------------------------------------------


def _module_file(name: str, root: Path) -> Path | None:
    path = root / Path(*name.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def _module_name(file: Path, root: Path) -> str:
    parts = file.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(file: Path, root: Path, inside_functions: bool = False) -> set[str]:
    """The package modules `file` imports when it is loaded (its top level, `if` and `try` blocks included), or
    (inside_functions) only those imported inside its functions and methods: loaded when they run."""
    stat = file.stat()  # read once per version of the file: the inputs stage asks for every point and stage
    return set(_module_imports(file, root, inside_functions, stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=4096)
def _module_imports(file: Path, root: Path, inside_functions: bool, mtime_ns: int, size: int) -> frozenset[str]:
    tree = ast.parse(file.read_text())
    package = _module_name(file, root).split(".")
    if file.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()

    def visit(nodes: list[ast.stmt], in_function: bool) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, True)
                continue
            if in_function == inside_functions:
                if isinstance(node, ast.Import):
                    found.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
                    if base.split(".")[0] == PACKAGE:
                        found.add(base)  # `from a import b`: b may be a module of a
                        found.update(f"{base}.{a.name}" for a in node.names if _module_file(f"{base}.{a.name}", root))
            for child in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, child, None)
                if isinstance(inner, list):
                    visit(inner, in_function)

    visit(tree.body, False)
    return frozenset(found)


def imported_closure(modules: tuple[str, ...] | list[str], root: Path = PROJECT_ROOT) -> set[str]:
    """The root-relative files of `modules` and of every package module their loading loads (parents included),
    ops/ left out (its files come through the registry: `op_definition_sources`, an op's own code)."""
    files: set[str] = set()
    todo = list(modules)
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        file = _module_file(name, root)
        if file is None:
            raise ConfigError(f"{name}: no such module under {root} (posttrainllm/lab/reads.py STAGES)")
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += module_imports(file, root)
        files.add(file.relative_to(root).as_posix())
    return {f for f in files if not f.startswith(f"{OPS.as_posix()}/")}


def op_packages(root: Path = PROJECT_ROOT) -> tuple[str, ...]:
    """ops/registry.py's OP_PACKAGES, read from the file (not imported: no torch here)."""
    registry = ast.parse((root / OPS / "registry.py").read_text())
    return next(ast.literal_eval(node.value) for node in registry.body if isinstance(node, ast.Assign)
                and any(isinstance(target, ast.Name) and target.id == "OP_PACKAGES" for target in node.targets))


def op_definition_sources(root: Path = PROJECT_ROOT) -> list[str]:
    """posttrainllm/ops/'s shared modules and the registry's op packages, but the ops' kernels: what importing the
    registry loads (validating a config does), never a kernel. Read from the files, not imported (no torch here)."""
    ops = root / OPS
    files = [path for path in ops.glob("*.py") if path.name not in NOT_LOADED]
    files += [path for package in op_packages(root) for path in (ops / package).rglob("*.py")
              if path.name not in KERNEL_FILES and "__pycache__" not in path.parts]
    return sorted(path.relative_to(root).as_posix() for path in files)


def _as_file(entry: str, root: Path) -> str:
    """A `loads` entry as dvc.yaml and the inputs files name it: a module's file, or a folder as it is."""
    if "/" in entry:
        return entry
    file = _module_file(entry, root)
    if file is None:
        raise ConfigError(f"{entry}: no such module under {root} (posttrainllm/lab/reads.py STAGES)")
    return file.relative_to(root).as_posix()


def stage_code(stage: str, root: Path = PROJECT_ROOT) -> list[str]:
    """The code a stage loads whatever the point: its script, its `loads` and what they import, and every op's
    definition where it validates a config; folders stand for every .py under them, each file once."""
    reads = STAGES[stage]
    script = f"pipelines/{stage}.py"
    modules = {m for m in module_imports(root / script, root)}  # the script's own imports
    modules |= {m for m in reads.loads if "/" not in m}
    code = imported_closure(sorted(modules), root) | {_as_file(m, root) for m in reads.loads if "/" in m}
    code |= {_as_file(m, root) for m in reads.loads if "/" not in m}  # ops/ modules named in loads (launches.py)
    if reads.ops:
        code |= set(op_definition_sources(root))
    if reads.kernels_of:
        code |= {f"{OPS.as_posix()}/{op}/kernels.py" for op in slot_ops(reads.kernels_of, root)}
    folders = [c for c in code if not c.endswith(".py")]
    code = {c for c in code if not any(c.startswith(folder + "/") for folder in folders)}
    return [script, *sorted(code)]


def _string_constants(file: Path) -> dict[str, str]:
    """A module's top-level `NAME = "text"` assignments (model/slots.py's slot names)."""
    found = {}
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return found


def slot_defaults(root: Path = PROJECT_ROOT) -> dict[str, str]:
    """{model slot: the op package whose definition declares its default math}: each registry package's
    definition.py's `model_defaults={...}` keys, read from the files as ops/registry.py `slot_op` reads them."""
    owners = {}
    for package in op_packages(root):
        definition = root / OPS / package / "definition.py"
        if not definition.is_file():
            continue
        for node in ast.walk(ast.parse(definition.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "model_defaults" and isinstance(node.value, ast.Dict):
                owners.update({key.value: package for key in node.value.keys if isinstance(key, ast.Constant)})
    return owners


def slot_ops(module: str, root: Path = PROJECT_ROOT) -> list[str]:
    """The op packages whose paths `module` fills model slots with: for each `slot_op(SLOT)` call, SLOT a constant of
    model/slots.py (or a literal), the op declaring that slot's default math (`slot_defaults`)."""
    tree = ast.parse(_module_file(module, root).read_text())
    names = _string_constants(_module_file(f"{PACKAGE}.model.slots", root))
    slots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "slot_op" \
                and node.args:
            arg = node.args[0]
            slots.add(names.get(arg.id) if isinstance(arg, ast.Name) else getattr(arg, "value", None))
    owners = slot_defaults(root)
    unknown = sorted(str(slot) for slot in slots if slot not in owners)
    if unknown:
        raise ConfigError(f"{module}: slot_op of {', '.join(unknown)}: no op's definition declares that slot's "
                          f"default (model_defaults); declared: {', '.join(sorted(owners))}")
    return sorted({owners[slot] for slot in slots})


# --- a point's op: its own code and declarations (ops/<op>/__init__.py READS) ----------------------------------


def _op_declaration(folder: str, root: Path) -> dict[str, Any]:
    """ops/<op>/__init__.py's READS, a literal (read, not imported), or {} where it has none or no folder."""
    init = root / folder / "__init__.py"
    if not init.is_file():
        return {}
    return _declared(init, init.stat().st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _declared(init: Path, mtime_ns: int) -> dict[str, Any]:
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "READS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def point_value(point: dict[str, Any], key: str) -> Any:
    value = point
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ConfigError(f"{key}: not in the planned point: regenerate params.yaml with `posttrainllm sweep`")
        value = value[part]
    return value


def op_reads(stage: str, point: dict[str, Any], root: Path = PROJECT_ROOT) -> dict[str, list[str]]:
    """What the point's op itself makes `stage` read: {"sources": [...], "params": [...]}.

    Its Triton code where the stage runs it (ops/<op>/kernels.py; under a quantized precision its fp8.py too),
    unless its declaration says it has none ("triton": False), and each entry of its declaration's "reads" whose
    "stages" (default: every point stage) hold `stage` and whose "when" ({config key: value}) the point matches:
    "code" (files or folders), "code_at" (config keys whose value is a file: a problem file) and "params".
    """
    config = point["config"]
    folder = f"{OPS.as_posix()}/{config['op']['name']}"
    declared = _op_declaration(folder, root)
    sources: list[str] = []
    params: list[str] = []
    if STAGES[stage].ops == "kernels" and declared.get("triton", True):
        quantized = ((config.get("precision") or {}).get("quantize") or {}).get("format")
        sources += [f"{folder}/fp8.py"] if quantized else []
        sources.append(f"{folder}/kernels.py")
    for entry in declared.get("reads", ()):
        if stage not in entry.get("stages", POINT_STAGES):
            continue
        if any(point_value(point, key) != value for key, value in (entry.get("when") or {}).items()):
            continue
        sources += list(entry.get("code", ()))
        sources += [str(point_value(point, key)) for key in entry.get("code_at", ())]
        params += [key for key in entry.get("params", ()) if key not in STAGES[stage].params]
    return {"sources": sources, "params": params}


def user_sources(config: dict[str, Any]) -> list[str]:
    """The files of the point's user paths (op.user_impls): project-relative, or absolute when installed
    elsewhere (the inputs stage hashes them either way, so an edit reruns the stages that run them)."""
    specs = config["op"].get("user_impls") or []  # a point planned by `posttrainllm sweep` always has the key
    if not specs:
        return []
    from types import SimpleNamespace

    from posttrainllm.lab.isolation.user import resolve
    from posttrainllm.ops.registry import OPS as BUILT_IN

    # resolving a spec reads the op's name only: an op made from a file is not loaded to hash a spec
    op = BUILT_IN.get(config["op"]["name"]) or SimpleNamespace(name=config["op"]["name"])
    return [resolve(spec, op).identity["file"] for spec in specs]


def point_stage_deps(stage: str, point: dict[str, Any], root: Path = PROJECT_ROOT) -> dict[str, list[str]]:
    """What a planned point's stage depends on: {"sources": files and folders, "params": paths in the point}."""
    if stage not in POINT_STAGES:
        raise ValueError(f"unknown point stage {stage!r}: the point stages are {', '.join(POINT_STAGES)}")
    reads = STAGES[stage]
    own = op_reads(stage, point, root)
    user = [*user_sources(point["config"]), *(point.get("kernel_files") or [])] if reads.runs_paths else []
    sources = list(dict.fromkeys([*stage_code(stage, root), *own["sources"], *user]))
    folders = [s for s in sources if not s.endswith(".py")]
    sources = [s for s in sources if not any(s.startswith(folder + "/") for folder in folders)]  # each file once
    return {"sources": sources, "params": [*reads.params, *own["params"]]}


def source_files(sources: list[str], root: Path) -> list[str]:
    """`sources` with every folder replaced by the .py files under it (root-relative, sorted); a ConfigError
    names the first that does not exist."""
    files = set()
    for source in sources:
        path = root / source
        if path.is_dir():
            files.update(f.relative_to(root).as_posix() for f in path.rglob("*.py"))
        elif path.is_file():
            files.add(source)
        else:
            raise ConfigError(f"{source}: not found under {root.resolve()}, but a point stage depends on it "
                              "(posttrainllm/lab/reads.py)")
    return sorted(files)


def undeclared_imports(stage: str, root: Path = PROJECT_ROOT) -> list[str]:
    """The package modules the stage's own module (lab/stages/<stage>.py) imports inside its functions that its
    declaration does not cover (neither in `loads` nor loaded by them): its inputs would miss them."""
    own = root / "posttrainllm" / "lab" / "stages" / f"{stage}.py"
    if not own.is_file():
        return []
    covered = set(stage_code(stage, root))
    missing = []
    for name in sorted(module_imports(own, root, inside_functions=True)):
        file = _module_file(name, root)
        relative = file.relative_to(root).as_posix() if file else name
        if relative.startswith(f"{OPS.as_posix()}/") or any(relative == c or relative.startswith(c.removesuffix(
                ".py").rstrip("/") + "/") for c in covered):
            continue
        missing.append(relative)
    return missing


# --- dvc.yaml: every stage's deps and params --------------------------------------------------------------


def dvc_deps(stage: str, root: Path = PROJECT_ROOT) -> list[str]:
    """The stage's deps in dvc.yaml. A point stage: its inputs file (its code and config keys, `point_stage_deps`),
    its op's folder by name where it runs the op's Triton code (so `dvc status` shows a kernel edit before the
    inputs stage runs; .dvcignore leaves out the bytecode), then what earlier stages wrote; another stage: its code, its files, then what earlier stages wrote."""
    reads = STAGES[stage]
    if stage in POINT_STAGES:
        # the op's folder, not its kernels.py: an op made from a problem file has no Triton code (ops/problem/)
        kernels = [f"{OPS.as_posix()}/${{item.config.op.name}}"] if reads.ops == "kernels" else []
        return [f"runs/inputs/${{key}}/{stage}.json", *kernels, *reads.upstream]
    return [*stage_code(stage, root), *(conf_file(f, root) for f in reads.files), *reads.upstream]


def conf_file(name: str, root: Path = PROJECT_ROOT) -> str:
    """conf/<group>/{default}.yaml as the file of the option conf/config.yaml picks for the group; else `name`."""
    if "{default}" not in name:
        return name
    import yaml

    defaults = yaml.safe_load((root / "conf" / "config.yaml").read_text())["defaults"]
    picked = {k: v for entry in defaults if isinstance(entry, dict) for k, v in entry.items()}
    return name.format(default=picked[name.split("/")[1]])


def dvc_params(stage: str, root: Path = PROJECT_ROOT) -> list[tuple[str, str, list[str]]]:
    """The stage's params in dvc.yaml, as (declared name, conf file, keys); none for a point stage (they are in its
    inputs file)."""
    params = STAGES[stage].params
    if stage in POINT_STAGES or not params:
        return []
    made = []
    for name, keys in params.items():
        file = conf_file(name, root)
        if isinstance(keys, EveryKey):
            import yaml

            keys = [key for key in yaml.safe_load((root / file).read_text()) if key not in keys.but]
        made.append((name, file, list(keys)))
    return made


def _yaml():
    from ruamel.yaml import YAML

    yaml = YAML()  # round-trip: dvc.yaml's comments, order and layout kept
    yaml.indent(mapping=2, sequence=4, offset=2)
    yaml.width = 120
    return yaml


def dvc_yaml(text: str, root: Path = PROJECT_ROOT) -> str:
    """dvc.yaml's text with every stage's deps and params as STAGES declares them, the rest (cmd, outs, foreach,
    comments) as it is. A ConfigError names a stage of dvc.yaml that STAGES lacks, or the reverse."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    yaml = _yaml()
    data = yaml.load(text)
    stages = data["stages"]
    if set(stages) != set(STAGES):
        raise ConfigError(f"dvc.yaml's stages ({', '.join(stages)}) are not posttrainllm/lab/reads.py STAGES "
                          f"({', '.join(STAGES)}): declare each stage there")
    for stage, spec in stages.items():
        body = spec["do"] if "do" in spec else spec
        notes = STAGES[stage].notes
        notes = {**CODE_NOTES, **notes}
        named = {conf_file(f, root): f for f in STAGES[stage].files}
        deps = CommentedSeq(dvc_deps(stage, root))
        for i, dep in enumerate(deps):
            if named.get(dep, dep) in notes:
                deps.yaml_add_eol_comment(notes[named.get(dep, dep)], i, column=0)
        body["deps"] = deps
        params = dvc_params(stage, root)
        if params:
            seq = CommentedSeq()
            for i, (name, file, keys) in enumerate(params):
                seq.append(CommentedMap({file: CommentedSeq(keys)}))
                if name in notes:
                    seq[i].yaml_add_eol_comment(notes[name], file, column=0)
            body["params"] = seq
        elif "params" in body:
            del body["params"]
    out = io.StringIO()
    yaml.dump(data, out)
    return out.getvalue()


def write_dvc_yaml(path: Path, check: bool = False, root: Path = PROJECT_ROOT) -> bool:
    """Whether dvc.yaml's deps and params were as STAGES declares them; where not, rewritten (unless `check`)."""
    text = path.read_text()
    made = dvc_yaml(text, root)
    if made != text and not check:
        path.write_text(made)
    return made == text


# --- the stamps: files outside the package a stage ran ---------------------------------------------------------


def outside_sources(stage: str, cfg: Any, folder: Path) -> dict[str, str]:
    """{file: sha256} of what a point stage ran from outside the package, for its stamp (track/stamp.py): the files
    of the point's user paths where the stage runs them (the runner's paths: each Impl's source, as resolved), and
    for the kernel stage the files of the Triton kernels they launched (its compile section, in kernel.json)."""
    if not STAGES[stage].runs_paths:
        return {}
    import json

    from posttrainllm.lab import runner
    from posttrainllm.ops.registry import op_for

    found = runner.outside_files(op_for(cfg), cfg)
    record = folder / "kernel.json"
    if stage == "kernel" and record.is_file():
        from posttrainllm.lab.compile import kernel_files

        found.update(kernel_files(json.loads(record.read_text()).get("compile") or {}))
    return found
