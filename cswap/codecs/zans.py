"""ZANS codec: a zero mask plus rANS-coded byte planes (format in cswap.kernels.zans).

Header meta: (tile, mode, symbols, coded_planes, streams_nbytes).

  tile           symbols per tile, a power of two in [32, 65536]
  mode           0 dense (every word is a symbol), 1 masked (a ZVC mask + the non-zeros)
  symbols        words coded per byte plane: numel in dense mode, the non-zeros in masked mode
  coded_planes   bit q set: byte plane q (q < element size) or, at q = element size, the
                 mask is rANS-coded (a frequency table in the payload); else stored raw
  streams_nbytes bytes of the tile streams section
"""

from __future__ import annotations

from ..errors import CorruptDataError
from ..kernels import zans as kernels
from .base import Codec

__all__ = ["ZANS", "CODEC"]

_WHERE = "cswap.codecs.zans"

_WHAT = {
    kernels.BAD_OFFSETS: "has a stream range starting at byte {pos} that is not an even range inside the "
                         "{streams}-byte streams section",
    kernels.BAD_LENGTH: "has a {pos}-byte stream, which is neither its raw length ({raw}) nor a coded length "
                        "its plane allows",
    kernels.BAD_FREQUENCIES: "belongs to a plane whose frequency table sums to {pos}, not {scale}",
    kernels.OVERRUN: "runs out of stream words at step {pos} (the decoder would read past the tile's stream)",
    kernels.BAD_STATE: "ends with lane {pos}'s rANS state != {low} (the stream or its states were altered)",
    kernels.TRAILING_WORDS: "leaves {pos} stream words unread",
}


def _plane_name(q: int, itemsize: int) -> str:
    return "zero mask" if q == itemsize else f"byte plane {q}"


