# A wrong ModelNew for tests/problems/rmsnorm.py: its forward takes eps as a second argument get_inputs never gives.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()

    def forward(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + eps)
