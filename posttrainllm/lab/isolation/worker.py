"""A user path's own process: its code is imported and called there, never in the lab's.

The lab holds the judge (the float64 oracle, the contract, the calibration, the timing statistics, the
receipt); the worker holds the user's module and nothing of those. One worker per user path per process of
the lab (one per DVC stage, one per `posttrainllm bench` point), started at the path's first call with the
lab's environment (TRITON_INTERPRET), its thread count (torch.get_num_threads(), which the stage set from
bench.threads), its working directory and sys.path. It is forked from the lab's zygote
(`python -m posttrainllm.lab.isolation.worker --zygote`, one per lab process, started at the first user path): a
process that has imported torch and this module and nothing else, and never calls any path, so a worker
starts in milliseconds instead of the ~1.5 s of importing torch, from the same clean state every time.
Whatever the user's code does to torch's functions, flags, thread count, Tensor methods, `time` or the GIL
stays in that process: the next path has a worker of its own and the lab has its own interpreter.

The protocol: framed messages over two pipes: plain data (dicts, lists, strings, numbers) pickled and read back
by an unpickler that refuses every class, then each tensor's storage as raw bytes with its dtype, size, stride
and offset; no object the worker chose is ever built in the lab (an output that is no tensor comes back as its
type's name only).

    load      import the user's module (an error there is the path's failure, "<Type>: <message>", located);
              answered with its function's `promises` (lab/invariance.py), as plain strings
    call      one call in the natural signature: the tensors, which of them require grad, the other
              arguments; the worker keeps the autograd graph under a call id when an output has history
    backward  the output gradients of a kept call -> the input gradients (None where unused)
    drop      forget kept graphs the lab no longer holds
    put/run   the timing protocol (lab/isolation/outside.py): a batch of input sets placed before the clock, then
              computed in one request, answered with the per-call times on the worker's clock and a checksum
              of every output; a "null" run repeats the loop and checksums calling nothing (what the lab
              subtracts); `fetch` then hands over every output, after the lab's clock has stopped
    ping      nothing: the round trip of an empty call

The guards see what the worker's copies saw: after each call the worker compares every tensor it was handed
(inputs; in backward, the output gradients) bitwise with its value before the call and sends back the ones
that changed, which the lab writes into its own buffers, so the lab's guard (lab/isolation/guards.py run_guarded)
finds and names the change; an output that shares storage with an input comes back as that very view of
the lab's buffer, so the aliasing guard names it; the worker counts Triton launches per call with
ops/launches.py and the lab adds them to its open counters (`record_launches`). These reports are the
worker's code, running beside the user's: a deliberate forger in the same process could lie in them
(not a sandbox: the worker is the same user, and can read any file it finds; the oracle's answers are
never in a file the worker is told of).

On the lab's side a user path is `remote(user)`: a function of the natural signature that sends its
arguments to the worker and, when the worker kept a graph, returns outputs attached to the lab's autograd
graph through `_Attach` (a torch.autograd.Function whose backward sends the output gradients). An exception
in the worker is raised in the lab as an exception of the same type name and message (`UserCodeError`
subclasses), carrying the worker's traceback and the innermost frame in the user's own files (`remote`: the
error reply's "traceback" and "where", track/failures.py); a worker that died is `WorkerDied`, naming its exit code
or signal.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import io
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import torch

from posttrainllm import rules
from posttrainllm.measure import device as devices
from posttrainllm.track.failures import first_line, locate, traceback_text
from posttrainllm.ops import emulate_bf16_in_interpreter, fast_language_patching_in_interpreter

_clock = time.perf_counter  # bound before any user code runs in a worker: a patched time.perf_counter is not ours
_TIMERS = {name: getattr(time, name) for name in ("perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns",
                                                  "time", "time_ns", "process_time", "process_time_ns")}
PACKAGE_PARENT = Path(__file__).resolve().parents[3]  # the folder holding posttrainllm/


class UserCodeError(RuntimeError):
    """An exception the user's code raised in its worker; each is re-raised as a subclass named as its type.
    `remote`: the worker's traceback text and the frame it located in the user's files (track/failures.py)."""

    remote: dict[str, Any] | None = None


class WorkerDied(RuntimeError):
    """The worker process ended without answering (a segfault, os._exit, a kill): no traceback, no frame."""

    @property
    def remote(self) -> dict[str, Any]:
        return {"traceback": f"WorkerDied: {self}\n(no traceback: the process ended without answering)\n",
                "where": None}


_ERROR_TYPES: dict[str, type] = {}


def _user_error(type_name: str, message: str, traceback: str | None = None,
                where: dict[str, Any] | None = None) -> UserCodeError:
    cls = _ERROR_TYPES.get(type_name)
    if cls is None:
        cls = _ERROR_TYPES[type_name] = type(type_name, (UserCodeError,), {})
    error = cls(message)
    error.remote = {"traceback": traceback or "", "where": where}
    return error


class _Foreign:
    """An output that is no tensor, as the lab sees it: an instance of a class named as the worker's type."""


_FOREIGN_TYPES: dict[str, type] = {}


def _foreign(type_name: str) -> Any:
    cls = _FOREIGN_TYPES.get(type_name)
    if cls is None:
        cls = _FOREIGN_TYPES[type_name] = type(type_name, (_Foreign,), {})
    return cls()


# --- the wire: plain data pickled without any class, tensors as raw storage bytes -----------------------------


class _PlainUnpickler(pickle.Unpickler):
    """Reads dicts, lists, tuples, strings, bytes, numbers, booleans and None: never a class or a function."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused {module}.{name}: a message holds plain data and tensors only")


def _send(conn: Connection, message: Any) -> None:
    """One message: its plain structure (tensors replaced by {"__tensor__": i, ...}), then each tensor's storage."""
    storages: list[torch.Tensor] = []

    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            value = value.detach()
            storage = value.untyped_storage()
            raw = torch.empty(0, dtype=torch.uint8, device=value.device).set_(storage).cpu()
            storages.append(raw)
            return {"__tensor__": len(storages) - 1, "nbytes": raw.numel(), "dtype": str(value.dtype).removeprefix("torch."),
                    "size": list(value.shape), "stride": list(value.stride()), "offset": value.storage_offset(),
                    "device": str(value.device)}
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(plain(v) for v in value)
        return value

    header = pickle.dumps(plain(message), protocol=5)
    conn.send_bytes(len(storages).to_bytes(4, "little") + header)
    for raw in storages:
        conn.send_bytes(memoryview(raw.numpy()) if raw.numel() else b"")


