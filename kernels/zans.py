"""ZANS: a zero mask plus byte planes entropy-coded with static interleaved rANS.

The tensor's integer view (word size W = 1, 2, 4 or 8 bytes) is cut into
symbols and byte planes:

  - mode "dense" (0): the symbols are all n words;
  - mode "masked" (1): the symbols are the non-zero words, in order, and a
    ZVC mask says where they go (uint32 words, bit i of word j = element
    32 j + i is non-zero, LSB first; bits past n are zero).

Plane q < W holds byte q of every symbol (little-endian: plane 0 is the low
byte; a float's sign and high exponent bits are in plane W - 1). In masked
mode plane W is the mask, read as 4 * ceil(n / 32) bytes. Each plane is cut
into tiles of `tile` symbols (the last one may be shorter), and every tile is
stored either raw or as an rANS stream that decodes on its own.

Payload format (little-endian; each section starts 16-byte aligned):

    offset  size                 field
    0       8 * (TT + 1)         offsets int64[TT + 1]: byte offset of tile i's stream in the
                                 streams section (entry 0 = 0, entry TT = streams_nbytes).
                                 Tiles are numbered plane by plane: the Tv = ceil(symbols /
                                 tile) tiles of plane 0, ..., of plane W - 1, then the
                                 Tm = ceil(mask_bytes / tile) tiles of the mask (Tm = 0 in
                                 dense mode); TT = W * Tv + Tm.
    A       512 * C              freqs uint16[C][256]: the frequency table of each coded
                                 plane (bit q of coded_planes set), in plane order; C is the
                                 number of coded planes, A = align16(8 * (TT + 1)).
    B       streams_nbytes       the tile streams, back to back; B = A + 512 * C.

The payload is exactly B + align16(streams_nbytes) bytes; padding is zero.
Header meta fields: (tile, mode, symbols, coded_planes, streams_nbytes).

A tile of `len` symbols has raw_len = len rounded up to even. Its stream is
  - raw: exactly raw_len bytes, the symbols then a zero byte if len is odd;
  - coded (only in a coded plane, and only when shorter than raw_len):
        K x uint32   the K = 32 final encoder states (lane order)
        E x uint16   the renormalisation words, in decoding order
    so 4 K <= stream length < raw_len, and E = (length - 4 K) / 2.
The stream length alone says which (offsets are even, so states and words
are 2-byte aligned; a state is read as two uint16 halves).

rANS (Duda; the interleaved byte-wise form of ryg_rans and dietgpu): states
are 32-bit, L = 2**16, renormalisation in 16-bit words, probabilities of
PROB_BITS = 12 bits (M = 4096). A plane's table f[256] sums to M, every
symbol present in the plane has f >= 1; c[s] = f[0] + ... + f[s - 1].
Symbol j of a tile belongs to lane j % K at step j // K.
  encoder (steps in reverse, every lane starts at x = L):
      if x >= f[s] << 20: emit x & 0xFFFF, x >>= 16       (at most one word)
      x = ((x // f[s]) << 12) + (x % f[s]) + c[s]
    the lanes that emit at step g write their words in lane order, and the
    steps' groups are laid out in forward order, so
  decoder (steps forward, x = the stored states):
      slot = x & 4095; s = the symbol with c[s] <= slot < c[s] + f[s]
      x = f[s] * (x >> 12) + slot - c[s]
      if x < L: x = x << 16 | the next word (lanes in lane order)
    and a consistent stream leaves every lane at x == L with every word read.

The decoder checks every tile (status row t = (code, position), codes below):
offsets inside the section and even (BAD_OFFSETS), a length that is the raw
length or a valid coded length for its plane (BAD_LENGTH), the plane's table
summing to M (BAD_FREQUENCIES, raw tiles of a coded plane included), no read
past the tile's words (OVERRUN, at step g), final states == L (BAD_STATE,
first lane), every word read (TRAILING_WORDS). Row TT holds the whole-buffer checks: offsets[0] == 0 and
offsets[TT] == streams_nbytes (BAD_ENDS), and in masked mode the mask's set
bits == symbols (MASK_COUNT). Reads stay inside the tile's stream range, table
lookups inside the tables, writes inside the outputs, whatever the payload
holds. Both backends report the same codes and positions.

How a buffer is chosen (from one histogram pass; `plan` on the host for the PyTorch
backend, its twin kernel on the device for Triton's, so both write the same bytes):
  - histograms: byte q of every word (W planes) and the mask bytes; nnz is
    the mask histogram weighted by popcount;
  - table per plane: f = floor(count * M / m), raised to 1 for present
    symbols, then the rounding remainder handed to the largest fractional
    parts (or taken from the largest frequencies), integers only;
  - a plane is coded iff its estimate sum count[s] * log2(M / f[s]) bits (in fixed
    point, 2**-16 bit) + 4 K bytes per tile + its 512-byte table is below CODE_BELOW
    (95%, in 1024ths) of raw:
    a plane that saves less is not worth a rANS decode instead of a copy;
  - mode: masked iff the estimated size of (mask + non-zero planes) is below
    that of (all planes); both come from the same histograms (a masked
    plane's histogram is the dense one less the zeros in bin 0). This
    replaces the rule of thumb zeros * 8 * max(W - 1, 1) > n (the mask costs
    up to 1 bit per element; a zero left in dense mode costs about its W - 1
    near-random low bytes): the estimate agrees with the rule where the rule
    is right and also sees entropy-coded masks of clustered zeros, zeros that
    are cheap in dense mode (int8, bool) and compressible low bytes.

Encoding (zans_launch, the runtime's path), with no host sync: one histogram pass,
then the plan in one kernel (2W + 1 programs, one per candidate plane, choosing what
`plan` chooses on the host: integers only, the estimate in fixed point; the last to
finish picks the mode and writes the plan's words, the encoder tables and the
payload's head), then the masked mode's compaction (mask words + non-zeros into
scratch, each 4096 words placed by decoupled look-back; its programs return at once in
dense mode), then ONE rANS pass that writes every coded tile's stream into bounded
scratch (the tile's raw_len bytes: a tile whose stream would not be shorter is stored
raw, so the scratch never overflows) and every tile's length, and a pack kernel that
finds each tile's offset by decoupled look-back over those lengths, copies streams and
raw tiles into place in a buffer reserved for the largest payload (reserve_nbytes),
writes the offset table and leaves streams_nbytes on the device beside the meta.
Each kernel after the plan is launched for the largest geometry and reads the real
one from the plan. One rANS pass plus a copy of the compressed bytes, rather than two
rANS passes (size, then write): the rANS step (a division per symbol) costs more than
copying its output once. zans_compress, into a buffer of the exact size, reads the
meta back (its one host sync) and copies the payload there. Scratch: the coded
planes' raw bytes (a byte per symbol), the mask (n / 8 bytes) and room for n
non-zeros (launch_scratch_bytes); decoding in masked mode needs the mask and the
non-zeros.

Decoding: tables (one kernel, on the device: 4096-entry slot -> (symbol, f,
slot - c) per coded plane), one kernel over every tile of every plane (raw
tiles are copied in the same loop) writing plane bytes straight into the
output words (dense) or into the mask and the non-zeros (masked), then in
masked mode one kernel that places the non-zeros where the mask says, each
4096 elements finding their first non-zero by decoupled look-back, and
checks the mask's count (_zans_unmask_kernel).

Work per symbol (one symbol = one byte of a plane) on the GPU (one warp per
tile, lanes = the K interleaved states; `tile` / K dependent steps per warp):
  encode: 1 byte load (strided by W), 2 table loads (packed f | c | shifts,
    and a 32-bit magic reciprocal: x // f is computed as umulhi + add + 2
    shifts, Granlund-Montgomery, exact for every 32-bit x and f <= 4096),
    about 12 integer ops, a warp prefix sum over the emit flags, <= 1 16-bit
    store; then the pack kernel copies the stream (1 load + 1 store per byte).
  decode: 1 table load (4096 x int32 per plane, L1-resident), a multiply-add
    and 5 other integer ops, a warp prefix sum, <= 1 16-bit load, 1 byte
    store (strided by W); masked mode adds the placing (mask + values read,
    word written, a popcount of each mask word).
  raw tiles: 1 byte load + 1 byte store per symbol.
  histogram: 1 word load per element, W + 1 warp histograms (tl.histogram:
    ballots per bin bit), per-program accumulators, 256 atomics per plane per
    program and round of 65536 tiles.

Built ahead of time (cswap.kernels.aot's recorder, every word size, the tuner's
blocks 128, 256 and 512, sm_80 and sm_90), under the launches' 128-register cap:
Triton 3.8, decode 56-58 registers, encode 48-54, histogram 60-90, pack 72-114,
mask count 26-30, no spills (benchmarks/results/static-triton-3.8.0). Triton 3.6
takes more (histogram 121-128) and spills 16-32 bytes in the histogram pass with
16-bit words at block 256 (in its inner loop on sm_80: one pass per compression,
left as is; benchmarks/results/static-triton-3.6.0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from . import zvc as _zvc
from .lookback import LOOK_BACK, exclusive_prefix, ticket
from .launch import LaunchConfig, decoder_output, launch_grid, max_registers, step_elements, to_device

__all__ = [
    "TILE", "LANES", "PROB_BITS", "PROB_SCALE", "STATE_LOW", "CODE_BELOW", "MIN_TILE", "MAX_TILE",
    "DENSE", "MASKED",
    "OK", "BAD_OFFSETS", "BAD_LENGTH", "BAD_FREQUENCIES", "OVERRUN", "BAD_STATE", "TRAILING_WORDS", "BAD_ENDS",
    "MASK_COUNT",
    "Plan", "plan", "normalize", "encoder_tables", "decoder_tables", "decoder_tables_ref", "geometry", "mask_nbytes", "stream_bounds",
    "layout", "size_bound", "byte_histograms", "predicted_size",
    "sections", "reserve_nbytes", "min_room_nbytes", "launch_scratch_bytes", "zans_launch", "zans_launch_ref",
    "zans_compress", "zans_decompress", "zans_compress_ref", "zans_decompress_ref",
]

# TILE = 16384 symbols per tile: the K x 4-byte state flush is 128 bytes a tile per
# coded plane, 0.8% of a raw tile and 1-3% of a coded one. Measured with this encoder on
# activations (small_cnn + VGG16 + ResNet-18 ReLU/pool outputs on digits, fp32 and bf16
# autocast; a GELU TransformerEncoder's bf16 saved tensors): 8192 gives 0.3-0.6% less
# ratio (2.232 / 2.755 / 1.489 against 2.238 / 2.772 / 1.497) and 32768 0.1-0.3% more
# (2.241 / 2.781 / 1.501), while halving the warps a tensor decodes with (one warp per
# tile). Untuned on a GPU. Any power of two in [MIN_TILE, MAX_TILE] decodes.
TILE = 16384
MIN_TILE = 32
MAX_TILE = 1 << 16
LANES = 32                   # K: interleaved states per tile, one per lane of a warp
PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS  # M
STATE_LOW = 1 << 16          # L; states live in [L, 2**32)
# Code a plane only if the estimate is below 95% of raw: a rANS decode costs several
# times a copy per byte, for 5% of the plane's bytes or less it is not worth it.
CODE_BELOW = 0.95
DENSE, MASKED = 0, 1

# Decoder status codes (column 0 of a status row; column 1 is the position).
OK = 0
BAD_OFFSETS = 1      # the tile's [start, end) is not an even range inside the streams section; pos = start
BAD_LENGTH = 2       # neither the raw length nor a coded length its plane allows; pos = length
BAD_FREQUENCIES = 3  # its plane's frequency table does not sum to M; pos = the sum
OVERRUN = 4          # the decoder needed more words than the stream has; pos = step
BAD_STATE = 5        # a lane did not end at x == L; pos = lane
TRAILING_WORDS = 6   # words left unread; pos = how many
BAD_ENDS = 7         # (last row) offsets[0] != 0 or offsets[TT] != streams_nbytes; pos = the bad value
MASK_COUNT = 8       # (last row) the mask's set bits differ from `symbols`; pos = the bits counted

_ALIGN = 16
_POPCOUNT8 = np.array([i.bit_count() for i in range(256)], dtype=np.int64)
_BITLEN = np.array([i.bit_length() for i in range(PROB_SCALE + 1)], dtype=np.int64)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- geometry and layout (shared) ------------------------------------------------------


def mask_nbytes(n: int) -> int:
    """Bytes of the ZVC mask of n elements (whole uint32 words)."""
    return 4 * _cdiv(n, 32)


def geometry(n: int, tile: int, mode: int, symbols: int, itemsize: int) -> tuple[int, int, int]:
    """(Tv, Tm, TT): tiles per byte plane, tiles of the mask plane, tiles in all."""
    tv = _cdiv(symbols, tile)
    tm = _cdiv(mask_nbytes(n), tile) if mode == MASKED else 0
    return tv, tm, itemsize * tv + tm


def _plane_lengths(n: int, mode: int, symbols: int, itemsize: int) -> list[int]:
    """Symbols in plane q = 0..W (plane W: the mask, empty in dense mode)."""
    return [symbols] * itemsize + [mask_nbytes(n) if mode == MASKED else 0]


def _raw_stream_nbytes(length: int, tile: int) -> int:
    """Bytes of a plane stored raw: its tiles' raw lengths (only the last tile can be odd)."""
    return length + (length % tile % 2 if length % tile else 0)


