# Follows KernelBench level1/19_ReLU.py: an elementwise activation, in KernelBench's problem-file format.
import torch
import torch.nn as nn


class Model(nn.Module):
    """
    Applies a ReLU to its input.
    """
    def __init__(self):
        super(Model, self).__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


batch_size = 4096
dim = 393216


def get_inputs():
    x = torch.rand(batch_size, dim)
    return [x]


def get_init_inputs():
    return []
