"""KV-cached and speculative decoding against full recomputation: same logits within fp32, same tokens."""

import math

import pytest
import torch

from posttrainllm.model.decode import first_mismatch, greedy_cached, greedy_recompute, speculative
from posttrainllm.model.heads import MedusaHeads
from posttrainllm.model.transformer import KVCache, ModelConfig, Transformer


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Transformer(ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96), seed=3).eval()
    with torch.no_grad():  # sharper logits than the N(0, 0.02) init, so greedy tokens vary
        m.lm_head.weight.mul_(30)
    return m


def test_cached_decoding_matches_recomputation(model):
    prompt = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(1))
    want_tokens, want_logits = greedy_recompute(model, prompt, 24)
    got_tokens, _, got_logits = greedy_cached(model, prompt, 24, keep_logits=True)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_tokens, want_tokens)
    assert len(set(want_tokens[0].tolist())) > 3  # not one token repeated: the check has teeth


def test_a_chunk_over_the_cache_equals_the_whole_sequence(model):
    seq = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    whole = model(seq)[0]  # (1, 30, V)
    cache = KVCache(model.config, 1, 40)
    parts = [model(seq[:, :20], cache=cache)[0], model(seq[:, 20:21], cache=cache)[0], model(seq[:, 21:], cache=cache)[0]]
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-5, rtol=1e-5)
    assert cache.length == 30
    cache.rollback(21)  # forget 21..29, then write them again
    again = model(seq[:, 21:], cache=cache)[0]
    torch.testing.assert_close(again, whole[:, 21:], atol=1e-5, rtol=1e-5)


def test_a_cache_that_forgets_rope_offsets_is_caught(model, monkeypatch):
    """Planted bug: positions restart at 0 for each chunk. The equality above must then fail."""
    seq = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    cache = KVCache(model.config, 1, 12)
    model(seq[:, :8], cache=cache)
    cache.length, saved = 0, cache.length  # RoPE of the next chunk computed as if at position 0 ...
    monkeypatch.setattr(cache, "append", lambda layer, k, v: (torch.cat([cache.k[layer][:, :, :saved], k], 2),
                                                               torch.cat([cache.v[layer][:, :, :saved], v], 2)))
    wrong = model(seq[:, 8:], cache=cache)[0]
    assert not torch.allclose(wrong, model(seq)[0][:, 8:], atol=1e-3)


def test_cache_bounds_are_refused(model):
    cache = KVCache(model.config, 1, 4)
    with pytest.raises(ValueError, match="KV cache full"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="rollback to 3"):
        cache.rollback(3)
    with pytest.raises(ValueError, match="max_len=200"):
        KVCache(model.config, 1, 200)


@pytest.mark.parametrize("num_heads", [0, 1, 3])
def test_speculative_decoding_is_lossless_whatever_the_heads_propose(model, num_heads):
    """Random heads (K = 1, 3) propose nonsense, K = 0 is plain decoding through the same loop: the output is
    greedy's. (These drafts are almost never accepted: the oracle tests below accept several per verification.)"""
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(4))
    want = greedy_cached(model, prompt, 30, keep_logits=True)[1]
    heads = MedusaHeads(model.lm_head.weight.detach(), num_heads)
    torch.manual_seed(5)
    with torch.no_grad():
        for block in heads.blocks:
            block.linear.weight.normal_(0, 0.5)
    got = speculative(model, heads if num_heads else None, prompt, 30)
    assert got.tokens == want.tokens
    assert len(got.accepted) == len(got.steps) and sum(m for _, m in got.steps) == 29
    assert len(got.token_latencies_s) == 29


