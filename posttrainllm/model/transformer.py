"""A small decoder-only transformer (Llama-shaped) whose calls are slots.

Pre-norm blocks: x + attn(rmsnorm(x)), then x + mlp(rmsnorm(x)). RoPE on q and k,
causal self-attention with n_kv_heads <= n_heads (MHA, GQA, MQA), SwiGLU MLP, untied
head. Its attention, linear layers, norms, rotation, MLP activation, experts and loss are
slots (model/slots.py: each one's contract), so the same weights can be trained with the
readable reference, PyTorch's fast path, or our Triton kernels: `swap(slot, fn)`, fn handed
in by bench-train from an op's registry through the op's model hook.

Generation keeps a KV cache (`KVCache`): `forward(idx, cache=cache)` runs the new tokens at
positions cache.length.. , appends their keys and values, and attends to everything cached.
The readable reference is full recomputation without a cache (posttrainllm/model/decode.py).

Each slot's call runs inside its profiler range (posttrainllm::<slot>), so train.py can
measure the fraction of a step each slot takes.

Speed switches (torch.compile, precision) belong to the runner (train.py), not here.

Shape legend
    B   batch           T    sequence length      C    d_model
    nh  query heads     nkv  key/value heads      hs   head_dim
    V   vocab size      F    mlp_hidden
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from posttrainllm.model import slots
from posttrainllm.model.slots import (ADD_NORM, ATTENTION, CACHED_ATTENTION, EXPERTS, LINEAR, LOSS, MLP_ACTIVATION,
                                      MLP_KINDS, MOE, NORM, ROPE, ROPE_TABLES, ROUTER, TREE_ATTENTION)


@dataclass
class ModelConfig:
    vocab_size: int = 256  # byte-level: the corpus is raw UTF-8 bytes, no tokenizer to version
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4  # < n_heads is GQA (1 is MQA): smaller K/V, the case kernels must handle
    # None means d_model // n_heads; may be set apart from it, because attention kernels
    # care about head_dim (16, 64, 128...) independently of the model width.
    head_dim: int | None = None
    # None means the Llama rule: 8/3 * d_model (SwiGLU has 3 matrices, so this keeps the
    # MLP's parameter count near a 4x GELU MLP), rounded up to a multiple of 32.
    mlp_hidden: int | None = None
    max_seq_len: int = 256  # size of the RoPE tables; longer inputs are refused, not extrapolated
    rope_theta: float = 10000.0  # RoPE base (Llama's): wavelengths from 2*pi up to ~theta*2*pi positions
    norm_eps: float = 1e-5  # RMSNorm epsilon; keeps rsqrt finite on an all-zero row
    # mlp="moe": each block's MLP is n_experts routed SwiGLU experts of width expert_hidden (None: mlp_hidden),
    # top_k per token, dropless; the router's load-balancing loss (Switch Transformer, Mixtral) is added to the
    # training loss times router_aux_coef (moe_aux_loss).
    mlp: str = "dense"
    n_experts: int = 4
    top_k: int = 2
    expert_hidden: int | None = None
    router_aux_coef: float = 0.01

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.n_kv_heads > self.n_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must be <= n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
                "(each key/value head serves an equal group of query heads)"
            )
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "set head_dim explicitly"
                )
            self.head_dim = self.d_model // self.n_heads
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int (RoPE rotates pairs), got {self.head_dim!r}")
        if self.mlp_hidden is None:
            self.mlp_hidden = 32 * math.ceil(8 * self.d_model / 3 / 32)
        if not isinstance(self.mlp_hidden, int) or self.mlp_hidden <= 0:
            raise ValueError(f"mlp_hidden must be a positive int, got {self.mlp_hidden!r}")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"mlp must be one of {', '.join(MLP_KINDS)}, got {self.mlp!r}")
        if self.expert_hidden is None:
            self.expert_hidden = self.mlp_hidden
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps!r}")


# --------------------------------------------------------------------------- the slots
# The model does not know which implementations exist: bench-train swaps in the functions from an op's registry
# (posttrainllm/ops/), the same ones parity checked and the microbench timed. Contracts: model/slots.py.


def call_slot(fns: dict[str, Callable[..., Any]], slot: str, *args: Any) -> Any:
    """fns[slot](*args) inside the slot's profiler range."""
    with record_function(slots.SLOTS[slot].profiler_range):
        return fns[slot](*args)


