"""Fuzzing the decoders (zvc, rle, csr, lz4, zans) on both backends.

The contract (DESIGN.md, Codecs): whatever bytes a buffer holds, decoding
either returns the tensor its header describes or raises
`cswap.CorruptDataError` (a ValueError), and never reads or writes out of
bounds, crashes or hangs. This file throws hypothesis-generated buffers at
`cswap.Compressed.from_bytes` + `codec.decompress`, with backend="torch"
everywhere and backend="triton" on CUDA or, without a GPU, in Triton's CPU
interpreter (TRITON_INTERPRET=1, set by conftest.py; small inputs only).

What is fuzzed
  - fully random bytes, bare or behind the magic (almost all stop at the header);
  - real buffers of random sparse tensors (random bit patterns or zero runs,
    every dtype width, 0-3 dims, empty and all-zero included), written by the
    codecs and, to reach code the default encoders never exercise, with small
    ZVC/RLE tiles, LZ4 chunks of any size holding blocks written by the
    `lz4` package (byte-granular, overlapping matches) and small ZANS tiles
    with every plane rANS-coded (tiny tensors otherwise store planes raw),
    behind a header built with `pack_header`;
  - those buffers with the payload replaced by random bytes of the same length
    (header and meta stay valid, so every case reaches the kernels);
  - buffers synthesized from scratch: random but consistent meta (ZVC tiles
    of 32 to 256, any LZ4 chunk size, random nnz / runs / block
    bytes, ZANS modes, coded planes and stream sizes) and a random payload
    of exactly the size the meta implies;
  - mutations of real buffers: bit flips, overwritten bytes, aligned
    int64/int32/uint16 fields (offset tables, masks, run records, column
    indices) set to edge values or moved by a few, truncation, extension,
    swapped payload slices, a byte deleted and another inserted (size kept),
    and header re-packs with other meta, shape or dtype (the CRC passes).

What is asserted, for every input
  1. decoding returns a tensor of the header's shape, dtype and device, or
     raises CorruptDataError: any other exception fails the test (an
     IndexError / RuntimeError from torch indexing out of bounds included);
  2. an unmodified buffer round-trips bit for bit (integer views, torch.equal);
  3. once the header is accepted, decompress(check=False) never raises and
     returns the right shape (bounds safety does not depend on `check`);
  4. the backends agree: both reject, or both return the same bits;
  5. an accepted zvc/rle/csr payload decodes to at most `nnz` non-zeros;
  6. no out-of-bounds access in the Triton kernels (interpreter only): Triton's
     interpreter itself does not notice one (a masked-on load from a bad
     address reads whatever is there, or crashes the process), so
     `BoundsChecked` moves every tensor argument of a launch into its own
     allocation between guard bytes and checks every unmasked address of
     every load, store and atomic against those allocations; the guard
     bytes must be intact after the launch. Its own test shows it catches
     one-past-the-end reads and writes and respects masks;
  7. no hang: each decode runs under a SIGALRM time limit (HANG_LIMIT_S,
     which interrupts Python loops such as the interpreter's and the LZ4
     reference decoder's) besides hypothesis's per-example deadline.

Runs are reproducible: derandomize=True and no example database. For a longer
hunt, CSWAP_FUZZ_SCALE=20 multiplies every example count (CI runs this file at 4 besides
the quick set's 1).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import struct
import threading
from dataclasses import dataclass
from datetime import timedelta

import lz4.block
import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

import cswap
from bitdata import bits, blocky, random_bits
from cswap import CorruptDataError
from cswap.codecs.container import pack_header
from cswap.kernels import csr as kc
from cswap.kernels import lz4 as kl
from cswap.kernels import rle as kr
from cswap.kernels import zans as ka
from cswap.kernels import zvc as kz
from cswap.kernels.launch import interpreting

CODECS = cswap.codecs.names()
# Element widths 1, 2, 4 and 8 (bool: only 0/1 are valid values, the payload may hold others).
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool]
SAME_WIDTH = {torch.float32: torch.int32, torch.int32: torch.float32, torch.float16: torch.bfloat16,
              torch.bfloat16: torch.int16, torch.float64: torch.int64, torch.int64: torch.float64,
              torch.int8: torch.uint8, torch.uint8: torch.bool, torch.bool: torch.int8}
NNZ_FIELD = {"zvc": 1, "rle": 2, "csr": 2, "zans": 2}  # which meta field is nnz (zans: symbols)

if torch.cuda.is_available() and not interpreting():
    TRITON_DEVICE = "cuda"
elif interpreting():
    TRITON_DEVICE = "cpu"
else:
    TRITON_DEVICE = None
needs_triton = pytest.mark.skipif(TRITON_DEVICE is None, reason="backend='triton' needs CUDA or TRITON_INTERPRET=1")

# A decode of these sizes takes milliseconds (the interpreter: tens of them);
# HANG_LIMIT_S only ends one that never would.
HANG_LIMIT_S = 30.0
TORCH_NUMEL = 1500  # torch backend: up to this many elements
TRITON_NUMEL = 200  # triton backend in the interpreter: keep it small

# CSWAP_FUZZ_SCALE=20 multiplies every example count for a longer hunt (the quick set: 1;
# CI runs this file again at 4).
SCALE = float(os.environ.get("CSWAP_FUZZ_SCALE", "1"))


def examples(n: int) -> int:
    return max(1, round(n * SCALE))


_COMMON = dict(derandomize=True, database=None, print_blob=False,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much])
TORCH = settings(max_examples=examples(30), deadline=timedelta(seconds=5), **_COMMON)
TRITON = settings(max_examples=examples(6), deadline=timedelta(seconds=20), **_COMMON)


# -- hang guard ---------------------------------------------------------------------------


class DecodeHang(Exception):
    pass


_hangs: list[str] = []


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise DecodeHang in the main thread after `seconds` (a no-op where SIGALRM is missing)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        _hangs.append(f"did not finish within {seconds} s")
        raise DecodeHang(_hangs[-1])

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- bounds checks for Triton's CPU interpreter --------------------------------------------


class OutOfBounds(AssertionError):
    pass


class BoundsChecked:
    """While active, every Triton launch in the interpreter runs with each tensor
    argument copied into its own allocation between GUARD guard bytes, and every
    unmasked address of a load, store or atomic must lie inside one argument
    (element included). Changed arguments are copied back after the launch, once
    the guards are found intact. Violations raise OutOfBounds inside the kernel
    (the interpreter wraps it in its InterpreterError) and are kept in
    `violations`."""

    GUARD = 256
    FILL = 0xA5

    def __init__(self):
        import triton.runtime.interpreter as ti

        self.ti = ti
        self.violations: list[str] = []
        self.accesses = 0  # addresses checked, so a test can see the checks ran
        self.launches = 0
        self._kernel = ""
        self._args: list[tuple[str, int, int]] = []  # (name, start, end)
        self._copies: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._saved: dict = {}

    # patching
    def __enter__(self):
        builder, executor = self.ti.InterpreterBuilder, self.ti.GridExecutor
        me = self
        orig_init, orig_restore = executor._init_args_hst, executor._restore_args_dev

        def init_args_hst(ex, *args, **kwargs):
            args_hst, kwargs_hst = orig_init(ex, *args, **kwargs)
            me._begin(getattr(ex.fn, "__name__", "kernel"))
            names = list(getattr(ex, "arg_names", []))
            args_hst = [me._isolate(a, names[i] if i < len(names) else f"arg{i}") for i, a in enumerate(args_hst)]
            kwargs_hst = {k: me._isolate(v, k) for k, v in kwargs_hst.items()}
            return args_hst, kwargs_hst

        def restore_args_dev(ex, *args, **kwargs):
            me._finish()

        self._saved = {(executor, "_init_args_hst"): orig_init, (executor, "_restore_args_dev"): orig_restore}
        for name, what in (("create_masked_load", "load"), ("create_masked_store", "store"),
                           ("create_atomic_rmw", "atomic"), ("create_atomic_cas", "atomic_cas")):
            orig = getattr(builder, name)
            self._saved[(builder, name)] = orig
            setattr(builder, name, self._checked(orig, what))
        executor._init_args_hst = init_args_hst
        executor._restore_args_dev = restore_args_dev
        return self

    def _checked(self, orig, what: str):
        """`orig` (a builder method) with its addresses checked first. The pointer and
        mask are found by parameter name ("ptrs" or "ptr", "mask"), which every Triton
        since 3.1 keeps, so added or reordered parameters (Triton 3.9 merged the cache
        and eviction arguments of loads and stores) change nothing here."""
        params = list(inspect.signature(orig).parameters)
        ptr = next((p for p in ("ptrs", "ptr") if p in params), None)
        if ptr is None:
            raise RuntimeError(f"test_fuzz.BoundsChecked: this Triton's interpreter {orig.__qualname__}"
                               f"{inspect.signature(orig)} has no 'ptrs' or 'ptr' parameter; update the checker")
        at_ptr = params.index(ptr)
        at_mask = params.index("mask") if "mask" in params else None

        def arg(args, kwargs, index, name):
            return args[index] if index < len(args) else kwargs.get(name)

        def checked(*args, **kwargs):
            mask = arg(args, kwargs, at_mask, "mask") if at_mask is not None else None
            self._check(arg(args, kwargs, at_ptr, ptr), mask, what)
            return orig(*args, **kwargs)
        return checked

    def __exit__(self, *exc):
        for (owner, name), fn in self._saved.items():
            setattr(owner, name, fn)
        self._copies.clear()
        self._args.clear()

    # launches
    def _begin(self, kernel: str) -> None:
        self.launches += 1
        self._kernel = kernel
        self._args = []
        self._copies = []

    def _isolate(self, t, name: str):
        if not isinstance(t, torch.Tensor):
            return t
        nbytes = t.numel() * t.element_size()
        if not t.is_contiguous():  # not isolated: its own extent still bounds it
            self._args.append((name, t.data_ptr(), t.data_ptr() + nbytes))
            return t
        buf = torch.full((nbytes + 2 * self.GUARD,), self.FILL, dtype=torch.uint8)
        body = buf[self.GUARD: self.GUARD + nbytes]
        if nbytes:
            body.copy_(t.reshape(-1).view(torch.uint8))
        copy = body.view(t.dtype).view(t.shape)
        self._copies.append((t, copy, buf, body.clone()))
        self._args.append((name, body.data_ptr(), body.data_ptr() + nbytes))
        return copy

    def _finish(self) -> None:
        for original, copy, buf, before in self._copies:
            g = self.GUARD
            if not (bool((buf[:g] == self.FILL).all()) and bool((buf[buf.numel() - g:] == self.FILL).all())):
                self._fail(f"{self._kernel}: a guard byte next to a tensor argument of "
                           f"{original.numel()} x {original.dtype} was overwritten")
            body = buf[g: buf.numel() - g]
            if not torch.equal(body, before):
                original.copy_(copy)

    # accesses
    def _check(self, ptrs, mask, what: str) -> None:
        p = np.asarray(ptrs.data).astype(np.uint64, copy=False)
        if mask is not None:
            m = np.broadcast_to(np.asarray(mask.data).astype(bool, copy=False), p.shape)
            p = p[m]
        p = p.reshape(-1)
        if p.size == 0:
            return
        self.accesses += p.size
        size = np.uint64(max(1, ptrs.get_element_ty().primitive_bitwidth // 8))
        ok = np.zeros(p.shape, dtype=bool)
        for _, start, end in self._args:
            s, e = np.uint64(start), np.uint64(end)
            ok |= (p >= s) & (p < e) & (e - p >= size)
        if ok.all():
            return
        bad = int(p[~ok][0])
        where = "no tensor argument"
        if self._args:  # name it by the nearest argument
            name, start, end = min(self._args, key=lambda a: min(abs(bad - a[1]), abs(bad - a[2])))
            where = f"{name} {bad - start:+d} (an argument of {end - start} bytes)"
        self._fail(f"{self._kernel}: {what} of {int(size)} bytes outside every tensor argument "
                   f"({int((~ok).sum())} addresses); the first at {where}")

    def _fail(self, message: str) -> None:
        self.violations.append(message)
        raise OutOfBounds(message)


def _can_check_bounds() -> bool:
    """BoundsChecked hooks private parts of Triton's interpreter (3.x); where they
    are missing the fuzz tests run unchecked and the checker's own test fails."""
    if not interpreting():
        return False
    import triton.runtime.interpreter as ti

    return all(hasattr(ti.InterpreterBuilder, n) for n in ("create_masked_load", "create_masked_store",
                                                           "create_atomic_rmw", "create_atomic_cas")) \
        and all(hasattr(ti.GridExecutor, n) for n in ("_init_args_hst", "_restore_args_dev"))


