"""Zero-value compression (ZVC): a bitmask of non-zeros, then the non-zeros.

Format of the payload (all little-endian; each section starts 16-byte aligned):

    tile_offsets  int64[T + 1]       T = ceil(n / TILE); entry t = number of non-zero
                                     elements before tile t (so entry T = nnz). Lets
                                     every tile decode on its own.
    masks         uint32[ceil(n/32)] word j, bit i (LSB first) = element 32*j + i is
                                     non-zero; bits past n are zero.
    values        word[nnz]          the non-zero elements, in order.

Elements are the integer view of the tensor (int8/16/32/64), so "zero" means
all bits zero and -0.0, NaN payloads, infinities and denormals survive.
TILE is stored in the container header, so a buffer decodes with the TILE it
was written with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lookback import LOOK_BACK, exclusive_prefix, ticket
from .launch import LaunchConfig, decoder_output, launch_grid, max_registers, step_elements

__all__ = ["TILE", "layout", "nonzero_offsets", "min_room_nbytes", "zvc_compress", "zvc_launch", "zvc_decompress",
           "zvc_compress_ref", "zvc_launch_ref", "zvc_decompress_ref"]

# TILE = 4096 elements (128 mask words): untuned default, pending a sweep on
# H100; any multiple of 32 decodes.
TILE = 4096
_ALIGN = 16


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def layout(n: int, tile: int, nnz: int, itemsize: int) -> tuple[int, int, int, int]:
    """Byte offsets of (tile_offsets, masks, values) and the payload size."""
    num_tiles = -(-n // tile)
    off_masks = _align(8 * (num_tiles + 1))
    off_values = off_masks + _align(4 * (-(-n // 32)))
    return 0, off_masks, off_values, off_values + _align(nnz * itemsize)


# -- Triton -------------------------------------------------------------------


# do_not_specialize: every integer argument varies per tensor; specialising on
# it (multiple of 16, equal to 1) would recompile in the middle of training.
@triton.jit(do_not_specialize=["n", "num_tiles"])
def _nonzero_count_kernel(words_ptr, counts_ptr, n, num_tiles, TILE: tl.constexpr, SUB: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0)
    idx = tl.arange(0, SUB)
    for t in range(pid, num_tiles, nprog):
        src = words_ptr + t * TILE
        tile_len = tl.minimum(n - t * TILE, TILE).to(tl.int32)
        count = tl.zeros([SUB], dtype=tl.int32)
        for s in range(0, TILE, SUB):
            offs = s + idx
            w = tl.load(src + offs, mask=offs < tile_len, other=0)
            count += (w != 0).to(tl.int32)
        tl.store(counts_ptr + t, tl.sum(count, axis=0).to(tl.int64))


@triton.jit
def _row_major(ROWS: tl.constexpr):
    """[ROWS, 32] offsets of a tile's elements, row-major."""
    return tl.arange(0, ROWS)[:, None] * 32 + tl.arange(0, 32)[None, :]


# One element a lane for the whole tile. Triton gives a tile loaded with 128-bit loads
# four neighbours a thread, and the non-zeros, stored or gathered at positions known only
# at run time, one element a thread: the tile then went through shared memory to change
# layout (three times a tile in the one-pass encoder), and a whole tile did not fit the
# decoder's 128 registers. So the kernels leave the tile's pointer unspecialised (no
# 16-byte alignment known: one element a load), and store or gather through 1-D views
# (_flat), whose layout every Triton gives one element a lane in order; a 2-D pointer
# with no contiguity, Triton 3.6 laid out down the columns (sm_90 builds, 2026-12-05).
@triton.jit
def _flat(x, N: tl.constexpr):
    return tl.reshape(x, [N])


