"""Attention as a lab op: softmax(Q Kᵀ / √D + mask) V, causal or not, MHA / GQA / MQA.

Paths (one function each: checked, timed and trained):
    reference   posttrainllm.ops.reference.attention: materialises the (S, S) scores
    sdpa        torch.nn.functional.scaled_dot_product_attention (PyTorch picks its backend; the model trains with it)
    sdpa_flash, sdpa_efficient, sdpa_cudnn, sdpa_math
                the same call pinned to one backend with torch.nn.attention.sdpa_kernel: each a peer of its
                own, registered only where it runs on the point's device, dtype and head dim (probed when
                the config is validated); the ones that do not run are named in the others' `backend`
    triton      posttrainllm.ops.attention: our FlashAttention-2 forward and backward
    compiled, flex (opt-in, op.peers): the reference under torch.compile; FlexAttention with a causal block
                mask (forward-only on the CPU, where PyTorch refuses its backward)
    user paths  op.user_impls, in the natural signature SIGNATURE (opdefs/user.py)

Shapes: q (B, H, S, D), k and v (B, Hkv, S, D) -> out (B, H, S, D), lse (B, H, S) fp32.
The row logsumexp is checked for the Triton path (its backward depends on it) against
the float64 reference, under its own fp32 contract; it is never timed as extra work:
the flash forward writes it in the same launch, and no other path computes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from posttrainllm.config import ConfigError, LabConfig, itemsize, next_power_of_two
from posttrainllm.opdefs.base import (LIBRARY, REFERENCE, BatchAxis, Case, Costs, Impl, ModelHooks, OpDef, Tensors,
                                      seeded_randn, softmax_scale)
from posttrainllm.opdefs.peers import compiled
from posttrainllm.ops import reference

_SDPA = LIBRARY["torch.nn.functional.scaled_dot_product_attention"]  # bound at start (base.LIBRARY)

ADVERSARIAL = ("large_logits", "growing_logits", "near_one_hot")


# --- the paths -------------------------------------------------------------------------


def _reference(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": reference.attention(x["q"], x["k"], x["v"], causal=cfg.op.causal, sm_scale=cfg.op.sm_scale)}


def _reference_from_lse(x: Tensors, cfg: LabConfig) -> Tensors:
    """The reference with P = exp(S − lse): a flash backward's formulation (gradient_baselines)."""
    return {"out": reference.attention(x["q"], x["k"], x["v"], causal=cfg.op.causal,
                                       softmax=reference.softmax_from_logsumexp)}


def _sdpa(x: Tensors, cfg: LabConfig) -> Tensors:
    """PyTorch's fused attention. GQA: fp16/bf16 pass enable_gqa=True (the flash kernel reads the
    small K/V directly); fp32 repeats the K/V heads first, because on CUDA enable_gqa with fp32 leaves
    only the unfused MATH backend (pytorch/pytorch#181528), ~3x slower than repeat + mem-efficient."""
    q, k, v = x["q"], x["k"], x["v"]
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    if n_kv_heads != n_heads and q.dtype in (torch.float16, torch.bfloat16):
        return {"out": _SDPA(q, k, v, is_causal=cfg.op.causal, scale=cfg.op.sm_scale,
                                                      enable_gqa=True)}
    if n_kv_heads != n_heads:
        k, v = reference.repeat_kv(k, n_heads), reference.repeat_kv(v, n_heads)  # (B, H, S, D)
    return {"out": _SDPA(q, k, v, is_causal=cfg.op.causal, scale=cfg.op.sm_scale)}


# --- SDPA pinned to one backend: a peer per backend the point's device has -----------------

# name -> SDPBackend member; flash and math read the small K/V of GQA directly (enable_gqa), the
# efficient and cuDNN kernels get K/V repeated to H heads first (their GQA support varies by version)
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION",
                 "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_math": "MATH"}
_NATIVE_GQA = ("sdpa_flash", "sdpa_math")


