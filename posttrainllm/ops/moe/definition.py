"""Routed experts (MoE) as a lab op: out = Σ_k route_weight · SwiGLU_expert(x), top-k of E experts per token.

Paths (one function each: checked, timed and trained as the experts of an MoE MLP):
    reference   posttrainllm.ops.moe.reference.moe_dense: every expert on every token, combined by a
                (T, E) gate that is zero for unchosen experts (E x the active FLOPs: the dense baseline)
    sparse      posttrainllm.ops.moe.reference.moe_sparse: per expert, gather its tokens, run it, scatter-add
    grouped_mm  torch.nn.functional.grouped_mm: tokens sorted by expert, one grouped GEMM per projection
    triton      posttrainllm.ops.moe.kernels: our grouped GEMM (gate+up with the SwiGLU epilogue, down with the
                routing weight, un-permute), forward and backward
    compiled    (opt-in, op.peers) the reference under torch.compile
    user paths  op.user_impls, in the natural signature SIGNATURE (lab/isolation/user.py)

The routing is an input, not part of the paths: the reference stage computes it once per case with
the reference router in fp32 (logits = x·W_r, softmax, top-k, renormalised over the k, ties to the
lower expert index) and every path runs on that same routing, so a near-tie flipped by low
precision can neither hide nor fake an expert bug. The router itself is checked apart
(`_router_check`, in parity.json's "inputs"): its fp32 expert ids must equal the float64 router's
exactly, and its fp32 weights must meet the fp32-level contract (precision.lse_contract).

Under a quantized precision (precision=fp8, fp8_rowwise: precision.quantize) the expert GEMMs run in fp8, forward
only (the recipe: posttrainllm/ops/moe/reference.py fp8_moe). make_inputs quantizes x and the three expert weights once
per case (x per tensor or per token; each expert's weights per expert or per output column) and every path gets
x, x_scale, w_gate, w_gate_scale, w_up, w_up_scale, w_down, w_down_scale and the routing (the router runs on the
unquantized x, as the model's does: the routing is the unquantized case's). h = silu(g)·u is quantized by each path
between its GEMMs (an intermediate):
    reference   posttrainllm.ops.moe.reference.fp8_moe: dequantize, then moe_dense with h quantized (float64: the oracle)
    triton      posttrainllm.ops.moe.fp8: e4m3 grouped GEMMs, scales and the routing weight in the epilogues
torch._scaled_grouped_mm (and F.scaled_grouped_mm) is probed and named absent (scaled_grouped_mm_refusal): it has
no CPU kernel, and on CUDA it takes rowwise scales only; no torch peer is wired yet. bench-train refuses the point
(lab/configure.py check_train_rules: the fp8 training recipe covers op=matmul's linear layers only).

Shapes: x (T, d); w_gate, w_up (E, d, f); w_down (E, f, d); route_weight (T, k) in the point's dtype;
route_idx (T, k) int64 (not differentiable) -> out (T, d).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F

from posttrainllm.config import ConfigError, LabConfig, itemsize
from posttrainllm.ops.base import (NO_BACKWARD, REFERENCE, BatchAxis, Case, Costs, CurveAxis, Impl, ModelHook, OpDef,
                                   Tensors, check_fp8_config, check_smem, seeded_randn)
from posttrainllm.ops.peers import compiled
from posttrainllm.ops.moe.config import Sizes
import posttrainllm.ops.moe.reference as moe_reference
import posttrainllm.ops.moe.costs as costs
from posttrainllm.ops import quantize

ROUTING_KINDS = ("one_expert", "empty_expert")
# torch >= 2.9: F.grouped_mm(mat_a, mat_b, *, offs=None, bias=None, out_dtype=None) over aten::_grouped_mm (same
# arguments; offs int32, the end row of each group). CUDA (torch 2.10/2.11, aten/native/cuda/GroupedBlas.cpp): a
# CUTLASS kernel when A, B and the output are bf16 on sm90/sm100 (rows of 16 bytes: _check_config), else a loop of
# mm over the groups (offs read on the host). Where it refuses the point's dtype or sizes it is probed out
# (grouped_mm_refusal) and named in microbench.json's describe.unavailable instead of failing the point.
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
GROUPED_MM_MISSING = "torch.nn.functional.grouped_mm is not in this PyTorch: no grouped_mm peer"
EXPERTS = ("x", "w_gate", "w_up", "w_down", "route_idx", "route_weight")


# --- the paths -------------------------------------------------------------------------


def _args(x: Tensors) -> list[torch.Tensor]:
    return [x[name] for name in EXPERTS]


def _reference(x: Tensors, cfg: LabConfig) -> Tensors:
    if "x_scale" in x:  # a quantized point's inputs: dequantize, then moe_dense with h quantized (float64 stays)
        return {"out": moe_reference.fp8_moe(*_fp8_args(x), out_dtype=getattr(torch, cfg.precision.dtype))}
    return {"out": moe_reference.moe_dense(*_args(x))}


def _sparse(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": moe_reference.moe_sparse(*_args(x))}


def _grouped_mm(x: Tensors, cfg: LabConfig) -> Tensors:
    """PyTorch's grouped GEMM: rows sorted by expert, `offs` the end row of each expert's group."""
    tokens, w_gate, w_up, w_down, route_idx, route_weight = _args(x)
    flat = route_idx.reshape(-1)  # (A,) A = T·k
    order = torch.sort(flat, stable=True).indices  # (A,) assignments grouped by expert
    offs = torch.cumsum(torch.bincount(flat, minlength=w_gate.shape[0]), 0).to(torch.int32)  # (E,)
    rows = tokens[order // route_idx.shape[1]]  # (A, d)
    h = F.silu(GROUPED_MM(rows, w_gate, offs=offs)) * GROUPED_MM(rows, w_up, offs=offs)  # (A, f)
    y = GROUPED_MM(h, w_down, offs=offs) * route_weight.reshape(-1)[order, None]  # (A, d)
    return {"out": torch.zeros_like(tokens).index_add(0, order // route_idx.shape[1], y)}  # (T, d)


_GROUPED_MM_PROBES: dict[tuple, str | None] = {}


def grouped_mm_refusal(cfg: LabConfig) -> str | None:
    """None if the grouped_mm path runs forward and backward on the point's device, dtype, d and f (a small
    problem: 8 tokens, top-2 of 3 experts, the last one empty), else why not."""
    if GROUPED_MM is None:
        return GROUPED_MM_MISSING
    device = cfg.device.name if cfg.device.name != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    sizes = Sizes.of(cfg)
    dtype, d, f = getattr(torch, cfg.precision.dtype), sizes.d_model, sizes.ffn
    key = (device, dtype, d, f)
    if key not in _GROUPED_MM_PROBES:
        if device == "cuda" and not torch.cuda.is_available():
            _GROUPED_MM_PROBES[key] = "no CUDA device"
        else:
            try:
                gen = torch.Generator().manual_seed(0)
                draw = lambda *size: torch.randn(*size, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
                x = {"x": draw(8, d), "w_gate": draw(3, d, f), "w_up": draw(3, d, f), "w_down": draw(3, f, d),
                     "route_weight": draw(8, 2).abs()}
                x = {name: t.requires_grad_() for name, t in x.items()}
                x["route_idx"] = torch.tensor([[0, 1], [1, 0]] * 4, device=device)  # expert 2: no token
                out = _grouped_mm(x, cfg)["out"]
                out.backward(torch.ones_like(out))
                _GROUPED_MM_PROBES[key] = None
            except Exception as exc:  # a refusal (dtype, alignment, device) is this path's absence, not a crash
                _GROUPED_MM_PROBES[key] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}" \
                    if str(exc).strip() else type(exc).__name__
    return _GROUPED_MM_PROBES[key]


def _impls_for(cfg: LabConfig) -> dict[str, Impl]:
    """The registry for this point: under fp8 the quantized paths (FP8_IMPLS), else IMPLS with grouped_mm only
    where it runs (grouped_mm_refusal)."""
    if cfg.precision.quantize is not None:
        return FP8_IMPLS
    return {name: impl for name, impl in IMPLS.items() if name != "grouped_mm" or grouped_mm_refusal(cfg) is None}


def _triton(x: Tensors, cfg: LabConfig) -> Tensors:
    from posttrainllm.ops.moe.kernels import moe

    t, w = cfg.tile, cfg.workgroup
    return {"out": moe(*_args(x), block_m=t.block_m, block_n=t.block_n, block_k=t.block_k, num_warps=w.num_warps,
                       num_stages=w.num_stages, input_precision=cfg.precision.dot_precision)}


def _triton_geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
    from posttrainllm.ops.moe.kernels import moe_launch

    d, t, w = case.dims, cfg.tile, cfg.workgroup
    return moe_launch(d["tokens"], d["d_model"], d["ffn"], d["experts"], d["top_k"], block_m=t.block_m,
                      block_n=t.block_n, block_k=t.block_k, num_warps=w.num_warps, num_stages=w.num_stages)


IMPLS = {
    REFERENCE: Impl(REFERENCE, "reference", _reference, backend="posttrainllm.ops.moe.reference.moe_dense",
                    cost_model="dense"),
    "sparse": Impl("sparse", "peer", _sparse, backend="posttrainllm.ops.moe.reference.moe_sparse (per-expert loop)",
                   cost_model="sparse"),
    **({"grouped_mm": Impl("grouped_mm", "peer", _grouped_mm, backend="torch.nn.functional.grouped_mm",
                           cost_model="grouped")}
       if GROUPED_MM is not None else {}),
    "triton": Impl("triton", "triton", _triton, geometry=_triton_geometry, backend="posttrainllm.ops.moe.moe",
                   cost_model="tiled",
                   kernels={"forward": ("_gate_up_kernel", "_down_kernel", "_unpermute_kernel"),
                            "backward": ("_down_backward_kernel", "_dx_rows_kernel", "_expert_grad_kernel")},
                   promises=("deterministic",)),  # no atomics: every sum in one order (lab/invariance.py checks)
}


# --- fp8 (precision.quantize): forward-only paths on x and expert weights quantized once per case -------------

FP8_INPUTS = ("x", "x_scale", "w_gate", "w_gate_scale", "w_up", "w_up_scale", "w_down", "w_down_scale", "route_idx",
              "route_weight")


def _fp8_args(x: Tensors) -> list[torch.Tensor]:
    return [x[name] for name in FP8_INPUTS]


def _fp8_triton(x: Tensors, cfg: LabConfig) -> Tensors:
    from posttrainllm.ops.moe.fp8 import fp8_moe

    t, w = cfg.tile, cfg.workgroup
    return {"out": fp8_moe(*_fp8_args(x), block_m=t.block_m, block_n=t.block_n, block_k=t.block_k,
                           num_warps=w.num_warps, num_stages=w.num_stages,
                           out_dtype=getattr(torch, cfg.precision.dtype))}


def _fp8_triton_geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
    launch = _triton_geometry(case, cfg)
    return {**launch, "backward": None, "recipe": case.quantize,
            "epilogues": "gate/up: acc * x_scale * w_scale, then SwiGLU, h in fp32; h -> e4m3 in PyTorch; down: "
                         "acc * h_scale * w_down_scale * route_weight, y in fp32; unpermute, then the output dtype"}


FP8_IMPLS = {
    REFERENCE: Impl(REFERENCE, "reference", _reference, backward=NO_BACKWARD,
                    backend="posttrainllm.ops.moe.reference.fp8_moe (dequantize, then moe_dense with h quantized)"),
    "triton": Impl("triton", "triton", _fp8_triton, geometry=_fp8_triton_geometry, backward=NO_BACKWARD,
                   backend="posttrainllm.ops.moe.fp8.fp8_moe", cost_model="fp8_tiled",
                   kernels={"forward": ("_fp8_gate_up_kernel", "_fp8_down_kernel", "_unpermute_kernel")},
                   promises=("deterministic",)),  # no atomics (batch invariance is not measured under fp8: its scales)
}

SCALED_GROUPED_MM = getattr(torch, "_scaled_grouped_mm", None)
_SCALED_GROUPED_MM_PROBES: dict[str, str] = {}  # device -> why not


def scaled_grouped_mm_refusal(cfg: LabConfig) -> str:
    """Why torch's fp8 grouped GEMM is no path of this point, one line: where torch._scaled_grouped_mm refuses a small
    rowwise problem on the point's device (CPU: no kernel), that refusal; where it runs, that it is not wired yet."""
    if SCALED_GROUPED_MM is None:
        return "torch._scaled_grouped_mm is not in this PyTorch"
    device = cfg.device.name if cfg.device.name != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if device not in _SCALED_GROUPED_MM_PROBES:
        if device == "cuda" and not torch.cuda.is_available():
            _SCALED_GROUPED_MM_PROBES[device] = "no CUDA device"
        else:
            try:  # 2 groups of 16 rows; B column-major (E, K, N), rowwise scales: what its CUDA kernel takes
                fp8 = torch.float8_e4m3fn
                a = torch.ones(32, 32, device=device).to(fp8)
                b = torch.ones(2, 32, 32, device=device).to(fp8).transpose(-2, -1).contiguous().transpose(-2, -1)
                SCALED_GROUPED_MM(a, b, torch.ones(32, device=device), torch.ones(2, 32, device=device),
                                  offs=torch.tensor([16, 32], dtype=torch.int32, device=device),
                                  out_dtype=torch.bfloat16)
                _SCALED_GROUPED_MM_PROBES[device] = ("runs on this device (rowwise scales only), but no path calls it "
                                                     "yet: unmeasured")
            except Exception as exc:  # a refusal (no kernel for the device, capability) is this peer's absence
                _SCALED_GROUPED_MM_PROBES[device] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}" \
                    if str(exc).strip() else type(exc).__name__
    return _SCALED_GROUPED_MM_PROBES[device]


