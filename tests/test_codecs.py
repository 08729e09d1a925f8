"""The codec API contract, the same for every registered codec."""

import pytest
import torch

import cswap
from bitdata import assert_bit_equal, random_bits

NAMES = cswap.codecs.names()


def test_registry():
    assert NAMES == ("zvc", "rle", "csr", "lz4", "zans")
    for name in NAMES:
        codec = cswap.codecs.get(name)
        assert codec.name == name and cswap.codecs.get(name) is codec
    with pytest.raises(ValueError, match="unknown codec 'gzip'; available: zvc, rle, csr, lz4, zans"):
        cswap.codecs.get("gzip")


def test_public_api():
    assert set(cswap.__all__) >= {"codecs", "Compressed", "CorruptDataError", "LaunchConfig"}
    assert issubclass(cswap.CorruptDataError, ValueError)
    assert callable(cswap.codecs.lz4.compress_block) and callable(cswap.codecs.lz4.decompress_block)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_blob_properties_and_round_trip(name, backend):
    x = random_bits((4, 33), torch.bfloat16, 0.6)
    codec = cswap.codecs.get(name)
    blob = codec.compress(x, backend=backend)
    assert isinstance(blob, cswap.Compressed)
    assert (blob.codec, blob.shape, blob.dtype, blob.device) == (name, x.shape, x.dtype, x.device)
    assert blob.data.dtype == torch.uint8 and blob.data.dim() == 1 and blob.data.is_contiguous()
    assert blob.nbytes == blob.data.numel()
    assert name in repr(blob)
    assert_bit_equal(codec.decompress(blob, backend=backend), x)
    assert_bit_equal(blob.decompress(), x)
    assert_bit_equal(cswap.codecs.decompress(blob), x)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_encode_and_decode_into_a_given_buffer(name, backend):
    """The runtime's entry points: the payload and header apart (header bytes written
    on the host), and decoding into memory the caller allocated."""
    x = random_bits((5, 37), torch.float16, 0.5)
    codec = cswap.codecs.get(name)
    given = []
    payload, header = codec.encode(x, backend=backend, alloc=lambda n: given.append(torch.empty(n, dtype=torch.uint8))
                                   or given[0])
    assert payload is given[0] and header.payload_nbytes == payload.numel()
    blob = codec.compress(x, backend=backend)
    assert bytes(blob.data[: header.header_nbytes].tolist()) == header.to_bytes()
    assert torch.equal(blob.payload, payload)
    out = torch.full((x.numel() * 2,), 0xA5, dtype=torch.uint8)  # garbage: every byte must be written
    y, check = codec.decode(payload, header, out=out, backend=backend)
    check.raise_if_bad()
    assert y.data_ptr() == out.data_ptr()
    assert_bit_equal(y, x)
    out.fill_(0xA5)  # a whole blob, as vdnnpp's host copies: decompress into the given buffer too
    y = codec.decompress(blob, backend=backend, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert_bit_equal(y, x)
    with pytest.raises(ValueError, match="out must be a contiguous 1-D uint8 tensor of 370 bytes"):
        codec.decode(payload, header, out=torch.empty(369, dtype=torch.uint8), backend=backend)
    with pytest.raises(ValueError, match="out must be a contiguous 1-D uint8 tensor of 370 bytes"):
        codec.decompress(blob, backend=backend, out=torch.empty(5, 74, dtype=torch.uint8))
    with pytest.raises(cswap.CorruptDataError, match="payload is"):
        codec.decode(payload[:-1], header, backend=backend)


@pytest.mark.parametrize("name", NAMES)
def test_from_bytes_and_to_round_trip(name):
    x = random_bits((3, 4, 5), torch.float32, 0.5)
    codec = cswap.codecs.get(name)
    blob = codec.compress(x)
    moved = blob.to("cpu")
    assert moved.codec == name and torch.equal(moved.data, blob.data)
    for data in (blob.data.clone(), bytes(blob.data.tolist())):
        rebuilt = cswap.Compressed.from_bytes(data)
        assert (rebuilt.codec, rebuilt.shape, rebuilt.dtype) == (name, x.shape, x.dtype)
        assert_bit_equal(codec.decompress(rebuilt), x)


# (LZ4 in the interpreter is the longest: slow; its own tests read unaligned input)
@pytest.mark.parametrize("backend,name", [
    pytest.param(backend, name, marks=pytest.mark.slow if (name, backend) == ("lz4", "triton") else (),
                 id=f"{backend}-{name}") for backend in ("torch", "triton") for name in NAMES])
def test_buffer_at_an_unaligned_address_decodes(name, backend):
    x = random_bits((4, 50), torch.float64, 0.5)
    blob = cswap.codecs.get(name).compress(x, backend=backend)
    data = torch.cat([torch.zeros(3, dtype=torch.uint8), blob.data])[3:]  # payload at an odd address
    rebuilt = cswap.Compressed.from_bytes(data)
    assert rebuilt.payload.data_ptr() % 16 != 0
    assert_bit_equal(rebuilt.decompress(backend=backend), x)
    pool = torch.zeros(blob.nbytes + 5, dtype=torch.uint8)
    assert_bit_equal(blob.to(out=pool[5:]).decompress(backend=backend), x)


@pytest.mark.parametrize("name", NAMES)
def test_non_contiguous_input_is_copied(name):
    base = random_bits((6, 10), torch.float16, 0.5)
    x = base.t()[::2]
    assert not x.is_contiguous()
    assert_bit_equal(cswap.codecs.get(name).decompress(cswap.codecs.get(name).compress(x)), x.contiguous())


@pytest.mark.parametrize("name", NAMES)
def test_requires_grad_input_is_detached(name):
    x = torch.randn(50, requires_grad=True)
    y = cswap.codecs.get(name).decompress(cswap.codecs.get(name).compress(x))
    assert not y.requires_grad and torch.equal(y, x.detach())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad,exc,match", [
    (torch.zeros(3, dtype=torch.complex64), TypeError, "not supported"),
    (torch.zeros(3, 3).to_sparse(), TypeError, "dense"),
    (torch.zeros(3, device="meta"), ValueError, "meta"),
    ([1.0, 2.0], TypeError, "torch.Tensor"),
], ids=["complex", "sparse", "meta", "list"])
def test_unsupported_input_raises_clearly(name, bad, exc, match):
    with pytest.raises(exc, match=match):
        cswap.codecs.get(name).compress(bad)


