"""A small decoder-only transformer (Llama-shaped) whose attention is a switch.

Pre-norm blocks: x + attn(rmsnorm(x)), then x + mlp(rmsnorm(x)). RoPE on q and k,
causal self-attention with n_kv_heads <= n_heads (MHA, GQA, MQA), SwiGLU MLP, untied
head. Two calls are switches looked up by name, so the same weights can be trained
with the readable reference, PyTorch's fast path, or our Triton kernels, each handed
in as a function from the op's registry (posttrainllm/opdefs/):

    attention   (q, k, v) -> o, causal           default: the reference math
    linear      (x, weight) -> x @ weightᵀ       default: F.linear

Each call runs inside a profiler range (posttrainllm::attention, posttrainllm::matmul),
so train.py can measure the fraction of a step each op takes.

Speed switches (torch.compile, precision) belong to the runner (train.py), not here.

Shape legend
    B   batch           T    sequence length      C    d_model
    nh  query heads     nkv  key/value heads      hs   head_dim
    V   vocab size      F    mlp_hidden
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from posttrainllm.ops import reference


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
    rope_theta: float = 10000.0  # RoPE base: wavelengths from 2*pi up to ~theta*2*pi positions
    norm_eps: float = 1e-5  # RMSNorm epsilon; keeps rsqrt finite on an all-zero row

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
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps!r}")


# --------------------------------------------------------------------------- the two switches
# The model does not know which implementations exist: bench-train hands it the functions
# from the op's registry (posttrainllm/opdefs/), the same ones parity checked and the
# microbench timed. Contracts:
#   attention(q, k, v) -> o    q: (B, nh, T, hs), k and v: (B, nkv, T, hs) -> (B, nh, T, hs), causal, 1/sqrt(hs)
#   linear(x, weight) -> y     x: (..., in), weight: (out, in) -> (..., out) = x @ weightᵀ

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
LinearFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The default: the readable math, materialising the (T, T) scores."""
    return reference.attention(q, k, v, causal=True)


class Linear(nn.Linear):
    """nn.Linear (no bias) whose matmul is the switch `linear_fn`, inside a profiler range."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.linear_fn: LinearFn = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with record_function("posttrainllm::matmul"):
            return self.linear_fn(x, self.weight)


# --------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 so bf16/fp16 activations keep their scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight).type_as(x)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency: (T, hs/2) each, fp32.

    Pair i of a head rotates at frequency theta^(-2i/hs): fast near i=0, slow near hs/2.
    """
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (hs/2,)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)  # (T, hs/2)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[..., i], x[..., i + hs/2]) by its position's angle.

    x: (B, heads, T, hs); cos, sin: (T, hs/2). The "rotate half" layout of GPT-NeoX and
    Hugging Face Llama. Rotating q and k by their positions makes q·k depend only on
    the offset between them. Computed in fp32 and cast back to x's dtype.
    """
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, heads, T, hs/2) each
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, heads, T, hs)
    return rotated.type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.q_proj = Linear(config.d_model, config.n_heads * config.head_dim)
        self.k_proj = Linear(config.d_model, config.n_kv_heads * config.head_dim)
        self.v_proj = Linear(config.d_model, config.n_kv_heads * config.head_dim)
        self.o_proj = Linear(config.n_heads * config.head_dim, config.d_model)
        self.attention_fn: AttentionFn = reference_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        with record_function("posttrainllm::attention"):
            y = self.attention_fn(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, nh*hs)
        return self.o_proj(y)  # (B, T, C)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): a gated MLP, C -> F -> C."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.d_model, config.mlp_hidden)
        self.up_proj = Linear(config.d_model, config.mlp_hidden)
        self.down_proj = Linear(config.mlp_hidden, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, F) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # (B, T, C)
        return x + self.mlp(self.mlp_norm(x))  # (B, T, C)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, *, seed: int = 0, attention: AttentionFn | None = None,
                 linear: LinearFn | None = None) -> None:
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
        cos, sin = rope_tables(config.max_seq_len, config.head_dim, config.rope_theta)
        # Not persistent: derived from the config, so checkpoints hold only learned weights.
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hs/2)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_seq_len, hs/2)
        if attention is not None:
            self.set_attention(attention)
        if linear is not None:
            self.set_linear(linear)

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

    def set_attention(self, fn: AttentionFn) -> None:
        """Run the same weights with another attention implementation."""
        for block in self.blocks:
            block.attn.attention_fn = fn

    def set_linear(self, fn: LinearFn) -> None:
        """Run every projection (q, k, v, o, MLP, head) with another matmul."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.linear_fn = fn

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) int64 -> logits (B, T, V), mean cross-entropy (or None)."""
        B, T = idx.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.config.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, hs/2)
        x = self.tok_emb(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x, cos, sin)  # (B, T, C)
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        if targets is None:
            return logits, None
        # Loss in fp32 whatever the autocast dtype: log-softmax over V is precision-sensitive.
        loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
        return logits, loss