# --- cases and inputs -------------------------------------------------------------------


def _recipe(cfg: LabConfig) -> str:
    return cfg.precision.quantize.recipe if cfg.precision.quantize is not None else ""


def _dims(cfg: LabConfig, tokens: int, d_model: int, ffn: int, top_k: int | None = None,
          experts: int | None = None) -> dict[str, int]:
    sizes = Sizes.of(cfg)
    return dict(tokens=tokens, d_model=d_model, ffn=ffn, experts=sizes.experts if experts is None else experts,
                top_k=sizes.top_k if top_k is None else top_k)


def _cases(cfg: LabConfig) -> list[Case]:
    """Per seed: the point's shape, a single token, sizes off every tile. On the first seed: every token
    routed to expert 0 (and expert 1 next), the last expert receiving no token, and top-k = E (sparse
    must then equal dense)."""
    sizes, recipe = Sizes.of(cfg), _recipe(cfg)
    main = (sizes.tokens, sizes.d_model, sizes.ffn)
    out = []
    for seed in cfg.parity.seeds:
        out.append(Case(f"T{main[0]}-seed{seed}", seed, _dims(cfg, *main), True, quantize=recipe))
        out += [Case(f"T{t}-d{d}-f{f}-seed{seed}", seed, _dims(cfg, t, d, f), False, quantize=recipe)
                for t, d, f in sizes.edge]
    seed = cfg.parity.seeds[0]
    out += [Case(f"T{main[0]}-{kind}", seed, _dims(cfg, *main), False, kind, quantize=recipe) for kind in ROUTING_KINDS]
    if sizes.top_k != sizes.experts:
        out.append(Case(f"T{main[0]}-top{sizes.experts}", seed, _dims(cfg, *main, top_k=sizes.experts), False,
                        quantize=recipe))
    return out


