"""ZVC codec: bitmask of non-zeros plus the non-zeros (format in cswap.kernels.zvc).

Header meta: (tile, nnz).
"""

from __future__ import annotations

from ..errors import CorruptDataError
from ..kernels import zvc as kernels
from .base import Codec

__all__ = ["ZVC", "CODEC"]


class ZVC(Codec):
    name = "zvc"
    n_meta = 2
    bounded = True  # (its one-pass encoder stops writing values at the end of the room)

    def _encode_scratch_bytes(self, numel, itemsize):
        tiles = -(-numel // kernels.TILE)
        # int64 per tile and one more: the count pass's counts and their prefix sums (encode),
        # the one-pass encoder's tile states (both paths)
        return 24 * (tiles + 1)

    def _encode(self, words, shape, config, backend, alloc):
        if backend == "triton":
            nnz = kernels.zvc_compress(words, alloc, config)
        else:
            nnz = kernels.zvc_compress_ref(words, alloc)
        return kernels.TILE, nnz

    def _launch_scratch_bytes(self, numel, itemsize):
        return 8 * (-(-numel // kernels.TILE) + 1)  # the one-pass encoder's tile states

    def _reserve_nbytes(self, numel, itemsize):
        return kernels.reserve_nbytes(numel, kernels.TILE, itemsize)

    def _min_room_nbytes(self, numel, itemsize):
        return kernels.min_room_nbytes(numel, kernels.TILE)

    def _launch(self, words, shape, config, backend, reserved, sizes):
        if backend == "triton":
            kernels.zvc_launch(words, reserved, config, sizes=sizes)
            return None
        return kernels.zvc_launch_ref(words, reserved)

    def _meta_from(self, words, numel, itemsize):
        (nnz,) = words
        if not 0 <= nnz <= numel:  # (what the kernels counted: never outside [0, numel])
            raise RuntimeError(f"cswap.codecs.zvc: the device counted {nnz} non-zeros in {numel} elements")
        return (kernels.TILE, nnz), kernels.layout(numel, kernels.TILE, nnz, itemsize)[3]

    def _check_meta(self, header):
        tile, nnz = header.meta
        n = header.shape.numel()
        where = "cswap.codecs.zvc"
        # The kernels hold one tile in registers: a power of two (tl.arange's rule) of
        # at least one 32-bit mask word, and at most 2**16 as for RLE.
        if tile < 32 or tile > 1 << 16 or tile & (tile - 1):
            raise CorruptDataError(f"{where}: tile size {tile} is not a power of two in [32, 65536]")
        if not 0 <= nnz <= n:
            raise CorruptDataError(f"{where}: {nnz} non-zeros recorded for a tensor of {n} elements")
        expected = kernels.layout(n, tile, nnz, header.dtype.itemsize)[3]
        if header.payload_nbytes != expected:
            raise CorruptDataError(f"{where}: payload is {header.payload_nbytes} bytes but {n} elements "
                                   f"with {nnz} non-zeros take {expected}")

    def _decode(self, payload, header, word_dtype, config, backend, out):
        tile, nnz = header.meta
        n = header.shape.numel()
        if backend == "triton":
            words, status = kernels.zvc_decompress(payload, n, tile, nnz, word_dtype, config, out)
        else:
            words, status = kernels.zvc_decompress_ref(payload, n, tile, nnz, word_dtype, out)
        return words, status

    def _raise_on_status(self, status, payload, header):
        if status.numel() and bool(status.any()):
            tile_index = int(status.nonzero()[0, 0])
            raise CorruptDataError(f"cswap.codecs.zvc: tile {tile_index} of {status.numel()} is inconsistent: "
                                   f"its mask bits disagree with its recorded offsets (the payload was altered)")


CODEC = ZVC()