def _recv(conn: Connection) -> Any:
    data = conn.recv_bytes()
    count = int.from_bytes(data[:4], "little")
    header = _PlainUnpickler(io.BytesIO(data[4:])).load()
    sizes: dict[int, int] = {}

    def find(value: Any) -> None:
        if isinstance(value, dict):
            if "__tensor__" in value:
                sizes[value["__tensor__"]] = int(value["nbytes"])
            else:
                for v in value.values():
                    find(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                find(v)

    find(header)
    storages = []
    for i in range(count):  # each storage read straight into memory torch allocated (aligned as its own tensors)
        flat = torch.empty(sizes.get(i, 0), dtype=torch.uint8)
        if flat.numel():
            if conn.recv_bytes_into(memoryview(flat.numpy())) != flat.numel():
                raise EOFError("a tensor's bytes were cut short")
        elif conn.recv_bytes():
            raise EOFError("a tensor's bytes were longer than its header says")
        storages.append(flat)

    def tensors(value: Any) -> Any:
        if isinstance(value, dict):
            if "__tensor__" in value:
                flat = storages[value["__tensor__"]]
                storage = flat.untyped_storage()
                if value["device"] != "cpu":
                    storage = flat.to(value["device"]).untyped_storage()
                return torch.empty(0, dtype=getattr(torch, value["dtype"]), device=value["device"]).set_(
                    storage, value["offset"], value["size"], value["stride"])
            return {k: tensors(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(tensors(v) for v in value)
        return value

    return tensors(header)


def _split(args: tuple, kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any], list[torch.Tensor]]:
    """The arguments with each top-level tensor replaced by {"tensor": i}, and the tensors in that order."""
    tensors: list[torch.Tensor] = []

    def slot(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return {"tensor": len(tensors) - 1}
        return {"value": value}

    return [slot(a) for a in args], {k: slot(v) for k, v in kwargs.items()}, tensors


def split_call(args: tuple, kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any], list[torch.Tensor]]:
    """A natural call as the worker's `put` and `call` requests carry it (public: lab/isolation/outside.py places
    its timed sets so): the arguments with each top-level tensor replaced by {"tensor": i}, and the tensors."""
    return _split(args, kwargs)


def _join(args: list[Any], kwargs: dict[str, Any], tensors: list[torch.Tensor]) -> tuple[list[Any], dict[str, Any]]:
    fill = lambda s: tensors[s["tensor"]] if "tensor" in s else s["value"]  # noqa: E731
    return [fill(a) for a in args], {k: fill(v) for k, v in kwargs.items()}


def _same_bits(before: torch.Tensor, after: torch.Tensor) -> bool:
    if before.shape != after.shape or before.dtype != after.dtype:
        return False
    if before.numel() == 0:
        return True
    as_bytes = lambda x: x.detach().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return torch.equal(as_bytes(before), as_bytes(after))


# --- the lab's side ------------------------------------------------------------------------------------------


class _Clean:
    """No user path: a worker that loads nothing (lab/isolation/outside.py's clean twin, rule outside_null)."""

    name = "(the lab's clean twin)"


CLEAN = _Clean()


class Worker:
    """One user path's worker process, as the lab holds it."""

    def __init__(self, user: Any, threads: int) -> None:
        self.name = user.name
        self.died: str | None = None
        self._lock = threading.RLock()
        self._dropped: list[int] = []
        started = time.perf_counter()
        lab_in, child_out = os.pipe()
        child_in, lab_out = os.pipe()
        try:
            self.process = _zygote().fork(child_in, child_out)
        finally:
            os.close(child_in)
            os.close(child_out)
        if hasattr(os, "sched_getaffinity"):  # rule same_cpus: on the CPUs the lab runs on now, before its import
            devices.pin(self.process.pid, os.sched_getaffinity(0))
        self._in = Connection(lab_in, writable=False)
        self._out = Connection(lab_out, readable=False)
        self.calls = {"call": 0, "backward": 0}
        try:
            reply = self.request({"op": "load", "threads": threads, "sys_path": list(sys.path),
                                  "user": None if user is CLEAN else {
                                      "name": user.name, "module": user.module, "attr": user.attr,
                                      "call": getattr(user, "call", "function"),
                                      "file": str(user.file) if user.file else None,
                                      "identity": {k: v for k, v in user.identity.items()
                                                   if isinstance(v, (str, type(None)))}}})
        except UserCodeError:
            self.close()
            raise
        finally:
            self.start_s = time.perf_counter() - started  # the fork (the zygote's start, first) + the user's module
        self.pid = reply["pid"]
        self.threads = reply["threads"]
        self.heap_kept = bool(reply.get("heap_kept"))  # rule outside_heap
        self.tampered: list[str] = reply.get("tampered") or []  # what its import changed (outside.py: no speed)
        self.promises: list[str] = reply.get("promises") or []  # its function's `promises` (lab/invariance.py)

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one message and wait for its answer; an error in the user's code raises its UserCodeError."""
        with self._lock:
            if self.died is not None:
                raise WorkerDied(self.died)
            if self._dropped and message["op"] != "load":
                message = {**message, "drop": self._dropped}
                self._dropped = []
            try:
                _send(self._out, message)
                reply = _recv(self._in)
            except (EOFError, OSError, BrokenPipeError):
                self.died = self._death(message["op"])
                raise WorkerDied(self.died) from None
        if "error" in reply:
            error = reply["error"]
            raise _user_error(error["type"], error["message"], error.get("traceback"), error.get("where"))
        return reply

    def _death(self, op: str) -> str:
        try:
            code = self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait(timeout=10)
        how = ("its exit status unknown" if code is None else
               f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}")
        return f"the worker process of user path {self.name!r} died during its {op} ({how})"

    def forget(self, call_id: int) -> None:
        """A kept graph the lab no longer holds: dropped with the next message (never from a finalizer's I/O)."""
        self._dropped.append(call_id)

    def close(self) -> None:
        """End the worker and every process it started (its process group; what it left orphaned, adopted by the
        zygote): nothing of a user path outlives its worker."""
        if self.process.poll() is None:
            try:
                with self._lock:
                    _send(self._out, {"op": "exit"})
                self.process.wait(timeout=5)
            except Exception:
                self.process.kill()
        self.process.end()
        for conn in (self._in, self._out):
            conn.close()


def _lab_env() -> dict[str, str]:
    """The lab's environment as it is now, this package first on PYTHONPATH: the zygote's, and each worker's."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_PARENT), *filter(None, [env.get("PYTHONPATH")])])
    return env


class _Zygote:
    """The lab's side of its zygote: a process that imported torch and this module, and forks a worker on request.

    Requests and answers are framed JSON over a Unix socket; a fork's two pipe ends travel with it as file
    descriptors (SCM_RIGHTS). The zygote is the workers' parent, so it reaps them and tells how each ended."""

    def __init__(self) -> None:
        lab_end, its_end = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-m", "posttrainllm.lab.isolation.worker", "--zygote",
                                         str(its_end.fileno())], pass_fds=(its_end.fileno(),), env=_lab_env(),
                                        stdin=subprocess.DEVNULL, cwd=os.getcwd(),
                                        start_new_session=True)  # a terminal's Ctrl-C is the lab's: it closes us
        its_end.close()
        self.socket = lab_end
        self.conn = Connection(os.dup(lab_end.fileno()))
        self.lock = threading.Lock()
        self.broken = False

    def ask(self, request: dict[str, Any], fds: tuple[int, ...] = ()) -> dict[str, Any]:
        with self.lock:
            if self.broken:  # an exchange cut short (an interrupt): its answer would be read as the next one's
                raise WorkerDied("the zygote's last exchange was interrupted")
            try:
                self.conn.send_bytes(json.dumps(request).encode())
                if fds:
                    socket.send_fds(self.socket, [b"F"], list(fds))
                return json.loads(self.conn.recv_bytes())
            except (EOFError, OSError) as exc:
                raise WorkerDied(f"the zygote that starts user paths' workers is gone ({exc or type(exc).__name__})"
                                 ) from None
            except BaseException:
                self.broken = True
                raise

    def fork(self, read_fd: int, write_fd: int) -> "_Forked":
        """A worker reading `read_fd` and writing `write_fd`, in the lab's environment and working directory."""
        request = {"op": "fork", "env": _lab_env(), "cwd": os.getcwd()}
        return _Forked(self, self.ask(request, (read_fd, write_fd))["pid"])

    def close(self) -> None:
        self.conn.close()
        self.socket.close()  # the zygote reads the end of its socket and exits
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class _Forked:
    """A forked worker as the lab holds it (what Worker uses of a subprocess.Popen): its exit code comes from
    the zygote, its parent; negative for a signal, as Popen's."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self.zygote, self.pid, self.code = zygote, pid, None

    def wait(self, timeout: float) -> int | None:
        """The exit code, waiting up to `timeout` s (subprocess.TimeoutExpired after); None if the zygote is gone."""
        if self.code is None:
            try:
                self.code = self.zygote.ask({"op": "wait", "pid": self.pid, "timeout": timeout})["code"]
            except WorkerDied:
                return None
            if self.code is None:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self.code

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def end(self) -> list[int]:
        """The worker's process group killed and reaped by the zygote, then every stray it adopted; their pids."""
        try:
            answer = self.zygote.ask({"op": "end", "pid": self.pid})
        except WorkerDied:
            return []
        self.code = answer["code"]
        return answer["strays"]


