"""Host buffers for copies (pinned when possible), reused across iterations.

Pinning memory costs milliseconds and synchronises the device, so the
swapper never pins per tensor in steady state: a buffer returned to the pool
waits (event guarded) until the last copy that read or wrote it has
finished, then serves the next request.

Size classes are powers of two (at least 512 bytes), because that is what
PyTorch's caching host allocator really pins for any request (it rounds every
block up to a power of two, ATen/core/CachingHostAllocator.h): counting
classes counts the memory truly held. A request takes an idle buffer of its
class, else the smallest idle one of up to four times its class: the first,
profiling iteration offloads uncompressed and so sizes the pool for every
later iteration that compresses by up to 4x.

The pool has its own lock and allocates outside it: a pinned allocation on
the offload worker never blocks forward, which only takes the swapper's lock.
Lock order: the swapper's lock, then the pool's (the swapper returns buffers
while holding its own); the pool calls nothing outside itself while holding its
lock, its warnings included.

Idle buffers go back to the system at `max_bytes`, and at `trim_idle()`: a
buffer no request used since the previous trim_idle (or `restart_use`) is
freed, and the host allocator's cache emptied so the memory really leaves the
process. Freeing pinned memory synchronises the device, hence rarely: cswap
trims at each epoch end, and once after the timed step, whose plan may leave
some of its buffers unused (see Swapper._trim_after_timed_pass).
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from typing import Callable

import torch

__all__ = ["HostPool", "idle", "size_class"]

_REUSE_UP_TO = 4  # an idle buffer serves requests down to a quarter of its size
_VIEWS_PER_BUFFER = 64  # (a buffer holding a group of tensors has a view per tensor, in two directions at most)


def size_class(nbytes: int) -> int:
    """n rounded up to a power of two, at least 512 bytes."""
    return 1 << (max(int(nbytes), 512) - 1).bit_length()


def idle(event, dev) -> bool:
    """The buffer's last copy is over: done, or failed (that failure was reported through
    the item that copied; the buffer holds nothing anyone waits for). Without this a pool
    buffer whose copy failed raised the old failure at every later use, in every step."""
    if event is None:
        return True
    try:
        return dev.event_query(event, at="host_pool.buffer_free")
    except Exception:  # noqa: BLE001 - the copy's own failure, already on its item
        return True


class HostPool:
    """Host buffers (pinned when possible) bounded by `max_bytes` in all.

    acquire(n, dev) -> a 1-D uint8 tensor of at least n bytes, or None when the
    bound would be exceeded even after dropping idle buffers (the caller then
    keeps its tensor on the device). release(buf, event) returns a buffer; it is
    reused only once `event` (the last copy touching it) has completed. pin_idle(sizes,
    dev) pins buffers ahead of the requests that will take them.
    `warn(key, message)` reports fallbacks (once per key) to the user's thread.
    """

    def __init__(self, max_bytes: int, pin_memory: bool = True, warn: Callable[[str, str], None] | None = None):
        if max_bytes < 0:
            raise ValueError(f"cswap.HostPool: max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.pin_memory = pin_memory
        self.pinned = pin_memory
        self._warn = warn or (lambda key, message: None)
        self._lock = threading.Lock()
        self._free: dict[int, list[tuple[torch.Tensor, object, object]]] = defaultdict(list)  # (buf, event, dev)
        self._devices: set = set()
        self.reserved_bytes = 0      # every buffer the pool owns, idle or lent, as really held
        self.peak_reserved_bytes = 0
        self.allocations = 0         # buffers created (pinned allocations made)
        self._used: set[int] = set()  # data_ptr of buffers acquired since the last trim_idle
        # data_ptr of a buffer -> {(dtype, shape): a view of its first bytes}. (An address, not id(): a
        # view holds its buffer's memory, so no other buffer can be given that address meanwhile.)
        self._views: dict[int, dict] = {}

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(buf.numel() for bufs in self._free.values() for buf, _, _ in bufs)

    def acquire(self, nbytes: int, dev, allocate: bool = True) -> torch.Tensor | None:
        """allocate=False: an idle buffer, or None (nothing allocated or freed, no warning)."""
        cls = size_class(nbytes)
        with self._lock:
            buf = self._reuse(cls)
            if buf is not None or not allocate:
                return buf
            if self.reserved_bytes + cls > self.max_bytes:
                self._free_idle(lambda b: self.reserved_bytes + cls > self.max_bytes)
            reserved = self._reserve(cls)
        if not reserved:  # warned outside the lock: the warning takes the swapper's lock, which is taken before ours
            self._warn("host-limit", f"cswap: host memory limit of {self.max_bytes / 2**30:.2f} GiB reached; "
                                     f"new tensors stay on the device until buffers come back (raise "
                                     f"max_host_bytes to offload more)")
            return None
        return self._allocate_reserved(cls, dev, used=True)

    def pin_idle(self, sizes, dev) -> int:
        """Make sure an idle buffer fits each of `sizes` (bytes), one each, pinning the
        missing ones within the bound; the number pinned. Nothing is freed or warned of:
        a request that later meets the limit is handled then. (Buffers pinned ahead of the
        requests, off the copies' path: see Offloader.flush.)"""
        taken, missing = [], []
        with self._lock:
            for cls in map(size_class, sizes):
                buf = self._reuse(cls, mark=False)
                if buf is None:
                    missing.append(cls)
                else:
                    taken.append(buf)
            for buf in taken:  # (idle: their last copies had completed)
                self._free[buf.numel()].append((buf, None, None))
        pinned = 0
        for cls in missing:
            with self._lock:
                if not self._reserve(cls):
                    continue
            buf = self._allocate_reserved(cls, dev, used=False)  # (used from the request that takes it)
            if buf is not None:
                self.release(buf)
                pinned += 1
        return pinned

    def acquire_each(self, sizes, dev) -> list[torch.Tensor] | None:
        """An idle buffer for each of `sizes` (bytes), or None, taking none, when one has no
        idle buffer; nothing is allocated. (A group of copies out whose one buffer of the
        group's size is not there yet takes the buffers its tensors had alone, in the timed
        step: its copies wait for no pinning.)"""
        taken = [None] * len(sizes)
        with self._lock:
            # (the smallest first, each taking the smallest idle buffer that fits it, leaves the
            # larger buffers to the larger requests)
            for i in sorted(range(len(sizes)), key=lambda i: sizes[i]):
                taken[i] = self._reuse(size_class(sizes[i]), mark=False)
                if taken[i] is None:
                    for back in taken:  # (idle: their last copies had completed)
                        if back is not None:
                            self._free[back.numel()].append((back, None, None))
                    return None
            self._used.update(buf.data_ptr() for buf in taken)
            return taken

    def _reuse(self, cls: int, mark: bool = True) -> torch.Tensor | None:
        """An idle buffer of this class, else the smallest of up to _REUSE_UP_TO times it,
        whose last copy has completed (the oldest first: its copy is the likeliest done).
        `mark`: count it as used (see trim_idle)."""
        fit = cls
        while fit <= _REUSE_UP_TO * cls:  # classes are powers of two
            bufs = self._free.get(fit)
            if bufs:
                for i, (buf, event, dev) in enumerate(bufs):
                    if idle(event, dev):
                        del bufs[i]
                        if mark:
                            self._used.add(buf.data_ptr())
                        return buf
            fit <<= 1
        return None

    def view(self, buf: torch.Tensor, dtype: torch.dtype, shape, offset: int = 0) -> torch.Tensor:
        """buf's bytes from `offset` (a multiple of dtype's size) as a tensor of `dtype` and
        `shape`, made once per buffer and kind and kept with it: a copy between a pooled
        buffer and a tensor needs no new views each step (a network saves the same shapes
        every pass)."""
        key = (dtype, tuple(shape), offset)
        address = buf.data_ptr()
        views = self._views.get(address)
        if views is None or len(views) >= _VIEWS_PER_BUFFER:  # (shapes that change every pass start over)
            views = self._views[address] = {}
        view = views.get(key)
        if view is None:
            nbytes = dtype.itemsize * math.prod(key[1])
            view = views[key] = buf[offset: offset + nbytes].view(dtype).view(key[1])
        return view

    def release(self, buf: torch.Tensor, event=None, dev=None) -> None:
        with self._lock:
            self._free[buf.numel()].append((buf, event, dev))

    def restart_use(self) -> None:
        """Count buffers as used from now on only (the next trim_idle frees the rest)."""
        with self._lock:
            self._used.clear()

    def trim_idle(self) -> int:
        """Free the idle buffers no request used since the previous call; the bytes freed."""
        with self._lock:
            before = self.reserved_bytes
            self._free_idle(lambda buf: buf.data_ptr() not in self._used)
            self._used.clear()
            freed = before - self.reserved_bytes
        self._empty_host_caches()
        return freed

    def clear(self) -> None:
        """Drop every idle buffer (lent ones come back later as usual)."""
        with self._lock:
            self._free_idle(lambda buf: True)
        self._empty_host_caches()

    def _empty_host_caches(self) -> None:
        """Freed pinned blocks stay cached by PyTorch's host allocator until emptied."""
        if self.pinned:
            for dev in list(self._devices):
                dev.empty_host_cache()

    def _reserve(self, cls: int) -> bool:
        """Count cls bytes as held, for an allocation made outside the lock, if the bound allows."""
        if self.reserved_bytes + cls > self.max_bytes:
            return False
        self.reserved_bytes += cls
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return True

    def _allocate_reserved(self, cls: int, dev, used: bool) -> torch.Tensor | None:
        """A new buffer of the cls bytes _reserve counted (given back if none could be made)."""
        buf = self._allocate(cls, dev, self.pinned)
        with self._lock:
            if buf is None:
                self.reserved_bytes -= cls
                return None
            self.allocations += 1
            if used:
                self._used.add(buf.data_ptr())
            self._devices.add(dev)
        return buf

    def _allocate(self, cls: int, dev, pinned: bool) -> torch.Tensor | None:
        if pinned:
            try:
                return dev.host_empty(cls, pinned=True)
            except RuntimeError as exc:
                self.pinned = False
                self._warn("pageable", f"cswap: pinned host memory unavailable ({exc}); falling back to pageable "
                                       f"memory, which makes copies synchronous and slower")
        try:
            return dev.host_empty(cls, pinned=False)
        except RuntimeError:  # host memory exhausted: the caller keeps the tensor on the device
            return None

    def _free_idle(self, select) -> None:
        """Free the idle buffers, largest classes first, for which select(buf) holds
        and whose last copy has completed."""
        for cls in sorted(self._free, reverse=True):
            keep = []
            for buf, event, dev in self._free[cls]:
                if select(buf) and idle(event, dev):
                    self.reserved_bytes -= cls
                    self._views.pop(buf.data_ptr(), None)  # (they hold the buffer's memory)
                else:
                    keep.append((buf, event, dev))
            self._free[cls] = keep
