"""The emulated asynchronous device itself (cswap.runtime.emulator): what it promises
about copies, events, the allocator and races, checked directly."""

from __future__ import annotations

import gc
import math
import threading
import time

import pytest
import torch

from cswap.runtime.emulator import POISON, EmulatedDevice


@pytest.fixture
def dev():
    device = EmulatedDevice(bandwidth_gbps=0.001)  # 1 MB/s: 4000 bytes take 4 ms
    yield device
    device.close()


def _saved(dev, n=1000):
    """A tensor autograd saved: written by compute, with the event that says so."""
    x = torch.arange(n, dtype=torch.float32)
    dev.on_saved(x)
    return x, dev.record_event(dev.compute_stream())


def test_a_copy_lands_bytes_over_bandwidth_after_it_starts(dev):
    x, ready = _saved(dev)
    d2h = dev.side_stream("d2h")
    host = dev.host_empty(4000, pinned=True)
    dev.wait_event(d2h, ready, at="offload.copy_after_ready")
    start = time.perf_counter()
    dev.copy(host, x.view(torch.uint8), d2h)
    done = dev.record_event(d2h)
    assert not done.query() and host[:4].tolist() == [POISON] * 4  # not there yet
    dev.event_synchronize(done, at="release.copy_done")
    assert time.perf_counter() - start >= 0.004
    assert torch.equal(host.view(torch.float32), x)
    (name, nbytes, began, ended), = dev.copies
    assert (name, nbytes) == ("d2h", 4000) and ended - began >= 0.004
    assert dev.hazards == []


def test_jitter_is_seeded(dev):
    def durations(seed):
        d = EmulatedDevice(bandwidth_gbps=1e3, jitter=0.003, seed=seed)
        s = d.side_stream("h2d")
        for _ in range(4):
            d.copy(d.host_empty(8, False), torch.zeros(8, dtype=torch.uint8), s)
        d.synchronize()
        d.close()
        return [round(end - start, 3) for _, _, start, end in d.copies]

    first = durations(1)
    assert max(first) > 0.0005 and len(set(first)) > 1
    assert durations(2) != first


def test_a_copy_without_its_wait_is_a_hazard_and_poisons(dev):
    x, _ = _saved(dev)  # no wait for the event: the copy may read x before compute wrote it
    d2h = dev.side_stream("d2h")
    host = dev.host_empty(4000, pinned=True)
    dev.copy(host, x.view(torch.uint8), d2h)
    dev.synchronize()
    assert len(dev.hazards) == 1 and "compute wrote" in dev.hazards[0]
    assert host[:4].tolist() == [POISON] * 4


def test_compute_reading_before_its_wait_is_a_hazard(dev):
    h2d = dev.side_stream("h2d")
    host = dev.host_empty(4000, pinned=True)
    y = dev.empty(4000, dev.compute_stream())
    dev.copy(y, host, h2d)
    dev.on_use(y)  # no wait: compute reads y while the copy into it is still pending
    dev.synchronize()
    assert len(dev.hazards) == 1 and "compute read" in dev.hazards[0]
    assert y[:4].tolist() == [POISON] * 4  # what compute may have read is garbage, as on a GPU
    dev.hazards.clear()
    y2 = dev.empty(4000, dev.compute_stream())
    dev.wait_stream(h2d, dev.compute_stream(), at="restore.decode_after_copy_in")
    dev.copy(y2, host, h2d)
    dev.wait_event(dev.compute_stream(), dev.record_event(h2d), at="unpack.compute_after_copy_in")
    dev.on_use(y2)
    assert dev.hazards == []
    # (once the host has synchronized with the copy, compute work issued after it is ordered too)


