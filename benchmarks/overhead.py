"""Host time per saved tensor: what cswap costs the training thread (issue 26).

A transformer step saves hundreds of tensors, and every microsecond the training
thread spends in cswap's hooks is one the GPU may wait. This benchmark makes the
copies free and measures what is left: a chain of Linear + ReLU layers on tiny
tensors (default 100 layers of 64 x 64, batch 32, one torch thread), so each
layer's ReLU output is offloaded and its weight is kept, and reports per provider,
side by side in one run, the median forward and backward time of a step (the garbage
collector's pauses left out) and the collector's mean time per step, and what each
adds over unpatched (stock autograd, timed in turn with them: the median over rounds
of the difference within a round) per offloaded tensor (pack in forward, unpack in
backward, and gc: the young generations' collections its objects cause, full ones
being off while timing; x min.: that as a multiple of `minimal`'s, which moves less
with the machine's speed) and per tensor the hooks keep:

    unpatched       stock autograd
    hooks           saved_tensors_hooks that return what they get: the floor of any hook-based offload
    save_on_cpu     torch.autograd.graph.save_on_cpu(): PyTorch's own (a copy per tensor, no threads)
    minimal         the least a hooks-based offload does in Python: pack copies an activation
                    (once per tensor) into a pooled host buffer, unpack copies it back into a new
                    tensor; no threads, events, checks or bookkeeping. The floor for vdnn's figure
    lean            a sketch of the per-tensor mechanics cswap's raw path had (before it copied in
                    groups), written flat through the same device seam: candidate test (movable,
                    device, producer, SwapInfo), dedup, version check, a record per tensor, a ready
                    event, a pooled host buffer, the copy on the D2H stream and its done event,
                    stash bytes under a lock, release of completed copies at each save (dropping
                    the memory, not the version counter), handles counted under a lock, lock-free
                    stats, restore with one prefetch ahead. No stash limit, rounds, failures,
                    observer or layer names. What a per-tensor Python offload costs at the least
    batched         a sketch of the per-group design at its leanest: saves grouped 16 at a time,
                    each group copied out with one torch._foreach_copy_ into host tensors kept
                    from the previous step (a steady network saves the same shapes), released as
                    a group, and restored for backward with one foreach copy per group; dedup and
                    version checks kept, no records, events or side streams (copies on the compute
                    stream). cswap now copies, releases and restores in groups too, but keeps its
                    records, stash, prefetch window and checks per tensor
    keep            cswap.patch, nothing a candidate (min_bytes above every tensor): every save kept
    vdnn, sc, cswap cswap.patch in its modes (every activation a candidate; sc: ZVC on every one)
    vdnnpp          vDNN++ as the CSWAP paper emulates it, the torchtune-style baseline: raw
                    copies, then ZVC on host threads

on each device of cswap's seam (--devices):

    cpu             CPU tensors outside any emulator: cswap's default for them, a device whose
                    operations complete at once (cswap.runtime.immediate): what users' CPU tests pay
    emulated        the emulated device with instant copies: the same with the emulator's race
                    detector, vector clocks and memory accounting on (what CI's tests run)
    lagging         the immediate device with events that complete 20 us after they are recorded,
                    as a tiny copy on a GPU: releases go through the releaser thread, as on CUDA.
                    This stands for the CUDA path's own host cost.
    cuda            the model on the GPU (only where one is): cswap's CUDA path itself, side
                    streams, events, pinned memory and torch's CUDA calls included (on an H200's
                    host it cost more than the lagging stand-in: benchmarks/results/nvidia-h200).
                    Each step ends with a device synchronize inside backward's timing, so
                    forward's figure is the host's alone and backward's includes the GPU's tail
                    (tiny here: the host is the bottleneck at these sizes).

and, with --busy, once more with a thread copying 64 MiB buffers beside training
(a copy in flight, as the worker's or a data loader's): torch releases the GIL
while it copies, so the training thread must not wait behind it. (In mode sc the
worker compresses while forward goes on: its Python competes for the GIL.)

    python benchmarks/overhead.py              # the full run (about a minute on 2 cores; two with --busy)
    python benchmarks/overhead.py --quick      # a smoke run

Every figure is measured on this machine's CPU (named in the results), and on
--devices cuda also on its GPU (named too).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import os
import statistics
import threading
import warnings
import weakref
from pathlib import Path

import torch
from torch import nn

import cswap
from cswap.runtime import emulator
from cswap.runtime.candidates import SwapInfo, movable, op_name, producer
from cswap.runtime.device import CudaDevice, device_of
from cswap.runtime.emulator import EmulatedDevice
from cswap.runtime.immediate import ImmediateDevice
from cswap.runtime.trace import per_tensor, seam_calls
from cswap.tune.host_cost import GcClock, chain, time_steps, young_collections_only  # (cswap-tune's)
from common import settle  # (a sibling: benchmarks/ is on the path, as for every script here)

PROVIDERS = ("unpatched", "hooks", "save_on_cpu", "minimal", "lean", "batched", "keep", "vdnn", "sc", "cswap", "vdnnpp")
PATCHED = ("keep", "vdnn", "sc", "cswap", "vdnnpp")  # cswap.patch'ed: stats to read, a patch to undo
PER_SAVED = ("hooks", "keep")  # their figures are per saved tensor (the others': per offloaded tensor)
DEVICES = ("cpu", "emulated", "lagging", "cuda")
LAG_S = 20e-6


def _keep_everything(model):
    return cswap.patch(model, mode="vdnn", min_bytes=1 << 40, verbose=False)


def _patched(model, mode):
    return cswap.patch(model, mode=mode, candidates="all", min_bytes=0, verbose=False)


def _identity_hooks():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


class MinimalOffload:
    """The `minimal` provider's hooks (see the module docstring): what any Python
    offload of a raw tensor must do, so its cost per tensor is the floor here."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.pin = device == "cuda"  # non-blocking copies need pinned host memory
        self.pool: dict[int, list[torch.Tensor]] = {}
        self.seen: dict[int, tuple] = {}  # id(tensor) -> (tensor, packed): a tensor saved twice goes once

    def pack(self, t: torch.Tensor):
        base = t._base if t._is_view() else t
        if base.grad_fn is None:  # weights (linear saves weight.t()) and inputs stay
            return t
        hit = self.seen.get(id(t))
        if hit is not None and hit[0] is t:
            return hit[1]
        nbytes = t.numel() * t.element_size()
        free = self.pool.get(nbytes)
        host = free.pop() if free else torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        host.copy_(t.reshape(-1).view(torch.uint8), non_blocking=self.pin)
        packed = [host, t.dtype, t.shape, None]  # [3]: restored, for the tensor's other saves
        self.seen[id(t)] = (t, packed)
        return packed

    def unpack(self, packed):
        if type(packed) is not list:
            return packed
        if packed[3] is None:
            host, dtype, shape, _ = packed
            out = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            out.copy_(host, non_blocking=self.pin)
            packed[3] = out.view(dtype).view(shape)
        return packed[3]

    def hooks(self):
        """The hooks for one step; the previous step's buffers (its backward is over, and on
        CUDA the step ended with a synchronize) go back to the pool."""
        for _, packed in self.seen.values():
            self.pool.setdefault(packed[0].numel(), []).append(packed[0])
        self.seen.clear()
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _in_place_check(tensor: torch.Tensor, version: int) -> None:
    if tensor._version != version:
        raise RuntimeError("a saved tensor was modified in place")


