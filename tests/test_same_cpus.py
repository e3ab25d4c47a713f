"""Rule same_cpus (measure/device.py same_cpus): a timed stage runs on fixed CPUs, restored after, and the
workers of user paths run on the same ones."""

import os

import pytest

from posttrainllm.lab.isolation import worker as workers
from posttrainllm.lab.stages.common import on_same_cpus
from posttrainllm.measure import device as devices
from posttrainllm.lab.configure import load

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to pin")


def test_a_timed_stage_runs_on_one_cpu_and_gives_the_others_back():
    before = os.sched_getaffinity(0)
    with devices.same_cpus(1) as cpus:
        assert len(cpus) == 1 and cpus <= before
        assert os.sched_getaffinity(0) == cpus
        assert devices.affinities(os.getpid()) == {frozenset(cpus)}  # every thread, not the main one alone
    assert os.sched_getaffinity(0) == before


def test_nothing_is_pinned_at_every_cpu_or_torchs_default():
    before = os.sched_getaffinity(0)
    for threads in (0, len(before)):
        with devices.same_cpus(threads) as cpus:
            assert cpus is None and os.sched_getaffinity(0) == before


def test_the_affinity_is_restored_when_the_stage_raises():
    before = os.sched_getaffinity(0)
    with pytest.raises(RuntimeError):
        with devices.same_cpus(1):
            raise RuntimeError("a stage that fails")
    assert os.sched_getaffinity(0) == before


def test_a_worker_started_in_a_timed_stage_runs_on_its_cpus():
    workers.close_all()
    try:
        with devices.same_cpus(1) as cpus:
            twin = workers.twin()
            assert devices.affinities(twin.pid) == {frozenset(cpus)}
    finally:
        workers.close_all()


def test_the_stage_decorator_pins_for_the_stage_and_reads_bench_threads():
    cfg = load(["device=cpu", "bench.threads=1", "run.log_mlflow=false"])
    seen = []
    stage = on_same_cpus(lambda cfg, out: seen.append(os.sched_getaffinity(0)) or "done")
    before = os.sched_getaffinity(0)
    assert stage(cfg, None) == "done"
    assert len(seen[0]) == 1 and os.sched_getaffinity(0) == before