def _pinned_sdpa(name: str):
    def fn(x: Tensors, cfg: LabConfig) -> Tensors:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = x["q"], x["k"], x["v"]
        gqa = k.shape[1] != q.shape[1]
        if gqa and name not in _NATIVE_GQA:
            k, v = reference.repeat_kv(k, q.shape[1]), reference.repeat_kv(v, q.shape[1])  # (B, H, S, D)
        with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[name])):  # only this backend: no silent fallback
            out = _SDPA(q, k, v, is_causal=cfg.op.causal, scale=cfg.op.sm_scale,
                                                 enable_gqa=gqa and name in _NATIVE_GQA)
        return {"out": out}

    fn.__name__ = f"_{name}"
    return fn


def _point_device(cfg: LabConfig) -> str:
    if cfg.device.name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device.name


_PROBES: dict[tuple, str | None] = {}


def _probe(name: str, device: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
           causal: bool, seq_lens: tuple[int, ...] = (64,)) -> str | None:
    """None if the backend runs forward and backward on a batch of one at each of `seq_lens` (a problem of the
    point's kind), else why not. Any exception is a refusal: torch raises RuntimeError ("No available kernel")
    for a backend that cannot take the inputs, but a backend's own checks may raise other types."""
    key = (name, device, dtype, heads, kv_heads, head_dim, causal, seq_lens)
    if key not in _PROBES:
        if device == "cuda" and not torch.cuda.is_available():
            _PROBES[key] = "no CUDA device"
        else:
            try:
                for s in seq_lens:
                    q = torch.randn(1, heads, s, head_dim, device=device, dtype=dtype, requires_grad=True)
                    k = torch.randn(1, kv_heads, s, head_dim, device=device, dtype=dtype, requires_grad=True)
                    probe_cfg = dataclasses.replace(_PROBE_CFG, op=dataclasses.replace(_PROBE_CFG.op, causal=causal))
                    out = _pinned_sdpa(name)({"q": q, "k": k, "v": k}, probe_cfg)["out"]
                    out.backward(torch.randn_like(out))  # a dO of out's strides, as the stages pass (not a
                    # stride-0 `.sum()` gradient, which some fused backwards refuse or copy)
                _PROBES[key] = None
            except Exception as exc:
                message = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
                at = f" at S={s}" if len(seq_lens) > 1 else ""
                _PROBES[key] = f"{type(exc).__name__}{at}: {message}" if message else f"{type(exc).__name__}{at}"
    return _PROBES[key]


def _probe_lengths(cfg: LabConfig, device: str) -> tuple[int, ...]:
    """S=64; on CUDA also the lengths the kernel stage runs (the point's own and its edges: S=1, S=1000 are off
    every tile), so that a backend refusing one of them (cuDNN's, say) is absent, not a failed path. On the GPU
    each probe takes milliseconds; the CPU keeps the one small probe."""
    if device != "cuda":
        return (64,)
    return tuple(sorted({64, cfg.shape.seq_len, *cfg.shape.edge_seq_lens}))


_PROBE_CFG = LabConfig()


def absent_backends(cfg: LabConfig) -> dict[str, str]:
    """{SDPA backend peer: why it does not run} on the point's device, dtype, head dim and causal mask."""
    device, dtype = _point_device(cfg), getattr(torch, cfg.precision.dtype)
    arch = cfg.architecture
    lengths = _probe_lengths(cfg, device)
    return {name: why for name in SDPA_BACKENDS
            if (why := _probe(name, device, dtype, arch.n_heads, arch.n_kv_heads, arch.head_dim, cfg.op.causal,
                              lengths))}


def _impls_for(cfg: LabConfig) -> dict[str, Impl]:
    """The registry for this point: the SDPA backend peers that run here, placed before the `triton` path.
    Each one's `backend` names the absent ones, so kernel.json and the receipt say what this device lacks."""
    absent = absent_backends(cfg)
    note = (f"; absent on {_point_device(cfg)} {cfg.precision.dtype} D={cfg.architecture.head_dim}: "
            f"{', '.join(absent)}" if absent else "")
    paths: dict[str, Impl] = {}
    for name, impl in IMPLS.items():
        if name == "triton":
            for peer in SDPA_BACKENDS:
                if peer not in absent:
                    paths[peer] = Impl(peer, "peer", _pinned_sdpa(peer), train=False, backend=(
                        "torch.nn.functional.scaled_dot_product_attention under "
                        f"sdpa_kernel(SDPBackend.{SDPA_BACKENDS[peer]}){note}"))
        paths[name] = impl
    return paths


