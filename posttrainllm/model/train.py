"""bench-train: train the same model with each implementation of an op swapped in, end to end.

A variant is a name and the functions it swaps into the model's slots ({slot: fn}, model/slots.py: its
attention, the matmul of every projection...), taken by the caller from the op's registry through the op's
model hook so the function trained is the function checked and timed; the first variant is the baseline.
For every variant: the same initial weights (same seed), the same batches
(corpus.batch_at, a pure function of (seed, step)), AdamW, `steps` optimizer steps.
The variants train interleaved, step by step (step k of every variant before step k+1 of any), so a shared
machine's drift in speed falls on all of them alike; each one's losses are those it would have alone.
What comes back is the loss at every step and the wall time of every step, so one
table shows both parity (do the loss curves agree?) and speed (tokens/s), plus one
extra, profiled step that says which fraction of a step each slot of the model takes.

Units and formulas
    step_ms           wall time of forward + backward + optimizer step, ms
                      (batches are built and moved to the device before timing;
                      on CUDA the clock stops after torch.cuda.synchronize())
    warm_ms_per_step  median of step_ms[warmup_steps:]
    noise.band        the baseline's warm ms/step against itself (a second copy of it, timing only,
                      interleaved with the variants; its halves alone without one): a measured speedup inside
                      [1/band, band] is no measurable change (model/amdahl.py noise_band)
    tokens_per_s      batch_size * seq_len / (warm_ms_per_step / 1000)
    drift[name]       |loss_name[n-1] - loss_baseline[n-1]|, the loss gap at the variant's last step n
                      (n = steps, or the variant's own `steps`: fewer for Triton through its interpreter)
    profile[slot]     time inside the slot's profiler ranges (forward) plus the autograd
                      nodes those ranges created (backward), over the profiled step's time
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from posttrainllm.model import amdahl
from posttrainllm.model.corpus import Corpus, batch_at, load_corpus
from posttrainllm.measure.device import fp32_matmuls
from posttrainllm.measure.memory import peak_bytes
from posttrainllm.model.slots import SLOTS
from posttrainllm.model.transformer import ModelConfig, Transformer, moe_aux_loss, moe_stats
from posttrainllm.measure.timing import summarize

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Variant:
    """One way to run the model: the functions it swaps into the model's slots ({slot: fn}; a slot not named keeps
    the model's default).

    interpreted: the variant runs Triton through its interpreter, so its step times are not speed.
    steps: train only the first `steps` batches (None: all). Its drift is read at its own last step,
        against the baseline's loss at that same step (the baseline records every step).
    """

    name: str
    fills: dict[str, Callable[..., Any]] = field(default_factory=dict)
    interpreted: bool = False
    steps: int | None = None


ORDER = "interleaved by step"  # round robin: step k of every variant (and the baseline's repeat) before step k+1

# AdamW settings shared by every implementation (GPT-style; only lr is a knob here).
ADAM_BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1  # on matrices only; RMSNorm weights are not decayed


def bench_train(
    model_cfg: ModelConfig,
    *,
    variants: list[Variant],
    steps: int,
    warmup_steps: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    seed: int,
    precision: str,
    device: str,
    corpus: Corpus | None = None,
    skipped: dict[str, str] | None = None,
    heldout: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict:
    """Train every variant, interleaved step by step; return a JSON-serialisable result dict.

    skipped: variants not trained, with why (a path that failed parity gets no training time);
    recorded in the result as they are.
    heldout: batches never trained on; each variant's model is scored on them (mean loss, no gradients) after
    its last step, and the baseline's also at every other variant's last step (its `steps`), so each
    variant's held-out loss has the baseline's at the same step beside it: impls[name]["heldout_loss"].
    """
    _check_args(model_cfg, variants, steps, warmup_steps, batch_size, seq_len, precision)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} requested but CUDA is not available")
    corpus = load_corpus() if corpus is None else corpus
    notes = _notes(precision, dev)

    # Same bytes for every implementation, built once and moved before any clock starts.
    batches = [
        tuple(t.to(dev) for t in batch_at(corpus, step, batch_size=batch_size, seq_len=seq_len, seed=seed))
        for step in range(steps)
    ]

    held = [tuple(t.to(dev) for t in batch) for batch in heldout] if heldout else None
    last_steps = {v.steps or steps for v in variants}
    baseline = variants[0].name
    with _precision_mode(precision, dev):
        trainers = [_Trainer(model_cfg, variant, batches, lr, seed, precision, dev, warmup_steps, held,
                             (last_steps if i == 0 else {variant.steps or steps}) if held else set())
                    for i, variant in enumerate(variants)]
        if not variants[0].interpreted and len(variants) > 1:  # the baseline again, timing only: its band
            trainers.append(_Trainer(model_cfg, variants[0], batches, lr, seed, precision, dev, warmup_steps,
                                     timing_only=True))
        # Round robin: step k of every variant before step k+1 of any, so the machine's drift (a shared CPU's
        # speed moves by tens of % over seconds) falls on every variant, and on the baseline's two copies, alike.
        for k in range(steps):
            for trainer in trainers:
                if k < trainer.steps:  # a variant with fewer steps leaves the round when done
                    trainer.step(k)
        finished = [trainer.finish() for trainer in trainers]  # one at a time, each freeing its model
    results = {variant.name: result for variant, (result, _) in zip(variants, finished)}
    n_params = finished[0][1]
    repeat = finished[-1][0]["step_ms"] if trainers[-1].timing_only else None
    noise = (amdahl.noise_band(results[baseline]["step_ms"], repeat, warmup_steps)
             if results[baseline]["timing_valid"] else None)
    baseline_losses = results[baseline]["losses"]
    drift = {name: abs(r["losses"][-1] - baseline_losses[len(r["losses"]) - 1]) for name, r in results.items()
             if name != baseline}
    drift_step = {name: len(r["losses"]) - 1 for name, r in results.items() if name != baseline}
    max_step_drift = {
        name: max(abs(a - b) for a, b in zip(r["losses"], baseline_losses))
        for name, r in results.items()
        if name != baseline
    }
    return {
        "impls": results,
        "variants": [v.name for v in variants],
        "skipped": dict(skipped or {}),
        "drift": drift,
        "drift_step": drift_step,  # the step each drift is read at: the variant's last
        "max_step_drift": max_step_drift,  # largest |loss gap| at any step, not only the last
        "baseline": baseline,
        "order": ORDER,  # how the variants' steps were ordered in time
        "noise": noise,  # the baseline's run-to-run band (model/amdahl.py noise_band); None when not speed
        "tokens_per_step": batch_size * seq_len,
        "n_params": n_params,
        "corpus": {"source": corpus.source, "sha256": corpus.sha256, "n_bytes": corpus.n_bytes},
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "precision": precision,
        "config": {
            "model": dict(vars(model_cfg)),
            "steps": steps,
            "warmup_steps": warmup_steps,
            "batch_size": batch_size,
            "seq_len": seq_len,
            "lr": lr,
            "seed": seed,
        },
        "notes": notes,
    }


class _Trainer:
    """One variant's training, a step at a time (bench_train interleaves them): its model and optimizer from the
    shared seed, `step(k)` trains batch k, `finish()` returns its result and frees its model.

    timing_only: only its losses and step times (no peak memory, no profiled step): the baseline's second copy.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        variant: Variant,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        lr: float,
        seed: int,
        precision: str,
        dev: torch.device,
        warmup_steps: int,
        heldout: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        score_after: set[int] = frozenset(),
        timing_only: bool = False,
    ) -> None:
        self.variant, self.batches, self.dev, self.warmup_steps = variant, batches, dev, warmup_steps
        self.heldout, self.score_after, self.timing_only = heldout, score_after, timing_only
        self.steps = variant.steps or len(batches)
        # Built on CPU then moved, so the initial weights are identical on every device.
        self.model: Transformer | None = Transformer(model_cfg, seed=seed, fills=variant.fills).to(dev)
        self.model.train()
        self.optimizer: torch.optim.AdamW | None = _adamw(self.model, lr)
        self.autocast_dtype = AUTOCAST_DTYPES.get(precision)
        # fp16 has a narrow exponent range: scale the loss so small gradients do not flush
        # to zero. CUDA only; bf16 has fp32's range and needs no scaler.
        self.scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16" and dev.type == "cuda")
        self.losses: list[float] = []
        self.step_ms: list[float] = []
        self.routing_steps: list[dict] = []  # MoE models: each step's routing, read after its clock stopped
        self.heldout_loss: dict[str, float] = {}  # steps trained -> mean loss on the held-out batches

    def _train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with _autocast(self.dev, self.autocast_dtype):
            _, loss = self.model(x, y)
        aux = moe_aux_loss(self.model)  # the routers' load-balancing loss (MoE models), trained but not reported
        self.scaler.scale(loss if aux is None else loss + aux).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        return loss

    @torch.no_grad()
    def _score(self) -> float:
        self.model.eval()
        with _autocast(self.dev, self.autocast_dtype):
            total = sum(float(self.model(x, y)[1]) for x, y in self.heldout)
        self.model.train()
        return total / len(self.heldout)

    def step(self, k: int) -> None:
        """Train batch k (the (k+1)-th step; steps run in order)."""
        if k != len(self.losses) or k >= self.steps:
            raise ValueError(f"{self.variant.name}: step {k} out of order ({len(self.losses)} of {self.steps} done)")
        t0 = time.perf_counter()
        loss = self._train_step(*self.batches[k])
        self.step_ms.append((time.perf_counter() - t0) * 1e3)
        self.losses.append(loss.item())
        if (routing := moe_stats(self.model)) is not None:
            self.routing_steps.append(routing)
        if k + 1 in self.score_after and self.heldout:  # outside the step's clock
            self.heldout_loss[str(k + 1)] = self._score()

    def finish(self) -> tuple[dict, int]:
        """Its result (and the model's parameter count) once its steps are done; then its model and optimizer go."""
        interpreted = self.variant.interpreted or self.timing_only
        extra_step = functools.partial(self._train_step, *self.batches[-1])  # not in the losses
        if self.timing_only:
            peak_mem = None
        elif self.dev.type == "cuda":
            # Every variant's model and optimizer are resident while they train interleaved, so the allocator's
            # absolute peak is not this variant's. One extra step gives its rise above what was allocated before
            # it (peak_bytes: reset_peak_memory_stats, memory_allocated, the step, max_memory_allocated - before);
            # adding what this trainer itself keeps resident (parameters, buffers, optimizer state) makes it the
            # peak its model alone would reach. The batches, the same for every variant, are not counted.
            peak_mem = peak_bytes(extra_step, "cuda", warmup=0)["peak_bytes"] + _resident_bytes(
                self.model, self.optimizer, self.dev)
        else:  # one extra step, its allocations replayed (memory.py): a rise, whatever else is resident;
            # the interpreter allocates outside torch
            peak_mem = None if interpreted else peak_bytes(extra_step, "cpu", warmup=0)["peak_bytes"]
        # One more step under the profiler (not in the losses), where its times mean something.
        profiled = None if interpreted else profile_step(extra_step, cuda=self.dev.type == "cuda")
        n_params = self.model.num_params()
        self.model = self.optimizer = None
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
        losses, step_ms = self.losses, self.step_ms
        warm = summarize(step_ms[self.warmup_steps:] or step_ms)
        tokens_per_step = self.batches[0][0].numel()
        return {
            "losses": losses,
            "step_ms": step_ms,
            "warm_ms_per_step": warm.median_ms,
            "step_ms_p20": warm.p20_ms,
            "step_ms_p80": warm.p80_ms,
            "noisy": warm.noisy,
            "tokens_per_s": tokens_per_step / (warm.median_ms / 1e3),
            "peak_mem_bytes": peak_mem,
            "final_loss_finite": math.isfinite(losses[-1]),
            # Triton through its interpreter: the losses are real, the step times are not speed
            "timing_valid": not self.variant.interpreted,
            "profile": profiled,
            **({"moe_routing": _routing_summary(self.routing_steps)} if self.routing_steps else {}),
            **({"heldout_loss": self.heldout_loss} if self.heldout_loss else {}),
        }, n_params


