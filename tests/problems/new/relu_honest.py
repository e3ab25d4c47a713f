# A ModelNew for tests/problems/relu.py: the same function as a select, with ReLU's gradient at 0 (zero). A clamp
# (torch.clamp(x, min=0)) passes the gradient at x == 0, and the lab's zero-row case says so.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super(ModelNew, self).__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, x, torch.zeros_like(x))
