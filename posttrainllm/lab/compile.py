"""The counter, not the story: every Triton kernel a point's paths launch, compiled for a GPU here, without one.

For each path that launches Triton kernels (ours, and user paths), a child process (Triton in its compiler mode,
not the interpreter) calls the path at the point's main case, forward then backward, with Triton's launch
replaced by a recorder: each launch's arguments reach Triton's own binder (`create_function_from_signature`, the
function `JITFunction.run` builds), which gives the specialization a GPU launch of those arguments gets: the
signature (i32 or i64 by value, pointers by dtype), the constexprs, the unit strides made constants and the
pointers and integers found divisible by 16. The kernel body never runs (no GPU, and no interpreter at a GPU
shape); an autotuned kernel records one launch per configuration of its space (its candidates, after its own
pruning), each row marked with the tuned launch it belongs to: such a kernel launches on a target if one of its
candidates fits there (`not_fitting`). Under tile/workgroup=auto our launchers take their autotuned branch here too
(ops/autotune.py `autotune_for_target`), once per target, their candidates pruned by that target's shared memory as
a GPU of it prunes them. Each launch is compiled with `triton.compile` for every target in `compile.targets` (ptxas
and cuobjdump from Triton's wheel; sm100 with its ptxas-blackwell) and its cubin read (measure/sass.py). Compiles
are cached by Triton's cache, keyed by the kernel's source, its specialization, the options and the target; a
launch's distinct kernels compile side by side, one forked process per CPU (`compile_workers`).

What a launch on CPU tensors cannot tell: the tile an autotuner would pick on the GPU (each candidate is
compiled, none timed), and a launcher that takes another branch on a CUDA tensor. Launchers run with Triton's
interpreter mode off, so the bf16 emulation the interpreter needs (ops/__init__.py) is off, as on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from posttrainllm import rules
from posttrainllm.measure import sass
from posttrainllm.files import shown
from posttrainllm.lab.isolation.user import distribution_of

NOT_TRITON = "launches no Triton kernel here"
INDUCTOR = "a torch.compile peer: its Triton kernels are Inductor's, generated on the device at run time"
AUTOTUNE_NOTE = ("tile/workgroup=auto: every candidate configuration the launchers' autotuner would time on a GPU "
                 "of each target (pruned by the launcher's shared-memory estimate against the target's per-block "
                 "limit, as the device's reported limit prunes it there) is compiled, none timed; a tuned kernel "
                 "launches if one of its candidates fits")
TIMEOUT_S = 900
KILL_WAIT_S = 30  # after a kill: a child in uninterruptible sleep is left, named, rather than waited on forever


@dataclasses.dataclass
class Launch:
    """One recorded launch: the kernel (a JITFunction), its arguments and grid, and which pass made it."""

    kernel: Any
    args: tuple
    kwargs: dict[str, Any]
    grid: Any
    direction: str
    autotune: dict[str, int] | None = None  # a candidate of an autotuned launch: {"launch": its number, "candidates"}


_direction = ["forward"]


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Triton launches recorded instead of run: JITFunction.run (the launch) and Autotuner.run (one launch per
    configuration its benchmark would time: its configs after its own pruning, `prune_configs`; all of them where
    that pruning needs a GPU, a perf_model reading the device)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    jit_run, tune_run = JITFunction.run, Autotuner.run

    def record(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append(Launch(self, args, kwargs, grid, _direction[0]))

    def each_config(self: Any, *args: Any, **kwargs: Any) -> None:
        self.nargs = dict(zip(self.arg_names, args))
        try:
            configs = self.prune_configs(kwargs)
        except Exception:  # a perf_model or early_config_prune that asks the device
            configs = self.configs
        finally:
            self.nargs = None
        tuned = {"launch": 1 + max((seen.autotune["launch"] for seen in launches if seen.autotune), default=0),
                 "candidates": len(configs)}
        for config in configs:
            first = len(launches)
            self.fn.run(*args, **{**kwargs, **config.all_kwargs()})
            for launch in launches[first:]:
                launch.autotune = tuned

    JITFunction.run, Autotuner.run = record, each_config
    try:
        yield launches
    finally:
        JITFunction.run, Autotuner.run = jit_run, tune_run


def specialize(launch: Launch, capability: int) -> tuple[Any, dict, dict, dict, Any, Any]:
    """(GPUTarget, signature, constexprs, attrs, options, grid) of a launch, by Triton's binder for `capability`."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    jit, kwargs = launch.kernel, dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", jit.debug) or knobs.runtime.debug  # as JITFunction.run sets them
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
    grid = launch.grid(bound) if callable(launch.grid) else launch.grid
    return target, signature, constexprs, attrs, options, tuple(grid)


