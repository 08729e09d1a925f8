"""The device seam: every device operation the runtime performs, in one place.

The runtime (swapper, offload, restore, host pool, profiler) talks to a device
only through a `Device`. Two implementations share this interface:

- `CudaDevice`: torch.cuda, what users run (one per CUDA device, so events,
  streams, synchronize and memory stats always name the tensor's device);
- `cswap.runtime.emulator.EmulatedDevice`: an asynchronous device emulated on
  CPU, for tests and development, with CUDA's ordering semantics, late copies,
  the caching allocator's reuse hazard and a race detector.

Streams and events are the implementation's own objects; the runtime never
calls their methods directly but goes through the device, naming each
synchronisation point (`at=`, see cswap.runtime.sync) so tests can switch one
off. Work that runs on a stream is handed over as a function: `launch` runs
it asynchronously (CUDA: now, with the stream current, its kernels queued;
emulator: on the stream's thread, in order), `call` runs it and returns its
value (for work that reads a result back on the host, as codecs do to size
their output).

`on_saved`, `on_use` and `host_access` tell the device what the host and
the compute stream touch (they are no-ops on CUDA, where the hardware needs no
telling; the emulator accounts memory and checks races with them).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
import time
from typing import Callable, NamedTuple

import torch

from . import sync

__all__ = ["Device", "CudaDevice", "Work", "device_of"]

SIDE_STREAMS = ("codec", "d2h", "h2d")


class Work(NamedTuple):
    """What a `launch` or `call` does, for a device that times device work (the timed
    twin, cswap.runtime.twin; the others ignore it): `kind` is "encode" or "decode"
    (of `codec`), "gather" (a copy on the device) or "checksum"; `nbytes` are the
    tensor's own bytes (encode's input, decode's output), of elements of `itemsize`."""

    kind: str
    codec: str | None
    nbytes: int
    itemsize: int = 4


