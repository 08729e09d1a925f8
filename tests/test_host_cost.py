"""The clocks cswap-tune and benchmarks/overhead.py time the training thread with."""

import gc
import time

import pytest

from cswap.tune.host_cost import GcClock


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
    assert outside == pytest.approx(wall - clock.seconds, abs=1e-4)
    assert clock not in gc.callbacks
    gc.collect()  # not counted once off
    assert clock.seconds == pytest.approx(wall - outside, abs=1e-4)
    assert clock.collections[2] >= 3 and sum(clock.seconds_by) == pytest.approx(clock.seconds)
