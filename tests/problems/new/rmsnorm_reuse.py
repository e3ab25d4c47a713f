# A wrong ModelNew for tests/problems/rmsnorm.py: it computes once and returns that result at every later call
# of the same shape.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.kept = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape not in self.kept:
            self.kept[x.shape] = x / torch.sqrt(torch.mean(x ** 2, dim=1, keepdim=True) + self.eps)
        return self.kept[x.shape]
