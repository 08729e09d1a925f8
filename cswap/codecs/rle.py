"""RLE codec: runs of non-zeros as (start, before) records plus the non-zeros
(format in cswap.kernels.rle).

Header meta: (tile, num_runs, nnz).
"""

from __future__ import annotations

from ..errors import CorruptDataError
from ..kernels import rle as kernels
from .base import Codec

__all__ = ["RLE", "CODEC"]


class RLE(Codec):
    name = "rle"
    n_meta = 3

    def _encode_scratch_bytes(self, numel, itemsize):
        tiles = -(-numel // kernels.TILE)
        return 32 * (tiles + 2)  # runs and non-zeros per tile (int64), and their prefix sums

    def _encode(self, words, shape, config, backend, alloc):
        if backend == "triton":
            num_runs, nnz = kernels.rle_compress(words, alloc, config)
        else:
            num_runs, nnz = kernels.rle_compress_ref(words, alloc)
        return kernels.TILE, num_runs, nnz

    def _check_meta(self, header):
        tile, num_runs, nnz = header.meta
        n = header.shape.numel()
        where = "cswap.codecs.rle"
        if tile < kernels.MIN_TILE or tile > kernels.MAX_TILE or tile & (tile - 1):
            raise CorruptDataError(f"{where}: tile size {tile} is not a power of two in "
                                   f"[{kernels.MIN_TILE}, {kernels.MAX_TILE}]")
        if not 0 <= nnz <= n:
            raise CorruptDataError(f"{where}: {nnz} non-zeros recorded for a tensor of {n} elements")
        # Every run holds at least one non-zero, and any non-zero is in a run.
        min_runs = 1 if nnz else 0
        if not min_runs <= num_runs <= nnz:
            raise CorruptDataError(f"{where}: {num_runs} runs recorded for {nnz} non-zeros; "
                                   f"expected between {min_runs} and {nnz}")
        expected = kernels.layout(n, tile, num_runs, nnz, header.dtype.itemsize)[-1]
        if header.payload_nbytes != expected:
            raise CorruptDataError(f"{where}: payload is {header.payload_nbytes} bytes but {n} elements "
                                   f"with {num_runs} runs and {nnz} non-zeros take {expected}")

    def _decode(self, payload, header, word_dtype, config, backend, out):
        tile, num_runs, nnz = header.meta
        n = header.shape.numel()
        if backend == "triton":
            words, status = kernels.rle_decompress(payload, n, tile, num_runs, nnz, word_dtype, config, out)
        else:
            words, status = kernels.rle_decompress_ref(payload, n, tile, num_runs, nnz, word_dtype, out)
        return words, status

    def _raise_on_status(self, status, payload, header):
        if status.numel() and bool(status.any()):
            tile_index = int(status.nonzero()[0, 0])
            raise CorruptDataError(f"cswap.codecs.rle: tile {tile_index} of {status.numel()} is inconsistent: "
                                   f"its run records disagree with each other or with the recorded offsets "
                                   f"(the payload was altered)")


CODEC = RLE()
