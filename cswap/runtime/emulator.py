"""An asynchronous device emulated on CPU, with CUDA's ordering semantics.

The runtime's CUDA code path runs against it on any machine, under conditions
at least as hostile as a GPU's:

- Streams. The compute stream is the caller: autograd runs on CPU tensors as
  usual. Each side stream is a thread that runs its queue in order: copies,
  device work (`launch`, `call`), event records and waits.
- A thread's own current stream. As torch.cuda.current_stream() is per
  thread, compute_stream() is the calling thread's: the compute stream, or
  within `with dev.stream(s)` a stream the caller made with `user_stream()`
  (a user's torch.cuda.Stream: it runs on the caller, as compute does, with a
  clock of its own). What autograd saves and uses inside the block is that
  stream's access, so work the runtime orders after the wrong stream is a race.
- Compute behind the host. With `compute_lag_s`, the compute stream runs that
  far behind the host, as a GPU's does while the host queues kernels ahead of
  it: an event recorded on compute completes that long after it is recorded,
  so side-stream work ordered after compute (a copy out after its tensor is
  computed, a copy in after compute's last use of the block) starts late, and
  a host that polls compute's events finds them pending. (The data is written
  at once all the same: ordering is checked by the race detector below, not by
  timing.)
- Copies finish late. A copy of N bytes completes N / bandwidth seconds after
  it starts, plus seeded random jitter, and it reads its source and writes its
  destination only then: a reader that does not wait sees the old contents,
  and a source dropped too early is gone.
- The caching allocator's hazard. Buffers the runtime allocates (`empty`) come
  from a caching allocator per stream. A buffer freed while another stream's
  work on it is pending, and not record_stream()ed to that stream, is poisoned
  (0xA5 bytes) at once, as CUDA would hand it to the next allocation; reuse on
  the stream it was allocated on waits for that stream's queue.
- A race detector. Every access to a tracked buffer (copies, device work,
  what autograd saves and uses, host reads and writes of host buffers) is
  checked with vector clocks against the synchronisation that orders it: an
  access not ordered after a conflicting one is a hazard, recorded in
  `hazards` and made visible by poisoning the data it produced or read. Events
  carry clocks; waits, host synchronization and queries merge them, exactly as
  CUDA orders work. So a missing wait is caught even when timing happens to
  hide it.
- Memory. `live_bytes` counts the device bytes held by saved activations
  (from the moment autograd saves them until their storage dies) and by the
  runtime's own buffers; `peak_bytes` their maximum. With `capacity_bytes`, an
  allocation or a first save beyond it raises torch.OutOfMemoryError (a saved
  tensor stands for the op output a GPU would have failed to allocate). Device
  work declares what it allocates beside its outputs (`call(...,
  scratch_bytes=)`, a codec's encoder temporaries): it counts while it runs.
  Reserved memory (`memory_reserved`) is what CUDA's caching allocator would
  hold for the same allocations and frees, per stream pool
  (cswap.runtime.allocator_model): saved activations in the pool of the stream
  that saved them, the runtime's buffers in the pool of the stream they were
  allocated on.
- Pinned memory as PyTorch's caching host allocator keeps it: blocks rounded
  up to a power of two, and kept after being freed until empty_host_cache().
  A copy to or from pageable host memory blocks the host until it is done, as
  CUDA's does (counted in `host_syncs` as "pageable copy").
- Errors. An exception in device work on a stream, or an injected failure
  (`inject_failure`), is carried by the next event recorded on that stream and
  raised by whoever synchronizes with it, as CUDA reports asynchronous errors.

What it does not model: kernel durations (device work takes the CPU time it
takes; compute's lag is one constant), compute waiting for a side stream
without the host waiting too (compute's waits block the caller), PCIe
sharing between several devices, and memory the runtime does not see
(autograd's temporaries, parameters, gradients).
"""

from __future__ import annotations

import math
import random
import threading
import time
import weakref
from collections import Counter, defaultdict, deque
from contextlib import contextmanager

import numpy as np
import torch

from . import sync
from .allocator_model import CachingAllocatorModel
from .device import SIDE_STREAMS, Device
from .immediate import ImmediateDevice

__all__ = ["EmulatedDevice", "current", "activate", "is_default", "POISON"]

POISON = 0xA5           # the byte pattern of recycled memory
HOST, COMPUTE = 0, 1    # clock ids of the host threads and the compute stream
_BLOCK = 512            # allocation granularity, as CUDA's caching allocator
_MAX_ACCESSES = 32      # accesses remembered per buffer
_DEADLOCK_S = 60.0      # a host wait longer than this is a deadlock: raise, never hang a test run


def _aligned(nbytes: int) -> np.ndarray:
    """A poisoned block starting at a multiple of _BLOCK, as the caching allocator's do."""
    raw = np.full(nbytes + _BLOCK, POISON, dtype=np.uint8)
    skip = -raw.ctypes.data % _BLOCK
    return raw[skip: skip + nbytes]


class _Clock(dict):
    """A vector clock: stream id -> the latest of its operations known to have happened."""

    def merge(self, other: dict) -> None:
        for sid, tick in other.items():
            if tick > self.get(sid, 0):
                self[sid] = tick

    def covers(self, sid: int, tick: int) -> bool:
        return self.get(sid, 0) >= tick