class Device:
    """The operations the runtime needs from a device (see the module docstring)."""

    kind: str = "device"
    device: torch.device
    # Whether the runtime tells it what the host and compute touch (on_saved, on_use,
    # host_access, uncounted_bytes): the emulator, whose accounting and race checks need it.
    observes: bool = False
    # The least the default stash and prefetch windows hold: below it, what a group of copies
    # costs the host per call (events, waits) matters more than the device memory it holds.
    window_floor_bytes: int = 0
    # Where its allocator starts a fresh tensor (bytes). A restored tensor starts at the
    # address its original had modulo this (Item.lead): kernels choose their path, and so
    # their rounding, by alignment as well as strides (cuBLASLt by up to 256 bytes, vectorized
    # reductions by 16). CUDA's caching allocator: 512.
    alignment: int = 512

    @functools.cached_property
    def nothing(self) -> torch.Tensor:
        """An empty tensor on this device: what a released item's source tensor points at
        (it drops the storage and keeps the version counter, cswap.runtime.items)."""
        return torch.empty(0, device=self.device)

    # -- streams and events ----------------------------------------------------------------
    def compute_stream(self):
        """The caller's current stream, where autograd's work runs."""
        raise NotImplementedError

    def side_stream(self, role: str):
        """The runtime's stream for `role` ("codec", "d2h" or "h2d"), made once per device."""
        raise NotImplementedError

    def record_event(self, stream, timing: bool = False, reuse=None):
        """An event recorded on `stream` (`timing`: elapsed_s can time it); `reuse`: an
        event of this device's, not timing, that nobody refers to any more, recorded anew
        instead of a new one (cswap.runtime.lanes keeps a pool of them)."""
        raise NotImplementedError

    def wait_event(self, stream, event, at: str) -> None:
        """Work queued on `stream` from now on waits for `event`."""
        raise NotImplementedError

    def wait_stream(self, stream, other, at: str) -> None:
        """Work queued on `stream` from now on waits for all work queued on `other` so far."""
        raise NotImplementedError

    def event_synchronize(self, event, at: str) -> None:
        """The host waits until `event` has completed."""
        raise NotImplementedError

    def event_query(self, event, at: str) -> bool:
        """Whether `event` has completed (the host then knows all work before it is done)."""
        raise NotImplementedError

    def elapsed_s(self, start, end) -> float | None:
        """Seconds between two completed timing events, None while either is pending."""
        raise NotImplementedError

    def record_stream(self, tensor: torch.Tensor, stream, at: str) -> None:
        """`tensor`'s memory is not recycled before work queued on `stream` so far completes."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """The host waits for every stream of this device."""
        raise NotImplementedError

    def host_time(self) -> float:
        """The calling thread's clock in seconds, for timing its waits (the timed twin's is virtual)."""
        return time.perf_counter()

    def capturing(self) -> bool:
        """The compute stream is being captured into a CUDA graph: nothing may be queued
        on other streams, recorded or waited for, so saved tensors stay in place."""
        return False

    def guard(self):
        """A context in which this device is the thread's current one (CUDA: work the
        runtime starts itself, such as building kernels, lands on it, and no thread
        makes a context on another GPU)."""
        return contextlib.nullcontext()

    # -- work ------------------------------------------------------------------------------
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        """Copy src into dst (same number of bytes) asynchronously on `stream`."""
        raise NotImplementedError

    def copy_all(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream) -> None:
        """`copy` for each pair, in order (CUDA: one foreach call queues them all)."""
        for dst, src in zip(dsts, srcs):
            self.copy(dst, src, stream)

    def launch(self, stream, fn: Callable[[], object], reads=(), writes=(), work: Work | None = None,
               scratch_bytes: int = 0) -> None:
        """Run device work `fn` on `stream` asynchronously; `reads`/`writes`: the tensors it touches;
        `work`: what it does (Work); `scratch_bytes` as call's."""
        raise NotImplementedError

    def call(self, stream, fn: Callable[[], object], reads=(), writes=(), scratch_bytes: int = 0,
             work: Work | None = None):
        """Run `fn` on `stream` and return its value; fn may wait for its own work on the stream.
        `scratch_bytes`: at most what fn allocates on the device beside its outputs (CUDA's
        allocator counts it itself; the emulator charges it while fn runs); `work` as launch's."""
        raise NotImplementedError

    # -- memory ----------------------------------------------------------------------------
    def empty(self, nbytes: int, stream) -> torch.Tensor:
        """A 1-D uint8 device buffer, allocated for use on `stream`."""
        raise NotImplementedError

    def empty_as(self, nbytes: int, dtype: torch.dtype, shape, stream, stride=None, lead: int = 0) -> torch.Tensor:
        """A dense device tensor of `dtype` and `shape` (`nbytes` in all) with `stride` (None:
        contiguous), allocated for use on `stream`: `empty`'s bytes, as that tensor, starting
        `lead` bytes into them (a multiple of the dtype's size, below `alignment`)."""
        flat = self.empty(lead + nbytes, stream)[lead:].view(dtype)
        return flat.view(shape) if stride is None else flat.as_strided(shape, stride)

    def host_empty(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A 1-D uint8 host buffer for copies (pinned, or pageable). PyTorch's caching host
        allocator pins a power of two for any request (ATen/core/CachingHostAllocator.h,
        PowerOf2Ceil) and keeps freed blocks until empty_host_cache(): the host pool asks
        for powers of two, so what it counts is what is pinned."""
        raise NotImplementedError

    def empty_host_cache(self) -> None:
        """Give freed pinned blocks cached by the host allocator back to the system."""

    def memory_allocated(self) -> int:
        raise NotImplementedError

    def max_memory_allocated(self) -> int:
        raise NotImplementedError

    def memory_reserved(self) -> int:
        raise NotImplementedError

    def max_memory_reserved(self) -> int:
        raise NotImplementedError

    def reset_peak(self) -> None:
        raise NotImplementedError

    def total_memory(self) -> int | None:
        """The device's memory in bytes (None: unlimited)."""
        raise NotImplementedError

    def usable_memory(self) -> int | None:
        """What memory_allocated() can reach now: free memory plus what PyTorch holds (None: unlimited)."""
        raise NotImplementedError

    # -- what the host and compute touch (the emulator's accounting and race checks) ---------
    def on_saved(self, t: torch.Tensor) -> None:
        """Autograd saved `t`, written by compute before now."""

    def uncounted_bytes(self, t: torch.Tensor) -> int:
        """Bytes saving `t` will add to memory_allocated() (on a GPU, none: its op allocated them)."""
        return 0

    def on_use(self, t: torch.Tensor) -> None:
        """Compute reads `t` from now on."""

    def host_access(self, t: torch.Tensor, write: bool) -> None:
        """The host reads (or writes) host buffer `t` now."""


class CudaDevice(Device):
    """torch.cuda for one CUDA device; every call names that device, or runs with it
    current: a worker thread's current device is GPU 0 until set, and entering a stream
    context or pinning memory there would make a context on GPU 0 in a process that
    trains on another.

    A device and stream are made current through torch's C calls (`_Current`), not
    torch.cuda.device and torch.cuda.stream: those Python context managers build
    Stream objects and look devices up on every entry, microseconds each, and an
    offloaded tensor passes through the seam about 25 times (measured on an H200's
    host, the CUDA path cost 3x its CPU stand-in per tensor)."""

    kind = "cuda"
    window_floor_bytes = 16 << 20

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"cswap.runtime: CudaDevice needs an indexed CUDA device, got {device}")
        self.index = self.device.index
        self._streams: dict[str, object] = {}
        self._known: dict[tuple, object] = {}  # (id, device, type) -> the Stream compute_stream returns for it
        self._lock = threading.Lock()

    def compute_stream(self):
        # torch.cuda.current_stream builds a new Stream each call; one per stream is kept.
        key = torch._C._cuda_getCurrentStream(self.index)
        stream = self._known.get(key)
        if stream is None:
            stream = self._known[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        return stream

    def guard(self):
        return _Current(self.index, None)

    def side_stream(self, role: str):
        stream = self._streams.get(role)  # (made once per role: the lock is for making it)
        if stream is not None:
            return stream
        with self._lock:
            stream = self._streams.get(role)
            if stream is None:
                if role not in SIDE_STREAMS:
                    raise ValueError(f"cswap.runtime: unknown stream role {role!r}")
                with _Current(self.index, None):
                    stream = _own_stream(self.device) or torch.cuda.Stream(self.device)
                self._streams[role] = stream
            return stream

    def capturing(self) -> bool:
        return torch._C._cuda_isCurrentStreamCapturing()  # (torch.cuda.is_current_stream_capturing, one frame less)

    def record_event(self, stream, timing: bool = False, reuse=None):
        # blocking=True: a host thread waiting on it sleeps instead of spinning a core.
        event = reuse if reuse is not None else torch.cuda.Event(enable_timing=timing, blocking=True)
        event.record(stream)
        return event

    def wait_event(self, stream, event, at: str) -> None:
        if sync.active(at):
            stream.wait_event(event)

    def wait_stream(self, stream, other, at: str) -> None:
        if sync.active(at):
            stream.wait_stream(other)

    def event_synchronize(self, event, at: str) -> None:
        if sync.active(at):
            event.synchronize()

    def event_query(self, event, at: str) -> bool:
        return event.query() if sync.active(at) else True

    def elapsed_s(self, start, end) -> float | None:
        if not (start.query() and end.query()):
            return None
        return start.elapsed_time(end) / 1e3

    def record_stream(self, tensor: torch.Tensor, stream, at: str) -> None:
        if sync.active(at):
            tensor.record_stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        with _Current(self.index, stream):
            dst.copy_(src, non_blocking=True)

    def copy_all(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream) -> None:
        with _Current(self.index, stream):
            torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def launch(self, stream, fn, reads=(), writes=(), work=None, scratch_bytes: int = 0) -> None:
        with _Current(self.index, stream):
            fn()

    def call(self, stream, fn, reads=(), writes=(), scratch_bytes: int = 0, work=None):
        with _Current(self.index, stream):
            return fn()

    def empty(self, nbytes: int, stream) -> torch.Tensor:
        with _Current(self.index, stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    @functools.cached_property
    def nothing(self) -> torch.Tensor:
        with _Current(self.index, None):  # (made on whichever thread releases first)
            return torch.empty(0, device=self.device)

    def empty_as(self, nbytes: int, dtype: torch.dtype, shape, stream, stride=None, lead: int = 0) -> torch.Tensor:
        if lead:
            return super().empty_as(nbytes, dtype, shape, stream, stride, lead)
        with _Current(self.index, stream):  # (one allocation, no views)
            if stride is None:
                return torch.empty(shape, dtype=dtype, device=self.device)
            return torch.empty_strided(shape, stride, dtype=dtype, device=self.device)

    def host_empty(self, nbytes: int, pinned: bool) -> torch.Tensor:
        with _Current(self.index, None):  # pinning registers the memory with the current device's context
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def empty_host_cache(self) -> None:
        free = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
        if free is not None:
            with _Current(self.index, None):
                free()

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def max_memory_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def total_memory(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    def usable_memory(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device)


class _Current:
    """Within it, device `index` is the thread's current device and `stream` (if not
    None) its current stream there; both are restored after. What
    `with torch.cuda.device(i), torch.cuda.stream(s):` does, in four C calls."""

    __slots__ = ("index", "stream", "previous_device", "previous_stream")

    def __init__(self, index: int, stream):
        self.index, self.stream = index, stream

    def __enter__(self):
        self.previous_device = torch._C._cuda_exchangeDevice(self.index)
        stream = self.stream
        if stream is not None:
            self.previous_stream = torch._C._cuda_getCurrentStream(self.index)
            torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                                     device_type=stream.device_type)
        return self

    def __exit__(self, *exc):
        if self.stream is not None:
            stream_id, device_index, device_type = self.previous_stream
            torch._C._cuda_setStream(stream_id=stream_id, device_index=device_index, device_type=device_type)
        torch._C._cuda_maybeExchangeDevice(self.previous_device)
        return False


_CUDA_STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking: no implicit sync with the legacy default stream


def _own_stream(device: torch.device):
    """A stream of cswap's own on `device` (current), or None. torch.cuda.Stream()
    hands out PyTorch's pooled streams round robin, which NCCL's process groups and
    other libraries draw from too: sharing one would serialise a copy behind a
    collective. Made as PyTorch makes its pool's (non-blocking), through the CUDA
    runtime PyTorch loaded, and given to torch as an ExternalStream; kept for the
    process's life (three per device)."""
    runtime = _cuda_runtime()
    if runtime is None:
        return None
    handle = ctypes.c_void_p()
    if runtime.cudaStreamCreateWithFlags(ctypes.byref(handle), _CUDA_STREAM_NON_BLOCKING) != 0 or not handle.value:
        return None
    return torch.cuda.ExternalStream(handle.value, device=device)


@functools.cache
def _cuda_runtime():
    """The CUDA runtime library this process loaded with PyTorch (from its memory
    map: the same copy, so the same current device), or None (not Linux, or a
    PyTorch linked with the runtime statically)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libcudart.so" in line})
    except OSError:
        return None
    for path in paths:
        try:
            runtime = ctypes.CDLL(path)
            create = runtime.cudaStreamCreateWithFlags
        except (OSError, AttributeError):
            continue
        create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        create.restype = ctypes.c_int
        return runtime
    return None


_CUDA: dict[int, CudaDevice] = {}
_CUDA_LOCK = threading.Lock()


def device_of(t: torch.Tensor) -> Device | None:
    """The device `t` lives on: CUDA, or for CPU tensors the active emulator (the
    one `cswap.testing.emulated_device()` opened, else a zero-delay one); None for
    devices cswap does not offload from."""
    if t.is_cuda:
        index = t.get_device()  # (an int: t.device builds a torch.device per call)
        dev = _CUDA.get(index)  # (made once per device: the lock is for making it)
        if dev is None:
            with _CUDA_LOCK:
                dev = _CUDA.get(index)
                if dev is None:
                    dev = _CUDA[index] = CudaDevice(torch.device("cuda", index))
        return dev
    if t.is_cpu:
        return _emulated_current()
    return None


def _emulated_current():
    global _emulated_current
    from .emulator import current  # (imported once: emulator imports this module)

    _emulated_current = current
    return current()
