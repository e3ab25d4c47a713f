"""The lab's rules, in one table: each an id (short snake_case, stable) and its text.

A stage result or a receipt names a rule by its id (`cite`): "band_rule": "band". A rule whose text holds values
of the run (a config value, a constant of the code that applies it) is cited with them beside its id:
"impossible_rule": {"id": "impossible", "fraction": 0.5}. Every view (`posttrainllm explain`, the report,
report.html) reads the text here (`text`), and docs/rules.md is written from this table
(`python -m posttrainllm.rules`; tests/test_rules.py keeps it in step).

An id is never reused for another rule; a rule whose meaning changes gets a new id. A receipt naming an id this
table does not hold (one written by another version) reads as "unknown rule '<id>'" in its place, and the rest
of the receipt reads as before. A rule stored as prose (a receipt written before its rule moved here) is shown
as it is. A rule may include others (`parts`): its text is its own, then each part's, and its citation carries
the parameters of all of them. A message shown to the user names a rule by `named` ("rule outside_null").

This module is the package's lowest layer: it imports nothing of the package, so every layer reads it.
"""

from __future__ import annotations

import re
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ID = re.compile(r"[a-z][a-z0-9_]*")
Cited = str | dict[str, Any]  # how a result stores a rule: its id, or {"id": id, **its parameters}


@dataclass(frozen=True)
class Rule:
    text: str  # a format string where the rule has parameters
    where: str  # the code that applies it
    params: dict[str, str] = field(default_factory=dict)  # each parameter of its own text: what fills it
    parts: tuple[str, ...] = ()  # the rules it includes (ids): their text follows its own, "; " between