def unspecialized(jit: Any, signature: dict, constexprs: dict, attrs: dict) -> tuple[dict, dict, dict]:
    """The same launch as a plain `i32`/pointer call: the strides a launch found equal to 1 back to `i32` and no
    divisibility marks. What a compile that ignores the launch gets (scalar loads, spills); kept to test that
    ours does not."""
    declared = {p.num for p in jit.params if p.is_constexpr}
    signature = {name: ("i32" if kind == "constexpr" and i not in declared else kind)
                 for i, (name, kind) in enumerate(signature.items())}
    constexprs = {path: value for path, value in constexprs.items() if len(path) != 1 or path[0] in declared}
    return signature, constexprs, {path: [] for path in attrs}


def _programs(grid: tuple) -> int:
    total = 1
    for g in grid:
        total *= int(g)
    return total


def _kernel_identity(jit: Any) -> dict[str, Any]:
    fn = jit.fn
    try:
        file = inspect.getsourcefile(fn)
    except TypeError:
        file = None
    return {"kernel": fn.__name__, "file": shown(Path(file)) if file else None,
            "source_sha256": hashlib.sha256(jit.src.encode()).hexdigest() if getattr(jit, "src", None) else None}


def launched_kernels(launches: list[Launch]) -> list[dict[str, Any]]:
    """Each distinct Triton kernel of `launches` once: its name, defining file (as the receipt shows files), the
    sha256 of its source, and the distribution and version that provide its module when installed."""
    found: dict[tuple, dict[str, Any]] = {}
    for launch in launches:
        identity = _kernel_identity(launch.kernel)
        key = (identity["file"], identity["kernel"], identity["source_sha256"])
        if key not in found:
            dist, version = distribution_of(getattr(launch.kernel.fn, "__module__", "") or "")
            found[key] = {**identity, "distribution": dist, "version": version}
    return [found[key] for key in sorted(found, key=lambda k: tuple(map(str, k)))]


def kernel_files(report: dict[str, Any]) -> dict[str, str]:
    """{file: sha256} of the files outside the package whose Triton kernels a path launched (the report's `kernels`):
    the kernel stage's stamp hashes them (lab/reads.py `outside_sources`); the lab/sweep.py plan lists them in the
    inputs of the stages that run user paths (`kernel_files`)."""
    found = {}
    for entry in report.get("paths", {}).values():
        for kernel in entry.get("kernels", ()):
            file = kernel.get("file")
            if file and not file.startswith("posttrainllm/") and Path(file).is_file():
                found[file] = hashlib.sha256(Path(file).read_bytes()).hexdigest()
    return found


