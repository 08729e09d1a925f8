"""`Compressed`: one contiguous uint8 buffer = header + payload.

Header (little-endian, version 1; its size is a multiple of 16 so the payload
is 16-byte aligned and codecs can view its sections as wider integers):

    offset  size        field
    0       4           magic b"CSWZ"
    4       1           format version (1)
    5       1           codec id (1 zvc, 2 rle, 3 csr, 4 lz4, 5 zans)
    6       1           dtype code (_DTYPES below)
    7       1           ndim (0..64)
    8       2           header size in bytes
    10      2           number of codec meta fields (int64 each)
    12      4           CRC-32 of the header, computed with this field zeroed
    16      8           payload size in bytes (the buffer is header + payload, exactly)
    24      8           numel
    32      8 * ndim    shape (int64 each)
    ...     8 * n_meta  codec meta fields (int64 each; meaning per codec)
    ...                 zero padding to a multiple of 16
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from math import prod

import torch

from ..errors import CorruptDataError

__all__ = ["Compressed"]

MAGIC = b"CSWZ"
VERSION = 1
_FIXED = struct.Struct("<4sBBBBHHIQQ")  # 32 bytes
MAX_NDIM = 64

# Stable codes: appending is fine, reordering breaks old buffers.
_DTYPE_NAMES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
    "float64", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz",
]
_DTYPES = {code: getattr(torch, name) for code, name in enumerate(_DTYPE_NAMES) if hasattr(torch, name)}
_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}
SUPPORTED_DTYPES = tuple(_DTYPES.values())

# Codec ids live here so that parsing a buffer needs no codec imported.
CODEC_IDS = {"zvc": 1, "rle": 2, "csr": 3, "lz4": 4, "zans": 5}
_CODEC_NAMES = {i: n for n, i in CODEC_IDS.items()}


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES[dtype]


def header_size(ndim: int, n_meta: int) -> int:
    raw = _FIXED.size + 8 * (ndim + n_meta)
    return (raw + 15) // 16 * 16


def pack_header(codec: str, dtype: torch.dtype, shape: tuple[int, ...], meta: tuple[int, ...],
                payload_nbytes: int) -> bytes:
    size = header_size(len(shape), len(meta))
    fixed = _FIXED.pack(MAGIC, VERSION, CODEC_IDS[codec], _DTYPE_CODES[dtype], len(shape), size,
                        len(meta), 0, payload_nbytes, prod(shape))
    body = fixed + struct.pack(f"<{len(shape) + len(meta)}q", *shape, *meta)
    body += bytes(size - len(body))
    crc = zlib.crc32(body)
    return body[:12] + struct.pack("<I", crc) + body[16:]


@dataclass(frozen=True)
class Header:
    codec: str
    dtype: torch.dtype
    shape: torch.Size
    meta: tuple[int, ...]
    header_nbytes: int
    payload_nbytes: int

    def to_bytes(self) -> bytes:
        """The header as it starts a buffer (pack_header of these fields)."""
        return pack_header(self.codec, self.dtype, tuple(self.shape), self.meta, self.payload_nbytes)


def unpack_header(read, total_nbytes: int) -> Header:
    """Parse and validate a header. `read(n)` returns the buffer's first n bytes."""
    where = "cswap.Compressed"
    if total_nbytes < _FIXED.size:
        raise CorruptDataError(f"{where}: buffer is {total_nbytes} bytes, shorter than the "
                               f"{_FIXED.size}-byte fixed header; it is truncated or not a cswap buffer")
    magic, version, codec_id, dcode, ndim, hsize, n_meta, crc, payload, numel = _FIXED.unpack(read(_FIXED.size))
    if magic != MAGIC:
        raise CorruptDataError(f"{where}: bad magic {magic!r} (expected {MAGIC!r}); not a cswap buffer")
    if version != VERSION:
        raise CorruptDataError(f"{where}: format version {version} is not supported (this cswap reads "
                               f"version {VERSION}); compress it again with this version")
    if ndim > MAX_NDIM or hsize != header_size(ndim, n_meta):
        raise CorruptDataError(f"{where}: header size {hsize} does not match ndim={ndim} and "
                               f"{n_meta} meta fields (expected {header_size(min(ndim, MAX_NDIM), n_meta)})")
    if hsize > total_nbytes:
        raise CorruptDataError(f"{where}: header needs {hsize} bytes but the buffer has {total_nbytes}; truncated")
    raw = read(hsize)
    if zlib.crc32(raw[:12] + bytes(4) + raw[16:]) != crc:
        raise CorruptDataError(f"{where}: header checksum mismatch; the header bytes were altered")
    if codec_id not in _CODEC_NAMES:
        raise CorruptDataError(f"{where}: unknown codec id {codec_id}")
    if dcode not in _DTYPES:
        raise CorruptDataError(f"{where}: unknown dtype code {dcode}")
    if hsize + payload != total_nbytes:
        what = "truncated" if hsize + payload > total_nbytes else "overlong"
        raise CorruptDataError(f"{where}: buffer is {total_nbytes} bytes but its header says "
                               f"{hsize} + {payload} payload bytes; it is {what}")
    fields = struct.unpack_from(f"<{ndim + n_meta}q", raw, _FIXED.size)
    shape, meta = fields[:ndim], fields[ndim:]
    if any(d < 0 for d in shape) or prod(shape) != numel:
        raise CorruptDataError(f"{where}: shape {tuple(shape)} is inconsistent with numel {numel}")
    return Header(_CODEC_NAMES[codec_id], _DTYPES[dcode], torch.Size(shape), tuple(meta), hsize, payload)