class EmulatedStream:
    """A stream of the emulated device (compute and user streams: the caller, `caller`;
    side streams: a thread)."""

    def __init__(self, dev: "EmulatedDevice", sid: int, name: str, caller: bool = False):
        self.dev, self.sid, self.name, self.caller = dev, sid, name, caller
        self.vc = _Clock()
        self.error: BaseException | None = None  # carried by the next event recorded here
        self.queue: deque = deque()
        self.cv = threading.Condition(dev._lock)
        self.rng = random.Random(f"{dev.seed}:{name}")
        self.thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"<emulated stream {self.name}>"


class EmulatedEvent:
    """An event: done once its stream reached it; carries the stream's clock and error."""

    __slots__ = ("dev", "stream", "vc", "done", "time", "error", "timing", "at", "issued_at")

    def __init__(self, dev: "EmulatedDevice", stream: EmulatedStream, timing: bool = False):
        self.dev, self.stream, self.timing = dev, stream, timing
        self.vc = _Clock()
        self.done = threading.Event()
        self.time: float | None = None
        self.error: BaseException | None = None
        # The timed twin's virtual clock (cswap.runtime.twin): when the event completes, and the
        # recording thread's time when it was recorded.
        self.at = self.issued_at = 0.0

    def query(self) -> bool:
        return self.dev.event_query(self, None)

    def synchronize(self) -> None:
        self.dev.event_synchronize(self, None)

    def elapsed_time(self, end: "EmulatedEvent") -> float:
        """Milliseconds from this event to `end`, as torch.cuda.Event.elapsed_time."""
        return (end.time - self.time) * 1e3


class _Buffer:
    """A tracked piece of memory: an autograd storage ("saved"), an emulated device
    block ("device"), or a host block ("host")."""

    __slots__ = ("kind", "nbytes", "stream", "recorded", "accesses", "pending", "block", "storage",
                 "counted", "free_vc", "frees_left", "pinned", "in_use", "guards", "reserve")

    def __init__(self, kind: str, nbytes: int, stream: EmulatedStream, block=None, storage=None):
        self.kind, self.nbytes, self.stream = kind, nbytes, stream
        self.recorded: set[EmulatedStream] = set()
        self.accesses: list[tuple[int, int, int, int, bool]] = []  # (lo, hi, sid, tick, write)
        self.pending: dict[int, int] = defaultdict(int)           # queued ops per stream id
        self.block = block                                        # numpy memory (device, host)
        self.storage = storage                                    # weakref to a saved storage
        self.counted = False
        self.in_use = 0                                           # bytes allocated from a device block
        self.free_vc: _Clock | None = None
        self.frees_left = 0
        self.guards: list = []  # events on caller streams it was recorded for, at its free: reused after them
        self.pinned = False
        self.reserve = None  # its block in the allocator model (device memory)


class _Ref:
    """Where an operation reads or writes: a byte range of a tracked buffer. It holds
    emulated memory strongly (the allocator, not the user, owns it) and an autograd
    storage only weakly unless the storage was record_stream()ed to the op's stream."""

    __slots__ = ("buf", "lo", "hi", "write", "strong")

    def __init__(self, buf: _Buffer, lo: int, hi: int, write: bool, strong):
        self.buf, self.lo, self.hi, self.write, self.strong = buf, lo, hi, write, strong

    def tensor(self) -> torch.Tensor | None:
        """The bytes, or None when the storage is gone."""
        if self.buf.block is not None:
            return torch.from_numpy(self.buf.block[self.lo: self.hi])
        storage = self.strong if self.strong is not None else self.buf.storage()
        if storage is None:
            return None
        return torch.empty(0, dtype=torch.uint8).set_(storage, self.lo, (self.hi - self.lo,))


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range of t's storage that t covers."""
    itemsize = t.element_size()
    lo = t.storage_offset() * itemsize
    if t.numel() == 0:
        return lo, lo
    extent = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return lo, lo + (extent + 1) * itemsize


class _Op:
    __slots__ = ("issue_vc", "refs")

    def __init__(self, issue_vc: _Clock, refs=()):
        self.issue_vc, self.refs = issue_vc, list(refs)


class _Copy(_Op):
    __slots__ = ("nbytes",)


class _Work(_Op):
    __slots__ = ("fn", "result", "finished", "blocking", "scratch")


class _Record(_Op):
    __slots__ = ("event",)


class _Wait(_Op):
    __slots__ = ("event",)


class _Free(_Op):
    __slots__ = ("buf",)