class ZANS(Codec):
    name = "zans"
    n_meta = 5
    size_words = 5  # what launch_into leaves on the device: the meta, streams_nbytes included
    bounded = True  # (its pack kernel stops writing streams at the end of the room)

    def _encode_scratch_bytes(self, numel, itemsize):
        # into a buffer of the exact size: the launch into one reserved for the largest, then a copy
        return kernels.reserve_nbytes(numel, itemsize) + self._launch_scratch_bytes(numel, itemsize)

    def _launch_scratch_bytes(self, numel, itemsize):
        return kernels.launch_scratch_bytes(numel, itemsize)

    def _encode(self, words, shape, config, backend, alloc):
        if backend == "triton":
            return kernels.zans_compress(words, alloc, config)
        return kernels.zans_compress_ref(words, alloc)

    def _reserve_nbytes(self, numel, itemsize):
        return kernels.reserve_nbytes(numel, itemsize)

    def _min_room_nbytes(self, numel, itemsize):
        return kernels.min_room_nbytes(numel, itemsize)

    def _launch(self, words, shape, config, backend, reserved, sizes):
        if backend == "triton":
            kernels.zans_launch(words, reserved, config, sizes=sizes)
            return None
        return kernels.zans_launch_ref(words, reserved)

    def _meta_from(self, words, numel, itemsize):
        tile, mode, symbols, coded, streams_nbytes = words
        lo, hi = kernels.stream_bounds(numel, tile, mode, symbols, coded, itemsize) if 0 <= symbols <= numel \
            else (0, -1)
        if tile != kernels.TILE or mode not in (kernels.DENSE, kernels.MASKED) or not lo <= streams_nbytes <= hi:
            raise RuntimeError(f"cswap.codecs.zans: the encoder left size words {tuple(words)}, impossible "
                               f"for {numel} elements of {itemsize} bytes")
        return tuple(words), kernels.layout(numel, tile, mode, symbols, coded, streams_nbytes, itemsize)[3]

    def _check_meta(self, header):
        tile, mode, symbols, coded, streams_nbytes = header.meta
        n = header.shape.numel()
        itemsize = header.dtype.itemsize
        # The kernels step through a tile K = 32 symbols at a time and split it in halves
        # for the scratch: a power of two; at most 2**16 as for ZVC and RLE.
        if tile < kernels.MIN_TILE or tile > kernels.MAX_TILE or tile & (tile - 1):
            raise CorruptDataError(f"{_WHERE}: tile size {tile} is not a power of two in "
                                   f"[{kernels.MIN_TILE}, {kernels.MAX_TILE}]")
        if mode not in (kernels.DENSE, kernels.MASKED):
            raise CorruptDataError(f"{_WHERE}: mode {mode} is neither 0 (dense) nor 1 (masked)")
        if mode == kernels.DENSE and symbols != n:
            raise CorruptDataError(f"{_WHERE}: a dense buffer codes every element, but it records {symbols} "
                                   f"symbols for {n} elements")
        if not 0 <= symbols <= n:
            raise CorruptDataError(f"{_WHERE}: {symbols} non-zeros recorded for a tensor of {n} elements")
        planes = itemsize + (mode == kernels.MASKED)
        if not 0 <= coded < 1 << planes:
            raise CorruptDataError(f"{_WHERE}: coded-plane bits {coded:#x} name planes a {header.dtype} tensor "
                                   f"in {'masked' if mode else 'dense'} mode does not have ({planes} planes)")
        lo, hi = kernels.stream_bounds(n, tile, mode, symbols, coded, itemsize)
        if not lo <= streams_nbytes <= hi or streams_nbytes % 2:
            raise CorruptDataError(f"{_WHERE}: a streams section of {streams_nbytes} bytes is impossible here "
                                   f"(an even size from {lo} to {hi} bytes)")
        expected = kernels.layout(n, tile, mode, symbols, coded, streams_nbytes, itemsize)[3]
        if header.payload_nbytes != expected:
            raise CorruptDataError(f"{_WHERE}: payload is {header.payload_nbytes} bytes but its meta "
                                   f"{tuple(header.meta)} lays out {expected}")

    def _decode(self, payload, header, word_dtype, config, backend, out):
        n = header.shape.numel()
        if backend == "triton":
            return kernels.zans_decompress(payload, n, *header.meta, word_dtype, config, out)
        return kernels.zans_decompress_ref(payload, n, *header.meta, word_dtype, out)

    def _raise_on_status(self, status, payload, header):
        bad = status[:, 0].nonzero()
        if bad.numel() == 0:
            return
        row = int(bad[0, 0])
        code, pos = status[row].tolist()
        tile, mode, symbols, coded, streams_nbytes = header.meta
        n, itemsize = header.shape.numel(), header.dtype.itemsize
        tv, tm, total = kernels.geometry(n, tile, mode, symbols, itemsize)
        if row == total:
            if code == kernels.BAD_ENDS:
                what = (f"its tile offset table does not run from 0 to the streams section's {streams_nbytes} "
                        f"bytes (found {pos})")
            elif code == kernels.MASK_COUNT:
                what = f"its zero mask marks {pos} non-zeros but {symbols} were coded"
            else:
                what = f"has unknown decoder status {code} ({pos})"
            raise CorruptDataError(f"{_WHERE}: the buffer is inconsistent: {what}; the payload was altered or "
                                   f"corrupted")
        q = row // tv if row < itemsize * tv else itemsize
        index = row % tv if q < itemsize else row - itemsize * tv
        length = symbols if q < itemsize else kernels.mask_nbytes(n)
        first = index * tile
        count = min(tile, length - first)
        template = _WHAT.get(code, "has unknown decoder status {code} ({pos})")
        what = template.format(pos=pos, code=code, streams=streams_nbytes, raw=count + count % 2,
                               scale=kernels.PROB_SCALE, low=kernels.STATE_LOW)
        raise CorruptDataError(f"{_WHERE}: tile {row} of {total} ({_plane_name(q, itemsize)}, symbols {first} to "
                               f"{first + count - 1}) {what}; the payload was altered or corrupted")

    def _bad(self, status):
        return super()._bad(status[:, 0])  # column 1 is the position


CODEC = ZANS()
