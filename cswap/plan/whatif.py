"""What training a model on a named GPU will cost, predicted without the GPU.

    p = cswap.predict(model, torch.empty(256, 3, 224, 224), gpu="h100-sxm-80gb")
    p.peak_bytes("cswap"), p.step_seconds("vdnn"), p.fits("none"), p.largest_batch("cswap")

The pieces, each saying where its figures come from:

- memory: one step traced on a fake GPU (cswap.plan.fake_gpu: every saved
  tensor, each op, the memory in use after each op, when each saved storage
  could leave the device). A mode's curve is the traced one minus, for every
  storage it offloads, its bytes from when it has left (the later of the step
  dropping its last reference and its copy out ending, from the timeline) until
  its copy back starts, plus the compressed buffer while it is being made and
  copied. When the link falls behind, the forward waits at the next offloaded
  tensor's save for the copy before it to end (the runtime's stash limit,
  modelled as one tensor in flight), so a tensor is gone by then at the latest.
  It fits when its peak is within the GPU's memory minus RESERVE_BYTES.
- compute: per op, cswap.plan.roofline's time model by op class (matmul,
  convolution, attention, memory-bound), fitted on published runs; with
  `times` (forward and backward seconds a cswap run measured on that GPU, e.g.
  its epoch report), each phase's ops scaled so the phase takes the measured time.
- transfers and codecs: a cswap-tune profile of that GPU when given (measured);
  otherwise AssumedProfile: the link as measured where this project measured it
  (GPU.measured_link: the H200), else at LINK_EFFICIENCY of its rate (assumed), and
  each codec at a stated fraction of HBM bandwidth (measured on the H200).
- sparsity: measured on real CPU steps, a file, or one number (cswap.plan.sparsity).
  Measured sparsity also gives ZANS's size per tensor (from its byte histograms,
  for the trace's dtype); otherwise the advisor takes ZANS's upper bound.
- the timeline: the runtime's, as cswap.plan.advisor.simulate models it (the
  stash and prefetch windows, compression and decoding on their own streams, the
  D2H and H2D links, a stall when a restore is late, codec kernels delaying the
  compute they run beside), with compute per op from above. Step time = compute +
  exposed time (transfers and kernels) + the training thread's time per
  offloaded tensor.

Modes are cswap.patch's: none, vdnn (every candidate raw), sc (ZVC on every
candidate), cswap (the advisor's choice per tensor, paper eq. 1-4); candidates
are ReLU and pooling outputs of at least MIN_BYTES, as in the runtime (or, in a
model without them such as a GELU transformer, every saved activation of that
size, as the runtime's default candidates="auto" does). Mode
"budget" is cswap.plan.budget's plan for the GPU's capacity (or the budget, if
given) over every saved activation of at least MIN_BYTES (keep, raw or a codec
each), checked on the full curve and planned again with any overshoot taken off.
Mode "recompute" is the same with checkpointing blocks as a fourth choice
(cswap.plan.recompute; `recompute=`: "auto" for the model's repeated blocks,
module names, a predicate, or False), shown when some block saves activations.
"""

from __future__ import annotations

import json
import math
import sys
from math import prod
from pathlib import Path
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from .. import codecs
from . import workspaces
from .advisor import Advisor, IterationProfile, TensorProfile, host_seconds, simulate
from .budget import KEEP, Instance, parse_bytes, plan_budget
from .recompute import RECOMPUTE, Block, inside, plan_with_recompute, resolve
from .gpus import GPU, gpu as lookup
from .inputs import Inputs
from .optimizers import paged_bytes
from .roofline import ADAPTER_DTYPES, PRECISIONS, op_times, time_model, trace_for
from .sparsity import SPARSE_OPS, Sparsity, dtype_name, record_keys

__all__ = ["AssumedProfile", "LINK_EFFICIENCY", "MIN_BYTES", "MODES", "RESERVE_BYTES", "ModePrediction",
           "Prediction", "TensorPrediction", "gib", "measured_times", "parse_bytes", "predict"]

MODES = ("none", "vdnn", "sc", "cswap")
BUDGETED = ("budget", "recompute")  # the modes that run under a memory budget (its windows)
MIN_BYTES = 1 << 20  # the runtime's default min_bytes on CUDA
# The CUDA context, cuBLAS's workspace and allocator fragmentation, which no trace of
# tensors sees: about 0.5-1 GiB on recent GPUs with PyTorch. Assumed. (cuDNN's convolution
# workspaces are on the curve: cswap.plan.workspaces.)
RESERVE_BYTES = 1 << 30
# Pinned cudaMemcpyAsync reaches about this fraction of the link's theoretical rate. Assumed
# (the H200 measured 0.88 of PCIe 5.0's: GPU.measured_link, used there).
LINK_EFFICIENCY = 0.8
# Codec throughput as a fraction of HBM bandwidth (bytes of input per second / HBM bytes per
# second), per direction, and a fixed time per call: measured on an H200 (cswap's Triton
# kernels, torch 2.11, Triton 3.6; benchmarks/results/nvidia-h200/codecs.json): lines
# through the medians at 16 and 256 MiB over fp32 and bf16 and 20-80% zeros. On other GPUs
# the throughput is scaled by their HBM bandwidth and the fixed time (host syncs, launches
# and Python, about 0.1-0.2 ms; over 1 ms for ZANS's several passes) taken as it is:
# assumed there until cswap-tune has run on them. (LZ4's encoder, a walk through each chunk
# in order, ran at about 3 GB/s on the H200.)
CODEC_HBM_FRACTION = {"zvc": (0.107, 0.133), "rle": (0.053, 0.097), "csr": (0.089, 0.348), "lz4": (0.0007, 0.031),
                      "zans": (0.022, 0.046)}
