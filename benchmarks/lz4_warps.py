"""LZ4's encoder by warps in flight: is its speed its hash tables missing L2? (issue 41)

One warp encodes one 16 KiB chunk at a time. Each warp in flight owns two hash tables of
4096 8-byte entries (64 KiB) and 16 KiB of staging for its block: 80 KiB. At cswap's default
launch (MAX_ENCODE_PROGRAMS, 2048 warps) that is 160 MiB of scratch, 128 MiB of it tables,
where an H100's or H200's L2 holds 50 MB. On the H200 (2026-12-04) the encoder ran at 5.3,
6.7 and 10.6 GB/s at 20, 50 and 80% zeros (256 MiB fp32) while issuing 16-17 warp
instructions per byte (`benchmarks/instructions.py`): 8-18% of the GPU's issue rate. The
hypothesis: each round's table lookups and atomics, 64 random 8-byte entries, go to HBM.
Fewer warps keep the tables in L2 but hide less of each round's latency; this benchmark
times the encoder at each count, side by side on the same tensors, and checks that every
count writes the same bytes (it must: the count only changes which warp takes which chunk).

    python benchmarks/lz4_warps.py            # GPU: 256 MiB fp32 at 20, 50 and 80% zeros
    python benchmarks/lz4_warps.py --quick    # CPU (TRITON_INTERPRET=1): the bytes only

Per tensor and count: the scratch the warps hold (MiB), and on a GPU the encode's time
(lz4_launch, the runtime's path; CUDA events, median) as ms, GB/s of input and a ratio to
the default count's. Results: lz4-warps.csv and .json under benchmarks/results/<device>/.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

import cswap
from cswap.kernels import lz4 as kl
from cswap.tune.synthetic import make_tensor

from common import environment, format_row, kernel_ms, write_results

MiB = 1 << 20
WARPS = (256, 512, 1024, 2048)


def measure(sparsity: float, nbytes: int, warps: list[int], device: torch.device) -> list[dict]:
    """One tensor encoded with each count of warps in flight (one warp a program)."""
    data = make_tensor(nbytes, sparsity, torch.float32, "blocky", device, seed=0).view(torch.uint8)
    reserved = torch.empty(kl.reserve_nbytes(nbytes), dtype=torch.uint8, device=device)
    num_chunks = -(-nbytes // kl.CHUNK)
    rows, first = [], None
    for count in warps:
        config = cswap.LaunchConfig(grid=count, block=32)
        in_flight = kl.encode_programs(num_chunks, config, device)
        reserved.zero_()
        blocks_nbytes = int(kl.lz4_launch(data, reserved, config))
        payload = reserved[: kl.layout(num_chunks, blocks_nbytes)[1]].clone()
        if first is None:
            first = payload
        row = {"sparsity": sparsity, "mib": nbytes / MiB, "warps": in_flight,
               "scratch_mib": in_flight * kl.encode_scratch_bytes_per_program() / MiB,
               "ratio": nbytes / payload.numel(), "same_bytes": torch.equal(payload, first)}
        if not row["same_bytes"]:
            raise AssertionError(f"lz4 with {in_flight} warps in flight wrote other bytes than with {warps[0]}")
        ms = kernel_ms(lambda: kl.lz4_launch(data, reserved, config), device)
        if ms is not None:
            row.update(encode_ms=ms, encode_gbps=nbytes / ms / 1e6)
        rows.append(row)
    base = max(rows, key=lambda r: r["warps"])
    for r in rows:
        if r.get("encode_ms") is not None:
            r["x_most_warps"] = r["encode_ms"] / base["encode_ms"]
    return rows


COLUMNS = [("sparsity", "zeros", "{:.0%}"), ("mib", "MiB", "{:g}"), ("warps", "warps", "{}"),
           ("scratch_mib", "scratch MiB", "{:.1f}"), ("ratio", "ratio", "{:.3f}"), ("same_bytes", "same", "{}"),
           ("encode_ms", "enc ms", "{:.2f}"), ("encode_gbps", "enc GB/s", "{:.1f}"),
           ("x_most_warps", "x most", "{:.2f}")]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one 64 KiB tensor, 1-4 warps, bytes only (CPU-friendly)")
    p.add_argument("--sizes-mib", type=float, nargs="+", help="tensor sizes (default 256; quick 0.0625)")
    p.add_argument("--sparsities", type=float, nargs="+", default=[0.2, 0.5, 0.8])
    p.add_argument("--warps", type=int, nargs="+", help=f"warps in flight (default {' '.join(map(str, WARPS))}; "
                                                         "quick 1 2 4)")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<device>)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("off a GPU the kernels run in Triton's interpreter: set TRITON_INTERPRET=1 (and use --quick)")
    sizes = args.sizes_mib or ([0.0625] if args.quick else [256])
    warps = sorted(args.warps or ([1, 2, 4] if args.quick else WARPS))
    print(f"# LZ4's encoder by warps in flight on {device}: bytes compared; times "
          + ("measured (CUDA events)" if device.type == "cuda" else "not taken (interpreter)"))
    widths = [6, 5, 6, 11, 6, 5, 7, 8, 6]
    print(format_row(COLUMNS, widths))
    rows = []
    for sparsity in args.sparsities:
        for mib in sizes:
            group = measure(sparsity, int(mib * MiB), warps, device)
            for row in group:
                print(format_row(COLUMNS, widths, row))
            rows += group
    env = environment(device, what="LZ4's encoder timed by warps in flight" if device.type == "cuda"
                      else "LZ4's encoder's bytes by warps in flight in Triton's interpreter (no times)")
    write_results(rows, env, args, args.out, device, "lz4-warps")
    return rows


if __name__ == "__main__":
    main()
