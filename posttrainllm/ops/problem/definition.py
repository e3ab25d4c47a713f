"""An op made from a problem file in KernelBench's format: `op=problem op.file=PATH`.

A problem file holds a `Model(nn.Module)`, `get_inputs()` (the forward's arguments), `get_init_inputs()` (the
constructor's) and module-level integer size constants (`batch_size = 4096`) both functions read. The lab makes of
it an OpDef at config time (`problem_op(cfg)`, reached through ops.registry.op_for):

    sizes       the file's int constants (and tuples of ints) that get_inputs/get_init_inputs read; op.sizes
                overrides them before either runs; with none given on a CPU point, every constant above
                SMALL is divided by one power-of-two factor (ratios kept; small ones, a `dim = 1`, a kernel
                size, untouched) until one call's inputs, parameters and output fit op.budget_mib
    reference   `Model` run in the inputs' dtype through torch.func.functional_call with the parameters and
                buffers handed to it as inputs: float64 is the oracle; at the point's precision it is the
                speed baseline (Model as the file's author runs it)
    compiled    (opt-in, op.peers) the same under torch.compile
    user paths  `[name=]NEW.py:ModelNew` (op.user_impls): the class is built in the path's worker with the same
                init inputs and called with Model's parameters and buffers where the names match
                (lab/isolation/worker.py, "module" user paths)
    cases       per parity seed, inputs drawn by the file's own get_inputs and parameters at the file's init
                (cases named file-seed<N>); on the first seed the lab's own at the same shapes and dtypes
                (lab-<kind>, op.input_kinds): signed N(0, 1) inputs, x1e4 (large), x1e-4 (tiny), and signed with
                the first input's first slice all zero (zero_row); their floating parameters drawn afresh
    parity      per row along the output's last axis (a 0-d output: one row), forward, and every gradient
                where the output is floating (inputs and parameters that are floating)
    costs       FLOPs by torch.utils.flop_counter.FlopCounterMode on the reference (it counts matmuls,
                convolutions and attention; elementwise work counts 0), bytes = inputs + parameters + output
                in the point's dtype: a floor (intermediates are not counted)
    curve       over one size constant (op.x_name; default batch_size, else the largest), at 1/4, 1/2 and 1
                of its value
    bench-train a problem op has no model hook: every path is skipped, and says why (NO_MODEL)
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from posttrainllm import rules
from posttrainllm.config import ConfigError, LabConfig, itemsize

if TYPE_CHECKING:
    from posttrainllm.ops.base import Case, OpDef, Tensors

NAME = "problem"
SMALL = 16  # constants at most this are left as they are when shrinking (a dim index, a kernel size, channels=3)
INPUT_KINDS = ("signed", "large", "tiny", "zero_row")
SCALES = {"signed": 1.0, "large": 1e4, "tiny": 1e-4, "zero_row": 1.0}
FILE_KIND = "file"
NO_MODEL = ("a problem file's op has no model hook (no layer of the lab's transformer is this op): bench-train "
            "trains none of its paths; `posttrainllm bench` checks and times them")


def _bad(file: str, what: str) -> ConfigError:
    return ConfigError(f"op.file={file}: {what}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0].removesuffix(", but expected one of:") if text else ""
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


# --- the file, read and loaded ---------------------------------------------------------------------------------


def _int_like(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, tuple) and bool(value) and all(isinstance(v, int) and not isinstance(v, bool)
                                                         for v in value))


def _globals_read(tree: ast.Module, functions: tuple[str, ...]) -> list[str]:
    """The names the given module-level functions read (loads), in order of first use."""
    found: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in functions:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in found:
                    found.append(sub.id)
    return found


@dataclass
class Problem:
    """A loaded problem file: its module, its Model, its size constants as written and as used."""

    path: Path
    shown: str
    sha256: str
    module: Any
    tree: ast.Module
    written: dict[str, Any]  # every size constant (int, or a tuple of ints) as the file writes it
    read: list[str]  # the module-level names get_inputs and get_init_inputs read
    used: dict[str, Any] = field(default_factory=dict)  # ... as this point runs it
    how: str = ""  # how `used` came about, in words

    @property
    def model(self) -> type:
        return self.module.Model

    def set_sizes(self, sizes: dict[str, Any]) -> None:
        for name, value in sizes.items():
            setattr(self.module, name, value)

    def evaluate(self, sizes: dict[str, Any], seed: int, device: str | None = None) -> tuple[list, Any, list]:
        """(init inputs, Model built from them, get_inputs()) at `sizes`, torch's global RNG seeded with `seed`
        (and put back as it was after): the file draws with torch.rand and nn's own init. A step that raises is
        a ConfigError naming the file and the step (FileBroken)."""
        import contextlib

        self.set_sizes(sizes)
        where = torch.device(device) if device else contextlib.nullcontext()
        with torch.random.fork_rng(devices=[]), where:
            torch.manual_seed(seed)
            init = self._step("get_init_inputs()", lambda: list(self.module.get_init_inputs()))
            model = self._step("Model(*get_init_inputs())", lambda: self.model(*init))
            inputs = self._step("get_inputs()", lambda: list(self.module.get_inputs()))
        return init, model, inputs

    def _step(self, what: str, run: Callable[[], Any]) -> Any:
        try:
            return run()
        except Exception as exc:
            floats = [f"{n} = {v!r}" for n, v in vars(self.module).items() if n in self.read and isinstance(v, float)
                      and what.startswith("get_inputs")]
            hint = f" (a size it reads is not an int: {', '.join(floats)})" if floats else ""
            raise FileBroken(_bad(self.shown, f"{what} raised {_first_line(exc)}{hint}")) from None


class FileBroken(ConfigError):
    """The problem file's own code raised at one step (Problem.evaluate)."""

    def __init__(self, error: ConfigError) -> None:
        super().__init__(str(error))