CAN_CHECK_BOUNDS = _can_check_bounds()


def bounds_checked(backend: str):
    return BoundsChecked() if backend == "triton" and CAN_CHECK_BOUNDS else contextlib.nullcontext()


# -- decoding ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    out: torch.Tensor | None  # the decoded tensor (on CPU), None when rejected
    stage: str                # "header" (from_bytes) or "decode" rejected it, or "ok"
    error: str = ""
    codec: str = ""
    meta: tuple = ()
    launches: int = 0         # Triton launches seen by the bounds checker (interpreter only)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def decode(data: bytes, backend: str, check: bool = True) -> Outcome:
    """from_bytes + decompress; CorruptDataError is an answer, anything else fails the test."""
    device = "cpu" if backend == "torch" else TRITON_DEVICE
    guard = bounds_checked(backend)
    del _hangs[:]
    try:
        with time_limit(HANG_LIMIT_S), guard:
            try:
                blob = cswap.Compressed.from_bytes(_as_tensor(data).to(device))
            except CorruptDataError as exc:
                return Outcome(None, "header", str(exc))
            try:
                out = cswap.codecs.get(blob.codec).decompress(blob, backend=backend, check=check)
            except CorruptDataError as exc:
                return Outcome(None, "decode", str(exc), blob.codec, blob.meta)
    except Exception as exc:
        if _hangs:
            pytest.fail(f"{backend} decode hung: {_hangs[0]}")
        if isinstance(guard, BoundsChecked) and guard.violations:
            pytest.fail(f"triton decode went out of bounds: {guard.violations[0]}")
        raise AssertionError(f"{backend} decode raised {type(exc).__name__}, not CorruptDataError: {exc}") from exc
    launches = guard.launches if isinstance(guard, BoundsChecked) else 0
    assert launches == 0 or guard.accesses > 0, "the bounds checker saw launches but no memory access"
    assert (out.shape, out.dtype, out.device) == (blob.shape, blob.dtype, blob.device), \
        f"decoded {out.shape} {out.dtype} on {out.device}, header says {blob.shape} {blob.dtype} on {blob.device}"
    return Outcome(out.cpu(), "ok", "", blob.codec, blob.meta, launches)


