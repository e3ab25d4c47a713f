"""Attention as a lab op: softmax(Q Kᵀ / √D + mask) V, causal or not, MHA / GQA / MQA.

Paths (one function each: checked, timed and trained):
    reference   posttrainllm.ops.attention.reference.attention: materialises the (S, S) scores
    sdpa        torch.nn.functional.scaled_dot_product_attention (PyTorch picks its backend; the model trains with it)
    sdpa_flash, sdpa_efficient, sdpa_cudnn, sdpa_math
                the same call pinned to one backend with torch.nn.attention.sdpa_kernel: each a peer of its
                own, registered only where it runs on the point's device, dtype and head dim (probed when
                the config is validated); the ones that do not run are named in the others' `backend`
    triton      posttrainllm.ops.attention.kernels: our FlashAttention-2 forward and backward
    compiled, flex (opt-in, op.peers): the reference under torch.compile; FlexAttention with a causal block
                mask (forward-only on the CPU, where PyTorch refuses its backward)
    user paths  op.user_impls, in the natural signature SIGNATURE (lab/isolation/user.py)

Shapes: q (B, H, S, D), k and v (B, Hkv, S, D) -> out (B, H, S, D), lse (B, H, S) fp32.
The row logsumexp is checked for the Triton path (its backward depends on it) against
the float64 reference, under its own fp32 contract; it is never timed as extra work:
the flash forward writes it in the same launch, and no other path computes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from posttrainllm.config import LabConfig, itemsize
from posttrainllm.ops.base import (LIBRARY, REFERENCE, BatchAxis, Case, Costs, Impl, ModelHook, OpDef, Tensors,
                                   seeded_randn, softmax_scale)
from posttrainllm.ops.autotune import AUTO_CPU_NOTE  # loaded with the definitions: no triton
from posttrainllm.ops.peers import compiled
import posttrainllm.ops.attention.config as op_config
import posttrainllm.ops.attention.reference as reference

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


_PROBE_CFG = LabConfig(op=op_config.Config())


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
                    paths[peer] = Impl(peer, "peer", _pinned_sdpa(peer), train=False,
                                       cost_model=_SDPA_COST_MODEL[peer], backend=(
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
    from posttrainllm.ops.attention.kernels import flash_attention_with_lse

    out, lse = flash_attention_with_lse(x["q"], x["k"], x["v"], causal=cfg.op.causal, sm_scale=cfg.op.sm_scale,
                                        **_triton_args(cfg),
                                        input_precision=cfg.precision.dot_precision, autotune=_autotune(cfg))
    return {"out": out, "lse": lse}


def _triton_geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
    """The launch geometry; with tile/workgroup=auto, what the autotuner chose for this case (CUDA), found by
    running the path once on the case's inputs, or that the fixed configuration ran (elsewhere)."""
    from posttrainllm.ops.attention.kernels import LAST_AUTOTUNE, attention_backward_launch, attention_launch

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
    REFERENCE: Impl(REFERENCE, "reference", _reference, backend="posttrainllm.ops.attention.reference.attention",
                    cost_model="materialised"),
    "sdpa": Impl("sdpa", "peer", _sdpa, backend="torch.nn.functional.scaled_dot_product_attention",
                 cost_model="sdpa"),
    "triton": Impl("triton", "triton", _triton, outputs=("out", "lse"), geometry=_triton_geometry,
                   backend="posttrainllm.ops.attention.flash_attention",
                   kernels={"forward": ("_attn_fwd_kernel",),
                            "backward": ("_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq")},
                   promises=("deterministic",),  # no atomics: every sum in one order (lab/invariance.py checks)
                   cost_model="fused"),
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


# --- each kind of path's own traffic (OpDef.path_costs; Impl.cost_model names one) --------------------------
#
# N = B·H·S·D and Nkv = B·Hkv·S·D elements (Q or O; K or V), P = B·H·S² (one (S, S) tensor per query head), s the
# point's itemsize; the causal mask's (S, S) bools are 1 byte each.


def _sizes(case: Case) -> tuple[int, int, int, int, int, int, int, int]:
    d = case.dims
    b, h, hkv, sl, hd = d["batch"], d["heads"], d["kv_heads"], d["seq_len"], d["head_dim"]
    return b, h, hkv, sl, hd, b * h * sl * hd, b * hkv * sl * hd, b * h * sl * sl