# --- ours ------------------------------------------------------------------------------------


def _autotune(cfg: LabConfig) -> str | None:
    """tile=auto tunes blocks, warps and stages jointly; workgroup=auto warps and stages alone."""
    return "tile" if cfg.tile.autotune else "workgroup" if cfg.workgroup.autotune else None


def _triton_args(cfg: LabConfig) -> dict[str, Any]:
    t, w = cfg.tile, cfg.workgroup
    return dict(block_q=t.block_q, block_kv=t.block_kv, num_warps=w.num_warps, num_stages=w.num_stages,
                dkdv_block_q=t.dkdv_block_q, dkdv_block_kv=t.dkdv_block_kv, dq_block_q=t.dq_block_q,
                dq_block_kv=t.dq_block_kv)


def _triton(x: Tensors, cfg: LabConfig) -> Tensors:
    from posttrainllm.ops.attention import flash_attention_with_lse

    out, lse = flash_attention_with_lse(x["q"], x["k"], x["v"], causal=cfg.op.causal, sm_scale=cfg.op.sm_scale,
                                        **_triton_args(cfg),
                                        input_precision=cfg.precision.dot_precision, autotune=_autotune(cfg))
    return {"out": out, "lse": lse}


def _triton_geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
    """The launch geometry; with tile/workgroup=auto, what the autotuner chose for this case (CUDA), found by
    running the path once on the case's inputs, or that the fixed configuration ran (elsewhere)."""
    from posttrainllm.ops.attention import AUTO_CPU_NOTE, LAST_AUTOTUNE, attention_backward_launch, attention_launch

    d = case.dims
    args = _triton_args(cfg)
    blocks = {k: args[k] for k in ("block_q", "block_kv", "num_warps", "num_stages")}
    forward = attention_launch(d["batch"], d["heads"], d["seq_len"], d["head_dim"], **blocks)
    backward = attention_backward_launch(d["batch"], d["heads"], d["kv_heads"], d["seq_len"], d["head_dim"], **args)
    geometry = {**forward, "backward": backward}
    mode = _autotune(cfg)
    if mode is None:
        return geometry
    if _point_device(cfg) != "cuda":
        return {**geometry, "autotune": {"mode": mode, "chosen": None, "note": AUTO_CPU_NOTE}}
    x = {name: t.requires_grad_() for name, t in _make_inputs(case, getattr(torch, cfg.precision.dtype),
                                                                "cuda").items()}
    LAST_AUTOTUNE.clear()
    try:
        out = _triton(x, cfg)["out"]  # tunes (or reuses the tuning for) the forward, then dK/dV and dQ on a dO
        out.backward(torch.randn_like(out))  # of real strides (`.sum()`'s would be a stride-0 broadcast)
    except Exception as exc:  # the geometry is read outside the kernel stage's per-path guard: the path's own
        # cases raise again there and record the failure against this path; here, say why nothing was chosen
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return {**geometry, "autotune": {"mode": mode, "chosen": dict(LAST_AUTOTUNE) or None,
                                         "error": f"{type(exc).__name__}: {message}"}}
    # The tuners' key holds the problem size (S, B·H) beside (HEAD_DIM, CAUSAL, KV_GROUP) and the dtypes: this is
    # the choice at the point's own shape; every other S of the point (edges, curve) is tuned on its own.
    return {**geometry, "autotune": {"mode": mode, "chosen": dict(LAST_AUTOTUNE),
                                     "note": "chosen by triton.autotune on this device (smem-pruned)"}}


