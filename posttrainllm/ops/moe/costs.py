"""Each kind of MoE path's own FLOPs and bytes (OpDef.path_costs; Impl.cost_model names one), formula beside figure.

Notation: T tokens, d model width, f expert width, E experts, k experts per token; A = T·k routed rows (assignments),
n_e the rows expert e receives (the case's own routing, as make_inputs routes it: definition.py _tokens_per_expert),
m the experts touched (n_e > 0), s the point's itemsize. The Triton kernels' tile: BM = tile.block_m,
BN = tile.block_n; R = Σ_e ceil(n_e/BM) the row blocks the routing fills; B = row_blocks_max(A, E, BM) the grid's bound
and P = B·BM its padded rows (kernels.py); Nf = ceil(f/BN), Nd = ceil(d/BN) the column tiles.

Two kinds of model:
    eager     (dense, sparse, grouped)  the path as eager PyTorch runs it, every aten op reading its tensor arguments
              and writing its results, whole (measure/traffic.py counts the same; tests/test_traffic.py checks each
              model against that count on CPU). A gather's source (x[token]) and an index_put's destination are
              counted whole, as is grouped_mm's stacked (E, d, f) weight: an expert with no rows is counted read.
    tiled     (triton, fp8_triton)  the GPU kernels' loads and stores, no cache between programs: each program of a
              (row block, column tile) grid loads its rows' full K slab and its expert's (K, BN) weight slab, so
              the gathered rows are read once per column tile (Nf or Nd times) and each expert's weights once per
              row block (R times in all), the masked padding rows not at all. Their eager parts (the plan, fp8's
              quantization of h, the route-weight gradient's sum) are counted as above. Per-row side values (the
              plan's int32 row indices, routing weights and per-row scales, 4 B per row per program) are left out:
              < 4/(s·min(d, f)) of the row traffic.
"""

from __future__ import annotations

import math

from posttrainllm.config import LabConfig, itemsize
from posttrainllm.ops.base import Case, Costs

BACKWARD = "backward = 2 x forward (dX and dW of gate, up and down)"


def _sizes(case: Case, cfg: LabConfig) -> tuple[int, int, int, int, int, int, int]:
    d = case.dims
    t, k = d["tokens"], d["top_k"]
    return t, d["d_model"], d["ffn"], d["experts"], k, t * k, itemsize(cfg.precision.dtype)


def _routed_flops(case: Case) -> int:
    d = case.dims
    return 2 * d["tokens"] * d["top_k"] * 3 * d["d_model"] * d["ffn"]


# --- eager paths -------------------------------------------------------------------------------------------------


def dense(case: Case, cfg: LabConfig) -> Costs:
    """The dense reference (reference.moe_dense), every expert on every token: (E, T, f) and (E, T, d) tensors and
    all E experts' weights, not the touched ones.

    forward: the (T, E) gate (zeros, scatter: 4·T·E·s and the routing T·k·(8 + s)); x·W_gate and x·W_up (E·T·f
    each written, E·d·f read), the SwiGLU's (E, T, f) passes, ·W_down (E·T·d written), the gate's einsum over E:
    s·(12·E·T·f + 2·E·T·d + 7·E·d·f + 4·T·E + 3·T·d) + T·k·(8 + s). forward + backward: s·(31·E·T·f + 6·E·T·d +
    17·E·d·f + 7·T·E + 12·T·d) + 2·T·k·(8 + s) (the route weights' gradient gathered back from the (T, E) gate).
    FLOPs: all E experts, E/k x the active. Working set: the weights and two (E, T, f) alive at once."""
    t, dm, f, n_exp, k, _, size = _sizes(case, cfg)
    forward = (size * (12 * n_exp * t * f + 2 * n_exp * t * dm + 7 * n_exp * dm * f + 4 * t * n_exp + 3 * t * dm)
               + t * k * (8 + size))
    train = (size * (31 * n_exp * t * f + 6 * n_exp * t * dm + 17 * n_exp * dm * f + 7 * t * n_exp + 12 * t * dm)
             + 2 * t * k * (8 + size))
    return Costs(2 * t * n_exp * 3 * dm * f, forward, 2.0, "2*T*E*3*d*f (every expert on every token)",
                 "s*(12*E*T*f + 2*E*T*d + 7*E*d*f + 4*T*E + 3*T*d) + T*k*(8 + s)", BACKWARD, train_bytes=train,
                 train_bytes_formula="s*(31*E*T*f + 6*E*T*d + 17*E*d*f + 7*T*E + 12*T*d) + 2*T*k*(8 + s)",
                 working_set=size * (3 * n_exp * dm * f + 2 * n_exp * t * f + 2 * t * dm),
                 working_set_formula="s*(3*E*d*f + 2*E*T*f + 2*T*d)", model="dense",
                 note="all E experts on every token, (E, T, f) tensors written and read one eager op at a time")


