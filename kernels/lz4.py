"""LZ4: the input cut into 64 KiB chunks, each one standard LZ4 block.

Payload format (little-endian; each section starts 16-byte aligned):

    offset  size            field
    0       8 * (C + 1)     block_offsets int64[C + 1]: byte offset of block c inside the
                            blocks section, i.e. the exclusive prefix sum of the block sizes
                            (entry 0 = 0, entry C = blocks_nbytes). C = ceil(nbytes / chunk).
    A       blocks_nbytes   the blocks, concatenated; A = align16(8 * (C + 1)).

The payload is exactly A + blocks_nbytes bytes; the padding before A is zero.
Chunk c holds the input bytes [c * chunk, min((c + 1) * chunk, nbytes)) of the
tensor's integer view; `chunk` (CHUNK = 16384 when we write it; any size up to
65536 decodes), C and blocks_nbytes are the header meta fields.

Each block is the public LZ4 block format (lz4/doc/lz4_Block_format.md),
readable by `lz4.block.decompress(block, uncompressed_size=n)`, and every
block that `lz4.block.compress(data, store_size=False)` writes decodes here.
A block is a list of sequences; one sequence is, byte by byte:

    1 byte      token: high nibble = literal length L (15 = "15 or more"),
                low nibble = match length M - 4 (15 = "19 or more")
    k bytes     if L >= 15: k = (L - 15) // 255 + 1 extension bytes, k - 1 of them
                255 and the last (L - 15) % 255; L is their sum plus 15
    L bytes     the literals, copied to the output as they are
    2 bytes     match offset (1..65535): the match copies from `offset` bytes back in
                the output; offset < M is an overlapping copy (a run)
    k bytes     if M - 4 >= 15: extension bytes of M - 4, as for L

The last sequence stops after its literals (no offset, no match). Our encoder
also keeps LZ4's end-of-block rules: the last 5 bytes are literals and the last
match starts at least 12 bytes before the end of the chunk.

Encoder: one warp per chunk, one pass, one kernel, no host sync (lz4_launch). Warps
take chunks by ticket, write each block into their own staging room, then place it by
decoupled look-back over the blocks' sizes (cswap.kernels.lookback) and copy it to its
place; the payload is written into room for the largest (reserve_nbytes), and its size
stays on the device. It is LZ4's greedy parse with a wider search, a tile of ENCODE_TILE
positions (one per lane) at a time:

1. Candidates. For every position i where a match may start (i <= n - 12), two
   candidates: the latest position with the same hash of the 4 bytes at i, and the
   latest with the same hash of the 8 bytes at i, each in an earlier tile of
   TABLE_TILE (32) positions (hashes: LZ4's multiplicative hash, HASH_MUL, top
   hash_bits bits; one table per hash of 4096 entries at 16 KiB chunks: a tile reads
   both before entering them, with atomic_max, so the latest position wins whatever
   the lanes' order; entries carry the chunk's tag, so tables are cleared once per
   32767 chunks a warp encodes, not per chunk). Repeats nearer than a tile are found
   by the nearest of the NEAR (4) positions before i whose 4 bytes equal those at i,
   which replaces the 4-byte candidate where there is one. A candidate counts only if
   its first 4 bytes equal those at i (a collision loses a match, never corrupts one);
   it is kept as an offset (0: none). Each lane reads its position's 4 bytes, the 4
   after and the 4 before from the four aligned words they span (byte by byte where
   the input is not 4-byte aligned), a tile ahead of the one it works on.
2. The walk, sequential per chunk as LZ4 is, through the tile's candidates: the first
   position from where the walk stands with a candidate starts a match; both
   candidates' matches are measured byte for byte (a warp's 32 bytes per step, up to
   the last 5 bytes) and the longer is taken (the 4-byte one on a tie); the sequence
   is written and the walk resumes after the match (in this tile or a later one).

The latest 4-byte match is what LZ4's table gives; the 8-byte one finds the
longer repeats a nearer 4-byte copy hides (rows or tiles repeated at a longer
period). Both backends find the same candidates and the same parse, so they
write the same bytes; the PyTorch reference gets the table's candidates by
sorting (hash, position) and searching it for each tile's start, every
position's match length from chains of equal offsets, then the parse by pointer
doubling. On real activations (small_cnn,
VGG16, ResNet-18 ReLU and pooling outputs) the blocks are within 1% of the
`lz4` package's default (LZ4_compress_default) on the same bytes.

Decoder: one chunk per warp, so a program of W warps decodes W chunks at once.
Each chunk's sequences are walked in order as LZ4 requires, all the program's
chunks together one sequence per round; within a sequence the warp's lanes copy
4 bytes each per step (literals, then the match: it reads
out[p - offset + (j % offset)], only bytes written before the match, so
overlapping matches copy in one pass after one barrier per round). Length
extensions are read 32 bytes per step. Every read stays inside the block, every
write inside the chunk's output, and every sequence consumes at least one
input byte, so no payload can make it read or write out of bounds or hang. A
per-chunk status (error code, byte position) reports the first problem; the
PyTorch reference decoder reports the same codes and positions. It rejects
offset 0, offsets before the chunk, lengths past the input or the chunk, a
block that ends after a match, and a decoded size other than the chunk's; like
many decoders it does not enforce the last-5-literals / 12-byte rules. The kernel
also checks each chunk's block offsets (a range inside the blocks section, the first
at 0, the last at its end) and does not decode a chunk whose offsets are not: one
kernel, its output not zeroed first (a chunk that fails leaves the rest of its bytes
as they were, and its status makes the call raise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import LaunchConfig, decoder_output, default_config, interpreting, launch_grid, max_registers
from .lookback import LOOK_BACK, exclusive_prefix, ticket

__all__ = [
    "CHUNK", "MAX_BLOCK_INPUT", "MAX_ENCODE_PROGRAMS", "check_chunk", "hash_bits", "OK", "TRUNCATED", "OFFSET_ZERO",
    "OFFSET_BEFORE_START", "OVERFLOW", "ENDS_WITH_MATCH", "SHORT", "BAD_OFFSETS", "layout", "block_bound", "sections",
    "reserve_nbytes", "encode_programs", "launch_scratch_bytes", "encode_scratch_bytes_per_program",
    "lz4_launch", "lz4_compress", "lz4_decompress", "lz4_launch_ref", "lz4_compress_ref", "lz4_decompress_ref",
]

# MAX_BLOCK_INPUT = 65536: the largest input whose every byte a 16-bit LZ4 offset
# (<= 65535) can reach, so chunks are independent and a chunk is one LZ4 block.
# CHUNK = 16384, what we write: one chunk is one warp's work when encoding and
# decoding, and 16 KiB chunks give a tensor 4x the warps of 64 KiB ones (an 8 MB
# tensor 512, about four per H100 SM) for about 1.4% more bytes
# (small_cnn's activations on digits: ratio 1.882 at 16 KiB, 1.909 at 64 KiB;
# benchmarks/lz4_chunks.py measures it on more models).
MAX_BLOCK_INPUT = 65536
CHUNK = 16384
# LZ4's own rules and names (lz4/lib/lz4.c): a match is at least MINMATCH bytes, the
# last match starts at least MFLIMIT bytes before the end of the block, and the last
# LASTLITERALS bytes are literals.
MINMATCH = 4
MFLIMIT = 12
LASTLITERALS = 5
# Knuth's multiplicative hash, LZ4's own (2654435761 = 2**32 / golden ratio).
HASH_MUL = 0x9E3779B1


def hash_bits(chunk: int) -> int:
    """Bits of the encoder's hash tables: one entry per four positions (12 bits, 4096
    entries, at 16 KiB chunks, as many as LZ4's default table has for 64 KiB)."""
    return chunk.bit_length() - 3


