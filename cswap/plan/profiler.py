"""The tensor profiler: when each candidate is saved and used, and how sparse it is.

Timing (the paper's "one time" rows of Table II) runs on one iteration: the
moment each offloaded tensor is saved in forward and first used in backward,
the end of forward and the last use in backward: timing events on the compute
stream of the tensors' device (cswap.runtime.device), read once after the
iteration (one sync). From them: Hidden_f of tensor i is the forward compute until
the next tensor is saved (the link is free for it that long), Hidden_b the
backward compute between the use of the tensor saved after it and its own use.

Those are the model's compute, not cswap's: the swapper brackets its own work at
each save and use (`pause` ... `resume`: waiting for copies out or in, sampling,
its host time) with a pair of events, and the times are read on a compute clock
that stops inside the brackets. A stamp is taken before any wait, so a tensor's
save is when the model made it, not when the stash let it in; the timed pass
offloads everything raw and, kept within the stash limit, waits for the link (on
a GPU the compute stream idles meanwhile), and none of that is counted as compute
that could hide a transfer.

Sparsity (the "epoch" rows) is sampled on one iteration per epoch with an
on-device reduction per tensor (non-zero count and number of non-zero runs
of its integer view: "zero" means all bits zero, as for the codecs) and the
histograms ZANS plans from (each byte plane's and the zero mask's bytes:
the advisor's ZANS size, `zans_bits`), read back in one sync when the epoch
ends. The host time spent in all of this is the reported profiling overhead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from math import prod

import numpy as np
import torch

from ..kernels import zans as _zans
from ..runtime.candidates import SwapInfo
from ..runtime.items import Phase
from .advisor import IterationProfile, TensorProfile

__all__ = ["MemoryTrace", "TensorProfiler", "sparsity_and_runs", "zans_histograms", "zans_bits"]

IDLE_PASSES = 3  # passes observed in a row with nothing offloaded before waiting for the epoch's end
_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _words(t: torch.Tensor) -> torch.Tensor:
    """t's elements as 1-D integer words (the codecs' view), in memory order when t is contiguous."""
    words = t.detach().reshape(-1)
    if words.stride(0) != 1:  # a gather, or one element with any stride: byte views need stride 1
        words = words.clone(memory_format=torch.contiguous_format)
    return words.view(_WORDS[t.element_size()])


def sparsity_and_runs(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(number of non-zero elements, number of maximal runs of non-zeros), as
    0-d device tensors (no sync), in the order of t's memory when t is dense."""
    nz = _words(t) != 0
    starts = nz[1:] & ~nz[:-1]
    return nz.sum(), starts.sum() + nz[:1].sum()


def zans_histograms(t: torch.Tensor) -> torch.Tensor:
    """The byte-plane and mask histograms ZANS's encoder would plan t from (int64
    [W + 1, 256] on t's device, no sync; cswap.kernels.zans.byte_histograms)."""
    return _zans.byte_histograms(_words(t))


def zans_bits(hist, numel: int, itemsize: int) -> float:
    """ZANS's predicted payload for a tensor with these histograms, in bits per element."""
    return 8.0 * _zans.predicted_size(np.asarray(hist), numel, itemsize) / max(numel, 1)


@dataclass
class _Record:
    info: SwapInfo
    saved: int | None = None      # stamps (indices into the pass's clock)
    used: int | None = None
    nnz: torch.Tensor | None = None
    runs: torch.Tensor | None = None
    hist: torch.Tensor | None = None  # ZANS's histograms
    storage: int = 0              # which storage it views (numbered in the pass)
    storage_bytes: int = 0

    def sample(self, t: torch.Tensor) -> None:
        self.nnz, self.runs = sparsity_and_runs(t)
        self.hist = zans_histograms(t)


@dataclass
class _Pass:
    timing: bool
    sampling: bool
    device: object = None  # the cswap.runtime.device.Device of the tensors
    start: int | None = None      # stamps: indices into `stamps`
    forward_end: int | None = None
    backward_start: int | None = None
    last_use: int | None = None
    stamps: list = field(default_factory=list)                  # timing events on the compute stream, in order
    pauses: list = field(default_factory=list)                  # (stamp, stamp): cswap's own work between
    compute: list | None = None                                 # per stamp: compute seconds since start (finish)
    records: dict[str, _Record] = field(default_factory=dict)   # offloaded: timed and sampled
    kept: dict[str, _Record] = field(default_factory=dict)      # kept on the device by the plan: sampled
    ticks: list = field(default_factory=list)                   # (device bytes, keys away), per save and use
    rises: list = field(default_factory=list)                   # per tick but the last: how far above it the
                                                                # device rose before the next
    storages: object = None                                     # storage -> its number (weak keys)
    numbered: int = 0                                           # storages numbered so far

    def storage_of(self, t: torch.Tensor) -> tuple[int, int]:
        """t's storage's number in this pass and its bytes: saved views of one storage
        (q, k and v of one projection; a LayerNorm output and its 2-D view) free memory
        only together."""
        from torch.utils.weak import WeakIdKeyDictionary

        if self.storages is None:
            self.storages = WeakIdKeyDictionary()  # weak: a freed storage's address is reused
        st = t.untyped_storage()
        if st not in self.storages:
            self.numbered += 1
            self.storages[st] = self.numbered
        return self.storages[st], st.nbytes()