def sparse(case: Case, cfg: LabConfig, counts: list[int]) -> Costs:
    """The per-expert loop (reference.moe_sparse) as eager PyTorch runs it: for each of the E experts a compare and
    a nonzero over route_idx (9·A + A + 16·n_e); for each of the m touched experts its rows gathered (x read whole:
    T·d), its three GEMMs on n_e rows with its own weights (3·d·f, views: no copy), the SwiGLU, the routing weight
    gathered (T·k read whole) and applied, and an out-of-place index_add that copies out (2·T·d) every time:
    10·E·A + 48·A + s·(2·T·d + 3·m·T·d + m·A + 3·m·d·f + 7·A·d + 8·A·f + 2·A).
    backward: each expert's weight slices get a full (E, d, f) gradient (select_backward: 3·E·d·f written per
    touched expert) summed over the m experts, and so do x's (T, d) and route_weight's (T, k) gathers (new_zeros,
    index_put): 32·A + s·(18·A·d + 15·A·f + 4·A + m·(4·T·d + 3·A + 9·d·f + 3·E·d·f) + (m − 1)·(3·T·d + 3·A +
    9·E·d·f)). Working set: x, out and its copy, the touched experts' weights, one expert's g, u and h."""
    t, dm, f, n_exp, k, a, size = _sizes(case, cfg)
    m, n_max = sum(1 for n in counts if n), max(counts)
    forward = 10 * n_exp * a + 48 * a + size * (2 * t * dm + 3 * m * t * dm + m * a + 3 * m * dm * f + 7 * a * dm
                                                 + 8 * a * f + 2 * a)
    backward = 32 * a + size * (18 * a * dm + 15 * a * f + 4 * a + m * (4 * t * dm + 3 * a + 9 * dm * f
                                                                         + 3 * n_exp * dm * f)
                                + max(m - 1, 0) * (3 * t * dm + 3 * a + 9 * n_exp * dm * f))
    return Costs(_routed_flops(case), forward, 2.0, "2*T*k*3*d*f (the routed rows only)",
                 f"10*E*A + 48*A + s*(2*T*d + 3*m*T*d + m*A + 3*m*d*f + 7*A*d + 8*A*f + 2*A) (A = T*k, m = {m} "
                 "experts touched)", BACKWARD, train_bytes=forward + backward,
                 train_bytes_formula="forward + 32*A + s*(18*A*d + 15*A*f + 4*A + m*(4*T*d + 3*A + 9*d*f + 3*E*d*f) "
                                     "+ (m - 1)*(3*T*d + 3*A + 9*E*d*f)) (a full (E, d, f) gradient per touched "
                                     "expert and weight, summed)",
                 working_set=size * (3 * t * dm + 3 * m * dm * f + 3 * n_max * f),
                 working_set_formula="s*(3*T*d + 3*m*d*f + 3*n_max*f) (x, out and its copy; the touched weights; "
                                     "one expert's g, u, h)", model="sparse",
                 note="eager, one expert at a time: x and out copied whole per touched expert (the gather's source "
                      "counted whole), each weight slice's gradient materialised (E, d, f) in the backward")