def _one_line(exc: BaseException) -> str:
    """The last meaningful line: a Triton CompilationError ends with its cause (failures.first_line would give the
    source excerpt it starts with)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip() and line.strip() != "^"]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def compile_launches(path: str, launches: list[Launch], targets: list[str],
                     specialized: bool = True) -> list[dict[str, Any]]:
    """One row per (distinct specialization, target): the kernel, how many launches share it, its counters.
    specialized=False compiles each launch `unspecialized` (tests: the guard against regressing to it)."""
    from triton.compiler import ASTSource

    rows: dict[tuple, dict[str, Any]] = {}
    jobs: list[tuple[dict[str, Any], Any, Any, Any, sass.Target]] = []  # (row, source, GPU target, options, target)
    for target_name in targets:
        target = sass.TARGETS[target_name]
        for launch in launches:
            base = {"path": path, **_kernel_identity(launch.kernel), "direction": launch.direction,
                    "target": target_name, **({"autotune": launch.autotune} if launch.autotune else {})}
            tuned = launch.autotune["launch"] if launch.autotune else None
            try:
                gpu, signature, constexprs, attrs, options, grid = specialize(launch, target.capability)
                if not specialized:
                    signature, constexprs, attrs = unspecialized(launch.kernel, signature, constexprs, attrs)
            except Exception as exc:
                key = (target_name, base["kernel"], launch.direction, tuned, "bind", _one_line(exc))
                rows.setdefault(key, {**base, "launches": 0, "fits": False,
                                      "reason": f"could not be bound: {_one_line(exc)}"})["launches"] += 1
                continue
            key = (target_name, base["kernel"], base["file"], launch.direction, repr(signature),
                   repr(sorted(constexprs.items())), repr(sorted(attrs.items())), options.num_warps,
                   options.num_stages, tuned)
            if key in rows:
                rows[key]["launches"] += 1
                continue
            names = list(signature)
            rows[key] = {**base, "launches": 1, "programs": _programs(grid), "num_warps": options.num_warps,
                         "num_stages": options.num_stages,
                         "constexprs": {names[p[0]]: _plain(v) for p, v in constexprs.items() if len(p) == 1},
                         "specialization": {names[p[0]]: "16-divisible" for p, a in attrs.items()
                                            if len(p) == 1 and a}}
            jobs.append((rows[key], ASTSource(launch.kernel, signature, constexprs, attrs), gpu, options, target))
    for (row, *_), counted in zip(jobs, _compile_all(jobs)):
        row.update(counted)
    return list(rows.values())


def _compile_one(source: Any, gpu: Any, options: Any, target: sass.Target) -> dict[str, Any]:
    """One kernel compiled for `target` and its cubin's counters, or why it does not compile; its compile time."""
    from triton.compiler import compile

    started = time.perf_counter()
    try:
        kernel = compile(source, target=gpu, options=options.__dict__)
        counted = sass.counters(kernel.asm["cubin"], kernel.metadata.shared, options.num_warps, target)
    except Exception as exc:  # fp8 where the target has no fp8 dot, a construct ptxas refuses, ...
        counted = {"fits": False, "reason": f"does not compile for {target.name}: {_one_line(exc)}"}
    return {**counted, "compile_s": round(time.perf_counter() - started, 3)}


_JOBS: list[tuple] = []  # the jobs of `_compile_all`, read by its forked workers by index


def _compile_job(index: int) -> dict[str, Any]:
    return _compile_one(*_JOBS[index][1:])


