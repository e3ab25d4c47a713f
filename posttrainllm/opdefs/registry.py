"""The implementations ("paths") of each op, the cases they run on, and their inputs.

Every op has the readable reference (posttrainllm.ops.reference) and its optimized
twins with the same inputs and outputs: PyTorch's own fast path (the peer a user
would otherwise pick) and our Triton kernel. One registry, so a stage or a test
flips between them by name.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from posttrainllm.ops import reference
from posttrainllm.config import LabConfig

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Case:
    """One parity case: a problem size and a seed. `main` marks the point's own shape (the timed one)."""

    name: str
    seed: int
    dims: dict[str, int]
    main: bool


@dataclass(frozen=True)
class Impl:
    """One implementation of an op.

    run: the forward outputs to check ("out", and "lse" where the path has one).
    differentiable: the op as an autograd-able function of the inputs, for gradient parity.
    """

    name: str
    kind: str  # reference | torch | triton
    run: Callable[[Tensors, LabConfig], Tensors]
    geometry: Callable[[Case, LabConfig], dict[str, Any]]
    differentiable: Callable[[Tensors, LabConfig], torch.Tensor]


def gradients(impl: Impl, inputs: Tensors, grad_out: torch.Tensor, cfg: LabConfig) -> Tensors:
    """d(out · grad_out)/d(input) for every input: "grad_q", "grad_k", ... (the backward pass to check)."""
    leaves = {name: x.detach().requires_grad_() for name, x in inputs.items()}
    out = impl.differentiable(leaves, cfg)
    grads = torch.autograd.grad(out, list(leaves.values()), grad_out)
    return {f"grad_{name}": g for name, g in zip(leaves, grads)}


def upstream_gradient(case: Case, out: torch.Tensor) -> torch.Tensor:
    """The dO fed to every backward of a case: standard normal from the case's seed, in out's dtype."""
    gen = torch.Generator().manual_seed(case.seed + 1_000_003)
    return torch.randn(out.shape, generator=gen, dtype=torch.float32).to(device=out.device, dtype=out.dtype)


def cases(cfg: LabConfig) -> list[Case]:
    """The point's shape, then edge shapes (off every tile, the causal boundary), once per seed."""
    shape, arch = cfg.shape, cfg.architecture
    out = []
    for seed in cfg.parity.seeds:
        if cfg.op.name == "attention":
            heads = dict(batch=shape.batch, heads=arch.n_heads, kv_heads=arch.n_kv_heads, head_dim=arch.head_dim)
            out.append(Case(f"S{shape.seq_len}-seed{seed}", seed, {**heads, "seq_len": shape.seq_len}, True))
            for s in shape.edge_seq_lens:
                out.append(Case(f"S{s}-seed{seed}", seed, {**heads, "batch": 1, "seq_len": s}, False))
        else:
            out.append(Case(f"{shape.m}x{shape.n}x{shape.k}-seed{seed}", seed,
                            dict(m=shape.m, n=shape.n, k=shape.k), True))
            for m, n, k in shape.edge_mnk:
                out.append(Case(f"{m}x{n}x{k}-seed{seed}", seed, dict(m=m, n=n, k=k), False))
    return out


def make_inputs(case: Case, op: str, dtype: torch.dtype, device: str) -> Tensors:
    """Standard-normal inputs drawn in fp32 from the case's seed, then cast to the point's dtype."""
    gen = torch.Generator().manual_seed(case.seed)
    d = case.dims

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    if op == "attention":
        q = randn(d["batch"], d["heads"], d["seq_len"], d["head_dim"])  # (B, H, S, D)
        k = randn(d["batch"], d["kv_heads"], d["seq_len"], d["head_dim"])  # (B, Hkv, S, D)
        v = randn(d["batch"], d["kv_heads"], d["seq_len"], d["head_dim"])  # (B, Hkv, S, D)
        return {"q": q, "k": k, "v": v}
    return {"a": randn(d["m"], d["k"]), "b": randn(d["k"], d["n"])}


def precision_context(cfg: LabConfig) -> contextlib.AbstractContextManager[None]:
    """TF32 for torch's own CUDA matmuls only when the point's precision asks for it."""
    from posttrainllm.measure.device import fp32_matmuls

    return fp32_matmuls(tf32=cfg.precision.allow_tf32)


# --- attention -------------------------------------------------------------------------


def _attention_reference(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": _attention_reference_out(x, cfg),
            "lse": reference.attention_logsumexp(x["q"], x["k"], causal=cfg.op.causal)}


def _attention_reference_out(x: Tensors, cfg: LabConfig) -> torch.Tensor:
    return reference.attention(x["q"], x["k"], x["v"], causal=cfg.op.causal)


def _attention_sdpa_out(x: Tensors, cfg: LabConfig) -> torch.Tensor:
    return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=cfg.op.causal,
                                          enable_gqa=x["k"].shape[1] != x["q"].shape[1])


