"""Planted (tests/test_invariance.py): a @ b with the K reduction split where the batch's size says (an even number
of rows of A: at K/4, an odd one: at K/2), as a kernel choosing its split-K from the batch does. Each result is within
the fp32 contract and the same on every run (deterministic), but a row's bits depend on how many rows came with it:
not batch-invariant."""


def matmul(a, b):
    split = a.shape[1] // (4 if a.shape[0] % 2 == 0 else 2)
    return a[:, :split] @ b[:split] + a[:, split:] @ b[split:]