def test_freeing_memory_under_a_pending_copy_is_a_hazard_unless_recorded(dev):
    h2d = dev.side_stream("h2d")
    gate = threading.Event()
    dev.launch(h2d, lambda: gate.wait(5))  # keeps the copy below pending
    host = dev.host_empty(4000, pinned=True)
    y = dev.empty(4000, dev.compute_stream())
    dev.wait_stream(h2d, dev.compute_stream(), at="restore.decode_after_copy_in")
    dev.copy(y, host, h2d)
    del y
    gc.collect()
    assert any("freed while work on h2d" in h for h in dev.hazards)
    gate.set()
    dev.synchronize()
    dev.hazards.clear()
    gate.clear()
    dev.launch(h2d, lambda: gate.wait(5))
    z = dev.empty(4000, dev.compute_stream())
    dev.wait_stream(h2d, dev.compute_stream(), at="restore.decode_after_copy_in")
    dev.copy(z, host, h2d)
    dev.record_stream(z, h2d, at="restore.record_restored")
    del z
    gc.collect()
    gate.set()
    dev.synchronize()
    assert dev.hazards == []


def test_compute_runs_behind_the_host_by_its_lag():
    """Issue 26 §7: a GPU's compute stream runs behind the host that queues its kernels.
    An event recorded on compute completes compute_lag_s later; side-stream work after it
    starts only then, and synchronize() waits for compute too."""
    lag = 0.2
    dev = EmulatedDevice(bandwidth_gbps=math.inf, compute_lag_s=lag)
    try:
        recorded = time.perf_counter()
        x, ready = _saved(dev)
        assert not ready.query()  # compute has not reached it yet
        d2h = dev.side_stream("d2h")
        host = dev.host_empty(4000, pinned=True)
        dev.wait_event(d2h, ready, at="offload.copy_after_ready")
        dev.copy(host, x.view(torch.uint8), d2h)
        done = dev.record_event(d2h)
        dev.event_synchronize(done, at="release.copy_done")
        assert time.perf_counter() - recorded >= lag and ready.query()
        (_, _, began, _), = dev.copies
        assert began - recorded >= lag  # the copy waited for compute, not only for the host
        assert torch.equal(host.view(torch.float32), x) and dev.hazards == []
        first = dev.record_event(dev.compute_stream(), timing=True)
        time.sleep(0.01)
        second = dev.record_event(dev.compute_stream(), timing=True)
        assert dev.elapsed_s(first, second) is None and not second.query()  # compute has not reached them
        dev.synchronize()  # waits for compute too
        assert second.query() and dev.elapsed_s(first, second) >= 0.01
    finally:
        dev.close()
    with pytest.raises(ValueError, match="compute_lag_s must be >= 0"):
        EmulatedDevice(compute_lag_s=-1)


def test_each_thread_has_its_own_current_stream_and_work_after_the_wrong_one_is_a_race(dev):
    """Issue 26 §7: torch.cuda.current_stream() is per thread. Inside dev.stream(s) the
    calling thread's compute_stream() is s and what autograd saves is s's write; another
    thread still sees the compute stream. A copy ordered after the compute stream instead
    of s reads what s wrote with nothing ordering the two."""
    s = dev.user_stream("mine")
    seen = {}
    with dev.stream(s):
        assert dev.compute_stream() is s
        worker = threading.Thread(target=lambda: seen.setdefault("other", dev.compute_stream()))
        worker.start()
        worker.join()
        x, ready_on_s = _saved(dev)
        wrong = dev.record_event(dev._compute)
    assert seen["other"] is dev._compute and dev.compute_stream() is dev._compute
    d2h = dev.side_stream("d2h")
    host = dev.host_empty(4000, pinned=True)
    dev.wait_event(d2h, wrong, at="offload.copy_after_ready")
    dev.copy(host, x.view(torch.uint8), d2h)
    dev.synchronize()
    assert len(dev.hazards) == 1 and "mine wrote" in dev.hazards[0]
    dev.hazards.clear()
    dev.wait_event(d2h, ready_on_s, at="offload.copy_after_ready")
    dev.copy(host, x.view(torch.uint8), d2h)
    dev.synchronize()
    assert dev.hazards == [] and torch.equal(host.view(torch.float32), x)
    with pytest.raises(ValueError, match="made by user_stream"):
        with dev.stream(d2h):
            pass
    with pytest.raises(ValueError, match="run on a side stream"):
        dev.copy(host, x.view(torch.uint8), s)


