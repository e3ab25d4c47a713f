"""SwiGLU's gate as a lab op: out = silu(gate) · up, silu(g) = g · sigmoid(g); gate, up (rows, F) -> out (rows, F).

The dense MLP's elementwise step between its gate/up projections and its down projection
(model/transformer.py SwiGLU: h = swiglu(gate (B, T, F), up (B, T, F))); rows = B·T, F = mlp_hidden.

Paths (one function each: checked, timed and trained as the gate of every dense MLP):
    reference   posttrainllm.ops.swiglu.reference.swiglu: F.silu(gate) * up in the point's dtype, the model's own math
                (there is no fused SwiGLU in PyTorch: this eager pair of kernels is also its "torch" path)
    triton      posttrainllm.ops.swiglu.kernels: one fused elementwise kernel forward (fp32 inside, one rounding), one
                backward that recomputes sigmoid(gate) and writes both gradients
    compiled    (opt-in, op.peers) the reference under torch.compile (inductor fuses it into one kernel)
    user paths  op.user_impls, in the natural signature SIGNATURE (lab/isolation/user.py)

Why the reference runs in the point's dtype (not fp32 and cast back): reference.py's functions run in their
inputs' dtype, so that the same call on float64 inputs is the oracle; and this is what the model trains with
(the model's mlp_activation default, model_defaults below; moe_reference.swiglu_expert). Its 16-bit baseline rounds twice (silu(gate), then the
product) where the fused kernel rounds once, so the contract's allowance is ~1-2 output ulps x error_multiple:
measured margins of the planted bugs in tests/ops/test_swiglu.py.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from posttrainllm.config import LabConfig, itemsize
from posttrainllm.ops.base import REFERENCE, BatchAxis, Case, Costs, Impl, ModelHook, OpDef, Tensors, seeded_randn
from posttrainllm.ops.peers import compiled
import posttrainllm.ops.swiglu.reference as swiglu_reference

ADVERSARIAL = ("large_gate", "tiny")
LARGE_GATE_SCALE = 15.0  # gate's std: ±30 at two sigma, sigmoid saturated (σ(−30) ≈ 9e-14)
LARGE_GATE_EXTREME = 100.0  # beyond fp32's e^x overflow (x > 88.7): e^(−g) is inf for g = −100


def _reference(x: Tensors, cfg: LabConfig) -> Tensors:
    return {"out": swiglu_reference.swiglu(x["gate"], x["up"])}


def _tile(cfg: LabConfig) -> dict[str, int]:
    """tile.block_m rows by tile.block_n columns of F per program; workgroup.num_warps (num_stages: no pipeline)."""
    return dict(block_rows=cfg.tile.block_m, block_f=cfg.tile.block_n, num_warps=cfg.workgroup.num_warps)


def _triton(x: Tensors, cfg: LabConfig) -> Tensors:
    from posttrainllm.ops.swiglu.kernels import swiglu

    return {"out": swiglu(x["gate"], x["up"], **_tile(cfg))}


def _triton_geometry(case: Case, cfg: LabConfig) -> dict[str, Any]:
    """The launch geometry (forward and backward alike); tile=auto runs its fixed blocks: no autotuner here."""
    from posttrainllm.ops.swiglu.kernels import swiglu_launch

    geometry = swiglu_launch(case.dims["rows"], case.dims["ffn"], **_tile(cfg))
    if cfg.tile.autotune or cfg.workgroup.autotune:
        geometry["autotune"] = {"mode": None, "chosen": None,
                                "note": "elementwise kernel: not autotuned, the auto tile's fixed blocks run"}
    return geometry


IMPLS = {
    REFERENCE: Impl(REFERENCE, "reference", _reference, backend="posttrainllm.ops.swiglu.reference.swiglu"),
    "triton": Impl("triton", "triton", _triton, geometry=_triton_geometry, backend="posttrainllm.ops.swiglu.swiglu",
                   kernels={"forward": ("_swiglu_forward_kernel",), "backward": ("_swiglu_backward_kernel",)},
                   promises=("deterministic", "batch_invariant")),  # no atomics; a program owns its rows (checked)
}


# --- cases and inputs -------------------------------------------------------------------


def _case(name: str, seed: int, rows: int, ffn: int, main: bool, inputs: str = "normal") -> Case:
    return Case(name, seed, dict(rows=rows, ffn=ffn), main, inputs)


def _cases(cfg: LabConfig) -> list[Case]:
    """Per seed: the point's shape (rows = shape.batch · shape.seq_len, F = architecture.mlp_hidden), a single
    row at that F, and rows = F = each of shape.edge_seq_lens (off every block in both dims). On the first seed,
    the adversarial inputs at the point's shape."""
    rows, ffn = cfg.shape.batch * cfg.shape.seq_len, cfg.architecture.mlp_hidden
    out = []
    for seed in cfg.parity.seeds:
        out.append(_case(f"R{rows}-F{ffn}-seed{seed}", seed, rows, ffn, True))
        out.append(_case(f"R1-F{ffn}-seed{seed}", seed, 1, ffn, False))
        out += [_case(f"R{s}-F{s}-seed{seed}", seed, s, s, False) for s in cfg.shape.edge_seq_lens]
    seed = cfg.parity.seeds[0]
    out += [_case(f"R{rows}-F{ffn}-{kind}", seed, rows, ffn, False, kind) for kind in ADVERSARIAL]
    return out


