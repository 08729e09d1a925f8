"""The clocks cswap-tune and benchmarks/overhead.py time the training thread with."""

import gc
import time

import pytest

from cswap.tune.host_cost import GcClock, young_collections_only


def test_steps_are_timed_without_the_collectors_pauses_which_are_counted_apart():
    """The collector's pauses are counted apart (GcClock.seconds) and left out of the step
    times (its `outside` clock stops while it collects), so neither a median hides them nor
    are they counted twice."""
    clock = GcClock()
    with clock.on():
        start_outside, start = clock.outside(), time.perf_counter()
        junk = [[i] for i in range(200_000)]
        for _ in range(3):
            gc.collect()
        outside, wall = clock.outside() - start_outside, time.perf_counter() - start
    del junk
    assert clock.seconds > 1e-3  # (three full collections of 200,000 lists)
    assert outside == pytest.approx(wall - clock.seconds, abs=1e-3)  # (1 ms: the clocks are read apart)
    assert clock not in gc.callbacks
    gc.collect()  # not counted once off
    assert clock.seconds == pytest.approx(wall - outside, abs=1e-3)
    assert clock.collections[2] >= 3 and sum(clock.seconds_by) == pytest.approx(clock.seconds)


def test_a_collection_counts_the_threads_cpu_time_not_time_the_scheduler_gave_others():
    """On a busy machine a collection can be preempted; the milliseconds other processes run
    then are not the collector's cost. Stood in for by a callback that sleeps inside the pause."""
    clock = GcClock()

    def preempted(phase, info):
        if phase == "start":
            time.sleep(0.3)

    with clock.on():
        gc.callbacks.append(preempted)  # after the clock's: it runs inside the timed pause
        try:
            start = time.perf_counter()
            gc.collect()
            wall = time.perf_counter() - start
        finally:
            gc.callbacks.remove(preempted)
    assert wall >= 0.3 and clock.collections[2] == 1
    assert 0 < clock.seconds < wall - 0.25  # the collection's own CPU time, without the 0.3 s asleep


def test_the_two_models_take_turns_step_by_step(monkeypatch):
    """Load on the machine comes and goes: timed in turns, each step of one model has one of
    the other beside it, rather than a round of steps that load may fall on alone."""
    import torch

    from cswap.tune import host_cost

    calls = []
    timed = host_cost.time_steps

    def spy(model, context, x, steps, clock=time.perf_counter):
        calls.append((id(model), steps))
        return timed(model, context, x, steps, clock)

    monkeypatch.setattr(host_cost, "time_steps", spy)
    host_cost._added_seconds(torch.device("cpu"), layers=4, width=8, batch=2, steps=3, rounds=2, warmup=1)
    (plain, _), (patched, _) = calls[:2]  # each model's warm-up
    assert plain != patched
    assert calls[2:] == [(plain, 1), (patched, 1)] * 6  # rounds x steps turns of one step each


def test_full_collections_are_off_while_timing_and_back_after():
    """When a full collection comes depends on every object in the process, so while
    cswap-tune and the overhead benchmark time steps only the young generations collect."""
    before = gc.get_threshold()
    with young_collections_only():
        during = gc.get_threshold()
        counts = GcClock()
        with counts.on():
            junk = [[[i]] for i in range(300_000)]  # promotes far more than a full collection waits for
        del junk
    assert during[:2] == before[:2] and during[2] >= 1 << 30
    assert counts.collections[0] > 0 and counts.collections[2] == 0
    assert gc.get_threshold() == before
