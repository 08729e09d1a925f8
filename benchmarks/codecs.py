"""Codec benchmark: cswap's four codecs against nvCOMP, side by side in one run.

For each codec x sparsity x size x dtype: compression ratio, compress and
decompress throughput (GB/s of uncompressed input, and % of the measured
device-to-device copy bandwidth), the pinned D2H/H2D copy of the raw tensor,
and the end-to-end swap (compress + D2H + H2D + decompress) against the raw
round trip (D2H + H2D). A codec that can compress without reading its size back
(ZVC) is also timed on that path, the runtime's (`launch_ms`, `launch_gbps`). Every case is checked bit-exact before it is timed.

    python benchmarks/codecs.py            # full sweep (on a GPU: 1 MiB .. 1 GiB)
    python benchmarks/codecs.py --quick    # small sizes; runs on CPU in a minute

Results: a printed table, and CSV + JSON under benchmarks/results/<device>/.
On a GPU each cswap row also carries its kernels' static figures for that
GPU's architecture at the launch config it ran (the most registers, spilled
and shared bytes over the kernels the codec launches; cswap.kernels.aot), so
throughput sits beside what the compiler made of the kernels.
On CPU there is no PCIe: transfer and swap columns are empty, and the codecs
run their PyTorch backend (the Triton interpreter is far too slow to time).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import cswap
from cswap.tune.synthetic import PATTERNS, make_tensor

from common import environment, format_row, kernel_ms, write_results

MiB = 1 << 20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# -- timing ----------------------------------------------------------------------


def bench_ms(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of fn() in ms (CUDA: common.kernel_ms)."""
    if device.type == "cuda":
        return kernel_ms(fn, device, repeats)
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbps(device: torch.device, repeats: int) -> float:
    """Device memory bandwidth as a plain copy moves it (bytes read + written)."""
    n = (256 if device.type == "cuda" else 64) * MiB
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device, repeats)
    return 2 * n / ms / 1e6


# -- providers ---------------------------------------------------------------------


class CswapProvider:
    def __init__(self, name: str, backend: str):
        self.name, self.codec, self.backend = name, cswap.codecs.get(name), backend

    def compress(self, x):
        return self.codec.compress(x, backend=self.backend)

    def decompress(self, blob, like):
        return self.codec.decompress(blob, backend=self.backend, check=False)

    def launcher(self, x):
        """The runtime's compression (Codec.launch_into: into room for the largest
        payload, its size left on the device), as a function to time; None for a codec
        that must read its size back to encode."""
        reserve = self.codec.reserve_nbytes(x.numel(), x.element_size())
        if reserve is None:
            return None
        reserved = torch.empty(reserve, dtype=torch.uint8, device=x.device)
        sizes = torch.empty(self.codec.size_words, dtype=torch.int64, device=x.device)
        return lambda: self.codec.launch_into(x, reserved, sizes, backend=self.backend)

    @staticmethod
    def nbytes(blob) -> int:
        return blob.nbytes

    @staticmethod
    def data(blob) -> torch.Tensor:
        return blob.data

    @staticmethod
    def rebuild(blob, data):
        return cswap.Compressed(data, blob._header)


class NvcompProvider:
    """nvCOMP through its Python API (nvidia-nvcomp-cu12/13), on torch's stream."""

    # Bitcomp algorithm_type=1 is its sparse mode.
    OPTIONS = {"LZ4": {}, "Cascaded": {}, "Bitcomp": {"algorithm_type": 1}}

    def __init__(self, algorithm: str):
        from nvidia import nvcomp

        self.nvcomp, self.algorithm = nvcomp, algorithm
        self.name = f"nvcomp-{algorithm.lower()}"
        self._codecs = {}

    def _codec(self, typestr: str):
        key = (typestr, torch.cuda.current_stream().cuda_stream)
        if key not in self._codecs:
            self._codecs[key] = self.nvcomp.Codec(algorithm=self.algorithm, cuda_stream=key[1],
                                                  data_type=typestr, **self.OPTIONS[self.algorithm])
        return self._codecs[key]

    def compress(self, x):
        words = x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
        typestr = words.__cuda_array_interface__["typestr"]
        return self._codec(typestr).encode(self.nvcomp.as_array(words)), typestr

    def decompress(self, blob, like):
        enc, typestr = blob
        out = torch.as_tensor(self._codec(typestr).decode(enc), device=like.device)
        return out.view(torch.uint8).view(like.dtype).reshape(like.shape)

    @staticmethod
    def nbytes(blob) -> int:
        return int(blob[0].buffer_size)

    @staticmethod
    def data(blob) -> torch.Tensor:
        return torch.as_tensor(blob[0], device="cuda").view(torch.uint8).reshape(-1)

    def rebuild(self, blob, data):
        return self.nvcomp.as_array(data), blob[1]