def grouped(case: Case, cfg: LabConfig, counts: list[int]) -> Costs:
    """torch's grouped GEMM path (definition.py _grouped_mm) as eager PyTorch runs it: the rows sorted by expert
    (sort, bincount, cumsum, int32 offsets; order // k twice), x's rows gathered once (A·d written, x read whole),
    three grouped_mm calls (each reading its A rows, the stacked (E, ·, ·) weights whole and the offsets), the
    SwiGLU, the routing weight gathered and applied, one index_add into zeros:
    88·A + 48·E + s·(5·T·d + 7·A·d + 8·A·f + 3·A + 3·E·d·f).
    backward: six grouped_mm (dX rows and dW per projection; dW written (E, ·, ·) whole), the SwiGLU's, the two
    gathers' index_put into zeros: 24·A + 24·E + s·(4·T·d + 18·A·d + 15·A·f + 7·A + 6·E·d·f). Working set: x and
    out, the gathered rows, the stacked weights, g, u, h."""
    t, dm, f, n_exp, k, a, size = _sizes(case, cfg)
    forward = 88 * a + 48 * n_exp + size * (5 * t * dm + 7 * a * dm + 8 * a * f + 3 * a + 3 * n_exp * dm * f)
    backward = 24 * a + 24 * n_exp + size * (4 * t * dm + 18 * a * dm + 15 * a * f + 7 * a + 6 * n_exp * dm * f)
    m = sum(1 for n in counts if n)
    return Costs(_routed_flops(case), forward, 2.0, "2*T*k*3*d*f (the routed rows only)",
                 "88*A + 48*E + s*(5*T*d + 7*A*d + 8*A*f + 3*A + 3*E*d*f) (A = T*k)", BACKWARD,
                 train_bytes=forward + backward,
                 train_bytes_formula="forward + 24*A + 24*E + s*(4*T*d + 18*A*d + 15*A*f + 7*A + 6*E*d*f)",
                 working_set=size * (2 * t * dm + a * dm + 3 * n_exp * dm * f + 3 * a * f),
                 working_set_formula="s*(2*T*d + A*d + 3*E*d*f + 3*A*f) (x, out; the gathered rows; the stacked "
                                     "weights; g, u, h)", model="grouped",
                 note="eager: one grouped GEMM per projection over the rows sorted by expert; the stacked weights "
                      f"counted whole (E = {n_exp}; {m} touched: an empty expert's weights are not read by a grouped "
                      "GEMM, so below T*k ~ E this counts up to (E - m)*3*d*f*s more than it reads)")


# --- tiled paths (the Triton kernels) ----------------------------------------------------------------------------


def plan_bytes(a: int, n_exp: int, blocks: int, padded: int, weight_size: int) -> int:
    """kernels.plan's eager traffic (sort, prefix sums, scatters into the (P,) row tables; route weights of
    `weight_size` bytes, cast to fp32): 16·P + 176·B + 188·E + 68 + A·(224 + 2·s) (+ (s + 4)·A when s != 4)."""
    cast = (weight_size + 4) * a if weight_size != 4 else 0
    return 16 * padded + 176 * blocks + 188 * n_exp + 68 + a * (224 + 2 * weight_size) + cast


PLAN_FORMULA = "plan = 16*P + 176*B + 188*E + 68 + A*(224 + 2*s) (+ (s + 4)*A at 16 bits)"


def route_weight_grad_bytes(a: int, padded: int, f_tiles: int, weight_size: int) -> int:
    """The backward's eager tail for d route_weight: the (P, Nf) fp32 partials zeroed and summed over Nf, gathered
    back to (T, k) through inv (int32 -> int64), cast to the weights' dtype: 8·P·Nf + 8·P + 24·A (+ (4 + s)·A)."""
    cast = (4 + weight_size) * a if weight_size != 4 else 0
    return 8 * padded * f_tiles + 8 * padded + 24 * a + cast


