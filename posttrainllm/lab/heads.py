"""Draft heads on a frozen base, and what they do to decoding: train base -> train heads -> measure decode -> receipt.

    train_base    the `architecture` model trained on the offline corpus's head (loss curve, held-out loss),
                  then frozen: <heads.out_dir>/base/ (shared by every K, reused while its settings match)
    train_heads   K Medusa heads (posttrainllm/model/heads.py) self-distilled on the base's own greedy
                  continuations of held-out prompts; per-head held-out top-1/top-5: <out_dir>/<heads.name>/
    decode        plain greedy (KV cache, one token a step) against speculative decoding on the same eval
                  prompts, measured the same way, with two controls: K = 0 through the speculative code path
                  and untrained heads (accepted length ~1). Every speculative output must equal greedy token
                  for token: a mismatch fails the run (LossyDecoding), a near-tie is named, never ignored.
    receipt       receipt.json + one MLflow run (posttrainllm/track/receipt.py: record_heads)

DVC runs them one process each (pipelines/train_base.py, train_heads.py, decode.py; decode writes the
receipt too); `posttrainllm experimental train-heads` runs the same functions in one process. Either way
each stage leaves a stamp (posttrainllm/track/stamp.py, written by lab/pipeline.py `stamped`): train_base
in <out_dir>/base/stamps/, train_heads and decode in <out_dir>/<heads.name>/stamps/; the receipt records
them and refuses stamps that ran different code.

Cached decoding and verification attend with heads.cached_attention, a path of the op that fills the model's
cached_attention slot (ops/registry.py `slot_op`: the op declaring that slot's default math). Triton through its
interpreter (CPU) is checked token for token like any path, but its timings are not speed: the receipt leaves them out and says why. Prompts come from the corpus's
held-out tail (heads.base.heldout_frac): its first half prompts the distillation, its second half the
evaluation, so neither the base nor the heads ever trained on an eval prompt.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch

from posttrainllm import rules
from posttrainllm.config import ConfigError, LabConfig
from posttrainllm.files import read_json, write_json
from posttrainllm.lab.pipeline import StageRun, execute, stamped
from posttrainllm.measure import device as devices
from posttrainllm.model.corpus import Corpus, batch_at, load_corpus, split_tail
from posttrainllm.model.corpus import prompts as corpus_prompts
from posttrainllm.model.decode import Generation, first_mismatch, greedy_cached, speculative, speculative_tree
from posttrainllm.model.heads import MedusaHeads, head_accuracy, self_distillation_loss
from posttrainllm.model.slots import ATTENTION, CACHED_ATTENTION, TREE_ATTENTION, defaults
from posttrainllm.model.transformer import KVCache, ModelConfig, Transformer

NOT_MEMORY_BOUND = ("a decode step here moves {gbps:.2f} GB/s of weights and KV cache, {frac:.1%} of the calibrated "
                    "copy bandwidth: the tiny model is not memory-bound on this device, a step's cost is per-op "
                    "overhead, so a (K+1)-position verification costs {ratio:.2f}x a 1-position step")


INTERPRETED = ("the decode attention is Triton through its interpreter (TRITON_INTERPRET=1): tokens checked, "
               "timings not speed (left out, as lab/stages/ does for interpreted paths)")
PREALLOCATED = ("the KV cache is preallocated for prompt + new tokens (+ K + 1 when verifying), so peak memory does "
                "not grow with the tokens generated; kv_cache_bytes is the cache's share of it")
TREE_VERIFICATION = ("{math}: the tree verification's explicit ancestor mask is an arbitrary mask, which no "
                     "cached_attention path takes (theirs is the slot's bottom-right causal mask), so tree "
                     "verification always attends with the reference math (the model's tree_attention default); "
                     "cached decoding and chain verification use heads.cached_attention")


def tree_attention_math() -> str:
    """The model's tree_attention default as module.function: what every tree verification attends with."""
    fn = defaults()[TREE_ATTENTION]
    return f"{fn.__module__}.{fn.__qualname__}"


class LossyDecoding(RuntimeError):
    """Speculative decoding produced a token plain greedy decoding did not; decode.json is already written."""


# --- folders, corpus, prompts ---------------------------------------------------------------------


def base_dir(cfg: LabConfig) -> Path:
    return Path(cfg.heads.out_dir) / "base"


def heads_dir(cfg: LabConfig) -> Path:
    return Path(cfg.heads.out_dir) / cfg.heads.name


