"""Kernels from outside: a user path is one more `Impl` of an op, made from a spec, never by editing opdefs/.

    op.user_impls=[kernels/my_attention.py:attention]        a file and a callable in it
    op.user_impls=[mine=my_package.kernels:attention]        an importable module (named `mine`)
    op.user_impls=[entry:fast]                               an installed distribution's entry point

A spec is `[name=]target`; the name defaults to the attribute's name (`attention` above). An entry point
lives in the group `posttrainllm.impls` under the name `<op>.<name>` (`attention.fast = my_package.kernels:attention`)
and joins a point only when named, never by being installed.

The callable takes the op's natural signature (`OpDef.signature`: attention `fn(q, k, v, *, causal, sm_scale)`,
matmul `fn(a, b)`, ...); the op's `adapt` turns it into the registry's dict form, so the user never sees it.
Whether it can backpropagate is the result's to say (an output without autograd history is forward-only).
The spec is checked when the config is validated by reading, never running, the user's code (a `@triton.jit`
fixes Triton's mode at import, before the stage has set it): the module is imported at the path's first call,
and an import that fails is that path's failure, recorded, not the point's.

Its identity (spec, file, sha256, distribution and version) goes into kernel.json, the receipt and the
stage stamps (lab/reads.py `outside_sources` passes the file of each of the point's paths to track/stamp.py).

A user path runs in a worker process of its own (lab/isolation/worker.py): its module is imported and called only
there, one worker per path per stage process; the registry's function (`registry_fn`) is the op's adapter around
the worker's proxy, differentiable through it. It meets the guards every path meets (lab/isolation/guards.py: the worker
reports writes into what it was handed, views of inputs and Triton launches, which the lab's guards then see and
name), the timed-result and roofline checks, and is timed from outside its worker (lab/isolation/outside.py: batches of
distinct input sets, the lab's clock, every output checked against the float64 oracle).
Trust: this is not a sandbox. What the path does to torch, its flags, threads, Tensor methods or `time` stays in
its worker; but the worker is the same user, can read any file it finds (the oracle's answers are never in a file
it is told of), and a deliberate forger in it could tamper with the worker's own reports.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from posttrainllm.config import ConfigError, LabConfig
from posttrainllm.files import shown

if TYPE_CHECKING:  # names for annotations only: base.py (OpDef.paths) imports this module, never the reverse
    from posttrainllm.ops.base import OpDef, Tensors

ENTRY_POINT_GROUP = "posttrainllm.impls"
ENTRY_PREFIX = "entry:"
USER_KIND = "user"
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")  # a path name: a file name, an MLflow key, a DVC stage key part


@dataclass(frozen=True)
class UserPath:
    """A user path, resolved without running any of its code: where its callable is and who made it.

    Nothing of the user's is imported when the config is validated (that runs before the stage has set
    Triton's mode, which a `@triton.jit` fixes at import): the spec is checked by reading files and package
    metadata, and the module is imported at the path's first call (`load`)."""

    name: str
    module: str  # the module to import: a dotted name, or (a file) the name it is loaded under
    file: Path | None  # the source file (for a file spec, the one loaded)
    attr: str
    identity: dict[str, Any]
    # how its worker calls it: "function", or "module" (an nn.Module class built there: OpDef.user_call)
    call: str = "function"

    def load(self) -> Callable[..., Any]:
        """Import the module (once per process) and return the callable; an import error is the path's to report."""
        from posttrainllm.lab.isolation.worker import load_user

        return load_user(self.module, self.file, self.attr, self.identity)


_RESOLVED: dict[tuple[str, str], UserPath] = {}