CODEC_FIXED_S = {"zvc": (141e-6, 114e-6), "rle": (174e-6, 154e-6), "csr": (195e-6, 125e-6), "lz4": (424e-6, 175e-6),
                 "zans": (1362e-6, 1150e-6)}


class AssumedProfile:
    """The advisor's profile interface for a GPU nobody has tuned on: assumed figures (module docstring)."""

    def __init__(self, gpu: GPU):
        self.gpu = gpu
        if gpu.measured_link:
            self.bw_d2h, self.bw_h2d = gpu.measured_link
            link = f"{gpu.link} as measured: {self.bw_d2h / 1e9:.1f} GB/s out, {self.bw_h2d / 1e9:.1f} in"
        else:
            self.bw_d2h = self.bw_h2d = gpu.link_bytes_per_s * LINK_EFFICIENCY
            link = f"assumed: {gpu.link} at {LINK_EFFICIENCY:.0%} of {gpu.link_bytes_per_s / 1e9:.1f} GB/s"
        self.codecs = tuple(CODEC_HBM_FRACTION)
        self.source = (f"{link}; codecs at {', '.join(f'{c} {a:.1%}/{b:.1%}' for c, (a, b) in CODEC_HBM_FRACTION.items())}"
                       f" of HBM bandwidth (compress/decompress) plus a fixed time per call, as measured on an H200")

    def seconds(self, codec: str, direction: str, size: float, sparsity: float) -> float:
        which = 0 if direction == "compress" else 1
        return CODEC_FIXED_S[codec][which] + size / (self.gpu.hbm_bytes_per_s * CODEC_HBM_FRACTION[codec][which])


