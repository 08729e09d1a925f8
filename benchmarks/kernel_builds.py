"""Static figures of every codec kernel, built ahead of time for sm_80 and sm_90.

No GPU needed: the codecs' launches are recorded with the specialisation
Triton gives them, compiled with Triton's bundled ptxas, and registers,
spilled bytes and shared memory read from the compiler, where each spill sits
read from the disassembly (cswap.kernels.aot).
The full matrix: every block the tuner searches x every word type x 32- and
64-bit sizes x both architectures (the test suite builds the sm_90 part).

    python benchmarks/kernel_builds.py                 # the full matrix, a few minutes on 2 cores
    python benchmarks/kernel_builds.py --arch 90 --blocks 128

Results: the printed table, and CSV + JSON under
benchmarks/results/static-triton-<version>/kernel-builds.*; figures are the
compiler's (built, not run). Throughput on a GPU is benchmarks/codecs.py's,
which records these figures beside its measurements.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter would replace the kernels at import

import torch  # noqa: E402
import triton  # noqa: E402

from cswap.kernels import aot  # noqa: E402
from cswap.tune.tuner import DEFAULT_BLOCKS  # noqa: E402

from common import RESULTS, environment, write_results  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=list(aot.ARCHS), help="compute capabilities")
    p.add_argument("--blocks", type=int, nargs="+", default=list(DEFAULT_BLOCKS), help="threads per program")
    p.add_argument("--workers", type=int, help="compiler processes (default: one per core)")
    p.add_argument("--out", type=Path, help=f"results folder (default {RESULTS}/static-triton-<version>)")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    builds = aot.build_matrix(tuple(args.blocks), aot.WORD_DTYPES, tuple(args.arch), large=True,
                              workers=args.workers)
    print(aot.format_table(builds))
    print("# " + aot.summary(builds).replace("\n", "\n# "))
    rows = [{**{k: v for k, v in asdict(b).items() if k != "log"}, "ok": b.ok} for b in builds]
    env = environment(torch.device("cpu"), figures="built by ptxas ahead of time (no GPU): not measured on one")
    out = args.out or RESULTS / f"static-triton-{triton.__version__}"
    write_results(rows, env, args, out, torch.device("cpu"), "kernel-builds")
    return rows


if __name__ == "__main__":
    sys.exit(0 if all(r["ok"] for r in main()) else 1)
