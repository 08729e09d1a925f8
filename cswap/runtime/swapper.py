"""The swapper: autograd's saved tensors go to host memory and come back.

`Swapper.pack` and `Swapper.unpack` are the two `saved_tensors_hooks`. This
module decides, per saved tensor, whether and how it leaves the device (pack),
and keeps the books; the journey itself is in three modules:

- cswap.runtime.offload: the stages out (encode on the worker, copy out on the
  sender, release), and raw copies out sent by pack itself in groups;
- cswap.runtime.restore: prefetch, copy in, decode and verify for backward;
- cswap.runtime.lanes: each device's side streams, and every wait and event
  between the stages.

An offloaded tensor is an Item (cswap.runtime.items) whose phase moves on in
one place (Item.advance, under this swapper's lock), and whose host copy is a
Lease given back in one place (Swapper.return_host).

Every device operation goes through the device seam (cswap.runtime.device):
CUDA, or the emulated asynchronous device on CPU. The code path is the same.

In flight. An offloaded tensor stays on the device until its copy completes,
and so does what was made to send it (the room reserved for its payload: for
the largest its codec can write, or, for ZVC and ZANS once the tensor was sent
in the pass before, for an eighth (at least 64 KiB) more than its payload then;
or a gathered copy): its footprint. pack() admits a tensor
only while the footprints in flight stay within the stash limit (else it
waits for the oldest copy), and prefetch restores ahead of backward only what
fits in the prefetch limit (a tensor and, compressed, its payload; one that
does not fit is fetched when backward asks). By default each limit is an
eighth of what a forward pass offloads (the stash: the previous pass's;
prefetch: the pass being restored), and each admits at least two tensors
whatever their size, the largest included: so that one tensor compresses
while the one before it is copied out, and the next restore copies in while
the one before it decodes. The device holds that little more than what stays,
at any model size, and the copies still overlap compute. Under a memory
budget, or with stash_bytes or prefetch_bytes given, the limits are kept
exactly (at least one tensor), and compressions reserve only their real size.

Dedup: a tensor saved by several ops is offloaded once; later saves of the
same tensor object at the same version share the first item. A weak
reference identifies the object, so a new tensor that reuses freed memory is
never mistaken for an old one.

In-place checks: with hooks installed autograd no longer checks saved
tensors' versions, so the swapper does, as stock autograd would.

Failures in the background threads are raised in the user's thread, at the
next pack or unpack (the training step stops; the next one starts clean), and
their warnings are given there too.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from typing import Callable

import torch

from .. import codecs
from ..codecs.base import WORD_DTYPES
from . import emulator
from .candidates import COMPILED_GRAPH, KEEP, SPARSE_PRODUCERS, SwapInfo, activation_producer, compiled_graph_inputs, \
    computed_inside, input_storages, movable, op_name
from .device import Device, device_of
from .hook_context import keeps_graph, mark
from .host_pool import HostPool
from .items import Handle, Item, KeptByPolicy, Pass, Phase, dense_permutation, drop_storage, modified_error
from .offload import Offloader
from .restore import Restorer, restore_footprint
from .stats import SwapStats
from .trace import stage

__all__ = ["Swapper", "check_policy", "default_max_host_bytes", "held_for_backward", "local_world_size"]

MiB = 1 << 20
Parameter = torch.nn.Parameter
AUTO_FRACTION = 8  # default stash and prefetch limits: this fraction of the previous pass's offloaded bytes
_LOOK = object()   # (a dedup entry not looked up yet)


# Launchers' names for the number of processes on this machine: torchrun, Slurm, Open MPI, MPICH.
_LOCAL_WORLD_SIZE = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def local_world_size() -> int:
    """Processes sharing this machine's memory, as the launcher says (1 when none does)."""
    for name in _LOCAL_WORLD_SIZE:
        value = os.environ.get(name, "").split("(")[0]  # Slurm may say "4(x2)"
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def default_max_host_bytes(fraction: float = 0.5) -> int:
    """This process's share of a fraction of the host memory available now: eight
    ranks on one machine each take a sixteenth, not half (8 GiB in all when the
    memory cannot be read)."""
    try:
        available = fraction * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        available = 8 << 30
    return int(available // local_world_size())


@functools.cache
def _offloadable_dtype(dtype: torch.dtype) -> bool:
    """Elements of 1, 2, 4 or 8 bytes (the codecs' integer views), not complex."""
    return dtype.itemsize in (1, 2, 4, 8) and not dtype.is_complex


def held_for_backward(t: torch.Tensor) -> bool:
    """A saved tensor the device keeps only for backward: not a parameter (nor a view of one)."""
    base = t._base if t._is_view() and t._base is not None else t
    return not (base.is_leaf and base.requires_grad)


def _check_codec_configs(configs) -> None:
    from ..kernels.launch import LaunchConfig

    if configs is None:
        return
    if not isinstance(configs, dict):
        raise TypeError(f"cswap: codec_configs must be a dict {{codec name: LaunchConfig}}, got "
                        f"{type(configs).__name__}")
    for name, config in configs.items():
        if name not in codecs.names():
            raise ValueError(f"cswap: codec_configs has an unknown codec {name!r}; codecs are "
                             f"{', '.join(codecs.names())}")
        if config is not None and not isinstance(config, LaunchConfig):
            raise TypeError(f"cswap: codec_configs[{name!r}] must be a cswap.LaunchConfig(grid, block) or None, "
                            f"got {config!r}")


def check_policy(mode: str, policy) -> None:
    """A user's policy must be callable and only goes with mode 'cswap'."""
    if policy is None:
        return
    if not callable(policy):
        raise TypeError(f"cswap: policy must be callable(info) -> codec name or None, got {type(policy).__name__}")
    if mode != "cswap":
        raise ValueError(f"cswap: a policy decides only in mode='cswap' (got mode={mode!r}); drop the "
                         f"mode argument or the policy")


class Swapper:
    """Offloads saved activations; see the module docstring.

    mode: "none" (hooks only), "vdnn" (offload, no compression), "sc" (ZVC on
    every candidate), "cswap" (policy(info) -> codec name, None or "keep"), "vdnnpp"
    (offload uncompressed, then ZVC-compress on the host with CPU threads to
    shrink the pinned footprint, and decompress on the host before the
    prefetch: vDNN++ as the CSWAP paper emulates it), "save_on_cpu" (the
    caller installs PyTorch's save_on_cpu instead of these hooks: a baseline).
    stash_bytes / prefetch_bytes: None (the default) for an eighth of the
    previous pass's offloaded bytes, or a number of bytes.
    """

    MODES = ("none", "vdnn", "sc", "cswap", "vdnnpp", "save_on_cpu")

    def __init__(self, mode: str | None = None, policy: Callable[[SwapInfo], str | None] | None = None, *,
                 candidates: str = "auto", min_bytes: int | None = None, stash_bytes: int | None = None,
                 prefetch_bytes: int | None = None, max_host_bytes: int | None = None, pin_memory: bool = True,
                 codec_configs: dict | None = None, checksum: bool = False, layer=None, observer=None):
        if mode is None:
            mode = "vdnn" if policy is None else "cswap"
        if mode not in self.MODES:
            raise ValueError(f"cswap: mode must be one of {self.MODES}, got {mode!r}")
        check_policy(mode, policy)
        if mode == "cswap" and policy is None:
            raise ValueError("cswap: mode='cswap' needs policy=callable(info) -> codec name or None")
        if candidates not in ("auto", "sparse", "all"):
            raise ValueError(f"cswap: candidates must be 'auto' (ReLU and pooling outputs, or every saved "
                             f"activation in a model without them), 'sparse' (ReLU and pooling outputs) or 'all' "
                             f"(every saved activation), got {candidates!r}")
        for name, value in (("min_bytes", min_bytes), ("stash_bytes", stash_bytes),
                            ("prefetch_bytes", prefetch_bytes), ("max_host_bytes", max_host_bytes)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"cswap: {name} must be a non-negative int of bytes (or None for the default), "
                                 f"got {value!r}")
        for name, value in (("pin_memory", pin_memory), ("checksum", checksum)):
            if not isinstance(value, bool):
                raise TypeError(f"cswap: {name} must be True or False, got {value!r}")
        _check_codec_configs(codec_configs)
        self.mode = mode
        self.offloads = mode not in ("none", "save_on_cpu")
        self.policy = policy
        self.candidates = candidates
        self._dense_seen = [0, 0]  # candidates="auto": activations and bytes passed over as dense
        self.min_bytes = min_bytes
        self.stash_bytes = stash_bytes
        self.prefetch_bytes = prefetch_bytes
        self.codec_configs = dict(codec_configs or {})
        self.checksum = checksum
        self.layer = layer or (lambda t, op: ("", "", ""))  # (made in, its type, saved in) of a candidate
        # A TensorProfiler (begin_pass, pause/resume, on_tick, on_pack, end_forward, on_unpack), or None;
        # none in the modes that offload nothing
        self.observer = observer if self.offloads else None
        # (tick) -> device bytes to stay within at the pass's tick-th save or use (a memory budget's
        # plan) or None; None when there is no budget: pack waits for copies out and prefetch
        # holds back while the device holds more (patch wires the budget).
        self.memory_limit: Callable[[int], int | None] | None = None
        # (kind) -> None: told when a step is not what a budget's plan assumes, one forward whose
        # backward frees its saves as it goes: "two forwards" (a forward before the backward of the
        # one before it) or "retained graph" (a backward that keeps its graph); it may raise
        self.step_unplanned: Callable[[str], None] | None = None
        self._awaiting_backward = 0  # forwards that saved for backward since the last use (under a budget)
        # While a pass traces memory (the budget's profiled step): tensors released since the
        # last tick, (tensor, nothing) to drop at the next, so what rises between two is the model's.
        self.held_drops: list | None = None
        self.lock = threading.RLock()
        self._warned: set[str] = set()
        self._notices: list[str] = []
        self.pool = HostPool(default_max_host_bytes() if max_host_bytes is None else max_host_bytes, pin_memory,
                             warn=self.notice)
        self.offloader = Offloader(self)
        self.restorer = Restorer(self)
        self.device: Device | None = None  # where the latest offload came from (for memory stats)
        self.tensor_device: torch.device | None = None  # the same, as a torch.device
        self._warmed: set[tuple[str, int]] = set()  # (codec, itemsize) pairs whose kernels are built
        self.inflight: deque[Item] = deque()  # admitted, not yet released, in pack order
        self.in_forward = False                # between begin_pass and end_pass: the training thread releases
        self._offload_bytes = 0                # the device bytes they hold (the stash)
        self.prefetched_bytes = 0              # device bytes restored ahead of use, not yet served
        self.prefetched_items = 0              # and how many restores
        self._peak_offload = self._peak_prefetch = 0  # the most of each since the stats' reset
        self._largest = 0                      # the largest footprint in the previous pass and this one so far
        self.payload_sizes = {}                # key -> (codec, nbytes, payload bytes) of its last launched encode
        self._previous_pass_bytes = 0          # the footprints of the previous pass's offloaded tensors
        self._failure: tuple[BaseException, Item | None] | None = None
        self._passes = 0                       # forward passes begun (an item's pass_number)
        self._trim: str | None = None          # "timed", "bridged", "counting": see _trim_after_timed_pass
        self._stopped_pass = -1                # the pass whose step a failure stopped
        self._stalls: list = []                # (device, asked, restored) events of on-demand restores
        self._pass: Pass | None = None
        self._phase = 0                        # forward passes and their ends so far (capture checks' epoch)
        self._capture = None                   # (device, compute stream, phase, verdict): the last capture check
        self.compiled_saves = 0                # saves recognised as a compiled graph's (patch checks it)
        self._graph_inputs = None              # the latest compiled graph call's inputs, and their storages
        self._input_storages: frozenset[int] = frozenset()
        self._seen: dict[int, Item | KeptByPolicy] = {}  # id(tensor) -> its item this pass (weak, version)
        self.stats = SwapStats(self)

    def capturing(self, dev: Device) -> bool:
        """dev.capturing(), asked once per phase (forward, then what follows it) and compute
        stream: a CUDA graph captures on a stream it makes current (torch.cuda.graph), so
        a capture that begins mid-phase is seen when its stream is; one that begins on the
        stream already current, mid-phase, is seen at the next phase (issue 39: the check
        is a CUDA call, and a save and a use each asked it)."""
        stream = dev.compute_stream()
        cached = self._capture
        phase = self._phase
        if cached is not None and cached[0] is dev and cached[1] is stream and cached[2] == phase:
            return cached[3]
        verdict = dev.capturing()
        self._capture = (dev, stream, phase, verdict)
        return verdict

    # -- passes -------------------------------------------------------------------------

    def begin_pass(self) -> None:
        """A new forward pass: new pack order, new dedup table."""
        self.surface()
        self._count_stalls()
        self.offloader.hand_over()  # (a forward that raised never reached end_pass)
        if self.restorer.unread:  # a backward that raised before its end read them
            self.restorer.abandon()
        if self._awaiting_backward and self.step_unplanned is not None:
            self.step_unplanned("two forwards")
        self.in_forward = True
        self._phase += 1
        if self._pass is not None and self._pass.footprint:
            # (the last pass's, not the largest ever: a first pass that read sizes back before
            # encoding counted each compressed tensor twice, and a steady pass holds less)
            self._previous_pass_bytes, self._largest = self._pass.footprint, self._pass.largest
        if self._trim is not None:
            self._trim_after_timed_pass(self._pass)
        self._pass = Pass()
        self._passes += 1
        self._seen.clear()
        self._drop_held()
        if self.observer is not None:
            self.observer.begin_pass()
            if self.observer.timing:
                self._trim = "timed"
            if self.observer.traces_memory:
                self.held_drops = []

    def _trim_after_timed_pass(self, previous: Pass | None) -> None:
        """The timed pass sends each raw tensor alone, into a host buffer of its size; the
        next step groups them into those buffers while buffers of its groups' sizes are
        pinned for the steps after (Offloader.flush), and the plan may compress or keep
        some: the buffers no later step needs would stay pinned, idle, until the epoch's
        end, or for good where epoch_end is never called. So the pool counts what the third
        step uses, and frees the rest as the fourth begins (steps counted by backwards,
        whatever forwards a step runs)."""
        if previous is None or not any(item.round for item in previous.items):
            return  # (its backward has not run: another forward of the same step, or none offloaded)
        if self._trim == "timed":  # the step after it groups into the timed step's buffers
            self._trim = "bridged"
        elif self._trim == "bridged":  # and the one after that into its own
            self.pool.restart_use()
            self._trim = "counting"
        else:
            self.pool.trim_idle()
            self._trim = None

    def end_pass(self, abandoned: bool = False) -> None:
        """The forward ended (`abandoned`: it raised, and its graph is gone)."""
        if self.memory_limit is not None and not abandoned and self._pass is not None and self._pass.ticks:
            self._awaiting_backward += 1
        if self.candidates == "auto" and self._pass is not None and (self._pass.candidates or self._dense_seen[0]):
            self._settle_candidates()
        self._seen.clear()
        self._graph_inputs, self._input_storages = None, frozenset()  # holds no input batch past the pass
        self._phase += 1  # (backward's first unpack asks again)
        self.offloader.hand_over()
        if self.observer is not None:
            self.observer.end_forward()

    def _settle_candidates(self) -> None:
        """candidates="auto", after the first step that saved activations: ReLU and pooling
        outputs when it made any (the paper's choice), else every saved activation (GELU
        and SiLU models: transformers), said once."""
        if self._pass.candidates:
            self.candidates = "sparse"
            return
        self.candidates = "all"
        count, nbytes = self._dense_seen
        self._warn_now("dense", f"cswap: none of the {count} activations ({nbytes / 2**20:.1f} MiB) this model's "
                                f"first step saved for backward is a ReLU or pooling output (a GELU/SiLU model, "
                                f"as transformers are), so from the next step every saved activation is "
                                f"offloaded (candidates='all'). Pass budget= to move only what must go, or "
                                f"candidates='sparse' to keep them")

    @property
    def releases_at_saves(self) -> bool:
        """The training thread releases completed copies as it sends more (Offloader.poll): while forward runs,
        without a memory budget (whose plan needs memory gone the moment a copy completes:
        the releaser thread's job). cswap.runtime.offload."""
        return self.in_forward and self.memory_limit is None

    def stash_limit(self) -> int:
        """Device bytes in flight out (tensors not yet released and the payloads made to send
        them) that pack admits more tensors within; by default at least two are in flight
        whatever their size (see _admit)."""
        if self.stash_bytes is not None:
            return self.stash_bytes
        return max(self._largest, self._previous_pass_bytes // AUTO_FRACTION, self._window_floor())

    def _window_floor(self) -> int:
        """The least a default window holds on this device (Device.window_floor_bytes; none
        under a memory budget, whose plan sets what the device may hold)."""
        dev = self.device
        return dev.window_floor_bytes if dev is not None and self.memory_limit is None else 0

    def prefetch_limit(self, pass_: Pass) -> int:
        """Device bytes restored ahead of backward's use, for the items of `pass_`; by default
        at least two restores are ahead whatever their size (fits_prefetch)."""
        if self.prefetch_bytes is not None:
            return self.prefetch_bytes
        return max(pass_.nbytes // AUTO_FRACTION, self._window_floor())

    def fits_prefetch(self, nbytes: int, limit: int, pending_bytes: int = 0, pending: int = 0) -> bool:
        """Whether one more restore holding `nbytes` fits ahead of backward (besides
        `pending` restores of `pending_bytes` about to be queued with it): within `limit`,
        or, by default (no prefetch_bytes, no memory budget), while fewer than two restores
        are ahead."""
        if self.prefetch_bytes is None and self.memory_limit is None and self.prefetched_items + pending < 2:
            return True
        return self.prefetched_bytes + pending_bytes + nbytes <= limit

    # -- pack -------------------------------------------------------------------------

    @mark  # (cswap's own hooks: a patched model inside a region or another patched model offloads as usual)
    def pack(self, t: torch.Tensor):
        """The pack hook. What it keeps in place is packed as (tensor, version) (a detached
        alias, which avoids the cycle output -> grad_fn -> saved output; autograd's in-place
        check, which hooks turn off, is made at unpack); what it offloads, as a Handle."""
        if self._notices or self._failure:
            self.surface()
        observer = self.observer
        observed = observer is not None and observer.current is not None
        if not observed:  # a weight or a view of one (linear saves weight.t()), the commonest save: kept at once
            base = t._base if t._is_view() else t
            if type(base) is Parameter and base.requires_grad:
                return t, t._version
            entry = self._live_entry(t, t._version)
            if type(entry) is Item and self.memory_limit is None and not entry.device.observes and \
                    not self.capturing(entry.device):
                handle = Handle(entry, self._pass, self, entry.view)
                if handle.item is not None:  # (else every save of it died meanwhile: offloaded anew below)
                    self.stats.add("deduplicated")  # saved again (the next op's input): on its way already
                    return handle
                entry = None
            if self.memory_limit is None and type(t) is torch.Tensor and t.layout is torch.strided and \
                    t.nbytes < self._floor(t.is_cuda):  # never a candidate, no budget (nbytes: dense ones only)
                dev = device_of(t)
                if dev is not None and not dev.observes:  # (the emulator counts every save)
                    return t.detach(), t._version
        if not movable(t):  # stays where it is, before anything reads its storage
            if not (t.is_leaf and t.requires_grad):
                self.stats.add("kept_unmovable")
            return t.detach(), t._version
        dev = device_of(t)
        if dev is None or self.capturing(dev):  # (a CUDA graph captures no copies on side streams: kept)
            return t.detach(), t._version
        if not observed:
            with stage("pack"):
                return self._pack(t, dev, None, sys._getframe(1), entry)
        at = observer.pause(dev)  # the timed pass: what follows is cswap's, not the model's
        try:
            with stage("pack"):
                return self._pack(t, dev, at, sys._getframe(1))
        finally:
            observer.resume(at)

    def _pack(self, t: torch.Tensor, dev: Device, at: int | None, caller, entry=_LOOK):
        """`at`: the profiler's stamp of this save (timed pass); `caller`: the frame that saved t;
        `entry`: t's dedup entry, when pack looked it up already (_LOOK: not yet)."""
        observer = self.observer
        held = dev.observes and held_for_backward(t)  # (the emulator counts a first save)
        incoming = dev.uncounted_bytes(t) if held else 0
        tick = self._tick()
        if at is not None:
            observer.on_tick(self._pass, dev, incoming)  # what the device holds, this tensor included
        if self.memory_limit is not None:
            limit = self.memory_limit(tick)
            if limit is not None:
                self._wait_within(limit - incoming, dev)
        if held:
            dev.on_saved(t)
        if not self.offloads:
            return t.detach(), t._version
        shared = self._already_offloaded(t, entry)  # (saved again: it was a candidate, no need to ask)
        if shared is not None:
            if type(shared) is not tuple:
                self.stats.add("deduplicated")
            return shared
        op = self._candidate_op(t, dev, caller)
        if op is None:
            return t.detach(), t._version
        saved, view, perm, key = t, None, dense_permutation(t), t
        if perm is None:  # (q, k, v of one projection; padded rows): sent as a dense tensor it lies in
            t, view, perm = self._dense_whole(t)
            key = t if t is saved._base else saved  # (a span is made anew for each save: its dedup key)
        if self._pass is None:
            self._pass = Pass()
        if "cpu" not in self._warned and emulator.is_default(dev):
            self._warn_now("cpu", "cswap: offloading CPU tensors to host memory saves no memory; cswap runs its "
                                  "full pipeline on CPU (against a device whose operations complete at once) only "
                                  "for testing and development")
        layer, layer_type, saved_in = self.layer(saved, op)  # (a span has no autograd node to name it)
        pass_ = self._pass
        info = SwapInfo(op, tuple(t.shape), t.dtype, t.nbytes, dev.device, layer, layer_type,
                        pass_.candidates, saved_in)
        pass_.candidates += 1
        codec = self._choose_codec(info)
        if codec == KEEP:  # the plan keeps it on the device (its sparsity is still sampled)
            self._seen[id(key)] = KeptByPolicy(key)
            self.stats.add("kept_by_plan")
            if observer is not None and observer.current is not None:
                observer.on_pack(info.key, t, info, dev, offloaded=False, at=at)
            return saved.detach(), saved._version
        item = Item(t, info, codec, perm, len(pass_.items), dev)
        if key is not t:
            item.weak, item.view = weakref.ref(key), view
        item.footprint, item.pass_number = self.offloader.footprint(item), self._passes
        if self.memory_limit is not None and item.footprint > info.nbytes:
            # What sending it allocates (a payload) is allocated on the worker,
            # some time after this save: room for it is made now, and counted until it is issued.
            limit = self.memory_limit(tick)
            if limit is not None:
                self._wait_within(limit - (item.footprint - info.nbytes), dev)
        self.device, self.tensor_device = dev, dev.device
        self._admit(item, pass_)
        # At once: an admitted item is always on its way (pack may raise below). Raw copies go
        # in groups, but in the timed pass (per-tensor timings), under a budget (whose plan
        # releases each tensor as its own copy completes) and in vdnnpp (which compresses
        # each host copy on its own).
        self.offloader.offload(item, grouped=at is None and self.memory_limit is None and self.mode != "vdnnpp")
        pass_.items.append(item)
        self._seen[id(key)] = item
        if observer is not None and observer.current is not None:  # (a pass it observes)
            observer.on_pack(item.key, t, info, dev, at=at)
        return Handle(item, pass_, self, view)

    @staticmethod
    def _dense_whole(t: torch.Tensor):
        """(tensor to send, view, its dense permutation) for a tensor `t` that is not dense
        (gaps, overlaps), so that it comes back with its exact strides (kernels choose their
        path, and so their rounding, by strides). The tensor it views, when that is dense, and
        t's place in it: the other views of it saved after t (k and v after q) are sent with
        it, once. Else the span of memory t covers, its gaps included, as a 1-D tensor: no
        more than t's storage, which t kept on the device."""
        if t._is_view():
            base = t._base
            # (of t's dtype: z.real, z.imag view a complex z in floats)
            perm = dense_permutation(base) if movable(base) and base.dtype == t.dtype else None
            if perm is not None:
                return base, (tuple(t.shape), t.stride(), t.storage_offset() - base.storage_offset()), perm
        # (t is not empty: an empty tensor is no candidate)
        length = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        span = t.detach().as_strided((length,), (1,), t.storage_offset())
        return span, (tuple(t.shape), t.stride(), 0), dense_permutation(span)

    def _floor(self, cuda: bool) -> int:
        """min_bytes, or its default: 1 MiB for CUDA tensors, none for CPU ones."""
        return self.min_bytes if self.min_bytes is not None else (MiB if cuda else 0)


    def _admit(self, item: Item, pass_: Pass) -> None:
        """Count the item in flight; while that would exceed the stash limit, wait for
        the oldest copy out to complete and release it (no polling). By default two
        tensors are always admitted, the largest included, so that one compresses while
        the one before it is copied out (the stash_bytes option and a memory budget's plan
        are kept exactly: at least one). A failure found while waiting is raised before the
        item is counted."""
        nbytes = item.footprint
        if nbytes > self._largest:
            self._largest = nbytes
        limit = self.stash_limit()
        least = 2 if self.stash_bytes is None and self.memory_limit is None else 1
        waited_since = None
        while True:
            if self._notices or self._failure:
                self.surface()
            with self.lock:
                if len(self.inflight) < least or self._offload_bytes + nbytes <= limit:
                    self._offload_bytes += nbytes
                    self.inflight.append(item)
                    if self._offload_bytes > self._peak_offload:  # (a new peak: the stats see only those)
                        self._peak_offload = self._offload_bytes
                        self.stats.peak("peak_offload_bytes", self._offload_bytes)
                    break
                oldest = self.inflight[0]
            waited_since = waited_since or item.device.host_time()
            self._wait_released(oldest, at="pack.stash_full")
        pass_.nbytes += item.info.nbytes
        pass_.footprint += nbytes
        pass_.largest = max(pass_.largest, nbytes)
        if waited_since is not None:
            self.stats.add("offload_stall_s", item.device.host_time() - waited_since)

    def _wait_within(self, limit: int, dev: Device) -> None:
        """Over the memory budget: wait for the oldest copies out to complete and release
        them until the device holds at most `limit` bytes or nothing is in flight (the
        plan counted on those tensors being gone by now)."""
        waited_since = None
        while dev.memory_allocated() + self._unissued_extra() > limit:
            with self.lock:
                if not self.inflight:
                    break
                oldest = self.inflight[0]
            waited_since = waited_since or dev.host_time()
            self._wait_released(oldest, at="pack.stash_full")
            if self.held_drops:  # (a pass tracing memory under a plan: the memory must go now)
                self._drop_held(hold_on=True)
        if waited_since is not None:
            self.stats.add("offload_stall_s", dev.host_time() - waited_since)

    def _unissued_extra(self) -> int:
        """Device bytes the worker has yet to allocate to send the items in flight (the
        memory budget counts them as held from their save on)."""
        with self.lock:
            return sum(it.footprint - it.info.nbytes for it in self.inflight if it.phase == Phase.PACKED)

    def _wait_released(self, item: Item, at: str) -> None:
        """Wait for the item's copy out, then release it."""
        self.offloader.wait_issued(item)
        if item.d2h_done is not None:
            try:
                item.device.event_synchronize(item.d2h_done, at=at)
            except Exception as exc:  # noqa: BLE001 - the copy failed: raised by surface()
                self.fail(exc, item)
        self.offloader.release_with(item)  # (and the rest of its group: their copies completed with it)

    def warm_up(self, choices) -> None:
        """Build now the kernels for each (codec, itemsize) in `choices`, on the device
        offloads come from, with this swapper's launch configs: Triton compiles on
        first launch, which would otherwise fall in the middle of a training step.
        Kernels see integer views, so the int dtype of that size stands for all."""
        for codec, itemsize in sorted(set(choices) - self._warmed):
            if self.tensor_device is None:
                return
            with self.device.guard():  # Triton launches on the current device
                codecs.warm_up(codec, WORD_DTYPES[itemsize], self.tensor_device, self.codec_configs.get(codec))
            self._warmed.add((codec, itemsize))

    def unstash(self, item: Item) -> None:
        """The item is released (called once, under the lock)."""
        self._offload_bytes -= item.footprint
        self.inflight.remove(item)

    def _already_offloaded(self, t: torch.Tensor, entry=_LOOK) -> Handle | tuple | None:
        """A handle on this pass's item for `t`, or for the tensor `t` is a view of
        (a flatten after pooling): the same bytes are never sent twice. `entry`: t's
        own dedup entry, when the caller looked it up already."""
        if entry is _LOOK:
            entry = self._live_entry(t, t._version)
        if entry is not None:
            if type(entry) is KeptByPolicy:
                return t.detach(), t._version
            handle = Handle(entry, self._pass, self, entry.view)  # (a span's: t's place in it)
            if handle.item is not None:  # (else its saves died since the lookup: offloaded anew)
                return handle
        # (a view of another dtype, view_as_complex(x) of a float x, cannot be served from x's copy)
        base = t._base if t._is_view() else None
        if base is not None and base.dtype != t.dtype:
            base = None
        entry = self._live_entry(base, t._version) if base is not None else None  # (a view shares its version)
        if entry is not None:  # (every entry is of a dense tensor: Swapper._dense_whole)
            if type(entry) is KeptByPolicy:
                return t.detach(), t._version
            # The restored base has the original strides from storage offset 0.
            view = (tuple(t.shape), t.stride(), t.storage_offset() - base.storage_offset())
            handle = Handle(entry, self._pass, self, view)
            if handle.item is not None:
                return handle
        return None

    def _live_entry(self, t: torch.Tensor, version: int) -> Item | KeptByPolicy | None:
        """This pass's dedup entry for the tensor object `t` at `version`, unless its saves
        all died (a new tensor at t's reused address, or t changed in place, has none)."""
        entry = self._seen.get(id(t))
        if entry is not None and entry.weak() is t and entry.version == version and not entry.freed:
            return entry
        return None

    def _candidate_op(self, t: torch.Tensor, dev: Device, caller) -> str | None:
        """The op that produced `t` when `t` is to be offloaded, else None. `t` is movable.
        `caller`: the frame that saved it (a compiled graph's saves count whatever
        `candidates` says: the graph hides which op made them)."""
        nbytes = t.nbytes
        if type(t) is Parameter or nbytes == 0 or not _offloadable_dtype(t.dtype):
            return None
        floor = self._floor(dev.kind == "cuda")
        activation, name = activation_producer(t)
        if not activation:
            graph_inputs = compiled_graph_inputs(caller)
            if graph_inputs is None:
                return None
            self.compiled_saves += 1
            if graph_inputs is not self._graph_inputs:  # one graph call saves many: its inputs' storages once
                self._graph_inputs, self._input_storages = graph_inputs, input_storages(graph_inputs)
            # (A compiled backward asserts its saved tensors' strides: they come back exact.)
            compiled = nbytes >= floor and computed_inside(t, self._input_storages)
            return COMPILED_GRAPH if compiled else None
        if nbytes < floor:
            return None
        if self.candidates == "all" or name in SPARSE_PRODUCERS:
            return op_name(name or "")
        if self.candidates == "auto":
            self._dense_seen[0] += 1
            self._dense_seen[1] += nbytes
        return None

    def _choose_codec(self, info: SwapInfo) -> str | None:
        """None (offload raw), a codec, or KEEP (leave it on the device)."""
        if self.mode in ("vdnn", "vdnnpp"):  # vdnnpp compresses on the host, after the transfer
            return None
        if self.mode == "sc":
            return "zvc"
        codec = self.policy(info)
        if codec is not None and codec != KEEP and codec not in codecs.names():
            raise ValueError(f"cswap: policy returned {codec!r} for {info.where}; expected None (offload raw), "
                             f"{KEEP!r} (leave it on the device) or one of {', '.join(codecs.names())}")
        return codec

    # -- unpack ---------------------------------------------------------------------------

    def unpack(self, packed):
        if self._notices or self._failure:
            self.surface()
        observer = self.observer
        observed = observer is not None and observer.current is not None
        if type(packed) is tuple:  # kept in place
            t, version = packed
            if observed or self.memory_limit is not None:
                at = self._at_use(device_of(t), observer if observed else None)
                if at is not None:
                    observer.resume(at)
            if t._version != version:
                raise modified_error(f"[{t.dtype} {list(t.shape)}]", version, t._version)
            return t
        if not observed and self.memory_limit is None:
            with stage("unpack"):
                return self.restorer.unpack(packed, None)
        if packed.item.round and self.step_unplanned is not None:  # (a second backward: where torch cannot say)
            self.step_unplanned("retained graph")
        at = self._at_use(packed.item.device, observer if observed else None)
        try:
            return self.restorer.unpack(packed, at)
        finally:
            if at is not None:
                observer.resume(at)

    def _at_use(self, dev: Device | None, observer) -> int | None:
        """At a use in the timed pass or under a budget: the profiler's pause (its stamp,
        or None) and tick, and the wait for copies out while over the budget."""
        if dev is None:
            return None
        at = None
        tick = self._tick()
        self._awaiting_backward = 0
        if self.step_unplanned is not None and keeps_graph():
            self.step_unplanned("retained graph")
        if observer is not None:
            at = observer.pause(dev)  # the timed pass: waits for copies are not compute
            observer.on_tick(self._pass, dev)
        if self.memory_limit is not None:
            limit = self.memory_limit(tick)
            if limit is not None:
                self._wait_within(limit, dev)
        return at

    def _tick(self) -> int:
        """A save or use under a memory check: its number in the pass (the budget's limit at
        it leaves room for what the profiled step rose to before the next). Under a budget
        the copies out completed by now are released first (the plan counts their memory
        gone then; the releaser thread runs late on a loaded host), and the tensors released
        since the last tick dropped when the pass traces memory.

        A pass that traces memory (the budget's profiled step) also first waits for the copies
        out of earlier saves to be queued, and releases those completed as a budget does: its
        trace says when each tensor can be away, for the plan of every later step, and must not
        depend on when the worker and releaser threads happen to run (a loaded host runs them
        late enough that backward serves a tensor from the device: the plan then sees it never
        away, where a later step, whose pack queues raw copies itself, sends it away in forward)."""
        tracing = self.held_drops is not None
        if tracing:
            self._await_issued()
        if (self.memory_limit is not None or tracing) and self.inflight:
            self.offloader.release_completed(handed=True)
        if self.held_drops:
            self._drop_held(hold_on=True)
        if self._pass is None:
            self._pass = Pass()
        tick = self._pass.ticks
        self._pass.ticks = tick + 1
        return tick

    def _await_issued(self) -> None:
        """Wait until the worker has queued the copy out of every item in flight (a later
        step's pack queues a raw copy itself, into a host buffer the first step allocated)."""
        with self.lock:
            waiting = [item for item in self.inflight if not item.issued.is_set()]
        for item in waiting:
            self.offloader.wait_issued(item)

    def _drop_held(self, hold_on: bool = False) -> None:
        """Drop the tensors released while a pass traces memory; `hold_on`: go on holding."""
        with self.lock:
            held, self.held_drops = self.held_drops, ([] if hold_on and self.held_drops is not None else None)
        for src, nothing in held or ():
            drop_storage(src, nothing)

    def check_version(self, item: Item) -> None:
        now = item.counter._version
        if now != item.version:
            raise modified_error(f"[{item.info.dtype} {list(item.info.shape)}], saved by {item.info.where} as "
                                 f"output of {item.info.op},", item.version, now)

    def end_round_if_served(self, item: Item) -> None:
        """Every live save of the item was unpacked: drop the restored tensor (backward
        owns it now); a later backward (retain_graph) restores it again. Under the lock."""
        if item.handles > 0 and item.unpacked >= item.handles:
            item.round += 1
            item.unpacked = 0
            item.restored = item.h2d_done = None
            self.uncount_prefetch(item)

    def count_prefetch(self, item: Item) -> None:
        """A prefetch was issued (under the lock): in flight until served."""
        if not item.prefetch_counted:
            item.prefetch_counted = True
            self.prefetched_items += 1
            self.prefetched_bytes += restore_footprint(item)
            if self.prefetched_bytes > self._peak_prefetch:
                self._peak_prefetch = self.prefetched_bytes
                self.stats.peak("peak_prefetch_bytes", self.prefetched_bytes)

    def uncount_prefetch(self, item: Item) -> None:
        if item.prefetch_counted:
            item.prefetch_counted = False
            self.prefetched_items -= 1
            self.prefetched_bytes -= restore_footprint(item)

    def note_stall(self, dev: Device, asked, restored) -> None:
        """An on-demand restore: compute asked at `asked` and waits for `restored`
        (timed once both events completed: no sync just to time it)."""
        if restored is not None:
            with self.lock:
                self._stalls.append((dev, asked, restored))
            self._count_stalls()

    def _count_stalls(self) -> None:
        """Add the stalls whose events completed to prefetch_stall_s."""
        with self.lock:
            pending, self._stalls = self._stalls, []
        waiting = []
        for dev, asked, restored in pending:
            seconds = dev.elapsed_s(asked, restored)
            if seconds is None:
                waiting.append((dev, asked, restored))
            else:
                self.stats.add("prefetch_stall_s", max(seconds, 0.0))
        with self.lock:
            self._stalls.extend(waiting)

    # -- failures and warnings from the background ----------------------------------------

    def fail(self, exc: BaseException, item: Item | None = None) -> None:
        """Record a background failure: raised in the user's thread by surface()."""
        with self.lock:
            if item is not None:
                if item.failure is exc:  # another waiter on the same event: reported already
                    return
                item.failure = item.failure or exc
            # (more failures of a pass whose step already stopped on one are not raised again:
            # the next step starts clean)
            if self._failure is None and (item is None or item.pass_number != self._stopped_pass):
                self._failure = (exc, item)

    def offload_failed(self, item: Item | None, exc: BaseException) -> RuntimeError:
        what = f"the {item.info.op} output of {item.info.where}" if item is not None else "a saved tensor"
        error = RuntimeError(f"cswap: offloading {what} failed ({type(exc).__name__}: {exc}); the training step "
                             f"stops here rather than lose it, and the next one starts clean")
        error.__cause__ = exc
        return error

    def notice(self, key: str, message: str) -> None:
        """A warning from any thread, given once, in the user's thread."""
        with self.lock:
            if key not in self._warned:
                self._warned.add(key)
                self._notices.append(message)

    def _warn_now(self, key: str, message: str) -> None:
        self.notice(key, message)
        self.surface()

    def surface(self) -> None:
        """Give pending warnings and raise a background failure (once) in this thread."""
        if not (self._notices or self._failure):
            return
        with self.lock:
            notices, self._notices = self._notices, []
            failure, self._failure = self._failure, None
        for message in notices:
            warnings.warn(message, RuntimeWarning, stacklevel=4)
        if failure is not None:
            exc, item = failure
            if item is not None:
                self._stopped_pass = item.pass_number
            raise self.offload_failed(item, exc)

    # -- lifetime ---------------------------------------------------------------------------

    def drop_handle(self, handle: Handle) -> None:
        item = handle.item
        if item is None:  # it was never counted (see Handle)
            return
        with self.lock:  # handles die in whichever thread the garbage collector runs
            item.handles -= 1
            if handle.served_round == item.round:  # it was counted in this round
                item.unpacked -= 1
            if item.handles > 0:
                self.end_round_if_served(item)
                return
            if item.freed:
                return
            item.freed = True
            self.uncount_prefetch(item)
            item.restored = item.h2d_done = None
            item.fallback = None
            self.return_host(item)

    def return_host(self, item: Item) -> None:
        """The one place an item's host copy goes back to the pool (under the lock), when
        nothing will read it any more: every save of it died (or vdnnpp keeps it compressed
        on the CPU), it is handled (the sender has put its copy out in it: ISSUED), no
        restore reads it on the host (busy) and no verdict waiting in it is unread. The
        pool reuses the buffer once its last copy completes (Lease.last_use); a group's,
        once every item in it has given its share back."""
        lease = item.lease
        if lease is None or not (item.freed or item.host_blob is not None) or item.phase < Phase.ISSUED \
                or item.busy or item.verdict_unread:
            return
        item.lease = item.host_view = None
        if item.freed:
            item.host_blob = None
        lease.give_back()

    def synchronize(self) -> None:
        """Wait until every admitted offload has been copied out and released, the work
        queued beside them is done (buffers pinned for the next step, vdnnpp's host
        compressions), and every verdict of a restore served to backward has been read."""
        while True:
            with self.lock:
                if not self.inflight:
                    break
                oldest = self.inflight[0]
            self._wait_released(oldest, at="release.copy_done")
        self.offloader.wait_background()
        if self.held_drops:
            self._drop_held(hold_on=True)
        if self.restorer.unread:  # (a backward that raised never reached its end)
            self.restorer.settle()

    def trim_host_pool(self) -> int:
        """Give back host buffers unused since the last call (at each epoch end)."""
        return self.pool.trim_idle()

    def close(self) -> None:
        """Finish queued offloads, stop the threads, drop idle host buffers."""
        try:
            self.synchronize()
        finally:
            self.offloader.stop()
            self.pool.clear()

    # -- stats ------------------------------------------------------------------------------

    def on_stats_reset(self) -> None:
        self.pool.peak_reserved_bytes = self.pool.reserved_bytes
        with self.lock:
            self._stalls.clear()
            self._peak_offload = self._peak_prefetch = 0
        if self.device is not None:
            self.device.reset_peak()

    def live_stat(self, name: str):
        if name == "prefetch_stall_s":
            self._count_stalls()
            return self.stats.counted("prefetch_stall_s")
        if name == "host_pool_bytes":
            return self.pool.reserved_bytes
        if name == "peak_host_pool_bytes":
            return self.pool.peak_reserved_bytes
        if self.device is None:
            return 0
        if name == "peak_gpu_reserved_bytes":
            return self.device.max_memory_reserved()
        return self.device.max_memory_allocated()