def stream_bounds(n: int, tile: int, mode: int, symbols: int, coded_planes: int, itemsize: int) -> tuple[int, int]:
    """The least and the most streams_nbytes a consistent buffer can have: raw tiles
    are exactly raw_len, a coded plane's tile at least min(raw_len, 4 K) bytes."""
    lo = hi = 0
    for q, length in enumerate(_plane_lengths(n, mode, symbols, itemsize)):
        raw = _raw_stream_nbytes(length, tile)
        hi += raw
        if (coded_planes >> q) & 1 and length:
            full, last = divmod(length, tile)
            lo += full * min(tile, 4 * LANES) + (min(last + last % 2, 4 * LANES) if last else 0)
        else:
            lo += raw
    return lo, hi


def layout(n: int, tile: int, mode: int, symbols: int, coded_planes: int, streams_nbytes: int,
           itemsize: int) -> tuple[int, int, int, int]:
    """Byte offsets of (offsets, freqs, streams) and the payload size."""
    total_tiles = geometry(n, tile, mode, symbols, itemsize)[2]
    off_freqs = _align(8 * (total_tiles + 1))
    off_streams = off_freqs + 512 * coded_planes.bit_count()
    return 0, off_freqs, off_streams, off_streams + _align(streams_nbytes)


def size_bound(n: int, itemsize: int, nnz: int, tile: int = TILE) -> int:
    """An upper bound on the payload bytes our encoder writes for n words with nnz non-zeros.

    The encoder picks the mode with the smaller estimate, and a plane's estimate is its
    raw size or, when coded, below it; so the chosen estimate is at most the smaller
    raw size, min(W * nnz + mask bytes, W * n). A coded plane's real size exceeds its
    estimate by at most log2(17/16) bits a symbol (after renormalisation x >= 16 f, so
    a step adds at most log2(M / f) + log2(1 + 1/16) bits to the state; the flush of
    the final states is in the estimate), plus one pad byte per plane; then the offset
    table and the alignment of the sections."""
    tiles = itemsize * _cdiv(n, tile) + _cdiv(mask_nbytes(n), tile)
    raw = min(itemsize * nnz + mask_nbytes(n), itemsize * n)
    slack = math.ceil((itemsize * n + mask_nbytes(n)) * math.log2(17 / 16) / 8)
    return _align(8 * (tiles + 1)) + raw + slack + (itemsize + 1) + _ALIGN


def predicted_size(hist, n: int, itemsize: int, tile: int = TILE) -> int:
    """The payload bytes our encoder's plan expects from the histograms (`byte_histograms`):
    the offset table, the chosen planes' tables and the estimate of their streams (each
    coded plane's order-0 entropy under its 12-bit table plus the K states flushed per
    tile, each raw plane its bytes), aligned as `layout` aligns them. What rANS really
    writes differs by its 16-bit renormalisation's rounding and the states' unused
    bits: measured on the 402 tensors of benchmarks/ratio.py's corpus, the prediction
    is 0 to 0.69% above the real payload (mean 0.15%). This is what the advisor
    weighs when the profiler has sampled a tensor's bytes."""
    if n == 0:
        return layout(0, tile, DENSE, 0, 0, 0, itemsize)[3]
    p = plan(hist, n, itemsize, tile)
    total_tiles = geometry(n, tile, p.mode, p.symbols, itemsize)[2]
    return _align(8 * (total_tiles + 1)) + _align(math.ceil(p.estimate))


def sections(payload: torch.Tensor, n: int, tile: int, mode: int, symbols: int, coded_planes: int,
             streams_nbytes: int, itemsize: int):
    """(offsets int64[TT + 1], freqs int16[C, 256], streams uint8) views of a payload."""
    total_tiles = geometry(n, tile, mode, symbols, itemsize)[2]
    _, off_freqs, off_streams, _ = layout(n, tile, mode, symbols, coded_planes, streams_nbytes, itemsize)
    c = coded_planes.bit_count()
    offsets = payload[: 8 * (total_tiles + 1)].view(torch.int64)
    freqs = payload[off_freqs: off_freqs + 512 * c].view(torch.int16).view(c, 256)
    streams = payload[off_streams: off_streams + streams_nbytes]
    return offsets, freqs, streams


# -- tables and the choice of planes (shared host code) ---------------------------------