_ZYGOTE: _Zygote | None = None


def _zygote() -> _Zygote:
    """This lab process's zygote, started at its first user path (again if it has died)."""
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.process.poll() is not None:
        _ZYGOTE = _Zygote()
    return _ZYGOTE


_WORKERS: dict[tuple, Worker] = {}
_FAILED: dict[tuple, Exception] = {}  # user paths whose worker could not load them, and why


def _key(user: Any) -> tuple:
    return (user.module, user.attr, user.identity.get("file"), user.identity.get("sha256"),
            getattr(user, "call", "function"))


def worker_for(user: Any) -> Worker:
    """The user path's worker in this process, started at its first use with the lab's thread count."""
    key = _key(user)
    if key in _FAILED:
        raise _FAILED[key]
    worker = _WORKERS.get(key)
    if worker is None:
        for other in [k for k in _WORKERS if k[:3] == key[:3]]:  # the same path, edited: one worker per path
            _WORKERS.pop(other).close()
        _prepare_lab()
        try:
            worker = Worker(user, torch.get_num_threads())
        except (UserCodeError, WorkerDied) as exc:  # its import failed: so does every later call, without a restart
            _FAILED[key] = exc
            raise
        _WORKERS[key] = worker
    return worker


def strays() -> list[int]:
    """The zygote's children that are no worker of this lab: processes a worker left orphaned, adopted there."""
    if _ZYGOTE is None or _ZYGOTE.process.poll() is not None:
        return []
    live = {w.process.pid for w in _WORKERS.values()} | ({_TWIN.process.pid} if _TWIN is not None else set())
    return [pid for pid in children_of(_ZYGOTE.process.pid) if pid not in live]


def end_strays() -> list[int]:
    """Every process the zygote adopted (a worker's orphans) killed with its group; their pids."""
    if _ZYGOTE is None or _ZYGOTE.process.poll() is not None:
        return []
    try:
        return _ZYGOTE.ask({"op": "strays"})["strays"]
    except WorkerDied:
        return []


def cpu_s(pids: list[int]) -> float:
    """The CPU seconds (user + system) the processes have used, from /proc (a gone one counts nothing)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
        except (OSError, IndexError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def alive() -> list[int]:
    """Every process below this lab's zygote now: its workers and whatever they started (a test counts them)."""
    return descendants_of(_ZYGOTE.process.pid) if _ZYGOTE is not None and _ZYGOTE.process.poll() is None else []