def check_any_bytes(data: bytes, backends=("torch",), original: torch.Tensor | None = None) -> list[Outcome]:
    """Every property for one buffer: decoded on each backend, check=True and False;
    `original` is the tensor when `data` is an unmodified buffer of it."""
    with contextlib.suppress(InvalidArgument):  # outside a hypothesis test there is nothing to note
        note(f"buffer ({len(data)} bytes): {data.hex()}")
    outcomes = [decode(data, b) for b in backends]
    for backend, o in zip(backends, outcomes):
        if o.stage != "header":  # the header passed: check=False decodes without complaint
            loose = decode(data, backend, check=False)
            assert loose.out is not None, f"{backend} check=False raised: {loose.error}"
            if o.out is not None:
                assert torch.equal(bits(loose.out), bits(o.out))
        if o.out is not None and o.codec in NNZ_FIELD:
            nnz = o.meta[NNZ_FIELD[o.codec]]
            assert int((bits(o.out) != 0).sum()) <= nnz, f"{o.codec}: more non-zeros decoded than the {nnz} recorded"
    first = outcomes[0]
    with contextlib.suppress(InvalidArgument):  # see --hypothesis-show-statistics
        event(f"{first.stage}: {first.error.split(':')[0]}" if first.error else first.stage)
    for backend, o in zip(backends[1:], outcomes[1:]):
        assert (first.out is None) == (o.out is None), \
            f"{backends[0]}: {first.stage} {first.error!r}; {backend}: {o.stage} {o.error!r}"
        if first.out is not None:
            assert torch.equal(bits(first.out), bits(o.out)), f"{backends[0]} and {backend} decode differently"
    if original is not None:
        for backend, o in zip(backends, outcomes):
            assert o.out is not None, f"{backend} rejected an unmodified buffer: {o.error}"
            assert o.out.shape == original.shape and o.out.dtype == original.dtype
            assert torch.equal(bits(o.out), bits(original)), f"{backend} round trip is not bit-exact"
    return outcomes