RULES: dict[str, Rule] = {
    # timing (measure/timing.py)
    "noisy": Rule("noisy = reps < {min_samples} or (p80 - p20) / median > {spread}",
                  "measure/timing.py summary",
                  {"min_samples": "timing.NOISY_MIN_SAMPLES", "spread": "timing.NOISY_SPREAD"}),
    "batch_mean": Rule(
        "every path the lab compares is read by one statistic: a sample is the mean per call over a batch of N "
        "consecutive calls, the figure the median over at least {batches_min} batches; in process N is sized from "
        "the last warm-up call so that {batches_min} batches fill bench.min_time_s (at most {batch_max} calls, and "
        "{batches_min} batches within bench.max_reps), and on the CPU one wall-clock span covers the batch, less "
        "what the lab's thread waited runnable on a run queue in it; a user path's batches are timed from outside "
        "its worker (rule outside_timing)",
        "measure/timing.py measure", {"batches_min": "timing.BATCHES_MIN", "batch_max": "timing.BATCH_MAX"}),
    "same_cpus": Rule(
        "a timed stage (microbench, bench-train) runs on bench.threads CPUs fixed for its whole length, the CPU it "
        "started on first, and every user path's worker is pinned to the same CPUs: a virtual machine's CPUs need not "
        "run at one speed, so two paths timed on different CPUs would compare the CPUs; a path that changes its "
        "worker's CPUs gets no speed. Nothing is pinned at bench.threads=0 or where the threads cover every CPU",
        "measure/device.py same_cpus", {}),
    "other_streams": Rule(
        "CUDA: each repetition's events (current stream) sit inside a device-wide synchronisation whose wall time "
        "counts every stream; a wall median over (1 + {slack:g}) x the events' median + {slack_ms:g} ms is work "
        "outside the timed stream: no speed",
        "measure/timing.py other_streams",
        {"slack": "timing.STREAM_SLACK", "slack_ms": "timing.STREAM_SLACK_MS"}),
    # the microbench stage (lab/stages/microbench.py)
    "band": Rule("faster: p80 < other's p20; slower: p20 > other's p80; else no measurable difference",
                 "lab/stages/microbench.py compare"),
    "timed_result": Rule(
        "after timing, each timed path is called on one of its timed input sets and its outputs checked against "
        "the float64 oracle; then those buffers are refilled in place with new values (another seed) and the check "
        "repeated: a path returning a stored result for inputs it has seen fails and gets no speed. Forward: the "
        "output; forward + backward: every output and gradient, under the parity stage's rules",
        "lab/stages/microbench.py _timed_result_check"),
    "impossible": Rule(
        "a median under {fraction:g} x the roofline's minimum time (the FLOPs of what was timed, forward or "
        "forward + backward, at the fastest calibrated GEMM peak among the formats at least as precise as the "
        "point's: a path may compute wider, never narrower; where none is calibrated here, the best of any dtype) "
        "is refused as impossible; the bytes roof is not used: a working set that fits the caches moves faster "
        "than the calibrated DRAM copy bandwidth (torch's rms_norm measured at 1.5x it on a 132 KB point)",
        "lab/stages/microbench.py impossible", {"fraction": "the config's bench.impossible_below"}),
    "rotation": Rule(
        "timed repetitions rotate over {n} distinct input sets (the case at seeds seed + i x {seed_step}, each in "
        "its own buffers), forward and forward + backward",
        "lab/isolation/rooms.py timed_input_sets",
        {"n": "rooms.timed_input_sets: bench.input_sets; on a CPU as many as a batch's most calls, within "
              "rooms.TIMED_SETS_MAX_BYTES",
         "seed_step": "rooms.INPUT_SET_SEED"}),
    "torch_state": Rule(
        "torch's thread count, grad mode, anomaly detection, default dtype and backends flags are read around "
        "every timed region: a path that changes them is named, gets no speed, and the state is put back",
        "lab/runner.py (the in-process runner's timing)"),
    "cost_model": Rule(
        "each path is placed on the roofline with its own FLOPs and bytes, from the model the op declares for its "
        "kind of path (paths.<name>.costs: the formula beside each figure; the reference's materialised (S, S) "
        "traffic, a fused kernel's re-reads per tile); a path that declares none is placed with the op's floor, "
        "and its costs say so (model 'floor'). The top-level flops and bytes are the floor; gflops_per_s is the "
        "floor's FLOPs per second, gbytes_per_s the path's own bytes",
        "lab/stages/microbench.py run_microbench"),
    "curve_check": Rule(
        "each size: every timed path's forward output against the float64 oracle under the point's contract "
        "before timing (a size that fails is timed in no mode); after timing, per mode, the timed-result check "
        "and the impossible-time floor (a size that fails them keeps no time)",
        "lab/stages/microbench.py _curve"),
    # a user path timed from outside its worker (lab/isolation/outside.py, worker.py)
    "outside_timing": Rule(
        "a user path is timed from outside its worker: batches of N >= {batch_min} distinct input sets (fresh each "
        "batch) placed in the worker before the clock, computed in one request the lab's clock spans, every output "
        "fetched after the clock, matched to its checksum and checked against the float64 oracle of its set, and "
        "what its calls changed of the worker asked after the clock",
        "lab/isolation/outside.py time_user_path", {"batch_min": "outside.BATCH_MIN"},
        parts=("outside_warmup", "outside_wake", "outside_heap", "outside_keep", "outside_refill",
               "outside_agreement", "timing_seed", "outside_process", "outside_thread")),
    "outside_agreement": Rule(
        "one sample per batch: (the lab's span of the request computing all N sets - that batch's null) / N, "
        "time.perf_counter after a device synchronize; the figure is the median over the batches; the worker's "
        "per-call times are recorded (worker_over_lab), never a sample: a path that front-loads or forges them "
        "gains nothing",
        "lab/isolation/outside.py time_user_path",
        parts=("outside_null", "outside_run_queue", "outside_unreadable")),
    "outside_null": Rule(
        "after each batch the lab times the same request calling nothing: the same batch loop, line for line, each "
        "call replaced by its kept result (the clock, the copies of rule outside_keep, the checks after the calls) and "
        "the checksums over that batch's outputs, once in the path's worker and once in a clean twin (a worker forked alike that never "
        "loaded a path), handed the same outputs; the smaller is the batch's null: a null the path's own process "
        "slows (a thread or a process that works only while nothing is called) is not subtracted",
        "lab/isolation/outside.py _batch"),
    "outside_run_queue": Rule(
        "a span, timed or null, counts the time its work was on a core: the lab subtracts what the worker's main "
        "thread and its own thread waited runnable on a run queue during it (the kernel's schedstat, read from "
        "/proc, the worker's outside it, the worker asleep before the clock starts: a wait is credited when its "
        "thread next runs), so a batch preempted by other processes on shared cores, or a lab that waits for a core "
        "to read the answer, reads as its calls ran, as the in-process median of single calls does (a call "
        "preempted is an outlier there); a span is never read as less than the two threads ran on a core in it (a "
        "wait of the lab's while the worker computed is not its to subtract); nothing is subtracted where the "
        "worker's other threads ran over {other_threads_share:.0%} of the span (work beside the main thread), or "
        "where the kernel does not say",
        "lab/isolation/outside.py _waited_s", {"other_threads_share": "outside.OTHER_THREADS_SHARE"}),
    "outside_unreadable": Rule(
        "a batch whose span, less its waits, does not stand above its null is unreadable: the load on the cores "
        "moved the two spans more than the batch's calls took; it is counted (unreadable_batches), never a sample "
        "(a 0 there is no time a call took), and the timing goes on for its {batches_min} samples; over "
        "{unreadable_max} unreadable batches, no speed: the machine was too loaded to time the path (a path cannot "
        "make a batch unreadable to its gain: that needs a span shorter than calling nothing)",
        "lab/isolation/outside.py time_user_path",
        {"batches_min": "timing.BATCHES_MIN", "unreadable_max": "outside.UNREADABLE_MAX"}),
    "timing_seed": Rule(
        "the timing's input sets are drawn from a base seed the lab draws at run time from the operating system's "
        "randomness (secrets), per path and mode, recorded after the timing: no source holds it, so no set can be "
        "computed ahead; parity's seeds stay the configuration's",
        "lab/isolation/outside.py seeds_drawn; checked by track/replay.py verify_timing_seeds"),
    "outside_warmup": Rule(
        "the warm-up is {warmups} batches of {batch_min} sets like the timed ones, on the lab's clock, every output "
        "checked: the last one's span less its null gives the per-call time that sizes N; a wrong warm-up gets no "
        "speed",
        "lab/isolation/outside.py time_user_path", {"warmups": "outside.WARMUPS", "batch_min": "outside.BATCH_MIN"}),
    "outside_wake": Rule(
        "every batch request, timed or null, starts with the worker's own {wake_ms:g} ms of small products "
        "(lab/isolation/worker.py _wake: no code of the path's): a process woken from a wait runs its first calls "
        "cold, which the lab's in-process loop never does; the null takes the {wake_ms:g} ms out of the span",
        "lab/isolation/worker.py _wake", {"wake_ms": "worker.WAKE_S, in ms"}),
    "outside_process": Rule(
        "a path's worker leads a process group of its own; the zygote that forks workers is a subreaper, so what a "
        "worker leaves orphaned (double-forked, setsid) is adopted there; before and after the timing the lab "
        "looks: an adopted process, or child processes that used over {idle_cpu_s:g} s of CPU over the timing, get "
        "the path no speed; a worker ends with its whole group and every adopted process, and every worker ends "
        "with its stage",
        "lab/isolation/outside.py _strays", {"idle_cpu_s": "outside.IDLE_CPU_S"}),
    "outside_heap": Rule(
        "a worker keeps the memory it frees mapped (glibc: mallopt, the trim threshold at its maximum, blocks under "
        "{mmap_max_mib:g} MiB from the heap, where a lab process's dynamic threshold ends), and before each batch's "
        "clock touches and frees twice the batch's inputs: a batch holds its N results until they are checked, and "
        "without this each of its calls faulted its pages in again (~50 minor faults, +35% a call at attention "
        "tiny) where the lab's in-process loop frees each result and faults none; the last batch is freed before "
        "the clock too; the worker's minor faults per call are recorded (faults_per_call)",
        "lab/isolation/worker.py _keep_heap, _reserve", {"mmap_max_mib": "worker.MMAP_THRESHOLD_MAX, in MiB"}),
    "outside_keep": Rule(
        "each call's outputs and gradients are copied, after its per-call clock, into buffers the worker made and "
        "wrote before the batch's clock, and the call's own are freed before the next call: the next call "
        "allocates where this one did, as in the lab's in-process loop, which frees each result before the next "
        "call (holding the N results instead put each call's temporaries at new addresses: +5% a call at "
        "attention tiny, on the thread's CPU clock); the null copies the kept results once more, so the copies are "
        "no part of a sample; on the CPU no set's inputs are read before its call (CUDA: the L2 is flushed, as "
        "measure() flushes it): reading them there was work in the span its null, run on warmer caches, did not "
        "take out; nothing else runs between two calls: the checks of the calls (the thread count, the CPUs, a "
        "tensor subclass returned) run after the last one, since a step between calls runs 2-3x slower after a "
        "call than in the null's back-to-back loop (69 us a call against the null's 27, attention tiny)",
        "lab/isolation/worker.py (the worker's batch: keep, null)"),
    "outside_thread": Rule(
        "at one lab thread (bench.threads=1, as torch runs its own work on the calling thread), the worker's "
        "threads other than its main one may use {other_threads_share:.0%} of the timed spans' time in CPU (at "
        "most {idle_cpu_s:g} s) over a path's whole timing, spans and the gaps between them, threads that ended "
        "included (the process's CPU clock, exact to the ns, less its main thread's; not clock ticks, 10 ms each, "
        "which read an honest compiled path's few threads as 10 ms): a thread the path leaves running, or starts "
        "and joins in each call, could compute the placed sets before the clock, work beside its calls while its "
        "main thread waits (a wait the rule outside_run_queue would otherwise take out), or slow the null; over "
        "that, no speed. Python threads still running its code at a scan are named too (the worker's scan)",
        "lab/isolation/outside.py _strays",
        {"other_threads_share": "outside.OTHER_THREADS_SHARE", "idle_cpu_s": "outside.IDLE_CPU_S"}),
    "outside_refill": Rule(
        "after the last batch, new values (another seed) are copied in place into its first set's buffers in the "
        "worker and that set computed again: a result stored by the buffers' address or identity fails the oracle "
        "check there and the path gets no speed",
        "lab/isolation/outside.py _refill_check"),
    "outside_memory": Rule(
        "a user path's peak memory is one forward call's in its worker: the larger of the sum of what torch's "
        "allocator (the profiler's events; CUDA: max_memory_allocated) and Python's tracemalloc (NumPy's buffers) "
        "counted in the worker, and the growth of its resident set read by the lab from outside "
        "(/proc/<pid>/status VmHWM after clear_refs); a peak below the bytes of the outputs it returned cannot be "
        "true (memory taken where neither count sees it, or outputs that are not its own): named, and no speed",
        "lab/isolation/outside.py user_memory"),
    "lab_stopped": Rule(
        "the lab counts every SIGCONT it receives (a stopped process is continued by one: SIGSTOP cannot be "
        "caught, but its end can); a path timed while the count moved gets no speed, and the stage ends with an "
        "error if the reference or the curve was: a path that stops the lab (the same user may signal it) slows "
        "whatever the lab times then, never to its own gain; a SIGKILL or SIGTERM ends the stage and leaves no "
        "receipt",
        "lab/isolation/outside.py continued, lab/stages/microbench.py"),
    "planted_bytecode": Rule(
        "when a lab process ends its workers, every bytecode file of the lab's package (its __pycache__ and any "
        "sourceless .pyc) and every cached file of a module it has loaded (torch's, numpy's, ...) that was written "
        "or changed (its inode's ctime, which no user can set back) after it first let a path run is removed and "
        "named: the lab itself writes its bytecode to a private prefix from then on, so such a file is a path's, "
        "and the next lab process would have loaded it before any check",
        "lab/isolation/worker.py drop_planted_bytecode"),
    # the roofline, the calibration and the curve (measure/)
    "roofline_class": Rule(
        "overhead-bound if seconds < {overhead_multiple:g} x overhead_s or achieved/attainable < {low_fraction:g}; "
        "else compute-bound if flops/bytes >= peak_flops/peak_bytes_per_s; else memory-bound",
        "measure/roofline.py roofline",
        {"overhead_multiple": "roofline.OVERHEAD_DOMINATES_BELOW", "low_fraction": "roofline.LOW_FRACTION"}),
    "above_roof": Rule(
        "achieved above attainable is not a result: above the calibrated FLOP peak, the calibration or the timing "
        "is wrong; above the DRAM copy roof with a working set larger than the last-level cache, the byte model "
        "or the calibration is (a cache-resident working set has the FLOP peak alone as its roof)",
        "measure/roofline.py roofline"),
    "local_peak": Rule(
        "a path above the calibrated FLOP peak has the peak remeasured before its speed is refused: a square GEMM "
        "of the path's own FLOPs (n = round((flops/2)^(1/3)), at least 16) in the point's dtype, {reps} warm "
        "calls, its fastest call (not the median: the median of a call like the path's own sits on it half the "
        "time) as the roof at that size; the larger of it and the calibrated peak is the FLOP roof, and a path "
        "still above it gets no speed",
        "measure/calibrate.py local_peak", {"reps": "calibrate.LOCAL_REPS"}),
    "regime": Rule(
        "per segment between two measured sizes, slope = d log(time) / d log(x), beside the slopes the path's "
        "FLOPs and bytes predict (d log(flops) / d log(x), d log(bytes) / d log(x), its cost model). Measured "
        "regime: overhead-bound if the time slope is under {overhead_fraction:g} x the smaller predicted slope; "
        "'leaves the cache' if its working set passes a cache level (L2, the last-level) within the segment and "
        "the time grows faster than both by more than {slope_tolerance:g}; 'beyond the model' if it does so with "
        "no cache crossing; 'compute or memory' where the FLOPs and bytes slopes are within {slope_tolerance:g} of "
        "each other (and time follows them); else whichever of the two slopes the time slope is nearer. Predicted "
        "regime: the roofline's at the segment's larger size (intensity against the ridge; a working set within "
        "the cache: compute, no DRAM roof). They agree when the measured is the predicted, or 'compute or memory' "
        "against either.",
        "measure/curves.py regimes",
        {"overhead_fraction": "curves.OVERHEAD_SLOPE_FRACTION", "slope_tolerance": "curves.SLOPE_TOLERANCE"}),
    # parity (lab/parity.py, lab/oracle.py, lab/stages/parity.py, lab/invariance.py)
    "parity_contract": Rule(
        "tensor: max_abs_err <= error_multiple * baseline_max_abs_err + floor_rel * max|oracle|, mismatch_frac <= "
        "max_mismatch (outside: |err| > atol + atol_rel * max|oracle| + rtol * |oracle|); each row: err_r <= "
        "error_multiple * baseline_err_r + floor_rel * max|oracle_r| + row_floor * max|oracle| (row_floor: "
        "grad_row_floor_rel for grad_*, else row_floor_rel); all finite; with min_sqnr_db, 10*log10(sum oracle^2 / "
        "sum err^2) >= min_sqnr_db; forward and backward calls each: inputs unchanged, no aliasing, a Triton path "
        "launched the kernels it names for that direction",
        "lab/parity.py check_output, lab/oracle.py judge_path"),
    "backward": Rule(
        'each path\'s "backward": "own" (its gradients checked as the forward is), another path\'s name '
        "(borrowed: its gradients are that path's math, shown as not checked, never a pass) or \"none\" "
        "(forward-only)",
        "lab/stages/parity.py run_parity"),
    "gradient_baseline": Rule(
        "each gradient's baseline is, element by element, the larger-error of the op's readable formulations in "
        "the point's precision (attention: torch.softmax, and P = exp(S - lse) as a flash backward recomputes it "
        "from the stored logsumexp)",
        "lab/oracle.py worst_gradient_baseline"),
    "quantization_error": Rule(
        "the quantization's own error, apart from any path's: each case's float64 oracle on the quantized inputs "
        "against the same float64 math on the unquantized inputs; SQNR = 10*log10(sum exact^2 / sum (quantized - "
        "exact)^2) of each output >= min_sqnr_db, and of each of its rows >= min_row_sqnr_db",
        "lab/parity.py quantization_check"),
    "determinism": Rule(
        "the main case run {runs} times on the same values, each in fresh buffers, forward and (its own backward) "
        "gradients; every output of runs 2.. compared bitwise with run 1's",
        "lab/invariance.py determinism", {"runs": "invariance.RUNS"}),
    "batch_invariance": Rule(
        "the main case's first and last rows (OpDef.batch_axis: what a row is, each tensor's batch dim) computed "
        "alone, in the main batch, and in batches of N+1 and N+2 at other positions among companions drawn from "
        "another seed (an op whose math depends on the batch's size keeps N and moves them); each row's forward "
        "outputs (where none is a row's, as a mean loss: its batched inputs' gradients) compared bitwise with the "
        "main batch's",
        "lab/invariance.py batch_invariance"),
    "properties": Rule(
        "a property a path promises (Impl.promises, a user function's `promises`) or the point requires "
        "(parity.require) and does not hold fails its parity with the first differing row; one neither promised "
        "nor required is reported, never judged",
        "lab/invariance.py judge"),
    # the compile report (lab/compile.py, measure/sass.py)
    "compile_counters": Rule(
        "each Triton launch of the point's main case (forward, then backward) captured where Triton binds it and "
        "specialized by Triton's own binder as a GPU launch of the same arguments is (unit strides constant, "
        "16-divisible pointers and integers marked), never run; compiled with triton.compile for each target; "
        "counters read from the cubin (cuobjdump -res-usage and -sass of Triton's wheel): registers per thread, "
        "the stack frame ptxas spills to, STL/LDL spill instructions, shared memory (the launch's dynamic plus the "
        "cubin's static), tensor cores from the MMA instructions, async copies from TMA/LDGSTS; occupancy by the "
        "CUDA occupancy calculator's rules against the target's per-SM limits; fits: shared memory within the "
        "target's per-block limit and one block's registers within an SM's",
        "lab/compile.py compile_launches, measure/sass.py counters"),
    "shared_memory": Rule(
        "shared memory per program of the point's tile by the op's one formula (ops/<op>/config.py), the one its "
        "config check refuses a tile by (device.smem_bytes) and its autotuner prunes candidates by; each row's "
        "shared_bytes is what that compiled kernel holds",
        "lab/compile.py"),
    # an op made from a problem file (its definition, in its op folder)
    "problem_rows": Rule("parity rows along the output's last axis (a 0-d output, a loss: one row)",
                         "the parity rows of an op made from a problem file"),
    "problem_bytes": Rule(
        "bytes: inputs + parameters and buffers + output in the point's dtype: a floor (no intermediate, no "
        "re-read counted)",
        "the costs of an op made from a problem file"),
    "problem_flops": Rule(
        "FLOPs: torch.utils.flop_counter.FlopCounterMode on the reference (it counts matmuls, convolutions and "
        "attention: elementwise work counts 0); backward multiple from the same count over forward + backward",
        "the costs of an op made from a problem file"),
    # the training step and the draft heads (model/, lab/heads.py)
    "noise_band": Rule(
        "a measured end-to-end speedup s is a change only when s > band or s < 1/band; band: the widest ratio of "
        "the baseline's warm ms/step to itself: a second copy of it against the first, the two trained interleaved "
        "step by step with the variants, over all warm steps and over each half of them (a change of the "
        "machine's speed hits both copies alike and cancels, as in a measured speedup; the first copy's halves "
        "against each other are recorded as drift); without a second copy, the first copy's second half against "
        "its first",
        "model/amdahl.py noise_band"),
    "trainer_sampler_gap": Rule(
        "per token the sampler generated (greedy_cached with its decode attention, prompts batched): |log p "
        "sampled - log p scored| where scored is one forward over prompt + tokens with the trainer's attention; "
        "bitwise = the two fp32 log-probabilities have the same bits",
        "model/gap.py measure_gap"),
    "heldout_loss": Rule(
        "mean cross-entropy (nats/byte) over {eval_batches} batches of the held-out tail",
        "lab/heads.py heldout_loss", {"eval_batches": "the config's heads.base.eval_batches"}),
    "head_accuracy": Rule(
        "head k at position t vs the base's greedy token t+k+1, over the eval prompts' generated tokens (held-out: "
        "never trained on)",
        "lab/heads.py train_heads"),
    "inter_token_latency": Rule(
        "a step that yields m tokens in dt gives m inter-token latencies of dt/m",
        "lab/heads.py measure_decode"),
    "accepted_length": Rule(
        "tokens per verification step: accepted drafts + the base's own next token (1 = nothing accepted)",
        "lab/heads.py measure_decode"),
    "draft_tree": Rule(
        "a Cartesian tree: under every candidate at depth d-1, the top-w_d tokens of head d; one forward over root "
        "+ candidates, each at position L + depth seeing the cache and its ancestors; the deepest candidate whose "
        "path equals the base's greedy tokens is accepted, plus the base's next token",
        "lab/heads.py measure_decode, model/decode.py speculative_tree"),
    "lossless_decoding": Rule(
        "every speculative output must equal plain greedy token for token, and plain greedy with "
        "heads.cached_attention greedy with the reference attention; a near-tie (top-2 logit gap < {near_tie:g}) is "
        "named and still counted",
        "lab/heads.py measure_decode", {"near_tie": "the config's heads.near_tie"}),
    "decode_speedup": Rule(
        "speedup = decode tokens/s of the variant / decode tokens/s of plain greedy; predicted = mean accepted "
        "length x greedy step time / verification step time",
        "lab/heads.py _speedup"),
    # the receipt and its views (track/)
    "best_peer": Rule(
        "best peer: the peer (kind 'peer' in the op's registry; every SDPA backend is one) with the lowest valid "
        "forward median",
        "track/derived.py best_peer"),
    "integrity": Rule(
        "what the receipt combines is what its stages wrote: every file a stage's stamp hashed is unchanged since, "
        "the contract parity judged by is the config's (precision.contract, lse_contract), and the calibration "
        "the microbench read is the file the calibrate stage wrote; otherwise the receipt fails and no path gets "
        "a speed until the point is rerun (`dvc repro`)",
        "track/receipt.py integrity_problems"),
}


