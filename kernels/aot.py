"""The codec kernels built ahead of time for real GPUs, on a machine without one.

`record()` runs the codecs' own launchers under a stand-in Triton driver that
compiles and launches nothing: each launch is captured with the specialisation
Triton's JIT gave it (argument types, pointer alignment, constexprs, warps),
so what is built below is what a GPU would build for the same call. `build()`
compiles one launch for sm_80 or sm_90 with Triton's bundled ptxas and reads
registers and spills from ptxas' log, shared memory from the kernel's metadata.

    python -m cswap.kernels.aot --arch 80 90 --json builds.json

prints one row per (kernel, config, arch). TRITON_INTERPRET must be unset in
the process (the interpreter replaces @triton.jit at import): the command line
and `build_matrix()` run in a fresh subprocess for that reason.

Private Triton surfaces used here (checked on Triton 3.9): `driver.set_active`
and its `_active`, `knobs.runtime.jit_cache_hook` and
`knobs.nvidia.dump_ptxas_log`; a Triton without the hook or the log fails in
`record()` / `build()` with a message that says so.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

import torch

from .launch import LaunchConfig

__all__ = ["ARCHS", "WORD_DTYPES", "Launch", "Build", "record", "codec_launches", "build", "build_matrix",
           "format_table"]

ARCHS = (80, 90)
WORD_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class Launch:
    """One kernel launch as Triton's JIT specialised it."""

    kernel: str                 # module.function, e.g. "zvc._zvc_compress_kernel"
    signature: dict             # parameter -> Triton type ("*i32", "i64", "constexpr", ...)
    constexprs: dict            # parameter -> value, for the constexpr parameters
    attrs: dict                 # argument index path -> [["tt.divisibility", 16]], ...
    num_warps: int
    words: str = ""             # the word dtype the codec launched it for ("" for bytes)

    @property
    def block(self) -> int:
        return 32 * self.num_warps

    @property
    def config(self) -> str:
        """Constexprs and argument widths that tell two builds of one kernel apart."""
        names = list(self.signature)
        consts = " ".join(f"{names[k[0]]}={v}" for k, v in self.constexprs.items() if isinstance(v, (int, bool)))
        wide = "i64" if any(t == "i64" for t in self.signature.values()) else "i32"
        return f"block={self.block} {self.words or 'u8'} {wide} {consts}".strip()

    def widened(self) -> "Launch":
        """The same launch as a tensor of 2**31 elements or more makes it: its
        element, byte, non-zero, run and column counts passed as 64-bit integers
        (tile and chunk counts stay 32-bit, as do rows: a first dimension of
        2**31 is not a tensor anyone trains on)."""
        signature = {k: ("i64" if t == "i32" and k in _SIZE_ARGUMENTS else t) for k, t in self.signature.items()}
        return Launch(self.kernel, signature, self.constexprs, self.attrs, self.num_warps, self.words)

    def key(self) -> tuple:
        return (self.kernel, tuple(self.signature.items()), tuple(sorted(map(str, self.constexprs.items()))),
                tuple(sorted(map(str, self.attrs.items()))), self.num_warps)


_SIZE_ARGUMENTS = {"n", "nnz", "num_runs", "cols", "nbytes", "blocks_nbytes", "symbols", "mask_bytes", "streams_nbytes"}


@dataclass
class Build:
    """Resources of one launch built for one architecture."""

    kernel: str
    config: str
    arch: int
    registers: int = -1
    spill_bytes: int = -1       # spill stores + spill loads, bytes
    shared_bytes: int = -1
    error: str = ""
    log: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return not self.error and self.spill_bytes == 0