def _kept(packed: tuple) -> torch.Tensor:
    """The sketches' unpack of a tensor their pack kept, as (tensor, version)."""
    _in_place_check(*packed)
    return packed[0]


class _LeanItem:
    __slots__ = ("info", "src", "counter", "version", "ready", "host", "done", "restored", "h2d", "index",
                 "handles")


class _LeanHandle:
    __slots__ = ("item", "owner")

    def __init__(self, item: _LeanItem, owner: "LeanOffload"):
        self.item, self.owner = item, owner
        with owner.lock:
            item.handles += 1

    def __del__(self):
        item, owner = self.item, self.owner
        with owner.lock:
            item.handles -= 1
            if item.handles == 0:  # the last save is gone: its host buffer goes back
                owner.pool.setdefault(item.info.nbytes, []).append(item.host)


class LeanOffload:
    """The `lean` provider's hooks (see the module docstring): cswap's per-tensor
    mechanics for a dense tensor sent raw, flat, so its figure is the least a
    per-tensor offload in Python pays here for them."""

    def __init__(self):
        self.lock = threading.RLock()  # stash bytes and handle counts (handles die on any thread)
        self.pool: dict[int, list[torch.Tensor]] = {}
        self.seen: dict[int, tuple] = {}
        self.items: list[_LeanItem] = []
        self.inflight: list[_LeanItem] = []
        self.stash = 0
        self.stats = cswap.SwapStats()

    def pack(self, t: torch.Tensor):
        base = t._base if t._is_view() else t
        if type(base) is nn.Parameter and base.requires_grad:
            return t, t._version
        hit = self.seen.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            self.stats.add("deduplicated")
            return _LeanHandle(hit[2], self)
        dev = device_of(t) if movable(t) else None
        if dev is None or dev.capturing() or base.grad_fn is None or not t.is_contiguous():
            return t.detach(), t._version
        name = producer(t)
        info = SwapInfo(op_name(name or ""), tuple(t.shape), t.dtype, t.numel() * t.element_size(), dev.device,
                        "", "", len(self.items))
        item = _LeanItem()
        item.info, item.version, item.handles, item.restored, item.index = info, t._version, 0, None, len(self.items)
        item.src = item.counter = t.detach()
        compute, d2h = dev.compute_stream(), dev.side_stream("d2h")
        item.ready = dev.record_event(compute)
        with self.lock:
            self.stash += info.nbytes
            self.stats.peak("peak_offload_bytes", self.stash)
        free = self.pool.get(info.nbytes)
        item.host = free.pop() if free else dev.host_empty(info.nbytes, pinned=dev.kind == "cuda")
        dev.wait_event(d2h, item.ready, at="offload.copy_after_ready")
        dev.copy(item.host, item.src.view(-1).view(torch.uint8), d2h)
        item.done = dev.record_event(d2h)
        self.stats.add_all(("offloaded_tensors", 1), ("offloaded_bytes", info.nbytes))
        self.items.append(item)
        inflight = self.inflight
        inflight.append(item)
        while inflight and dev.event_query(inflight[0].done, at="release.copy_done"):  # completed copies release
            with self.lock:
                done = inflight.pop(0)
                self.stash -= done.info.nbytes
            done.src = None
            done.counter.data = dev.nothing
        self.seen[id(t)] = (weakref.ref(t), item.version, item)
        return _LeanHandle(item, self)

    def _restore(self, item: _LeanItem, dev) -> None:
        compute, h2d = dev.compute_stream(), dev.side_stream("h2d")
        y = dev.empty(item.info.nbytes, h2d)  # (on the stream that writes it: no wait for compute)
        dev.copy(y, item.host, h2d)
        dev.record_stream(y, compute, at="restore.record_restored")
        item.h2d = dev.record_event(h2d)
        item.restored = y.view(item.info.dtype).view(item.info.shape)
        self.stats.add("restored_tensors")

    def unpack(self, packed):
        if type(packed) is tuple:
            return _kept(packed)
        item = packed.item
        _in_place_check(item.counter, item.version)
        dev = device_of(item.counter)
        if item.restored is None:
            if item.src is not None:  # (the copy has not completed: served from the device)
                item.restored, item.h2d = item.src.detach(), None
            else:
                self._restore(item, dev)
            before = self.items[item.index - 1] if item.index else None
            if before is not None and before.restored is None and before.src is None:  # one ahead
                self._restore(before, dev)
        if item.h2d is not None:
            dev.wait_event(dev.compute_stream(), item.h2d, at="unpack.compute_after_copy_in")
        return item.restored

    def hooks(self):
        """The hooks for one step (the previous step's records go: backward used them)."""
        self.items, self.inflight = [], []
        self.seen.clear()
        self.stash = 0
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Group:
    __slots__ = ("tensors", "shapes", "host", "restored")

    def __init__(self):
        self.tensors, self.shapes, self.host, self.restored = [], [], None, None


