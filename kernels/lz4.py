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

Encoder (one program per chunk, grid-stride over chunks; run twice: pass 1
writes each block's size, the host takes one prefix sum and allocates, pass 2
writes the bytes). The chunk is cut into NSEG = CHUNK // SEG segments of
SEG = 32 bytes. A full segment is a match segment if its bytes equal those of
segment s - 1 (offset 32: turns a zero run into one long overlapping match) or
else those of the earliest segment with the same hash (an atomic_min into a
per-program table of two entries per segment, indexed by the top bits of
h = (h ^ w) * HASH_MUL mod 2**32 folded over the segment's 8 little-endian
int32 words w; the bytes are compared, so a collision only loses a match).
The last two full segments and a partial tail are always literals, which keeps
the end-of-block rules. A sequence begins at segment 0 and wherever segment s - 1 is a match that
segment s does not extend with the same offset, so a sequence is literal
segments then match segments; prefix sums give each sequence's L, M, offset,
size and position. The program walks the chunk in phases (hash, match,
sequences, sequence headers, literals), each a loop of steps of a few segments
per thread whose results go through the program's scratch, so registers stay
bounded whatever the block. The encoder finds only repeats aligned to 32 bytes
(zero runs and repeated tiles); it is built for speed on the GPU, not for the
ratio of a byte-wise LZ4 search.

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
many decoders it does not enforce the last-5-literals / 12-byte rules.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import LaunchConfig, decoder_output, default_config, launch_grid

__all__ = [
    "CHUNK", "MAX_BLOCK_INPUT", "check_chunk", "hash_bits", "scratch_words", "OK", "TRUNCATED", "OFFSET_ZERO",
    "OFFSET_BEFORE_START", "OVERFLOW", "ENDS_WITH_MATCH",
    "SHORT", "BAD_OFFSETS", "layout", "block_bound", "sections",
    "lz4_compress", "lz4_decompress", "lz4_compress_ref", "lz4_decompress_ref",
]

# MAX_BLOCK_INPUT = 65536: the largest input whose every byte a 16-bit LZ4 offset
# (<= 65535) can reach, so chunks are independent and a chunk is one LZ4 block.
# CHUNK = 16384, what we write: one chunk is one warp's work when decoding, and
# 16 KiB chunks give a tensor 4x the warps of 64 KiB ones (an 8 MB tensor 512,
# about four per H100 SM) for +0.06% bytes on real activations
# (benchmarks/lz4_chunks.py: small_cnn, VGG16, ResNet-18 ReLU/pool outputs,
# 110 MiB, ratio 1.261 at 64 KiB, 1.260 at 16 KiB, 1.256 at 8 KiB).
MAX_BLOCK_INPUT = 65536
CHUNK = 16384
# SEG = 32 bytes (8 int32 words): zero runs and tensors made of repeated tiles
# (>= 32 B) still match. Untuned (no GPU measurement yet); SEG, the table size
# and the step sizes are free to change: the decoder reads any valid LZ4 block.
SEG = 32


