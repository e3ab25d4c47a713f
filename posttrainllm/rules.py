"""The lab's rules, in one table: each an id (short snake_case, stable) and its text.

A stage result or a receipt names a rule by its id (`cite`): "band_rule": "band". A rule whose text holds values
of the run (a config value, a constant of the code that applies it) is cited with them beside its id:
"impossible_rule": {"id": "impossible", "fraction": 0.5}. Every view (`posttrainllm explain`, the report,
report.html) reads the text here (`text`), and docs/rules.md is written from this table
(`python -m posttrainllm.rules`; tests/test_rules.py keeps it in step).

An id is never reused for another rule; a rule whose meaning changes gets a new id. A receipt naming an id this
table does not hold (one written by another version) reads as "unknown rule '<id>'" in its place, and the rest
of the receipt reads as before. A rule still written out in full where it is stored (the isolation's rules,
lab/isolation/, and the trainer's, model/, until they move here) is shown as it is.

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
    params: dict[str, str] = field(default_factory=dict)  # each parameter: what fills it


RULES: dict[str, Rule] = {
    # timing (measure/timing.py)
    "noisy": Rule("noisy = reps < {min_samples} or (p80 - p20) / median > {spread}",
                  "measure/timing.py summary",
                  {"min_samples": "timing.NOISY_MIN_SAMPLES", "spread": "timing.NOISY_SPREAD"}),
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
        "lab/isolation/rooms.py input_sets",
        {"n": "the config's bench.input_sets", "seed_step": "rooms.INPUT_SET_SEED"}),
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


def cite(rule_id: str, **params: Any) -> Cited:
    """How a result names a rule: its id, with the values of its parameters where it has any. An id the table
    lacks, or parameters other than the rule's, are the lab's own mistake: KeyError, TypeError."""
    rule = RULES[rule_id]
    if set(params) != set(rule.params):
        raise TypeError(f"rule {rule_id!r} takes {sorted(rule.params)}, was given {sorted(params)}")
    return {"id": rule_id, **params} if params else rule_id


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
    missing = placeholders(found.text) - set(params)
    if missing:
        return f"rule {rule_id(cited)!r} stored without its {', '.join(sorted(missing))}: " + found.text
    return found.text.format(**params)


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
        if rule.params:
            lines += [f"- `{name}`: {what}" for name, what in rule.params.items()] + [""]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m posttrainllm.rules [ROOT]: rewrite docs/rules.md
    target = Path(sys.argv[1] if len(sys.argv) > 1 else ".") / DOCS
    target.write_text(markdown())
    print(f"wrote {target}")