def slot_defaults(*names: str) -> dict[str, Callable[..., Any] | None]:
    """What a module's slots run until one is swapped: the model's defaults (slots.defaults)."""
    every = slots.defaults()
    return {name: every[name] for name in names}


class KVCache:
    """Every layer's keys and values for positions [0, length), preallocated to max_len: (B, nkv, max_len, hs).

    A forward with the cache writes its T new positions at [length, length + T) in every layer,
    then `length` advances by T. `rollback(n)` forgets positions >= n (rejected speculative tokens):
    their slots are simply overwritten by the next forward.
    """

    def __init__(self, config: ModelConfig, batch: int, max_len: int, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        if not 0 < max_len <= config.max_seq_len:
            raise ValueError(f"max_len={max_len} must be in [1, max_seq_len={config.max_seq_len}]")
        shape = (batch, config.n_kv_heads, max_len, config.head_dim)  # (B, nkv, max_len, hs)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.max_len, self.length = max_len, 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, nkv, T, hs) at [length, length + T) of `layer`; return its (B, nkv, length + T, hs) views."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {k.shape[2]} positions > max_len={self.max_len}")
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def rollback(self, length: int) -> None:
        """Keep positions [0, length): the speculative tokens after them were rejected."""
        if not 0 <= length <= self.length:
            raise ValueError(f"rollback to {length}: the cache holds {self.length} positions")
        self.length = length

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


class Linear(nn.Linear):
    """nn.Linear (no bias) whose matmul is the linear slot."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.fns = slot_defaults(LINEAR)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return call_slot(self.fns, LINEAR, x, self.weight)


# --------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """x / rms(x) * weight through the norm slot (default: the readable math in fp32, rounded once)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fns = slot_defaults(NORM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return call_slot(self.fns, NORM, x, self.weight, self.eps)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.q_proj = Linear(config.d_model, config.n_heads * config.head_dim)
        self.k_proj = Linear(config.d_model, config.n_kv_heads * config.head_dim)
        self.v_proj = Linear(config.d_model, config.n_kv_heads * config.head_dim)
        self.o_proj = Linear(config.n_heads * config.head_dim, config.d_model)
        self.fns = slot_defaults(ROPE, ATTENTION, CACHED_ATTENTION, TREE_ATTENTION)
        # Set by Transformer.forward for the length of one call with a cache: (cache, this layer's index).
        # Block.forward passes only (x, cos, sin), so the cache reaches the attention this way.
        self.cache: tuple[KVCache, int] | None = None
        # Set likewise for a tree verification (Transformer.hidden's `tree`): (T, L + T) bool, True = may NOT see.
        self.tree_mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        with record_function(slots.SLOTS[ROPE].profiler_range):  # one range around q's and k's rotations
            q, k = self.fns[ROPE](q, cos, sin), self.fns[ROPE](k, cos, sin)
        if self.cache is None:
            y = call_slot(self.fns, ATTENTION, q, k, v)  # (B, nh, T, hs)
        else:
            cache, layer = self.cache
            k_all, v_all = cache.append(layer, k, v)  # (B, nkv, L + T, hs), L positions cached before
            if self.tree_mask is None:  # (B, nh, T, hs): the chunk at the end
                y = call_slot(self.fns, CACHED_ATTENTION, q, k_all, v_all)
            else:  # a tree of candidates: an arbitrary mask, which the cached_attention paths (the Triton kernel's
                # bottom-right causal mask) do not take
                y = call_slot(self.fns, TREE_ATTENTION, q, k_all, v_all, self.tree_mask)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, nh*hs)
        return self.o_proj(y)  # (B, T, C)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): a gated MLP, C -> F -> C."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.d_model, config.mlp_hidden)
        self.up_proj = Linear(config.d_model, config.mlp_hidden)
        self.down_proj = Linear(config.mlp_hidden, config.d_model)
        self.fns = slot_defaults(MLP_ACTIVATION)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)  # (B, T, F) each
        h = call_slot(self.fns, MLP_ACTIVATION, gate, up)  # (B, T, F)
        return self.down_proj(h)  # (B, T, C)