def _router_inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """x (T, d) and the router W_r (d, E) in fp32, shaped by the case's routing kind; then the draw for the rest.

    one_expert    feature 0 of x is 4 for every token and W_r[0] = (5, 2.5, 0, ...): logits of expert 0
                  and 1 sit ~20 and ~10 above the rest (std ~1), so every token picks expert 0 first, 1 next
    empty_expert  feature 0 is 4 and W_r[0, E-1] = -5: the last expert's logit sits ~20 below, no token picks it
    """
    d = case.dims
    randn = seeded_randn(case.seed, torch.float32, "cpu")
    x = randn(d["tokens"], d["d_model"])  # (T, d)
    w_router = randn(d["d_model"], d["experts"], scale=d["d_model"] ** -0.5)  # (d, E): logits of std ~1
    if case.inputs in ROUTING_KINDS:
        x[:, 0] = 4.0
        w_router[0] = 0.0
        if case.inputs == "one_expert":
            w_router[0, 0], w_router[0, 1 % d["experts"]] = 5.0, 2.5
        else:
            w_router[0, -1] = -5.0
    elif case.inputs != "normal":
        raise ValueError(f"unknown moe input kind {case.inputs!r}: valid are normal, {', '.join(ROUTING_KINDS)}")
    return x, w_router, randn