class Oracle:
    """Draft heads that know the base: handed the hidden state at position t of the base's greedy path, head k
    drafts the base's argmax after that path's next token and the drafts of heads 1..k-1. Heads in `wrong`
    (0-based) draft the base's runner-up instead, so the drafts after a wrong one continue the wrong branch
    exactly as the base would (recomputed, no cache): they match the verification's tokens too, and only a
    verifier that stops at the first rejection emits greedy's tokens. `rank` places each head's draft at that
    rank of its top-w list (tree verification), among the base's 3rd, 4th, ... tokens (never its top 2).

    The position is found among the hidden states of `path` (prompt + greedy tokens), the only states a
    lossless decoder hands its heads; any other state fails here: the decoder already emitted a non-greedy token.
    """

    def __init__(self, model, path, num_heads, wrong=(), rank=None):
        self.model, self.path, self.num_heads, self.wrong = model, path, num_heads, set(wrong)
        self.rank = rank or (0,) * num_heads
        with torch.no_grad():
            self.states = model.hidden(path)[0]  # (T, C): every state on the greedy path
            self.logits = model.lm_head(self.states)  # (T, V): the base's logits along it

    def _ranked(self, hidden, width):
        """hidden (C,) -> (K, width): each head's list, its draft at rank[k]."""
        gap = (self.states - hidden).norm(dim=-1)  # (T,)
        t = int(gap.argmin())
        assert gap[t] < 1e-3, f"heads handed a state off the base's greedy path (nearest {float(gap[t]):.3g} away)"
        context, branched, rows = self.path[:, :t + 2], False, []  # up to the base's own next token, chosen at t
        for k in range(self.num_heads):
            on_path = not branched and context.shape[1] <= self.path.shape[1]
            last = self.logits[context.shape[1] - 1] if on_path else self.model(context)[0][0, -1]  # (V,)
            ranked = last.topk(width + 2).indices  # (width + 2,)
            draft = ranked[1] if k in self.wrong else ranked[0]
            branched |= k in self.wrong
            others = ranked[2:].tolist()
            rows.append((others[:self.rank[k]] + [int(draft)] + others[self.rank[k]:])[:width])
            context = torch.cat([context, draft.view(1, 1)], dim=1)
        return torch.tensor(rows)

    @torch.no_grad()
    def propose(self, hidden):  # (1, C) -> (1, K): each head's top-1, as MedusaHeads.propose
        return self._ranked(hidden[0], 1)[None, :, 0]

    @torch.no_grad()
    def propose_topk(self, hidden, width):  # (C,) -> (K, width), as MedusaHeads.propose_topk
        return self._ranked(hidden, width)


@pytest.fixture(scope="module")
def greedy_path(model):
    """A prompt (1, 9) and its greedy path (1, 9 + 16 + 3): 16 tokens to decode, + 3 (K, the tree's depth) for
    the states of the last step's overshoot."""
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(11))
    return prompt, torch.cat([prompt, greedy_cached(model, prompt, 16 + 3)[0]], dim=1)


@pytest.mark.parametrize("wrong, accepts", [((), 3), ((1,), 1)])
def test_chain_verification_accepts_exactly_the_drafts_before_the_first_wrong_one(model, greedy_path, wrong, accepts):
    """K = 3 oracle drafts. All right: every verification accepts all 3 (4 tokens a step). Head 2 wrong (the
    base's runner-up), head 3 still matching the base's token after it (the first verification, checked by
    hand, shows it): every verification accepts exactly 1. A verifier that accepts past the first rejection
    emits the wrong draft (or, if it only counts them, reports more accepted)."""
    prompt, path = greedy_path
    oracle = Oracle(model, path, 3, wrong)
    with torch.no_grad():  # the first verification by hand: which drafts equal the base's tokens
        drafts = oracle.propose(model.hidden(prompt)[:, -1])  # (1, 3)
        chunk = torch.cat([path[:, :10], drafts], dim=1)  # (1, 9 + 4): the prompt, the base's next token, drafts
        greedy = model(chunk)[0][0, 9:12].argmax(-1)  # (3,): the base's token after each draft's prefix
    assert (drafts[0] == greedy).tolist() == [k not in wrong for k in range(3)]
    got = speculative(model, oracle, prompt, 16)
    assert got.tokens == path[0, 9:25].tolist()
    assert got.accepted == [accepts] * math.ceil(15 / (accepts + 1))  # 15 tokens after the first, accepts + 1 a step
    assert sum(m for _, m in got.steps) == 15  # the last step's overshoot trimmed


def test_a_mismatch_is_found_and_a_near_tie_is_named():
    logits = [torch.tensor([1.0, 0.0]), torch.tensor([2.0, 2.0 - 1e-5])]
    assert first_mismatch([0, 0], [0, 0], logits, 1e-3) is None
    found = first_mismatch([0, 1], [0, 0], logits, 1e-3)
    assert found["index"] == 1 and found["near_tie"] and found["top2_gap"] == pytest.approx(1e-5, rel=1e-2)
    assert not first_mismatch([1, 0], [0, 0], logits, 1e-3)["near_tie"]


