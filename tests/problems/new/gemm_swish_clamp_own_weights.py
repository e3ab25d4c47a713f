# A wrong ModelNew for tests/problems/gemm_swish_clamp.py: its linear layer is named apart from Model's, so it
# runs with its own initial weights, not the ones it is handed.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, bias=True):
        super(ModelNew, self).__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)

    def forward(self, x):
        y = self.linear(x)
        return torch.tanh((y * torch.sigmoid(y) * 0.5).clamp(-1.0, 1.0))
