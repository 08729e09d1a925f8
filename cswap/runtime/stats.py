"""Counters of what the swapper did, as a read-only mapping with reset()."""

from __future__ import annotations

import threading
from collections.abc import Mapping

__all__ = ["SwapStats"]

_FIELDS = {
    "offloaded_tensors": "tensors copied to host memory (each storage once per forward)",
    "offloaded_bytes": "their size before compression",
    "transferred_bytes": "bytes moved to the host, after compression",
    "compressed_tensors": "offloaded tensors that were compressed first",
    "sent_at_encode": "of those, tensors whose copy out was queued right behind their encode, as large as their payload "
                      "in the pass before (no wait for the sender thread; a payload grown since is topped up)",
    "compress_oom": "compressions that ran out of device memory (the tensor was sent uncompressed)",
    "payload_overflow": "compressed payloads larger than the room their size in the pass before reserved (the "
                        "tensor was sent uncompressed)",
    "host_compressed_tensors": "vdnnpp: host copies compressed on the CPU after the transfer",
    "deduplicated": "saves of an already offloaded tensor (served by its first copy)",
    "kept_on_gpu": "candidates left on the device because host memory ran out (max_host_bytes)",
    "kept_by_plan": "candidates a plan left on the device (a policy or a budget's plan said KEEP)",
    "kept_unmovable": "saved tensors cswap cannot move (sparse, nested, quantized, meta, tensor subclasses such as "
                      "DTensor), left where they are",
    "restored_tensors": "tensors brought back for backward",
    "served_from_device": "saves backward asked for while the tensor was still on the device (no round trip)",
    "prefetched": "restores started ahead of need",
    "on_demand": "restores started only when backward asked",
    "prefetch_oom": "prefetches stopped by device out of memory (fetched on demand instead)",
    "oom_retries": "on-demand restores retried after device out of memory",
    "prefetch_stall_s": "seconds compute waited for on-demand restores (device time, from events)",
    "offload_stall_s": "seconds forward waited because the in-flight offloads reached stash_bytes (or the memory budget)",
    "peak_offload_bytes": "most bytes offloaded but not yet released at once (bounded by stash_bytes)",
    "peak_prefetch_bytes": "most bytes restored ahead of use at once (bounded by prefetch_bytes)",
    "host_pool_bytes": "host memory held by the buffer pool now",
    "peak_host_pool_bytes": "most host memory the pool held",
    "peak_gpu_bytes": "device memory allocated, at most, since the last reset",
    "peak_gpu_reserved_bytes": "device memory reserved by the allocator, at most, since the last reset",
}


_LIVE = ("prefetch_stall_s", "host_pool_bytes", "peak_host_pool_bytes", "peak_gpu_bytes", "peak_gpu_reserved_bytes")


_PEAKS = ("peak_offload_bytes", "peak_prefetch_bytes")  # the most at once: a maximum, not a sum


class SwapStats(Mapping):
    """What was offloaded, moved and restored since the last reset().

    Counting costs the hooks next to nothing: each thread (the training thread,
    autograd's device thread, the worker, the releaser) adds to a tally of its own,
    which only it writes, so no lock is taken per count; a read sums the tallies
    (and takes the largest of each peak). A count made while reset() runs may land
    on either side of it."""

    fields = tuple(_FIELDS)

    def __init__(self, swapper=None):
        self._swapper = swapper
        self._lock = threading.Lock()  # new tallies only
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._tallies: dict[int, dict] = {}  # thread ident -> its counts
        if self._swapper is not None:
            self._swapper.on_stats_reset()

    def _tally(self) -> dict:
        ident = threading.get_ident()
        counts = self._tallies.get(ident)
        if counts is None:
            counts = dict.fromkeys(_FIELDS, 0)
            counts["prefetch_stall_s"] = counts["offload_stall_s"] = 0.0
            with self._lock:
                self._tallies = {**self._tallies, ident: counts}  # (readers iterate the old dict safely)
        return counts

    def add(self, name: str, value=1) -> None:
        counts = self._tallies.get(threading.get_ident()) or self._tally()
        counts[name] += value

    def add_all(self, *pairs) -> None:
        """add(name, value) for each (name, value)."""
        counts = self._tallies.get(threading.get_ident()) or self._tally()
        for name, value in pairs:
            counts[name] += value

    def peak(self, name: str, value: int) -> None:
        counts = self._tallies.get(threading.get_ident()) or self._tally()
        if value > counts[name]:
            counts[name] = value

    def counted(self, name: str):
        """The count itself, over every thread (what a live field adds to)."""
        tallies = self._tallies.values()
        if name in _PEAKS:
            return max((counts[name] for counts in tallies), default=0)
        return sum((counts[name] for counts in tallies), 0.0 if name.endswith("_s") else 0)

    def __getitem__(self, name: str):
        if name not in _FIELDS:
            raise KeyError(f"cswap.stats: no field {name!r}; fields are {', '.join(_FIELDS)}")
        if self._swapper is not None and name in _LIVE:
            return self._swapper.live_stat(name)
        return self.counted(name)

    def __iter__(self):
        return iter(_FIELDS)

    def __len__(self) -> int:
        return len(_FIELDS)

    def __getattr__(self, name: str):
        """stats.offloaded_tensors as stats["offloaded_tensors"]: what the repr shows works."""
        if name in _FIELDS:
            return self[name]
        raise AttributeError(f"cswap.stats: no field {name!r}; fields are {', '.join(_FIELDS)}")

    def __dir__(self):
        return [*super().__dir__(), *_FIELDS]

    def __repr__(self) -> str:
        return "SwapStats(" + ", ".join(f"{k}={self[k]}" for k in self) + ")"

    @staticmethod
    def describe(name: str) -> str:
        return _FIELDS[name]