def test_live_and_peak_bytes_and_capacity():
    dev = EmulatedDevice(capacity_bytes=4096)
    x = torch.zeros(256)  # 1 KiB saved by autograd
    dev.on_saved(x)
    dev.on_saved(x[10:])  # the same storage again: counted once
    assert dev.live_bytes == 1024
    a = dev.empty(1000, dev.compute_stream())  # 1024 allocated
    assert dev.live_bytes == dev.peak_bytes == 2048
    with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
        dev.empty(3000, dev.compute_stream())
    del a, x
    gc.collect()
    assert dev.live_bytes == 0 and dev.peak_bytes == 2048
    dev.reset_peak()
    assert dev.peak_bytes == 0
    dev.close()


def test_device_work_is_charged_its_declared_scratch_while_it_runs():
    """Issue 26 §5: a codec's encoder allocates temporaries beside its output; the
    emulator counts them while the work runs, and fails the work as CUDA would when
    they do not fit."""
    dev = EmulatedDevice(capacity_bytes=8192)
    side = dev.side_stream("codec")
    seen = dev.call(side, lambda: dev.live_bytes, scratch_bytes=3000)
    assert seen == 3000 and dev.live_bytes == 0 and dev.peak_bytes == 3000
    with pytest.raises(torch.OutOfMemoryError, match="11192 bytes of scratch"):
        dev.call(side, lambda: None, scratch_bytes=3000 + 8192)
    assert dev.live_bytes == 0
    dev.close()


def test_pinned_memory_is_rounded_and_cached_until_emptied(dev):
    a = dev.host_empty(5000, pinned=True)
    assert a.numel() == 5000 and dev.pinned_bytes == 8192
    del a
    gc.collect()
    assert dev.pinned_bytes == 8192  # PyTorch's host allocator keeps freed blocks
    b = dev.host_empty(6000, pinned=True)  # and reuses them
    assert dev.pinned_bytes == 8192
    del b
    gc.collect()
    dev.empty_host_cache()
    assert dev.pinned_bytes == 0


def test_an_injected_failure_surfaces_at_the_next_synchronization(dev):
    d2h = dev.side_stream("d2h")
    dev.inject_failure("copy", RuntimeError("link down"))
    dev.copy(dev.host_empty(8, True), torch.zeros(8, dtype=torch.uint8), d2h)
    failed = dev.record_event(d2h)
    with pytest.raises(RuntimeError, match="link down"):
        dev.event_synchronize(failed, at="release.copy_done")
    later = dev.record_event(d2h)  # reported once: the stream goes on
    dev.event_synchronize(later, at="release.copy_done")


def test_a_copy_with_pageable_memory_blocks_the_host_and_reports_its_own_failure(dev):
    """As cudaMemcpyAsync from or to pageable memory: the host waits for the stream, the
    copy is done when the call returns, and its failure is raised by the call."""
    d2h = dev.side_stream("d2h")
    slow = EmulatedDevice(bandwidth_gbps=1e-3)  # 8 bytes take 8 us: long enough to be pending if queued
    host = slow.host_empty(8, False)
    slow.copy(host, torch.full((8,), 7, dtype=torch.uint8), slow.side_stream("d2h"))
    assert slow.host_syncs[threading.current_thread().name, "pageable copy"] == 1
    assert host.tolist() == [7] * 8  # (no host_access needed: the host waited for it)
    slow.close()
    dev.inject_failure("copy", RuntimeError("link down"))
    with pytest.raises(RuntimeError, match="link down"):
        dev.copy(dev.host_empty(8, False), torch.zeros(8, dtype=torch.uint8), d2h)
    dev.event_synchronize(dev.record_event(d2h), at="release.copy_done")  # reported once


def test_a_closed_device_refuses_work_with_a_clear_error(dev):
    d2h = dev.side_stream("d2h")
    dev.close()
    assert dev.record_event(d2h).query()  # nothing is pending any more
    with pytest.raises(RuntimeError, match="emulated device: the device is closed"):
        dev.copy(dev.host_empty(8, False), torch.zeros(8, dtype=torch.uint8), d2h)
