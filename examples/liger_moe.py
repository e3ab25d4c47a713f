"""Liger-Kernel's fused MoE (liger_kernel.ops.fused_moe, Triton grouped GEMM with a SwiGLU epilogue) as a
user path of op=moe: a third-party kernel nobody here wrote, adapted to the op's natural signature.

    pip install --no-deps liger-kernel==0.8.5
    LIGER_FUSED_MOE_AUTOTUNE=0 posttrainllm bench op=moe 'op.user_impls=[examples/liger_moe.py:liger_moe]'

Liger takes gate_up_proj (E, 2f, d) = [W_gate; W_up] transposed, down_proj (E, d, f) = W_downᵀ and int32
routing indices; the cat and transposes below are differentiable, so its backward reaches our weights.
"""

import torch


def liger_moe(x, w_gate, w_up, w_down, route_idx, route_weight):
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    gate_up = torch.cat([w_gate.transpose(1, 2), w_up.transpose(1, 2)], dim=1)  # (E, 2f, d)
    return LigerFusedMoEFunction.apply(x, gate_up, w_down.transpose(1, 2), route_idx.to(torch.int32), route_weight)