def _make_inputs(case: Case, dtype: torch.dtype, device: str) -> Tensors:
    """x, the router and the experts drawn in fp32 from the case's seed (experts scaled so each projection keeps
    unit scale), cast to the point's dtype; the routing from the reference router in fp32 on the cast x.

    A quantized case (Case.quantize '<fp8 format>:<scaling>') then quantizes x and the three expert weights, in the
    reference math (ops/moe/reference.py fp8_moe's recipe): x per tensor () or per token (T, 1); each expert's w_gate
    and w_up per expert (E, 1, 1) or per output column (E, 1, f), w_down (E, 1, 1) or (E, 1, d). The routing is the
    unquantized case's."""
    d = case.dims
    x, w_router, randn = _router_inputs(case)
    n_exp, dm, f = d["experts"], d["d_model"], d["ffn"]
    w_gate, w_up = randn(n_exp, dm, f, scale=dm ** -0.5), randn(n_exp, dm, f, scale=dm ** -0.5)  # (E, d, f)
    w_down = randn(n_exp, f, dm, scale=f ** -0.5)  # (E, f, d)
    x = x.to(dtype)
    route_idx, route_weight = moe_reference.moe_router(x.float(), w_router, d["top_k"])  # (T, k) each, fp32 router
    tensors = {"x": x, "w_gate": w_gate, "w_up": w_up, "w_down": w_down, "route_weight": route_weight}
    # route_idx contiguous on every device (the router's top-k is a strided slice; a copy to CUDA is contiguous, a
    # CPU one would keep it strided, and each path's reshape would copy it: traffic costs.py does not model)
    tensors = {**{k: v.to(device=device, dtype=dtype) for k, v in tensors.items()},
               "route_idx": route_idx.contiguous().to(device)}
    if not case.quantize:
        return tensors
    fmt, scaling = case.quantize.split(":")
    fp8, rowwise = getattr(torch, fmt), scaling == "row"
    for name in ("x", "w_gate", "w_up", "w_down"):  # x: dim 1 is d (per token); weights: dim 1 is K (per column)
        scale = quantize.fp8_scale(tensors[name], 1 if rowwise else None if name == "x" else (1, 2), fp8)
        tensors[name], tensors[f"{name}_scale"] = quantize.quantize_fp8(tensors[name], scale, fp8), scale
    return tensors


