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

A spill is hot when it sits in an innermost loop, where a kernel spends its
time; `build()` finds where ptxas put each spill by disassembling the cubin
with the nvdisasm Triton ships (`hot_spills`). A value carried across the
tile loop or a step loop that ptxas stores and reloads once per tile or step
(4096 elements, a 16 KiB chunk, or 256-4096 elements) costs nothing
measurable; ptxas 12.8 (Triton 3.6) makes a few such under the launches'
128-register cap (launch.MAX_REGISTERS).

Private Triton surfaces used here (checked on Triton 3.6, 3.8 and 3.9):
`driver.set_active` and its `_active`, `knobs.runtime.jit_cache_hook`,
`knobs.nvidia.dump_ptxas_log` and `knobs.nvidia.nvdisasm`; a Triton without
the hook or the log fails in `record()` / `build()` with a message that says
so.
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
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

import torch

from .launch import MAX_REGISTERS, LaunchConfig

__all__ = ["ARCHS", "MAX_REGISTERS", "WORD_DTYPES", "Launch", "Build", "record", "codec_launches", "build",
           "build_matrix", "format_table", "spill_sites", "load_bytes_per_iteration", "summary"]

ARCHS = (80, 90)
# The gate: at most MAX_REGISTERS per thread (launch.py: every launch asks ptxas for
# it), and no spill in an innermost loop (see spill_sites).
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
    maxnreg: int | None = None  # the launch's register cap (ptxas' .maxnreg), None: ptxas chooses

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
        return Launch(self.kernel, signature, self.constexprs, self.attrs, self.num_warps, self.words, self.maxnreg)

    def key(self) -> tuple:
        return (self.kernel, tuple(self.signature.items()), tuple(sorted(map(str, self.constexprs.items()))),
                tuple(sorted(map(str, self.attrs.items()))), self.num_warps, self.maxnreg)


_SIZE_ARGUMENTS = {"n", "nnz", "values_room", "room", "num_runs", "cols", "nbytes", "blocks_nbytes", "symbols",
                   "mask_bytes", "streams_nbytes"}


@dataclass
class Build:
    """Resources of one launch built for one architecture."""

    kernel: str
    config: str
    arch: int
    registers: int = -1
    spill_bytes: int = -1       # spill stores + spill loads, bytes
    hot_spills: int = -1        # spill instructions in innermost loops (0 when none spill)
    shared_bytes: int = -1
    load_bytes: int = -1        # global bytes a thread's loads ask for in one loop pass (load_bytes_per_iteration)
    fences: int = -1            # full memory fences (MEMBAR) in the code: an acq_rel atomic puts one before it
    error: str = ""
    log: str = field(default="", repr=False)

    @property
    def problems(self) -> list[str]:
        """Why this build fails the compile gate (empty: it passes)."""
        if self.error:
            return [self.error]
        found = []
        if self.registers > MAX_REGISTERS:
            found.append(f"{self.registers} registers (budget {MAX_REGISTERS})")
        if self.hot_spills:
            found.append(f"{self.hot_spills} spill instructions in innermost loops")
        return found

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def status(self) -> str:
        if self.problems:
            return "; ".join(self.problems)
        return "ok" if self.spill_bytes == 0 else "ok (spills outside innermost loops)"


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
        options = json.loads(compile["specialization_data"])["options"]
        launches.append(Launch(_kernel_name(jit), signature, dict(compile["constants"]),
                               dict(compile["configs"][0]), int(compile["num_warps"]), words,
                               options.get("maxnreg")))
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
            with record(arch, label) as got:
                zvc.zvc_compress(words, alloc, config)
                zvc.zvc_decompress(zvc_payload, n, zvc.TILE, zvc_nnz, dtype, config)
                rle.rle_compress(words, alloc, config)
                rle.rle_decompress(rle_payload, n, rle.TILE, rle_runs, rle_nnz, dtype, config)
                csr.csr_compress(words, rows, cols, alloc, config)
                csr.csr_compress(words, n // 4, 4, alloc, config)  # rows narrower than a tile
                csr.csr_decompress(csr_payload, rows, cols, csr_nnz, 4, dtype, config)
                # (the runtime's path: its plan stays on the device, so nothing here reads it back)
                zans.zans_launch(words, alloc(zans.reserve_nbytes(n, words.element_size())), config)
                zans.zans_decompress(zans_payload, n, *zans_meta, dtype, config)
            for launch in got:
                launches.setdefault(launch.key(), launch)
        data = _sample(n, torch.uint8)
        lz4_payload = torch.zeros(0, dtype=torch.uint8)
        chunks, blocks_nbytes = lz4.lz4_compress_ref(data, lambda k: _keep(k, lz4_payload))
        with record(arch) as got:
            lz4.lz4_launch(data, alloc(lz4.reserve_nbytes(n)), config)  # (the one kernel; nothing read back)
            lz4.lz4_decompress(lz4_payload, n, lz4.CHUNK, chunks, blocks_nbytes, config)
        for launch in got:
            launches.setdefault(launch.key(), launch)
    return list(launches.values())


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
                                      options={"num_warps": launch.num_warps, "maxnreg": launch.maxnreg})
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
    sass = _disassemble(compiled.asm["cubin"])
    result.hot_spills = sum(1 for _, inner in spill_sites(sass) if inner)
    result.load_bytes = load_bytes_per_iteration(sass)
    result.fences = len(_SASS_FENCE.findall(sass))
    return result


