"""Which device a point runs on, how Triton runs there, and the fingerprint of the machine.

On a machine without CUDA, Triton kernels run through Triton's interpreter
(TRITON_INTERPRET=1): numerically meaningful, never a speed. The variable must be
set before any `@triton.jit` kernel is defined, so `prepare` runs before the ops
modules are imported (they are imported lazily, inside the stage functions).

PyTorch itself is imported lazily too: the DVC `device` stage runs on every `dvc repro`,
and `machine_fingerprint` reads what it needs from files when it can (no torch import).
"""

from __future__ import annotations

import ast
import contextlib
import glob
import importlib.util
import os
import platform
import sys
from pathlib import Path
from typing import Any, Iterator

NO_CUDA = ("device=cuda: CUDA is not available here (torch.cuda.is_available() is False): "
           "valid choices here are auto, cpu")


def resolve(name: str) -> str:
    """auto -> cuda when torch sees a GPU, else cpu; cuda where there is none is a ConfigError."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        from posttrainllm.config import ConfigError

        raise ConfigError(NO_CUDA)
    return name


def check_available(name: str) -> None:
    """Refuse (ConfigError, one line) a device this machine does not have; imports torch only for cuda."""
    if name == "cuda":
        resolve(name)


def prepare(name: str, threads: int = 0) -> str:
    """Resolve the device, route Triton through its interpreter off-GPU, fix the CPU thread count."""
    import torch

    device = resolve(name)
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from posttrainllm.ops import fast_language_patching_in_interpreter

        fast_language_patching_in_interpreter()  # its patching of triton.language made cheaper (ops/__init__.py)
    if threads:
        torch.set_num_threads(threads)
    return device


def current_cpu() -> int | None:
    """The CPU this process last ran on (/proc/self/stat's `processor`); None where there is no /proc."""
    try:
        return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def own_cpus() -> list[int] | None:
    """The CPUs this process may run on now, sorted (rule same_cpus: a timed stage's, pinned); None off Linux."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def _threads_of(pid: int) -> list[int]:
    """The thread ids of process `pid` (its main one and any pool's), from /proc; just `pid` where there is none."""
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")] if os.path.isdir(f"/proc/{pid}/task") else [pid]


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` allowed only `cpus`."""
    for task in _threads_of(pid):
        try:
            os.sched_setaffinity(task, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def affinities(pid: int) -> set[frozenset[int]]:
    """The CPU sets the threads of process `pid` are allowed (one set where all agree)."""
    found = set()
    for task in _threads_of(pid):
        try:
            found.add(frozenset(os.sched_getaffinity(task)))
        except ProcessLookupError:
            pass
    return found


@contextlib.contextmanager
def same_cpus(threads: int) -> Iterator[set[int] | None]:
    """Rule same_cpus: a timed stage runs on `threads` CPUs fixed for its whole length, the one it is on first
    (then the lowest others it may use), and restored after. A virtual machine's CPUs need not run at one speed
    (docs/timing.md, "Fifth pass", benchmarks/cpu_speeds.py), so two paths timed on different CPUs would compare
    the CPUs. The workers of user paths are pinned to the same set (lab/isolation/outside.py). Nothing is pinned where
    `threads` is 0 (torch's default: every CPU) or covers every CPU the process may use, or off Linux."""
    if not hasattr(os, "sched_setaffinity"):
        yield None
        return
    allowed = os.sched_getaffinity(0)
    if threads <= 0 or threads >= len(allowed):
        yield None
        return
    first = current_cpu()
    chosen = {first} if first in allowed else set()
    chosen |= set(sorted(allowed - chosen)[:threads - len(chosen)])
    before = {frozenset(a) for a in affinities(os.getpid())}
    pin(os.getpid(), chosen)
    try:
        yield chosen
    finally:
        pin(os.getpid(), set(next(iter(before))) if len(before) == 1 else allowed)


def last_level_cache_bytes(device: str) -> int | None:
    """The device's last-level cache: a GPU's L2, a CPU's largest cache level (Linux sysfs, cpu0); None if unknown."""
    import torch

    if device == "cuda":
        return getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", None) or None
    from pathlib import Path

    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (entry / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text))
    return max(sizes) if sizes else None


def triton_interpreted() -> bool:
    try:
        import triton

        return bool(triton.knobs.runtime.interpret)
    except (ImportError, AttributeError):
        return os.environ.get("TRITON_INTERPRET") == "1"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _info(device: str, device_name: str, threads: int, torch_version: str, triton_version: str) -> dict[str, Any]:
    """The fingerprint's fields, in their order (runs/device.json is hashed by DVC: order matters)."""
    return {
        "device": device,
        "device_name": device_name,
        "cpu_name": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "torch": torch_version,
        "triton": triton_version,
        "python": platform.python_version(),
        "platform": sys.platform,
        "triton_interpreted": device != "cuda",
    }


def fingerprint(device: str) -> dict[str, Any]:
    """What a timing depends on: the device, its software, and the thread count.

    DVC stages that time things depend on this (runs/device.json), so a cached
    timing is never restored on another device.
    """
    import torch
    import triton

    info = _info(device, torch.cuda.get_device_name() if device == "cuda" else _cpu_name(),
                 torch.get_num_threads(), torch.__version__, triton.__version__)
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(cuda=torch.version.cuda, capability=f"{props.major}.{props.minor}",
                    sm_count=props.multi_processor_count, memory_bytes=props.total_memory)
    return info


def machine_fingerprint() -> dict[str, Any]:
    """`fingerprint(resolve("auto"))` as a fresh process sees it, without importing torch where it can.

    The DVC `device` stage runs on every `dvc repro`; importing torch (and Triton) there is most
    of a no-op repro's time. The same values come from files when that is safe: torch's and
    Triton's versions from the files their `__version__` is defined in, "no GPU" from a torch
    build without CUDA/ROCm or no visible NVIDIA driver, and torch's default thread count by the
    rule of its x86-64 Linux CPU builds (MKL + OpenMP: the physical cores this process may run
    on). Anything else (a GPU, another platform, OMP_*/MKL_* settings) asks torch itself.
    tests/test_provenance.py checks both ways give the same JSON.
    """
    return _fingerprint_from_files() or fingerprint(resolve("auto"))


def _constants(package: str, filename: str, names: tuple[str, ...]) -> dict[str, Any] | None:
    """Top-level `name = <literal>` assignments of one file of an installed package, without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        tree = ast.parse((Path(list(spec.submodule_search_locations)[0]) / filename).read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    found: dict[str, Any] = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else []
        for target in targets:
            if isinstance(target, ast.Name) and target.id in names:
                try:
                    found[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    return None
    return found if set(names) <= set(found) else None


def _gpu_driver_visible() -> bool:
    """An NVIDIA driver (or WSL's GPU bridge) this process could reach."""
    return (os.path.exists("/proc/driver/nvidia") or bool(glob.glob("/dev/nvidia[0-9]*"))
            or os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/dxg"))


def _physical_cores(cpus: set[int]) -> int | None:
    """Distinct (package, core) pairs among `cpus`, from sysfs."""
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            return None
    return len(cores) or None


def _fingerprint_from_files() -> dict[str, Any] | None:
    """machine_fingerprint's torch-free path, or None where only torch can say."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    if any(k.startswith(("OMP_", "MKL_", "KMP_", "GOMP_")) for k in os.environ):
        return None  # thread settings: torch's own answer, not our rule
    torch_version = _constants("torch", "version.py", ("__version__", "cuda", "hip"))
    triton_version = _constants("triton", "__init__.py", ("__version__",))
    if torch_version is None or triton_version is None or torch_version["hip"] is not None:
        return None
    if torch_version["cuda"] is not None and _gpu_driver_visible():
        return None  # a CUDA build next to a driver: torch.cuda.is_available() decides
    try:
        threads = _physical_cores(os.sched_getaffinity(0))
    except OSError:
        return None
    if threads is None:
        return None
    return _info("cpu", _cpu_name(), threads, torch_version["__version__"], triton_version["__version__"])


@contextlib.contextmanager
def fp32_matmuls(*, tf32: bool) -> Iterator[None]:
    """Pin how torch's CUDA fp32 matmuls and convolutions run, then restore the caller's setting.

    tf32=True lets them use TF32 tensor cores (10-bit mantissa); False forces IEEE fp32, so a
    process-wide TF32 setting cannot leak into an fp32 point. No effect on the CPU.
    torch >= 2.9 spells this `fp32_precision` (the old `allow_tf32` flags warn there).
    """
    import torch

    cuda_mm, conv = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(cuda_mm, "fp32_precision"):
        saved = (cuda_mm.fp32_precision, conv.conv.fp32_precision)
        cuda_mm.fp32_precision = conv.conv.fp32_precision = "tf32" if tf32 else "ieee"
    else:
        saved = (cuda_mm.allow_tf32, conv.allow_tf32)
        cuda_mm.allow_tf32 = conv.allow_tf32 = tf32
    try:
        yield
    finally:
        if hasattr(cuda_mm, "fp32_precision"):
            cuda_mm.fp32_precision, conv.conv.fp32_precision = saved
        else:
            cuda_mm.allow_tf32, conv.allow_tf32 = saved


def available_memory_bytes(device: str) -> int | None:
    """Memory a new allocation can use now: free CUDA memory, or the kernel's MemAvailable on CPU (None if unknown)."""
    if device == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