def _router_check(case: Case, inputs: Tensors, cfg: LabConfig) -> dict[str, Any]:
    """The routing every path ran on, against the float64 router on the same x: ids exactly, weights under the
    fp32-level contract (max|w32 − w64| <= error_multiple · max|round_fp32(w64) − w64| + floor_rel · max|w64|)."""
    contract, k = cfg.precision.lse_contract, case.dims["top_k"]
    x, w_router, _ = _router_inputs(case)
    # the router's input: the cast x (a quantized case's is the unquantized one the routing was made from)
    x = x.to(getattr(torch, cfg.precision.dtype)) if case.quantize else inputs["x"].cpu()
    idx32, w32 = moe_reference.moe_router(x.float(), w_router, k)
    idx64, w64 = moe_reference.moe_router(x.double(), w_router.double(), k)
    logits = torch.sort(x.double() @ w_router.double(), dim=-1, descending=True).values  # (T, E)
    margin = (logits[:, k - 1] - logits[:, k]).min().item() if k < logits.shape[1] else None
    err = (w32.double() - w64).abs().max().item()
    allowed = contract.error_multiple * (w64.float().double() - w64).abs().max().item() \
        + contract.floor_rel * w64.abs().max().item()
    reasons = []
    if not torch.equal(idx32, idx64):
        reasons.append(f"fp32 router picks other experts than the float64 router for "
                       f"{int((idx32 != idx64).any(1).sum())} tokens")
    if not torch.equal(inputs["route_idx"].cpu(), idx32):
        reasons.append("the recorded route_idx is not the fp32 router's")
    if err > allowed:
        reasons.append(f"route weights max_abs_err {err:.3g} > allowed {allowed:.3g}")
    counts = torch.bincount(idx32.reshape(-1), minlength=case.dims["experts"])
    return {"verdict": "fail" if reasons else "pass", "reason": "; ".join(reasons),
            "route_weight_max_abs_err": err, "route_weight_allowed": allowed,
            "min_topk_logit_margin": margin, "tokens_per_expert": counts.tolist()}


def _problem(case: Case) -> str:
    d = case.dims
    return f"T={d['tokens']} d={d['d_model']} f={d['ffn']} E={d['experts']} k={d['top_k']}"


