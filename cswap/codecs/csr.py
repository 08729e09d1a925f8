"""CSR codec: row pointers, column indices and non-zeros of the tensor's 2-D
view (rows, cols) = (shape[0], numel // shape[0]) (format in cswap.kernels.csr).

Header meta: (rows, cols, nnz, index_bytes).
"""

from __future__ import annotations

import torch

from ..errors import CorruptDataError
from ..kernels import csr as kernels
from .base import Codec

__all__ = ["CSR", "CODEC"]

_WHERE = "cswap.codecs.csr"
_STATUS_BITS = tuple(kernels.STATUS)


class CSR(Codec):
    name = "csr"
    n_meta = 4

    def _encode_scratch_bytes(self, numel, itemsize):
        tiles = -(-numel // kernels.TILE)
        return 16 * (tiles + 1)  # ZVC's count pass

    def _encode(self, words, shape, config, backend, alloc):
        rows, cols = kernels.view_2d(shape)
        if backend == "triton":
            nnz = kernels.csr_compress(words, rows, cols, alloc, config)
        else:
            nnz = kernels.csr_compress_ref(words, rows, cols, alloc)
        return rows, cols, nnz, kernels.index_bytes_for(cols)

    def _check_meta(self, header):
        rows, cols, nnz, index_bytes = header.meta
        n = header.shape.numel()
        want_rows, want_cols = kernels.view_2d(header.shape)
        if (rows, cols) != (want_rows, want_cols):
            raise CorruptDataError(f"{_WHERE}: meta records a {rows} x {cols} view but shape "
                                   f"{tuple(header.shape)} views as {want_rows} x {want_cols}")
        if index_bytes != kernels.index_bytes_for(cols):
            raise CorruptDataError(f"{_WHERE}: column indices of {index_bytes} bytes recorded for {cols} "
                                   f"columns (expected {kernels.index_bytes_for(cols)})")
        if not 0 <= nnz <= n:
            raise CorruptDataError(f"{_WHERE}: {nnz} non-zeros recorded for a tensor of {n} elements")
        expected = kernels.layout(rows, nnz, index_bytes, header.dtype.itemsize)[3]
        if header.payload_nbytes != expected:
            raise CorruptDataError(f"{_WHERE}: payload is {header.payload_nbytes} bytes but {rows} rows with "
                                   f"{nnz} non-zeros of {header.dtype.itemsize} bytes take {expected}")

    def _decode(self, payload, header, word_dtype, config, backend, out):
        rows, cols, nnz, index_bytes = header.meta
        if backend == "triton":
            words, status = kernels.csr_decompress(payload, rows, cols, nnz, index_bytes, word_dtype, config, out=out)
        else:
            words, status = kernels.csr_decompress_ref(payload, rows, cols, nnz, index_bytes, word_dtype, out=out)
        return words, status

    def _raise_on_status(self, status, payload, header):
        _raise_on_status(status)


def _raise_on_status(status: torch.Tensor) -> None:
    """One host sync: which STATUS bits any tile reported."""
    bits = torch.tensor(_STATUS_BITS, dtype=torch.int8, device=status.device)
    found = ((status[:, None] & bits) != 0).any(0).tolist()
    problems = [kernels.STATUS[bit] for bit, hit in zip(_STATUS_BITS, found) if hit]
    if problems:
        raise CorruptDataError(f"{_WHERE}: the payload is inconsistent ({'; '.join(problems)}); "
                               f"it was altered or corrupted after compression")


CODEC = CSR()