def hash_bits(chunk: int) -> int:
    """Bits of the encoder's hash table: two entries per segment keep collisions rare
    (12 bits, 4096 entries, for a 64 KiB chunk's 2048 segments; 10 at 16 KiB)."""
    return (2 * (chunk // SEG) - 1).bit_length()


# Knuth's multiplicative hash constant, 2**32 / golden ratio.
HASH_MUL = 0x9E3779B1
# The encoder walks a chunk in steps: SEGS_PER_THREAD segments per thread (two
# segments' 16 words hashed and compared three ways stay in registers) and
# LITERAL_BYTES per thread when copying literals (one 16-byte load, then byte
# stores: a literal lands at any byte offset of the block). Holding all 2048
# segments at once (the first encoder) took 249-255 registers and spilled.
SEGS_PER_THREAD = 2
LITERAL_BYTES = 16
# DECODE_BYTES_PER_LANE = 4: a warp copies 128 bytes of literals or match per step.
DECODE_BYTES_PER_LANE = 4
# Each encoder program needs scratch_words(chunk) int32 words of global scratch;
# capping the programs at 4096 bounds it to 4096 * 20 KB = 84 MB at 16 KiB chunks (336 MB at
# 64 KiB) whatever grid is asked for.
MAX_ENCODE_PROGRAMS = 4096
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

# Scratch of one encoder program, in int32 words (offsets computed in the kernel):
# hash table [1 << hash_bits(chunk)]; per segment: hash, match offset (0 =
# literal), sequence [NSEG each]; per sequence: literal and match bytes before it [NSEG + 1 each],
# first segment, match offset, block position of its literal 0 minus that
# literal's chunk position [NSEG each].
def scratch_words(chunk: int) -> int:
    """int32 words of scratch one encoder program needs for chunks of `chunk` bytes."""
    return (1 << hash_bits(chunk)) + 8 * (chunk // SEG) + 2


def check_chunk(chunk: int) -> None:
    """The encoders' chunk: a power of two from 1 KiB to 64 KiB (any block size up to
    64 KiB is standard LZ4; the encoder needs whole 32-byte segments)."""
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


# -- Triton: encoder -------------------------------------------------------------------


@triton.jit(do_not_specialize=["nbytes", "num_chunks"])
def _lz4_compress_kernel(src8_ptr, src32_ptr, offsets_ptr, sizes_ptr, dst_ptr, scratch_ptr, nbytes,
                         num_chunks, CHUNK: tl.constexpr, SEG: tl.constexpr, HBITS: tl.constexpr,
                         STEP: tl.constexpr, LIT_ROWS: tl.constexpr, LIT_BYTES: tl.constexpr,
                         SCRATCH: tl.constexpr, WRITE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0)
    NSEG: tl.constexpr = CHUNK // SEG
    W: tl.constexpr = SEG // 4
    HSIZE: tl.constexpr = 1 << HBITS
    T0: tl.constexpr = 0
    HASH: tl.constexpr = T0 + HSIZE
    CODE: tl.constexpr = HASH + NSEG
    SEQ: tl.constexpr = CODE + NSEG
    SL: tl.constexpr = SEQ + NSEG
    SM: tl.constexpr = SL + NSEG + 1
    BEG: tl.constexpr = SM + NSEG + 1
    OFF: tl.constexpr = BEG + NSEG
    LB: tl.constexpr = OFF + NSEG
    tl.static_assert(LB + NSEG <= SCRATCH)
    tl.static_assert(SEG % LIT_BYTES == 0)
    sc = scratch_ptr + pid * SCRATCH
    lane = tl.arange(0, STEP)
    for c in range(pid, num_chunks, nprog):
        tl.debug_barrier()  # the previous chunk's scratch reads finish before we overwrite it
        n = tl.minimum(nbytes - c * CHUNK, CHUNK).to(tl.int32)
        words = src32_ptr + c * (CHUNK // 4)
        nfull = n // SEG
        nactive = (n + SEG - 1) // SEG
        # 1. Hash each full segment's 8 words; the table keeps the earliest segment per hash.
        for h0 in range(0, HSIZE, STEP):
            tl.store(sc + T0 + h0 + lane, tl.full([STEP], NSEG, tl.int32), mask=h0 + lane < HSIZE)
        tl.debug_barrier()
        for s0 in range(0, NSEG, STEP):
            s = s0 + lane
            full = s < nfull
            h = tl.zeros([STEP], dtype=tl.uint32)
            for j in tl.static_range(W):
                w = tl.load(words + s * W + j, mask=full, other=0)
                h = (h ^ w.to(tl.uint32, bitcast=True)) * 0x9E3779B1  # HASH_MUL
            h = (h >> (32 - HBITS)).to(tl.int32)
            tl.store(sc + HASH + s, h)
            # Relaxed: the barrier below orders the table for its readers.
            tl.atomic_min(sc + T0 + h, s, mask=full, sem="relaxed")
        tl.debug_barrier()
        # 2. Match offset of each segment (0 = literal). The last two full segments
        # and the partial tail stay literal (end-of-block rules).
        for s0 in range(0, NSEG, STEP):
            s = s0 + lane
            full = s < nfull
            # .cg: read the atomics' result from L2, never a stale L1 line
            cand = tl.load(sc + T0 + tl.load(sc + HASH + s), mask=full, other=NSEG, cache_modifier=".cg")
            allowed = s < nfull - 2
            ok_a = allowed & (s >= 1)
            ok_b = allowed & (cand < s)
            eq_a = ok_a
            eq_b = ok_b
            for j in tl.static_range(W):
                w = tl.load(words + s * W + j, mask=allowed, other=0)
                wa = tl.load(words + (s - 1) * W + j, mask=ok_a, other=0)
                wb = tl.load(words + cand * W + j, mask=ok_b, other=0)
                eq_a = eq_a & (w == wa)
                eq_b = eq_b & (w == wb)
            tl.store(sc + CODE + s, tl.where(eq_a, SEG, tl.where(eq_b, (s - cand) * SEG, 0)))
        tl.debug_barrier()
        # 3. Sequences: literal segments, then match segments sharing one offset.
        nseq = n * 0
        lit_before = n * 0
        mat_before = n * 0
        for s0 in range(0, NSEG, STEP):
            s = s0 + lane
            kind = tl.load(sc + CODE + s)
            prev = tl.load(sc + CODE + s - 1, mask=s >= 1, other=0)
            active = s < nactive
            is_m = kind > 0
            cont = is_m & (prev == kind)
            begin = active & ((s == 0) | ((prev > 0) & (cont == 0)))
            seg_lit = tl.where(active & (kind == 0), tl.minimum(n - s * SEG, SEG), 0)
            seg_mat = tl.where(is_m, SEG, 0)
            bi = begin.to(tl.int32)
            seq = nseq + tl.cumsum(bi, axis=0) - 1
            tl.store(sc + SL + seq, lit_before + tl.cumsum(seg_lit, axis=0) - seg_lit, mask=begin)
            tl.store(sc + SM + seq, mat_before + tl.cumsum(seg_mat, axis=0) - seg_mat, mask=begin)
            tl.store(sc + BEG + seq, s, mask=begin)
            tl.store(sc + OFF + seq, kind, mask=is_m)  # all match segments of a sequence agree
            tl.store(sc + SEQ + s, seq, mask=active)
            nseq += tl.sum(bi, axis=0)
            lit_before += tl.sum(seg_lit, axis=0)
            mat_before += tl.sum(seg_mat, axis=0)
        tl.store(sc + SL + nseq, lit_before)
        tl.store(sc + SM + nseq, mat_before)
        tl.debug_barrier()
        # 4. One lane per sequence: its size, position, and (WRITE) its token,
        # length extensions and offset. The block was pre-filled with 255, so every
        # extension byte but the last is already written.
        if WRITE:
            base = tl.load(offsets_ptr + c)
        else:
            base = c * 0
        total = n * 0
        for k0 in range(0, nseq, STEP):
            k = k0 + lane
            kv = k < nseq
            lit = tl.load(sc + SL + k + 1, mask=kv, other=0) - tl.load(sc + SL + k, mask=kv, other=0)
            mat = tl.load(sc + SM + k + 1, mask=kv, other=0) - tl.load(sc + SM + k, mask=kv, other=0)
            ext_l = tl.where(lit >= 15, (lit - 15) // 255 + 1, 0)
            ext_m = tl.where(mat >= 19, (mat - 19) // 255 + 1, 0)
            size = tl.where(kv, 1 + ext_l + lit + tl.where(mat > 0, 2 + ext_m, 0), 0)
            pos = total + tl.cumsum(size, axis=0) - size
            if WRITE:
                off = tl.load(sc + OFF + k, mask=kv & (mat > 0), other=0)
                p = dst_ptr + base + pos
                token = (tl.minimum(lit, 15) << 4) | tl.where(mat > 0, tl.minimum(mat - 4, 15), 0)
                tl.store(p, token.to(tl.uint8), mask=kv)
                tl.store(p + ext_l, ((lit - 15) % 255).to(tl.uint8), mask=kv & (lit >= 15))
                po = p + 1 + ext_l + lit
                has_m = kv & (mat > 0)
                tl.store(po, (off & 255).to(tl.uint8), mask=has_m)
                tl.store(po + 1, (off >> 8).to(tl.uint8), mask=has_m)
                tl.store(po + 1 + ext_m, ((mat - 19) % 255).to(tl.uint8), mask=kv & (mat >= 19))
                beg = tl.load(sc + BEG + k, mask=kv, other=0)
                tl.store(sc + LB + k, pos + 1 + ext_l - beg * SEG, mask=kv)
            total += tl.sum(size, axis=0)
        if WRITE:
            tl.debug_barrier()
            # 5. Literal bytes: byte i of the chunk goes to block position LB[SEQ[i // SEG]] + i.
            # A row is LIT_BYTES bytes of one segment: one vector load, the lookups once.
            row = tl.arange(0, LIT_ROWS)
            col = tl.arange(0, LIT_BYTES)
            src = src8_ptr + c * CHUNK
            dst = dst_ptr + base
            for b0 in range(0, n, LIT_ROWS * LIT_BYTES):
                first = b0 + row * LIT_BYTES
                sg = first // SEG
                lit_row = (first < n) & (tl.load(sc + CODE + sg, mask=first < n, other=1) == 0)
                lb = tl.load(sc + LB + tl.load(sc + SEQ + sg, mask=lit_row, other=0), mask=lit_row, other=0)
                i = first[:, None] + col[None, :]
                dpos = lb[:, None] + i
                m = lit_row[:, None] & (i < n) & (dpos >= 0) & (dpos < total)
                tl.store(dst + dpos, tl.load(src + i, mask=m, other=0), mask=m)
        else:
            tl.store(sizes_ptr + c, total.to(tl.int64))


def _word_views(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8, int32) views of the same bytes; copies only when `data` is not 16-byte
    aligned or not a whole number of words (the int32 loads need both)."""
    n = data.numel()
    if data.data_ptr() % 16 or n % 4:
        padded = torch.zeros(-(-n // 16) * 16, dtype=torch.uint8, device=data.device)
        padded[:n] = data
        data = padded
    return data, data.view(torch.int32)


def _check_bytes(data: torch.Tensor, where: str) -> None:
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        raise TypeError(f"{where}: expected a 1-D uint8 tensor")


def lz4_compress(data: torch.Tensor, alloc, config: LaunchConfig | None = None,
                 chunk: int = CHUNK) -> tuple[int, int]:
    """Compress 1-D uint8 `data` with Triton into `alloc(payload_nbytes)`, one LZ4
    block per `chunk` bytes.

    Returns (num_chunks, blocks_nbytes). One host sync (the blocks' total size).
    """
    _check_bytes(data, "cswap.kernels.lz4.lz4_compress")
    check_chunk(chunk)
    nbytes = data.numel()
    num_chunks = -(-nbytes // chunk)
    if num_chunks == 0:
        alloc(layout(0, 0)[1]).zero_()
        return 0, 0
    src8, src32 = _word_views(data)
    programs, warps = launch_grid(config, num_chunks, data.device)
    programs = min(programs, MAX_ENCODE_PROGRAMS)
    scratch = torch.empty(programs * scratch_words(chunk), dtype=torch.int32, device=data.device)
    sizes = torch.zeros(num_chunks, dtype=torch.int64, device=data.device)
    threads = 32 * warps
    args = dict(CHUNK=chunk, SEG=SEG, HBITS=hash_bits(chunk), STEP=min(chunk // SEG, SEGS_PER_THREAD * threads),
                LIT_ROWS=threads, LIT_BYTES=LITERAL_BYTES, SCRATCH=scratch_words(chunk), num_warps=warps)
    _lz4_compress_kernel[(programs,)](src8, src32, sizes, sizes, src8, scratch, nbytes, num_chunks,
                                      WRITE=False, **args)
    ends = torch.cumsum(sizes, 0)
    blocks_nbytes = int(ends[-1])  # the one host sync: sizes the buffer
    payload = alloc(layout(num_chunks, blocks_nbytes)[1])
    off_blocks = layout(num_chunks, blocks_nbytes)[0]
    payload[:off_blocks].zero_()
    offsets, blocks = sections(payload, num_chunks, blocks_nbytes)
    offsets[1:].copy_(ends)
    blocks.fill_(255)
    _lz4_compress_kernel[(programs,)](src8, src32, offsets, sizes, blocks, scratch, nbytes, num_chunks,
                                      WRITE=True, **args)
    return num_chunks, blocks_nbytes


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
        # block_offsets are untrusted: clamp each block into the blocks section.
        ib = tl.minimum(tl.maximum(tl.load(offsets_ptr + c, mask=live, other=0), 0), blocks_nbytes)
        ie = tl.minimum(tl.maximum(tl.load(offsets_ptr + c + 1, mask=live, other=0), ib), blocks_nbytes)
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
        done = live == 0
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
        tl.store(status_ptr + 2 * c, err.to(tl.int64), mask=live)
        tl.store(status_ptr + 2 * c + 1, errpos.to(tl.int64), mask=live)


def _offsets_status(offsets: torch.Tensor, blocks_nbytes: int, status: torch.Tensor) -> None:
    """Mark chunks whose block range is not inside the blocks section or goes
    backwards (on the device: no sync). Position = the recorded start offset."""
    if status.shape[0] == 0:
        return
    start, end = offsets[:-1], offsets[1:]
    bad = (start < 0) | (end < start) | (end > blocks_nbytes)
    bad[0] |= offsets[0] != 0
    bad[-1] |= offsets[-1] != blocks_nbytes
    status[:, 0] = torch.where(bad, BAD_OFFSETS, status[:, 0])
    status[:, 1] = torch.where(bad, start, status[:, 1])


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
    out = decoder_output(out, nbytes, torch.uint8, payload.device, zero=True)
    status = torch.zeros((num_chunks, 2), dtype=torch.int64, device=payload.device)
    if num_chunks:
        # One chunk per warp: a program of `warps` warps decodes that many chunks at once.
        warps = (config or default_config(payload.device)).num_warps
        programs, _ = launch_grid(config, -(-num_chunks // warps), payload.device)
        if blocks.numel() == 0:  # every block is empty: nothing is read, any uint8 pointer will do
            blocks = torch.zeros(1, dtype=torch.uint8, device=payload.device)
        _lz4_decompress_kernel[(programs,)](blocks, offsets, out, status, nbytes, chunk, blocks_nbytes,
                                            num_chunks, ROWS=warps, STEP=32 * DECODE_BYTES_PER_LANE,
                                            num_warps=warps)
    _offsets_status(offsets, blocks_nbytes, status)
    return out, status


# -- PyTorch reference: encoder (same bytes as the Triton encoder) -------------------------

# Chunks per step of the reference encoder: bounds its temporaries to ~50 MB.
_REF_GROUP = 16


def _mul32(h: torch.Tensor, k: int) -> torch.Tensor:
    """(h * k) mod 2**32 for 0 <= h, k < 2**32 without int64 overflow."""
    lo, hi = k & 0xFFFF, k >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _plan(group: torch.Tensor, n: torch.Tensor) -> dict[str, torch.Tensor]:
    """Segments, sequences and block sizes for chunks `group` (uint8 [Cg, chunk],
    zero-padded) of lengths `n` (int64 [Cg]): the Triton kernel's steps, batched."""
    dev = group.device
    cg = n.numel()
    NSEG = group.shape[1] // SEG  # noqa: N806  (the kernel's name)
    s = torch.arange(NSEG, device=dev)
    words = group.view(torch.int32).view(cg, NSEG, SEG // 4).to(torch.int64) & 0xFFFFFFFF
    nfull = (n // SEG)[:, None]
    full = s < nfull
    h = torch.zeros(cg, NSEG, dtype=torch.int64, device=dev)
    for j in range(SEG // 4):
        h = _mul32(h ^ words[..., j], HASH_MUL)
    h = h >> (32 - hash_bits(group.shape[1]))
    table = torch.full((cg, 1 << hash_bits(group.shape[1])), NSEG, dtype=torch.int64, device=dev)
    table.scatter_reduce_(1, h, torch.where(full, s, NSEG), "amin")
    cand = table.gather(1, h)
    allowed = s < nfull - 2
    ok_a = allowed & (s >= 1)
    ok_b = allowed & (cand < s)
    prev_words = torch.roll(words, 1, dims=1)
    eq_a = ok_a & (words == prev_words).all(-1)
    cand_words = words.gather(1, cand.clamp(max=NSEG - 1)[..., None].expand(-1, -1, SEG // 4))
    eq_b = ok_b & (words == cand_words).all(-1)
    kind = torch.where(eq_a, SEG, torch.where(eq_b, (s - cand) * SEG, 0))
    prev = torch.nn.functional.pad(kind[:, :-1], (1, 0))
    active = s < ((n + SEG - 1) // SEG)[:, None]
    is_m = kind > 0
    cont = is_m & (prev == kind)
    begin = active & ((s == 0) | ((prev > 0) & ~cont))
    seg_lit = torch.where(active & ~is_m, (n[:, None] - s * SEG).clamp(max=SEG), 0)
    seg_mat = torch.where(is_m, SEG, 0)
    seq = torch.cumsum(begin, 1) - 1
    nseq = begin.sum(1)
    dump = NSEG + 1  # column for lanes that store nothing
    col = torch.where(begin, seq, dump)
    sl = torch.zeros(cg, NSEG + 2, dtype=torch.int64, device=dev)
    sm = torch.zeros_like(sl)
    beg = torch.zeros_like(sl)
    off = torch.zeros_like(sl)
    sl.scatter_(1, col, torch.cumsum(seg_lit, 1) - seg_lit)
    sm.scatter_(1, col, torch.cumsum(seg_mat, 1) - seg_mat)
    beg.scatter_(1, col, s.expand(cg, -1))
    off.scatter_(1, torch.where(is_m, seq, dump), kind)
    sl.scatter_(1, nseq[:, None], seg_lit.sum(1, keepdim=True))
    sm.scatter_(1, nseq[:, None], seg_mat.sum(1, keepdim=True))
    kv = s < nseq[:, None]
    lit = torch.where(kv, sl[:, 1:NSEG + 1] - sl[:, :NSEG], 0)
    mat = torch.where(kv, sm[:, 1:NSEG + 1] - sm[:, :NSEG], 0)
    off = torch.where(kv & (mat > 0), off[:, :NSEG], 0)
    ext_l = torch.where(lit >= 15, (lit - 15).clamp(min=0) // 255 + 1, 0)
    ext_m = torch.where(mat >= 19, (mat - 19).clamp(min=0) // 255 + 1, 0)
    size = torch.where(kv, 1 + ext_l + lit + torch.where(mat > 0, 2 + ext_m, 0), 0)
    return dict(kind=kind, active=active, seq=seq, kv=kv, lit=lit, mat=mat, off=off, ext_l=ext_l,
                ext_m=ext_m, size=size, beg=beg[:, :NSEG], total=size.sum(1))


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


def _write_group(blocks: torch.Tensor, base: torch.Tensor, group: torch.Tensor, n: torch.Tensor,
                 plan: dict[str, torch.Tensor]) -> None:
    kv, lit, mat, off, ext_l, ext_m = (plan[k] for k in ("kv", "lit", "mat", "off", "ext_l", "ext_m"))
    pos = torch.cumsum(plan["size"], 1) - plan["size"]
    p = base[:, None] + pos
    token = (lit.clamp(max=15) << 4) | torch.where(mat > 0, (mat - 4).clamp(0, 15), 0)

    def put(where, mask, values):
        blocks[where[mask]] = values[mask].to(torch.uint8)

    put(p, kv, token)
    put(p + ext_l, kv & (lit >= 15), (lit - 15) % 255)
    po = p + 1 + ext_l + lit
    has_m = kv & (mat > 0)
    put(po, has_m, off & 255)
    put(po + 1, has_m, off >> 8)
    put(po + 1 + ext_m, kv & (mat >= 19), (mat - 19) % 255)
    lb = pos + 1 + ext_l - plan["beg"] * SEG
    seglb = torch.where(plan["active"], lb.gather(1, plan["seq"].clamp(min=0)), 0)
    i = torch.arange(group.shape[1], device=group.device)
    sg = i // SEG
    lit_byte = (i < n[:, None]) & (plan["kind"][:, sg] == 0)
    put(base[:, None] + seglb[:, sg] + i, lit_byte, group)


def lz4_compress_ref(data: torch.Tensor, alloc, chunk: int = CHUNK) -> tuple[int, int]:
    """Reference encoder in plain PyTorch (any device); writes the same bytes as `lz4_compress`."""
    _check_bytes(data, "cswap.kernels.lz4.lz4_compress_ref")
    check_chunk(chunk)
    num_chunks = -(-data.numel() // chunk)
    sizes = torch.zeros(num_chunks, dtype=torch.int64, device=data.device)
    for c0, group, n in _groups(data, chunk):
        sizes[c0: c0 + n.numel()] = _plan(group, n)["total"]
    ends = torch.cumsum(sizes, 0)
    blocks_nbytes = int(ends[-1]) if num_chunks else 0
    off_blocks, total = layout(num_chunks, blocks_nbytes)
    payload = alloc(total)
    payload[:off_blocks].zero_()
    offsets, blocks = sections(payload, num_chunks, blocks_nbytes)
    offsets[1:].copy_(ends)
    blocks.fill_(255)
    for c0, group, n in _groups(data, chunk):
        _write_group(blocks, offsets[c0: c0 + n.numel()], group, n, _plan(group, n))
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
        ib = min(max(offs[c], 0), blocks_nbytes)
        ie = min(max(offs[c + 1], ib), blocks_nbytes)
        ob = c * chunk
        codes.append(_decode_block_py(src, ib, ie, decoded, ob, min(ob + chunk, nbytes)))
    status = torch.tensor(codes, dtype=torch.int64).reshape(num_chunks, 2).to(payload.device)
    _offsets_status(offsets, blocks_nbytes, status)
    result = torch.frombuffer(decoded, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    if out is None:
        return result.to(payload.device), status
    return decoder_output(out, nbytes, torch.uint8, payload.device, zero=False).copy_(result), status
