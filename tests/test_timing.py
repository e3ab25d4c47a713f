"""timing: the method (flush placement, rep counting, statistics, the noisy rule) on synthetic inputs."""

import pytest
import torch

from posttrainllm.measure import timing
from posttrainllm.measure.timing import NOISY_SPREAD, measure, summarize


class FakeClock:
    """A seconds clock that the timed function advances by a known amount; logs every read."""

    def __init__(self, log: list[str]):
        self.now, self.log = 0.0, log

    def __call__(self) -> float:
        self.log.append("clock")
        return self.now


def test_flush_runs_once_before_every_timed_rep_and_outside_the_timed_region():
    log: list[str] = []
    clock = FakeClock(log)
    durations = iter([0.002, 0.001, 0.003, 0.004, 0.005, 0.006, 0.007])

    def fn():
        log.append("fn")
        clock.now += next(durations, 0.001)

    def flush():
        log.append("flush")
        clock.now += 100.0  # a flush that took long would show up in the samples if it were timed

    t = measure(fn, device="cpu", warmup=2, reps=4, min_time_s=0.0, max_reps=10, flush=flush, clock=clock)
    assert log[:2] == ["fn", "fn"]  # warmup: no flush, no clock
    assert log[2:] == ["flush", "clock", "fn", "clock"] * 4
    assert t.samples_ms == pytest.approx([3.0, 4.0, 5.0, 6.0])  # the warmup durations (2, 1 ms) are not samples
    assert t.flushed and t.median_ms == pytest.approx(4.5)


def test_no_flush_on_cpu_by_default_and_explicit_none():
    assert timing.l2_flush("cpu") is None
    t = measure(lambda: None, device="cpu", warmup=0, reps=3, min_time_s=0.0, max_reps=3)
    assert not t.flushed
    t = measure(lambda: None, device="cpu", warmup=0, reps=3, min_time_s=0.0, max_reps=3, flush=None)
    assert not t.flushed and len(t.samples_ms) == 3


def test_sync_brackets_each_wall_clock_sample():
    log: list[str] = []
    clock = FakeClock(log)

    def fn():
        log.append("fn")
        clock.now += 0.001

    measure(fn, device="cpu", warmup=1, reps=2, min_time_s=0.0, max_reps=2, flush=lambda: log.append("flush"),
            clock=clock, sync=lambda: log.append("sync"))
    assert log == ["fn", "sync"] + ["flush", "sync", "clock", "fn", "sync", "clock"] * 2


def test_reps_extend_until_min_time_and_stop_at_max_reps():
    log: list[str] = []
    clock = FakeClock(log)

    def fn():
        clock.now += 0.010  # 10 ms per call

    t = measure(fn, device="cpu", warmup=0, reps=2, min_time_s=0.05, max_reps=100, clock=clock)
    assert len(t.samples_ms) == 5  # 5 x 10 ms reaches 50 ms
    t = measure(fn, device="cpu", warmup=0, reps=2, min_time_s=10.0, max_reps=7, clock=clock)
    assert len(t.samples_ms) == 7


def test_summary_statistics_on_known_samples():
    t = summarize([float(x) for x in range(1, 11)], threads=3)  # 1..10 ms
    assert t.median_ms == 5.5 and t.min_ms == 1.0
    assert t.p20_ms == pytest.approx(2.8) and t.p80_ms == pytest.approx(8.2)  # numpy's linear quantiles
    assert t.iqr_ms == pytest.approx(7.75 - 3.25)
    s = t.summary()
    assert s["reps"] == 10 and s["threads"] == 3 and "samples_ms" not in s
    assert {"median_ms", "p20_ms", "p80_ms", "min_ms", "cv", "iqr_ms", "noisy", "flushed"} <= set(s)


def test_measure_records_the_thread_count():
    t = measure(lambda: None, device="cpu", warmup=0, reps=3, min_time_s=0.0, max_reps=3)
    assert t.threads == torch.get_num_threads()


def test_noisy_rule():
    tight = [10.0] * 8 + [10.5, 10.2]
    assert not summarize(tight).noisy
    # One huge outlier moves the CV, not the median or the p20-p80 band: still comparable.
    assert not summarize(tight + [500.0]).noisy
    # A wide middle band is noisy: p80 - p20 = 0.3 x median here.
    wide = [8.0, 8.0, 8.5, 8.5, 10.0, 10.0, 11.5, 11.5, 12.0, 12.0]
    t = summarize(wide)
    assert (t.p80_ms - t.p20_ms) / t.median_ms > NOISY_SPREAD and t.noisy
    # Too few samples to know the spread.
    assert summarize([1.0, 1.0]).noisy


def test_noisy_boundary():
    # p20 = 9, p80 = 11 exactly on a median of 10: spread 0.20 is not above the limit.
    t = summarize([9.0, 9.0, 10.0, 11.0, 11.0, 9.0, 9.0, 10.0, 11.0, 11.0, 10.0])
    assert (t.p80_ms - t.p20_ms) / t.median_ms == pytest.approx(NOISY_SPREAD)
    assert not t.noisy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_default_flushes_l2_and_uses_events():
    a = torch.randn(256, 256, device="cuda")
    t = measure(lambda: a @ a, device="cuda", warmup=2, reps=5, min_time_s=0.0, max_reps=5)
    assert t.flushed and len(t.samples_ms) == 5 and t.median_ms > 0
    calls: list[str] = []
    measure(lambda: a @ a, device="cuda", warmup=0, reps=3, min_time_s=0.0, max_reps=3,
            flush=lambda: calls.append("flush"))
    assert calls == ["flush"] * 3


def test_work_on_another_stream_is_named_from_the_synchronised_wall_clock():
    from posttrainllm.measure.timing import other_streams

    events = [1.0, 1.1, 0.9, 1.0, 1.05]
    assert other_streams(events, [1.08, 1.15, 1.0, 1.1, 1.12]) is None  # the synchronisation's own cost
    side = other_streams(events, [3.0, 3.1, 2.9, 3.0, 3.2])  # the call's real work ran on a side stream
    assert side.startswith("work outside the timed stream") and "3 ms" in side
    assert other_streams([0.004] * 5, [0.03] * 5) is None  # a tiny kernel: under the absolute slack
    assert other_streams(events, []) is None  # no wall clock (the CPU)