def closed_after(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stage whose workers end with it (a decorator): none outlives the stage, its bench or its test."""
    import functools

    @functools.wraps(fn)
    def stage(*args: Any, **kwargs: Any) -> Any:
        try:
            result = fn(*args, **kwargs)
        except BaseException:  # an interrupt, the stage's error: the workers end, the stage's exception stands
            try:
                close_all()
            except Exception:
                pass
            raise
        close_all()
        return result

    return stage


_PREPARED = False


def _prepare_lab() -> None:
    """Before this lab process starts its first worker: every module of the judge imported (none is read from a
    file a path could have written after that, such as a bytecode cache) and a private bytecode prefix for any
    later import (rule planted_bytecode: what a path writes is removed when the workers end)."""
    global _PREPARED
    if _PREPARED:
        return
    import pkgutil
    import tempfile

    package = str(Path(__file__).resolve().parents[1])  # posttrainllm/: walked by path (the layers point downward)
    for info in pkgutil.walk_packages([package], "posttrainllm."):
        if info.name.split(".")[1] in JUDGE_PACKAGES and not info.name.endswith("__main__"):
            spec = info.module_finder.find_spec(info.name)  # type: ignore[call-arg]
            if spec is None or not str(spec.origin).endswith(".py"):  # a sourceless .pyc is no module of ours
                continue
            try:
                importlib.import_module(info.name)
            except ImportError:  # an optional dependency this machine lacks: that module is never used here
                continue
    if sys.pycache_prefix is None:
        sys.pycache_prefix = tempfile.mkdtemp(prefix="posttrainllm-bytecode-")  # 0700: this user's, this process's
    _BYTECODE_SINCE.append(time.time())  # from here a path may run: bytecode written after is not the lab's
    _PREPARED = True


JUDGE_PACKAGES = ("lab", "track", "measure", "opdefs", "ops", "model")
_BYTECODE_SINCE: list[float] = []  # when this process first let a path run (rule planted_bytecode)


def drop_planted_bytecode() -> list[str]:
    """Rule planted_bytecode: the bytecode files a path could have planted for the next lab process, removed;
    their paths."""
    if not _BYTECODE_SINCE:
        return []
    since, private = _BYTECODE_SINCE[0], sys.pycache_prefix
    package = Path(importlib.import_module("posttrainllm").__file__).resolve().parent
    files = set(package.rglob("*.pyc"))
    for module in list(sys.modules.values()):
        cached = getattr(module, "__cached__", None)
        if isinstance(cached, str) and cached.endswith(".pyc"):
            files.add(Path(cached))
    dropped = []
    for path in sorted(files):
        try:
            if (private and str(path).startswith(private)) or path.stat().st_ctime < since:
                continue
            path.unlink()
            dropped.append(str(path))
        except OSError:
            continue
    if dropped:
        print(f"posttrainllm: removed {len(dropped)} bytecode file(s) written while user paths ran, which the next lab "
              f"process would load ({rules.named('planted_bytecode')}): {', '.join(dropped[:5])}"
              f"{' ...' if len(dropped) > 5 else ''}",
              file=sys.stderr)
    return dropped


def started(user: Any) -> Worker | None:
    """The worker of `user` if this process has started one."""
    return _WORKERS.get(_key(user))


_TWIN: Worker | None = None


def twin() -> Worker:
    """This lab process's clean twin: a worker forked like a path's that loads no path (rule outside_null)."""
    global _TWIN
    if _TWIN is None or _TWIN.died is not None or _TWIN.process.poll() is not None:
        _prepare_lab()
        _TWIN = Worker(CLEAN, torch.get_num_threads())
    return _TWIN


def close_all() -> None:
    """End every worker this process started, each with its whole process group, and whatever they left orphaned
    (at the end of a stage, at exit, and where a test wants a fresh one)."""
    global _TWIN
    _FAILED.clear()
    while _WORKERS:
        _, worker = _WORKERS.popitem()
        worker.close()
    if _TWIN is not None:
        _TWIN.close()
        _TWIN = None
    end_strays()
    drop_planted_bytecode()


def _at_exit() -> None:
    global _ZYGOTE
    close_all()
    if _ZYGOTE is not None:
        _ZYGOTE.close()
        _ZYGOTE = None


atexit.register(_at_exit)


class _Link:
    """One kept call: the worker, the call id, and which outputs have autograd history there."""

    def __init__(self, worker: Worker, call_id: int, differentiable: list[bool]) -> None:
        self.worker, self.call_id, self.differentiable = worker, call_id, differentiable
        weakref.finalize(self, worker.forget, call_id)


class _Attach(torch.autograd.Function):
    """The worker's outputs as outputs of the lab's inputs; backward asks the worker for the input gradients."""

    @staticmethod
    def forward(ctx: Any, link: _Link, n_inputs: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.link, ctx.n_inputs = link, n_inputs
        ctx.set_materialize_grads(False)
        outputs = tensors[n_inputs:]
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, link.differentiable) if not d])
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        link = ctx.link
        sent = [g.detach() if g is not None else None for g in grads]
        reply = link.worker.request({"op": "backward", "id": link.call_id, "grads": sent})
        link.worker.calls["backward"] += 1
        _apply_changes(reply, list(grads))
        return (None, None, *reply["grads"], *[None] * len(grads))


def _apply_changes(reply: dict[str, Any], tensors: list[Any]) -> None:
    """What the worker saw: its Triton launches into the lab's open counters; its writes into the lab's buffers."""
    if reply.get("launched"):
        from posttrainllm.ops.launches import record_launches

        record_launches(reply["launched"])
    with torch.no_grad():
        for index, value in (reply.get("changed") or {}).items():
            target = tensors[int(index)]
            if target is not None:
                target.copy_(value.to(target.device))


def _rebuild(skeleton: Any, outputs: list[Any]) -> Any:
    kind = skeleton["kind"]
    if kind == "tensor":
        return outputs[skeleton["index"]]
    if kind == "seq":
        items = [_rebuild(s, outputs) for s in skeleton["items"]]
        return tuple(items) if skeleton["tuple"] else items
    if kind == "value":
        return skeleton["value"]
    return _foreign(skeleton["type"])


def rebuild_result(skeleton: Any, outputs: list[Any]) -> Any:
    """A worker's answer as the natural result (public: lab/isolation/outside.py reads its fetched sets so): the
    answer's skeleton filled with its output tensors; an output that is no tensor is its type's name only."""
    return _rebuild(skeleton, outputs)


def _output_tensor(spec: dict[str, Any], inputs: list[torch.Tensor]) -> torch.Tensor:
    """A returned tensor; one sharing an input's storage in the worker is the same view of the lab's input."""
    if "view_of" not in spec:
        return spec["data"]
    source = inputs[spec["view_of"]]
    dtype = getattr(torch, spec["dtype"])
    return torch.empty(0, dtype=dtype, device=source.device).set_(
        source.untyped_storage(), spec["offset"], spec["size"], spec["stride"])


def remote(user: Any) -> Callable[..., Any]:
    """The lab's function for a user path, in the op's natural signature: each call runs in the path's worker."""

    def call(*args: Any, **kwargs: Any) -> Any:
        worker = worker_for(user)
        skeleton, kw, tensors = _split(args, kwargs)
        grad = torch.is_grad_enabled()
        flags = [bool(grad and t.requires_grad) for t in tensors]
        reply = worker.request({"op": "call", "args": skeleton, "kwargs": kw, "grad": grad, "flags": flags,
                                "tensors": [t.detach() for t in tensors]})
        worker.calls["call"] += 1
        _apply_changes(reply, tensors)
        outputs = [_output_tensor(spec, tensors) for spec in reply["outputs"]]
        if reply.get("id") is not None:
            differentiable = [bool(spec.get("grad")) for spec in reply["outputs"]]
            attached = _Attach.apply(_Link(worker, reply["id"], differentiable), len(tensors), *tensors, *outputs)
            outputs = list(attached) if isinstance(attached, tuple) else [attached]
        return _rebuild(reply["result"], outputs)

    call.__name__ = user.name
    call.user_path = user  # the lab's timing (lab/isolation/outside.py) reaches the worker through it
    return call


# --- the worker's side ---------------------------------------------------------------------------------------


def _encode(obj: Any, outputs: list[torch.Tensor]) -> dict[str, Any]:
    if isinstance(obj, torch.Tensor):
        outputs.append(obj)
        return {"kind": "tensor", "index": len(outputs) - 1}
    if isinstance(obj, (tuple, list)):
        return {"kind": "seq", "tuple": isinstance(obj, tuple), "items": [_encode(o, outputs) for o in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"kind": "value", "value": obj}
    return {"kind": "foreign", "type": type(obj).__name__}


def _out_spec(out: torch.Tensor, inputs: list[torch.Tensor]) -> dict[str, Any]:
    if out.device.type != "meta" and out.untyped_storage().nbytes():
        pointer = out.untyped_storage().data_ptr()
        for i, x in enumerate(inputs):
            if x.untyped_storage().nbytes() and x.untyped_storage().data_ptr() == pointer:
                return {"view_of": i, "offset": out.storage_offset(), "size": list(out.shape),
                        "stride": list(out.stride()), "dtype": str(out.dtype).removeprefix("torch.")}
    return {"data": out.detach(), "grad": bool(out.requires_grad)}


def _changed(before: list[torch.Tensor | None], after: list[Any]) -> dict[int, torch.Tensor]:
    return {i: a.detach().clone() for i, (b, a) in enumerate(zip(before, after))
            if b is not None and isinstance(a, torch.Tensor) and not _same_bits(b, a)}


def _counting() -> Any:
    """Triton launches of a call, counted when the user's code has Triton loaded (else there are none)."""
    import contextlib

    if "triton" not in sys.modules:
        return contextlib.nullcontext(None)
    from posttrainllm.ops.launches import count_triton_launches

    return count_triton_launches()


def _patch_interpreter() -> None:
    """Once the user's code has Triton loaded: under the interpreter, its bf16 dots and casts computed as the GPU
    computes them, as the lab's own kernels do there (ops/__init__.py USER_BF16_INTERPRETER_REASON), and with the interpreter's
    patching of triton.language made cheaper (LANGUAGE_PATCHING_REASON), as the lab's own are."""
    if "triton" in sys.modules:
        emulate_bf16_in_interpreter()
        fast_language_patching_in_interpreter()


_FLUSH: list[Any] = []


def _prime(tensors: list[torch.Tensor]) -> None:
    """A call's cache as the lab's in-process timing (measure/timing.py) gives each call: on CUDA the L2 flushed.
    On the CPU nothing: a set's inputs are read by its call (measured at attention tiny: a call over distinct sets
    read from the last-level cache runs as one rotating over 4 sets, 0.98x), and reading them before the call put
    work in the span that its null, run on warmer caches, did not take out (+4% a call; rule outside_null)."""
    if any(t.is_cuda for t in tensors):
        if not _FLUSH:
            from posttrainllm.measure.timing import l2_flush

            _FLUSH.append(l2_flush("cuda"))
        _FLUSH[0]()


WAKE_S = 0.002  # rule outside_wake


def _wake() -> None:
    """WAKE_S of the worker's own work before a batch (small products on its own tensors, no code of the path's):
    a process woken from a wait runs its first calls cold (measured: +5-15% a call, the first one 2x), where the
    lab's in-process timing loop never waits; this brings the core up before the batch's clock starts."""
    a = torch.ones(64, 64)
    deadline = _clock() + WAKE_S
    while _clock() < deadline:
        a = torch.mm(a, a).clamp_(-1.0, 1.0)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where its dynamic threshold stops
RESERVE_EXTRA = 8 * 2**20  # _reserve: beyond twice a batch's inputs, for one call's temporaries


def _keep_heap() -> bool:
    """Rule outside_heap: the worker's freed memory stays mapped, as a long-running lab process's does.
    A batch keeps its N results until it is checked, so glibc returned the heap's top to the system after every
    batch and each call of the next faulted its pages in again (~50 minor faults, +35% a call, measured with
    getrusage at attention tiny), where the lab's in-process loop frees each result before the next call and
    faults none. Allocations under glibc's dynamic mmap ceiling come from the heap, as they do in a lab process
    once it has freed one such block. False where the C library has no mallopt."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        return (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
                and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1)
    except (OSError, AttributeError):
        return False


def _reserve(nbytes: int) -> None:
    """Rule outside_heap: `nbytes` of the heap touched and freed before a batch's clock (kept mapped by
    _keep_heap), so the batch's kept results and its calls' temporaries land on pages already there, as a warm lab
    process's do; in pieces under glibc's mmap threshold, so they come from the heap and stay."""
    pieces = [torch.empty(min(nbytes - k, MMAP_THRESHOLD_MAX // 2), dtype=torch.uint8).fill_(0)
              for k in range(0, max(nbytes, 0), MMAP_THRESHOLD_MAX // 2)]
    del pieces


def _sync(tensors: list[torch.Tensor]) -> None:
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()


def checksums(answer: dict[str, Any]) -> list[float | None]:
    """Per output and gradient of one answer: the float64 sum of its values (None for no tensor)."""
    return [float(t.detach().sum(dtype=torch.float64)) if isinstance(t, torch.Tensor) else None
            for t in [*answer["outputs"], *answer["grads"]]]


def _first(result: Any) -> torch.Tensor:
    """The output a forward + backward call backpropagates: the result, or its first item (the adapters' "out")."""
    return result[0] if isinstance(result, (tuple, list)) else result


def _backward(result: Any, grad: torch.Tensor | list[torch.Tensor]) -> None:
    """A forward + backward call's backward: dO into the result's first item, or (an op with more differentiable
    outputs, lab/outside.py) a list of dOs into the results in order."""
    if isinstance(grad, (list, tuple)):
        torch.autograd.backward(list(result)[:len(grad)], list(grad))
    else:
        _first(result).backward(grad)


def _process_state() -> dict[str, Any]:
    """The torch switches a path could flip to change its own speed or, in a shared process, another path's."""
    b = torch.backends
    return {"threads": torch.get_num_threads(), "anomaly_detection": torch.is_anomaly_enabled(),
            "default_dtype": str(torch.get_default_dtype()),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(), "mkldnn.enabled": b.mkldnn.enabled,
            "switch_interval_s": sys.getswitchinterval(),  # a longer one lets a thread hold the GIL through a span
            "cudnn.enabled": b.cudnn.enabled, "cudnn.benchmark": b.cudnn.benchmark}


def _ours() -> dict[tuple[str, str], Any]:
    """Every callable of the lab's modules loaded here (this worker's own among them) and of its _Server."""
    found: dict[tuple[str, str], Any] = {}
    here = sys.modules[__name__]
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "posttrainllm" or name.startswith("posttrainllm.") or module is here):
            for attr, value in list(vars(module).items()):
                if callable(value) and not attr.startswith("__"):
                    found[(name, attr)] = value
    found.update({("_Server", attr): v for attr, v in vars(_Server).items() if callable(v)})
    return found


def _promises(fn: Any) -> list[str]:
    """The function's `promises` attribute as plain strings (a tuple or list of names; anything else is one name);
    the lab judges the names."""
    found = getattr(fn, "promises", None) or ()
    return [str(p) for p in (found if isinstance(found, (tuple, list, set, frozenset)) else [found])]


def _tampered(state: dict[str, Any], ours: dict[tuple[str, str], Any], user_file: str | None,
              server: Any = None) -> list[str]:
    """What the user's code changed of this process that no kernel needs to: torch's switches, `time`'s clocks,
    the lab's own functions (those loaded before it ran, or any of the lab's modules bound to its code), the
    server's handlers (on its class, in the dispatch table, or set on the server object itself)."""
    now = _process_state()
    changed = [f"{key} {state[key]} -> {now[key]}" for key in state if now[key] != state[key]]
    if server is not None:
        changed += [f"set {name} on the worker's server object (its requests go to the class's own)"
                    for name in REQUESTS if name in vars(server)]
        if type(server) is not _Server:
            changed.append(f"changed the worker's server's class to {type(server).__name__}")
    changed += [f"replaced the worker's handler of {op!r}" for op in REQUESTS
                if _HANDLERS.get(op) is not ours.get(("_Server", op))]
    changed += [f"replaced time.{name}" for name, fn in _TIMERS.items() if getattr(time, name) is not fn]
    current = _ours()
    changed += [f"replaced {m}.{a}" for (m, a), v in ours.items() if current.get((m, a)) is not v]
    if user_file:
        changed += [f"replaced {m}.{a}" for (m, a), v in current.items() if (m, a) not in ours and
                    getattr(getattr(v, "__code__", None), "co_filename", None) == user_file]
        changed += [f"a thread running its code ({name})" for name in _threads_in(user_file)]
    return changed


def _threads_in(user_file: str) -> list[str]:
    """The threads other than this one whose stack is in the user's file (computing a result late, holding the GIL)."""
    frames = sys._current_frames()
    found = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident) if thread is not threading.current_thread() else None
        while frame is not None:
            if frame.f_code.co_filename == user_file:
                found.append(thread.name)
                break
            frame = frame.f_back
    return found