def _resident_bytes(model: Transformer, optimizer: torch.optim.Optimizer, dev: torch.device) -> int:
    """Bytes a trainer keeps on `dev` between steps: its parameters, buffers and optimizer state (each storage
    once: tied weights share one)."""
    state = (t for per_param in optimizer.state.values() for t in per_param.values() if torch.is_tensor(t))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers(), *state) if t.device.type == dev.type}
    return sum(storages.values())


def _routing_summary(steps: list[dict]) -> dict[str, Any]:
    """An MoE model's routing over the trained steps: the last step's histogram (tokens per expert, per layer),
    every step's histogram and load-balancing loss, and the assignments dropped, counted over all steps."""
    last = steps[-1]
    return {**last,
            "dropped": [sum(s["dropped"][layer] for s in steps) for layer in range(len(last["dropped"]))],
            "dropped_counted_over_steps": len(steps),
            "tokens_per_expert_per_step": [s["tokens_per_expert"] for s in steps],  # (steps, layers, E)
            "load_balance_loss_per_step": [s["load_balance_loss"] for s in steps]}  # (steps, layers)


def profile_step(run_step: Any, *, cuda: bool) -> dict[str, Any]:
    """One step under the PyTorch profiler: the fraction of its time each of the model's slots takes.

    Forward: the slot's `posttrainllm::<slot>` ranges. Backward: the autograd nodes whose
    sequence number belongs to an op recorded inside those ranges (the profiler links a
    backward node to the forward op that created it by that number). Times are CPU time
    on CPU and GPU kernel time on CUDA.
    On CPU the step runs under the legacy autograd profiler: the same ranges, times and
    sequence numbers, without Kineto's `USDT: ... profiler_start/stop` lines on stderr.
    Kernel times on CUDA need Kineto (torch.profiler).
    """
    legacy = None
    if not cuda:
        try:
            from torch.autograd.profiler_legacy import profile as legacy
        except ImportError:  # a torch without it: torch.profiler, chatter and all
            legacy = None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with legacy() if legacy is not None else profile(activities=activities) as prof:
        with record_function("posttrainllm::step"):
            run_step()
    events = prof.function_events if legacy is not None else prof.events()

    def spent(e: Any) -> float:
        return e.device_time_total if cuda else e.cpu_time_total

    def node_nr(e: Any) -> int:
        """A backward range's sequence number: Kineto puts it on `evaluate_function: XBackward0`
        itself, the legacy profiler only on the `XBackward0` node recorded inside it."""
        if e.sequence_nr >= 0:
            return e.sequence_nr
        node = e.name.split(": ", 1)[-1]
        return next((c.sequence_nr for c in e.cpu_children if c.name == node), -1)

    step = next(e for e in events if e.name == "posttrainllm::step")
    total_us = sum(e.self_device_time_total for e in events) if cuda else step.cpu_time_total
    out: dict[str, Any] = {"step_us": total_us, "clock": "cuda kernel time" if cuda else "cpu time"}
    for name, slot in SLOTS.items():
        ranges = [e for e in events if e.name == slot.profiler_range]
        forward_ops = {e.sequence_nr for e in events if e.sequence_nr >= 0 and any(
            e.thread == r.thread and r.time_range.start <= e.time_range.start and e.time_range.end <= r.time_range.end
            for r in ranges)}
        backward = [e for e in events
                    if e.name.startswith("autograd::engine::evaluate_function:") and node_nr(e) in forward_ops]
        forward_us, backward_us = sum(spent(r) for r in ranges), sum(spent(e) for e in backward)
        out[name] = {"calls": len(ranges), "forward_us": forward_us, "backward_us": backward_us,
                   "fraction": (forward_us + backward_us) / total_us if total_us else None}
    return out