class _GroupHandle:
    __slots__ = ("group", "index", "counter", "version")


class BatchedOffload:
    """The `batched` provider's hooks (see the module docstring)."""

    def __init__(self, device: str = "cpu", group: int = 16):
        self.device, self.group = device, group
        self.pin = device == "cuda"
        self.nothing = torch.empty(0, device=device)
        self.seen: dict[int, tuple] = {}
        self.groups: list[_Group] = []
        self.pending: _Group | None = None
        self.host: dict[tuple, list[torch.Tensor]] = {}  # (group number, shapes, dtypes) -> host tensors

    def pack(self, t: torch.Tensor):
        base = t._base if t._is_view() else t
        if type(base) is nn.Parameter and base.requires_grad:
            return t, t._version
        hit = self.seen.get(id(t))
        if hit is not None and hit[0]() is t and hit[1].version == t._version:
            return hit[1]
        if base.grad_fn is None or not t.is_contiguous():
            return t.detach(), t._version
        group = self.pending
        if group is None:
            group = self.pending = _Group()
        handle = _GroupHandle()
        handle.group, handle.index, handle.version = group, len(group.tensors), t._version
        handle.counter = t.detach()
        group.tensors.append(handle.counter)
        group.shapes.append((t.shape, t.dtype))
        if len(group.tensors) == self.group:
            self._copy_out(group)
        self.seen[id(t)] = (weakref.ref(t), handle)
        return handle

    def _copy_out(self, group: _Group) -> None:
        key = (len(self.groups), tuple(group.shapes))
        host = self.host.get(key)
        if host is None:
            host = self.host[key] = [torch.empty(shape, dtype=dtype, pin_memory=self.pin)
                                     for shape, dtype in group.shapes]
        torch._foreach_copy_(host, group.tensors, non_blocking=self.pin)
        group.host = host
        for tensor in group.tensors:  # released: the memory goes, the version counters stay (stream-ordered)
            tensor.data = self.nothing
        self.groups.append(group)
        self.pending = None

    def unpack(self, packed):
        if type(packed) is tuple:
            return _kept(packed)
        _in_place_check(packed.counter, packed.version)
        group = packed.group
        if group.restored is None:
            if group.host is None:  # the last, partial group of forward: still on the device
                group.restored = list(group.tensors)
            else:
                group.restored = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in group.shapes]
                torch._foreach_copy_(group.restored, group.host, non_blocking=self.pin)
        return group.restored[packed.index]

    def hooks(self):
        """The hooks for one step (the previous step's backward is over)."""
        self.groups, self.pending = [], None
        self.seen.clear()
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def provider(name: str, model: nn.Module, device: str = "cpu"):
    """(the model to train, a context to run each step in)."""
    if name == "unpatched":
        return model, contextlib.nullcontext
    if name == "hooks":
        return model, _identity_hooks
    if name == "save_on_cpu":
        return model, functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=device == "cuda")
    if name == "minimal":
        return model, MinimalOffload(device).hooks
    if name == "lean":
        return model, LeanOffload().hooks
    if name == "batched":
        return model, BatchedOffload(device).hooks
    if name == "keep":
        return _keep_everything(model), contextlib.nullcontext
    return _patched(model, name), contextlib.nullcontext