def normalize(counts) -> np.ndarray:
    """256 frequencies summing to M from a histogram (every present symbol >= 1).
    Integer arithmetic only, deterministic; all zeros for an empty histogram."""
    h = np.asarray(counts, dtype=np.int64).reshape(256)
    m = int(h.sum())
    if m == 0:
        return np.zeros(256, dtype=np.int64)
    present = h > 0
    f = h * PROB_SCALE // m
    f[present & (f == 0)] = 1
    diff = PROB_SCALE - int(f.sum())
    if diff > 0:  # hand the remainder to the largest fractional parts (ties: more frequent, lower)
        rem = h * PROB_SCALE % m
        order = np.lexsort((np.arange(256), -h, -rem))
        order = order[present[order]]
        f[order[:diff]] += 1  # diff < number of present symbols: each floor lost < 1
    while diff < 0:  # the raised rare symbols took too much: take it from the largest
        i = int(np.argmax(f))
        take = min(-diff, int(f[i]) - 1)
        # Take at most half the gap to the next largest at a time, so several share it.
        others = np.delete(f, i)
        take = max(1, min(take, (int(f[i]) - int(others.max())) // 2 or 1))
        f[i] -= take
        diff += take
    return f


# The estimate in fixed point, integers only, so that the device's plan (zans_launch)
# makes the host's choices: a symbol of frequency f costs EST_BITS[f] = round((12 - log2 f)
# x 2**16) 65536ths of a bit, and one byte is BYTE_FX of those units.
_EST_FRAC = 16
_EST_BITS = np.concatenate([[0], np.rint((PROB_BITS - np.log2(np.arange(1, PROB_SCALE + 1)))
                                         * (1 << _EST_FRAC)).astype(np.int64)])
_BYTE_FX = 1 << (_EST_FRAC + 3)
_BYTE_FX_C = tl.constexpr(_BYTE_FX)
_BELOW_SCALE = 1024  # code_below in 1024ths: a plane is coded iff estimate * 1024 < below * raw


def _below(code_below: float) -> int:
    """code_below in 1024ths (inf, to code every plane: far above any ratio)."""
    return 1 << 20 if math.isinf(code_below) else round(code_below * _BELOW_SCALE)


def _coded_estimate(h: np.ndarray, f: np.ndarray, tile: int) -> int:
    """Estimated coded bytes of a plane with histogram h and table f, in BYTE_FX units:
    its entropy under f, the K states flushed per tile and its 512-byte table."""
    m = int(h.sum())
    bits = int((h * _EST_BITS[f]).sum())  # f = 0 only where h = 0
    return bits + (_cdiv(m, tile) * 4 * LANES + 512) * _BYTE_FX


@dataclass(frozen=True)
class Plan:
    mode: int
    symbols: int
    coded_planes: int
    freqs: np.ndarray          # int64 [W + 1, 256], zero rows for raw planes
    estimate: int              # estimated payload bytes of the chosen mode (streams + tables)


def plan(hist, n: int, itemsize: int, tile: int = TILE, code_below: float = CODE_BELOW) -> Plan:
    """Mode, coded planes and tables from the histograms (int64 [W + 1, 256]: rows
    0..W-1 the byte planes of all n words, row W the mask bytes). A plane is coded
    when its estimate is below `code_below` x raw (tests pass inf to code every plane)."""
    hist = np.asarray(hist, dtype=np.int64).reshape(itemsize + 1, 256)
    mask_hist = hist[itemsize]
    if n and (int(mask_hist.sum()) != mask_nbytes(n) or any(int(h.sum()) != n for h in hist[:itemsize])):
        raise RuntimeError(f"cswap.kernels.zans: histogram totals {hist.sum(1).tolist()} do not match {n} "
                           f"elements (a kernel bug)")
    nnz = int((mask_hist * _POPCOUNT8).sum())
    zeros = n - nnz

    below = _below(code_below) * (_BYTE_FX // _BELOW_SCALE)

    def choose(h):  # (cost in BYTE_FX units, coded, table)
        m = int(h.sum())
        if m == 0:
            return 0, False, None
        f = normalize(h)
        coded = _coded_estimate(h, f, tile)
        return (coded, True, f) if coded < below * m else (m * _BYTE_FX, False, None)

    dense = [choose(h) for h in hist[:itemsize]]
    masked_hist = hist[:itemsize].copy()
    masked_hist[:, 0] -= zeros
    masked = [choose(h) for h in masked_hist] + [choose(mask_hist)]
    dense_cost = sum(c for c, _, _ in dense)
    masked_cost = sum(c for c, _, _ in masked)
    use_masked = n > 0 and masked_cost < dense_cost
    chosen = masked if use_masked else dense + [(0, False, None)]
    freqs = np.zeros((itemsize + 1, 256), dtype=np.int64)
    coded_planes = 0
    for q, (_, coded, f) in enumerate(chosen):
        if coded:
            freqs[q] = f
            coded_planes |= 1 << q
    return Plan(MASKED if use_masked else DENSE, nnz if use_masked else n, coded_planes, freqs,
                (masked_cost if use_masked else dense_cost) // _BYTE_FX)


def encoder_tables(freqs: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per plane and symbol: packed f | c << 13 | sh2 << 25 | sh1 << 29, and the magic
    reciprocal m (int32 bit patterns), so that x // f = (t + ((x - t) >> sh1)) >> sh2
    with t = umulhi(x, m) for every 32-bit x (Granlund & Montgomery 1994, fig. 4.1).
    The host's statement of what the device's plan kernel builds."""
    f = np.asarray(freqs, dtype=np.int64)
    c = np.cumsum(f, axis=1) - f
    ff = np.maximum(f, 1)
    bits = _BITLEN[ff - 1]  # ceil(log2 f)
    magic = (np.int64(1) << 32) * ((np.int64(1) << bits) - ff) // ff + 1  # < 2**32; 2**43 at most inside
    sh1 = np.minimum(bits, 1)
    sh2 = np.maximum(bits - 1, 0)
    packed = f | (c & 4095) << 13 | sh2 << 25 | sh1 << 29
    magic32 = np.where(magic >= 1 << 31, magic - (1 << 32), magic)
    tables = torch.from_numpy(np.stack([packed.astype(np.int32), magic32.astype(np.int32)]))
    packed_t, magic_t = to_device(tables, device)  # one copy, queued: no host sync
    return packed_t, magic_t


def decoder_tables(freqs: torch.Tensor, coded_planes: int, itemsize: int, config: LaunchConfig | None = None,
                   zero: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the payload's tables (int16 [C, 256], on its device), in one kernel and no
    host sync: dec int32 [W + 1, 4096] (slot -> sym | (f - 1) << 8 | (slot - c) << 20),
    table_ok int32 [W + 1] (1 where the plane is raw or its table sums to M) and the
    sums. A corrupt table still gives in-range entries (garbage symbols, flagged).
    `zero`: an int64 tensor the same kernel zeroes (a later kernel's look-back state,
    which then needs no launch of its own)."""
    device = freqs.device
    if zero is None:
        zero = torch.empty(0, dtype=torch.int64, device=device)
    planes = itemsize + 1
    dec = torch.empty(planes, PROB_SCALE, dtype=torch.int32, device=device)
    ok = torch.empty(planes, dtype=torch.int32, device=device)
    sums = torch.empty(planes, dtype=torch.int64, device=device)
    if freqs.numel() == 0:  # no plane coded: any int16 pointer for the kernel's masked-off loads
        freqs = dec.view(torch.int16)
    warps = launch_grid(config, planes, device)[1]
    _zans_tables_kernel[(planes,)](freqs, dec, ok, sums, zero, zero.numel(), coded_planes, num_warps=warps,
                                   maxnreg=max_registers(warps))
    return dec, ok, sums


def decoder_tables_ref(freqs: torch.Tensor, coded_planes: int, itemsize: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """decoder_tables in PyTorch ops, one plane at a time (the reference decoder's)."""
    device = freqs.device
    planes = itemsize + 1
    dec = torch.zeros(planes, PROB_SCALE, dtype=torch.int32, device=device)
    ok = torch.ones(planes, dtype=torch.int32, device=device)
    sums = torch.full((planes,), PROB_SCALE, dtype=torch.int64, device=device)
    rows = [q for q in range(planes) if (coded_planes >> q) & 1]
    slots = torch.arange(PROB_SCALE, dtype=torch.int64, device=device)
    symbols = torch.arange(256, dtype=torch.int64, device=device)
    # One plane at a time: 4096-element ops stay under ATen's grain (see _REF_ROWS).
    for i, q in enumerate(rows):
        f = freqs[i].to(torch.int64) & 0xFFFF
        cum = torch.cumsum(f, 0)
        # slot -> the present symbol with the largest start c <= slot (searchsorted(cum, slot,
        # right=True) for a valid table; torch.searchsorted runs a parallel region per call).
        starts = torch.zeros(PROB_SCALE + 1, dtype=torch.int64, device=device)
        starts.scatter_reduce_(0, (cum - f).clamp(max=PROB_SCALE), torch.where(f > 0, symbols, 0), "amax")
        sym = torch.cummax(starts[:PROB_SCALE], 0).values
        fs = f.gather(0, sym)
        cs = cum.gather(0, sym) - fs
        entry = sym | ((fs - 1) & 4095) << 8 | ((slots - cs) & 4095) << 20
        dec[q] = torch.where(entry >= 1 << 31, entry - (1 << 32), entry).to(torch.int32)
        total = cum[-1]
        sums[q] = total
        ok[q] = (total == PROB_SCALE).to(torch.int32)
    return dec, ok, sums


def _freqs_int16(freqs: np.ndarray, coded_planes: int) -> np.ndarray:
    """The coded planes' tables as stored: int16 [C, 256] (uint16 bit patterns)."""
    rows = [freqs[q] for q in range(freqs.shape[0]) if (coded_planes >> q) & 1]
    return np.stack(rows).astype(np.uint16).view(np.int16) if rows else np.zeros((0, 256), dtype=np.int16)


# -- Triton -------------------------------------------------------------------------------


@triton.jit
def _byte_hist(w, shift: tl.constexpr, SUB: tl.constexpr):
    b = ((w >> shift) & 255).to(tl.int32)
    return tl.histogram(tl.reshape(b, [SUB]), 256)


@triton.jit
def _flush_hist(ptr, h, pad):
    bins = tl.arange(0, 256)
    tl.atomic_add(ptr + bins, h.to(tl.int64) - tl.where(bins == 0, pad, 0), sem="relaxed")  # (read next launch)


# A program's histograms are int32 and flushed (256 atomics per plane) every ROUND of its
# tiles: ROUND x 4096 elements stay below 2**31 counts, and int32 accumulators hold half
# the registers of int64 ones (9 planes x 256 bins at one warp: 72 registers, not 144).
_HIST_ROUND = 1 << 16


@triton.jit(do_not_specialize=["n", "num_tiles"])
def _zans_histogram_kernel(words_ptr, hist_ptr, n, num_tiles,
                           W: tl.constexpr, TILE: tl.constexpr, SUB: tl.constexpr, ROUND: tl.constexpr):
    """Byte histograms of every plane and of the mask bytes (whose bits the plan counts
    for the non-zeros)."""
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0)
    ROWS: tl.constexpr = SUB // 32
    rows = tl.arange(0, ROWS)
    lane = tl.arange(0, 32)
    bit = tl.arange(0, 8)
    for r0 in range(pid, num_tiles, nprog * ROUND):
        h0 = tl.zeros([256], dtype=tl.int32)
        h1 = tl.zeros([256], dtype=tl.int32)
        h2 = tl.zeros([256], dtype=tl.int32)
        h3 = tl.zeros([256], dtype=tl.int32)
        h4 = tl.zeros([256], dtype=tl.int32)
        h5 = tl.zeros([256], dtype=tl.int32)
        h6 = tl.zeros([256], dtype=tl.int32)
        h7 = tl.zeros([256], dtype=tl.int32)
        hm = tl.zeros([256], dtype=tl.int32)
        pad_words = (pid * 0).to(tl.int64)  # zero words histogrammed past n
        pad_mask = (pid * 0).to(tl.int64)   # zero mask bytes past the mask
        for t in range(r0, tl.minimum(r0 + nprog * ROUND, num_tiles), nprog):
            src = words_ptr + t * TILE
            tile_len = tl.minimum(n - t * TILE, TILE).to(tl.int32)
            for s in range(0, TILE, SUB):
                offs = s + rows[:, None] * 32 + lane[None, :]
                inb = offs < tile_len
                w = tl.load(src + offs, mask=inb, other=0)
                nz = (w != 0).to(tl.int32)
                w = w.to(tl.int64) if W == 8 else w.to(tl.int32)  # sign-extended: byte q is (w >> 8q) & 255
                pad_words += SUB - tl.sum(tl.sum(inb.to(tl.int32), axis=1), axis=0)
                h0 += _byte_hist(w, 0, SUB)
                if W > 1:
                    h1 += _byte_hist(w, 8, SUB)
                if W > 2:
                    h2 += _byte_hist(w, 16, SUB)
                    h3 += _byte_hist(w, 24, SUB)
                if W > 4:
                    h4 += _byte_hist(w, 32, SUB)
                    h5 += _byte_hist(w, 40, SUB)
                    h6 += _byte_hist(w, 48, SUB)
                    h7 += _byte_hist(w, 56, SUB)
                mbytes = tl.sum(tl.reshape(nz, [ROWS * 4, 8]) << bit[None, :], axis=1)
                hm += tl.histogram(mbytes, 256)
                valid_rows = tl.sum((s + rows * 32 < tile_len).to(tl.int32), axis=0)
                pad_mask += 4 * (ROWS - valid_rows)
        _flush_hist(hist_ptr, h0, pad_words)
        if W > 1:
            _flush_hist(hist_ptr + 256, h1, pad_words)
        if W > 2:
            _flush_hist(hist_ptr + 2 * 256, h2, pad_words)
            _flush_hist(hist_ptr + 3 * 256, h3, pad_words)
        if W > 4:
            _flush_hist(hist_ptr + 4 * 256, h4, pad_words)
            _flush_hist(hist_ptr + 5 * 256, h5, pad_words)
            _flush_hist(hist_ptr + 6 * 256, h6, pad_words)
            _flush_hist(hist_ptr + 7 * 256, h7, pad_words)
        _flush_hist(hist_ptr + W * 256, hm, pad_mask)


# The device's plan (zans_launch): int64 words. Words 0-4 are the header's meta (streams_nbytes
# written by the pack kernel), then what the encode and pack kernels need, then the scratch
# base of each plane (W + 1 words).
_PLAN_TILE, _PLAN_MODE, _PLAN_SYMBOLS, _PLAN_CODED, _PLAN_STREAMS = (tl.constexpr(i) for i in range(5))
_PLAN_TV, _PLAN_TT, _PLAN_MASK_BYTES, _PLAN_OFF_STREAMS, _PLAN_BASES = (tl.constexpr(i) for i in range(5, 10))
_PLAN_WORDS = 32   # (the bases of at most 9 planes end at word 18)
_ROW = tl.constexpr(258)  # a candidate plane's work row: cost, coded, its table f[256]
_M = tl.constexpr(PROB_SCALE)
_M_BITS = tl.constexpr(PROB_BITS)
_K = tl.constexpr(LANES)
_MASKED = tl.constexpr(MASKED)


@triton.jit
def _popcount8(b):
    b = b - ((b >> 1) & 0x55)
    b = (b & 0x33) + ((b >> 2) & 0x33)
    return (b + (b >> 4)) & 0x0F


@triton.jit
def _candidate_hist(hist_ptr, row, less, j):
    """Bins j of histogram row `row`, bin 0 less `less` (a masked byte plane's zeros)."""
    return tl.load(hist_ptr + row * 256 + j) - tl.where(j == 0, less, 0)


@triton.jit(do_not_specialize=["n", "tile", "below"])
def _zans_plan_kernel(hist_ptr, est_ptr, work_ptr, ticket_ptr, plan_ptr, enc_ptr, magic_ptr, head_ptr,
                      n, tile, below, W: tl.constexpr):
    """`plan` on the device, integers only, choosing what the host's would. Program p < W:
    dense byte plane p; W <= p < 2W: masked byte plane p - W; p = 2W: the mask. Each
    normalizes its histogram (as `normalize`) and estimates its cost (as `_coded_estimate`)
    into its work row; the last to finish (by ticket) picks the mode and writes the plan
    words, the encoder tables and the payload's head (offset padding, frequency tables)."""
    p = tl.program_id(0)
    bins = tl.arange(0, 256)
    nnz = tl.sum(tl.load(hist_ptr + W * 256 + bins) * _popcount8(bins), axis=0)
    zeros = n - nnz
    row = tl.where(p < W, p, tl.where(p < 2 * W, p - W, W))
    less = tl.where((p >= W) & (p < 2 * W), zeros, 0)
    h = _candidate_hist(hist_ptr, row, less, bins)
    m = tl.sum(h, axis=0)
    mm = tl.maximum(m, 1)
    present = h > 0
    f = h * _M // mm
    f = tl.where(present & (f == 0), 1, f)
    diff = _M - tl.sum(f, axis=0)
    # diff > 0: one more to the `diff` first present symbols by (remainder, count) down,
    # then index up (normalize's lexsort): each symbol's rank is how many come before it.
    rem = h * _M % mm
    rank = tl.zeros([256], dtype=tl.int32)
    for j0 in range(0, 256, 8):  # (8 columns a step: [256, 8] blocks fit 8 warps' registers)
        j = j0 + tl.arange(0, 8)
        hj = _candidate_hist(hist_ptr, row, less, j)
        rj = hj * _M % mm
        ahead = (rj[None, :] > rem[:, None]) | ((rj[None, :] == rem[:, None]) & (
            (hj[None, :] > h[:, None]) | ((hj[None, :] == h[:, None]) & (j[None, :] < bins[:, None]))))
        rank += tl.sum((ahead & (hj[None, :] > 0)).to(tl.int32), axis=1)
    f = tl.where(present & (rank < diff), f + 1, f)
    while diff < 0:  # the raised rare symbols took too much: from the largest, half a gap at a time
        top = tl.max(f, axis=0)
        i = tl.min(tl.where(f == top, bins, 256), axis=0)
        second = tl.max(tl.where(bins == i, -1, f), axis=0)
        half = (top - second) // 2
        take = tl.maximum(1, tl.minimum(tl.minimum(-diff, top - 1), tl.where(half == 0, 1, half)))
        f = tl.where(bins == i, f - take, f)
        diff += take
    bits = tl.sum(h * tl.load(est_ptr + f, mask=present, other=0), axis=0)
    coded_cost = bits + ((m + tile - 1) // tile * 4 * _K + 512) * _BYTE_FX_C
    coded = (m > 0) & (coded_cost < below * m)
    cost = tl.where(coded, coded_cost, m * _BYTE_FX_C)
    tl.store(work_ptr + p * _ROW + bins, tl.where(bins == 0, cost, coded.to(tl.int64)), mask=bins < 2)
    tl.store(work_ptr + p * _ROW + 2 + bins, f)
    if tl.atomic_add(ticket_ptr, 1) == 2 * W:  # (acq_rel: every other program's rows are written)
        _zans_plan_final(work_ptr, plan_ptr, enc_ptr, magic_ptr, head_ptr, n, nnz, tile, W)


@triton.jit
def _zans_plan_final(work_ptr, plan_ptr, enc_ptr, magic_ptr, head_ptr, n, nnz, tile, W: tl.constexpr):
    idx = tl.arange(0, 32)
    cand = idx < 2 * W + 1
    cost = tl.load(work_ptr + idx * _ROW, mask=cand, other=0, volatile=True)
    dense_cost = tl.sum(tl.where(idx < W, cost, 0), axis=0)
    masked_cost = tl.sum(tl.where((idx >= W) & cand, cost, 0), axis=0)
    use_masked = (n > 0) & (masked_cost < dense_cost)
    um = (idx * 0 + use_masked.to(tl.int32)) != 0  # (as a block: the interpreter's masks want one)
    # plane q's candidate: dense p = q (no mask plane), masked p = W + q (the mask: 2W)
    q = idx
    src = tl.where(um, W + q, q)
    valid = (q <= W) & (um | (q < W))
    cbit = tl.load(work_ptr + src * _ROW + 1, mask=valid, other=0, volatile=True)
    coded_planes = tl.sum(cbit << q, axis=0)
    symbols = tl.where(use_masked, nnz, n)
    mask_bytes = 4 * ((n + 31) // 32)
    mbytes = tl.where(use_masked, mask_bytes, 0)
    tv = (symbols + tile - 1) // tile
    total_tiles = W * tv + tl.where(use_masked, (mask_bytes + tile - 1) // tile, 0)
    offsets_end = 8 * (total_tiles + 1)
    off_freqs = (offsets_end + 15) // 16 * 16
    off_streams = off_freqs + 512 * tl.sum(cbit, axis=0)
    length = tl.where(q < W, symbols, mbytes)
    size = tl.where((cbit != 0) & (length > 0), length // tile * (tile // 2) + (length % tile + 1) // 2, 0)
    bases = tl.cumsum(size, axis=0) - size
    words = tl.where(idx == _PLAN_TILE, tile, 0)
    words = tl.where(idx == _PLAN_MODE, use_masked.to(tl.int64), words)
    words = tl.where(idx == _PLAN_SYMBOLS, symbols, words)
    words = tl.where(idx == _PLAN_CODED, coded_planes, words)
    words = tl.where(idx == _PLAN_TV, tv, words)
    words = tl.where(idx == _PLAN_TT, total_tiles, words)
    words = tl.where(idx == _PLAN_MASK_BYTES, mbytes, words)
    words = tl.where(idx == _PLAN_OFF_STREAMS, off_streams, words)
    tl.store(plan_ptr + idx, words, mask=idx < _PLAN_BASES)
    tl.store(plan_ptr + _PLAN_BASES + idx, bases, mask=idx <= W)
    # The payload's head: zeros from the offset table's end (from 0 with no tile: offsets[0])
    # to the tables, then each coded plane's table as uint16, in plane order.
    pad = tl.arange(0, 16)
    pad_from = tl.where(total_tiles == 0, 0, offsets_end)
    tl.store(head_ptr + pad_from + pad, tl.zeros([16], dtype=tl.uint8), mask=pad_from + pad < off_freqs)
    bins = tl.arange(0, 256)
    for qq in tl.static_range(W + 1):
        bit = (coded_planes >> qq) & 1
        row = tl.where(use_masked, W + qq, qq)
        live = (bins * 0 + bit) != 0
        f = tl.load(work_ptr + row * _ROW + 2 + bins, mask=live, other=0, volatile=True)
        c = tl.cumsum(f, axis=0) - f
        ff = tl.maximum(f, 1)
        lg = tl.zeros([256], dtype=tl.int64)
        for b in tl.static_range(_M_BITS + 1):
            lg += (ff > (1 << b)).to(tl.int64)  # ceil(log2 f)
        magic = (((tl.full([256], 1, tl.int64) << lg) - ff) << 32) // ff + 1
        packed = f | (c & 4095) << 13 | tl.maximum(lg - 1, 0) << 25 | tl.minimum(lg, 1) << 29
        tl.store(enc_ptr + qq * 256 + bins, packed.to(tl.int32))
        tl.store(magic_ptr + qq * 256 + bins, tl.where(magic >= (1 << 31), magic - (1 << 32), magic).to(tl.int32))
        at = off_freqs + 512 * _popcount8(coded_planes & ((1 << qq) - 1)) + 2 * bins
        tl.store(head_ptr + at, (f & 255).to(tl.uint8), mask=live)
        tl.store(head_ptr + at + 1, (f >> 8).to(tl.uint8), mask=live)


@triton.jit
def _tile_geometry(t, symbols, mask_bytes, tile, tiles_per_plane, W: tl.constexpr):
    """Plane q, first symbol and length of global tile(s) t."""
    vt = W * tiles_per_plane
    is_mask = t >= vt
    tpp = tl.maximum(tiles_per_plane, 1)
    q = tl.where(is_mask, W, t // tpp)
    tip = tl.where(is_mask, t - vt, t % tpp)
    plane_len = tl.where(is_mask, mask_bytes, symbols)
    first = tip * tile
    tlen = tl.minimum(plane_len - first, tile)
    return is_mask, q, tip, first, tlen


@triton.jit(do_not_specialize=["words_ptr", "n", "num_tiles"])
def _zans_compact_kernel(words_ptr, masks_ptr, values_ptr, state_ptr, plan_ptr, n, num_tiles,
                         TILE: tl.constexpr, LOOK: tl.constexpr):
    """Masked mode's compaction in one read of the input: each TILE words' mask words and
    non-zeros, placed by decoupled look-back (state_ptr: int64[num_tiles + 1], zero before
    the launch), as ZVC's one-pass encoder does; nothing when the device's plan chose the
    dense mode. (A count pass, a prefix sum and ZVC's second pass until 2026-12-05.)"""
    tiles = tl.where(tl.load(plan_ptr + _PLAN_MODE) == _MASKED, num_tiles, 0)
    t = ticket(state_ptr)
    while t < tiles:
        w, inb, nz = _zvc._masked_tile(words_ptr, masks_ptr, t, n, TILE)
        pos = _zvc._placed(nz, state_ptr, t, LOOK)[2]
        tl.store(values_ptr + _zvc._flat(pos, TILE), _zvc._flat(w, TILE), mask=_zvc._flat(inb & (nz != 0), TILE))
        t = ticket(state_ptr)


@triton.jit(do_not_specialize=["tile"])
def _zans_encode_kernel(words_ptr, values_ptr, mask_ptr, enc_ptr, magic_ptr, plan_ptr, scratch_ptr, lens_ptr,
                        tile, W: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr):
    """rANS-encode every tile of the coded planes, one tile per warp (a [ROWS, K] block:
    row = tile, column = lane), into its scratch region; write every tile's stream length.
    The geometry is the device's plan (_PLAN_* words of plan_ptr); the symbols are the
    words themselves in dense mode, the compacted non-zeros (values_ptr) in masked mode."""
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0)
    r = tl.arange(0, ROWS)
    k = tl.arange(0, K)
    # (a block of equal values, not a 0-d bool, for the masks below: see _zans_pack_kernel's tiles)
    masked = (tl.zeros([ROWS, K], dtype=tl.int64) + tl.load(plan_ptr + _PLAN_MODE)) == _MASKED
    symbols = tl.load(plan_ptr + _PLAN_SYMBOLS)
    coded_planes = tl.load(plan_ptr + _PLAN_CODED)
    tiles_per_plane = tl.load(plan_ptr + _PLAN_TV)
    total_tiles = tl.load(plan_ptr + _PLAN_TT)
    mask_bytes = tl.load(plan_ptr + _PLAN_MASK_BYTES)
    sbase_ptr = plan_ptr + _PLAN_BASES
    for base in range(pid * ROWS, total_tiles, nprog * ROWS):
        t = base + r
        live = t < total_tiles
        is_mask, q, tip, first, tlen = _tile_geometry(t, symbols, mask_bytes, tile, tiles_per_plane, W)
        tlen = tl.where(live, tlen, 0)
        cap = (tlen + 1) // 2  # halfwords of the tile's scratch region (its raw length)
        coded = live & (((coded_planes >> q) & 1) == 1)
        region = tl.load(sbase_ptr + q, mask=coded, other=0) + tip * (tile // 2)
        steps = tl.max(tl.where(coded, (tlen + K - 1) // K, 0), axis=0)
        x = tl.full([ROWS, K], 65536, dtype=tl.uint32)
        emitted = tl.zeros([ROWS], dtype=tl.int32)
        for gg in range(0, steps):
            g = steps - 1 - gg
            j = g * K + k[None, :]
            act = coded[:, None] & (j < tlen[:, None])
            at = first[:, None] + j
            sv = tl.load(values_ptr + at * W + q[:, None], mask=act & (is_mask[:, None] == 0) & masked, other=0)
            sv += tl.load(words_ptr + at * W + q[:, None], mask=act & (is_mask[:, None] == 0) & (masked == 0),
                          other=0)
            sm = tl.load(mask_ptr + at, mask=act & is_mask[:, None], other=0)
            s = tl.where(is_mask[:, None], sm, sv).to(tl.int32) & 255
            e = tl.load(enc_ptr + q[:, None] * 256 + s, mask=act, other=0)
            m = tl.load(magic_ptr + q[:, None] * 256 + s, mask=act, other=0).to(tl.uint32, bitcast=True)
            f = (e & 8191).to(tl.uint32)
            c = ((e >> 13) & 4095).to(tl.uint32)
            sh2 = ((e >> 25) & 15).to(tl.uint32)
            sh1 = ((e >> 29) & 1).to(tl.uint32)
            emit = act & ((x >> 20) >= f)
            ei = emit.to(tl.int32)
            emitted += tl.sum(ei, axis=1)
            pos = cap[:, None] - emitted[:, None] + tl.cumsum(ei, axis=1) - ei
            word = (x & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True)
            tl.store(scratch_ptr + region[:, None] + pos, word, mask=emit & (pos >= 0))
            x = tl.where(emit, x >> 16, x)
            hi = tl.umulhi(x, m)
            quot = (hi + ((x - hi) >> sh1)) >> sh2
            x = tl.where(act, x + c + quot * (4096 - f), x)
        keep = coded & (2 * K + emitted < cap)
        spos = region + cap - emitted - 2 * K
        lo16 = (x & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True)
        hi16 = (x >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
        tl.store(scratch_ptr + spos[:, None] + 2 * k[None, :], lo16, mask=keep[:, None])
        tl.store(scratch_ptr + spos[:, None] + 2 * k[None, :] + 1, hi16, mask=keep[:, None])
        lens = tl.where(keep, 2 * (2 * K + emitted), 2 * cap)
        tl.store(lens_ptr + t, lens.to(tl.int64), mask=live)


@triton.jit(do_not_specialize=["meta_ptr", "tile", "room"])
def _zans_pack_kernel(words_ptr, values_ptr, mask_ptr, scratch_ptr, plan_ptr, lens_ptr, state_ptr, offsets_ptr,
                      payload_ptr, meta_ptr, tile, room, W: tl.constexpr, BLOCK: tl.constexpr, LOOK: tl.constexpr):
    """Copy each tile's stream into the payload (the encoder's stream from scratch, or the
    tile's raw bytes and a zero pad byte from the plane) at its offset, the sum of the
    lengths before it, found by decoupled look-back over tiles taken by ticket (state_ptr:
    int64[largest tile count + 1], zero before the launch; a prefix sum of its own until
    2026-12-05), and write the offset table; the last tile also
    zeroes the streams' alignment padding and writes the meta (tile, mode, symbols,
    coded_planes, streams_nbytes) at meta_ptr (the plan's first words, or the caller's).
    Nothing is written at or past byte `room` of the payload (a buffer reserved for less
    than the largest): streams_nbytes still counts every stream, for the host to see it."""
    i0 = tl.arange(0, BLOCK)
    first_lane = i0 == 0
    masked = (i0 * 0 + tl.load(plan_ptr + _PLAN_MODE)) == _MASKED  # (a block, as each tile's t below)
    symbols = tl.load(plan_ptr + _PLAN_SYMBOLS)
    tiles_per_plane = tl.load(plan_ptr + _PLAN_TV)
    total_tiles = tl.load(plan_ptr + _PLAN_TT)
    mask_bytes = tl.load(plan_ptr + _PLAN_MASK_BYTES)
    sbase_ptr = plan_ptr + _PLAN_BASES
    off_streams = tl.load(plan_ptr + _PLAN_OFF_STREAMS)
    streams_ptr = payload_ptr + off_streams
    streams_room = room - off_streams
    t0 = ticket(state_ptr)
    while t0 < total_tiles:
        before = exclusive_prefix(state_ptr, t0, tl.load(lens_ptr + t0), LOOK)  # (published first: no wait on the copy)
        # Everything per tile as a block of BLOCK equal values: the CPU interpreter (Triton
        # 3.9) turns a 0-d bool & a block of bools into integers, which a mask rejects.
        t = t0 + i0 * 0
        is_mask, q, tip, first, tlen = _tile_geometry(t, symbols, mask_bytes, tile, tiles_per_plane, W)
        length = tl.load(lens_ptr + t)
        start = before + i0 * 0
        end = start + length
        tl.store(offsets_ptr + t + 1, end, mask=first_lane)
        tl.store(offsets_ptr + t, start, mask=first_lane & (t == 0))
        raw = length == tlen + (tlen & 1)
        # A coded tile's stream ends where its scratch region does (byte 2 * (region + cap)).
        src = tl.load(sbase_ptr + q) * 2 + tip * tile + 2 * ((tlen + 1) // 2) - length
        for s in range(0, tl.max(length, axis=0), BLOCK):
            i = s + i0
            inb = i < length
            in_tile = inb & raw & (i < tlen)
            pv = tl.load(values_ptr + (first + i) * W + q, mask=in_tile & (is_mask == 0) & masked, other=0)
            pv += tl.load(words_ptr + (first + i) * W + q, mask=in_tile & (is_mask == 0) & (masked == 0), other=0)
            pm = tl.load(mask_ptr + first + i, mask=in_tile & is_mask, other=0)
            sc = tl.load(scratch_ptr + src + i, mask=inb & (raw == 0), other=0)
            tl.store(streams_ptr + start + i, tl.where(raw, tl.where(is_mask, pm, pv), sc),
                     mask=inb & (start + i < streams_room))
        last = t == total_tiles - 1
        pad = (16 - end % 16) % 16
        tl.store(streams_ptr + end + i0, tl.zeros([BLOCK], dtype=tl.uint8),
                 mask=last & (i0 < pad) & (end + i0 < streams_room))
        meta = tl.where(i0 == _PLAN_STREAMS, end, tl.load(plan_ptr + i0, mask=i0 < _PLAN_STREAMS, other=0))
        tl.store(meta_ptr + i0, meta, mask=last & (i0 <= _PLAN_STREAMS))
        t0 = ticket(state_ptr)


@triton.jit(do_not_specialize=["zero_len", "coded_planes"])
def _zans_tables_kernel(freqs_ptr, dec_ptr, ok_ptr, sums_ptr, zero_ptr, zero_len, coded_planes):
    """decoder_tables, one plane per program. A slot's symbol is the k-th present one,
    k the number of present symbols whose start c = f[0] + ... + f[s - 1] is at or below
    the slot (starts rise with s): a 1 at each start, summed over the slots, then the
    present symbols listed in order. The table's own row is the scratch for both. The
    programs also zero zero_ptr[:zero_len] between them."""
    q = tl.program_id(0)
    sym = tl.arange(0, 256)
    slots = tl.arange(0, 4096)
    for i in range(q * 4096, zero_len, tl.num_programs(0) * 4096):
        tl.store(zero_ptr + i + slots, tl.zeros([4096], dtype=tl.int64), mask=i + slots < zero_len)
    plane_coded = (coded_planes >> q) & 1
    coded = plane_coded == 1
    # (masks as blocks of equal values: see _zans_pack_kernel's tiles)
    coded_sym, coded_slot = (sym * 0 + plane_coded) == 1, (slots * 0 + plane_coded) == 1
    bits = tl.arange(0, 16)
    row = tl.sum(tl.where(bits < q, (coded_planes >> bits) & 1, 0), axis=0)  # its table among the coded planes'
    f = tl.load(freqs_ptr + row * 256 + sym, mask=coded_sym, other=0).to(tl.int32) & 0xFFFF
    start = tl.cumsum(f, axis=0) - f
    total = tl.sum(f, axis=0)
    present = coded_sym & (f > 0)
    starts_here = present & (start < 4096)
    table = dec_ptr + q * 4096
    tl.store(table + slots, tl.zeros([4096], dtype=tl.int32))
    tl.debug_barrier()
    tl.store(table + start, tl.full([256], 1, dtype=tl.int32), mask=starts_here)
    tl.debug_barrier()
    k = tl.cumsum(tl.load(table + slots), axis=0)  # present symbols starting at or below each slot
    tl.debug_barrier()
    rank = tl.cumsum(present.to(tl.int32), axis=0) - 1
    tl.store(table + rank, start << 8 | sym, mask=starts_here)  # the k-th present symbol and its start
    tl.debug_barrier()
    mark = tl.load(table + k - 1, mask=k > 0, other=0)
    chosen = mark & 255
    fs = tl.load(freqs_ptr + row * 256 + chosen, mask=coded_slot, other=0).to(tl.int32) & 0xFFFF
    entry = chosen | ((fs - 1) & 4095) << 8 | ((slots - (mark >> 8)) & 4095) << 20
    tl.debug_barrier()
    tl.store(table + slots, tl.where(coded, entry, 0))
    tl.store(ok_ptr + q, tl.where(coded, total == 4096, True).to(tl.int32))
    tl.store(sums_ptr + q, tl.where(coded, total, 4096).to(tl.int64))


@triton.jit(do_not_specialize=["symbols", "mask_bytes", "tile", "tiles_per_plane", "total_tiles", "coded_planes",
                               "streams_nbytes"])
def _zans_decode_kernel(s16_ptr, s8_ptr, offsets_ptr, dec_ptr, table_ok_ptr, table_sum_ptr,
                        values_ptr, mask_ptr, status_ptr,
                        symbols, mask_bytes, tile, tiles_per_plane, total_tiles, coded_planes, streams_nbytes,
                        W: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr):
    """Decode every tile of every plane, one tile per warp; raw tiles are copied in the
    same loop. Plane q < W writes byte q of values[j]; the mask plane writes mask[j]."""
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0)
    r = tl.arange(0, ROWS)
    k = tl.arange(0, K)
    for base in range(pid * ROWS, total_tiles, nprog * ROWS):
        t = base + r
        live = t < total_tiles
        is_mask, q, tip, first, tlen = _tile_geometry(t, symbols, mask_bytes, tile, tiles_per_plane, W)
        tlen = tl.where(live, tlen, 0)
        raw_len = tlen + (tlen & 1)
        start = tl.load(offsets_ptr + t, mask=live, other=0)
        end = tl.load(offsets_ptr + t + 1, mask=live, other=0)
        length = end - start
        range_ok = (start >= 0) & (start <= end) & (end <= streams_nbytes) & ((start & 1) == 0) & ((end & 1) == 0)
        plane_coded = ((coded_planes >> q) & 1) == 1
        raw = range_ok & (length == raw_len)
        shape_ok = raw | (range_ok & plane_coded & (length < raw_len) & (length >= 4 * K))
        table_ok = tl.load(table_ok_ptr + q, mask=live, other=1) != 0
        table_sum = tl.load(table_sum_ptr + q, mask=live, other=0)
        code = tl.where(range_ok, tl.where(shape_ok, tl.where(table_ok, 0, 3), 2), 1)
        code = tl.where(live, code, 0)
        pos = tl.where(code == 0, 0, tl.where(range_ok, tl.where(shape_ok, table_sum, length), start))
        good = live & (code == 0)
        is_raw = good & raw
        is_coded = good & (raw == 0)
        nwords = tl.where(is_coded, (length - 4 * K) // 2, 0)
        h0 = start // 2
        lo = tl.load(s16_ptr + h0[:, None] + 2 * k[None, :], mask=is_coded[:, None], other=0)
        hi = tl.load(s16_ptr + h0[:, None] + 2 * k[None, :] + 1, mask=is_coded[:, None], other=0)
        x = lo.to(tl.uint16, bitcast=True).to(tl.uint32) | (hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)
        wbase = h0 + 2 * K
        consumed = tl.zeros([ROWS], dtype=tl.int64)
        overrun = tl.full([ROWS], -1, dtype=tl.int64)
        steps = tl.max(tl.where(live, (tlen + K - 1) // K, 0), axis=0)
        for g in range(0, steps):
            j = g * K + k[None, :]
            act = live[:, None] & (j < tlen[:, None])
            at = first[:, None] + j
            rb = tl.load(s8_ptr + start[:, None] + j, mask=act & is_raw[:, None], other=0)
            cact = act & is_coded[:, None]
            slot = (x & 4095).to(tl.int32)
            d = tl.load(dec_ptr + q[:, None] * 4096 + slot, mask=cact, other=0).to(tl.uint32, bitcast=True)
            xn = ((d >> 8) & 4095) * (x >> 12) + (x >> 12) + (d >> 20)
            need = cact & (xn < 65536)
            ni = need.to(tl.int32)
            p = consumed[:, None] + (tl.cumsum(ni, axis=1) - ni)
            inside = p < nwords[:, None]
            wv = tl.load(s16_ptr + wbase[:, None] + p, mask=need & inside, other=0)
            wv = wv.to(tl.uint16, bitcast=True).to(tl.uint32)
            short = tl.max((need & (inside == 0)).to(tl.int32), axis=1) > 0
            overrun = tl.where((overrun < 0) & short, g, overrun)
            x = tl.where(cact, tl.where(need, (xn << 16) | wv, xn), x)
            consumed += tl.sum(ni, axis=1)
            sym = tl.where(is_raw[:, None], rb.to(tl.int32), tl.where(is_coded[:, None], (d & 255).to(tl.int32), 0))
            sym = sym.to(tl.uint8)
            tl.store(values_ptr + at * W + q[:, None], sym, mask=act & (is_mask[:, None] == 0))
            tl.store(mask_ptr + at, sym, mask=act & is_mask[:, None])
        bad_lane = tl.min(tl.where(is_coded[:, None] & (x != 65536), k[None, :], K), axis=1)
        code = tl.where(is_coded & (overrun >= 0), 4,
                        tl.where(is_coded & (bad_lane < K), 5, tl.where(is_coded & (consumed != nwords), 6, code)))
        pos = tl.where(is_coded & (overrun >= 0), overrun,
                       tl.where(is_coded & (bad_lane < K), bad_lane.to(tl.int64),
                                tl.where(is_coded & (consumed != nwords), nwords - consumed, pos)))
        tl.store(status_ptr + 2 * t, code.to(tl.int64), mask=live)
        tl.store(status_ptr + 2 * t + 1, pos.to(tl.int64), mask=live)
    if pid == 0:  # row TT: the offsets start at 0 and end at the streams' size
        first = tl.load(offsets_ptr)
        last = tl.load(offsets_ptr + total_tiles)
        bad_first, bad_last = first != 0, last != streams_nbytes
        tl.store(status_ptr + 2 * total_tiles, tl.where(bad_first | bad_last, 7, 0).to(tl.int64))  # BAD_ENDS
        tl.store(status_ptr + 2 * total_tiles + 1, tl.where(bad_first, first, tl.where(bad_last, last, 0)))


@triton.jit(do_not_specialize=["out_ptr", "n", "symbols", "num_tiles"])
def _zans_unmask_kernel(mask_ptr, values_ptr, out_ptr, state_ptr, check_ptr, n, symbols, num_tiles,
                        TILE: tl.constexpr, LOOK: tl.constexpr):
    """Masked mode's last step, in one pass: each TILE elements' non-zeros go where the mask
    says, the first of them found by decoupled look-back over the tiles before (state_ptr:
    int64[num_tiles + 1], zero before the launch). Bits at or past n are ignored, no value
    is read at or past `symbols`, and the last tile checks the mask's count: check_ptr is
    the status's row TT, (code, position), set to (MASK_COUNT, bits counted) when they
    differ from `symbols` and the row holds no earlier failure. (Three kernels and a
    prefix sum in the 2026-12-04 measurement: ZVC's decoder, with its offsets counted
    first.)"""
    ROWS: tl.constexpr = TILE // 32
    rows = tl.arange(0, ROWS)
    lane = tl.arange(0, 32)
    offs = _zvc._row_major(ROWS)
    t = ticket(state_ptr)
    while t < num_tiles:
        tile_len = tl.minimum(n - t * TILE, TILE).to(tl.int32)
        inb = offs < tile_len
        m = tl.load(mask_ptr + t * ROWS + rows, mask=rows * 32 < tile_len, other=0).to(tl.uint32, bitcast=True)
        bit = tl.where(inb, ((m[:, None] >> lane[None, :].to(tl.uint32)) & 1).to(tl.int32), 0)
        prefix, total, pos = _zvc._placed(bit, state_ptr, t, LOOK)
        v = tl.load(values_ptr + _zvc._flat(pos, TILE), mask=_zvc._flat((bit != 0) & (pos < symbols), TILE), other=0)
        tl.store(out_ptr + t * TILE + _zvc._flat(offs, TILE), v, mask=_zvc._flat(inb, TILE))
        if t == num_tiles - 1:
            found = prefix + total
            bad = (tl.load(check_ptr) == 0) & (found != symbols)
            tl.store(check_ptr, tl.full([], 8, tl.int64), mask=bad)  # MASK_COUNT
            tl.store(check_ptr + 1, found, mask=bad)
        t = ticket(state_ptr)


# -- launchers ------------------------------------------------------------------------------


def _as_u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _scratch_bases(n: int, tile: int, mode: int, symbols: int, coded_planes: int, itemsize: int
                   ) -> tuple[list[int], int]:
    """Halfword offset of each coded plane's scratch region (its raw_len halfwords per
    tile, back to back) and the scratch halfwords in all: the host's statement of the
    bases the device's plan kernel writes (the tests hold one to the other)."""
    bases, total = [], 0
    for q, length in enumerate(_plane_lengths(n, mode, symbols, itemsize)):
        bases.append(total)
        if (coded_planes >> q) & 1 and length:
            full, last = divmod(length, tile)
            total += full * (tile // 2) + (last + 1) // 2
    return bases, total


def reserve_nbytes(n: int, itemsize: int, tile: int = TILE) -> int:
    """The bytes zans_launch writes into for n words of `itemsize` bytes, whatever its
    plan: the offsets of either mode's tiles, a table for every plane and every tile raw
    (a coded tile is kept only when shorter), aligned as `layout` aligns them."""
    streams = itemsize * (n + 1) + mask_nbytes(n)  # raw planes: a pad byte each after an odd last tile
    return min_room_nbytes(n, itemsize, tile) + _align(streams)


def min_room_nbytes(n: int, itemsize: int, tile: int = TILE) -> int:
    """The least buffer zans_launch takes: room for its largest head (the offsets of
    either mode's tiles and a table for every plane), which it writes before any stream."""
    tiles = itemsize * _cdiv(n, tile) + _cdiv(mask_nbytes(n), tile)
    return _align(8 * (tiles + 1)) + 512 * (itemsize + 1)


def launch_scratch_bytes(n: int, itemsize: int, tile: int = TILE) -> int:
    """At most the device bytes zans_launch allocates beside `reserved` (the cost table
    it keeps per device included)."""
    zvc_tiles = _cdiv(n, _zvc.TILE)
    most_tiles = itemsize * _cdiv(n, tile) + _cdiv(mask_nbytes(n), tile)
    planes = itemsize + 1
    return (8 * (2 + planes * 256) + _align(8 * (zvc_tiles + 1))       # ticket, histograms, look-back states
            + 8 * (most_tiles + 1) + 8 * most_tiles                       # (the compaction's, the pack's); lengths
            + 8 * ((2 * planes - 1) * _ROW.value + _PLAN_WORDS + planes * 256)  # the plan's work and tables
            + mask_nbytes(n) + itemsize * n                              # the compacted mask and non-zeros
            + 2 * ((itemsize * n + mask_nbytes(n)) // 2 + planes)        # the coded streams' scratch
            + 8 * (PROB_SCALE + 1))                                       # cost table


_EST_TABLES: dict = {}


def _est_table(device) -> torch.Tensor:
    """_EST_BITS on `device`, made once per device (the plan kernel's cost per symbol)."""
    key = str(torch.device(device))
    if key not in _EST_TABLES:
        _EST_TABLES[key] = to_device(torch.from_numpy(_EST_BITS), device)
    return _EST_TABLES[key]


def _plan_on_device(hist: torch.Tensor, ticket: torch.Tensor, n: int, itemsize: int, tile: int,
                    code_below: float, head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(plan words int64 [_PLAN_WORDS], encoder tables, magic reciprocals): `plan` in one
    kernel of 2W + 1 programs, which also writes the payload's head into `head`."""
    device = hist.device
    candidates = 2 * itemsize + 1
    rows = candidates * _ROW.value
    work = torch.empty(rows + _PLAN_WORDS + (itemsize + 1) * 256, dtype=torch.int64, device=device)
    plan_words = work[rows: rows + _PLAN_WORDS]
    tables = work[rows + _PLAN_WORDS:].view(torch.int32).view(2, itemsize + 1, 256)
    below = _below(code_below) * (_BYTE_FX // _BELOW_SCALE)
    # 8 warps whatever the config: a thread per symbol of a table, and [256, 8] compares per
    # step of the ranking (95 registers on sm_90, no spill; 4 warps spilled 156 bytes at 32 columns).
    _zans_plan_kernel[(candidates,)](hist, _est_table(device), work, ticket, plan_words, tables[0], tables[1],
                                     head, n, tile, below, W=itemsize, num_warps=8, maxnreg=max_registers(8))
    return plan_words, tables[0], tables[1]


def zans_launch(words: torch.Tensor, reserved: torch.Tensor, config: LaunchConfig | None = None,
                tile: int = TILE, code_below: float = CODE_BELOW, sizes: torch.Tensor | None = None) -> torch.Tensor:
    """Compress 1-D integer `words` with Triton into `reserved` (reserve_nbytes bytes,
    16-byte aligned) without a host sync: the histograms, the plan (mode, coded planes,
    tables: what `plan` chooses on the host) and every size stay on the device, and each
    kernel is launched for the largest geometry, its programs past the plan's returning
    at once. Returns the meta (tile, mode, symbols, coded_planes, streams_nbytes) as int64
    [5] on the device; the payload is the first layout(...)[3] bytes of `reserved`, byte
    for byte what zans_compress_ref writes. `reserved` may be shorter than reserve_nbytes
    (not than min_room_nbytes): then nothing is written past its end, and a payload larger
    than it is incomplete (the caller compares its size, from the meta, with the room).
    `sizes` (int64 [5] on the device): the last kernel writes the meta there too, saving the
    caller a copy."""
    n, itemsize, device = words.numel(), words.element_size(), words.device
    if reserved.numel() < min_room_nbytes(n, itemsize, tile):
        raise ValueError(f"cswap.kernels.zans: a buffer of {reserved.numel()} bytes cannot hold the head of "
                         f"{n} words of {itemsize} bytes ({min_room_nbytes(n, itemsize, tile)} bytes)")
    num_tiles = _cdiv(n, _zvc.TILE)
    planes = itemsize + 1
    most_tiles = itemsize * _cdiv(n, tile) + _cdiv(mask_nbytes(n), tile)  # masked mode with every word non-zero
    # One zeroed buffer: the plan's ticket (and a word of padding, so that every piece is
    # 16-byte aligned and the kernels compile once whatever the size), the histograms, and
    # the look-back states of the compaction and of the pack (tickets and tiles' counts).
    hist_end = 2 + planes * 256
    compact_end = hist_end + _align(8 * (num_tiles + 1)) // 8
    zeroed = torch.zeros(compact_end + most_tiles + 1, dtype=torch.int64, device=device)
    ticket, hist = zeroed[:1], zeroed[2: hist_end]
    compact_state, pack_state = zeroed[hist_end: compact_end], zeroed[compact_end:]
    if num_tiles:
        grid, warps = launch_grid(config, num_tiles, device)
        sub = step_elements(_zvc.TILE, warps, itemsize)
        _zans_histogram_kernel[(grid,)](words, hist, n, num_tiles, W=itemsize, TILE=_zvc.TILE,
                                        SUB=sub, ROUND=_HIST_ROUND, num_warps=warps, maxnreg=max_registers(warps))
    plan_words, enc, magic = _plan_on_device(hist, ticket, n, itemsize, tile, code_below, reserved)
    if n == 0:
        if sizes is not None:
            sizes.copy_(plan_words[:5])
        return plan_words[:5]
    # Masked mode's compaction (the mask words and the non-zeros, in one pass), a launch
    # whose programs return at once in dense mode.
    masks = torch.empty(_cdiv(n, 32), dtype=torch.int32, device=device)
    values = torch.empty(n, dtype=words.dtype, device=device)
    grid, warps = launch_grid(config, num_tiles, device)
    warps = max(warps, _zvc.TILE_MIN_WARPS)  # (a whole tile at once, as ZVC's one-pass encoder)
    _zans_compact_kernel[(grid,)](words, masks, values, compact_state, plan_words, n, num_tiles, TILE=_zvc.TILE,
                                  LOOK=LOOK_BACK, num_warps=warps, maxnreg=max_registers(warps))
    scratch = torch.empty((itemsize * n + mask_nbytes(n)) // 2 + planes, dtype=torch.int16, device=device)
    lens = torch.empty(most_tiles, dtype=torch.int64, device=device)
    words8, values8, masks8 = _as_u8(words), _as_u8(values), _as_u8(masks)
    warps = launch_grid(config, 1, device)[1]  # one warp per tile: a program takes `warps` tiles
    grid = launch_grid(config, _cdiv(most_tiles, warps), device)[0]
    _zans_encode_kernel[(grid,)](words8, values8, masks8, enc, magic, plan_words, scratch, lens, tile, W=itemsize,
                                 K=LANES, ROWS=warps, num_warps=warps, maxnreg=max_registers(warps))
    grid, warps = launch_grid(config, most_tiles, device)
    _zans_pack_kernel[(grid,)](words8, values8, masks8, scratch.view(torch.uint8), plan_words, lens, pack_state,
                               reserved.view(torch.int64), reserved, plan_words if sizes is None else sizes, tile,
                               reserved.numel(), W=itemsize, BLOCK=32 * warps * 4, LOOK=LOOK_BACK,
                               num_warps=warps, maxnreg=max_registers(warps))
    return plan_words[:5]


def zans_compress(words: torch.Tensor, alloc, config: LaunchConfig | None = None, tile: int = TILE,
                  code_below: float = CODE_BELOW) -> tuple[int, int, int, int, int]:
    """Compress 1-D integer `words` with Triton into `alloc(payload_nbytes)`; returns the
    meta (tile, mode, symbols, coded_planes, streams_nbytes). zans_launch, then its
    meta read back (the one host sync) and the payload copied to its exact size."""
    n, itemsize, device = words.numel(), words.element_size(), words.device
    reserved = torch.empty(reserve_nbytes(n, itemsize, tile), dtype=torch.uint8, device=device)
    meta = tuple(zans_launch(words, reserved, config, tile, code_below).tolist())
    payload = alloc(layout(n, *meta[:4], meta[4], itemsize)[3])
    payload.copy_(reserved[: payload.numel()])
    return meta


def zans_launch_ref(words: torch.Tensor, reserved: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """zans_launch in plain PyTorch (the reference encoder into `reserved`; nothing
    written when the payload is larger)."""
    def room(nbytes: int) -> torch.Tensor | None:
        return reserved[:nbytes] if nbytes <= reserved.numel() else None

    meta = zans_compress_ref(words, room, tile)
    return torch.tensor(meta, dtype=torch.int64, device=words.device)


def _global_checks(status: torch.Tensor, offsets: torch.Tensor, streams_nbytes: int) -> None:
    """Row TT: offsets[0] == 0 and offsets[TT] == streams_nbytes (on the device, no sync)."""
    first, last = offsets[0], offsets[-1]
    bad_first, bad_last = first != 0, last != streams_nbytes
    status[-1, 0] = torch.where(bad_first | bad_last, BAD_ENDS, status[-1, 0])
    status[-1, 1] = torch.where(bad_first, first, torch.where(bad_last, last, status[-1, 1]))


def _mask_count_check(status: torch.Tensor, found: torch.Tensor, symbols: int) -> None:
    bad = (status[-1, 0] == 0) & (found != symbols)
    status[-1, 0] = torch.where(bad, MASK_COUNT, status[-1, 0])
    status[-1, 1] = torch.where(bad, found, status[-1, 1])


def zans_decompress(payload: torch.Tensor, n: int, tile: int, mode: int, symbols: int, coded_planes: int,
                    streams_nbytes: int, word_dtype: torch.dtype, config: LaunchConfig | None = None,
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode with Triton (into `out` when given); returns (words, status int64 [TT + 1, 2])."""
    device = payload.device
    itemsize = word_dtype.itemsize
    tv, tm, total_tiles = geometry(n, tile, mode, symbols, itemsize)
    offsets, freqs, streams = sections(payload, n, tile, mode, symbols, coded_planes, streams_nbytes, itemsize)
    out = decoder_output(out, n, word_dtype, device, zero=False)
    status = torch.empty(total_tiles + 1, 2, dtype=torch.int64, device=device)  # the kernel writes every row
    zvc_tiles = _cdiv(n, _zvc.TILE)
    if mode == MASKED:
        masks = torch.empty(_cdiv(n, 32), dtype=torch.int32, device=device)
        values = torch.empty(symbols, dtype=word_dtype, device=device)
        state = torch.empty(zvc_tiles + 1 if n else 0, dtype=torch.int64, device=device)  # (zeroed with the tables)
    else:
        masks = torch.empty(0, dtype=torch.int32, device=device)
        values = out
        state = None
    dec, table_ok, table_sum = decoder_tables(freqs, coded_planes, itemsize, config, zero=state)
    warps = launch_grid(config, 1, device)[1]
    grid = launch_grid(config, _cdiv(total_tiles, warps), device)[0]
    s16 = streams[: streams_nbytes // 2 * 2].view(torch.int16) if streams_nbytes >= 2 else \
        torch.empty(0, dtype=torch.int16, device=device)
    _zans_decode_kernel[(grid,)](s16, streams, offsets, dec, table_ok, table_sum, _as_u8(values), _as_u8(masks),
                                 status, symbols, mask_nbytes(n) if mode == MASKED else 0, tile, tv,
                                 total_tiles, coded_planes, streams_nbytes, W=itemsize, K=LANES, ROWS=warps,
                                 num_warps=warps, maxnreg=max_registers(warps))
    if mode == MASKED and n:
        grid, warps = launch_grid(config, zvc_tiles, device)
        warps = max(warps, _zvc.TILE_MIN_WARPS)  # (a whole tile at once, as ZVC's one-pass encoder)
        _zans_unmask_kernel[(grid,)](masks, values, out, state, status[-1], n, symbols, zvc_tiles, TILE=_zvc.TILE,
                                     LOOK=LOOK_BACK, num_warps=warps, maxnreg=max_registers(warps))
    return out, status


# -- PyTorch reference ------------------------------------------------------------------------


def _count_bytes(b: torch.Tensor) -> torch.Tensor:
    """torch.bincount(b, minlength=256) of uint8 `b`, without bincount's host sync on
    CUDA (it reads b.max() back to size its output)."""
    ones = torch.ones(1, dtype=torch.int64, device=b.device).expand(b.numel())
    return torch.zeros(256, dtype=torch.int64, device=b.device).index_add_(0, b.long(), ones)


def _byte_histograms(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, itemsize = words.numel(), words.element_size()
    planes = words.view(torch.uint8).view(n, itemsize)
    hist = torch.empty(itemsize + 1, 256, dtype=torch.int64, device=words.device)
    for q in range(itemsize):
        hist[q] = _count_bytes(planes[:, q])
    nz = words != 0
    mask8 = _zvc._mask_words(nz).view(torch.uint8) if n else torch.empty(0, dtype=torch.uint8, device=words.device)
    hist[itemsize] = _count_bytes(mask8)
    return hist, nz, mask8


# byte_histograms takes this many elements at a time (a multiple of 32, so every pass
# covers whole mask words): its temporaries stay about ten bytes per element of one pass
# (an int64 index per byte), whatever the tensor (the profiler samples tensors in
# forward, where memory is tightest).
_HIST_CHUNK = 1 << 22


def byte_histograms(words: torch.Tensor) -> torch.Tensor:
    """The encoder's histograms of 1-D integer `words` in PyTorch ops, on their device and
    without a host sync: int64 [W + 1, 256], rows 0..W-1 byte q of every word, row W the
    bytes of the ZVC mask. `predicted_size` turns them into the payload's size."""
    hist = _byte_histograms(words[:_HIST_CHUNK])[0]
    for start in range(_HIST_CHUNK, words.numel(), _HIST_CHUNK):
        hist += _byte_histograms(words[start: start + _HIST_CHUNK])[0]
    return hist


def _hist_ref(words: torch.Tensor) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """Histograms [W + 1, 256] as `_histogram`, with the non-zero flags and mask bytes."""
    hist, nz, mask8 = _byte_histograms(words)
    return hist.cpu().numpy(), nz, mask8


def _plane_tiles(plane: torch.Tensor, tile: int, width: int) -> torch.Tensor:
    """A plane's bytes as [tiles, width] (tile symbols a row, zero padded to width >= them)."""
    tiles = _cdiv(plane.numel(), tile)
    padded = torch.zeros(tiles, width, dtype=torch.uint8, device=plane.device)
    if tiles > 1:
        padded[:-1, :tile] = plane[: (tiles - 1) * tile].view(tiles - 1, tile)
    if tiles:
        last = plane[(tiles - 1) * tile:]
        padded[-1, : last.numel()] = last
    return padded


# The reference's rANS loops take at most _REF_ROWS tiles at a time: 1023 x 32 states
# stay under ATen's grain size (32768 elements), so each step's ops run serially. On a
# small machine an OpenMP parallel region per op costs more than the op (measured on a
# 2-core VM: 12 ms per parallel torch op with the default OMP_WAIT_POLICY, against
# microseconds for the op), and the loops run ~10 ops per step. The encoder takes
# _ENC_ROWS at a time (its per-symbol tables cost 24 bytes a symbol).
_REF_ROWS = 1023
_ENC_ROWS = 256


def _rans_encode_ref(syms: torch.Tensor, lens: torch.Tensor, freqs: torch.Tensor, cums: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode tiles (syms uint8 [R, S * K], lens int64 [R], per-tile tables int64 [R, 256])
    in lock step, steps in reverse; returns the final states int64 [R, K], the words
    int16 [R, S, K] (x & 0xFFFF at each step) and the emit flags bool [R, S, K]."""
    rows, width = syms.shape
    steps = width // LANES
    device = syms.device
    states = torch.empty(rows, LANES, dtype=torch.int64, device=device)
    words = torch.empty(rows, steps, LANES, dtype=torch.int16, device=device)
    emits = torch.empty(rows, steps, LANES, dtype=torch.bool, device=device)
    for lo in range(0, rows, _ENC_ROWS):
        hi = min(lo + _ENC_ROWS, rows)
        s = syms[lo:hi].to(torch.int64)
        # Past a tile's end f = M, c = 0: x // M * M + x % M = x and x >> 20 < M, so those
        # lanes neither change nor emit and the loop needs no activity mask.
        pad = torch.arange(width, device=device) >= lens[lo:hi, None]
        f = torch.where(pad, PROB_SCALE, freqs[lo:hi].gather(1, s)).view(hi - lo, steps, LANES)
        c = torch.where(pad, 0, cums[lo:hi].gather(1, s)).view(hi - lo, steps, LANES)
        mf = PROB_SCALE - f
        wd = torch.empty(hi - lo, steps, LANES, dtype=torch.int32, device=device)
        em = emits[lo:hi]
        x = torch.full((hi - lo, LANES), STATE_LOW, dtype=torch.int64, device=device)
        for g in range(steps - 1, -1, -1):
            fg = f[:, g]
            e = (x >> 20) >= fg
            em[:, g] = e
            wd[:, g] = x & 0xFFFF
            x = torch.where(e, x >> 16, x)
            x = x + c[:, g] + torch.div(x, fg, rounding_mode="floor") * mf[:, g]
        words[lo:hi] = _to_int16(wd)
        states[lo:hi] = x
    return states, words, emits


def zans_compress_ref(words: torch.Tensor, alloc, tile: int = TILE, code_below: float = CODE_BELOW
                      ) -> tuple[int, int, int, int, int]:
    """Reference encoder in plain PyTorch; writes the same bytes as `zans_compress`."""
    n, itemsize, device = words.numel(), words.element_size(), words.device
    hist, nz, mask8 = _hist_ref(words)
    p = plan(hist, n, itemsize, tile, code_below)
    total_tiles = geometry(n, tile, p.mode, p.symbols, itemsize)[2]
    if p.mode == MASKED:
        values = words[nz]
        planes = [values.view(torch.uint8).view(-1, itemsize)[:, q] for q in range(itemsize)]
        planes.append(mask8)
    else:
        planes = [words.view(torch.uint8).view(-1, itemsize)[:, q] for q in range(itemsize)]
        planes.append(torch.empty(0, dtype=torch.uint8, device=device))
    coded = [bool((p.coded_planes >> q) & 1) and plane.numel() > 0 for q, plane in enumerate(planes)]
    # Every tile's length; the coded planes' tiles encoded together (one loop over steps).
    plane_lens, coded_rows = [], []
    width = _cdiv(min(tile, max(plane.numel() for plane in planes)), LANES) * LANES
    for q, plane in enumerate(planes):
        count = _cdiv(plane.numel(), tile)
        lens_q = torch.full((count,), tile, dtype=torch.int64, device=device)
        if count:
            lens_q[-1] = plane.numel() - (count - 1) * tile
        plane_lens.append(lens_q)
        if coded[q]:
            coded_rows.append((q, _plane_tiles(plane, tile, width), lens_q))
    encoded = {}
    if coded_rows:
        f = torch.from_numpy(p.freqs).to(device)
        row_plane = torch.cat([torch.full((len(lq),), q, dtype=torch.int64, device=device)
                               for q, _, lq in coded_rows])
        states, wds, emits = _rans_encode_ref(torch.cat([t for _, t, _ in coded_rows]),
                                              torch.cat([lq for _, _, lq in coded_rows]), f[row_plane],
                                              (torch.cumsum(f, 1) - f)[row_plane])
        r0 = 0
        for q, _, lens_q in coded_rows:
            r1 = r0 + lens_q.numel()
            emitted = emits[r0:r1].sum((1, 2))
            keep = 2 * LANES + emitted < (lens_q + 1) // 2  # else the tile is stored raw
            encoded[q] = (states[r0:r1], wds[r0:r1], emits[r0:r1], keep, emitted)
            r0 = r1
    tile_lens = []
    for q, lens_q in enumerate(plane_lens):
        raw_q = lens_q + (lens_q & 1)
        if q in encoded:
            keep, emitted = encoded[q][3], encoded[q][4]
            raw_q = torch.where(keep, 2 * (2 * LANES + emitted), raw_q)
        tile_lens.append(raw_q)
    lens = torch.cat(tile_lens) if tile_lens else torch.zeros(0, dtype=torch.int64, device=device)
    offsets = torch.zeros(total_tiles + 1, dtype=torch.int64, device=device)
    torch.cumsum(lens, 0, out=offsets[1:])
    streams_nbytes = int(offsets[-1])
    payload = alloc(layout(n, tile, p.mode, p.symbols, p.coded_planes, streams_nbytes, itemsize)[3])
    if payload is None:  # (zans_launch_ref's room is too small for it)
        return tile, p.mode, p.symbols, p.coded_planes, streams_nbytes
    payload.zero_()
    out_offsets, out_freqs, streams = sections(payload, n, tile, p.mode, p.symbols, p.coded_planes,
                                               streams_nbytes, itemsize)
    out_offsets.copy_(offsets)
    out_freqs.copy_(to_device(torch.from_numpy(_freqs_int16(p.freqs, p.coded_planes)), device))
    s16 = streams.view(torch.int16) if streams_nbytes else None
    offs = offsets.tolist()
    t0 = 0
    for q, plane in enumerate(planes):
        count = _cdiv(plane.numel(), tile)
        keep = encoded[q][3].tolist() if coded[q] else [False] * count
        a = 0
        while a < count:  # runs of coded or raw tiles: each run's streams are contiguous
            b = a + 1
            while b < count and keep[b] == keep[a]:
                b += 1
            start = offs[t0 + a]
            if keep[a]:
                states, wds, emits = encoded[q][:3]
                halves = torch.stack([states[a:b] & 0xFFFF, states[a:b] >> 16], 2).view(b - a, 2 * LANES)
                body = torch.cat([_to_int16(halves), wds[a:b].view(b - a, -1)], 1)
                take = torch.cat([torch.ones(b - a, 2 * LANES, dtype=torch.bool, device=device),
                                  emits[a:b].view(b - a, -1)], 1)
                data = body[take]
                s16[start // 2: start // 2 + data.numel()] = data
            else:
                chunk = plane[a * tile: b * tile]
                streams[start: start + chunk.numel()] = chunk  # a pad byte after an odd last tile stays 0
            a = b
        t0 += count
    return tile, p.mode, p.symbols, p.coded_planes, streams_nbytes


def _to_int16(v: torch.Tensor) -> torch.Tensor:
    """Values in [0, 65536) as the int16 with the same bits."""
    return ((v ^ 0x8000) - 0x8000).to(torch.int16)


def _rans_decode_ref(rows: torch.Tensor, streams: torch.Tensor, start: torch.Tensor, length: torch.Tensor,
                     q: torch.Tensor, tlen: torch.Tensor, dec: torch.Tensor, syms: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode the coded tiles `rows` in lock step into syms[rows]; returns their (code, pos)."""
    codes, positions = [], []
    for lo in range(0, rows.numel(), _REF_ROWS):
        part = rows[lo: lo + _REF_ROWS]
        code, pos, out = _rans_decode_rows(streams, start[part], length[part], q[part], tlen[part], dec)
        syms.index_copy_(0, part, torch.nn.functional.pad(out, (0, syms.shape[1] - out.shape[1])))
        codes.append(code)
        positions.append(pos)
    return torch.cat(codes), torch.cat(positions)


def _rans_decode_rows(streams: torch.Tensor, start: torch.Tensor, length: torch.Tensor, q: torch.Tensor,
                      tlen: torch.Tensor, dec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    device = streams.device
    s16 = (streams[: streams.numel() // 2 * 2].view(torch.int16).to(torch.int32) & 0xFFFF)
    last = s16.numel() - 1  # >= 2 K - 1: a coded tile holds its 4 K bytes of states
    rows = start.numel()
    lanes = torch.arange(LANES, device=device)
    h0 = start // 2

    def take(index):  # gather: far cheaper than advanced indexing on CPU
        return s16.gather(0, index.reshape(-1)).view(index.shape).to(torch.int64)

    x = take(h0[:, None] + 2 * lanes) | take(h0[:, None] + 2 * lanes + 1) << 16
    nwords = (length - 4 * LANES)[:, None] // 2
    wbase = h0[:, None] + 2 * LANES
    consumed = torch.zeros(rows, 1, dtype=torch.int64, device=device)
    overrun = torch.full((rows,), -1, dtype=torch.int64, device=device)
    table = dec.view(-1).to(torch.int64) & 0xFFFFFFFF
    sym_table, f_table, bias_table = table & 255, ((table >> 8) & 4095) + 1, table >> 20
    qbase = q[:, None] * PROB_SCALE
    lens = tlen[:, None]
    steps = _cdiv(int(tlen.max()), LANES)
    out = torch.zeros(rows, steps, LANES, dtype=torch.uint8, device=device)
    for g in range(steps):
        act = (g * LANES + lanes) < lens
        slot = (qbase + (x & 4095)).view(-1)
        xn = (f_table.gather(0, slot).view(x.shape) * (x >> 12) + bias_table.gather(0, slot).view(x.shape)) \
            & 0xFFFFFFFF
        need = act & (xn < STATE_LOW)
        ni = need.to(torch.int64)
        p = consumed + torch.cumsum(ni, 1) - ni
        read = need & (p < nwords)
        wv = torch.where(read, take(torch.where(read, wbase + p, 0).clamp_(max=last)), 0)
        overrun = torch.where((overrun < 0) & (need & ~read).any(1), g, overrun)
        x = torch.where(act, torch.where(need, (xn << 16 | wv) & 0xFFFFFFFF, xn), x)
        consumed += ni.sum(1, keepdim=True)
        out[:, g] = torch.where(act, sym_table.gather(0, slot).view(x.shape), 0)
    consumed, nwords = consumed[:, 0], nwords[:, 0]
    bad_lane = torch.where(x != STATE_LOW, lanes, LANES).min(1).values
    trailing = consumed != nwords
    code = torch.where(overrun >= 0, OVERRUN, torch.where(bad_lane < LANES, BAD_STATE,
                                                          torch.where(trailing, TRAILING_WORDS, OK)))
    pos = torch.where(overrun >= 0, overrun, torch.where(bad_lane < LANES, bad_lane,
                                                         torch.where(trailing, nwords - consumed, 0)))
    return code, pos, out.view(rows, -1)


def _tile_table(n: int, tile: int, mode: int, symbols: int, itemsize: int, device) -> tuple[torch.Tensor, ...]:
    """Per global tile: plane q, first symbol, length (int64 tensors)."""
    tv, tm, total = geometry(n, tile, mode, symbols, itemsize)
    t = torch.arange(total, dtype=torch.int64, device=device)
    vt = itemsize * tv
    is_mask = t >= vt
    q = torch.where(is_mask, itemsize, t // max(tv, 1))
    tip = torch.where(is_mask, t - vt, t % max(tv, 1))
    plane_len = torch.where(is_mask, mask_nbytes(n) if mode == MASKED else 0, symbols)
    first = tip * tile
    return q, first, torch.minimum(plane_len - first, torch.full_like(first, tile))


def zans_decompress_ref(payload: torch.Tensor, n: int, tile: int, mode: int, symbols: int, coded_planes: int,
                        streams_nbytes: int, word_dtype: torch.dtype, out: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference decoder; returns (words, status) like `zans_decompress`, same codes and positions."""
    device = payload.device
    itemsize = word_dtype.itemsize
    tv, tm, total_tiles = geometry(n, tile, mode, symbols, itemsize)
    offsets, freqs, streams = sections(payload, n, tile, mode, symbols, coded_planes, streams_nbytes, itemsize)
    dec, table_ok, table_sum = decoder_tables_ref(freqs, coded_planes, itemsize)
    status = torch.zeros(total_tiles + 1, 2, dtype=torch.int64, device=device)
    q, first, tlen = _tile_table(n, tile, mode, symbols, itemsize, device)
    raw_len = tlen + (tlen & 1)
    start, end = offsets[:-1], offsets[1:]
    length = end - start
    range_ok = (start >= 0) & (start <= end) & (end <= streams_nbytes) & (start % 2 == 0) & (end % 2 == 0)
    plane_coded = ((coded_planes >> q) & 1) == 1
    raw = range_ok & (length == raw_len)
    shape_ok = raw | (range_ok & plane_coded & (length < raw_len) & (length >= 4 * LANES))
    t_ok = table_ok[q] != 0
    code = torch.where(range_ok, torch.where(shape_ok, torch.where(t_ok, 0, BAD_FREQUENCIES), BAD_LENGTH),
                       BAD_OFFSETS)
    pos = torch.where(code == 0, 0, torch.where(range_ok, torch.where(shape_ok, table_sum[q], length), start))
    good = code == 0
    is_raw, is_coded = good & raw, good & ~raw
    longest = min(tile, max(_plane_lengths(n, mode, symbols, itemsize)))  # a small tensor's tiles are short
    syms = torch.zeros(total_tiles, _cdiv(longest, LANES) * LANES, dtype=torch.uint8, device=device)
    j = torch.arange(syms.shape[1], device=device)
    # Raw tiles: byte copies from the stream (in chunks of rows: int64 indices cost 8x).
    raw_rows = is_raw.nonzero()[:, 0]
    for lo in range(0, raw_rows.numel(), 64):
        rr = raw_rows[lo: lo + 64]
        valid = j[None, :] < tlen[rr][:, None]
        idx = torch.where(valid, start[rr][:, None] + j[None, :], 0)
        syms.index_copy_(0, rr, torch.where(valid, streams.gather(0, idx.view(-1)).view(idx.shape), 0))
    coded_rows = is_coded.nonzero()[:, 0]
    if coded_rows.numel():
        code_c, pos_c = _rans_decode_ref(coded_rows, streams, start, length, q, tlen, dec, syms)
        code[coded_rows], pos[coded_rows] = code_c, pos_c
    status[:-1, 0], status[:-1, 1] = code, pos
    _global_checks(status, offsets, streams_nbytes)
    # Scatter the planes.
    out = decoder_output(out, n, word_dtype, device, zero=True)
    values = torch.zeros(symbols, dtype=word_dtype, device=device) if mode == MASKED else out
    v8 = values.view(torch.uint8).view(-1, itemsize) if symbols else None
    t0 = 0
    for plane in range(itemsize):
        if tv:
            v8[:, plane] = syms[t0: t0 + tv].reshape(-1)[:symbols]
        t0 += tv
    if mode == MASKED and n:
        mask8 = syms[t0: t0 + tm].reshape(-1)[: mask_nbytes(n)]
        nz = _zvc._mask_bits(mask8.view(torch.int32), n)
        found = nz.sum()
        _mask_count_check(status, found, symbols)
        if int(found) == symbols:
            out[nz] = values
    return out, status