_SASS_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_SASS_BRANCH = re.compile(r"^(@!?U?P\w+\s+)?BRA((?:\.\w+)*)\b.*`\((\.L_x_\d+)\)")
_SASS_EXIT = re.compile(r"^(@!?U?P\w+\s+)?(EXIT|RET)\b")
_SASS_SPILL = re.compile(r"\b(STL|LDL)(\.\w+)*\b")
_SASS_FENCE = re.compile(r"\bMEMBAR\b")


def spill_sites(sass: str) -> list[tuple[int, bool]]:
    """For each spill instruction (STL/LDL) in `sass` (nvdisasm -c output): how many
    loops contain it, and whether one of them is innermost (contains no other
    loop), where a kernel spends its time (see _loops)."""
    code, block_of, bodies = _loops(sass)
    innermost = [body for body in bodies if not any(other < body for other in bodies)]
    return [(sum(1 for body in bodies if block_of[i] in body), any(block_of[i] in body for body in innermost))
            for i, text in enumerate(code) if _SASS_SPILL.search(text)]


_SASS_GLOBAL_LOAD = re.compile(r"\bLDG((?:\.\w+)*)")
_LOAD_BYTES = {"128": 16, "64": 8, "U8": 1, "S8": 1, "U16": 2, "S16": 2}


def load_bytes_per_iteration(sass: str) -> int:
    """The global bytes one thread's loads (LDG) ask for in one pass through a loop's
    own code (its nested loops aside), the most over the kernel's loops and the code
    outside them: what a thread can have in flight at once, since ptxas issues a
    pass's independent loads before their first use. A static figure from `sass`
    (nvdisasm -c output), not a measurement."""
    code, block_of, bodies = _loops(sass)
    regions = [{b for b in body if not any(other < body and b in other for other in bodies)} for body in bodies]
    regions.append(set(block_of.values()) - set().union(*bodies))  # the code outside every loop
    per_region = [0] * len(regions)
    for i, text in enumerate(code):
        load = _SASS_GLOBAL_LOAD.search(text)
        if load:
            width = next((_LOAD_BYTES[m] for m in load.group(1).split(".") if m in _LOAD_BYTES), 4)
            for r, region in enumerate(regions):
                if block_of[i] in region:
                    per_region[r] += width
    return max(per_region, default=0)