def model_config(cfg: LabConfig) -> ModelConfig:
    a = cfg.architecture
    return ModelConfig(vocab_size=256, d_model=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads,
                       n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, mlp_hidden=a.mlp_hidden,
                       max_seq_len=cfg.heads.base.max_seq_len)


def split_corpus(cfg: LabConfig) -> tuple[Corpus, Corpus, Corpus]:
    """(train, held-out, the whole): the held-out part is the corpus's last heads.base.heldout_frac of bytes."""
    corpus = load_corpus()
    return (*split_tail(corpus, cfg.heads.base.heldout_frac), corpus)


def prompts(heldout: Corpus, count: int, length: int, part: str) -> torch.Tensor:
    """model/corpus.py `prompts`, a held-out half too short for the configured prompts being a ConfigError."""
    try:
        return corpus_prompts(heldout, count, length, part)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def base_fingerprint(cfg: LabConfig, corpus: Corpus) -> str:
    """What the base depends on: the architecture, heads.base and the exact corpus bytes."""
    key = {"architecture": asdict(cfg.architecture), "base": asdict(cfg.heads.base), "corpus": corpus.sha256}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _lr(step: int, steps: int, warmup: int, peak: float) -> float:
    """Linear warmup to `peak`, then cosine decay to peak / 10."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# --- train base -----------------------------------------------------------------------------------


@torch.no_grad()
def heldout_loss(model: Transformer, heldout: Corpus, cfg: LabConfig) -> float:
    b = cfg.heads.base
    losses = [float(model(*batch_at(heldout, i, batch_size=b.batch_size, seq_len=b.seq_len, seed=b.seed + 1))[1])
              for i in range(b.eval_batches)]
    return sum(losses) / len(losses)


def train_base(cfg: LabConfig) -> dict[str, Any]:
    """Train the base on the corpus's head; write base.pt (weights) and base.json (curve, held-out loss, sample)."""
    b = cfg.heads.base
    # untimed, so not bench.threads (the stage runner set that already): heads.base.threads, 0 = every usable CPU
    device = devices.prepare(cfg.device.name, b.threads or len(os.sched_getaffinity(0)))
    train, heldout, corpus = split_corpus(cfg)
    model = Transformer(model_config(cfg), seed=b.seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=b.lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses, started = [], time.perf_counter()
    initial_heldout = heldout_loss(model.eval(), heldout, cfg)
    model.train()
    for step in range(b.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, b.steps, b.warmup_steps, b.lr)
        x, y = batch_at(train, step, batch_size=b.batch_size, seq_len=b.seq_len, seed=b.seed)  # (B, T) each
        _, loss = model(x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - started
    model.eval()
    sample_prompt = prompts(heldout, 1, cfg.heads.prompt_len, "eval").to(device)
    sample, _, _ = greedy_cached(model, sample_prompt, cfg.heads.new_tokens)
    report = {
        "fingerprint": base_fingerprint(cfg, corpus), "model": asdict(model.config), "params": model.num_params(),
        "corpus": {"source": corpus.source, "sha256": corpus.sha256, "n_bytes": corpus.n_bytes,
                   "train_bytes": train.n_bytes, "heldout_bytes": heldout.n_bytes},
        "train": asdict(b), "device": device, "threads": torch.get_num_threads(), "train_s": seconds,
        "losses": losses, "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "heldout_loss_before": initial_heldout, "heldout_loss": heldout_loss(model, heldout, cfg),
        "heldout_loss_rule": rules.cite("heldout_loss", eval_batches=b.eval_batches),
        "sample": {"prompt": bytes(sample_prompt[0].tolist()).decode("utf-8", "replace"),
                   "greedy": bytes(sample[0].tolist()).decode("utf-8", "replace")},
    }
    out = base_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out / "base.pt")
    write_json(out / "base.json", report)
    return report


def load_base(cfg: LabConfig, device: str) -> tuple[Transformer, dict[str, Any]]:
    """The frozen base of these settings; ConfigError (one line) when it is missing or was trained otherwise."""
    out = base_dir(cfg)
    if not (out / "base.json").exists():
        raise ConfigError(f"no base under {out}: run `python pipelines/train_base.py` or "
                          "`posttrainllm experimental train-heads`")
    info = read_json(out / "base.json")
    want = base_fingerprint(cfg, split_corpus(cfg)[2])
    if info["fingerprint"] != want:
        raise ConfigError(f"the base under {out} was trained with other settings (fingerprint {info['fingerprint']}, "
                          f"these give {want}): retrain it (`python pipelines/train_base.py`)")
    model = Transformer(model_config(cfg)).to(device)
    model.load_state_dict(torch.load(out / "base.pt", weights_only=True))
    for p in model.parameters():
        p.requires_grad_(False)  # frozen: heads never change the base
    return model.eval(), info


def ensure_base(cfg: LabConfig) -> tuple[dict[str, Any], bool]:
    """The base's report, trained (and stamped) unless one matches these settings and this code: (report, trained)."""
    from posttrainllm.track import stamp

    try:
        info = load_base(cfg, devices.prepare(cfg.device.name, cfg.bench.threads))[1]
        made = stamp.read_stamps(base_dir(cfg)).get("train_base")
        if made is not None:
            stamp.check_consistent({"train_base": made, "now": {"sources": stamp.loaded_sources()}}, base_dir(cfg))
        return info, False
    except (ConfigError, stamp.StampMismatch):
        return stamped("train_base", stage_run("train_base", cfg)), True


# --- train heads ----------------------------------------------------------------------------------


def ensure_quality_base(cfg: LabConfig) -> None:
    """`posttrainllm bench-train` under a quantized precision: train the draft-heads base where there is none, with
    the settings DVC's train_base stage uses (conf/ as it is: architecture mha, heads k3), into heads.out_dir
    (lab/stages/bench_train.py quality_base_dir: the trained model the quality gate decodes with)."""
    from posttrainllm.lab.configure import load

    if cfg.precision.quantize is None or (base_dir(cfg) / "base.json").exists():
        return
    print(f"posttrainllm: no draft-heads base under {base_dir(cfg)}: training it (the quality gate decodes "
          "with it) ...", file=sys.stderr, flush=True)
    ensure_base(load([f"heads.out_dir={cfg.heads.out_dir}", f"device={cfg.device.name}"]))


def _base_digest(model: Transformer) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train_heads(cfg: LabConfig) -> dict[str, Any]:
    """Self-distil K heads on the frozen base; write heads.pt and heads.json (loss curve, per-head accuracy)."""
    h = cfg.heads
    device = devices.prepare(cfg.device.name, cfg.bench.threads)
    base, base_info = load_base(cfg, device)
    digest_before = _base_digest(base)
    _, heldout, _ = split_corpus(cfg)
    started = time.perf_counter()
    # the data: held-out prompts and the base's own greedy continuations, and its hidden states over them
    distill_prompts = prompts(heldout, h.train_prompts, h.prompt_len, "distill").to(device)  # (N, P)
    continuation, _, _ = greedy_cached(base, distill_prompts, h.continuation_len)  # (N, C)
    tokens = torch.cat([distill_prompts, continuation], dim=1)  # (N, P + C)
    eval_prompts = prompts(heldout, h.eval_prompts, h.prompt_len, "eval").to(device)  # (E, P)
    eval_tokens = torch.cat([eval_prompts, greedy_cached(base, eval_prompts, h.new_tokens)[0]], dim=1)  # (E, P + N)
    with torch.no_grad():
        hidden, eval_hidden = base.hidden(tokens), base.hidden(eval_tokens)  # (N, T, C), (E, T', C)
    data_s = time.perf_counter() - started
    torch.manual_seed(h.seed)
    heads = MedusaHeads(base.lm_head.weight.detach(), h.num_heads).to(device)
    untrained = head_accuracy(heads(eval_hidden), eval_tokens, h.prompt_len) if h.num_heads else []
    losses, per_head = [], []
    if h.num_heads:
        opt = torch.optim.AdamW(heads.parameters(), lr=h.lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(h.seed)
        for step in range(h.steps):
            for group in opt.param_groups:
                group["lr"] = _lr(step, h.steps, max(1, h.steps // 20), h.lr)
            rows = torch.randint(0, tokens.shape[0], (h.batch_size,), generator=gen)  # (B,)
            loss, ce = self_distillation_loss(heads(hidden[rows]), tokens[rows], h.prompt_len, h.loss_decay)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            per_head.append(ce)
    with torch.no_grad():
        accuracy = head_accuracy(heads(eval_hidden), eval_tokens, h.prompt_len) if h.num_heads else []
    if _base_digest(base) != digest_before:
        raise RuntimeError("training the heads changed the base's weights")  # never: the base is frozen
    generated = eval_tokens[:, h.prompt_len:]  # (E, N): what the eval prompts' drafts must match
    grams = [tuple(row[i:i + 4]) for row in generated.tolist() for i in range(len(row) - 3)]
    report = {"num_heads": h.num_heads, "base_fingerprint": base_info["fingerprint"], "base_digest": digest_before,
              "eval_continuations": {
                  "distinct_4gram_fraction": len(set(grams)) / max(1, len(grams)),
                  "note": "a tiny byte-level model's greedy continuations fall into loops (runs of spaces, repeated "
                          "phrases); loops are easy to draft, so acceptance here runs higher than on a real model's "
                          "text. Medusa-1 reports per-head top-1 ~0.56/0.32/0.20/0.15 on Vicuna-7B",
                  "samples": [bytes(row).decode("utf-8", "replace") for row in generated[:3].tolist()]},
              "data": {"distill_prompts": h.train_prompts, "prompt_len": h.prompt_len,
                       "continuation_len": h.continuation_len, "eval_prompts": h.eval_prompts,
                       "eval_new_tokens": h.new_tokens, "data_s": data_s,
                       "targets": "the base's own greedy continuations (self-distillation)"},
              "loss_weights": [h.loss_decay ** k for k in range(1, h.num_heads + 1)],
              "losses": losses, "per_head_ce": per_head, "train_s": time.perf_counter() - started,
              "heldout_accuracy": accuracy, "untrained_heldout_accuracy": untrained,
              "accuracy_rule": rules.cite("head_accuracy")}
    out = heads_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(heads.state_dict(), out / "heads.pt")
    write_json(out / "heads.json", report)
    return report


def load_heads(cfg: LabConfig, base: Transformer, device: str) -> MedusaHeads:
    heads = MedusaHeads(base.lm_head.weight.detach(), cfg.heads.num_heads).to(device)
    heads.load_state_dict(torch.load(heads_dir(cfg) / "heads.pt", weights_only=True))
    return heads.eval()


# --- decode ---------------------------------------------------------------------------------------


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]

    return {"median": statistics.median(ordered), "p20": at(0.2), "p80": at(0.8)}


def _summarise(gens: list[Generation], peak: dict[str, Any], K: int, timed: bool) -> dict[str, Any]:
    """Figures of one variant over the eval prompts (units in the keys); no timings unless `timed`."""
    produced = sum(len(g.tokens) for g in gens)
    entry: dict[str, Any] = {"steps": sum(len(g.steps) for g in gens), "tokens": produced, "peak_memory": peak}
    if timed:
        total_s = sum(g.ttft_s + g.decode_s for g in gens)
        decode_tokens = sum(len(g.tokens) - 1 for g in gens)
        entry.update({
            "ttft_ms": {k: v * 1e3 for k, v in _quantiles([g.ttft_s for g in gens]).items()},
            "itl_ms": {k: v * 1e3 for k, v in _quantiles([x for g in gens for x in g.token_latencies_s]).items()},
            "tokens_per_s": produced / total_s,  # every generated token / (prefill + decode) time
            "decode_tokens_per_s": decode_tokens / sum(g.decode_s for g in gens),  # after the first / decode time
            "step_ms": {k: v * 1e3 for k, v in _quantiles([dt for g in gens for dt, _ in g.steps]).items()},
        })
    accepted = [n for g in gens for n in g.accepted]
    if accepted:
        entry["mean_accepted_length"] = sum(n + 1 for n in accepted) / len(accepted)  # tokens per verification
        entry["acceptance_rate_per_head"] = [sum(n >= k for n in accepted) / len(accepted) for k in range(1, K + 1)]
    return entry


def cached_attention(cfg: LabConfig) -> tuple[Callable[..., torch.Tensor], dict[str, Any]]:
    """heads.cached_attention as the model's cached_attention slot function, (q, k, v) -> o, a path of the op that
    fills that slot (registry.slot_op), and what it is."""
    from posttrainllm.ops.registry import slot_op, with_op_defaults

    op = slot_op(CACHED_ATTENTION)
    impl = op.impls[cfg.heads.cached_attention]  # its built-in registry: op.peers / op.user_impls are a point's
    interpreted = impl.kind == "triton" and devices.triton_interpreted()
    return op.model_hook.fill(impl, with_op_defaults(cfg, op.name)), {"path": impl.name, "backend": impl.backend,
                                                 "triton_interpreted": interpreted, "timed": not interpreted}


def trainer_sampler_gap(cfg: LabConfig, base: Transformer, eval_prompts: torch.Tensor) -> dict[str, Any]:
    """The eval prompts sampled by cached_attention paths (the reference and heads.cached_attention) and scored by
    the built-in paths of the op filling the model's attention slot (the training forward), in two batches: the
    prompts at their length and cut to about half of it (model/gap.py). On the CPU, Triton runs through its
    interpreter (values, not speed)."""
    from posttrainllm.model.gap import measure_gap
    from posttrainllm.ops.registry import slot_op, with_op_defaults

    sampler, trainer = slot_op(CACHED_ATTENTION), slot_op(ATTENTION)
    samplers = {name: sampler.model_hook.fill(sampler.impls[name], with_op_defaults(cfg, sampler.name))
                for name in dict.fromkeys(["reference", cfg.heads.cached_attention])}
    trainers = {name: trainer.model_hook.fill(impl, with_op_defaults(cfg, trainer.name))
                for name, impl in trainer.impls.items()}
    batches = [eval_prompts, eval_prompts[:, : eval_prompts.shape[1] // 2 + 1]]
    gap = measure_gap(base, batches, cfg.heads.new_tokens, samplers, trainers)
    gap["triton_interpreted"] = devices.triton_interpreted()
    return gap


def measure_decode(cfg: LabConfig, calibration: dict[str, Any] | None = None) -> dict[str, Any]:
    """Plain greedy vs speculative on the same eval prompts, the controls beside them; decode.json.

    Every variant attends with heads.cached_attention, but for trained_tree's tree verifications (opt-in:
    heads.tree; TREE_VERIFICATION says why and what instead). Raises LossyDecoding (after writing) when any
    speculative output differs from greedy, or (another attention than the reference) greedy decoding
    differs from greedy decoding with the reference attention.
    """
    from posttrainllm.measure.memory import peak_bytes

    h = cfg.heads
    device = devices.prepare(cfg.device.name, cfg.bench.threads)
    base, base_info = load_base(cfg, device)
    chosen, chosen_info = cached_attention(cfg)  # heads.cached_attention's path, in the slot's contract
    _, heldout, _ = split_corpus(cfg)
    eval_prompts = prompts(heldout, h.eval_prompts, h.prompt_len, "eval").to(device)  # (E, P)
    K = h.num_heads
    variants: dict[str, MedusaHeads | None] = {"spec_k0": None}
    if K:
        torch.manual_seed(h.seed)
        variants["untrained"] = MedusaHeads(base.lm_head.weight.detach(), K).to(device).eval()
        variants["trained"] = load_heads(cfg, base, device)
    tree = list(h.tree) if K else []  # the trained heads again, verified as a tree of candidates

    def run(name: str, prompt: torch.Tensor) -> Generation:
        if name == "greedy":
            return greedy_cached(base, prompt, h.new_tokens, keep_logits=True)[1]
        if name == "trained_tree":
            return speculative_tree(base, variants["trained"], prompt, h.new_tokens, tree)
        return speculative(base, variants[name], prompt, h.new_tokens)

    names = ["greedy", *variants, *(["trained_tree"] if tree else [])]
    reference_attention = base.slot(CACHED_ATTENTION)  # the model's default: the readable math
    base.swap(CACHED_ATTENTION, chosen)
    for name in names:  # untimed warmup, every variant alike
        for i in range(min(h.warmup_prompts, h.eval_prompts)):
            run(name, eval_prompts[i:i + 1])
    gens: dict[str, list[Generation]] = {name: [] for name in names}
    for i in range(h.eval_prompts):  # interleaved per prompt, so drifts in machine load hit every variant alike
        for name in names:
            gens[name].append(run(name, eval_prompts[i:i + 1]))
    timed = chosen_info["timed"]
    report: dict[str, Any] = {"device": device, "threads": torch.get_num_threads(), "num_heads": K,
                              "prompts": h.eval_prompts, "prompt_len": h.prompt_len, "new_tokens": h.new_tokens,
                              "base_fingerprint": base_info["fingerprint"], CACHED_ATTENTION: chosen_info,
                              "variants": {}, "mismatches": {},
                              "itl_rule": rules.cite("inter_token_latency"),
                              "accepted_length_rule": rules.cite("accepted_length")}
    if tree:
        report["tree"] = {"widths": tree, "entries": h.tree_size(),
                          "verification_attention": TREE_VERIFICATION.format(math=tree_attention_math()),
                          "rule": rules.cite("draft_tree")}
    if not timed:
        report["timings"] = {"valid": False, "reason": INTERPRETED}
    for name in names:
        peak = peak_bytes(lambda name=name: run(name, eval_prompts[:1]), device, warmup=0)
        spare = 0 if name == "greedy" else (0 if name == "spec_k0" else K) + 1  # speculative: room for a chunk
        if name == "trained_tree":
            spare = h.tree_size()
        cache = KVCache(base.config, 1, h.prompt_len + h.new_tokens + spare, dtype=base.tok_emb.weight.dtype)
        peak.update(kv_cache_bytes=cache.nbytes(), note=PREALLOCATED)  # what greedy_cached / speculative allocate
        depth = len(tree) if name == "trained_tree" else 0 if name == "spec_k0" else K
        report["variants"][name] = _summarise(gens[name], peak, depth, timed)
        if name == "trained_tree":
            report["variants"][name]["verification_attention"] = f"reference ({defaults()[TREE_ATTENTION].__name__})"
    mismatches = []
    for name in names[1:]:
        for i, (got, want) in enumerate(zip(gens[name], gens["greedy"])):
            found = first_mismatch(got.tokens, want.tokens, want.logits, h.near_tie)
            if found:
                mismatches.append({"variant": name, "prompt": i, **found})
    if h.cached_attention != "reference":  # the path itself: greedy with it against greedy with the reference
        base.swap(CACHED_ATTENTION, reference_attention)
        for i, got in enumerate(gens["greedy"]):
            want = greedy_cached(base, eval_prompts[i:i + 1], h.new_tokens, keep_logits=True)[1]
            found = first_mismatch(got.tokens, want.tokens, want.logits, h.near_tie)
            if found:
                mismatches.append({"variant": "greedy vs reference attention", "prompt": i, **found})
        base.swap(CACHED_ATTENTION, chosen)
    report["mismatches"] = {"count": len(mismatches), "near_ties": sum(bool(m.get("near_tie")) for m in mismatches),
                            "first": mismatches[:10],
                            "rule": rules.cite("lossless_decoding", near_tie=h.near_tie)}
    report["lossless"] = not mismatches
    report["trainer_sampler_gap"] = trainer_sampler_gap(cfg, base, eval_prompts)
    report["speedup"] = _speedup(report, base, calibration, cfg) if timed else {"valid": False, "reason": INTERPRETED}
    out = heads_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "decode.json", report)
    if mismatches:
        first = mismatches[0]
        raise LossyDecoding(f"{len(mismatches)} speculative outputs differ from greedy decoding (first: {first['variant']} "
                            f"prompt {first['prompt']} token {first['index']}"
                            f"{', a near-tie' if first.get('near_tie') else ''})")
    return report


def _speedup(report: dict[str, Any], base: Transformer, calibration: dict[str, Any] | None,
             cfg: LabConfig) -> dict[str, Any]:
    """Measured speedups against plain greedy, the step-cost model that predicts them, and why (or why not)."""
    v = report["variants"]
    plain = v["greedy"]
    out: dict[str, Any] = {"rule": rules.cite("decode_speedup")}
    step_s = plain["step_ms"]["median"] / 1e3
    for name, entry in v.items():
        if name == "greedy":
            continue
        item = {"measured": entry["decode_tokens_per_s"] / plain["decode_tokens_per_s"],
                "verify_over_step": entry["step_ms"]["median"] / plain["step_ms"]["median"]}
        if "mean_accepted_length" in entry:
            item["predicted"] = entry["mean_accepted_length"] / item["verify_over_step"]
        out[name] = item
    # Is a decode step memory-bound here? Bytes one step must move: every weight once, plus the KV cache read.
    weight_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    c = base.config
    kv_bytes = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4 * (report["prompt_len"] + report["new_tokens"] // 2)
    achieved = (weight_bytes + kv_bytes) / step_s
    out["step_bytes"] = weight_bytes + kv_bytes
    out["step_bytes_formula"] = "all weights (fp32) + 2*layers*Hkv*D*4*(prompt + new_tokens/2) KV cache bytes"
    out["step_gbytes_per_s"] = achieved / 1e9
    if calibration:
        bandwidth = calibration["peaks"]["copy_bytes_per_s"]
        out["fraction_of_bandwidth"] = achieved / bandwidth
        trained = out.get("trained") or out.get("spec_k0")
        if achieved / bandwidth < 0.5:
            out["why"] = NOT_MEMORY_BOUND.format(gbps=achieved / 1e9, frac=achieved / bandwidth,
                                                 ratio=trained["verify_over_step"])
        else:
            out["why"] = (f"a decode step moves {achieved / 1e9:.2f} GB/s, {achieved / bandwidth:.1%} of the "
                          "calibrated bandwidth: memory-bound, so verifying K+1 positions costs about one step")
    trained = out.get("trained")
    if trained is not None:
        pays = trained["measured"] > 1.0
        out["verdict"] = (f"speculation {'pays' if pays else 'does not pay'} here: {trained['measured']:.2f}x measured, "
                          f"{trained.get('predicted', float('nan')):.2f}x predicted from accepted length "
                          f"{v['trained']['mean_accepted_length']:.2f} and a verification costing "
                          f"{trained['verify_over_step']:.2f}x a step")
    tree = out.get("trained_tree")
    if tree is not None and trained is not None:
        out["tree_vs_chain"] = {"accepted_length_ratio": v["trained_tree"]["mean_accepted_length"]
                                / v["trained"]["mean_accepted_length"],
                                "measured": tree["measured"] / trained["measured"],
                                "verify_over_chain_verify": tree["verify_over_step"] / trained["verify_over_step"]}
        out["tree_verdict"] = (f"tree {report['tree']['widths']} ({report['tree']['entries']} entries): accepted length "
                               f"{v['trained_tree']['mean_accepted_length']:.2f} vs chain "
                               f"{v['trained']['mean_accepted_length']:.2f}, {tree['measured']:.2f}x measured vs "
                               f"{trained['measured']:.2f}x, {tree.get('predicted', float('nan')):.2f}x predicted "
                               f"(a tree verification costs {tree['verify_over_step']:.2f}x a step)")
    return out


# --- receipt and the one-process run --------------------------------------------------------------


def record(cfg: LabConfig) -> tuple[dict[str, Any], str | None]:
    """receipt.json (+ metrics.json) in the heads folder, then its MLflow run (track/receipt.py)."""
    from posttrainllm.track import receipt

    folder = heads_dir(cfg)
    decode = read_json(folder / "decode.json") if (folder / "decode.json").exists() else None
    built = receipt.build_heads(cfg, folder, read_json(base_dir(cfg) / "base.json"), read_json(folder / "heads.json"),
                                decode, stamps(cfg))
    return built, receipt.record_heads(built, folder, log_mlflow=cfg.run.log_mlflow)


def stamps(cfg: LabConfig) -> dict[str, dict[str, Any]]:
    """The stamps of train_base and train_heads, checked against each other and this process's code (StampMismatch).

    The decode stage's own stamp is written when it ends, after the receipt (as the point receipt
    stage's): it lies beside the receipt, in <heads.name>/stamps/decode.json.
    """
    from posttrainllm.track import stamp

    found = {**stamp.read_stamps(base_dir(cfg), exclude=("decode",)),
             **stamp.read_stamps(heads_dir(cfg), exclude=("train_base", "decode"))}
    if found:
        stamp.check_consistent({**found, "decode": {"sources": stamp.loaded_sources()}},
                               f"{base_dir(cfg) / stamp.STAMPS} and {heads_dir(cfg) / stamp.STAMPS}")
    return found


def table(receipt: dict[str, Any]) -> str:
    """One row per decoding variant, then the per-head accuracy and the verdict, as plain text."""
    decode, heads = receipt["decode"] or {"variants": {}, "speedup": {}}, receipt["heads"]
    w = max([10, *map(len, decode["variants"])])  # the name column: 10 unless trained_tree is there
    lines = [f"heads {receipt['point']}: K={heads['num_heads']} on a base with held-out loss "
             f"{receipt['base']['heldout_loss']:.3f} nats/byte ({decode.get('device')}, {decode.get('threads')} threads, "
             f"{(decode.get(CACHED_ATTENTION) or {}).get('path', 'reference')} cached attention)",
             f"{'variant':>{w}} {'accepted':>8} {'tok/s':>9} {'speedup':>8} {'TTFT ms':>8} "
             f"{'ITL ms p50 (p20-p80)':>22} {'peak MB':>8}"]
    for name, v in decode["variants"].items():
        peak_mb = f"{v['peak_memory']['peak_bytes'] / 2**20:>8.2f}"
        if "itl_ms" not in v:  # interpreted: no timings
            lines.append(f"{name:>{w}} {v.get('mean_accepted_length', 1.0):>8.2f} {'-':>9} {'-':>8} {'-':>8} "
                         f"{'-':>22} {peak_mb}")
            continue
        speedup = (decode["speedup"].get(name) or {}).get("measured", 1.0 if name == "greedy" else float("nan"))
        itl = v["itl_ms"]
        lines.append(f"{name:>{w}} {v.get('mean_accepted_length', 1.0):>8.2f} {v['decode_tokens_per_s']:>9.1f} "
                     f"{speedup:>7.2f}x {v['ttft_ms']['median']:>8.2f} "
                     f"{itl['median']:>8.3f} ({itl['p20']:.3f}-{itl['p80']:.3f}) {peak_mb}")
    for k, acc in enumerate(heads.get("heldout_accuracy") or [], start=1):
        rate = (decode["variants"].get("trained") or {}).get("acceptance_rate_per_head") or []
        lines.append(f"  head {k}: held-out top-1 {acc['top1']:.3f}, top-5 {acc['top5']:.3f}"
                     + (f", accepted in {rate[k - 1]:.1%} of verifications" if len(rate) >= k else ""))
    if decode.get("mismatches"):
        lines.append(f"  lossless: {decode['lossless']} ({decode['mismatches']['count']} mismatches, "
                     f"{decode['mismatches']['near_ties']} near-ties)")
    if decode.get("tree"):
        lines.append(f"  trained_tree verifies with {decode['tree']['verification_attention'].split(':')[0]} "
                     "(an explicit tree mask; no cached_attention path takes one)")
    for key in ("verdict", "tree_verdict", "why", "reason"):
        if decode["speedup"].get(key):
            lines.append(f"  {decode['speedup'][key]}")
    gap = decode.get("trainer_sampler_gap")
    for name, pair in (gap or {}).get("pairs", {}).items():  # sampler -> trainer (model/gap.py)
        lines.append(f"  trainer-sampler gap, decode {name}: max |d log p| {pair['max_abs']:.2e}, mean "
                     f"{pair['mean_abs']:.2e}, {pair['bitwise_fraction']:.0%} of {pair['tokens']} tokens bitwise")
    if gap and gap.get("why_not_bitwise"):
        lines.append(f"  {gap['why_not_bitwise']}")
    return "\n".join(lines)


def decode_and_record(cfg: LabConfig, calibration_path: Path) -> tuple[dict[str, Any], str | None]:
    """measure_decode, then the receipt (also after a lossy decode, whose LossyDecoding is raised after it)."""
    from posttrainllm.measure import calibrate

    device = devices.prepare(cfg.device.name, cfg.bench.threads)
    lossy: LossyDecoding | None = None
    try:
        measure_decode(cfg, calibrate.load_or_measure(calibration_path, device))
    except LossyDecoding as exc:
        lossy = exc
    done = record(cfg)
    if lossy is not None:
        raise lossy
    return done


def stage_run(stage: str, cfg: LabConfig, calibration_path: Path = Path("runs") / "calibration.json") -> StageRun:
    """One heads stage, set up for lab/pipeline.py's `stamped` (DVC and the CLI alike)."""
    if stage == "train_base":
        return StageRun(cfg, "heads-base", base_dir(cfg), lambda: train_base(cfg))
    point = f"heads-{cfg.heads.name}"
    if stage == "train_heads":
        return StageRun(cfg, point, heads_dir(cfg), lambda: train_heads(cfg))
    if stage == "decode":
        def work() -> tuple[dict[str, Any], str | None]:
            from posttrainllm.track.store import TrackingFailed

            try:
                done = decode_and_record(cfg, calibration_path)
            except (LossyDecoding, TrackingFailed):  # the receipt was written all the same
                print(table(read_json(heads_dir(cfg) / "receipt.json")))
                raise
            print(table(done[0]))
            return done
        return StageRun(cfg, point, heads_dir(cfg), work)
    raise ValueError(f"unknown heads stage {stage!r}: valid are train_base, train_heads, decode")


def run_stage(stage: str, argv: list[str]) -> int:
    """`python pipelines/<stage>.py [heads=NAME] [overrides]`: one heads stage (DVC), config composed from conf/.

    Exit codes as the point stages' (lab/pipeline.py `execute`): 0 done, also when decoding was lossy (a
    verdict, recorded in decode.json and the receipt: the pipeline runs on); 2 bad config, no matching base,
    or stamps that disagree; 3 MLflow failed.
    """
    from posttrainllm.lab.configure import load

    def setup() -> StageRun | None:
        from posttrainllm.lab import approval

        cfg = load(["device=auto", *argv])
        try:  # on a GPU its training and timing loops need approval, as the timed point stages do
            found = approval.check([cfg], train=False, heads=True, what=f"stage {stage} heads-{cfg.heads.name}")
        except approval.NotApproved as exc:  # nothing run, nothing written
            print(f"posttrainllm: not approved: {exc}", file=sys.stderr)
            return None
        if found:
            print(f"posttrainllm: approved: {stage} heads-{cfg.heads.name}: {found.line()}", file=sys.stderr)
        return stage_run(stage, cfg)

    return execute(stage, setup, verdicts=(LossyDecoding,))
