"""Dynamic instruction count per byte of each codec, counted in Triton's interpreter.

Every operation a kernel executes in the interpreter (TRITON_INTERPRET=1) is
counted as the warp instructions it would issue on a GPU: an operation over E
elements in a program of W warps issues W * ceil(E / (32 W)) (a scalar one, W);
a reduction or scan counts its input once more plus five shuffle steps per
warp; W is the launch's own (a kernel that fixes its warps, as LZ4's encoder and
ZANS's plan do, is counted at them; LZ4's encoder runs a GPU's 32-position
rounds). Layout-only operations (ranges, splats, broadcasts) are free. The count
is the design's, not the hardware's: no 64-bit splitting, no address modes,
no caches; it compares designs (before / after a change) on the same input.
Counts are given per kernel and summed per direction; the PyTorch glue
between launches (prefix sums, allocation) is not counted.

    python benchmarks/instructions.py                       # this checkout
    python benchmarks/instructions.py --label before --json before.json

Input: `--mib` MiB of ReLU-like fp32 activations (blocky zeros) at each
sparsity; the launch config is cswap's default GPU one (block 128). Results:
the printed table and, with --json, a file; figures are counts, not times.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

import cswap  # noqa: E402
from cswap.kernels import lz4 as lz4_kernels  # noqa: E402
from cswap.tune.synthetic import make_tensor  # noqa: E402

# Operations that only describe layout or values known at compile time.
_FREE = {"create_make_range", "create_splat", "create_expand_dims", "create_broadcast", "create_get_program_id",
         "create_get_num_programs", "create_print", "create_assert", "create_assume", "create_barrier"}


class Counter:
    """Counts warp instructions of interpreted kernels, per kernel, while installed."""

    def __init__(self, num_warps: int):
        self.num_warps = num_warps
        self.by_kernel: dict[str, int] = {}
        self._kernel = "(outside a kernel)"
        self._saved: list = []

    def _cost(self, elements: int) -> int:
        w = self.num_warps
        return w * math.ceil(max(elements, 1) / (32 * w))

    def _wrap(self, owner, name, cost_of):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            result = original(*args, **kwargs)
            self.by_kernel[self._kernel] = self.by_kernel.get(self._kernel, 0) + cost_of(args, result)
            return result

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def __enter__(self):
        builder = interpreter.InterpreterBuilder
        for name in dir(builder):
            if (name.startswith("create_") or name in ("binary_op", "ternary_op", "unary_op", "cast_impl")) \
                    and name not in _FREE and callable(getattr(builder, name)):
                self._wrap(builder, name, lambda args, result: self._cost(_elements(result)))
        self._wrap(interpreter.ReduceScanOpInterface, "apply",
                   lambda args, result: 2 * self._cost(_elements(args[1])) + 5 * self.num_warps)
        launch = interpreter.InterpretedFunction.run

        def run(function, *args, **kwargs):  # a launch: what follows is this kernel's, at its own warps
            self._kernel = function.fn.__name__.strip("_").removesuffix("_kernel")
            default, self.num_warps = self.num_warps, kwargs.get("num_warps", self.num_warps)
            try:
                return launch(function, *args, **kwargs)
            finally:
                self._kernel = "(outside a kernel)"
                self.num_warps = default

        self._saved.append((interpreter.InterpretedFunction, "run", launch))
        interpreter.InterpretedFunction.run = run
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)


def _elements(value) -> int:
    if isinstance(value, (tuple, list)):
        return max((_elements(v) for v in value), default=1)
    data = getattr(value, "data", None)
    if data is None and hasattr(value, "handle"):
        data = getattr(value.handle, "data", None)
    return int(getattr(data, "size", 1) or 1)


def count(codec: str, x: torch.Tensor, config: cswap.LaunchConfig) -> tuple[dict, dict]:
    """Warp instructions per kernel for compressing and for decompressing x."""
    c = cswap.codecs.get(codec)
    with Counter(config.num_warps) as compress:
        blob = c.compress(x, config=config, backend="triton")
    with Counter(config.num_warps) as decompress:
        y = c.decompress(blob, config=config, backend="triton")
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8)), codec
    return compress.by_kernel, decompress.by_kernel


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, default=0.25, help="tensor size in MiB (the interpreter is slow)")
    p.add_argument("--sparsities", type=float, nargs="+", default=[0.5, 0.9])
    p.add_argument("--codecs", nargs="+", default=list(cswap.codecs.names()))
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--label", default="this checkout")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    config = cswap.LaunchConfig(grid=132 * 4, block=args.block)
    # LZ4's encoder at a GPU's round of 32 positions, not the interpreter's wide one (the
    # same bytes: tests/test_lz4.py checks both shapes against the reference)
    lz4_kernels.encode_tile = lambda: lz4_kernels.ENCODE_TILE
    rows = []
    print(f"# warp instructions per uncompressed byte, counted in Triton's interpreter ({args.label}); "
          f"{args.mib} MiB fp32, block {args.block}")
    print(f"{'codec':<6} {'sparsity':>8} {'compress':>10} {'decompress':>11}   per kernel")
    for sparsity in args.sparsities:
        x = make_tensor(int(args.mib * (1 << 20)), sparsity, torch.float32, "blocky", torch.device("cpu"), seed=0)
        nbytes = x.numel() * x.element_size()
        for codec in args.codecs:
            comp, dec = count(codec, x, config)
            per_kernel = {k: v / nbytes for k, v in {**comp, **dec}.items()}
            row = {"label": args.label, "codec": codec, "sparsity": sparsity, "bytes": nbytes, "block": args.block,
                   "compress_per_byte": sum(comp.values()) / nbytes,
                   "decompress_per_byte": sum(dec.values()) / nbytes, "per_kernel": per_kernel}
            rows.append(row)
            kernels = ", ".join(f"{k} {v:.3f}" for k, v in per_kernel.items())
            print(f"{codec:<6} {sparsity:>8.2f} {row['compress_per_byte']:>10.3f} {row['decompress_per_byte']:>11.3f}"
                  f"   {kernels}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