@triton.jit
def _masked_tile(words_ptr, masks_ptr, t, n, TILE: tl.constexpr):
    """Tile t's words as a [TILE // 32, 32] block (elements row-major), which of them lie
    inside the n words, and which are non-zero (0/1); writes its mask words (bit i = element
    i of a row). Shared by ZVC's one-pass encoder and ZANS's masked-mode compaction."""
    ROWS: tl.constexpr = TILE // 32
    rows = tl.arange(0, ROWS)
    lane = tl.arange(0, 32)
    tile_len = tl.minimum(n - t * TILE, TILE).to(tl.int32)
    offs = _row_major(ROWS)
    inb = offs < tile_len
    w = tl.load(words_ptr + t * TILE + offs, mask=inb, other=0)
    nz = (w != 0).to(tl.int32)
    bits = nz.to(tl.uint32) << lane[None, :].to(tl.uint32)
    tl.store(masks_ptr + t * ROWS + rows, tl.sum(bits, axis=1).to(tl.int32, bitcast=True), mask=rows * 32 < tile_len)
    return w, inb, nz


@triton.jit
def _placed(nz, state_ptr, t, LOOK: tl.constexpr):
    """Where tile t's non-zeros go, given its [ROWS, 32] 0/1 matrix `nz` (elements row-major):
    publishes the tile's count by decoupled look-back and returns (the non-zeros of the tiles
    before it, its own count, each element's position among all non-zeros). Shared by ZVC's
    one-pass encoder and ZANS's masked mode (zans._zans_compact_kernel, _zans_unmask_kernel)."""
    row_count = tl.sum(nz, axis=1)
    total = tl.sum(row_count, axis=0).to(tl.int64)
    prefix = exclusive_prefix(state_ptr, t, total, LOOK)
    row_before = tl.cumsum(row_count, axis=0) - row_count
    return prefix, total, prefix + row_before[:, None] + tl.cumsum(nz, axis=1) - nz


