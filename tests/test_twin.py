"""The timed twin (cswap.runtime.twin): the emulated device on a GPU's virtual clock.

What it promises about time, checked on the seam directly (a copy takes latency plus
bytes over bandwidth, queued work starts when its stream and the events it waits for
allow, a waiting host jumps, a waiting compute stream does not hold the host), on the
model's compute (the roofline, scaled), and on a patched model end to end: its
gradients are stock autograd's, the copies overlap compute, and offloading costs what
the link says."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cswap
from cswap.runtime.device import Work
from cswap.runtime.twin import CALL_S, MODEL_OP_S, ComputeClock, MeasuredCodecs, TimedDevice, TwinSpec
from cswap.testing import timed_twin

MiB = 1 << 20


def _spec(**overrides) -> TwinSpec:
    """A round-numbered GPU: 1 GB/s each way, 1 ms of latency, codecs at 1 ms per MB, no host time."""
    fields = dict(d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9, link_latency_s=1e-3, host_scale=0.0,
                  codec_seconds=lambda codec, direction, nbytes, sparsity, itemsize=4: nbytes / 1e9)
    fields.update(overrides)
    return TwinSpec.measured(**fields)


@pytest.fixture
def dev():
    device = TimedDevice(_spec())
    yield device
    device.close()


def _calls(*names) -> float:
    return sum(CALL_S[name] for name in names)


def test_a_copy_takes_latency_plus_bytes_over_bandwidth_and_a_sync_waits_for_it(dev):
    d2h = dev.side_stream("d2h")
    x = torch.zeros(1_000_000, dtype=torch.uint8)
    host = dev.host_empty(x.numel(), pinned=True)
    start = dev.now()
    dev.copy(host, x, d2h)
    done = dev.record_event(d2h)
    assert done.at == pytest.approx(start + CALL_S["copy"] + 1e-3 + 1e-3)  # queued after the call's own cost
    assert not dev.event_query(done, at="release.copy_done")  # the host has not got there
    dev.event_synchronize(done, at="release.copy_done")
    assert dev.now() == pytest.approx(done.at)  # (the call's own cost passed while it waited)
    assert dev.event_query(done, at="release.copy_done")
    assert torch.equal(host, x)  # the data moved too


def test_work_on_a_stream_runs_in_order_after_the_events_it_waits_for(dev):
    compute, d2h, h2d = dev.compute_stream(), dev.side_stream("d2h"), dev.side_stream("h2d")
    dev.compute(0.010)  # compute is 10 ms behind the host
    ready = dev.record_event(compute)
    dev.wait_event(d2h, ready, at="offload.copy_after_ready")
    a, b = torch.zeros(2_000_000, dtype=torch.uint8), dev.host_empty(2_000_000, pinned=True)
    dev.copy(b, a, d2h)
    dev.copy(b, a, d2h)
    dev.copy(a[:1000], b[:1000], h2d)  # another stream: not behind d2h's copies
    spans = [s for s in dev.spans if s.what == "copy"]
    first, second, other = spans
    assert first.start == pytest.approx(ready.at) and ready.at >= 0.010
    assert second.start == pytest.approx(first.end)
    assert first.end - first.start == pytest.approx(1e-3 + 2e-3)
    assert other.start < first.end and other.stream == "h2d"


def test_a_copy_to_the_host_on_any_stream_waits_for_the_copy_engine(dev):
    """As on the H200: an encode's sizes, read back on the codec's stream, came back only
    once the tensor sent before them had crossed the link."""
    d2h, codec, h2d = dev.side_stream("d2h"), dev.side_stream("codec"), dev.side_stream("h2d")
    big, pinned = dev.empty(2_000_000, codec), dev.host_empty(2_000_000, pinned=True)
    sizes, slot = dev.empty(8, codec), dev.host_empty(8, pinned=True)
    dev.copy(pinned, big, d2h)
    dev.copy(slot, sizes, codec)        # the other stream's copy out queues behind the first
    dev.copy(big[:8], slot, h2d)        # a copy in takes the other engine
    send, readback, copy_in = [s for s in dev.spans if s.what == "copy"]
    assert readback.stream == "codec" and readback.start == pytest.approx(send.end)
    assert copy_in.start < send.end


def test_compute_waiting_for_a_copy_does_not_hold_the_host(dev):
    compute, h2d = dev.compute_stream(), dev.side_stream("h2d")
    x = torch.zeros(10_000_000, dtype=torch.uint8)  # 10 ms on the link
    y = dev.empty(x.numel(), compute)
    dev.copy(y, x, h2d)
    done = dev.record_event(h2d)
    before = dev.now()
    dev.wait_event(compute, done, at="unpack.compute_after_copy_in")
    assert dev.now() - before < 1e-4  # the host goes on
    dev.compute(0.001)
    after = dev.record_event(compute)
    assert after.at == pytest.approx(done.at + 0.001)  # compute ran after the copy


def test_device_work_takes_what_its_work_says_and_a_call_waits_for_it(dev):
    compress = dev.side_stream("codec")
    src = torch.zeros(1000, dtype=torch.float32)
    src[::2] = 1.0
    seen = []
    spec = _spec(codec_seconds=lambda codec, direction, nbytes, sparsity, itemsize=4:
                 seen.append((codec, direction, nbytes, sparsity, itemsize)) or 0.005)
    timed = TimedDevice(spec)
    try:
        before = timed.now()
        assert timed.call(timed.side_stream("codec"), lambda: 7, reads=[src],
                          work=Work("encode", "zvc", 4000, 4)) == 7
        assert timed.now() - before == pytest.approx(0.005 + _calls("stream", "launch", "sync"), abs=1e-6)
        assert seen == [("zvc", "compress", 4000, 0.5, 4)]  # sparsity read off the tensor
        timed.launch(timed.side_stream("h2d"), lambda: None, reads=[torch.zeros(1000, dtype=torch.uint8)],
                     work=Work("decode", "zvc", 4000, 4))
        assert seen[-1] == ("zvc", "decompress", 4000, 0.75, 4)  # from the payload's size
    finally:
        timed.close()
    unknown = dev.call(compress, lambda: None, work=None)  # no Work: no time on the device
    assert unknown is None and [s.end - s.start for s in dev.spans][-1] == 0.0


def test_timing_events_measure_virtual_time(dev):
    compute = dev.compute_stream()
    start = dev.record_event(compute, timing=True)
    dev.compute(0.004)
    end = dev.record_event(compute, timing=True)
    assert dev.elapsed_s(start, end) is None  # not complete yet on the host's clock
    dev.synchronize()
    assert dev.elapsed_s(start, end) == pytest.approx(0.004, abs=1e-6)


def test_host_time_counts_the_threads_own_work_not_the_emulators():
    timed = TimedDevice(_spec(host_scale=1.0))
    try:
        before = timed.now()
        total = 0
        for i in range(200_000):  # the host's own Python: counted
            total += i
        assert timed.now() - before > 1e-3
        d2h = timed.side_stream("d2h")
        cpu, before = time.thread_time(), timed.now()
        for _ in range(2000):  # the emulator's bookkeeping: only the calls' modelled costs
            timed.record_event(d2h)
        cpu, virtual = time.thread_time() - cpu, timed.now() - before
        assert 2000 * CALL_S["record"] <= virtual < 2000 * CALL_S["record"] + 0.3 * cpu
    finally:
        timed.close()


def test_calibrated_host_time_stands_for_a_host_of_one_speed(monkeypatch):
    """This CPU's speed swings: calibrate_host scales host time by the reference Python's
    time on the host the twin stands for over its time now, so the same work costs the same
    virtual time on a slow or a fast moment of this CPU."""
    import cswap.runtime.twin as twin

    timed = TimedDevice(_spec(host_scale=2.0))  # (a host twice as slow as the reference one)
    try:
        for now_s, scale in ((2 * twin.HOST_REFERENCE_S, 1.0), (twin.HOST_REFERENCE_S / 4, 8.0)):
            monkeypatch.setattr(twin, "host_reference_s", lambda: now_s)
            assert timed.calibrate_host() == pytest.approx(scale)
            assert timed.host_scale == pytest.approx(scale)
            before, cpu = timed.now(), time.thread_time()
            total = 0
            for i in range(200_000):  # the host's own Python
                total += i
            virtual, cpu = timed.now() - before, time.thread_time() - cpu
            assert virtual == pytest.approx(scale * cpu, rel=0.05, abs=50e-6)
    finally:
        timed.close()
    monkeypatch.undo()
    assert 0 < twin.host_reference_s() < 1.0  # (the reference itself: a few ms of this CPU)


def test_a_background_thread_acts_no_earlier_than_the_training_thread_reaches_its_time(dev):
    d2h = dev.side_stream("d2h")
    x = torch.zeros(5_000_000, dtype=torch.uint8)
    dev.copy(dev.host_empty(x.numel(), pinned=True), x, d2h)
    done = dev.record_event(d2h)
    order = []

    def releaser():
        dev.event_synchronize(done, at="release.copy_done")
        order.append(("released", dev.now()))

    thread = threading.Thread(target=releaser)
    thread.start()
    thread.join(0.05)
    assert thread.is_alive()  # held: the training thread is still before done.at
    order.append(("training thread", dev.now()))
    dev.compute(0.010)
    dev.synchronize()  # the training thread waits: the releaser goes
    thread.join(5)
    assert order[0][0] == "training thread" and order[1][1] >= done.at
    assert dev.held_too_long == 0


def test_measured_codecs_interpolate_in_size_and_sparsity():
    rows = [{"codec": "zvc", "itemsize": 4, "sparsity": s, "bytes": b, "compress_ms": ms, "decompress_ms": ms / 2}
            for s, points in ((0.2, ((1 * MiB, 0.1), (16 * MiB, 0.2), (256 * MiB, 1.2))),
                              (0.8, ((1 * MiB, 0.1), (16 * MiB, 0.1), (256 * MiB, 0.6))))
            for b, ms in points]
    codecs = MeasuredCodecs(rows)
    assert codecs.seconds("zvc", "compress", 1024, 0.2) == pytest.approx(0.1e-3)  # below: the fixed cost
    assert codecs.seconds("zvc", "compress", 136 * MiB, 0.2) == pytest.approx(0.7e-3)
    assert codecs.seconds("zvc", "compress", 496 * MiB, 0.2) == pytest.approx(2.2e-3)  # the last line, on
    assert codecs.seconds("zvc", "compress", 256 * MiB, 0.5) == pytest.approx(0.9e-3)
    assert codecs.seconds("zvc", "compress", 256 * MiB, 0.95) == pytest.approx(0.6e-3)  # clamped
    assert codecs.seconds("zvc", "decompress", 256 * MiB, 0.2, itemsize=2) == pytest.approx(0.6e-3)  # fp32's
    with pytest.raises(KeyError, match="lz4"):
        codecs.seconds("lz4", "compress", 1, 0.5)


def test_the_h200_table_says_what_was_measured_there():
    spec = TwinSpec.measured()
    assert spec.gpu.label == "NVIDIA H200 SXM 141GB"
    assert 54e9 < spec.d2h_bytes_per_s < 57e9 and 5e-6 < spec.link_latency_s < 12e-6
    # gpu-2026-12-04/codecs/codecs.csv: fp32, blocky, 80% zeros, 256 MiB, on the runtime's path (launch_ms)
    zvc = spec.codec_seconds("zvc", "compress", 256 * MiB, 0.8)
    assert zvc == pytest.approx(0.4679e-3, rel=1e-3)
    assert spec.codec_seconds("lz4", "compress", 256 * MiB, 0.8) > 20e-3  # LZ4's encoder: about 11 GB/s


def _mlp(width=256, depth=4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())],
                         nn.Linear(width, 10))


def _step_time(dev, model, x, y) -> float:
    dev.synchronize()
    start = dev.now()
    F.cross_entropy(model(x), y).backward()
    dev.synchronize()
    return dev.now() - start


def test_the_compute_clock_times_the_models_ops_at_the_roofline_and_scales_the_batch():
    from cswap.plan.roofline import LAUNCH_FLOOR_S

    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    times = {}
    for scale in (1, 10_000):
        model = _mlp()
        dev = TimedDevice(_spec(scale=scale))
        with ComputeClock(dev, model) as clock:
            times[scale] = _step_time(dev, model, x, y)
        dev.close()
        assert clock.ops > 10
        # the slower of the host, which launches each op, and compute, which runs them in a row
        assert times[scale] == pytest.approx(max(clock.ops * MODEL_OP_S, clock.seconds), rel=0.2)
        assert clock.seconds >= clock.ops * LAUNCH_FLOOR_S
    assert times[1] == pytest.approx(clock.ops * MODEL_OP_S, rel=0.2)  # tiny: the host is the bound
    assert times[10_000] > 5 * times[1]  # compute-bound at 10,000 times the batch


def test_a_patched_model_trains_exactly_on_the_twin_and_its_copies_overlap_compute():
    x, y = torch.randn(512, 256), torch.randint(0, 10, (512,))
    reference = _mlp()
    F.cross_entropy(reference(x), y).backward()
    steps = {}
    for mode in ("unpatched", "vdnn", "sc"):
        model = _mlp()
        spec = TwinSpec.measured(scale=1000, host_scale=0.0)
        with timed_twin(spec, model) as dev:
            if mode != "unpatched":
                cswap.patch(model, mode=mode, verbose=False, candidates="all", min_bytes=0)
            _step_time(dev, model, x, y)  # (first steps size the pool)
            model.zero_grad(set_to_none=True)
            steps[mode] = _step_time(dev, model, x, y)
            copies = [s for s in dev.spans if s.what == "copy" and s.stream == "d2h"]
            computes = [s for s in dev.spans if s.stream == "compute"]
            assert dev.hazards == []
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), mode
        if mode != "unpatched":
            assert len(copies) >= 4
            overlapped = [c for c in copies if any(k.start < c.end and c.start < k.end for k in computes)]
            assert overlapped, f"{mode}: no copy out ran beside compute"
            cswap.unpatch(model)
    link = 512 * 256 * 4 * 1000 / 55e9  # one activation each way
    assert steps["vdnn"] > steps["unpatched"] + link  # the link is slower than this compute
    assert steps["sc"] < steps["vdnn"]  # half the bytes (ReLU: about half zeros)


def test_what_does_not_grow_with_the_batch_is_not_scaled():
    """Weights, their gradients and optimizer state have the parameters' shapes: an
    optimizer step takes the same time whatever the scale."""
    seconds = {}
    for scale in (1, 10_000):
        model = _mlp()
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        dev = TimedDevice(_spec(scale=scale))
        with ComputeClock(dev, model) as clock:
            optimizer.step()
        dev.close()
        seconds[scale] = clock.seconds
    assert seconds[1] > 0 and seconds[10_000] == pytest.approx(seconds[1])
