"""LZ4 codec: 16 KiB chunks, each a standard LZ4 block (format in cswap.kernels.lz4).

Header meta: (chunk, num_chunks, blocks_nbytes).

Besides the codec, `compress_block` and `decompress_block` read and write
single LZ4 blocks (the public block format, as `lz4.block` with
store_size=False), so cswap's blocks interoperate with any LZ4 library.
"""

from __future__ import annotations

import operator

import torch

from ..errors import CorruptDataError
from ..kernels import lz4 as kernels
from ..kernels.launch import LaunchConfig
from .base import Codec, resolve_backend

__all__ = ["LZ4", "CODEC", "compress_block", "decompress_block"]

_WHERE = "cswap.codecs.lz4"


def _describe(label: str, code: int, pos: int, block_len: int, chunk_len: int, start: int, end: int,
              blocks_nbytes: int) -> str:
    """The error message for one decoder status (code, position)."""
    if code == kernels.TRUNCATED:
        what = f"is truncated at byte {pos} of {block_len}"
    elif code == kernels.OFFSET_ZERO:
        what = f"has a match offset of 0 at byte {pos} of {block_len}"
    elif code == kernels.OFFSET_BEFORE_START:
        what = (f"has a match offset at byte {pos} of {block_len} that reaches before the start of "
                f"its {chunk_len}-byte chunk")
    elif code == kernels.OVERFLOW:
        what = (f"decodes past the end of its {chunk_len}-byte chunk (sequence at byte {pos} of "
                f"{block_len})")
    elif code == kernels.ENDS_WITH_MATCH:
        what = f"ends with a match at byte {pos} of {block_len}; an LZ4 block must end with literals"
    elif code == kernels.SHORT:
        what = f"decodes to {pos} bytes but its chunk has {chunk_len} (block of {block_len} bytes)"
    elif code == kernels.BAD_OFFSETS:
        what = (f"has block offsets [{start}, {end}) that are not an increasing range inside the "
                f"{blocks_nbytes}-byte blocks section")
    else:
        what = f"has unknown decoder status {code} at byte {pos}"
    return f"{_WHERE}: {label} {what}; the data was altered or is not LZ4"


def _raise_status(status: torch.Tensor, offsets: torch.Tensor, nbytes: int, chunk: int, blocks_nbytes: int,
                  single: bool = False) -> None:
    """Raise CorruptDataError for the first chunk with a non-zero status (one host sync)."""
    if status.numel() == 0:
        return
    bad = status[:, 0].nonzero()
    if bad.numel() == 0:
        return
    c = int(bad[0, 0])
    code, pos = status[c].tolist()
    start, end = offsets[c: c + 2].tolist()
    lo = min(max(start, 0), blocks_nbytes)
    block_len = min(max(end, lo), blocks_nbytes) - lo
    chunk_len = min(chunk, nbytes - c * chunk)
    label = "the block" if single else f"block {c} of {status.shape[0]}"
    raise CorruptDataError(_describe(label, code, pos, block_len, chunk_len, start, end, blocks_nbytes))