def load_file(file: str) -> Problem:
    """Read and import a problem file; ConfigError naming the file and what is wrong with it."""
    path = Path(file).expanduser()
    if not path.is_file():
        raise _bad(file, f"no such file (from {Path.cwd()})")
    source = path.read_text()
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as exc:
        raise _bad(file, f"does not parse: {exc.msg} (line {exc.lineno})") from None
    defined = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    for needed in ("Model", "get_inputs", "get_init_inputs"):
        if needed not in defined:
            raise _bad(file, f"no {'class' if needed == 'Model' else 'function'} {needed} (a KernelBench problem "
                             f"file defines Model, get_inputs and get_init_inputs; this one defines "
                             f"{', '.join(sorted(defined)) or 'none of them'})")
    sha = hashlib.sha256(source.encode()).hexdigest()
    name = f"posttrainllm_problem_{sha[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise _bad(file, f"importing it raised {_first_line(exc)}") from None
    if not (isinstance(module.Model, type) and issubclass(module.Model, torch.nn.Module)):
        raise _bad(file, f"Model is a {type(module.Model).__name__}, not a torch.nn.Module class")
    read = _globals_read(tree, ("get_inputs", "get_init_inputs"))
    written = {n: getattr(module, n) for n in read if n in vars(module) and _int_like(getattr(module, n))}
    from posttrainllm.files import shown

    return Problem(path.resolve(), shown(path), sha, module, tree, written, read)


# --- sizes -------------------------------------------------------------------------------------------------------