def placeholders(rule_text: str) -> set[str]:
    """The parameters a rule's text names ({name} or {name:spec})."""
    return {name for _, name, _, _ in string.Formatter().parse(rule_text) if name}


def full_text(rule_id: str) -> str:
    """A rule's whole text, unfilled: its own, then each part's (and theirs), "; " between."""
    rule = RULES[rule_id]
    return "; ".join([rule.text, *(full_text(part) for part in rule.parts)])


def parameters(rule_id: str) -> set[str]:
    """What a citation of the rule carries: its own parameters and its parts'."""
    rule = RULES[rule_id]
    return set(rule.params).union(*(parameters(part) for part in rule.parts))


def cite(rule_id: str, **params: Any) -> Cited:
    """How a result names a rule: its id, with the values of its parameters where it has any. An id the table
    lacks, or parameters other than the rule's, are the lab's own mistake: KeyError, TypeError."""
    wanted = parameters(rule_id)
    if set(params) != wanted:
        raise TypeError(f"rule {rule_id!r} takes {sorted(wanted)}, was given {sorted(params)}")
    return {"id": rule_id, **params} if params else rule_id


def named(rule_id: str) -> str:
    """How a message shown to the user names a rule: "rule <id>" (its text: docs/rules.md, `posttrainllm explain`).
    An id the table lacks is the lab's own mistake: KeyError."""
    RULES[rule_id]
    return f"rule {rule_id}"