class MoEMLP(nn.Module):
    """Routed SwiGLU experts: y = Σ_k route_weight · expert_k(x), dropless (every assignment computed).

    The router slot runs in fp32 (softmax, top-k, renormalised over the k, ties to the lower index); the experts
    are the experts slot (default: every expert on every row). Each forward keeps its load-balancing loss and
    its histogram.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        n_exp, d, f = config.n_experts, config.d_model, config.expert_hidden
        self.top_k = config.top_k
        self.w_router = nn.Parameter(torch.randn(d, n_exp) * 0.02)  # (C, E)
        self.w_gate = nn.Parameter(torch.randn(n_exp, d, f) * 0.02)  # (E, C, Fe)
        self.w_up = nn.Parameter(torch.randn(n_exp, d, f) * 0.02)  # (E, C, Fe)
        # writes into the residual stream: GPT-2's 1/sqrt(2 * n_layers) as for down_proj
        self.w_down = nn.Parameter(torch.randn(n_exp, f, d) * 0.02 / math.sqrt(2 * config.n_layers))  # (E, Fe, C)
        self.fns = slot_defaults(ROUTER, EXPERTS)
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.assignments = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        rows = x.reshape(B * T, C)  # (N, C)
        logits = rows.float() @ self.w_router.float()  # (N, E), fp32 whatever the autocast dtype
        route_idx, route_weight = call_slot(self.fns, ROUTER, rows.float(), self.w_router.float(), self.top_k)  # (N, k)
        n_exp = self.w_router.shape[1]
        counts = torch.bincount(route_idx.reshape(-1), minlength=n_exp)  # (E,) assignments per expert
        # load balance: E · Σ_e (fraction of assignments to e) · (mean router probability of e)
        self.aux_loss = n_exp * (counts.float() / route_idx.numel() * torch.softmax(logits, -1).mean(0)).sum()
        self.tokens_per_expert, self.assignments = counts.detach(), route_idx.numel()
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        # autocast does not reach a custom Function: cast here
        y = call_slot(self.fns, EXPERTS, rows.to(dtype), self.w_gate.to(dtype), self.w_up.to(dtype),
                      self.w_down.to(dtype), route_idx, route_weight.to(dtype))  # (N, C)
        return y.reshape(B, T, C).to(x.dtype)


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Σ over MoE layers of router_aux_coef · load-balancing loss of the last forward (None: no MoE layer)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoEMLP) and m.aux_loss is not None]
    return model.config.router_aux_coef * torch.stack(losses).sum() if losses else None


def moe_stats(model: nn.Module) -> dict | None:
    """The last forward's routing: tokens per expert per layer; dropped is 0 by construction (dropless)."""
    layers = [m.tokens_per_expert.tolist() for m in model.modules()
              if isinstance(m, MoEMLP) and m.tokens_per_expert is not None]
    if not layers:
        return None
    assignments = [m.assignments for m in model.modules() if isinstance(m, MoEMLP) and m.assignments]
    balance = [m.aux_loss.item() for m in model.modules() if isinstance(m, MoEMLP) and m.aux_loss is not None]
    return {"tokens_per_expert": layers, "assignments": assignments,
            "dropped": [a - sum(c) for a, c in zip(assignments, layers)],  # T·k routed − Σ computed per expert
            # E·Σ_e f_e·P_e per layer, before router_aux_coef: ~1 when balanced, at most E/k (f_e <= 1/k),
            # reached when every token goes to the same k experts
            "load_balance_loss": balance,
            "dropless": "every (token, expert) assignment is computed: no capacity factor, nothing dropped"}


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MoEMLP(config) if config.mlp == MOE else SwiGLU(config)
        self.fns = slot_defaults(ADD_NORM)  # the attention's residual add and mlp_norm in one (None: unfused)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a = self.attn(self.attn_norm(x), cos, sin)  # (B, T, C)
        if self.fns[ADD_NORM] is None:
            x = x + a  # (B, T, C)
            return x + self.mlp(self.mlp_norm(x))  # (B, T, C)
        y, x = call_slot(self.fns, ADD_NORM, x, a, self.mlp_norm.weight, self.mlp_norm.eps)  # (B, T, C) each
        return x + self.mlp(y)  # (B, T, C)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, *, seed: int = 0,
                 fills: dict[str, Callable[..., Any]] | None = None) -> None:
        """fills: {slot: fn} swapped in once built (`swap`); the same seed gives the same weights whatever fills."""
        super().__init__()
        self.config = config
        # Initialise under a private RNG state: the same seed gives the same weights
        # whatever ran before, and the caller's global RNG is left as it was.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
            self.norm = RMSNorm(config.d_model, config.norm_eps)
            # Untied head: with a 256-byte vocab the embedding is <1% of the weights, so
            # tying saves nothing, and untied matches the Llama models the kernels target.
            self.lm_head = Linear(config.d_model, config.vocab_size)
            self._init_weights()
        cos, sin = slots.defaults()[ROPE_TABLES](config.max_seq_len, config.head_dim, config.rope_theta)
        # Not persistent: derived from the config, so checkpoints hold only learned weights.
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hs/2)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_seq_len, hs/2)
        self.fns = slot_defaults(LOSS)  # None: lm_head, then F.cross_entropy on the fp32 logits
        for slot, fn in (fills or {}).items():
            self.swap(slot, fn)

    def _init_weights(self) -> None:
        # GPT-2 init: N(0, 0.02), and the two projections that write into the residual
        # stream scaled by 1/sqrt(2 * n_layers) so its variance does not grow with depth.
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, mean=0.0, std=residual_std)
            elif param.dim() == 2:
                nn.init.normal_(param, mean=0.0, std=0.02)
            # 1-D parameters are RMSNorm weights: they stay at 1.

    def swap(self, slot: str, fn: Callable[..., Any]) -> None:
        """Run the same weights with `fn` in `slot` (model/slots.py: its contract), in every module that calls it.
        An unknown slot, or one this architecture does not call (experts in a dense model), is refused."""
        slots.check(slot)
        modules = [module for module in self.modules() if slot in getattr(module, "fns", {})]
        if not modules:
            raise ValueError(f"this model calls no {slot} slot (mlp={self.config.mlp!r})")
        for module in modules:
            module.fns[slot] = fn

    def slot(self, slot: str) -> Callable[..., Any] | None:
        """What runs in `slot` now (the same in every module that calls it: `swap` sets them all)."""
        slots.check(slot)
        return next(module.fns[slot] for module in self.modules() if slot in getattr(module, "fns", {}))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None, *,
               tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """idx (B, T) -> the normed last hidden state (B, T, C), what lm_head (and draft heads) read.

        With a cache, idx holds positions [cache.length, cache.length + T): their keys and values are
        appended to the cache and the attention sees every cached position (bottom-right causal).

        tree = (depth (T,) int64, visible (T, T) bool), with a cache only: idx is a flattened tree of
        candidates (posttrainllm/model/decode.py `speculative_tree`); entry i sits at RoPE position
        cache.length + depth[i] and attends to every cached position plus the entries visible[i] marks
        (its ancestors and itself), through the tree_attention slot. Its keys and values still
        fill the cache slots [length, length + T) in flattened order: the caller compacts them.
        """
        B, T = idx.shape
        start = 0 if cache is None else cache.length
        if start + T > self.config.max_seq_len:
            raise ValueError(f"sequence length {start + T} exceeds max_seq_len={self.config.max_seq_len}")
        mask = None
        if tree is None:
            cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]  # (T, hs/2)
        else:
            if cache is None:
                raise ValueError("a tree verification runs over a KV cache: pass cache=")
            depth, visible = tree  # (T,), (T, T)
            cos, sin = self.rope_cos[start + depth], self.rope_sin[start + depth]  # (T, hs/2): position = depth
            mask = torch.cat([visible.new_zeros((T, start)), ~visible], dim=1)  # (T, L + T), True = may NOT see
        x = self.tok_emb(idx)  # (B, T, C)
        try:
            for layer, block in enumerate(self.blocks):
                block.attn.cache = None if cache is None else (cache, layer)
                block.attn.tree_mask = mask
                x = block(x, cos, sin)  # (B, T, C)
        finally:
            for block in self.blocks:
                block.attn.cache = None
                block.attn.tree_mask = None
        if cache is not None:
            cache.length = start + T
        return self.norm(x)  # (B, T, C)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, cache: KVCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) int64 -> logits (B, T, V), mean cross-entropy (or None). See `hidden` for the cache."""
        B, T = idx.shape
        h = self.hidden(idx, cache)  # (B, T, C)
        if targets is not None and self.fns[LOSS] is not None:  # the head and the loss fused: no logits
            return None, call_slot(self.fns, LOSS, h.reshape(B * T, -1), self.lm_head.weight, targets.reshape(B * T))
        logits = self.lm_head(h)  # (B, T, V)
        if targets is None:
            return logits, None
        # Loss in fp32 whatever the autocast dtype: log-softmax over V is precision-sensitive.
        with record_function(slots.SLOTS[LOSS].profiler_range):
            loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
        return logits, loss