def _make_inputs(case: Case, dtype: torch.dtype, device: str) -> Tensors:
    """Standard-normal gate and up drawn in fp32 from the case's seed, shaped by the case's input kind, then cast
    to the point's dtype.

    large_gate  gate of std 15 (sigmoid saturates: ±30 at two sigma), and each row's first element at ±100
                (alternating by row): past the fp32 overflow of e^(−g), past fp16's from |g| > 11
    tiny        gate and up scaled by the 4th root of the dtype's smallest normal (fp16 0.088, bf16/fp32 5.9e-10):
                silu's linear regime, with out ≈ gate·up/2 and both gradients still normal numbers
    """
    d = case.dims
    randn = seeded_randn(case.seed, torch.float32, "cpu")
    gate, up = randn(d["rows"], d["ffn"]), randn(d["rows"], d["ffn"])  # (rows, F)
    if case.inputs == "large_gate":
        gate = gate * LARGE_GATE_SCALE
        sign = 1.0 - 2.0 * (torch.arange(d["rows"]) % 2)  # +1, −1, +1, ... by row
        gate[:, 0] = LARGE_GATE_EXTREME * sign
    elif case.inputs == "tiny":
        scale = torch.finfo(dtype).tiny ** 0.25
        gate, up = gate * scale, up * scale
    elif case.inputs != "normal":
        raise ValueError(f"unknown swiglu input kind {case.inputs!r}: valid are normal, {', '.join(ADVERSARIAL)}")
    return {"gate": gate.to(device=device, dtype=dtype), "up": up.to(device=device, dtype=dtype)}


def _problem(case: Case) -> str:
    return f"rows={case.dims['rows']} F={case.dims['ffn']}"


FLOPS_PER_ELEMENT = 5  # σ(g) 3 (e^(−g), 1 + e, the reciprocal), g · σ, · up
# σ again 3, silu 1, d_up 1; 1 − σ, g · (1 − σ), 1 + ..., σ · (...) 4; dh · up, · silu' 2
BACKWARD_FLOPS_PER_ELEMENT = 11


def _costs(case: Case, cfg: LabConfig) -> Costs:
    """Elementwise, memory-bound. FLOPs per element of out: 5 (σ(g) = 1 / (1 + e^(−g)) counted as 3: the exp, the
    add, the reciprocal; then g · σ and · up). Bytes: read gate and up, write out, once each: 3·rows·F·itemsize
    (intensity 5 / (3·itemsize): 0.83 FLOP/B in bf16/fp16, 0.42 in fp32, far below every device's ridge).
    Backward: 11 FLOPs per element (σ recomputed, not saved: 3; silu 1, d_up 1; silu'(g) = σ·(1 + g·(1 − σ)) 4;
    d_gate = dh · up · silu' 2) -> 2.2x the forward; it moves 5·rows·F·itemsize (reads gate, up, dh; writes
    d_gate, d_up)."""
    n, size = case.dims["rows"] * case.dims["ffn"], itemsize(cfg.precision.dtype)
    return Costs(FLOPS_PER_ELEMENT * n, 3 * n * size, BACKWARD_FLOPS_PER_ELEMENT / FLOPS_PER_ELEMENT,
                 "5*rows*F (sigmoid as exp + add + reciprocal, then 2 multiplies)", "3*rows*F*itemsize",
                 "backward = 2.2 x forward (11*rows*F: sigmoid recomputed); bytes 5*rows*F*itemsize")


