"""Decode attention as a lab op: a query chunk against a KV cache, causal mask aligned bottom-right.

    o = softmax(Q Kᵀ / √D + M) V,   q (B, H, Sq, D), k and v (B, Hkv, Sk, D), Sq <= Sk -> o (B, H, Sq, D)
    M: query i of the chunk (position i + Sk − Sq) sees keys j <= i + Sk − Sq

Sq = 1 is one decode step; Sq = K + 1 is a speculative verification (posttrainllm/model/decode.py).

Paths (one function each: checked, timed and trained):
    reference   posttrainllm.ops.decode_attention.reference.chunk_attention: materialises the (Sq, Sk) scores
    sdpa        torch SDPA. Its `is_causal` aligns the mask top-left when Sq != Sk (query i sees j <= i),
                which is wrong for a chunk at the end of a cache: it gets an explicit boolean mask there
                (none at Sq = 1, where every key is visible; is_causal only when Sq == Sk)
    triton      posttrainllm.ops.decode_attention.kernels: split-KV (flash-decoding) forward, GQA groups read K/V once;
                its backward is the readable math's (decoding is inference; see the kernel's docstring), declared
                borrowed (backward="reference"): parity shows its gradients as not checked, never as a pass

Opt-in (op.peers): compiled, the reference under torch.compile. User paths (op.user_impls) take the
natural signature SIGNATURE (lab/isolation/user.py).

The microbench's figure is the bandwidth: bytes of KV cache read per second against the calibrated copy
bandwidth (the roofline), over the context length Sk (`shape.curve` as Sk, Sq = 1).
"""

from __future__ import annotations

import dataclasses

from typing import Any, Callable

import torch

from posttrainllm.config import LabConfig, itemsize
from posttrainllm.ops.base import (LIBRARY, REFERENCE, BatchAxis, Case, Costs, Impl, ModelHook, OpDef, Tensors,
                                   check_smem, seeded_randn, softmax_scale)
from posttrainllm.ops.attention.definition import SCALE_CASE_FACTOR, train_case
from posttrainllm.ops.decode_attention.config import Sizes
from posttrainllm.ops.peers import compiled
import posttrainllm.ops.attention.reference as attention_reference
import posttrainllm.ops.decode_attention.reference as decode_attention_reference

_SDPA = LIBRARY["torch.nn.functional.scaled_dot_product_attention"]  # bound at start (base.LIBRARY)

# --- the paths -------------------------------------------------------------------------


