"""Host time of each CUDA call the runtime makes per offloaded tensor (issue 26).

An offloaded tensor passes through cswap's device seam about 25 times (events
recorded, queried and waited on, streams made current for copies and
allocations). This times each such call on the host, median of many, side by side
with the way it was made before (torch.cuda.device and torch.cuda.stream context
managers, torch.cuda.current_stream), so the per-tensor figure of
benchmarks/overhead.py --devices cuda can be read as a sum:

    python benchmarks/cuda_seam.py          # needs a CUDA GPU; a few seconds

Results: a printed table, and CSV + JSON under benchmarks/results/<device>/.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from cswap.runtime.device import CudaDevice, _Current


def per_call_us(fn, calls: int, rounds: int) -> float:
    """Median over rounds of the mean host time of one call, in microseconds."""
    results = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        results.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(results)


def cases(dev: CudaDevice):
    """(name, how, fn): each call the seam makes, and the one it replaced where it changed.
    Each names the synchronisation point (cswap.runtime.sync) the runtime calls it at."""
    device = dev.device
    side = dev.side_stream("d2h")
    small = torch.zeros(2048, device=device)  # 8 KiB: the copy is queued, not waited for
    pinned = torch.empty(small.numel() * 4, dtype=torch.uint8, pin_memory=True)
    done = dev.record_event(side)
    torch.cuda.synchronize()

    def contexts():
        with torch.cuda.device(device), torch.cuda.stream(side):
            pass

    def current():
        with _Current(dev.index, side):
            pass

    def copy_contexts():
        with torch.cuda.device(device), torch.cuda.stream(side):
            pinned.copy_(small.view(torch.uint8), non_blocking=True)

    def empty_contexts():
        with torch.cuda.device(device), torch.cuda.stream(side):
            torch.empty(8192, dtype=torch.uint8, device=device)

    return [
        ("make a stream current", "torch.cuda.device + torch.cuda.stream", contexts),
        ("make a stream current", "_Current (cswap)", current),
        ("compute stream", "torch.cuda.current_stream", lambda: torch.cuda.current_stream(device)),
        ("compute stream", "CudaDevice.compute_stream (cswap)", dev.compute_stream),
        ("copy 8 KiB D2H on a side stream", "context managers", copy_contexts),
        ("copy 8 KiB D2H on a side stream", "CudaDevice.copy (cswap)",
         lambda: dev.copy(pinned, small.view(torch.uint8), side)),
        ("allocate 8 KiB on a side stream", "context managers", empty_contexts),
        ("allocate 8 KiB on a side stream", "CudaDevice.empty (cswap)", lambda: dev.empty(8192, side)),
        ("record an event", "CudaDevice.record_event", lambda: dev.record_event(side)),
        ("query a done event", "CudaDevice.event_query", lambda: dev.event_query(done, "release.copy_done")),
        ("stream waits on an event", "CudaDevice.wait_event", lambda: dev.wait_event(side, done, "offload.copy_after_ready")),
        ("stream waits on a stream", "CudaDevice.wait_stream",
         lambda: dev.wait_stream(side, dev.compute_stream(), "restore.decode_after_copy_in")),
        ("record_stream", "CudaDevice.record_stream", lambda: dev.record_stream(small, side, "restore.record_restored")),
        ("capturing?", "CudaDevice.capturing", dev.capturing),
    ]


def main(argv=None) -> list[dict]:
    from common import environment, write_results

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="calls per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<device>)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU: it times CUDA calls on the host")
    device = torch.device("cuda", torch.cuda.current_device())
    dev = CudaDevice(device)
    rows = []
    print(f"{'call':34} {'made with':40} {'us per call':>11}")
    for name, how, fn in cases(dev):
        for _ in range(100):  # warm: allocator blocks, lazily created events
            fn()
        us = per_call_us(fn, args.calls, args.rounds)
        rows.append({"call": name, "how": how, "us_per_call": us})
        print(f"{name:34} {how:40} {us:11.2f}")
    write_results(rows, environment(device), args, args.out, device, "cuda-seam")
    return rows


if __name__ == "__main__":
    main()
