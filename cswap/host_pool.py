"""Pinned host buffers in size classes, reused across iterations.

`cudaHostAlloc` costs milliseconds and synchronises the device, so the
swapper never pins memory per tensor in steady state: a buffer returned to
the pool waits (event guarded) until the last copy that reads or writes it
has finished, then serves the next request of its size class.

Size classes: a request of n bytes gets a buffer of n rounded up to a
quarter of n's power of two (at most 25% slack, few classes, good reuse
between iterations whose tensors differ slightly), or an idle buffer of up
to twice that when none of its own class is free.

Idle buffers go back to the system at `max_bytes`, and at `trim_idle()`
(cswap calls it at each epoch end): a buffer no request has used since the
previous trim_idle is freed. Compressed sizes drift with sparsity, and the
first, uncompressed iteration needs other sizes than the rest; without this
the pool would keep every size it ever met. Freeing pinned memory
synchronises the device, hence once an epoch rather than per iteration.
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import torch

__all__ = ["HostPool", "size_class"]


def size_class(nbytes: int) -> int:
    """n rounded up to a multiple of 2**(floor(log2 n) - 2), at least 512 bytes."""
    nbytes = max(int(nbytes), 512)
    step = 1 << max(nbytes.bit_length() - 3, 0)
    return -(-nbytes // step) * step


class HostPool:
    """Host buffers (pinned when possible) bounded by `max_bytes` in all.

    acquire(n) -> a 1-D uint8 tensor of at least n bytes, or None when the
    bound would be exceeded even after dropping idle buffers (the caller then
    keeps its tensor on the GPU). release(buf, event) returns a buffer; it is
    reused only once `event` (the last copy touching it) has completed.
    """

    def __init__(self, max_bytes: int, pin_memory: bool = True):
        if max_bytes < 0:
            raise ValueError(f"cswap.HostPool: max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._free: dict[int, list[tuple[torch.Tensor, object]]] = defaultdict(list)
        self.reserved_bytes = 0      # every buffer the pool owns, idle or lent
        self.peak_reserved_bytes = 0
        self.allocations = 0         # buffers created (pinned allocations made)
        self.pinned = self.pin_memory
        self._warned_full = False
        self._used: set[int] = set()  # data_ptr of buffers acquired since the last trim_idle

    @property
    def idle_bytes(self) -> int:
        return sum(buf.numel() for bufs in self._free.values() for buf, _ in bufs)

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        cls = size_class(nbytes)
        # Its own class first, else the smallest idle buffer of up to twice the size:
        # compressed sizes drift with sparsity, and a slightly larger buffer serves
        # better than a new pinned allocation.
        for fit in sorted(c for c in self._free if cls <= c <= 2 * cls):
            for i, (buf, event) in enumerate(self._free[fit]):
                if event is None or event.query():
                    del self._free[fit][i]
                    self._used.add(buf.data_ptr())
                    return buf
        if self.reserved_bytes + cls > self.max_bytes:
            self._trim(self.reserved_bytes + cls - self.max_bytes)
        if self.reserved_bytes + cls > self.max_bytes:
            if not self._warned_full:
                self._warned_full = True
                warnings.warn(f"cswap: host memory limit of {self.max_bytes / 2**30:.2f} GiB reached; new "
                              f"tensors stay on the GPU until buffers come back (raise max_host_bytes "
                              f"to offload more)", RuntimeWarning, stacklevel=4)
            return None
        buf = self._allocate(cls)
        if buf is not None:
            self._used.add(buf.data_ptr())
            self.reserved_bytes += cls
            self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
            self.allocations += 1
        return buf

    def release(self, buf: torch.Tensor, event=None) -> None:
        self._free[buf.numel()].append((buf, event))

    def trim_idle(self) -> int:
        """Free the idle buffers no request used since the previous call; the bytes freed."""
        before = self.reserved_bytes
        self._free_idle(lambda buf: buf.data_ptr() not in self._used)
        self._used.clear()
        return before - self.reserved_bytes

    def clear(self) -> None:
        """Drop every idle buffer (lent ones come back later as usual)."""
        self._trim(self.reserved_bytes)

    def _allocate(self, cls: int) -> torch.Tensor | None:
        if self.pinned:
            try:
                return torch.empty(cls, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as exc:
                self.pinned = False
                warnings.warn(f"cswap: pinned host memory unavailable ({exc}); falling back to pageable "
                              f"memory, which makes copies synchronous and slower", RuntimeWarning,
                              stacklevel=5)
        try:
            return torch.empty(cls, dtype=torch.uint8)
        except RuntimeError:  # host memory exhausted: the caller keeps the tensor on the GPU
            return None

    def _trim(self, nbytes: int) -> None:
        """Free idle buffers (largest classes first) until `nbytes` are released."""
        target = self.reserved_bytes - nbytes
        self._free_idle(lambda buf: self.reserved_bytes > target)

    def _free_idle(self, select) -> None:
        """Free the idle buffers, largest classes first, for which select(buf) holds
        and whose last copy has completed."""
        for cls in sorted(self._free, reverse=True):
            keep = []
            for buf, event in self._free[cls]:
                if select(buf) and (event is None or event.query()):
                    self.reserved_bytes -= cls
                else:
                    keep.append((buf, event))
            self._free[cls] = keep
