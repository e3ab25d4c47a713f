"""The trainer–sampler gap (model/gap.py): decode's log-probabilities against the training forward's, per pair."""

import torch

from posttrainllm.model.gap import compare, measure_gap
from posttrainllm.model.slots import defaults
from posttrainllm.model.transformer import ModelConfig, Transformer

TINY = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=64, max_seq_len=64)


def split_by_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A decode path that picks its KV split count from the batch (split-KV, as decode kernels do) and combines the
    splits' partial softmaxes in fp16: right to ~1e-3, but the same row gets other values in another batch."""
    splits = max(1, q.shape[0])
    bounds = torch.linspace(0, k.shape[2], splits + 1).round().long().tolist()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5  # (B, H, Tq, Tk)
    tq, tk = q.shape[2], k.shape[2]
    mask = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)  # bottom-right causal: the chunk at the cache's end
    scores = scores.masked_fill(~mask, float("-inf"))
    outs, sums, maxes = [], [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi == lo:
            continue
        part = scores[..., lo:hi]
        m = part.amax(-1, keepdim=True).clamp_min(-1e30)
        p = (part - m).exp()
        outs.append((p @ v[:, :, lo:hi]).half())
        sums.append(p.sum(-1, keepdim=True).half())
        maxes.append(m)
    top = torch.stack(maxes).amax(0)
    scale = [(m - top).exp() for m in maxes]
    num = sum(o.float() * s for o, s in zip(outs, scale))
    den = sum(d.float() * s for d, s in zip(sums, scale))
    return num / den


def _prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (3, 9), generator=gen), torch.randint(0, 256, (3, 4), generator=gen)]


def test_compare_counts_equal_bits_and_the_largest_difference():
    a = torch.tensor([[-1.0, -2.0, -3.0]])
    got = compare(a, a.clone())
    assert got["bitwise"] and got["bitwise_fraction"] == 1.0 and got["max_abs"] == 0.0 and got["tokens"] == 3
    b = a.clone()
    b[0, 1] = torch.nextafter(b[0, 1], torch.tensor(0.0))  # one ulp: allclose by any tolerance, not bitwise
    got = compare(a, b)
    assert not got["bitwise"] and abs(got["bitwise_fraction"] - 2 / 3) < 1e-12 and 0 < got["max_abs"] < 1e-6


def test_every_pair_is_measured_and_a_batch_dependent_decode_path_is_named_by_its_gap():
    model = Transformer(TINY, seed=0).eval()
    reference_attention, reference_chunk_attention = defaults()["attention"], defaults()["cached_attention"]
    gap = measure_gap(model, _prompts(), 6, {"reference": reference_chunk_attention, "split_by_batch": split_by_batch},
                      {"reference": reference_attention, "sdpa": lambda q, k, v: torch.nn.functional
                       .scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)})
    assert set(gap["pairs"]) == {"reference -> reference", "reference -> sdpa", "split_by_batch -> reference",
                                 "split_by_batch -> sdpa"}
    assert gap["batches"] == [{"prompts": 3, "prompt_len": 9}, {"prompts": 3, "prompt_len": 4}]
    assert all(p["tokens"] == 2 * 3 * 6 for p in gap["pairs"].values())
    honest, planted = gap["pairs"]["reference -> reference"], gap["pairs"]["split_by_batch -> reference"]
    assert honest["max_abs"] < 1e-4  # the same math, other shapes: at most a few ulps apart
    assert planted["max_abs"] > 10 * max(honest["max_abs"], 1e-6)
    assert planted["bitwise_fraction"] < honest["bitwise_fraction"]
    assert ("why_not_bitwise" in gap) == (not honest["bitwise"])
    assert gap["rule"] == "trainer_sampler_gap"  # by id: its text is posttrainllm/rules.py's
    # the model attends as before
    assert all(b.attn.fns["attention"] is reference_attention and b.attn.fns["cached_attention"] is reference_chunk_attention
               for b in model.blocks)