def gib(n: float) -> str:
    """Bytes as "1.23 GiB" (or "45.6 MiB" below a GiB)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class TensorPrediction:
    """One saved activation: what it is and what each mode does with it."""

    index: int
    made_in: str
    made_in_type: str
    op: str
    saved_by: str
    occurrence: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    sparsity: float
    runs: int
    decisions: dict[str, str] = field(default_factory=dict)  # mode -> "keep", "raw" or a codec
    why: str = ""
    zans_bits: float | None = None  # ZANS's predicted bits per element (measured sparsity only)

    def to_json(self) -> dict:
        return {**self.__dict__, "shape": list(self.shape)}


@dataclass
class ModePrediction:
    mode: str
    peak_bytes: int
    step_seconds: float
    compute_seconds: float
    exposed_seconds: float
    codec_seconds: float
    pcie_bytes: int           # both directions
    offloaded: int            # storages moved off the device
    compressed: int
    curve_seconds: list[float] = field(default_factory=list)  # memory over one step
    curve_bytes: list[int] = field(default_factory=list)
    host_seconds: float = 0.0  # the training thread's time for the offloaded tensors (in step_seconds)
    paging_seconds: float = 0.0  # a paged optimizer's state moved over the host link (in step_seconds)
    workspace_bytes: list[int] = field(default_factory=list)  # per op: cuDNN's workspace (in curve_bytes)


@dataclass
class Prediction:
    """A what-if for one model, batch and GPU. Every figure is predicted; `sources` says from what."""

    gpu: GPU
    precision: str
    optimizer: str
    batch: int
    capacity_bytes: int       # the GPU's memory minus the reserve (or the budget, if smaller)
    budget_bytes: int | None
    modes: dict[str, ModePrediction]
    tensors: list[TensorPrediction]
    sources: dict[str, str]
    instance: Instance | None = None  # the budget planner's problem: every saved activation of MIN_BYTES+
    _again: object = None     # predict() at another batch, for largest_batch
    _largest: dict = field(default_factory=dict)
    _others: dict = field(default_factory=dict)  # predictions at other batches
    blocks: list = field(default_factory=list)  # the recompute planner's blocks over `instance`'s tensors
    optimizer_in_backward: bool = False
    paged_bytes: int = 0      # a paged optimizer's state, in unified memory: in no peak (cswap.plan.optimizers)
    besides_saved_bytes: list[int] = field(default_factory=list)  # per op: what the step holds beside saved activations

    def _mode(self, mode: str) -> ModePrediction:
        if mode not in self.modes:
            raise ValueError(f"cswap.plan: no mode {mode!r} in this prediction; it has {', '.join(self.modes)}")
        return self.modes[mode]

    def peak_bytes(self, mode: str = "none") -> int:
        return self._mode(mode).peak_bytes

    def saved_peak_bytes(self, mode: str = "none") -> int:
        """The peak of what saved activations and cswap's buffers alone hold on the device
        (weights, gradients and the step's other tensors aside): the figure the emulated
        device and the timed twin count (cswap.runtime.emulator), to check the plan on."""
        mp = self._mode(mode)
        curve = np.array(mp.curve_bytes, dtype=np.int64) - np.array(self.besides_saved_bytes, dtype=np.int64)
        if mp.workspace_bytes:
            curve -= np.array(mp.workspace_bytes, dtype=np.int64)
        return int(curve.max(initial=0))

    def step_seconds(self, mode: str = "none") -> float:
        return self._mode(mode).step_seconds

    def fits(self, mode: str = "none") -> bool:
        return self._mode(mode).peak_bytes <= self.capacity_bytes

    def slowdown(self, mode: str) -> float:
        return self.step_seconds(mode) / self.step_seconds("none") - 1.0

    def largest_batch(self, mode: str = "none", limit: int = 1 << 16) -> int:
        """The largest batch whose predicted peak in `mode` fits (0 if none does).
        Peaks are near-affine in the batch: a line through this batch and half of
        it (or 2) places it, and predictions next to the guess settle it."""
        self._mode(mode)
        if mode not in self._largest:
            self._largest[mode] = self._search(mode, limit)
        return self._largest[mode]

    def _at(self, b: int) -> "Prediction":
        if b not in self._others:
            self._others[b] = self if b == self.batch else self._again(b)
        return self._others[b]

    def _search(self, mode: str, limit: int) -> int:
        def fits(b: int) -> bool:
            return b == 0 or self._at(b).fits(mode)

        b1 = self.batch
        b2 = b1 // 2 if b1 > 1 else 2
        p1, p2 = self.peak_bytes(mode), self._at(b2).peak_bytes(mode)
        slope = (p1 - p2) / (b1 - b2)
        guess = limit if slope <= 0 else int((self.capacity_bytes - (p1 - slope * b1)) // slope)
        guess = min(max(guess, 0), limit)
        lo, hi = (guess, None) if fits(guess) else (None, guess)
        step = max(1, guess // 64)
        while lo is None:  # step down until one fits
            b = max(hi - step, 0)
            lo, hi = (b, hi) if fits(b) else (None, b)
            step *= 2
        while hi is None:  # step up until one does not
            b = min(lo + step, limit)
            if b == lo:
                return lo
            lo, hi = (b, None) if fits(b) else (lo, b)
            step *= 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def summary(self, largest: bool = False, tensors: int = 10) -> str:
        """What cswap-plan prints: the per-mode table, how each figure was obtained, and
        the `tensors` largest saved activations (0: all). largest: add each mode's
        largest batch that fits (a prediction per batch tried)."""
        g = self.gpu
        lines = [f"cswap-plan: {self.batch} per step on {g.label} ({gib(g.memory_bytes)}), {self.precision}, "
                 f"{self.optimizer}{' in backward' if self.optimizer_in_backward else ''}. PREDICTED, nothing "
                 f"measured on the GPU.",
                 f"limit {gib(self.capacity_bytes)} ({'budget' if self.budget_bytes else 'memory minus reserve'})",
                 ""]
        w = max(6, *(len(m) for m in self.modes))
        head = f"{'mode':<{w}} {'peak':>10} {'fits':>4} {'step ms':>9} {'slowdown':>8} {'PCIe GiB':>8} " \
               f"{'offload':>7} {'compr.':>6}" + (f" {'max batch':>9}" if largest else "")
        lines += [head, "-" * len(head)]
        for m, mp in self.modes.items():
            row = (f"{m:<{w}} {gib(mp.peak_bytes):>10} {'yes' if self.fits(m) else 'NO':>4} "
                   f"{mp.step_seconds * 1e3:>9.2f} {self.slowdown(m):>+8.1%} {mp.pcie_bytes / 2**30:>8.2f} "
                   f"{mp.offloaded:>7} {mp.compressed:>6}")
            if largest:
                row += f" {self.largest_batch(m):>9}"
            lines.append(row)
        lines += ["", "how each figure was obtained:"]
        lines += [f"  {k:<9} {v}" for k, v in self.sources.items()]
        shown = sorted(self.tensors, key=lambda t: -t.nbytes)
        shown = shown[:tensors] if tensors else shown
        lines += ["", f"saved activations ({len(shown)} of {len(self.tensors)}, largest first), named by the "
                      f"module that made them:",
                  f"{'made in':<28} {'op':<12} {'saved by':<20} {'MiB':>7} {'sparsity':>8}  "
                  + " ".join(f"{m:<6}" for m in self.modes) + "  why (cswap)"]
        for t in shown:
            where = f"{t.made_in or '<root>'} ({t.made_in_type})"
            lines.append(f"{where[:28]:<28} {t.op[:12]:<12} {t.saved_by[:20]:<20} {t.nbytes / 2**20:>7.1f} "
                         f"{t.sparsity:>8.2f}  " + " ".join(f"{t.decisions[m]:<6}" for m in self.modes)
                         + f"  {t.why}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        modes = ", ".join(f"{m} {gib(p.peak_bytes)} {p.step_seconds * 1e3:.2f} ms" for m, p in self.modes.items())
        return (f"Prediction({self.gpu.name}, batch {self.batch}, {self.precision}, {len(self.tensors)} saved "
                f"activations; {modes}; predicted)")

    def to_json(self) -> str:
        g = self.gpu
        doc = {
            "what": "a prediction (cswap-plan): nothing here was measured on the GPU",
            "gpu": {"name": g.name, "label": g.label, "memory_bytes": g.memory_bytes, "sources": list(g.sources)},
            "precision": self.precision, "optimizer": self.optimizer,
            "optimizer_in_backward": self.optimizer_in_backward, "paged_bytes": self.paged_bytes, "batch": self.batch,
            "capacity_bytes": self.capacity_bytes, "budget_bytes": self.budget_bytes, "sources": self.sources,
            "modes": {m: {k: v for k, v in p.__dict__.items() if not k.startswith("curve")} |
                      {"fits": self.fits(m), "largest_batch": self._largest.get(m),
                       "saved_peak_bytes": self.saved_peak_bytes(m)}
                      for m, p in self.modes.items()},
            "tensors": [t.to_json() for t in self.tensors],
        }
        return json.dumps(doc, indent=1)


# -- the prediction ------------------------------------------------------------------------------------------


@dataclass
class _Group:
    """One storage of saved activations: what an offload moves."""

    storage: int
    records: list
    nbytes: int
    saved_at: int
    used_at: int
    dropped_at: int
    sparsity: float
    runs: int
    op: str
    made_in: str
    made_in_type: str
    zans_bits: float | None

    @property
    def key(self) -> str:
        return f"{self.records[0].index}:{self.made_in}"

    @property
    def last_used_at(self) -> int:
        """The op of its last use in backward (its storage dies after it)."""
        return max(r.used_at for r in self.records)

    @property
    def made_at(self) -> int:
        """The op that made it (a pooling's output is saved an op later), else its save."""
        return min([r.made_at for r in self.records if r.made_at is not None] + [self.saved_at])


def _groups(trace, sparsity_of, zans_of) -> list[_Group]:
    by_storage: dict[int, list] = {}
    for r in trace.activations():
        if r.used_at is not None:
            by_storage.setdefault(r.storage, []).append(r)
    groups = []
    end = len(trace.ops)
    for storage, records in by_storage.items():
        first = records[0]
        s, runs = sparsity_of[first.index]
        groups.append(_Group(storage, records, first.storage_bytes, min(r.saved_at for r in records),
                             min(r.used_at for r in records),
                             first.dropped_at if first.dropped_at is not None else end, s, runs, first.op,
                             first.made_in, first.made_in_type, zans_of[first.index]))
    groups.sort(key=lambda g: g.saved_at)
    return groups


def _iteration(groups: list[_Group], starts: np.ndarray, phase_s: dict) -> IterationProfile:
    """The advisor's view of the offloaded storages: save and use times from the op times."""
    forward_s, backward_s = phase_s["forward"], phase_s["backward"]
    saves = [float(starts[g.saved_at]) for g in groups]
    uses = [float(starts[g.used_at]) - forward_s for g in groups]
    tensors = []
    for i, g in enumerate(groups):
        hidden_f = (saves[i + 1] if i + 1 < len(groups) else forward_s) - saves[i]
        hidden_b = uses[i] - (uses[i + 1] if i + 1 < len(groups) else 0.0)
        r = g.records[0]
        tensors.append(TensorProfile(key=g.key, layer=g.made_in, layer_type=g.made_in_type, op=g.op,
                                     shape=r.shape, itemsize=r.dtype.itemsize, sparsity=g.sparsity, runs=g.runs,
                                     save_s=saves[i], use_s=max(uses[i], 0.0), hidden_f=max(hidden_f, 0.0),
                                     hidden_b=max(hidden_b, 0.0), zans_bits=g.zans_bits))
    return IterationProfile(forward_s=forward_s, backward_s=backward_s, tensors=tuple(tensors))


def _op_index(starts: np.ndarray, t: float) -> int:
    """The first op starting at or after `t` seconds."""
    return int(np.searchsorted(starts, t, side="left"))


def _step_clock(starts: np.ndarray, forward_end: int, moved: list[_Group], sim) -> np.ndarray:
    """Each op's start on the simulated step's clock: backward's ops later by the waits
    before them (forward's, and each use's for its restore), so that the simulation's times
    map to the ops that run then. The simulation takes restores in reverse save order,
    which is not always the order backward uses them (within a transformer layer), so an
    op's shift is the least of the uses at or after it: the clock never runs backwards,
    and a use the simulation put late does not move every op after it."""
    shift = np.zeros(len(starts))
    shift[forward_end:] = sim.forward_stall_s
    at = np.full(len(starts), np.inf)
    for g in moved:
        if g.key in sim.use_at_s:
            at[g.used_at] = min(at[g.used_at], sim.use_at_s[g.key] - starts[g.used_at])
    if np.isfinite(at).any():
        last = int(np.flatnonzero(np.isfinite(at))[-1])
        least_after = np.minimum.accumulate(at[::-1])[::-1]
        shift[forward_end:last + 1] = np.maximum(shift[forward_end:last + 1], least_after[forward_end:last + 1])
        shift[last + 1:] = max(shift[last], at[np.isfinite(at)].max())
    return starts + shift


def _mode(name, trace, groups, choices: dict, profile, starts, phase_s, sizes, room: float) -> ModePrediction:
    """One mode's peak, step time and curve, for `choices` (storage -> None raw / codec),
    cuDNN's workspaces on the curve as far as `room` (the step's device memory) holds them."""
    live = np.array([op.live_bytes for op in trace.ops], dtype=np.float64)
    compute = sum(phase_s.values())
    moved = [g for g in groups if g.storage in choices]
    if not moved:
        return _with_workspaces(ModePrediction(name, 0, compute, compute, 0.0, 0.0, 0, 0, 0, starts.tolist()),
                                trace, live, room)
    iteration = _iteration(moved, starts, phase_s)
    keyed = {g.key: choices[g.storage] for g in moved}
    sim = simulate(iteration, keyed, profile, {g.key: sizes[g.storage] for g in moved},
                   budgeted=name in BUDGETED)
    curve = live.copy()
    codec_s = pcie = 0.0
    forward_end = _op_index(starts, phase_s["forward"])
    save_at = [h.saved_at for h in moved] + [forward_end]
    clock = _step_clock(starts, forward_end, moved, sim)
    for g in moved:
        wait = save_at[sim.freed_by_save[g.key]]
        codec = keyed[g.key]
        size = sizes[g.storage].get(codec, g.nbytes) if codec else g.nbytes
        pcie += 2 * size
        if codec:
            codec_s += profile.seconds(codec, "compress", g.nbytes, g.sparsity)
            codec_s += profile.seconds(codec, "decompress", g.nbytes, g.sparsity)
        # back-pressure: a forward that outruns the link waits for this copy to end at a later
        # save (the one whose stash window it fills)
        gone = max(g.dropped_at, min(_op_index(starts, sim.offload_end_s[g.key]), max(wait, g.saved_at + 1)))
        # back from when its restore is queued (its memory is taken then), on the step's clock
        back = min(max(_op_index(clock, sim.restore_issued_s[g.key]), forward_end), g.used_at)
        served = sim.offload_end_s[g.key] > sim.restore_issued_s[g.key]
        if served:  # its copy out had not ended when backward asked for it: it never left, and
            # the runtime holds it (and its payload) after its last use until that copy ends
            out_until = max(_op_index(clock, sim.offload_end_s[g.key]), gone)
            curve[g.last_used_at + 1:out_until] += g.nbytes
        else:
            out_until = gone
            curve[gone:back] -= g.nbytes
        if codec:
            first = g.records[0]
            numel, itemsize = prod(first.shape), first.dtype.itemsize
            # while made and copied out: the payload, in the room reserved for it in a steady step
            # (the largest the codec can write; ZVC's and ZANS's, an eighth, at least 64 KiB, over
            # its size) unless a memory budget sizes it first (cswap.runtime.offload.footprint)
            reserved = None if name in BUDGETED else codecs.get(codec).room_nbytes(numel, itemsize, size)
            curve[g.saved_at:out_until] += size if reserved is None else reserved
            curve[g.saved_at] += codecs.get(codec).encode_scratch_bytes(numel, itemsize)  # the encoder's temporaries
            if not served:  # while copied in and decoded: the payload, freed once decoded
                decoded = _op_index(clock, sim.restored_s[g.key])
                curve[back:min(max(decoded, back + 1), g.used_at)] += size
    host_s = host_seconds(profile) * len(moved)
    step = compute + sim.exposed_s + host_s  # (the kernels' time beside compute is in exposed_s)
    return _with_workspaces(ModePrediction(name, 0, step, compute, sim.exposed_s, codec_s, int(pcie), len(moved),
                                           sum(1 for c in keyed.values() if c), starts.tolist(), host_seconds=host_s),
                            trace, curve, room)


def _with_workspaces(mp: ModePrediction, trace, curve: np.ndarray, room: float) -> ModePrediction:
    """`mp` with `curve` and its peak, each op's cuDNN workspace on top where room holds it."""
    workspace = np.array([op.workspace for op in trace.ops], dtype=np.float64)
    full = workspaces.with_workspaces(curve, workspace, room) if workspace.any() else curve
    taken = (full - curve).astype(np.int64)
    return replace(mp, peak_bytes=int(full.max(initial=0)), curve_bytes=full.astype(np.int64).tolist(),
                   workspace_bytes=taken.tolist() if taken.any() else [])


def _budget_instance(trace, groups: list[_Group], starts, phase_s, link, sizes) -> tuple[Instance, list]:
    """Every saved activation of at least MIN_BYTES as a planning problem. An offloaded
    one is away from when the step drops it (or, for one it still holds, the next op)
    until the tensor saved after it is used in backward (prefetch one ahead)."""
    movable = [g for g in groups if g.nbytes >= MIN_BYTES]
    forward_end = _op_index(starts, phase_s["forward"])
    windows = []
    for i, g in enumerate(movable):
        back = movable[i + 1].used_at if i + 1 < len(movable) else forward_end
        windows.append((max(g.dropped_at, g.saved_at + 1), min(back, g.used_at)))
    iteration = _iteration(movable, starts, phase_s)
    curve = np.array([op.live_bytes for op in trace.ops], dtype=np.float64)
    return (Instance.build(iteration, link, curve, windows, sizes={g.key: sizes[g.storage] for g in movable}),
            movable)


def _budget_mode(trace, groups, starts, phase_s, link, sizes, capacity, room) -> tuple[ModePrediction, dict, Instance]:
    """The planner's choice, checked on the full curve (late copies, compressed buffers)
    and planned again with the overshoot off the budget until it fits (or 4 tries)."""
    inst, movable = _budget_instance(trace, groups, starts, phase_s, link, sizes)

    def check(plan):
        choices = {g.storage: c for g, c in zip(movable, plan.choices) if c != KEEP}
        return _mode("budget", trace, groups, choices, link, starts, phase_s, sizes, room), choices

    _, (mode, choices) = _replan_until_it_fits(capacity, lambda target: plan_budget(inst, target), check)
    return mode, choices, inst


def _replan_until_it_fits(capacity: int, plan_at, check, tries: int = 8):
    """Plan at the budget and check the plan on the full curve (late copies, compressed
    buffers); while that overshoots, plan again with the target lowered by at least the
    overshoot, and by twice the last cut each time: a plan is a discrete choice, so the
    same few MiB can overshoot again at a target lowered by just that much (ResNet-50 at
    batch 1070 on an H100 did four times and was called unfit, though larger batches fit).
    Returns (the plan, what check made of it: (ModePrediction, ...))."""
    target, cut = capacity, 0
    for _ in range(tries):
        plan = plan_at(target)
        checked = check(plan)
        if checked[0].peak_bytes <= capacity or not plan.fits:
            break
        cut = max(checked[0].peak_bytes - capacity, 2 * cut)
        target -= cut
    return plan, checked


def _candidates(groups: list[_Group]) -> list[_Group]:
    """What cswap.patch's default (candidates="auto") offloads: ReLU and pooling outputs of
    MIN_BYTES or more, or every saved activation of that size in a model without them."""
    large = [g for g in groups if g.nbytes >= MIN_BYTES]
    sparse = [g for g in large if g.op in SPARSE_OPS]
    return sparse or large


def _blocks(names: list[str], trace, movable: list[_Group], op_s: np.ndarray) -> list[Block]:
    """The blocks the planner may recompute: the saved activations made and saved inside
    each (not its input, which checkpointing still saves) and its forward's seconds."""
    blocks = []
    for name in names:
        members = tuple(i for i, g in enumerate(movable)
                        if inside(g.made_in, name) and all(inside(r.module, name) for r in g.records))
        seconds = float(sum(t for op, t in zip(trace.ops, op_s) if op.phase == "forward" and inside(op.module, name)))
        blocks.append(Block(name, members, seconds))
    return blocks


def _recompute_mode(trace, groups, starts, phase_s, link, sizes, capacity, room,
                    blocks) -> tuple[ModePrediction, dict]:
    """The budget planner with recompute as a fourth choice (cswap.plan.recompute), checked on
    the full curve and planned again with any overshoot off the budget, as _budget_mode."""
    inst, movable = _budget_instance(trace, groups, starts, phase_s, link, sizes)

    def check(plan):
        choices = {g.storage: c for g, c in zip(movable, plan.choices) if c not in (KEEP, RECOMPUTE)}
        mode = _mode("recompute", trace, groups, choices, link, starts, phase_s, sizes, room)
        curve = np.array(mode.curve_bytes, dtype=np.float64)
        for i, c in enumerate(plan.choices):
            a, b = inst.windows[i]
            if c == RECOMPUTE and a < b:
                curve[a:b] -= movable[i].nbytes
        again = sum(b.seconds for b in blocks if b.name in plan.recomputed)
        mode = replace(mode, peak_bytes=int(curve.max(initial=0)), step_seconds=mode.step_seconds + again,
                       compute_seconds=mode.compute_seconds + again, curve_bytes=curve.astype(np.int64).tolist())
        return mode, choices

    plan, (mode, choices) = _replan_until_it_fits(capacity, lambda target: plan_with_recompute(inst, blocks, target),
                                                  check)
    choices.update({g.storage: RECOMPUTE for g, c in zip(movable, plan.choices) if c == RECOMPUTE})
    return mode, choices


def _choices(mode: str, groups: list[_Group], decisions) -> dict:
    """What `mode` offloads, as cswap.patch does: storage -> None (raw) or a codec."""
    candidates = _candidates(groups)
    if mode == "vdnn":
        return {g.storage: None for g in candidates}
    if mode == "sc":
        return {g.storage: "zvc" for g in candidates}
    if mode == "cswap":
        return {g.storage: decisions[g.key].codec for g in candidates}
    return {}


def measured_times(source) -> tuple[dict, str]:
    """{"forward": s, "backward": s} and where from: a dict with forward_s and backward_s,
    or a cswap report folder / epochs.jsonl (its last epoch that has them)."""
    if isinstance(source, dict):
        doc, where = source, "given"
    else:
        path = Path(source)
        path = path / "epochs.jsonl" if path.is_dir() else path
        try:
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError) as exc:
            raise ValueError(f"cswap.plan: cannot read measured times from {path} ({exc}); give a cswap "
                             f"report folder or its epochs.jsonl") from exc
        doc = next((e["metrics"] for e in reversed(lines) if "forward_s" in e.get("metrics", {})), {})
        where = f"{path}"
    try:
        times = {"forward": float(doc["forward_s"]), "backward": float(doc["backward_s"])}
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"cswap.plan: no forward_s and backward_s in {where}; cswap writes them in each epoch "
                         f"report once a step has been profiled") from None
    if min(times.values()) <= 0:
        raise ValueError(f"cswap.plan: measured times must be positive, got {times}")
    return times, where