class _Server:
    def __init__(self) -> None:
        self.fn: Callable[..., Any] | None = None
        self.kept: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.batches: dict[str, dict[str, Any]] = {}
        self.last: dict[str, Any] | None = None
        self.last_kept: list[dict[str, Any]] = []  # the last batch's answers, kept (rule outside_keep)
        self.buffers: list[list[torch.Tensor | None]] = []  # rule outside_keep: per set of the placed batch
        self.layout: list[tuple[Any, Any, Any]] = []  # the shapes of a set's outputs and gradients, last seen
        self.scratch: list[list[torch.Tensor | None]] = []  # rule outside_keep in the null: per set, per output
        self.last_tensors: list[list[torch.Tensor]] = []
        self.last_backward = False
        self.last_sets: list[tuple[list[torch.Tensor], list[Any], dict[str, Any]]] = []
        self.next_id = 0
        self.state: dict[str, Any] = {}
        self.ours: dict[tuple[str, str], Any] = {}
        self.user_file: str | None = None
        self.found: set[str] = set()  # what a timed run saw changed in a call, until `scan` asks
        self.heap_kept = False  # rule outside_heap: set at load

    def load(self, m: dict[str, Any]) -> dict[str, Any]:
        if m["threads"]:
            torch.set_num_threads(m["threads"])
        self.heap_kept = _keep_heap()  # in the twin too: both nulls alike
        sys.path[:] = m["sys_path"]
        u = m["user"]
        self.state, self.ours = _process_state(), _ours()  # as the lab set them, before any of the user's code
        if u is None:  # the clean twin: no path in this process
            return {"pid": os.getpid(), "threads": torch.get_num_threads(), "promises": [], "tampered": [],
                    "heap_kept": self.heap_kept}
        target = load_user(u["module"], Path(u["file"]) if u["file"] else None, u["attr"], u["identity"])
        if not callable(target):
            raise TypeError(f"{u['attr']} in {u['identity'].get('file')} is a {type(target).__name__}, not a callable")
        if u.get("call") == "module":
            target = module_path(target, u["attr"])
        self.fn = target
        _patch_interpreter()
        code = getattr(target, "__code__", None)
        self.user_file = str(u["file"]) if u["file"] else (code.co_filename if code else None)
        return {"pid": os.getpid(), "threads": torch.get_num_threads(), "promises": _promises(target),
                "heap_kept": self.heap_kept,
                "tampered": _tampered(self.state, self.ours, self.user_file, self)}

    def call(self, m: dict[str, Any]) -> dict[str, Any]:
        tensors = [t.requires_grad_() if f and t.is_floating_point() else t for t, f in zip(m["tensors"], m["flags"])]
        args, kwargs = _join(m["args"], m["kwargs"], tensors)
        before = [t.detach().clone() for t in tensors]
        _patch_interpreter()  # a module that imports Triton only when called
        with _counting() as launches, torch.set_grad_enabled(m["grad"]):
            result = self.fn(*args, **kwargs)
        outputs: list[torch.Tensor] = []
        skeleton = _encode(result, outputs)
        specs = [_out_spec(o, tensors) for o in outputs]
        reply = {"result": skeleton, "outputs": specs, "changed": _changed(before, tensors),
                 "launched": dict(launches.by_kernel) if launches else {}, "id": None}
        if m["grad"] and any(s.get("grad") for s in specs):
            self.next_id += 1
            self.kept[self.next_id] = (tensors, outputs)
            reply["id"] = self.next_id
        return reply

    def backward(self, m: dict[str, Any]) -> dict[str, Any]:
        tensors, outputs = self.kept.pop(m["id"])
        grads = m["grads"]
        before = [g.detach().clone() if g is not None else None for g in grads]
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        wrt = [i for i, t in enumerate(tensors) if t.requires_grad]
        found: list[torch.Tensor | None] = [None] * len(tensors)
        with _counting() as launches:
            if pairs and wrt:
                got = torch.autograd.grad([o for o, _ in pairs], [tensors[i] for i in wrt], [g for _, g in pairs],
                                          allow_unused=True)
                for i, g in zip(wrt, got):
                    found[i] = g.detach() if g is not None else None
        return {"grads": found, "changed": _changed(before, grads),
                "launched": dict(launches.by_kernel) if launches else {}}

    def put(self, m: dict[str, Any]) -> dict[str, Any]:
        # the last batch (checked by now) freed here, before the clock: not by the next timed run, in its span
        self.last, self.last_kept, self.last_tensors, self.last_sets, self.buffers = None, [], [], [], []
        sets = []
        for s in m["sets"]:
            tensors = [t.requires_grad_() if f and t.is_floating_point() else t for t, f in zip(s["tensors"],
                                                                                           s["flags"])]
            sets.append((tensors, *_join(s["args"], s["kwargs"], tensors)))
        self.batches[m["key"]] = {"sets": sets, "grad_outs": m.get("grad_outs")}
        # rule outside_keep: each set's results are copied into buffers made (and written, so no page faults) here
        self.buffers = [[torch.zeros(size, dtype=dtype, device=device) if size is not None else None
                         for size, dtype, device in self.layout] for _ in sets]
        if self.heap_kept:  # room for the batch's calls, about its inputs' size, twice over
            placed = [t for tensors, _, _ in sets for t in tensors] + list(m.get("grad_outs") or [])
            _reserve(2 * sum(t.numel() * t.element_size() for t in placed if t.device.type == "cpu") + RESERVE_EXTRA)
        return {}

    def _keep(self, i: int, result: Any, grads: list[Any], null: bool, odd: set[str]) -> dict[str, Any]:
        """Rule outside_keep: a call's outputs and gradients copied into the buffers `put` made for set i (any
        other made now), after its clock; the caller then drops the call's own, so the next call allocates where this one
        did, as in the lab's in-process loop, which frees each result before the next call. The set's answer.
        null: the same copies into scratch buffers, one per set and output as the kept ones are (made once; one
        shared buffer stays in cache where N distinct ones do not: docs/timing.md, "Fourth pass"), the kept
        answers left as they are. A returned tensor subclass is named in `odd` (it can compute when read).
        As few steps as the copies allow: it runs between two timed calls."""
        if type(result) is torch.Tensor:  # the common answer: one tensor, no skeleton to walk
            outputs, skeleton = [result], {"kind": "tensor", "index": 0}
        else:
            outputs = []
            skeleton = _encode(result, outputs)
        if null:
            while len(self.scratch) <= i:
                self.scratch.append([])
            slots = self.scratch[i]
        else:
            slots = self.buffers[i] if i < len(self.buffers) else []
        copies: list[torch.Tensor | None] = []
        for j, t in enumerate(outputs + grads):
            if type(t) is not torch.Tensor:
                if not isinstance(t, torch.Tensor):
                    copies.append(None)
                    continue
                if not isinstance(t, torch.nn.Parameter):
                    odd.add(type(t).__name__)
            buffer = slots[j] if j < len(slots) else None
            if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype or buffer.device != t.device:
                buffer = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                if null:
                    slots.extend([None] * (j + 1 - len(slots)))
                    slots[j] = buffer
            copies.append(buffer.copy_(t.detach() if t.requires_grad else t))  # no graph kept; no op more
        if i == 0 and not null:  # the next batch's buffers are made like these
            self.layout = [(tuple(c.shape), c.dtype, c.device) if c is not None else (None, None, None)
                           for c in copies]
        return {"result": skeleton, "outputs": copies[:len(outputs)], "grads": copies[len(outputs):]}

    def run(self, m: dict[str, Any]) -> dict[str, Any]:
        """Compute every set of a batch, each call on the worker's clock; answer with the times and a checksum of
        every output (read before answering: a result still being written after it differs when fetched).
        With "null": the same loop, line for line, over the last batch's sets, its calls replaced by the last
        batch's results (their kept copies): every step around a call (the clock, the copies of rule outside_keep)
        and the checksums, the overhead the lab subtracts from its span (rule outside_null).
        Rule outside_keep: between two calls only what a call's result needs (its copy out, its gradients reset);
        every check of the calls runs after the last one. A step between calls runs 2-3x slower after a call than
        in the null's back-to-back loop, so each step there charges the path time its null does not take out."""
        null = m.get("null", False)
        _patch_interpreter()  # before the clock
        batch = None if null else self.batches.pop(m["key"])
        backward = (batch["grad_outs"] is not None) if batch else self.last_backward
        sets = batch["sets"] if batch else [(t, (), {}) for t in self.last_tensors]
        grad_outs = batch["grad_outs"] if batch else None
        cuda = any(t.is_cuda for tensors, _, _ in sets for t in tensors)
        fn, stored = self.fn, self.last_kept
        samples, kept = [], []
        odd: set[str] = set()
        cpus, threads = devices.own_cpus(), self.state.get("threads", torch.get_num_threads())  # rule same_cpus: as pinned
        _wake()  # null or not: the same, so the lab's null takes it out of the span
        with torch.set_grad_enabled(backward and not null):
            for i, (tensors, args, kwargs) in enumerate(sets):
                if cuda:
                    _prime(tensors)  # null or not: the L2 flushed as measure() flushes it (rule outside_null)
                    torch.cuda.synchronize()
                start = _clock()
                if null:
                    result = rebuild_result(stored[i]["result"], stored[i]["outputs"])
                else:
                    result = fn(*args, **kwargs)
                    if backward:
                        _backward(result, grad_outs[i])
                if cuda:
                    torch.cuda.synchronize()
                samples.append(_clock() - start)
                grads = (stored[i]["grads"] if null else [t.grad for t in tensors]) if backward else []
                answer = self._keep(i, result, grads, null, odd)
                kept.append(stored[i] if null else answer)
                result = grads = answer = None  # the call's own outputs (and its graph) freed before the next call
                if backward:
                    for t in tensors:
                        t.grad = None
        tampered: set[str] = set()
        if torch.get_num_threads() != threads:
            tampered.add(f"threads {threads} -> {torch.get_num_threads()} in a call")
        if devices.own_cpus() != cpus:
            tampered.add(f"moved to CPUs {devices.own_cpus()} from {cpus} in a call (rule same_cpus)")
        # a tensor subclass can compute when read, after the per-call clock: not a timed result
        tampered.update(f"returned a {name} (a torch.Tensor subclass: it can compute when read, after the clock)"
                        for name in odd)
        if not null:
            self.last_kept, self.last_backward, self.last_sets, self.buffers = kept, backward, sets, []
            self.last_tensors = [tensors for tensors, _, _ in sets]
            self.found |= tampered  # handed over by `scan`, after the lab's clock (the span holds no scan)
        self.last = {"results": kept, "threads": torch.get_num_threads()}
        return {"samples_s": samples, "checksums": [checksums(a) for a in kept]}

    def scan(self, m: dict[str, Any]) -> dict[str, Any]:
        """What the path's calls changed of this process (outside.py: no speed), asked after the lab's clock:
        torch's switches, the clocks, the lab's functions, this server's handlers, threads left running."""
        found, self.found = self.found, set()
        found.update(_tampered(self.state, self.ours, self.user_file, self))
        return {"tampered": sorted(found)}

    def twin(self, m: dict[str, Any]) -> dict[str, Any]:
        """A clean worker's stand-in for a batch (rule outside_null): the last results are the outputs and
        gradients the lab sends, so a "null" run here costs what the path's worker's null costs, with no code of
        the path's in this process."""
        self.last_backward = bool(m["backward"])
        self.last_kept = [{"result": a["result"], "outputs": a["outputs"], "grads": a.get("grads") or []}
                          for a in m["answers"]]
        self.last_tensors = m["inputs"]
        return {}

    def memory(self, m: dict[str, Any]) -> dict[str, Any]:
        """One forward call of the set put under m["key"], its peak counted in this process by torch's allocator
        (measure/memory.py) and by tracemalloc (NumPy's buffers, Python's objects); answers with both counts and the
        outputs themselves. With "plain", the call alone, uncounted: the lab reads the resident set's growth around
        it from outside (rule outside_memory), with no profiler's memory in it."""
        import tracemalloc

        from posttrainllm.measure.memory import peak_bytes

        tensors, args, kwargs = self.batches[m["key"]]["sets"][0]
        if m.get("plain"):  # one call and nothing else: the lab reads the resident set's growth around it
            with torch.no_grad():
                self.fn(*args, **kwargs)
            _sync(tensors)
            return {}
        del self.batches[m["key"]]
        results: list[Any] = []

        def call() -> Any:
            with torch.no_grad():
                results.append(self.fn(*args, **kwargs))
            _sync(tensors)
            return results[-1]

        _patch_interpreter()
        tracemalloc.start()
        try:
            torch_peak = peak_bytes(call, m["device"], warmup=0)
            python_peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        outputs: list[torch.Tensor] = []
        _encode(results[-1], outputs)
        return {"allocator": torch_peak, "tracemalloc_bytes": python_peak, "outputs": [o.detach() for o in outputs]}

    def refill(self, m: dict[str, Any]) -> dict[str, Any]:
        """New values copied in place into the last batch's first set's own buffers, and that set computed again
        (`run`, then `fetch`): a result stored by the buffers' identity (their address, their id) is the old one."""
        tensors, args, kwargs = self.last_sets[0]
        with torch.no_grad():
            for t, new in zip(tensors, m["tensors"]):
                t.copy_(new)
        grad_outs = [m["grad_out"]] if m.get("grad_out") is not None else None
        self.batches["refill"] = {"sets": [(tensors, args, kwargs)], "grad_outs": grad_outs}
        return self.run({"key": "refill"})

    def fetch(self, m: dict[str, Any]) -> dict[str, Any]:
        """The last batch's answers, after the lab's clock has stopped."""
        return self.last or {}

    def ping(self, m: dict[str, Any]) -> dict[str, Any]:
        return {}


