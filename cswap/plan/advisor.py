"""The execution advisor: should a saved activation be compressed, and with which codec?

Inputs are what the tensor profiler measured for one iteration (`IterationProfile`,
one `TensorProfile` per offloaded tensor, in save order) and a device profile
(`cswap.tune.profile.Profile`, or any object with `bw_d2h`, `bw_h2d` in bytes/s,
`codecs` and `seconds(codec, direction, size, sparsity)`). The output is one
`Decision` per tensor: a codec, or None for "offload uncompressed".

Compressed sizes
----------------
`compressed_size` predicts the bytes of cswap's buffer for a codec (container
header + payload) from the formats' own layout functions (cswap.kernels.*.layout,
cswap.codecs.container.header_size), not from Size * (1 - sparsity). With
nnz = round(numel * (1 - sparsity)):

- zvc, csr: exact (the formats depend only on numel / the 2-D view and nnz).
- rle: exact given the number of runs R the encoder sees. The profiler counts
  maximal runs of non-zeros over the whole tensor; the encoder cuts runs at its
  tile boundaries, so R lies in [runs, runs + tiles - 1]. The estimate adds the
  expected number of cuts, (tiles - 1) * (nnz - runs) / numel (the chance that an
  element and its successor are both non-zero, taken as uniform along the
  tensor); the real size lies between the sizes at those two ends.
- zans: from the tensor's byte statistics when the profiler sampled them
  (TensorProfile.zans_bits: the payload `cswap.kernels.zans.predicted_size`
  expects from the tensor's byte-plane and mask histograms, in bits per element,
  scaled to the tensor's numel; 0 to 0.7% above the real buffer on the
  activations of benchmarks/ratio.py).
  Unsampled: the encoder's upper bound, `cswap.kernels.zans.size_bound` (about
  ZVC's size), so ZANS is chosen only on measured evidence.
- lz4: an estimate. cswap's encoder is LZ4's greedy parse (cswap.kernels.lz4):
  zero runs become matches, everything else is literals. The non-zero bytes are
  assumed not to repeat (activation values seldom do). Zero-run lengths are
  modelled as geometric with the measured mean (numel - nnz) / zero runs (zero
  runs ~ `runs`): a run of at least 4 bytes is matched whole, as one sequence
  (a match to an earlier zero run), or two when it has 12 bytes or more (the
  rest at offset 1); shorter runs stay literals, and so does the first byte of
  each chunk's first zero run (nothing earlier to match), and a match also takes
  in the bytes next to its run that repeat with it (a float's sign/exponent
  byte: about 2 bytes per run, 1 for 1-byte types, measured on the
  synthetic data of the tests). Each sequence costs its token, its length
  extension bytes (one per 255 of length past 15 / 19) and a 2-byte offset; one
  final literal-only sequence ends each block; the result is clamped to [one
  byte, LZ4's bound] per block and is never less than the block offsets section.
  Checked against the encoder in tests/test_advisor.py (blocky and iid data,
  fp32 and int8, 1 MiB and 256 KiB).

Independent mode (the paper's equations 1-4, with the real sizes S_c)
----------------------------------------------------------------------
Per tensor, with S = its bytes and s its sparsity:

    T'  = max(S / BW_d2h - Hidden_f, 0) + max(S / BW_h2d - Hidden_b, 0)
    T_c = Time_c(S, s) + Time_dc(S, s) + max(S_c / BW_d2h - Hidden_f, 0)
                                       + max(S_c / BW_h2d - Hidden_b, 0)

Compress with argmin_c T_c only if it is strictly below T' (ties between codecs
go to the first in `codecs` order). Each tensor is judged alone, as if it had
both PCIe links to itself.

Timeline mode (a model of one iteration with shared links)
----------------------------------------------------------
`simulate` replays one iteration as the runtime runs it (cswap.runtime.offload and
restore), in the spirit of SwapAdvisor's simulator. It is a model built from the
profiled timings, not a measurement:

- Forward: tensors are packed in save order. Pack admits a tensor while the device
  bytes in flight out (the tensor, and for a compressed one the room the runtime
  reserves for its payload in a steady step: ZVC's and ZANS's an eighth, at least
  64 KiB, over its size, another codec's the largest it writes, or the tensor's size
  where the size is read first) fit the stash window (an eighth of the pass, at least
  the largest) or fewer than two tensors are in flight; else forward waits for the
  oldest copy out to end, and every later save moves on by that wait.
  Encodes run in order on the codec stream from the save (Time_c). Copies run on the
  D2H link in the order they are issued (S_c / BW_d2h): a raw one at its save (pack
  sends it); a ZVC or ZANS one at its save too, starting once its encode has run (the
  worker queues it behind the encode, where the room and header are smaller than the
  tensor); any other compressed one by the runtime's sender
  thread once the encode's sizes have landed (read back on the same link, behind the
  copies issued before the encode ended) and the sender has the GIL: SEND_S later if
  the training thread is waiting then, else when it next waits, or SWITCH_S later at
  most, as the H200's traces showed (`sender_waits`: every compressed one so, as
  before c30342c). Forward stall = the sum of the waits, each charged to the
  tensor waited for.
  Under a memory budget (`budgeted`) one tensor in flight is enough to wait, and a
  payload holds its compressed size (the runtime reads it before copying out).
- Backward starts when forward's compute ends; a tensor whose copy out has not ended
  when it is restored is served from the device. Tensors are used in reverse save
  order at use_s (from the start of backward, shifted by the stalls so far). The
  first is restored when backward asks for it; after each use, the next restores are
  issued while the tensors restored ahead (each with its payload) fit the prefetch
  window (an eighth of the pass's bytes) or fewer than two are ahead. Copies in run
  in order on the H2D link (S_c / BW_h2d), decodes in order on the codec stream after
  their copy in (Time_dc); if a tensor is ready after its use time, the difference is
  a stall, which delays every later backward event.
- The advisor's timeline mode scores its options without the device's shortcut:
  every tensor leaves, and one whose copy out has not ended when backward asks for
  it waits for it (else a slower option, leaving a tensor on the device longer,
  would look better and save no memory).
- A codec kernel running beside compute delays it by SM_SHARE of its time (all of
  it: the kernels use every SM; the timed twin assumes the same): an encode in
  forward delays every later save, a decode every later use.
- exposed_s = forward stall + the sum of backward stalls, kernels included.

Timeline decisions are greedy, one pass: start from all uncompressed; visit the
tensors by decreasing size (ties in save order); for each, keep earlier choices
and pick the option among {None, codecs...} minimising the simulated exposed_s
(the kernels' time beside compute included), and at equal time the fewer bytes
moved; an option must be strictly better to replace the current one (None, then
`codecs` order, wins ties). Finally the independent decisions are scored the same way and kept
if strictly cheaper, so timeline mode never scores worse in its own model than
all-uncompressed or the independent choices. Decisions in timeline mode still
report T' and T_c from equations 1-4; only `codec` (and `t_best`) follow the
greedy choice.

All input errors are ValueErrors prefixed ``cswap.plan.advisor:``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from math import prod
from typing import Callable, Iterable, Mapping

from .. import codecs as _codecs
from ..codecs.container import header_size
from ..kernels import csr as _csr
from ..kernels import lz4 as _lz4
from ..kernels import rle as _rle
from ..kernels import zans as _zans
from ..kernels import zvc as _zvc

__all__ = ["TensorProfile", "IterationProfile", "Decision", "SimResult", "Advisor", "compressed_size",
           "simulate"]

_WHERE = "cswap.plan.advisor"
MODES = ("independent", "timeline")
# Codec meta fields in the container header (see each codec's module docstring).
_N_META = {"zvc": 2, "rle": 3, "csr": 4, "lz4": 3, "zans": 5}
_ITEMSIZES = (1, 2, 4, 8)


def _fail(msg: str):
    raise ValueError(f"{_WHERE}: {msg}")


def _non_negative(value, what: str, unit: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        _fail(f"{what} must be a number of {unit}, got {value!r}")
    if not math.isfinite(v) or v < 0:
        _fail(f"{what} must be a finite, non-negative number of {unit}, got {value!r}")
    return v


def _time(value, what: str) -> float:
    return _non_negative(value, what, "seconds")


def _sparsity(value, what: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        _fail(f"{what} must be a number in [0, 1], got {value!r}")
    if not 0.0 <= v <= 1.0:  # also rejects NaN
        _fail(f"{what} must be in [0, 1], got {value!r}")
    return v


def _bits(value, what: str) -> float:
    return _non_negative(value, what, "bits per element")


def _count(value, what: str) -> int:
    if isinstance(value, bool):
        _fail(f"{what} must be a non-negative integer, got {value!r}")
    try:
        v = int(value)
    except (TypeError, ValueError):
        _fail(f"{what} must be a non-negative integer, got {value!r}")
    if v != value or v < 0:
        _fail(f"{what} must be a non-negative integer, got {value!r}")
    return v


def _shape(shape, what: str = "shape") -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        _fail(f"{what} must be a sequence of non-negative integers, got {shape!r}")
    return tuple(_count(d, f"{what} {dims}: dimension") for d in dims)


def _itemsize(value) -> int:
    v = _count(value, "itemsize")
    if v not in _ITEMSIZES:
        _fail(f"itemsize must be one of {_ITEMSIZES} bytes (the codecs' word sizes), got {value!r}")
    return v


# -- profiles ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorProfile:
    """What the tensor profiler measured for one offloaded tensor in one iteration.

    key: stable id across iterations ("3:features.3"); layer, layer_type, op:
    where it came from; shape and itemsize (bytes per element); sparsity: the
    fraction of all-zero elements; runs: maximal runs of non-zero elements (for
    the RLE and LZ4 sizes); save_s: seconds from the start of forward to its
    save; use_s: seconds from the start of backward to its first use; hidden_f /
    hidden_b: compute that can overlap its offload / prefetch (the paper's
    Hidden_f, Hidden_b); zans_bits: ZANS's predicted payload in bits per element,
    from the tensor's sampled byte histograms (None when not sampled). Checked on
    construction (ValueError).
    """

    key: str
    layer: str
    layer_type: str
    op: str
    shape: tuple[int, ...]
    itemsize: int
    sparsity: float
    runs: int
    save_s: float
    use_s: float
    hidden_f: float
    hidden_b: float
    zans_bits: float | None = None

    def __post_init__(self):
        if not isinstance(self.key, str) or not self.key:
            _fail(f"a tensor's key must be a non-empty string, got {self.key!r}")
        where = f"tensor {self.key!r}"
        for name in ("layer", "layer_type", "op"):
            if not isinstance(getattr(self, name), str):
                _fail(f"{where}: {name} must be a string, got {getattr(self, name)!r}")
        set_ = object.__setattr__
        set_(self, "shape", _shape(self.shape, f"{where}: shape"))
        set_(self, "itemsize", _itemsize(self.itemsize))
        set_(self, "sparsity", _sparsity(self.sparsity, f"{where}: sparsity"))
        set_(self, "runs", _count(self.runs, f"{where}: runs"))
        for name in ("save_s", "use_s", "hidden_f", "hidden_b"):
            set_(self, name, _time(getattr(self, name), f"{where}: {name}"))
        if self.zans_bits is not None:
            set_(self, "zans_bits", _bits(self.zans_bits, f"{where}: zans_bits"))

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class IterationProfile:
    """One timed iteration: forward and backward durations and the offloaded tensors in save order."""

    forward_s: float
    backward_s: float
    tensors: tuple[TensorProfile, ...]

    def __post_init__(self):
        object.__setattr__(self, "forward_s", _time(self.forward_s, "forward_s"))
        object.__setattr__(self, "backward_s", _time(self.backward_s, "backward_s"))
        tensors = tuple(self.tensors)
        seen = set()
        for t in tensors:
            if not isinstance(t, TensorProfile):
                _fail(f"tensors must be TensorProfile objects, got {type(t).__name__}")
            if t.key in seen:
                _fail(f"duplicate tensor key {t.key!r} in one iteration; keys must be unique")
            seen.add(t.key)
        object.__setattr__(self, "tensors", tensors)


@dataclass(frozen=True)
class Decision:
    """The advisor's verdict for one tensor.

    codec: the codec to use, or None to offload uncompressed. t_prime: eq. 1,
    the exposed swap time without compression (s). t_best: T of the chosen
    codec (eq. 2-4), or t_prime when codec is None. t_codec: T per codec
    considered. sizes: predicted compressed bytes per codec (header included).
    """

    key: str
    codec: str | None
    t_prime: float
    t_best: float
    t_codec: dict[str, float] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class SimResult:
    """The timeline model's verdict on one iteration (seconds; see the module docstring)."""

    exposed_s: float
    forward_stall_s: float
    backward_stall_s: float
    per_tensor_stall_s: dict[str, float]
    # per tensor, seconds from the start of the iteration (backward shifted by the stalls):
    offload_end_s: dict[str, float] = field(default_factory=dict)    # its copy out is done
    restore_start_s: dict[str, float] = field(default_factory=dict)  # its copy back starts
    use_at_s: dict[str, float] = field(default_factory=dict)         # it is used (after any stall)
    restore_issued_s: dict[str, float] = field(default_factory=dict)  # its restore is queued (memory taken)
    restored_s: dict[str, float] = field(default_factory=dict)       # it is back (copied in, decoded)
    # per tensor, the index of the tensor at whose save its device memory is gone at the latest
    # (the forward waits there for its copy out; len(tensors): by the end of forward)
    freed_by_save: dict[str, int] = field(default_factory=dict)