def _reference(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": decode_attention_reference.chunk_attention(x["q"], x["k"], x["v"], sm_scale=cfg.op.sm_scale)}


def _reference_from_lse(x: Tensors, cfg: LabConfig) -> Tensors:
    """The reference with P = exp(S − lse): a flash backward's formulation (gradient_baselines)."""
    return {"out": decode_attention_reference.chunk_attention(x["q"], x["k"], x["v"], softmax=attention_reference.softmax_from_logsumexp)}


def _sdpa(x: Tensors, cfg: LabConfig) -> Tensors:
    """SDPA with the bottom-right mask made explicit (is_causal is top-left when Sq != Sk). GQA as in
    ops/attention/definition.py: enable_gqa for fp16/bf16, K/V heads repeated for fp32 (pytorch/pytorch#181528)."""
    q, k, v = x["q"], x["k"], x["v"]
    q_len, kv_len = q.shape[2], k.shape[2]
    mask = None if q_len == 1 else ~decode_attention_reference.chunk_causal_mask(q_len, kv_len, q.device)  # (Sq, Sk), True = attend
    options: dict[str, Any] = {"is_causal": True} if q_len == kv_len else {"attn_mask": mask}
    options["scale"] = cfg.op.sm_scale
    if k.shape[1] != q.shape[1] and q.dtype in (torch.float16, torch.bfloat16):
        return {"out": _SDPA(q, k, v, enable_gqa=True, **options)}
    if k.shape[1] != q.shape[1]:
        k, v = attention_reference.repeat_kv(k, q.shape[1]), attention_reference.repeat_kv(v, q.shape[1])  # (B, H, Sk, D)
    return {"out": _SDPA(q, k, v, **options)}


def _triton_options(cfg: LabConfig) -> dict[str, Any]:
    t, w = cfg.tile, cfg.workgroup
    return dict(block_q=t.block_q, block_kv=t.block_kv, split_blocks=cfg.op.kv_split_blocks, num_warps=w.num_warps,
                num_stages=w.num_stages, input_precision=cfg.precision.dot_precision, sm_scale=cfg.op.sm_scale)


def _triton(x: Tensors, cfg: LabConfig) -> Tensors:
    from posttrainllm.ops.decode_attention.kernels import decode_attention

    return {"out": decode_attention(x["q"], x["k"], x["v"], **_triton_options(cfg))}


def _triton_geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
    from posttrainllm.ops.decode_attention.kernels import decode_attention_launch

    d, options = case.dims, _triton_options(cfg)
    options.pop("input_precision")
    options.pop("sm_scale")
    return {**decode_attention_launch(d["batch"], d["heads"], d["kv_heads"], d["q_len"], d["kv_len"], d["head_dim"],
                                      **options),
            "backward": "posttrainllm.ops.decode_attention.reference.chunk_attention (recomputed; decoding never trains)"}


IMPLS = {
    REFERENCE: Impl(REFERENCE, "reference", _reference, backend="posttrainllm.ops.decode_attention.reference.chunk_attention",
                    cost_model="materialised"),
    "sdpa": Impl("sdpa", "peer", _sdpa,
                 backend="torch.nn.functional.scaled_dot_product_attention (explicit bottom-right mask when Sq != Sk)"),
    "triton": Impl("triton", "triton", _triton, geometry=_triton_geometry,
                   backend="posttrainllm.ops.decode_attention.decode_attention (forward; backward: reference math)",
                   backward=REFERENCE,  # the kernel recomputes the readable math's backward: not its own
                   kernels={"forward": ("_chunk_attn_split_kernel", "_chunk_attn_combine_kernel")},
                   promises=("deterministic",),  # no atomics: every sum in one order (lab/invariance.py checks)
                   cost_model="split"),
}


# --- cases and inputs -------------------------------------------------------------------


def _case(name: str, seed: int, cfg: LabConfig, q_len: int, kv_len: int, *, kv_heads: int | None = None,
          main: bool = False, inputs: str = "normal", options: dict[str, Any] | None = None) -> Case:
    arch = cfg.architecture
    dims = dict(batch=cfg.shape.batch, heads=arch.n_heads, kv_heads=kv_heads or arch.n_kv_heads,
                head_dim=arch.head_dim, q_len=q_len, kv_len=kv_len)
    return Case(name, seed, dims, main, inputs, options=options or {})


def _cases(cfg: LabConfig) -> list[Case]:
    """The main decode step (Sq = 1 against shape.ops.decode_attention.kv_len keys), then every Sq <= Sk pair of its
    sizes' lengths per seed; on the first seed, the other KV-head layouts (MHA, GQA with 2 query heads per
    KV head, MQA) the architecture is not, large logits (scores with std ~10), the smallest chunk at another
    softmax scale (a path that ignores sm_scale fails), and bench-train's full sequence (Sq = Sk = train.seq_len,
    train.batch_size) unless a case has it already."""
    sizes, arch = Sizes.of(cfg), cfg.architecture
    out = []
    for seed in cfg.parity.seeds:
        out.append(_case(f"Sq1-Sk{sizes.kv_len}-seed{seed}", seed, cfg, 1, sizes.kv_len, main=True))
        out += [_case(f"Sq{sq}-Sk{sk}-seed{seed}", seed, cfg, sq, sk)
                for sq in sizes.q_lens for sk in sizes.kv_lens if sq <= sk]
    seed = cfg.parity.seeds[0]
    sq, sk = max(s for s in sizes.q_lens if s <= max(sizes.kv_lens)), max(sizes.kv_lens)
    for kv_heads in sorted({arch.n_heads, arch.n_heads // 2 if arch.n_heads % 2 == 0 else 1, 1} - {arch.n_kv_heads}):
        out.append(_case(f"Sq{sq}-Sk{sk}-Hkv{kv_heads}", seed, cfg, sq, sk, kv_heads=kv_heads))
    out.append(_case(f"Sq{sq}-Sk{sk}-large_logits", seed, cfg, sq, sk, inputs="large_logits"))
    sk = min([s for s in sizes.kv_lens if s > 1] or [sizes.kv_len])  # one key: softmax 1, any scale
    sq = min([s for s in sizes.q_lens if 1 < s <= sk] or [1])  # more than one query: the mask too
    scale = round(SCALE_CASE_FACTOR * softmax_scale(cfg, arch.head_dim), 6)
    out.append(_case(f"Sq{sq}-Sk{sk}-sm_scale{scale:g}", seed, cfg, sq, sk, options={"sm_scale": scale}))
    heads = {k: v for k, v in out[0].dims.items() if k not in ("batch", "q_len", "kv_len")}
    return out + train_case(cfg, out, heads, ("q_len", "kv_len"), seed, {})


def _make_inputs(case: Case, dtype: torch.dtype, device: str) -> Tensors:
    """Standard-normal q, k, v drawn in fp32 from the case's seed, then cast; large_logits scales q by 10."""
    d = case.dims
    randn = seeded_randn(case.seed, torch.float32, "cpu")
    q = randn(d["batch"], d["heads"], d["q_len"], d["head_dim"])  # (B, H, Sq, D)
    k = randn(d["batch"], d["kv_heads"], d["kv_len"], d["head_dim"])  # (B, Hkv, Sk, D)
    v = randn(d["batch"], d["kv_heads"], d["kv_len"], d["head_dim"])  # (B, Hkv, Sk, D)
    if case.inputs == "large_logits":
        q = q * 10.0
    elif case.inputs != "normal":
        raise ValueError(f"unknown decode_attention input kind {case.inputs!r}: valid are normal, large_logits")
    return {name: t.to(device=device, dtype=dtype) for name, t in (("q", q), ("k", k), ("v", v))}


def _problem(case: Case) -> str:
    d = case.dims
    return (f"B={d['batch']} H={d['heads']} Hkv={d['kv_heads']} Sq={d['q_len']} Sk={d['kv_len']} "
            f"D={d['head_dim']}")


def _costs(case: Case, cfg: LabConfig) -> Costs:
    """FLOPs: Q Kᵀ and P V, 2·D each per visible (query, key) pair: 4·B·H·D·(Sq·Sk − Sq·(Sq−1)/2), the
    chunk's own future triangle masked out. Bytes: the KV cache read once, 2·B·Hkv·Sk·D·itemsize, plus Q
    read and O written, 2·B·H·Sq·D·itemsize: the floor a kernel can reach (the split kernel's fp32 partial
    states, B·H·Sq·splits·(D+2)·4 bytes written and read, are extra). At Sq = 1 that is ~1 FLOP per byte
    (G = H/Hkv times more with GQA): memory-bound on every device, so GB/s is the figure."""
    d, size = case.dims, itemsize(cfg.precision.dtype)
    visible = d["q_len"] * d["kv_len"] - d["q_len"] * (d["q_len"] - 1) // 2
    flops = 4 * d["batch"] * d["heads"] * d["head_dim"] * visible
    kv_bytes = 2 * d["batch"] * d["kv_heads"] * d["kv_len"] * d["head_dim"] * size
    nbytes = kv_bytes + 2 * d["batch"] * d["heads"] * d["q_len"] * d["head_dim"] * size
    return Costs(flops, nbytes, 2.5, "4*B*H*D*(Sq*Sk - Sq*(Sq-1)/2)",
                 "2*B*Hkv*Sk*D*itemsize (KV cache) + 2*B*H*Sq*D*itemsize (Q, O)",
                 "backward = 2.5 x forward (FlashAttention's convention; decoding runs no backward)")


def _sizes(case: Case) -> tuple[int, int, int, int, int]:
    """(Nq = B·H·Sq·D, Nk = B·H·Sk·D (the cache repeated to H heads), Nkv = B·Hkv·Sk·D, P = B·H·Sq·Sk, Sq·Sk)."""
    d = case.dims
    b, h, hkv, sq, sk, hd = d["batch"], d["heads"], d["kv_heads"], d["q_len"], d["kv_len"], d["head_dim"]
    return b * h * sq * hd, b * h * sk * hd, b * hkv * sk * hd, b * h * sq * sk, sq * sk


def _materialised(case: Case, cfg: LabConfig) -> Costs:
    """The readable reference (ops/decode_attention/reference.py chunk_attention) as eager PyTorch runs it, forward (measure/traffic.py
    counts the same, tests/test_traffic.py): the cache repeated to H heads (read 2·Nkv, write 2·Nk: G = H/Hkv times
    the cache, again in MHA, a copy), Q Kᵀ (Nq + Nk, P), · scale (P, P), the mask (ones, triu, read by
    masked_fill: 4·Sq·Sk bools) and masked_fill (P, P), softmax (P, P), P V (P + Nk, Nq):
    s·(8·P + 2·Nq + 4·Nk + 2·Nkv) + 4·Sq·Sk. At Sq = 1 the cache's 2·Nkv bytes become 2·Nkv + 4·Nk."""
    floor = _costs(case, cfg)
    nq, nk, nkv, p, sqsk = _sizes(case)
    size = itemsize(cfg.precision.dtype)
    return dataclasses.replace(
        floor, bytes=size * (8 * p + 2 * nq + 4 * nk + 2 * nkv) + 4 * sqsk,
        bytes_formula="s*(8*P + 2*Nq + 4*Nk + 2*Nkv) + 4*Sq*Sk (P = B*H*Sq*Sk, Nq = B*H*Sq*D, Nk = B*H*Sk*D, "
                      "Nkv = B*Hkv*Sk*D)",
        working_set=size * (2 * nkv + 2 * nk + 2 * p + 2 * nq),
        working_set_formula="s*(2*Nkv + 2*Nk + 2*P + 2*Nq) (the cache, its repeat, scores, Q, O)",
        model="materialised", note="the cache copied to H heads and read again, the scores written and read, one "
                                   "eager op at a time; forward only (decoding trains nothing)")


def _split(case: Case, cfg: LabConfig) -> Costs:
    """Our split-KV kernel (ops/decode_attention/kernels.py): grid (row blocks, B·Hkv, splits); each program reads its
    piece of K and V once for every query row block of its head group, and writes its partial state (row max,
    sum, the (D,) accumulator in fp32), which the combine kernel reads back:
    s·(2·Nq + 2·Nkv·row_blocks) + 2·B·H·Sq·splits·(D + 2)·4."""
    from posttrainllm.ops.decode_attention.kernels import decode_attention_launch

    floor = _costs(case, cfg)
    d, size = case.dims, itemsize(cfg.precision.dtype)
    nq, _, nkv, _, _ = _sizes(case)
    options = _triton_options(cfg)
    launch = decode_attention_launch(d["batch"], d["heads"], d["kv_heads"], d["q_len"], d["kv_len"], d["head_dim"],
                                     **{k: options[k] for k in ("block_q", "block_kv", "split_blocks", "num_warps",
                                                                "num_stages")})
    row_blocks, splits = launch["grid"][0], launch["num_splits"]
    partial = 2 * d["batch"] * d["heads"] * d["q_len"] * splits * (d["head_dim"] + 2) * 4
    return dataclasses.replace(
        floor, bytes=size * (2 * nq + 2 * nkv * row_blocks) + partial,
        bytes_formula=f"s*(2*Nq + 2*Nkv*row_blocks) + 2*B*H*Sq*splits*(D + 2)*4 (row_blocks={row_blocks}, "
                      f"splits={splits})",
        working_set=size * (2 * nq + 2 * nkv) + partial // 2, working_set_formula="s*(2*Nq + 2*Nkv) + the partials",
        model="split", note=f"{splits} cache pieces ({launch['split_rule']}): their fp32 partial states written and "
                            "read back by the combine kernel")


PATH_COSTS = {"materialised": _materialised, "split": _split}


def _curve_case(cfg: LabConfig, x: int) -> Case:
    """One decode step (Sq = 1) against a cache of x keys: the curve's axis is the context length."""
    seed = cfg.parity.seeds[0]
    return _case(f"Sq1-Sk{x}-seed{seed}", seed, cfg, 1, x, main=True)


# --- the model --------------------------------------------------------------------------


def _fill(impl: Impl, cfg: LabConfig) -> Callable[..., torch.Tensor]:
    """The model's attention slots as a chunk against its KV cache: bench-train's full-sequence causal attention is
    the chunk Sq == Sk, and the draft heads' cached decoding (the cached_attention slot) any chunk Sq <= Sk: the same
    function, checked and timed."""

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return impl.fn({"q": q, "k": k, "v": v}, cfg)["out"]

    return attention


def _model_problem(cfg: LabConfig) -> str:
    arch, train = cfg.architecture, cfg.train
    return (f"B={train.batch_size} H={arch.n_heads} Hkv={arch.n_kv_heads} Sq=Sk={train.seq_len} "
            f"D={arch.head_dim}")


def _check_config(cfg: LabConfig) -> None:
    """Q + (K, V) per pipeline stage must fit the shared memory: (BLOCK_Q + 2·BLOCK_KV·num_stages)·D·itemsize.
    (BLOCK_Q shrinks to the G·Sq rows of a KV head, BLOCK_KV to no less than 16; neither needs the shape.)"""
    tile = cfg.tile
    smem = (tile.block_q + 2 * tile.block_kv * cfg.workgroup.num_stages) * cfg.architecture.head_dim * itemsize(
        cfg.precision.dtype)
    check_smem(cfg, smem)


def _reference_bytes(case: Case, cfg: LabConfig) -> int:
    """The reference stage's peak, estimated as for attention: ~6 float64 (B, H, Sq, Sk) score tensors through
    autograd, next to ~10 float64 copies of Q, K, V, O (the K/V repeated to H heads included)."""
    d = case.dims
    scores = 6 * d["batch"] * d["heads"] * d["q_len"] * d["kv_len"] * 8
    tensors = 10 * (2 * d["heads"] * d["q_len"] + 2 * d["heads"] * d["kv_len"]) * d["batch"] * d["head_dim"] * 8
    return scores + tensors


SIGNATURE = ("fn(q, k, v, *, sm_scale: float) -> out; q (B, H, Sq, D), k and v (B, Hkv, Sk, D), Sq <= Sk, "
             "query i of the chunk sees keys j <= i + Sk - Sq (bottom-right causal); out (B, H, Sq, D) in q's dtype")

TEMPLATE = '''
import torch


def {name}(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float) -> torch.Tensor:
    """softmax(Q Kᵀ · sm_scale + M) V for a query chunk at the end of a KV cache (M: bottom-right causal).

    q: (B, H, Sq, D); k, v: (B, Hkv, Sk, D), Sq <= Sk, H a multiple of Hkv -> out (B, H, Sq, D) in q's dtype.
    Query i of the chunk (position i + Sk - Sq) sees keys j <= i + Sk - Sq; Sq = 1 is one decode step.
    """
    n_heads, q_len, kv_len = q.shape[1], q.shape[2], k.shape[2]
    k = k.repeat_interleave(n_heads // k.shape[1], dim=1)  # (B, H, Sk, D)
    v = v.repeat_interleave(n_heads // v.shape[1], dim=1)  # (B, H, Sk, D)
    scores = (q.float() @ k.float().transpose(-2, -1)) * sm_scale  # (B, H, Sq, Sk)
    future = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).triu(kv_len - q_len + 1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)  # (B, H, Sq, Sk)
    return (probs @ v.float()).to(q.dtype)  # (B, H, Sq, D)
'''


def _adapt(fn: Any) -> Any:
    def path(x: Tensors, cfg: LabConfig) -> Tensors:
        q = x["q"]
        return {"out": fn(q, x["k"], x["v"], sm_scale=softmax_scale(cfg, q.shape[-1]))}

    path.__name__ = getattr(fn, "__name__", "user")
    return path


OP = OpDef(
    name="decode_attention", x_name="kv_len", input_names=("q", "k", "v"), impls=IMPLS, cases=_cases,
    make_inputs=_make_inputs, problem=_problem, costs=_costs, path_costs=PATH_COSTS, curve_case=_curve_case,
    # the training forward's attention is the chunk Sq == Sk; cached decoding and verification, any chunk
    model_hook=ModelHook("attention", _fill, also=("cached_attention",)),
    model_problem=_model_problem,
    model_defaults={"cached_attention": decode_attention_reference.chunk_attention,
                    "tree_attention": decode_attention_reference.masked_chunk_attention}, check_config=_check_config,
    reference_bytes=_reference_bytes, gradient_baselines=(("exp(S - lse)", _reference_from_lse),),
    optional_peers={"compiled": compiled("decode_attention", _reference, _make_inputs,
                                         "posttrainllm.ops.decode_attention.reference.chunk_attention")},
    signature=SIGNATURE, adapt=_adapt, template=TEMPLATE,
    batch_axis=BatchAxis("one sequence of one batch entry: its query chunk and its KV cache", {"q": 0, "k": 0, "v": 0},
                         {"out": 0, "lse": 0}, note="every sequence of a batch has the same cache length here (the "
                         "op takes one kv_len): batches of mixed cache lengths are not tried"),
)