@functools.lru_cache(maxsize=256)
def _histogram(dims: tuple[tuple[str, int], ...], seed: int, inputs: str, dtype: str) -> tuple[int, ...]:
    x, w_router, _ = _router_inputs(Case("", seed, dict(dims), True, inputs))
    idx, _ = moe_reference.moe_router(x.to(getattr(torch, dtype)).float(), w_router, dict(dims)["top_k"])
    return tuple(torch.bincount(idx.reshape(-1), minlength=dict(dims)["experts"]).tolist())


def _tokens_per_expert(case: Case, cfg: LabConfig) -> list[int]:
    """The rows each expert receives under the case's routing, as _make_inputs routes it (the fp32 router on x cast
    to the point's dtype): what the routed paths' traffic and the touched experts' weights follow."""
    return list(_histogram(tuple(sorted(case.dims.items())), case.seed, case.inputs, cfg.precision.dtype))


def _touched_experts(case: Case, cfg: LabConfig) -> int:
    """Experts that receive at least one token under the case's routing (their weights are read)."""
    return sum(1 for n in _tokens_per_expert(case, cfg) if n)


def _costs(case: Case, cfg: LabConfig) -> Costs:
    """Active FLOPs: each of the T·k assignments runs gate, up and down (d x f each): 2·T·k·3·d·f; the routing
    weight and SwiGLU are O(T·k·f) and left out. The dense reference runs all E experts: 2·T·E·3·d·f.
    Bytes: read x and write out (T·d each), the weights of the experts actually touched (3·d·f each), the
    routing (T·k ids of 8 B and weights). Backward: 2x (dX and dW, one GEMM each per projection).
    A quantized case: x and the weights in 1 byte, their fp32 scales (x: 1 or T; each touched expert: 3, or
    2·f + d rowwise), out in the point's dtype; h's round trip is the path's own traffic, not counted."""
    d, size = case.dims, itemsize(cfg.precision.dtype)
    t, dm, f, k = d["tokens"], d["d_model"], d["ffn"], d["top_k"]
    flops = 2 * t * k * 3 * dm * f
    if case.quantize:
        fmt, scaling = case.quantize.split(":")
        touched, one = _touched_experts(case, cfg), itemsize(fmt)
        scales = 1 + 3 * touched if scaling == "tensor" else t + touched * (2 * f + dm)
        nbytes = (t * dm + touched * 3 * dm * f) * one + t * dm * size + scales * 4 + t * k * (8 + size)
        return Costs(flops, nbytes, 2.0, "2*T*k*3*d*f (active; dense reference: 2*T*E*3*d*f)",
                     "(T*d + E_touched*3*d*f)*1 + T*d*itemsize + scales*4 + T*k*(8 + itemsize) (scales: "
                     "1 + 3*E_touched, or T + E_touched*(2*f + d) rowwise)",
                     "backward = 2 x forward (dX and dW of gate, up and down); not timed: the fp8 paths are "
                     "forward-only")
    nbytes = (2 * t * dm + _touched_experts(case, cfg) * 3 * dm * f) * size + t * k * (8 + size)
    return Costs(flops, nbytes, 2.0, "2*T*k*3*d*f (active; dense reference: 2*T*E*3*d*f)",
                 "(2*T*d + E_touched*3*d*f)*itemsize + T*k*(8 + itemsize)",
                 "backward = 2 x forward (dX and dW of gate, up and down)")



# --- each kind of path's own traffic (OpDef.path_costs; Impl.cost_model names one): posttrainllm/ops/moe/costs.py ---


def _routed(model: Callable[[Case, LabConfig, list[int]], Costs]) -> Callable[[Case, LabConfig], Costs]:
    """A routed path's model at the case's own routing (the rows each expert receives)."""
    return lambda case, cfg: model(case, cfg, _tokens_per_expert(case, cfg))


PATH_COSTS = {"dense": costs.dense, **{name: _routed(model) for name, model in costs.ROUTED.items()}}


