"""Compressed sparse row (CSR): row pointers, column indices, non-zero values.

The tensor is viewed as a 2-D matrix (rows, cols) (see `view_2d`):

    ndim 0 or 1         rows = 1,        cols = numel
    ndim >= 2           rows = shape[0], cols = prod(shape[1:])

so shape (0, 5) is 0 rows of 5 columns, (3, 0) is 3 rows of 0 columns and
(0,) is 1 row of 0 columns. Element e of the flat tensor is (e // cols, e % cols).

Format of the payload (all little-endian; each section starts at a multiple of
16 bytes, padding bytes are zero):

    offset     size                  field
    0          8 * (rows + 1)        crow_indices int64[rows + 1]: entry r = number of
                                     non-zeros in rows 0 .. r-1 (entry 0 = 0, entry
                                     rows = nnz)
    C          index_bytes * nnz     col_indices  int32[nnz] when cols <= 2**31 - 1,
                                     else int64[nnz] (index_bytes = 4 or 8): the column
                                     of each non-zero, row by row, increasing in a row
    V          itemsize * nnz        values word[nnz]: the non-zero elements in the
                                     same (row-major) order
    end        -                     payload size = V + align16(itemsize * nnz)

with C = align16(8 * (rows + 1)) and V = C + align16(index_bytes * nnz). The
container header stores (rows, cols, nnz, index_bytes).

Elements are the integer view of the tensor (int8/16/32/64), so "zero" means
all bits zero and -0.0, NaN payloads, infinities and denormals survive. On
that integer view the three sections equal `view.to_sparse_csr()`'s
crow_indices, col_indices (up to their dtype) and values; for float inputs
without -0.0 they equal the float tensor's too.

The format does not depend on any tile size: TILE below only splits the work.
Encoding is parallel over the flat elements (rows may be few and huge): a count
pass gives each tile's non-zeros, a cumsum their offsets, and a write pass puts
every non-zero at its offset plus its exclusive rank in the tile and the first
element of each row writes that row's pointer. Decoding is parallel over the
non-zeros: each one binary-searches its row in crow_indices.

The decoders never read or write out of bounds whatever the payload holds, and
report per tile a status byte of the STATUS bits (tiles of TILE non-zeros, and
of TILE row pointers for the monotonicity check; one last entry for the row
pointers' two ends). A non-zero failing a check is not written (its output
element stays zero). A changed value or a column moved within its row's
ordering is not detected: the payload carries no checksum.
"""

from __future__ import annotations

from math import prod

import torch
import triton
import triton.language as tl

from .launch import LaunchConfig, decoder_output, launch_grid, max_registers, step_elements
from .zvc import nonzero_offsets

__all__ = ["TILE", "STATUS", "view_2d", "index_bytes_for", "layout", "sections", "search_steps",
           "csr_compress", "csr_decompress", "csr_compress_ref", "csr_decompress_ref"]

# TILE = 4096 elements (or non-zeros) per loop step of a program: untuned
# default, the same as ZVC and RLE, pending a sweep on H100. Any power of two
# works (tl.arange); the format does not depend on it.
TILE = 4096
_ALIGN = 16
_INT32_MAX = 2**31 - 1

# Status bits a decoder reports per tile (value -> what was inconsistent).
STATUS = {
    1: "row pointers do not start at 0 and end at nnz",
    2: "row pointers decrease",
    4: "a non-zero lies in no row (row pointers are inconsistent)",
    8: "a column index is outside [0, cols)",
    16: "column indices do not strictly increase within a row",
}


def view_2d(shape) -> tuple[int, int]:
    """(rows, cols) of the 2-D view of a tensor of `shape`."""
    shape = tuple(shape)
    if len(shape) <= 1:
        return 1, prod(shape)
    return shape[0], prod(shape[1:])


def index_bytes_for(cols: int) -> int:
    """Width of a column index: int32 while every column fits, else int64."""
    return 4 if cols <= _INT32_MAX else 8


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def layout(rows: int, nnz: int, index_bytes: int, itemsize: int) -> tuple[int, int, int, int]:
    """Byte offsets of (crow_indices, col_indices, values) and the payload size."""
    off_col = _align(8 * (rows + 1))
    off_values = off_col + _align(index_bytes * nnz)
    return 0, off_col, off_values, off_values + _align(itemsize * nnz)


def sections(payload: torch.Tensor, rows: int, nnz: int, index_bytes: int, word_dtype: torch.dtype):
    """(crow_indices, col_indices, values) as views of `payload` (sizes already validated)."""
    itemsize = word_dtype.itemsize
    _, off_col, off_values, _ = layout(rows, nnz, index_bytes, itemsize)
    crow = payload[: 8 * (rows + 1)].view(torch.int64)
    col = payload[off_col: off_col + index_bytes * nnz].view(torch.int32 if index_bytes == 4 else torch.int64)
    values = payload[off_values: off_values + itemsize * nnz].view(word_dtype)
    return crow, col, values