def compile_workers() -> int:
    """Processes that compile side by side: one per CPU this process may use. Processes, not threads: each
    compile keeps Triton's global state to itself, and on attention tile=auto's 31 candidates (2 cores, cold cache)
    two processes took 60 s against 67.5 s for two threads and 132 s for one process (docs/compile.md)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _compile_all(jobs: list[tuple]) -> list[dict[str, Any]]:
    """Each job's `_compile_one`, in order: in forked worker processes, one per CPU, when there is more than one
    job (an autotuned launch's candidates, a backward's kernels). Fork, so the kernels (user paths' too) reach the
    workers as they are here; the workers only compile (no torch op runs in them)."""
    workers = min(len(jobs), compile_workers())
    if workers < 2:
        return [_compile_one(*job[1:]) for job in jobs]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    _JOBS[:] = jobs
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(_compile_job, range(len(jobs))))
    finally:
        _JOBS.clear()


def _plain(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)


def call_once(op: Any, cfg: Any, impl: Any, fn: Any, device: str = "cpu") -> str | None:
    """One path's forward and (when it has one) backward at the point's main case, on `device`: what the compile
    child records (on CPU tensors, nothing run) and what the GPU check runs under Nsight Compute (lab/gpucheck.py).
    Returns why the backward did not run, or None."""
    import torch

    from posttrainllm.lab.oracle import differentiated, upstream_gradients
    from posttrainllm.ops.registry import NO_BACKWARD, case_config
    from posttrainllm.ops.base import leaves_of, point_dtype

    case = next(c for c in op.cases(cfg) if c.main)
    call_cfg = case_config(case, cfg)
    leaves = leaves_of(op.make_inputs(case, point_dtype(cfg), device))
    _direction[0] = "forward"
    try:
        with torch.enable_grad():
            outputs = fn(leaves, call_cfg)
        out = outputs["out"]
        wrt = [x for x in leaves.values() if x.requires_grad]
        if impl.backward != NO_BACKWARD and out.requires_grad and wrt:
            _direction[0] = "backward"
            try:
                outs, dos = differentiated(outputs, upstream_gradients(op, case, outputs))
                torch.autograd.grad(outs, wrt, dos, allow_unused=True)
            except Exception as exc:
                return f"backward not captured: {_one_line(exc)}"
        return None
    finally:
        _direction[0] = "forward"


def _capture(op: Any, cfg: Any, impl: Any, fn: Any, shared_per_block: int | None = None
             ) -> tuple[list[Launch], str | None]:
    """The launches of one path's forward and (when it has one) backward at the point's main case (`call_once`);
    with `shared_per_block`, our launchers' autotuned branch, its candidates pruned by that many bytes (a target's)."""
    from posttrainllm.ops.autotune import autotune_for_target  # every op's tuned launchers read the limit there

    tuning = autotune_for_target(shared_per_block) if shared_per_block else contextlib.nullcontext()
    with recording() as launches, tuning:
        note = call_once(op, cfg, impl, fn)
    return launches, note


def compile_in_process(config: dict[str, Any], targets: list[str], specialized: bool = True) -> dict[str, Any]:
    """The child's work (Triton in compiler mode): every path's launches, compiled for `targets`."""
    from posttrainllm.lab.configure import validate_schema  # the op node: the chosen op's keys
    from posttrainllm.lab import runner
    from posttrainllm.ops.registry import op_for

    cfg = validate_schema(config)
    op = op_for(cfg)
    report: dict[str, Any] = {"op": op.name, "targets": targets, "rule": rules.cite("compile_counters"), "paths": {},
                              "rows": []}
    tuned = cfg.tile.autotune or cfg.workgroup.autotune
    if tuned:
        report["note"] = AUTOTUNE_NOTE
    elif op.smem_bytes is not None:  # the fixed tile's estimate, beside each compiled kernel's own shared_bytes
        report["smem_bytes"] = {"per_program": op.smem_bytes(cfg), "rule": rules.cite("shared_memory")}
    # the autotuned branch prunes by the target's shared memory: one capture per target (none compiled: one capture)
    captures = [([t], sass.TARGETS[t].shared_per_block) for t in targets] if tuned and targets else [(targets, None)]
    for impl in runner.optimized(op, cfg):
        run = runner.runner_for(impl)
        if not run.may_launch_triton:
            report["paths"][impl.name] = {"note": INDUCTOR if impl.kind == "compiled" else NOT_TRITON}
            continue
        started = time.perf_counter()
        rows, captured, note = [], [], None
        try:
            fn = run.loaded_here(op)
            for some_targets, shared in captures:
                launches, note = _capture(op, cfg, impl, fn, shared)
                captured.append(launches)
                rows += compile_launches(impl.name, launches, some_targets, specialized)
        except Exception as exc:
            report["paths"][impl.name] = {"error": f"its call failed while launches were recorded: {_one_line(exc)}"}
            continue
        entry: dict[str, Any] = {"launches": len(captured[0]),  # the first target's (the candidates: per target)
                                 "kernels": launched_kernels([launch for some in captured for launch in some]),
                                 "seconds": round(time.perf_counter() - started, 2)}
        if not captured[0]:
            entry["note"] = NOT_TRITON
        if note:
            entry["backward_note"] = note
        report["paths"][impl.name] = entry
        report["rows"] += rows
    tuned_launches = autotune_summary(report)
    if tuned_launches:  # ours under tile/workgroup=auto, a user's @triton.autotune
        report["autotune"] = tuned_launches
    return report


def compile_point(cfg: Any, targets: list[str] | None = None, *, specialized: bool = True) -> dict[str, Any]:
    """compile.json's content for a point: the child process's report (module doc), or the reason it has none."""
    targets = list(targets if targets is not None else cfg.compile.targets)
    unknown = [t for t in targets if t not in sass.TARGETS]
    if unknown:
        raise ValueError(f"compile.targets: {unknown} unknown; choose from {sorted(sass.TARGETS)}")
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "compile.json"
        started = time.perf_counter()
        child = start(cfg, targets, result, specialized=specialized)
        return finish(child, result, targets, started)


def start(cfg: Any, targets: list[str], result: Path, *, specialized: bool = True) -> subprocess.Popen:
    """The compile child, started (it runs beside the caller: the kernel stage collects it at its end)."""
    fd, name = tempfile.mkstemp(suffix=".json", prefix="compile-request-")
    os.close(fd)
    payload = Path(name)
    payload.write_text(json.dumps({"config": _read(cfg), "targets": targets, "result": str(result),
                                   "specialized": specialized}))
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # the compiler mode: JITFunctions, whose launch we record
    # its output goes to a file, never a pipe: a process it leaves (a user module's grandchild) holding a pipe would
    # keep a reader waiting after the child's end; it leads a process group of its own, killed whole at its end
    output = tempfile.TemporaryFile(mode="w+", prefix="compile-output-")
    child = subprocess.Popen([sys.executable, "-m", "posttrainllm.lab.compile", str(payload)],
                             stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
    child.request = payload  # removed by `finish`
    child.output = output
    return child


def _end_group(child: subprocess.Popen) -> None:
    """SIGKILL to what is left of the child's process group (a process it started and left running)."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(cfg: Any) -> dict[str, Any]:
    """The parts of the point's config a compile depends on, the kernel stage's params (lab/sweep.py STAGE_PARAMS),
    read one by one: the stage's stamp records what it read, and DVC reruns it when one of these changes."""
    from omegaconf import OmegaConf

    from posttrainllm.config import point_shape

    plain = lambda node: OmegaConf.to_container(OmegaConf.structured(node), resolve=True)  # noqa: E731
    precision = cfg.precision
    return {"op": plain(cfg.op), "tile": plain(cfg.tile), "workgroup": plain(cfg.workgroup),
            "architecture": plain(cfg.architecture), "shape": point_shape(cfg), "compile": plain(cfg.compile),
            "device": {"name": cfg.device.name}, "bench": {"threads": cfg.bench.threads},
            "precision": {"dtype": precision.dtype, "allow_tf32": precision.allow_tf32,
                          "dot_precision": precision.dot_precision,
                          "quantize": plain(precision.quantize) if precision.quantize is not None else None}}


