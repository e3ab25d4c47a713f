"""Complete, checked dependencies: what each stage depends on against what it imports and reads, and stamps.

What each stage reads is declared once (posttrainllm/lab/reads.py), and dvc.yaml's deps and params are written
from it (`posttrainllm dvc-yaml`). A point stage depends on its inputs file runs/inputs/<point>/<stage>.json
(dvc.yaml), which lists, from the point's config, every file it runs and every config key it reads
(`point_stage_deps`); the other stages list theirs in dvc.yaml. Each must cover every posttrainllm module its
process loads and every config key it reads; both are derived by running the stages of two points of
different ops (in a copy of the project, with `dvc repro`) and reading their stamps
(posttrainllm/track/stamp.py). On a CPU the timed stages skip the Triton path (interpreter timings
are not speed), so microbench and bench_train also run once more "as on a GPU" (the interpreter
counted as a device: what they import and read is the point, not their numbers). A point stage lists
an op's kernel file exactly where it runs it, so an edit reruns the points that run the edited code
and no others. The receipt refuses stamps that disagree about shared code.
"""

import copy
import functools
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from conftest import run_command as _run, short_calibration
import yaml

from posttrainllm.config import PROJECT_ROOT, ConfigError, Contract, TileConfig
from posttrainllm.lab import reads, sweep
from posttrainllm.lab.configure import load
from posttrainllm.model import slots
from posttrainllm.ops import registry
from posttrainllm.track import stamp

POINT = "baseline"
MATMUL = "op-matmul"  # a point of another op: its kernel is not attention's
MOE = "op-moe"  # one more op, up to parity: its paths depend on its shape (ops/moe/definition.py probes grouped_mm)
POINT_STAGES = sweep.POINT_STAGES
KERNEL_STAGES = reads.KERNEL_STAGES  # the stages that run the op's Triton path
ALWAYS_CHANGED = {"device", "inputs"}  # dvc.yaml: they run on every `dvc repro`
ENV_RECORD = {stamp.RECORD_ENV: "1"}  # the timed stages record their config reads too

