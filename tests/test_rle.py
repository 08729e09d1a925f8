import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cswap
from bitdata import DTYPES, assert_bit_equal, bits, blocky, random_bits, special_values
from cswap.codecs.container import pack_header
from cswap.kernels import rle as kr

RLE = cswap.codecs.get("rle")
BACKENDS = ["torch", "triton"]
T = kr.TILE
SHAPES = [(), (0,), (1,), (2,), (31,), (T - 1,), (T,), (T + 1,), (2 * T + 3,), (3, 5, 7), (2, 0, 3)]


def _encode(x, tile, backend):
    """Kernel-level encode with any tile: (payload, num_runs, nnz)."""
    buf = []

    def alloc(nbytes):
        buf.append(torch.empty(nbytes, dtype=torch.uint8))
        return buf[0]

    if backend == "triton":
        num_runs, nnz = kr.rle_compress(x, alloc, cswap.LaunchConfig(grid=3, block=32), tile=tile)
    else:
        num_runs, nnz = kr.rle_compress_ref(x, alloc, tile=tile)
    return buf[0], num_runs, nnz


def _wrap(payload, dtype, shape, meta):
    """A buffer with a valid header (CRC passes) around any payload and meta."""
    raw = pack_header("rle", dtype, tuple(shape), tuple(meta), payload.numel())
    return torch.cat([torch.frombuffer(bytearray(raw), dtype=torch.uint8), payload])


def _sections(blob, payload=None):
    tile, num_runs, nnz = blob.meta
    payload = blob.payload if payload is None else payload
    word_dtype = bits(torch.empty(0, dtype=blob.dtype)).dtype
    return kr.sections(payload, blob.shape.numel(), tile, num_runs, nnz, word_dtype)