def _loops(sass: str) -> tuple[list[str], dict[int, int], list[set[int]]]:
    """(instructions, the basic block of each, the blocks of each loop) of `sass`.
    Loops are the natural loops of the control-flow graph (a back edge to a block
    that dominates it, and the blocks that reach it without passing there), so
    loops ptxas laid out out of order still nest right."""
    labels, code, pending = {}, [], []
    for line in sass.splitlines():
        label = _SASS_LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        found = _SASS_INSTRUCTION.search(line)
        if found:
            labels.update((name, len(code)) for name in pending)
            pending = []
            code.append(found.group(2))
    if not code:
        return [], {}, []
    # Basic blocks: a block starts at the first instruction, a branch target, or after a branch or exit.
    starts = {0} | set(labels.values())
    for i, text in enumerate(code):
        if _SASS_BRANCH.match(text) or _SASS_EXIT.match(text):
            starts.add(i + 1)
    starts = sorted(k for k in starts if k < len(code))
    block_of = {}
    for b, start in enumerate(starts):
        end = starts[b + 1] if b + 1 < len(starts) else len(code)
        block_of.update((i, b) for i in range(start, end))
    successors = []
    for b, start in enumerate(starts):
        last = (starts[b + 1] if b + 1 < len(starts) else len(code)) - 1
        text, nxt = code[last], []
        branch, leaves = _SASS_BRANCH.match(text), _SASS_EXIT.match(text)
        if branch and branch.group(3) in labels:
            nxt.append(block_of[labels[branch.group(3)]])
        # Predicated, or BRA.DIV (taken only when the warp has diverged): it may fall through.
        conditional = bool((branch or leaves) and (branch or leaves).group(1)) or \
            bool(branch and re.search(r"\.(DIV|CONV)", branch.group(2)))
        if not (branch or leaves) or conditional:
            if last + 1 < len(code):
                nxt.append(block_of[last + 1])
        successors.append(nxt)
    n = len(starts)
    reachable, stack = set(), [0]
    while stack:
        block = stack.pop()
        if block not in reachable:
            reachable.add(block)
            stack.extend(successors[block])
    successors = [nxt if b in reachable else [] for b, nxt in enumerate(successors)]
    predecessors = [[] for _ in range(n)]
    for b, nxt in enumerate(successors):
        for c in nxt:
            predecessors[c].append(b)
    dominators = [{0}] + [set(reachable) for _ in range(n - 1)]
    changed = True
    while changed:
        changed = False
        for b in sorted(reachable - {0}):
            reached = [dominators[p] for p in predecessors[b]]
            new = set.intersection(*reached) | {b} if reached else {b}
            if new != dominators[b]:
                dominators[b], changed = new, True
    loops: dict[int, set[int]] = {}  # header -> blocks of its natural loop(s)
    for tail, nxt in enumerate(successors):
        for header in nxt:
            if header in dominators[tail]:
                body, stack = loops.setdefault(header, {header}), [tail]
                while stack:
                    block = stack.pop()
                    if block not in body:
                        body.add(block)
                        stack.extend(predecessors[block])
    return code, block_of, list(loops.values())


def _disassemble(cubin: bytes) -> str:
    from triton import knobs

    path = knobs.nvidia.nvdisasm.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([path, "-c", f.name], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"cswap.kernels.aot: {path} could not disassemble a kernel: {run.stderr.strip()}")
    return run.stdout


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
    rows = [("kernel", "config", "arch", "registers", "spilled B", "hot spills", "shared B", "loads B/pass",
             "fences", "status")]
    for b in sorted(builds, key=lambda b: (b.kernel, b.config, b.arch)):
        rows.append((b.kernel, b.config, f"sm_{b.arch}", str(b.registers), str(b.spill_bytes), str(b.hot_spills),
                     str(b.shared_bytes), str(b.load_bytes), str(b.fences), b.status))
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
            json.dump([{**{k: v for k, v in asdict(b).items() if k != "log"}, "ok": b.ok} for b in builds], f,
                      indent=1)
    print(summary(builds))
    return 0 if all(b.ok for b in builds) else 1


def summary(builds: list[Build]) -> str:
    """'672 builds: 668 pass the gate (4 of them spill outside innermost loops), ...'."""
    passing = [b for b in builds if b.ok]
    cold = sum(1 for b in passing if b.spill_bytes)
    line = (f"{len(builds)} builds: {len(passing)} pass the gate ({cold} of them spill outside innermost loops); "
            f"most registers {max((b.registers for b in builds), default=0)}")
    failed = [f"{b.kernel} [{b.config}] sm_{b.arch}: {b.status}" for b in builds if not b.ok]
    return "\n".join([line, *failed])


if __name__ == "__main__":
    raise SystemExit(main())
