"""The timed twin: the emulated device with a GPU's durations, on a virtual clock.

The emulated device (cswap.runtime.emulator) checks the order of device work; it
does not time it. The twin adds time, and keeps this CPU's own speed out of the
device's times:

- A virtual clock. Every host thread has a time of its own, and each stream the
  time its queued work ends. Work queued on a stream at host time h starts at
  the latest of h, the end of the stream's earlier work and the events it waits
  for, and takes its duration; an event completes when the work queued before it
  on its stream has. A host thread that waits (event_synchronize, `call`, a
  pageable copy, synchronize, `.item()`) jumps to the time it waited for; a query
  says done only once that time has passed on the asking thread's clock; the
  compute stream waiting for an event delays compute, not the host. A thread that
  uses an event another thread recorded is at least at the time it was recorded
  (the worker takes a job no earlier than pack made it), and a background thread
  that waited for the device until t acts only once the training thread's clock
  has reached t (or it waits too): the releaser cannot drop a tensor "before" the
  training thread, at an earlier time, looks for it.
- Durations. A copy takes `link_latency_s` + bytes x scale / the link's bandwidth
  (d2h or h2d stream); device work takes what its `Work` says: a codec at
  `codec_seconds(codec, direction, bytes x scale, sparsity)`, a gather or a checksum
  at HBM bandwidth; the model's ops, which run on the calling thread, take the
  roofline time of their FLOPs and bytes x scale on the GPU (`ComputeClock`), times
  `compute_factor` (calibrated on a measured step).
- Host work, counted as it runs: a thread's own CPU time between device calls
  (time.thread_time: waiting, and other threads holding the GIL, do not count),
  times `host_scale`, plus each CUDA call's cost as timed on an H200's host
  (CALL_S). This CPU's speed swings; `calibrate_host` times a reference piece of
  Python between steps and scales host time so that it stands for a host of one
  speed (HOST_REFERENCE_S). The emulator's own bookkeeping and the model's CPU
  kernels are left out, and so is this CPU's time between two of the model's ops
  (freeing and faulting in memory, mostly): those cost MODEL_OP_S each, as measured
  on the H200's host.

The data moves as in the emulator (stream threads, but no sleeping: in real time
the link is infinitely fast), so its ordering checks and race detector still
hold; only time is virtual. `scale` lets a small batch stand for a large one:
device durations are computed on bytes and FLOPs times scale.

Every queued piece of work is logged (`spans`: stream, what, when queued, start,
end, bytes), so tests can check the pipeline's shape: what overlaps what, what
waited for what. `busy_s` sums each stream's work and `blocked_s` each thread's
virtual waits.

A codec kernel queued on a side stream while compute has work queued delays that
work by `sm_share` of its time (default all of it: the kernels use every SM;
assumed, as cswap-plan assumes, not measured).

Not modelled: the GIL (threads
run their Python side by side on their own clocks), a thread woken by another
through a Python lock or queue rather than an event (it keeps its own time), the
caching allocator's own synchronisations and cudaMalloc, a bounded launch queue
(the host here may run any distance ahead of the GPU), memory over time (memory
figures are the emulator's, in real execution order).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from . import sync
from .device import Work
from .emulator import EmulatedDevice, EmulatedEvent, _DEADLOCK_S

__all__ = ["CALL_S", "HOST_REFERENCE_S", "MODEL_OP_S", "ComputeClock", "MeasuredCodecs", "Span", "TimedDevice",
           "TwinSpec", "host_reference_s"]

# Host seconds per CUDA call, timed one by one on the H200's host by benchmarks/cuda_seam.py
# (benchmarks/results/nvidia-h200/README.md): an async copy 6.2 us, an allocation 4.0, an event
# record 2.1, the compute stream 0.19. The calls it did not time (a wait, a query, a
# synchronisation's own cost, record_stream, the capture check, a kernel launch) are assumed
# at an event record's cost.
CALL_S = {"copy": 6.2e-6, "empty": 4.0e-6, "record": 2.1e-6, "stream": 0.19e-6, "wait": 2.1e-6,
          "query": 2.1e-6, "sync": 2.1e-6, "record_stream": 2.1e-6, "capture": 2.1e-6, "launch": 6.2e-6}
# The host's time per kernel of the model itself (Python, autograd, the dispatcher, the launch),
# measured on the H200's host: stock autograd on benchmarks/overhead.py's chain (100 x Linear 64
# + ReLU, batch 32: 801 kernels a step, host-bound) took 10.2 ms a step (overhead-ab/new-1).
# This CPU's own time between two of the model's ops is not used: it is mostly freeing and
# faulting in the CPU's memory (zero_grad alone takes 30 ms of it at VGG16's size).
MODEL_OP_S = 12.7e-6
HOLD_S = 0.5  # real seconds a background thread waits for the training thread's clock at most
# Pinning new host memory (cudaHostAlloc): a fixed cost and a rate. Assumed (typical figures:
# a few hundred microseconds and about 10 GB/s page-locking); a pooled buffer costs nothing.
PIN_FIXED_S, PIN_BYTES_PER_S = 300e-6, 10e9
# The host the twin stands for runs host_reference_s's Python in this long. The twin counts its
# threads' CPU time as that host's, and this CPU's speed swings: the same Python took 2.3 to 5 ms
# of thread time within a minute on 2026-12-01, and the compressed modes' steps moved by a fifth
# with it (their encodes are queued by the worker's Python). TimedDevice.calibrate_host scales
# host time to this speed. Assumed: this CPU's median on 2026-12-01 (Python 3.11), until
# `scripts/gpu_session.sh headline` times it on the H200's host.
HOST_REFERENCE_S = 4.1e-3


MEASURED_H200 = Path(__file__).resolve().parents[1] / "data" / "twin-nvidia-h200.json"


class _Record:
    __slots__ = ("key", "size", "state")

    def __init__(self, key: int, size: int):
        self.key, self.size, self.state = key, size, 0


def _book(table: dict, record: _Record, i: int) -> int:
    table[record.key] = record
    record.state = (record.state + i) & 7
    return record.size if record.state else len(table)


def _reference_work(n: int = 5000) -> int:
    """A fixed piece of Python like a runtime's bookkeeping: small objects, their attributes,
    a dict, a bounded list."""
    table, out = {}, []
    for i in range(n):
        out.append(_book(table, _Record(i & 1023, i * 4), i))
        if len(out) > 64:
            del out[:32]
    return len(table)


def host_reference_s(repeats: int = 3) -> float:
    """This thread's CPU seconds for the reference Python, the fastest of `repeats` runs (other
    work on the machine only ever adds time)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        _reference_work()
        best = min(best, time.thread_time() - start)
    return max(best, 1e-9)