def predict(model: nn.Module, example_inputs, gpu, *, precision: str = "fp32", optimizer: str = "sgd",
            loss=None, budget=None, profile=None, sparsity=None, times=None,
            reserve_bytes: int = RESERVE_BYTES, recompute="auto", optimizer_in_backward: bool = False,
            compile: bool = False, adapter_dtype: str = "float32") -> Prediction:
    """Predict one training step of `model` on `example_inputs` (a tensor, a tuple of
    forward's positional arguments or a dict of its keyword arguments such as
    {"input_ids": ids, "labels": ids}; any device, "meta" included: only shapes and
    dtypes are read; the batch is the first tensor's leading dimension) on `gpu` (a
    name from cswap.gpus()). optimizer: one of cswap.plan.optimizers.OPTIMIZERS (sgd with
    momentum, adam, adamw, and bitsandbytes' adamw8bit, paged_adamw, paged_adamw8bit, whose
    paged state lies outside PyTorch's allocator: `paged_bytes`, in no peak);
    optimizer_in_backward: each parameter stepped, and its gradient freed, as soon as
    the gradient is made. loss(output) -> scalar: the step's loss; by default the
    output's own loss when it has one (Hugging Face models given labels), else the
    mean of its first tensor. precision: fp32 (TF32 convolutions where the GPU has them,
    PyTorch's default), tf32, amp (float16 autocast), bf16 or fp16 (the model cast).
    A model in torch.channels_last runs its convolutions NHWC: an NCHW one's convolutions
    on tensor cores also pay cuDNN's layout transposes (cswap.plan.roofline). budget: bytes, "20GiB" or a fraction of the GPU's memory: the limit `fits` checks
    (at most the GPU's memory minus `reserve_bytes`).
    profile: a cswap-tune profile of that GPU (a path or cswap.Profile) for PCIe and
    codec times, or any object the advisor takes (bw_d2h, bw_h2d, codecs, seconds)
    with a `source` line saying where its figures come from; otherwise assumed. sparsity: "auto" (measured on a few CPU steps of
    the model, cswap.plan.sparsity.auto), a number for every ReLU/pooling output, a
    cswap.plan.sparsity.Sparsity, or None (no zeros: compression never pays).
    times: forward and backward seconds measured by a cswap run of this model and
    batch on that GPU (its report folder, epochs.jsonl, or {"forward_s", "backward_s"}):
    they replace the roofline's phase totals (the roofline still shares them out per op).
    recompute: the blocks mode "recompute" may checkpoint ("auto": the repeated blocks,
    transformer layers and residual blocks; module names; a predicate (name, module) ->
    bool; False for none). compile: the model under torch.compile (inductor): what its
    partitioner saves and recomputes, and its pointwise ops fused; each repeated block
    compiled on its own where the model has them, as torchtune does (cswap.plan.compiled).
    adapter_dtype, for a peft model at bf16 or fp16: "float32" (peft's default: the adapters'
    weights, gradients and optimizer states in float32, the step under autocast as Hugging
    Face's Trainer runs it) or "model" (cast with the model, as torchtune does)."""
    from .fake_gpu import adapter_parameters
    from .sparsity import auto, from_number

    if not isinstance(model, nn.Module):
        raise TypeError(f"cswap.predict: expected a torch.nn.Module, got {type(model).__name__}")
    g = lookup(gpu)
    if precision not in PRECISIONS:
        raise ValueError(f"cswap.predict: precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if adapter_dtype not in ADAPTER_DTYPES:
        raise ValueError(f"cswap.predict: adapter_dtype must be one of {', '.join(ADAPTER_DTYPES)}, got "
                         f"{adapter_dtype!r}")
    if precision == "bf16":
        g.peak_flops("bf16")  # a GPU without bf16 raises, saying why
    try:
        inputs = Inputs.of(example_inputs)
        batch = inputs.batch
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"cswap.predict: {exc}") from None
    if isinstance(sparsity, str) and sparsity == "auto":
        sparsity = auto(model, inputs)
    elif isinstance(sparsity, (int, float)):
        sparsity = from_number(sparsity)
    sparsity = sparsity or Sparsity({}, "assumed: no zeros (give sparsity= to measure or state it)")
    if profile is not None and not hasattr(profile, "bw_d2h"):
        from ..tune.profile import read_profile
        profile = read_profile(profile)
    link = profile or AssumedProfile(g)
    link_source = getattr(link, "source", None) or \
        f"measured: cswap-tune profile of {profile.doc['device']['name']}"
    budget_bytes = parse_bytes(budget, g.memory_bytes) if budget is not None else None

    x = inputs.map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))
    trace = trace_for(model, x, precision, optimizer, loss, arch=g.arch, optimizer_in_backward=optimizer_in_backward,
                      compile=compile, adapter_dtype=adapter_dtype)
    paged = paged_bytes(optimizer, model, trace.idle_parameters)
    model_of_time, model_source = time_model(g)
    op_s = op_times(trace.ops, g, precision, model_of_time)
    rate = ("torch.matmul's rate measured on it (cswap.plan.gpus.MATMUL_DB)" if g.matmul_flops else
            "its datasheet at the median share measured GPUs reach (no matmul measurement of it found)")
    compute_source = (f"predicted: FLOPs and bytes per op against the {g.label}'s HBM bandwidth and {rate}, "
                      f"by an {model_source}")
    if times is not None:
        measured, where = measured_times(times)
        phases = np.array([op.phase for op in trace.ops])
        for phase, seconds in measured.items():
            mask = phases == phase
            if op_s[mask].sum() > 0:
                op_s[mask] *= seconds / op_s[mask].sum()
        compute_source = (f"measured: forward {measured['forward'] * 1e3:.2f} ms and backward "
                          f"{measured['backward'] * 1e3:.2f} ms from {where}, shared out per op by the roofline; "
                          f"optimizer step predicted")
    starts = np.concatenate([[0.0], np.cumsum(op_s)])[:-1] if len(op_s) else np.zeros(0)
    phase_s = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    for op, t in zip(trace.ops, op_s):
        phase_s[op.phase] += float(t)

    acts = trace.activations()
    keys = record_keys([(r.made_in, r.op) for r in acts])
    sparsity_of = {r.index: sparsity.of(k, math.prod(r.shape), r.op) for r, k in zip(acts, keys)}
    zans_of = {r.index: sparsity.zans_bits_of(k, r.dtype) for r, k in zip(acts, keys)}
    groups = _groups(trace, sparsity_of, zans_of)
    advisor = Advisor(link)
    decisions = advisor.decide(_iteration(groups, starts, phase_s)) if groups else {}  # sizes, why: every storage
    if candidates := _candidates(groups):  # as the runtime decides: among the tensors it offloads
        decisions.update(advisor.decide(_iteration(candidates, starts, phase_s)))
    sizes = {grp.storage: decisions[grp.key].sizes for grp in groups}

    plans = {m: _choices(m, groups, decisions) for m in MODES}
    room = capacity = g.memory_bytes - reserve_bytes  # (room: what cuDNN's workspaces may take, budget or not)
    modes = {m: _mode(m, trace, groups, plans[m], link, starts, phase_s, sizes, room) for m in MODES}
    if budget_bytes is not None:
        capacity = min(budget_bytes, capacity)
    modes["budget"], plans["budget"], instance = _budget_mode(trace, groups, starts, phase_s, link, sizes,
                                                              capacity, room)
    names = resolve(model, recompute) if recompute is not False else []
    blocks = []
    if names:
        movable = [g for g in groups if g.nbytes >= MIN_BYTES]
        blocks = _blocks(names, trace, movable, op_s)
        if any(b.members for b in blocks):
            modes["recompute"], plans["recompute"] = _recompute_mode(trace, groups, starts, phase_s, link, sizes,
                                                                     capacity, room, blocks)
    if paged:
        modes = {m: _paged(mp, paged, capacity, link) for m, mp in modes.items()}
    tensors = _tensor_predictions(acts, keys, sparsity_of, zans_of, groups, decisions, plans)
    host_source = "the profile's" if getattr(link, "host_s_per_tensor", None) is not None else \
        "measured on an H200's host by benchmarks/overhead.py --devices cuda"
    sources = {
        "memory": f"predicted: one {optimizer} step{' (in backward, per parameter)' if optimizer_in_backward else ''} "
                  f"traced on a fake GPU (FakeTensorMode + MemTracker, torch {torch.__version__})"
                  + (", compiled: the graphs torch.compile's partitioner makes, replayed" if compile else "")
                  + ("; cuDNN's convolution workspaces as the H200 took them (cswap.plan.workspaces)"
                     if any(op.workspace for op in trace.ops) else "")
                  + f"; reserve "
                  f"{reserve_bytes / 2**30:.2f} GiB assumed for the CUDA context and cuBLAS's workspace"
                  + (f"; plus {paged / 2**30:.2f} GiB of paged optimizer state in unified memory, outside "
                     f"PyTorch's allocator (in no peak: what the GPU has left beside the peak holds part of it, "
                     f"the rest crosses the host link in and out each step, in the step time; assumed)"
                     if paged else ""),
        "compute": compute_source,
        "transfers": link_source,
        "sparsity": sparsity.source,
        "timeline": f"predicted: cswap's staged timeline (two tensors in flight at least, compression and decode "
                    f"on streams of their own beside compute, shared D2H/H2D links, a ZVC or ZANS copy out queued "
                    f"behind its encode, any other compressed one by the sender thread when it has the GIL, as the "
                    f"H200's traces showed, prefetch window), plus "
                    f"{1e6 * host_seconds(link):.0f} us of the training thread per offloaded tensor ({host_source})",
    }
    nf4_module = sys.modules.get(f"{__package__}.quantized")  # (imported where a model has NF4 layers, not by cswap)
    quantized = sum(isinstance(m, nf4_module.NF4Linear) for m in model.modules()) if nf4_module else 0
    if quantized:
        per_value = nf4_module.nf4_bytes(2**20) / 2**20
        sources["quantized"] = (f"assumed: {quantized} frozen linear layers held in NF4 with double quantization "
                                f"({per_value:.3f} bytes a value), each weight dequantized to the compute dtype "
                                f"for every multiply, in one memory-bound kernel (cswap.plan.quantized)")
    adapters = adapter_parameters(model) if precision in ("bf16", "fp16") else set()
    if adapters:
        count = sum(p.numel() for p in model.parameters() if id(p) in adapters)
        sources["adapters"] = (
            f"assumed: peft's {count / 1e6:.1f} M adapter weights in float32 (peft's default), their gradients and "
            f"optimizer states too, the step under {precision} autocast as Hugging Face's Trainer runs it "
            f"(adapter_dtype='model' for adapters cast with the model, as torchtune holds them)"
            if adapter_dtype == "float32" else
            f"assumed: peft's {count / 1e6:.1f} M adapter weights cast to {precision} with the model (as torchtune "
            f"holds them; peft's default keeps them in float32: adapter_dtype='float32')")
    if trace.idle_parameters:
        idle = trace.idle_parameters
        sources["unused"] = (f"traced: {len(idle)} trainable parameters get no gradient in this step "
                             f"({', '.join(idle[:3])}{', ...' if len(idle) > 3 else ''}: unused, or used under "
                             f"no_grad), so neither a gradient nor optimizer state is counted for them")
    if trace.attention:
        calls = ", ".join(f"{n} {b}" for b, n in sorted(trace.attention.items()))
        sources["attention"] = (f"assumed: scaled_dot_product_attention as PyTorch's dispatcher picks it on compute "
                                f"capability {g.arch / 10:.1f} ({calls} per forward; cswap.plan.attention)")

    def again(b: int) -> Prediction:
        resized = x.map(lambda t: torch.empty((b, *t.shape[1:]), dtype=t.dtype, device="meta"))
        # measured times at another batch: in proportion to it (compute-bound layers)
        scaled = None if times is None else {f"{k}_s": v * b / batch for k, v in measured.items()}
        return predict(model, resized, g, precision=precision, optimizer=optimizer, loss=loss, budget=budget,
                       profile=profile, sparsity=sparsity, times=scaled, reserve_bytes=reserve_bytes,
                       recompute=recompute, optimizer_in_backward=optimizer_in_backward, compile=compile,
                       adapter_dtype=adapter_dtype)

    return Prediction(g, precision, optimizer, batch, capacity, budget_bytes, modes, tensors, sources, instance,
                      again, blocks=blocks, optimizer_in_backward=optimizer_in_backward, paged_bytes=paged,
                      besides_saved_bytes=_besides_saved(trace, groups).tolist())


