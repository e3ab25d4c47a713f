"""The stages' typed records (track/records.py): one writer, one reader, a schema version checked on every read."""

import json

import pytest

from posttrainllm.config import ConfigError
from posttrainllm.lab.configure import load
from posttrainllm.lab.stages import kernel as kernel_stage, parity as parity_stage, reference as reference_stage
from posttrainllm.track import records
from posttrainllm.track.records import (Amdahl, AmdahlVariant, BenchTrainRecord, ForwardBackward, KernelPath,
                                        KernelRecord, MicrobenchPath, MicrobenchRecord, ParityPath, ParityRecord,
                                        RecordError, ReferenceRecord, TimingSummary, TrainImpl)

SMALL = ["op=rmsnorm", "device=cpu", "parity.seeds=[0]", "shape.seq_len=16", "shape.edge_seq_lens=[]",
         "op.only=[torch]"]


A_PATH = {"kind": "torch", "backend": "torch", "problem": "N=4", "geometry": {}, "emulation": None, "violations": [],
          "launched": {}}


def _kernel(**changes):
    return KernelRecord(**{"device": "cpu", "triton_interpreted": False, "paths": {"a": KernelPath(**A_PATH)},
                           **changes})


def test_a_record_round_trips_with_its_version_and_leaves_out_optional_nones(tmp_path):
    path = tmp_path / "kernel.json"
    _kernel().write(path)
    written = json.loads(path.read_text())
    assert written == {"schema_version": KernelRecord.SCHEMA_VERSION, "device": "cpu", "triton_interpreted": False,
                       "paths": {"a": A_PATH}}  # no compile, no library_replaced, no backward: none here
    assert KernelRecord.read(path) == _kernel()
    _kernel(compile={"rows": []}).write(path)
    assert KernelRecord.read(path).compile == {"rows": []}


def test_a_missing_file_another_version_or_no_version_is_one_line_naming_the_stage(tmp_path):
    path = tmp_path / "kernel.json"
    with pytest.raises(RecordError, match=r"no kernel.json here: run the kernel stage first"):
        KernelRecord.read(path)
    assert KernelRecord.read_optional(path) is None
    path.write_text(json.dumps({**_kernel().to_dict(), "schema_version": KernelRecord.SCHEMA_VERSION + 1}))
    with pytest.raises(RecordError) as raised:
        KernelRecord.read(path)
    line = str(raised.value)
    assert "\n" not in line and f"schema_version {KernelRecord.SCHEMA_VERSION + 1}" in line
    assert "rerun the kernel stage" in line
    path.write_text(json.dumps({k: v for k, v in _kernel().to_dict().items() if k != "schema_version"}))
    with pytest.raises(RecordError, match="no schema_version"):
        KernelRecord.read(path)
    assert issubclass(RecordError, ConfigError)  # a DVC stage exits 2 with the line (lab/pipeline.py execute)


def test_keys_a_record_does_not_name_are_refused_and_missing_ones_named(tmp_path):
    with pytest.raises(RecordError, match=r"KernelRecord has no 'speed' \(its keys: device, triton_interpreted"):
        KernelRecord.from_dict({**_kernel().to_dict(), "speed": 2.0})
    with pytest.raises(RecordError, match="KernelRecord lacks paths"):
        KernelRecord.from_dict({"device": "cpu", "triton_interpreted": False})


def test_bench_trains_growing_trainer_figures_ride_along_at_the_top_level(tmp_path):
    data = {"impls": {}, "skipped": {}, "drift": {"x": 0.1}, "drift_verdict": {"x": "pass"}, "baseline": "reference",
            "losses_note": "kept"}
    record = BenchTrainRecord.from_dict(data)
    assert record.trainer == {"baseline": "reference", "losses_note": "kept"}
    record.write(tmp_path / "bench_train.json")
    written = json.loads((tmp_path / "bench_train.json").read_text())
    assert written == {"schema_version": BenchTrainRecord.SCHEMA_VERSION, **data}
    assert BenchTrainRecord.read(tmp_path / "bench_train.json") == record