def _describe(case: Case, inputs: Tensors, cfg: LabConfig, measure: Any = None) -> dict[str, Any]:
    """What the microbench records beyond time: the routing's histogram and the sparse-vs-dense cost gap."""
    d = case.dims
    size = itemsize(case.quantize.split(":")[0] if case.quantize else cfg.precision.dtype)  # the expert weights'
    t, dm, f, n_exp, k = d["tokens"], d["d_model"], d["ffn"], d["experts"], d["top_k"]
    counts = torch.bincount(inputs["route_idx"].reshape(-1).cpu(), minlength=n_exp)
    touched = int((counts > 0).sum())
    return {
        "tokens_per_expert": counts.tolist(),
        "experts_touched": touched,
        "active_flops": 2 * t * k * 3 * dm * f, "active_flops_formula": "2*T*k*3*d*f",
        "dense_flops": 2 * t * n_exp * 3 * dm * f, "dense_flops_formula": "2*T*E*3*d*f (E/k x the active)",
        "expert_weight_bytes_touched": touched * 3 * dm * f * size,
        "expert_weight_bytes_total": n_exp * 3 * dm * f * size,
        "expert_weight_bytes_formula": "E_touched*3*d*f*itemsize (total: E*3*d*f*itemsize; the weights' itemsize: "
                                       "1 under fp8)",
        "active_params": k * 3 * dm * f, "total_params": n_exp * 3 * dm * f,
        "decode_note": "at T=1 every touched expert's 3*d*f weights are read for 2*k*3*d*f FLOPs: intensity "
                       "~1/itemsize FLOP/B, memory-bound on expert weights (the curve starts at T=1)",
        "unavailable": ({"scaled_grouped_mm": scaled_grouped_mm_refusal(cfg)} if case.quantize else
                        {"grouped_mm": why} if (why := grouped_mm_refusal(cfg)) else {}),
    }


def _curve_case(cfg: LabConfig, x: int) -> Case:
    sizes, seed = Sizes.of(cfg), cfg.parity.seeds[0]
    return Case(f"T{x}-seed{seed}", seed, _dims(cfg, x, sizes.d_model, sizes.ffn), True, quantize=_recipe(cfg))


def _expert_curve_case(cfg: LabConfig, x: int) -> Case:
    """x experts at fixed active parameters (shape.ops.moe.tokens tokens, d, f and top-k fixed): the total expert
    parameters and the dense reference's FLOPs (2·T·E·3·d·f) grow with E; the routed paths' active FLOPs do not."""
    sizes, seed = Sizes.of(cfg), cfg.parity.seeds[0]
    dims = _dims(cfg, sizes.tokens, sizes.d_model, sizes.ffn, experts=x)
    return Case(f"E{x}-T{sizes.tokens}-seed{seed}", seed, dims, True, quantize=_recipe(cfg))


# --- the model --------------------------------------------------------------------------


def _fill(impl: Impl, cfg: LabConfig) -> Callable[..., torch.Tensor]:
    """Each MoE MLP's experts run `impl.fn` on its rows, its weights and its router's routing."""

    def moe(x, w_gate, w_up, w_down, route_idx, route_weight):
        tensors = dict(zip(EXPERTS, (x, w_gate, w_up, w_down, route_idx, route_weight)))
        return impl.fn(tensors, cfg)["out"]

    return moe


def _model_problem(cfg: LabConfig) -> str:
    arch, train = cfg.architecture, cfg.train
    return (f"T={train.batch_size * train.seq_len} d={arch.d_model} f={arch.expert_hidden} E={arch.n_experts} "
            f"k={arch.top_k}")