@dataclass
class MemoryTrace:
    """Device memory through one timed iteration, at each save and use of a saved tensor
    (a tick), with every candidate offloaded raw. Saved tensors are grouped by the
    storage they view: a storage leaves the device only when all its saved views have
    (moving one of q, k and v frees nothing). `groups` lists each storage's keys in
    save order, `group_bytes` its size; `windows[key]` the ticks [a, b) over which that
    tensor was away (its copy out done and the step done with it, until its copy back
    started; empty when never away), `group_windows` those over which all of a
    storage's views were; `curve[k]` the most the device would have held from tick k
    to the next had nothing been offloaded (what it held, plus the storages away, plus
    `rise[k]`: how far the model's own temporaries took it above that before the next
    tick; the profiled step releases copied tensors at ticks only, so that rise is the
    model's alone)."""

    curve: np.ndarray
    windows: dict[str, tuple[int, int]]
    measured_peak: int  # the most the device held, offloading everything
    groups: list[list[str]] = field(default_factory=list)
    group_bytes: list[int] = field(default_factory=list)
    group_windows: list[tuple[int, int]] = field(default_factory=list)
    rise: np.ndarray | None = None  # per tick: what the model's own temporaries add before the next (in curve)


def _memory_trace(ticks, storage_of: dict[str, tuple[int, int]], rises=()) -> MemoryTrace | None:
    """From the ticks (device bytes, keys away), each key's (storage number, bytes) and
    how far the device rose above each tick before the next (`rises`; 0 after the last)."""
    if not ticks:
        return None
    windows: dict[str, tuple[int, int]] = {}
    for k, (_, away) in enumerate(ticks):
        for key in away:
            a, b = windows.get(key, (k, k))
            if b == k:  # still the first stretch away (a later one would be a second round)
                windows[key] = (a, k + 1)
    windows = {key: windows.get(key, (0, 0)) for key in storage_of}
    members: dict[int, list[str]] = {}
    for key, (number, _) in storage_of.items():
        members.setdefault(number, []).append(key)
    groups = list(members.values())
    group_bytes = [storage_of[keys[0]][1] for keys in groups]
    group_windows = []
    for keys in groups:
        a, b = max(windows[k][0] for k in keys), min(windows[k][1] for k in keys)
        group_windows.append((a, b) if a < b else (0, 0))
    rise = np.zeros(len(ticks))
    rise[:len(rises)] = rises[:len(ticks)]
    held = np.array([held for held, _ in ticks], dtype=np.float64) + rise
    curve = held.copy()
    for (a, b), nbytes in zip(group_windows, group_bytes):
        curve[a:b] += nbytes
    return MemoryTrace(curve, windows, int(held.max()), groups, group_bytes, group_windows, rise)


