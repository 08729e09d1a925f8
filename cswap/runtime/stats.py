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
    "compress_oom": "compressions that ran out of device memory (the tensor was sent uncompressed)",
    "host_compressed_tensors": "vdnnpp: host copies compressed on the CPU after the transfer",
    "deduplicated": "saves of an already offloaded tensor (served by its first copy)",
    "kept_on_gpu": "candidates left on the device because host memory ran out (max_host_bytes)",
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


class SwapStats(Mapping):
    """What was offloaded, moved and restored since the last reset()."""

    fields = tuple(_FIELDS)

    def __init__(self, swapper=None):
        self._swapper = swapper
        self._lock = threading.Lock()  # the worker, the releaser and the user's thread all count
        self.reset()

    def reset(self) -> None:
        self._counts = {name: 0 for name in _FIELDS}
        self._counts["prefetch_stall_s"] = 0.0
        self._counts["offload_stall_s"] = 0.0
        if self._swapper is not None:
            self._swapper.on_stats_reset()

    def add(self, name: str, value=1) -> None:
        with self._lock:
            self._counts[name] += value

    def add_all(self, *pairs) -> None:
        """add(name, value) for each (name, value), under one lock."""
        with self._lock:
            counts = self._counts
            for name, value in pairs:
                counts[name] += value

    def peak(self, name: str, value: int) -> None:
        with self._lock:
            if value > self._counts[name]:
                self._counts[name] = value

    def counted(self, name: str):
        """The counter itself (what a live field adds to)."""
        return self._counts[name]

    def __getitem__(self, name: str):
        if name not in _FIELDS:
            raise KeyError(f"cswap.stats: no field {name!r}; fields are {', '.join(_FIELDS)}")
        if self._swapper is not None and name in _LIVE:
            return self._swapper.live_stat(name)
        return self._counts[name]

    def __iter__(self):
        return iter(_FIELDS)

    def __len__(self) -> int:
        return len(_FIELDS)

    def __repr__(self) -> str:
        return "SwapStats(" + ", ".join(f"{k}={self[k]}" for k in self) + ")"

    @staticmethod
    def describe(name: str) -> str:
        return _FIELDS[name]
