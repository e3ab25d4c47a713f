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


# --- rule batch_mean: the statistic every compared path is read by --------------------------------------------------

def test_batched_samples_are_batch_means_sized_from_the_last_warmup():
    """N comes from the last warm-up call (BATCHES_MIN batches fill min_time_s); a sample is one batch's mean per
    call, so a slow call in every batch moves the figure, where a median of single calls drops it."""
    log: list[str] = []
    clock = FakeClock(log)
    k = [0]

    def fn():
        k[0] += 1
        clock.now += 0.011 if k[0] % 10 == 0 else 0.001  # every tenth call 11 ms, the others 1 ms

    # min_time_s 0.05 over 5 batches: 10 ms a batch, at the last warm-up's 1 ms: N = 10
    t = measure(fn, device="cpu", warmup=2, reps=1, min_time_s=0.05, max_reps=200, clock=clock, batched=True,
                run_queue=None)
    assert t.batched and t.batch_size == 10
    assert len(t.samples_ms) == timing.BATCHES_MIN  # reps=1 is met, the batches are not
    assert t.median_ms == pytest.approx(2.0)  # (9 x 1 + 11) / 10 ms
    singles = measure(fn, device="cpu", warmup=2, reps=50, min_time_s=0.0, max_reps=50, clock=clock)
    assert singles.median_ms == pytest.approx(1.0)  # the statistic the outside timing could not match
    assert t.summary()["timing_rule"] == timing.BATCH_MEAN and "timing_rule" not in singles.summary()


def test_batched_cpu_batch_is_one_span_less_its_run_queue_wait():
    log: list[str] = []
    clock = FakeClock(log)
    readings = iter([(0, 0), (2_000_000, 3_000_000)] * 100)  # per batch: ran 2 ms, waited 3 ms (ns)

    def fn():
        log.append("fn")
        clock.now += 0.001

    def slow_batch_fn():  # every call waits 0.3 ms on a run queue: 10 calls, 3 ms of a 13 ms span
        clock.now += 0.0003
        fn()

    t = measure(slow_batch_fn, device="cpu", warmup=1, reps=1, min_time_s=0.0, max_reps=200, clock=clock,
                batched=True, run_queue=lambda: next(readings))
    assert t.batch_size == 1 and len(t.samples_ms) == timing.BATCHES_MIN  # min_time_s 0: a batch of one
    # one span per batch: clock, the calls, clock; less the wait, capped at the span less what ran (1.3 - 2 < 0)
    assert t.samples_ms == pytest.approx([1.3] * timing.BATCHES_MIN)
    log.clear()
    readings = iter([(0, 0), (10_000_000, 3_000_000)] * 100)  # ran 10 ms of a 13 ms span, waited 3 ms
    k = [0]

    def ten_ms():
        k[0] += 1
        clock.now += 0.013 if k[0] > 1 else 0.001  # the warm-up 1 ms: N = ceil(0.05 / 5 / 0.001) = 10

    t = measure(ten_ms, device="cpu", warmup=1, reps=1, min_time_s=0.05, max_reps=200, clock=clock, batched=True,
                run_queue=lambda: next(readings))
    assert t.batch_size == 10
    assert t.samples_ms[0] == pytest.approx((130.0 - 3.0) / 10)  # the 3 ms waited is out of the span
    assert t.run_queue_share == pytest.approx(3.0 / 130.0)


def test_batch_size_bounds():
    assert timing.batch_size(0.001, min_time_s=0.2, max_reps=200) == 40  # wants 40 ms / 1 ms = 40
    assert timing.batch_size(1e-6, min_time_s=0.2, max_reps=1000) == timing.BATCH_MAX  # capped
    assert timing.batch_size(1e-6, min_time_s=0.2, max_reps=200) == 40  # 5 batches within max_reps
    assert timing.batch_size(1.0, min_time_s=0.2, max_reps=200) == 1  # a slow call: batches of one
    assert timing.batch_size(1e-6, min_time_s=0.2, max_reps=3) == 1  # too few reps for 5 batches


def test_batched_never_exceeds_max_reps_and_unbatched_is_unchanged():
    log: list[str] = []
    clock = FakeClock(log)

    def fn():
        clock.now += 0.001

    t = measure(fn, device="cpu", warmup=1, reps=1, min_time_s=10.0, max_reps=23, clock=clock, batched=True,
                run_queue=None)
    assert t.batch_size * len(t.samples_ms) <= 23 and t.batch_size == 4  # 23 // 5
    plain = measure(fn, device="cpu", warmup=1, reps=1, min_time_s=10.0, max_reps=23, clock=clock)
    assert len(plain.samples_ms) == 23 and plain.batch_size == 1 and not plain.batched


def test_batched_cuda_style_keeps_the_flush_outside_each_call():
    """With a flush (CUDA), each call is timed on its own with the flush outside it; the sample is their mean."""
    log: list[str] = []
    clock = FakeClock(log)

    def fn():
        log.append("fn")
        clock.now += 0.002

    def flush():
        log.append("flush")
        clock.now += 1.0

    t = measure(fn, device="cpu", warmup=1, reps=1, min_time_s=0.02, max_reps=200, flush=flush, clock=clock,
                batched=True)
    assert t.batch_size == 2 and t.samples_ms == pytest.approx([2.0] * len(t.samples_ms))
    assert log.count("flush") == log.count("fn") - 1  # every timed call, not the warm-up
