"""Where a path failed, and whether this machine could have run it at all.

Located: a path that raises, at its import or at a call, is recorded with the exception's type and message, the
innermost frame of the code it belongs to (`locate`: file, line, that line's text, the function) and its full
traceback, which the kernel stage writes beside the receipt (`<point>/tracebacks/<path>.txt`, named in the
verdict). Whose frame:
- a user path: the innermost frame in the user's own files, i.e. outside the posttrainllm package, the standard
  library and installed packages (site-packages: torch, triton, ...). Triton's interpreter runs a kernel's own
  source under its file name and re-raises the kernel's error as an InterpreterError, so the exception chain is
  read from its root cause outward: a Triton kernel failing under the interpreter is located at its own line;
- a built-in path: the innermost frame in posttrainllm (its kernel's line, under the interpreter).
Where no such frame exists (a call with the wrong arguments fails in its caller), the next kind is taken: the
lab's frame for a user path, then any. A user path's worker (lab/isolation/worker.py) locates its own exception and
sends the traceback and the frame back with the error; the lab locates the built-in paths'.

Cannot run here: not every failure says the path is wrong. `classify` names the ones that say this machine lacks
what the code needs (a GPU driver, CUDA, a feature Triton's interpreter does not have); such a path gets the
verdict CANNOT_RUN_HERE, with the reason and what would run it. It gets no speed and is never counted as a
broken contract. CANNOT_RUN holds every pattern, each named and commented; nothing else decides it.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

CANNOT_RUN_HERE = "cannot run here"  # a path's parity verdict, beside "pass" and "fail"
TRACEBACKS = "tracebacks"  # <point>/tracebacks/<path>.txt: a failed path's full traceback

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # posttrainllm/
PROJECT_ROOT = PACKAGE_DIR.parent
USER, LAB, LIBRARY = "user", "lab", "library"  # whose code a frame runs

GPU = "a GPU with its driver"
CUDA = "a CUDA GPU, with a CUDA build of torch"
COMPILED = "a GPU, where Triton compiles the kernel instead of interpreting it"
_INTERPRETER_FRAME = re.compile(r"[/\\]triton[/\\]runtime[/\\]interpreter\.py\"")  # a frame of Triton's interpreter


@dataclass(frozen=True)
class Gap:
    """What this machine lacks, as a failure shows it: `message` searched in the traceback's text (every chained
    exception's "<Type>: <message>" line is in it); with `interpreted`, only where the traceback passes through
    Triton's interpreter; with `source`, only where the located frame's file holds that pattern too."""

    name: str
    message: str
    reason: str
    runs_on: str
    interpreted: bool = False
    source: str | None = None


CANNOT_RUN = (
    # Triton asked for its GPU driver (triton.runtime.driver.active) and found none: libraries that query the
    # device when imported raise it at import, a kernel launched without TRITON_INTERPRET at its launch
    Gap("triton_no_driver", r"\b0 active drivers", "Triton found no GPU driver (0 active drivers)", GPU),
    # a torch.cuda call (torch.cuda.device(...), current_device(), .cuda()) on a torch built without CUDA: the
    # first is torch.cuda's lazy init, the second entering torch.cuda.device
    Gap("torch_without_cuda", r"Torch not compiled with CUDA enabled|PyTorch was compiled without CUDA support",
        "a torch.cuda call on a torch built without CUDA", CUDA),
    # the same calls on a CUDA build of torch where no device or driver is visible
    Gap("no_cuda_device", r"No CUDA GPUs are available|Found no NVIDIA driver|no CUDA-capable device is detected",
        "a torch.cuda call with no CUDA device visible", CUDA),
    # FlagGems (5.0.2) looks for a device when imported and raises this without one
    Gap("no_device", r"No device were detected", "the library found no device at import", GPU),
    # Triton's interpreter has no libdevice: tl.extra.libdevice's functions are empty stubs there and return
    # None, which fails where it is used ("cannot convert None of type <class 'NoneType'> to tensor", ...)
    Gap("interpreter_libdevice", r"NoneType", "Triton's interpreter has no libdevice (its functions return None "
        "there)", COMPILED, interpreted=True, source=r"\blibdevice\b"),
    # the interpreter hands a kernel its scalar arguments as Python numbers where the compiler gives a Triton
    # scalar, so `eps.to(tl.float32)` in a kernel raises there (Liger-Kernel 0.8.5's RMSNorm)
    Gap("interpreter_scalar_to", r"'(float|int|bool)' object has no attribute 'to'",
        "Triton's interpreter passes a scalar argument as a Python number, which has no .to()", COMPILED,
        interpreted=True),
)


def _roots() -> list[str]:
    """Folders of code that is neither the user's nor the lab's: the standard library and installed packages."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
    for name in ("torch", "triton"):  # wherever they are installed, an editable checkout too
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            roots.add(str(Path(module.__file__).resolve().parent))
    return [os.path.realpath(r) + os.sep for r in roots]