# -- compressed sizes -------------------------------------------------------------------------------------


def _clamp_runs(runs: int, numel: int, nnz: int) -> int:
    """Runs consistent with nnz: at least one if anything is non-zero, at most nnz
    and at most one more than the zeros (sparsity and runs may be sampled apart)."""
    if nnz == 0:
        return 0
    return max(1, min(runs, nnz, numel - nnz + 1))


def _rle_runs_estimate(numel: int, nnz: int, runs: int) -> int:
    """Runs the RLE encoder sees: `runs` plus the expected cuts at tile boundaries."""
    tiles = -(-numel // _rle.TILE)
    if numel == 0 or tiles <= 1:
        return runs
    cuts = round((tiles - 1) * (nnz - runs) / numel)
    return runs + min(max(cuts, 0), tiles - 1)


def _ext(length: float, base: int) -> float:
    """LZ4 length-extension bytes for a literal (base 15) or match (base 19) length."""
    return 0.0 if length < base else float((length - base) // 255 + 1)


def _lz4_blocks_estimate(numel: int, itemsize: int, nnz: int, runs: int) -> int:
    """Estimated size of the blocks section of cswap's LZ4 payload (see the module docstring)."""
    total = numel * itemsize
    if total == 0:
        return 0
    chunk = _lz4.CHUNK
    chunks = -(-total // chunk)
    zeros = numel - nnz
    # zero runs: between non-zero runs (runs - 1 .. runs + 1 of them), plus splits at chunk ends
    zero_runs = 0.0 if zeros == 0 else (1.0 if nnz == 0 else float(max(runs, 1)))
    if zeros:
        zero_runs += (chunks - 1) * zeros / numel
    matched = seq_one = seq_two = 0.0
    if zero_runs > 0:
        mu = zeros / zero_runs                 # mean zero-run length, elements
        q = 1.0 - 1.0 / mu if mu > 1 else 0.0  # geometric: P(L >= j) = q ** (j - 1)
        k4 = -(-_lz4.MINMATCH // itemsize)     # elements in the shortest run a match covers
        k2 = -(-(3 * _lz4.MINMATCH) // itemsize)  # ... in the shortest taking two sequences
        short = sum(j * (1.0 - q) * q ** (j - 1) for j in range(1, k4))  # E[L; L < k4]
        matched = itemsize * (zeros - zero_runs * short)
        seq_one = zero_runs * q ** (k4 - 1)
        seq_two = zero_runs * q ** (k2 - 1)
        # each chunk's first zero run has nothing earlier to match: its first byte is a
        # literal, the rest a match at offset 1
        matched -= min(float(chunks), seq_one)
        # a match also takes in neighbouring bytes that repeat with the zeros (a float's
        # sign/exponent byte before the run, measured: about 2 per run; 1 for bytes)
        matched += seq_one * min(itemsize, 2)
    matched = min(max(matched, 0.0), max(total - chunks * _lz4.LASTLITERALS, 0.0))
    literals = total - matched
    seqs = seq_one + seq_two
    lit_seqs = seq_one + chunks                # sequences carrying literals (second ones of a run carry none)
    size = seqs + chunks + literals + 2.0 * seqs  # tokens, literals, offsets
    size += lit_seqs * _ext(literals / lit_seqs, 15)
    if seqs > 0:
        size += seqs * _ext(matched / seqs, 19)
    full, tail = divmod(total, chunk)
    bound = full * _lz4.block_bound(chunk) + (_lz4.block_bound(tail) if tail else 0)
    return int(min(max(round(size), chunks), bound))


def compressed_size(codec: str, shape, itemsize: int, sparsity: float, runs: int,
                    zans_bits: float | None = None) -> int:
    """Predicted total bytes (container header + payload) of cswap's buffer for `codec`.

    nnz = round(numel * (1 - sparsity)). zvc and csr are exact; rle is exact
    given the runs the encoder sees and estimates the cuts at its tile
    boundaries (the real size lies between the sizes for `runs` and
    `runs + tiles - 1` runs); lz4 is an estimate (module docstring); zans is
    numel * zans_bits / 8 when the tensor's bytes were sampled (never above the
    bound), else the upper bound cswap.kernels.zans.size_bound. `runs` is
    clamped to what nnz allows. Unknown codec: ValueError.
    """
    if codec not in _N_META:
        _fail(f"unknown codec {codec!r}; compressed_size knows {', '.join(_N_META)}")
    shape = _shape(shape)
    itemsize = _itemsize(itemsize)
    sparsity = _sparsity(sparsity, "sparsity")
    runs = _count(runs, "runs")
    numel = prod(shape)
    nnz = min(max(round(numel * (1.0 - sparsity)), 0), numel)
    runs = _clamp_runs(runs, numel, nnz)
    header = header_size(len(shape), _N_META[codec])
    if codec == "zvc":
        payload = _zvc.layout(numel, _zvc.TILE, nnz, itemsize)[-1]
    elif codec == "csr":
        rows, cols = _csr.view_2d(shape)
        payload = _csr.layout(rows, nnz, _csr.index_bytes_for(cols), itemsize)[-1]
    elif codec == "rle":
        payload = _rle.layout(numel, _rle.TILE, _rle_runs_estimate(numel, nnz, runs), nnz, itemsize)[-1]
    elif codec == "zans":
        payload = _zans.size_bound(numel, itemsize, nnz)
        if zans_bits is not None:
            payload = min(payload, math.ceil(numel * _bits(zans_bits, "zans_bits") / 8))
    else:
        num_chunks = -(-numel * itemsize // _lz4.CHUNK)
        payload = _lz4.layout(num_chunks, _lz4_blocks_estimate(numel, itemsize, nnz, runs))[-1]
    return header + payload


# -- per-tensor costs -------------------------------------------------------------------------------------


def _check_profile(profile) -> tuple[float, float, tuple[str, ...]]:
    for name in ("bw_d2h", "bw_h2d", "codecs", "seconds"):
        if not hasattr(profile, name):
            _fail(f"the profile has no {name!r}; pass a cswap.tune.profile.Profile (cswap.load_profile())")
    bws = []
    for name in ("bw_d2h", "bw_h2d"):
        bw = getattr(profile, name)
        if not isinstance(bw, (int, float)) or not math.isfinite(bw) or bw <= 0:
            _fail(f"the profile's {name} must be a positive number of bytes/s, got {bw!r}")
        bws.append(float(bw))
    return bws[0], bws[1], tuple(profile.codecs)


def _seconds(profile, codec: str, direction: str, size: int, sparsity: float) -> float:
    v = float(profile.seconds(codec, direction, size, sparsity))
    if not math.isfinite(v):
        _fail(f"the profile predicts {v} s to {direction} {size} bytes with {codec}; check its time model")
    return max(v, 0.0)


# The training thread's time per offloaded tensor, pack and unpack together: 185 us, measured by
# benchmarks/overhead.py --devices cuda on an H200's host (cswap's vdnn against unpatched; 184 us in
# the quieter of two runs, benchmarks/results/nvidia-h200/overhead-ab/new-1). The CPU stand-in for
# that path measured about 100 us on this project's 2-core CPU: the CUDA calls themselves cost more.
# A profile carries its own machine's figure (runtime.host_us_per_tensor, which cswap-tune measures).
# The timeline counts it in full: the host issues the compute, so a host that falls behind delays it.
HOST_S_PER_TENSOR = 185e-6


def host_seconds(profile) -> float:
    """The profile's host seconds per offloaded tensor, else HOST_S_PER_TENSOR."""
    value = getattr(profile, "host_s_per_tensor", None)
    return HOST_S_PER_TENSOR if value is None else float(value)


@dataclass
class _Costs:
    """Everything about one tensor the two modes need: sizes and kernel times per option, and
    the training thread's time when it is offloaded at all (any option but keep)."""

    size: dict[str | None, int]
    t_c: dict[str | None, float]
    t_dc: dict[str | None, float]
    host: float = 0.0


def _costs(t: TensorProfile, profile, codecs: Iterable[str], sizes: Mapping[str, int] | None = None) -> _Costs:
    c = _Costs({None: t.nbytes}, {None: 0.0}, {None: 0.0}, host_seconds(profile))
    for codec in codecs:
        if sizes is not None and codec in sizes:
            c.size[codec] = _count(sizes[codec], f"tensor {t.key!r}: size for {codec}")
        else:
            c.size[codec] = compressed_size(codec, t.shape, t.itemsize, t.sparsity, t.runs, t.zans_bits)
        c.t_c[codec] = _seconds(profile, codec, "compress", t.nbytes, t.sparsity)
        c.t_dc[codec] = _seconds(profile, codec, "decompress", t.nbytes, t.sparsity)
    return c


def _exposed(size: float, t: TensorProfile, bw_d2h: float, bw_h2d: float) -> float:
    return max(size / bw_d2h - t.hidden_f, 0.0) + max(size / bw_h2d - t.hidden_b, 0.0)


# -- the timeline model -----------------------------------------------------------------------------------


WINDOW_FRACTION = 8  # the runtime's default stash and prefetch windows: an eighth of a pass (Swapper)
WINDOW_LEAST = 2     # and at least this many tensors in flight, the largest included
# Of a codec kernel's time, what compute running beside it loses: the kernels use every SM, so
# compute yields them for about as long (assumed, as the timed twin assumes by default,
# cswap.runtime.twin.TwinSpec.sm_share; not measured: a GPU trace will tell).
SM_SHARE = 1.0
# A compressed tensor's copy out is queued by the runtime's sender thread once its encode's
# sizes have landed on the host (cswap.runtime.offload: send). The sender is Python: it needs
# the GIL, which the training thread holds while it runs forward. On the H200 (the profiled
# sc and cswap steps of benchmarks/results/nvidia-h200/trace/, 2026-12-04) a copy went out
# 0.1-0.5 ms after its sizes landed when the training thread was waiting (median 0.4: SEND_S),
# and 2.6-4.4 ms after when it had just resumed forward: when it next waited, or 5 ms later at
# most (SWITCH_S, the largest wait seen, rounded up). Not Python's switch interval: each aten
# call lets the GIL go and takes it back before a waiting thread runs, which restarts that
# thread's interval; its wait is a race it wins sooner or later (benchmarks/gil_wait.py).
SEND_S = 0.4e-3
SWITCH_S = 5e-3


def _room(t: TensorProfile, codec: str, size: int) -> int:
    """The device bytes the runtime reserves for the tensor's payload in a steady step."""
    room = _codecs.get(codec).room_nbytes(t.numel, t.itemsize, size)
    return t.nbytes if room is None else room


def _sent_at_encode(t: TensorProfile, codec: str | None, size: int, budgeted: bool) -> bool:
    """Whether the runtime queues the tensor's copy out right behind its encode
    (cswap.runtime.offload._copy_early: as many bytes as the pass before's payload, the same
    in a steady step): a bounded codec's, where its room and header are smaller than the
    tensor; else the sender queues it once the sizes have landed. Under a memory budget the
    runtime reads each size first."""
    if codec is None or budgeted or not _codecs.get(codec).bounded:
        return False
    return header_size(len(t.shape), _N_META[codec]) + _room(t, codec, size) < t.nbytes


def _timeline(iteration: IterationProfile, options: list[str | None], costs: list[_Costs], bw_d2h: float,
              bw_h2d: float, served_from_device: bool = True, budgeted: bool = False,
              decode_waits: bool = False, sender_waits: bool = False) -> SimResult:
    tensors = iteration.tensors
    n = len(tensors)
    per = {t.key: 0.0 for t in tensors}
    # The device bytes each holds while in flight out: the tensor, and for a compressed one the
    # room reserved for its payload (cswap.runtime.offload.footprint: the largest its codec can
    # write, ZVC's and ZANS's an eighth, at least 64 KiB, over its size; the tensor's size again
    # where the size is read first); under a memory budget, the payload at its size, and one
    # tensor in flight at least
    if budgeted:
        footprint = [t.nbytes + (c.size[k] if k else 0) for t, k, c in zip(tensors, options, costs)]
    else:
        footprint = [t.nbytes + (_room(t, k, c.size[k]) if k else 0) for t, k, c in zip(tensors, options, costs)]
    least = 1 if budgeted else WINDOW_LEAST
    stash = max(max(footprint, default=0), sum(footprint) // WINDOW_FRACTION)
    # forward: pack admits a tensor while the footprints in flight fit the stash (two at least),
    # else it waits for the oldest copy out; encodes run in order on the codec stream, copies
    # in order of issue on the D2H link: a raw one at its save (pack sends it), a bounded
    # codec's at its save too, starting once its encode has run (the worker queues it behind
    # the encode), any other compressed one when the sender has its sizes (read back on the
    # link behind the copies issued before its encode ended) and the GIL (SEND_S, SWITCH_S);
    # so did every compressed one before c30342c (sender_waits)
    early = [not sender_waits and _sent_at_encode(t, k, c.size[k] if k else 0, budgeted)
             for t, k, c in zip(tensors, options, costs)]
    shift = compress = link = late = 0.0
    offload_end = [math.inf] * n  # (inf: not issued yet)
    queued = [math.inf] * n  # when each copy out was queued
    encoded = [0.0] * n
    freed_by = [n] * n
    inflight: list[int] = []
    unsent: list[int] = []  # compressed, their copies not issued yet, in order
    copies: list[tuple[float, float]] = []  # (issued at, ends) per copy out, in order of issue
    sender = 0.0  # when the sender issued its last copy

    def issue(j: int, at: float, ready: float = 0.0) -> None:
        nonlocal link
        queued[j] = at
        link = offload_end[j] = max(at, link, ready) + costs[j].size[options[j]] / bw_d2h
        copies.append((at, link))

    def landed(j: int) -> float:  # the sizes' copy waits for the copies issued before it was queued
        for at, end in reversed(copies):  # (ends grow in order of issue: the last such is the latest)
            if at <= encoded[j]:
                return max(encoded[j], end)
        return encoded[j]

    def send_landed(until: float, blocked_from: float | None = None) -> None:
        """Issue the sender's copies whose sizes have landed by `until`. While the training
        thread runs (blocked_from None) the sender has the GIL only at the switch interval;
        while it is blocked (from `blocked_from`), at once (sizes that land as it wakes,
        behind the copy it waited for, lose the GIL to it)."""
        nonlocal sender
        while unsent:
            at = landed(unsent[0])
            if blocked_from is None:
                if at + SWITCH_S > until:
                    return
                gil = at + SWITCH_S
            else:
                if at >= until:
                    return
                gil = max(at, blocked_from)
            sender = max(sender, gil) + SEND_S
            issue(unsent.pop(0), sender)

    for i, t in enumerate(tensors):
        c, k = costs[i], options[i]
        save = t.save_s + shift
        send_landed(save)
        for j in inflight:
            if offload_end[j] <= save:  # (released by this save)
                freed_by[j] = i
        inflight = [j for j in inflight if offload_end[j] > save]
        while len(inflight) >= least and sum(footprint[j] for j in inflight) + footprint[i] > stash:
            oldest = inflight.pop(0)
            freed_by[oldest] = i
            while oldest in unsent:  # the training thread waits: the sender has the GIL
                send_landed(max(save, landed(unsent[0])) + SEND_S, blocked_from=save)
            wait = offload_end[oldest] - save
            if wait > 0:
                send_landed(save + wait, blocked_from=save)
                per[tensors[oldest].key] += wait
                shift += wait
                save += wait
        if k is not None:
            start = max(save, compress)
            compress = encoded[i] = start + c.t_c[k]
            if start < iteration.forward_s + shift:  # beside forward's compute, which yields the SMs
                shift += SM_SHARE * c.t_c[k]
                per[t.key] += SM_SHARE * c.t_c[k]
            else:  # beside backward's
                late += SM_SHARE * c.t_c[k]
            if early[i]:
                issue(i, save, ready=encoded[i])
            else:
                unsent.append(i)
        else:
            issue(i, save)
        inflight.append(i)
    forward_end = iteration.forward_s + shift
    send_landed(forward_end)  # (forward runs until its end; then autograd's engine, in C++)
    send_landed(math.inf, blocked_from=forward_end)
    forward_stall = shift
    # backward starts at once: a restore waits until the tensor's copy out is queued
    # (Offloader.wait_issued), and a tensor whose copy out has not ended then is served from
    # the device. Restores go ahead of use within the prefetch window (an eighth of the pass's
    # bytes, two at least), refilled once half of what is ahead has been used (Restorer.prefetch):
    # copies in order on the H2D link, decodes in order on the codec stream after their copy
    # in; compute waits for the one it uses
    b0 = iteration.forward_s + forward_stall
    window = sum(t.nbytes for t in tensors) // WINDOW_FRACTION
    restore_start: dict[str, float] = {}
    issued_at: dict[str, float] = {}
    ready_at: dict[int, float] = {}
    used: dict[str, float] = {}
    h2d = decode = b0
    ahead: list[int] = []
    order = list(range(n - 1, -1, -1))
    issued = 0  # restores issued, in `order`

    def restore(i: int, at: float) -> None:
        nonlocal h2d, decode, back
        c, k = costs[i], options[i]
        at = max(at, queued[i])
        issued_at[tensors[i].key] = at
        if served_from_device and offload_end[i] > at:  # not yet released: served from the device
            restore_start[tensors[i].key] = ready_at[i] = at
            return
        start = restore_start[tensors[i].key] = max(at, h2d, offload_end[i])
        h2d = end = start + c.size[k] / bw_h2d
        if k is not None:
            decode = end = max(end, decode) + c.t_dc[k]
            back += SM_SHARE * c.t_dc[k]  # (beside backward's compute, which yields the SMs)
            per[tensors[i].key] += SM_SHARE * c.t_dc[k]
        ready_at[i] = end

    def held(i: int) -> int:  # what a restore ahead of use holds: the tensor and its payload
        return tensors[i].nbytes + (costs[i].size[options[i]] if options[i] else 0)

    back = late
    if n:
        per[tensors[-1].key] += late
    # With decode_waits, autograd's thread blocks on each decode while the GPU runs the kernels
    # it queued before: once it has waited, it reaches the next unpacks, and queues their
    # restores, when it last resumed (`host`), and the op that asked waits only for what the
    # thread waited beyond the GPU's own time (inf: it has not waited, or never does)
    host = math.inf
    for i in order:
        t = tensors[i]
        use = b0 + t.use_s + back
        if i not in ready_at:  # not restored ahead: on demand
            at = min(host, use)
            restore(i, at)
            if decode_waits and options[i] is not None:
                host = max(at, ready_at[i])
            issued += 1
        if i in ahead:
            ahead.remove(i)
        stall = max(0.0, ready_at[i] - use)
        if stall > 0:
            per[t.key] += stall
            back += stall
            use += stall
        used[t.key] = use
        at = min(host, use)
        refill = not ahead or sum(held(a) for a in ahead) <= window // 2
        while refill and issued < n:  # the next restores, within the window
            j = order[issued]
            if j in ready_at:
                issued += 1
                continue
            if len(ahead) >= least and sum(held(a) for a in ahead) + held(j) > window:
                break
            restore(j, at)
            if decode_waits and options[j] is not None:  # (the thread waits for it)
                at = host = max(at, ready_at[j])
                if host > use:
                    per[tensors[j].key] += host - use
                    back += host - use
                    use = host
            ahead.append(j)
            issued += 1
    return SimResult(exposed_s=forward_stall + back, forward_stall_s=forward_stall, backward_stall_s=back,
                     per_tensor_stall_s=per, offload_end_s={t.key: e for t, e in zip(tensors, offload_end)},
                     restore_start_s=restore_start, use_at_s=used, restore_issued_s=issued_at,
                     restored_s={tensors[i].key: e for i, e in ready_at.items()},
                     freed_by_save={t.key: f for t, f in zip(tensors, freed_by)})


def simulate(iteration: IterationProfile, choices: Mapping[str, str | None], profile,
             codecs_sizes: Mapping[str, Mapping[str, int]] | None = None,
             served_from_device: bool = True, budgeted: bool = False, decode_waits: bool = False,
             sender_waits: bool = False) -> SimResult:
    """Replay one iteration in the timeline model (module docstring) with each tensor's
    codec from `choices` (key -> codec or None; keys left out are offloaded
    uncompressed). codecs_sizes: optional key -> {codec: bytes} (e.g. Decision.sizes)
    overriding `compressed_size`. served_from_device: a tensor whose copy out has not
    ended when backward asks for it is served from the device, as the runtime does
    (False: it is waited for, as the advisor scores its options). budgeted: the runtime
    under a memory budget (windows admit one tensor at least, payloads held at their
    size, with no room reserved). decode_waits: the thread that queues a decode waits for it
    (while the GPU runs the kernels queued before), as the runtime did before 138c7ca (torch 2.11 on CUDA copied each decode's verdict from
    pageable memory and synchronized; benchmarks/twin.py --pageable-verdict replays the same);
    sender_waits: every compressed copy out is queued by the sender thread once the sizes have
    landed, as the runtime did before c30342c (a bounded codec's is now queued behind its
    encode): both for setting a GPU's measurement of that runtime beside the model. A model,
    not a measurement."""
    if not isinstance(iteration, IterationProfile):
        _fail(f"simulate needs an IterationProfile, got {type(iteration).__name__}")
    bw_d2h, bw_h2d, available = _check_profile(profile)
    keys = {t.key for t in iteration.tensors}
    for key, codec in choices.items():
        if key not in keys:
            _fail(f"choices name tensor {key!r}, which is not in the iteration")
        if codec is not None and (codec not in available or codec not in _N_META):
            _fail(f"tensor {key!r}: codec {codec!r} is not in the profile (it has {', '.join(available)})")
    options = [choices.get(t.key) for t in iteration.tensors]
    sizes = codecs_sizes or {}
    costs = [_costs(t, profile, [k] if k else [], sizes.get(t.key)) for t, k in zip(iteration.tensors, options)]
    return _timeline(iteration, options, costs, bw_d2h, bw_h2d, served_from_device, budgeted, decode_waits,
                     sender_waits)


# -- the advisor ------------------------------------------------------------------------------------------


class Advisor:
    """Decides per tensor whether to compress before offloading, and with which codec.

        advisor = Advisor(cswap.load_profile())               # paper eq. 1-4, per tensor
        advisor = Advisor(profile, mode="timeline")           # shared links, greedy
        decisions = advisor.decide(iteration)                 # {key: Decision}
        codec_of = advisor.policy(decisions)                  # key -> codec or None

    codecs: the codecs to consider, in tie-break order (default: the profile's).
    """

    def __init__(self, profile, codecs=None, mode: str = "independent"):
        if mode not in MODES:
            _fail(f"mode must be one of {MODES}, got {mode!r}")
        self.bw_d2h, self.bw_h2d, available = _check_profile(profile)
        if codecs is None:
            codecs = available
        elif isinstance(codecs, str):
            codecs = (codecs,)
        codecs = tuple(codecs)
        for c in codecs:
            if c not in available:
                _fail(f"codec {c!r} is not in the profile (it has {', '.join(available) or 'none'})")
            if c not in _N_META:
                _fail(f"codec {c!r} has no size model; the advisor knows {', '.join(_N_META)}")
        if len(set(codecs)) != len(codecs):
            _fail(f"codecs {codecs} name a codec twice")
        self.profile = profile
        self.codecs = codecs
        self.mode = mode

    def __repr__(self) -> str:
        return f"Advisor(mode={self.mode!r}, codecs={self.codecs})"

    def decide(self, iteration: IterationProfile) -> dict[str, Decision]:
        """One Decision per tensor of `iteration`, keyed by TensorProfile.key."""
        if not isinstance(iteration, IterationProfile):
            _fail(f"decide needs an IterationProfile, got {type(iteration).__name__}")
        tensors = iteration.tensors
        costs = [_costs(t, self.profile, self.codecs) for t in tensors]
        t_primes, t_codecs, independent = [], [], []
        for t, c in zip(tensors, costs):
            t_prime = _exposed(t.nbytes, t, self.bw_d2h, self.bw_h2d)
            t_codec = {k: c.t_c[k] + c.t_dc[k] + _exposed(c.size[k], t, self.bw_d2h, self.bw_h2d)
                       for k in self.codecs}
            best = None
            for k in self.codecs:  # strict <: ties go to the earlier codec
                if best is None or t_codec[k] < t_codec[best]:
                    best = k
            t_primes.append(t_prime)
            t_codecs.append(t_codec)
            independent.append(best if best is not None and t_codec[best] < t_prime else None)
        chosen = independent
        if self.mode == "timeline":
            chosen = self._greedy(iteration, costs, independent)
        return {t.key: Decision(key=t.key, codec=k, t_prime=tp, t_best=tc[k] if k is not None else tp,
                                t_codec=tc, sizes={name: c.size[name] for name in self.codecs})
                for t, c, k, tp, tc in zip(tensors, costs, chosen, t_primes, t_codecs)}

    def _score(self, iteration, options, costs) -> tuple[float, int]:
        """(exposed time, the kernels' included, bytes moved): at equal time, the option that
        moves fewer bytes (which frees the device and the link sooner) wins."""
        # (every tensor leaves: one served from the device because its copy out is slow would
        # make the slower option look better, and save no memory)
        sim = _timeline(iteration, options, costs, self.bw_d2h, self.bw_h2d, served_from_device=False)
        moved = sum(c.size[k] for k, c in zip(options, costs))
        return sim.exposed_s, moved

    def _greedy(self, iteration: IterationProfile, costs: list[_Costs],
                independent: list[str | None]) -> list[str | None]:
        n = len(iteration.tensors)
        options: list[str | None] = [None] * n
        best_score = self._score(iteration, options, costs)
        order = sorted(range(n), key=lambda i: (-iteration.tensors[i].nbytes, i))
        for i in order:
            for k in self.codecs:
                trial = options.copy()
                trial[i] = k
                score = self._score(iteration, trial, costs)
                if score < best_score:
                    options, best_score = trial, score
        if self._score(iteration, independent, costs) < best_score:
            options = list(independent)
        return options

    def policy(self, decisions: Mapping[str, Decision]) -> Callable:
        """f(key) -> codec or None (None for keys without a decision). f also
        accepts an object with a `.key` (a cswap.SwapInfo), so it can be passed
        as `cswap.patch(model, policy=...)`."""
        table = {key: d.codec for key, d in decisions.items()}

        def codec_for(key):
            return table.get(getattr(key, "key", key))

        return codec_for
