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