# The tables answer for earlier tiles of TABLE_TILE positions: a tile is looked up
# before any of it enters them (a warp's 32 lanes at once). Nearer repeats are found
# by NEAR: each position also tries the NEAR positions before it, nearest first.
TABLE_TILE = 32
NEAR = 4


# The encoder is one warp per chunk. ENCODE_TILE positions (one per lane) are hashed,
# looked up and entered in the tables per round, and the parse walks through them before
# the next round; the match-length and copy steps take the warp's lanes (a byte each).
# The interpreter pays per operation, not per element: one wide step.
ENCODE_TILE = 32
ENCODE_TILE_INTERPRETED = 256
# Chunks in flight at once (one warp each), whatever grid is asked for: each holds its
# scratch (encode_scratch_bytes_per_program: 80.1 KiB at 16 KiB chunks, so 160 MiB at the
# cap; 2048 is about 15 warps per H100 SM).
MAX_ENCODE_PROGRAMS = 2048


def encode_tile(interpreted: bool | None = None) -> int:
    """Positions the encoder hashes per round (and lanes its walk steps with)."""
    return ENCODE_TILE_INTERPRETED if (interpreting() if interpreted is None else interpreted) else ENCODE_TILE


# DECODE_BYTES_PER_LANE = 4: a warp copies 128 bytes of literals or match per step.
DECODE_BYTES_PER_LANE = 4
_ALIGN = 16

# Per-chunk decoder status codes (status[c] = (code, byte position)).
OK = 0
TRUNCATED = 1            # the block ends inside a sequence (position: that sequence/field)
OFFSET_ZERO = 2          # a match offset of 0 (position: the offset field)
OFFSET_BEFORE_START = 3  # a match offset reaching before the chunk's first byte
OVERFLOW = 4             # literals or a match run past the end of the chunk
ENDS_WITH_MATCH = 5      # the block ends right after a match, not with literals
SHORT = 6                # the block ends before the chunk is full (position: bytes decoded)
BAD_OFFSETS = 7          # block_offsets[c], [c + 1] are not a range inside the blocks section

_TRUNCATED = tl.constexpr(TRUNCATED)
_OFFSET_ZERO = tl.constexpr(OFFSET_ZERO)
_OFFSET_BEFORE_START = tl.constexpr(OFFSET_BEFORE_START)
_OVERFLOW = tl.constexpr(OVERFLOW)
_ENDS_WITH_MATCH = tl.constexpr(ENDS_WITH_MATCH)
_SHORT = tl.constexpr(SHORT)
_BAD_OFFSETS = tl.constexpr(BAD_OFFSETS)
_MINMATCH = tl.constexpr(MINMATCH)
_MFLIMIT = tl.constexpr(MFLIMIT)
_LASTLITERALS = tl.constexpr(LASTLITERALS)
_TABLE_TILE = tl.constexpr(TABLE_TILE)


def check_chunk(chunk: int) -> None:
    """The encoders' chunk: a power of two from 1 KiB to 64 KiB (any block size up to
    64 KiB is standard LZ4; a power of two sizes the hash table)."""
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not 1024 <= chunk <= MAX_BLOCK_INPUT \
            or chunk & (chunk - 1):
        raise ValueError(f"cswap.kernels.lz4: chunk must be a power of two in [1024, {MAX_BLOCK_INPUT}], "
                         f"got {chunk!r}")


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def layout(num_chunks: int, blocks_nbytes: int) -> tuple[int, int]:
    """(byte offset of the blocks section, payload size)."""
    off_blocks = _align(8 * (num_chunks + 1))
    return off_blocks, off_blocks + blocks_nbytes


def block_bound(n: int) -> int:
    """LZ4_compressBound: the largest valid LZ4 block for n input bytes."""
    return n + n // 255 + 16


