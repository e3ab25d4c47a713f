"""DVC stage 'bench_train': the model trained with each path of the point's op swapped in: loss drift,
Amdahl's prediction and, under a quantized precision, the quality gate (bench_train.json).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from posttrainllm.config import ConfigError, LabConfig
from posttrainllm.lab import runner
from posttrainllm.measure import device as devices
from posttrainllm.ops.registry import NO_BACKWARD
from posttrainllm.ops.registry import op_for  # the point's op: a built-in, or one made from op.file (op=problem)
from posttrainllm.lab.runner import closed_after  # a stage's workers end with it
from posttrainllm.track.records import BenchTrainRecord, MicrobenchRecord
from posttrainllm.lab.stages.common import (ContractBroken, FAILED_PARITY, runs_interpreted, parity_paths, passed_parity,
                                            on_same_cpus, refusals)


FORWARD_ONLY = "forward-only: not trained (no backward to train with)"  # bench-train's skip of such a path


QUANTIZED_BASELINE = "bf16"  # under a quantized precision, bench-train's baseline: the same model, linear layers in bf16


AUTOCAST_OF = {"bfloat16": "bf16", "float16": "fp16"}  # a quantized precision's dtype -> bench-train's autocast


def quality_base_dir(cfg: LabConfig) -> Path:
    """Where the draft-heads base lives (lab/heads.py base_dir): the trained model the quality gate decodes with."""
    return Path(cfg.heads.out_dir) / "base"


@on_same_cpus
@closed_after
def run_bench_train(cfg: LabConfig, out: Path, *, quality_base: Path | None = None) -> dict[str, Any]:
    """The model from `architecture`, trained with each implementation of the point's op swapped in.

    The implementations come from the op's registry (train.impls, or all; the reference
    first, the drift baseline), each swapped in by the op's own model hook: the function
    trained is the function checked and timed. A path that failed parity is not trained
    (recorded as skipped). Records the loss drift against the reference (the contract's
    train_loss_drift) and Amdahl's prediction from the forward+backward microbench speedup. Under a quantized
    precision, the quality gate decodes with the draft-heads base in `quality_base` (a DVC stage: the train_base
    stage's folder; None: under heads.out_dir, `quality_base_dir`).
    """
    from posttrainllm.model import amdahl
    from posttrainllm.model.train import Variant, bench_train
    from posttrainllm.model.transformer import ModelConfig

    op = op_for(cfg)
    if op.no_model is not None:  # no model hook (a problem file's op): nothing is trained, and the record says why
        result = {"impls": {}, "drift": {}, "drift_verdict": {}, "not_trained": op.no_model,
                  "skipped": {name: op.no_model for name in runner.train_impls(op, cfg)}}
        BenchTrainRecord.from_dict(result).write(out / BenchTrainRecord.FILE)
        return result
    quantized = cfg.precision.quantize
    device = devices.prepare(cfg.device.name, cfg.bench.threads)
    arch, train = cfg.architecture, cfg.train
    model_fields = dict(vocab_size=256, d_model=arch.d_model, n_layers=arch.n_layers, n_heads=arch.n_heads,
                        n_kv_heads=arch.n_kv_heads, head_dim=arch.head_dim, mlp_hidden=arch.mlp_hidden,
                        mlp=arch.mlp, n_experts=arch.n_experts, top_k=arch.top_k, expert_hidden=arch.expert_hidden,
                        router_aux_coef=arch.router_aux_coef, max_seq_len=train.seq_len)
    model_cfg = ModelConfig(**{**model_fields, **op.model_overrides(cfg)})
    passed = passed_parity(out)
    refused = refusals(out)
    paths = parity_paths(op, cfg, out)
    variants, skipped = [], {}
    if quantized is not None:  # the baseline: the same model with F.linear in bf16 (what the fp8 recipe is against)
        variants.append(Variant(QUANTIZED_BASELINE))
    for name in runner.train_impls(op, cfg):
        if not passed.get(name, False):
            skipped[name] = refused.get(name, FAILED_PARITY)
            continue
        impl = paths[name]
        if impl.train_refusal:
            skipped[name] = impl.train_refusal
            continue
        if impl.backward == NO_BACKWARD and quantized is None:  # a quantized path trains by the recipe's backward
            skipped[name] = FORWARD_ONLY
            continue
        interpreted = runs_interpreted(impl)
        variants.append(Variant(name, {op.model_hook.slot: op.model_hook.fill(impl, cfg)}, interpreted=interpreted,
                                steps=min(train.interpreted_steps, train.steps) if interpreted else None))
    trained = {v.name: runner.runner_for(paths[v.name]) for v in variants if v.name in paths}
    before = {name: run.before_training() for name, run in trained.items()}  # before any clock (a worker's start)
    common = dict(variants=variants, steps=train.steps, warmup_steps=train.warmup_steps, batch_size=train.batch_size,
                  seq_len=train.seq_len, lr=train.lr, seed=train.seed, device=device, skipped=skipped)
    if quantized is None:
        result = bench_train(model_cfg, precision=cfg.precision.name, **common)
    else:
        result = _train_quantized(cfg, model_cfg, common, device, quality_base or quality_base_dir(cfg))
    notes = runner.training_notes(trained, before, train.steps, device)  # a worker's round trips per step
    if notes:
        result["user_paths"] = notes
    limit = cfg.precision.contract.train_loss_drift
    result["drift_limit"] = limit
    result["drift_verdict"] = {name: "pass" if drift <= limit else "fail" for name, drift in result["drift"].items()}
    model_problem = op.model_problem(cfg)  # what the op's hook swapped into the model, in words
    result["amdahl"] = amdahl.check(result, MicrobenchRecord.read(out / MicrobenchRecord.FILE).to_dict(),
                                    profiled_range=op.model_hook.slot, model_problem=model_problem)
    result["model_problem"] = model_problem
    record = BenchTrainRecord.from_dict(result)
    record.write(out / BenchTrainRecord.FILE)
    broken = [f"loss drift of {name} exceeds train_loss_drift={limit:g}"
              for name, verdict in record.drift_verdict.items() if verdict != "pass"]
    broken += [f"quality of {name}: {'; '.join(q['failed'])}"
               for name, q in (record.quality or {}).get("variants", {}).items() if q["verdict"] != "pass"]
    if broken:
        raise ContractBroken(", ".join(broken))
    return result


def _train_quantized(cfg: LabConfig, model_cfg: Any, common: dict[str, Any], device: str,
                     folder: Path) -> dict[str, Any]:
    """bench-train under a quantized precision: every variant trained on the corpus's head under the precision's
    16-bit autocast (the bf16 baseline with F.linear, each fp8 path through the recipe, ops/matmul/definition.py), scored
    on its held-out tail; then the draft-heads base decodes held-out prompts with each path's fp8 linear layers
    against bf16 ones (model/quality.py). The `quality` section and its verdicts join the result."""
    from posttrainllm.lab.configure import check_train_rules
    from posttrainllm.model import quality
    from posttrainllm.model.corpus import batch_at, load_corpus, prompts, split_tail
    from posttrainllm.model.train import bench_train

    check_train_rules(cfg)  # an op whose fp8 paths are forward-only (op=moe) has no training recipe: refused
    q, train = cfg.precision.quantize, cfg.train
    gate = q.quality
    try:  # before any training: the gate cannot run without it
        base, identity = quality.load_trained_base(folder)
    except FileNotFoundError:
        raise ConfigError(f"no draft-heads base under {folder}: the quality gate decodes with it; train it with "
                          "`dvc repro train_base` or `posttrainllm experimental train-heads`") from None
    corpus = load_corpus()
    head, tail = split_tail(corpus, gate.heldout_frac)
    try:
        held_prompts = prompts(tail, gate.prompts, gate.prompt_len, "eval").to(device)
    except ValueError as exc:
        raise ConfigError(f"precision.quantize.quality: {exc}") from None
    heldout = [batch_at(tail, i, batch_size=train.batch_size, seq_len=train.seq_len, seed=train.seed + 1)
               for i in range(gate.heldout_batches)]
    result = bench_train(model_cfg, precision=AUTOCAST_OF[cfg.precision.dtype], corpus=head, heldout=heldout,
                         **common)
    result["precision"] = cfg.precision.name
    result["quantize"] = {"recipe": q.recipe, "grad_format": q.grad_format,
                          "trained_on": f"the corpus's first {1 - gate.heldout_frac:.0%} ({head.n_bytes} bytes); "
                                        f"held-out loss over {gate.heldout_batches} batches of the rest"}
    base = base.to(device)
    op = op_for(cfg)
    paths = runner.paths(op, cfg)
    names = [v.name for v in common["variants"][1:]]
    linears = {name: op.model_hook.fill(paths[name], cfg) for name in names}  # the linear slot's (trains_quantized)
    interpreted = {name for name in names if runs_interpreted(paths[name])}
    greedy = quality.greedy_section(base, held_prompts, gate.new_tokens, linears, torch.nn.functional.linear)
    greedy["base"] = identity
    greedy["interpreted"] = sorted(interpreted)
    result["quality"] = quality.gate(result, greedy, gate)
    return result