class MeasuredCodecs:
    """Codec times measured on a GPU (a table of compress and decompress milliseconds by
    codec, dtype, size and sparsity, as benchmarks/codecs.py measured them), interpolated:
    linearly in size between the measured sizes (below the smallest, its time: the fixed
    cost per call dominates; above the largest, the line through the last two) and in
    sparsity between the measured ones (clamped outside them)."""

    def __init__(self, rows: list[dict]):
        self._points: dict[tuple[str, str, int], dict[float, list[tuple[float, float]]]] = {}
        for row in rows:
            for direction in ("compress", "decompress"):
                key = (row["codec"], direction, row["itemsize"])
                by_sparsity = self._points.setdefault(key, {})
                by_sparsity.setdefault(row["sparsity"], []).append((row["bytes"], row[f"{direction}_ms"] / 1e3))
        for by_sparsity in self._points.values():
            for points in by_sparsity.values():
                points.sort()

    def seconds(self, codec: str, direction: str, nbytes: float, sparsity: float, itemsize: int = 4) -> float:
        key = (codec, direction, itemsize)
        if key not in self._points:
            key = (codec, direction, 4)
        if key not in self._points:
            raise KeyError(f"cswap.runtime.twin: no measured {direction} times for codec {codec!r}")
        by_sparsity = self._points[key]
        levels = sorted(by_sparsity)
        sparsity = min(max(sparsity, levels[0]), levels[-1])
        above = next((s for s in levels if s >= sparsity), levels[-1])
        below = max((s for s in levels if s <= sparsity), default=levels[0])
        at_below, at_above = _along(by_sparsity[below], nbytes), _along(by_sparsity[above], nbytes)
        if above == below:
            return at_below
        return at_below + (at_above - at_below) * (sparsity - below) / (above - below)