class _StandInDriver:
    """Enough of a Triton driver for the JIT to specialise a launch for `target`."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True


def _kernel_name(jit_function) -> str:
    return f"{jit_function.fn.__module__.rsplit('.', 1)[-1]}.{jit_function.fn.__name__}"


@contextlib.contextmanager
def record(arch: int = 90, words: str = ""):
    """Capture every Triton launch inside the block (nothing compiles or runs).

    Yields the list the launches are appended to; `words` labels them."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    if _interpreting():
        raise RuntimeError("cswap.kernels.aot: TRITON_INTERPRET=1 is set; the interpreter replaces the "
                           "kernels at import. Run in a process without it (python -m cswap.kernels.aot).")
    if not hasattr(knobs.runtime, "jit_cache_hook"):
        raise RuntimeError(f"cswap.kernels.aot: this Triton ({_triton_version()}) has no "
                           f"knobs.runtime.jit_cache_hook; ahead-of-time builds need Triton 3.4 or later")
    launches: list[Launch] = []

    def hook(*, fn, compile, **_):
        jit = fn.jit_function
        signature = dict(compile["signature"])
        launches.append(Launch(_kernel_name(jit), signature, dict(compile["constants"]),
                               dict(compile["configs"][0]), int(compile["num_warps"]), words))
        return True  # "handled": the JIT neither compiles nor launches

    previous_hook, previous_driver = knobs.runtime.jit_cache_hook, driver._active  # None until first used
    driver.set_active(_StandInDriver(GPUTarget("cuda", arch, 32)))
    knobs.runtime.jit_cache_hook = hook
    try:
        yield launches
    finally:
        knobs.runtime.jit_cache_hook = previous_hook
        driver.set_active(previous_driver)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_version() -> str:
    import triton
    return triton.__version__