def _autocast(dev: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if dtype is None else torch.autocast(dev.type, dtype=dtype)


def _adamw(model: Transformer, lr: float) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices and embeddings
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # RMSNorm weights
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=ADAM_BETAS)


@contextlib.contextmanager
def _precision_mode(precision: str, dev: torch.device) -> Iterator[None]:
    """On CUDA, fp32 and tf32 runs pin how fp32 matmuls run (devices.fp32_matmuls); others leave it."""
    if precision not in ("fp32", "tf32") or dev.type != "cuda":
        yield
        return
    with fp32_matmuls(tf32=precision == "tf32"):
        yield


def _notes(precision: str, dev: torch.device) -> list[str]:
    notes = []
    if precision == "tf32" and dev.type != "cuda":
        notes.append("tf32 requested on CPU: there are no TF32 units, so this run is identical to fp32")
    if precision in ("fp32", "tf32") and dev.type == "cuda":
        kind = "TF32 tensor cores" if precision == "tf32" else "IEEE fp32 (TF32 off)"
        notes.append(f"{precision}: CUDA fp32 matmuls pinned to {kind} for this run, restored afterwards")
    if precision in AUTOCAST_DTYPES:
        notes.append(
            f"{precision}: torch.autocast({dev.type!r}, {precision}) with fp32 master weights, "
            "fp32 RMSNorm, RoPE and loss"
        )
    if precision == "fp16":
        notes.append("fp16 loss scaling: " + ("GradScaler" if dev.type == "cuda" else "none (CPU has no GradScaler path)"))
    if precision in AUTOCAST_DTYPES and dev.type == "cpu":
        notes.append(
            f"{precision} on CPU: speed depends on the CPU's instruction set (avx512_bf16/AMX make bf16 "
            "matmuls faster than fp32; without AVX512-FP16, fp16 matmuls run ~100x slower than fp32). "
            "Not a GPU speed signal"
        )
    if dev.type != "cuda":
        notes.append(
            "peak_mem_bytes on CPU: the peak live bytes of PyTorch's CPU allocator during one extra step "
            "(profiler allocation events replayed); None for Triton through its interpreter, which allocates "
            "outside PyTorch"
        )
    return notes


def _check_args(
    model_cfg: ModelConfig,
    variants: list[Variant],
    steps: int,
    warmup_steps: int,
    batch_size: int,
    seq_len: int,
    precision: str,
) -> None:
    names = [v.name for v in variants]
    if not variants:
        raise ValueError("give at least one variant: the first is the drift baseline")
    if len(set(names)) != len(names):
        raise ValueError(f"variants {names!r} have duplicate names")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; valid choices: {list(PRECISIONS)}")
    if steps < 1 or not 0 <= warmup_steps < steps:
        raise ValueError(f"need steps >= 1 and 0 <= warmup_steps < steps, got steps={steps}, warmup_steps={warmup_steps}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    if seq_len > model_cfg.max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds model max_seq_len={model_cfg.max_seq_len}")

