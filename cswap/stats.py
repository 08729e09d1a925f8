"""Counters of what the swapper did, as a read-only mapping with reset()."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["SwapStats"]

_FIELDS = {
    "offloaded_tensors": "tensors copied to host memory (each storage once per forward)",
    "offloaded_bytes": "their size before compression",
    "transferred_bytes": "bytes moved to the host, after compression",
    "compressed_tensors": "offloaded tensors that were compressed first",
    "host_compressed_tensors": "vdnnpp: host copies compressed on the CPU after the transfer",
    "deduplicated": "saves of an already offloaded tensor (served by its first copy)",
    "kept_on_gpu": "candidates left in place (host memory limit, or no buffer)",
    "restored_tensors": "tensors brought back for backward",
    "prefetched": "restores started ahead of need",
    "on_demand": "restores started only when backward asked",
    "prefetch_oom": "prefetches stopped by GPU out of memory (fetched on demand instead)",
    "oom_retries": "on-demand restores retried after GPU out of memory",
    "prefetch_stall_s": "seconds unpack waited for a restore (host clock)",
    "offload_stall_s": "seconds forward waited because the stash limit was reached",
    "host_pool_bytes": "host memory held by the buffer pool now",
    "peak_host_pool_bytes": "most host memory the pool held",
    "peak_gpu_bytes": "torch.cuda.max_memory_allocated since the last reset (CUDA only)",
}


class SwapStats(Mapping):
    """What was offloaded, moved and restored since the last reset()."""

    fields = tuple(_FIELDS)

    def __init__(self, swapper=None):
        self._swapper = swapper
        self.reset()

    def reset(self) -> None:
        self._counts = {name: 0 for name in _FIELDS}
        self._counts["prefetch_stall_s"] = 0.0
        self._counts["offload_stall_s"] = 0.0
        if self._swapper is not None:
            self._swapper.on_stats_reset()

    def add(self, name: str, value=1) -> None:
        self._counts[name] += value

    def __getitem__(self, name: str):
        if name not in _FIELDS:
            raise KeyError(f"cswap.stats: no field {name!r}; fields are {', '.join(_FIELDS)}")
        if self._swapper is not None and name in ("host_pool_bytes", "peak_host_pool_bytes", "peak_gpu_bytes"):
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