def _sample(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Half zeros in short runs: every codec path has work (runs, tiles, matches)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randint(1, 100, (n,), generator=g, dtype=torch.int64)
    x[torch.rand(n, generator=g) < 0.5] = 0
    return x.to(dtype)


def codec_launches(blocks=(128,), word_dtypes=WORD_DTYPES, arch: int = 90) -> list[Launch]:
    """Every kernel launch the codecs make, compressing and decompressing, per
    word dtype (LZ4 works on bytes) and block size; duplicates removed."""
    from . import csr, lz4, rle, zans, zvc

    def alloc(nbytes):
        return torch.zeros(nbytes, dtype=torch.uint8)

    n = 200_004  # several tiles and chunks; not a multiple of 16, like most tensors
    launches: dict[tuple, Launch] = {}
    for block in blocks:
        config = LaunchConfig(grid=8, block=block)
        for dtype in word_dtypes:
            words = _sample(n, dtype)
            label = str(dtype).removeprefix("torch.")
            rows, cols = 12, n // 12
            zvc_payload = torch.zeros(0, dtype=torch.uint8)
            zvc_nnz = zvc.zvc_compress_ref(words, lambda k: _keep(k, zvc_payload))
            rle_payload = torch.zeros(0, dtype=torch.uint8)
            rle_runs, rle_nnz = rle.rle_compress_ref(words, lambda k: _keep(k, rle_payload))
            csr_payload = torch.zeros(0, dtype=torch.uint8)
            csr_nnz = csr.csr_compress_ref(words, rows, cols, lambda k: _keep(k, csr_payload))
            zans_payload = torch.zeros(0, dtype=torch.uint8)
            zans_meta = zans.zans_compress_ref(words, lambda k: _keep(k, zans_payload))
            with record(arch, label) as got, _zans_planned_from_reference(zans):
                zvc.zvc_compress(words, alloc, config)
                zvc.zvc_decompress(zvc_payload, n, zvc.TILE, zvc_nnz, dtype, config)
                rle.rle_compress(words, alloc, config)
                rle.rle_decompress(rle_payload, n, rle.TILE, rle_runs, rle_nnz, dtype, config)
                csr.csr_compress(words, rows, cols, alloc, config)
                csr.csr_compress(words, n // 4, 4, alloc, config)  # rows narrower than a tile
                csr.csr_decompress(csr_payload, rows, cols, csr_nnz, 4, dtype, config)
                zans.zans_compress(words, alloc, config)
                zans.zans_decompress(zans_payload, n, *zans_meta, dtype, config)
            for launch in got:
                launches.setdefault(launch.key(), launch)
        data = _sample(n, torch.uint8)
        lz4_payload = torch.zeros(0, dtype=torch.uint8)
        chunks, blocks_nbytes = lz4.lz4_compress_ref(data, lambda k: _keep(k, lz4_payload))
        with record(arch) as got:
            lz4.lz4_compress(data, alloc, config)
            lz4.lz4_decompress(lz4_payload, n, lz4.CHUNK, chunks, blocks_nbytes, config)
        for launch in got:
            launches.setdefault(launch.key(), launch)
    return list(launches.values())


@contextlib.contextmanager
def _zans_planned_from_reference(zans):
    """Nothing runs while launches are recorded, but ZANS plans its encoding from its
    histogram: the histogram kernel is launched (and recorded) as usual, and the plan
    is made from the reference's histogram of the same words."""
    launch_histogram = zans._histogram

    def histogram(words, config):
        counts = launch_histogram(words, config)[1]
        return zans.byte_histograms(words).cpu().numpy(), counts

    zans._histogram = histogram
    try:
        yield
    finally:
        zans._histogram = launch_histogram


def _keep(nbytes: int, holder: torch.Tensor) -> torch.Tensor:
    holder.resize_(nbytes)
    return holder


_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def build(launch: Launch, arch: int) -> Build:
    """Compile `launch` for sm_`arch` (no GPU needed) and read its resources."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import csr, lz4, rle, zans, zvc  # noqa: F401  (the kernels' modules, by short name)

    module, name = launch.kernel.split(".")
    fn = getattr(sys.modules[f"{__package__}.{module}"], name)
    result = Build(launch.kernel, launch.config, arch)
    source = ASTSource(fn, launch.signature, launch.constexprs, launch.attrs)
    stdout = io.StringIO()
    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True  # a cached kernel would skip ptxas and its log
    try:
        with contextlib.redirect_stdout(stdout):
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": launch.num_warps})
    except Exception as exc:  # noqa: BLE001  a compile error is a result to report
        result.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
        return result
    result.log = stdout.getvalue()
    registers = _PTXAS_REGISTERS.findall(result.log)
    spills = _PTXAS_SPILLS.findall(result.log)
    if not registers or not spills:
        result.error = "ptxas printed no resource usage (knobs.nvidia.dump_ptxas_log unsupported?)"
        return result
    result.registers = max(int(r) for r in registers)
    result.spill_bytes = max(int(s) + int(l) for s, l in spills)
    result.shared_bytes = int(compiled.metadata.shared)
    return result


def _build_job(job):
    launch, arch = job
    return build(launch, arch)


def build_matrix(blocks=(128,), word_dtypes=WORD_DTYPES, archs=ARCHS, large: bool = False,
                 workers: int | None = None) -> list[Build]:
    """Every codec launch at `blocks` x `word_dtypes`, built for each of `archs` (and,
    with `large`, with 64-bit sizes too), in `workers` processes."""
    launches = codec_launches(blocks, word_dtypes)
    if large:
        launches += [launch.widened() for launch in launches]
    jobs = [(launch, arch) for arch in archs for launch in launches]
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    if workers == 1:
        return [_build_job(job) for job in jobs]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_build_job, jobs, chunksize=1))


def format_table(builds: list[Build]) -> str:
    rows = [("kernel", "config", "arch", "registers", "spilled B", "shared B", "status")]
    for b in sorted(builds, key=lambda b: (b.kernel, b.config, b.arch)):
        status = b.error or ("ok" if b.ok else "SPILLS")
        rows.append((b.kernel, b.config, f"sm_{b.arch}", str(b.registers), str(b.spill_bytes),
                     str(b.shared_bytes), status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cswap.kernels.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), help="compute capabilities, e.g. 80 90")
    parser.add_argument("--blocks", type=int, nargs="+", default=[128], help="threads per program")
    parser.add_argument("--dtypes", nargs="+", default=[str(d).removeprefix("torch.") for d in WORD_DTYPES])
    parser.add_argument("--large", action="store_true", help="also build with 64-bit sizes (>= 2**31 elements)")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--json", help="write the builds here")
    args = parser.parse_args(argv)
    if _interpreting():
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.call([sys.executable, "-m", "cswap.kernels.aot", *(argv or sys.argv[1:])], env=env)
    builds = build_matrix(tuple(args.blocks), tuple(_dtype(d) for d in args.dtypes), tuple(args.arch),
                          args.large, args.workers)
    print(format_table(builds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in asdict(b).items() if k != "log"} for b in builds], f, indent=1)
    failed = [b for b in builds if not b.ok]
    print(f"{len(builds) - len(failed)} of {len(builds)} builds compile without spills")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