def is_cited(value: Any) -> bool:
    """Whether a stored value names a rule by id (a prose rule, stored before it moved here, does not)."""
    return (isinstance(value, dict) and isinstance(value.get("id"), str)) or (
        isinstance(value, str) and ID.fullmatch(value) is not None)


def rule_id(cited: Cited) -> str:
    return cited["id"] if isinstance(cited, dict) else cited


def text(cited: Cited | None) -> str:
    """A stored rule as a person reads it: the table's text, its parameters filled in. An id the table does not
    hold reads "unknown rule '<id>'"; a rule stored as prose (not yet moved here) reads as it is; None: "-"."""
    if cited is None:
        return "-"
    if not is_cited(cited):
        return str(cited)
    found = RULES.get(rule_id(cited))
    if found is None:
        return f"unknown rule {rule_id(cited)!r} (not in this posttrainllm's table, posttrainllm/rules.py)"
    params = {k: v for k, v in cited.items() if k != "id"} if isinstance(cited, dict) else {}
    whole = full_text(rule_id(cited))
    missing = placeholders(whole) - set(params)
    if missing:
        return f"rule {rule_id(cited)!r} stored without its {', '.join(sorted(missing))}: " + whole
    try:
        return whole.format(**params)
    except (ValueError, TypeError):  # a value its format cannot take (a receipt of another version)
        return f"rule {rule_id(cited)!r} stored with {params}, which its text cannot show: " + whole


