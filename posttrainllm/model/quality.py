"""What a quantized precision does to what the model outputs: bench-train's `quality` section and its gate.

Two checks, each against the same model in bf16 (precision.quantize.quality: the limits and why):

    held-out loss   each variant's model, trained by bench-train on the corpus's head (same seed, batches, steps
                    as the bf16 one), scored on batches of the held-out tail: mean cross-entropy, nats/byte.
                    gap = loss(variant) - loss(bf16) at the variant's last step (the bf16 run is scored there too)
    greedy tokens   a trained model (the draft-heads base, runs/heads/base) decodes held-out prompts greedily
                    with its linear layers in bf16 and with each variant's fp8 linear layers, under bf16
                    autocast. agreement = the fraction of generated tokens equal at the same position;
                    first_divergence = per prompt, the first position where they differ (None: never)

A path passes when gap <= max_heldout_loss_gap and agreement >= min_greedy_agreement; one that fails gets no
speed in the report (track/report.py), as a parity failure does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

import torch

from posttrainllm.model.decode import greedy_cached
from posttrainllm.model.slots import LINEAR
from posttrainllm.model.transformer import ModelConfig, Transformer

LinearFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # the linear slot's contract (model/slots.py)

BASE_FILES = ("base.pt", "base.json")  # what the draft-heads base stage writes (lab/heads.py train_base)


def load_trained_base(folder: Path) -> tuple[Transformer, dict[str, Any]]:
    """The draft-heads base in `folder` as it was trained (its model config from base.json), frozen, in eval mode,
    and its identity: fingerprint, the sha256 of its weights, held-out loss. FileNotFoundError when absent."""
    info = json.loads((folder / "base.json").read_text())
    weights = folder / "base.pt"
    model = Transformer(ModelConfig(**info["model"]))
    model.load_state_dict(torch.load(weights, weights_only=True))
    for p in model.parameters():
        p.requires_grad_(False)
    identity = {"folder": str(folder), "fingerprint": info.get("fingerprint"),
                "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
                "heldout_loss": info.get("heldout_loss"), "params": info.get("params")}
    return model.eval(), identity


@torch.no_grad()
def greedy_tokens(model: Transformer, prompts: torch.Tensor, new_tokens: int, linear: LinearFn,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """prompts (B, P) -> the (B, new_tokens) greedy continuation with every projection running `linear`."""
    model.swap(LINEAR, linear)
    device = prompts.device.type
    with torch.autocast(device, dtype=dtype):
        return greedy_cached(model, prompts, new_tokens)[0]


def agreement(got: torch.Tensor, want: torch.Tensor) -> dict[str, Any]:
    """got, want (B, N) token ids: the fraction equal at the same position and, per row, the first position that
    differs (None where none does)."""
    same = got == want  # (B, N)
    first = [None if bool(row.all()) else int((~row).nonzero()[0]) for row in same]
    return {"agreement": float(same.float().mean()), "first_divergence": first, "tokens": int(same.numel())}


def greedy_section(model: Transformer, prompts: torch.Tensor, new_tokens: int,
                   linears: dict[str, LinearFn], baseline: LinearFn) -> dict[str, Any]:
    """Per variant, its greedy tokens against the baseline's (bf16 linear layers) on the same prompts."""
    want = greedy_tokens(model, prompts, new_tokens, baseline)
    found = {name: agreement(greedy_tokens(model, prompts, new_tokens, fn), want) for name, fn in linears.items()}
    return {"prompts": int(prompts.shape[0]), "prompt_len": int(prompts.shape[1]), "new_tokens": new_tokens,
            "variants": found}


def gate(train: dict[str, Any], greedy: dict[str, Any] | None, limits: Any) -> dict[str, Any]:
    """The quality section: per variant (not the baseline) its held-out gap and greedy agreement, and its verdict.

    train: bench_train's result, each impl with "heldout_loss" {steps: loss}; greedy: greedy_section's, or None
    where it did not run (then the verdict says why, never "pass"); limits: precision.quantize.quality."""
    baseline = train["baseline"]
    base_losses = train["impls"][baseline]["heldout_loss"]
    variants: dict[str, Any] = {}
    for name, entry in train["impls"].items():
        if name == baseline:
            continue
        steps, loss = max(entry["heldout_loss"].items(), key=lambda kv: int(kv[0]))
        gap = loss - base_losses[steps]
        found = (greedy or {}).get("variants", {}).get(name)
        failed = [f"held-out loss gap {gap:.4f} > {limits.max_heldout_loss_gap:g}"] \
            if not gap <= limits.max_heldout_loss_gap else []
        if found is None:
            failed.append("greedy tokens not decoded")
        elif not found["agreement"] >= limits.min_greedy_agreement:
            failed.append(f"greedy agreement {found['agreement']:.3f} < {limits.min_greedy_agreement:g}")
        variants[name] = {"heldout_steps": int(steps), "heldout_loss": loss, "bf16_heldout_loss": base_losses[steps],
                          "heldout_gap": gap, "greedy": found,
                          "verdict": "fail" if failed else "pass", "failed": failed}
    return {"baseline": baseline, "variants": variants,
            "limits": {"max_heldout_loss_gap": limits.max_heldout_loss_gap,
                       "min_greedy_agreement": limits.min_greedy_agreement, "reason": limits.reason},
            "greedy": {k: v for k, v in (greedy or {}).items() if k != "variants"}}