def _besides_saved(trace, groups: list[_Group]) -> np.ndarray:
    """Per op, the device bytes the step holds beside its saved activations, each of which
    is held from the op that made it until its last use in backward."""
    curve = np.array([op.live_bytes for op in trace.ops], dtype=np.int64)
    for g in groups:
        curve[g.made_at:g.last_used_at + 1] -= g.nbytes
    return curve


def _paged(mp: ModePrediction, paged: int, capacity: int, link) -> ModePrediction:
    """A paged optimizer's state lives in unified memory: what the GPU has left beside the
    step's peak holds part of it, and the driver moves the rest in over the host link for
    the optimizer step and back out again, every step (bitsandbytes' paged optimizers;
    assumed: no reuse between steps)."""
    overflow = max(0, paged - max(0, capacity - mp.peak_bytes))
    seconds = overflow / link.bw_h2d + overflow / link.bw_d2h
    return replace(mp, step_seconds=mp.step_seconds + seconds, paging_seconds=seconds)


def _tensor_predictions(acts, keys, sparsity_of, zans_of, groups, decisions, plans) -> list[TensorPrediction]:
    group_of = {r.index: grp for grp in groups for r in grp.records}
    out = []
    for r, key in zip(acts, keys):
        grp = group_of.get(r.index)
        s, runs = sparsity_of[r.index]
        decided = {}
        for m, plan in plans.items():
            if grp is None or grp.storage not in plan:
                decided[m] = "keep"
            else:
                decided[m] = plan[grp.storage] or "raw"
        why = ""
        if grp is not None and grp.key in decisions:
            d = decisions[grp.key]
            best = min(d.t_codec, key=d.t_codec.get) if d.t_codec else None
            why = (f"T'={d.t_prime * 1e3:.3f} ms raw; best codec {best} T={d.t_codec[best] * 1e3:.3f} ms "
                   f"({d.sizes[best] / max(grp.nbytes, 1):.0%} of the bytes)" if best else "")
            if grp.nbytes < MIN_BYTES:
                why = f"under {MIN_BYTES >> 20} MiB: kept; " + why
            elif grp.storage not in plans["vdnn"]:
                why = "not a ReLU/pooling output: vdnn, sc and cswap keep it; " + why
        out.append(TensorPrediction(r.index, r.made_in, r.made_in_type, r.op, r.saved_by, key[2], r.shape,
                                    dtype_name(r.dtype), r.nbytes, s, runs, decided, why,
                                    zans_of[r.index]))
    return out