# -- buffers --------------------------------------------------------------------------------


def wrap(codec: str, dtype: torch.dtype, shape, meta, payload: bytes) -> bytes:
    """A buffer with a valid header (its CRC passes) around any payload."""
    return pack_header(codec, dtype, tuple(shape), tuple(int(m) for m in meta), len(payload)) + payload


def _kernel_payload(encoder, words, **kw):
    """(encoder's result, payload bytes) of a cswap.kernels encoder called with its alloc."""
    held: list[torch.Tensor] = []

    def alloc(n):
        held.append(torch.empty(n, dtype=torch.uint8))
        return held[0]

    result = encoder(words, alloc, **kw)
    return result, held[0].numpy().tobytes()


def _lz4_chunked(x: torch.Tensor, chunk: int) -> bytes:
    """x as LZ4 blocks of `chunk` bytes each, written by the lz4 package."""
    data = bits(x).reshape(-1).view(torch.uint8).numpy().tobytes()
    blocks = [lz4.block.compress(data[i: i + chunk], store_size=False) for i in range(0, len(data), chunk)]
    ends = np.cumsum([0] + [len(b) for b in blocks]).tolist()
    off_blocks, _ = kl.layout(len(blocks), ends[-1])
    head = struct.pack(f"<{len(ends)}q", *ends)
    payload = head + bytes(off_blocks - len(head)) + b"".join(blocks)
    return wrap("lz4", x.dtype, x.shape, (chunk, len(blocks), ends[-1]), payload)


def encode(codec: str, x: torch.Tensor, variant: int) -> bytes:
    """A real buffer of x: variant 0 is the codec's own (torch backend); others use
    small tiles / chunks (zvc, rle, lz4, zans) that the default encoders never write."""
    if variant == 0 or codec == "csr":
        return cswap.codecs.get(codec).compress(x, backend="torch").data.numpy().tobytes()
    words = bits(x).reshape(-1)
    if codec == "zvc":
        tile = (32, 64, 128)[variant % 3]
        nnz, payload = _kernel_payload(kz.zvc_compress_ref, words, tile=tile)
        return wrap("zvc", x.dtype, x.shape, (tile, nnz), payload)
    if codec == "rle":
        tile = (16, 32, 64)[variant % 3]
        (runs, nnz), payload = _kernel_payload(kr.rle_compress_ref, words, tile=tile)
        return wrap("rle", x.dtype, x.shape, (tile, runs, nnz), payload)
    if codec == "zans":  # every plane coded: tiles of 256+ symbols hold rANS streams, smaller ones stay raw
        tile = (32, 64, 256, 512, 256)[variant % 5]
        meta, payload = _kernel_payload(ka.zans_compress_ref, words, tile=tile, code_below=float("inf"))
        return wrap("zans", x.dtype, x.shape, meta, payload)
    # Blocks from the lz4 package (byte-granular matches, overlapping copies), of
    # small chunks and of the default one. (cswap's own encoder pads every chunk
    # to 64 KiB: too slow to call per small chunk.)
    return _lz4_chunked(x, (16, 64, 256, 1000, kl.CHUNK)[variant % 5])