@triton.jit(do_not_specialize=["words_ptr", "nnz_ptr", "n", "num_tiles", "offsets_pad", "masks_pad", "values_room"])
def _zvc_one_pass_kernel(words_ptr, offsets_ptr, masks_ptr, values_ptr, state_ptr, nnz_ptr, n, num_tiles, offsets_pad,
                         masks_pad, values_room, TILE: tl.constexpr, LOOK: tl.constexpr, VALUES_PAD: tl.constexpr):
    """Count, place and write each tile in one read of the input: tiles taken by ticket
    find the non-zeros before them by decoupled look-back (cswap.kernels.lookback; its
    state_ptr: int64[num_tiles + 1], zero before the launch), then write. The last tile
    also writes the total (offsets[num_tiles], and nnz_ptr: the caller's size word) and
    zeroes the padding (offsets_pad int64 words after the offsets, masks_pad int32 words
    after the masks, the values' up to VALUES_PAD words).
    No value is written at or past values_room words (a buffer reserved for less than
    the largest payload): the total still counts them all, for the host to see the overflow."""
    t = ticket(state_ptr)
    while t < num_tiles:
        w, inb, nz = _masked_tile(words_ptr, masks_ptr, t, n, TILE)
        prefix, total, pos = _placed(nz, state_ptr, t, LOOK)
        tl.store(offsets_ptr + t, prefix)
        tl.store(values_ptr + _flat(pos, TILE), _flat(w, TILE), mask=_flat(inb & (nz != 0) & (pos < values_room), TILE))
        if t == num_tiles - 1:
            nnz = prefix + total
            tl.store(offsets_ptr + num_tiles, nnz)
            tl.store(nnz_ptr, nnz)
            pad = tl.arange(0, 4)
            tl.store(offsets_ptr + num_tiles + 1 + pad, pad.to(tl.int64) * 0, mask=pad < offsets_pad)
            tl.store(masks_ptr + (n + 31) // 32 + pad, pad * 0, mask=pad < masks_pad)
            vpad = tl.arange(0, VALUES_PAD)
            tl.store(values_ptr + nnz + vpad, tl.zeros([VALUES_PAD], dtype=w.dtype),
                     mask=(vpad < (VALUES_PAD - nnz % VALUES_PAD) % VALUES_PAD) & (nnz + vpad < values_room))
        t = ticket(state_ptr)


@triton.jit(do_not_specialize=["out_ptr", "n", "nnz", "num_tiles"])
def _zvc_decompress_kernel(masks_ptr, offsets_ptr, values_ptr, out_ptr, status_ptr, n, nnz,
                           num_tiles, TILE: tl.constexpr, SUB: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0)
    ROWS: tl.constexpr = SUB // 32
    rows = tl.arange(0, ROWS)
    lane = tl.arange(0, 32)
    for t in range(pid, num_tiles, nprog):
        dst = out_ptr + t * TILE
        mask_src = masks_ptr + t * (TILE // 32)
        tile_len = tl.minimum(n - t * TILE, TILE).to(tl.int32)
        # The payload is untrusted: clamp the tile's value range into [0, nnz].
        raw_start = tl.load(offsets_ptr + t)
        raw_end = tl.load(offsets_ptr + t + 1)
        start = tl.minimum(tl.maximum(raw_start, 0), nnz)
        end = tl.minimum(tl.maximum(raw_end, start), nnz)
        src = values_ptr + start
        avail = tl.minimum(end - start, TILE).to(tl.int32)  # values the tile may read
        count = tile_len * 0
        for s in range(0, TILE, SUB):
            offs = s + _row_major(ROWS)
            inb = offs < tile_len
            m = tl.load(mask_src + s // 32 + rows, mask=s + rows * 32 < tile_len, other=0)
            m = m.to(tl.uint32, bitcast=True)
            bit = ((m[:, None] >> lane[None, :].to(tl.uint32)) & 1).to(tl.int32)
            bit = tl.where(inb, bit, 0)
            row_count = tl.sum(bit, axis=1)
            row_before = tl.cumsum(row_count, axis=0) - row_count
            pos = count + row_before[:, None] + tl.cumsum(bit, axis=1) - bit
            v = tl.load(src + _flat(pos, SUB), mask=_flat(inb & (bit != 0) & (pos < avail), SUB), other=0)
            tl.store(dst + _flat(offs, SUB), v, mask=_flat(inb, SUB))
            count += tl.sum(row_count, axis=0)
        bad = (count != end - start) | (raw_start != start) | (raw_end != end)
        # The tiles must account for exactly nnz values, from the first.
        bad |= ((t == 0) & (raw_start != 0)) | ((t == num_tiles - 1) & (raw_end != nnz))
        tl.store(status_ptr + t, bad.to(tl.int8))


def _sections(payload: torch.Tensor, n: int, tile: int, nnz: int, word_dtype: torch.dtype):
    itemsize = word_dtype.itemsize
    _, off_masks, off_values, _ = layout(n, tile, nnz, itemsize)
    num_tiles = -(-n // tile)
    offsets = payload[: 8 * (num_tiles + 1)].view(torch.int64)
    masks = payload[off_masks: off_masks + 4 * (-(-n // 32))].view(torch.int32)
    values = payload[off_values: off_values + nnz * itemsize].view(word_dtype)
    return offsets, masks, values


def nonzero_offsets(words: torch.Tensor, tile: int, config: LaunchConfig | None = None) -> torch.Tensor:
    """int64[T + 1] on the device: entry t = non-zero words before tile t of `tile` words
    (entry 0 = 0, entry T = nnz). The count pass of ZVC and CSR."""
    n = words.numel()
    num_tiles = -(-n // tile)
    counts = torch.zeros(num_tiles + 1, dtype=torch.int64, device=words.device)
    if num_tiles:
        grid, warps = launch_grid(config, num_tiles, words.device)
        _nonzero_count_kernel[(grid,)](words, counts[1:], n, num_tiles, TILE=tile,
                                       SUB=step_elements(tile, warps, words.element_size()), num_warps=warps, maxnreg=max_registers(warps))
    return torch.cumsum(counts, 0)


# The one-pass encoder and the decoder hold a whole tile in registers: under 8 warps,
# ptxas spills it (sm_90, 128 registers a thread; `python -m cswap.kernels.aot`), so
# they run at least 8 (as do ZANS's compaction and unmask).
TILE_MIN_WARPS = 8


def _one_pass(words: torch.Tensor, payload: torch.Tensor, config: LaunchConfig | None, tile: int,
              sizes: torch.Tensor | None = None) -> torch.Tensor:
    """Write the payload of `words` into `payload` in one kernel (_zvc_one_pass_kernel);
    returns the offsets' last entry, nnz, as a 1-element int64 view on the device, which
    the kernel also writes into `sizes` (int64 [1]) when given.
    `payload` holds at least the offsets and masks (min_room_nbytes); values that do
    not fit are not written (the payload is whole when layout(n, tile, nnz)[3] fits)."""
    n, itemsize = words.numel(), words.element_size()
    num_tiles = -(-n // tile)
    if payload.numel() < min_room_nbytes(n, tile):
        raise ValueError(f"cswap.kernels.zvc: a buffer of {payload.numel()} bytes cannot hold the offsets and "
                         f"masks of {n} elements ({min_room_nbytes(n, tile)} bytes)")
    offsets, masks, values = _sections(payload, n, tile, n, words.dtype)
    values_room = (payload.numel() - layout(n, tile, 0, itemsize)[2]) // itemsize  # (the padding's room too)
    if not num_tiles:
        payload[:16].zero_()  # the offsets' one entry (0) and its padding
        if sizes is not None:
            sizes.zero_()
        return offsets[:1]
    state = torch.zeros(num_tiles + 1, dtype=torch.int64, device=words.device)
    grid, warps = launch_grid(config, num_tiles, words.device)
    warps = max(warps, TILE_MIN_WARPS)
    offsets_pad, masks_pad = (-(num_tiles + 1)) % (_ALIGN // 8), (-masks.numel()) % (_ALIGN // 4)
    nnz_out = offsets[num_tiles:] if sizes is None else sizes
    _zvc_one_pass_kernel[(grid,)](words, offsets, masks, values, state, nnz_out, n, num_tiles, offsets_pad, masks_pad,
                                  values_room, TILE=tile, LOOK=LOOK_BACK, VALUES_PAD=_ALIGN // itemsize,
                                  num_warps=warps, maxnreg=max_registers(warps))
    return offsets[num_tiles:]


def zvc_compress(words: torch.Tensor, alloc, config: LaunchConfig | None = None, tile: int = TILE) -> int:
    """Compress 1-D integer `words` with Triton into `alloc(payload_nbytes)`; returns nnz.
    The payload's size is read on the host (one sync) from a count pass before the
    one-pass encoder writes it: zvc_launch, into room for the largest, reads once."""
    n = words.numel()
    nnz = int(nonzero_offsets(words, tile, config)[-1])  # the one host sync: sizes the buffer
    payload = alloc(layout(n, tile, nnz, words.element_size())[3])
    _one_pass(words, payload, config, tile)
    return nnz


def reserve_nbytes(n: int, tile: int, itemsize: int) -> int:
    """The bytes zvc_launch writes into: the largest payload of n elements (every one non-zero)."""
    return layout(n, tile, n, itemsize)[3]


def min_room_nbytes(n: int, tile: int) -> int:
    """The least buffer zvc_launch takes: the offsets and the masks (the payload with no non-zero)."""
    return layout(n, tile, 0, 1)[3]


def zvc_launch(words: torch.Tensor, reserved: torch.Tensor, config: LaunchConfig | None = None,
               tile: int = TILE, sizes: torch.Tensor | None = None) -> torch.Tensor:
    """zvc_compress without the host sync, in one read of the input: the payload is
    written into `reserved` (16-byte aligned), byte for byte what zvc_compress writes for
    the same input, in the first layout(n, tile, nnz, itemsize)[3] bytes. Returns nnz as
    a 1-element int64 tensor on the device, for the caller to read back when the work
    has run. `reserved` may be shorter than reserve_nbytes (not than min_room_nbytes):
    then nothing is written past its end, and a payload larger than it is incomplete
    (the caller compares its size, from nnz, with the room). `sizes` (int64 [1] on the
    device): the kernel writes nnz there too, saving the caller a copy."""
    return _one_pass(words, reserved, config, tile, sizes)


def zvc_decompress(payload: torch.Tensor, n: int, tile: int, nnz: int, word_dtype: torch.dtype,
                   config: LaunchConfig | None = None, out: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode with Triton (into `out` when given); returns (words, per-tile status:
    non-zero = inconsistent tile)."""
    offsets, masks, values = _sections(payload, n, tile, nnz, word_dtype)
    num_tiles = -(-n // tile)
    out = decoder_output(out, n, word_dtype, payload.device, zero=False)
    status = torch.empty(num_tiles, dtype=torch.int8, device=payload.device)  # every tile writes its own
    if num_tiles:
        grid, warps = launch_grid(config, num_tiles, payload.device)
        warps = max(warps, TILE_MIN_WARPS)
        # A default tile in one step: its masks, then its values, two dependent loads a
        # tile (16 KiB of fp32 a program; steps of 512 elements had 2 KiB in flight).
        _zvc_decompress_kernel[(grid,)](masks, offsets, values, out, status, n, nnz, num_tiles, TILE=tile,
                                        SUB=min(tile, TILE), num_warps=warps,
                                        maxnreg=max_registers(warps))
    return out, status


# -- PyTorch reference ----------------------------------------------------------


def _mask_words(nz: torch.Tensor) -> torch.Tensor:
    """Pack a bool vector LSB-first into 32-bit words (as int32), one byte per element of temp."""
    n = nz.numel()
    padded = torch.zeros(-(-n // 32) * 32, dtype=torch.uint8, device=nz.device)
    padded[:n] = nz
    # 1, 2, 4, ..., 128 made on the device (torch.tensor(..., device=) copies from pageable memory: a host sync)
    weights = torch.ones(8, dtype=torch.uint8, device=nz.device) << torch.arange(8, dtype=torch.uint8, device=nz.device)
    # Little-endian: byte k of word j holds elements 32j + 8k .. 32j + 8k + 7.
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8).view(torch.int32)


def _mask_bits(masks: torch.Tensor, n: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=masks.device)
    return ((masks.view(torch.uint8)[:, None] >> shifts) & 1).reshape(-1)[:n].bool()


def _tile_counts(nz: torch.Tensor, tile: int) -> torch.Tensor:
    n = nz.numel()
    padded = torch.zeros(-(-n // tile) * tile, dtype=torch.bool, device=nz.device)
    padded[:n] = nz
    return padded.view(-1, tile).sum(1)


def zvc_compress_ref(words: torch.Tensor, alloc, tile: int = TILE) -> int:
    """Reference encoder in plain PyTorch; writes the same bytes as `zvc_compress`."""
    n = words.numel()
    nz = words != 0
    values = words[nz]
    nnz = values.numel()
    payload = alloc(layout(n, tile, nnz, words.element_size())[3])
    if payload is None:  # (zvc_launch_ref's room is too small for it)
        return nnz
    payload.zero_()
    offsets, masks, out_values = _sections(payload, n, tile, nnz, words.dtype)
    offsets[1:].copy_(torch.cumsum(_tile_counts(nz, tile), 0))
    masks.copy_(_mask_words(nz))
    out_values.copy_(values)
    return nnz


def zvc_launch_ref(words: torch.Tensor, reserved: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """zvc_launch's reference: the same bytes in `reserved`, nnz as a 1-element int64 tensor
    (the reference reads sizes on the host: on a GPU the Triton launch does not)."""
    def room(nbytes: int) -> torch.Tensor | None:
        return reserved[:nbytes] if nbytes <= reserved.numel() else None  # (too small: nothing written)

    nnz = zvc_compress_ref(words, room, tile)
    return torch.full((1,), nnz, dtype=torch.int64, device=words.device)


def zvc_decompress_ref(payload: torch.Tensor, n: int, tile: int, nnz: int, word_dtype: torch.dtype,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference decoder; returns (words, per-tile status) like `zvc_decompress`."""
    offsets, masks, values = _sections(payload, n, tile, nnz, word_dtype)
    nz = _mask_bits(masks, n)
    counts = _tile_counts(nz, tile)
    status = (offsets[1:] - offsets[:-1] != counts).to(torch.int8)
    out = decoder_output(out, n, word_dtype, payload.device, zero=True)
    found = int(nz.sum())
    # Scatter only what is consistent: never index values past nnz.
    if found == nnz and offsets[0] == 0:
        out[nz] = values
    elif status.numel():
        status[0] = 1  # total mismatch: report it even if each tile looks fine
    return out, status