class EmulatedDevice(Device):
    """See the module docstring. Public: live_bytes, peak_bytes, reset_peak(),
    hazards, copies (a log), host_syncs, calls and timed_events (counters),
    stream_of(), pinned_bytes, inject_failure(), close()."""

    kind = "emulated"
    observes = True
    alignment = 64  # the CPU tensors it is handed: PyTorch's CPU allocator's (its own blocks start at 512, as CUDA's)

    def __init__(self, bandwidth_gbps: float = 12.0, jitter: float = 0.0, seed: int = 0,
                 capacity_bytes: int | None = None, pin_latency_s: float = 0.0, compute_lag_s: float = 0.0,
                 log: bool = True):
        if not bandwidth_gbps > 0:
            raise ValueError(f"cswap.testing: bandwidth_gbps must be > 0 (math.inf: instant copies), "
                             f"got {bandwidth_gbps!r}")
        if jitter < 0:
            raise ValueError(f"cswap.testing: jitter must be >= 0 seconds, got {jitter!r}")
        if not compute_lag_s >= 0:
            raise ValueError(f"cswap.testing: compute_lag_s must be >= 0 seconds, got {compute_lag_s!r}")
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"cswap.testing: capacity_bytes must be None or >= 0, got {capacity_bytes!r}")
        self.device = torch.device("cpu")
        self.bandwidth = bandwidth_gbps * 1e9
        self.jitter = float(jitter)
        self.seed = seed
        self.capacity_bytes = capacity_bytes
        self.pin_latency_s = pin_latency_s
        self.compute_lag_s = float(compute_lag_s)
        self._lock = threading.RLock()
        self.host_vc = _Clock()
        self._compute = EmulatedStream(self, COMPUTE, "compute", caller=True)
        self._callers: list[EmulatedStream] = [self._compute]  # compute and the user streams
        self._current = threading.local()                       # .stream: the thread's, when not compute
        self._streams: dict[str, EmulatedStream] = {}           # the side streams, by role
        self._next_sid = COMPUTE + 1
        self._buffers: dict[int, _Buffer] = {}                 # storage data_ptr -> buffer
        self._free_blocks: dict[tuple[int, int], list[_Buffer]] = defaultdict(list)
        self._pinned_cache: dict[int, list[np.ndarray]] = defaultdict(list)
        self._failures: dict[str, list[BaseException]] = defaultdict(list)
        self._closed = False
        self.live_bytes = 0
        self.peak_bytes = 0
        self.allocator = CachingAllocatorModel()  # reserved memory, per stream pool, as CUDA's allocator holds it
        self.pinned_bytes = 0       # host memory pinned, cached blocks included
        self.hazards: list[str] = []
        # Times a host thread waited for the device: (thread name, sync point or "call on <stream>") -> count
        self.host_syncs: Counter = Counter()
        self._failing_allocations = None  # fail_allocations()
        self.calls: Counter = Counter()  # the runtime's calls of the seam, by name
        self.timed_events: Counter = Counter()  # events recorded with timing=True, by stream name
        self._depth = threading.local()
        # Logs for tests (off for the process-wide zero-delay device, which runs for ever):
        self.copies: deque = deque(maxlen=100_000 if log else 0)  # (stream, nbytes, start, end) per copy
        # (at, start, end, event time, by) per wait the caller sat through; by: "host" (a host
        # synchronization) or "compute" (the compute stream, which is the caller, waiting)
        self.waits: deque = deque(maxlen=100_000 if log else 0)

    def __repr__(self) -> str:
        return (f"<cswap emulated device: {self.bandwidth / 1e9:g} GB/s, jitter {self.jitter:g} s, "
                f"live {self.live_bytes} B, peak {self.peak_bytes} B>")

    # -- streams and events ----------------------------------------------------------------

    def compute_stream(self) -> EmulatedStream:
        """The calling thread's current stream (see the module docstring)."""
        return self._current_stream()

    def _current_stream(self) -> EmulatedStream:  # (what autograd's accesses are charged to)
        return getattr(self._current, "stream", self._compute)

    def user_stream(self, name: str = "user") -> EmulatedStream:
        """A new stream that runs on the caller, as compute does (a user's torch.cuda.Stream())."""
        with self._lock:
            stream = EmulatedStream(self, self._new_sid(), name, caller=True)
            self._callers.append(stream)
        return stream

    @contextmanager
    def stream(self, stream: EmulatedStream):
        """The calling thread's current stream is `stream` inside the block (torch.cuda.stream(s))."""
        if not (isinstance(stream, EmulatedStream) and stream.dev is self and stream.caller):
            raise ValueError(f"cswap emulated device: stream() takes the compute stream or one made by "
                             f"user_stream() on this device, got {stream!r}")
        before, self._current.stream = self._current_stream(), stream
        try:
            yield stream
        finally:
            self._current.stream = before

    def _new_sid(self) -> int:
        sid, self._next_sid = self._next_sid, self._next_sid + 1
        return sid

    def side_stream(self, role: str) -> EmulatedStream:
        with self._lock:
            stream = self._streams.get(role)
            if stream is None:
                if role not in SIDE_STREAMS:
                    raise ValueError(f"cswap.runtime: unknown stream role {role!r}")
                stream = EmulatedStream(self, self._new_sid(), role)
                stream.thread = threading.Thread(target=self._run, args=(stream,), daemon=True,
                                                 name=f"cswap-emulated-{role}")
                self._streams[role] = stream
                stream.thread.start()
            return stream

    def _tick(self, stream: EmulatedStream) -> int:
        """A new operation of a caller stream (compute's, a user's) or the host (they run in the caller)."""
        if stream is not None and stream.caller:
            stream.vc.merge(self.host_vc)
            stream.vc[stream.sid] = stream.vc.get(stream.sid, 0) + 1
            return stream.vc[stream.sid]
        self.host_vc[HOST] = self.host_vc.get(HOST, 0) + 1
        return self.host_vc[HOST]

    def record_event(self, stream: EmulatedStream, timing: bool = False, reuse=None) -> EmulatedEvent:
        return self._record(stream, timing, reuse)

    def _record(self, stream: EmulatedStream, timing: bool = False, reuse=None) -> EmulatedEvent:
        if timing:
            with self._lock:
                self.timed_events[stream.name] += 1
        if reuse is not None:  # (nobody refers to it: not even a stream's queue)
            reuse.__init__(self, stream, timing)
            event = reuse
        else:
            event = EmulatedEvent(self, stream, timing)
        with self._lock:
            if stream.caller or self._closed:  # (closed: everything has completed)
                self._tick(stream)
                event.vc.merge(stream.vc)
                event.time = time.perf_counter()
                if stream.caller and self.compute_lag_s and not self._closed:
                    event.time += self.compute_lag_s  # when compute, behind the host, reaches it
                    self._behind(event)
                else:
                    event.done.set()
            else:
                op = _Record(_Clock(self.host_vc))
                op.event = event
                self._enqueue(stream, op)
        return event

    def wait_event(self, stream: EmulatedStream, event: EmulatedEvent, at: str) -> None:
        if not sync.active(at):
            return
        if stream.caller:  # the compute stream (or a user's) is the caller: it waits here
            self._await(event, at, merge=False)
            with self._lock:
                stream.vc.merge(event.vc)
            if event.error is not None:
                raise event.error
            return
        with self._lock:
            op = _Wait(_Clock(self.host_vc))
            op.event = event
            self._enqueue(stream, op)

    def wait_stream(self, stream: EmulatedStream, other: EmulatedStream, at: str) -> None:
        if sync.active(at):
            self.wait_event(stream, self.record_event(other), at)

    def event_synchronize(self, event: EmulatedEvent, at: str | None) -> None:
        if at is not None and not sync.active(at):
            return
        self._await(event, at, merge=True)
        if event.error is not None:
            raise event.error

    def event_query(self, event: EmulatedEvent, at: str | None) -> bool:
        if at is not None and not sync.active(at):
            return True
        if not event.done.is_set():
            return False
        with self._lock:
            self.host_vc.merge(event.vc)
        if event.error is not None:
            raise event.error
        return True

    def _await(self, event: EmulatedEvent, at, merge: bool) -> None:
        start = time.perf_counter()
        if not event.done.wait(_DEADLOCK_S):
            raise RuntimeError(f"cswap emulated device: an event on {event.stream.name} did not complete within "
                               f"{_DEADLOCK_S:.0f} s (waited at {at}); the streams are deadlocked")
        end = time.perf_counter()
        with self._lock:
            if merge:
                self.host_vc.merge(event.vc)
                self.host_syncs[threading.current_thread().name, at] += 1
            self.waits.append((at, start, end, event.time, "host" if merge else "compute"))

    def elapsed_s(self, start: EmulatedEvent, end: EmulatedEvent) -> float | None:
        if not (start.timing and end.timing):  # as CUDA's elapsed_time refuses
            raise RuntimeError("cswap emulated device: elapsed time between events needs both recorded with "
                               "timing=True")
        if not (start.done.is_set() and end.done.is_set()):
            return None
        return end.time - start.time

    def record_stream(self, tensor: torch.Tensor, stream: EmulatedStream, at: str) -> None:
        if sync.active(at):
            with self._lock:
                self._track(tensor).recorded.add(stream)

    def synchronize(self) -> None:
        for stream in [*self._callers, *self._streams.values()]:
            self.event_synchronize(self.record_event(stream), None)

    def _behind(self, event: EmulatedEvent) -> None:
        """A caller stream's event completes at event.time, on the thread that keeps compute's
        lag (events are recorded in time order: one queue). Under the lock."""
        compute = self._compute
        if compute.thread is None:
            compute.thread = threading.Thread(target=self._run_behind, daemon=True, name="cswap-emulated-compute")
            compute.thread.start()
        compute.queue.append(event)
        compute.cv.notify()

    def _run_behind(self) -> None:
        while True:
            with self._lock:
                event = self._next_queued(self._compute)
            if event is None:
                return
            left = event.time - time.perf_counter()
            if left > 0:
                time.sleep(left)
            event.done.set()

    # -- work ------------------------------------------------------------------------------

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: EmulatedStream) -> None:
        nbytes = dst.numel() * dst.element_size()
        if nbytes != src.numel() * src.element_size():
            raise ValueError(f"cswap emulated device: copy of {src.numel() * src.element_size()} bytes into "
                             f"{nbytes}")
        if not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError("cswap emulated device: copies take contiguous tensors")
        with self._lock:
            op = _Copy(_Clock(self.host_vc), [self._ref(src, False, stream), self._ref(dst, True, stream)])
            op.nbytes = nbytes
            self._enqueue(stream, op)
            pageable = any(ref.buf.kind == "host" and not ref.buf.pinned for ref in op.refs)
        if pageable:  # as cudaMemcpyAsync with pageable memory: the host waits for the stream and the copy
            done = self.record_event(stream)
            self._await(done, "pageable copy", merge=True)
            if done.error is not None:  # (a synchronous copy reports its failure itself)
                raise done.error

    def launch(self, stream: EmulatedStream, fn, reads=(), writes=(), work=None, scratch_bytes: int = 0) -> None:
        self._work(stream, fn, reads, writes, blocking=False, scratch=scratch_bytes)

    def call(self, stream: EmulatedStream, fn, reads=(), writes=(), scratch_bytes: int = 0, work=None):
        with self._lock:  # the host waits for the stream (a codec reading sizes back)
            self.host_syncs[threading.current_thread().name, f"call on {stream.name}"] += 1
        op = self._work(stream, fn, reads, writes, blocking=True, scratch=scratch_bytes)
        if not op.finished.wait(_DEADLOCK_S):
            raise RuntimeError(f"cswap emulated device: work on {stream.name} did not finish within "
                               f"{_DEADLOCK_S:.0f} s; the streams are deadlocked")
        kind, value = op.result
        if kind == "error":
            raise value
        return value

    def _work(self, stream, fn, reads, writes, blocking: bool, scratch: int = 0) -> _Work:
        with self._lock:
            refs = [self._ref(t, False, stream) for t in reads] + [self._ref(t, True, stream) for t in writes]
            if stream.caller:
                raise ValueError("cswap emulated device: device work runs on a side stream")
            op = _Work(_Clock(self.host_vc), refs)
            op.fn, op.result, op.blocking, op.scratch = fn, None, blocking, scratch
            op.finished = threading.Event()
            self._enqueue(stream, op)
        return op

    def inject_failure(self, op: str = "copy", error: BaseException | None = None) -> None:
        """The next `op` ("copy" or "launch") on any side stream fails with `error`
        (default: a RuntimeError), reported as CUDA reports an asynchronous error."""
        if op not in ("copy", "launch"):
            raise ValueError(f"cswap emulated device: can inject failures into 'copy' or 'launch', got {op!r}")
        self._failures[op].append(error or RuntimeError(f"cswap emulated device: injected {op} failure"))

    def fail_allocations(self, when) -> None:
        """From now on the allocation of a tensor on a side stream (empty_as: a restored
        tensor; not the runtime's byte buffers) raises torch.OutOfMemoryError where
        `when(nbytes, stream name)` says so (None: stop), as the caching allocator would."""
        self._failing_allocations = when

    def empty_as(self, nbytes: int, dtype: torch.dtype, shape, stream: EmulatedStream, stride=None,
                 lead: int = 0) -> torch.Tensor:
        when = self._failing_allocations
        if when is not None and not stream.caller and when(int(nbytes), stream.name):
            raise torch.OutOfMemoryError(f"cswap emulated device: out of memory allocating {nbytes} bytes on "
                                         f"{stream.name} (injected)")
        return super().empty_as(nbytes, dtype, shape, stream, stride, lead)

    # -- the side streams' threads ------------------------------------------------------------

    def _enqueue(self, stream: EmulatedStream, op: _Op) -> None:
        if stream.caller:
            raise ValueError(f"cswap emulated device: copies and device work run on a side stream, not on "
                             f"{stream.name}")
        if self._closed and not isinstance(op, (_Free, _Record)):
            raise RuntimeError("cswap emulated device: the device is closed (its emulated_device() block has "
                               "ended); run backward inside the block that ran forward")
        if self._closed:  # nothing runs any more: a free needs no stream order now
            if isinstance(op, _Free):
                op.buf.frees_left -= 1
                if op.buf.frees_left == 0:
                    self._reclaim(op.buf)
            return
        for ref in op.refs:
            ref.buf.pending[stream.sid] += 1
        stream.queue.append(op)
        stream.cv.notify()

    def _next_queued(self, stream: EmulatedStream):
        """The next entry of the stream's queue, waited for; None once the device is closed
        and the queue is empty (the thread then stops). Under the lock."""
        while not stream.queue:
            if self._closed:
                return None
            stream.cv.wait()
        return stream.queue.popleft()

    def _run(self, stream: EmulatedStream) -> None:
        while True:
            with self._lock:
                op = self._next_queued(stream)
                if op is None:
                    return
                stream.vc.merge(op.issue_vc)
                stream.vc[stream.sid] = stream.vc.get(stream.sid, 0) + 1
                tick = stream.vc[stream.sid]
            try:
                self._execute(stream, op, tick)
            except BaseException as exc:  # noqa: BLE001 - the stream carries it to the next event
                with self._lock:
                    stream.error = stream.error or exc
            finally:
                self._done_with(stream, op)
            del op

    def _done_with(self, stream: EmulatedStream, op: _Op) -> None:
        """The op no longer uses its buffers (before its tensors are dropped: a
        storage that dies then is freed after the work, not during it)."""
        with self._lock:
            for ref in op.refs:
                ref.buf.pending[stream.sid] -= 1
            op.refs = []

    def _execute(self, stream: EmulatedStream, op: _Op, tick: int) -> None:
        if isinstance(op, _Record):
            with self._lock:
                op.event.vc.merge(stream.vc)
                op.event.error, stream.error = stream.error, None
                op.event.time = time.perf_counter()
            op.event.done.set()
        elif isinstance(op, _Wait):
            if not op.event.done.wait(_DEADLOCK_S):
                raise RuntimeError(f"cswap emulated device: {stream.name} waited {_DEADLOCK_S:.0f} s for an event "
                                   f"on {op.event.stream.name}; the streams are deadlocked")
            with self._lock:
                stream.vc.merge(op.event.vc)
                if op.event.error is not None:
                    stream.error = stream.error or op.event.error
        elif isinstance(op, _Copy):
            self._execute_copy(stream, op, tick)
        elif isinstance(op, _Work):
            self._execute_work(stream, op, tick)
        elif isinstance(op, _Free):
            with self._lock:
                op.buf.free_vc.merge(stream.vc)  # (what the allocator learns when it finds the free done)
                op.buf.frees_left -= 1
                if op.buf.frees_left == 0:
                    self._reclaim(op.buf)

    def _execute_copy(self, stream: EmulatedStream, op: _Copy, tick: int) -> None:
        start = time.perf_counter()
        duration = op.nbytes / self.bandwidth + (stream.rng.uniform(0.0, self.jitter) if self.jitter else 0.0)
        if math.isfinite(duration) and duration > 0:
            time.sleep(max(0.0, start + duration - time.perf_counter()))
        src_ref, dst_ref = op.refs
        with self._lock:
            ok = self._access(src_ref, stream, tick, "copy")
            ok = self._access(dst_ref, stream, tick, "copy") and ok
            src, dst = src_ref.tensor(), dst_ref.tensor()
            failure = self._failures["copy"].pop(0) if self._failures["copy"] else None
        if dst is not None:
            if ok and src is not None:
                dst.copy_(src)
            else:
                dst.fill_(POISON)
        self._done_with(stream, op)
        del src, dst
        end = time.perf_counter()
        with self._lock:
            self.copies.append((stream.name, op.nbytes, start, end))
        if failure is not None:
            raise failure

    def _execute_work(self, stream: EmulatedStream, op: _Work, tick: int) -> None:
        scratch = op.scratch
        with self._lock:
            ok = all([self._access(ref, stream, tick, "device work") for ref in op.refs])
            failure = None
            if not op.blocking and self._failures["launch"]:
                failure = self._failures["launch"].pop(0)
            elif scratch and self.capacity_bytes is not None and self.live_bytes + scratch > self.capacity_bytes:
                failure = torch.OutOfMemoryError(
                    f"cswap emulated device: out of memory allocating {scratch} bytes of scratch on {stream.name} "
                    f"({self.live_bytes} of {self.capacity_bytes} bytes in use)")
            elif scratch:
                reserve = self.allocator.allocate(stream, scratch)
                self._grow(scratch)
        try:
            if failure is not None:
                raise failure
            value = op.fn()
            if not ok:  # it computed from memory it had no right to read: its output is garbage
                for ref in op.refs:
                    out = ref.tensor() if ref.write else None
                    if out is not None:
                        out.fill_(POISON)
            op.result = ("value", value)
        except BaseException as exc:  # noqa: BLE001
            op.result = ("error", exc)
            if not op.blocking:
                raise
        finally:
            if scratch and failure is None:
                with self._lock:
                    self.live_bytes -= scratch
                    self.allocator.free(reserve)  # (the stream's own later work may take it)
            self._done_with(stream, op)
            op.fn = None
            op.finished.set()

    # -- the race detector -----------------------------------------------------------------------

    def _access(self, ref: _Ref, stream: EmulatedStream, tick: int, what: str) -> bool:
        """Check an access by `stream` (its clock after this op) and remember it; False on a hazard."""
        buf, vc = ref.buf, stream.vc
        ok = True
        for lo, hi, sid, t, write in buf.accesses:
            if (write or ref.write) and sid != stream.sid and lo < ref.hi and ref.lo < hi \
                    and not vc.covers(sid, t):
                ok = False
                self._hazard(f"{what} on {stream.name} {'writes' if ref.write else 'reads'} bytes "
                             f"[{ref.lo}, {ref.hi}) of a {buf.kind} buffer of {buf.nbytes} bytes that "
                             f"{self._stream_name(sid)} {'wrote' if write else 'read'} with no synchronisation "
                             f"ordering the two")
                break
        if buf.kind == "saved" and ref.strong is None and buf.storage() is None:
            ok = False
            self._hazard(f"{what} on {stream.name} used a saved tensor's memory after it was freed (the tensor "
                         f"was released before the work on it completed, and not record_stream()ed)")
        buf.accesses.append((ref.lo, ref.hi, stream.sid, tick, ref.write))
        del buf.accesses[:-_MAX_ACCESSES]
        return ok

    def _host_side_access(self, t: torch.Tensor, party, write: bool, what: str) -> bool:
        """An access by compute (party = the compute stream) or the host (party None)."""
        with self._lock:
            buf = self._track(t)
            lo, hi = self._range(t, buf)
            tick = self._tick(party)
            return self._access(_Ref(buf, lo, hi, write, None), party or _HostView(self), tick, what)

    def _hazard(self, message: str) -> None:
        self.hazards.append(message)

    def _stream_name(self, sid: int) -> str:
        if sid == HOST:
            return "the host"
        return next((s.name for s in (*self._callers, *self._streams.values()) if s.sid == sid), f"stream {sid}")

    # -- what the host and compute touch -------------------------------------------------------

    def on_saved(self, t: torch.Tensor) -> None:
        """The first save of a storage: compute wrote it before now (later saves of it,
        by other ops or as views, only refer to it)."""
        with self._lock:
            buf = self._track(t)
            if buf.counted or buf.kind != "saved":
                return
            if self.capacity_bytes is not None and self.live_bytes + buf.nbytes > self.capacity_bytes:
                # on a GPU the op's output allocation would have failed: the forward stops here
                raise torch.OutOfMemoryError(
                    f"cswap emulated device: out of memory holding a saved tensor of {buf.nbytes} bytes "
                    f"({self.live_bytes} of {self.capacity_bytes} bytes in use)")
            buf.counted = True
            buf.reserve = self.allocator.allocate(buf.stream, buf.nbytes)
            self._grow(buf.nbytes)
        self._host_side_access(t, self._current_stream(), True, "autograd's save")

    def uncounted_bytes(self, t: torch.Tensor) -> int:
        """A first save is where the emulator counts a saved storage (the op's allocation)."""
        with self._lock:
            buf = self._buffers.get(t.untyped_storage().data_ptr())
            counted = buf is not None and (buf.block is not None or buf.counted)
        return 0 if counted else t.untyped_storage().nbytes()

    def on_use(self, t: torch.Tensor) -> None:
        if not self._host_side_access(t, self._current_stream(), False, "backward's use"):
            lo, hi = _span(t)  # what a GPU would read there: not the data
            torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), lo, (hi - lo,)).fill_(POISON)

    def host_access(self, t: torch.Tensor, write: bool) -> None:
        self._host_side_access(t, None, write, "the host")

    # -- memory ------------------------------------------------------------------------------

    def _grow(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def empty(self, nbytes: int, stream: EmulatedStream) -> torch.Tensor:
        """Allocated bytes count the request rounded up to 512 (as CUDA's memory_allocated);
        blocks come in powers of two, so that cached ones serve later requests of drifting
        sizes (compressed buffers) as CUDA's block splitting would."""
        size = max(_BLOCK, -(-int(nbytes) // _BLOCK) * _BLOCK)
        block = 1 << (size - 1).bit_length()
        with self._lock:
            if self.capacity_bytes is not None and self.live_bytes + size > self.capacity_bytes:
                raise torch.OutOfMemoryError(
                    f"cswap emulated device: out of memory allocating {size} bytes ({self.live_bytes} of "
                    f"{self.capacity_bytes} bytes in use)")
            buf = self._cached(stream, block)
            if buf is None:
                buf = _Buffer("device", block, stream, block=_aligned(block))
                self._buffers[buf.block.ctypes.data] = buf
            buf.recorded = set()
            buf.in_use = size
            buf.reserve = self.allocator.allocate(stream, size)
            self._grow(size)
        return self._wrap(buf, nbytes, self._freed)

    def _cached(self, stream: EmulatedStream, block: int) -> _Buffer | None:
        """A freed block of this size and stream's pool whose guards have completed (the
        caching allocator queries the events record_stream put on other streams at its
        free, and takes a block only once they are done: what it knows then is the host's).
        Under the lock."""
        free = self._free_blocks[(stream.sid, block)]
        for i in range(len(free) - 1, -1, -1):
            buf = free[i]
            if all(event.done.is_set() for event in buf.guards):
                for event in buf.guards:
                    self.host_vc.merge(event.vc)
                if buf.free_vc is not None:  # the streams that held it finished with it: the host knows
                    self.host_vc.merge(buf.free_vc)
                buf.guards = []
                del free[i]
                return buf
        return None

    def _wrap(self, buf: _Buffer, nbytes: int, on_free) -> torch.Tensor:
        view = buf.block[:max(int(nbytes), 1)]
        weakref.finalize(view, on_free, buf)
        t = torch.frombuffer(view, dtype=torch.uint8)
        return t[:nbytes]

    def _freed(self, buf: _Buffer) -> None:
        """A device block's last tensor died: recycle it once the streams allow."""
        with self._lock:
            self.live_bytes -= buf.in_use
            buf.free_vc = _Clock(self.host_vc)
            waits = set(buf.recorded)
            callers = {s for s in waits if s.caller}  # (their work is the caller's: an event on each guards reuse)
            waits -= callers
            buf.guards = [self._record(s) for s in callers if s is not buf.stream]
            if buf.stream.caller:
                buf.free_vc.merge(buf.stream.vc)
            else:
                waits.add(buf.stream)
            self._check_free(buf, exempt={buf.stream.sid} | {s.sid for s in waits} | {s.sid for s in callers})
            buf.frees_left = len(waits)
            if not waits:
                self._reclaim(buf)
                return
            for stream in waits:
                op = _Free(_Clock(self.host_vc))
                op.buf = buf
                self._enqueue(stream, op)

    def _is_caller(self, sid: int) -> bool:
        """Accesses of a stream that runs on the caller (compute, a user's) precede a free in host order."""
        return any(s.sid == sid for s in self._callers)

    def _check_free(self, buf: _Buffer, exempt: set[int]) -> None:
        """Work of other streams that is pending, or not known to be done, when the memory is freed."""
        vc = buf.free_vc
        for sid, count in buf.pending.items():
            if count > 0 and sid not in exempt:
                self._hazard(f"a {buf.kind} buffer of {buf.nbytes} bytes was freed while work on "
                             f"{self._stream_name(sid)} still used it (no record_stream, no wait)")
                return
        for lo, hi, sid, t, write in buf.accesses:
            if sid not in exempt and sid != HOST and not self._is_caller(sid) and not vc.covers(sid, t):
                self._hazard(f"a {buf.kind} buffer of {buf.nbytes} bytes was freed with no synchronisation "
                             f"after {self._stream_name(sid)}'s use of it")
                return

    def _reclaim(self, buf: _Buffer) -> None:
        buf.block.fill(POISON)  # what the next allocation of this block would leave there
        buf.recorded = set()
        self._free_blocks[(buf.stream.sid, buf.nbytes)].append(buf)
        self.allocator.free(buf.reserve)

    def host_empty(self, nbytes: int, pinned: bool) -> torch.Tensor:
        # As PyTorch's caching host allocator: a power of two per pinned block.
        size = 1 << max(int(nbytes) - 1, 0).bit_length() if pinned else int(nbytes)
        with self._lock:
            cached = self._pinned_cache[size] if pinned else None
            block = cached.pop() if cached else None
        if block is None:
            if pinned:
                if self.pin_latency_s:
                    time.sleep(self.pin_latency_s)  # cudaHostAlloc takes milliseconds
                with self._lock:
                    self.pinned_bytes += size
            block = np.full(max(size, 1), POISON, dtype=np.uint8)
        with self._lock:
            buf = self._buffers.get(block.ctypes.data)
            if buf is None or buf.block is not block:
                buf = _Buffer("host", size, self._compute, block=block)
                buf.pinned = pinned
                self._buffers[block.ctypes.data] = buf
        return self._wrap(buf, nbytes, self._host_freed)

    def _host_freed(self, buf: _Buffer) -> None:
        with self._lock:
            if buf.pinned:  # PyTorch's host allocator keeps the block for reuse
                self._pinned_cache[buf.nbytes].append(buf.block)
            else:
                self._buffers.pop(buf.block.ctypes.data, None)

    def empty_host_cache(self) -> None:
        with self._lock:
            for size, blocks in self._pinned_cache.items():
                for block in blocks:
                    self.pinned_bytes -= size
                    self._buffers.pop(block.ctypes.data, None)
            self._pinned_cache.clear()

    def memory_allocated(self) -> int:
        return self.live_bytes

    def max_memory_allocated(self) -> int:
        return self.peak_bytes

    def memory_reserved(self) -> int:
        return self.allocator.reserved

    def max_memory_reserved(self) -> int:
        return self.allocator.reserved  # (segments are never given back: the peak is now)

    def total_memory(self) -> int | None:
        return self.capacity_bytes

    def usable_memory(self) -> int | None:
        return self.capacity_bytes

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes

    def stream_of(self, t: torch.Tensor) -> str | None:
        """The name of the stream whose pool `t`'s memory came from (None: not this device's
        allocation, e.g. a tensor autograd made)."""
        with self._lock:
            buf = self._buffers.get(t.untyped_storage().data_ptr())
            if buf is None or buf.block is None or buf.kind != "device":
                return None
            return buf.stream.name

    # -- tracking ------------------------------------------------------------------------------

    def _track(self, t: torch.Tensor) -> _Buffer:
        """The buffer holding t's storage; an unknown storage is taken as autograd's."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        buf = self._buffers.get(ptr)
        if buf is not None and (buf.block is not None or buf.storage() is storage):
            return buf
        buf = _Buffer("saved", storage.nbytes(), self._current_stream(), storage=weakref.ref(storage))
        self._buffers[ptr] = buf
        weakref.finalize(storage, self._saved_freed, buf, ptr)
        return buf

    def _saved_freed(self, buf: _Buffer, ptr: int) -> None:
        with self._lock:
            if self._buffers.get(ptr) is buf:
                del self._buffers[ptr]
            if buf.counted:
                self.live_bytes -= buf.nbytes
                self.allocator.free(buf.reserve)
            buf.free_vc = _Clock(self.host_vc)
            buf.free_vc.merge(buf.stream.vc)
            self._check_free(buf, exempt={buf.stream.sid} | {s.sid for s in buf.recorded})

    def _range(self, t: torch.Tensor, buf: _Buffer) -> tuple[int, int]:
        lo, hi = _span(t)
        if buf.block is not None:  # a view into an emulated block: offsets from the block's start
            base = t.untyped_storage().data_ptr() - buf.block.ctypes.data
            lo, hi = lo + base, hi + base
        return lo, hi

    def _ref(self, t: torch.Tensor, write: bool, stream: EmulatedStream) -> _Ref:
        buf = self._track(t)
        lo, hi = self._range(t, buf)
        strong = None
        if buf.block is None and (stream in buf.recorded or buf.stream is stream):
            strong = t.untyped_storage()
        return _Ref(buf, lo, hi, write, strong)

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish queued work and stop the stream threads."""
        self.synchronize()
        with self._lock:
            self._closed = True
            streams = [s for s in (self._compute, *self._streams.values()) if s.thread is not None]
            for stream in streams:
                stream.cv.notify_all()
        for stream in streams:
            stream.thread.join(timeout=_DEADLOCK_S)


# The seam's calls, counted per name in EmulatedDevice.calls (the outermost call of a thread
# only: the emulator's own calls of its methods are not the runtime's).
_COUNTED = ("compute_stream", "side_stream", "capturing", "record_event", "wait_event", "wait_stream",
            "event_synchronize", "event_query", "elapsed_s", "record_stream", "synchronize", "copy", "copy_all",
            "launch", "call", "empty", "empty_as", "host_empty", "empty_host_cache")


def _counting(name: str, method):
    def counted(self, *args, **kwargs):
        depth = self._depth
        outer = not getattr(depth, "n", 0)
        if outer:
            with self._lock:
                self.calls[name] += 1
        depth.n = getattr(depth, "n", 0) + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            depth.n -= 1

    counted.__name__, counted.__doc__, counted.__wrapped__ = method.__name__, method.__doc__, method
    return counted


for _name in _COUNTED:
    setattr(EmulatedDevice, _name, _counting(_name, getattr(EmulatedDevice, _name)))


class _HostView:
    """The host as the party of an access (its clock is the device's host clock)."""

    sid = HOST
    name = "the host"

    def __init__(self, dev: EmulatedDevice):
        self.vc = dev.host_vc


_DEFAULT = ImmediateDevice()
_ACTIVE: list[Device] = []
_STATE = threading.Lock()


def current() -> Device:
    """The device CPU tensors use: the innermost active emulator, else one whose every
    operation completes at once and checks nothing (cswap.runtime.immediate)."""
    if not _ACTIVE:  # (a list's truth is read atomically: no lock on the common path)
        return _DEFAULT
    with _STATE:
        return _ACTIVE[-1] if _ACTIVE else _DEFAULT


def is_default(dev: Device) -> bool:
    return dev is _DEFAULT


@contextmanager
def activate(dev: Device):
    """CPU tensors offloaded inside this block take `dev` (an emulator, or any device of the seam for CPU tensors)."""
    with _STATE:
        _ACTIVE.append(dev)
    try:
        yield dev
    finally:
        with _STATE:
            _ACTIVE.remove(dev)