def parse_spec(spec: str) -> tuple[str | None, str]:
    """`[name=]target` -> (name or None, target)."""
    spec = str(spec).strip()
    name, sep, target = spec.partition("=")
    if not sep:
        return None, spec
    if not _NAME.match(name.strip()):
        raise ConfigError(f"op.user_impls: {spec!r}: the name {name.strip()!r} must start with a letter and hold "
                          "only letters, digits, '_', '-' and '.'")
    return name.strip(), target.strip()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _defined_names(path: Path, spec: str) -> set[str]:
    """The names a module file binds at its top level (defs, classes, assignments, imports), read, not run."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as exc:
        raise ConfigError(f"op.user_impls: {spec!r}: {path} does not parse: {exc.msg} (line {exc.lineno})") from None
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _check_attr(path: Path, attr: str, spec: str) -> None:
    names = _defined_names(path, spec)
    if attr.split(".")[0] not in names:
        defs = sorted(n for n in names if not n.startswith("_"))
        raise ConfigError(f"op.user_impls: {spec!r}: no attribute {attr!r} in {path}"
                          + (f" (defined there: {', '.join(defs)})" if defs else ""))


def _module_file(module_name: str, spec: str) -> Path:
    """The source file of a module, found without importing it (nor, for a dotted name, its parents)."""
    top, *rest = module_name.split(".")
    found = importlib.util.find_spec(top) if top not in sys.modules else getattr(sys.modules[top], "__spec__", None)
    if found is None:
        raise ConfigError(f"op.user_impls: {spec!r}: no module {module_name!r} is importable here; a file needs its "
                          "path, e.g. kernels/my_attention.py:attention")
    if not rest:
        if not found.origin or not found.origin.endswith(".py"):
            raise ConfigError(f"op.user_impls: {spec!r}: module {module_name!r} has no Python source to hash")
        return Path(found.origin)
    for base in found.submodule_search_locations or []:
        for candidate in (Path(base, *rest).with_suffix(".py"), Path(base, *rest, "__init__.py")):
            if candidate.is_file():
                return candidate
    raise ConfigError(f"op.user_impls: {spec!r}: no module {module_name!r} in {top}")


def distribution_of(module_name: str) -> tuple[str | None, str | None]:
    """(distribution, version) that provides the module's top-level package when installed, else (None, None)."""
    top = module_name.split(".")[0]
    dists = importlib.metadata.packages_distributions().get(top) or []
    if not dists:
        return None, None
    return dists[0], importlib.metadata.version(dists[0])


def _file_identity(path: Path) -> dict[str, Any]:
    return {"file": shown(path), "sha256": _sha256(path)}


def installed_entry_points(op_name: str | None = None) -> dict[str, importlib.metadata.EntryPoint]:
    """{`<op>.<name>`: entry point} of the group posttrainllm.impls (of one op when given)."""
    found = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return {k: v for k, v in found.items() if op_name is None or k.startswith(f"{op_name}.")}


def _entry_point(entry: str, op: OpDef, spec: str) -> importlib.metadata.EntryPoint:
    installed = installed_entry_points()
    key = f"{op.name}.{entry}"
    if key not in installed:
        others = sorted(k.split(".")[0] for k in installed if k.split(".", 1)[-1] == entry)
        mine = sorted(k.split(".", 1)[1] for k in installed_entry_points(op.name))
        if others:
            raise ConfigError(f"op.user_impls: {spec!r}: the entry point {entry!r} is declared for "
                              f"{', '.join(others)}, not for op {op.name}")
        raise ConfigError(f"op.user_impls: {spec!r}: no installed entry point {key!r} in group {ENTRY_POINT_GROUP}"
                          + (f" (installed for {op.name}: {', '.join(mine)})" if mine else
                             f" (none installed for {op.name})"))
    return installed[key]


def _cache_key(op: OpDef, spec: str) -> tuple:
    """A resolution holds while the file it names is the same file, unchanged: a relative path from another
    working directory, or an edit, resolves again (its identity must name what runs)."""
    where = parse_spec(spec)[1].rpartition(":")[0]
    if where.endswith(".py") or "/" in where or "\\" in where:
        file = Path(where).expanduser().resolve()
        stat = file.stat() if file.is_file() else None
        return op.name, spec, str(file), stat and (stat.st_mtime_ns, stat.st_size)
    return op.name, spec


