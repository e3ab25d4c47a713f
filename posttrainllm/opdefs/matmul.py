"""Matmul as a lab op: C = A @ B, A (M, K), B (K, N) -> C (M, N).

Paths (one function each: checked, timed and trained as every projection of the model):
    reference   posttrainllm.ops.reference.matmul: a @ b
    torch       torch.matmul (BLAS on CPU, cuBLAS on CUDA): on CPU the same call as the reference,
                so their curves must agree within noise (a useful null check of the timer)
    triton      posttrainllm.ops.matmul: our tiled, GROUP_M-swizzled kernel, forward and backward
    compiled    (opt-in, op.peers) the reference under torch.compile
    user paths  op.user_impls, in the natural signature SIGNATURE (opdefs/user.py)
"""

from __future__ import annotations

from typing import Any

import torch

from posttrainllm.config import ConfigError, LabConfig, itemsize, next_power_of_two
from posttrainllm.opdefs.base import REFERENCE, Case, Costs, Impl, ModelHooks, OpDef, Tensors, seeded_randn
from posttrainllm.opdefs.peers import compiled
from posttrainllm.ops import reference


def _reference(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": reference.matmul(x["a"], x["b"])}


def _torch(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": torch.matmul(x["a"], x["b"])}


def _autotune(cfg: LabConfig) -> str | None:
    """tile=auto tunes blocks, warps and stages jointly; workgroup=auto warps and stages alone."""
    return "tile" if cfg.tile.autotune else "workgroup" if cfg.workgroup.autotune else None


def _triton(x: Tensors, cfg: LabConfig) -> Tensors:
    from posttrainllm.ops.matmul import matmul

    t, w = cfg.tile, cfg.workgroup
    return {"out": matmul(x["a"], x["b"], block_m=t.block_m, block_n=t.block_n, block_k=t.block_k,
                          group_m=w.group_m, num_warps=w.num_warps, num_stages=w.num_stages,
                          input_precision=cfg.precision.dot_precision, autotune=_autotune(cfg))}


def _triton_geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
    """The launch geometry; with tile/workgroup=auto, what the autotuner chose for the forward (CUDA: the
    path runs once on the case's inputs), or that the fixed configuration ran (elsewhere)."""
    from posttrainllm.ops.attention import AUTO_CPU_NOTE
    from posttrainllm.ops.matmul import LAST_AUTOTUNE, matmul_launch

    t, w, d = cfg.tile, cfg.workgroup, case.dims
    geometry = matmul_launch(d["m"], d["n"], d["k"], block_m=t.block_m, block_n=t.block_n, block_k=t.block_k,
                             group_m=w.group_m, num_warps=w.num_warps, num_stages=w.num_stages)
    mode = _autotune(cfg)
    if mode is None:
        return geometry
    on_cuda = cfg.device.name == "cuda" or (cfg.device.name == "auto" and torch.cuda.is_available())
    if not on_cuda:
        return {**geometry, "autotune": {"mode": mode, "chosen": None, "note": AUTO_CPU_NOTE}}
    LAST_AUTOTUNE.clear()
    with torch.no_grad():
        _triton(_make_inputs(case, getattr(torch, cfg.precision.dtype), "cuda"), cfg)
    return {**geometry, "autotune": {"mode": mode, "chosen": dict(LAST_AUTOTUNE),
                                     "note": "chosen by triton.autotune on this device (smem-pruned)"}}


IMPLS = {
    REFERENCE: Impl(REFERENCE, "reference", _reference, backend="posttrainllm.ops.reference.matmul"),
    "torch": Impl("torch", "peer", _torch, backend="torch.matmul"),
    "triton": Impl("triton", "triton", _triton, geometry=_triton_geometry, backend="posttrainllm.ops.matmul.matmul",
                   kernels={"forward": ("_matmul_kernel",), "backward": ("_matmul_kernel",)}),
}


def _cases(cfg: LabConfig) -> list[Case]:
    """The point's shape, then sizes off every block (and 1x1x1), once per seed."""
    shape = cfg.shape
    out = []
    for seed in cfg.parity.seeds:
        out.append(Case(f"{shape.m}x{shape.n}x{shape.k}-seed{seed}", seed, dict(m=shape.m, n=shape.n, k=shape.k),
                        True))
        out += [Case(f"{m}x{n}x{k}-seed{seed}", seed, dict(m=m, n=n, k=k), False) for m, n, k in shape.edge_mnk]
    return out


def _make_inputs(case: Case, dtype: torch.dtype, device: str) -> Tensors:
    """Standard-normal A and B drawn in fp32 from the case's seed, cast to the point's dtype."""
    randn, d = seeded_randn(case.seed, dtype, device), case.dims
    return {"a": randn(d["m"], d["k"]), "b": randn(d["k"], d["n"])}


def _problem(case: Case) -> str:
    d = case.dims
    return f"M={d['m']} N={d['n']} K={d['k']}"


def _costs(case: Case, cfg: LabConfig) -> Costs:
    """(M, K) @ (K, N): M·N dot products of length K -> 2·M·N·K FLOPs. Backward: dA = dC Bᵀ and
    dB = Aᵀ dC, each 2·M·N·K -> 2x the forward. Bytes: read A and B, write C, once each."""
    d, size = case.dims, itemsize(cfg.precision.dtype)
    return Costs(2 * d["m"] * d["n"] * d["k"], (d["m"] * d["k"] + d["k"] * d["n"] + d["m"] * d["n"]) * size, 2.0,
                 "2*M*N*K", "(M*K + K*N + M*N)*itemsize", "backward = 2 x forward (dA and dB, 2*M*N*K each)")


def _curve_case(cfg: LabConfig, x: int) -> Case:
    seed = cfg.parity.seeds[0]
    return Case(f"{x}x{x}x{x}-seed{seed}", seed, dict(m=x, n=x, k=x), True)


def _model_hooks(impl: Impl, cfg: LabConfig) -> ModelHooks:
    """Every projection x @ Wᵀ of the model runs `impl.fn` on (rows of x, Wᵀ).

    Autocast does not reach a custom autograd.Function, so 16-bit autocast casts both operands
    here, as F.linear under autocast would."""

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
        rows = x.reshape(-1, x.shape[-1])  # (N, in)
        out = impl.fn({"a": rows, "b": weight.t()}, cfg)["out"]  # (N, in) @ (in, out) -> (N, out)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    return ModelHooks(linear=linear)


def _model_problem(cfg: LabConfig) -> str:
    arch, train = cfg.architecture, cfg.train
    return f"M={train.batch_size * train.seq_len} N={arch.mlp_hidden} K={arch.d_model} (MLP up)"


def _check_config(cfg: LabConfig) -> None:
    """A block larger than its dimension, or A and B tiles per pipeline stage over the shared memory, is refused.

    Shared memory per program: (BLOCK_M·BLOCK_K + BLOCK_K·BLOCK_N) · itemsize · num_stages.
    """
    tile, shape = cfg.tile, cfg.shape
    for block, dim in (("block_m", "m"), ("block_n", "n"), ("block_k", "k")):
        bound = max(16, next_power_of_two(getattr(shape, dim)))
        if getattr(tile, block) > bound:
            raise ConfigError(f"tile.{block}={getattr(tile, block)} does not fit shape.{dim}={getattr(shape, dim)}: "
                              f"use a block <= {bound}")
    smem = (tile.block_m * tile.block_k + tile.block_k * tile.block_n) * itemsize(cfg.precision.dtype) \
        * cfg.workgroup.num_stages
    if smem > cfg.device.smem_bytes:
        raise ConfigError(f"tile {tile.name} with num_stages={cfg.workgroup.num_stages} needs {smem} B of shared "
                          f"memory per program, over device.smem_bytes={cfg.device.smem_bytes}")


def _reference_bytes(case: Case, cfg: LabConfig) -> int:
    """A, B, C and both gradients, in float64 and in the point's precision: ~4 copies of each."""
    d = case.dims
    return 4 * (d["m"] * d["k"] + d["k"] * d["n"] + d["m"] * d["n"]) * 8 * 2


SIGNATURE = "fn(a, b) -> c; a (M, K), b (K, N), c (M, N) in a's dtype"

TEMPLATE = '''
import torch


def {name}(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """C = A @ B.   a: (M, K), b: (K, N) -> (M, N) in a's dtype.

    The lab checks it against float64 math, per element and per row of C, forward and both gradients
    (autograd through this function, or your own torch.autograd.Function); no autograd history: forward-only.
    """
    return (a.float() @ b.float()).to(a.dtype)  # fp32 accumulation, as a tensor-core GEMM does
'''


def _adapt(fn: Any) -> Any:
    def path(x: Tensors, cfg: LabConfig) -> Tensors:
        return {"out": fn(x["a"], x["b"])}

    path.__name__ = getattr(fn, "__name__", "user")
    return path


OP = OpDef(
    name="matmul", x_name="size", input_names=("a", "b"), impls=IMPLS, cases=_cases, make_inputs=_make_inputs,
    problem=_problem, costs=_costs, curve_case=_curve_case, model_hooks=_model_hooks, model_problem=_model_problem,
    profiled_range="matmul", check_config=_check_config, reference_bytes=_reference_bytes,
    curve_sizes=lambda cfg: list(cfg.shape.matmul_curve or cfg.shape.curve),
    optional_peers={"compiled": compiled("matmul", _reference, _make_inputs, "posttrainllm.ops.reference.matmul")},
    signature=SIGNATURE, adapt=_adapt, template=TEMPLATE,
)