def make_device(name: str):
    """The seam's device for CPU tensors (None: cswap's default for them)."""
    if name in ("cpu", "cuda"):
        return None
    if name == "emulated":
        return EmulatedDevice(bandwidth_gbps=math.inf, log=False)
    if name == "lagging":
        return ImmediateDevice(latency_s=LAG_S)
    raise ValueError(f"unknown device {name!r}; choose from {DEVICES}")


@contextlib.contextmanager
def copy_in_flight(on: bool):
    """A thread copying 64 MiB buffers the whole time, as a worker's copy or a data
    loader's would: torch releases the GIL inside the copy, so the training thread
    should not wait for it."""
    if not on:
        yield
        return
    stop = threading.Event()
    src, dst = torch.empty(64 << 20, dtype=torch.uint8), torch.empty(64 << 20, dtype=torch.uint8)

    def copy():
        while not stop.is_set():
            dst.copy_(src)

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def measure(args) -> list[dict]:
    """Per device and load: every provider (and stock autograd) in turn, round after round,
    so that drift in the machine's speed falls on all of them alike; medians of all steps,
    what each adds over stock autograd within a round (the median over rounds), and the
    garbage collector's time while each ran."""
    torch.set_num_threads(1)  # the hooks' cost, not the matmuls' threading
    x_cpu = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(0))
    offloaded = args.layers  # one ReLU output per layer (the next Linear's save shares it)
    saved = 3 * args.layers  # per layer: Linear's input and weight (as weight.t()), ReLU's output
    rows = []
    for busy in ([False, True] if args.busy else [False]):
        for device in args.devices:
            where = "cuda" if device == "cuda" else "cpu"
            x = x_cpu.to(where)
            dev = make_device(device)
            active = (lambda: emulator.activate(dev)) if dev is not None else contextlib.nullcontext
            names = ["unpatched", *(n for n in args.providers if n != "unpatched")]
            trained = {}
            times = {name: ([], []) for name in names}
            by_round = {name: [] for name in names}  # (forward, backward) median of each round
            collecting = {name: GcClock() for name in names}
            with warnings.catch_warnings(), copy_in_flight(busy), young_collections_only():
                warnings.simplefilter("ignore")
                with active():
                    for name in names:
                        trained[name] = provider(name, chain(args.layers, args.width).to(where), where)
                        time_steps(*trained[name], x, args.warmup)
                    for r in range(args.rounds):
                        # Each round starts one provider later, and each provider's background work is
                        # let finish after its steps (common.settle): neither falls on the next one's.
                        for name in names[r % len(names):] + names[:r % len(names)]:
                            with collecting[name].on():
                                forward, backward = time_steps(*trained[name], x, args.steps,
                                                               clock=collecting[name].outside)
                            settle(cswap, trained[name][0])
                            times[name][0].extend(forward)
                            times[name][1].extend(backward)
                            by_round[name].append((statistics.median(forward), statistics.median(backward)))
                    stats = {name: cswap.stats(model) for name, (model, _) in trained.items()
                             if name in PATCHED}
                    for name in stats:
                        cswap.unpatch(trained[name][0])
            if isinstance(dev, EmulatedDevice):
                dev.close()
            base_f, base_b = (statistics.median(v) for v in times["unpatched"])
            timed_steps = args.rounds * args.steps
            base_gc = collecting["unpatched"].seconds / timed_steps
            for name in names:
                forward, backward = (statistics.median(v) for v in times[name])
                collected = collecting[name].seconds / timed_steps  # the collector's mean per step
                row = {"device": device, "busy": busy, "provider": name, "forward_ms": 1e3 * forward,
                       "backward_ms": 1e3 * backward, "gc_ms": 1e3 * collected,
                       "step_ms": 1e3 * (forward + backward + collected),
                       "x_unpatched": (forward + backward + collected) / (base_f + base_b + base_gc)}
                if name != "unpatched":
                    per = saved if name in PER_SAVED else offloaded
                    # What it adds: the median over rounds of its difference to stock autograd in the
                    # same round (this shared machine's speed can change by 2x within a minute).
                    pack, unpack = (statistics.median(mine[i] - base[i] for mine, base in
                                                      zip(by_round[name], by_round["unpatched"])) / per
                                    for i in (0, 1))
                    gc_added = (collected - base_gc) / per
                    row.update(pack_us=1e6 * pack, unpack_us=1e6 * unpack, gc_us=1e6 * gc_added,
                               added_us_per_tensor=1e6 * (pack + unpack + gc_added),
                               per="saved tensor" if per == saved else
                               "layer (its 3 saved tensors copied)" if name == "save_on_cpu" else "offloaded tensor")
                if name in stats:
                    row["offloaded_per_step"] = stats[name]["offloaded_tensors"] / \
                        (args.warmup + args.rounds * args.steps)
                rows.append(row)
    for row in rows:  # against save_on_cpu and the minimal offload, on the same device and load
        def ref(name):
            return next((r for r in rows if r["device"] == row["device"] and r["busy"] == row["busy"]
                         and r["provider"] == name), None)
        if ref("save_on_cpu") is not None:
            row["x_save_on_cpu"] = row["step_ms"] / ref("save_on_cpu")["step_ms"]
        floor = ref("minimal")  # the time added per offloaded tensor, as a multiple of the floor's: a ratio
        if floor is not None and row.get("per") == "offloaded tensor" and floor["added_us_per_tensor"] > 0:
            row["x_minimal"] = row["added_us_per_tensor"] / floor["added_us_per_tensor"]  # (steadier than us)
    return rows