def test_the_stages_write_through_their_records_and_read_through_them(tmp_path):
    cfg = load([*SMALL, f"run.out_dir={tmp_path}", "run.name=p"])
    out = tmp_path / "p"
    reference_stage.run_reference(cfg, out)
    assert ReferenceRecord.read(out / "reference.pt").op == "rmsnorm"
    returned = kernel_stage.run_kernel(cfg, out)
    assert returned == KernelRecord.read(out / "kernel.json").to_dict()
    assert returned["schema_version"] == KernelRecord.SCHEMA_VERSION
    report = parity_stage.run_parity(cfg, out)
    assert ParityRecord.read(out / "parity.json").verdict == report["verdict"] == "pass"
    # a kernel.json of another version: the parity stage refuses it in one line, before judging anything
    stale = {**json.loads((out / "kernel.json").read_text()), "schema_version": 0}
    (out / "kernel.json").write_text(json.dumps(stale))
    (out / "parity.json").unlink()
    with pytest.raises(RecordError, match="kernel.json: schema_version 0, but this code reads KernelRecord"):
        parity_stage.run_parity(cfg, out)
    assert not (out / "parity.json").exists()


def test_a_reference_of_another_version_is_refused(tmp_path):
    import torch

    torch.save({"op": "rmsnorm", "dtype": "float32", "records": []}, tmp_path / "reference.pt")  # unversioned
    with pytest.raises(RecordError, match="reference.pt: schema_version None, but this code reads ReferenceRecord"):
        ReferenceRecord.read(tmp_path / "reference.pt")
    ReferenceRecord(op="rmsnorm", dtype="float32", records=[]).write(tmp_path / "reference.pt")
    assert ReferenceRecord.read(tmp_path / "reference.pt").records == []
    assert records.VERSION_KEY == "schema_version"


def test_a_path_entry_is_a_typed_part_read_and_written_as_the_stage_wrote_it():
    record = KernelRecord.from_dict({"device": "cpu", "triton_interpreted": False,
                                     "paths": {"a": {**A_PATH, "backward": "own", "error": "RuntimeError: x"}}})
    entry = record.paths["a"]
    assert isinstance(entry, KernelPath) and entry.backward == "own" and entry.invariance is None
    # optional keys the entry lacked stay out; one it had as None (emulation) stays in
    assert record.to_dict()["paths"]["a"] == {**A_PATH, "backward": "own", "error": "RuntimeError: x"}
    assert "emulation" in record.to_dict()["paths"]["a"]


def test_an_unknown_key_in_a_path_entry_is_refused_naming_the_record_the_entry_and_its_keys(tmp_path):
    data = {**_kernel().to_dict(), "paths": {"sdpa": {**A_PATH, "speed": 2.0}}}
    (tmp_path / "kernel.json").write_text(json.dumps(data))
    with pytest.raises(RecordError) as raised:
        KernelRecord.read(tmp_path / "kernel.json")
    line = str(raised.value)
    assert "\n" not in line
    assert line.startswith(f"{tmp_path / 'kernel.json'}: paths['sdpa']: KernelPath has no 'speed' (its keys: kind, ")
    assert "launched" in line and "promises" in line


def test_a_missing_key_in_a_path_entry_is_named_with_the_stage_to_rerun():
    entry = {k: v for k, v in A_PATH.items() if k != "launched"}
    with pytest.raises(RecordError, match=r"the kernel record: paths\['a'\]: KernelPath lacks launched: rerun the "
                                          r"kernel stage"):
        KernelRecord.from_dict({"device": "cpu", "triton_interpreted": False, "paths": {"a": entry}})
    with pytest.raises(RecordError, match=r"paths\['a'\]: KernelPath is list, not an object"):
        KernelRecord.from_dict({"device": "cpu", "triton_interpreted": False, "paths": {"a": [1]}})
    with pytest.raises(RecordError, match=r"paths is list, not a dict"):
        KernelRecord.from_dict({"device": "cpu", "triton_interpreted": False, "paths": []})