@st.composite
def shapes(draw, max_numel: int):
    ndim = draw(st.integers(0, 3))
    if ndim == 0:
        return ()
    if ndim == 1:
        return (draw(st.integers(0, max_numel)),)
    if ndim == 2:
        rows = draw(st.integers(0, 24))
        return (rows, draw(st.integers(0, max_numel // max(rows, 1))))
    return tuple(draw(st.integers(0, 7)) for _ in range(3))


@st.composite
def tensors(draw, max_numel: int):
    shape = draw(shapes(max_numel))
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(["random", "runs", "zeros", "dense"]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if kind == "dense":
        return random_bits(shape, dtype, 0.0, generator=g)
    sparsity = draw(st.sampled_from([0.1, 0.5, 0.8, 0.97]))
    if kind == "runs":
        return blocky(shape, dtype, sparsity, run=draw(st.sampled_from([1, 3, 17, 40])), generator=g)
    return random_bits(shape, dtype, sparsity, generator=g)


@st.composite
def real_buffers(draw, codec: str, max_numel: int):
    x = draw(tensors(max_numel))
    variant = draw(st.integers(0, 5))
    return x, encode(codec, x, variant)


def _split(data: bytes) -> tuple[bytes, bytes]:
    blob = cswap.Compressed.from_bytes(data)
    hsize = len(data) - blob.payload.numel()
    return data[:hsize], data[hsize:]


# Values that sit on the edges of the offset and length fields.
EDGE_INTS = [0, 1, 2, 3, 4, 7, 15, 16, 31, 32, 255, 256, 4095, 4096, 65535, 65536, 2**31 - 1, 2**31,
             2**32 - 1, 2**62, 2**63 - 1, -1, -2, -16, -(2**31), -(2**63)]
# int64/int32/uint16: set an aligned field to `value`; add64/add32/add16: add a small
# delta to one (an offset moved by a few passes more of the monotonicity checks).
MUTATIONS = ["flip", "set", "int64", "int32", "uint16", "add64", "add32", "add16", "truncate", "extend",
             "swap", "shift"]


@st.composite
def mutations(draw):
    kind = draw(st.sampled_from(MUTATIONS))
    anywhere = draw(st.integers(0, 9)) == 0  # mostly the payload: header changes only meet the CRC
    where = draw(st.integers(0, 2**32))
    other = draw(st.integers(0, 2**32))
    value = draw(st.one_of(st.sampled_from(EDGE_INTS), st.integers(-(2**63), 2**63 - 1)))
    return kind, anywhere, where, other, value


def mutate(data: bytes, ops) -> bytes:
    buf = bytearray(data)
    base = len(_split(data)[0])  # the header's size
    for kind, anywhere, where, other, value in ops:
        lo = 0 if anywhere or len(buf) <= base else base
        span = len(buf) - lo
        if kind in ("truncate", "extend"):
            if kind == "truncate":
                del buf[lo + where % (span + 1):]
            else:
                buf += bytes((value >> (8 * i)) & 255 for i in range(1 + other % 8)) * (1 + where % 4)
            continue
        if span <= 0:
            continue
        pos = lo + where % span
        if kind == "flip":
            buf[pos] ^= 1 << (other % 8)
        elif kind == "set":
            buf[pos] = value & 255
        elif kind in ("int64", "int32", "uint16", "add64", "add32", "add16"):
            width = {"64": 8, "32": 4, "16": 2}[kind[-2:]]
            pos = lo + (pos - lo) // width * width  # the fields are aligned
            if pos + width <= len(buf):
                if kind.startswith("add"):
                    value = int.from_bytes(buf[pos: pos + width], "little") + (value % 81 - 40)
                buf[pos: pos + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
        elif kind == "swap":
            a, b = pos, lo + other % span
            n = min(1 + value % 32, len(buf) - max(a, b))
            buf[a: a + n], buf[b: b + n] = buf[b: b + n], buf[a: a + n]
        elif kind == "shift":  # delete a byte and insert one elsewhere: the size is kept
            del buf[pos]
            buf.insert(lo + other % span, value & 255)
    return bytes(buf)


@st.composite
def meta_changes(draw, codec: str):
    """(field index or 'shape' / 'dtype', new value, resize payload to the meta's layout?)"""
    n_meta = cswap.codecs.get(codec).n_meta
    field = draw(st.sampled_from(list(range(n_meta)) + ["shape", "dtype"]))
    delta = draw(st.one_of(st.sampled_from([-1, 1, -2, 2, 16, -16]), st.sampled_from(EDGE_INTS),
                           st.integers(-(2**63), 2**63 - 1)))
    return field, delta, draw(st.booleans()), draw(st.integers(0, 2**16))


def expected_payload(codec: str, shape, dtype, meta) -> int | None:
    """Payload size the meta implies (None when the meta cannot be laid out)."""
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    itemsize = dtype.itemsize
    try:
        if codec == "zvc":
            tile, nnz = meta
            return kz.layout(n, tile, nnz, itemsize)[3] if tile > 0 and nnz >= 0 else None
        if codec == "rle":
            tile, runs, nnz = meta
            return kr.layout(n, tile, runs, nnz, itemsize)[-1] if tile > 0 and min(runs, nnz) >= 0 else None
        if codec == "csr":
            rows, _, nnz, index_bytes = meta
            return kc.layout(rows, nnz, index_bytes, itemsize)[3] if min(rows, nnz, index_bytes) >= 0 else None
        if codec == "zans":
            tile, mode, symbols, coded, streams_nbytes = meta
            ok = tile > 0 and mode in (0, 1) and min(symbols, coded, streams_nbytes) >= 0
            return ka.layout(n, tile, mode, symbols, coded, streams_nbytes, itemsize)[3] if ok else None
        _, chunks, blocks_nbytes = meta
        return kl.layout(chunks, blocks_nbytes)[1] if min(chunks, blocks_nbytes) >= 0 else None
    except (ZeroDivisionError, OverflowError):
        return None


def apply_meta_change(data: bytes, change) -> bytes:
    field, delta, resize, seed = change
    blob = cswap.Compressed.from_bytes(data)
    codec, shape, dtype, meta = blob.codec, tuple(blob.shape), blob.dtype, list(blob.meta)
    payload = _split(data)[1]
    if field == "shape":  # same numel, other shape: reversed, flattened, or split
        shape = tuple(reversed(shape)) if delta % 3 == 0 else (blob.shape.numel(),) if delta % 3 == 1 \
            else (1,) + shape
    elif field == "dtype":
        dtype = SAME_WIDTH[dtype] if delta % 2 else DTYPES[delta % len(DTYPES)]
    else:
        value = meta[field] + delta if abs(delta) <= 16 else delta
        meta[field] = max(-(2**63), min(2**63 - 1, value))
    if resize:
        size = expected_payload(codec, shape, dtype, meta)
        if size is not None and size <= 1 << 16:  # pad with seeded random bytes, or cut
            rng = np.random.default_rng(seed)
            payload = (payload + rng.integers(0, 256, max(size - len(payload), 0), dtype=np.uint8).tobytes())[:size]
    return wrap(codec, dtype, shape, meta, payload)


@st.composite
def synthesized(draw, codec: str, max_numel: int):
    """A header with random but consistent meta (it passes check_meta) and a random
    payload of exactly the size that meta implies."""
    shape = draw(shapes(max_numel))
    dtype = draw(st.sampled_from(DTYPES))
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if codec == "zvc":
        meta = (32 << draw(st.integers(0, 3)), draw(st.integers(0, n)))
    elif codec == "rle":
        nnz = draw(st.integers(0, n))
        meta = (1 << draw(st.integers(4, 8)), draw(st.integers(1 if nnz else 0, nnz)), nnz)
    elif codec == "csr":
        rows, cols = kc.view_2d(shape)
        meta = (rows, cols, draw(st.integers(0, n)), kc.index_bytes_for(cols))
    elif codec == "zans":
        tile, mode = 32 << draw(st.integers(0, 4)), draw(st.integers(0, 1))
        symbols = draw(st.integers(0, n)) if mode else n
        coded = draw(st.integers(0, (1 << (dtype.itemsize + mode)) - 1))
        lo, hi = ka.stream_bounds(n, tile, mode, symbols, coded, dtype.itemsize)
        meta = (tile, mode, symbols, coded, 2 * draw(st.integers(lo // 2, hi // 2)))
    else:
        nbytes = n * dtype.itemsize
        chunk = draw(st.integers(max(1, -(-nbytes // 48)), max(1, nbytes)))
        chunks = -(-nbytes // chunk)
        meta = (chunk, chunks, draw(st.integers(chunks, chunks * kl.block_bound(chunk))))
    size = expected_payload(codec, shape, dtype, meta)
    payload = draw(st.binary(min_size=size, max_size=size))
    return wrap(codec, dtype, shape, meta, payload)


# -- the harness itself ---------------------------------------------------------------------


@triton.jit
def _probe_kernel(src_ptr, dst_ptr, n, SHIFT_LOAD: tl.constexpr, SHIFT_STORE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    v = tl.load(src_ptr + i + SHIFT_LOAD, mask=i < n, other=0)
    tl.store(dst_ptr + i + SHIFT_STORE, v, mask=i < n)


@triton.jit
def _probe_scalar_kernel(src_ptr, dst_ptr, k):
    tl.store(dst_ptr, tl.load(src_ptr + k))  # unmasked


@pytest.mark.skipif(not interpreting(), reason="checks the CPU interpreter's bounds instrumentation")
def test_bounds_checker_catches_out_of_bounds_and_respects_masks():
    assert CAN_CHECK_BOUNDS, "Triton's interpreter changed: update BoundsChecked (fuzzing runs without it)"
    src = torch.arange(10, dtype=torch.int32)
    dst = torch.zeros(10, dtype=torch.int32)
    with BoundsChecked() as guard:  # in bounds; lanes 10..15 masked off
        _probe_kernel[(1,)](src, dst, 10, SHIFT_LOAD=0, SHIFT_STORE=0, BLOCK=16)
    assert torch.equal(dst, src) and guard.launches == 1 and guard.accesses == 20 and not guard.violations
    for shift_load, shift_store, what in [(1, 0, "load"), (-1, 0, "load"), (0, 1, "store"), (0, -1, "store")]:
        with BoundsChecked() as guard, pytest.raises(Exception, match="outside every tensor argument"):
            _probe_kernel[(1,)](src, dst, 10, SHIFT_LOAD=shift_load, SHIFT_STORE=shift_store, BLOCK=16)
        assert len(guard.violations) == 1 and guard.violations[0].startswith(f"_probe_kernel: {what} of 4 bytes")
        assert guard.violations[0].endswith(f"the first at {'src' if what == 'load' else 'dst'}_ptr "
                                            f"{'+40' if max(shift_load, shift_store) > 0 else '-4'} "
                                            f"(an argument of 40 bytes)")
    # Reaching past one argument into another's memory is caught too: arguments are
    # copied apart. Without the checker (restored on exit) nothing complains.
    both = torch.arange(20, dtype=torch.int32)
    with BoundsChecked() as guard, pytest.raises(Exception, match="outside every tensor argument"):
        _probe_kernel[(1,)](both[:10], both[10:], 10, SHIFT_LOAD=10, SHIFT_STORE=0, BLOCK=16)
    _probe_kernel[(1,)](both[:10], both[10:], 10, SHIFT_LOAD=10, SHIFT_STORE=0, BLOCK=16)
    # Unmasked scalar loads are checked as well.
    with BoundsChecked() as guard:
        _probe_scalar_kernel[(1,)](src, dst, 9)
    assert int(dst[0]) == 9 and guard.accesses == 2
    with BoundsChecked() as guard, pytest.raises(Exception, match="outside every tensor argument"):
        _probe_scalar_kernel[(1,)](src, dst, 10)


def test_time_limit_stops_a_hang():
    if not hasattr(signal, "setitimer"):
        pytest.skip("no SIGALRM on this platform")
    with pytest.raises(DecodeHang), time_limit(0.2):
        while True:
            pass


@pytest.mark.parametrize("name", CODECS)
def test_harness_sees_decoder_errors_and_reaches_the_decoders(name):
    # A real buffer round-trips; zeroing its payload reaches the decoder (the header
    # stays valid) where a non-empty tensor's payload is rejected, not by the header.
    x = random_bits((5, 7), torch.float32, 0.5, generator=torch.Generator().manual_seed(1))
    data = cswap.codecs.get(name).compress(x, backend="torch").data.numpy().tobytes()
    backends = ("torch", "triton") if TRITON_DEVICE else ("torch",)
    check_any_bytes(data, backends, original=x)
    head, payload = _split(data)
    for backend in backends:
        zeroed = decode(head + bytes(len(payload)), backend)
        assert zeroed.stage == "decode" and zeroed.error.startswith(f"cswap.codecs.{name}")
    if CAN_CHECK_BOUNDS:  # the Triton decode really ran under the bounds checker
        assert decode(data, "triton").launches >= 1


@pytest.mark.parametrize("tile", [0, 16, 96, 160, 224, 32 * 33, 1 << 17])
def test_zvc_tile_must_be_a_power_of_two_the_kernels_can_hold(tile):
    # Found by test_triton_synthesized_buffers: the header check accepted any
    # multiple of 32, but the Triton kernels need a power of two (tl.arange) and
    # raised "arange's range must be a power of 2"; such a header is now rejected.
    x = random_bits((7, 43), torch.float16, 0.5, generator=torch.Generator().manual_seed(tile))
    nnz = int((bits(x) != 0).sum())
    data = wrap("zvc", x.dtype, x.shape, (tile, nnz), bytes(64))
    with pytest.raises(cswap.CorruptDataError, match="power of two"):
        cswap.Compressed.from_bytes(data)


# -- the fuzz tests -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@settings(TORCH, max_examples=examples(75))
@given(data=st.binary(max_size=400), prefix=st.sampled_from([b"", b"CSWZ", b"CSWZ\x01", b"CSWZ\x01\x04\x08\x01"]))
def test_random_bytes(backend, data, prefix):
    out = decode(prefix + data, backend)
    assert out.out is None and out.stage == "header"  # 2**-32 odds of a CRC match aside


@pytest.mark.parametrize("name", CODECS)
@TORCH
@given(data=st.data())
def test_torch_unmodified_buffers_round_trip(name, data):
    x, buf = data.draw(real_buffers(name, TORCH_NUMEL))
    check_any_bytes(buf, ("torch",), original=x)


@pytest.mark.parametrize("name", CODECS)
@TORCH
@given(data=st.data())
def test_torch_random_payload_behind_a_valid_header(name, data):
    _, buf = data.draw(real_buffers(name, TORCH_NUMEL))
    head, payload = _split(buf)
    keep = data.draw(st.sampled_from([0, 0, 8, 16, 32]))  # keep the first offsets, sometimes
    noise = data.draw(st.binary(min_size=len(payload), max_size=len(payload)))
    fuzzed = head + payload[:keep] + noise[keep:]
    assert decode(fuzzed, "torch").stage != "header"  # every case reaches the decoder
    check_any_bytes(fuzzed, ("torch",))


@pytest.mark.parametrize("name", CODECS)
@TORCH
@given(data=st.data())
def test_torch_synthesized_buffers(name, data):
    buf = data.draw(synthesized(name, TORCH_NUMEL))
    assert decode(buf, "torch").stage != "header"
    check_any_bytes(buf, ("torch",))


@pytest.mark.parametrize("name", CODECS)
@settings(TORCH, max_examples=examples(50))
@given(data=st.data())
def test_torch_mutated_buffers(name, data):
    x, buf = data.draw(real_buffers(name, TORCH_NUMEL))
    ops = data.draw(st.lists(mutations(), min_size=1, max_size=4))
    fuzzed = mutate(buf, ops)
    check_any_bytes(fuzzed, ("torch",), original=x if fuzzed == buf else None)


@pytest.mark.parametrize("name", CODECS)
@TORCH
@given(data=st.data())
def test_torch_meta_changes_behind_a_valid_header(name, data):
    _, buf = data.draw(real_buffers(name, TORCH_NUMEL))
    check_any_bytes(apply_meta_change(buf, data.draw(meta_changes(name))), ("torch",))


# Triton (CPU interpreter): smaller inputs and fewer examples; every case decodes on
# both backends, which must agree, under the bounds checker.
BOTH = ("torch", "triton")


@needs_triton
@pytest.mark.parametrize("name", CODECS)
@TRITON
@given(data=st.data())
def test_triton_unmodified_buffers_round_trip(name, data):
    x, buf = data.draw(real_buffers(name, TRITON_NUMEL))
    check_any_bytes(buf, BOTH, original=x)


@needs_triton
@pytest.mark.parametrize("name", CODECS)
@TRITON
@given(data=st.data())
def test_triton_random_payload_behind_a_valid_header(name, data):
    _, buf = data.draw(real_buffers(name, TRITON_NUMEL))
    head, payload = _split(buf)
    keep = data.draw(st.sampled_from([0, 16, 32]))
    noise = data.draw(st.binary(min_size=len(payload), max_size=len(payload)))
    check_any_bytes(head + payload[:keep] + noise[keep:], BOTH)


@needs_triton
@pytest.mark.parametrize("name", CODECS)
@TRITON
@given(data=st.data())
def test_triton_synthesized_buffers(name, data):
    check_any_bytes(data.draw(synthesized(name, TRITON_NUMEL)), BOTH)


@needs_triton
@pytest.mark.parametrize("name", CODECS)
@settings(TRITON, max_examples=examples(12))
@given(data=st.data())
def test_triton_mutated_buffers(name, data):
    x, buf = data.draw(real_buffers(name, TRITON_NUMEL))
    ops = data.draw(st.lists(mutations(), min_size=1, max_size=3))
    fuzzed = mutate(buf, ops)
    check_any_bytes(fuzzed, BOTH, original=x if fuzzed == buf else None)


@needs_triton
@pytest.mark.parametrize("name", CODECS)
@TRITON
@given(data=st.data())
def test_triton_meta_changes_behind_a_valid_header(name, data):
    _, buf = data.draw(real_buffers(name, TRITON_NUMEL))
    check_any_bytes(apply_meta_change(buf, data.draw(meta_changes(name))), BOTH)