def providers(args, device) -> list:
    backend = "triton" if device.type == "cuda" else "torch"
    found = [CswapProvider(name, backend) for name in args.codecs]
    if device.type == "cuda" and not args.no_nvcomp:
        try:
            from nvidia import nvcomp  # noqa: F401
        except ImportError:
            print("nvidia.nvcomp not importable: nvCOMP columns skipped (pip install nvidia-nvcomp-cu12/13)")
        else:
            found += [NvcompProvider(a) for a in NvcompProvider.OPTIONS]
    return found


# -- one case ------------------------------------------------------------------------


def run_case(provider, x, device, repeats, bw_gbps, raw) -> dict:
    nbytes = x.numel() * x.element_size()
    blob = provider.compress(x)
    y = provider.decompress(blob, x)
    words = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    if not torch.equal(y.view(words), x.view(words)):
        raise AssertionError(f"{provider.name}: round trip is not bit-exact; refusing to time it")
    size = provider.nbytes(blob)
    c_ms = bench_ms(lambda: provider.compress(x), device, repeats)
    d_ms = bench_ms(lambda: provider.decompress(blob, x), device, repeats)
    row = {
        "provider": provider.name, "ratio": nbytes / size, "compressed_bytes": size,
        "compress_ms": c_ms, "decompress_ms": d_ms,
        "compress_gbps": nbytes / c_ms / 1e6, "decompress_gbps": nbytes / d_ms / 1e6,
    }
    row["compress_pct_bw"] = 100 * row["compress_gbps"] / bw_gbps
    row["decompress_pct_bw"] = 100 * row["decompress_gbps"] / bw_gbps
    launch = getattr(provider, "launcher", lambda x: None)(x)
    if launch is not None:  # the runtime's path: no host sync, the payload written in place
        row["launch_ms"] = bench_ms(launch, device, repeats)
        row["launch_gbps"] = nbytes / row["launch_ms"] / 1e6
    if raw:  # (on a GPU, unless --calls-only)
        pinned, back = raw["pinned"], raw["device_buf"]
        if provider.data(blob).numel() > pinned.numel():  # an expanding codec (CSR at low sparsity)
            pinned = torch.empty(provider.data(blob).numel(), dtype=torch.uint8, pin_memory=True)
            back = torch.empty_like(pinned, device=device)

        def swap():
            b = provider.compress(x)
            data = provider.data(b)
            host = pinned[: data.numel()]
            host.copy_(data, non_blocking=True)
            dev = back[: data.numel()]
            dev.copy_(host, non_blocking=True)
            return provider.decompress(provider.rebuild(b, dev), x)

        row["swap_ms"] = bench_ms(swap, device, repeats)
        row["swap_vs_raw"] = row["swap_ms"] / raw["round_trip_ms"]
    return row


def static_figures(arch: int, block: int, codecs_used) -> dict:
    """{(codec, word itemsize): {registers, spill_bytes, hot_spills, shared_bytes, build_errors}}: the
    most over the kernels each codec launches at `block` threads, built for sm_`arch`
    (cswap.kernels.aot; needs a process without TRITON_INTERPRET)."""
    from cswap.kernels import aot

    figures: dict = {}
    for launch in aot.codec_launches((block,), aot.WORD_DTYPES, arch=arch):
        codec = launch.kernel.split(".")[0]
        if codec not in codecs_used:
            continue
        built = aot.build(launch, arch)
        sizes = [1, 2, 4, 8] if codec == "lz4" else [getattr(torch, launch.words).itemsize]
        for itemsize in sizes:
            entry = figures.setdefault((codec, itemsize), {"registers": 0, "spill_bytes": 0, "hot_spills": 0,
                                                           "shared_bytes": 0, "build_errors": ""})
            for key in ("registers", "spill_bytes", "hot_spills", "shared_bytes"):
                entry[key] = max(entry[key], getattr(built, key))
            entry["build_errors"] = entry["build_errors"] or built.error
    return figures


def raw_transfers(x, device, repeats) -> dict:
    if device.type != "cuda":
        return {}
    nbytes = x.numel() * x.element_size()
    flat = x.view(torch.uint8).reshape(-1) if x.dtype != torch.bool else x.view(torch.uint8)
    pinned = torch.empty(nbytes + MiB, dtype=torch.uint8, pin_memory=True)
    device_buf = torch.empty(nbytes + MiB, dtype=torch.uint8, device=device)
    d2h = bench_ms(lambda: pinned[:nbytes].copy_(flat, non_blocking=True), device, repeats)
    h2d = bench_ms(lambda: device_buf[:nbytes].copy_(pinned[:nbytes], non_blocking=True), device, repeats)

    def round_trip():
        pinned[:nbytes].copy_(flat, non_blocking=True)
        device_buf[:nbytes].copy_(pinned[:nbytes], non_blocking=True)

    return {"pinned": pinned, "device_buf": device_buf, "d2h_ms": d2h, "h2d_ms": h2d,
            "d2h_gbps": nbytes / d2h / 1e6, "h2d_gbps": nbytes / h2d / 1e6,
            "round_trip_ms": bench_ms(round_trip, device, repeats)}


