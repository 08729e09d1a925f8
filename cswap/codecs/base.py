"""The `Codec` base class: input checks, integer views, backends, the container.

Besides `compress`/`decompress` (one self-describing buffer), `encode` and
`decode` serve the runtime: the payload alone on the device and the header on
the host (the runtime writes the header bytes into host memory itself, so no
host-to-device copy or stream sync is spent on them), and decoding into an
output the caller allocated where the tensor will be used. `launch` starts an
encode without reading its size back (a `Pending`: the runtime reads the sizes
later, on another thread, while the next tensor compresses).

A codec subclass implements three things on 1-D integer "word" tensors
(int8/16/32/64, the bit pattern of the user's tensor):

    _encode(words, shape, config, backend, alloc) -> meta tuple
        compress; `shape` is the user tensor's shape (CSR needs its 2-D
        view); call alloc(payload_nbytes) once to get the payload view
        (uint8, 16-byte aligned, on words' device) and fill it.
    _check_meta(header)
        raise CorruptDataError unless the meta fields agree with numel, the
        element size and the payload size. Runs before any kernel.
    _decode(payload, header, word_dtype, config, backend, out) -> (words, status)
        decompress (into `out`, 1-D words, when not None). Kernels never read or write out of bounds, whatever the
        payload holds; they report payload inconsistencies in `status`, a
        device tensor that is all zeros for a consistent payload.
    _raise_on_status(status, payload, header)
        raise CorruptDataError describing the first problem in `status`
        (reads it on the host: one sync).
"""

from __future__ import annotations

import math
from typing import Callable, ClassVar

import torch

from ..errors import CorruptDataError
from ..kernels.launch import LaunchConfig, check_triton_device
from .container import SUPPORTED_DTYPES, Compressed, Header, header_size

__all__ = ["Codec", "DecodeCheck", "Pending", "WORD_DTYPES"]

WORD_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
BACKENDS = ("auto", "triton", "torch")


def _check_input(x, where: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(x).__name__}")
    if x.is_nested or x.layout != torch.strided:
        raise TypeError(f"{where}: only dense (strided) tensors are supported, got layout {x.layout}; "
                        f"call .to_dense() first")
    if x.device.type == "meta" or type(x).__name__ == "FakeTensor":
        raise ValueError(f"{where}: a {x.device.type if x.device.type == 'meta' else 'fake'} tensor has no "
                         f"data to compress; pass a real CPU or CUDA tensor")
    if x.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{where}: dtype {x.dtype} is not supported; supported are real dtypes of "
                        f"1, 2, 4 or 8 bytes: {names}")