def test_bad_backend_and_config_raise():
    codec = cswap.codecs.get("zvc")
    with pytest.raises(ValueError, match="backend must be one of"):
        codec.compress(torch.zeros(3), backend="cuda")
    with pytest.raises(TypeError, match="LaunchConfig"):
        codec.compress(torch.zeros(3), backend="triton", config=(1, 128))
    with pytest.raises(ValueError, match="grid"):
        cswap.LaunchConfig(grid=0)
    with pytest.raises(ValueError, match="block"):
        cswap.LaunchConfig(grid=1, block=96)
    assert cswap.LaunchConfig(grid=8, block=256).num_warps == 8


def test_decompress_checks_codec_and_type():
    blob = cswap.codecs.get("zvc").compress(torch.ones(4))
    with pytest.raises(ValueError, match="written by codec 'zvc'"):
        cswap.codecs.get("rle").decompress(blob)
    with pytest.raises(TypeError, match="from_bytes"):
        cswap.codecs.get("zvc").decompress(blob.data)


def test_from_bytes_rejects_garbage():
    with pytest.raises(cswap.CorruptDataError, match="magic"):
        cswap.Compressed.from_bytes(torch.zeros(64, dtype=torch.uint8))
    with pytest.raises(cswap.CorruptDataError, match="shorter"):
        cswap.Compressed.from_bytes(b"CSWZ")
    with pytest.raises(TypeError, match="1-D uint8"):
        cswap.Compressed.from_bytes(torch.zeros(64, dtype=torch.int32))


@pytest.mark.parametrize("name", NAMES)
def test_altered_header_byte_anywhere_raises(name):
    blob = cswap.codecs.get(name).compress(random_bits((2, 50), torch.float32, 0.5))
    hsize = blob.data.numel() - blob.payload.numel()
    for i in range(hsize):
        data = blob.data.clone()
        data[i] ^= 0x41
        with pytest.raises(cswap.CorruptDataError):
            cswap.Compressed.from_bytes(data)


@pytest.mark.parametrize("name", NAMES)
def test_every_truncation_raises(name):
    blob = cswap.codecs.get(name).compress(random_bits((300,), torch.int16, 0.5))
    for cut in range(0, blob.nbytes, 7):
        with pytest.raises(cswap.CorruptDataError):
            cswap.Compressed.from_bytes(blob.data[:cut])


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_gpu_round_trip_and_cross_device(name):
    x = random_bits((1000, 37), torch.float32, 0.5, device="cuda")
    codec = cswap.codecs.get(name)
    blob = codec.compress(x)
    assert blob.device.type == "cuda"
    host = blob.to("cpu")
    assert_bit_equal(codec.decompress(host), x.cpu())
    assert_bit_equal(codec.decompress(host.to("cuda", non_blocking=True)), x)
    assert_bit_equal(codec.decompress(codec.compress(x.cpu()).to("cuda")), x)


def test_to_out_buffer_copies_into_its_front():
    x = random_bits((500,), torch.float32, 0.5)
    blob = cswap.codecs.get("zvc").compress(x)
    pool = torch.full((blob.nbytes + 100,), 7, dtype=torch.uint8)
    moved = blob.to(out=pool)
    assert moved.data.data_ptr() == pool.data_ptr() and int(pool[blob.nbytes]) == 7
    assert_bit_equal(moved.decompress(), x)
    with pytest.raises(ValueError, match="at least"):
        blob.to(out=torch.empty(blob.nbytes - 1, dtype=torch.uint8))


