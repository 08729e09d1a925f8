import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cswap
from bitdata import DTYPES, assert_bit_equal, bits, blocky, random_bits, rewrap, special_values
from cswap.codecs.container import pack_header
from cswap.kernels import zvc as kz

ZVC = cswap.codecs.get("zvc")
BACKENDS = ["torch", "triton"]
SHAPES = [(), (0,), (1,), (31,), (33,), (kz.TILE - 1,), (kz.TILE + 1,), (3, 5, 7), (2, 0, 3)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype(dtype, backend):
    x = random_bits((2 * kz.TILE + 77,), dtype, sparsity=0.5)
    blob = ZVC.compress(x, backend=backend)
    assert blob.codec == "zvc" and blob.dtype == dtype and blob.shape == x.shape
    assert_bit_equal(ZVC.decompress(blob, backend=backend), x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_shapes(shape, backend):
    x = random_bits(shape, torch.float32, sparsity=0.3)
    assert_bit_equal(ZVC.decompress(ZVC.compress(x, backend=backend), backend=backend), x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparsity", [0.0, 0.2, 0.5, 0.9, 1.0])
def test_round_trip_sparsity(sparsity, backend):
    x = random_bits((kz.TILE + 100,), torch.float16, sparsity=sparsity)
    blob = ZVC.compress(x, backend=backend)
    assert blob.meta[1] == int((bits(x) != 0).sum())
    assert_bit_equal(ZVC.decompress(blob, backend=backend), x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_survive(dtype, backend):
    x = special_values(dtype)
    assert_bit_equal(ZVC.decompress(ZVC.compress(x, backend=backend), backend=backend), x)


@pytest.mark.parametrize("tile", [32, 2 * kz.TILE], ids=["one-word", "two-steps"])
def test_decoder_reads_buffers_of_any_tile(tile):
    """The tile comes from the header: the decoder takes min(tile, TILE) elements a step,
    so a tile of one mask word decodes in one short step and a tile of 2 x TILE in two,
    the count of values carried between them; a mask bit flipped in the first step shows
    in that tile's status alone."""
    x = random_bits((2 * tile + 45,), torch.float32, sparsity=0.5)
    words = bits(x).reshape(-1)
    held = []
    nnz = kz.zvc_compress_ref(words, lambda k: held.append(torch.empty(k, dtype=torch.uint8)) or held[0], tile=tile)
    out, status = kz.zvc_decompress(held[0], words.numel(), tile, nnz, torch.int32)
    assert torch.equal(out, words) and not status.any()
    _, masks, _ = kz._sections(held[0], words.numel(), tile, nnz, torch.int32)
    masks[min(tile, kz.TILE) // 32 - 1] ^= 1  # tile 0's (first step's) last mask word: one value more or less
    out, status = kz.zvc_decompress(held[0], words.numel(), tile, nnz, torch.int32)
    assert status.tolist()[0] != 0 and not status[1:].any()


def test_format_masks_lsb_first_then_values():
    x = torch.zeros(40, dtype=torch.int32)
    x[0], x[3], x[31], x[32], x[39] = 7, -1, 5, 9, 2
    blob = ZVC.compress(x, backend="torch")
    offsets, masks, values = kz._sections(blob.payload, 40, kz.TILE, 5, torch.int32)
    assert offsets.tolist() == [0, 5]
    assert [m & 0xFFFFFFFF for m in masks.tolist()] == [(1 << 0) | (1 << 3) | (1 << 31), (1 << 0) | (1 << 7)]
    assert values.tolist() == [7, -1, 5, 9, 2]


def test_tile_offsets_count_nonzeros_per_tile():
    x = torch.zeros(3 * kz.TILE, dtype=torch.int8)
    x[:10] = 1
    x[2 * kz.TILE: 2 * kz.TILE + 4] = 3
    blob = ZVC.compress(x, backend="torch")
    offsets, _, _ = kz._sections(blob.payload, x.numel(), kz.TILE, 14, torch.int8)
    assert offsets.tolist() == [0, 10, 10, 14]


@pytest.mark.parametrize("x", [random_bits((3 * kz.TILE + 5,), torch.bfloat16, 0.6),
                               random_bits((77,), torch.float64, 0.1),
                               random_bits((0,), torch.float32)], ids=["bf16", "f64", "empty"])
def test_backends_write_identical_bytes_and_decode_each_other(x):
    a = ZVC.compress(x, backend="torch")
    b = ZVC.compress(x, backend="triton")
    assert torch.equal(a.data, b.data)
    assert_bit_equal(ZVC.decompress(a, backend="triton"), x)
    assert_bit_equal(ZVC.decompress(b, backend="torch"), x)


@pytest.mark.parametrize("grid,block", [(1, 32), (2, 64), (3, 128), (1000, 256)])
def test_launch_config_does_not_change_result(grid, block):
    x = random_bits((5 * kz.TILE + 3,), torch.float32, 0.5)
    config = cswap.LaunchConfig(grid=grid, block=block)
    blob = ZVC.compress(x, config=config, backend="triton")
    assert torch.equal(blob.data, ZVC.compress(x, backend="torch").data)
    assert_bit_equal(ZVC.decompress(blob, config=config, backend="triton"), x)


def test_zvc_shrinks_sparse_data():
    x = blocky((8 * 1024,), torch.float32, sparsity=0.5)
    blob = ZVC.compress(x, backend="torch")
    nnz = int((bits(x) != 0).sum())
    assert blob.nbytes < x.numel() * 4 * 0.6
    assert blob.payload.numel() < nnz * 4 + x.numel() / 8 + 64


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(min_size=0, max_size=600), width=st.sampled_from([1, 2, 4, 8]),
       zero_every=st.integers(1, 8))
def test_property_round_trip(data, width, zero_every):
    raw = bytearray(data[: len(data) // width * width])
    for i in range(0, len(raw), width * zero_every):  # inject zero elements
        raw[i: i + width] = bytes(width)
    dtype = {1: torch.uint8, 2: torch.float16, 4: torch.float32, 8: torch.float64}[width]
    x = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    assert_bit_equal(ZVC.decompress(ZVC.compress(x, backend="torch"), backend="torch"), x)


@settings(max_examples=6, deadline=None)
@given(n=st.integers(0, 3 * kz.TILE), sparsity=st.floats(0, 1))
def test_property_round_trip_triton(n, sparsity):
    x = random_bits((n,), torch.int16, sparsity)
    blob = ZVC.compress(x, backend="triton")
    assert_bit_equal(ZVC.decompress(blob, backend="triton"), x)


# -- corrupt buffers -------------------------------------------------------------


@pytest.fixture
def blob():
    return ZVC.compress(random_bits((2 * kz.TILE + 9,), torch.float32, 0.5), backend="torch")


@pytest.mark.parametrize("meta", [(kz.TILE, -1), (kz.TILE, 10**9), (33, 10), (0, 10)])
def test_inconsistent_meta_raises_before_decoding(blob, meta):
    with pytest.raises(cswap.CorruptDataError, match="cswap.codecs.zvc"):
        cswap.Compressed.from_bytes(rewrap(blob, meta=meta))


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_nnz_with_matching_size_raises(backend):
    # 9 int32 non-zeros (36 bytes, padded to 48); claiming 10 keeps the payload
    # size, so only the decoder can notice. It must raise, not read past the values.
    x = torch.zeros(2 * kz.TILE + 9, dtype=torch.int32)
    x[torch.arange(9) * 900] = torch.arange(1, 10, dtype=torch.int32)
    blob = ZVC.compress(x, backend="torch")
    tile, nnz = blob.meta
    assert nnz == 9 and kz.layout(x.numel(), tile, 10, 4)[3] == blob.payload.numel()
    bad = cswap.Compressed.from_bytes(rewrap(blob, meta=(tile, 10)))
    with pytest.raises(cswap.CorruptDataError, match="tile"):
        ZVC.decompress(bad, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("section", ["mask", "offset"])
def test_altered_payload_raises(blob, backend, section):
    payload = blob.payload.clone()
    n = blob.shape.numel()
    offsets, masks, _ = kz._sections(payload, n, kz.TILE, blob.meta[1], torch.int32)
    if section == "mask":
        assert masks[5] != -1
        masks[5] = -1  # all 32 set: tile 0's count no longer matches its offsets
    else:
        offsets[1] += 3
    bad = cswap.Compressed.from_bytes(rewrap(blob, payload=payload))
    with pytest.raises(cswap.CorruptDataError):
        ZVC.decompress(bad, backend=backend)
    # check=False skips the report but still never reads out of bounds
    y = ZVC.decompress(bad, backend=backend, check=False)
    assert y.shape == blob.shape


def test_header_dtype_itemsize_matches_payload():
    x = random_bits((100,), torch.float64, 0.5)
    blob = ZVC.compress(x, backend="torch")
    # Relabel as float32 with the same payload: sizes no longer agree.
    raw = pack_header("zvc", torch.float32, (100,), blob.meta, blob.payload.numel())
    data = torch.cat([torch.frombuffer(bytearray(raw), dtype=torch.uint8), blob.payload])
    with pytest.raises(cswap.CorruptDataError, match="payload is"):
        cswap.Compressed.from_bytes(data)


def test_header_layout_is_as_documented():
    blob = ZVC.compress(torch.zeros(2, 3), backend="torch")
    magic, version, codec_id, _, ndim, hsize, n_meta = struct.unpack_from("<4sBBBBHH", bytes(blob.data[:12].tolist()))
    assert (magic, version, codec_id, ndim, n_meta) == (b"CSWZ", 1, 1, 2, 2)
    assert hsize % 16 == 0 and blob.payload.data_ptr() % 16 == 0


# -- GPU ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_gpu_large_round_trip(dtype):
    x = random_bits((64 << 20) // torch.empty((), dtype=dtype).element_size(), dtype, 0.5, device="cuda")
    blob = ZVC.compress(x)
    assert torch.equal(blob.data, ZVC.compress(x, backend="torch").data)
    assert_bit_equal(ZVC.decompress(blob), x)


@pytest.mark.gpu
def test_gpu_more_than_2_31_elements():
    n = 2**31 + 4099
    if torch.cuda.get_device_properties(0).total_memory < 8 * n:
        pytest.skip("needs about 8 bytes of GPU memory per element")
    x = torch.zeros(n, dtype=torch.int8, device="cuda")
    x[-5:] = torch.tensor([1, 2, 0, 4, 5], dtype=torch.int8)
    x[2**31 - 3: 2**31 + 3] = 7
    blob = ZVC.compress(x)
    assert blob.meta[1] == 10
    y = ZVC.decompress(blob)
    assert torch.equal(y, x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape,dtype,sparsity", [((0,), torch.float32, 0.5), ((1,), torch.int8, 0.0),
                                                  ((33,), torch.bfloat16, 1.0), ((kz.TILE + 5,), torch.float32, 0.5),
                                                  ((2, kz.TILE + 77), torch.float64, 0.9),
                                                  ((3, 5, 7), torch.int16, 0.3)], ids=str)
def test_a_launch_without_its_size_writes_what_compress_writes(shape, dtype, sparsity, backend):
    """Codec.launch: the payload goes into a buffer reserved for the largest one, and
    nnz stays on the device; read back, it gives compress's payload and header byte
    for byte (padding included: the buffer starts poisoned)."""
    x = random_bits(shape, dtype, sparsity=sparsity)
    reserved = []

    def alloc(n):
        reserved.append(torch.full((n,), 0xA5, dtype=torch.uint8))
        return reserved[0]

    pending = ZVC.launch(x, backend=backend, alloc=alloc)
    assert not pending.deferred and pending.reserved is reserved[0]
    assert reserved[0].numel() >= kz.layout(x.numel(), kz.TILE, x.numel(), x.element_size())[3]
    payload, header = pending.finish(pending.sizes.tolist())
    blob = ZVC.compress(x, backend=backend)
    assert header == blob._header and torch.equal(payload, blob.payload)
    assert payload.data_ptr() == reserved[0].data_ptr()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64], ids=str)
def test_a_launch_into_less_room_writes_nothing_past_it_and_counts_the_whole_payload(dtype, backend):
    """The runtime reserves room from the payload of the step before (room_nbytes). Where
    the payload fits, the bytes are compress's; where it does not, nothing is written past
    the room (a fence of poisoned bytes after it stays) and the sizes still give the whole
    payload's header, for the caller to see the overflow."""
    x = random_bits((2 * kz.TILE + 77,), dtype, sparsity=0.5)
    blob = ZVC.compress(x, backend=backend)
    exact = blob.payload.numel()
    for room in (exact, exact - 16, kz.min_room_nbytes(x.numel(), kz.TILE)):
        fenced = torch.full((room + 4096,), 0xA5, dtype=torch.uint8)
        sizes = torch.empty(1, dtype=torch.int64)
        ZVC.launch_into(x, fenced[:room], sizes, backend=backend)
        assert ZVC.launched(sizes.tolist(), tuple(x.shape), x.dtype) == blob._header
        assert bool((fenced[room:] == 0xA5).all()), f"written past a room of {room} bytes"
        if room == exact:
            assert torch.equal(fenced[:room], blob.payload)


def test_room_for_a_known_payload_is_an_eighth_more_at_least_64_kib_at_most_the_largest():
    n, itemsize = 10**6, 4
    largest = ZVC.reserve_nbytes(n, itemsize)
    assert ZVC.room_nbytes(n, itemsize, None) == largest
    assert ZVC.room_nbytes(n, itemsize, 10**6) == 1125008  # 1125000, 16-byte aligned
    assert ZVC.room_nbytes(n, itemsize, 200_000) == 200_000 + 65536
    assert ZVC.room_nbytes(n, itemsize, largest - 10) == largest
    assert ZVC.room_nbytes(n, itemsize, 0) == kz.min_room_nbytes(n, kz.TILE)  # (the offsets and masks)
    assert cswap.codecs.get("zans").room_nbytes(n, 2, 10**6) == 1125008
    lz4 = cswap.codecs.get("lz4")  # (not bounded: always room for its largest payload)
    assert lz4.room_nbytes(n, itemsize, 8000) == lz4.reserve_nbytes(n, itemsize)


def test_a_room_too_small_for_the_offsets_and_masks_raises():
    x = random_bits((kz.TILE + 5,), torch.float32, sparsity=0.5)
    room = kz.min_room_nbytes(x.numel(), kz.TILE)
    with pytest.raises(ValueError, match="cannot hold the offsets and masks"):
        kz.zvc_launch(x.view(torch.int32), torch.empty(room - 16, dtype=torch.uint8))


def test_codecs_that_size_their_buffer_on_the_host_defer_their_encode():
    rle = cswap.codecs.get("rle")
    x = random_bits((500,), torch.float32, sparsity=0.6)
    pending = rle.launch(x, backend="torch")
    assert pending.deferred and pending.sizes is None
    payload, header = pending.finish()
    blob = rle.compress(x, backend="torch")
    assert header == blob._header and torch.equal(payload, blob.payload)
