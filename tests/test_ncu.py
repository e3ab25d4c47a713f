"""Nsight Compute's measured counters beside the static ones (measure/ncu.py, lab/gpucheck.py). No GPU here: the
parser reads ncu's CSV as its manual lays it out, and the profiled child runs on the CPU (Triton's interpreter)."""

from __future__ import annotations

import json

import torch

from posttrainllm.lab import gpucheck
from posttrainllm.measure import ncu

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _line(launch: int, kernel: str, metric: str, unit: str, value: str) -> str:
    return (f'"{launch}","4242","python3","127.0.0.1","{kernel}","1","7","(128, 1, 1)","(64, 16, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


def _csv(launches: list[tuple[str, dict[str, tuple[str, str]]]]) -> str:
    lines = ["==PROF== Connected to process 4242 (/usr/bin/python3)", "profiled triton", HEADER]
    for launch, (kernel, metrics) in enumerate(launches):
        lines += [_line(launch, kernel, ncu.METRICS[key], unit, value) for key, (unit, value) in metrics.items()]
    return "\n".join(lines + ["==PROF== Disconnected from process 4242"])


def _launch(regs: str, occupancy: str, dram: str, duration: tuple[str, str]):
    return {"ncu_registers": ("register/thread", regs), "ncu_achieved_occupancy_pct": ("%", occupancy),
            "ncu_dram_throughput_pct": ("%", dram), "ncu_duration_us": duration}


def test_ncu_csv_is_read_per_launch_and_each_kernels_median_goes_beside_its_static_row():
    text = _csv([("_attn_fwd_kernel", _launch("192", "12.31", "40.5", ("usecond", "1,250.5"))),
                 ("_attn_fwd_kernel", _launch("192", "12.35", "n/a", ("nsecond", "1,249,500"))),
                 ("_attn_fwd_kernel", _launch("192", "12.40", "41.5", ("msecond", "1.3"))),
                 ("_attn_bwd_dq", _launch("174", "11", "30", ("usecond", "900")))])
    launches = ncu.parse(text)
    assert [launch["kernel"] for launch in launches] == ["_attn_fwd_kernel"] * 3 + ["_attn_bwd_dq"]
    assert launches[0]["ncu_duration_us"] == 1250.5 and launches[1]["ncu_duration_us"] == 1249.5  # separators, units
    assert launches[1]["ncu_dram_throughput_pct"] is None  # "n/a": no value, not zero
    measured = ncu.per_kernel(launches)
    assert measured["_attn_fwd_kernel"] == {"ncu_launches": 3, "ncu_registers": 192.0,
                                            "ncu_achieved_occupancy_pct": 12.35, "ncu_dram_throughput_pct": 41.0,
                                            "ncu_duration_us": 1250.5}
    rows = [{"kernel": "_attn_fwd_kernel", "registers": 192}, {"kernel": "_attn_bwd_dkdv", "registers": 194}]
    merged = ncu.beside(rows, measured)
    assert merged[0]["ncu_registers"] == 192.0 and "ncu_registers" not in merged[1]  # ncu did not see dK/dV
    assert ncu.parse("==PROF== ERR_NVGPUCTRPERM - The user does not have permission") == []


def test_ncu_profiles_only_the_points_kernels_by_name():
    argv = ncu.command("/usr/local/cuda/bin/ncu", "out/ncu.csv", ["_attn_fwd_kernel", "_attn_bwd_dq",
                                                                   "_attn_fwd_kernel"], ["python3", "-m", "x"], 64)
    assert argv[argv.index("--kernel-name") + 1] == "regex:^(_attn_bwd_dq|_attn_fwd_kernel)"
    assert argv[argv.index("--metrics") + 1].split(",") == list(ncu.METRICS.values())
    assert argv[argv.index("--launch-count") + 1] == "64" and argv[-3:] == ["python3", "-m", "x"]


def test_without_ncu_the_check_says_so_and_keeps_the_static_counters(tmp_path, monkeypatch):
    monkeypatch.setattr(ncu, "find", lambda: None)
    (tmp_path / "p").mkdir()
    rows = [{"kernel": "_attn_fwd_kernel", "registers": 192}]
    (tmp_path / "p" / "counters.json").write_text(json.dumps({"rows": rows}))
    assert gpucheck.measured_counters(tmp_path, "gpu_check", "p", rows) == ncu.NOT_FOUND
    assert gpucheck.measured_counters(tmp_path, "gpu_check", "p", []) == "ncu: no Triton kernel to profile"
    assert json.loads((tmp_path / "p" / "counters.json").read_text())["rows"] == rows


def test_the_profiled_child_runs_each_triton_path_once_forward_and_backward(tmp_path, capsys):
    """What ncu would profile: the point's Triton path called once at its main case, its backward too (here on the
    CPU, through the interpreter); PyTorch's own paths are not run."""
    from triton.runtime.interpreter import InterpretedFunction

    launched = []
    run = InterpretedFunction.run

    def counting(self, *args, **kwargs):
        launched.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    InterpretedFunction.run = counting
    threads = torch.get_num_threads()  # the child sets the point's thread count: this test process keeps its own
    try:
        assert gpucheck.main([str(tmp_path), "--sweep", "smoke", "--profile-point", "baseline"]) == 0
    finally:
        InterpretedFunction.run = run
        torch.set_num_threads(threads)
    assert capsys.readouterr().out.splitlines() == ["profiled triton"]
    assert launched == ["_attn_fwd_kernel", "_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq"], launched