def h_quantize_bytes(a: int, padded: int, ffn: int, rowwise: bool) -> int:
    """fp8.py's eager quantization of h (P, f) fp32 to e4m3 between the launches (quantize.fp8_scale, quantize_fp8):
    rowwise, amax per row and the scaled cast over all P rows: 33·P·f + 32·P; per tensor, the amax over the A
    routed rows gathered through inv, the cast over all P: 25·P·f + 16·A·f + 20·A + 32."""
    if rowwise:
        return 33 * padded * ffn + 32 * padded
    return 25 * padded * ffn + 16 * a * ffn + 20 * a + 32


def _tile(case: Case, cfg: LabConfig, counts: list[int]) -> tuple[int, int, int, int, int, int]:
    """(BM, BN, R, B, P, m): the tile, the row blocks the routing fills, the grid's bound and its padded rows, the
    experts touched."""
    from posttrainllm.ops.moe.kernels import row_blocks_max

    bm, bn = cfg.tile.block_m, cfg.tile.block_n
    a = case.dims["tokens"] * case.dims["top_k"]
    blocks = row_blocks_max(a, case.dims["experts"], bm)
    return bm, bn, sum(math.ceil(n / bm) for n in counts), blocks, blocks * bm, sum(1 for n in counts if n)


def tiled(case: Case, cfg: LabConfig, counts: list[int]) -> Costs:
    """Our grouped GEMM (kernels.py) at its tile: forward (no gradient asked: g and u not stored)
        gate/up    x's gathered rows per f tile (A·d·Nf), W_gate and W_up per row block (2·R·d·f), h (A·f)
        down       h per d tile (A·f·Nd), W_down per row block (R·f·d), y (A·d)
        unpermute  y (A·d), out (T·d)
    s·(A·d·Nf + A·f·Nd + 3·R·d·f + A·f + 2·A·d + T·d) + plan. forward + backward adds g and u (2·A·f) and
        down bwd   dOut[tok] per f tile (A·d·Nf), W_down per row block (R·d·f), h, g, u (3·A·f), dg, du (2·A·f)
        dX rows    dg, du per d tile (2·A·f·Nd), W_gate and W_up per row block (2·R·d·f), the rows (A·d)
        unpermute  the rows (A·d), dX (T·d)
        dW         x's rows per f tile and dg, du per d tile; h per d tile and dOut per f tile; every expert's
                   dW stored (3·E·d·f, zeros for an expert with no row)
    and the d route_weight partials (4·A·Nf stored, then the eager tail).
    FLOPs: each row block computes its BM rows in full (the padding of each expert's last block too)."""
    t, dm, f, n_exp, k, a, size = _sizes(case, cfg)
    bm, bn, rows_blocks, blocks, padded, m = _tile(case, cfg, counts)
    nf, nd = math.ceil(f / bn), math.ceil(dm / bn)
    plan = plan_bytes(a, n_exp, blocks, padded, size)
    kernels = size * (a * dm * nf + a * f * nd + 3 * rows_blocks * dm * f + a * f + 2 * a * dm + t * dm)
    backward = (size * (3 * a * dm * nf + 5 * a * f * nd + 3 * rows_blocks * dm * f + 5 * a * f + 2 * a * dm
                        + t * dm + 3 * n_exp * dm * f)
                + 4 * a * nf + route_weight_grad_bytes(a, padded, nf, size))
    tile = f"tile.{cfg.tile.name}: BM = {bm}, BN = {bn}; R = {rows_blocks} row blocks, B = {blocks}, P = {padded}"
    return Costs(2 * rows_blocks * bm * 3 * dm * f, kernels + plan, 2.0,
                 "2*R*BM*3*d*f (each row block's BM rows in full: the padding rows computed too)",
                 "s*(A*d*Nf + A*f*Nd + 3*R*d*f + A*f + 2*A*d + T*d) + plan (x's rows re-read per column tile, "
                 f"each expert's weights per row block; {PLAN_FORMULA})", BACKWARD,
                 train_bytes=kernels + plan + 2 * size * a * f + backward,
                 train_bytes_formula="forward + 2*s*A*f (g, u) + s*(3*A*d*Nf + 5*A*f*Nd + 3*R*d*f + 5*A*f + 2*A*d "
                                     "+ T*d + 3*E*d*f) + 4*A*Nf + 8*P*Nf + 8*P + 24*A (+ (4 + s)*A at 16 bits)",
                 working_set=size * (2 * t * dm + 3 * m * dm * f + a * (dm + f)),
                 working_set_formula="s*(2*T*d + 3*m*d*f + A*(d + f)) (x, out; the touched weights; h and y rows)",
                 model="tiled", note=f"{tile}; no cache between programs: an upper bound on DRAM traffic where the "
                                     "re-read rows and weights stay in L2")