def _model_overrides(cfg: LabConfig) -> dict[str, Any]:
    """The op=moe point trains an MoE model: an MoE architecture as it is; a dense one gets an MoE MLP of
    architecture.n_experts experts, top_k each, of width mlp_hidden / top_k (the dense MLP's active parameters)."""
    arch = cfg.architecture
    return {} if arch.mlp == "moe" else {"mlp": "moe", "expert_hidden": max(1, arch.mlp_hidden // arch.top_k)}


def _check_config(cfg: LabConfig) -> None:
    """grouped_mm reads rows of 16 bytes (d and f multiples of 16 / itemsize); gate+up hold an X tile and two
    weight tiles per pipeline stage: (BLOCK_M·BLOCK_K + 2·BLOCK_K·BLOCK_N) · itemsize · num_stages of shared memory
    (1-byte operands under fp8, whose paths follow ops/base.py check_fp8_config and have no grouped_mm)."""
    sizes, tile, quantize = Sizes.of(cfg), cfg.tile, cfg.precision.quantize
    if quantize is not None:
        check_fp8_config(cfg, "reference, triton")
    size = itemsize(quantize.format if quantize is not None else cfg.precision.dtype)
    align = 16 // size
    for t, d, f in [(sizes.tokens, sizes.d_model, sizes.ffn), *sizes.edge]:
        if quantize is None and GROUPED_MM is not None and (d % align or f % align):
            raise ConfigError(f"moe sizes d={d}, f={f}: torch grouped_mm needs multiples of {align} in "
                              f"{cfg.precision.dtype} (16-byte rows)")
    smem = (tile.block_m * tile.block_k + 2 * tile.block_k * tile.block_n) * size * cfg.workgroup.num_stages
    check_smem(cfg, smem)


def _reference_bytes(case: Case, cfg: LabConfig) -> int:
    """The dense float64 oracle: ~8 (E, T, f) tensors through autograd (g, u, h and their gradients), ~4 (E, T, d),
    and the expert weights with their gradients in float64, fp32 and the point's precision (~8 copies)."""
    d = case.dims
    t, dm, f, n_exp = d["tokens"], d["d_model"], d["ffn"], d["experts"]
    return 8 * (8 * n_exp * t * f + 4 * n_exp * t * dm + 8 * 3 * n_exp * dm * f)


SIGNATURE = ("fn(x, w_gate, w_up, w_down, route_idx, route_weight) -> out; x (T, d), w_gate and w_up (E, d, f), "
             "w_down (E, f, d), route_idx (T, k) int64, route_weight (T, k); out (T, d) in x's dtype = "
             "Σ_k route_weight[t, k] · (silu(x w_gate[e]) ∘ (x w_up[e])) w_down[e], e = route_idx[t, k]")

TEMPLATE = '''
import torch
import torch.nn.functional as F


def {name}(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
           route_idx: torch.Tensor, route_weight: torch.Tensor) -> torch.Tensor:
    """Routed SwiGLU experts: out[t] = Σ_k route_weight[t, k] · expert_{{route_idx[t, k]}}(x[t]).

    x: (T, d); w_gate, w_up: (E, d, f); w_down: (E, f, d); route_idx: (T, k) int64; route_weight: (T, k)
    -> out (T, d) in x's dtype, with expert_e(x) = (silu(x W_gate[e]) * (x W_up[e])) W_down[e].
    Gradients are checked for x, the three weights and route_weight.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # (T, d)
    for e in range(w_gate.shape[0]):
        token, slot = (route_idx == e).nonzero(as_tuple=True)  # the (token, slot) pairs routed to e
        if token.numel() == 0:
            continue
        xe = x[token].float()  # (n_e, d)
        h = F.silu(xe @ w_gate[e].float()) * (xe @ w_up[e].float())  # (n_e, f)
        y = (h @ w_down[e].float()) * route_weight[token, slot].float()[:, None]  # (n_e, d)
        out = out.index_add(0, token, y)
    return out.to(x.dtype)
'''


def _adapt(fn: Any) -> Any:
    def path(x: Tensors, cfg: LabConfig) -> Tensors:
        return {"out": fn(*_args(x))}

    path.__name__ = getattr(fn, "__name__", "user")
    return path


OP = OpDef(
    name="moe", x_name="tokens", input_names=("x", "w_gate", "w_up", "w_down", "route_weight", "route_idx"),
    impls=IMPLS, cases=_cases, make_inputs=_make_inputs, problem=_problem, costs=_costs, curve_case=_curve_case,
    model_hook=ModelHook("experts", _fill), model_problem=_model_problem,
    model_defaults={"experts": moe_reference.moe_dense, "router": moe_reference.moe_router}, check_config=_check_config,
    reference_bytes=_reference_bytes, path_costs=PATH_COSTS, nondiff_inputs=("route_idx",), input_checks=_router_check,
    curve_sizes=lambda cfg: list(Sizes.of(cfg).curve), model_overrides=_model_overrides,
    extra_curves=(CurveAxis("experts", lambda cfg: list(Sizes.of(cfg).expert_curve), _expert_curve_case),),
    describe=_describe,  # the weight and routing-weight gradients' max_error_only: conf/op/moe.yaml
    point_impls=_impls_for, quantizes=True, reserved_names=("scaled_grouped_mm",),
    optional_peers={"compiled": compiled("moe", _reference, _make_inputs, "posttrainllm.ops.moe.reference.moe_dense")},
    signature=SIGNATURE, adapt=_adapt, template=TEMPLATE,
    batch_axis=BatchAxis("a token with its routing", {"x": 0, "route_weight": 0, "route_idx": 0}, {"out": 0},
                         note="the experts' weight gradients sum over the tokens: not a token's"),
)