def _scaled(value: Any, factor: int) -> Any:
    one = lambda v: v if v <= SMALL else max(1, v // factor)  # noqa: E731
    return tuple(one(v) for v in value) if isinstance(value, tuple) else one(value)


def _tensor_bytes(values: Any) -> int:
    if isinstance(values, torch.Tensor):
        return values.numel() * values.element_size()
    if isinstance(values, (list, tuple)):
        return sum(_tensor_bytes(v) for v in values)
    return 0


def _no_grad(model: torch.nn.Module, inputs: list) -> Any:
    with torch.no_grad():
        return model(*inputs)


def _footprint(problem: Problem, sizes: dict[str, Any], device: str | None) -> int:
    """Bytes of one call in float32: inputs + parameters and buffers + output."""
    init, model, inputs = problem.evaluate(sizes, 0, device)
    out = problem._step("Model's forward on get_inputs()", lambda: _no_grad(model, inputs))
    if not isinstance(out, torch.Tensor):
        return _tensor_bytes(inputs)  # the one-tensor rule is checked (and named) at the point's sizes
    state = list(model.state_dict().values())
    as_fp32 = lambda ts: sum(t.numel() * (4 if t.is_floating_point() else t.element_size())  # noqa: E731
                             for t in ts if isinstance(t, torch.Tensor))
    return as_fp32(inputs) + as_fp32(state) + as_fp32([out])


def choose_sizes(problem: Problem, cfg: LabConfig, on_cpu: bool) -> None:
    """problem.used and problem.how: the file's sizes with op.sizes over them; with none given on a CPU point,
    shrunk by one power-of-two factor (constants above SMALL; ratios kept) until one call fits op.budget_mib."""
    given = dict(cfg.op.sizes)
    for name, value in given.items():
        if name not in problem.written:
            written = vars(problem.module).get(name, None)
            why = (f"{name} = {written!r} in the file is a {type(written).__name__}, not an int size"
                   if name in vars(problem.module) and not name.startswith("__") else f"no size constant {name}")
            raise _bad(problem.shown, f"op.sizes.{name}: {why}; its sizes are "
                                      f"{', '.join(problem.written) or 'none'}")
        if not (isinstance(value, int) and not isinstance(value, bool)) or value < 1:
            raise _bad(problem.shown, f"op.sizes.{name}={value!r}: a size is a positive int")
        if isinstance(problem.written[name], tuple):
            raise _bad(problem.shown, f"op.sizes.{name}: {name} = {problem.written[name]!r} is a tuple; op.sizes "
                                      "sets int constants only")
    if given:
        problem.used = {**problem.written, **given}
        problem.how = f"op.sizes over the file's ({', '.join(f'{k}={v}' for k, v in given.items())})"
        return
    if not on_cpu:
        problem.used, problem.how = dict(problem.written), "the file's own"
        return
    budget = int(cfg.op.budget_mib * 2**20)
    factor, size = 1, None
    largest = max([v for value in problem.written.values() for v in (value if isinstance(value, tuple)
                                                                        else (value,))] or [1])
    while True:
        sizes = {k: _scaled(v, factor) for k, v in problem.written.items()}
        try:
            size = _footprint(problem, sizes, "meta")
        except Exception:  # a file whose draws or math meta tensors cannot run: measured for real, from small up
            _shrink_for_real(problem, budget, largest)
            return
        if size <= budget or factor > largest:
            break
        factor *= 2
    problem.used = sizes
    problem.how = ("the file's own (they fit op.budget_mib)" if factor == 1 else
                   f"the file's divided by {factor} (constants > {SMALL}; ratios kept) so one call's inputs, "
                   f"parameters and output fit op.budget_mib={cfg.op.budget_mib:g} ({size / 2**20:.2f} MiB)")


def _shrink_for_real(problem: Problem, budget: int, largest: int) -> None:
    factor = 1
    while factor * 2 <= largest and max(_scaled(largest, factor * 2), 1) > 64:
        factor *= 2  # start where the largest constant is ~64 and grow while it fits
    while factor > 1 and _footprint(problem, {k: _scaled(v, factor // 2) for k, v in problem.written.items()},
                                    None) <= budget:
        factor //= 2
    problem.used = {k: _scaled(v, factor) for k, v in problem.written.items()}
    problem.how = (f"the file's divided by {factor} (constants > {SMALL}; ratios kept), measured on real tensors "
                   "(meta tensors could not run the file), to fit op.budget_mib")


# --- the op ------------------------------------------------------------------------------------------------------


def _on_cpu(cfg: LabConfig) -> bool:
    return cfg.device.name == "cpu" or (cfg.device.name == "auto" and not torch.cuda.is_available())


def _fresh(init: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A parameter drawn afresh at its init's scale: N(mean, std) of the init; a constant init c (weights 1,
    biases 0) becomes c + N(0, (0.5·max(|c|, 1))²), so that a path ignoring it differs."""
    x = init.detach().double()
    mean = float(x.mean()) if x.numel() else 0.0
    std = float(x.std()) if x.numel() > 1 else 0.0
    scale = std if std > 0 else 0.5 * max(abs(mean), 1.0)
    noise = torch.randn(init.shape, generator=gen, dtype=torch.float32).double()
    return (mean + scale * noise).to(init.dtype)


class ProblemOp:
    """The pieces of the OpDef of one problem file at one point's sizes (problem_op builds the OpDef)."""

    def __init__(self, problem: Problem, cfg: LabConfig) -> None:
        self.problem = problem
        self.sizes = dict(problem.used)
        self.seeds = list(cfg.parity.seeds)
        self.kinds = list(cfg.op.input_kinds)
        init, model, inputs = self._checked_main()
        params = inspect.signature(problem.model.forward).parameters
        names = [n for n in params if n != "self"]
        positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(names) != len(inputs) and not any(p.kind == p.VAR_POSITIONAL for p in params.values()):
            raise _bad(problem.shown, f"get_inputs() gives {len(inputs)} arguments; Model.forward takes "
                                      f"{len(positional) - 1} ({', '.join(names)})")
        self.arg_names = [names[i] if i < len(names) and params[names[i]].kind != inspect.Parameter.VAR_POSITIONAL
                          else f"arg{i}" for i in range(len(inputs))]
        self.state_names = []
        for key in model.state_dict():
            self.state_names.append(key if key not in self.arg_names else f"model.{key}")
        self._state_keys = dict(zip(self.state_names, model.state_dict()))
        state = model.state_dict()
        self.buffer_names = [n for n, k in self._state_keys.items() if k not in dict(model.named_parameters())]
        self.input_names = (*self.arg_names, *self.state_names)
        values = [*inputs, *(state[k] for k in self._state_keys.values())]
        self.nondiff = tuple(n for n, v in zip(self.input_names, values)
                             if not v.is_floating_point() or n in self.buffer_names)
        out = self._main_out
        self.floating_out = out.is_floating_point()
        self.x_name = cfg.op.x_name or ("batch_size" if "batch_size" in self.sizes else
                                        max(self.sizes, key=lambda k: self.sizes[k] if isinstance(self.sizes[k], int)
                                            else -1, default=None))
        if self.x_name not in self.sizes or not isinstance(self.sizes.get(self.x_name), int):
            ints = [k for k, v in self.sizes.items() if isinstance(v, int)]
            raise _bad(problem.shown, f"op.x_name={self.x_name!r}: the curve runs over an int size constant of the "
                                      f"file: valid choices are {', '.join(ints) or 'none (it has none)'}")
        self._init: dict[tuple, list] = {}
        self._by_shapes: dict[tuple, tuple] = {}
        self._models: dict[str, torch.nn.Module] = {}
        self._costs: dict[tuple, Any] = {}
        self.main_init = init

    def _checked_main(self) -> tuple[list, Any, list]:
        p = self.problem
        init, model, inputs = p.evaluate(self.sizes, 0)
        bad = [f"#{i} is a {type(x).__name__}" for i, x in enumerate(inputs) if not isinstance(x, torch.Tensor)]
        if bad:
            raise _bad(p.shown, f"get_inputs() must return tensors: {', '.join(bad)}")
        for value in init:
            if isinstance(value, torch.Tensor):
                raise _bad(p.shown, "get_init_inputs() returns a tensor: the lab hands init inputs to a worker "
                                    "as plain values (ints, floats, strings, tuples)")
        out = p._step("Model's forward on get_inputs()", lambda: _no_grad(model, inputs))
        if not isinstance(out, torch.Tensor):
            what = (f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else
                    f"a {type(out).__name__}")
            raise _bad(p.shown, f"Model's forward returns {what}, not a tensor: the lab checks one output tensor")
        self._main_out = out
        return init, model, inputs

    # -- inputs ---------------------------------------------------------------------------------------------------

    def init_inputs(self, dims: dict[str, Any]) -> list:
        key = tuple(sorted(dims.items()))
        if key not in self._init:
            self._init[key] = self.problem.evaluate(dims, 0)[0]
        return self._init[key]

    def make_inputs(self, case: Case, dtype: torch.dtype, device: str) -> Tensors:
        """The case's inputs: the file's draws (get_inputs, the Model's init) under the case's seed; a lab
        kind replaces the floating inputs by seeded N(0, 1) draws at its scale and draws the floating
        parameters afresh (_fresh)."""
        dims = {k: (tuple(v) if isinstance(v, list) else v) for k, v in case.dims.items()}
        _, model, inputs = self.problem.evaluate(dims, case.seed)
        state = model.state_dict()
        values = {**dict(zip(self.arg_names, inputs)),
                  **{n: state[k].detach().clone() for n, k in self._state_keys.items()}}
        if case.inputs != FILE_KIND:
            if case.inputs not in SCALES:
                raise ValueError(f"unknown problem input kind {case.inputs!r}: valid are {FILE_KIND}, "
                                 f"{', '.join(INPUT_KINDS)}")
            gen = torch.Generator().manual_seed(case.seed * 7919 + INPUT_KINDS.index(case.inputs) + 1)
            first = True
            for name in self.arg_names:
                x = values[name]
                if x.is_floating_point():
                    values[name] = (torch.randn(x.shape, generator=gen) * SCALES[case.inputs]).to(x.dtype)
                    if case.inputs == "zero_row" and first and x.dim() >= 1:
                        values[name][0] = 0
                    first = False
            for name in self.state_names:
                if name not in self.buffer_names and values[name].is_floating_point():
                    values[name] = _fresh(values[name], gen)
        out = {n: (x.to(dtype) if x.is_floating_point() else x).to(device) for n, x in values.items()}
        self._by_shapes[self._shape_key(out)] = tuple(sorted(dims.items()))
        return out

    @staticmethod
    def _shape_key(x: Tensors) -> tuple:
        return tuple((n, tuple(t.shape)) for n, t in x.items())

    def init_for(self, x: Tensors) -> list:
        """The init inputs of the sizes that drew inputs of x's shapes (the point's when none did)."""
        dims = self._by_shapes.get(self._shape_key(x))
        return self.init_inputs(dict(dims)) if dims is not None else self.main_init

    def model_for(self, x: Tensors) -> torch.nn.Module:
        init = self.init_for(x)
        key = repr(init)
        if key not in self._models:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                self._models[key] = self.problem.model(*init)
        return self._models[key]

    def call(self, model: torch.nn.Module, x: Tensors) -> torch.Tensor:
        state = {k: x[n] for n, k in self._state_keys.items()}
        return torch.func.functional_call(model, state, tuple(x[n] for n in self.arg_names))

    def reference_fn(self) -> Callable[[Tensors, LabConfig], Tensors]:
        """The reference as a plain function (the compiled peer copies its code object: no bound method)."""
        made = self

        def reference(x: Tensors, cfg: Any) -> Tensors:
            return {"out": made.call(made.model_for(x), x)}

        return reference

    # -- cases, costs -----------------------------------------------------------------------------------------------

    def case(self, dims: dict[str, Any], seed: int, main: bool, kind: str) -> Case:
        from posttrainllm.ops.base import Case

        name = f"file-seed{seed}" if kind == FILE_KIND else f"lab-{kind}"
        if dims != self.sizes:
            name = f"{self.x_name}{dims[self.x_name]}-{name}"
        return Case(name, seed, dict(dims), main, kind)

    def cases(self, cfg: LabConfig) -> list[Case]:
        out = [self.case(self.sizes, seed, i == 0, FILE_KIND) for i, seed in enumerate(cfg.parity.seeds)]
        out += [self.case(self.sizes, cfg.parity.seeds[0], False, kind) for kind in cfg.op.input_kinds]
        return out

    def describe_case(self, case: Case) -> str:
        sizes = " ".join(f"{k}={v}" for k, v in case.dims.items())
        origin = "the file's get_inputs and init" if case.inputs == FILE_KIND else \
            f"the lab's {case.inputs} inputs and fresh parameters"
        return f"{self.problem.shown} {sizes} ({origin})"

    def costs(self, case: Case, cfg: LabConfig) -> Any:
        from torch.utils.flop_counter import FlopCounterMode

        from posttrainllm.ops.base import Costs

        key = (tuple(sorted(case.dims.items())), cfg.precision.dtype)
        if key not in self._costs:
            x = self.make_inputs(self.case(case.dims, self.seeds[0], True, FILE_KIND), torch.float32, "cpu")
            model = self.model_for(x)
            with FlopCounterMode(display=False) as forward:
                out = self.call(model, x)
            leaves = {n: t.detach().requires_grad_(t.is_floating_point() and n not in self.nondiff)
                      for n, t in x.items()}
            train = None
            if self.floating_out and any(t.requires_grad for t in leaves.values()):
                with FlopCounterMode(display=False) as both:
                    y = self.call(model, leaves)
                    if y.requires_grad:
                        y.backward(torch.ones_like(y))
                train = both.get_total_flops()
            counted = forward.get_total_flops()
            flops = counted or max(out.numel(), 1)  # the roofline needs FLOPs > 0: a floor, said so
            multiple = (train - counted) / counted if counted and train is not None else 2.0
            size = itemsize(cfg.precision.dtype)
            nbytes = sum(t.numel() * (size if t.is_floating_point() else t.element_size())
                         for t in [*x.values(), out])
            self._costs[key] = Costs(int(flops), int(nbytes), float(multiple),
                                     rules.text("problem_flops") + ("" if counted else "; it counted 0 here: 1 FLOP "
                                                                    "per output element, a floor"),
                                     rules.text("problem_bytes"),
                                     "backward: FlopCounterMode over forward + backward, less the forward"
                                     if counted and train is not None else
                                     "backward: 2 x forward, assumed (FlopCounterMode counted no forward FLOPs)")
        return self._costs[key]

    def reference_bytes(self, case: Case, cfg: LabConfig) -> int:
        """The float64 oracle through autograd: ~16 float64 copies of one call's inputs, parameters and output."""
        return 16 * 2 * _footprint_cached(self, case)

    def curve_sizes(self, cfg: LabConfig) -> list[int]:
        top = self.sizes[self.x_name]
        return sorted({max(1, top // 4), max(1, top // 2), top})

    def curve_case(self, cfg: LabConfig, x: int) -> Case:
        return self.case({**self.sizes, self.x_name: x}, cfg.parity.seeds[0], True, FILE_KIND)

    # -- user paths -------------------------------------------------------------------------------------------------

    def adapt(self, fn: Callable[..., Any]) -> Callable[[Tensors, LabConfig], Tensors]:
        """A ModelNew in its worker: the forward's arguments, then Model's parameters and buffers by name."""
        state_keys = [self._state_keys[n] for n in self.state_names]

        def path(x: Tensors, cfg: LabConfig) -> Tensors:
            tensors = [x[n] for n in self.arg_names] + [x[n] for n in self.state_names]
            return {"out": fn(*tensors, init_inputs=list(self.init_for(x)), state_names=state_keys)}

        path.__name__ = getattr(fn, "__name__", "user")
        return path

    def check_user(self, user: Any) -> None:
        """A user path of this op is a class (ModelNew) whose __init__ takes what get_init_inputs gives and
        whose forward takes what get_inputs gives: read from its file, never run (lab/isolation/user.py)."""
        file = user.identity.get("file") or user.file
        tree = ast.parse(Path(user.file).read_text(), filename=str(user.file))
        attr = user.attr.split(".")[-1]
        found = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == attr), None)
        spec = user.identity["spec"]
        if found is None:
            raise ConfigError(f"op.user_impls: {spec!r}: {attr} in {file} is not a class: a problem's user path is "
                              "a class such as ModelNew(nn.Module), built with get_init_inputs() and called with "
                              "get_inputs()")
        for method, given, what in (("__init__", len(self.main_init), "get_init_inputs()"),
                                    ("forward", len(self.arg_names), "get_inputs()")):
            fn = next((n for n in found.body if isinstance(n, ast.FunctionDef) and n.name == method), None)
            if fn is None:
                if method == "forward":
                    raise ConfigError(f"op.user_impls: {spec!r}: {attr} in {file} has no forward")
                continue
            args = fn.args
            positional = [a.arg for a in [*args.posonlyargs, *args.args]][1:]
            required = len(positional) - len(args.defaults)
            if args.vararg is None and not required <= given <= len(positional):
                want = list(inspect.signature(getattr(self.problem.model, method)).parameters)
                raise ConfigError(f"op.user_impls: {spec!r}: {attr}.{method}({', '.join(positional)}) in {file} "
                                  f"does not take the {given} argument(s) {what} gives (Model.{method} takes "
                                  f"{', '.join(n for n in want if n != 'self') or 'none'})")


_FOOTPRINTS: dict[tuple, int] = {}


def _footprint_cached(op: ProblemOp, case: Case) -> int:
    key = (op.problem.sha256, tuple(sorted(case.dims.items())))
    if key not in _FOOTPRINTS:
        try:
            _FOOTPRINTS[key] = _footprint(op.problem, dict(case.dims), "meta")
        except Exception:
            _FOOTPRINTS[key] = _footprint(op.problem, dict(case.dims), None)
    return _FOOTPRINTS[key]


def template(problem: Problem) -> str:
    """A ModelNew to start from: the file's imports and helpers, and its Model's class renamed ModelNew (the
    readable math, correct as it is: the lab's parity passes it)."""
    source = problem.path.read_text()
    imports, defs = [], []
    for node in problem.tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)) and \
                getattr(node, "name", None) not in ("get_inputs", "get_init_inputs"):
            text = ast.get_source_segment(source, node).replace("{", "{{").replace("}", "}}")
            if getattr(node, "name", None) == "Model":
                text = text.replace("class Model(", "class {name}(", 1).replace("super(Model, self)",
                                                                                   "super({name}, self)")
            (imports if isinstance(node, (ast.Import, ast.ImportFrom)) else defs).append(text)
    return "\n" + "\n".join(imports) + "\n\n\n" + "\n\n\n".join(defs) + "\n"


_BUILT: dict[tuple, "OpDef"] = {}


def problem_op(cfg: LabConfig) -> OpDef:
    """The OpDef of op.file at this point (cached per file content, sizes, seeds, input kinds and device)."""
    from posttrainllm.ops.base import REFERENCE, Impl, OpDef
    from posttrainllm.ops.peers import compiled

    if not cfg.op.file:
        raise ConfigError("op=problem needs op.file=PATH: a problem file in KernelBench's format (Model, get_inputs, "
                          "get_init_inputs; see docs/bring-your-own-op.md)")
    path = Path(cfg.op.file).expanduser()
    stat = path.stat() if path.is_file() else None
    key = (str(path.resolve()), stat and (stat.st_mtime_ns, stat.st_size), tuple(sorted(cfg.op.sizes.items())),
           cfg.op.x_name, tuple(cfg.parity.seeds), tuple(cfg.op.input_kinds), cfg.op.budget_mib, _on_cpu(cfg))
    if key in _BUILT:
        return _BUILT[key]
    for kind in cfg.op.input_kinds:
        if kind not in INPUT_KINDS:
            raise ConfigError(f"op.input_kinds: unknown kind {kind!r}: valid choices are {', '.join(INPUT_KINDS)}")
    problem = load_file(cfg.op.file)
    choose_sizes(problem, cfg, _on_cpu(cfg))
    made = ProblemOp(problem, cfg)
    backward = "own" if made.floating_out and len(made.nondiff) < len(made.input_names) else "none"
    reference_fn = made.reference_fn()
    reference = Impl(REFERENCE, "reference", reference_fn, backward=backward, train_refusal=NO_MODEL,
                     backend=f"Model of {problem.shown} (torch.func.functional_call; float64: the oracle)")
    sizes_line = " ".join(f"{k}={v}" for k, v in made.sizes.items())

    op = OpDef(
        name=NAME, x_name=made.x_name, input_names=made.input_names, impls={REFERENCE: reference},
        cases=made.cases, make_inputs=made.make_inputs, problem=made.describe_case, costs=made.costs,
        curve_case=made.curve_case, model_hook=None,
        model_problem=lambda cfg: "none: " + NO_MODEL, check_config=lambda cfg: None,
        row_ndim={"out": 1}, reference_bytes=made.reference_bytes, nondiff_inputs=made.nondiff,
        curve_sizes=made.curve_sizes,
        optional_peers={"compiled": compiled(f"{NAME}-{problem.sha256[:12]}-{sizes_line}", reference_fn,
                                             made.make_inputs, f"Model of {problem.shown}")},
        signature=(f"class ModelNew(nn.Module): __init__(*get_init_inputs()), forward(*get_inputs()) -> one tensor, "
                   f"as Model of {problem.shown}; given Model's parameters and buffers where the names match"),
        adapt=made.adapt, template=template(problem), describe=lambda case, x, cfg, measure=None: record(made),
        user_call="module", check_user=made.check_user, no_model=NO_MODEL, template_name="ModelNew",
    )
    op.problem_file = made  # what the receipt's problem record reads (record)
    _BUILT[key] = op
    return op


def record(made: ProblemOp) -> dict[str, Any]:
    """What a point records of its problem file: where, which sizes and why, what came from the file."""
    p = made.problem
    return {"file": p.shown, "sha256": p.sha256, "sizes_written": {k: v for k, v in p.written.items()},
            "sizes_used": made.sizes, "sizes_how": p.how, "x_name": made.x_name,
            "inputs": list(made.arg_names), "parameters_and_buffers": list(made.state_names),
            "cases_from_file": [f"file-seed{s}" for s in made.seeds],
            "cases_from_lab": [f"lab-{k}" for k in made.kinds],
            "rows_rule": rules.cite("problem_rows"), "flops_rule": rules.cite("problem_flops"),
            "bytes_rule": rules.cite("problem_bytes")}