def test_a_timed_entrys_figures_come_together_with_its_median():
    """A timing's summary keys are written with its median, None included (other_streams, run_queue_share), and
    an entry with a median that lacks one is refused; an entry without a median (not valid) has none of them."""
    refused = MicrobenchPath.from_dict({"valid": False, "reason": "failed parity: no speed"})
    assert refused.to_dict() == {"valid": False, "reason": "failed parity: no speed"}
    timed = MicrobenchPath(valid=True, median_ms=1.0, p20_ms=0.9, p80_ms=1.1, min_ms=0.8, cv=0.1, iqr_ms=0.1,
                           noisy=False, threads=1, flushed=False, batched=False, batch_size=1, reps=5, gflops_per_s=1.0,
                           gbytes_per_s=1.0, memory={}, costs={}, backward="own",
                           forward_backward=ForwardBackward(valid=False, reason="none"))
    written = timed.to_dict()
    assert written["other_streams"] is None and written["roofline"] is None and "run_queue_share" in written
    assert "timing_rule" not in written and "speedup_vs_reference" not in written
    assert MicrobenchPath.from_dict(written) == timed
    with pytest.raises(RecordError, match=r"MicrobenchPath lacks p80_ms, roofline"):
        MicrobenchPath.from_dict({k: v for k, v in written.items() if k not in ("p80_ms", "roofline")})


A_SUMMARY = {"median_ms": 2.0, "p20_ms": 1.9, "p80_ms": 2.1, "min_ms": 1.8, "cv": 0.05, "iqr_ms": 0.1, "noisy": False,
             "threads": 1, "flushed": False, "other_streams": None, "batched": True, "batch_size": 4,
             "run_queue_share": None, "reps": 5, "timing_rule": "batch_mean"}


def test_a_paths_forward_backward_is_a_timing_summary_as_its_forward_is_or_not_valid_and_why():
    timed = {**A_SUMMARY, "gflops_per_s": 3.0, "roofline": None, "speedup_vs_reference": 1.2, "vs_reference": "faster"}
    entry = MicrobenchPath.from_dict({"valid": True, **A_SUMMARY, "gflops_per_s": 1.0, "gbytes_per_s": 1.0,
                                      "memory": {}, "costs": {}, "roofline": None, "backward": "own",
                                      "forward_backward": timed})
    fb = entry.forward_backward
    assert isinstance(fb, ForwardBackward) and isinstance(entry, TimingSummary) and isinstance(fb, TimingSummary)
    assert fb.median_ms == 2.0 and fb.timing_rule == "batch_mean" and fb.speedup_vs_reference == 1.2
    assert fb.valid is None
    assert entry.to_dict()["forward_backward"] == timed  # no `valid` key where it was timed, as the stage wrote it
    assert list(entry.to_dict())[:4] == ["valid", "median_ms", "p20_ms", "p80_ms"]  # the forward's keys in place
    forward_only = ForwardBackward.from_dict({"valid": False, "reason": "forward-only"})
    assert forward_only.to_dict() == {"valid": False, "reason": "forward-only"}
    with pytest.raises(RecordError, match=r"forward_backward: ForwardBackward has no 'speed' \(its keys: median_ms, "):
        MicrobenchPath.from_dict({**entry.to_dict(), "forward_backward": {**timed, "speed": 2.0}},
                                 "microbench.json", "paths['sdpa']")
    with pytest.raises(RecordError, match=r"paths\['sdpa'\].forward_backward: ForwardBackward lacks reps, roofline"):
        MicrobenchPath.from_dict({**entry.to_dict(), "forward_backward": {
            k: v for k, v in timed.items() if k not in ("reps", "roofline")}}, "microbench.json", "paths['sdpa']")


def test_a_parity_entry_of_a_path_that_could_not_run_round_trips():
    gap = {"reason": "no CUDA device", "runs_on": "an NVIDIA GPU"}
    entry = {"verdict": "cannot run here", "failed_cases": [], "cases": [], "worst": {}, "cannot_run_here": gap,
             "error": {"type": "RuntimeError", "cannot_run_here": gap}, "violations": [], "emulation": None,
             "backward": "own", "launched": {}, "user": {"spec": "k.py:f"}, "gradients": "not checked"}
    record = ParityRecord.from_dict({"precision": "fp32", "contract": {}, "lse_contract": None, "rule": "r",
                                     "backward_rule": "b", "cases": [], "paths": {"mine": entry}, "notes": [],
                                     "invariance": {}, "verdict": "pass", "first_failure": None, "headline": ""})
    assert isinstance(record.paths["mine"], ParityPath) and record.paths["mine"].cannot_run_here == gap
    assert record.to_dict()["paths"]["mine"] == entry