# -- driver ----------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes and fewer cases (CPU-friendly)")
    p.add_argument("--sizes-mib", type=float, nargs="+", help="tensor sizes in MiB")
    p.add_argument("--sparsities", type=float, nargs="+", help="fractions of zero elements")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), help="element types")
    p.add_argument("--codecs", nargs="+", choices=cswap.codecs.names(), default=list(cswap.codecs.names()))
    p.add_argument("--pattern", choices=PATTERNS, default="blocky", help="where the zeros are (blocky = ReLU-like)")
    p.add_argument("--repeats", type=int, help="timed repeats per measurement")
    p.add_argument("--no-nvcomp", action="store_true", help="skip nvCOMP even if it is installed")
    p.add_argument("--calls-only", action="store_true",
                   help="time the codec calls alone: no transfers, swaps or kernel builds (codecs_ab.py's runs)")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<device>)")
    args = p.parse_args(argv)
    full = not args.quick
    args.sizes_mib = args.sizes_mib or ([1, 16, 256, 1024] if full else [0.25, 1])
    args.sparsities = args.sparsities or ([0.2, 0.5, 0.7, 0.9] if full else [0.2, 0.5, 0.9])
    args.dtypes = args.dtypes or ["fp32", "bf16"]
    args.repeats = args.repeats or (10 if full else 3)
    return args


COLUMNS = [  # (row key, header, format)
    ("provider", "provider", "{}"), ("dtype", "dtype", "{}"), ("size_mib", "MiB", "{:.2f}"),
    ("sparsity", "sparsity", "{:.2f}"), ("ratio", "ratio", "{:.2f}"), ("compress_gbps", "comp GB/s", "{:.1f}"),
    ("launch_gbps", "launch GB/s", "{:.1f}"), ("decompress_gbps", "dec GB/s", "{:.1f}"), ("compress_pct_bw", "comp %bw", "{:.1f}"),
    ("decompress_pct_bw", "dec %bw", "{:.1f}"), ("swap_ms", "swap ms", "{:.3f}"),
    ("swap_vs_raw", "swap/raw", "{:.2f}"),
]
WIDTHS = [14] + [9] * (len(COLUMNS) - 1)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bw = copy_bandwidth_gbps(device, args.repeats)
    env = environment(device, copy_bandwidth_gbps=bw)
    print(f"# cswap codec benchmark on {env['device']} ({device.type}); torch {env['torch']}, "
          f"triton {env['triton']}; copy bandwidth {bw:.0f} GB/s (read + write); pattern {args.pattern}")
    found = providers(args, device)
    static = {}
    if device.type == "cuda" and not args.calls_only:  # what the compiler made of the kernels, beside their speed
        from cswap.kernels.launch import default_config

        major, minor = torch.cuda.get_device_capability(device)
        static = static_figures(10 * major + minor, default_config(device).block, args.codecs)
    print(format_row(COLUMNS, WIDTHS))
    rows = []
    for dtype_name in args.dtypes:
        for size_mib in args.sizes_mib:
            for sparsity in args.sparsities:
                x = make_tensor(int(size_mib * MiB), sparsity, DTYPES[dtype_name], args.pattern, device)
                raw = {} if args.calls_only else raw_transfers(x, device, args.repeats)
                base = {"dtype": dtype_name, "size_mib": size_mib, "sparsity": sparsity, "pattern": args.pattern,
                        "bytes": x.numel() * x.element_size(),
                        **{k: v for k, v in raw.items() if k.endswith(("_ms", "_gbps"))}}
                for provider in found:
                    try:
                        row = {**base, **run_case(provider, x, device, args.repeats, bw, raw),
                               **static.get((provider.name, x.element_size()), {})}
                    except Exception as exc:  # one provider failing must not hide the others
                        row = {**base, "provider": provider.name, "error": f"{type(exc).__name__}: {exc}"}
                        print(f"  {provider.name}: {row['error']}", flush=True)
                    else:
                        print(format_row(COLUMNS, WIDTHS, row), flush=True)
                    rows.append(row)
                del x, raw
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    write_results(rows, env, args, args.out, device, "codecs-quick" if args.quick else "codecs")
    return rows


if __name__ == "__main__":
    main()