def search_steps(rows: int) -> int:
    """Halvings of [0, rows) that leave one row: the binary search's fixed step count."""
    return max(rows - 1, 0).bit_length()


def _zero_padding(payload: torch.Tensor, rows: int, nnz: int, index_bytes: int, itemsize: int) -> None:
    """Zero the bytes between sections: part of the format, so both backends write them alike."""
    _, off_col, off_values, end = layout(rows, nnz, index_bytes, itemsize)
    for used_end, section_end in ((8 * (rows + 1), off_col), (off_col + index_bytes * nnz, off_values),
                                  (off_values + itemsize * nnz, end)):
        if used_end < section_end:
            payload[used_end:section_end].zero_()


def _num_check_tiles(rows: int, nnz: int, tile: int) -> int:
    """Decoder tiles: enough to cover the nnz non-zeros and the rows row-pointer pairs."""
    return max(-(-nnz // tile), -(-rows // tile))


# -- Triton -------------------------------------------------------------------


# do_not_specialize: every integer argument varies per tensor; specialising on
# it (multiple of 16, equal to 1) would recompile in the middle of training.
# Each program walks its tile in steps of SUB elements (launch.step_elements).


@triton.jit(do_not_specialize=["n", "cols", "num_tiles"])
def _csr_compress_kernel(words_ptr, tile_start_ptr, crow_ptr, col_ptr, values_ptr, n, cols, num_tiles,
                         TILE: tl.constexpr, SUB: tl.constexpr, WIDE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0)
    idx = tl.arange(0, SUB)
    for t in range(pid, num_tiles, nprog):
        src = words_ptr + t * TILE
        tile_len = tl.minimum(n - t * TILE, TILE).to(tl.int32)
        base = tl.load(tile_start_ptr + t)  # non-zeros of earlier tiles
        values = values_ptr + base
        columns = col_ptr + base
        # (row, col) of each element without a 64-bit division per element (tens
        # of instructions on a GPU): divide the tile's start once; when cols >= TILE
        # (WIDE) the tile crosses at most one row end, at tile position to_end.
        r0 = (t * TILE) // cols
        c0 = t * TILE - r0 * cols
        row0 = crow_ptr + r0
        to_end = tl.minimum(cols - c0, TILE).to(tl.int32)
        rank = tile_len * 0
        for s in range(0, TILE, SUB):
            offs = s + idx
            inb = offs < tile_len
            w = tl.load(src + offs, mask=inb, other=0)
            nz = (w != 0).to(tl.int32)
            pos = rank + tl.cumsum(nz, axis=0) - nz  # exclusive rank in the tile
            if WIDE:
                wrap = offs >= to_end
                row = wrap.to(tl.int32)
                col = tl.where(wrap, offs - to_end, c0 + offs)
            else:  # cols < TILE: 32-bit division, whatever width cols came in
                narrow_cols = cols.to(tl.int32)
                rel = c0.to(tl.int32) + offs
                row = rel // narrow_cols
                col = rel - row * narrow_cols
            keep = inb & (nz != 0)
            tl.store(values + pos, w, mask=keep)
            tl.store(columns + pos, col.to(col_ptr.dtype.element_ty), mask=keep)
            # A row's first element knows how many non-zeros precede the row.
            tl.store(row0 + row, base + pos, mask=inb & (col == 0))
            rank += tl.sum(nz, axis=0)


@triton.jit(do_not_specialize=["rows", "cols", "nnz", "steps", "num_tiles"])
def _csr_decompress_kernel(crow_ptr, col_ptr, values_ptr, out_ptr, status_ptr, rows, cols, nnz, steps,
                           num_tiles, TILE: tl.constexpr, SUB: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0)
    idx = tl.arange(0, SUB)
    for t in range(pid, num_tiles, nprog):
        flags = pid.to(tl.int32) * 0
        if t * TILE < rows:
            # Row pointers must not decrease: pairs (k, k + 1) for k < rows.
            for s in range(0, TILE, SUB):
                k = t * TILE + s + idx
                pair = k < rows
                a = tl.load(crow_ptr + k, mask=pair, other=0)
                b = tl.load(crow_ptr + k + 1, mask=pair, other=0)
                flags = flags | (2 * tl.max((pair & (b < a)).to(tl.int32), axis=0))
        if t * TILE < nnz:
            for s in range(0, TILE, SUB):
                k = t * TILE + s + idx
                # Non-zero k: its row r is the last with crow[r] <= k (binary search
                # in [0, rows), indices as wide as rows).
                live = k < nnz
                hi = tl.zeros([SUB], dtype=tl.int32) + rows
                lo = hi * 0
                for _ in range(steps):
                    mid = (lo + hi) // 2
                    go = tl.load(crow_ptr + mid, mask=live & (mid <= rows), other=0) <= k
                    lo = tl.where(go, mid, lo)
                    hi = tl.where(go, hi, mid)
                r = lo
                has_row = live & (r < rows)
                start = tl.load(crow_ptr + r, mask=has_row, other=0)
                end = tl.load(crow_ptr + r + 1, mask=has_row, other=0)
                in_row = has_row & (start <= k) & (k < end)
                no_row = live & (in_row == 0)
                col = tl.load(col_ptr + k, mask=live, other=0).to(tl.int64)
                col_ok = (col >= 0) & (col < cols)
                bad_col = in_row & (col_ok == 0)
                # Not the first of its row: the previous column must be smaller. -1
                # stands in for "no previous", which every valid column passes.
                follows = in_row & (k > start) & (k > 0)
                prev = tl.load(col_ptr + k - 1, mask=follows, other=-1).to(tl.int64)
                bad_order = follows & (prev >= col)
                ok = in_row & col_ok & (prev < col)
                v = tl.load(values_ptr + k, mask=ok, other=0)
                tl.store(out_ptr + r.to(tl.int64) * cols + col, v, mask=ok)
                flags = flags | (4 * tl.max(no_row.to(tl.int32), axis=0)) \
                    | (8 * tl.max(bad_col.to(tl.int32), axis=0)) \
                    | (16 * tl.max(bad_order.to(tl.int32), axis=0))
        tl.store(status_ptr + t, flags.to(tl.int8))
        if t == 0:  # the row pointers' ends: crow[0] == 0 and crow[rows] == nnz (bit 1, the last row)
            first = tl.load(crow_ptr)
            last = tl.load(crow_ptr + rows)
            tl.store(status_ptr + num_tiles, ((first != 0) | (last != nnz)).to(tl.int8))


def csr_compress(words: torch.Tensor, rows: int, cols: int, alloc, config: LaunchConfig | None = None,
                 tile: int = TILE, index_bytes: int | None = None) -> int:
    """Compress 1-D integer `words` viewed as (rows, cols) with Triton into
    `alloc(payload_nbytes)`; returns nnz. index_bytes defaults to
    index_bytes_for(cols); 8 forces int64 columns (tests of that path need no
    2**31 columns)."""
    n = words.numel()
    index_bytes = _check_view(n, rows, cols, index_bytes)
    num_tiles = -(-n // tile)
    grid, warps = launch_grid(config, num_tiles, words.device)
    tile_start = nonzero_offsets(words, tile, config)  # ZVC's count pass
    nnz = int(tile_start[-1])  # the one host sync: sizes the buffer
    payload = alloc(layout(rows, nnz, index_bytes, words.element_size())[3])
    _zero_padding(payload, rows, nnz, index_bytes, words.element_size())
    crow, col, values = sections(payload, rows, nnz, index_bytes, words.dtype)
    if num_tiles:
        _csr_compress_kernel[(grid,)](words, tile_start, crow, col, values, n, cols, num_tiles, TILE=tile,
                                      SUB=step_elements(tile, warps, words.element_size()), WIDE=cols >= tile,
                                      num_warps=warps, maxnreg=max_registers(warps))
    else:  # no elements: every row is empty (and there may be rows, e.g. shape (3, 0))
        crow.zero_()
    crow[rows].fill_(nnz)  # (not `crow[rows] = nnz`: on CUDA, torch 2.11 copies the int from pageable memory)
    return nnz


def csr_decompress(payload: torch.Tensor, rows: int, cols: int, nnz: int, index_bytes: int,
                   word_dtype: torch.dtype, config: LaunchConfig | None = None,
                   tile: int = TILE, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode with Triton (into `out` when given); returns (words, per-tile status of
    STATUS bits, 0 = consistent).

    Sizes must already agree with the payload (`layout`); its contents may be anything.
    """
    n = rows * cols
    if n == 0:  # nothing to write; only the row pointers to check
        return csr_decompress_ref(payload, rows, cols, nnz, index_bytes, word_dtype, tile, out)
    crow, col, values = sections(payload, rows, nnz, index_bytes, word_dtype)
    num_tiles = _num_check_tiles(rows, nnz, tile)
    out = decoder_output(out, n, word_dtype, payload.device, zero=True)
    status = torch.empty(num_tiles + 1, dtype=torch.int8, device=payload.device)  # (the kernel writes every one)
    grid, warps = launch_grid(config, num_tiles, payload.device)
    _csr_decompress_kernel[(grid,)](crow, col, values, out, status, rows, cols, nnz, search_steps(rows),
                                    num_tiles, TILE=tile, SUB=step_elements(tile, warps, out.element_size()),
                                    num_warps=warps, maxnreg=max_registers(warps))
    return out, status


def _check_view(n: int, rows: int, cols: int, index_bytes: int | None) -> int:
    """Validate the encoder's view; returns the column index width."""
    if rows < 0 or cols < 0 or rows * cols != n:
        raise ValueError(f"cswap.kernels.csr: a ({rows}, {cols}) view does not hold {n} elements; "
                         f"use view_2d(shape)")
    if index_bytes is None:
        return index_bytes_for(cols)
    if index_bytes not in (4, 8) or index_bytes < index_bytes_for(cols):
        raise ValueError(f"cswap.kernels.csr: index_bytes={index_bytes} cannot hold {cols} columns; "
                         f"use 4 or 8 (8 when cols > 2**31 - 1)")
    return index_bytes


def _ends_flag(crow: torch.Tensor, rows: int, nnz: int) -> torch.Tensor:
    """Status bit 1 on the device (no sync): crow[0] == 0 and crow[rows] == nnz."""
    return ((crow[0] != 0) | (crow[rows] != nnz)).to(torch.int8)


# -- PyTorch reference ----------------------------------------------------------


def csr_compress_ref(words: torch.Tensor, rows: int, cols: int, alloc, index_bytes: int | None = None) -> int:
    """Reference encoder in plain PyTorch (any device); writes the same bytes as `csr_compress`."""
    n = words.numel()
    index_bytes = _check_view(n, rows, cols, index_bytes)
    nz = words != 0
    flat = nz.nonzero().squeeze(1)
    nnz = flat.numel()
    payload = alloc(layout(rows, nnz, index_bytes, words.element_size())[3])
    _zero_padding(payload, rows, nnz, index_bytes, words.element_size())
    crow, col, values = sections(payload, rows, nnz, index_bytes, words.dtype)
    crow[0] = 0
    torch.cumsum(nz.view(rows, cols).sum(1), 0, out=crow[1:])
    col.copy_(flat % max(cols, 1))
    values.copy_(words[flat])
    return nnz


def _tile_any(bad: torch.Tensor, num_tiles: int, tile: int) -> torch.Tensor:
    """Per tile of `tile` consecutive entries: does any entry of `bad` hold?"""
    padded = torch.zeros(num_tiles * tile, dtype=torch.bool, device=bad.device)
    padded[: bad.numel()] = bad
    return padded.view(num_tiles, tile).any(1)


def _find_rows(crow: torch.Tensor, rows: int, k: torch.Tensor) -> torch.Tensor:
    """The Triton decoder's binary search, step for step: last r in [0, rows) with crow[r] <= k."""
    lo = torch.zeros_like(k)
    hi = torch.full_like(k, rows)
    for _ in range(search_steps(rows)):
        mid = (lo + hi) // 2
        go = crow[mid] <= k
        lo = torch.where(go, mid, lo)
        hi = torch.where(go, hi, mid)
    return lo


def csr_decompress_ref(payload: torch.Tensor, rows: int, cols: int, nnz: int, index_bytes: int,
                       word_dtype: torch.dtype, tile: int = TILE, out: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference decoder; returns (words, per-tile status) exactly like `csr_decompress`."""
    device = payload.device
    crow, col, values = sections(payload, rows, nnz, index_bytes, word_dtype)
    num_tiles = _num_check_tiles(rows, nnz, tile)
    status = torch.zeros(num_tiles + 1, dtype=torch.int32, device=device)
    out = decoder_output(out, rows * cols, word_dtype, device, zero=True)
    if num_tiles:
        status[:-1] += 2 * _tile_any(crow[1:] < crow[:-1], num_tiles, tile)
    if nnz:
        k = torch.arange(nnz, device=device)
        r = _find_rows(crow, rows, k)  # rows >= 1 here: nnz <= rows * cols
        start, end = crow[r], crow[r + 1]
        in_row = (start <= k) & (k < end)
        col = col.long()
        col_ok = (col >= 0) & (col < cols)
        prev = col[(k - 1).clamp(min=0)]
        follows = in_row & (k > start) & (k > 0)
        bad_order = follows & (prev >= col)
        ok = in_row & col_ok & ~bad_order
        out[(r * cols + col)[ok]] = values[ok]
        for bit, bad in ((4, ~in_row), (8, in_row & ~col_ok), (16, bad_order)):
            status[:-1] += bit * _tile_any(bad, num_tiles, tile)
    status[-1] = _ends_flag(crow, rows, nnz)
    return out, status.to(torch.int8)
