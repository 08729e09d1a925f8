"""Timing that says how it was measured.

CUDA: `triton.testing.do_bench` (CUDA events, warm-up, L2 flushed between
runs), median. CPU: `time.perf_counter` around each call after warm-up calls,
median. Every `Timing` records the backend and device that produced it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

__all__ = ["Timing", "measure", "time_codec"]


@dataclass(frozen=True)
class Timing:
    seconds: float     # median of the repeats
    backend: str       # the codec backend timed ("triton", "torch", or "copy")
    device: str        # "cuda:0", "cpu"
    method: str        # "do_bench" (CUDA events) or "perf_counter"
    repeats: int

    def to_dict(self) -> dict:
        return asdict(self)


def measure(fn: Callable[[], object], device, backend: str, *, repeats: int = 10, warmup: int = 2) -> Timing:
    """Median time of fn() on `device` (seconds)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"cswap.tune.timing: repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    device = torch.device(device)
    if device.type == "cuda":
        import triton.testing

        # do_bench takes milliseconds of warm-up and of repetitions; it runs fn
        # once first to estimate its time and derives the counts from that.
        with torch.cuda.device(device):
            ms = triton.testing.do_bench(fn, warmup=max(1, 5 * warmup), rep=max(5, 10 * repeats),
                                         return_mode="median")
        return Timing(ms / 1e3, backend, str(device), "do_bench", repeats)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return Timing(statistics.median(times), backend, str(device), "perf_counter", repeats)


def time_codec(name: str, x: torch.Tensor, config, backend: str, repeats: int) -> tuple[float, float, int]:
    """(compress seconds, decompress seconds, compressed bytes) of codec `name` on x."""
    from .. import codecs

    codec = codecs.get(name)
    blob = codec.compress(x, config=config, backend=backend)
    c = measure(lambda: codec.compress(x, config=config, backend=backend), x.device, backend, repeats=repeats)
    d = measure(lambda: codec.decompress(blob, config=config, backend=backend, check=False), x.device, backend,
                repeats=repeats)
    return c.seconds, d.seconds, blob.nbytes