A_VARIANT = {"losses": [5.5, 5.4], "step_ms": [3.0, 2.0], "warm_ms_per_step": 2.0, "step_ms_p20": 2.0,
             "step_ms_p80": 2.0, "noisy": False, "tokens_per_s": 16000.0, "peak_mem_bytes": None,
             "final_loss_finite": True, "timing_valid": True, "profile": {"step_us": 10.0, "clock": "cpu time"}}


def _trained(**impls):
    return {"impls": impls, "skipped": {}, "drift": {}, "drift_verdict": {}, "baseline": "reference"}


def test_a_variants_entry_is_a_typed_part_its_optional_keys_left_out():
    """bench_train.json's impls: each variant a TrainImpl; an MoE model's routing and a quantized run's held-out
    losses only where they were measured."""
    record = BenchTrainRecord.from_dict(_trained(reference=A_VARIANT, fp8={**A_VARIANT, "heldout_loss": {"2": 5.6}}))
    assert isinstance(record.impls["reference"], TrainImpl) and record.impls["reference"].warm_ms_per_step == 2.0
    assert record.impls["reference"].moe_routing is None and record.impls["fp8"].heldout_loss == {"2": 5.6}
    written = record.to_dict()["impls"]
    assert written["reference"] == A_VARIANT and "moe_routing" not in written["fp8"]
    assert written["reference"]["peak_mem_bytes"] is None  # not measured: stays, as the trainer wrote it


def test_an_unknown_or_missing_key_in_a_variants_entry_is_one_line_naming_it(tmp_path):
    path = tmp_path / "bench_train.json"
    path.write_text(json.dumps({"schema_version": BenchTrainRecord.SCHEMA_VERSION,
                                **_trained(reference={**A_VARIANT, "speed": 2.0})}))
    with pytest.raises(RecordError) as raised:
        BenchTrainRecord.read(path)
    line = str(raised.value)
    assert "\n" not in line
    assert line.startswith(f"{path}: impls['reference']: TrainImpl has no 'speed' (its keys: losses, step_ms, ")
    lacking = {k: v for k, v in A_VARIANT.items() if k != "timing_valid"}
    with pytest.raises(RecordError, match=r"impls\['sdpa'\]: TrainImpl lacks timing_valid: rerun the bench_train "
                                          r"stage"):
        BenchTrainRecord.from_dict(_trained(sdpa=lacking))


AN_AMDAHL = {"op": "norm", "fraction": 0.1, "baseline": "reference", "speedup_used": "forward+backward",
             "band": None, "variants": {
                 "torch": {"valid": True, "microbench_speedup": 2.0, "predicted_speedup": 1.05, "measured_speedup": 1.0,
                           "measured_change": None, "reading": "", "forward_speedup": 1.5,
                           "in_model_op_speedup": None, "sentence": "norm is 10% of the step"},
                 "triton": {"valid": False, "reason": "no valid speed"}}}