def _attention_sdpa(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": _attention_sdpa_out(x, cfg)}


def _attention_triton(x: Tensors, cfg: LabConfig) -> Tensors:
    from posttrainllm.ops.attention import triton_attention

    out, lse = triton_attention(x["q"], x["k"], x["v"], causal=cfg.op.causal, sm_scale=None,
                                block_q=cfg.tile.block_q, block_kv=cfg.tile.block_kv,
                                num_warps=cfg.workgroup.num_warps, num_stages=cfg.workgroup.num_stages,
                                input_precision=cfg.precision.dot_precision)
    return {"out": out, "lse": lse}


def _attention_triton_out(x: Tensors, cfg: LabConfig) -> torch.Tensor:
    from posttrainllm.ops.attention import flash_attention

    return flash_attention(x["q"], x["k"], x["v"], causal=cfg.op.causal, block_q=cfg.tile.block_q,
                           block_kv=cfg.tile.block_kv, num_warps=cfg.workgroup.num_warps,
                           num_stages=cfg.workgroup.num_stages, input_precision=cfg.precision.dot_precision)


def _attention_triton_geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
    from posttrainllm.ops.attention import attention_launch

    from posttrainllm.ops.attention import attention_backward_launch

    d, t, w = case.dims, cfg.tile, cfg.workgroup
    forward = attention_launch(d["batch"], d["heads"], d["seq_len"], d["head_dim"], block_q=t.block_q,
                               block_kv=t.block_kv, num_warps=w.num_warps, num_stages=w.num_stages)
    backward = attention_backward_launch(d["batch"], d["heads"], d["kv_heads"], d["seq_len"], d["head_dim"],
                                         block_q=t.block_q, block_kv=t.block_kv, num_warps=w.num_warps,
                                         num_stages=w.num_stages)
    return {**forward, "backward": backward}


# --- matmul ----------------------------------------------------------------------------


def _matmul_reference_out(x: Tensors, cfg: LabConfig) -> torch.Tensor:
    return reference.matmul(x["a"], x["b"])


def _matmul_torch_out(x: Tensors, cfg: LabConfig) -> torch.Tensor:
    return torch.matmul(x["a"], x["b"])


def _matmul_triton_out(x: Tensors, cfg: LabConfig) -> torch.Tensor:
    from posttrainllm.ops.matmul import matmul

    t, w = cfg.tile, cfg.workgroup
    return matmul(x["a"], x["b"], block_m=t.block_m, block_n=t.block_n, block_k=t.block_k, group_m=w.group_m,
                  num_warps=w.num_warps, num_stages=w.num_stages, input_precision=cfg.precision.dot_precision)


def _matmul_reference(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": _matmul_reference_out(x, cfg)}


def _matmul_torch(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": _matmul_torch_out(x, cfg)}


def _matmul_triton(x: Tensors, cfg: LabConfig) -> Tensors:
    from posttrainllm.ops.matmul import triton_matmul

    t, w = cfg.tile, cfg.workgroup
    out = triton_matmul(x["a"], x["b"], block_m=t.block_m, block_n=t.block_n, block_k=t.block_k, group_m=w.group_m,
                        num_warps=w.num_warps, num_stages=w.num_stages, input_precision=cfg.precision.dot_precision)
    return {"out": out}


def _matmul_triton_geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
    from posttrainllm.ops.matmul import matmul_launch

    t, w, d = cfg.tile, cfg.workgroup, case.dims
    return matmul_launch(d["m"], d["n"], d["k"], block_m=t.block_m, block_n=t.block_n, block_k=t.block_k,
                         group_m=w.group_m, num_warps=w.num_warps, num_stages=w.num_stages)


def _backend(name: str) -> Callable[[Case, LabConfig], dict[str, Any]]:
    return lambda case, cfg: {"backend": name}


REFERENCE = "reference"
IMPLS: dict[str, dict[str, Impl]] = {
    "attention": {
        REFERENCE: Impl(REFERENCE, "reference", _attention_reference, _backend("posttrainllm.reference.attention"),
                        _attention_reference_out),
        "sdpa": Impl("sdpa", "torch", _attention_sdpa, _backend("torch.nn.functional.scaled_dot_product_attention"),
                     _attention_sdpa_out),
        "triton": Impl("triton", "triton", _attention_triton, _attention_triton_geometry, _attention_triton_out),
    },
    "matmul": {
        REFERENCE: Impl(REFERENCE, "reference", _matmul_reference, _backend("posttrainllm.reference.matmul"),
                        _matmul_reference_out),
        "torch": Impl("torch", "torch", _matmul_torch, _backend("torch.matmul"), _matmul_torch_out),
        "triton": Impl("triton", "triton", _matmul_triton, _matmul_triton_geometry, _matmul_triton_out),
    },
}


def optimized(op: str) -> list[Impl]:
    """The paths checked against the reference (everything but the reference itself)."""
    return [impl for name, impl in IMPLS[op].items() if name != REFERENCE]


def problem_dims(case: Case, op: str) -> str:
    d = case.dims
    if op == "attention":
        return f"B={d['batch']} H={d['heads']} Hkv={d['kv_heads']} S={d['seq_len']} D={d['head_dim']}"
    return f"M={d['m']} N={d['n']} K={d['k']}"