IMPLS = {
    REFERENCE: Impl(REFERENCE, "reference", _reference, backend="posttrainllm.ops.reference.attention"),
    "sdpa": Impl("sdpa", "peer", _sdpa, backend="torch.nn.functional.scaled_dot_product_attention"),
    "triton": Impl("triton", "triton", _triton, outputs=("out", "lse"), geometry=_triton_geometry,
                   backend="posttrainllm.ops.attention.flash_attention",
                   kernels={"forward": ("_attn_fwd_kernel",),
                            "backward": ("_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq")},
                   promises=("deterministic",)),  # no atomics: every sum in one order (lab/invariance.py checks)
}


def _oracle_extra(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"lse": reference.attention_logsumexp(x["q"], x["k"], causal=cfg.op.causal, sm_scale=cfg.op.sm_scale)}


# --- cases and inputs -------------------------------------------------------------------


SCALE_CASE_FACTOR = 2.5  # the sm_scale case: this times the point's softmax scale (a path that ignores it fails)


def _cases(cfg: LabConfig) -> list[Case]:
    """The point's shape and edge lengths (off every tile, S=1: the causal boundary) per seed, then on the first
    seed: adversarial inputs at the point's shape, one edge length at another softmax scale (a path that ignores
    sm_scale fails), and the shape bench-train trains at (causal: the model's mask), unless a case has it already."""
    shape, arch = cfg.shape, cfg.architecture
    heads = dict(batch=shape.batch, heads=arch.n_heads, kv_heads=arch.n_kv_heads, head_dim=arch.head_dim)
    out = []
    for seed in cfg.parity.seeds:
        out.append(Case(f"S{shape.seq_len}-seed{seed}", seed, {**heads, "seq_len": shape.seq_len}, True))
        out += [Case(f"S{s}-seed{seed}", seed, {**heads, "batch": 1, "seq_len": s}, False)
                for s in shape.edge_seq_lens]
    seed = cfg.parity.seeds[0]
    out += [Case(f"S{shape.seq_len}-{kind}", seed, {**heads, "seq_len": shape.seq_len}, False, kind)
            for kind in ADVERSARIAL]
    s = min([s for s in shape.edge_seq_lens if s > 1] or [shape.seq_len])  # S=1: softmax 1 whatever the scale
    scale = round(SCALE_CASE_FACTOR * softmax_scale(cfg, arch.head_dim), 6)
    out.append(Case(f"S{s}-sm_scale{scale:g}", seed, {**heads, "batch": 1, "seq_len": s}, False,
                    options={"sm_scale": scale}))
    return out + train_case(cfg, out, heads, ("seq_len",), seed, {} if cfg.op.causal else {"causal": True})


def train_case(cfg: LabConfig, cases: list[Case], heads: dict[str, int], length_dims: tuple[str, ...], seed: int,
               options: dict[str, Any]) -> list[Case]:
    """The problem bench-train trains the path at (train.batch_size sequences of train.seq_len, the architecture's
    heads; `options`: the model's, e.g. its causal mask), as a parity case unless one of `cases` is it already."""
    train = cfg.train
    dims = {**heads, "batch": train.batch_size, **{d: train.seq_len for d in length_dims}}
    if any(c.dims == dims and c.options == options and c.inputs == "normal" for c in cases):
        return []
    return [Case(f"S{train.seq_len}-B{train.batch_size}-train", seed, dims, False, options=options)]


