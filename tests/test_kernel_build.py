"""The compile gate (issues 12, 24): every codec kernel, built ahead of time for a
real GPU without one, compiles, fits the register budget and spills nothing in
an innermost loop (a value carried across the tile or step loop may spill: it
is stored and loaded once per tile or step). It runs on every supported Triton:
CI runs this file with the newest and the oldest (.ci/run).

CI builds for sm_90 at every block size the tuner can choose and every word
dtype the codecs launch, and at the default block with 64-bit sizes (tensors
of 2**31 elements or more); `python benchmarks/kernel_builds.py` builds the full
matrix (sm_80 and sm_90, every block, both size widths) and writes it to a file.
The builds run in a subprocess: TRITON_INTERPRET, which these tests set for the
other modules, replaces the kernels at import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cswap.kernels.aot import MAX_REGISTERS, spill_sites
from cswap.kernels.launch import LaunchConfig
from cswap.kernels.zvc import TILE_MIN_WARPS
from cswap.tune.tuner import DEFAULT_BLOCKS

pytestmark = pytest.mark.slow  # the compile gate: CI runs it (pytest -m slow), on both version jobs

DEFAULT_BLOCK = LaunchConfig(grid=1).block
KERNELS = {f"{codec}._{codec}_{part}_kernel" for codec in ("rle", "csr") for part in ("compress", "decompress")}
KERNELS |= {"zvc._nonzero_count_kernel", "rle._rle_count_kernel"}  # ZVC's count pass serves CSR too
KERNELS |= {"zvc._zvc_one_pass_kernel", "zvc._zvc_decompress_kernel"}
KERNELS |= {"lz4._lz4_encode_kernel", "lz4._lz4_decompress_kernel"}
KERNELS |= {f"zans._zans_{part}_kernel" for part in ("histogram", "plan", "compact", "encode", "pack", "decode",
                                                     "unmask", "tables")}
ONE_BUILD_FOR_ALL_WORDS = {"zans._zans_tables_kernel"}  # decoder tables: whatever the tensor
# pointers and a plane mask, or the tile (ZANS's encode and pack read their sizes from the device's plan):
# no argument grows with the tensor past 32 bits (the tables kernel zeroes n / 4096 + 1 words of look-back state)
NO_SIZES = {"zans._zans_tables_kernel", "zans._zans_encode_kernel", "zans._zans_pack_kernel"}
# hold a whole tile: at least this many threads
MIN_BLOCK = {name: 32 * TILE_MIN_WARPS
             for name in ("zvc._zvc_one_pass_kernel", "zvc._zvc_decompress_kernel", "zans._zans_unmask_kernel",
                          "zans._zans_compact_kernel")}
FIXED_BLOCK = {"zans._zans_plan_kernel": 256,  # one thread per symbol of a table, whatever the config
               "lz4._lz4_encode_kernel": 32}  # one warp per chunk


def _build(tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # integer kernels: only silences Triton 3.9's notice
    run = subprocess.run([sys.executable, "-m", "cswap.kernels.aot", "--arch", "90", "--json", str(out), *args],
                         env=env, capture_output=True, text=True, timeout=600)
    print(run.stdout)
    assert out.exists(), run.stdout + run.stderr
    return json.loads(out.read_text()), run


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("aot")
    tuner_blocks, run = _build(tmp, "blocks", "--blocks", *map(str, DEFAULT_BLOCKS))
    wide, run_wide = _build(tmp, "wide", "--blocks", str(DEFAULT_BLOCK), "--large")
    return tuner_blocks + [b for b in wide if " i64 " in b["config"]], (run, run_wide)


def test_every_kernel_is_built_at_every_tuner_block_and_word_type(builds):
    results, _ = builds
    assert {b["kernel"] for b in results} == KERNELS
    for kernel in KERNELS:
        configs = {b["config"] for b in results if b["kernel"] == kernel}
        blocks = {FIXED_BLOCK[kernel]} if kernel in FIXED_BLOCK else {max(b, MIN_BLOCK.get(kernel, 0))
                                                                       for b in DEFAULT_BLOCKS}
        for block in blocks:
            words = {c.split()[1] for c in configs if c.startswith(f"block={block} ")}
            if kernel.startswith("lz4"):
                expected = {"u8"}
            elif kernel in ONE_BUILD_FOR_ALL_WORDS:  # recorded under the first word type
                expected = {"int8"}
            else:
                expected = {"int8", "int16", "int32", "int64"}
            assert words == expected, (kernel, block, words)
        if kernel not in NO_SIZES:
            assert any(" i64 " in c for c in configs), f"{kernel}: no build with 64-bit sizes"


def test_no_compile_errors_and_no_hot_spills(builds):
    """A spill in an innermost loop fails; one of a value carried across the tile or
    step loop (stored and loaded once per tile or step) is reported and passes."""
    results, runs = builds
    bad = [b for b in results if b["error"] or b["hot_spills"] != 0]
    assert not bad, "\n".join(f"{b['kernel']} [{b['config']}] sm_{b['arch']}: {b['error'] or b['hot_spills']} "
                              f"spill instructions in innermost loops" for b in bad)
    assert all(run.returncode == 0 for run in runs)


def test_lz4_encoder_never_spills(builds):
    """Issue 24: its sequential walk is the codec's bottleneck; no spill at all, on
    every supported Triton."""
    results, _ = builds
    spills = [(b["config"], b["spill_bytes"]) for b in results
              if b["kernel"] == "lz4._lz4_encode_kernel" and b["spill_bytes"] != 0]
    assert not spills


def test_registers_within_budget(builds):
    results, _ = builds
    over = [b for b in results if b["registers"] > MAX_REGISTERS]
    assert not over, [(b["kernel"], b["config"], b["registers"]) for b in over]
    assert all(b["registers"] > 0 and b["shared_bytes"] >= 0 for b in results)


def test_whole_tile_kernels_keep_their_tile_out_of_shared_memory(builds):
    """Their non-zeros go to (or come from) positions known at run time, in the layout the
    tile was loaded in (kernels.zvc._flat): no conversion of the tile through shared
    memory, which took ZVC's one-pass encoder 8-32 KiB a program and three round trips a
    tile; what is left is the reductions' scratch."""
    results, _ = builds
    for kernel in MIN_BLOCK:
        shared = {b["config"]: b["shared_bytes"] for b in results if b["kernel"] == kernel}
        assert shared and all(0 <= nbytes <= 1024 for nbytes in shared.values()), (kernel, shared)