@pytest.mark.parametrize("name", NAMES)
def test_truncated_overlong_and_altered_buffers_raise(name):
    blob = cswap.codecs.get(name).compress(random_bits((3, 700), torch.float32, 0.5))
    with pytest.raises(cswap.CorruptDataError, match="truncated"):
        cswap.Compressed.from_bytes(blob.data[:-1])
    with pytest.raises(cswap.CorruptDataError, match="overlong"):
        cswap.Compressed.from_bytes(torch.cat([blob.data, blob.data[:3]]))
    with pytest.raises(cswap.CorruptDataError):
        cswap.Compressed.from_bytes(blob.data[:20])
    data = blob.data.clone()
    data[33] ^= 1  # inside the shape field: the header CRC catches it
    with pytest.raises(cswap.CorruptDataError, match="checksum"):
        cswap.Compressed.from_bytes(data)


def _overcommit_always() -> bool:
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


@pytest.mark.skipif(_overcommit_always(), reason="vm.overcommit_memory=1 grants any allocation until it is touched")
def test_header_claiming_more_memory_than_exists_raises_memory_error():
    """An all-zero CSR tensor of 2**42 int8 elements compresses to 96 bytes; decoding
    such a header must fail with a clear MemoryError, not an allocator RuntimeError."""
    from cswap.codecs.container import pack_header
    from cswap.kernels import csr as kc

    rows, cols = 1, 1 << 42
    meta = (rows, cols, 0, kc.index_bytes_for(cols))
    size = kc.layout(rows, 0, meta[3], 1)[3]
    blob = cswap.Compressed.from_bytes(pack_header("csr", torch.int8, (rows, cols), meta, size) + bytes(size))
    with pytest.raises(MemoryError, match=r"shape \(1, 4398046511104\).*more than cpu memory"):
        blob.decompress(backend="torch")


def _allocated_peak(fn) -> int:
    """The most bytes the CPU allocator held at once for what fn allocated (its profile)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted((e for e in prof.events() if e.cpu_memory_usage), key=lambda e: e.time_range.start):
        live += event.cpu_memory_usage
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "lz4" else n for n in NAMES])
@pytest.mark.parametrize("dtype, density", [(torch.float32, 0.5), (torch.bfloat16, 0.9), (torch.int8, 0.3)])
def test_encoders_allocate_at_most_their_declared_scratch(name, dtype, density):
    """Issue 26 §5: what the Triton encoder allocates beside its payload is bounded by
    encode_scratch_bytes, which the emulator charges and the budget planner reserves
    (measured here on the CPU allocator, the kernels interpreted; 4096 elements)."""
    x = random_bits((64, 64), dtype, density)
    codec = cswap.codecs.get(name)
    out = []
    peak = _allocated_peak(lambda: out.append(codec.encode(x, backend="triton")))
    payload, _ = out[0]
    scratch = peak - payload.numel()
    assert 0 < scratch <= codec.encode_scratch_bytes(x.numel(), x.element_size()), (scratch, name)


@pytest.mark.parametrize("name", ["zvc", "zans"])
@pytest.mark.parametrize("dtype, density", [(torch.float32, 0.5), (torch.bfloat16, 1.0)])
def test_launches_allocate_at_most_their_declared_scratch(name, dtype, density):
    """What launch_into allocates beside its reserved buffer and size words is bounded by
    launch_scratch_bytes, which the runtime charges while the encode runs."""
    x = random_bits((64, 64), dtype, density)
    codec = cswap.codecs.get(name)
    reserved = torch.empty(codec.reserve_nbytes(x.numel(), x.element_size()), dtype=torch.uint8)
    sizes = torch.empty(codec.size_words, dtype=torch.int64)
    codec.launch_into(x, reserved, sizes, backend="triton")  # (ZANS's cost table, made once per device)
    scratch = _allocated_peak(lambda: codec.launch_into(x, reserved, sizes, backend="triton"))
    assert 0 < scratch <= codec.launch_scratch_bytes(x.numel(), x.element_size()), (scratch, name)


@pytest.mark.parametrize("name", ["zvc", "lz4", "zans"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_launch_into_takes_only_size_words_its_kernels_can_write(name, backend):
    """The Triton launchers write the size words from their last kernel, straight into
    `sizes`: a tensor of another dtype, too short or strided is refused with a message
    (a kernel would write int64 words past it), and the words a good one gets are the
    ones encode's header holds."""
    codec = cswap.codecs.get(name)
    x = random_bits((40, 33), torch.float32, 0.5)
    reserved = torch.empty(codec.reserve_nbytes(x.numel(), x.element_size()), dtype=torch.uint8)
    for bad in (torch.zeros(codec.size_words, dtype=torch.int32), torch.zeros(codec.size_words - 1, dtype=torch.int64),
                torch.zeros(2 * (codec.size_words + 1), dtype=torch.int64)[::2]):
        with pytest.raises(ValueError, match="sizes must be a contiguous int64 tensor of at least"):
            codec.launch_into(x, reserved, bad, backend=backend)
    sizes = torch.full((codec.size_words + 1,), -7, dtype=torch.int64)  # (longer is fine: the rest untouched)
    codec.launch_into(x, reserved, sizes, backend=backend)
    payload, header = codec.encode(x, backend="torch")
    assert codec.launched(sizes[:-1].tolist(), tuple(x.shape), x.dtype) == header and sizes[-1] == -7
    assert torch.equal(reserved[: payload.numel()], payload)