def _make_inputs(case: Case, dtype: torch.dtype, device: str) -> Tensors:
    """Standard-normal q, k, v drawn in fp32 from the case's seed, shaped by the case's input kind,
    then cast to the point's dtype.

    large_logits    q scaled so the scaled scores have std 10 (maxima near ±30 and beyond)
    growing_logits  keys drift along q's mean direction, so scores rise with the key index (~6 over
                    the sequence): later KV blocks raise the running max (the online-softmax rescale path)
    near_one_hot    query i is 2x key i (its own position, visible under the causal mask):
                    one score per row dominates the rest by ~2·√D (>= 11 at D=32: weight >= 0.99)
    """
    d = case.dims
    b, h, hkv, s, hd = d["batch"], d["heads"], d["kv_heads"], d["seq_len"], d["head_dim"]
    randn = seeded_randn(case.seed, torch.float32, "cpu")
    q, k, v = randn(b, h, s, hd), randn(b, hkv, s, hd), randn(b, hkv, s, hd)  # (B, H|Hkv, S, D)
    if case.inputs == "large_logits":
        q = q * 10.0
    elif case.inputs == "growing_logits":
        direction = torch.ones(hd) / hd ** 0.5
        q = q + 2.0 * direction
        ramp = torch.linspace(0.0, 3.0 * hd ** 0.5, s)[:, None] * direction  # (S, D): scores rise ~6 over S
        k = k + ramp
    elif case.inputs == "near_one_hot":
        q = 2.0 * reference.repeat_kv(k, h) + 0.1 * q
    elif case.inputs != "normal":
        raise ValueError(f"unknown attention input kind {case.inputs!r}: valid are normal, {', '.join(ADVERSARIAL)}")
    return {name: t.to(device=device, dtype=dtype) for name, t in (("q", q), ("k", k), ("v", v))}


def _problem(case: Case) -> str:
    d = case.dims
    return f"B={d['batch']} H={d['heads']} Hkv={d['kv_heads']} S={d['seq_len']} D={d['head_dim']}"


def _costs(case: Case, cfg: LabConfig) -> Costs:
    """FLOPs: Q Kᵀ and P V are each 2·S·S·D per head -> 4·B·H·S²·D; causal keeps about half. The
    softmax's exp/sum/max are O(S²) and left out, as FlashAttention's papers do. Backward: 2.5x the
    forward (FlashAttention's convention: five S²·D matmuls against the forward's two).
    Bytes: read Q (B·H·S·D), K and V (B·Hkv·S·D each), write O (B·H·S·D); a naive implementation
    also writes and reads the (S, S) scores, so this is the floor a fused kernel can reach."""
    d, size = case.dims, itemsize(cfg.precision.dtype)
    flops = 4 * d["batch"] * d["heads"] * d["seq_len"] ** 2 * d["head_dim"]
    flops = flops // 2 if cfg.op.causal else flops
    nbytes = (2 * d["batch"] * d["heads"] + 2 * d["batch"] * d["kv_heads"]) * d["seq_len"] * d["head_dim"] * size
    return Costs(flops, nbytes, 2.5, "4*B*H*S^2*D (x0.5 causal)", "(2*B*H + 2*B*Hkv)*S*D*itemsize",
                 "backward = 2.5 x forward (FlashAttention: 5 vs 2 S^2*D matmuls)")


def _curve_case(cfg: LabConfig, x: int) -> Case:
    arch, seed = cfg.architecture, cfg.parity.seeds[0]
    dims = dict(batch=cfg.shape.batch, heads=arch.n_heads, kv_heads=arch.n_kv_heads, head_dim=arch.head_dim, seq_len=x)
    return Case(f"S{x}-seed{seed}", seed, dims, True)


# --- the model --------------------------------------------------------------------------


def _model_hooks(impl: Impl, cfg: LabConfig) -> ModelHooks:
    """The model's causal self-attention calls `impl.fn` itself: the function checked and timed."""
    causal_cfg = dataclasses.replace(cfg, op=dataclasses.replace(cfg.op, causal=True))

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return impl.fn({"q": q, "k": k, "v": v}, causal_cfg)["out"]

    return ModelHooks(attention=attention)


def _model_problem(cfg: LabConfig) -> str:
    arch, train = cfg.architecture, cfg.train
    return f"B={train.batch_size} H={arch.n_heads} Hkv={arch.n_kv_heads} S={train.seq_len} D={arch.head_dim}"