def _materialised(case: Case, cfg: LabConfig) -> Costs:
    """The readable reference (ops/reference.attention) as eager PyTorch runs it: each op reads its inputs and
    writes its outputs, in the point's dtype (measure/traffic.py counts the same, tests/test_traffic.py).

    forward: repeat K, V (read 2·Nkv, write 2·N); Q Kᵀ (2·N, P); · scale (P, P); causal: the mask (ones, triu:
    3·S² bools) and masked_fill (P + S², P); softmax (P, P); P V (P + N, N).
    backward: dP = dO Vᵀ (2·N, P); dV = Pᵀ dO (P + N, N); softmax's (2·P, P); causal: masked_fill's (P + S², P);
    · scale (P, P); dQ = dS K and dK = dSᵀ Q (2·(P + N), 2·N); GQA: the repeats' sums (2·N, 2·Nkv), else one
    copy (N, N).
    FLOPs: Q Kᵀ and P V over the whole (S, S), the masked half too: 4·B·H·S²·D.
    Working set: the inputs, the repeated K and V, O, and two (S, S) tensors alive at once (scores and the next)."""
    b, h, hkv, sl, hd, n, nkv, p = _sizes(case)
    size, causal = itemsize(cfg.precision.dtype), cfg.op.causal
    forward = size * ((8 if causal else 6) * p + 6 * n + 2 * nkv) + (4 * sl * sl if causal else 0)
    gqa = hkv != h
    backward = size * ((11 if causal else 9) * p + 10 * n + (2 * nkv if gqa else 0)) + (sl * sl if causal else 0)
    mask = "causal" if causal else "no mask"
    return Costs(4 * b * h * sl * sl * hd, forward, 2.5, "4*B*H*S^2*D (the whole (S, S): the masked half is computed "
                 "too)", f"s*({8 if causal else 6}*P + 6*N + 2*Nkv)" + (" + 4*S^2" if causal else "") +
                 f" ({mask}; P = B*H*S^2, N = B*H*S*D, Nkv = B*Hkv*S*D, s = itemsize)",
                 "backward = 2.5 x forward (five S^2*D matmuls against two)",
                 train_bytes=forward + backward,
                 train_bytes_formula=f"forward + s*({11 if causal else 9}*P + 10*N" + (" + 2*Nkv)" if gqa else ")")
                 + (" + S^2" if causal else ""),
                 working_set=size * (2 * p + 4 * n + 2 * nkv), working_set_formula="s*(2*P + 4*N + 2*Nkv)",
                 model="materialised",
                 note=f"the (S, S) scores and probabilities written and read in {cfg.precision.dtype}, forward and "
                      "backward, one eager op at a time (no cache between them)")


def _math(case: Case, cfg: LabConfig) -> Costs:
    """SDPA's MATH backend (ATen's _scaled_dot_product_attention_math), eager: it scales Q and K by √scale
    (2·N, 2·N), forms Q Kᵀ (3·N + P read with P V, P + N written), adds a causal bias it builds as an (S, S)
    tensor (ones, tril, where: S²·(4 + c) bytes; add: P + S²·c, P), softmax (P, P); GQA repeats K and V first
    (2·Nkv, 2·N). Backward: the four matmuls (5·N + 3·P, P + 3·N), softmax's (2·P, P), the scales' (2·N, 2·N) and
    the gradients of K and V (GQA: their sums, 2·N, 2·Nkv; else one copy in s, N, N). c: its compute itemsize, fp32
    for 16-bit inputs on the CPU, which then adds the casts of Q, K, V, O, dO, the gradients and one (S, S)."""
    b, h, hkv, sl, hd, n, nkv, p = _sizes(case)
    size, causal = itemsize(cfg.precision.dtype), cfg.op.causal
    upcast = _point_device(cfg) == "cpu" and size == 2
    c = 4 if upcast else size
    gqa = hkv != h
    forward = (c * ((6 if causal else 4) * p + 8 * n + (2 * nkv + 2 * n if gqa else 0))
               + (sl * sl * (2 * c + 4) + 16 if causal else 0))
    backward = c * (7 * p + 12 * n + (2 * n + 2 * nkv if gqa else 0)) + (0 if gqa else 2 * size * n)
    casts = ""
    if upcast:
        forward += (n + 2 * nkv) * (size + 4) + n * (4 + size) + p * (4 + size)
        backward += n * (size + 4) + (n + 2 * nkv) * (4 + size)
        casts = " + the fp32 casts: (2*N + 2*Nkv + P)*(s + 4) forward, (2*N + 2*Nkv)*(s + 4) backward"
    return Costs(4 * b * h * sl * sl * hd, forward, 2.5, "4*B*H*S^2*D (the whole (S, S))",
                 f"c*({6 if causal else 4}*P + 8*N" + (" + 2*Nkv + 2*N" if gqa else "") + ")"
                 + (" + S^2*(2*c + 4) + 16" if causal else "") + f"{casts} (c = {c})",
                 "backward = 2.5 x forward (five S^2*D matmuls against two)",
                 train_bytes=forward + backward,
                 train_bytes_formula="forward + c*(7*P + 12*N) + " + ("c*(2*N + 2*Nkv)" if gqa else "2*s*N"),
                 working_set=c * (2 * p + 4 * n), working_set_formula="c*(2*P + 4*N)", model="math",
                 note="ATen's math backend: the (S, S) scores and probabilities in "
                      f"{'float32' if upcast else cfg.precision.dtype}, forward and backward")