@dataclass(frozen=True, eq=False)
class Compressed:
    """A compressed tensor: `data` holds header and payload in one uint8 tensor.

    Build one with `codec.compress(x)` or `Compressed.from_bytes(data)`; move
    it with `.to(device)` (one copy); restore it with `codec.decompress(blob)`
    or `blob.decompress()`.
    """

    data: torch.Tensor
    _header: Header = field(repr=False)

    @property
    def codec(self) -> str:
        return self._header.codec

    @property
    def shape(self) -> torch.Size:
        return self._header.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._header.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def uncompressed_nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    @property
    def ratio(self) -> float:
        """Uncompressed over compressed size (>1 means smaller)."""
        return self.uncompressed_nbytes / self.nbytes

    @property
    def payload(self) -> torch.Tensor:
        return self.data[self._header.header_nbytes:]

    @property
    def meta(self) -> tuple[int, ...]:
        return self._header.meta

    def to(self, device=None, non_blocking: bool = False, out: torch.Tensor | None = None) -> "Compressed":
        """Copy the bytes to `device`, or into the front of `out` (a 1-D uint8
        buffer of at least `nbytes`, e.g. from a pinned pool: then
        non_blocking=True makes the copy asynchronous). One copy either way."""
        if out is None:
            return Compressed(self.data.to(device, non_blocking=non_blocking), self._header)
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < self.nbytes:
            raise ValueError(f"cswap.Compressed.to: out must be a 1-D uint8 tensor of at least {self.nbytes} "
                             f"bytes, got {out.dtype} of shape {tuple(out.shape)}")
        dst = out[: self.nbytes]
        dst.copy_(self.data, non_blocking=non_blocking)
        return Compressed(dst, self._header)

    def pin_memory(self) -> "Compressed":
        return Compressed(self.data.pin_memory(), self._header)

    def decompress(self, **kwargs) -> torch.Tensor:
        from . import get
        return get(self.codec).decompress(self, **kwargs)

    @classmethod
    def from_bytes(cls, data) -> "Compressed":
        """Rebuild from the bytes of `.data` (a 1-D uint8 tensor on any device, or
        bytes-like), validating the header and every size in it."""
        if isinstance(data, (bytes, bytearray, memoryview)):
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
            got = f"{data.dtype} tensor of shape {tuple(data.shape)}" if isinstance(data, torch.Tensor) \
                else type(data).__name__
            raise TypeError(f"cswap.Compressed.from_bytes: expected a 1-D uint8 tensor or bytes, got {got}")
        data = data.contiguous()

        def read(n):
            return data[:n].cpu().numpy().tobytes()

        header = unpack_header(read, data.numel())
        from . import get
        get(header.codec).check_meta(header)
        return cls(data, header)

    def __repr__(self) -> str:
        return (f"Compressed(codec={self.codec!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"nbytes={self.nbytes}, ratio={self.ratio:.2f}, device={self.device})")