REQUESTS = ("load", "call", "backward", "put", "run", "scan", "twin", "memory", "refill", "fetch", "ping")
_HANDLERS = {op: vars(_Server)[op] for op in REQUESTS}  # the class's own, taken before any user code runs


def _handler(op: Any) -> Callable[..., Any]:
    """The class's handler of a request (never an attribute of the server object: a path could set one)."""
    if not isinstance(op, str) or op not in _HANDLERS:
        raise ValueError(f"unknown request {op!r}: the requests are {', '.join(REQUESTS)}, exit")
    return _HANDLERS[op]


def load_user(module_name: str, file: Path | None, attr: str, identity: dict[str, Any]) -> Callable[..., Any]:
    """A user path's callable (lab/isolation/user.py UserPath): its module imported once per process, from its file or by
    its dotted name, then `attr` (dotted) read from it; an import error is the path's to report. The file is
    hashed into the stamps of the stages that run it (lab/reads.py `outside_sources`)."""
    if identity["source"] == "file":
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module  # Triton's @jit reads the source through the module
            try:
                loader_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
    else:
        module = importlib.import_module(module_name)
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part)
    return fn


def module_path(cls: Any, attr: str) -> Callable[..., Any]:
    """A "module" user path (OpDef.user_call; a problem file's ModelNew): `cls` built once per init inputs, in
    this worker, and called with the forward's tensors followed by the reference's parameters and buffers, named
    by `state_names`; those its own state has are what it runs with (torch.func.functional_call), the others it
    never sees. Its `promises` are the class's."""
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise TypeError(f"{attr} is a {type(cls).__name__}, not a torch.nn.Module class")
    built: dict[str, torch.nn.Module] = {}

    def call(*tensors: torch.Tensor, init_inputs: list[Any], state_names: list[str]) -> Any:
        key = repr(init_inputs)
        if key not in built:
            built[key] = cls(*init_inputs)
        module = built[key]
        own = {*dict(module.named_parameters()), *dict(module.named_buffers())}
        n = len(tensors) - len(state_names)
        state = {name: t for name, t in zip(state_names, tensors[n:]) if name in own}
        return torch.func.functional_call(module, state, tuple(tensors[:n]))

    call.promises = getattr(cls, "promises", ())
    call.__name__ = attr
    return call


