"""Greedy generation: full recomputation (the readable reference), KV-cached, and speculative (lossless).

    greedy_recompute   every step runs the whole sequence again, no cache: the reference
    greedy_cached      prefill the prompt into a KVCache, then one-token decode steps
    speculative        Medusa chain verification: the heads propose K tokens; the base checks them
                       in ONE forward of K + 1 positions over the cache; the longest prefix equal to
                       the base's own greedy tokens is accepted, plus the base's next token; the
                       cache is rolled back past the rejected positions. K = 0 is plain decoding
                       through the same code path.
    speculative_tree   Medusa tree verification (opt-in: heads.tree): the heads' top-w lists span a tree
                       of candidate continuations (`candidate_tree`), verified in ONE forward with a tree
                       attention mask; the longest root-to-node path the base agrees with is accepted,
                       plus the base's next token, and its cache entries compacted into place.

Lossless means the speculative tokens equal greedy_cached's token for token: every accepted
token IS the base's argmax at its position. Floating point can still differ (a (K+1)-row forward
reduces in another order than a 1-row one), so an argmax whose top-2 logits are nearly tied can
flip: `first_mismatch` finds it and names it a near-tie when the gap is below a threshold.

Timing: each result carries the wall-clock time of its prefill (time to first token) and of
every later step with the number of tokens it produced, so inter-token latency is per token:
a step that yields m tokens in dt seconds contributes m latencies of dt / m.

Shape legend
    B   batch    P   prompt length    N   new tokens    K   draft heads    V   vocab
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from posttrainllm.model.heads import MedusaHeads
from posttrainllm.model.transformer import KVCache, Transformer


@dataclass
class Generation:
    tokens: list[int]  # the N generated tokens (prompt excluded)
    ttft_s: float  # prefill + first token
    steps: list[tuple[float, int]] = field(default_factory=list)  # (seconds, tokens produced) per later step
    accepted: list[int] = field(default_factory=list)  # speculative: draft tokens accepted per verification
    logits: list[torch.Tensor] = field(default_factory=list)  # greedy: (V,) logits that chose each token

    @property
    def token_latencies_s(self) -> list[float]:
        """Inter-token latency, per token after the first: a step of m tokens in dt gives m values dt / m."""
        return [dt / m for dt, m in self.steps for _ in range(m)][: max(0, len(self.tokens) - 1)]

    @property
    def decode_s(self) -> float:
        return sum(dt for dt, _ in self.steps)

    def record(self, seconds: float, emitted: list[int], accepted: int) -> None:
        """One verification step: its time, the tokens it emitted, and how many drafts it accepted."""
        self.steps.append((seconds, len(emitted)))
        self.accepted.append(accepted)
        self.tokens += emitted

    def trimmed(self, new_tokens: int) -> Generation:
        """The last step may overshoot new_tokens: its surplus tokens are dropped, its time kept."""
        extra = len(self.tokens) - new_tokens
        if extra:
            self.tokens = self.tokens[:new_tokens]
            dt, m = self.steps[-1]
            self.steps[-1] = (dt, m - extra)
        return self


@torch.no_grad()
def greedy_recompute(model: Transformer, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: prompt (B, P) -> tokens (B, N) and the logits that chose them (B, N, V), no cache."""
    seq, logits = prompt, []
    for _ in range(new_tokens):
        last = model(seq)[0][:, -1]  # (B, V): the whole sequence recomputed
        logits.append(last)
        seq = torch.cat([seq, last.argmax(-1, keepdim=True)], dim=1)  # (B, P + i + 1)
    return seq[:, prompt.shape[1]:], torch.stack(logits, dim=1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy_cached(model: Transformer, prompt: torch.Tensor, new_tokens: int, *, keep_logits: bool = False
                  ) -> tuple[torch.Tensor, Generation | None, torch.Tensor | None]:
    """Prefill, then one-token steps: prompt (B, P) -> tokens (B, N); timed when B == 1; logits (B, N, V) if asked."""
    B, P = prompt.shape
    device = prompt.device
    cache = KVCache(model.config, B, P + new_tokens, device=device, dtype=model.tok_emb.weight.dtype)
    _sync(device)
    start = time.perf_counter()
    last = model(prompt, cache=cache)[0][:, -1]  # (B, V)
    tokens, logits = [last.argmax(-1)], [last] if keep_logits else []
    _sync(device)
    gen = Generation(tokens=[], ttft_s=time.perf_counter() - start)
    for _ in range(new_tokens - 1):
        t0 = time.perf_counter()
        last = model(tokens[-1][:, None], cache=cache)[0][:, -1]  # (B, V): one new position over the cache
        tokens.append(last.argmax(-1))
        if keep_logits:
            logits.append(last)
        _sync(device)
        gen.steps.append((time.perf_counter() - t0, 1))
    out = torch.stack(tokens, dim=1)  # (B, N)
    if B == 1:
        gen.tokens = out[0].tolist()
        gen.logits = [row[0] for row in logits] if keep_logits else []
    return out, (gen if B == 1 else None), (torch.stack(logits, dim=1) if keep_logits else None)


@torch.no_grad()
def speculative(model: Transformer, heads: MedusaHeads | None, prompt: torch.Tensor, new_tokens: int) -> Generation:
    """Medusa chain decoding of one prompt (1, P): lossless by construction (module docstring).

    Each verification forwards [last token, p_1..p_K] at positions L..L+K over the cache: g_i, the
    base's argmax after chunk[:i+1]; n = the longest run with p_j == g_{j-1}; emit p_1..p_n and g_n;
    keep positions up to L+n (rollback to L+n+1); the heads then propose from the hidden state at n.
    """
    if prompt.shape[0] != 1:
        raise ValueError(f"speculative decoding here is batch 1, got a prompt of shape {tuple(prompt.shape)}")
    K = 0 if heads is None else heads.num_heads
    device = prompt.device
    P = prompt.shape[1]
    cache = KVCache(model.config, 1, P + new_tokens + K + 1, device=device, dtype=model.tok_emb.weight.dtype)
    _sync(device)
    start = time.perf_counter()
    hidden = model.hidden(prompt, cache)[:, -1]  # (1, C)
    nxt = model.lm_head(hidden).argmax(-1)  # (1,)
    drafts = heads.propose(hidden) if K else prompt.new_zeros((1, 0))  # (1, K)
    _sync(device)
    gen = Generation(tokens=[int(nxt)], ttft_s=time.perf_counter() - start)
    while len(gen.tokens) < new_tokens:
        t0 = time.perf_counter()
        length = cache.length
        chunk = torch.cat([nxt[:, None], drafts], dim=1)  # (1, K + 1)
        hidden = model.hidden(chunk, cache)  # (1, K + 1, C), the cache now holds L + K + 1 positions
        greedy = model.lm_head(hidden).argmax(-1)[0]  # (K + 1,): g_i, the base's token after chunk[:i+1]
        match = (drafts[0] == greedy[:K]).long()  # (K,)
        n = int(match.cumprod(0).sum()) if K else 0  # accepted drafts: the leading run of matches
        cache.rollback(length + n + 1)  # keep the last token and the n accepted drafts
        emitted = [*drafts[0, :n].tolist(), int(greedy[n])]
        nxt = greedy[n:n + 1]  # (1,): g_n, not yet in the cache
        drafts = heads.propose(hidden[:, n]) if K else drafts  # (1, K): from the state that chose g_n
        _sync(device)
        gen.record(time.perf_counter() - t0, emitted, n)
    return gen.trimmed(new_tokens)


@dataclass(frozen=True)
class CandidateTree:
    """A Cartesian tree of candidates (Medusa's, before its sparse trees): widths (w_1..w_D), D <= K.

    Entry 0 is the root, the base's current token (not yet in the cache). Every entry at depth d-1 has w_d
    children, the top-w_d tokens of head d (the same list under every parent: the heads all read the hidden
    state that chose the root). Entries are flattened breadth first, so a parent precedes its children:
    1 + w_1 + w_1·w_2 + ... + w_1···w_D entries. [1] * K is the chain of `speculative`.
    """

    widths: tuple[int, ...]
    parent: tuple[int, ...]  # (T,): the parent's flattened index, -1 for the root
    depth: torch.Tensor  # (T,) int64: 0 for the root; the RoPE position is cache.length + depth
    choice: torch.Tensor  # (T,) int64: the rank of the entry's token in its head's top-w list (root: 0)
    visible: torch.Tensor  # (T, T) bool: True where entry i may see entry j (j is i or one of its ancestors)

    @property
    def size(self) -> int:
        return len(self.parent)


def candidate_tree(widths: list[int] | tuple[int, ...]) -> CandidateTree:
    """The flattened tree of `widths` (module docstring): parents, depths, ranks and the ancestor mask."""
    widths = tuple(int(w) for w in widths)
    if not widths or min(widths) < 1:
        raise ValueError(f"a candidate tree needs one or more widths, each >= 1, got {list(widths)}")
    parent, depth, choice, level = [-1], [0], [0], [0]
    for d, width in enumerate(widths, start=1):
        below = []
        for p in level:
            for rank in range(width):
                parent.append(p)
                depth.append(d)
                choice.append(rank)
                below.append(len(parent) - 1)
        level = below
    visible = torch.zeros(len(parent), len(parent), dtype=torch.bool)  # (T, T)
    for i in range(len(parent)):
        j = i
        while j >= 0:  # itself, then up to the root
            visible[i, j] = True
            j = parent[j]
    return CandidateTree(widths, tuple(parent), torch.tensor(depth), torch.tensor(choice), visible)


def compact(cache: KVCache, start: int, sources: list[int]) -> None:
    """Move every layer's cache entries at positions `sources` to [start, start + len(sources)), in order."""
    if not sources:
        return
    index = torch.tensor(sources, device=cache.k[0].device)
    for keys, values in zip(cache.k, cache.v):
        keys[:, :, start:start + len(sources)] = keys[:, :, index]  # the gather copies first: overlaps are safe
        values[:, :, start:start + len(sources)] = values[:, :, index]


@torch.no_grad()
def speculative_tree(model: Transformer, heads: MedusaHeads, prompt: torch.Tensor, new_tokens: int,
                     widths: list[int] | tuple[int, ...]) -> Generation:
    """Medusa tree decoding of one prompt (1, P): lossless by construction, as `speculative`.

    Each verification forwards the flattened tree (`candidate_tree`: root = the last token, then the
    candidates) over the cache in one call, entry i at position L + depth_i, seeing the cache and its
    ancestors only (Transformer.hidden's `tree`: reference.masked_chunk_attention, whatever the decode
    attention, since the decode_attention paths take no arbitrary mask). g_i = the base's argmax at
    entry i; entry i is accepted when its parent is and its token equals g_parent; the deepest accepted
    entry b (unique: siblings hold distinct tokens) gives the path root -> b: emit its tokens and g_b,
    compact the path's keys and values to positions L+1.. and roll back to L + depth_b + 1; the heads
    then propose from the hidden state at b. Generation.accepted holds depth_b per verification.
    """
    if prompt.shape[0] != 1:
        raise ValueError(f"speculative decoding here is batch 1, got a prompt of shape {tuple(prompt.shape)}")
    tree = candidate_tree(widths)
    if heads is None or len(tree.widths) > heads.num_heads:
        raise ValueError(f"a tree of depth {len(tree.widths)} needs as many draft heads, got "
                         f"{0 if heads is None else heads.num_heads}")
    device = prompt.device
    P = prompt.shape[1]
    depth, visible = tree.depth.to(device), tree.visible.to(device)  # (T,), (T, T)
    head_of, rank_of = (tree.depth[1:] - 1).to(device), tree.choice[1:].to(device)  # (T-1,) each
    depths, parents, width = tree.depth.tolist(), tree.parent, max(tree.widths)
    cache = KVCache(model.config, 1, P + new_tokens + tree.size, device=device, dtype=model.tok_emb.weight.dtype)
    _sync(device)
    start = time.perf_counter()
    hidden = model.hidden(prompt, cache)[:, -1]  # (1, C)
    nxt = model.lm_head(hidden).argmax(-1)  # (1,)
    top = heads.propose_topk(hidden[0], width)  # (K, W)
    _sync(device)
    gen = Generation(tokens=[int(nxt)], ttft_s=time.perf_counter() - start)
    while len(gen.tokens) < new_tokens:
        t0 = time.perf_counter()
        length = cache.length
        chunk = torch.cat([nxt, top[head_of, rank_of]])[None]  # (1, T): the root, then the candidates
        hidden = model.hidden(chunk, cache, tree=(depth, visible))  # (1, T, C); cache slots [L, L + T) written
        greedy_t = model.lm_head(hidden).argmax(-1)[0]  # (T,): g_i, the base's token after entry i's path
        greedy, tokens = greedy_t.tolist(), chunk[0].tolist()
        ok, best = [True] + [False] * (tree.size - 1), 0
        for i in range(1, tree.size):  # breadth first: a parent is decided before its children
            ok[i] = ok[parents[i]] and tokens[i] == greedy[parents[i]]
            if ok[i] and depths[i] > depths[best]:
                best = i
        path, j = [], best
        while j > 0:
            path.append(j)
            j = parents[j]
        path.reverse()  # flattened indices of the accepted candidates, root excluded, shallowest first
        compact(cache, length + 1, [length + i for i in path])  # the root stays at L
        cache.rollback(length + len(path) + 1)
        emitted = [*(tokens[i] for i in path), greedy[best]]
        nxt = greedy_t[best:best + 1]  # (1,): g_b, not yet in the cache
        top = heads.propose_topk(hidden[0, best], width)  # (K, W): from the state that chose g_b
        _sync(device)
        gen.record(time.perf_counter() - t0, emitted, len(path))
    return gen.trimmed(new_tokens)


def first_mismatch(got: list[int], want: list[int], want_logits: list[torch.Tensor], near_tie: float
                   ) -> dict | None:
    """None when equal; else where they part, both tokens, and the reference's top-2 logit gap there
    (`near_tie`: the gap is below the threshold, so a different reduction order can flip the argmax)."""
    if got == want:
        return None
    index = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    entry: dict = {"index": index, "got": got[index] if index < len(got) else None,
                   "want": want[index] if index < len(want) else None}
    if index < len(want_logits):
        top2 = want_logits[index].float().topk(2).values
        entry["top2_gap"] = float(top2[0] - top2[1])
        entry["near_tie"] = entry["top2_gap"] < near_tie
    return entry