def kind(filename: str, roots: list[str] | None = None) -> str:
    """Whose code a frame's file is: USER, LAB (the posttrainllm package) or LIBRARY (`roots`: _roots())."""
    if not filename or filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>: not a file of anyone's
        return LIBRARY
    path = os.path.realpath(filename)
    if path.startswith(str(PACKAGE_DIR) + os.sep):
        return LAB
    parts = Path(path).parts
    if "site-packages" in parts or "dist-packages" in parts or any(path.startswith(r) for r in roots or _roots()):
        return LIBRARY
    return USER


def shown(filename: str) -> str:
    """A file as a verdict shows it: relative to the project when inside it, else absolute."""
    path = Path(filename).resolve()
    return path.relative_to(PROJECT_ROOT).as_posix() if path.is_relative_to(PROJECT_ROOT) else str(path)


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and what caused it, outermost first (as the traceback prints them, last)."""
    found: list[BaseException] = []
    while exc is not None and all(exc is not e for e in found):
        found.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return found


def _frames(tb: TracebackType | None) -> list[traceback.FrameSummary]:
    return list(traceback.extract_tb(tb))


def locate(exc: BaseException, *, user: bool) -> dict[str, Any] | None:
    """The innermost frame of the path's own code: for a user path the user's files, else posttrainllm's (then the
    other kind, then any), read from the root cause outward. {"file", "line", "text", "function"}, or None."""
    chain = _chain(exc)[::-1]  # root cause first
    roots = _roots()
    for wanted in ((USER, LAB, LIBRARY) if user else (LAB, USER, LIBRARY)):
        for e in chain:
            frames = [f for f in _frames(e.__traceback__) if kind(f.filename, roots) == wanted]
            if frames:
                frame = frames[-1]
                return {"file": shown(frame.filename), "line": frame.lineno, "text": (frame.line or "").strip(),
                        "function": frame.name}
    return None


def traceback_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def describe(exc: BaseException, *, user: bool) -> dict[str, Any]:
    """A failure as a verdict records it: {"type", "message", "where", "traceback"} and, where `classify` finds what
    this machine lacks, "cannot_run_here". An exception from a user path's worker carries the worker's traceback
    and frame (`remote`); any other is located here."""
    remote = getattr(exc, "remote", None)
    if remote is not None:
        text, where = remote.get("traceback") or "", remote.get("where")
    else:
        text, where = traceback_text(exc), locate(exc, user=user)
    failure: dict[str, Any] = {"type": type(exc).__name__, "message": first_line(exc), "where": where,
                               "traceback": text}
    gap = classify(failure)
    if gap is not None:
        failure["cannot_run_here"] = gap
    return failure


def _source(where: dict[str, Any] | None) -> str:
    if not where:
        return ""
    path = Path(where["file"])
    path = path if path.is_absolute() else PROJECT_ROOT / path
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def classify(failure: dict[str, Any]) -> dict[str, str] | None:
    """The first pattern of CANNOT_RUN the failure matches: {"pattern", "reason", "runs_on"}; None when none does
    (then the failure is the path's: a broken contract)."""
    text = failure.get("traceback") or f"{failure['type']}: {failure['message']}"
    for gap in CANNOT_RUN:
        if not re.search(gap.message, text):
            continue
        if gap.interpreted and not _INTERPRETER_FRAME.search(text):
            continue
        if gap.source is not None and not re.search(gap.source, _source(failure.get("where"))):
            continue
        return {"pattern": gap.name, "reason": gap.reason, "runs_on": gap.runs_on}
    return None


def at(where: dict[str, Any] | None) -> str:
    """"file:line: text" of a located frame ("" for none)."""
    if not where:
        return ""
    return f"{where['file']}:{where['line']}" + (f": {where['text']}" if where.get("text") else "")


def line(failure: dict[str, Any]) -> str:
    """One line: "<Type>: <message> (at file:line: text)"."""
    head = f"{failure['type']}: {failure['message']}" if failure["message"] else failure["type"]
    return head + (f" (at {at(failure['where'])})" if failure.get("where") else "")


def write_traceback(folder: Path, name: str, failure: dict[str, Any], what: str) -> str:
    """The failure's full traceback into folder/tracebacks/<name>.txt, headed by what failed and where; returns
    the file's path relative to `folder` (what the verdict names)."""
    path = folder / TRACEBACKS / f"{name}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    head = [f"path {name}: {what}: {failure['type']}: {failure['message']}"]
    if failure.get("where"):
        head.append(f"located: {at(failure['where'])} (in {failure['where']['function']})")
    gap = failure.get("cannot_run_here")
    if gap:
        head.append(f"{CANNOT_RUN_HERE}: {gap['reason']}; runs on {gap['runs_on']} ({gap['pattern']})")
    path.write_text("\n".join(head) + "\n\n" + (failure.get("traceback") or "(no traceback)\n"))
    return path.relative_to(folder).as_posix()