# Run a stage script with the Triton path treated as on a GPU (timed, profiled): what it imports and reads.
GPU_LIKE = (
    "import runpy, sys\n"
    "from posttrainllm.measure import device\n"
    "device.triton_interpreted = lambda: False\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
# Run a script and write the project files of every module it loaded (for the stages without stamps).
IMPORTS = (
    "import atexit, json, runpy, sys\n"
    "from pathlib import Path\n"
    "out = sys.argv[1]\n"
    "def dump():\n"
    "    root = Path.cwd().resolve()\n"
    "    files = {Path(m.__file__).resolve() for m in list(sys.modules.values()) if getattr(m, '__file__', None)}\n"
    "    Path(out).write_text(json.dumps(sorted(f.relative_to(root).as_posix() for f in files\n"
    "                                           if f.is_relative_to(root / 'posttrainllm'))))\n"
    "atexit.register(dump)\n"
    "sys.argv = sys.argv[2:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


# --- the checks, as functions (so that each is also shown to fail) ------------------------------


def stage_spec(dvc: dict, stage: str, point: str = POINT, plan: dict | None = None) -> dict:
    """A stage's deps, params and outs from dvc.yaml's dict, `${key}` / `${item}` of a foreach stage set to `point`.

    A point stage's inputs file stands for what it lists: the planned point's `point_stage_deps` (plan: params.yaml),
    its params as `points.<point>.<path>`; `${item.<path>}` is the planned point's value.
    """
    spec = dvc["stages"][stage]
    spec = spec.get("do", spec)

    def sub(text: str) -> str:
        if plan is not None and point in plan["points"]:  # ${item.a.b}: a value of the planned point
            text = re.sub(r"\$\{item\.([\w.]+)\}", lambda m: str(functools.reduce(
                lambda value, part: value[part], m[1].split("."), plan["points"][point])), text)
        return text.replace("${key}", point).replace("${item}", point)

    deps = [sub(next(iter(d)) if isinstance(d, dict) else d) for d in spec.get("deps", [])]
    params: list[str] = []
    for p in spec.get("params", []):
        if isinstance(p, dict):  # {file: [keys]}: keys of another params file
            params += [f"{sub(file)}:{key}" for file, keys in p.items() for key in keys]
        else:
            params.append(sub(p))
    if f"runs/inputs/{point}/{stage}.json" in deps:
        planned = reads.point_stage_deps(stage, plan["points"][point])
        deps += planned["sources"]
        params += [f"points.{point}.{path}" for path in planned["params"]]
    outs = [sub(next(iter(o)) if isinstance(o, dict) else o) for o in spec.get("outs", [])]
    return {"deps": deps, "params": params, "outs": outs}


def uncovered_sources(sources, deps: list[str]) -> list[str]:
    """The source files no dep covers (a dep covers itself and, as a folder, everything under it)."""
    deps = [d.rstrip("/") for d in deps]
    return sorted(s for s in sources if not any(s == d or s.startswith(d + "/") for d in deps))


def uncovered_keys(keys, params: list[str], point: str = POINT) -> list[str]:
    """The config keys no param covers: `points.<point>.config.tile` covers `tile.block_q`, `points.<point>` all."""
    full = {key: f"points.{point}.config.{key}" for key in keys}
    return sorted(key for key, name in full.items() if not any(name == p or name.startswith(p + ".") for p in params))


def without(spec: dict, field: str, entry: str) -> dict:
    """A stage spec with one entry of its deps or params removed."""
    fewer = {**spec, field: [e for e in spec[field] if e != entry]}
    assert len(fewer[field]) < len(spec[field]), entry
    return fewer


def listed_kernels(plan: dict, point: str, stage: str, root: Path = PROJECT_ROOT) -> set[str]:
    """The posttrainllm/ops/ files a point's stage depends on (its inputs file's sources)."""
    files = reads.source_files(reads.point_stage_deps(stage, plan["points"][point])["sources"], root)
    return {f for f in files if f.startswith("posttrainllm/ops/")}


# --- a copy of the project, two points reproduced ------------------------------------------------


def _with_points_of_other_ops(root: Path) -> None:
    """The smoke sweep and points of other ops (op-matmul, op-moe: one dimension changed each), a tiny
    draft-heads base: every bench_train depends on it (dvc.yaml), but what the stages load and read does not
    depend on its size (its 600 steps were a third of this module's time), and a short calibration."""
    short_calibration(root)  # what calibrate loads does not depend on it: run twice here (dvc repro, its imports)
    path = root / "conf" / "sweep" / "smoke.yaml"
    plan = yaml.safe_load(path.read_text())
    plan["vary"]["op"] = ["matmul", "moe"]
    # attention's cases shorter (S=128 and 100 were most of its kernel stage): what it loads and reads is the same
    plan["overrides"] += ["shape.seq_len=64", "shape.edge_seq_lens=[1,37]"]
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    heads = root / "conf" / "heads" / "k3.yaml"
    config = yaml.safe_load(heads.read_text())
    config["base"].update(steps=6, warmup_steps=1, batch_size=4, seq_len=32, eval_batches=1, threads=1)
    heads.write_text(yaml.safe_dump(config, sort_keys=False))


@pytest.fixture(scope="module")
def project(project_copy):
    """A committed copy of the project, the smoke sweep, op-matmul and op-moe planned, the baseline point
    reproduced, op-matmul and op-moe up to parity (what the timed stages read). Every stage checks its stamp
    against its inputs file (lab/pipeline.py `stamped`): a file or key missing there fails `dvc repro`."""
    root, env = project_copy("deps", sweep="smoke", edit=_with_points_of_other_ops, env=ENV_RECORD)
    _run(["dvc", "repro", f"receipt@{POINT}", f"parity@{MATMUL}", f"parity@{MOE}"], root, env)
    return root, env


@pytest.fixture(scope="module")
def dvc(project):
    root, _ = project
    return yaml.safe_load((root / "dvc.yaml").read_text())


@pytest.fixture(scope="module")
def plan(project):
    root, _ = project
    return yaml.safe_load((root / "params.yaml").read_text())


@pytest.fixture(scope="module")
def stamps(project):
    root, _ = project
    return stamp.read_stamps(root / "runs" / POINT)


def _gpu_like(root: Path, env: dict, side: Path, point: str) -> dict:
    """microbench and bench_train of a smaller copy of `point` in `side`, the Triton path timed as on a GPU."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    config = params["points"][point]["config"]
    config["shape"]["curve"] = [32, 64]
    if config["op"]["name"] == "matmul":  # a smaller model (as HEADS_TINY): what the stages load and read does not
        # depend on its size; its interpreted Triton GEMMs trained at d_model=128 took 20 s, at 64 7 s (attention's
        # paths at head_dim=16 took longer, 39 s against 8 s: left as they are)
        config["architecture"].update(d_model=64, mlp_hidden=128, head_dim=16)
    config["bench"].update(warmup=0, reps=1, max_reps=1, min_time_s=0.0)
    config["train"].update(steps=1, warmup_steps=0)  # one step: the Triton path trains through the interpreter
    params["points"] = {point: params["points"][point]}
    (side / "params.yaml").write_text(yaml.safe_dump(params))
    (side / "runs" / point).mkdir(parents=True)
    shutil.copy(root / "runs" / "calibration.json", side / "runs")
    shutil.copy(root / "runs" / point / "parity.json", side / "runs" / point)
    for stage in ("microbench", "bench_train"):
        _run([sys.executable, "-c", GPU_LIKE, str(root / "pipelines" / f"{stage}.py"), point], side, env)
    made = stamp.read_stamps(side / "runs" / point)
    assert set(made) == {"microbench", "bench_train"}
    assert json.loads((side / "runs" / point / "microbench.json").read_text())["paths"]["triton"]["valid"]
    return made


@pytest.fixture(scope="module")
def gpu_like_stamps(project, tmp_path_factory):
    """microbench and bench_train of the baseline, as on a GPU."""
    root, env = project
    return _gpu_like(root, env, tmp_path_factory.mktemp("gpu_like"), POINT)


@pytest.fixture(scope="module")
def matmul_stamps(project, tmp_path_factory):
    """op-matmul's stamps, stage: [made]: reference, kernel, parity as DVC ran them, microbench and bench_train
    as on a GPU."""
    root, env = project
    made = {stage: [found] for stage, found in stamp.read_stamps(root / "runs" / MATMUL).items()}
    assert set(made) == {"reference", "kernel", "parity"}
    for stage, found in _gpu_like(root, env, tmp_path_factory.mktemp("gpu_like_matmul"), MATMUL).items():
        made[stage] = [found]
    return made


@pytest.fixture(scope="module")
def moe_stamps(project):
    """op-moe's reference, kernel and parity stamps, as DVC ran them."""
    root, _ = project
    made = stamp.read_stamps(root / "runs" / MOE)
    assert set(made) == {"reference", "kernel", "parity"}
    return made


def _imports_of(root: Path, env: dict, script: str, *args: str) -> list[str]:
    out = root.parent / f"imports-{Path(script).stem}.json"
    _run([sys.executable, "-c", IMPORTS, str(out), script, *args], root, env)
    return [*json.loads(out.read_text()), script]


# --- (a) deps cover every module a stage loads ---------------------------------------------------


@pytest.mark.slow
def test_every_stage_depends_on_every_module_it_loads(project, dvc, plan, stamps, gpu_like_stamps, matmul_stamps,
                                                      moe_stamps, tmp_path):
    root, env = project
    assert set(stamps) == set(POINT_STAGES)
    loaded = {(POINT, stage): set(stamps[stage]["sources"]) for stage in POINT_STAGES}
    for stage, made in gpu_like_stamps.items():
        loaded[POINT, stage] |= set(made["sources"])
    for stage, made in matmul_stamps.items():
        loaded[MATMUL, stage] = set().union(*(m["sources"] for m in made))
    for stage, made in moe_stamps.items():
        loaded[MOE, stage] = set(made["sources"])
    for stage in ("device", "calibrate", "inputs"):
        out = str(tmp_path / ("runs/inputs" if stage == "inputs" else f"{stage}.json"))
        loaded[POINT, stage] = set(_imports_of(root, env, f"pipelines/{stage}.py", out))
    assert "posttrainllm/ops/attention/kernels.py" in loaded[POINT, "microbench"]  # the GPU path: what was missed before
    assert "posttrainllm/ops/matmul/kernels.py" in loaded[MATMUL, "microbench"]

    for (point, stage), sources in loaded.items():
        assert f"pipelines/{stage}.py" in sources
        spec = stage_spec(dvc, stage, point, plan)
        assert uncovered_sources(sources, spec["deps"]) == [], f"stage {stage} of {point} misses deps"
        # and the check bites: without any one dep that covers a loaded file, that file is reported
        op_folder = f"posttrainllm/ops/{plan['points'][point]['config']['op']['name']}"
        for dep in spec["deps"]:
            if dep == op_folder:  # named by dvc.yaml for `dvc status`; its files are the inputs file's too
                continue
            covered = [s for s in sources if s == dep or s.startswith(dep + "/")]
            if covered:
                fewer = [d for d in without(spec, "deps", dep)["deps"] if not dep.startswith(op_folder + "/")
                         or d != op_folder]  # a file of the op's folder: the folder would cover it
                assert set(covered) <= set(uncovered_sources(sources, fewer)), (stage, dep)


@pytest.mark.slow
def test_the_timed_stages_were_missing_the_kernels_and_their_params(dvc, plan, gpu_like_stamps):
    """The bug this guards against: microbench and bench_train without the op's kernel and the tile params."""
    for stage, made in gpu_like_stamps.items():
        spec = stage_spec(dvc, stage, POINT, plan)
        deps_before = without(without(spec, "deps", "posttrainllm/ops/attention"), "deps",
                              "posttrainllm/ops/attention/kernels.py")["deps"]
        assert "posttrainllm/ops/attention/kernels.py" in uncovered_sources(made["sources"], deps_before)
        params_before = without(spec, "params", f"points.{POINT}.config.tile")["params"]
        assert {"tile.block_q", "tile.block_kv"} <= set(uncovered_keys(made["config_keys"], params_before)), stage


@pytest.mark.slow
def test_a_point_stage_lists_an_ops_kernel_file_exactly_where_it_runs_it(plan, stamps, gpu_like_stamps, matmul_stamps,
                                                                        moe_stamps):
    """What was seen: after an edit of ops/attention/kernels.py, `dvc status` listed microbench and bench_train of
    every point, op-matmul's too, though its stamps showed no attention kernel loaded."""
    ran = {POINT: {stage: [stamps[stage], *([gpu_like_stamps[stage]] if stage in gpu_like_stamps else [])]
                   for stage in POINT_STAGES},
           MATMUL: matmul_stamps, MOE: {stage: [made] for stage, made in moe_stamps.items()}}
    for point, by_stage in ran.items():
        for stage, made in by_stage.items():
            loaded = {f for m in made for f in m["sources"] if f.startswith("posttrainllm/ops/")}
            assert listed_kernels(plan, point, stage) == loaded, (point, stage)
    assert "posttrainllm/ops/attention/kernels.py" not in listed_kernels(plan, MATMUL, "microbench")
    # its launch geometry's note and its autotuner's shared memory: ops/autotune.py, loaded with every definition
    assert "posttrainllm/ops/attention/kernels.py" not in listed_kernels(plan, MATMUL, "kernel")


# --- (b) params cover every config key a stage reads ---------------------------------------------


@pytest.mark.slow
def test_every_stage_lists_every_config_key_it_reads_in_its_params(dvc, plan, stamps, gpu_like_stamps, matmul_stamps,
                                                                   moe_stamps):
    read = {(POINT, stage): set(stamps[stage]["config_keys"])
            | set((gpu_like_stamps.get(stage) or {}).get("config_keys") or []) for stage in POINT_STAGES}
    for stage, made in matmul_stamps.items():
        read[MATMUL, stage] = set().union(*(m["config_keys"] for m in made))
    for stage, made in moe_stamps.items():
        read[MOE, stage] = set(made["config_keys"])
    for (point, stage), keys in read.items():
        assert keys, stage
        assert not any(k.split(".")[0] in ("run", "sweep") for k in keys)
        spec = stage_spec(dvc, stage, point, plan)
        assert uncovered_keys(keys, spec["params"], point) == [], f"stage {stage} of {point} misses params"
        # and the check bites: without any one param that covers a key read, that key is reported
        for param in spec["params"]:
            covered = [k for k in keys if f"points.{point}.config.{k}" == param
                       or f"points.{point}.config.{k}".startswith(param + ".")]
            if covered:
                missing = uncovered_keys(keys, without(spec, "params", param)["params"], point)
                assert set(covered) <= set(missing), (stage, param)
    assert "bench.threads" in stamps["reference"]["config_keys"]  # prepare() sets the thread count it computes with
    for stage in ("kernel", "parity"):  # the bug this guards against: keys op-moe's grouped_mm probe reads, unlisted
        assert {"shape.ops.moe.d_model", "shape.ops.moe.ffn"} <= read[MOE, stage]


@pytest.mark.slow
def test_stamps_carry_the_revision_the_device_and_are_in_the_receipt(project, stamps):
    root, env = project
    head = _run(["git", "rev-parse", "HEAD"], root, env).stdout.strip()
    for stage, made in stamps.items():
        assert made["stage"] == stage and made["point"] == POINT
        assert made["revision"] == head and made["dirty"] is False
        assert made["device"]["device"] == "cpu" and made["device"]["threads"] == 1
        for path, digest in made["sources"].items():
            assert stamp.file_sha256(root / path) == digest
    receipt = json.loads((root / "runs" / POINT / "receipt.json").read_text())
    assert receipt["stamps"] == {s: stamps[s] for s in POINT_STAGES if s != "receipt"}


# --- (d) an edit reruns the points that run the edited code and no others ------------------------


@pytest.mark.slow
def test_an_edit_reruns_the_stages_that_run_the_edited_file_and_no_others(project):
    root, env = project
    inputs = root / "runs" / "inputs"

    def status() -> set[str]:
        out = _run(["dvc", "status", "--with-deps", f"receipt@{POINT}", f"parity@{MATMUL}", f"parity@{MOE}"],
                   root, env).stdout
        return {line[:-1] for line in out.splitlines() if line.endswith(":") and not line[0].isspace()}

    def after_editing(path: str) -> tuple[set[str], set[str], set[str]]:
        """What `dvc status` lists at once and once the inputs stage saw the edit, and which inputs files changed."""
        before = {f.relative_to(inputs).as_posix(): f.read_bytes() for f in inputs.rglob("*.json")}
        edited = root / path
        original = edited.read_text()
        try:
            edited.write_text(original + "# a speed-only edit\n")
            at_once = status() - ALWAYS_CHANGED
            _run(["dvc", "repro", "inputs"], root, env)
            listed = status() - ALWAYS_CHANGED
            changed = {name for name, content in before.items() if (inputs / name).read_bytes() != content}
        finally:
            edited.write_text(original)
            _run(["dvc", "repro", "inputs"], root, env)
        return at_once, listed, changed

    assert status() <= ALWAYS_CHANGED  # everything else is up to date
    at_once, listed, changed = after_editing("posttrainllm/ops/attention/kernels.py")
    assert at_once == {f"kernel@{POINT}", f"microbench@{POINT}", f"bench_train@{POINT}"}  # they name ops/<op>/kernels.py
    assert listed == at_once  # op-matmul reads no attention code (its autotune note: ops/autotune.py)
    assert changed == {f"{point}/{stage}.json" for point in (POINT, "precision-fp16") for stage in KERNEL_STAGES}
    at_once, listed, changed = after_editing("posttrainllm/ops/matmul/kernels.py")
    assert at_once == listed == {f"kernel@{MATMUL}"}  # its timed stages did not run in this copy
    assert changed == {f"{MATMUL}/{stage}.json" for stage in KERNEL_STAGES}
    assert status() <= ALWAYS_CHANGED


def test_an_edit_changes_the_inputs_of_the_default_sweeps_points_that_run_it_and_no_others(tmp_path):
    """The default sweep (the committed params.yaml): which point stages an edit of each kernel reruns."""
    for folder in ("pipelines", "posttrainllm"):
        shutil.copytree(PROJECT_ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    points = sweep.read_points(PROJECT_ROOT / "params.yaml")["points"]

    def inputs() -> dict[tuple[str, str], dict]:
        return {(name, stage): sweep.stage_inputs(name, stage, point, tmp_path)
                for name, point in points.items() for stage in POINT_STAGES}

    ops = {name: point["config"]["op"]["name"] for name, point in points.items()}
    assert {"attention", "matmul", "decode_attention", "moe"} <= set(ops.values())
    before = inputs()
    for kernel in ("attention", "matmul", "decode_attention", "moe"):
        path = tmp_path / "posttrainllm" / "ops" / kernel / "kernels.py"
        original = path.read_text()
        path.write_text(original + "# a speed-only edit\n")
        after = inputs()
        path.write_text(original)
        changed = {key for key in before if after[key] != before[key]}
        expected = {(name, stage) for name, op in ops.items() if op == kernel for stage in KERNEL_STAGES}
        assert changed == expected, kernel
    assert inputs() == before


def test_point_stages_depend_on_their_inputs_file_which_every_repro_rewrites():
    dvc = yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text())
    for stage in POINT_STAGES:
        spec = dvc["stages"][stage]["do"]
        assert spec["deps"][0] == f"runs/inputs/${{key}}/{stage}.json"
        # the code and the config reach a point stage through its inputs file, and its op's folder (its kernels) by name too
        code = [d for d in spec["deps"] if d.startswith(("posttrainllm", "pipelines", "conf", "params"))]
        assert code == (["posttrainllm/ops/${item.config.op.name}"] if stage in KERNEL_STAGES else []), stage
        assert "params" not in spec, stage
    inputs = dvc["stages"]["inputs"]
    assert inputs["always_changed"] is True and inputs["outs"] == [{"runs/inputs": {"cache": False}}]
    assert inputs["cmd"] == "python pipelines/inputs.py runs/inputs"


# --- a stage refuses to finish on code or config its inputs file does not list -----------------------


def test_check_inputs_refuses_a_file_or_a_key_the_inputs_file_does_not_list():
    made = {"stage": "kernel", "sources": {"pipelines/kernel.py": "a" * 64, "posttrainllm/ops/matmul/kernels.py": "b" * 64},
            "config_keys": ["tile.block_m", "op.name"]}
    listed = {"sources": {"pipelines/kernel.py": "a" * 64, "posttrainllm/ops/matmul/kernels.py": "c" * 64},
              "params": {"config.tile": {}, "config.op": {}}}
    stamp.check_inputs(made, listed, "runs/inputs/x/kernel.json")  # the hashes may differ: a set check
    stamp.check_inputs({**made, "config_keys": None}, listed, "here")  # a timed stage's reads unrecorded
    fewer = {**listed, "sources": {"pipelines/kernel.py": "a" * 64}}
    with pytest.raises(stamp.StampMismatch, match=r"^stage kernel ran with posttrainllm/ops/matmul/kernels.py, which "
                                                  r"runs/inputs/x/kernel.json does not list: DVC would not rerun"):
        stamp.check_inputs(made, fewer, "runs/inputs/x/kernel.json")
    with pytest.raises(stamp.StampMismatch, match=r"ran with config key tile.block_m, which here does not list"):
        stamp.check_inputs(made, {**listed, "params": {"config.tile.block_n": 32, "config.op": {}}}, "here")


def test_a_point_stage_that_ran_code_its_inputs_file_does_not_list_exits_2(planned, monkeypatch, capsys):
    from posttrainllm.lab import pipeline

    monkeypatch.setattr(pipeline, "_stage", lambda name: lambda cfg, sweep_: None)
    loaded = {"pipelines/parity.py": "a" * 64, "posttrainllm/ops/matmul/kernels.py": "b" * 64}
    monkeypatch.setattr(stamp, "stage_sources", lambda stage, root=PROJECT_ROOT, outside=None: dict(loaded))
    inputs = planned / "runs" / "inputs" / POINT / "parity.json"
    inputs.parent.mkdir(parents=True)
    inputs.write_text(json.dumps({"sources": {"pipelines/parity.py": "a" * 64}, "params": {"config": {}}}))

    assert pipeline.run_stage("parity", [POINT]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines()
             if not line.endswith(" ...") and " ... [sweep: " not in line]  # the stage's start line
    assert lines == [f"posttrainllm: parity {POINT}: stage parity ran with posttrainllm/ops/matmul/kernels.py, which "
                     f"runs/inputs/{POINT}/parity.json does not list: DVC would not rerun it when that changes; "
                     "declare it in posttrainllm/lab/reads.py STAGES, then `dvc repro`"]
    inputs.write_text(json.dumps({"sources": loaded, "params": {"config": {}}}))
    assert pipeline.run_stage("parity", [POINT]) == 0


def test_an_inputs_file_names_a_missing_source_in_one_line(tmp_path):
    point = {"changes": {}, "config": {"op": {"name": "nosuchop"}, "tile": {"name": "b32"},
                                       "workgroup": {"name": "w4s2"}}}
    with pytest.raises(ConfigError, match=r"^posttrainllm/ops/nosuchop/kernels.py: not found under .*, but a point stage "
                                          r"depends on it \(posttrainllm/lab/reads.py\)$"):
        sweep.stage_inputs("p", "kernel", point, PROJECT_ROOT)


# --- (e) the heads stages (posttrainllm/lab/heads.py): the same checks, config keys mapped to conf/ files ----

HEADS_ITEM = "k1"
HEADS_STAGES = {"train_base": "base", "train_heads": HEADS_ITEM, "decode": HEADS_ITEM}  # stage: its folder
# a tiny base and few tokens: what the stages load and read does not depend on the sizes
HEADS_TINY = ["architecture.d_model=64", "architecture.mlp_hidden=128", "architecture.head_dim=16",
              "heads.base.steps=6", "heads.base.threads=1", "heads.base.warmup_steps=1", "heads.base.batch_size=4",
              "heads.base.seq_len=32",
              "heads.base.eval_batches=1", "heads.base.max_seq_len=48", "heads.prompt_len=12",
              "heads.continuation_len=12", "heads.train_prompts=4", "heads.steps=2", "heads.batch_size=4",
              "heads.eval_prompts=1", "heads.new_tokens=4", "heads.warmup_prompts=0", "run.log_mlflow=false"]


@pytest.fixture(scope="module")
def heads_stamps(project):
    """train_base, train_heads and decode of K = 1 in the project copy (the scripts DVC runs, tiny sizes by
    override), decode once more with heads.cached_attention=triton (interpreted): {stage: [stamps]}."""
    root, env = project
    out = root / "runs" / "heads"
    run = [sys.executable, "pipelines/{}.py", f"heads={HEADS_ITEM}", *HEADS_TINY]
    for stage in ("train_base", "train_heads", "decode"):
        _run([a.format(stage) for a in run] + (["heads.cached_attention=triton"] if stage == "decode" else []), root, env)
    triton = stamp.read_stamps(out / HEADS_ITEM)["decode"]
    _run([a.format("decode") for a in run], root, env)  # the default (reference) last: its receipt stays
    made = {stage: stamp.read_stamps(out / folder)[stage] for stage, folder in HEADS_STAGES.items()}
    assert "posttrainllm/ops/decode_attention/kernels.py" in triton["sources"] and "tile.block_q" in triton["config_keys"]
    return {stage: [made[stage], *([triton] if stage == "decode" else [])] for stage in HEADS_STAGES}


@functools.cache
def conf_source(root: Path, key: str, item: str) -> str | None:
    """Where a heads stage's config value is set: "conf/<file>:<key in it>", or None (posttrainllm/config.py's default).

    A group's value comes from the option conf/config.yaml picks (heads: the stage's item, device: auto, as the
    scripts pass), else from the option it builds on (its `defaults`); any other key from conf/config.yaml.
    """
    def has(data, dotted: str) -> bool:
        for part in dotted.split("."):
            if not isinstance(data, dict) or part not in data:
                return False
            data = data[part]
        return True

    config = yaml.safe_load((root / "conf" / "config.yaml").read_text())
    choices = {k: v for d in config["defaults"] if isinstance(d, dict) for k, v in d.items()}
    choices.update(heads=item, device="auto")
    group, _, rest = key.partition(".")
    if group not in choices:
        return f"conf/config.yaml:{key}" if has(config, key) else None
    option = choices[group]
    while option:
        file = f"conf/{group}/{option}.yaml"
        data = yaml.safe_load((root / file).read_text())
        if has(data, rest):
            return f"{file}:{rest}"
        option = next((d for d in data.get("defaults", []) if isinstance(d, str) and d != "_self_"), None)
    return None


def uncovered_conf_keys(root: Path, keys, spec: dict, item: str) -> list[str]:
    """The keys whose conf/ value no param (file:key or a parent) and no whole-file dep covers."""
    def covered(key: str) -> bool:
        source = conf_source(root, key, item)
        if source is None:
            return "posttrainllm/config.py" in spec["deps"]
        return source.split(":")[0] in spec["deps"] or any(source == p or source.startswith(p + ".")
                                                           for p in spec["params"])

    return sorted(k for k in keys if not covered(k))


@pytest.mark.slow
def test_the_heads_stages_depend_on_every_module_they_load_and_list_every_key_they_read(project, dvc, heads_stamps):
    root, _ = project
    for stage, made in heads_stamps.items():
        spec = stage_spec(dvc, stage, HEADS_ITEM)
        sources = set().union(*(m["sources"] for m in made))
        keys = set().union(*(m["config_keys"] for m in made))
        assert f"pipelines/{stage}.py" in sources and "posttrainllm/lab/pipeline.py" in sources
        assert {"architecture.d_model", "heads.base.steps", "bench.threads"} <= keys
        assert uncovered_sources(sources, spec["deps"]) == [], f"dvc.yaml: stage {stage} misses deps"
        assert uncovered_conf_keys(root, keys, spec, HEADS_ITEM) == [], f"dvc.yaml: stage {stage} misses params"
        # and the checks bite: without any one dep or param, what it covered is reported
        for dep in spec["deps"]:
            covered = [s for s in sources if s == dep or s.startswith(dep + "/")]
            fewer = {**spec, "deps": [d for d in spec["deps"] if d != dep]}
            assert set(covered) <= set(uncovered_sources(sources, fewer["deps"])), (stage, dep)
            read = [k for k in keys if (conf_source(root, k, HEADS_ITEM) or "").split(":")[0] == dep]
            assert set(read) <= set(uncovered_conf_keys(root, keys, fewer, HEADS_ITEM)), (stage, dep)
        for param in spec["params"]:
            read = [k for k in keys if (source := conf_source(root, k, HEADS_ITEM) or "") == param
                    or source.startswith(param + ".")]
            fewer = {**spec, "params": [p for p in spec["params"] if p != param]}
            assert set(read) <= set(uncovered_conf_keys(root, keys, fewer, HEADS_ITEM)), (stage, param)
    # the bug this guards against: the heads.* keys train_base read were listed, heads.out_dir was not
    base = stage_spec(dvc, "train_base")
    fewer = {**base, "params": [p for p in base["params"] if p != "conf/heads/k3.yaml:out_dir"]}
    assert uncovered_conf_keys(root, heads_stamps["train_base"][0]["config_keys"], fewer, "k3") == ["heads.out_dir"]


@pytest.mark.slow
def test_the_heads_stamps_are_outs_carry_the_revision_and_are_in_the_receipt(project, dvc, heads_stamps):
    root, env = project
    head = _run(["git", "rev-parse", "HEAD"], root, env).stdout.strip()
    for stage, folder in HEADS_STAGES.items():
        made = heads_stamps[stage][0]
        assert made["stage"] == stage and made["point"] == f"heads-{folder}"
        assert made["revision"] == head and made["dirty"] is False and made["device"]["threads"] == 1
        assert f"runs/heads/{folder}/stamps/{stage}.json" in stage_spec(dvc, stage, HEADS_ITEM)["outs"]
        for path, digest in made["sources"].items():
            assert stamp.file_sha256(root / path) == digest
    receipt = json.loads((root / "runs" / "heads" / HEADS_ITEM / "receipt.json").read_text())
    assert receipt["stamps"] == {s: heads_stamps[s][0] for s in ("train_base", "train_heads")}
    assert receipt["decode"]["cached_attention"]["path"] == "reference" and receipt["decode"]["lossless"]


# --- (c) the receipt refuses stamps that disagree --------------------------------------------------


def _stamp(stage: str, sources: dict, device: dict | None = None) -> dict:
    return {"stage": stage, "point": POINT, "created_at": "2026-01-01T00:00:00+00:00", "revision": "0" * 40,
            "dirty": False, "device": device or {"device": "cpu", "threads": 1}, "sources": sources,
            "config_keys": []}


@pytest.fixture
def planned(tmp_path, monkeypatch):
    """A folder with the smoke sweep planned in params.yaml, as the working directory."""
    from posttrainllm import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["sweep", "sweep=smoke"]) == 0
    return tmp_path


def test_receipt_stage_refuses_stamps_that_disagree_about_shared_code(planned, capsys):
    from posttrainllm.lab.pipeline import run_stage

    folder = planned / "runs" / POINT
    shared = "posttrainllm/ops/attention/kernels.py"
    stamp.write_stamp(folder, _stamp("kernel", {shared: "a" * 64, "posttrainllm/config.py": "c" * 64}))
    stamp.write_stamp(folder, _stamp("microbench", {shared: "b" * 64, "posttrainllm/config.py": "c" * 64}))

    assert run_stage("receipt", [POINT]) == 2

    lines = [line for line in capsys.readouterr().err.splitlines()
             if not line.endswith(" ...") and " ... [sweep: " not in line]  # the stage's start line
    err = lines[0]
    assert len(lines) == 1 and "Traceback" not in err
    assert err.startswith(f"posttrainllm: receipt {POINT}: stages kernel and microbench ran different versions "
                          f"of {shared} ")
    assert "runs/baseline/stamps" in err
    assert not (folder / "receipt.json").exists()


def test_receipt_refuses_timed_stages_from_different_devices(planned):
    from posttrainllm.lab.pipeline import load_point
    from posttrainllm.track import receipt

    cfg, sweep = load_point(POINT)
    folder = planned / "runs" / POINT
    stamp.write_stamp(folder, _stamp("microbench", {}, {"device": "cpu", "threads": 1}))
    stamp.write_stamp(folder, _stamp("bench_train", {}, {"device": "cpu", "threads": 2}))
    with pytest.raises(stamp.StampMismatch, match="stages bench_train and microbench were timed on different "
                                                  "devices \\(differ in threads"):
        receipt.build(cfg, sweep=sweep)


def test_receipt_records_stamps_that_agree_and_a_changed_revision_alone_is_fine(planned):
    from posttrainllm.lab.pipeline import load_point
    from posttrainllm.track import receipt

    cfg, sweep = load_point(POINT)
    folder = planned / "runs" / POINT
    older = {**_stamp("reference", {"pipelines/reference.py": "d" * 64}), "revision": "1" * 40}
    stamp.write_stamp(folder, older)
    stamp.write_stamp(folder, _stamp("kernel", {"pipelines/kernel.py": "e" * 64}))
    built = receipt.build(cfg, sweep=sweep)
    assert built["stamps"] == {"kernel": _stamp("kernel", {"pipelines/kernel.py": "e" * 64}), "reference": older}


def test_a_stage_whose_contract_broke_is_stamped_and_the_sweep_runs_on(planned, monkeypatch, capsys):
    from posttrainllm.lab import pipeline
    from posttrainllm.lab.stages.common import ContractBroken

    def broken(cfg, sweep):
        cfg.precision.contract.atol  # a read, recorded
        raise ContractBroken("triton broke the fp32 contract")

    monkeypatch.setattr(pipeline, "_stage", lambda name: broken)
    assert pipeline.run_stage("parity", [POINT]) == 0
    made = json.loads((planned / "runs" / POINT / "stamps" / "parity.json").read_text())
    assert made["stage"] == "parity" and "precision.contract.atol" in made["config_keys"]
    assert "posttrainllm/lab/pipeline.py" in made["sources"] and "pipelines/parity.py" in made["sources"]
    assert "__getattribute__" not in Contract.__dict__


# --- how config reads are recorded -----------------------------------------------------------------


def test_config_reads_map_to_dotted_keys_and_the_classes_are_restored():
    cfg = load(["device=cpu"])
    with stamp.record_config_reads(cfg) as reads:
        cfg.tile.block_q
        cfg.precision.lse_contract.atol  # same class as precision.contract: told apart by instance
        cfg.run.name, cfg.sweep  # where to write and the plan: not recorded
        cfg.tile  # a group, not a value
        copy.copy(cfg.op).causal  # a copy: mapped by its class
        copy.copy(cfg.precision.contract).rtol  # a copy of a class with two places: both
    assert reads.keys() == ["op.causal", "precision.contract.rtol", "precision.lse_contract.atol",
                            "precision.lse_contract.rtol", "tile.block_q"]
    for cls in (TileConfig, Contract, type(cfg), type(cfg.op)):  # type(cfg.op): the op's own (ops/<op>/config.py)
        assert "__getattribute__" not in cls.__dict__

    with pytest.raises(RuntimeError), stamp.record_config_reads(cfg):
        raise RuntimeError("a stage that crashed")
    assert "__getattribute__" not in TileConfig.__dict__


def test_timed_stages_record_config_reads_only_when_asked(monkeypatch):
    monkeypatch.delenv(stamp.RECORD_ENV, raising=False)
    assert stamp.records_reads("parity") and not stamp.records_reads("microbench")
    monkeypatch.setenv(stamp.RECORD_ENV, "1")
    assert stamp.records_reads("microbench") and stamp.records_reads("bench_train")


def test_the_checks_report_what_is_missing():
    dvc = {"stages": {"s": {"foreach": "${points}", "do": {
        "deps": ["pipelines/s.py", "posttrainllm/ops", "runs/${key}/x.json"],
        "params": ["points.${key}.config.tile", {"conf/config.yaml": ["bench.threads"]}]}}}}
    spec = stage_spec(dvc, "s")
    assert spec["params"] == [f"points.{POINT}.config.tile", "conf/config.yaml:bench.threads"]
    assert uncovered_sources(["posttrainllm/ops/attention/kernels.py", "posttrainllm/opsx.py"], spec["deps"]) == [
        "posttrainllm/opsx.py"]
    assert uncovered_keys(["tile.block_q", "tiles.x", "workgroup.num_warps"], spec["params"]) == [
        "tiles.x", "workgroup.num_warps"]
    assert uncovered_keys(["tile.block_q"], [f"points.{POINT}"]) == []


def test_editing_a_user_paths_file_reruns_kernel_parity_microbench_and_bench_train_only(tmp_path):
    """op.user_impls: the user's file is in the inputs of the stages that run it or record its identity."""
    from posttrainllm.config import point_config

    for folder in ("pipelines", "posttrainllm"):
        shutil.copytree(PROJECT_ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    kernel = tmp_path / "my_attention.py"
    kernel.write_text((PROJECT_ROOT / "examples" / "torch_attention.py").read_text())
    point = {"changes": {}, "config": point_config(load(["device=cpu", f"op.user_impls=[{kernel}:sdpa_attention]"]))}

    def inputs() -> dict[str, dict]:
        return {stage: sweep.stage_inputs("baseline", stage, point, tmp_path) for stage in POINT_STAGES}

    before = inputs()
    assert str(kernel) in before["kernel"]["sources"] and str(kernel) not in before["reference"]["sources"]
    kernel.write_text(kernel.read_text() + "# a speed-only edit\n")
    after = inputs()
    assert {stage for stage in POINT_STAGES if after[stage] != before[stage]} == set(reads.USER_STAGES)
    assert set(reads.USER_STAGES) == {"kernel", "parity", "microbench", "bench_train"}


# --- one declaration: dvc.yaml written from it, and it sees a new op and a new import --------------------------


def _copy(root: Path) -> Path:
    """The package, the stage scripts, conf/ and dvc.yaml, copied under `root`."""
    for folder in ("pipelines", "posttrainllm", "conf"):
        shutil.copytree(PROJECT_ROOT / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(PROJECT_ROOT / "dvc.yaml", root / "dvc.yaml")
    return root


def test_the_committed_dvc_yaml_has_the_deps_and_params_the_declaration_gives():
    text = (PROJECT_ROOT / "dvc.yaml").read_text()
    assert reads.dvc_yaml(text) == text, "dvc.yaml is stale: run `posttrainllm dvc-yaml` and commit it"
    dvc = yaml.safe_load(text)
    assert set(dvc["stages"]) == set(reads.STAGES)
    for stage in ("calibrate", "train_base", "decode"):  # every op's definition, found through the registry
        deps = stage_spec(dvc, stage, "k1")["deps"]
        assert {f"posttrainllm/ops/{op}/definition.py" for op in registry.OP_PACKAGES} <= set(deps), stage
        assert not [d for d in deps if d.endswith(("/kernels.py", "/fp8.py"))] or stage == "decode"
    # the draft heads' decode runs the Triton code of the ops lab/heads.py fills the model's slots with, none other
    assert [d for d in stage_spec(dvc, "decode", "k1")["deps"] if d.endswith("/kernels.py")] == [
        f"posttrainllm/ops/{op}/kernels.py" for op in reads.slot_ops("posttrainllm.lab.heads")]
    assert reads.slot_ops("posttrainllm.lab.heads") == sorted({registry.slot_op(slot).name for slot in (
        slots.ATTENTION, slots.CACHED_ATTENTION)})  # read from the files as the registry finds them


def test_a_new_op_folder_reaches_dvc_yaml_and_its_points_inputs_without_a_hand_line(tmp_path):
    root = _copy(tmp_path)
    registry_py = root / "posttrainllm" / "ops" / "registry.py"
    registry_py.write_text(registry_py.read_text().replace('    "add_rmsnorm",\n', '    "add_rmsnorm",\n    "planted",\n'))
    folder = root / "posttrainllm" / "ops" / "planted"
    folder.mkdir()
    for name in ("__init__.py", "definition.py", "reference.py", "kernels.py"):
        (folder / name).write_text("")
    text = (root / "dvc.yaml").read_text()
    assert reads.write_dvc_yaml(root / "dvc.yaml", check=True, root=root) is False  # stale now: the check says so
    assert (root / "dvc.yaml").read_text() == text  # and writes nothing
    assert reads.write_dvc_yaml(root / "dvc.yaml", root=root) is False
    made = yaml.safe_load((root / "dvc.yaml").read_text())
    for stage in ("calibrate", "train_base", "train_heads", "decode"):
        deps = stage_spec(made, stage, "k1")["deps"]
        assert {f"posttrainllm/ops/planted/{n}" for n in ("__init__.py", "definition.py", "reference.py")} <= set(
            deps), stage
        assert "posttrainllm/ops/planted/kernels.py" not in deps
    assert reads.write_dvc_yaml(root / "dvc.yaml", check=True, root=root)  # written: as declared
    point = {"config": {"op": {"name": "planted"}, "tile": {"name": "b32"}, "workgroup": {"name": "w4s2"}}}
    for stage in POINT_STAGES:  # its kernel only where the stage runs an op's Triton path
        files = reads.source_files(reads.point_stage_deps(stage, point, root)["sources"], root)
        assert "posttrainllm/ops/planted/definition.py" in files
        assert ("posttrainllm/ops/planted/kernels.py" in files) == (stage in KERNEL_STAGES), stage


def test_a_stage_module_importing_what_its_declaration_does_not_list_is_found(tmp_path):
    assert {stage: reads.undeclared_imports(stage) for stage in POINT_STAGES} == {stage: [] for stage in POINT_STAGES}
    root = _copy(tmp_path)
    parity = root / "posttrainllm" / "lab" / "stages" / "parity.py"
    original = parity.read_text()
    assert "posttrainllm/track/report.py" not in reads.stage_code("parity", root)
    # inside a function: loaded when it runs, so the declaration must list it
    parity.write_text(original + "\n\ndef _planted():\n    from posttrainllm.track import report  # noqa: F401\n")
    assert reads.undeclared_imports("parity", root) == ["posttrainllm/track/report.py"]
    # at the top: loaded with the module, so its inputs list it (and what it imports) without a word
    parity.write_text(original + "\nfrom posttrainllm.track import report  # noqa: F401,E402\n")
    assert reads.undeclared_imports("parity", root) == []
    assert "posttrainllm/track/report.py" in reads.stage_code("parity", root)
    assert "posttrainllm/track/report.py" not in reads.stage_code("reference", root)


def test_dvc_yaml_command_checks_and_writes(tmp_path, monkeypatch, capsys):
    from posttrainllm import cli

    monkeypatch.chdir(tmp_path)
    committed = (PROJECT_ROOT / "dvc.yaml").read_text()
    stale = committed.replace("      - posttrainllm/lab/sweep.py\n", "")
    assert stale != committed
    (tmp_path / "dvc.yaml").write_text(stale)
    assert cli.main(["dvc-yaml", "--check"]) == 1
    assert "posttrainllm dvc-yaml" in capsys.readouterr().err and (tmp_path / "dvc.yaml").read_text() == stale
    assert cli.main(["dvc-yaml"]) == 0
    assert (tmp_path / "dvc.yaml").read_text() == committed
    assert cli.main(["dvc-yaml", "--check"]) == 0
    assert cli.main(["dvc-yaml", "--force"]) == 2
    assert capsys.readouterr().err.strip().endswith("usage: posttrainllm dvc-yaml [--check] (got --force)")


def test_a_stage_that_runs_a_user_path_stamps_its_file_passed_by_its_runner(tmp_path):
    """No global: the stage's own paths (lab/runner.py `outside_files`) and the kernel stage's compile section."""
    kernel = tmp_path / "my_attention.py"
    kernel.write_text((PROJECT_ROOT / "examples" / "torch_attention.py").read_text())
    cfg = load(["device=cpu", f"op.user_impls=[{kernel}:sdpa_attention]"])
    digest = stamp.file_sha256(kernel)
    assert reads.outside_sources("reference", cfg, tmp_path) == {}  # it never runs the path
    for stage in reads.USER_STAGES:
        assert reads.outside_sources(stage, cfg, tmp_path) == {str(kernel): digest}, stage
    library = tmp_path / "library_kernels.py"
    library.write_text("# a Triton kernel's file\n")
    (tmp_path / "kernel.json").write_text(json.dumps({"compile": {"paths": {"mine": {"kernels": [
        {"file": str(library)}, {"file": "posttrainllm/ops/attention/kernels.py"}]}}}}))
    assert reads.outside_sources("kernel", cfg, tmp_path) == {str(kernel): digest,
                                                            str(library): stamp.file_sha256(library)}
    assert str(library) not in reads.outside_sources("parity", cfg, tmp_path)
    made = stamp.stage_stamp("kernel", POINT, {}, [], outside=reads.outside_sources("kernel", cfg, tmp_path))
    assert made["sources"][str(kernel)] == digest and "pipelines/kernel.py" in made["sources"]


def test_every_point_stage_dep_dvc_yaml_names_exists_for_every_op_problem_included():
    """What was seen: `dvc repro` of sweep=problems failed at kernel@problem-cross_entropy, its dep
    posttrainllm/ops/problem/kernels.py not found (an op made from a problem file has no Triton code). A point
    stage's deps, with the point's op put in, must each exist."""
    stages = yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text())["stages"]
    for op in [*registry.OPS, registry.PROBLEM]:
        for stage in reads.POINT_STAGES:
            for dep in stages[stage]["do"]["deps"]:
                if "${item.config.op.name}" in dep:
                    path = PROJECT_ROOT / dep.replace("${item.config.op.name}", op)
                    assert path.exists(), f"{stage}: {dep} for op={op}: {path} does not exist"
