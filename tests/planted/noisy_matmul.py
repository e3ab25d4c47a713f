"""Planted (tests/test_invariance.py): a @ b plus noise ~1e-7 of its scale, new on every call. Far below the fp32
contract (it passes parity's allclose), but no two runs give the same bits: not deterministic."""

import torch

_calls = [0]


def matmul(a, b):
    _calls[0] += 1
    out = a @ b
    noise = torch.randn(out.shape, generator=torch.Generator().manual_seed(_calls[0]))
    return out + out.detach().abs().amax() * 1e-7 * noise.to(out.dtype)
