"""The stages' typed records (track/records.py): one writer, one reader, a schema version checked on every read."""

import json

import pytest

from posttrainllm.config import ConfigError
from posttrainllm.lab.configure import load
from posttrainllm.lab.stages import kernel as kernel_stage, parity as parity_stage, reference as reference_stage
from posttrainllm.track import records
from posttrainllm.track.records import (BenchTrainRecord, KernelRecord, ParityRecord, RecordError,
                                        ReferenceRecord)

SMALL = ["op=rmsnorm", "device=cpu", "parity.seeds=[0]", "shape.seq_len=16", "shape.edge_seq_lens=[]",
         "op.only=[torch]"]


def _kernel(**changes):
    return KernelRecord(**{"device": "cpu", "triton_interpreted": False, "paths": {"a": {"kind": "torch"}},
                           **changes})


def test_a_record_round_trips_with_its_version_and_leaves_out_optional_nones(tmp_path):
    path = tmp_path / "kernel.json"
    _kernel().write(path)
    written = json.loads(path.read_text())
    assert written == {"schema_version": KernelRecord.SCHEMA_VERSION, "device": "cpu", "triton_interpreted": False,
                       "paths": {"a": {"kind": "torch"}}}  # no compile, no library_replaced: the stage had none
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
