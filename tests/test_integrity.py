"""A receipt combines what its stages wrote, or it says it does not (rule "integrity", posttrainllm/rules.py).

A user path's worker runs as the lab's own user and can rewrite any file it finds: parity.json after the parity
stage judged it, or runs/calibration.json whose peaks decide which speeds are possible. Each stage's stamp hashes
the files it wrote; the inputs stage hashes the calibration before any point stage runs; the receipt checks both,
and the contract parity judged by against the config's.
"""

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from posttrainllm import rules
from posttrainllm.measure.roofline import CLASSIFICATION
from posttrainllm.measure.timing import NOISY
from posttrainllm.lab import pipeline
from posttrainllm.lab.stages import common as stage_common, microbench as microbench_stage
from posttrainllm.lab.configure import load
from posttrainllm.track import receipt, records, stamp
from posttrainllm.track.stamp import file_sha256

POINT = "baseline"


def test_each_point_stage_hashes_exactly_the_files_dvc_declares_as_its_outputs():
    dvc = yaml.safe_load((Path(__file__).parents[1] / "dvc.yaml").read_text())
    for name in pipeline.POINT_STAGES:
        outs = [next(iter(o)) if isinstance(o, dict) else o for o in dvc["stages"][name]["do"]["outs"]]
        written = sorted(Path(o).name for o in outs if "/stamps/" not in o and o.startswith("runs/${key}/"))
        if name == "receipt":  # it checks the others; nothing comes after it
            assert name not in pipeline.STAGE_OUTPUTS
            continue
        assert sorted(pipeline.STAGE_OUTPUTS[name]) == written, name


@pytest.fixture
def planned(tmp_path, monkeypatch):
    """The smoke sweep planned in a working directory, its baseline with a parity stage stamped as DVC leaves it."""
    from posttrainllm import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["sweep", "sweep=smoke"]) == 0
    cfg, _ = pipeline.load_point(POINT)
    folder = tmp_path / "runs" / POINT
    folder.mkdir(parents=True)
    records.ParityRecord(verdict="pass", precision="fp32", contract=json.loads(json.dumps(
        asdict(cfg.precision.contract))), lse_contract=None, paths={}, rule="parity_contract", backward_rule="backward",
        cases=[], notes=[],
        invariance={}, first_failure=None, headline="").write(folder / "parity.json")
    timed = {"valid": True, "noisy": False, "memory": {"peak_bytes": 64}, "p20_ms": 1.0, "p80_ms": 2.0, "min_ms": 1.0,
             "cv": 0.1, "iqr_ms": 0.5, "threads": 1, "flushed": False, "batched": False, "batch_size": 1, "reps": 5,
             "gflops_per_s": 1.0, "gbytes_per_s": 1.0, "costs": {}, "backward": "none",
             "forward_backward": {"valid": False, "reason": "forward-only"}}  # a timed entry's figures
    records.MicrobenchRecord(
        paths={"reference": records.MicrobenchPath(**timed, median_ms=2.0),
               "sdpa": records.MicrobenchPath(**timed, median_ms=1.0)}, device="cpu", threads=1,
        case="main", problem="", flops=1.0, bytes=1.0, train_flops=3.0, flops_formula="", bytes_formula="",
        backward_formula="", noisy_rule=NOISY, band_rule="band", roofline_rule=CLASSIFICATION, peaks={},
        timed_result_rule="timed_result", impossible_rule=rules.cite("impossible", fraction=0.5),
        rotation_rule=rules.cite("rotation", n=4, seed_step=7919), state_rule="torch_state", calibration={},
        above_roof_rule="above_roof", last_level_cache_bytes=None, cost_model_rule="cost_model", curve={}).write(folder / "microbench.json")
    made = stamp.stage_stamp("parity", POINT, {"device": "cpu"}, [], outputs=(folder / "parity.json",))
    stamp.write_stamp(folder, made)
    return cfg, folder