def count_calls(args) -> list[dict]:
    """The seam calls each patched provider makes per offloaded tensor in steady state
    (issue 39), on each device (the default device for CPU tensors, the emulated one with
    CUDA's window floor, the lagging one, the GPU's): counted by cswap.runtime.trace.seam_calls
    over `args.steps` steps after the warm-up (and the profiler's timed steps), with the
    background threads' work included, by the stage that made them. `keep` (every save
    kept) is counted per saved tensor. A count, not a time: the same on any machine."""
    x_cpu = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(0))
    rows = []
    for device in args.devices:
        where = "cuda" if device == "cuda" else "cpu"
        x = x_cpu.to(where)
        dev = make_device(device)
        if isinstance(dev, EmulatedDevice):
            dev.window_floor_bytes = CudaDevice.window_floor_bytes  # (as CUDA's; the emulator's own is none)
        active = (lambda: emulator.activate(dev)) if dev is not None else contextlib.nullcontext
        with warnings.catch_warnings(), active():
            warnings.simplefilter("ignore")
            seam = dev if dev is not None else device_of(x)
            for name in (n for n in args.providers if n in PATCHED):
                model, context = provider(name, chain(args.layers, args.width).to(where), where)
                time_steps(model, context, x, max(args.warmup, 5))  # (the profiler times up to 4 steps)
                settle(cswap, model)
                cswap.stats(model).reset()
                with seam_calls(seam) as counts:
                    time_steps(model, context, x, args.steps)
                    settle(cswap, model)
                offloaded = cswap.stats(model)["offloaded_tensors"]
                cswap.unpatch(model)
                per = 3 * args.layers * args.steps if name in PER_SAVED else offloaded
                if not per:
                    continue
                counted = per_tensor(counts, per)
                by_call = counted.pop("by_call")
                rows.append({"device": device, "provider": name, "per": "saved tensor" if name in PER_SAVED
                             else "offloaded tensor", "tensors": per, **counted,
                             **{f"{call}_per_tensor": n for call, n in by_call.items()}})
        if isinstance(dev, EmulatedDevice):
            dev.close()
    print(f"{'device':9} {'provider':9} {'CUDA calls':>10} {'events':>7} {'pack':>6} {'send':>6} {'encode':>6} "
          f"{'release':>7} {'unpack':>6} {'prefetch':>8} {'restore':>7} {'other':>6}  per")
    for r in rows:
        stages = [r.get(f"{k}_calls", 0.0) for k in ("pack", "send", "encode")] + \
                 [r.get("release_calls", 0.0) + r.get("copy_wait_calls", 0.0)] + \
                 [r.get(f"{k}_calls", 0.0) for k in ("unpack", "prefetch", "restore", "other")]
        print(f"{r['device']:9} {r['provider']:9} {r['cuda_calls']:10.2f} {r['events']:7.2f} "
              f"{stages[0]:6.2f} {stages[1]:6.2f} {stages[2]:6.2f} {stages[3]:7.2f} {stages[4]:6.2f} "
              f"{stages[5]:8.2f} {stages[6]:7.2f} {stages[7]:6.2f}  {r['per']}")
    return rows


