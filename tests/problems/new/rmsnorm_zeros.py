# A wrong ModelNew for tests/problems/rmsnorm.py: it returns zeros of the right shape and dtype.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x) * x