def resolve(spec: str, op: OpDef) -> UserPath:
    """Check one spec for `op` and say where its callable is (cached per op and spec); runs none of its code.
    ConfigError with one line on any problem: no such file, attribute, module or entry point, a bad name."""
    key = _cache_key(op, str(spec))
    if key in _RESOLVED:
        return _RESOLVED[key]
    name, target = parse_spec(spec)
    identity: dict[str, Any] = {"spec": str(spec), "op": op.name, "distribution": None, "version": None}
    if target.startswith(ENTRY_PREFIX):
        entry = target[len(ENTRY_PREFIX):].strip()
        ep = _entry_point(entry, op, spec)
        module_name, _, attr = (part.strip() for part in ep.value.partition(":"))
        file = _module_file(module_name, spec)
        dist = getattr(ep, "dist", None)
        identity.update(source="entry_point", entry_point=f"{ep.name} = {ep.value}", **_file_identity(file),
                        distribution=dist.name if dist else None, version=dist.version if dist else None)
        name = name or entry
    else:
        where, sep, attr = target.rpartition(":")
        if not sep or not where or not attr:
            raise ConfigError(f"op.user_impls: {spec!r}: expected [name=]file.py:attr, [name=]module:attr or "
                              f"[name=]entry:<name>")
        if where.endswith(".py") or "/" in where or "\\" in where:
            file = Path(where).expanduser()
            if not file.is_file():
                raise ConfigError(f"op.user_impls: {spec!r}: no file {where} (from {Path.cwd()})")
            file = file.resolve()
            identity.update(source="file", **_file_identity(file))
            module_name = f"posttrainllm_user_{op.name}_{identity['sha256'][:12]}"
        else:
            module_name, file = where, _module_file(where, spec)
            dist, version = distribution_of(where)
            identity.update(source="module", **_file_identity(file), distribution=dist, version=version)
        name = name or attr.split(".")[-1]
    _check_attr(file, attr, spec)
    if not _NAME.match(name):
        raise ConfigError(f"op.user_impls: {spec!r}: {name!r} cannot name a path (a letter first, then letters, "
                          "digits, '_', '-', '.'): give one, name=<spec>")
    identity["name"] = name
    path = UserPath(name, module_name, file, attr, identity)
    _RESOLVED[key] = path
    return path


def registry_fn(user: UserPath, op: OpDef) -> Callable[[Tensors, LabConfig], Tensors]:
    """The registry's function of a user path (`Impl.fn`, OpDef.paths): the op's adapter around the path's worker
    (lab/isolation/worker.py), which imports the user's module at the first call, in its own process."""
    from posttrainllm.lab.isolation.worker import remote

    natural = remote(user)
    fn = op.adapt(natural)
    fn.__name__ = user.name
    return fn


def user_paths(op: OpDef, cfg: LabConfig, taken: set[str]) -> dict[str, Any]:
    """The paths of `op.user_impls`, adapted to the registry (OpDef.paths' `outside`); a name already taken is
    refused."""
    import dataclasses

    from posttrainllm.ops.base import ISOLATED, Impl

    paths: dict[str, Impl] = {}
    for spec in list(cfg.op.user_impls):
        user = resolve(spec, op)
        if op.user_call != user.call:
            user = dataclasses.replace(user, call=op.user_call)
        if op.check_user is not None:
            op.check_user(user)
        if user.name in taken or user.name in paths:
            where = "a built-in path" if user.name in taken else "another user path"
            raise ConfigError(f"op.user_impls: {spec!r}: the name {user.name!r} is taken by {where} of "
                              f"{op.name} (taken: {', '.join(sorted(taken | set(paths)))}); name it, "
                              f"<name>={spec}")
        paths[user.name] = Impl(user.name, USER_KIND, registry_fn(user, op), backend=f"{user.identity['spec']} "
                                f"({user.identity['file']})", user=user.identity, train_refusal=op.no_model,
                                runner=ISOLATED, source=user)
    return paths