# -- round trips --------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype(dtype, backend):
    x = random_bits((2 * T + 77,), dtype, sparsity=0.5)
    blob = RLE.compress(x, backend=backend)
    assert blob.codec == "rle" and blob.dtype == dtype and blob.shape == x.shape
    assert blob.meta == (T, blob.meta[1], int((bits(x) != 0).sum()))
    assert_bit_equal(RLE.decompress(blob, backend=backend), x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_shapes(shape, backend):
    x = random_bits(shape, torch.float32, sparsity=0.3)
    assert_bit_equal(RLE.decompress(RLE.compress(x, backend=backend), backend=backend), x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparsity", [0.0, 0.1, 0.5, 0.9, 0.99, 1.0])
def test_round_trip_sparsity(sparsity, backend):
    x = random_bits((T + 100,), torch.float16, sparsity=sparsity)
    blob = RLE.compress(x, backend=backend)
    assert blob.meta[2] == int((bits(x) != 0).sum())
    assert_bit_equal(RLE.decompress(blob, backend=backend), x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fill", ["zeros", "ones"])
def test_all_zero_and_no_zero(fill, backend):
    x = getattr(torch, fill)(2 * T + 5, dtype=torch.bfloat16)
    blob = RLE.compress(x, backend=backend)
    # No zeros: one run per tile (runs are cut at tile boundaries); all zeros: none.
    assert blob.meta[1:] == ((3, x.numel()) if fill == "ones" else (0, 0))
    assert_bit_equal(RLE.decompress(blob, backend=backend), x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_survive(dtype, backend):
    x = special_values(dtype)
    assert_bit_equal(RLE.decompress(RLE.compress(x, backend=backend), backend=backend), x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_blocky_multi_dim(backend):
    x = blocky((4, 3, 1000), torch.float32, sparsity=0.6, run=100)
    assert_bit_equal(RLE.decompress(RLE.compress(x, backend=backend), backend=backend), x)


# -- the format ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_format_runs_starts_befores_values(backend):
    x = torch.zeros(40, dtype=torch.int32)
    x[1:3] = torch.tensor([5, 6])
    x[5] = -1
    x[30:40] = torch.arange(1, 11)
    blob = RLE.compress(x, backend=backend)
    assert blob.meta == (T, 3, 13)
    sec = _sections(blob)
    assert sec.run_offsets.tolist() == [0, 3] and sec.value_offsets.tolist() == [0, 13]
    assert sec.starts.to(torch.int64).tolist() == [1, 5, 30]
    assert sec.befores.to(torch.int64).tolist() == [0, 2, 3]
    assert sec.values.tolist() == [5, 6, -1] + list(range(1, 11))
    # sections are 16-byte aligned and the padding is zero
    assert blob.payload.numel() == 16 + 16 + 16 + 16 + 64
    assert blob.payload[32 + 6: 48].tolist() == [0] * 10  # after starts


def test_runs_are_cut_at_tile_boundaries():
    x = torch.zeros(3 * T, dtype=torch.int8)
    x[T - 3: T + 2] = 1     # crosses the boundary between tiles 0 and 1
    x[2 * T + 7: 3 * T] = 2  # runs to the end of the last tile
    blob = RLE.compress(x, backend="torch")
    sec = _sections(blob)
    assert sec.run_offsets.tolist() == [0, 1, 2, 3]
    assert sec.value_offsets.tolist() == [0, 3, 5, T - 7 + 5]
    assert sec.starts.to(torch.int64).tolist() == [T - 3, 0, 7]
    assert sec.befores.to(torch.int64).tolist() == [0, 0, 0]
    assert torch.equal(RLE.compress(x, backend="triton").data, blob.data)


def test_rle_beats_zvc_on_long_zero_runs():
    x = blocky((64 * 1024,), torch.float32, sparsity=0.5, run=256)
    blob = RLE.compress(x, backend="torch")
    nnz = int((bits(x) != 0).sum())
    zvc_equivalent = x.numel() // 32 * 4 + nnz * 4
    assert blob.payload.numel() < zvc_equivalent
    assert blob.payload.numel() - nnz * 4 < (x.numel() // 32 * 4) / 4  # overhead far below ZVC's masks
    assert_bit_equal(RLE.decompress(blob), x)


@pytest.mark.parametrize("x", [random_bits((3 * T + 5,), torch.bfloat16, 0.6),
                               blocky((2 * T + 1,), torch.float32, 0.5, run=300),
                               random_bits((77,), torch.float64, 0.1),
                               random_bits((0,), torch.float32)], ids=["bf16", "blocky", "f64", "empty"])
def test_backends_write_identical_bytes_and_decode_each_other(x):
    a = RLE.compress(x, backend="torch")
    b = RLE.compress(x, backend="triton")
    assert torch.equal(a.data, b.data)
    assert_bit_equal(RLE.decompress(a, backend="triton"), x)
    assert_bit_equal(RLE.decompress(b, backend="torch"), x)


# (3, 128) in the quick run: several programs, each looping; the rest with the slow tests
@pytest.mark.parametrize("grid,block", [pytest.param(1, 32, marks=pytest.mark.slow),
                                        pytest.param(2, 64, marks=pytest.mark.slow), (3, 128),
                                        pytest.param(1000, 256, marks=pytest.mark.slow)])
def test_launch_config_does_not_change_result(grid, block):
    x = blocky((5 * T + 3,), torch.float32, 0.5, run=50)
    config = cswap.LaunchConfig(grid=grid, block=block)
    blob = RLE.compress(x, config=config, backend="triton")
    assert torch.equal(blob.data, RLE.compress(x, backend="torch").data)
    assert_bit_equal(RLE.decompress(blob, config=config, backend="triton"), x)


@pytest.mark.parametrize("tile", [16, 64])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 63, 64, 65, 200])
def test_small_tiles_round_trip_through_the_header(tile, n):
    # The tile travels in the header: a buffer written with another tile decodes.
    x = random_bits((n,), torch.int16, 0.4).view(torch.int16)
    payload, num_runs, nnz = _encode(x, tile, "torch")
    assert torch.equal(_encode(x, tile, "triton")[0], payload)
    blob = cswap.Compressed.from_bytes(_wrap(payload, torch.int16, (n,), (tile, num_runs, nnz)))
    for backend in BACKENDS:
        assert_bit_equal(RLE.decompress(blob, backend=backend), x)


@pytest.mark.slow  # 7 s in the interpreter
def test_largest_tile_uses_all_16_bits():
    # starts and befores above 2**15: the uint16 fields must not sign-extend.
    tile = kr.MAX_TILE
    x = blocky((tile + 10,), torch.int8, 0.3, run=3).view(torch.int8)
    payload, num_runs, nnz = _encode(x, tile, "torch")
    assert torch.equal(_encode(x, tile, "triton")[0], payload)
    sec = kr.sections(payload, x.numel(), tile, num_runs, nnz, torch.int8)
    assert int(sec.starts.to(torch.int64).max()) > 1 << 15 and int(sec.befores.to(torch.int64).max()) > 1 << 15
    blob = cswap.Compressed.from_bytes(_wrap(payload, torch.int8, (x.numel(),), (tile, num_runs, nnz)))
    for backend in BACKENDS:
        assert_bit_equal(RLE.decompress(blob, backend=backend), x)


def test_kernel_contract_errors():
    with pytest.raises(ValueError, match="power of two"):
        kr.rle_compress_ref(torch.zeros(4, dtype=torch.int32), lambda n: None, tile=100)
    with pytest.raises(ValueError, match="1-D contiguous"):
        kr.rle_compress_ref(torch.zeros(4, dtype=torch.float32), lambda n: None)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs=st.lists(st.tuples(st.booleans(), st.integers(1, 3000)), max_size=8),
       width=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**16))
def test_property_round_trip(runs, width, seed):
    # Alternating zero / non-zero stretches of any length, across tile boundaries.
    g = torch.Generator().manual_seed(seed)
    dtype = {1: torch.uint8, 2: torch.float16, 4: torch.float32, 8: torch.float64}[width]
    parts = [torch.zeros(k, dtype=dtype) if zero else random_bits((k,), dtype, 0.0, generator=g)
             for zero, k in runs]
    x = torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
    blob = RLE.compress(x, backend="torch")
    assert_bit_equal(RLE.decompress(blob, backend="torch"), x)


@settings(max_examples=6, deadline=None)
@given(n=st.integers(0, 3 * T), sparsity=st.floats(0, 1), run=st.integers(1, 500))
def test_property_round_trip_triton(n, sparsity, run):
    x = blocky((n,), torch.int16, sparsity, run=run) if n else torch.empty(0, dtype=torch.int16)
    blob = RLE.compress(x, backend="triton")
    assert torch.equal(blob.data, RLE.compress(x, backend="torch").data)
    assert_bit_equal(RLE.decompress(blob, backend="triton"), x)


# -- corrupt buffers -------------------------------------------------------------


@pytest.fixture
def blob():
    return RLE.compress(blocky((2 * T + 9,), torch.float32, 0.5, run=100), backend="torch")


@pytest.mark.parametrize("meta,match", [
    ((T, 1, -1), "non-zeros"), ((T, 1, 10**9), "non-zeros"), ((T, 0, 5), "runs"), ((T, 6, 5), "runs"),
    ((T, -1, 5), "runs"), ((100, 1, 5), "power of two"), ((8, 1, 5), "power of two"),
    ((1 << 17, 1, 5), "power of two"), ((T, 3, 5), "payload is"),
])
def test_inconsistent_meta_raises_before_decoding(blob, meta, match):
    with pytest.raises(cswap.CorruptDataError, match="cswap.codecs.rle: .*" + match):
        cswap.Compressed.from_bytes(_wrap(blob.payload.clone(), blob.dtype, blob.shape, meta))


def test_header_dtype_itemsize_matches_payload():
    x = random_bits((100,), torch.float64, 0.5)
    blob = RLE.compress(x, backend="torch")
    with pytest.raises(cswap.CorruptDataError, match="payload is"):
        cswap.Compressed.from_bytes(_wrap(blob.payload, torch.float32, (100,), blob.meta))


def _same_size_meta(blob, field, delta):
    """Meta with one total changed but the payload size unchanged (alignment slack)."""
    meta = list(blob.meta)
    meta[field] += delta
    n, itemsize = blob.shape.numel(), blob.dtype.itemsize
    assert kr.layout(n, *meta, itemsize)[-1] == blob.payload.numel(), "pick another input"
    return tuple(meta)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("field,delta", [(1, 1), (1, -1), (2, 1), (2, -1)],
                         ids=["runs+1", "runs-1", "nnz+1", "nnz-1"])
def test_wrong_totals_with_matching_size_raise(backend, field, delta):
    # Only the decoder can notice: the totals disagree with the offsets.
    x = torch.zeros(2 * T + 9, dtype=torch.int32)
    x[torch.arange(5) * 1500] = torch.arange(1, 6, dtype=torch.int32)
    x[100:102] = 7
    blob = RLE.compress(x, backend="torch")
    assert blob.meta == (T, 6, 7)
    bad = cswap.Compressed.from_bytes(_wrap(blob.payload.clone(), blob.dtype, blob.shape,
                                            _same_size_meta(blob, field, delta)))
    with pytest.raises(cswap.CorruptDataError, match="cswap.codecs.rle: tile"):
        RLE.decompress(bad, backend=backend)
    assert RLE.decompress(bad, backend=backend, check=False).shape == x.shape


def _alter(sec, how):
    """Edit one run record or offset in place; returns the tile it breaks."""
    s, b = sec.starts, sec.befores
    if how == "start_not_increasing":
        s[1] = s[0]
    elif how == "runs_touch":  # no zero between two runs: not maximal
        s[1] = s[0].to(torch.int64) + (b[1].to(torch.int64) - b[0].to(torch.int64))
    elif how == "first_before_nonzero":
        b[0] = 1
    elif how == "empty_run":
        b[1] = b[0]
    elif how == "befores_decrease":
        b[2] = 0
    elif how == "run_past_tile_end":
        s[sec.run_offsets[1] - 1] = T - 1
    elif how == "start_out_of_tile":
        s[0] = 65535
    elif how == "run_offset":
        sec.run_offsets[1] += 1
    elif how == "run_offset_negative":
        sec.run_offsets[1] = -(2**40)
    elif how == "value_offset":  # more non-zeros than tile 0 has elements
        sec.value_offsets[1] += T
    elif how == "value_offset_huge":
        sec.value_offsets[2] = 2**62
    elif how == "first_offset":
        sec.run_offsets[0] = 1
    else:
        raise AssertionError(how)


ALTERATIONS = ["start_not_increasing", "runs_touch", "first_before_nonzero", "empty_run", "befores_decrease",
               "run_past_tile_end", "start_out_of_tile", "run_offset", "run_offset_negative", "value_offset",
               "value_offset_huge", "first_offset"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ALTERATIONS)
def test_altered_payload_raises(blob, backend, how):
    payload = blob.payload.clone()
    sec = _sections(blob, payload)
    assert int(sec.run_offsets[1]) >= 3  # tile 0 has several runs to edit
    _alter(sec, how)
    assert not torch.equal(payload, blob.payload)
    bad = cswap.Compressed.from_bytes(_wrap(payload, blob.dtype, blob.shape, blob.meta))
    with pytest.raises(cswap.CorruptDataError, match="cswap.codecs.rle: tile"):
        RLE.decompress(bad, backend=backend)
    # check=False skips the report but still never reads out of bounds
    assert RLE.decompress(bad, backend=backend, check=False).shape == blob.shape


def test_random_corruption_is_caught_alike_and_never_crashes():
    # Small tiles, random bytes overwritten anywhere: both decoders agree on
    # whether the payload is consistent, and agree on the output when it is.
    rng = random.Random(0)
    tile = 16
    for _ in range(40):
        n = rng.randint(1, 90)
        x = random_bits((n,), torch.int16, rng.random()).view(torch.int16)
        payload, num_runs, nnz = _encode(x, tile, "torch")
        altered = payload.clone()
        for _ in range(rng.randint(1, 3)):
            altered[rng.randrange(altered.numel())] = rng.randrange(256)
        ref, ref_status = kr.rle_decompress_ref(altered, n, tile, num_runs, nnz, torch.int16)
        out, status = kr.rle_decompress(altered, n, tile, num_runs, nnz, torch.int16,
                                        cswap.LaunchConfig(grid=2, block=32))
        assert bool(ref_status.any()) == bool(status.any())
        if not status.any():
            assert torch.equal(out, ref)
        if torch.equal(altered, payload):
            assert_bit_equal(out, x)


# -- GPU ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("run", [1, 256])
def test_gpu_large_round_trip(dtype, run):
    n = (64 << 20) // torch.empty((), dtype=dtype).element_size()
    x = blocky((n,), dtype, 0.5, run=run, device="cuda")
    blob = RLE.compress(x)
    assert torch.equal(blob.data, RLE.compress(x, backend="torch").data)
    assert_bit_equal(RLE.decompress(blob), x)
    assert_bit_equal(RLE.decompress(blob, backend="torch"), x)


@pytest.mark.gpu
def test_gpu_more_than_2_31_elements():
    n = 2**31 + 4099
    if torch.cuda.get_device_properties(0).total_memory < 8 * n:
        pytest.skip("needs about 8 bytes of GPU memory per element")
    x = torch.zeros(n, dtype=torch.int8, device="cuda")
    x[-5:] = torch.tensor([1, 2, 0, 4, 5], dtype=torch.int8)
    x[2**31 - 3: 2**31 + 3] = 7
    blob = RLE.compress(x)
    assert blob.meta == (T, 4, 10)  # 2**31 is a tile boundary: that run is cut in two
    sec = _sections(blob)
    assert sec.starts.cpu().to(torch.int64).tolist() == [T - 3, 0, T - 2, 1]
    del x
    y = RLE.decompress(blob)
    assert y[2**31 - 4: 2**31 + 4].tolist() == [0, 7, 7, 7, 7, 7, 7, 0]
    assert y[-6:].tolist() == [0, 1, 2, 0, 4, 5]
    assert int((y != 0).sum()) == 10
