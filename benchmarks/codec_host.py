"""The host's time per codec call on the runtime's path, without a GPU: cswap's part and Triton's, apart.

The runtime's codec calls (Codec.launch_into to encode, Codec.decode into the tensor's
memory) run on cswap's codec thread and hold the GIL while they run, and a call on a
small tensor costs its host time more than its kernels'. Here every call runs against a
stand-in Triton driver: each kernel is compiled once for sm_90 (Triton's ptxas) and each
launch goes through Triton's whole Python path (arguments bound, the cache looked up,
launch metadata) to a launcher that does nothing. Timed again with Triton's JIT entry
stubbed out, the difference is Triton's part; the rest is cswap's (its checks, views,
layout arithmetic and the torch allocations it makes). Not counted: the CUDA driver's
launch itself (cuLaunchKernel) and what torch's allocations and memsets cost on CUDA
(the tensors here are CPU tensors). Figures are this machine's host time, measured;
a GPU host's differs by its CPU.

    python benchmarks/codec_host.py                    # zvc, lz4, zans: 1 MiB fp32, 80% zeros
    python benchmarks/codec_host.py --codecs zvc --rounds 3

Results: a printed table, and codec-host.csv / .json under benchmarks/results/<device>/.
Runs without TRITON_INTERPRET (the interpreter replaces the kernels at import).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported anywhere

import torch  # noqa: E402
import triton.runtime.jit as triton_jit  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

import cswap  # noqa: E402
from cswap.codecs import base as codec_base  # noqa: E402
from cswap.kernels import aot  # noqa: E402
from cswap.kernels.launch import PROGRAMS_PER_SM, LaunchConfig  # noqa: E402
from cswap.tune.synthetic import make_tensor  # noqa: E402

from common import environment, format_row, write_results  # noqa: E402

MiB = 1 << 20
SMS = 132  # an H100's


class _Utils:
    """The driver's binary loader and device query, answered without a device."""

    @staticmethod
    def load_binary(name, kernel, shared, device):
        return 1, 1, 64, 0, 1024  # module, function, registers, spills, most threads

    @staticmethod
    def get_device_properties(device):
        return {"max_shared_mem": 232448, "multiprocessor_count": SMS, "max_num_regs": 65536, "warpSize": 32}


class StandInDriver(aot._StandInDriver):
    """The build tool's stand-in driver (it lets the JIT specialise and compile for sm_90),
    with a binary loader and a launcher that does nothing, so that launches go through."""

    utils = _Utils()

    def __init__(self):
        super().__init__(GPUTarget("cuda", 90, 32))
        self.launches = 0

    def launcher_cls(self, src, metadata):
        def launch(*args, **kwargs):
            self.launches += 1
        return launch


def _median_us(fn, calls: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def measure(name: str, x: torch.Tensor, config: LaunchConfig, calls: int, rounds: int) -> list[dict]:
    """One row per direction: host us per call through Triton's path and with it stubbed."""
    codec = cswap.codecs.get(name)
    reserved = torch.empty(codec.reserve_nbytes(x.numel(), x.element_size()), dtype=torch.uint8)
    sizes = torch.zeros(codec.size_words, dtype=torch.int64)
    payload, header = codec.encode(x, backend="torch")  # (the same format: the reference writes it)
    out = torch.empty(x.numel() * x.element_size(), dtype=torch.uint8)
    calls_of = {"encode": lambda: codec.launch_into(x, reserved, sizes, config, backend="triton"),
                "decode": lambda: codec.decode(payload, header, out=out, config=config, backend="triton")}
    stand_in, previous = StandInDriver(), driver._active
    resolve, run = codec_base.resolve_backend, triton_jit.JITFunction.run
    driver.set_active(stand_in)
    codec_base.resolve_backend = lambda backend, device, where: backend  # (CPU tensors, Triton's path)
    rows = []
    try:
        for direction, call in calls_of.items():
            call()  # compiles every kernel the call launches
            stand_in.launches = 0
            call()
            launches = stand_in.launches
            total = _median_us(call, calls, rounds)
            triton_jit.JITFunction.run = lambda self, *args, **kwargs: None
            try:
                own = _median_us(call, calls, rounds)
            finally:
                triton_jit.JITFunction.run = run
            rows.append({"codec": name, "direction": direction, "mib": x.numel() * x.element_size() / MiB,
                         "triton_launches": launches, "host_us": total, "cswap_us": own,
                         "triton_us": total - own, "triton_us_per_launch": (total - own) / max(launches, 1)})
    finally:
        codec_base.resolve_backend = resolve
        driver.set_active(previous)
    return rows


COLUMNS = [("codec", "codec", "{}"), ("direction", "call", "{}"), ("triton_launches", "launches", "{}"),
           ("host_us", "host us", "{:.1f}"), ("cswap_us", "cswap us", "{:.1f}"), ("triton_us", "Triton us", "{:.1f}"),
           ("triton_us_per_launch", "a launch", "{:.1f}")]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codecs", nargs="+", default=["zvc", "lz4", "zans"], choices=cswap.codecs.names())
    p.add_argument("--mib", type=float, default=1.0, help="tensor size (fp32, 80%% blocky zeros)")
    p.add_argument("--calls", type=int, default=200, help="calls per timed round")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (the median is kept)")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<device>)")
    args = p.parse_args(argv)
    x = make_tensor(int(args.mib * MiB), 0.8, torch.float32, "blocky", torch.device("cpu"), seed=0)
    config = LaunchConfig(grid=PROGRAMS_PER_SM * SMS, block=128)  # the default launch on an H100
    print(f"# host us per codec call on this machine's CPU (measured), {args.mib:g} MiB fp32 at 80% zeros; "
          f"the CUDA driver's launches and torch's CUDA allocations not counted")
    widths = [6, 7, 9, 9, 9, 10, 9]
    print(format_row(COLUMNS, widths))
    rows = []
    for name in args.codecs:
        for row in measure(name, x, config, args.calls, args.rounds):
            print(format_row(COLUMNS, widths, row), flush=True)
            rows.append(row)
    device = torch.device("cpu")
    write_results(rows, environment(device, what="host time per codec call, stand-in Triton driver"), args,
                  args.out, device, "codec-host")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