def serve(read_fd: int, write_fd: int) -> None:
    """The worker's loop: one answer per message until "exit" or the lab's end of the pipe closes."""
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    server = _Server()
    while True:
        try:
            message = _recv(inbox)
        except EOFError:
            return
        if message["op"] == "exit":
            return
        for call_id in message.get("drop", ()):
            server.kept.pop(call_id, None)
        try:
            reply = _handler(message.get("op"))(server, message)
        except (Exception, SystemExit) as exc:  # the user's error is the path's, reported, never the worker's end
            reply = _error_reply(exc)
        try:
            _send(outbox, reply)
        except (BrokenPipeError, ConnectionResetError):  # the lab is gone (interrupted): nobody to answer
            return
        except Exception as exc:  # an output torch cannot hand over as plain bytes (a sparse tensor, a subclass)
            _send(outbox, _error_reply(exc, "its result could not be sent: "))


def _error_reply(exc: BaseException, prefix: str = "") -> dict[str, Any]:
    """The error as the lab raises it: type, first line of the message, the full traceback and the innermost frame
    in the user's own files (track/failures.py `locate`; for a Triton kernel under the interpreter, its own line)."""
    return {"error": {"type": type(exc).__name__, "message": prefix + first_line(exc),
                      "traceback": traceback_text(exc), "where": locate(exc, user=True)}}