def finish(child: subprocess.Popen, result: Path, targets: list[str], started: float) -> dict[str, Any]:
    """The child's report once it has ended, or why there is none (its last line of output)."""
    err = None
    try:
        child.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _end_group(child)
        try:
            child.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        err = f"it ran past {TIMEOUT_S} s and was stopped"
    finally:
        _end_group(child)
        child.request.unlink(missing_ok=True)
        child.output.seek(0)
        out = child.output.read()
        child.output.close()
    if not result.exists():
        tail = (err or out or "").strip().splitlines()[-1:] or [f"exit {child.returncode}"]
        return {"targets": targets, "rule": rules.cite("compile_counters"),
                "error": f"the compile process failed: {tail[0]}",
                "paths": {}, "rows": []}
    report = json.loads(result.read_text())
    report["seconds"] = round(time.perf_counter() - started, 2)
    return report


def not_fitting(report: dict[str, Any], target: str | None = None) -> list[str]:
    """One line per kernel that would not launch on `target` (default: every target): kernel, bytes, limit. An
    autotuned launch fails only when none of its candidates fits (the autotuner scores the others as never
    finishing, and picks among the rest)."""
    lines = [f"{row['path']}: {row['kernel']} ({row['direction']}, {row['target']}): {row['reason']}"
             for row in report.get("rows", []) if not row.get("autotune") and not row.get("fits", True)
             and target in (None, row["target"])]
    for (path, name, _), rows in sass.tuned_launches(report.get("rows", []), target).items():
        if not any(row.get("fits", True) for row in rows):
            reasons = "; ".join(dict.fromkeys(f"{_blocks(row)}: {row['reason']}" for row in rows))
            lines.append(f"{path}: {rows[0]['kernel']} ({rows[0]['direction']}, {name}): none of its "
                         f"{rows[0]['autotune']['candidates']} autotune candidates launches: {reasons}")
    return lines