def test_no_kernel_fences_but_the_plans_last_program(builds):
    """A full fence (MEMBAR) waits until every store the thread issued has landed. The
    look-back's atomics are relaxed (kernels/lookback.py): with Triton's default, acq_rel,
    ZVC's one-pass encoder paid four or more a tile. Only ZANS's plan kernel needs one: its
    last program reads the rows every other program wrote."""
    results, _ = builds
    fenced = {b["kernel"] for b in results if b["fences"] != 0}
    assert fenced == {"zans._zans_plan_kernel"}, fenced  # (its acq_rel atomic: the count sees it)


def test_every_block_a_launch_config_admits_fits_the_blocks_registers(tmp_path):
    """LaunchConfig admits blocks up to 1024 threads, beyond the tuner's 512; a block has
    64K registers, so there a thread gets 64. Under the 128-register cap alone LZ4's
    encoder was built with 114 and failed to launch on an H200 ("out of resource:
    threads, Required: 1024, Hardware limit: 768"); the cap now falls with the block.
    At 64 registers a kernel may spill (RLE's encoder does on Triton 3.6): the gate on
    spills holds at the blocks the tuner chooses, this one only asks that it launches."""
    results, _ = _build(tmp_path, "block1024", "--blocks", "1024", "--dtypes", "int32")
    assert KERNELS <= {b["kernel"] for b in results}
    too_many = [(b["kernel"], b["registers"]) for b in results
                if b["error"] or not 0 < b["registers"] * FIXED_BLOCK.get(b["kernel"], 1024) <= 1 << 16]
    assert not too_many, too_many


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   STL [R1], R0 ;
.L_x_0:
        /*0020*/                   LDL R2, [R1] ;
.L_x_1:
        /*0030*/                   IADD3 R3, R3, 0x1, RZ ;
        /*0040*/                   STL.64 [R1+0x8], R2 ;
        /*0050*/               @P0 BRA `(.L_x_1) ;
        /*0060*/                   LDL R4, [R1+0x8] ;
        /*0070*/               @P1 BRA `(.L_x_0) ;
        /*0080*/                   EXIT ;
.L_x_2:
        /*0090*/                   BRA `(.L_x_2);
"""


# The same loops as ptxas may lay them out: the inner loop after the EXIT, reached by a
# forward branch and leaving by another; BRA.DIV is taken only by a diverged warp.
SASS_OUT_OF_ORDER = """
        /*0000*/                   STL [R1], R0 ;
.L_x_0:
        /*0010*/                   LDL R2, [R1] ;
        /*0020*/                   BRA.DIV UR6, `(.L_x_2) ;
        /*0030*/                   BRA `(.L_x_1) ;
.L_x_2:
        /*0040*/               @P1 BRA `(.L_x_0) ;
        /*0050*/                   EXIT ;