class TensorProfiler:
    """Armed for timing and/or sparsity sampling; observes one forward/backward pass."""

    def __init__(self):
        self.timing_armed = True
        self.sampling_armed = True
        self.current: _Pass | None = None
        self.iteration: IterationProfile | None = None      # latest complete timing
        self.sparsity: dict[str, tuple[float, int]] = {}    # key -> (sparsity, runs), latest sample
        self.zans_bits: dict[str, float] = {}               # key -> ZANS bits per element, latest sample
        self.infos: dict[str, SwapInfo] = {}                # key -> latest info (from the passes observed)
        self.overhead_s = 0.0                               # host seconds spent profiling, since reset
        self.record_memory = False                          # trace device memory in the timed pass
        self.memory: MemoryTrace | None = None              # ...of the latest complete timing
        self.device = None                                  # the Device of the latest complete timing
        self._idle_passes = 0                               # passes observed in a row that offloaded nothing
        # Called when finish() completes a timed iteration: at a step boundary (the next
        # forward's start, or an epoch's end), never inside a save (the controller decides).
        self.on_iteration = None

    @property
    def active(self) -> bool:
        return self.current is not None

    def arm_sampling(self) -> None:
        """Sample the next pass (each epoch's end); time it too while no pass has been timed."""
        self.sampling_armed = True
        self.timing_armed |= self.iteration is None
        self._idle_passes = 0

    def arm_timing(self) -> None:
        self.timing_armed = True
        self._idle_passes = 0

    @staticmethod
    def _stamp(p: _Pass, device) -> int:
        if p.device is None:
            p.device = device
        p.stamps.append(device.record_event(device.compute_stream(), timing=True))
        return len(p.stamps) - 1

    def stamp(self, device) -> int | None:
        """A timing stamp on the compute clock of the timed pass (None when not timing)."""
        p = self.current
        if p is None or not p.timing:
            return None
        return self._stamp(p, device)

    def pause(self, device) -> int | None:
        """cswap's own work starts (a save or use: waits, sampling, bookkeeping): the
        compute clock stops until `resume`. Returns the stamp (None when not timing)."""
        p = self.current
        if p is None or not p.timing:
            return None
        start = time.perf_counter()
        at = self._stamp(p, device)
        if p.start is None:
            p.start = at
        self.overhead_s += time.perf_counter() - start
        return at

    def resume(self, at: int | None) -> None:
        p = self.current
        if at is None or p is None or not p.timing:
            return
        start = time.perf_counter()
        p.pauses.append((at, self._stamp(p, p.device)))
        self.overhead_s += time.perf_counter() - start

    # -- called by the swapper -----------------------------------------------------------

    def begin_pass(self) -> None:
        """A forward pass starts: finish the previous one, start observing if armed."""
        start = time.perf_counter()
        self.finish()
        if self.timing_armed or self.sampling_armed:
            self.current = _Pass(self.timing_armed, self.sampling_armed)
            self.timing_armed = self.sampling_armed = False
        self.overhead_s += time.perf_counter() - start

    @property
    def timing(self) -> bool:
        """The pass observed now is timed (the swapper then sends each raw tensor alone)."""
        p = self.current
        return p is not None and p.timing

    @property
    def traces_memory(self) -> bool:
        """The pass observed now traces device memory at each tick (the swapper then releases
        copied tensors at ticks only, so that what rises between two is the model's own)."""
        p = self.current
        return p is not None and p.timing and self.record_memory

    def on_tick(self, pass_, device, incoming: int = 0) -> None:
        """A tensor is about to be saved or used (the swapper's pass_ holds its items):
        in the timed pass, with record_memory, note what the device holds and what is away."""
        p = self.current
        if p is None or not p.timing or not self.record_memory:
            return
        start = time.perf_counter()
        away = ()
        if pass_ is not None:
            records = p.records
            away = tuple(item.key for item in pass_.items
                         if item.phase == Phase.RELEASED and item.restored is None and item.weak() is None
                         and item.key in records and records[item.key].used is None)
        if p.ticks:  # the interval since the last tick: its peak (the model's temporaries) over what was held then
            p.rises.append(max(0, device.max_memory_allocated() - p.ticks[-1][0]))
        held = device.memory_allocated() + incoming
        device.reset_peak()  # (the user's peak statistics of this one step cover its end only)
        p.ticks.append((held, away))
        self.overhead_s += time.perf_counter() - start

    def on_pack(self, key: str, t: torch.Tensor, info: SwapInfo, device, offloaded: bool = True,
                at: int | None = None) -> None:
        """A candidate was saved in the pass observed (`at`: the stamp its pause began with).
        The swapper calls it only while a pass is observed: every key the profiler reports
        (timings, sparsity) comes from such a pass, so those passes' infos are the ones read."""
        p = self.current
        if p is None:
            return
        self.infos[key] = info
        start = time.perf_counter()
        if p.device is None:
            p.device = device
        if not offloaded:  # kept by the plan: only its sparsity
            if p.sampling:
                p.kept[key] = _Record(info)
                p.kept[key].sample(t)
            self.overhead_s += time.perf_counter() - start
            return
        record = p.records.setdefault(key, _Record(info))
        if p.timing and self.record_memory:
            record.storage, record.storage_bytes = p.storage_of(t)
        if p.timing and at is not None and record.saved is None:
            record.saved = at
        if p.sampling:
            record.sample(t)
        self.overhead_s += time.perf_counter() - start

    def end_forward(self) -> None:
        p = self.current
        if p is not None and p.timing and p.start is not None:
            p.forward_end = self._stamp(p, p.device)

    def on_unpack(self, key: str, at: int | None) -> None:
        """Backward asked for an offloaded tensor (`at`: the stamp its pause began with)."""
        p = self.current
        if p is None or not p.timing or at is None or key not in p.records:
            return
        if p.backward_start is None:
            p.backward_start = at
        if p.records[key].used is None:
            p.records[key].used = at
        p.last_use = at

    # -- results --------------------------------------------------------------------------

    def finish(self) -> None:
        """Read back the observed pass (one sync on CUDA): sparsity samples, and the
        iteration's timing if backward used every recorded tensor."""
        p, self.current = self.current, None
        if p is None or not (p.records or p.kept):
            # Nothing was offloaded in it: observe the next pass instead, a few times (an
            # evaluation pass, a first step that settles the candidates), then wait for the
            # epoch's end: observing stamps every save, which a model that offloads nothing
            # would pay at every step.
            if p is not None and self._idle_passes < IDLE_PASSES:
                self._idle_passes += 1
                self.timing_armed |= p.timing
                self.sampling_armed |= p.sampling
            return
        if p.records:
            self._idle_passes = 0
        start = time.perf_counter()
        p.device.synchronize()
        if p.sampling:
            sampled = {**p.records, **p.kept}
            # one copy to the host for every histogram
            hists = torch.cat([r.hist.reshape(-1) for r in sampled.values()]).cpu().numpy()
            at = 0
            for key, r in sampled.items():
                numel = prod(r.info.shape)
                self.sparsity[key] = (1.0 - int(r.nnz) / max(numel, 1), int(r.runs))
                size = r.hist.numel()
                self.zans_bits[key] = zans_bits(hists[at: at + size].reshape(r.hist.shape), numel,
                                                r.info.dtype.itemsize)
                at += size
        complete = p.timing and p.records and p.forward_end is not None and \
            all(r.saved is not None and r.used is not None for r in p.records.values())
        if complete:
            p.compute = self._compute_clock(p)
            self.iteration = self._iteration(p)
            self.device = p.device
            if self.record_memory:
                storage_of = {k: (r.storage, r.storage_bytes) for k, r in p.records.items()}
                self.memory = _memory_trace(p.ticks, storage_of, p.rises)
        elif p.timing and (p.records or self._idle_passes < IDLE_PASSES):
            self._idle_passes += not p.records  # (everything kept: as a pass that offloaded nothing)
            self.timing_armed = True  # no (complete) backward: time the next pass
        self.overhead_s += time.perf_counter() - start
        if complete and self.on_iteration is not None:
            self.on_iteration()

    @staticmethod
    def _compute_clock(p: _Pass) -> list[float]:
        """Each stamp's seconds since the pass's first, less the pauses that ended by then."""
        first = p.stamps[0]
        wall = [max(p.device.elapsed_s(first, e), 0.0) for e in p.stamps]
        paused_at = [0.0] * len(wall)  # seconds paused in the pause ending at each stamp
        for a, b in p.pauses:
            paused_at[b] += max(wall[b] - wall[a], 0.0)
        clock, paused = [], 0.0
        for seconds, stop in zip(wall, paused_at):
            paused += stop
            clock.append(seconds - paused)
        return clock

    @staticmethod
    def _seconds(p: _Pass, a: int, b: int) -> float:
        return max(p.compute[b] - p.compute[a], 0.0)

    def _iteration(self, p: _Pass) -> IterationProfile:
        keys = list(p.records)
        forward_s = self._seconds(p, p.start, p.forward_end)
        backward_s = self._seconds(p, p.backward_start, p.last_use)
        saves = [self._seconds(p, p.start, p.records[k].saved) for k in keys]
        uses = [self._seconds(p, p.backward_start, p.records[k].used) for k in keys]
        tensors = []
        for i, key in enumerate(keys):
            info = p.records[key].info
            sparsity, runs = self.sparsity.get(key, (0.0, 1))
            hidden_f = (saves[i + 1] if i + 1 < len(keys) else forward_s) - saves[i]
            hidden_b = uses[i] - (uses[i + 1] if i + 1 < len(keys) else 0.0)
            tensors.append(TensorProfile(
                key=key, layer=info.layer, layer_type=info.layer_type, op=info.op, shape=tuple(info.shape),
                itemsize=info.dtype.itemsize, sparsity=sparsity, runs=runs, save_s=saves[i], use_s=uses[i],
                hidden_f=max(hidden_f, 0.0), hidden_b=max(hidden_b, 0.0), zans_bits=self.zans_bits.get(key)))
        return IterationProfile(forward_s=forward_s, backward_s=backward_s, tensors=tuple(tensors))

    def latest(self) -> IterationProfile | None:
        """The timed iteration with the latest sparsity samples filled in."""
        if self.iteration is None:
            return None
        tensors = []
        for t in self.iteration.tensors:
            sparsity, runs = self.sparsity.get(t.key, (t.sparsity, t.runs))
            tensors.append(replace(t, sparsity=sparsity, runs=runs, zans_bits=self.zans_bits.get(t.key, t.zans_bits)))
        return IterationProfile(self.iteration.forward_s, self.iteration.backward_s, tuple(tensors))