def _check_config(cfg: LabConfig) -> None:
    """A block larger than the sequence, or Q + (K, V) per pipeline stage over the shared memory, is refused.

    Shared memory per program: (BLOCK_Q + 2·BLOCK_KV·num_stages) · D · itemsize.
    """
    tile, shape = cfg.tile, cfg.shape
    bound = max(16, next_power_of_two(shape.seq_len))
    for block in ("block_q", "block_kv", "dkdv_block_q", "dkdv_block_kv", "dq_block_q", "dq_block_kv"):
        if getattr(tile, block) is None:
            continue
        if getattr(tile, block) > bound:
            raise ConfigError(f"tile.{block}={getattr(tile, block)} does not fit shape.seq_len={shape.seq_len}: "
                              f"use a block <= {bound}")
    smem = (tile.block_q + 2 * tile.block_kv * cfg.workgroup.num_stages) * cfg.architecture.head_dim * itemsize(
        cfg.precision.dtype)
    if smem > cfg.device.smem_bytes:
        raise ConfigError(f"tile {tile.name} with num_stages={cfg.workgroup.num_stages} needs {smem} B of shared "
                          f"memory per program, over device.smem_bytes={cfg.device.smem_bytes}")


# --- the peers users reach for, opt-in (op.peers) ------------------------------------------------


_FLEX: dict[str, Any] = {}


def _flex(x: Tensors, cfg: LabConfig) -> Tensors:
    """FlexAttention (torch.nn.attention.flex_attention) under torch.compile, with a causal block mask: the score
    modification a user writes instead of a kernel. GQA through enable_gqa. The mask is built per (S, device)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from posttrainllm.opdefs.peers import compiled_call, input_signature, signature_label

    q, k, v = x["q"], x["k"], x["v"]
    mask = None
    if cfg.op.causal:
        mask_key = ("mask", q.shape[2], str(q.device))
        if mask_key not in _FLEX:
            _FLEX[mask_key] = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B=None, H=None,
                                           Q_LEN=q.shape[2], KV_LEN=k.shape[2], device=str(q.device))
        mask = _FLEX[mask_key]
    # a fresh compiled copy per input signature, as the compiled peer (opdefs/peers.py): compiled code or it raises
    return {"out": compiled_call(("flex", input_signature(x), cfg.op.causal), flex_attention, signature_label(x),
                                 q, k, v, block_mask=mask, scale=cfg.op.sm_scale,
                                 enable_gqa=k.shape[1] != q.shape[1])}


FLEX_BACKEND = "torch.nn.attention.flex_attention.flex_attention (torch.compile, causal block mask)"
FLEX_CPU_NO_BACKWARD = "FlexAttention does not support backward on CPU (torch 2.13): forward-only here"


def _flex_peer(cfg: LabConfig) -> Impl:
    """Forward-only on the CPU, where PyTorch refuses its backward: recorded per point, not a failure."""
    from posttrainllm.opdefs.peers import EVIDENCE_NOTE, evidence, first_call_geometry

    cpu = _point_device(cfg) != "cuda"
    backend = FLEX_BACKEND + (f"; {FLEX_CPU_NO_BACKWARD}" if cpu else "")
    return Impl("flex", "peer", _flex, train=False, backward="none" if cpu else "own", backend=backend,
                geometry=first_call_geometry(_flex, _make_inputs, FLEX_BACKEND),
                evidence=lambda: {"note": EVIDENCE_NOTE, "signatures": evidence(("flex",))})


# --- a user path: its natural signature ---------------------------------------------------


SIGNATURE = ("fn(q, k, v, *, causal: bool, sm_scale: float) -> out, or (out, lse); q (B, H, S, D), k and v "
             "(B, Hkv, S, D) with H a multiple of Hkv (GQA: query head h reads K/V head h // (H // Hkv)); out "
             "(B, H, S, D) in q's dtype; lse, if returned, (B, H, S) fp32, the natural-log row logsumexp of the "
             "scaled, masked scores (checked too)")

TEMPLATE = '''
import math

import torch


def {name}(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, sm_scale: float) -> torch.Tensor:
    """softmax(Q Kᵀ · sm_scale + causal mask) V.

    q: (B, H, S, D); k, v: (B, Hkv, S, D), H a multiple of Hkv -> out (B, H, S, D) in q's dtype.
    Optionally return (out, lse) with lse (B, H, S) fp32, the row logsumexp of the scaled, masked scores.
    The lab checks it against float64 math: per element, per row, forward and gradients (autograd through
    this function, or your own torch.autograd.Function); a result without autograd history is forward-only.
    """
    n_heads, seq_len = q.shape[1], q.shape[2]
    k = k.repeat_interleave(n_heads // k.shape[1], dim=1)  # (B, H, S, D)
    v = v.repeat_interleave(n_heads // v.shape[1], dim=1)  # (B, H, S, D)
    scores = (q.float() @ k.float().transpose(-2, -1)) * sm_scale  # (B, H, S, S)
    if causal:
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # (B, H, S, S)
    return (probs @ v.float()).to(q.dtype)  # (B, H, S, D)
'''


def _adapt(fn: Any) -> Any:
    def path(x: Tensors, cfg: LabConfig) -> Tensors:
        q = x["q"]
        got = fn(q, x["k"], x["v"], causal=cfg.op.causal, sm_scale=softmax_scale(cfg, q.shape[-1]))
        if isinstance(got, (tuple, list)) and len(got) == 2:
            return {"out": got[0], "lse": got[1]}
        return {"out": got}

    path.__name__ = getattr(fn, "__name__", "user")
    return path


def _oracle_chunks(case: Case) -> list[dict[str, tuple]]:
    """One piece per (batch, kv head): its query heads and its K/V, so a piece holds G·S² scores, not B·H·S²."""
    d = case.dims
    group = d["heads"] // d["kv_heads"]
    return [{"q": (slice(b, b + 1), slice(g * group, (g + 1) * group)),
             "k": (slice(b, b + 1), slice(g, g + 1)), "v": (slice(b, b + 1), slice(g, g + 1))}
            for b in range(d["batch"]) for g in range(d["kv_heads"])]


def _reference_bytes(case: Case, cfg: LabConfig) -> int:
    """The reference stage's peak, estimated: a piece's float64 scores live as ~6 (G, S, S) tensors through
    autograd (scores, masked, probs, their gradients), next to the whole problem's inputs, outputs and
    gradients in float64, in the point's precision and in fp32 (about 10 copies of Q, K, V, O)."""
    d = case.dims
    group = d["heads"] // d["kv_heads"]
    piece = 6 * group * d["seq_len"] ** 2 * 8
    tensors = 10 * (2 * d["heads"] + 2 * d["kv_heads"]) * d["batch"] * d["seq_len"] * d["head_dim"] * 8
    return piece + tensors