.L_x_1:
        /*0060*/                   STL.64 [R1+0x8], R2 ;
        /*0070*/               @P0 BRA `(.L_x_1) ;
        /*0080*/                   LDL R4, [R1+0x8] ;
        /*0090*/                   BRA `(.L_x_2) ;
.L_x_3:
        /*00a0*/                   BRA `(.L_x_3);
"""


@pytest.mark.parametrize("sass", [SASS, SASS_OUT_OF_ORDER], ids=["in-order", "out-of-order"])
def test_spill_sites_follow_the_natural_loop_nesting(sass):
    # Before the tile loop, in it, in the innermost loop inside it, in it again; the
    # trailing self-branch after EXIT is no loop.
    assert spill_sites(sass) == [(0, False), (1, False), (2, True), (1, False)]


def test_the_table_names_every_build(builds):
    results, (run, _) = builds
    header = run.stdout.splitlines()[0].split()
    assert header[:4] == ["kernel", "config", "arch", "registers"]
    assert run.stdout.count("sm_90") == sum(1 for b in results if " i64 " not in b["config"])


COMPILE_ONCE = r'''
import json, sys, torch
from collections import defaultdict
from cswap.codecs.base import WORD_DTYPES
from cswap.kernels import aot, csr, lz4, rle, zans, zvc

def keep(holder):
    def alloc(nbytes):
        holder.resize_(nbytes)
        return holder
    return alloc

gen = torch.Generator().manual_seed(0)
builds = defaultdict(set)
for i in range(20):
    n = [1, 2, 15, 16, 17, 31, 32, 4095, 4096, 4097, 65535, 65536, 65537, 100003][i % 14] + 7919 * (i // 14)
    sparsity = [0.0, 0.3, 0.6, 0.9, 1.0][i % 5]
    for dtype in (torch.int8, torch.float16, torch.float32, torch.int64):
        x = (torch.rand(n, generator=gen) >= sparsity).to(dtype) * 3
        words = x.view(WORD_DTYPES[dtype.itemsize])
        payloads = [torch.zeros(0, dtype=torch.uint8) for _ in range(5)]
        z = zvc.zvc_compress_ref(words, keep(payloads[0]))
        r = rle.rle_compress_ref(words, keep(payloads[1]))
        c = csr.csr_compress_ref(words, 1, n, keep(payloads[2]))
        data = words.view(torch.uint8)
        l = lz4.lz4_compress_ref(data, keep(payloads[3]))
        zm = zans.zans_compress_ref(words, keep(payloads[4]))
        alloc = keep(torch.zeros(0, dtype=torch.uint8))
        with aot.record(words=str(words.dtype)) as launches:
            zvc.zvc_compress(words, alloc)
            zvc.zvc_decompress(payloads[0], n, zvc.TILE, z, words.dtype)
            rle.rle_compress(words, alloc)
            rle.rle_decompress(payloads[1], n, rle.TILE, *r, words.dtype)
            csr.csr_compress(words, 1, n, alloc)
            csr.csr_decompress(payloads[2], 1, n, c, 4, words.dtype)
            lz4.lz4_launch(data, alloc(lz4.reserve_nbytes(data.numel())))
            lz4.lz4_decompress(payloads[3], data.numel(), lz4.CHUNK, *l)
            zans.zans_launch(words, torch.zeros(zans.reserve_nbytes(n, words.element_size()), dtype=torch.uint8))
            zans.zans_decompress(payloads[4], n, *zm, words.dtype)
        for launch in launches:
            # One build per kernel, word type and constexprs (the kernel's own variants:
            # CSR's wide-row path).
            variant = (launch.kernel, launch.words if "lz4" not in launch.kernel else "u8",
                       sorted(map(str, launch.constexprs.items())))
            builds[json.dumps(variant)].add(launch.key())
json.dump({k: len(v) for k, v in builds.items()}, sys.stdout)
'''


def test_kernels_compile_once_per_word_type_and_config():
    """20 tensors of different sizes (1 element to several tiles and chunks, odd and
    multiples of 16) and sparsities (0 to 100% zeros) in four dtypes: each kernel
    has one specialisation per word type, so it compiles once, not per tensor."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE_ONCE], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    builds = json.loads(run.stdout)
    kernels = {tuple(json.loads(v)[:2]) for v in builds}
    assert len(kernels) == (len(KERNELS) - 2) * 4 + 2, kernels  # one per word type; lz4's 2 on bytes
    assert set(builds.values()) == {1}, {k: v for k, v in builds.items() if v != 1}
