"""Attention as a plain PyTorch function, brought to the lab as a user path:

    posttrainllm bench op=attention 'op.user_impls=[examples/torch_attention.py:sdpa_attention]'

PyTorch's fused call with the scale and GQA passed through; its backward is PyTorch's (autograd).
"""

import torch
import torch.nn.functional as F


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, sm_scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale, enable_gqa=k.shape[1] != q.shape[1])