def test_speculative_decoding_through_the_triton_decode_kernel_equals_greedy(model, tmp_path):
    """heads.cached_attention=triton (interpreted on a CPU): greedy and speculative decoding attend with our
    kernel, chunks of 1 and K + 1 queries, and give greedy-with-the-reference's tokens; a planted mask bug does not."""
    from conftest import kernel_mutant

    from posttrainllm.lab.configure import load
    from posttrainllm.lab.heads import cached_attention

    fn, info = cached_attention(load(["device=cpu", "heads.cached_attention=triton"]))
    assert info["path"] == "triton" and info["timed"] is not info["triton_interpreted"]
    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(6))
    want = greedy_cached(model, prompt, 8, keep_logits=True)[1]
    heads = MedusaHeads(model.lm_head.weight.detach(), 2)
    chunks = []

    def counted(q, k, v):
        chunks.append(q.shape[2])
        return fn(q, k, v)

    default = model.slot("cached_attention")
    model.swap("cached_attention", counted)
    try:
        assert greedy_cached(model, prompt, 8)[1].tokens == want.tokens
        assert speculative(model, heads, prompt, 8).tokens == want.tokens
        mutant = kernel_mutant(tmp_path, "decode_attention", "limit = query + SK - SQ", "limit = query")
        model.swap("cached_attention", lambda q, k, v: mutant.decode_attention(q, k, v))  # top-left: wrong in a cache
        assert greedy_cached(model, prompt, 8)[1].tokens != want.tokens
    finally:
        model.swap("cached_attention", default)
    assert {1, 3} <= set(chunks)  # one-token steps and K + 1 = 3 position verifications ran through the kernel


# --- tree verification (opt-in: heads.tree) ------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_ish(model):
    """K = 3 heads overfit (a few Adam steps) to the base's greedy continuation of one prompt: they guess it well,
    so tree verifications accept deep paths (and compaction has entries to move), yet not always the top-1."""
    from posttrainllm.model.heads import self_distillation_loss

    prompt = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(7))
    tokens = torch.cat([prompt, greedy_cached(model, prompt, 40)[0]], dim=1)  # (1, 49)
    with torch.no_grad():
        hidden = model.hidden(tokens)  # (1, 49, C)
    torch.manual_seed(8)
    heads = MedusaHeads(model.lm_head.weight.detach(), 3)
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    for _ in range(25):
        loss, _ = self_distillation_loss(heads(hidden), tokens, 9, 0.8)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval(), prompt


def _random_heads(model, num_heads):
    heads = MedusaHeads(model.lm_head.weight.detach(), num_heads)
    torch.manual_seed(5)
    with torch.no_grad():
        for block in heads.blocks:
            block.linear.weight.normal_(0, 0.5)
    return heads


def test_a_candidate_tree_is_breadth_first_and_each_entry_sees_its_ancestors_only():
    from posttrainllm.model.decode import candidate_tree

    tree = candidate_tree([2, 2, 1])
    assert tree.size == 1 + 2 + 4 + 4 and tree.parent == (-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6)
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert tree.choice.tolist() == [0, 0, 1, 0, 1, 0, 1, 0, 0, 0, 0]
    assert tree.visible[9].nonzero().flatten().tolist() == [0, 2, 5, 9]  # root, its grandparent, parent, itself
    assert not tree.visible[2, 1]  # siblings do not see each other
    with pytest.raises(ValueError, match="each >= 1"):
        candidate_tree([2, 0])


@pytest.mark.parametrize("widths", [[2, 2, 1], [3, 1]])
def test_tree_speculative_decoding_is_lossless_with_random_and_trained_heads(model, trained_ish, widths):
    from posttrainllm.model.decode import speculative_tree

    heads, prompt = trained_ish
    for proposer in (_random_heads(model, 3), heads):
        want = greedy_cached(model, prompt, 30, keep_logits=True)[1]
        got = speculative_tree(model, proposer, prompt, 30, widths)
        assert got.tokens == want.tokens
        assert len(got.accepted) == len(got.steps) and sum(m for _, m in got.steps) == 29
    assert max(got.accepted) == len(widths)  # the trained heads' deepest paths were accepted


