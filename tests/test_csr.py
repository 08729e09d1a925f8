import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from math import prod

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cswap
from bitdata import DTYPES, FLOAT_DTYPES, assert_bit_equal, bits, blocky, random_bits, rewrap, special_values
from cswap.codecs.container import pack_header
from cswap.kernels import csr as kc

CSR = cswap.codecs.get("csr")
BACKENDS = ["torch", "triton"]
T = kc.TILE
# Tile boundaries in the flat elements (encoder) and in the rows / non-zeros (decoder).
SHAPES = [(), (0,), (1,), (31,), (T - 1,), (T,), (T + 1,), (3, 5, 7), (2, 0, 3), (0, 4), (3, 0),
          (T + 1, 1), (2, T // 2 + 1), (3, T + 5), (5, 3, 1, 2)]


def _alloc(store):
    def alloc(nbytes):
        store.append(torch.empty(nbytes, dtype=torch.uint8))
        return store[-1]
    return alloc


def _sections(blob):
    rows, _, nnz, index_bytes = blob.meta
    word = bits(torch.empty(0, dtype=blob.dtype)).dtype
    return kc.sections(blob.payload, rows, nnz, index_bytes, word)


def _sparse_csr(x2d):
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state"
        warnings.simplefilter("ignore", UserWarning)
        return x2d.to_sparse_csr()


# -- round trips ------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype(dtype, backend):
    x = random_bits((3, T // 2 + 77), dtype, sparsity=0.5)  # rows and tiles cross
    blob = CSR.compress(x, backend=backend)
    assert blob.codec == "csr" and blob.dtype == dtype and blob.shape == x.shape
    assert blob.meta == (3, T // 2 + 77, int((bits(x) != 0).sum()), 4)
    assert_bit_equal(CSR.decompress(blob, backend=backend), x)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shapes_identical_bytes_and_cross_decoding(shape):
    x = random_bits(shape, torch.float32, sparsity=0.3)
    a = CSR.compress(x, backend="torch")
    b = CSR.compress(x, backend="triton")
    assert torch.equal(a.data, b.data)
    assert a.meta[:2] == kc.view_2d(shape)
    for blob in (a, b):
        for backend in BACKENDS:
            assert_bit_equal(CSR.decompress(blob, backend=backend), x)


@pytest.mark.parametrize("shape,view", [((), (1, 1)), ((0,), (1, 0)), ((7,), (1, 7)), ((0, 5), (0, 5)),
                                        ((3, 0), (3, 0)), ((2, 3, 4), (2, 12)), ((4, 0, 2), (4, 0))])
def test_view_2d(shape, view):
    assert kc.view_2d(shape) == view
    assert CSR.compress(torch.zeros(shape), backend="torch").meta[:2] == view


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparsity", [0.0, 0.2, 0.5, 0.9, 1.0])
def test_round_trip_sparsity(sparsity, backend):
    x = random_bits((5, T // 3 + 7), torch.float16, sparsity=sparsity)
    blob = CSR.compress(x, backend=backend)
    assert blob.meta[2] == int((bits(x) != 0).sum())
    assert_bit_equal(CSR.decompress(blob, backend=backend), x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_survive(dtype, backend):
    x = special_values(dtype)
    x = torch.stack([bits(x), bits(x).flip(0)]).view(x.dtype)  # two rows
    blob = CSR.compress(x, backend=backend)
    assert blob.meta[2] == int((bits(x) != 0).sum())  # -0.0 is a non-zero bit pattern: kept
    assert_bit_equal(CSR.decompress(blob, backend=backend), x)


# -- the format ---------------------------------------------------------------------


def test_format_by_hand():
    x = torch.zeros(3, 5, dtype=torch.int16)
    x[0, 1], x[0, 4], x[2, 0], x[2, 2], x[2, 3] = 7, -1, 5, 9, 2
    for backend in BACKENDS:
        blob = CSR.compress(x, backend=backend)
        assert blob.meta == (3, 5, 5, 4)
        # crow 4 x 8 = 32 bytes; col 5 x 4 = 20 -> 32; values 5 x 2 = 10 -> 16
        assert blob.payload.numel() == 32 + 32 + 16
        crow, col, values = _sections(blob)
        assert crow.tolist() == [0, 2, 2, 5]
        assert col.dtype == torch.int32 and col.tolist() == [1, 4, 0, 2, 3]
        assert values.tolist() == [7, -1, 5, 9, 2]
        p = blob.payload
        assert p[32 + 20: 64].eq(0).all() and p[64 + 10:].eq(0).all()  # padding is zero
        assert p.data_ptr() % 16 == 0 and col.data_ptr() % 16 == 0 and values.data_ptr() % 16 == 0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4, 300), (1, 1000), (50, 2, 3), (700, 1)], ids=str)
def test_sections_equal_to_sparse_csr(dtype, shape):
    x = torch.relu(torch.randn(shape)).to(dtype)  # no -0.0: float zeros are all-zero bits
    assert not (bits(x) == bits(torch.tensor(-0.0, dtype=dtype))).any()
    rows, cols = kc.view_2d(shape)
    ref = _sparse_csr(x.reshape(rows, cols))
    for backend in BACKENDS:
        crow, col, values = _sections(CSR.compress(x, backend=backend))
        assert torch.equal(crow, ref.crow_indices())
        assert torch.equal(col.long(), ref.col_indices())
        assert_bit_equal(values.view(dtype), ref.values())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sections_equal_to_sparse_csr_of_integer_view(dtype):
    x = random_bits((6, 333), dtype, 0.6)  # -0.0 and NaNs included: the integer view keeps them
    ref = _sparse_csr(bits(x))
    crow, col, values = _sections(CSR.compress(x, backend="triton"))
    assert torch.equal(crow, ref.crow_indices()) and torch.equal(col.long(), ref.col_indices())
    assert torch.equal(values, ref.values())


def test_index_width():
    assert kc.index_bytes_for(2**31 - 1) == 4 and kc.index_bytes_for(2**31) == 8
    # A 1 x 2**31 view needs int64 columns; meta says so, checked without any data.
    shape, payload = (1, 2**31), kc.layout(1, 0, 8, 1)[3]
    good = pack_header("csr", torch.int8, shape, (1, 2**31, 0, 8), payload)
    cswap.Compressed.from_bytes(torch.cat([torch.frombuffer(bytearray(good), dtype=torch.uint8),
                                           torch.zeros(payload, dtype=torch.uint8)]))
    bad = pack_header("csr", torch.int8, shape, (1, 2**31, 0, 4), payload)
    with pytest.raises(cswap.CorruptDataError, match="column indices of 4 bytes"):
        cswap.Compressed.from_bytes(torch.cat([torch.frombuffer(bytearray(bad), dtype=torch.uint8),
                                               torch.zeros(payload, dtype=torch.uint8)]))


@pytest.mark.parametrize("tile", [kc.TILE, 64])
def test_int64_columns_path(tile):
    # The int64 column path, forced on a small view (a real one needs 2**31 columns).
    x = bits(random_bits((5, 3 * 64 + 1), torch.float32, 0.4)).reshape(-1)
    ref, tri = [], []
    nnz = kc.csr_compress_ref(x, 5, 193, _alloc(ref), index_bytes=8)
    assert kc.csr_compress(x, 5, 193, _alloc(tri), tile=tile, index_bytes=8) == nnz
    assert torch.equal(ref[0], tri[0])
    _, col, _ = kc.sections(ref[0], 5, nnz, 8, torch.int32)
    assert col.dtype == torch.int64 and torch.equal(col, _sparse_csr(x.view(5, 193)).col_indices())
    for out, status in (kc.csr_decompress(ref[0], 5, 193, nnz, 8, torch.int32, tile=tile),
                        kc.csr_decompress_ref(ref[0], 5, 193, nnz, 8, torch.int32, tile=tile)):
        assert torch.equal(out, x) and not status.any()
    with pytest.raises(ValueError, match="index_bytes=2 cannot hold"):
        kc.csr_compress_ref(torch.zeros(1, dtype=torch.int8), 1, 1, _alloc([]), index_bytes=2)


@pytest.mark.parametrize("grid,block", [(1, 32), (2, 64), (3, 128), (1000, 256)])
def test_launch_config_does_not_change_result(grid, block):
    x = random_bits((7, 3 * T // 7 + 5), torch.float32, 0.3)  # 4 encoder tiles, 4 decoder tiles
    config = cswap.LaunchConfig(grid=grid, block=block)
    blob = CSR.compress(x, config=config, backend="triton")
    assert torch.equal(blob.data, CSR.compress(x, backend="torch").data)
    assert_bit_equal(CSR.decompress(blob, config=config, backend="triton"), x)


@pytest.mark.parametrize("tile", [32, 64, 256])
def test_small_tiles_write_the_same_format(tile):
    # The format does not depend on TILE: small tiles put many tile boundaries
    # inside rows and across row starts.
    x = bits(random_bits((9, 70), torch.bfloat16, 0.5)).reshape(-1)
    ref, tri = [], []
    nnz = kc.csr_compress_ref(x, 9, 70, _alloc(ref))
    assert kc.csr_compress(x, 9, 70, _alloc(tri), cswap.LaunchConfig(3, 64), tile=tile) == nnz
    assert torch.equal(ref[0], tri[0])
    out, status = kc.csr_decompress(ref[0], 9, 70, nnz, 4, torch.int16, cswap.LaunchConfig(2), tile=tile)
    assert torch.equal(out, x) and status.numel() == -(-nnz // tile) + 1 and not status.any()


def test_csr_shrinks_sparse_data():
    x = blocky((64, 128), torch.float32, sparsity=0.9)
    blob = CSR.compress(x, backend="torch")
    nnz = blob.meta[2]
    assert blob.payload.numel() <= 8 * 65 + 8 * nnz + 32
    assert blob.nbytes < x.numel() * 4 * 0.25


def test_concurrent_compress_keeps_each_shape():
    # Compressing from several threads (as the runtime's offload worker may) keeps shapes apart.
    xs = [random_bits((r + 1, 40 - r), torch.float32, 0.5) for r in range(12)]
    with ThreadPoolExecutor(4) as pool:
        blobs = list(pool.map(lambda x: CSR.compress(x, backend="torch"), xs))
    for x, blob in zip(xs, blobs):
        assert blob.meta[:2] == tuple(x.shape)
        assert_bit_equal(CSR.decompress(blob), x)


# -- properties ---------------------------------------------------------------------


@st.composite
def _tensors(draw, max_numel=400):
    shape = tuple(draw(st.lists(st.integers(0, 9), max_size=4)))
    while prod(shape) > max_numel:
        shape = shape[1:]
    width = draw(st.sampled_from([1, 2, 4, 8]))
    raw = bytearray(draw(st.binary(min_size=prod(shape) * width, max_size=prod(shape) * width)))
    zero_every = draw(st.integers(1, 6))
    for i in range(0, len(raw), width * zero_every):  # inject zero elements
        raw[i: i + width] = bytes(width)
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.int64}[width]
    x = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    return x.reshape(shape)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=_tensors())
def test_property_round_trip(x):
    blob = CSR.compress(x, backend="torch")
    rows, cols = kc.view_2d(x.shape)
    ref = _sparse_csr(bits(x).reshape(rows, cols))
    crow, col, values = _sections(blob)
    assert torch.equal(crow, ref.crow_indices()) and torch.equal(col.long(), ref.col_indices())
    assert torch.equal(values, ref.values())
    assert_bit_equal(CSR.decompress(blob, backend="torch"), x)


@settings(max_examples=6, deadline=None)
@given(x=_tensors(max_numel=3 * T))
def test_property_round_trip_triton(x):
    blob = CSR.compress(x, backend="triton")
    assert torch.equal(blob.data, CSR.compress(x, backend="torch").data)
    assert_bit_equal(CSR.decompress(blob, backend="triton"), x)


# -- corrupt buffers -------------------------------------------------------------


@pytest.fixture
def blob():
    # Rows 0, 1, 3, 4, 5 hold 8 non-zeros at columns 0, 7, ..., 49; row 2 is empty.
    x = torch.zeros(6, 50, dtype=torch.int32)
    for r in (0, 1, 3, 4, 5):
        x[r, ::7] = torch.arange(1, 9, dtype=torch.int32) * (r + 1)
    blob = CSR.compress(x, backend="torch")
    assert _sections(blob)[0].tolist() == [0, 8, 16, 16, 24, 32, 40]
    return blob


@pytest.mark.parametrize("meta,match", [
    ((5, 60, 40, 4), "views as 6 x 50"), ((6, 51, 40, 4), "views as 6 x 50"), ((6, 50, 40, 8), "4 bytes|8 bytes"),
    ((6, 50, -1, 4), "-1 non-zeros"), ((6, 50, 301, 4), "301 non-zeros"), ((6, 50, 44, 4), "payload is"),
    ((6, 50, 40, 2), "2 bytes")])
def test_inconsistent_meta_raises_before_decoding(blob, meta, match):
    with pytest.raises(cswap.CorruptDataError, match=f"cswap.codecs.csr: .*({match})"):
        cswap.Compressed.from_bytes(rewrap(blob, meta=meta))


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_nnz_with_matching_size_raises(blob, backend):
    # 40 int32 columns and values take 160 bytes each; 37 non-zeros (148 -> 160)
    # keep the payload size, so only the decoder can notice.
    assert kc.layout(6, 37, 4, 4)[3] == blob.payload.numel()
    bad = cswap.Compressed.from_bytes(rewrap(blob, meta=(6, 50, 37, 4)))
    with pytest.raises(cswap.CorruptDataError, match="end at nnz"):
        CSR.decompress(bad, backend=backend)


def _corrupt(name, crow, col, values):
    if name == "crow_start":
        crow[0] = 1
    elif name == "crow_end":
        crow[-1] = 39
    elif name == "crow_decreases":
        crow[3] = 30  # > crow[4] = 24
    elif name == "crow_negative":
        crow[1] = -5
    elif name == "crow_huge":
        crow[4] = 2**62
    elif name == "col_too_big":
        col[3] = 50
    elif name == "col_negative":
        col[12] = -1
    elif name == "col_huge":
        col[39] = 2**31 - 1
    elif name == "col_repeats":
        col[3] = col[2]
    elif name == "col_decreases":
        col[10] = 0  # k = 10 is the third of row 1
    elif name == "everything":
        crow.view(torch.uint8).fill_(0xAB)
        col.view(torch.uint8).fill_(0xCD)
    elif name == "value":
        values[5] += 1  # not detectable: CSR carries no checksum


EXPECTED = {"crow_start": 1, "crow_end": 1, "crow_decreases": 2, "crow_negative": 2, "crow_huge": 2,
            "col_too_big": 8, "col_negative": 8, "col_huge": 8, "col_repeats": 16, "col_decreases": 16,
            "everything": 1}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(EXPECTED), ids=str)
def test_altered_payload_raises(blob, backend, name):
    payload = blob.payload.clone()
    _corrupt(name, *kc.sections(payload, 6, 40, 4, torch.int32))
    bad = cswap.Compressed.from_bytes(rewrap(blob, payload=payload))
    with pytest.raises(cswap.CorruptDataError, match=re.escape(kc.STATUS[EXPECTED[name]])):
        CSR.decompress(bad, backend=backend)
    # check=False skips the report but still never reads or writes out of bounds
    y = CSR.decompress(bad, backend=backend, check=False)
    assert y.shape == blob.shape


def test_altered_value_is_not_detected(blob):
    payload = blob.payload.clone()
    _corrupt("value", *kc.sections(payload, 6, 40, 4, torch.int32))
    y = CSR.decompress(cswap.Compressed.from_bytes(rewrap(blob, payload=payload)), backend="triton")
    assert (y != blob.decompress()).sum() == 1


def _status_bits(status):
    found = 0
    for s in status.tolist():
        found |= s
    return found


@pytest.mark.parametrize("name", list(EXPECTED), ids=str)
def test_backends_report_the_same_status(blob, name):
    payload = blob.payload.clone()
    _corrupt(name, *kc.sections(payload, 6, 40, 4, torch.int32))
    for tile in (kc.TILE, 16):
        out_t, status_t = kc.csr_decompress(payload, 6, 50, 40, 4, torch.int32, cswap.LaunchConfig(2), tile=tile)
        out_r, status_r = kc.csr_decompress_ref(payload, 6, 50, 40, 4, torch.int32, tile=tile)
        assert torch.equal(status_t, status_r)
        assert status_t.numel() == -(-40 // tile) + 1
        assert _status_bits(status_t) & EXPECTED[name]
        if not status_t[:-1].bitwise_and(2).any():  # rows are unambiguous: same elements written
            assert torch.equal(out_t, out_r)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
       data=st.data())
def test_property_random_corruption_is_safe(flips, data):
    x = random_bits((5, 23), torch.float16, 0.5)
    blob = CSR.compress(x, backend="torch")
    payload = blob.payload.clone()
    for pos, byte in flips:
        payload[pos % payload.numel()] = byte
    rows, cols, nnz, index_bytes = blob.meta
    out, status = kc.csr_decompress_ref(payload, rows, cols, nnz, index_bytes, torch.int16, tile=16)
    assert out.shape == (115,) and status.numel() == -(-max(nnz, rows) // 16) + 1
    bad = cswap.Compressed.from_bytes(rewrap(blob, payload=payload))
    try:
        y = CSR.decompress(bad, backend="torch")
    except cswap.CorruptDataError:
        assert status.any()
    else:
        assert not status.any() and torch.equal(bits(y).reshape(-1), out)
    if data.draw(st.integers(0, 9)) == 0:  # now and then, the Triton decoder agrees
        out_t, status_t = kc.csr_decompress(payload, rows, cols, nnz, index_bytes, torch.int16, tile=16)
        assert torch.equal(status_t, status)
        if not status[:-1].bitwise_and(2).any():
            assert torch.equal(out_t, out)


# -- GPU ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_gpu_large_round_trip(dtype):
    n = (64 << 20) // torch.empty((), dtype=dtype).element_size()
    x = random_bits((1000, n // 1000), dtype, 0.5, device="cuda")
    blob = CSR.compress(x)
    assert torch.equal(blob.data, CSR.compress(x, backend="torch").data)
    assert_bit_equal(CSR.decompress(blob), x)
    assert_bit_equal(CSR.decompress(blob, backend="torch"), x)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2**31 + 4099,), (2**21 + 3, 1024)], ids=["one_row_int64_cols", "many_rows"])
def test_gpu_more_than_2_31_elements(shape):
    n = prod(shape)
    if torch.cuda.get_device_properties(0).total_memory < 5 * n:
        pytest.skip("needs about 5 bytes of GPU memory per element")
    x = torch.zeros(n, dtype=torch.int8, device="cuda")
    x[-5:] = torch.tensor([1, 2, 0, 4, 5], dtype=torch.int8)
    x[2**31 - 3: 2**31 + 3] = 7
    x = x.view(shape)
    blob = CSR.compress(x)
    rows, cols = kc.view_2d(shape)
    assert blob.meta == (rows, cols, 10, 8 if cols > 2**31 - 1 else 4)
    assert torch.equal(blob.data, CSR.compress(x, backend="torch").data)
    assert torch.equal(CSR.decompress(blob), x)