def _along(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear time at size x through (size, time) points sorted by size."""
    if x <= points[0][0] or len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


def measured(path: Path = MEASURED_H200) -> dict:
    """A GPU's measured figures for the twin (the link and the codecs; see TwinSpec.measured)."""
    return json.loads(Path(path).read_text())


@dataclass(frozen=True)
class TwinSpec:
    """The GPU the twin stands for. Bandwidths in bytes per second."""

    gpu: object                        # a cswap.plan.gpus.GPU: compute peaks and HBM bandwidth
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    link_latency_s: float
    codec_seconds: Callable[..., float]  # (codec, "compress"/"decompress", bytes, sparsity, itemsize)
    scale: float = 1.0                 # each device byte and FLOP stands for this many
    compute_factor: float = 1.0        # times the roofline's op time (calibrated on a measured step)
    precision: str = "fp32"
    host_scale: float = 1.0            # times this CPU's host time
    sm_share: float = 1.0              # of a kernel's time on a side stream, what compute running then loses
    source: str = ""                   # where the figures come from

    @classmethod
    def measured(cls, path: Path = MEASURED_H200, **overrides) -> "TwinSpec":
        """The GPU measured in `path` (default: the H200 of 2026-11-26, cswap/data/twin-nvidia-h200.json,
        made by `python benchmarks/twin.py --table` from benchmarks/results/nvidia-h200/codecs.csv):
        its pinned link (bandwidth and latency, fitted to the copies timed at 1 and 256 MiB) and its
        codecs' times (MeasuredCodecs); compute by the roofline of its entry in cswap.plan.gpus."""
        from ..plan.gpus import gpu

        doc = measured(path)
        link = doc["link"]
        fields = dict(gpu=gpu(doc["gpu"]), d2h_bytes_per_s=link["d2h_bytes_per_s"],
                      h2d_bytes_per_s=link["h2d_bytes_per_s"], link_latency_s=link["latency_s"],
                      codec_seconds=MeasuredCodecs(doc["codecs"]).seconds,
                      source=f"{doc['device']} measured {doc['date']} ({doc['source']})")
        fields.update(overrides)
        return cls(**fields)


class Span(NamedTuple):
    """One piece of work on a stream, in virtual seconds."""

    stream: str
    what: str        # "copy", "compute", "encode zvc", "decode zvc", "gather", "checksum"
    queued: float    # the queuing thread's time
    start: float
    end: float
    nbytes: int      # bytes it moves or works on (x scale)
    thread: str


class _Clock:
    """A host thread's virtual time and the CPU time it had at its last mark."""

    __slots__ = ("t", "mark", "depth", "after_op", "waiting")

    def __init__(self):
        self.t = 0.0
        self.mark = time.thread_time()
        self.depth = 0          # inside a device call: the outermost one counts the host's time
        self.after_op = False   # its last call was one of the model's ops (ComputeClock)
        self.waiting = False    # it waits for the device now


class TimedDevice(EmulatedDevice):
    """The emulated device on a virtual clock with a GPU's durations (module docstring)."""

    kind = "emulated"

    def __init__(self, spec: TwinSpec, seed: int = 0, capacity_bytes: int | None = None, log: bool = True):
        super().__init__(bandwidth_gbps=float("inf"), seed=seed, capacity_bytes=capacity_bytes, log=log)
        self.spec = spec
        self.host_scale = spec.host_scale  # (calibrate_host keeps it for a host of one speed)
        self._local = threading.local()
        self._main = self._clock           # the training thread's (the one that makes the device)
        self.held_too_long = 0             # background threads let go before the training thread caught up
        self._tails: dict = {}  # id(stream), or a copy engine ("d2h", "h2d") -> when its queued work ends
        self.spans: deque[Span] = deque(maxlen=1_000_000 if log else 0)
        self.busy_s: Counter = Counter()         # stream name -> virtual seconds of work queued on it
        self.blocked_s: Counter = Counter()      # thread name -> virtual seconds it waited for the device

    def __repr__(self) -> str:
        return f"<cswap timed twin of {self.spec.gpu.name}: scale {self.spec.scale:g}>"

    # -- the virtual clock ------------------------------------------------------------------------

    @property
    def _clock(self) -> _Clock:
        clock = getattr(self._local, "clock", None)
        if clock is None:
            clock = self._local.clock = _Clock()
        return clock

    def _hold(self, t: float) -> None:
        """A background thread (the releaser) that waited for the device until `t` acts no
        earlier than the training thread reaches t, or waits itself: what it does then (a
        tensor released) must not be seen by the training thread at an earlier time (a
        restore that on the GPU would still find the tensor on the device). At most
        HOLD_S of real time, in case the training thread waits for it in a way the twin
        cannot see (counted in held_too_long)."""
        main = self._main
        deadline = time.perf_counter() + HOLD_S
        while main.t < t and not main.waiting:
            if time.perf_counter() > deadline:
                self.held_too_long += 1
                return
            time.sleep(50e-6)

    def calibrate_host(self, reference_s: float = HOST_REFERENCE_S) -> float:
        """Time the reference Python on this thread now, and scale every thread's host time by
        spec.host_scale x reference_s over it from here on: host time then stands for a host
        that runs it in reference_s, however fast this CPU is at the moment. Call it between
        steps (its own time is not counted). Returns the scale."""
        clock = self._enter()
        self.host_scale = self.spec.host_scale * reference_s / host_reference_s()
        self._leave(clock)
        return self.host_scale

    def now(self) -> float:
        """The calling thread's virtual time, its host work so far counted."""
        clock = self._enter()
        self._leave(clock)
        return clock.t

    host_time = now

    def _enter(self, cost: float = 0.0, model_op: bool = False) -> _Clock:
        """A device call costing the host `cost` (or, `model_op`, one of the model's ops)
        begins on the calling thread: the host's own work since its last call counts, as this
        CPU ran it, unless it lay between two of the model's ops (the model's own host work:
        MODEL_OP_S an op); then the call's cost, before what it queues."""
        clock = self._clock
        clock.depth += 1
        if clock.depth == 1:
            cpu = time.thread_time()
            if not (model_op and clock.after_op):
                clock.t += (cpu - clock.mark) * self.host_scale
            clock.t += cost
            clock.mark = cpu
        return clock

    def _leave(self, clock: _Clock, cost: float = 0.0, model_op: bool = False) -> None:
        """The call ends; `cost`: what it cost the host after its work was queued."""
        clock.depth -= 1
        if clock.depth == 0:  # the call's own CPU time is the emulator's, not a GPU host's: left out
            clock.t += cost
            clock.mark = time.thread_time()
            clock.after_op = model_op

    def _see(self, clock: _Clock, event) -> None:
        """The caller has an event another thread recorded: it is no earlier than that."""
        if isinstance(event, EmulatedEvent) and event.issued_at > clock.t:
            clock.t = event.issued_at

    def _reach(self, clock: _Clock, t: float) -> None:
        """The calling thread waited for the device until `t`."""
        if t > clock.t:
            self.blocked_s[threading.current_thread().name] += t - clock.t
            clock.t = t

    def _tail(self, stream) -> float:
        return self._tails.get(id(stream), 0.0)

    def _queue(self, stream, seconds: float, h: float, what: str, nbytes: int = 0, engine: str | None = None) -> float:
        """Work of `seconds` queued on `stream` at host time h: when it ends. A copy between
        host and device also waits for the copy engine of its direction (`engine`: "d2h" or
        "h2d"), whichever stream queued the copies before it: on the H200 an encode's few
        bytes of sizes, read back on the codec's stream, waited for the tensor being sent
        (benchmarks/results/nvidia-h200/trace/, 2026-12-04)."""
        with self._lock:
            start = max(self._tails.get(id(stream), 0.0), h, self._tails.get(engine, 0.0))
            end = start + seconds
            self._tails[id(stream)] = end
            if engine is not None:
                self._tails[engine] = end
            self.busy_s[stream.name] += seconds
            self.spans.append(Span(stream.name, what, h, start, end, nbytes, threading.current_thread().name))
        return end

    def _kernel(self, stream, seconds: float, h: float, work) -> float:
        """A kernel queued on a side stream; compute running meanwhile loses spec.sm_share of its time."""
        end = self._queue(stream, seconds, h, _what(work), _nbytes(work, self.spec))
        if self.spec.sm_share and seconds:
            with self._lock:
                key = id(self._compute)
                if self._tails.get(key, 0.0) > end - seconds:
                    self._tails[key] += seconds * self.spec.sm_share
        return end

    def compute(self, seconds: float, what: str = "compute", nbytes: int = 0) -> None:
        """Model work of `seconds` queued by the calling thread on its current stream (ComputeClock)."""
        self._queue(self.compute_stream(), seconds, self._clock.t, what, nbytes)

    def wait_for_compute(self) -> None:
        """The calling thread reads a result of compute back (`.item()`): it waits for its stream."""
        clock = self._enter(CALL_S["sync"])
        try:
            self._reach(clock, self._tail(self.compute_stream()))
        finally:
            self._leave(clock)

    # -- durations ---------------------------------------------------------------------------------

    def _engine(self, dst: torch.Tensor, src: torch.Tensor, stream) -> str | None:
        """The copy engine a copy from src to dst on `stream` takes: "d2h", "h2d", or None (on
        the device). A tensor that is no host buffer of this device's counts as the device's,
        except on the link's own streams, whose copies all cross it."""
        to_host, from_host = self.is_host_buffer(dst), self.is_host_buffer(src)
        if to_host != from_host:
            return "d2h" if to_host else "h2d"
        return stream.name if stream.name in ("d2h", "h2d") else None

    def _copy_seconds(self, engine: str | None, nbytes: int) -> float:
        spec = self.spec
        if engine is None:  # on the device: read and write
            return 2 * nbytes * spec.scale / spec.gpu.hbm_bytes_per_s
        rate = spec.d2h_bytes_per_s if engine == "d2h" else spec.h2d_bytes_per_s
        return spec.link_latency_s + nbytes * spec.scale / rate

    def _work_seconds(self, work: Work | None, reads) -> float:
        if work is None:
            return 0.0
        spec = self.spec
        nbytes = work.nbytes * spec.scale
        if work.kind == "encode":
            sparsity, itemsize = (_zero_fraction(reads[0]), reads[0].element_size()) if reads else (0.5, 4)
            return spec.codec_seconds(work.codec, "compress", nbytes, sparsity, itemsize)
        if work.kind == "decode":  # sparsity from the payload's size (as ZVC's: nonzeros plus masks)
            payload = reads[0].numel() * reads[0].element_size() if reads else work.nbytes / 2
            sparsity = min(max(1 - payload / max(work.nbytes, 1), 0.0), 1.0)
            return spec.codec_seconds(work.codec, "decompress", nbytes, sparsity, work.itemsize)
        if work.kind == "gather":
            return 2 * nbytes / spec.gpu.hbm_bytes_per_s
        if work.kind == "checksum":
            return nbytes / spec.gpu.hbm_bytes_per_s
        raise ValueError(f"cswap.runtime.twin: unknown work kind {work.kind!r}")

    # -- the seam, on the virtual clock ---------------------------------------------------------------

    def compute_stream(self):
        clock = self._enter(CALL_S["stream"])
        try:
            return super().compute_stream()
        finally:
            self._leave(clock)

    def side_stream(self, role: str):
        clock = self._enter()  # (made once, kept: no call on CUDA)
        try:
            return super().side_stream(role)
        finally:
            self._leave(clock)

    def capturing(self) -> bool:
        self._leave(self._enter(CALL_S["capture"]))
        return False

    def record_event(self, stream, timing: bool = False, reuse=None) -> EmulatedEvent:
        clock = self._enter(CALL_S["record"])
        try:
            event = super().record_event(stream, timing, reuse)
            with self._lock:
                event.issued_at = clock.t
                event.at = max(self._tails.get(id(stream), 0.0), clock.t)
            return event
        finally:
            self._leave(clock)

    def wait_event(self, stream, event, at: str) -> None:
        clock = self._enter(CALL_S["wait"])
        try:
            self._see(clock, event)
            if sync.active(at):  # the stream, not the host, waits (compute included: a GPU's does)
                with self._lock:
                    if event.at > self._tails.get(id(stream), 0.0):
                        self._tails[id(stream)] = event.at
            super().wait_event(stream, event, at)
        finally:
            self._leave(clock)

    def event_synchronize(self, event, at: str | None) -> None:
        clock = self._enter(CALL_S["sync"])
        try:
            self._see(clock, event)
            super().event_synchronize(event, at)
        finally:
            self._leave(clock)

    def _await(self, event: EmulatedEvent, at, merge: bool) -> None:
        clock = self._clock
        clock.waiting = True
        try:
            super()._await(event, at, merge)
        finally:
            clock.waiting = False
        if merge:  # the host waited for it (a synchronisation, a pageable copy)
            self._reach(clock, event.at)
            if clock is not self._main:
                self._hold(clock.t)

    def event_query(self, event, at: str | None) -> bool:
        clock = self._enter(CALL_S["query"])
        try:
            self._see(clock, event)
            if at is not None and not sync.active(at):
                return True
            if event.at > clock.t:
                return False
            if not event.done.wait(_DEADLOCK_S):  # (the work before it runs without sleeping: soon)
                raise RuntimeError(f"cswap timed twin: an event on {event.stream.name} did not complete within "
                                   f"{_DEADLOCK_S:.0f} s (queried at {at}); the streams are deadlocked")
            return super().event_query(event, at)
        finally:
            self._leave(clock)

    def elapsed_s(self, start: EmulatedEvent, end: EmulatedEvent) -> float | None:
        clock = self._enter(2 * CALL_S["query"])
        try:
            if not (start.timing and end.timing):
                return super().elapsed_s(start, end)  # (raises as CUDA's does)
            self._see(clock, start)
            self._see(clock, end)
            if max(start.at, end.at) > clock.t:
                return None
            return end.at - start.at
        finally:
            self._leave(clock)

    def record_stream(self, tensor: torch.Tensor, stream, at: str) -> None:
        clock = self._enter(CALL_S["record_stream"])
        try:
            super().record_stream(tensor, stream, at)
        finally:
            self._leave(clock)

    def synchronize(self) -> None:
        clock = self._enter(CALL_S["sync"])
        try:
            super().synchronize()
            with self._lock:
                end = max(self._tails.values(), default=0.0)
            self._reach(clock, end)
        finally:
            self._leave(clock)

    def _queue_copy(self, dst: torch.Tensor, src: torch.Tensor, stream, h: float) -> None:
        nbytes = dst.numel() * dst.element_size()
        engine = self._engine(dst, src, stream)
        self._queue(stream, self._copy_seconds(engine, nbytes), h, "copy", int(nbytes * self.spec.scale), engine)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        clock = self._enter(CALL_S["copy"])
        try:
            self._queue_copy(dst, src, stream, clock.t)
            super().copy(dst, src, stream)
        finally:
            self._leave(clock)

    def copy_all(self, dsts, srcs, stream) -> None:
        clock = self._enter(CALL_S["copy"])  # one call on CUDA (a foreach copy): one call's cost
        try:
            for dst, src in zip(dsts, srcs):
                self._queue_copy(dst, src, stream, clock.t)
                EmulatedDevice.copy(self, dst, src, stream)
        finally:
            self._leave(clock)

    def launch(self, stream, fn, reads=(), writes=(), work=None, scratch_bytes: int = 0) -> None:
        clock = self._enter(CALL_S["launch"])
        try:
            self._kernel(stream, self._work_seconds(work, reads), clock.t, work)
            super().launch(stream, fn, reads, writes, work, scratch_bytes)
        finally:
            self._leave(clock)

    def call(self, stream, fn, reads=(), writes=(), scratch_bytes: int = 0, work=None):
        clock = self._enter(CALL_S["launch"])
        try:
            end = self._kernel(stream, self._work_seconds(work, reads), clock.t, work)
            clock.waiting = True
            try:
                value = super().call(stream, fn, reads, writes, scratch_bytes, work)
            finally:
                clock.waiting = False
            self._reach(clock, end)  # the host read its result back
            return value
        finally:
            self._leave(clock, CALL_S["sync"])

    def empty(self, nbytes: int, stream) -> torch.Tensor:
        clock = self._enter(CALL_S["empty"])
        try:
            return super().empty(nbytes, stream)
        finally:
            self._leave(clock)

    def host_empty(self, nbytes: int, pinned: bool) -> torch.Tensor:
        clock = self._enter()
        cost = 0.0
        try:
            if pinned:
                size = 1 << max(int(nbytes) - 1, 0).bit_length()
                with self._lock:
                    cached = bool(self._pinned_cache[size])
                if not cached:
                    cost = PIN_FIXED_S + size * self.spec.scale / PIN_BYTES_PER_S
            return super().host_empty(nbytes, pinned)
        finally:
            self._leave(clock, cost)

    # The emulator's bookkeeping: no CUDA call, and its CPU time is not a GPU host's.
    def on_saved(self, t: torch.Tensor) -> None:
        clock = self._enter()
        try:
            super().on_saved(t)
        finally:
            self._leave(clock)

    def uncounted_bytes(self, t: torch.Tensor) -> int:
        clock = self._enter()
        try:
            return super().uncounted_bytes(t)
        finally:
            self._leave(clock)

    def on_use(self, t: torch.Tensor) -> None:
        clock = self._enter()
        try:
            super().on_use(t)
        finally:
            self._leave(clock)

    def host_access(self, t: torch.Tensor, write: bool) -> None:
        clock = self._enter()
        try:
            super().host_access(t, write)
        finally:
            self._leave(clock)

    def is_host_buffer(self, t: torch.Tensor) -> bool:
        """Whether `t` lives in a host buffer of this device's (pinned or pageable)."""
        buf = self._buffers.get(t.untyped_storage().data_ptr())
        return buf is not None and buf.kind == "host"


def _what(work: Work | None) -> str:
    if work is None:
        return "work"
    return f"{work.kind} {work.codec}" if work.codec else work.kind


def _nbytes(work: Work | None, spec: TwinSpec) -> int:
    return 0 if work is None else int(work.nbytes * spec.scale)


_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _zero_fraction(t: torch.Tensor) -> float:
    """The fraction of t's elements that are all-zero bit patterns (the codecs' zeros)."""
    if t.numel() == 0:
        return 0.0
    words = t.detach()
    if words.dtype.is_floating_point or words.dtype.is_complex or words.dtype == torch.bool:
        words = words.contiguous().view(_INTS[words.element_size()])
    return 1.0 - torch.count_nonzero(words).item() / words.numel()


# -- the model's compute ----------------------------------------------------------------------------------

_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach",
              "alias", "set_", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"}
_READS_BACK = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2"}


class ComputeClock:
    """Times the ops the entering thread runs (the model's forward, backward and optimizer)
    on the twin's compute stream: each op's FLOPs (torch.utils.flop_counter) and the bytes of
    its tensors by cswap.plan.roofline's time model by op class,
    times spec.compute_factor. Views, allocations and ops on host buffers (cswap's own
    bookkeeping) take no time; an op that reads a result back to the host (`.item()`,
    nonzero) waits for compute. Use as a context manager.

    With spec.scale, what grows with the batch counts scale times: a tensor's bytes, unless
    it has the shape of one of `model`'s parameters or buffers (weights, their gradients,
    optimizer state) or at most one element; an op's FLOPs, when any of its inputs grows.
    (An activation that happens to have a parameter's shape is counted once: rare.)"""

    def __init__(self, dev: TimedDevice, model: torch.nn.Module | None = None):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        from torch.utils.flop_counter import flop_registry

        from ..plan.roofline import op_seconds, time_model

        spec = dev.spec
        model_of_time, _ = time_model()
        fixed = set() if model is None else {tuple(t.shape) for t in (*model.parameters(), *model.buffers())}
        self.dev = dev
        self.ops = 0
        self.seconds = 0.0
        clock = self

        class _Op(NamedTuple):
            name: str
            flops: float
            bytes: float
            dtype: torch.dtype | None
            channels_last: bool = False  # (the twin's models run NCHW, as the H200's did)

        def seconds_of(func, args, kwargs, out) -> float:
            name = func._overloadpacket.__name__
            if func.is_view or name in _NO_KERNEL:
                return 0.0
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if not outs:
                return 0.0
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if any(dev.is_host_buffer(t) for t in ins + outs):
                return 0.0
            count = flop_registry.get(func._overloadpacket)
            flops = int(count(*args, **kwargs, out_val=out)) if count is not None else 0
            grows = [t.numel() > 1 and tuple(t.shape) not in fixed for t in ins + outs]
            moved = sum(t.numel() * t.element_size() * (spec.scale if g else 1) for t, g in zip(ins + outs, grows))
            floating = next((t.dtype for t in ins if t.is_floating_point()), None)
            op = _Op(name, flops * (spec.scale if any(grows[:len(ins)]) else 1), moved, floating)
            return op_seconds(op, spec.gpu, spec.precision, model_of_time) * spec.compute_factor

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                host = dev._enter(model_op=True)
                seconds = 0.0
                try:
                    out = func(*args, **kwargs)
                    if host.depth > 1:  # the emulator's own work inside a device call
                        return out
                    seconds = seconds_of(func, args, kwargs, out)
                    if seconds:
                        host.t += MODEL_OP_S  # (its launch, before it is queued)
                        dev.compute(seconds, func._overloadpacket.__name__)
                        clock.ops += 1
                        clock.seconds += seconds
                    if func._overloadpacket.__name__ in _READS_BACK:
                        dev._reach(host, dev._tail(dev.compute_stream()))
                    return out
                finally:  # (the op's CPU time is not the host's)
                    dev._leave(host, model_op=True)

        self._mode = Mode()

    def __enter__(self) -> "ComputeClock":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