def autotune_summary(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per autotuned launch and target: how many candidates the autotuner would time, how many launch, spill,
    use tensor cores; the candidates that do not launch, each with why."""
    summary = []
    for (path, target, launch), rows in sass.tuned_launches(report.get("rows", [])).items():
        counted = [row for row in rows if "registers" in row]
        summary.append({
            "path": path, "kernel": rows[0]["kernel"], "direction": rows[0]["direction"], "target": target,
            "launch": launch, "candidates": rows[0]["autotune"]["candidates"],
            "fit": sum(bool(row.get("fits")) for row in rows),
            "spill": sum(row["spill_bytes"] > 0 for row in counted),
            "tensor_cores": sum(row["tensor_cores"] != "none" for row in counted),
            "not_fitting": {_blocks(row): row["reason"] for row in rows if not row.get("fits", True)}})
    return summary


def _blocks(row: dict[str, Any]) -> str:
    """A row's configuration in one word: its BLOCK_* constexprs, then warps and stages (128x64x128 w8s3)."""
    blocks = "x".join(str(v) for k, v in row.get("constexprs", {}).items() if k.startswith("BLOCK_"))
    warps = f"w{row['num_warps']}s{row['num_stages']}" if "num_warps" in row else ""
    return " ".join(part for part in (blocks, warps) if part) or "-"


COLUMNS = ("path", "kernel", "direction", "target", "blocks", "launches", "num_warps", "num_stages", "registers",
           "spill_bytes", "shared_bytes", "ctas_per_sm", "tensor_cores", "async_copy", "fits")


def table(report: dict[str, Any]) -> str:
    """compile.json as a console table: one row per kernel and target, then each path's note and each reason."""
    import pandas as pd

    lines = [report[key] for key in ("error", "note") if report.get(key)]
    rows = report.get("rows", [])
    if rows:
        frame = pd.DataFrame([{c: row.get(c, "") for c in COLUMNS} | {"blocks": _blocks(row).split(" ")[0]}
                              for row in rows])
        frame["shared_bytes"] = frame["shared_bytes"].map(lambda b: f"{b / 1024:.0f} KB" if b != "" else "")
        lines.append(frame.to_string(index=False))
    for name, entry in report.get("paths", {}).items():
        for key in ("note", "error", "backward_note"):
            if entry.get(key):
                lines.append(f"{name}: {entry[key]}")
    for tuned in autotune_summary(report):
        lines.append(f"{tuned['path']}: {tuned['kernel']} ({tuned['direction']}, {tuned['target']}): "
                     f"{tuned['fit']} of {tuned['candidates']} autotune candidates launch, {tuned['spill']} spill, "
                     f"{tuned['tensor_cores']} use tensor cores")
    lines += not_fitting(report)
    return "\n".join(lines)


def _main() -> None:
    payload = json.loads(Path(sys.argv[1]).read_text())
    report = compile_in_process(payload["config"], payload["targets"], payload.get("specialized", True))
    Path(payload["result"]).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    _main()