def _tile_keys(sl: int, block_q: int, causal: bool) -> tuple[int, int]:
    """(Σ over query tiles of the keys each reads, Σ of rows × keys it computes): tile i of block_q rows reads the
    keys up to its last row under the causal mask (its diagonal block in full), all S otherwise."""
    tiles = -(-sl // block_q)
    keys = [min((i + 1) * block_q, sl) if causal else sl for i in range(tiles)]
    rows = [min(block_q, sl - i * block_q) for i in range(tiles)]
    return sum(keys), sum(r * k for r, k in zip(rows, keys))


def _tile_rows(sl: int, block_kv: int, causal: bool) -> int:
    """Σ over key tiles of the query rows each reads (the dK/dV pass): rows from the tile's first key on, causal."""
    tiles = -(-sl // block_kv)
    return sum(sl - j * block_kv if causal else sl for j in range(tiles))


def _fused(case: Case, cfg: LabConfig, tile: dict[str, int], assumed: str) -> Costs:
    """A FlashAttention-2 kernel with these tiles: nothing (S, S) leaves the chip; each query tile re-reads K and V.

    forward: Q read and O written once (2·N), K and V per query tile of block_q rows, Σ_i k_i keys per head
    (k_i = min((i+1)·block_q, S) causal, S otherwise): 2·B·H·D·Σk_i; the logsumexp written (4·B·H·S).
    backward: delta = rowsum(dO∘O) (2·N read, 4·B·H·S written); dK/dV: K, V read and dK, dV written once
    (4·Nkv) while each key tile of dkdv_block_kv re-reads its query rows' Q, dO (2·D each) and lse, delta
    (8 B): B·H·Σr_j·(2·D·s + 8); dQ: Q, dO, lse, delta read and dQ written once, K and V per query tile of
    dq_block_q, as the forward.
    FLOPs: what the tiles compute, the diagonal tiles in full: 4·B·H·D·Σ_i rows_i·k_i."""
    b, h, hkv, sl, hd, n, nkv, _ = _sizes(case)
    size, causal = itemsize(cfg.precision.dtype), cfg.op.causal
    keys, pairs = _tile_keys(sl, tile["block_q"], causal)
    forward = size * (2 * n + 2 * b * h * hd * keys) + 4 * b * h * sl
    dq_keys, _ = _tile_keys(sl, tile["dq_block_q"], causal)
    rows = _tile_rows(sl, tile["dkdv_block_kv"], causal)
    backward = (size * 2 * n + 4 * b * h * sl  # delta
                + size * 4 * nkv + b * h * rows * (2 * hd * size + 8)  # dK/dV
                + size * 3 * n + 8 * b * h * sl + size * 2 * b * h * hd * dq_keys)  # dQ
    blocks = ", ".join(f"{k}={v}" for k, v in tile.items())
    return Costs(4 * b * h * hd * pairs, forward, 2.5, f"4*B*H*D*sum_i rows_i*k_i (tiles of block_q={tile['block_q']}"
                 ", the diagonal tile in full)",
                 "s*(2*N + 2*B*H*D*sum_i k_i) + 4*B*H*S (k_i = min((i+1)*block_q, S) causal, else S)",
                 "backward = 2.5 x forward (five S^2*D matmuls against two)",
                 train_bytes=forward + backward,
                 train_bytes_formula="forward + s*(5*N + 4*Nkv) + 12*B*H*S + B*H*sum_j r_j*(2*D*s + 8) "
                                     "+ s*2*B*H*D*sum_i k_i(dq_block_q) (r_j: query rows key tile j re-reads)",
                 working_set=size * (2 * n + 2 * nkv) + 4 * b * h * sl,
                 working_set_formula="s*(2*N + 2*Nkv) + 4*B*H*S (Q, K, V, O, lse)", model="fused",
                 note=f"tiles {blocks} ({assumed}); K/V re-read per query tile, no (S, S) in memory")


def _triton_tile(cfg: LabConfig) -> dict[str, int]:
    t = cfg.tile
    return {"block_q": t.block_q, "block_kv": t.block_kv, "dkdv_block_q": t.dkdv_block_q or t.block_q,
            "dkdv_block_kv": t.dkdv_block_kv or t.block_kv, "dq_block_q": t.dq_block_q or t.block_q,
            "dq_block_kv": t.dq_block_kv or t.block_kv}


def _triton_costs(case: Case, cfg: LabConfig) -> Costs:
    return _fused(case, cfg, _triton_tile(cfg), "tile." + cfg.tile.name + (", before autotune: the chosen tiles are "
                  "in the kernel's geometry" if cfg.tile.autotune else ""))


# ATen's CPU flash kernel splits the queries by S (32 below 192, 64 below 768, else 256) and the keys by 512;
# on CUDA the flash and memory-efficient kernels are taken at 128 x 64 (FlashAttention-2's forward at D <= 128)
def _sdpa_tile(case: Case, cfg: LabConfig) -> tuple[dict[str, int], str]:
    sl = case.dims["seq_len"]
    if _point_device(cfg) == "cpu":
        q_split = 32 if sl < 192 else 64 if sl < 768 else 256
        tile, assumed = (q_split, 512), "ATen's CPU flash kernel's query and key splits at this S"
    else:
        tile, assumed = (128, 64), "assumed: FlashAttention-2's 128 x 64 forward tile; the library's own choice"
    return ({"block_q": tile[0], "block_kv": tile[1], "dkdv_block_q": tile[0], "dkdv_block_kv": tile[1],
             "dq_block_q": tile[0], "dq_block_kv": tile[1]}, assumed)


def _sdpa_costs(case: Case, cfg: LabConfig, repeats: str = "fp32") -> Costs:
    """A fused SDPA backend at its tiles; where the path repeats K and V to H heads first (GQA; `repeats`: "fp32",
    the generic call's rule (_sdpa), "always" (the efficient and cuDNN backends), "never" (flash: enable_gqa)), a
    copy the fused kernel does not need: read 2·Nkv, write 2·N forward, summed back (2·N, 2·Nkv) in the backward."""
    tile, assumed = _sdpa_tile(case, cfg)
    costs = _fused(case, cfg, tile, assumed)
    b, h, hkv, sl, hd, n, nkv, _ = _sizes(case)
    if hkv == h or repeats == "never" or (repeats == "fp32" and cfg.precision.dtype in ("float16", "bfloat16")):
        return costs
    copy = itemsize(cfg.precision.dtype) * (2 * nkv + 2 * n)
    return dataclasses.replace(costs, bytes=costs.bytes + copy, bytes_formula=costs.bytes_formula
                               + " + s*(2*Nkv + 2*N) (K, V repeated to H heads first)",
                               train_bytes=costs.train_bytes + 2 * copy,
                               train_bytes_formula=costs.train_bytes_formula + " + 2*s*(2*Nkv + 2*N) (the repeats)",
                               working_set=costs.working_set + itemsize(cfg.precision.dtype) * 2 * n,
                               note=costs.note + "; K, V repeated to H heads first (fp32 GQA)")


PATH_COSTS = {"materialised": _materialised, "math": _math, "fused": _triton_costs, "sdpa": _sdpa_costs,
              "sdpa_native_gqa": lambda case, cfg: _sdpa_costs(case, cfg, "never"),
              "sdpa_repeated_kv": lambda case, cfg: _sdpa_costs(case, cfg, "always")}
_SDPA_COST_MODEL = {"sdpa_flash": "sdpa_native_gqa", "sdpa_efficient": "sdpa_repeated_kv",
                    "sdpa_cudnn": "sdpa_repeated_kv", "sdpa_math": "math"}


def _curve_case(cfg: LabConfig, x: int) -> Case:
    arch, seed = cfg.architecture, cfg.parity.seeds[0]
    dims = dict(batch=cfg.shape.batch, heads=arch.n_heads, kv_heads=arch.n_kv_heads, head_dim=arch.head_dim, seq_len=x)
    return Case(f"S{x}-seed{seed}", seed, dims, True)


# --- the model --------------------------------------------------------------------------


def _fill(impl: Impl, cfg: LabConfig) -> Callable[..., torch.Tensor]:
    """The model's causal self-attention calls `impl.fn` itself: the function checked and timed."""
    causal_cfg = dataclasses.replace(cfg, op=dataclasses.replace(cfg.op, causal=True))

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return impl.fn({"q": q, "k": k, "v": v}, causal_cfg)["out"]

    return attention


def _causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The model's default attention: the readable math, causal, materialising the (T, T) scores."""
    return reference.attention(q, k, v, causal=True)


def _model_problem(cfg: LabConfig) -> str:
    arch, train = cfg.architecture, cfg.train
    return f"B={train.batch_size} H={arch.n_heads} Hkv={arch.n_kv_heads} S={train.seq_len} D={arch.head_dim}"


# --- the peers users reach for, opt-in (op.peers) ------------------------------------------------


_FLEX: dict[str, Any] = {}


def _flex(x: Tensors, cfg: LabConfig) -> Tensors:
    """FlexAttention (torch.nn.attention.flex_attention) under torch.compile, with a causal block mask: the score
    modification a user writes instead of a kernel. GQA through enable_gqa. The mask is built per (S, device)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from posttrainllm.ops.peers import compiled_call, input_signature, signature_label

    q, k, v = x["q"], x["k"], x["v"]
    mask = None
    if cfg.op.causal:
        mask_key = ("mask", q.shape[2], str(q.device))
        if mask_key not in _FLEX:
            _FLEX[mask_key] = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B=None, H=None,
                                           Q_LEN=q.shape[2], KV_LEN=k.shape[2], device=str(q.device))
        mask = _FLEX[mask_key]
    # a fresh compiled copy per input signature, as the compiled peer (ops/peers.py): compiled code or it raises
    return {"out": compiled_call(("flex", input_signature(x), cfg.op.causal), flex_attention, signature_label(x),
                                 q, k, v, block_mask=mask, scale=cfg.op.sm_scale,
                                 enable_gqa=k.shape[1] != q.shape[1])}


FLEX_BACKEND = "torch.nn.attention.flex_attention.flex_attention (torch.compile, causal block mask)"
FLEX_CPU_NO_BACKWARD = "FlexAttention does not support backward on CPU (torch 2.13): forward-only here"


def _flex_peer(cfg: LabConfig) -> Impl:
    """Forward-only on the CPU, where PyTorch refuses its backward: recorded per point, not a failure."""
    from posttrainllm.ops.peers import EVIDENCE_NOTE, evidence, first_call_geometry

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
    make_inputs=_make_inputs, problem=_problem, costs=_costs, curve_case=_curve_case, model_hook=ModelHook("attention", _fill),
    model_problem=_model_problem, model_defaults={"attention": _causal_reference}, check_config=op_config.check_config,
    smem_bytes=op_config.point_smem_bytes,
    oracle_extra=_oracle_extra, row_ndim={"lse": 0},
    # Near one-hot rows stress the forward's online softmax. Their gradients cancel (dS = P∘(dP − D) with
    # P ≈ one-hot): a fused backward forms D = rowsum(dO∘O) from the rounded O, so SDPA's and our backward
    # both miss the per-row bound there in bf16/fp16 while the readable math (exact softmax backward) does not.
    forward_only_inputs=("near_one_hot",),
    gradient_baselines=(("exp(S - lse)", _reference_from_lse),),
    oracle_chunks=_oracle_chunks, reference_bytes=_reference_bytes, path_costs=PATH_COSTS,
    output_follows={"out": "q", "lse": "q", "grad_q": "q", "grad_k": "k", "grad_v": "v"},
    point_impls=_impls_for,
    optional_peers={"compiled": compiled(
        "attention", _reference, _make_inputs, "posttrainllm.ops.attention.reference.attention"), "flex": _flex_peer},
    reserved_names=tuple(SDPA_BACKENDS), optional_outputs=("lse",),
    signature=SIGNATURE, adapt=_adapt, template=TEMPLATE,
    batch_axis=BatchAxis("one sequence of one batch entry (every head and position of it)", {"q": 0, "k": 0, "v": 0},
                         {"out": 0, "lse": 0}),
)