def fp8_tiled(case: Case, cfg: LabConfig, counts: list[int]) -> Costs:
    """fp8.py's forward at its tile, x and the weights in e4m3 (1 byte), h and y in fp32, out in the point's dtype o:
        gate/up    x's rows per f tile (A·d·Nf), W_gate and W_up per row block (2·R·d·f), h in fp32 (4·A·f)
        quantize   h -> e4m3 in PyTorch over all P rows (h_quantize_bytes)
        down       h_q per d tile (A·f·Nd), W_down per row block (R·f·d), y in fp32 (4·A·d)
        unpermute  y (4·A·d), out (o·T·d)
    A·d·Nf + A·f·Nd + 3·R·d·f + 4·A·f + 8·A·d + o·T·d + the weights' scales + quantize + plan; the scales rowwise
    are per output column, 4·(2·f + d) per row block, else one per expert (left out). Forward only."""
    t, dm, f, n_exp, k, a, size = _sizes(case, cfg)
    bm, bn, rows_blocks, blocks, padded, m = _tile(case, cfg, counts)
    nf, nd = math.ceil(f / bn), math.ceil(dm / bn)
    rowwise = case.quantize.split(":")[1] == "row"
    scales = 4 * rows_blocks * (2 * f + dm) if rowwise else 0
    kernels = a * dm * nf + a * f * nd + 3 * rows_blocks * dm * f + 4 * a * f + 8 * a * dm + size * t * dm + scales
    quantize = h_quantize_bytes(a, padded, f, rowwise)
    quantize_formula = "33*P*f + 32*P" if rowwise else "25*P*f + 16*A*f + 20*A + 32"
    return Costs(2 * rows_blocks * bm * 3 * dm * f, kernels + quantize + plan_bytes(a, n_exp, blocks, padded, size),
                 2.0, "2*R*BM*3*d*f (each row block's BM rows in full)",
                 "A*d*Nf + A*f*Nd + 3*R*d*f + 4*A*f + 8*A*d + o*T*d" + (" + 4*R*(2*f + d) (column scales)"
                                                                          if rowwise else "")
                 + f" + quantize h ({quantize_formula}) + plan ({PLAN_FORMULA})",
                 BACKWARD + "; not timed: the fp8 paths are forward-only",
                 working_set=t * dm + 3 * m * dm * f + 5 * a * f + 4 * a * dm + size * t * dm,
                 working_set_formula="T*d + 3*m*d*f + 5*A*f + 4*A*d + o*T*d (x_q, the touched weights, h in fp32 "
                                     "and e4m3, y, out)",
                 model="fp8_tiled",
                 note=f"tile.{cfg.tile.name}: BM = {bm}, BN = {bn}; R = {rows_blocks} row blocks, P = {padded}; "
                      f"{case.quantize} scales; no cache between programs")


# the routed paths' models, each given the case's tokens per expert (definition.py wires them)
ROUTED = {"sparse": sparse, "grouped": grouped, "tiled": tiled, "fp8_tiled": fp8_tiled}