def _curve_case(cfg: LabConfig, x: int) -> Case:
    seed = cfg.parity.seeds[0]
    return _case(f"R{x}-F{cfg.architecture.mlp_hidden}-seed{seed}", seed, x, cfg.architecture.mlp_hidden, True)


# --- the model --------------------------------------------------------------------------


def _fill(impl: Impl, cfg: LabConfig) -> Callable[..., torch.Tensor]:
    """Every dense MLP's gate runs `impl.fn` on its (B·T, F) rows (under autocast gate and up already share the
    autocast dtype: both come out of a Linear)."""

    def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ffn = gate.shape[-1]
        out = impl.fn({"gate": gate.reshape(-1, ffn), "up": up.reshape(-1, ffn)}, cfg)["out"]  # (B·T, F)
        return out.reshape(gate.shape)  # (B, T, F)

    return swiglu


def _model_problem(cfg: LabConfig) -> str:
    arch, train = cfg.architecture, cfg.train
    return f"rows={train.batch_size * train.seq_len} F={arch.mlp_hidden} (each layer's dense MLP gate)"


def _model_overrides(cfg: LabConfig) -> dict[str, Any]:
    """The op=swiglu point trains dense MLPs (an MoE MLP's experts fuse their SwiGLU into op=moe's kernels)."""
    return {} if cfg.architecture.mlp == "dense" else {"mlp": "dense"}


def _check_config(cfg: LabConfig) -> None:
    """No rule of its own: an elementwise kernel holds no shared memory and masks its ragged tiles, so every tile
    (powers of two, TileConfig) fits every (rows, F)."""


def _reference_bytes(case: Case, cfg: LabConfig) -> int:
    """gate, up, out, dO, silu(gate) saved by autograd and both gradients (7 tensors), in float64 and again in the
    point's precision and its copies: ~2 x 7 float64 tensors of rows·F."""
    return 2 * 7 * case.dims["rows"] * case.dims["ffn"] * 8


SIGNATURE = "fn(gate, up) -> out; gate, up (rows, F), out (rows, F) in gate's dtype = silu(gate) · up"

TEMPLATE = '''
import torch
import torch.nn.functional as F


def {name}(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: silu(gate) * up, silu(g) = g * sigmoid(g).   gate, up: (rows, F) -> (rows, F) in gate's dtype.

    The lab checks it against float64 math, per element and per row, forward and both gradients
    (autograd through this function, or your own torch.autograd.Function); no autograd history: forward-only.
    """
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)  # fp32 inside, one rounding, as a fused kernel
'''


def _adapt(fn: Any) -> Any:
    def path(x: Tensors, cfg: LabConfig) -> Tensors:
        return {"out": fn(x["gate"], x["up"])}

    path.__name__ = getattr(fn, "__name__", "user")
    return path


OP = OpDef(
    name="swiglu", x_name="rows", input_names=("gate", "up"), impls=IMPLS, cases=_cases, make_inputs=_make_inputs,
    problem=_problem, costs=_costs, curve_case=_curve_case, model_hook=ModelHook("mlp_activation", _fill), model_problem=_model_problem,
    model_defaults={"mlp_activation": swiglu_reference.swiglu}, check_config=_check_config, reference_bytes=_reference_bytes,
    model_overrides=_model_overrides,
    optional_peers={"compiled": compiled("swiglu", _reference, _make_inputs, "posttrainllm.ops.swiglu.reference.swiglu")},
    signature=SIGNATURE, adapt=_adapt, template=TEMPLATE,
    batch_axis=BatchAxis("a token", {"gate": 0, "up": 0}, {"out": 0}),
)