def collector_cost(args) -> list[dict]:
    """Python's garbage collector, every generation on, over `args.collector` steps of each
    provider alone on the CPU (a full collection comes every few hundred steps here, so the
    table's short rounds cannot time it): collections per generation, their mean
    duration, and the milliseconds per step and microseconds per offloaded tensor they
    cost. What full collections cost depends on the objects the process holds (this
    benchmark's: its count is given); how often they come, on what the steps leave
    promoted."""
    torch.set_num_threads(1)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(0))
    rows = []
    for name in args.providers:
        if name in ("sc", "vdnnpp", "cswap") and args.collector > 400:
            print(f"# {name}: left out (its codec launches take minutes per thousand steps on a CPU; vdnn "
                  f"stands for the runtime's records)")
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, context = provider(name, chain(args.layers, args.width))
            time_steps(model, context, x, args.warmup)
            gc.collect()
            with GcClock().on() as clock:
                time_steps(model, context, x, args.collector)
            if name in PATCHED:
                cswap.unpatch(model)
        per = 3 * args.layers if name in PER_SAVED else args.layers
        counts, seconds = clock.collections, clock.seconds_by
        rows.append({"provider": name, "steps": args.collector, "tracked_objects": len(gc.get_objects()),
                     **{f"gen{g}_collections": counts[g] for g in range(3)},
                     **{f"gen{g}_ms_each": 1e3 * seconds[g] / counts[g] if counts[g] else None for g in range(3)},
                     "ms_per_step": 1e3 * clock.seconds / args.collector,
                     "us_per_tensor": 1e6 * clock.seconds / args.collector / per})
    print(f"{'provider':12} {'collections (gen 0/1/2)':>24} {'ms each (gen 0/1/2)':>24} {'ms/step':>8} "
          f"{'us/tensor':>9}")
    for r in rows:
        each = "/".join("-" if r[f"gen{g}_ms_each"] is None else f"{r[f'gen{g}_ms_each']:.2f}" for g in range(3))
        print(f"{r['provider']:12} {'/'.join(str(r[f'gen{g}_collections']) for g in range(3)):>24} {each:>24} "
              f"{r['ms_per_step']:8.3f} {r['us_per_tensor']:9.1f}")
    return rows


