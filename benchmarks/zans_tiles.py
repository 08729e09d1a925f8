"""ZANS by tile size: what a shorter rANS chain buys in time and costs in ratio (issue 41).

ZANS decodes each tile of a byte plane with one warp, its 32 lanes each running one rANS
state through tile / 32 dependent steps. On the H200 (2026-12-04) a 1 MiB bf16 decode took
0.32 ms and a 256 MiB one ran at 99 GB/s: both fit a decoder bound by the latency of that
chain (about 0.45 us a step), not by memory. If so, a shorter tile decodes a small tensor
in proportionally less time (more warps, fewer steps each) and leaves a large one's
throughput where it is, for a larger share of each tile in its 128-byte state flush: the
ratio falls (0.5% at 8192 symbols, 1.5% at 4096 on GELU bf16, measured on a CPU). Any
power-of-two tile in [32, 65536] decodes, so this benchmark times the kernels directly at
each tile, side by side, on the same tensors:

    python benchmarks/zans_tiles.py            # GPU: 1, 16 and 256 MiB
    python benchmarks/zans_tiles.py --quick    # CPU: 64 KiB, ratios only (the interpreter's times mean nothing)

Per tile and tensor: the ratio, the warps a plane decodes with, the steps each lane runs,
and on a GPU the encode (the runtime's path, zans_launch) and decode times (CUDA events,
median), as ms and GB/s of raw input, and as a ratio to the default tile's. At the default
tile the kernels are also timed with more programs an SM than the default launch's 4
(`--programs-per-sm`; 16 warps an SM at 4, where the decoder's 56 registers leave room for
36): if a large tensor's decode speeds up with them, its chains were too few in flight,
not too slow. Results: zans-tiles.csv and .json under benchmarks/results/<device>/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from cswap.kernels import zans as kz
from cswap.kernels.launch import PROGRAMS_PER_SM, LaunchConfig, default_config
from cswap.tune.synthetic import make_tensor

from common import environment, format_row, kernel_ms, write_results

MiB = 1 << 20
TILES = (4096, 8192, 16384, 32768)
DEFAULT_PROGRAMS = PROGRAMS_PER_SM  # an SM's programs at the default launch


def case_tensor(case: str, nbytes: int, device: torch.device) -> torch.Tensor:
    """bf16-gelu: dense GELU outputs in bf16 (a transformer's); fp32-relu80: ReLU-like
    fp32 with 80% blocky zeros (a CNN's)."""
    if case == "bf16-gelu":
        g = torch.Generator().manual_seed(0)
        x = torch.nn.functional.gelu(torch.randn(nbytes // 2, generator=g)).to(torch.bfloat16)
        return x.to(device)
    return make_tensor(nbytes, 0.8, torch.float32, "blocky", device, seed=0)


def launch_config(device: torch.device, programs_per_sm: int) -> LaunchConfig:
    """The default launch's block, with `programs_per_sm` programs an SM (a CPU: one SM)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return LaunchConfig(grid=programs_per_sm * sms, block=default_config(device).block)


def measure(case: str, nbytes: int, tile: int, device: torch.device, repeats: int,
            programs_per_sm: int = DEFAULT_PROGRAMS) -> dict:
    x = case_tensor(case, nbytes, device)
    words = x.view({2: torch.int16, 4: torch.int32}[x.element_size()])
    n, itemsize = words.numel(), words.element_size()
    config = launch_config(device, programs_per_sm)
    reserved = torch.empty(kz.reserve_nbytes(n, itemsize, tile), dtype=torch.uint8, device=device)
    meta = tuple(kz.zans_launch(words, reserved, config, tile=tile).tolist())
    size = kz.layout(n, *meta[:4], meta[4], itemsize)[3]
    payload = reserved[:size].clone()
    out, status = kz.zans_decompress(payload, n, *meta, words.dtype, config)
    if not torch.equal(out, words) or bool(status[:, 0].any()):
        raise AssertionError(f"zans at tile {tile} did not round-trip {case} of {nbytes} bytes")
    symbols = meta[2]
    row = {"case": case, "mib": nbytes / MiB, "tile": tile, "programs_per_sm": programs_per_sm,
           "ratio": nbytes / size, "mode": meta[1],
           "coded_planes": bin(meta[3]).count("1"), "warps_per_plane": -(-symbols // tile),
           "steps_per_lane": min(tile, symbols) // kz.LANES}
    encode = kernel_ms(lambda: kz.zans_launch(words, reserved, config, tile=tile), device, repeats)
    decode = kernel_ms(lambda: kz.zans_decompress(payload, n, *meta, words.dtype, config, out=out), device, repeats)
    if encode is not None:
        row.update(encode_ms=encode, decode_ms=decode, encode_gbps=nbytes / encode / 1e6,
                   decode_gbps=nbytes / decode / 1e6)
    return row


def relative(rows: list[dict]) -> None:
    """Each row's times and ratio against the default tile's, at the default launch, on the
    same tensor."""
    base = {(r["case"], r["mib"]): r for r in rows
            if r["tile"] == kz.TILE and r["programs_per_sm"] == DEFAULT_PROGRAMS}
    for r in rows:
        b = base.get((r["case"], r["mib"]))
        if b is None:
            continue
        r["ratio_vs_default"] = r["ratio"] / b["ratio"]
        for key in ("encode_ms", "decode_ms"):
            if r.get(key) is not None:
                r[f"{key[:-3]}_x_default"] = r[key] / b[key]


COLUMNS = [("case", "case", "{}"), ("mib", "MiB", "{:g}"), ("tile", "tile", "{}"),
           ("programs_per_sm", "progs/SM", "{}"), ("ratio", "ratio", "{:.4f}"),
           ("ratio_vs_default", "vs 16K", "{:.4f}"), ("warps_per_plane", "warps", "{}"),
           ("steps_per_lane", "steps", "{}"), ("encode_ms", "enc ms", "{:.3f}"), ("encode_gbps", "enc GB/s", "{:.0f}"),
           ("decode_ms", "dec ms", "{:.3f}"), ("decode_gbps", "dec GB/s", "{:.0f}"),
           ("decode_x_default", "dec x16K", "{:.2f}")]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one 64 KiB tensor per case, ratios only (CPU-friendly)")
    p.add_argument("--sizes-mib", type=float, nargs="+", help="tensor sizes (default 1 16 256; quick 0.0625)")
    p.add_argument("--tiles", type=int, nargs="+", default=list(TILES), help="symbols per tile (powers of two)")
    p.add_argument("--cases", nargs="+", choices=["bf16-gelu", "fp32-relu80"], default=["bf16-gelu", "fp32-relu80"])
    p.add_argument("--programs-per-sm", type=int, nargs="+",
                   help="launches to time at the default tile, in programs an SM (default 4 8 16; quick 4)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<device>)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("off a GPU the kernels run in Triton's interpreter: set TRITON_INTERPRET=1 (and use --quick)")
    sizes = args.sizes_mib or ([0.0625] if args.quick else [1, 16, 256])
    if kz.TILE not in args.tiles:
        args.tiles = sorted({*args.tiles, kz.TILE})
    programs = sorted({DEFAULT_PROGRAMS, *(args.programs_per_sm or ([] if args.quick else [8, 16]))})
    runs = [(tile, DEFAULT_PROGRAMS) for tile in args.tiles]
    runs += [(kz.TILE, k) for k in programs if k != DEFAULT_PROGRAMS]
    rows = []
    widths = [12, 7, 6, 8, 7, 7, 6, 6, 7, 8, 7, 8, 8]
    print(f"# ZANS by tile on {device}: ratios measured; times "
          + ("measured (CUDA events)" if device.type == "cuda" else "not taken (interpreter)"))
    print(format_row(COLUMNS, widths))
    for case in args.cases:
        for mib in sizes:
            group = []
            for tile, k in runs:
                t0 = time.perf_counter()
                group.append(measure(case, int(mib * MiB), tile, device, args.repeats, k))
                group[-1]["wall_s"] = time.perf_counter() - t0
            relative(group)
            for row in group:
                print(format_row(COLUMNS, widths, row))
            rows += group
    env = environment(device, what="ZANS kernels timed per tile size" if device.type == "cuda"
                      else "ZANS ratios per tile size in Triton's interpreter (no times)")
    write_results(rows, env, args, args.out, device, "zans-tiles")
    if device.type == "cuda":
        decode = [r["decode_x_default"] for r in rows if r["tile"] == min(args.tiles) and r["mib"] == min(sizes)
                  and r["programs_per_sm"] == DEFAULT_PROGRAMS]
        print(f"# smallest tile, smallest size: decode x{statistics.median(decode):.2f} of the default tile's")
    return rows


if __name__ == "__main__":
    main()