@pytest.mark.parametrize("rank, wrong, accepts", [((1, 0, 0), (), 3), ((1, 1, 0), (1,), 1)])
def test_tree_verification_accepts_exactly_the_greedy_path(model, greedy_path, rank, wrong, accepts):
    """Tree [2, 2, 1] of oracle drafts. Head 1's draft at rank 1, below a token the base ranks 3rd (a chain of the
    heads' top-1s would be rejected at its first draft): the tree accepts all 3 every verification. Add head 2
    drafting the base's runner-up (at rank 1), head 3 continuing that branch as the base would: exactly 1
    accepted, though that branch's depth-3 entry matches the base's token after its parent; a rule that does not
    require the ancestors accepted accepts it and emits the runner-up."""
    from posttrainllm.model.decode import speculative_tree

    prompt, path = greedy_path
    got = speculative_tree(model, Oracle(model, path, 3, wrong, rank), prompt, 16, [2, 2, 1])
    assert got.tokens == path[0, 9:25].tolist()
    assert got.accepted == [accepts] * math.ceil(15 / (accepts + 1))


def test_trained_heads_accept_more_than_untrained_ones(model, trained_ish):
    """The trained_ish heads, distilled on this prompt's greedy continuation, accept more than one draft per
    verification on average (the lab's mean accepted length, lab/heads.py `_summarise`); K = 3 untrained heads
    (zero-init: each guesses the base's next token, whatever its depth) accept at least one token fewer."""
    from posttrainllm.lab.heads import _summarise

    heads, prompt = trained_ish
    want = greedy_cached(model, prompt, 16)[1].tokens
    untrained = MedusaHeads(model.lm_head.weight.detach(), 3)
    got = {name: speculative(model, h, prompt, 16) for name, h in (("trained", heads), ("untrained", untrained))}
    assert got["trained"].tokens == got["untrained"].tokens == want
    length = {name: _summarise([g], {}, 3, timed=False)["mean_accepted_length"] for name, g in got.items()}
    assert length["trained"] > 2 and length["trained"] >= length["untrained"] + 1


def test_each_tree_entry_sees_the_cache_and_its_path_only(model):
    """One tree forward gives each entry the logits of prompt + its own root-to-entry path run as a sequence.
    A mask that lets an entry see every earlier entry of the flattened chunk (its siblings' subtrees) fails."""
    from posttrainllm.model.decode import candidate_tree

    prompt = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(9))
    tree = candidate_tree([2, 2, 1])
    chunk = torch.randint(0, 256, (1, tree.size), generator=torch.Generator().manual_seed(10))  # any tokens

    def tree_logits(visible):
        cache = KVCache(model.config, 1, 40)
        model(prompt, cache=cache)
        return model.lm_head(model.hidden(chunk, cache, tree=(tree.depth, visible)))[0]  # (T, V)

    def path_logits():
        rows = []
        for i in range(tree.size):
            path = tree.visible[i].nonzero().flatten()  # ancestors and itself, in flattened (= depth) order
            rows.append(model(torch.cat([prompt, chunk[:, path]], dim=1))[0][0, -1])
        return torch.stack(rows)  # (T, V)

    want = path_logits()
    torch.testing.assert_close(tree_logits(tree.visible), want, atol=1e-4, rtol=1e-4)
    flattened = torch.ones(tree.size, tree.size, dtype=torch.bool).tril()  # planted bug: causal over the chunk
    assert not torch.allclose(tree_logits(flattened), want, atol=1e-3)


def test_tree_cache_compaction_leaves_greedys_cache(model, trained_ish, monkeypatch):
    """After tree decoding, the cache holds exactly the accepted tokens' keys and values: greedy_cached's."""
    from posttrainllm.model import decode

    made = []

    class Kept(KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(decode, "KVCache", Kept)
    heads, prompt = trained_ish
    want = decode.greedy_cached(model, prompt, 30)[1]
    got = decode.speculative_tree(model, heads, prompt, 30, [2, 2, 1])
    assert got.tokens == want.tokens and max(got.accepted) >= 2  # depth >= 2 was accepted: entries were moved
    greedy, tree = made
    n = 9 + 30 - 1  # the prompt and every generated token but the last
    assert greedy.length == n and tree.length >= n
    for layer in range(model.config.n_layers):
        torch.testing.assert_close(tree.k[layer][:, :, :n], greedy.k[layer][:, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tree.v[layer][:, :, :n], greedy.v[layer][:, :, :n], atol=1e-5, rtol=1e-5)
