"""Our fused linear cross-entropy (posttrainllm/ops/cross_entropy/kernels.py) against the readable math, forward and backward.

Odd sizes (37 tokens off the 16-token chunk, V = 1000 off every 256 block), a single token, ignored targets (a whole
chunk, and all of them), label smoothing, logits of ~1e5; bad input refused. The peak memory against the reference's:
tests/test_cross_entropy_op.py, through the microbench's own calls.
"""

import pytest
import torch

from posttrainllm.measure.memory import peak_bytes
from posttrainllm.ops.cross_entropy import reference
from posttrainllm.ops.cross_entropy.kernels import cross_entropy_launch, fused_linear_cross_entropy

GEOMETRY = dict(chunk_size=16, block_v=256)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # max err / max|oracle|


def _problem(n, c, v, *, seed=0, ignored=(), logit_std=1.0):
    gen = torch.Generator().manual_seed(seed)
    scale = (logit_std / c ** 0.5) ** 0.5
    h = torch.randn(n, c, generator=gen) * scale
    weight = torch.randn(v, c, generator=gen) * scale
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[list(ignored)] = -100
    return h, weight, targets


def _check(problem, dtype, **options):
    h, weight, targets = problem
    leaves = [h.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()]
    loss = fused_linear_cross_entropy(*leaves, targets, **options, **GEOMETRY)
    assert loss.shape == () and loss.dtype == torch.float32
    grad_out = torch.tensor(1.7)
    grads = torch.autograd.grad(loss, leaves, grad_out)
    exact = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference.linear_cross_entropy(*exact, targets, **options)
    ref_grads = torch.autograd.grad(ref, exact, grad_out.double())
    tol = TOLERANCE[dtype]
    assert abs(loss.item() - ref.item()) <= tol * abs(ref.item()), (loss.item(), ref.item())
    for got, want, leaf in zip(grads, ref_grads, leaves):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        assert (got.double() - want).abs().max() <= tol * want.abs().max()
    return loss, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, c, v, ignored, smoothing", [
    (37, 40, 1000, (0, 5, 36), 0.0),  # N off the chunk, V off every block, ignored targets in two chunks
    (1, 16, 300, (), 0.1),  # a single token, label smoothing
])
def test_matches_the_reference(n, c, v, ignored, smoothing, dtype):
    _check(_problem(n, c, v, ignored=ignored), dtype, label_smoothing=smoothing)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_strided_targets_view_is_read_through_its_stride(dtype):
    """targets[::2] of an interleaved tensor: each row's own target (ignored ones included), not its neighbour's in
    memory (read at unit stride, the loss and the gradients are another batch's)."""
    h, weight, targets = _problem(37, 40, 1000, ignored=(0, 5, 36))
    others = torch.randint(0, 1000, (37,), generator=torch.Generator().manual_seed(1))
    view = torch.stack([targets, others], 1).reshape(-1)[::2]
    assert view.stride() == (2,) and torch.equal(view, targets)
    _check((h, weight, view), dtype)


def test_the_forward_holds_no_fp32_copy_of_the_weight():
    """At bf16, N 64, C 512, V 32768 (CPU allocator events: deterministic): the forward under no_grad allocates one
    (16, V) fp32 block of logits and the GEMMs' slabs, 4.2 MB, not the weight in fp32 (V·C·4 = 67 MB: the forward
    took 69 MB with it); with gradients, grad_weight in fp32 and its bf16 cast (V·C·6) and little else."""
    h, weight, targets = _problem(64, 512, 32768)
    h, weight = h.bfloat16(), weight.bfloat16()
    fp32_weight = weight.numel() * 4
    with torch.no_grad():
        forward = peak_bytes(lambda: fused_linear_cross_entropy(h, weight, targets, chunk_size=16, block_v=8192),
                             "cpu", warmup=0)["peak_bytes"]
    assert forward < fp32_weight / 8, forward
    leaves = [h.requires_grad_(), weight.requires_grad_()]
    train = peak_bytes(lambda: fused_linear_cross_entropy(*leaves, targets, chunk_size=16, block_v=8192).backward(),
                       "cpu", warmup=0)["peak_bytes"]
    assert train < weight.numel() * (4 + 2) + fp32_weight / 8, train


def test_a_wholly_ignored_chunk_is_finite_and_other_ignore_indices_work():
    loss, (dh, dw) = _check(_problem(40, 16, 300, ignored=range(16, 32)), torch.float32)  # chunk 2 of 3
    assert torch.isfinite(loss) and dh[16:32].abs().max() == 0  # ignored rows: no gradient
    h, weight, targets = _problem(40, 16, 300)
    targets[:16] = 7
    _check((h, weight, targets), torch.float32, ignore_index=7, label_smoothing=0.2)


def test_every_target_ignored_is_nan_like_the_reference_with_zero_gradients():
    """The mean of nothing: F.cross_entropy's 0/0 is NaN, and its gradients are zero; ours the same."""
    h, weight, targets = _problem(20, 16, 300, ignored=range(20))
    leaves = [h.requires_grad_(), weight.requires_grad_()]
    loss = fused_linear_cross_entropy(*leaves, targets, **GEOMETRY)
    ref = reference.linear_cross_entropy(h, weight, targets)
    assert loss.isnan() and ref.isnan()
    dh, dw = torch.autograd.grad(loss, leaves)
    assert dh.abs().max() == 0 and dw.abs().max() == 0


def test_logits_of_1e5_do_not_overflow():
    """exp(1e5) is inf in fp32: the online max subtraction keeps every term <= 1."""
    problem = _problem(20, 16, 300, logit_std=3e4)
    h, weight, _ = problem
    assert (h @ weight.t()).abs().max() > 5e4
    loss, grads = _check(problem, torch.float32)
    assert loss > 1e3 and all(torch.isfinite(g).all() for g in grads)


def test_no_grad_computes_no_gradient_and_one_backward_per_forward():
    h, weight, targets = _problem(20, 16, 300)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(h.requires_grad_(), weight.requires_grad_(), targets, **GEOMETRY)
    assert not loss.requires_grad
    loss = fused_linear_cross_entropy(h, weight, targets, **GEOMETRY)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()


def test_launch_geometry_and_bad_input_is_refused():
    assert cross_entropy_launch(37, 40, 1000, chunk_size=16, block_v=256, num_warps=4) == {
        "chunks": 3, "chunk_rows": 16, "grid_per_chunk": [16], "block_v": 256, "vocab_blocks": 4, "num_warps": 4,
        "logits_bytes_per_chunk": 16 * 1000 * 4}
    h, weight, targets = _problem(8, 16, 300)
    bad = targets.clone()
    bad[3] = 300
    for call, message in [
        (lambda: fused_linear_cross_entropy(h, weight, bad), "1 targets outside \\[0, V=300\\)"),
        (lambda: fused_linear_cross_entropy(h, weight.half(), targets), "give one dtype"),
        (lambda: fused_linear_cross_entropy(h, weight, targets.int()), "int64"),
        (lambda: fused_linear_cross_entropy(h, weight[:, :8], targets), "shapes differ"),
        (lambda: fused_linear_cross_entropy(h, weight, targets, label_smoothing=1.5), "must be in \\[0, 1\\]"),
        (lambda: fused_linear_cross_entropy(h, weight, targets, block_v=100), "power of two"),
        (lambda: fused_linear_cross_entropy(h, weight, targets, chunk_size=0), "chunk_size=0"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