def test_the_amdahl_check_is_a_typed_part_each_variant_valid_with_its_figures_or_not_and_why(tmp_path):
    record = BenchTrainRecord.from_dict({**_trained(), "amdahl": AN_AMDAHL})
    assert isinstance(record.amdahl, Amdahl) and record.amdahl.band is None
    torch_check, triton_check = record.amdahl.variants["torch"], record.amdahl.variants["triton"]
    assert isinstance(torch_check, AmdahlVariant) and torch_check.predicted_speedup == 1.05
    assert triton_check.reason == "no valid speed" and triton_check.predicted_speedup is None
    assert record.to_dict()["amdahl"] == AN_AMDAHL  # Nones a valid check has (no band: measured_change) stay
    unknown = {**AN_AMDAHL, "variants": {"torch": {**AN_AMDAHL["variants"]["torch"], "speed": 2.0}}}
    path = tmp_path / "bench_train.json"
    path.write_text(json.dumps({"schema_version": BenchTrainRecord.SCHEMA_VERSION, **_trained(), "amdahl": unknown}))
    with pytest.raises(RecordError) as raised:
        BenchTrainRecord.read(path)
    line = str(raised.value)
    assert "\n" not in line
    assert line.startswith(f"{path}: amdahl.variants['torch']: AmdahlVariant has no 'speed' (its keys: valid, ")
    with pytest.raises(RecordError, match=r"the bench_train record: amdahl: Amdahl has no 'f' \(its keys: op, "):
        BenchTrainRecord.from_dict({**_trained(), "amdahl": {**AN_AMDAHL, "f": 0.1}})
    lacking = {k: v for k, v in AN_AMDAHL["variants"]["torch"].items() if k != "sentence"}
    with pytest.raises(RecordError, match=r"amdahl.variants\['torch'\]: AmdahlVariant lacks sentence"):
        BenchTrainRecord.from_dict({**_trained(), "amdahl": {**AN_AMDAHL, "variants": {"torch": lacking}}})


QUICK = ["bench.reps=3", "bench.min_time_s=0", "bench.warmup=1", "bench.max_reps=12", "shape.curve=[8,16]",
         "run.log_mlflow=false"]
TRAIN = ["train.steps=2", "train.warmup_steps=1", "train.batch_size=2", "train.seq_len=16"]  # the interpreter's too


def test_the_stages_records_read_back_and_write_the_same_bytes(tmp_path):
    """kernel.json, parity.json, microbench.json and bench_train.json as the stages write them: read through their
    records (each path, each trained variant, a typed entry) and written again, the same file, byte for byte (the
    receipt, report and replay read the same keys and values)."""
    from posttrainllm.lab.stages import bench_train as bench_train_stage, microbench as microbench_stage

    cfg = load([*SMALL[:-1], *QUICK, *TRAIN, f"run.out_dir={tmp_path}", "run.name=p"])  # every rmsnorm path
    out = tmp_path / "p"
    reference_stage.run_reference(cfg, out)
    kernel_stage.run_kernel(cfg, out)
    parity_stage.run_parity(cfg, out)
    microbench_stage.run_microbench(cfg, out, {"peaks": {"gemm_flops_per_s": {"float32": 1e11},
                                                         "copy_bytes_per_s": 1e10}})
    returned = bench_train_stage.run_bench_train(cfg, out)
    for kind, entry in ((KernelRecord, KernelPath), (ParityRecord, ParityPath), (MicrobenchRecord, MicrobenchPath)):
        text = (out / kind.FILE).read_text()
        record = kind.read(out / kind.FILE)
        assert len(record.paths) > 1 and all(isinstance(p, entry) for p in record.paths.values())
        again = tmp_path / kind.FILE
        record.write(again)
        assert again.read_text() == text
    micro = MicrobenchRecord.read(out / MicrobenchRecord.FILE).paths
    assert micro["reference"].valid and micro["reference"].median_ms > 0
    assert isinstance(micro["torch"].forward_backward, ForwardBackward)
    assert micro["torch"].forward_backward.median_ms > 0 and micro["torch"].forward_backward.speedup_vs_reference
    text = (out / BenchTrainRecord.FILE).read_text()
    trained = BenchTrainRecord.read(out / BenchTrainRecord.FILE)
    assert set(trained.impls) == {"reference", "torch", "triton"}
    assert all(isinstance(v, TrainImpl) for v in trained.impls.values())
    assert trained.impls["triton"].timing_valid is False and trained.impls["reference"].losses
    trained.write(tmp_path / BenchTrainRecord.FILE)
    assert (tmp_path / BenchTrainRecord.FILE).read_text() == text
    assert trained.to_dict() == {"schema_version": BenchTrainRecord.SCHEMA_VERSION, **returned}
    assert isinstance(trained.amdahl, Amdahl) and set(trained.amdahl.variants) == {"torch", "triton"}
    assert trained.amdahl.variants["torch"].valid and not trained.amdahl.variants["triton"].valid