def zygote(fd: int) -> None:
    """`python -m posttrainllm.lab.isolation.worker --zygote FD`: until the lab's end of socket FD closes, fork a worker per
    "fork" request (its pipe ends arrive as file descriptors) and answer "wait" requests with a worker's exit code.
    A worker starts in a session of its own, in the environment and working directory the lab sent, and serves."""
    control = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    ended: dict[int, int] = {}
    _become_subreaper()  # a process a worker forks and leaves (double-forked, setsid) is reparented here, not to init
    workers: set[int] = set()
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if request["op"] == "fork":
            _, fds, _, _ = socket.recv_fds(control, 1, 2)
            pid = os.fork()
            if pid == 0:  # the worker
                code = 0
                try:
                    conn.close()
                    control.close()
                    os.setsid()
                    os.environ.clear()
                    os.environ.update(request["env"])
                    os.chdir(request["cwd"])
                    serve(*fds)
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    code = 1
                finally:
                    os._exit(code)
            for f in fds:
                os.close(f)
            workers.add(pid)
            answer: dict[str, Any] = {"pid": pid}
        elif request["op"] == "end":  # a worker and everything it started: its process group, then the strays
            pid = request["pid"]
            _kill_group(pid)
            if pid not in ended:
                ended[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            workers.discard(pid)
            answer = {"code": ended[pid], "strays": _end_strays(workers)}
        elif request["op"] == "strays":  # the processes a worker left here (their worker gone or not), ended
            answer = {"strays": _end_strays(workers)}
        else:  # "wait": the worker's exit code within the timeout, else None
            pid, deadline = request["pid"], time.monotonic() + request["timeout"]
            while pid not in ended:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    ended[pid] = os.waitstatus_to_exitcode(status)
                elif time.monotonic() >= deadline:
                    break
                else:
                    time.sleep(0.005)
            answer = {"code": ended.get(pid)}
        try:
            conn.send_bytes(json.dumps(answer).encode())
        except OSError:  # the lab is gone (interrupted): nobody to answer
            return


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def _become_subreaper() -> bool:
    """This process adopts its orphaned descendants (Linux >= 3.4): a worker's grandchildren stay in reach."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _kill_group(pid: int) -> None:
    """SIGKILL to a worker's process group (it leads a session of its own) and to the worker itself."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def children_of(parent: int) -> list[int]:
    """The processes whose parent is `parent`, read from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry))
    return found


def descendants_of(root: int) -> list[int]:
    """Every process below `root` (children, theirs, ...), read from /proc."""
    found, todo = [], [root]
    while todo:
        for child in children_of(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def _end_strays(workers: set[int]) -> list[int]:
    """Kill and reap every child of this zygote that is not a live worker (a worker's orphaned descendants, adopted
    here), their process groups too, until none is left; the pids ended."""
    ended: list[int] = []
    for _ in range(100):
        strays = [pid for pid in children_of(os.getpid()) if pid not in workers]
        if not strays:
            break
        for pid in strays:
            _kill_group(pid)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            ended.append(pid)
    return ended


if __name__ == "__main__":  # python -m posttrainllm.lab.isolation.worker --zygote FD
    zygote(int(sys.argv[2]))