OP = OpDef(
    name="attention", x_name="seq_len", input_names=("q", "k", "v"), impls=IMPLS, cases=_cases,
    make_inputs=_make_inputs, problem=_problem, costs=_costs, curve_case=_curve_case, model_hooks=_model_hooks,
    model_problem=_model_problem, profiled_range="attention", check_config=_check_config,
    oracle_extra=_oracle_extra, row_ndim={"lse": 0},
    # Near one-hot rows stress the forward's online softmax. Their gradients cancel (dS = P∘(dP − D) with
    # P ≈ one-hot): a fused backward forms D = rowsum(dO∘O) from the rounded O, so SDPA's and our backward
    # both miss the per-row bound there in bf16/fp16 while the readable math (exact softmax backward) does not.
    forward_only_inputs=("near_one_hot",),
    gradient_baselines=(("exp(S - lse)", _reference_from_lse),),
    oracle_chunks=_oracle_chunks, reference_bytes=_reference_bytes,
    output_follows={"out": "q", "lse": "q", "grad_q": "q", "grad_k": "k", "grad_v": "v"},
    point_impls=_impls_for,
    optional_peers={"compiled": compiled(
        "attention", _reference, _make_inputs, "posttrainllm.ops.reference.attention"), "flex": _flex_peer},
    reserved_names=tuple(SDPA_BACKENDS), optional_outputs=("lse",),
    signature=SIGNATURE, adapt=_adapt, template=TEMPLATE,
    batch_axis=BatchAxis("one sequence of one batch entry (every head and position of it)", {"q": 0, "k": 0, "v": 0},
                         {"out": 0, "lse": 0}),
)
