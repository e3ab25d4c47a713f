"""Mixture of experts' readable math (router, dense and sparse dispatch, the fp8 recipe): the oracle.

No performance tricks live here: the textbook formula in eager PyTorch, run in whatever dtype its inputs
have: call it on float64 inputs for the oracle, or on the point's precision for the plain in-precision
baseline.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from posttrainllm.ops import quantize  # by module: a test's patch of it reaches here
from posttrainllm.ops.swiglu.reference import swiglu


# Shape legend (MoE)
#     T   tokens (rows of x)      d   model width       f   expert FFN width
#     E   experts                 k   experts per token (top-k)
# Expert weights are stacked "x @ W" style: w_gate, w_up (E, d, f), w_down (E, f, d).
# The routing is two (T, k) tensors: route_idx (int64 expert ids, best first) and
# route_weight (the renormalised probabilities of those experts).


def moe_router(x: torch.Tensor, w_router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing, in the dtype of its inputs (the model and the lab call it in fp32).

    x: (T, d), w_router: (d, E) -> route_idx (T, k) int64, route_weight (T, k).
    logits = x · W_r; probs = softmax(logits); keep the k largest; weights = probs / Σ_k probs
    (renormalised over the chosen k, as Mixtral does). Tie-break: equal logits go to the lower
    expert index (a stable descending sort), so the rule is written down, not left to topk.
    """
    logits = x @ w_router  # (T, E)
    probs = torch.softmax(logits, dim=-1)  # (T, E)
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices  # (T, E): ties keep index order
    route_idx = order[:, :top_k]  # (T, k)
    chosen = probs.gather(1, route_idx)  # (T, k)
    return route_idx, chosen / chosen.sum(dim=-1, keepdim=True)


def swiglu_expert(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One expert: (silu(x W_gate) * (x W_up)) W_down.   x: (..., d), w_gate/w_up: (d, f), w_down: (f, d)."""
    return swiglu(x @ w_gate, x @ w_up) @ w_down


def moe_dense(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
              route_idx: torch.Tensor, route_weight: torch.Tensor, quantize_h: Any = None) -> torch.Tensor:
    """Every expert on every token, combined by a (T, E) gate that is zero for unchosen experts.

    E x the active FLOPs (the honest dense baseline). x: (T, d) -> (T, d).
    quantize_h(h, routed): what an fp8 chain does to h = silu(x W_gate) · (x W_up) (E, T, f) between its GEMMs,
    given which (expert, token) rows are routed ((E, T) bool); None: nothing (fp8_moe below passes one).
    """
    n_experts = w_gate.shape[0]
    gate = torch.zeros(x.shape[0], n_experts, dtype=route_weight.dtype, device=x.device)  # (T, E)
    gate = gate.scatter(1, route_idx, route_weight)  # (T, E): route_weight where chosen, else 0
    if quantize_h is None:
        expert_out = swiglu_expert(x.unsqueeze(0), w_gate, w_up, w_down)  # (1, T, d) through (E, ...) -> (E, T, d)
    else:
        rows = x.unsqueeze(0)  # (1, T, d)
        routed = torch.zeros(gate.shape, dtype=torch.bool, device=x.device).scatter(1, route_idx, True).t()  # (E, T)
        expert_out = quantize_h(swiglu(rows @ w_gate, rows @ w_up), routed) @ w_down  # (E, T, f) -> (E, T, d)
    return torch.einsum("te,etd->td", gate.to(expert_out.dtype), expert_out)  # (T, d)


def moe_sparse(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
               route_idx: torch.Tensor, route_weight: torch.Tensor) -> torch.Tensor:
    """For each expert: gather its tokens, run it, scatter-add the weighted result. x: (T, d) -> (T, d)."""
    out = torch.zeros_like(x)  # (T, d)
    for e in range(w_gate.shape[0]):
        token, slot = torch.nonzero(route_idx == e, as_tuple=True)  # (n_e,) each: which token, which of its k
        if token.numel() == 0:
            continue
        y = swiglu_expert(x[token], w_gate[e], w_up[e], w_down[e])  # (n_e, d)
        out = out.index_add(0, token, y * route_weight[token, slot, None].to(y.dtype))  # (T, d)
    return out



# --- fp8 MoE: the routed experts' GEMMs in 8 bits (op=moe under precision=fp8, fp8_rowwise), forward only --------
# The expert GEMMs are an fp8 GEMM chain: g = x W_gate[e], u = x W_up[e] on e4m3 x and weights, h = silu(g) · u in
# fp32, h quantized again to e4m3, y = h W_down[e] · route_weight. Scales, per recipe (x and the weights are quantized
# once per case by the op's make_inputs, ops/moe/definition.py; h by each path, being an intermediate):
#     tensorwise  x: one scale (); each expert's w_gate, w_up, w_down: one scale each, (E, 1, 1); h: one scale over
#                 the routed rows (the T·k rows of a grouped GEMM; rows no token picked are no part of it)
#     rowwise     x: one per token (T, 1); w_gate[e], w_up[e] (d, f): one per output column, (E, 1, f); w_down[e]
#                 (f, d): (E, 1, d); h: one per routed row (over f)
# Every scale is constant along its GEMM's K, so it factors out of the sum and an fp8 kernel applies it in the epilogue.


def fp8_moe(x: torch.Tensor, x_scale: torch.Tensor, w_gate: torch.Tensor, w_gate_scale: torch.Tensor,
            w_up: torch.Tensor, w_up_scale: torch.Tensor, w_down: torch.Tensor, w_down_scale: torch.Tensor,
            route_idx: torch.Tensor, route_weight: torch.Tensor,
            out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """moe_dense on the dequantized operands, h quantized between the GEMMs (the recipe above): x_scale 0-dim is the
    tensorwise recipe, (T, 1) the rowwise one. x (T, d), w_gate, w_up (E, d, f), w_down (E, f, d) fp8 (or their
    values in a wider dtype) -> (T, d). In fp32, rounded to out_dtype; in float64 for float64 inputs (the oracle:
    exact dequantized values; h is quantized as every path does, from its value rounded to fp32), left in float64.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    rowwise = x_scale.dim() == 2

    def quantize_h(h: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:  # h (E, T, f), routed (E, T)
        # (E, T, 1), or () over the routed rows
        scale = quantize.fp8_scale(h, -1) if rowwise else quantize.fp8_scale(h[routed])
        return quantize.dequantize_fp8(quantize.quantize_fp8(h, scale), scale, compute)

    dq = quantize.dequantize_fp8
    out = moe_dense(dq(x, x_scale, compute), dq(w_gate, w_gate_scale, compute), dq(w_up, w_up_scale, compute),
                    dq(w_down, w_down_scale, compute), route_idx, route_weight.to(compute), quantize_h=quantize_h)
    return out if compute == torch.float64 else out.to(out_dtype)