def resolve_backend(backend: str, device: torch.device, where: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{where}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton":
        check_triton_device(device, where)
    return backend


def as_words(x: torch.Tensor) -> torch.Tensor:
    """The bits of `x` as a flat integer tensor (copies only if not contiguous)."""
    x = x.detach().resolve_conj().resolve_neg().contiguous()
    return x.view(WORD_DTYPES[x.element_size()]).reshape(-1)


class DecodeCheck:
    """The decoder's consistency verdict on one buffer, read later.

    `bad` is a 0-d bool tensor on the buffer's device, computed on the stream
    that decoded (no host sync); `raise_if_bad()` reads it (one sync) and
    raises CorruptDataError with the decoder's own description of the problem.
    """

    __slots__ = ("bad", "_codec", "_status", "_payload", "_header")

    def __init__(self, codec: "Codec", status: torch.Tensor, payload: torch.Tensor, header: Header):
        self._codec, self._status, self._payload, self._header = codec, status, payload, header
        self.bad = codec._bad(status)

    def raise_if_bad(self) -> None:
        if bool(self.bad):
            self._codec._raise_on_status(self._status, self._payload, self._header)
            raise CorruptDataError(f"cswap.codecs.{self._codec.name}: the payload is inconsistent; it was "
                                   f"altered or corrupted after compression")


class Pending:
    """A compression launched on the device whose size the host has not read back (Codec.launch).

    `reserved`: the device buffer the payload is being written into (room for the
    largest payload of this tensor); `sizes`: a small int64 tensor on the device that
    holds what the host needs to know (ZVC: the number of non-zeros), to be copied
    back once the launch has run. `finish(words)` then gives the payload (the first
    bytes of `reserved`) and its header. A codec whose encoder must size its buffer on
    the host gives a deferred Pending (`deferred`: no reserved buffer, no sizes), and
    `finish()` runs the whole encode, with its host read, when called."""

    __slots__ = ("reserved", "sizes", "_finish")

    def __init__(self, finish, reserved: torch.Tensor | None = None, sizes: torch.Tensor | None = None):
        self.reserved, self.sizes, self._finish = reserved, sizes, finish

    @property
    def deferred(self) -> bool:
        return self.sizes is None

    def finish(self, words=None) -> tuple[torch.Tensor, Header]:
        """(payload, header): from the sizes read back (a sequence of ints), or, deferred, by encoding now."""
        return self._finish(words)


SMALL_TEMPORARIES = 16 * 512  # see Codec.encode_scratch_bytes
# A bounded codec's room (Codec.room_nbytes) over the payload it is sized from: the runtime sizes
# it from the tensor's payload in the pass before, and activations' sparsity drifts by a few per
# cent between steps (a small tensor's by more: hence the least margin); a payload that outgrows
# it is sent uncompressed that pass.
ROOM_MARGIN = 0.125
ROOM_LEAST_MARGIN = 64 * 1024


class Codec:
    """One compression format with a Triton and a PyTorch backend."""

    name: ClassVar[str]
    n_meta: ClassVar[int]

    def encode_scratch_bytes(self, numel: int, itemsize: int) -> int:
        """At most the device bytes the Triton encoder allocates for a tensor of `numel`
        elements of `itemsize` bytes, besides its payload, while it runs: the runtime
        counts them (a budget must, and the emulator charges them; on CUDA they come
        from the codec stream's pool). SMALL_TEMPORARIES covers the scalars and
        short tables each encoder makes, at CUDA's 512-byte allocation grain."""
        return SMALL_TEMPORARIES + self._encode_scratch_bytes(numel, itemsize)

    def _encode_scratch_bytes(self, numel: int, itemsize: int) -> int:
        raise NotImplementedError

    def launch_scratch_bytes(self, numel: int, itemsize: int) -> int:
        """At most the device bytes launch_into allocates beside `reserved` and `sizes`
        while it runs (the runtime charges them as encode_scratch_bytes)."""
        return SMALL_TEMPORARIES + self._launch_scratch_bytes(numel, itemsize)

    def _launch_scratch_bytes(self, numel: int, itemsize: int) -> int:
        return 0

    def compress(self, x: torch.Tensor, config: LaunchConfig | None = None, backend: str = "auto") -> Compressed:
        """Compress `x` losslessly (bit for bit) into one contiguous buffer.

        Any dense tensor of 1-, 2-, 4- or 8-byte dtype, any shape; a
        non-contiguous tensor is copied to contiguous first. `config` sets
        the Triton launch (ignored by the torch backend).
        """
        hsize = header_size(x.dim(), self.n_meta) if isinstance(x, torch.Tensor) else 0
        whole: list[torch.Tensor] = []

        def alloc(payload_nbytes: int) -> torch.Tensor:  # the payload behind room for the header
            whole.append(torch.empty(hsize + payload_nbytes, dtype=torch.uint8, device=x.device))
            return whole[0][hsize:]

        payload, header = self.encode(x, config, backend, alloc)
        data = whole[0]
        data[:hsize].copy_(torch.frombuffer(bytearray(header.to_bytes()), dtype=torch.uint8))
        return Compressed(data, header)

    def encode(self, x: torch.Tensor, config: LaunchConfig | None = None, backend: str = "auto",
               alloc: Callable[[int], torch.Tensor] | None = None) -> tuple[torch.Tensor, Header]:
        """Compress `x` into its payload (on x's device) and header (on the host).

        `alloc(nbytes)` gives the payload's memory (a 1-D uint8 tensor on x's
        device, 16-byte aligned; default torch.empty). The buffer `compress`
        returns is header.to_bytes() followed by this payload.
        """
        where = f"cswap.codecs.{self.name}.compress"
        _check_input(x, where)
        backend = resolve_backend(backend, x.device, where)
        shape = tuple(x.shape)
        box: list[torch.Tensor] = []

        def take(payload_nbytes: int) -> torch.Tensor:
            if box:
                raise RuntimeError(f"{where}: alloc called twice")
            if alloc is None:
                box.append(torch.empty(payload_nbytes, dtype=torch.uint8, device=x.device))
            else:
                box.append(alloc(payload_nbytes))
            return box[0]

        meta = tuple(int(m) for m in self._encode(as_words(x), shape, config, backend, take))
        if len(meta) != self.n_meta or not box:
            raise RuntimeError(f"{where}: codec returned {len(meta)} meta fields (expected {self.n_meta})")
        payload = box[0]
        header = Header(self.name, x.dtype, torch.Size(shape), meta, header_size(len(shape), self.n_meta),
                        payload.numel())
        return payload, header

    def launch(self, x: torch.Tensor, config: LaunchConfig | None = None, backend: str = "auto",
               alloc: Callable[[int], torch.Tensor] | None = None) -> Pending:
        """Start compressing `x` without reading anything back on the host: the kernels
        write into a buffer from `alloc` (room for the largest payload), and the sizes
        the header needs stay on the device (see Pending). The payload and header that
        `Pending.finish` gives equal `encode`'s, byte for byte. Codecs whose encoder
        sizes its buffer on the host return a deferred Pending."""
        where = f"cswap.codecs.{self.name}.compress"
        _check_input(x, where)
        nbytes = self.reserve_nbytes(x.numel(), x.element_size())
        if nbytes is None:
            return Pending(lambda _words=None: self.encode(x, config, backend, alloc))
        reserved = alloc(nbytes) if alloc is not None else torch.empty(nbytes, dtype=torch.uint8, device=x.device)
        sizes = torch.empty(self.size_words, dtype=torch.int64, device=x.device)
        self.launch_into(x, reserved, sizes, config, backend)

        def finish(words) -> tuple[torch.Tensor, Header]:
            header = self.launched(words, tuple(x.shape), x.dtype)
            return reserved[: header.payload_nbytes], header

        return Pending(finish, reserved, sizes)

    # The three steps of `launch`, for the runtime, which allocates and reads back itself.
    size_words: ClassVar[int] = 1  # int64 words launch_into leaves for the host

    def reserve_nbytes(self, numel: int, itemsize: int) -> int | None:
        """The device bytes launch_into writes into for `numel` elements of `itemsize`
        bytes; None: this codec cannot launch without reading sizes back (encode)."""
        return self._reserve_nbytes(numel, itemsize)

    # A bounded codec's launch_into also takes a `reserved` shorter than reserve_nbytes (of
    # room_nbytes): it writes nothing past its end, and its sizes still count the whole
    # payload, so launched() tells the caller when the payload did not fit.
    bounded: ClassVar[bool] = False

    def room_nbytes(self, numel: int, itemsize: int, payload_nbytes: int | None) -> int | None:
        """The device bytes to reserve for launch_into when this tensor's payload last took
        `payload_nbytes` (None: not known): a bounded codec's room for a payload up to
        ROOM_MARGIN larger, and at least ROOM_LEAST_MARGIN (and its fixed sections), 16-byte
        aligned, at most reserve_nbytes; else reserve_nbytes."""
        largest = self.reserve_nbytes(numel, itemsize)
        if largest is None or payload_nbytes is None or not self.bounded:
            return largest
        margin = max(math.ceil(payload_nbytes * ROOM_MARGIN), ROOM_LEAST_MARGIN)
        room = max(payload_nbytes + margin, self._min_room_nbytes(numel, itemsize))
        return min(largest, -(-room // 16) * 16)

    def launch_into(self, x: torch.Tensor, reserved: torch.Tensor, sizes: torch.Tensor,
                    config: LaunchConfig | None = None, backend: str = "auto") -> None:
        """Queue the encode of `x` into `reserved` (reserve_nbytes bytes, or a bounded codec's
        room_nbytes; 16-byte aligned, on x's device), leaving `size_words` int64 words in
        `sizes` for launched(); no host sync."""
        where = f"cswap.codecs.{self.name}.compress"
        backend = resolve_backend(backend, x.device, where)
        if (sizes.dtype != torch.int64 or sizes.numel() < self.size_words or not sizes.is_contiguous()
                or sizes.device != x.device):  # (the kernels write int64 words there)
            raise ValueError(f"{where}: sizes must be a contiguous int64 tensor of at least {self.size_words} "
                             f"words on {x.device}, got {sizes.dtype} of {sizes.numel()} on {sizes.device}")
        words = self._launch(as_words(x), tuple(x.shape), config, backend, reserved, sizes)
        if words is not None:  # (the Triton launchers write `sizes` from their last kernel)
            sizes[: words.numel()].copy_(words)

    def launched(self, words, shape: tuple[int, ...], dtype: torch.dtype) -> Header:
        """The header of what launch_into wrote, from its size words read back (ints); the
        payload is the first header.payload_nbytes bytes of the reserved buffer."""
        numel = math.prod(shape)
        meta, payload_nbytes = self._meta_from(tuple(int(w) for w in words), numel, dtype.itemsize)
        return Header(self.name, dtype, torch.Size(shape), meta, header_size(len(shape), self.n_meta), payload_nbytes)

    def decompress(self, blob: Compressed, config: LaunchConfig | None = None, backend: str = "auto",
                   check: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
        """Restore the tensor: same shape, dtype and bits, on `blob`'s device.

        check=False skips reading back the decoder's on-device consistency
        flags (saves a host sync); bounds safety does not depend on it.
        out: where to write its bytes (a contiguous 1-D uint8 tensor of its
        size on that device, as `decode`'s), instead of a new tensor.
        """
        restored, verdict = self.decompress_deferred(blob, config, backend, out)
        if check:
            verdict.raise_if_bad()
        return restored

    def decompress_deferred(self, blob: Compressed, config: LaunchConfig | None = None,
                            backend: str = "auto", out: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, DecodeCheck]:
        """`decompress` without the host sync: returns the tensor and the
        decoder's DecodeCheck, to be read once the decode has run."""
        where = f"cswap.codecs.{self.name}.decompress"
        if not isinstance(blob, Compressed):
            raise TypeError(f"{where}: expected a cswap.Compressed, got {type(blob).__name__}; "
                            f"use cswap.Compressed.from_bytes(data) for raw bytes")
        if blob.codec != self.name:
            raise ValueError(f"{where}: buffer was written by codec {blob.codec!r}; use "
                             f"cswap.codecs.get({blob.codec!r}) or blob.decompress()")
        return self.decode(blob.payload, blob._header, out=out, config=config, backend=backend)

    def decode(self, payload: torch.Tensor, header: Header, out: torch.Tensor | None = None,
               config: LaunchConfig | None = None, backend: str = "auto") -> tuple[torch.Tensor, DecodeCheck]:
        """Decode a payload described by `header` (as `encode` returned them) into
        `out` (a contiguous 1-D uint8 tensor of the tensor's size on payload's
        device) or a new tensor; returns it with the decoder's DecodeCheck (no
        host sync)."""
        where = f"cswap.codecs.{self.name}.decompress"
        if header.codec != self.name:
            raise ValueError(f"{where}: the header is codec {header.codec!r}'s")
        self.check_meta(header)
        if payload.numel() != header.payload_nbytes:
            raise CorruptDataError(f"{where}: payload is {payload.numel()} bytes but its header says "
                                   f"{header.payload_nbytes}")
        backend = resolve_backend(backend, payload.device, where)
        word_dtype = WORD_DTYPES[header.dtype.itemsize]
        out_words = None
        if out is not None:
            nbytes = header.shape.numel() * header.dtype.itemsize
            if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != nbytes or not out.is_contiguous() \
                    or out.device != payload.device:
                raise ValueError(f"{where}: out must be a contiguous 1-D uint8 tensor of {nbytes} bytes on "
                                 f"{payload.device}, got {out.dtype} of shape {tuple(out.shape)} on {out.device}")
            out_words = out.view(word_dtype)
        if payload.numel() and payload.data_ptr() % 16:
            # Decoders view sections as int32/int64; a buffer rebuilt from bytes at
            # an arbitrary address (from_bytes on a slice, to(out=) into an offset
            # view) is copied once to fresh, aligned memory.
            payload = payload.clone()
        try:
            words, status = self._decode(payload, header, word_dtype, config, backend, out_words)
        except RuntimeError as exc:  # a header may claim any size (all zeros compress that well)
            if isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" not in str(exc):
                raise  # CUDA OOM keeps its type: the runtime waits for frees and retries on it
            raise MemoryError(f"{where}: the buffer decodes to a {header.dtype} tensor of shape "
                              f"{tuple(header.shape)} ({header.shape.numel() * header.dtype.itemsize} bytes), "
                              f"more than {payload.device} memory can hold; if the buffer is not from a trusted "
                              f"source, its header may be lying") from exc
        return words.view(header.dtype).reshape(header.shape), DecodeCheck(self, status, payload, header)

    def check_meta(self, header: Header) -> None:
        if len(header.meta) != self.n_meta:
            raise CorruptDataError(f"cswap.codecs.{self.name}: header has {len(header.meta)} meta fields, "
                                   f"expected {self.n_meta}")
        self._check_meta(header)

    # -- implemented by each codec ------------------------------------------------
    def _encode(self, words: torch.Tensor, shape: tuple[int, ...], config, backend: str,
                alloc: Callable[[int], torch.Tensor]) -> tuple[int, ...]:
        raise NotImplementedError

    def _check_meta(self, header: Header) -> None:
        raise NotImplementedError

    # Codecs that launch without a host read (Codec.launch) implement these three:
    def _reserve_nbytes(self, numel: int, itemsize: int) -> int | None:
        """The buffer _launch writes into for a tensor of `numel` words; None: the codec
        cannot launch without reading sizes back (Codec.launch defers its encode)."""
        return None

    def _min_room_nbytes(self, numel: int, itemsize: int) -> int:
        """A bounded codec's least room: what it writes whatever the input."""
        return 0

    def _launch(self, words: torch.Tensor, shape: tuple[int, ...], config, backend: str,
                reserved: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor | None:
        """Write the payload into `reserved` and the int64 words the host needs into `sizes`,
        or return those words (on the device) for the caller to copy there."""
        raise NotImplementedError

    def _meta_from(self, words: tuple[int, ...], numel: int, itemsize: int) -> tuple[tuple[int, ...], int]:
        """(meta fields, payload bytes) from the words _launch left, read back."""
        raise NotImplementedError

    def _decode(self, payload: torch.Tensor, header: Header, word_dtype: torch.dtype, config,
                backend: str, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _raise_on_status(self, status: torch.Tensor, payload: torch.Tensor, header: Header) -> None:
        raise NotImplementedError

    def _bad(self, status: torch.Tensor) -> torch.Tensor:
        """0-d bool on status's device: did any tile report a problem (no host sync)."""
        return status.any()  # (one reduction: any non-zero word; False when empty)

    def __repr__(self) -> str:
        return f"<cswap codec {self.name!r}>"