class LZ4(Codec):
    name = "lz4"
    n_meta = 3

    def _encode_scratch_bytes(self, numel, itemsize):
        # the launch's scratch, and room for the largest payload before it is copied to its size
        return self._launch_scratch_bytes(numel, itemsize) + self._reserve_nbytes(numel, itemsize)

    def _launch_scratch_bytes(self, numel, itemsize):
        return kernels.launch_scratch_bytes(numel * itemsize)

    def _reserve_nbytes(self, numel, itemsize):
        return kernels.reserve_nbytes(numel * itemsize)

    def _launch(self, words, shape, config, backend, reserved, sizes):
        data = words.view(torch.uint8)
        if backend == "triton":
            kernels.lz4_launch(data, reserved, config, sizes=sizes)
            return None
        return kernels.lz4_launch_ref(data, reserved)

    def _meta_from(self, words, numel, itemsize):
        (blocks_nbytes,) = words
        nbytes = numel * itemsize
        num_chunks = -(-nbytes // kernels.CHUNK)
        if not num_chunks <= blocks_nbytes <= num_chunks * kernels.block_bound(kernels.CHUNK):
            raise RuntimeError(f"cswap.codecs.lz4: the device wrote {blocks_nbytes} block bytes for "
                               f"{num_chunks} chunks")
        return (kernels.CHUNK, num_chunks, blocks_nbytes), kernels.layout(num_chunks, blocks_nbytes)[1]

    def _encode(self, words, shape, config, backend, alloc):
        data = words.view(torch.uint8)
        if backend == "triton":
            num_chunks, blocks_nbytes = kernels.lz4_compress(data, alloc, config)
        else:
            num_chunks, blocks_nbytes = kernels.lz4_compress_ref(data, alloc)
        return kernels.CHUNK, num_chunks, blocks_nbytes

    def _check_meta(self, header):
        chunk, num_chunks, blocks_nbytes = header.meta
        nbytes = header.shape.numel() * header.dtype.itemsize
        if not 1 <= chunk <= kernels.MAX_BLOCK_INPUT:
            raise CorruptDataError(f"{_WHERE}: chunk size {chunk} is not in [1, {kernels.MAX_BLOCK_INPUT}]")
        expected = -(-nbytes // chunk)
        if num_chunks != expected:
            raise CorruptDataError(f"{_WHERE}: {num_chunks} chunks recorded, but {nbytes} bytes in chunks of "
                                   f"{chunk} make {expected}")
        lo, hi = num_chunks, num_chunks * kernels.block_bound(chunk)
        if not lo <= blocks_nbytes <= hi:
            raise CorruptDataError(f"{_WHERE}: a blocks section of {blocks_nbytes} bytes is impossible for "
                                   f"{num_chunks} LZ4 blocks of at most {chunk} bytes each "
                                   f"(expected {lo} to {hi})")
        payload = kernels.layout(num_chunks, blocks_nbytes)[1]
        if header.payload_nbytes != payload:
            raise CorruptDataError(f"{_WHERE}: payload is {header.payload_nbytes} bytes but {num_chunks + 1} "
                                   f"block offsets and {blocks_nbytes} block bytes take {payload}")

    def _decode(self, payload, header, word_dtype, config, backend, out):
        chunk, num_chunks, blocks_nbytes = header.meta
        nbytes = header.shape.numel() * header.dtype.itemsize
        out8 = None if out is None else out.view(torch.uint8)
        if backend == "triton":
            out, status = kernels.lz4_decompress(payload, nbytes, chunk, num_chunks, blocks_nbytes, config,
                                                 out=out8)
        else:
            out, status = kernels.lz4_decompress_ref(payload, nbytes, chunk, num_chunks, blocks_nbytes, out=out8)
        return out.view(word_dtype), status

    def _raise_on_status(self, status, payload, header):
        chunk, num_chunks, blocks_nbytes = header.meta
        nbytes = header.shape.numel() * header.dtype.itemsize
        offsets = kernels.sections(payload, num_chunks, blocks_nbytes)[0]
        _raise_status(status, offsets, nbytes, chunk, blocks_nbytes)

    def _bad(self, status):
        return super()._bad(status[:, 0])  # column 1 is the byte position


CODEC = LZ4()


# -- single blocks ---------------------------------------------------------------------


def _check_uint8(x, what: str, where: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or x.dim() != 1:
        got = f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{where}: {what} must be a 1-D uint8 tensor, got {got}")


def compress_block(data: torch.Tensor, backend: str | None = "auto",
                   config: LaunchConfig | None = None) -> torch.Tensor:
    """Compress up to 65536 bytes (1-D uint8, any device) into one standard LZ4
    block, as `lz4.block.compress(data, store_size=False)` would accept back."""
    where = f"{_WHERE}.compress_block"
    _check_uint8(data, "data", where)
    n = data.numel()
    if n > kernels.MAX_BLOCK_INPUT:
        raise ValueError(f"{where}: one block holds at most {kernels.MAX_BLOCK_INPUT} bytes, got {n}; "
                         f"split the input, or compress the whole tensor with cswap.codecs.get('lz4')")
    backend = resolve_backend(backend or "auto", data.device, where)
    if n == 0:  # a lone token with no literals: LZ4's block for empty input
        return torch.zeros(1, dtype=torch.uint8, device=data.device)
    buf: list[torch.Tensor] = []

    def alloc(k: int) -> torch.Tensor:
        buf.append(torch.empty(k, dtype=torch.uint8, device=data.device))
        return buf[0]

    data = data.contiguous()
    chunk = kernels.MAX_BLOCK_INPUT
    if backend == "triton":
        num_chunks, blocks_nbytes = kernels.lz4_compress(data, alloc, config, chunk=chunk)
    else:
        num_chunks, blocks_nbytes = kernels.lz4_compress_ref(data, alloc, chunk=chunk)
    return kernels.sections(buf[0], num_chunks, blocks_nbytes)[1].clone()


def decompress_block(block: torch.Tensor, uncompressed_size: int, backend: str | None = "auto",
                     config: LaunchConfig | None = None) -> torch.Tensor:
    """Decode one standard LZ4 block (1-D uint8, any device) that holds exactly
    `uncompressed_size` bytes; raises CorruptDataError naming the problem and its
    byte position when the block is malformed or decodes to another size."""
    where = f"{_WHERE}.decompress_block"
    _check_uint8(block, "block", where)
    try:
        n = operator.index(uncompressed_size)
    except TypeError:
        raise TypeError(f"{where}: uncompressed_size must be an int, got "
                        f"{type(uncompressed_size).__name__}") from None
    if n < 0:
        raise ValueError(f"{where}: uncompressed_size must be >= 0, got {n}")
    backend = resolve_backend(backend or "auto", block.device, where)
    size = block.numel()
    off_blocks, total = kernels.layout(1, size)
    payload = torch.zeros(total, dtype=torch.uint8, device=block.device)
    payload[:16].view(torch.int64)[1].fill_(size)  # (fill_: no copy from pageable memory on CUDA)
    payload[off_blocks:] = block
    if backend == "triton":
        out, status = kernels.lz4_decompress(payload, n, n, 1, size, config)
    else:
        out, status = kernels.lz4_decompress_ref(payload, n, n, 1, size)
    _raise_status(status, kernels.sections(payload, 1, size)[0], n, n, size, single=True)
    return out