def sections(payload: torch.Tensor, num_chunks: int, blocks_nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_offsets int64[C + 1], blocks uint8) views of a payload."""
    off_blocks, total = layout(num_chunks, blocks_nbytes)
    return payload[: 8 * (num_chunks + 1)].view(torch.int64), payload[off_blocks:total]


def reserve_nbytes(nbytes: int, chunk: int = CHUNK) -> int:
    """The bytes lz4_launch writes into: the largest payload of `nbytes` input bytes
    (every block at LZ4's bound)."""
    num_chunks = -(-nbytes // chunk)
    return layout(num_chunks, num_chunks * block_bound(chunk))[1]


def _staging_bytes(chunk: int) -> int:
    return _align(block_bound(chunk))


def encode_scratch_bytes_per_program(chunk: int = CHUNK) -> int:
    """One encoder warp's scratch: its two hash tables (64-bit entries) and the room
    its block is written in before its place in the payload is known."""
    return 2 * 8 * (1 << hash_bits(chunk)) + _staging_bytes(chunk)


def encode_programs(num_chunks: int, config: LaunchConfig | None, device: torch.device) -> int:
    """Encoder warps launched: one per chunk, up to the config's threads (grid x block
    / 32 warps) and MAX_ENCODE_PROGRAMS."""
    config = config or default_config(device)
    return max(1, min(num_chunks, config.grid * config.num_warps, MAX_ENCODE_PROGRAMS))


def launch_scratch_bytes(nbytes: int, chunk: int = CHUNK) -> int:
    """At most the device bytes lz4_launch allocates beside `reserved`, whatever the config:
    each warp's scratch and the chunks' look-back states."""
    num_chunks = -(-nbytes // chunk)
    if not num_chunks:
        return 0
    return min(num_chunks, MAX_ENCODE_PROGRAMS) * encode_scratch_bytes_per_program(chunk) + 8 * (num_chunks + 1)


# -- Triton: encoder -------------------------------------------------------------------


@triton.jit
def _word(src, i, mask):
    """The 4 bytes at src + i as a little-endian uint32 (bytes are loaded one by one:
    positions have any alignment)."""
    w = tl.load(src + i, mask=mask, other=0).to(tl.uint32)
    w |= tl.load(src + i + 1, mask=mask, other=0).to(tl.uint32) << 8
    w |= tl.load(src + i + 2, mask=mask, other=0).to(tl.uint32) << 16
    return w | (tl.load(src + i + 3, mask=mask, other=0).to(tl.uint32) << 24)


@triton.jit
def _word_before(src, i, mask):
    """The 4 bytes before src + i (those before the chunk's start read as 0)."""
    w = tl.load(src + i - 4, mask=mask & (i >= 4), other=0).to(tl.uint32)
    w |= tl.load(src + i - 3, mask=mask & (i >= 3), other=0).to(tl.uint32) << 8
    w |= tl.load(src + i - 2, mask=mask & (i >= 2), other=0).to(tl.uint32) << 16
    return w | (tl.load(src + i - 1, mask=mask & (i >= 1), other=0).to(tl.uint32) << 24)


@triton.jit
def _funnel(a, b, shift):
    """The 4 bytes `shift` / 8 bytes into the 8 bytes a, b (uint32 words, little-endian)."""
    return (a >> shift) | ((b << (31 - shift)) << 1)  # (shift 0: b's part shifts out in two steps)


@triton.jit
def _word_at(src, i, mask, ALIGNED: tl.constexpr):
    """_word, from the two aligned words it spans where the input is 4-byte aligned."""
    if ALIGNED:
        words = src.to(tl.pointer_type(tl.uint32))
        q = i >> 2
        shift = ((i & 3) * 8).to(tl.uint32)
        return _funnel(tl.load(words + q, mask=mask, other=0), tl.load(words + q + 1, mask=mask, other=0), shift)
    else:
        return _word(src, i, mask)


@triton.jit
def _words(src, i, mask, ALIGNED: tl.constexpr):
    """(the 4 bytes at i, the 4 after them, the 4 before them) as _word and _word_before
    read them; where the input is 4-byte aligned, from the 4 aligned words they span."""
    if ALIGNED:
        words = src.to(tl.pointer_type(tl.uint32))
        q = i >> 2
        shift = ((i & 3) * 8).to(tl.uint32)
        w0 = tl.load(words + q - 1, mask=mask & (q >= 1), other=0)
        w1 = tl.load(words + q, mask=mask, other=0)
        w2 = tl.load(words + q + 1, mask=mask, other=0)
        w3 = tl.load(words + q + 2, mask=mask, other=0)
        return _funnel(w1, w2, shift), _funnel(w2, w3, shift), _funnel(w0, w1, shift)
    else:
        return _word(src, i, mask), _word(src, i + 4, mask), _word_before(src, i, mask)


@triton.jit
def _in_round(h, HT: tl.constexpr):
    """Per lane of a round wider than a table tile (the interpreter's): the latest lane
    with its hash in an earlier table tile of the round (-1: none), which a GPU's
    round, one table tile, finds in the table."""
    lane = tl.arange(0, HT)
    earlier = (lane[None, :] // _TABLE_TILE) < (lane[:, None] // _TABLE_TILE)
    return tl.max(tl.where((h[:, None] == h[None, :]) & earlier, lane[None, :], -1), axis=1)


@triton.jit
def _checked(cand, i, live, v, src, ALIGNED: tl.constexpr):
    """Offset i - cand where position cand's 4 bytes equal v (0: none, or cand < 0)."""
    ok = live & (cand >= 0)
    return tl.where(ok & (_word_at(src, cand, ok, ALIGNED) == v), i - cand, 0)


@triton.jit
def _tile_candidates(t4, t8, h4, h8, i, live, lo, before, src, t0, tag, HT: tl.constexpr,
                     ALIGNED: tl.constexpr):
    """The candidates' offsets (0: none) for a round of HT positions i = t0 + [0, HT)
    whose 4 bytes are lo and the 4 before them `before`; then the round enters the tables.

    A table entry is (tag << 16 | position + 1) << 32 | the position's 4 bytes: an entry
    of another tag is an earlier chunk's (none), and a candidate is checked against the
    bytes it carries, with no load of them. Both tables are read (from L2: atomics write
    there) before either is written, and written with atomic_max, so each entry ends at
    the latest position of its hash whatever the order of the lanes. The 4-byte
    candidate is the nearest of the NEAR positions before i whose bytes equal lo, where
    there is one."""
    e4 = tl.load(t4 + h4, mask=live, other=0, cache_modifier=".cg")
    e8 = tl.load(t8 + h8, mask=live, other=0, cache_modifier=".cg")
    k4 = (e4 >> 32).to(tl.int32)
    k8 = (e8 >> 32).to(tl.int32)
    c4 = (k4 & 0xFFFF) - 1
    c8 = (k8 & 0xFFFF) - 1
    d4 = tl.where(live & ((k4 >> 16) == tag) & (e4.to(tl.uint32) == lo), i - c4, 0)
    d8 = tl.where(live & ((k8 >> 16) == tag) & (e8.to(tl.uint32) == lo), i - c8, 0)
    if HT > _TABLE_TILE:  # (the interpreter's wide round: a candidate in it is checked by a load)
        in4 = _in_round(tl.where(live, h4, -1), HT)  # (hashes are >= 0: a dead lane matches none)
        in8 = _in_round(tl.where(live, h8, -1), HT)
        d4 = tl.where(in4 >= 0, _checked(tl.where(in4 >= 0, t0 + in4, -1), i, live, lo, src, ALIGNED), d4)
        d8 = tl.where(in8 >= 0, _checked(tl.where(in8 >= 0, t0 + in8, -1), i, live, lo, src, ALIGNED), d8)
    tl.debug_barrier()  # every lane has read the tables before the round enters them
    entry = ((tag << 16) | (i + 1)).to(tl.int64) << 32 | lo.to(tl.int64)
    tl.atomic_max(t4 + h4, entry, mask=live, sem="relaxed")
    tl.atomic_max(t8 + h8, entry, mask=live, sem="relaxed")
    d4 = tl.where(live & (i >= 4) & (before == lo), 4, d4)  # the nearest last: it wins
    d4 = tl.where(live & (i >= 3) & (((lo << 24) | (before >> 8)) == lo), 3, d4)
    d4 = tl.where(live & (i >= 2) & (((lo << 16) | (before >> 16)) == lo), 2, d4)
    d4 = tl.where(live & (i >= 1) & (((lo << 8) | (before >> 24)) == lo), 1, d4)
    return d4, d8


@triton.jit
def _match_length(src, q, off, last, STEP: tl.constexpr):
    """Length of the match at q with offset `off` (its first 4 bytes are known to agree),
    ending at `last` at the latest; 0 when off is 0."""
    lane = tl.arange(0, STEP)
    k = q + _MINMATCH
    going = off > 0
    while going:
        pos = k + lane
        live = pos < last
        a = tl.load(src + pos, mask=live, other=0)
        b = tl.load(src + pos - off, mask=live, other=0)
        agree = tl.min(tl.where(live & (a == b), STEP, lane), axis=0)
        k += agree
        going = agree == STEP
    return tl.where(off > 0, k - q, 0)


@triton.jit
def _sequence_size(lit, ml):
    ext_l = tl.where(lit >= 15, (lit - 15) // 255 + 1, 0)
    ext_m = tl.where(ml >= _MINMATCH + 15, (ml - _MINMATCH - 15) // 255 + 1, 0)
    return 1 + ext_l + lit + tl.where(ml > 0, 2 + ext_m, 0)


@triton.jit
def _put_ext(dst, k, last, STEP: tl.constexpr):
    """A length's k extension bytes at dst: k - 1 of 255, then `last`."""
    lane = tl.arange(0, STEP)
    for j in range(0, k - 1, STEP):
        tl.store(dst + j + lane, tl.full([STEP], 255, tl.uint8), mask=j + lane < k - 1)
    tl.store(dst + k - 1, last.to(tl.uint8), mask=k > 0)


@triton.jit
def _emit(dst, lits, lit, off, ml, STEP: tl.constexpr):
    """Write one sequence at dst: `lit` literals from `lits`, then (ml > 0) a match of
    length ml at offset off."""
    lane = tl.arange(0, STEP)
    ext_l = tl.where(lit >= 15, (lit - 15) // 255 + 1, 0)
    token = (tl.minimum(lit, 15) << 4) | tl.where(ml > 0, tl.minimum(ml - _MINMATCH, 15), 0)
    tl.store(dst, token.to(tl.uint8))
    _put_ext(dst + 1, ext_l, (lit - 15) % 255, STEP)
    for j in range(0, lit, STEP):
        idx = j + lane
        live = idx < lit
        tl.store(dst + 1 + ext_l + idx, tl.load(lits + idx, mask=live, other=0), mask=live)
    po = dst + 1 + ext_l + lit
    has = ml > 0
    tl.store(po, (off & 255).to(tl.uint8), mask=has)
    tl.store(po + 1, (off >> 8).to(tl.uint8), mask=has)
    ext_m = tl.where(ml >= _MINMATCH + 15, (ml - _MINMATCH - 15) // 255 + 1, 0)
    _put_ext(po + 2, ext_m, (ml - _MINMATCH - 15) % 255, STEP)


@triton.jit(do_not_specialize=["total_ptr", "nbytes", "num_chunks", "offsets_pad"])
def _lz4_encode_kernel(src_ptr, offsets_ptr, blocks_ptr, state_ptr, tables_ptr, staging_ptr, total_ptr, nbytes,
                       num_chunks, offsets_pad, CHUNK: tl.constexpr, HBITS: tl.constexpr, HT: tl.constexpr,
                       STAGE: tl.constexpr, LOOK: tl.constexpr, ALIGNED: tl.constexpr):
    """One warp per chunk, one pass: chunks are taken by ticket; each is hashed, looked
    up and parsed a tile at a time into the warp's staging room, then placed by
    decoupled look-back over the blocks' sizes and copied to its place. The last chunk
    writes the total (offsets[num_chunks], and total_ptr: the caller's size word) and
    zeroes the offsets' padding."""
    pid = tl.program_id(0).to(tl.int64)
    HSIZE: tl.constexpr = 1 << HBITS
    t4 = tables_ptr + pid * (2 * HSIZE)
    t8 = t4 + HSIZE
    stage = staging_ptr + pid * STAGE
    hl = tl.arange(0, HT)
    k = 0  # chunks this warp has encoded
    c = ticket(state_ptr)
    while c < num_chunks:
        n = tl.minimum(nbytes - c * CHUNK, CHUNK).to(tl.int32)
        src = src_ptr + c * CHUNK
        starts = tl.maximum(n - (_MFLIMIT - 1), 0)  # positions where a match may start
        last = n - _LASTLITERALS
        tag = k % 32767 + 1  # this chunk's table entries (15 bits: entries stay positive)
        tl.debug_barrier()  # the previous chunk's table reads and staging copy are done
        if tag == 1:  # the first chunk, and once every 32767: no entry of an old chunk has this tag
            for h0 in range(0, 2 * HSIZE, HT):
                tl.store(t4 + h0 + hl, tl.zeros([HT], tl.int64), mask=h0 + hl < 2 * HSIZE)
        p = n * 0       # where the walk stands: no match starts before it
        anchor = n * 0  # the first byte not yet written
        size = n * 0    # block bytes written
        # Each tile's bytes are loaded a tile ahead: they arrive while the tile before
        # is looked up and parsed (a warp waits on a load only where it uses it).
        lo_next, hi_next, before_next = _words(src, hl, hl < starts, ALIGNED)
        for t0 in range(0, starts, HT):
            tl.debug_barrier()  # the table's clear or the last round's entries are visible
            i = t0 + hl
            live = i < starts
            lo = lo_next
            hi = hi_next
            before = before_next
            ahead = i + HT < starts
            lo_next, hi_next, before_next = _words(src, i + HT, ahead, ALIGNED)
            mixed = lo * 0x9E3779B1  # HASH_MUL
            h4 = (mixed >> (32 - HBITS)).to(tl.int32)
            h8 = (((mixed ^ hi) * 0x9E3779B1) >> (32 - HBITS)).to(tl.int32)
            d4, d8 = _tile_candidates(t4, t8, h4, h8, i, live, lo, before, src, t0, tag, HT, ALIGNED)
            # The greedy parse through this tile: the first position from p with a
            # candidate starts a match (the longer of its two); the walk resumes after it.
            going = p < t0 + HT
            while going:
                f = tl.min(tl.where(((d4 > 0) | (d8 > 0)) & (i >= p), hl, HT), axis=0)
                found = f < HT
                if found:
                    q = t0 + f
                    o4 = tl.sum(tl.where(hl == f, d4, 0), axis=0)
                    o8 = tl.sum(tl.where(hl == f, d8, 0), axis=0)
                    l4 = _match_length(src, q, o4, last, HT)
                    l8 = _match_length(src, q, o8, last, HT)
                    ml = tl.where(l8 > l4, l8, l4)
                    off = tl.where(l8 > l4, o8, o4)
                    lit = q - anchor
                    _emit(stage + size, src + anchor, lit, off, ml, HT)
                    size += _sequence_size(lit, ml)
                    p = q + ml
                    anchor = p
                going = found & (p < t0 + HT)
        lit = n - anchor
        _emit(stage + size, src + anchor, lit, n * 0, n * 0, HT)
        size += _sequence_size(lit, n * 0)
        prefix = exclusive_prefix(state_ptr, c, size.to(tl.int64), LOOK)
        tl.store(offsets_ptr + c, prefix)
        tl.debug_barrier()  # the block is in staging
        dst = blocks_ptr + prefix
        for j in range(0, size, 4 * HT):
            idx = j + tl.arange(0, 4 * HT)
            tl.store(dst + idx, tl.load(stage + idx, mask=idx < size), mask=idx < size)
        if c == num_chunks - 1:
            tl.store(offsets_ptr + num_chunks, prefix + size)
            tl.store(total_ptr, prefix + size)
            pad = tl.arange(0, 2)
            tl.store(offsets_ptr + num_chunks + 1 + pad, pad.to(tl.int64) * 0, mask=pad < offsets_pad)
        k += 1
        c = ticket(state_ptr)


def _check_bytes(data: torch.Tensor, where: str) -> None:
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        raise TypeError(f"{where}: expected a 1-D uint8 tensor")


def lz4_launch(data: torch.Tensor, reserved: torch.Tensor, config: LaunchConfig | None = None,
               chunk: int = CHUNK, sizes: torch.Tensor | None = None) -> torch.Tensor:
    """Compress 1-D uint8 `data` with Triton into `reserved` (reserve_nbytes bytes, 16-byte
    aligned), one LZ4 block per `chunk` bytes, in one kernel and no host sync. The payload
    is the first layout(num_chunks, blocks_nbytes)[1] bytes; returns blocks_nbytes as a
    1-element int64 tensor on the device, for the caller to read back when the work has run,
    which the kernel also writes into `sizes` (int64 [1] on the device) when given."""
    _check_bytes(data, "cswap.kernels.lz4.lz4_launch")
    check_chunk(chunk)
    nbytes = data.numel()
    num_chunks = -(-nbytes // chunk)
    offsets = reserved[: 8 * (num_chunks + 1)].view(torch.int64)
    if num_chunks == 0:
        reserved[: layout(0, 0)[1]].zero_()
        if sizes is not None:
            sizes.zero_()
        return offsets[:1]
    programs = encode_programs(num_chunks, config, data.device)
    tables = torch.empty(programs * (2 << hash_bits(chunk)), dtype=torch.int64, device=data.device)
    staging = torch.empty(programs * _staging_bytes(chunk), dtype=torch.uint8, device=data.device)
    state = torch.zeros(num_chunks + 1, dtype=torch.int64, device=data.device)
    blocks = reserved[layout(num_chunks, 0)[0]:]
    total = offsets[num_chunks:] if sizes is None else sizes
    _lz4_encode_kernel[(programs,)](data, offsets, blocks, state, tables, staging, total, nbytes, num_chunks,
                                    (-(num_chunks + 1)) % 2, CHUNK=chunk, HBITS=hash_bits(chunk),
                                    HT=encode_tile(), STAGE=_staging_bytes(chunk), LOOK=LOOK_BACK,
                                    ALIGNED=data.data_ptr() % 4 == 0, num_warps=1, maxnreg=max_registers(1))
    return offsets[num_chunks:]


def lz4_compress(data: torch.Tensor, alloc, config: LaunchConfig | None = None,
                 chunk: int = CHUNK) -> tuple[int, int]:
    """Compress 1-D uint8 `data` with Triton into `alloc(payload_nbytes)`, one LZ4
    block per `chunk` bytes: lz4_launch into room for the largest payload, then the
    payload copied into its exact size. Returns (num_chunks, blocks_nbytes).
    One host sync (the blocks' total size)."""
    _check_bytes(data, "cswap.kernels.lz4.lz4_compress")
    check_chunk(chunk)
    num_chunks = -(-data.numel() // chunk)
    reserved = torch.empty(reserve_nbytes(data.numel(), chunk), dtype=torch.uint8, device=data.device)
    blocks_nbytes = int(lz4_launch(data, reserved, config, chunk))  # the one host sync: sizes the buffer
    total = layout(num_chunks, blocks_nbytes)[1]
    alloc(total).copy_(reserved[:total])
    return num_chunks, blocks_nbytes


def lz4_launch_ref(data: torch.Tensor, reserved: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """lz4_launch's bytes from the reference encoder (it reads sizes on the host)."""
    _, blocks_nbytes = lz4_compress_ref(data, lambda k: reserved[:k], chunk)
    return torch.tensor([blocks_nbytes], dtype=torch.int64, device=data.device)


# -- Triton: decoder --------------------------------------------------------------------


@triton.jit
def _read_ext(src, ip, iend, v, limit, W: tl.constexpr):
    """Add LZ4 length-extension bytes at `ip` to `v` for every row where v == 15,
    reading a W-byte window per row and step (rows: [R] vectors of block-local
    32-bit positions; `src` the rows' block pointers).

    Returns (v, ip after the last byte, truncated). Stops early once v > limit
    (the caller reports an overflow); truncated = the block ended first.
    """
    idx = tl.arange(0, W)[None, :]
    more = v == 15
    trunc = v < 0
    while tl.max(more.to(tl.int32), axis=0) > 0:
        pos = ip[:, None] + idx
        b = tl.load(src[:, None] + pos, mask=more[:, None] & (pos < iend[:, None]), other=0).to(tl.int32)
        stop = (b != 255) | (pos >= iend[:, None])
        first = tl.min(tl.where(stop, idx, W), axis=1)
        found = first < W
        v = tl.where(more, v + 255 * first, v)
        over = v > limit
        past = found & (ip + first >= iend)
        trunc = tl.where(more, past & (over == 0), trunc)
        last = tl.sum(tl.where(idx == first[:, None], b, 0), axis=1)
        v = tl.where(more & found & (past == 0), v + last, v)
        ip = tl.where(more, ip + tl.where(found, first + 1, W), ip)
        more = more & (found == 0) & (over == 0)
    return v, ip, trunc


@triton.jit(do_not_specialize=["nbytes", "chunk", "blocks_nbytes", "num_chunks"])
def _lz4_decompress_kernel(blocks_ptr, offsets_ptr, out_ptr, status_ptr, nbytes, chunk, blocks_nbytes,
                           num_chunks, ROWS: tl.constexpr, STEP: tl.constexpr):
    # ROWS chunks per program, one per warp: each row walks its block's sequences
    # (LZ4 is sequential within a block) while its warp's lanes copy STEP bytes of
    # literals or match per step. Rows advance together one sequence per round, so
    # one barrier per round serves all of them. 64-bit only for where a block and
    # its chunk sit; positions within them are 32-bit (a block is < 2**17 bytes).
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0)
    col = tl.arange(0, STEP)[None, :]
    row = tl.arange(0, ROWS)
    for c0 in range(pid * ROWS, num_chunks, nprog * ROWS):
        c = c0 + row
        live = c < num_chunks
        # block_offsets are untrusted: a chunk whose range is not inside the blocks section
        # (or does not start and end it, first and last) is not decoded; its status says so.
        start = tl.load(offsets_ptr + c, mask=live, other=0)
        end = tl.load(offsets_ptr + c + 1, mask=live, other=0)
        bad = (start < 0) | (end < start) | (end > blocks_nbytes)
        bad = bad | ((c == 0) & (start != 0)) | ((c == num_chunks - 1) & (end != blocks_nbytes))
        ib = tl.minimum(tl.maximum(start, 0), blocks_nbytes)
        ie = tl.minimum(tl.maximum(end, ib), blocks_nbytes)
        src = blocks_ptr + ib
        dst = out_ptr + c * chunk
        # Decoding fails long before 2**30 bytes into a block (a sequence of n bytes
        # writes more than n): clamping keeps positions 32-bit.
        blen = tl.minimum(ie - ib, 1 << 30).to(tl.int32)
        olen = tl.maximum(tl.minimum(nbytes - c * chunk, chunk), 0).to(tl.int32)
        ip = tl.zeros([ROWS], dtype=tl.int32)
        op = ip
        err = ip
        errpos = ip
        done = (live == 0) | bad
        while tl.min(done.to(tl.int32), axis=0) == 0:
            going = done == 0
            # Token and literals.
            tstart = ip
            has_tok = going & (ip < blen)
            tok = tl.load(src + ip, mask=has_tok, other=0).to(tl.int32)
            lit, ip1, trunc1 = _read_ext(src, ip + 1, blen, tl.where(has_tok, tok >> 4, 0), olen - op, 32)
            e = tl.where(has_tok, 0, _TRUNCATED)
            e = tl.where((e == 0) & trunc1, _TRUNCATED, e)
            e = tl.where((e == 0) & (lit > olen - op), _OVERFLOW, e)
            e = tl.where((e == 0) & (lit > blen - ip1), _TRUNCATED, e)
            ncopy = tl.where(going & (e == 0), lit, 0)
            longest = tl.max(ncopy, axis=0)
            j = longest * 0
            while j < longest:
                jj = j + col
                m = jj < ncopy[:, None]
                v = tl.load(src[:, None] + ip1[:, None] + jj, mask=m, other=0)
                tl.store(dst[:, None] + op[:, None] + jj, v, mask=m)
                j += STEP
            ip2 = ip1 + ncopy
            op2 = op + ncopy
            last = (e == 0) & (ip2 >= blen)
            short = last & (op2 != olen)
            # Offset and match (only when input remains after the literals).
            mt = going & (e == 0) & (ip2 < blen)
            has_off = mt & (ip2 + 2 <= blen)
            b0 = tl.load(src + ip2, mask=has_off, other=0).to(tl.int32)
            b1 = tl.load(src + ip2 + 1, mask=has_off, other=0).to(tl.int32)
            off = b0 | (b1 << 8)
            ml, ip3, trunc2 = _read_ext(src, ip2 + 2, blen, tl.where(has_off, tok & 15, 0), olen - op2 - 4, 32)
            ml += 4
            e2 = tl.where(mt & (has_off == 0), _TRUNCATED, 0)
            e2 = tl.where(has_off & (off == 0), _OFFSET_ZERO, e2)
            e2 = tl.where(has_off & (e2 == 0) & (off > op2), _OFFSET_BEFORE_START, e2)
            e2 = tl.where(has_off & (e2 == 0) & trunc2, _TRUNCATED, e2)
            e2 = tl.where(has_off & (e2 == 0) & (ml > olen - op2), _OVERFLOW, e2)
            e2 = tl.where(has_off & (e2 == 0) & (ip3 >= blen), _ENDS_WITH_MATCH, e2)
            mcopy = tl.where(has_off & (e2 == 0), ml, 0)
            period = tl.maximum(off, 1)[:, None]
            tl.debug_barrier()  # earlier stores to out are visible to the match's loads
            longest = tl.max(mcopy, axis=0)
            j = longest * 0
            while j < longest:
                jj = j + col
                m = jj < mcopy[:, None]
                # Only bytes before the match: overlap-safe in one pass.
                v = tl.load(dst[:, None] + (op2[:, None] - period + jj % period), mask=m, other=0)
                tl.store(dst[:, None] + op2[:, None] + jj, v, mask=m)
                j += STEP
            fail = tl.where(e != 0, e, tl.where(short, _SHORT, e2))
            where = tl.where(e != 0, tstart, tl.where(short, op2, ip2))
            err = tl.where(going, fail, err)
            errpos = tl.where(going & (fail != 0), where, errpos)
            done = done | (fail != 0) | last
            ip = tl.where(going, ip3, ip)
            op = tl.where(going, op2 + mcopy, op)
        tl.store(status_ptr + 2 * c, tl.where(bad, _BAD_OFFSETS, err).to(tl.int64), mask=live)
        tl.store(status_ptr + 2 * c + 1, tl.where(bad, start, errpos.to(tl.int64)), mask=live)


def _check_payload(payload: torch.Tensor, nbytes: int, chunk: int, num_chunks: int, blocks_nbytes: int,
                   where: str) -> None:
    """The decoders' contract: sizes that agree (the codec checks them in _check_meta)."""
    _check_bytes(payload, where)
    if nbytes < 0 or chunk < 0 or blocks_nbytes < 0 or num_chunks < (1 if nbytes else 0) \
            or num_chunks * chunk < nbytes or payload.numel() < layout(num_chunks, blocks_nbytes)[1]:
        raise ValueError(f"{where}: inconsistent sizes: {nbytes} bytes in {num_chunks} chunks of {chunk}, "
                         f"{blocks_nbytes} block bytes, payload of {payload.numel()} bytes")


def lz4_decompress(payload: torch.Tensor, nbytes: int, chunk: int, num_chunks: int, blocks_nbytes: int,
                   config: LaunchConfig | None = None, out: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode with Triton (into `out` when given); returns (uint8[nbytes], status
    int64[C, 2] = (code, position))."""
    _check_payload(payload, nbytes, chunk, num_chunks, blocks_nbytes, "cswap.kernels.lz4.lz4_decompress")
    offsets, blocks = sections(payload, num_chunks, blocks_nbytes)
    # The kernel writes every byte of a chunk that decodes and every chunk's status (a chunk
    # that fails leaves the rest of its bytes as they were: its status makes the call raise).
    out = decoder_output(out, nbytes, torch.uint8, payload.device, zero=False)
    status = torch.empty((num_chunks, 2), dtype=torch.int64, device=payload.device)
    if num_chunks:
        # One chunk per warp: a program of `warps` warps decodes that many chunks at once.
        warps = (config or default_config(payload.device)).num_warps
        programs, _ = launch_grid(config, -(-num_chunks // warps), payload.device)
        if blocks.numel() == 0:  # every block is empty: nothing is read, any uint8 pointer will do
            blocks = torch.zeros(1, dtype=torch.uint8, device=payload.device)
        _lz4_decompress_kernel[(programs,)](blocks, offsets, out, status, nbytes, chunk, blocks_nbytes,
                                            num_chunks, ROWS=warps, STEP=32 * DECODE_BYTES_PER_LANE,
                                            num_warps=warps, maxnreg=max_registers(warps))
    return out, status


# -- PyTorch reference: encoder (same bytes as the Triton encoder) -------------------------

# Chunks per step of the reference encoder: bounds its temporaries to ~100 MB at 16 KiB chunks.
_REF_GROUP = 64
# Bytes compared in the first step when the reference extends a match (then twice as many each step).
_COMPARE = 16


def _mul32(h: torch.Tensor, k: int) -> torch.Tensor:
    """(h * k) mod 2**32 for 0 <= h, k < 2**32 without int64 overflow."""
    lo, hi = k & 0xFFFF, k >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[r, index[r, j]] with the index clamped into the row (callers mask the clamped lanes)."""
    return x.gather(1, index.clamp(0, x.shape[1] - 1))


def _candidates(v: torch.Tensor, h: torch.Tensor, starts: torch.Tensor, hbits: int) -> torch.Tensor:
    """Per position the offset back to the latest position with the same hash in an
    earlier tile of TABLE_TILE positions (what the table holds when the tile looks it up),
    where that position's first 4 bytes (v) are the same; 0 where there is none."""
    i = torch.arange(v.shape[1], device=v.device).expand_as(v)
    hashes = torch.where(starts, h, 1 << hbits) << 17
    key = torch.sort(hashes | i, dim=1).values
    query = hashes | (i // TABLE_TILE * TABLE_TILE)
    j = torch.searchsorted(key, query) - 1  # the last entry before the tile, in hash order
    found = key.gather(1, j.clamp(min=0))
    cand = torch.where((j >= 0) & ((found >> 17) == (query >> 17)), found & 0x1FFFF, -1)
    return torch.where(starts & (cand >= 0) & (_gather(v, cand) == v), i - cand, 0)


def _near(d: torch.Tensor, v: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """d, but the nearest of the NEAR positions before each whose 4 bytes equal its own
    where there is one."""
    i = torch.arange(v.shape[1], device=v.device).expand_as(v)
    for w in range(NEAR, 0, -1):  # the nearest last: it wins
        d = torch.where(starts & (i >= w) & (_gather(v, i - w) == v), w, d)
    return d


def _lengths(group: torch.Tensor, d: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Per position the exact length of its match at offset d (0 where d is 0), up to `last`
    (LZ4's last literals). Consecutive positions with the same offset form a chain whose
    lengths follow from its last position's, so bytes are compared only past chain ends;
    and a chain end's comparison stops at the next chain end of the same offset, whose
    length it then continues (so no byte is compared twice for one offset, however often
    hash collisions cut a long match into chains)."""
    cg, chunk = d.shape
    i = torch.arange(chunk, device=d.device).expand(cg, -1)
    valid = d > 0
    cont = valid & (torch.nn.functional.pad(d[:, 1:], (0, 1)) == d)
    row, col = (valid & ~cont).nonzero(as_tuple=True)
    back = d[row, col]
    order = torch.argsort((row * (1 << 17) + back) * (1 << 17) + col)  # by row, offset, position
    row, col, back = row[order], col[order], back[order]
    start = row * chunk + col
    same_next = torch.zeros_like(row, dtype=torch.bool)
    same_next[:-1] = (row[1:] == row[:-1]) & (back[1:] == back[:-1])
    next_start = torch.where(same_next, torch.nn.functional.pad(start[1:], (0, 1)), -1)
    limit = last[row] + row * chunk
    stop = torch.where(same_next, torch.minimum(next_start, limit), limit)
    end = start + MINMATCH  # the first 4 bytes agree (the candidate was checked)
    flat = group.reshape(-1)
    top = flat.numel() - 1
    active = torch.arange(row.numel(), device=d.device)
    width = _COMPARE
    while active.numel():  # windows double: a long match takes few steps
        k = end[active, None] + torch.arange(width, device=d.device)
        same = (k < stop[active, None]) & (flat[k.clamp(max=top)] == flat[(k - back[active, None]).clamp(0, top)])
        run = same.to(torch.int32).cumprod(1).sum(1)
        end[active] += run
        active = active[run == width]
        width = min(2 * width, chunk)
    # A comparison that reached the next chain end of its offset goes on as that one's does.
    reached = same_next & (end >= next_start)
    index = torch.arange(row.numel(), device=d.device)
    resolved = torch.cummin(torch.where(reached, row.numel(), index).flip(0), 0).values.flip(0)
    end = end[resolved] if row.numel() else end
    chain_end = torch.zeros_like(d)
    chain_end[row, col] = end - row * chunk
    last_of_chain = torch.cummin(torch.where(cont, 2 * chunk, i).flip(1), 1).values.flip(1)
    return torch.where(valid, _gather(chain_end, last_of_chain) - i, 0)


def _matches(group: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-2 for chunks `group` (uint8 [Cg, chunk], zero-padded) of lengths n:
    per position the chosen match's offset and length (0 where no match starts)."""
    cg, chunk = group.shape
    i = torch.arange(chunk, device=group.device).expand(cg, -1)
    b = torch.nn.functional.pad(group.to(torch.int64), (0, 7))
    lo = b[:, :-7] | (b[:, 1:-6] << 8) | (b[:, 2:-5] << 16) | (b[:, 3:-4] << 24)
    hi = b[:, 4:-3] | (b[:, 5:-2] << 8) | (b[:, 6:-1] << 16) | (b[:, 7:] << 24)
    hbits = hash_bits(chunk)
    h4 = _mul32(lo, HASH_MUL) >> (32 - hbits)
    h8 = _mul32(_mul32(lo, HASH_MUL) ^ hi, HASH_MUL) >> (32 - hbits)
    starts = i < (n - (MFLIMIT - 1)).clamp(min=0)[:, None]
    last = n - LASTLITERALS
    d4 = _near(_candidates(lo, h4, starts, hbits), lo, starts)
    d8 = _candidates(lo, h8, starts, hbits)
    len4 = _lengths(group, d4, last)
    len8 = _lengths(group, d8, last)
    longer = len8 > len4
    return torch.where(longer, d8, d4), torch.where(longer, len8, len4)


def _parse(length: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Step 3, the greedy parse: the match starts reached from position 0 by taking
    every match found and stepping one byte otherwise (bool [Cg, chunk]), found for
    all positions at once by pointer doubling."""
    cg, chunk = length.shape
    i = torch.arange(chunk, device=length.device).expand(cg, -1)
    sink = chunk
    stop = (n - (MFLIMIT - 1)).clamp(min=0)[:, None]
    nxt = i + torch.where(length > 0, length, 1)
    jump = torch.nn.functional.pad(torch.where(nxt < stop, nxt, sink), (0, 1), value=sink)
    seen = torch.zeros(cg, chunk + 1, dtype=torch.uint8, device=length.device)
    seen[:, 0] = 1
    span = 1
    while span <= chunk:  # after k rounds `seen` holds the first 2**k positions of the walk
        seen.scatter_reduce_(1, jump, seen.clone(), "amax")
        jump = jump.gather(1, jump)
        span *= 2
    return seen[:, :chunk].bool() & (length > 0) & (i < stop)


def _ext(count: torch.Tensor, lo: int) -> torch.Tensor:
    """Length-extension bytes LZ4 writes for a field whose token nibble saturates at `lo` + 15."""
    return torch.where(count >= lo + 15, (count - lo - 15).clamp(min=0) // 255 + 1, 0)


def _sequences(group: torch.Tensor, n: torch.Tensor) -> dict[str, torch.Tensor]:
    """The group's sequences as flat lists in block order (row, then position): each one's
    row, literal start and count, match offset and length (0 in a row's last sequence,
    which has literals only) and position in its block; and each block's size (`total`)."""
    cg, chunk = group.shape
    d, length = _matches(group, n)
    mrow, mpos = _parse(length, n).nonzero(as_tuple=True)
    none = torch.zeros(cg, dtype=length.dtype, device=group.device)
    row = torch.cat([mrow, torch.arange(cg, device=group.device)])
    at = torch.cat([mpos, n])  # a row's last sequence sits where its match would start: the chunk's end
    mlen = torch.cat([length[mrow, mpos], none])
    off = torch.cat([d[mrow, mpos], none])
    order = torch.argsort(row * (chunk + 1) + at)
    row, at, mlen, off = row[order], at[order], mlen[order], off[order]
    end = at + mlen
    first = torch.ones_like(row, dtype=torch.bool)
    first[1:] = row[1:] != row[:-1]
    anchor = torch.where(first, 0, torch.nn.functional.pad(end[:-1], (1, 0)))
    lit = at - anchor
    size = 1 + _ext(lit, 0) + lit + torch.where(mlen > 0, 2 + _ext(mlen, MINMATCH), 0)
    total = torch.zeros(cg, dtype=size.dtype, device=group.device).index_add_(0, row, size)
    pos = torch.cumsum(size, 0) - size - (torch.cumsum(total, 0) - total)[row]
    return dict(row=row, anchor=anchor, lit=lit, off=off, mlen=mlen, pos=pos, total=total)


def _groups(data: torch.Tensor, chunk: int):
    """Yield (first chunk, uint8 [Cg, chunk] zero-padded, lengths int64 [Cg])."""
    nbytes = data.numel()
    num_chunks = -(-nbytes // chunk)
    for c0 in range(0, num_chunks, _REF_GROUP):
        c1 = min(c0 + _REF_GROUP, num_chunks)
        lo, hi = c0 * chunk, min(c1 * chunk, nbytes)
        group = torch.zeros((c1 - c0) * chunk, dtype=torch.uint8, device=data.device)
        group[: hi - lo] = data[lo:hi]
        starts = torch.arange(c0, c1, device=data.device) * chunk
        yield c0, group.view(c1 - c0, chunk), (nbytes - starts).clamp(max=chunk)


def _write_group(blocks: torch.Tensor, base: torch.Tensor, group: torch.Tensor,
                 seq: dict[str, torch.Tensor]) -> None:
    """Write the blocks of one group at offsets `base` (the blocks were pre-filled with
    255, so of a length's extension bytes only the last needs writing)."""
    row, anchor, lit, off, mlen, pos = (seq[k] for k in ("row", "anchor", "lit", "off", "mlen", "pos"))

    def put(where, mask, values):
        blocks[where[mask]] = values[mask].to(torch.uint8)

    everywhere = torch.ones_like(lit, dtype=torch.bool)
    p = base[row] + pos
    ext_l = _ext(lit, 0)
    put(p, everywhere, (lit.clamp(max=15) << 4) | (mlen - MINMATCH).clamp(0, 15))
    put(p + ext_l, lit >= 15, (lit - 15) % 255)
    po = p + 1 + ext_l + lit
    match = mlen > 0
    put(po, match, off & 255)
    put(po + 1, match, off >> 8)
    put(po + 1 + _ext(mlen, MINMATCH), mlen >= MINMATCH + 15, (mlen - MINMATCH - 15) % 255)
    # The literals, all sequences' at once: byte j of sequence k's.
    k = torch.repeat_interleave(torch.arange(lit.numel(), device=lit.device), lit)
    j = torch.arange(k.numel(), device=lit.device) - (torch.cumsum(lit, 0) - lit)[k]
    blocks[(p + 1 + ext_l)[k] + j] = group.reshape(-1)[row[k] * group.shape[1] + anchor[k] + j]


def lz4_compress_ref(data: torch.Tensor, alloc, chunk: int = CHUNK) -> tuple[int, int]:
    """Reference encoder in plain PyTorch (any device); writes the same bytes as `lz4_compress`.
    Each group of chunks is written to its own buffer, then all are copied into the payload
    (the group's parse is found once; its block sizes are known only after it)."""
    _check_bytes(data, "cswap.kernels.lz4.lz4_compress_ref")
    check_chunk(chunk)
    num_chunks = -(-data.numel() // chunk)
    sizes = torch.zeros(num_chunks, dtype=torch.int64, device=data.device)
    parts = []
    for c0, group, n in _groups(data, chunk):
        seq = _sequences(group, n)
        sizes[c0: c0 + n.numel()] = seq["total"]
        local = torch.cumsum(seq["total"], 0)
        part = torch.full((int(local[-1]),), 255, dtype=torch.uint8, device=data.device)
        _write_group(part, local - seq["total"], group, seq)
        parts.append(part)
    ends = torch.cumsum(sizes, 0)
    blocks_nbytes = int(ends[-1]) if num_chunks else 0
    off_blocks, total = layout(num_chunks, blocks_nbytes)
    payload = alloc(total)
    payload[:off_blocks].zero_()
    offsets, blocks = sections(payload, num_chunks, blocks_nbytes)
    offsets[1:].copy_(ends)
    if parts:
        torch.cat(parts, out=blocks)
    return num_chunks, blocks_nbytes


# -- PyTorch reference: decoder (sequential, on CPU bytes) --------------------------------


def _read_ext_py(src, ip: int, ie: int, v: int, limit: int) -> tuple[int, int, bool]:
    """Python twin of `_read_ext`: same value, stopping rule and truncation flag."""
    while v <= limit:
        if ip >= ie:
            return v, ip, True
        b = src[ip]
        ip += 1
        v += b
        if b != 255:
            break
    return v, ip, False


def _decode_block_py(src, ib: int, ie: int, out: bytearray, ob: int, oe: int) -> tuple[int, int]:
    """Decode src[ib:ie] into out[ob:oe]; returns (status code, position) like the kernel."""
    ip, op = ib, ob
    while True:
        tstart = ip
        if ip >= ie:
            return TRUNCATED, tstart - ib
        tok = src[ip]
        lit, ip, trunc = tok >> 4, ip + 1, False
        if lit == 15:
            lit, ip, trunc = _read_ext_py(src, ip, ie, lit, oe - op)
        if trunc:
            return TRUNCATED, tstart - ib
        if lit > oe - op:
            return OVERFLOW, tstart - ib
        if lit > ie - ip:
            return TRUNCATED, tstart - ib
        out[op: op + lit] = src[ip: ip + lit]
        ip, op = ip + lit, op + lit
        if ip >= ie:
            return (SHORT, op - ob) if op != oe else (OK, 0)
        mpos = ip - ib
        if ip + 2 > ie:
            return TRUNCATED, mpos
        off = src[ip] | (src[ip + 1] << 8)
        ip += 2
        if off == 0:
            return OFFSET_ZERO, mpos
        if off > op - ob:
            return OFFSET_BEFORE_START, mpos
        ml = tok & 15
        if ml == 15:
            ml, ip, trunc = _read_ext_py(src, ip, ie, ml, oe - op - 4)
            if trunc:
                return TRUNCATED, mpos
        ml += 4
        if ml > oe - op:
            return OVERFLOW, mpos
        if ip >= ie:
            return ENDS_WITH_MATCH, mpos
        if off >= ml:
            out[op: op + ml] = out[op - off: op - off + ml]
        else:  # overlapping: the last `off` bytes repeat
            out[op: op + ml] = (out[op - off: op] * (ml // off + 1))[:ml]
        op += ml


def lz4_decompress_ref(payload: torch.Tensor, nbytes: int, chunk: int, num_chunks: int,
                       blocks_nbytes: int, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference decoder: a sequential Python loop over CPU bytes; returns
    (uint8[nbytes], status int64[C, 2]) on payload's device, like `lz4_decompress`."""
    _check_payload(payload, nbytes, chunk, num_chunks, blocks_nbytes, "cswap.kernels.lz4.lz4_decompress_ref")
    offsets, blocks = sections(payload, num_chunks, blocks_nbytes)
    offs = offsets.tolist()
    src = blocks.cpu().numpy().tobytes()
    decoded = bytearray(nbytes)
    codes = []
    for c in range(num_chunks):
        start, end = offs[c], offs[c + 1]
        if start < 0 or end < start or end > blocks_nbytes or (c == 0 and start != 0) \
                or (c == num_chunks - 1 and end != blocks_nbytes):  # (not decoded, as the kernel)
            codes.append((BAD_OFFSETS, start))
            continue
        ob = c * chunk
        codes.append(_decode_block_py(src, start, end, decoded, ob, min(ob + chunk, nbytes)))
    status = torch.tensor(codes, dtype=torch.int64).reshape(num_chunks, 2).to(payload.device)
    result = torch.frombuffer(decoded, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    if out is None:
        return result.to(payload.device), status
    return decoder_output(out, nbytes, torch.uint8, payload.device, zero=False).copy_(result), status
