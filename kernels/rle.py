"""Zero-run-length encoding (RLE): runs of non-zeros, tiled for parallel decoding.

The words are cut into tiles of TILE elements (the last tile may be short).
Within a tile, each maximal run of non-zero elements (runs are cut at tile
boundaries) is one record of two uint16 fields:

    start   tile-local position of the run's first element (0 .. TILE-1)
    before  number of non-zero elements in the tile before the run

A run's length is implied: the next run's `before` (or, for the tile's last
run, the tile's non-zero count) minus its own `before`. Runs are maximal, so
consecutive runs of a tile are separated by at least one zero.

Format of the payload (all little-endian; each section starts 16-byte aligned,
padding bytes are zero):

    run_offsets    int64[T + 1]   T = ceil(n / TILE); entry t = number of runs
                                  before tile t (entry T = R, the number of runs)
    value_offsets  int64[T + 1]   entry t = number of non-zeros before tile t
                                  (entry T = nnz)
    starts         uint16[R]      the runs' `start`, tile by tile, in order
    befores        uint16[R]      the runs' `before`, same order
    values         word[nnz]      the non-zero elements, in order

Elements are the integer view of the tensor (int8/16/32/64), so "zero" means
all bits zero and -0.0, NaN payloads, infinities and denormals survive. The
container header stores (TILE, R, nnz), so a buffer decodes with the TILE it
was written with. Cost: 4 bytes per run plus 16 bytes per tile (plus the
values), against ZVC's 4 bytes per 32 elements: RLE wins on long zero runs.

Decoding is parallel per element: each element binary-searches its tile's
`starts` for the last run starting at or before it. The decoders validate
every tile (offsets monotonic and ending at the totals, starts increasing
with a gap, every run of length >= 1 inside the tile, the runs accounting for
the tile's non-zeros) and report a per-tile status flag; they never read or
write out of bounds whatever the payload holds. On an inconsistent payload
the Triton decoder's output for the bad tiles is unspecified (but in bounds);
the PyTorch decoder leaves them zero. The payload carries no checksum: an
alteration that leaves every tile consistent (a changed value, or a value
offset moved by a few where the tile's last run still fits) is not detected.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import LaunchConfig, decoder_output, launch_grid, max_registers, step_elements

__all__ = ["TILE", "MIN_TILE", "MAX_TILE", "Sections", "check_tile", "layout", "sections", "rle_compress",
           "rle_decompress", "rle_compress_ref", "rle_decompress_ref"]

# TILE = 4096 elements: untuned default, the same tile as ZVC, pending a sweep
# on H100. It must be a power of two (tl.arange) of at most 65536 so that
# tile-local positions and counts fit in uint16.
TILE = 4096
MIN_TILE = 16
MAX_TILE = 1 << 16
_ALIGN = 16


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def check_tile(tile: int) -> None:
    if not isinstance(tile, int) or tile < MIN_TILE or tile > MAX_TILE or tile & (tile - 1):
        raise ValueError(f"cswap.kernels.rle: tile must be a power of two in [{MIN_TILE}, {MAX_TILE}], "
                         f"got {tile!r}")


def layout(n: int, tile: int, num_runs: int, nnz: int, itemsize: int) -> tuple[int, int, int, int, int, int]:
    """Byte offsets of (run_offsets, value_offsets, starts, befores, values) and the payload size."""
    offsets_nbytes = _align(8 * (-(-n // tile) + 1))
    off_starts = 2 * offsets_nbytes
    off_befores = off_starts + _align(2 * num_runs)
    off_values = off_befores + _align(2 * num_runs)
    return 0, offsets_nbytes, off_starts, off_befores, off_values, off_values + _align(nnz * itemsize)


class Sections(NamedTuple):
    run_offsets: torch.Tensor    # int64[T + 1]
    value_offsets: torch.Tensor  # int64[T + 1]
    starts: torch.Tensor         # uint16[R]
    befores: torch.Tensor        # uint16[R]
    values: torch.Tensor         # word[nnz]


def sections(payload: torch.Tensor, n: int, tile: int, num_runs: int, nnz: int,
             word_dtype: torch.dtype) -> Sections:
    """Typed views of the payload's sections (the payload must be exactly `layout(...)[-1]` bytes)."""
    itemsize = word_dtype.itemsize
    _, off_vo, off_s, off_b, off_v, _ = layout(n, tile, num_runs, nnz, itemsize)
    num_tiles = -(-n // tile)
    return Sections(
        payload[: 8 * (num_tiles + 1)].view(torch.int64),
        payload[off_vo: off_vo + 8 * (num_tiles + 1)].view(torch.int64),
        payload[off_s: off_s + 2 * num_runs].view(torch.uint16),
        payload[off_b: off_b + 2 * num_runs].view(torch.uint16),
        payload[off_v: off_v + nnz * itemsize].view(word_dtype),
    )


# -- Triton -------------------------------------------------------------------


# do_not_specialize: every integer argument varies per tensor; specialising on
# it (multiple of 16, equal to 1) would recompile in the middle of training.
# 64-bit arithmetic only for a tile's place in memory; 32-bit within it; each
# program walks its tile in steps of SUB elements (launch.step_elements).
# The compress step scans two flags (run starts, non-zeros) over the step: at 8
# elements per thread Triton 3.6 built it with 152-186 registers at 128-256
# threads (8- and 16-bit words); at 4, 56-124 on 3.6 and 48-88 on 3.8.
COMPRESS_ELEMENTS_PER_THREAD = 4


@triton.jit
def _load_runs(src, offs, tile_len):
    """(words, non-zero flags, run-start flags) at tile positions `offs`; flags are int32 0/1."""
    inb = offs < tile_len
    w = tl.load(src + offs, mask=inb, other=0)
    # The previous element, read again rather than shifted in registers; the
    # tile's first element always starts a run (other=0).
    prev = tl.load(src + offs - 1, mask=inb & (offs > 0), other=0)
    nz = (w != 0).to(tl.int32)
    first = nz & (prev == 0).to(tl.int32)
    return w, nz, first


@triton.jit(do_not_specialize=["n", "num_tiles"])
def _rle_count_kernel(words_ptr, runs_ptr, nnz_ptr, n, num_tiles, TILE: tl.constexpr, SUB: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0)
    idx = tl.arange(0, SUB)
    for t in range(pid, num_tiles, nprog):
        src = words_ptr + t * TILE
        tile_len = tl.minimum(n - t * TILE, TILE).to(tl.int32)
        runs = tl.zeros([SUB], dtype=tl.int32)
        nzs = tl.zeros([SUB], dtype=tl.int32)
        for s in range(0, TILE, SUB):
            _, nz, first = _load_runs(src, s + idx, tile_len)
            runs += first
            nzs += nz
        tl.store(runs_ptr + t, tl.sum(runs, axis=0).to(tl.int64))
        tl.store(nnz_ptr + t, tl.sum(nzs, axis=0).to(tl.int64))


@triton.jit(do_not_specialize=["n", "num_runs", "nnz", "num_tiles"])
def _rle_compress_kernel(words_ptr, run_offsets_ptr, value_offsets_ptr, starts_ptr, befores_ptr,
                         values_ptr, n, num_runs, nnz, num_tiles, TILE: tl.constexpr, SUB: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0)
    idx = tl.arange(0, SUB)
    for t in range(pid, num_tiles, nprog):
        src = words_ptr + t * TILE
        tile_len = tl.minimum(n - t * TILE, TILE).to(tl.int32)
        run_base = tl.load(run_offsets_ptr + t)
        value_base = tl.load(value_offsets_ptr + t)
        starts = starts_ptr + run_base
        befores = befores_ptr + run_base
        dst = values_ptr + value_base
        # Never write past the sections, even if the input changed since the count pass.
        run_room = tl.minimum(num_runs - run_base, TILE).to(tl.int32)
        value_room = tl.minimum(nnz - value_base, TILE).to(tl.int32)
        runs_done = tile_len * 0
        values_done = tile_len * 0
        for s in range(0, TILE, SUB):
            offs = s + idx
            w, nz, first = _load_runs(src, offs, tile_len)
            run = runs_done + tl.cumsum(first, axis=0) - 1
            before = values_done + tl.cumsum(nz, axis=0) - nz
            is_first = (first != 0) & (run < run_room)
            tl.store(starts + run, offs.to(tl.uint16), mask=is_first)
            tl.store(befores + run, before.to(tl.uint16), mask=is_first)
            tl.store(dst + before, w, mask=(nz != 0) & (before < value_room))
            runs_done += tl.sum(first, axis=0)
            values_done += tl.sum(nz, axis=0)


@triton.jit(do_not_specialize=["n", "num_runs", "nnz", "num_tiles"])
def _rle_decompress_kernel(run_offsets_ptr, value_offsets_ptr, starts_ptr, befores_ptr, values_ptr,
                           out_ptr, status_ptr, n, num_runs, nnz, num_tiles,
                           TILE: tl.constexpr, SUB: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0)
    MAX_RUNS: tl.constexpr = TILE // 2  # maximal runs need a zero between them
    idx = tl.arange(0, SUB)
    for t in range(pid, num_tiles, nprog):
        dst = out_ptr + t * TILE
        tile_len = tl.minimum(n - t * TILE, TILE).to(tl.int32)
        # The payload is untrusted: clamp the tile's record and value ranges
        # into the sections, and flag the tile if clamping changed anything.
        r0_raw = tl.load(run_offsets_ptr + t)
        r1_raw = tl.load(run_offsets_ptr + t + 1)
        v0_raw = tl.load(value_offsets_ptr + t)
        v1_raw = tl.load(value_offsets_ptr + t + 1)
        r0 = tl.minimum(tl.maximum(r0_raw, 0), num_runs)
        r1 = tl.minimum(tl.maximum(r1_raw, r0), num_runs)
        v0 = tl.minimum(tl.maximum(v0_raw, 0), nnz)
        v1 = tl.minimum(tl.maximum(v1_raw, v0), nnz)
        count = tl.minimum(r1 - r0, MAX_RUNS).to(tl.int32)
        tile_nnz = tl.minimum(v1 - v0, TILE).to(tl.int32)
        bad = (r0 != r0_raw) | (r1 != r1_raw) | (v0 != v0_raw) | (v1 != v1_raw) \
            | (r1 - r0 > MAX_RUNS) | (v1 - v0 > tile_len) | ((count == 0) & (tile_nnz != 0))
        # The tiles must account for exactly the recorded runs and values, from the first.
        bad |= ((t == 0) & ((r0_raw != 0) | (v0_raw != 0))) \
            | ((t == num_tiles - 1) & ((r1_raw != num_runs) | (v1_raw != nnz)))
        starts = starts_ptr + r0
        befores = befores_ptr + r0
        src = values_ptr + v0

        # Check every run record: length >= 1, inside the tile, after the
        # previous run with a gap, and the first one has nothing before it.
        bad_runs = count * 0
        for j0 in range(0, count, SUB):
            j = j0 + idx
            jm = j < count
            s = tl.load(starts + j, mask=jm, other=0).to(tl.int32)
            b = tl.load(befores + j, mask=jm, other=0).to(tl.int32)
            has_next = (j + 1) < count
            b_next = tl.load(befores + j + 1, mask=has_next, other=0).to(tl.int32)
            length = tl.where(has_next, b_next, tile_nnz) - b
            has_prev = jm & (j > 0)
            s_prev = tl.load(starts + j - 1, mask=has_prev, other=0).to(tl.int32)
            b_prev = tl.load(befores + j - 1, mask=has_prev, other=0).to(tl.int32)
            run_bad = (length < 1) | (s + length > tile_len) | ((j == 0) & (b != 0)) \
                | (has_prev & (s <= s_prev + (b - b_prev)))
            bad_runs += tl.sum((jm & run_bad).to(tl.int32), axis=0)
        tl.store(status_ptr + t, (bad | (bad_runs > 0)).to(tl.int8))

        # Per element: the last run with start <= position, by binary search in
        # starts[0:count]; bit_length(count) halvings empty the range (few runs,
        # RLE's good case, take few steps).
        steps = count * 0
        while (count >> steps) > 0:
            steps += 1
        for s0 in range(0, TILE, SUB):
            i = s0 + idx
            lo = tl.zeros([SUB], dtype=tl.int32)
            hi = lo + count
            for _ in range(steps):
                active = lo < hi
                mid = (lo + hi) // 2
                s_mid = tl.load(starts + mid, mask=active, other=0).to(tl.int32)
                right = active & (s_mid <= i)
                left = active & (s_mid > i)
                lo = tl.where(right, mid + 1, lo)
                hi = tl.where(left, mid, hi)
            k = lo - 1
            found = k >= 0
            s_k = tl.load(starts + k, mask=found, other=0).to(tl.int32)
            b_k = tl.load(befores + k, mask=found, other=0).to(tl.int32)
            k_next = (k + 1) < count
            b_k_next = tl.load(befores + k + 1, mask=found & k_next, other=0).to(tl.int32)
            d = i - s_k
            in_run = found & (d >= 0) & (d < tl.where(k_next, b_k_next, tile_nnz) - b_k)
            inb = i < tile_len
            v = tl.load(src + b_k + d, mask=inb & in_run & (b_k + d < tile_nnz), other=0)
            tl.store(dst + i, v, mask=inb)


def _check_words(words: torch.Tensor, who: str) -> None:
    if words.dim() != 1 or not words.is_contiguous() or words.dtype not in (
            torch.int8, torch.int16, torch.int32, torch.int64):
        raise ValueError(f"{who}: expected 1-D contiguous int8/16/32/64 words, got {words.dtype} "
                         f"of shape {tuple(words.shape)}")


def rle_compress(words: torch.Tensor, alloc, config: LaunchConfig | None = None,
                 tile: int = TILE) -> tuple[int, int]:
    """Compress 1-D integer `words` with Triton into `alloc(payload_nbytes)`; returns (num_runs, nnz)."""
    _check_words(words, "cswap.kernels.rle.rle_compress")
    check_tile(tile)
    n = words.numel()
    num_tiles = -(-n // tile)
    # Rows of an even length: both rows' count pointers have the same alignment
    # whatever num_tiles is, so the kernel compiles once, not once per parity.
    counts = torch.zeros(2, (num_tiles + 2) // 2 * 2, dtype=torch.int64, device=words.device)
    grid, warps = launch_grid(config, num_tiles, words.device)
    if num_tiles:
        sub = step_elements(tile, warps, words.element_size())
        _rle_count_kernel[(grid,)](words, counts[0, 1:], counts[1, 1:], n, num_tiles, TILE=tile, SUB=sub,
                                   num_warps=warps, maxnreg=max_registers(warps))
    offsets = torch.cumsum(counts[:, : num_tiles + 1], 1)
    num_runs, nnz = offsets[:, -1].tolist()  # the one host sync: sizes the buffer
    payload = alloc(layout(n, tile, num_runs, nnz, words.element_size())[-1])
    payload.zero_()  # padding bytes are part of the format: keep them deterministic
    sec = sections(payload, n, tile, num_runs, nnz, words.dtype)
    sec.run_offsets.copy_(offsets[0])
    sec.value_offsets.copy_(offsets[1])
    if num_tiles:
        sub = step_elements(tile, warps, words.element_size(), COMPRESS_ELEMENTS_PER_THREAD)
        _rle_compress_kernel[(grid,)](words, sec.run_offsets, sec.value_offsets, sec.starts,
                                      sec.befores, sec.values, n, num_runs, nnz, num_tiles,
                                      TILE=tile, SUB=sub, num_warps=warps, maxnreg=max_registers(warps))
    return num_runs, nnz


def rle_decompress(payload: torch.Tensor, n: int, tile: int, num_runs: int, nnz: int,
                   word_dtype: torch.dtype, config: LaunchConfig | None = None, out: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode with Triton (into `out` when given); returns (words, per-tile status:
    non-zero = inconsistent tile)."""
    check_tile(tile)
    sec = sections(payload, n, tile, num_runs, nnz, word_dtype)
    num_tiles = -(-n // tile)
    out = decoder_output(out, n, word_dtype, payload.device, zero=False)
    status = torch.empty(num_tiles, dtype=torch.int8, device=payload.device)  # every tile writes its own
    if num_tiles:
        grid, warps = launch_grid(config, num_tiles, payload.device)
        _rle_decompress_kernel[(grid,)](sec.run_offsets, sec.value_offsets, sec.starts, sec.befores,
                                        sec.values, out, status, n, num_runs, nnz, num_tiles,
                                        TILE=tile, SUB=step_elements(tile, warps, out.element_size()),
                                        num_warps=warps, maxnreg=max_registers(warps))
    return out, status


# -- PyTorch reference ----------------------------------------------------------


# Torch has only barebones uint16 support (no indexing on older versions): the
# reference moves uint16 fields through int16 views, bit for bit.
def _read_u16(u: torch.Tensor) -> torch.Tensor:
    return u.view(torch.int16).to(torch.int64) & 0xFFFF


def _write_u16(u: torch.Tensor, v: torch.Tensor) -> None:
    u.view(torch.int16).copy_(torch.where(v >= 1 << 15, v - (1 << 16), v))


def _tiled(x: torch.Tensor, tile: int) -> torch.Tensor:
    """`x` zero-padded to whole tiles, as a (T, tile) matrix."""
    padded = torch.zeros(-(-x.numel() // tile) * tile, dtype=x.dtype, device=x.device)
    padded[: x.numel()] = x
    return padded.view(-1, tile)


def _check_totals(status: torch.Tensor, sec: Sections, num_runs: int, nnz: int) -> None:
    """Offsets must start at 0 and end at the totals (on the device: no sync; the
    reference's, which the kernel checks in its first and last tiles)."""
    status[0] |= ((sec.run_offsets[0] != 0) | (sec.value_offsets[0] != 0)).to(torch.int8)
    status[-1] |= ((sec.run_offsets[-1] != num_runs) | (sec.value_offsets[-1] != nnz)).to(torch.int8)


def rle_compress_ref(words: torch.Tensor, alloc, tile: int = TILE) -> tuple[int, int]:
    """Reference encoder in plain PyTorch; writes the same bytes as `rle_compress`."""
    _check_words(words, "cswap.kernels.rle.rle_compress_ref")
    check_tile(tile)
    n = words.numel()
    nz = _tiled(words != 0, tile)
    first = nz.clone()
    first[:, 1:] &= ~nz[:, :-1]  # a run starts where the previous element is zero
    nz_i = nz.to(torch.int32)
    before = torch.cumsum(nz_i, 1) - nz_i
    tile_idx, start = first.nonzero(as_tuple=True)  # row-major: runs in order
    values = words[words != 0]
    num_runs, nnz = start.numel(), values.numel()
    payload = alloc(layout(n, tile, num_runs, nnz, words.element_size())[-1])
    payload.zero_()
    sec = sections(payload, n, tile, num_runs, nnz, words.dtype)
    sec.run_offsets[1:].copy_(torch.cumsum(first.sum(1), 0))
    sec.value_offsets[1:].copy_(torch.cumsum(nz_i.sum(1), 0))
    _write_u16(sec.starts, start)
    _write_u16(sec.befores, before[tile_idx, start].to(torch.int64))
    sec.values.copy_(values)
    return num_runs, nnz


def rle_decompress_ref(payload: torch.Tensor, n: int, tile: int, num_runs: int, nnz: int,
                       word_dtype: torch.dtype, out: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference decoder; returns (words, per-tile status) like `rle_decompress`.

    Tiles that fail a check are left zero; if the offsets themselves are
    inconsistent, runs cannot be assigned to tiles and the output is all zero.
    """
    check_tile(tile)
    sec = sections(payload, n, tile, num_runs, nnz, word_dtype)
    dev = payload.device
    num_tiles = -(-n // tile)
    out = decoder_output(out, n, word_dtype, dev, zero=True)
    status = torch.zeros(num_tiles, dtype=torch.int8, device=dev)
    if not num_tiles:
        return out, status
    ro, vo = sec.run_offsets, sec.value_offsets
    tile_len = (n - torch.arange(num_tiles, device=dev) * tile).clamp(max=tile)
    tile_runs, tile_nnz = ro[1:] - ro[:-1], vo[1:] - vo[:-1]
    offsets_bad = (ro[:-1] < 0) | (tile_runs < 0) | (ro[1:] > num_runs) \
        | (vo[:-1] < 0) | (tile_nnz < 0) | (vo[1:] > nnz)
    bad = offsets_bad | (tile_runs > tile // 2) | (tile_nnz > tile_len) | ((tile_runs == 0) & (tile_nnz != 0))
    status.copy_(bad)
    _check_totals(status, sec, num_runs, nnz)
    if bool(offsets_bad.any() | (ro[0] != 0) | (ro[-1] != num_runs)):
        return out, status  # runs cannot be assigned to tiles

    run_tile = torch.repeat_interleave(torch.arange(num_tiles, device=dev), tile_runs, output_size=num_runs)
    s, b = _read_u16(sec.starts), _read_u16(sec.befores)
    j = torch.arange(num_runs, device=dev)
    is_first = j == ro[run_tile]
    is_last = j == ro[run_tile + 1] - 1
    length = torch.where(is_last, tile_nnz[run_tile], b.roll(-1)) - b
    prev_end = (s + length).roll(1)
    run_bad = (length < 1) | (s + length > tile_len[run_tile]) | (is_first & (b != 0)) \
        | (~is_first & (s <= prev_end))
    # int32 counts: an int8 sum of 256 bad runs would wrap to "good"
    flags = status.to(torch.int32).index_put_((run_tile,), run_bad.to(torch.int32), accumulate=True)
    status.copy_(flags != 0)

    # Expand the runs of consistent tiles: every index below stays in bounds.
    length = torch.where(status[run_tile] == 0, length, 0)
    total = int(length.sum())
    run = torch.repeat_interleave(j, length, output_size=total)
    d = torch.arange(total, device=dev) - (torch.cumsum(length, 0) - length)[run]
    pos = run_tile[run] * tile + s[run] + d
    out[pos] = sec.values[vo[run_tile[run]] + b[run] + d]
    return out, status
