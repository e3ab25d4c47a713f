"""The model's swappable slots: each call of the transformer that an implementation can replace, declared once.

A slot is a role in the model (its attention, its linear layers, its norm), named by the model, with the contract a
function must meet to fill it. The transformer calls each slot inside the profiler range posttrainllm::<slot>, so
bench-train measures a slot's share of the step by name; `Transformer.swap(slot, fn)` replaces what runs there.

The model knows no op of the lab. Its default math in a slot is an op's readable reference, declared by that op
(OpDef.model_defaults) and taken through the registry (`defaults`), or the model's own (OWN_DEFAULTS); an op's paths
fill a slot through the op's model hook (OpDef.model_hook: its slot, and the path as that slot's function).

Three words of the model's vocabulary equal an op's name: the slots "attention" and "rope", and the MLP kind "moe"
(ModelConfig.mlp). They are the model's own words for its layers (causal self-attention, rotary position embedding,
a mixture-of-experts MLP), the names Llama and Mixtral give them, whatever op of the lab fills them:
tests/test_op_folders.py exempts the words spelled as strings here (VOCABULARY), in this module only. The rest of
the model names them by this module's constants.

Shape legend: B batch, T sequence length, C d_model, nh/nkv query/key-value heads, hs head_dim, V vocab,
F mlp_hidden, N = B·T rows, E experts, Fe expert_hidden, k experts per token, L positions cached before T.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any, Callable

import torch.nn.functional as F

from posttrainllm.ops.registry import model_defaults  # the ops declare which slots their readable math is


@dataclass(frozen=True)
class Slot:
    """One swappable call: its name (the profiler range's), the contract of a function filling it, and what runs
    there where nothing is swapped in, in words."""

    name: str
    contract: str
    default: str

    @property
    def profiler_range(self) -> str:
        return f"posttrainllm::{self.name}"


ATTENTION = "attention"
CACHED_ATTENTION = "cached_attention"
TREE_ATTENTION = "tree_attention"
LINEAR = "linear"
NORM = "norm"
ADD_NORM = "add_norm"
ROPE = "rope"
MLP_ACTIVATION = "mlp_activation"
ROUTER = "router"
EXPERTS = "experts"
LOSS = "loss"

SLOTS: dict[str, Slot] = {slot.name: slot for slot in (
    Slot(ATTENTION, "(q, k, v) -> o   q (B, nh, T, hs), k and v (B, nkv, T, hs) -> (B, nh, T, hs): causal, "
                    "softmax scale 1/sqrt(hs), GQA by head groups", "the readable math (its (T, T) scores)"),
    Slot(CACHED_ATTENTION, "(q, k, v) -> o   q (B, nh, T, hs) the last T of k, v (B, nkv, L + T, hs) "
                           "-> (B, nh, T, hs): a chunk against the KV cache, bottom-right causal mask",
         "the readable math"),
    Slot(TREE_ATTENTION, "(q, k, v, blocked) -> o   as cached_attention under an arbitrary mask blocked "
                         "(T, L + T) bool, True = may not see: a tree of speculative candidates",
         "the readable math (no fast path takes an arbitrary mask)"),
    Slot(LINEAR, "(x, weight) -> y   x (..., in), weight (out, in) -> (..., out) = x @ weightᵀ: every projection "
                 "(q, k, v, o, the MLP's, the head)", "F.linear"),
    Slot(NORM, "(x, weight, eps) -> y   x (..., C), weight (C,) -> (..., C) in x's dtype: "
               "x / sqrt(mean(x²) + eps) · weight (RMSNorm): the blocks' two and the final one", "the readable math"),
    Slot(ADD_NORM, "(x, a, weight, eps) -> (y, h)   x, a (..., C), weight (C,) -> h = x + a (the residual stream) "
                   "and y = norm(h) · weight, each (..., C) in x's dtype: a block's residual add after attention "
                   "and its MLP norm in one", "none: the add, then the norm slot"),
    Slot(ROPE, "(x, cos, sin) -> y   x (B, heads, T, hs), cos and sin (T, hs/2) fp32 -> (B, heads, T, hs): "
               "rotate-half, q and k", "the readable math (fp32)"),
    Slot(MLP_ACTIVATION, "(gate, up) -> h   gate, up (..., F) -> silu(gate) · up (..., F): a dense MLP's gated "
                         "activation (SwiGLU)", "the readable math"),
    Slot(ROUTER, "(x, w_router, k) -> (route_idx, route_weight)   x (N, C), w_router (C, E) fp32 -> (N, k) int64 "
                 "and (N, k): softmax, top-k, renormalised over the k, ties to the lower index",
         "the readable math"),
    Slot(EXPERTS, "(x, w_gate, w_up, w_down, route_idx, route_weight) -> y   x (N, C), w_gate and w_up "
                  "(E, C, Fe), w_down (E, Fe, C), route_idx (N, k) int64, route_weight (N, k) -> (N, C): an MoE "
                  "MLP's routed SwiGLU experts, dropless", "the readable math (every expert on every row)"),
    Slot(LOSS, "(h, weight, targets) -> loss   h (N, C), weight (V, C), targets (N,) int64 -> mean cross-entropy "
               "of h @ weightᵀ: the head and the loss in one (a fused path never makes the logits)",
         "none: the head (the linear slot), then F.cross_entropy on fp32 logits"),
)}

# ModelConfig.mlp: each block's MLP is a dense SwiGLU, or routed SwiGLU experts (a mixture of experts)
DENSE, MOE = "dense", "moe"
MLP_KINDS = (DENSE, MOE)

# What the model is built with, not swapped: the RoPE tables, (seq_len, head_dim, theta) -> (cos, sin), each
# (seq_len, head_dim/2) fp32, position · theta^(-2i/head_dim). Its math is an op's too (model_defaults).
ROPE_TABLES = "rope_tables"

# The model's own defaults; None: the model's own path (Slot.default says which). Every other slot's default, and
# ROPE_TABLES, is an op's readable math
OWN_DEFAULTS: dict[str, Callable[..., Any] | None] = {LINEAR: F.linear, ADD_NORM: None, LOSS: None}


@cache
def _declared() -> dict[str, Callable[..., Any]]:
    declared = model_defaults()
    wanted = (set(SLOTS) - set(OWN_DEFAULTS)) | {ROPE_TABLES}
    missing, unknown = sorted(wanted - set(declared)), sorted(set(declared) - wanted)
    if missing or unknown:
        raise ValueError(f"the ops' model defaults (OpDef.model_defaults) do not match the model's slots: "
                         f"missing {missing}, not a slot taking one {unknown}; slots: {', '.join(SLOTS)}")
    return declared


def defaults() -> dict[str, Callable[..., Any] | None]:
    """What runs in every slot where nothing is swapped in (and ROPE_TABLES): a fresh dict."""
    return {**_declared(), **OWN_DEFAULTS}


def check(slot: str) -> Slot:
    """The slot named `slot`; an unknown name is refused with the valid ones."""
    if slot not in SLOTS:
        raise ValueError(f"unknown model slot {slot!r}: valid choices are {', '.join(SLOTS)}")
    return SLOTS[slot]


VOCABULARY = {*SLOTS, *MLP_KINDS}  # the words tests/test_op_folders.py lets this module spell (the docstring says why)
