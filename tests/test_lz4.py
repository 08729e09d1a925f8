import random

import lz4.block
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cswap
from bitdata import DTYPES, assert_bit_equal, blocky, random_bits, rewrap, special_values
from cswap.codecs import lz4 as codec_lz4
from cswap.kernels import lz4 as kl

LZ4 = cswap.codecs.get("lz4")
BACKENDS = ["torch", "triton"]
CHUNK = kl.CHUNK
MFLIMIT = kl.MFLIMIT
# lz4.block.compress settings our decoders must read: default, fast at several
# accelerations, high compression at two levels.
LZ4_MODES = [dict(), dict(mode="fast", acceleration=1), dict(mode="fast", acceleration=16),
             dict(mode="high_compression", compression=9), dict(mode="high_compression", compression=12)]
SLOW = pytest.mark.slow


def on_backends(values, quick_on_triton):
    """(value, backend) parameters: every value on torch, and on triton too, where only the
    values `quick_on_triton` accepts are in the quick set (the interpreter takes seconds a
    case; `pytest -m slow`, which CI runs, covers the rest)."""
    return [pytest.param(v, backend, marks=SLOW if backend == "triton" and not quick_on_triton(v) else (),
                         id=f"{v}-{backend}") for v in values for backend in BACKENDS]


def u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def blocks_of(blob):
    """The LZ4 blocks of a compressed tensor, as bytes, with their chunk sizes."""
    chunk, num_chunks, blocks_nbytes = blob.meta
    offsets, blocks = kl.sections(blob.payload, num_chunks, blocks_nbytes)
    offs = offsets.tolist()
    nbytes = blob.shape.numel() * blob.dtype.itemsize
    return [(bytes(blocks[offs[c]: offs[c + 1]].tolist()), min(chunk, nbytes - c * chunk))
            for c in range(num_chunks)]


def mixed_bytes(n: int, rng: random.Random) -> bytes:
    """Runs of one byte, random bytes and copies of earlier stretches (overlapping
    and not): the kinds of sequences an LZ4 encoder writes."""
    out = bytearray()
    while len(out) < n:
        r = rng.random()
        if r < 0.3:
            out += bytes([rng.randrange(256)]) * rng.randrange(1, 300)
        elif r < 0.6 or len(out) < 8:
            out += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
        else:
            a = rng.randrange(len(out))
            out += out[a: a + rng.randrange(4, 100)]
    return bytes(out[:n])


