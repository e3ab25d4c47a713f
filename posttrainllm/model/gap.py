"""The trainer–sampler gap: what the sampler said a token's log-probability was, against what the trainer computes.

In RL post-training the sampler (decode with a KV cache, a query chunk at a time, prompts batched) and the trainer
(one forward over the whole sequence) compute the "same" log-probabilities with different kernels, shapes and
reduction orders; any gap makes on-policy training silently off-policy. Here, for each pair of paths:

    sample   greedy_cached with the sampler's decode attention: the tokens and the log-probability of each
             under the logits that chose it (B, N)
    score    one forward over prompt + tokens with the trainer's attention: the same tokens' log-probabilities
    compare  |Δ log p| per token (max, mean) and the fraction of tokens whose fp32 log-probabilities are equal
             bit for bit

Prompts come in batches, each of one length (the KV cache holds one length per batch: ragged batches would need a
per-row length it does not have). The model's attention slots are restored when done.

Shape legend
    B   batch    P   prompt length    N   new tokens    V   vocab
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from posttrainllm import rules
from posttrainllm.model.decode import greedy_cached
from posttrainllm.model.slots import ATTENTION, CACHED_ATTENTION
from posttrainllm.model.transformer import Transformer

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits (B, N, V), tokens (B, N) -> (B, N): each token's log-probability, log_softmax in fp32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None])[..., 0]


@torch.no_grad()
def sample(model: Transformer, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """prompt (B, P) -> tokens (B, N) and their log-probabilities as the sampler computed them (B, N)."""
    tokens, _, logits = greedy_cached(model, prompt, new_tokens, keep_logits=True)
    return tokens, chosen_logprobs(logits, tokens)


@torch.no_grad()
def score(model: Transformer, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The trainer's log-probabilities of `tokens` (B, N) after `prompt` (B, P): one full-sequence forward."""
    logits = model(torch.cat([prompt, tokens], dim=1))[0]  # (B, P + N, V): position t predicts token t + 1
    return chosen_logprobs(logits[:, prompt.shape[1] - 1:-1], tokens)


def compare(sampled: torch.Tensor, scored: torch.Tensor) -> dict[str, Any]:
    """|Δ log p| over every token, and the fraction equal bit for bit (both fp32)."""
    diff = (sampled.double() - scored.double()).abs()
    same = sampled.contiguous().view(torch.int32) == scored.contiguous().view(torch.int32)
    return {"tokens": int(diff.numel()), "max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
            "bitwise_fraction": float(same.double().mean()), "bitwise": bool(same.all())}


def rows_batch_invariant(model: Transformer, prompt: torch.Tensor) -> bool:
    """Whether the model's first linear layer gives a row the same bits alone as among the B·P rows of a forward:
    where it does not, decode (B rows a step) and the forward (B·P rows) differ outside attention already."""
    x = model.tok_emb(prompt).reshape(-1, model.config.d_model)  # (B·P, d)
    weight = model.lm_head.weight  # (V, d): the layer every log-probability passes through
    together = x @ weight.T
    return all(torch.equal(together[i], (x[i:i + 1] @ weight.T)[0]) for i in range(0, x.shape[0], 7))


def measure_gap(model: Transformer, prompts: list[torch.Tensor], new_tokens: int, samplers: dict[str, AttentionFn],
                trainers: dict[str, AttentionFn]) -> dict[str, Any]:
    """Every sampler against every trainer on the same batches of prompts: {"pairs": {"<sampler> -> <trainer>":
    compare(...)}, ...}, and where no pair is bitwise, why not (the same attention on both sides differs too:
    the rest of the model; else the attention paths)."""
    saved = (model.slot(ATTENTION), model.slot(CACHED_ATTENTION))
    pairs: dict[str, dict[str, Any]] = {}
    try:
        for s_name, s_fn in samplers.items():
            model.swap(CACHED_ATTENTION, s_fn)
            runs = [sample(model, prompt, new_tokens) for prompt in prompts]
            sampled = torch.cat([lp.reshape(-1) for _, lp in runs])
            for t_name, t_fn in trainers.items():
                model.swap(ATTENTION, t_fn)
                scored = torch.cat([score(model, prompt, tokens).reshape(-1)
                                    for prompt, (tokens, _) in zip(prompts, runs)])
                pairs[f"{s_name} -> {t_name}"] = compare(sampled, scored)
    finally:
        model.swap(ATTENTION, saved[0])
        model.swap(CACHED_ATTENTION, saved[1])
    out: dict[str, Any] = {"rule": rules.cite("trainer_sampler_gap"),
                           "batches": [{"prompts": int(p.shape[0]), "prompt_len": int(p.shape[1])} for p in prompts],
                           "new_tokens": new_tokens, "pairs": pairs}
    same = [name for name in pairs if name.split(" -> ")[0] == name.split(" -> ")[1]]
    if not any(pairs[name]["bitwise"] for name in same):
        invariant = rows_batch_invariant(model, prompts[0])
        out["why_not_bitwise"] = (
            "no path is bitwise with itself across sampler and trainer: the gap is not only attention's. "
            + ("This device's matmul gives a row other bits alone than among the rows of a batch (the output "
               "layer, checked here): a decode step multiplies B rows, the forward B·P, so every layer's "
               "reduction order differs" if not invariant else
               "This device's matmul is row-invariant on the output layer; the rest (the attention's own "
               "shapes: a query chunk against the cache vs the full causal square) is where it differs"))
    return out
