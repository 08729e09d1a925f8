"""Effective host <-> device copy bandwidth: the profile's BW_d2h and BW_h2d.

CUDA: pinned host buffer <-> device buffer, non-blocking copies, timed with
CUDA events over a range of sizes; the figure the cost model uses is the
median over the sizes of at least 16 MiB (smaller copies are latency-bound
and would understate the link). Without CUDA it measures host memcpy, so
that the pipeline runs; such a profile describes the CPU, not a GPU.
"""

from __future__ import annotations

import statistics

import torch

from .timing import measure

__all__ = ["DEFAULT_SIZES", "copy_seconds", "probe"]

MiB = 1 << 20
DEFAULT_SIZES = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)


def copy_seconds(nbytes: int, device, repeats: int = 10) -> tuple[float, float]:
    """(D2H, H2D) seconds to copy nbytes through a pinned host buffer (host memcpy without CUDA)."""
    device = torch.device(device)
    pinned = device.type == "cuda"
    n = max(int(nbytes), 1)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    d2h = measure(lambda: host.copy_(dev, non_blocking=pinned), device, "copy", repeats=repeats)
    h2d = measure(lambda: dev.copy_(host, non_blocking=pinned), device, "copy", repeats=repeats)
    return d2h.seconds, h2d.seconds


def probe(device=None, sizes=DEFAULT_SIZES, repeats: int = 10) -> dict:
    """{"d2h_gbps", "h2d_gbps", "pinned", "samples": [{"bytes", "d2h_gbps", "h2d_gbps"}, ...]}."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sizes = sorted(int(s) for s in sizes)
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"cswap.tune.bandwidth: sizes must be positive byte counts, got {sizes}")
    samples = []
    for n in sizes:
        d2h, h2d = copy_seconds(n, device, repeats)
        samples.append({"bytes": n, "d2h_gbps": n / d2h / 1e9, "h2d_gbps": n / h2d / 1e9})
    large = [s for s in samples if s["bytes"] >= 16 * MiB] or samples[-1:]
    return {"d2h_gbps": statistics.median(s["d2h_gbps"] for s in large),
            "h2d_gbps": statistics.median(s["h2d_gbps"] for s in large),
            "pinned": device.type == "cuda", "samples": samples}