def tiled(nbytes: int, period: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pattern = torch.randint(0, 256, (period,), dtype=torch.uint8, generator=g)
    return pattern.repeat(-(-nbytes // period))[:nbytes]


# -- round trips -------------------------------------------------------------------------


# The kernels see bytes: one dtype of each width runs through the interpreter in the quick set.
ONE_OF_EACH_WIDTH = (torch.float32, torch.bfloat16, torch.bool, torch.float64)


@pytest.mark.parametrize("dtype,backend", on_backends(DTYPES, lambda d: d in ONE_OF_EACH_WIDTH))
def test_round_trip_every_dtype(dtype, backend):
    x = blocky((1500,), dtype, sparsity=0.5, run=40)
    blob = LZ4.compress(x, backend=backend)
    assert blob.codec == "lz4" and blob.dtype == dtype and blob.shape == x.shape
    assert_bit_equal(LZ4.decompress(blob, backend=backend), x)


SHAPES = [(), (0,), (1,), (7,), (MFLIMIT - 1,), (MFLIMIT,), (MFLIMIT + 1,), (CHUNK - 1,), (CHUNK,),
          (CHUNK + 1,), (3, 5, 7), (2, 0, 3)]


@pytest.mark.parametrize("shape,backend", on_backends(SHAPES, lambda shape: shape not in ((CHUNK - 1,), (CHUNK,))))
def test_round_trip_shapes(shape, backend):
    # Fewer zeros for the interpreted kernel: fewer matches, each a step of its walk.
    x = random_bits(shape, torch.uint8, sparsity=0.3 if backend == "torch" else 0.05)
    blob = LZ4.compress(x, backend=backend)
    assert_bit_equal(LZ4.decompress(blob, backend=backend), x)
    assert blob.meta[1] == -(-x.numel() // CHUNK)


@pytest.mark.parametrize("nbytes,backend", on_backends(
    [MFLIMIT - 1, MFLIMIT, MFLIMIT + 1, MFLIMIT + 4, 100, CHUNK - MFLIMIT, CHUNK + MFLIMIT + 1],
    lambda nbytes: nbytes != CHUNK - MFLIMIT))
def test_zero_runs_near_the_end_of_block_rules_and_chunk_edges_are_valid_lz4(nbytes, backend):
    # All-zero data maximises matches, so it exercises the end-of-block rules.
    x = torch.zeros(nbytes, dtype=torch.uint8)
    blob = LZ4.compress(x, backend=backend)
    for block, n in blocks_of(blob):
        assert lz4.block.decompress(block, uncompressed_size=n) == bytes(n)
    assert_bit_equal(LZ4.decompress(blob, backend=backend), x)


@pytest.mark.parametrize("sparsity,backend", on_backends([0.0, 0.2, 0.5, 0.9, 1.0], lambda s: s in (0.5, 1.0)))
def test_round_trip_sparsity(sparsity, backend):
    x = blocky((3000,), torch.float16, sparsity=sparsity, run=64)
    blob = LZ4.compress(x, backend=backend)
    assert_bit_equal(LZ4.decompress(blob, backend=backend), x)
    if sparsity == 1.0:
        assert blob.ratio > 20


@pytest.mark.parametrize("dtype,backend", on_backends(DTYPES, lambda d: d in ONE_OF_EACH_WIDTH))
def test_special_values_survive(dtype, backend):
    x = special_values(dtype).repeat(9)  # repeated: matches of NaN payloads, -0.0, ...
    assert_bit_equal(LZ4.decompress(LZ4.compress(x, backend=backend), backend=backend), x)


# -- format ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_format_bytes_of_a_zero_run(backend):
    # 256 zero bytes: one literal, a match at offset 1 up to the last 5 bytes (250 bytes:
    # 4 + 15 + extension 231), then the 5 literals LZ4 ends a block with. The lz4
    # package writes the same 11 bytes.
    blob = LZ4.compress(torch.zeros(256, dtype=torch.uint8), backend=backend)
    assert blob.meta == (CHUNK, 1, 11)
    offsets, blocks = kl.sections(blob.payload, 1, 11)
    assert offsets.tolist() == [0, 11]
    expected = bytes([0x1F, 0, 1, 0, 231, 0x50]) + bytes(5)
    assert bytes(blocks.tolist()) == expected == lz4.block.compress(bytes(256), store_size=False)
    assert blob.payload.numel() == 16 + 11


def test_format_block_offsets_are_an_exclusive_prefix_of_block_sizes():
    x = torch.cat([torch.zeros(CHUNK, dtype=torch.uint8), random_bits((CHUNK,), torch.uint8, 0.0),
                   torch.zeros(10, dtype=torch.uint8)])
    blob = LZ4.compress(x, backend="torch")
    chunk, num_chunks, blocks_nbytes = blob.meta
    assert (chunk, num_chunks) == (CHUNK, 3)
    offsets = kl.sections(blob.payload, num_chunks, blocks_nbytes)[0]
    sizes = [len(b) for b, _ in blocks_of(blob)]
    assert offsets.tolist() == [0, sizes[0], sizes[0] + sizes[1], blocks_nbytes]
    assert kl.layout(3, blocks_nbytes) == (32, 32 + blocks_nbytes) == (32, blob.payload.numel())
    assert sizes[0] < 600 and sizes[1] > CHUNK and sizes[2] == 11  # zeros, random-ish, 10 literals


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_repeated_4k_pattern_compresses_10x(backend):
    # 1 MiB (torch) / 64 KiB (triton, slower here) of one random 4 KiB pattern. A
    # block matches only within itself: each chunk stores the pattern once, so the
    # ratio is about chunk / 4 KiB (4 at the codec's 16 KiB, 16 at 64 KiB chunks).
    x = tiled((1 << 20) if backend == "torch" else (64 << 10), 4096, seed=3)
    blob = LZ4.compress(x, backend=backend)
    assert CHUNK / 4096 * 0.9 <= blob.ratio <= CHUNK / 4096, blob.ratio
    assert_bit_equal(LZ4.decompress(blob, backend="torch"), x)
    encode = kl.lz4_compress if backend == "triton" else kl.lz4_compress_ref
    out = []
    _, blocks_nbytes = encode(x, lambda n: out.append(torch.empty(n, dtype=torch.uint8)) or out[0], chunk=65536)
    assert x.numel() / blocks_nbytes >= 10


def test_zero_runs_compress_well():
    # Per 16 KiB chunk: one literal, one match of 16378 bytes (65 extension bytes), 5
    # literals: 75 bytes, and 8 bytes of block offset.
    blob = LZ4.compress(torch.zeros(1 << 20, dtype=torch.uint8), backend="torch")
    assert blob.meta[2] == 64 * 75 and blob.ratio > 190, blob.ratio


def test_random_data_grows_by_at_most_the_lz4_bound():
    x = random_bits((3 * CHUNK + 5,), torch.uint8, sparsity=0.0)
    blob = LZ4.compress(x, backend="torch")
    assert blob.meta[2] <= sum(kl.block_bound(n) for _, n in blocks_of(blob))


def test_the_longer_of_the_two_candidates_wins():
    # At the third "ABCD" the latest earlier "ABCD" (the second) matches 4 bytes, the
    # latest earlier "ABCDxyzw" (the first) matches 40: the match takes the first.
    head = b"ABCDxyzw" + bytes(range(100, 132))
    data = head + b"ABCD" + b"-" * 30 + head + b"." * 20
    x = u8(data)
    row = torch.zeros(1, CHUNK, dtype=torch.uint8)  # a chunk as the encoder sees it (its width sizes the tables)
    row[0, : len(data)] = x
    d, length = kl._matches(row, torch.tensor([len(data)]))
    third = len(head) + 4 + 30
    assert (int(d[0, third]), int(length[0, third])) == (third, len(head))
    blob = LZ4.compress(x, backend="torch")
    (block, n), = blocks_of(blob)
    assert lz4.block.decompress(block, uncompressed_size=n) == data


def _activations() -> list[torch.Tensor]:
    """ReLU and pooling outputs of a small CNN on digits, fp32 and bf16: what cswap offloads."""
    from sklearn.datasets import load_digits
    torch.manual_seed(0)
    images = torch.tensor(load_digits().images[:8], dtype=torch.float32)[:, None] / 16
    images = torch.nn.functional.interpolate(images, size=32).expand(-1, 3, -1, -1)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                              torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU())
    outs = []
    with torch.no_grad():
        h = images
        for layer in net:
            h = layer(h)
            if not isinstance(layer, torch.nn.Conv2d):
                outs += [h.clone(), h.to(torch.bfloat16)]
    return outs


def test_within_5_percent_of_the_lz4_package_on_activations():
    ours = theirs = 0
    for x in _activations():
        ours += LZ4.compress(x, backend="torch").payload.numel()
        raw = x.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        theirs += len(lz4.block.compress(raw, store_size=False))
    assert ours <= 1.05 * theirs, ours / theirs


# -- backends agree ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,x", [
    pytest.param("blocky-bf16", blocky((CHUNK // 2 + 77,), torch.bfloat16, 0.6, run=3000), marks=SLOW),
    pytest.param("tiled", tiled(CHUNK + 300, 1024), marks=SLOW),
    pytest.param("zeros", torch.zeros(5000, dtype=torch.int32), marks=SLOW),
    pytest.param("random", random_bits((999,), torch.float64, 0.0), marks=SLOW),
    ("mixed", u8(mixed_bytes(3000, random.Random(7)))),  # many sequences, overlapping matches, extensions
    pytest.param("relu", torch.randn(300).relu(), marks=SLOW),
    ("empty", torch.empty(0, dtype=torch.float32)),
])
def test_backends_write_identical_bytes_and_decode_each_other(name, x):
    a = LZ4.compress(x, backend="torch")
    b = LZ4.compress(x, backend="triton")
    assert torch.equal(a.data, b.data)
    assert_bit_equal(LZ4.decompress(a, backend="triton"), x)
    assert_bit_equal(LZ4.decompress(b, backend="torch"), x)


def test_unaligned_and_odd_sized_input():
    # A view at an odd byte offset with an odd size: the int32 loads need a copy.
    base = blocky((3 * CHUNK // 2 + 3,), torch.uint8, 0.5, run=5000)
    x = base[1:]
    assert x.data_ptr() % 4 and x.numel() % 4
    a = LZ4.compress(x, backend="triton")
    assert torch.equal(a.data, LZ4.compress(x.clone(), backend="torch").data)
    assert_bit_equal(LZ4.decompress(a, backend="triton"), x)


# (3, 128) in the quick run: several programs, each looping; the rest with the slow tests
@pytest.mark.parametrize("grid,block", [pytest.param(1, 32, marks=pytest.mark.slow),
                                        pytest.param(2, 64, marks=pytest.mark.slow), (3, 128),
                                        pytest.param(1000, 256, marks=pytest.mark.slow)])
def test_launch_config_does_not_change_result(grid, block):
    x = blocky((CHUNK + 100,), torch.uint8, 0.5, run=5000)  # few sequences: fast to interpret
    config = cswap.LaunchConfig(grid=grid, block=block)
    blob = LZ4.compress(x, config=config, backend="triton")
    assert torch.equal(blob.data, LZ4.compress(x, backend="torch").data)
    assert_bit_equal(LZ4.decompress(blob, config=config, backend="triton"), x)


@pytest.mark.slow
@pytest.mark.parametrize("offset", [0, 1])
def test_the_gpus_tiles_write_the_same_bytes(offset, monkeypatch):
    """A GPU's warp hashes and walks 32 positions per round (kl.ENCODE_TILE); the
    interpreter runs 256-wide rounds. Run the GPU's shape here, on 4-byte aligned input
    (read as aligned words) and not (read byte by byte): repeats closer than a tile
    (the near candidates), farther (table candidates), and matches that end in a later
    tile give the reference's bytes."""
    monkeypatch.setattr(kl, "encode_tile", lambda: kl.ENCODE_TILE)
    g = torch.Generator().manual_seed(32)
    pieces = [torch.randint(0, 4, (1200,), generator=g, dtype=torch.uint8),          # short repeats
              torch.arange(40, dtype=torch.uint8).repeat(30),                         # period 40
              torch.randint(0, 256, (500,), generator=g, dtype=torch.uint8).repeat(3)]   # period 500
    body = torch.cat(pieces)
    # Chunks of 1024 whose first match starts at 4 (period 4) and at 7 (period 3 after 4
    # other bytes): the near candidates' bytes before the chunk's first word.
    first, second = u8(b"abcd" * 8), u8(b"0123" + b"abc" * 10)
    data = torch.cat([first, body[: 1024 - first.numel()], second, body[1024:]])
    x = torch.cat([torch.zeros(offset, dtype=torch.uint8), data])[offset:]
    assert (x.data_ptr() % 4 == 0) == (offset == 0)
    mine, reference = torch.zeros(0, dtype=torch.uint8), torch.zeros(0, dtype=torch.uint8)
    got = kl.lz4_compress(x, mine.resize_, cswap.LaunchConfig(grid=2, block=64), chunk=1024)
    assert got == kl.lz4_compress_ref(x, reference.resize_, chunk=1024)
    assert torch.equal(mine, reference)
    assert torch.equal(kl.lz4_decompress_ref(mine, x.numel(), 1024, *got)[0], x)


def test_a_warp_ignores_the_table_entries_of_chunks_it_encoded_before():
    """One warp encodes both chunks (grid 1, one warp), so its tables still hold the
    first chunk's entries, tagged as that chunk's. In the second chunk "WXYZ" repeats at
    offset 10, inside one tile: no candidate for the reference (the tables answer for
    earlier tiles, the near candidates reach 4 back). Only an entry left by the first
    chunk, whose "WXYZ" sits at the same place, could offer it."""
    g = torch.Generator().manual_seed(7)
    first = torch.zeros(1024, dtype=torch.uint8)
    second = torch.randint(0, 256, (1024,), generator=g, dtype=torch.uint8)
    for chunk, at in ((first, [10]), (second, [10, 20])):
        for i in at:
            chunk[i: i + 4] = u8(b"WXYZ")
    x = torch.cat([first, second])
    mine, reference = torch.zeros(0, dtype=torch.uint8), torch.zeros(0, dtype=torch.uint8)
    got = kl.lz4_compress(x, mine.resize_, cswap.LaunchConfig(grid=1, block=32), chunk=1024)
    assert got == kl.lz4_compress_ref(x, reference.resize_, chunk=1024)
    assert torch.equal(mine, reference)


# -- interoperability with the lz4 package ------------------------------------------------------


INTEROP_INPUTS = {
    "run": b"a" * 3000,                                      # overlapping match, offset 1
    "period3": b"xyz" * 700 + b"0123456789ab",                # overlapping match, offset 3
    "mixed": mixed_bytes(2500, random.Random(5)),             # many sequences, long extensions
    "random": bytes(random.Random(6).randrange(256) for _ in range(700)),  # one literal run
    "tiny": b"abc",
    "empty": b"",
}


@pytest.mark.parametrize("mode", LZ4_MODES, ids=lambda m: "-".join(map(str, m.values())) or "default")
@pytest.mark.parametrize("name", list(INTEROP_INPUTS))
def test_our_decoders_read_lz4_package_blocks(name, mode):
    data = INTEROP_INPUTS[name]
    block = u8(lz4.block.compress(data, store_size=False, **mode))
    for backend in BACKENDS:
        out = codec_lz4.decompress_block(block, len(data), backend=backend)
        assert out.dtype == torch.uint8 and bytes(out.tolist()) == data


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,data", [
    ("zeros-64k", bytes(CHUNK)),
    pytest.param("tiled-64k", bytes(tiled(CHUNK, 4096).tolist()), marks=SLOW),
    ("blocky", bytes(blocky((3000,), torch.int8, 0.5, run=70).view(torch.uint8).tolist())),
    ("random", bytes(random_bits((1000,), torch.uint8, 0.0).tolist())),
    ("short", b"hello world"),
    ("one", b"\x00"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_lz4_package_reads_our_blocks(name, data, backend):
    block = codec_lz4.compress_block(u8(data), backend=backend)
    assert lz4.block.decompress(bytes(block.tolist()), uncompressed_size=len(data)) == data
    assert bytes(codec_lz4.decompress_block(block, len(data), backend=backend).tolist()) == data


def test_compress_block_api():
    assert codec_lz4.compress_block(torch.empty(0, dtype=torch.uint8)).tolist() == [0]
    assert codec_lz4.decompress_block(torch.zeros(1, dtype=torch.uint8), 0).numel() == 0
    with pytest.raises(ValueError, match="at most 65536 bytes, got 65537"):
        codec_lz4.compress_block(torch.zeros(kl.MAX_BLOCK_INPUT + 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="1-D uint8"):
        codec_lz4.compress_block(torch.zeros(10, dtype=torch.int32))
    with pytest.raises(TypeError, match="1-D uint8"):
        codec_lz4.decompress_block(b"\x00", 0)
    with pytest.raises(ValueError, match=">= 0"):
        codec_lz4.decompress_block(torch.zeros(1, dtype=torch.uint8), -1)
    with pytest.raises(ValueError, match="backend"):
        codec_lz4.compress_block(torch.zeros(3, dtype=torch.uint8), backend="cuda")


# -- hypothesis ---------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(min_size=0, max_size=3000), width=st.sampled_from([1, 2, 4, 8]),
       runs=st.lists(st.tuples(st.integers(0, 2999), st.integers(1, 400), st.integers(0, 255)), max_size=4))
def test_property_round_trip(data, width, runs):
    raw = bytearray(data)
    for start, length, value in runs:  # inject runs so that matches occur
        raw[start: start + length] = bytes([value]) * len(raw[start: start + length])
    raw = raw[: len(raw) // width * width]
    dtype = {1: torch.uint8, 2: torch.float16, 4: torch.float32, 8: torch.float64}[width]
    x = u8(bytes(raw)).view(dtype)
    blob = LZ4.compress(x, backend="torch")
    assert_bit_equal(LZ4.decompress(blob, backend="torch"), x)
    pos = 0
    for block, n in blocks_of(blob):
        assert lz4.block.decompress(block, uncompressed_size=n) == bytes(raw[pos: pos + n])
        pos += n


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=2000), reps=st.integers(1, 20), mode=st.sampled_from(LZ4_MODES))
def test_property_torch_decoder_reads_lz4_package(data, reps, mode):
    data = (data[:100] * reps) + data  # repeats of varied periods
    block = lz4.block.compress(data, store_size=False, **mode)
    assert bytes(codec_lz4.decompress_block(u8(block), len(data), backend="torch").tolist()) == data


@settings(max_examples=5, deadline=None)
@given(n=st.integers(0, CHUNK + 200), sparsity=st.floats(0, 1), run=st.integers(100, 3000))
def test_property_round_trip_triton(n, sparsity, run):
    x = blocky((n,), torch.uint8, sparsity, run=run)
    blob = LZ4.compress(x, backend="triton")
    assert_bit_equal(LZ4.decompress(blob, backend="triton"), x)


# -- malformed blocks --------------------------------------------------------------------------------

MALFORMED = [
    # name, block, uncompressed size, expected code, position, message
    ("empty-block", b"", 5, kl.TRUNCATED, 0, "truncated at byte 0 of 0"),
    ("literals-cut", b"\x50abcd", 5, kl.TRUNCATED, 0, "truncated at byte 0 of 5"),
    ("length-extension-cut", b"\xf0\xff\xff", 1000, kl.TRUNCATED, 0, "truncated at byte 0 of 3"),
    ("offset-cut", b"\x40abcd\x01", 20, kl.TRUNCATED, 5, "truncated at byte 5 of 6"),
    ("match-extension-cut", b"\x4fabcd\x01\x00\xff", 300, kl.TRUNCATED, 5, "truncated at byte 5 of 8"),
    ("offset-zero", b"\x40abcd\x00\x00\x50hello", 13, kl.OFFSET_ZERO, 5, "offset of 0 at byte 5"),
    ("offset-before-start", b"\x40abcd\x05\x00\x50hello", 13, kl.OFFSET_BEFORE_START, 5, "before the start"),
    ("literals-overflow", b"\x60abcdef", 5, kl.OVERFLOW, 0, "past the end of its 5-byte chunk"),
    ("match-overflow", b"\x4fabcd\x01\x00\x10\x50hello", 20, kl.OVERFLOW, 5, "past the end of its 20-byte"),
    ("ends-with-match", b"\x40abcd\x04\x00", 8, kl.ENDS_WITH_MATCH, 5, "ends with a match at byte 5 of 7"),
    ("short", b"\x50hello", 6, kl.SHORT, 5, "decodes to 5 bytes but its chunk has 6"),
    ("trailing-bytes", b"\x50hello\x00", 5, kl.TRUNCATED, 6, "truncated at byte 6 of 7"),
    # 5000 extension bytes of 255: stops as soon as the length exceeds the output, and
    # when it does not, at the end of the block; never loops past it.
    ("huge-literal-length", b"\xf0" + b"\xff" * 5000, 100, kl.OVERFLOW, 0, "past the end"),
    ("endless-extension", b"\xf0" + b"\xff" * 5000, 2_000_000, kl.TRUNCATED, 0, "truncated at byte 0 of 5001"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,block,n,code,pos,message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_blocks_raise(name, block, n, code, pos, message, backend):
    with pytest.raises(cswap.CorruptDataError, match=f"cswap.codecs.lz4: the block .*{message}"):
        codec_lz4.decompress_block(u8(block), n, backend=backend)
    payload = torch.zeros(kl.layout(1, len(block))[1], dtype=torch.uint8)
    payload[8:16].view(torch.int64)[0] = len(block)
    payload[16:] = u8(block)
    decode = kl.lz4_decompress if backend == "triton" else kl.lz4_decompress_ref
    out, status = decode(payload, n, n, 1, len(block))
    assert status.tolist() == [[code, pos]]
    assert out.numel() == n


def test_reference_lz4_rejects_what_we_reject():
    # The reference library reads lengths the same way: these are not LZ4 blocks of
    # n bytes (offset 0 is left out: some lz4 versions accept it).
    for name, block, n, code, _, _ in MALFORMED:
        if code == kl.SHORT:  # n is only a capacity to lz4: it returns fewer bytes
            assert len(lz4.block.decompress(block, uncompressed_size=n)) < n
        elif code != kl.OFFSET_ZERO:
            with pytest.raises(lz4.block.LZ4BlockError):
                lz4.block.decompress(block, uncompressed_size=n)


def _corruptions(count: int, seed: int):
    rng = random.Random(seed)
    for _ in range(count):
        data = mixed_bytes(rng.randrange(1, 500), rng)
        block = bytearray(lz4.block.compress(data, store_size=False))
        for _ in range(rng.randrange(1, 4)):
            kind = rng.randrange(3)
            if kind == 0:
                block[rng.randrange(len(block))] = rng.choice([0, 15, 0xF0, 0xFF, rng.randrange(256)])
            elif kind == 1:
                block = block[: rng.randrange(len(block) + 1)] or bytearray(b"\xff")
            else:
                block += bytes([rng.randrange(256)])
        yield bytes(block), len(data) + rng.choice([0, 0, 1, -1])


def test_fuzzed_blocks_torch_decoder_is_safe_and_agrees_with_lz4():
    codes = set()
    for block, n in _corruptions(300, seed=7):
        payload = torch.zeros(kl.layout(1, len(block))[1], dtype=torch.uint8)
        payload[8:16].view(torch.int64)[0] = len(block)
        payload[16:] = u8(block)
        out, status = kl.lz4_decompress_ref(payload, n, n, 1, len(block))
        code = int(status[0, 0])
        codes.add(code)
        try:
            ref = lz4.block.decompress(block, uncompressed_size=n)
        except lz4.block.LZ4BlockError:
            ref = None
        if ref is not None and len(ref) == n and code != kl.OFFSET_ZERO:
            assert code == kl.OK and bytes(out.tolist()) == ref
    assert codes >= {kl.OK, kl.TRUNCATED, kl.OVERFLOW, kl.OFFSET_BEFORE_START, kl.SHORT}


@SLOW  # (tests/test_fuzz.py fuzzes the Triton decoder in the quick set)
def test_fuzzed_blocks_triton_matches_torch_status_and_output():
    for block, n in _corruptions(40, seed=11):
        payload = torch.zeros(kl.layout(1, len(block))[1], dtype=torch.uint8)
        payload[8:16].view(torch.int64)[0] = len(block)
        payload[16:] = u8(block)
        out_ref, status_ref = kl.lz4_decompress_ref(payload, n, n, 1, len(block))
        out, status = kl.lz4_decompress(payload, n, n, 1, len(block), cswap.LaunchConfig(1, 32))
        assert status.tolist() == status_ref.tolist(), block
        if status_ref[0, 0] == kl.OK:  # (a block that fails leaves its chunk's remaining bytes unwritten)
            assert torch.equal(out, out_ref)


# -- corrupt buffers -----------------------------------------------------------------------------------


@pytest.fixture
def blob():
    x = torch.cat([blocky((CHUNK // 4,), torch.float32, 0.5, run=1000), random_bits((100,), torch.float32, 0.0)])
    return LZ4.compress(x, backend="torch")  # 2 blocks


def test_payload_padding_is_zero(blob):
    assert blob.meta[1] == 2 and blob.payload[24:32].tolist() == [0] * 8


@pytest.mark.parametrize("meta,match", [
    ((0, 2, 100), "chunk size 0"),
    ((kl.MAX_BLOCK_INPUT + 1, 1, 100), "chunk size 65537"),
    ((CHUNK, 3, None), "3 chunks recorded"),
    ((1024, 2, None), f"make {-(-(CHUNK + 400) // 1024)}"),  # the blob's CHUNK + 400 bytes
    ((CHUNK, 2, 1), "impossible"),
    ((CHUNK, 2, 10**12), "impossible"),
    ((CHUNK, 2, -1), "impossible"),
    ((CHUNK, 2, "+1"), "payload is"),
])
def test_inconsistent_meta_raises_before_decoding(blob, meta, match):
    chunk, num_chunks, blocks_nbytes = meta
    if blocks_nbytes is None:
        blocks_nbytes = blob.meta[2]
    elif blocks_nbytes == "+1":
        blocks_nbytes = blob.meta[2] + 1
    with pytest.raises(cswap.CorruptDataError, match="cswap.codecs.lz4"):
        cswap.Compressed.from_bytes(rewrap(blob, meta=(chunk, num_chunks, blocks_nbytes)))
    with pytest.raises(cswap.CorruptDataError, match=match):
        cswap.Compressed.from_bytes(rewrap(blob, meta=(chunk, num_chunks, blocks_nbytes)))


def _edit_offsets(blob, index, value):
    payload = blob.payload.clone()
    payload[: 8 * (blob.meta[1] + 1)].view(torch.int64)[index] = value
    return cswap.Compressed.from_bytes(rewrap(blob, payload=payload))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("index,value,match", [
    (1, -5, "block 0 of 2 has block offsets \\[0, -5\\)"),
    (1, 10**9, "block 0 of 2 has block offsets \\[0, 1000000000\\)"),
    (0, 3, "block 0 of 2 has block offsets \\[3, "),
    (2, 5, "block 1 of 2 has block offsets"),
])
def test_bad_block_offsets_raise(blob, backend, index, value, match):
    bad = _edit_offsets(blob, index, value)
    with pytest.raises(cswap.CorruptDataError, match=match):
        LZ4.decompress(bad, backend=backend)
    assert LZ4.decompress(bad, backend=backend, check=False).shape == blob.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_moved_block_boundary_raises_naming_the_block(blob, backend):
    offsets = kl.sections(blob.payload, 2, blob.meta[2])[0]
    bad = _edit_offsets(blob, 1, int(offsets[1]) - 1)  # block 0 loses its last byte
    with pytest.raises(cswap.CorruptDataError, match="block 0 of 2 is truncated at byte"):
        LZ4.decompress(bad, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_altered_block_bytes_raise(blob, backend):
    offsets = kl.sections(blob.payload, 2, blob.meta[2])[0].tolist()
    payload = blob.payload.clone()
    start = kl.layout(2, blob.meta[2])[0]
    # Block 1 is one literal run (token 0xF0, extension bytes, 400 literals). With token 0
    # its extension bytes read as a match offset reaching before the chunk.
    assert int(payload[start + offsets[1]]) == 0xF0
    payload[start + offsets[1]] = 0
    bad = cswap.Compressed.from_bytes(rewrap(blob, payload=payload))
    with pytest.raises(cswap.CorruptDataError, match="cswap.codecs.lz4: block 1 of 2 has a match offset at byte 1 "):
        LZ4.decompress(bad, backend=backend)
    y = LZ4.decompress(bad, backend=backend, check=False)  # no check: still in bounds
    assert y.shape == blob.shape


def test_corrupt_payload_decodes_identically_on_both_backends(blob):
    rng = random.Random(3)
    start = kl.layout(2, blob.meta[2])[0]
    for _ in range(3):
        payload = blob.payload.clone()
        for _ in range(4):
            payload[start + rng.randrange(blob.meta[2])] = rng.randrange(256)
        bad = cswap.Compressed.from_bytes(rewrap(blob, payload=payload))
        a = LZ4.decompress(bad, backend="torch", check=False)
        b = LZ4.decompress(bad, backend="triton", check=False)
        assert_bit_equal(a, b)


# -- GPU ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_gpu_large_round_trip(dtype):
    n = (64 << 20) // torch.empty((), dtype=dtype).element_size()
    x = blocky((n,), dtype, 0.5, run=256, device="cuda")
    blob = LZ4.compress(x)
    assert torch.equal(blob.data, LZ4.compress(x, backend="torch").data)
    assert blob.ratio > 1.5
    assert_bit_equal(LZ4.decompress(blob), x)
    assert_bit_equal(LZ4.decompress(blob.to("cpu"), backend="torch"), x.cpu())
    for block, size in blocks_of(blob.to("cpu"))[:3]:
        assert len(lz4.block.decompress(block, uncompressed_size=size)) == size


@pytest.mark.gpu
def test_gpu_reads_lz4_package_blocks():
    for name, data in INTEROP_INPUTS.items():
        for mode in LZ4_MODES:
            block = u8(lz4.block.compress(data, store_size=False, **mode)).cuda()
            assert bytes(codec_lz4.decompress_block(block, len(data)).cpu().tolist()) == data, (name, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("grid,block", [(1, 32), (7, 64), (64, 256), (1000, 1024)])
def test_gpu_launch_config_does_not_change_result(grid, block):
    # Many programs and warps: races in the encoder's scratch would change bytes here.
    x = blocky((40 * CHUNK + 123,), torch.uint8, 0.5, run=300, device="cuda")
    x[: 4 * CHUNK] = tiled(4 * CHUNK, 4096).cuda()
    config = cswap.LaunchConfig(grid=grid, block=block)
    blob = LZ4.compress(x, config=config, backend="triton")
    assert torch.equal(blob.data, LZ4.compress(x, backend="torch").data)
    assert_bit_equal(LZ4.decompress(blob, config=config, backend="triton"), x)


@pytest.mark.gpu
def test_gpu_fuzzed_blocks_match_torch():
    for block, n in _corruptions(300, seed=13):
        payload = torch.zeros(kl.layout(1, len(block))[1], dtype=torch.uint8)
        payload[8:16].view(torch.int64)[0] = len(block)
        payload[16:] = u8(block)
        out_ref, status_ref = kl.lz4_decompress_ref(payload, n, n, 1, len(block))
        out, status = kl.lz4_decompress(payload.cuda(), n, n, 1, len(block))
        assert status.tolist() == status_ref.tolist(), block
        assert torch.equal(out.cpu(), out_ref)


@pytest.mark.gpu
def test_gpu_more_than_2_31_elements():
    n = 2**31 + 4099
    if torch.cuda.get_device_properties(0).total_memory < 4 * n:
        pytest.skip("needs about 4 bytes of GPU memory per element")
    x = torch.zeros(n, dtype=torch.int8, device="cuda")
    x[-5:] = torch.tensor([1, 2, 0, 4, 5], dtype=torch.int8)
    x[2**31 - 3: 2**31 + 3] = 7
    blob = LZ4.compress(x)
    assert blob.meta[1] == -(-n // CHUNK) and blob.ratio > 100
    y = LZ4.decompress(blob)
    assert torch.equal(y, x)
