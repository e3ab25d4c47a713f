# Follows KernelBench level2/81_Gemm_Swish_Divide_Clamp_Tanh_Clamp.py: a GEMM with an elementwise epilogue.
import torch
import torch.nn as nn


class Model(nn.Module):
    """
    A linear layer followed by swish, a division by 2, a clamp to [-1, 1], tanh and a clamp again.
    """
    def __init__(self, in_features, out_features, bias=True):
        super(Model, self).__init__()
        self.gemm = nn.Linear(in_features, out_features, bias=bias)

    def forward(self, x):
        x = self.gemm(x)
        x = x * torch.sigmoid(x)
        x = x / 2.0
        x = torch.clamp(x, min=-1.0, max=1.0)
        x = torch.tanh(x)
        x = torch.clamp(x, min=-1.0, max=1.0)
        return x


batch_size = 1024
in_features = 8192
out_features = 8192


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