def test_a_receipt_of_untouched_files_finds_nothing(planned):
    cfg, folder = planned
    built = receipt.build(cfg)
    assert built["stamps"]["parity"]["outputs"] == {"parity.json": file_sha256(folder / "parity.json")}
    assert built["integrity"]["problems"] == []
    assert built["microbench"]["paths"]["sdpa"]["valid"] is True


def test_a_report_rewritten_after_its_stage_fails_the_receipt_and_takes_every_speed(planned):
    cfg, folder = planned
    report = json.loads((folder / "parity.json").read_text())
    (folder / "parity.json").write_text(json.dumps({**report, "verdict": "pass", "notes": ["rewritten"]}))
    built = receipt.build(cfg)
    problems = built["integrity"]["problems"]
    assert len(problems) == 1 and problems[0].startswith("parity.json changed since the parity stage wrote it")
    assert receipt.verdict(built) == "fail"
    for entry in built["microbench"]["paths"].values():
        assert entry["valid"] is False and "parity.json changed since the parity stage" in entry["reason"]


def test_a_contract_that_is_not_the_configs_is_named(planned):
    cfg, folder = planned
    report = json.loads((folder / "parity.json").read_text())
    report["contract"]["atol"] = 1.0  # raised after the fact: what parity judged by is not what the config says
    (folder / "parity.json").write_text(json.dumps(report))
    stamp.write_stamp(folder, stamp.stage_stamp("parity", POINT, {"device": "cpu"}, [],
                                                outputs=(folder / "parity.json",)))
    built = receipt.build(cfg)
    assert built["integrity"]["problems"] == [
        "parity judged by another contract than the config's (differs in atol)"]
    assert receipt.verdict(built) == "fail"


def test_a_calibration_rewritten_after_the_calibrate_stage_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    written = {"peaks": {"gemm_flops_per_s": {"float32": 5e10}, "copy_bytes_per_s": 2e10}}
    pipeline.CALIBRATION.parent.mkdir(parents=True)
    pipeline.CALIBRATION.write_text(json.dumps(written))
    inputs = pipeline.INPUTS / POINT / "microbench.json"
    inputs.parent.mkdir(parents=True)
    inputs.write_text(json.dumps({"reads": {"runs/calibration.json": file_sha256(pipeline.CALIBRATION)}}))
    read, problem = pipeline.calibration(POINT)
    assert problem is None and read["peaks"] == written["peaks"]
    pipeline.CALIBRATION.write_text(json.dumps({**written, "peaks": {**written["peaks"],
                                                                     "gemm_flops_per_s": {"float32": 5e15}}}))
    read, problem = pipeline.calibration(POINT)
    assert problem.startswith("runs/calibration.json is not what the calibrate stage wrote (sha256 ")
    inputs.unlink()  # a stage script run by hand, without the inputs stage: nothing to check against
    assert pipeline.calibration(POINT)[1] is None


def test_no_path_but_the_reference_is_timed_against_a_rewritten_calibration(tmp_path):
    from conftest import parity_report

    # the torch peer: a path that would be timed (our Triton one is interpreted here: never timed, so not asserted)
    cfg = load(["op=rmsnorm", "device=cpu", "parity.seeds=[0]", "bench.reps=3", "bench.min_time_s=0",
                "bench.warmup=1", "shape.curve=[16,32]", "shape.seq_len=16", "shape.edge_seq_lens=[37]",
                "op.only=[torch]"])
    parity_report(cfg, tmp_path)
    calibration = {"peaks": {"gemm_flops_per_s": {"float32": 1e11}, "copy_bytes_per_s": 1e10}, "sha256": "ab" * 32}
    micro = microbench_stage.run_microbench(cfg, tmp_path, calibration, "runs/calibration.json is not what the calibrate "
                                                              "stage wrote")
    assert micro["calibration"]["problem"].startswith("runs/calibration.json is not")
    assert micro["paths"]["reference"]["valid"] is True
    timed = {name: entry for name, entry in micro["paths"].items()  # Triton here is interpreted: never timed
             if name != "reference" and stage_common.INTERPRETER_NOT_SPEED not in entry.get("reason", "")}
    assert timed and all(not e["valid"] and "calibrate stage wrote: its peaks" in e["reason"] for e in timed.values())