def cited_in(value: Any) -> list[Cited]:
    """Every rule named by id under a key `rule` or `*_rule` in a stored result, in order, each once."""
    found: list[Cited] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, item in node.items():
                if isinstance(key, str) and (key == "rule" or key.endswith("_rule")) and is_cited(item):
                    if item not in found:
                        found.append(item)
                else:
                    walk(item)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(value)
    return found


DOCS = Path("docs/rules.md")
DOCS_HEAD_LINE = "<!-- written by `python -m posttrainllm.rules` from posttrainllm/rules.py; do not edit by hand -->"
DOCS_INTRO = ("Every rule the lab applies, by the id its results and receipts name it by (`\"band_rule\": \"band\"`). "
             "A rule with parameters is stored with the values its run used (`{\"id\": \"impossible\", "
             "\"fraction\": 0.5}`); below they are shown as `{name}`. `posttrainllm explain`, the report and "
             "report.html read the same table, so a receipt copied away from the project still reads.")


def markdown() -> str:
    """docs/rules.md: every rule, its id, where it is applied, its text and its parameters (a paragraph a line:
    a rule's text, wrapped, could start a line with its own "+ " or "- " and read as a list)."""
    lines = [DOCS_HEAD_LINE, "", "# Rules", "", DOCS_INTRO, ""]
    for rid, rule in RULES.items():
        shown = re.sub(r"<(?=[A-Za-z])", r"\\<", rule.text.replace("*", "\\*"))  # markdown: a product, no tag
        lines += [f"## `{rid}`", "", f"Applied in: {rule.where}.", "", shown, ""]
        if rule.parts:
            lines += ["Includes, after its own text: " + ", ".join(f"[`{part}`](#{part})" for part in rule.parts)
                      + " (a citation of it carries their parameters too).", ""]
        if rule.params:
            lines += [f"- `{name}`: {what}" for name, what in rule.params.items()] + [""]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m posttrainllm.rules [ROOT]: rewrite docs/rules.md
    target = Path(sys.argv[1] if len(sys.argv) > 1 else ".") / DOCS
    target.write_text(markdown())
    print(f"wrote {target}")