def show(rows: list[dict]) -> None:
    print(f"{'device':9} {'busy':5} {'provider':12} {'fwd ms':>8} {'bwd ms':>8} {'x unp.':>7} {'x s_o_c':>7} "
          f"{'pack us':>8} {'unpack us':>9} {'gc us':>6} {'added us':>9} {'x min.':>6}  per")
    for r in rows:
        def f(key, fmt):
            return format(r[key], fmt) if key in r else "-"
        print(f"{r['device']:9} {str(r['busy']):5} {r['provider']:12} {r['forward_ms']:8.2f} {r['backward_ms']:8.2f} "
              f"{f('x_unpatched', '7.2f')} {f('x_save_on_cpu', '7.2f')} {f('pack_us', '8.1f')} "
              f"{f('unpack_us', '9.1f')} {f('gc_us', '6.1f')} {f('added_us_per_tensor', '9.1f')} {f('x_minimal', '6.2f')}  {r.get('per', '')}")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def main(argv=None) -> list[dict]:
    from common import environment, write_results

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run: 10 layers, few steps")
    p.add_argument("--layers", type=int, default=100)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="timed steps per provider and round")
    p.add_argument("--rounds", type=int, default=5, help="rounds over the providers (medians of all steps)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--devices", nargs="+", choices=DEVICES, default=[d for d in DEVICES if d != "cuda"],
                   help="devices of the seam to run on (cuda: only on a GPU machine; not in the default)")
    p.add_argument("--busy", action="store_true", help="also with a copy in flight on another thread")
    p.add_argument("--calls-only", action="store_true",
                   help="only the seam calls per tensor (calls.csv/.json; a count: seconds on any machine)")
    p.add_argument("--collector", type=int, metavar="STEPS",
                   help="instead: the garbage collector's cost, every generation on, over STEPS steps of each "
                        "provider on the CPU (a few thousand to see full collections)")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<device>)")
    args = p.parse_args(argv)
    if "cuda" in args.devices and not torch.cuda.is_available():
        p.error("--devices cuda needs a CUDA GPU; this machine has none (leave cuda out)")
    if args.quick:
        args.layers, args.steps, args.rounds, args.warmup = 10, 2, 2, 1
    if args.collector:
        rows = collector_cost(args)
        env = environment(torch.device("cpu"), torch_threads=1, cpu_model=_cpu_model(), cores=os.cpu_count())
        write_results(rows, env, args, args.out, torch.device("cpu"), "overhead-collector")
        return rows
    # Results go under the GPU's folder when it ran, else the CPU's; both are named in the environment.
    where = torch.device("cuda" if "cuda" in args.devices else "cpu")
    env = environment(where, torch_threads=1, cpu_model=_cpu_model(), cores=os.cpu_count())
    calls = count_calls(args)
    write_results(calls, env, args, args.out, where, "calls-quick" if args.quick else "calls")
    if args.calls_only:
        return calls
    rows = measure(args)
    show(rows)
    write_results(rows, env, args, args.out, where, "overhead-quick" if args.quick else "overhead")
    return rows


if __name__ == "__main__":
    main()
