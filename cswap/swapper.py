"""The swapper: autograd's saved tensors go to host memory and come back.

`Swapper.pack` and `Swapper.unpack` are the two `saved_tensors_hooks`.

Offload (CUDA). pack() records an event on the compute stream and hands the
tensor to a worker thread, so forward never waits (unless the stash limit of
in-flight bytes is reached). The worker, on a D2H side stream, waits for the
event, compresses if the policy chose a codec (a codec sizes its output with
one host sync, which blocks only the worker), copies into a pinned buffer from
the host pool and records a done event. The swapper holds the saved tensor
until that event has completed and only then drops it: the memory is released
after the copy, never before. Temporaries (the compressed buffer) live on the
D2H stream only, so stream order protects them without record_stream.

Restore (CUDA). Backward unpacks items in roughly reverse pack order. On the
first unpack of item k, the H2D copies (and decompression) of items k-1,
k-2, ... start on an H2D side stream, up to `prefetch_bytes` ahead; unpack
waits only for its own item's event. An item not prefetched is fetched on
demand (time counted in prefetch_stall_s). The restored tensor is allocated on
the H2D stream and used on the compute stream, so it is record_stream()ed to
the compute stream once: the caching allocator then cannot hand its memory to
the H2D stream before backward is done with it. The swapper drops its own
reference once every save of the item has been unpacked in this backward
(retain_graph: the host copy stays until autograd frees the graph, and the
next backward restores again).

Without CUDA the same pipeline runs synchronously with host buffers from the
same pool (no streams, no events): every path but the stream plumbing is
exercised on CPU. `asynchronous=True` forces the worker thread on CPU too.

Dedup: a tensor saved by several ops is offloaded once; later saves of the
same tensor object at the same version share the first item. A weak
reference identifies the object, so a new tensor that reuses freed memory is
never mistaken for an old one.

In-place checks: with hooks installed autograd no longer checks saved
tensors' versions, so the swapper does, as stock autograd would.

Integrity. A compressed host copy is checked when it comes back: its header
bytes must equal what was written and the decoder's consistency flags must
be clear. checksum=True adds an end-to-end checksum (cswap.integrity) of the
bytes sent, compressed or not, taken on the GPU before the copy out and
compared after the copy in. On CUDA the verdicts travel to the host with the
restore, and unpack reads them after waiting for its own item's restore
only. A corrupt copy raises CorruptDataError naming the layer, never
gradients from wrong values.

GPU out of memory while restoring. A prefetch that runs out of memory stops
prefetching (the item is fetched on demand later); an on-demand restore that
runs out waits for the device's pending frees and retries, then gives back
the prefetched tensors backward has not used yet (their host copies stay)
and retries again, and only then raises. No tensor is ever dropped.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
import warnings
import weakref
from typing import Callable

import torch

from . import codecs, integrity
from .candidates import (COMPILED_GRAPH, SPARSE_PRODUCERS, SwapInfo, is_activation, op_name, producer,
                         saved_by_compiled_graph)
from .codecs.container import Compressed, unpack_header
from .errors import CorruptDataError
from .host_pool import HostPool
from .stats import SwapStats

__all__ = ["Swapper", "check_policy", "default_max_host_bytes"]

MiB = 1 << 20
_STOP = object()


def default_max_host_bytes(fraction: float = 0.5) -> int:
    """A fraction of the host memory available now (8 GiB when it cannot be read)."""
    try:
        return int(fraction * os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def _dense_permutation(t: torch.Tensor) -> list[int] | None:
    """A permutation p with t.permute(p) contiguous (same memory, no copy), or
    None when t is not dense (overlapping or with gaps). Restoring through the
    inverse permutation gives back t's strides (channels_last stays so)."""
    if t.is_contiguous():
        return list(range(t.dim()))
    perm = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))
    return perm if t.permute(perm).is_contiguous() else None


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def _version_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor that shares t's version counter but not its memory: in-place
    changes to t (or any view of it) stay visible after t itself is gone."""
    alias = t.detach()
    with torch.autograd._unsafe_preserve_version_counter(alias):
        alias.set_()
    return alias


def _modified_error(what: str, saved: int, now: int) -> RuntimeError:
    return RuntimeError(
        f"one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: {what} is at version {now}; expected version {saved} instead. (cswap keeps "
        f"autograd's check: do not modify a tensor in place after autograd saved it.)")


class _Kept:
    """A saved tensor left in place (not a candidate): a detached alias, which
    avoids the reference cycle output -> grad_fn -> saved output, and its version."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor):
        self.tensor = t.detach()
        self.version = t._version


class _Pass:
    """The items offloaded during one forward pass, in pack order."""

    __slots__ = ("items", "__weakref__")

    def __init__(self):
        self.items: list[_Item] = []


class _Item:
    """One offloaded tensor (one storage), shared by every save of it."""

    def __init__(self, t: torch.Tensor, info: SwapInfo, codec: str | None, perm, pass_: _Pass):
        self.info = info
        self.key = info.key
        self.codec = codec
        self.src: torch.Tensor | None = t          # strong until the copy is done
        self.weak = weakref.ref(t)                 # identity, for dedup
        self.version = t._version
        self.version_alias = _version_alias(t)
        self.perm = perm                           # None: restored contiguous
        self.pass_ = pass_
        self.index = len(pass_.items)
        self.host: torch.Tensor | None = None      # host buffer (from the pool)
        self.header = None                         # Compressed header when compressed
        self.host_blob = None                      # vdnnpp: the host copy, compressed on the CPU
        self.busy = False                          # a restore is reading `host` (vdnnpp must wait)
        self.moved = 0                             # bytes in the host buffer
        self.ready = None                          # CUDA event on the compute stream at pack
        self.d2h_done = None                       # CUDA event: host copy complete
        self.issued = threading.Event()            # the worker has processed it
        self.fallback: torch.Tensor | None = None  # offload failed: the tensor itself
        self.restored: torch.Tensor | None = None
        self.h2d_done = None                       # CUDA event: restore complete
        self.expected_sum = None                   # checksum of the bytes sent (host int64), checksum=True
        self.pending = None                        # host int64 [decoder bad, checksum] of the restore, unread
        self.error: CorruptDataError | None = None  # a prefetch found the host copy corrupt
        self.last_read = None                      # the latest copy reading `host`
        self.stashed = False                       # counted in the stash limit
        self.handles = 0                           # live saves (handles) of it
        self.unpacked = 0                          # of those, served in this round
        self.round = 0                             # one round = one backward's use
        self.freed = False


class _Handle:
    """What autograd stores for an offloaded save; frees the item with the last one.
    `view` = (size, stride, offset): the save was a view of the item's tensor."""

    __slots__ = ("item", "swapper", "view", "served_round")

    def __init__(self, item: _Item, swapper: "Swapper", view=None):
        self.item = item
        self.swapper = swapper
        self.view = view
        self.served_round = -1
        with swapper._lock:
            item.handles += 1

    def __del__(self):
        try:
            self.swapper._drop_handle(self)
        except Exception:  # never raise from a finalizer (interpreter shutdown)
            pass


def _work(swapper_ref, jobs: queue.SimpleQueue) -> None:
    """The offload worker: issue queued items; when idle, release finished copies."""
    while True:
        swapper = swapper_ref()
        busy = swapper is not None and bool(swapper._inflight)
        del swapper  # no strong reference while blocked on the queue
        try:
            item = jobs.get(timeout=0.01 if busy else None)
        except queue.Empty:
            item = None
        swapper = swapper_ref()
        if item is _STOP or swapper is None:
            return
        try:
            if item is None:
                swapper._release_finished(wait_oldest=True)
            else:
                swapper._issue(item)  # never raises; sets item.issued
                swapper._release_finished()
        except Exception as exc:  # keep serving: unpack waits on items this thread issues
            swapper._warn_once("worker", f"cswap: offload worker error ({type(exc).__name__}: {exc})")
        del swapper


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A small tensor's value on the host: asynchronously (into pinned memory) from CUDA;
    read it only after the current stream's next recorded event has completed."""
    return t.to("cpu", non_blocking=True) if t.is_cuda else t


def _check_codec_configs(configs) -> None:
    from .kernels.launch import LaunchConfig

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
    every candidate), "cswap" (policy(info) -> codec name or None), "vdnnpp"
    (offload uncompressed, then ZVC-compress on the host with CPU threads to
    shrink the pinned footprint, and decompress on the host before the
    prefetch: vDNN++ as the CSWAP paper emulates it), "save_on_cpu" (the
    caller installs PyTorch's save_on_cpu instead of these hooks: a baseline).
    """

    MODES = ("none", "vdnn", "sc", "cswap", "vdnnpp", "save_on_cpu")

    def __init__(self, mode: str | None = None, policy: Callable[[SwapInfo], str | None] | None = None, *,
                 candidates: str = "sparse", min_bytes: int | None = None, stash_bytes: int = 4 << 30,
                 prefetch_bytes: int = 256 * MiB, max_host_bytes: int | None = None, pin_memory: bool = True,
                 codec_configs: dict | None = None, asynchronous: bool | None = None, checksum: bool = False,
                 layer=None, observer=None):
        if mode is None:
            mode = "vdnn" if policy is None else "cswap"
        if mode not in self.MODES:
            raise ValueError(f"cswap: mode must be one of {self.MODES}, got {mode!r}")
        check_policy(mode, policy)
        if mode == "cswap" and policy is None:
            raise ValueError("cswap: mode='cswap' needs policy=callable(info) -> codec name or None")
        if candidates not in ("sparse", "all"):
            raise ValueError(f"cswap: candidates must be 'sparse' (ReLU and pooling outputs) or 'all' "
                             f"(every saved activation), got {candidates!r}")
        for name, value in (("min_bytes", min_bytes), ("stash_bytes", stash_bytes),
                            ("prefetch_bytes", prefetch_bytes), ("max_host_bytes", max_host_bytes)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"cswap: {name} must be a non-negative int of bytes, got {value!r}")
        for name, value in (("pin_memory", pin_memory), ("checksum", checksum)):
            if not isinstance(value, bool):
                raise TypeError(f"cswap: {name} must be True or False, got {value!r}")
        if asynchronous is not None and not isinstance(asynchronous, bool):
            raise TypeError(f"cswap: asynchronous must be None (threaded on CUDA only), True or False, "
                            f"got {asynchronous!r}")
        _check_codec_configs(codec_configs)
        self.mode = mode
        self.policy = policy
        self.candidates = candidates
        self.min_bytes = min_bytes
        self.stash_bytes = stash_bytes
        self.prefetch_bytes = prefetch_bytes
        self.codec_configs = dict(codec_configs or {})
        self.asynchronous = asynchronous
        self.checksum = checksum
        self.layer = layer or (lambda: ("", ""))
        self.observer = observer  # a TensorProfiler (begin_pass, on_pack, end_forward, on_unpack), or None
        self.pool = HostPool(default_max_host_bytes() if max_host_bytes is None else max_host_bytes, pin_memory)
        self.stats = SwapStats(self)
        self._lock = threading.RLock()
        self._stash_cv = threading.Condition(self._lock)
        self._inflight: list[_Item] = []   # issued, copy maybe running, src still held
        self._stash_bytes = 0              # bytes of items queued or in flight
        self._pass: _Pass | None = None
        self._seen: dict[int, tuple[weakref.ref, int, _Item]] = {}
        self._streams: dict[torch.device, tuple] = {}
        self._queue: queue.SimpleQueue | None = None
        self._worker: threading.Thread | None = None
        self._warned: set[str] = set()
        self._host_threads = None  # vdnnpp's CPU compression pool, made on first use

    # -- passes -------------------------------------------------------------------------

    def begin_pass(self) -> None:
        """A new forward pass: new pack order, new dedup table."""
        self._pass = _Pass()
        self._seen.clear()
        self._release_finished()
        if self.observer is not None:
            self.observer.begin_pass()

    def end_pass(self) -> None:
        self._seen.clear()
        if self.observer is not None:
            self.observer.end_forward()

    # -- pack -------------------------------------------------------------------------

    def pack(self, t: torch.Tensor):
        op = None if self.mode in ("none", "save_on_cpu") else self._candidate_op(t, sys._getframe(1))
        if op is None:
            return _Kept(t)
        shared = self._already_offloaded(t)
        if shared is not None:
            self.stats.add("deduplicated")
            return shared
        if self._pass is None:
            self._pass = _Pass()
        perm = _dense_permutation(t)
        layer, layer_type = self.layer()
        info = SwapInfo(op=op, shape=tuple(t.shape), dtype=t.dtype,
                        nbytes=t.numel() * t.element_size(), device=t.device, layer=layer,
                        layer_type=layer_type, index=len(self._pass.items))
        codec = self._choose_codec(info)
        item = _Item(t, info, codec, perm, self._pass)
        if not self._start_offload(item, t):
            return _Kept(t)
        self._pass.items.append(item)
        self._seen[id(t)] = (item.weak, item.version, item)
        if self.observer is not None:
            self.observer.on_pack(item.key, t, info)
        return _Handle(item, self)

    def _already_offloaded(self, t: torch.Tensor) -> _Handle | None:
        """A handle on this pass's item for `t`, or for the tensor `t` is a view of
        (a flatten after pooling): the same bytes are never sent twice."""
        entry = self._seen.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t._version and not entry[2].freed:
            return _Handle(entry[2], self)
        base = t._base if t._is_view() else None
        entry = self._seen.get(id(base)) if base is not None else None
        if entry is not None and entry[0]() is base and entry[1] == t._version and not entry[2].freed \
                and entry[2].perm is not None:
            # The restored base has the original strides from storage offset 0.
            view = (tuple(t.shape), t.stride(), t.storage_offset() - base.storage_offset())
            return _Handle(entry[2], self, view)
        return None

    def _candidate_op(self, t: torch.Tensor, caller) -> str | None:
        """The op that produced `t` when `t` is to be offloaded, else None. `caller`:
        the frame that saved it (a compiled graph's saves count whatever `candidates`
        says: the graph hides which op made them)."""
        if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter) or t.is_sparse \
                or t.layout != torch.strided or t.device.type == "meta" or t.numel() == 0:
            return None
        if t.dtype.itemsize not in (1, 2, 4, 8) or t.is_complex():
            return None
        floor = self.min_bytes if self.min_bytes is not None else (MiB if t.is_cuda else 0)
        if t.numel() * t.element_size() < floor:
            return None
        if not is_activation(t):
            # A compiled backward may assert its saved tensors' strides: only dense
            # ones, which come back with the same strides, leave the device.
            compiled = saved_by_compiled_graph(t, caller) and _dense_permutation(t) is not None
            return COMPILED_GRAPH if compiled else None
        name = producer(t)
        return op_name(name or "") if self.candidates == "all" or name in SPARSE_PRODUCERS else None

    def _choose_codec(self, info: SwapInfo) -> str | None:
        if self.mode in ("vdnn", "vdnnpp"):  # vdnnpp compresses on the host, after the transfer
            return None
        if self.mode == "sc":
            return "zvc"
        codec = self.policy(info)
        if codec is not None and codec not in codecs.names():
            raise ValueError(f"cswap: policy returned {codec!r} for {info.where}; expected None or one of "
                             f"{', '.join(codecs.names())}")
        return codec

    def _start_offload(self, item: _Item, t: torch.Tensor) -> bool:
        """Hand the item to the offload path; False when it must stay in place."""
        if t.is_cuda:
            stream = torch.cuda.current_stream(t.device)
            item.ready = stream.record_event()
        else:
            item.ready = None
            self._warn_once("cpu", "cswap: offloading CPU tensors to host memory saves no memory; cswap "
                                   "runs its full pipeline on CPU only for testing and development")
        if not self._asynchronous(t):
            self._issue(item)
            self._release_finished(wait_oldest=t.is_cuda)
            return item.fallback is None
        with self._lock:
            while self._stash_bytes + item.info.nbytes > self.stash_bytes and self._stash_bytes > 0:
                start = time.perf_counter()
                self._stash_cv.wait(timeout=0.05)
                self.stats.add("offload_stall_s", time.perf_counter() - start)
                self._release_finished_locked()
            self._stash_bytes += item.info.nbytes
            item.stashed = True
        self._ensure_worker().put(item)
        return True

    def _asynchronous(self, t: torch.Tensor) -> bool:
        return t.is_cuda if self.asynchronous is None else self.asynchronous

    # -- the offload itself (worker thread, or inline) -------------------------------------

    def _ensure_worker(self) -> queue.SimpleQueue:
        if self._worker is None or not self._worker.is_alive():
            self._queue = queue.SimpleQueue()
            # The worker holds the swapper weakly and stops when it is collected.
            self._worker = threading.Thread(target=_work, args=(weakref.ref(self), self._queue),
                                            name="cswap-offload", daemon=True)
            weakref.finalize(self, self._queue.put, _STOP)
            self._worker.start()
        return self._queue

    def _issue(self, item: _Item) -> None:
        """Compress (maybe) and copy to a host buffer; never raises: on failure the
        item keeps its tensor (fallback) and backward uses it as stock autograd would."""
        t = item.src
        try:
            if t.is_cuda:
                with torch.cuda.device(t.device):
                    d2h = self._stream_pair(t.device)[0]
                    with torch.cuda.stream(d2h):
                        d2h.wait_event(item.ready)
                        self._copy_out(item, t, non_blocking=True)
                        item.d2h_done = d2h.record_event()
            else:
                self._copy_out(item, t, non_blocking=False)
        except Exception as exc:  # offload failed: keep the tensor, warn once, train on
            item.fallback = t.detach()  # detached: no cycle tensor -> grad_fn -> handle -> item
            self.stats.add("kept_on_gpu")
            self._warn_once("offload", f"cswap: offloading {item.info.where} failed ({type(exc).__name__}: "
                                       f"{exc}); such tensors stay on the device")
        finally:
            with self._lock:
                self._inflight.append(item)
                if item.freed and item.host is not None:  # every save died meanwhile
                    self.pool.release(item.host, item.d2h_done)
                    item.host = None
                item.issued.set()  # under the lock, so _drop_handle sees host and issued agree

    def _copy_out(self, item: _Item, t: torch.Tensor, non_blocking: bool) -> None:
        src = t.permute(item.perm) if item.perm is not None else t.contiguous()
        raw = item.info.nbytes
        data, header = _flat_bytes(src), None
        if item.codec is not None:
            blob = codecs.get(item.codec).compress(src, config=self.codec_configs.get(item.codec))
            if blob.nbytes < raw:  # compression that does not shrink is not sent
                data, header = blob.data, blob._header
        with self._lock:
            if item.freed:  # every save died before the copy: nothing to keep
                return
            host = self.pool.acquire(data.numel())
            item.host = host  # under the lock: _drop_handle returns it if the item dies now
        if host is None:  # host memory limit: the tensor stays where it is
            item.fallback = t.detach()
            self.stats.add("kept_on_gpu")
            return
        if self.checksum:  # of the bytes sent, before they leave the device
            item.expected_sum = _to_host(integrity.checksum(data))
        host[: data.numel()].copy_(data, non_blocking=non_blocking)
        item.header, item.moved = header, data.numel()
        self.stats.add("offloaded_tensors")
        self.stats.add("offloaded_bytes", raw)
        self.stats.add("transferred_bytes", item.moved)
        if header is not None:
            self.stats.add("compressed_tensors")

    def _release_finished(self, wait_oldest: bool = False) -> None:
        """Drop the saved tensors whose host copy has completed (in issue order);
        wait_oldest: first block (outside the lock) until the oldest copy is done."""
        if wait_oldest:
            with self._lock:
                done = self._inflight[0].d2h_done if self._inflight else None
            if done is not None:
                done.synchronize()
        with self._lock:
            self._release_finished_locked()

    def _release_finished_locked(self) -> None:
        while self._inflight:
            item = self._inflight[0]
            if item.d2h_done is not None and not item.d2h_done.query():
                return
            self._inflight.pop(0)
            self._settle(item)
        self._stash_cv.notify_all()

    def _settle(self, item: _Item) -> None:
        """The copy is done: drop the tensor (its memory is released now)."""
        item.src = None
        if item.stashed:
            item.stashed = False
            self._stash_bytes -= item.info.nbytes
        if self.mode == "vdnnpp" and item.host is not None and item.header is None and not item.freed:
            if self._host_threads is None:
                from concurrent.futures import ThreadPoolExecutor

                self._host_threads = ThreadPoolExecutor(max(1, (os.cpu_count() or 2) // 2),
                                                        thread_name_prefix="cswap-host-zvc")
            self._host_threads.submit(self._host_compress, item, item.host)

    def _host_compress(self, item: _Item, host: torch.Tensor) -> None:
        """vdnnpp: ZVC the host copy on the CPU and give the pinned buffer back."""
        try:
            words = host[: item.moved].view(item.info.dtype)
            blob = codecs.get("zvc").compress(words, backend="torch")
        except Exception as exc:  # the pinned copy stays; nothing is lost
            self._warn_once("host-zvc", f"cswap: host compression failed ({type(exc).__name__}: {exc})")
            return
        with self._lock:
            if item.host is not host or item.freed or item.busy or blob.nbytes >= item.moved:
                return
            item.host_blob, item.host = blob, None
            self.pool.release(host, item.last_read or item.d2h_done)
        self.stats.add("host_compressed_tensors")

    # -- unpack ---------------------------------------------------------------------------

    def unpack(self, packed):
        if isinstance(packed, _Kept):
            t = packed.tensor
            if t._version != packed.version:
                raise _modified_error(f"[{t.dtype} {list(t.shape)}]", packed.version, t._version)
            return t
        item = packed.item
        self._check_version(item)
        if self.observer is not None:
            self.observer.on_unpack(item.key)
        self._release_finished()  # settle finished offloads early (frees their GPU tensors)
        out = self._unpack_item(item, packed)
        return out if packed.view is None else out.as_strided(*packed.view)

    def _unpack_item(self, item: _Item, handle: _Handle) -> torch.Tensor:
        if item.error is not None:  # a prefetch found its host copy corrupt
            raise item.error
        if item.restored is None:  # not prefetched: backward waits for this copy
            start = time.perf_counter()
            if self._restore_on_demand(item):
                self.stats.add("on_demand")
            if item.h2d_done is not None:
                item.h2d_done.synchronize()
            self.stats.add("prefetch_stall_s", time.perf_counter() - start)
        self._verify(item)
        if item.h2d_done is not None:  # compute waits for its own item only
            torch.cuda.current_stream(item.info.device).wait_event(item.h2d_done)
        out = item.restored
        with self._lock:
            first, round_ = item.unpacked == 0, item.round
            if handle.served_round != item.round:
                handle.served_round = item.round
                item.unpacked += 1
            self._end_round_if_served(item)
        if first:
            self._prefetch(item, round_)
        return out

    def _end_round_if_served(self, item: _Item) -> None:
        """Every live save of the item was unpacked: drop the restored tensor (backward
        owns it now); a later backward (retain_graph) restores it again."""
        if item.handles > 0 and item.unpacked >= item.handles:
            item.round += 1
            item.unpacked = 0
            item.restored = None
            item.h2d_done = None

    def _check_version(self, item: _Item) -> None:
        now = item.version_alias._version
        if now != item.version:
            raise _modified_error(f"[{item.info.dtype} {list(item.info.shape)}], saved by {item.info.where} as "
                                  f"output of {item.info.op},", item.version, now)

    def _prefetch(self, item: _Item, round_: int) -> None:
        """Start restoring the items backward will want next, up to prefetch_bytes of
        them (at least the next one; prefetch_bytes=0 turns prefetch off), skipping
        those already served in this backward (round_: item's round in it). Eager
        backward unpacks in reverse pack order; a compiled graph's backward unpacks
        its saved tensors in forward order: the direction follows what was served."""
        items = item.pass_.items
        before = items[item.index - 1] if item.index > 0 else None
        ascending = before is not None and not before.freed and before.round != round_
        order = range(item.index + 1, len(items)) if ascending else range(item.index - 1, -1, -1)
        budget = self.prefetch_bytes
        for n, j in enumerate(order):
            if budget <= 0:
                break
            other = items[j]
            if other.freed or other.round != round_:  # gone, or already served in this backward
                continue
            if other.restored is None and other.error is None:
                if budget < other.info.nbytes and n > 0:
                    break
                try:
                    if self._restore(other):
                        self.stats.add("prefetched")
                except torch.OutOfMemoryError:  # no room now: backward fetches it on demand
                    self.stats.add("prefetch_oom")
                    break
                except CorruptDataError as exc:  # raised when backward reaches that item
                    other.error = exc
            budget -= other.info.nbytes

    def _restore_on_demand(self, item: _Item) -> bool:
        """`_restore`, and when the GPU is out of memory: wait for the device's pending
        frees and retry; then give back prefetched restores backward has not used
        yet (their host copies stay) and retry; only then raise."""
        for attempt in range(3):
            try:
                return self._restore(item)
            except torch.OutOfMemoryError as exc:
                if attempt == 2:
                    raise torch.OutOfMemoryError(
                        f"cswap: restoring the {item.info.nbytes / MiB:.1f} MiB {item.info.op} output of "
                        f"{item.info.where} for backward ran out of GPU memory, even after waiting for "
                        f"pending frees and giving back prefetched tensors; its host copy is kept. Lower "
                        f"prefetch_bytes or the batch size ({exc})") from exc
                self.stats.add("oom_retries")
                if attempt == 1:
                    self._drop_unused_prefetches(item)
                if item.info.device.type == "cuda":
                    torch.cuda.synchronize(item.info.device)  # blocks freed on other streams become reusable
        raise AssertionError("unreachable")

    def _drop_unused_prefetches(self, keep: _Item) -> None:
        for other in keep.pass_.items:
            if other is not keep and other.restored is not None and other.unpacked == 0 \
                    and other.fallback is None:
                other.restored = other.h2d_done = other.pending = None

    def _restore(self, item: _Item) -> bool:
        """Bring the item back (asynchronously on CUDA) into item.restored; False
        when its offload had failed and the tensor itself serves."""
        item.issued.wait()
        if item.fallback is not None:
            item.restored = item.fallback
            return False
        device = item.info.device
        try:
            if device.type == "cuda":
                with torch.cuda.device(device):
                    h2d = self._stream_pair(device)[1]
                    with torch.cuda.stream(h2d):
                        h2d.wait_event(item.d2h_done)
                        y = self._copy_in(item, device, non_blocking=True)
                        item.h2d_done = item.last_read = h2d.record_event()
                y.record_stream(torch.cuda.current_stream(device))  # allocated on h2d, used on compute
            else:
                y = self._copy_in(item, device, non_blocking=False)
        finally:
            item.busy = False
        item.restored = y
        self.stats.add("restored_tensors")
        return True

    def _copy_in(self, item: _Item, device: torch.device, non_blocking: bool) -> torch.Tensor:
        info = item.info
        shape = [info.shape[p] for p in item.perm] if item.perm is not None else list(info.shape)
        with self._lock:
            blob = item.host_blob
            if blob is None:
                host = item.host[: item.moved]
                item.busy = True  # vdnnpp's host compression leaves this buffer alone for now
        if blob is not None:  # vdnnpp: decompress on the CPU, then copy up through a pinned buffer
            try:
                raw = _flat_bytes(codecs.get("zvc").decompress(blob, backend="torch"))
            except CorruptDataError as exc:
                raise self._corrupt(item, str(exc)) from exc
            self._expect(item, None, raw)
            if device.type == "cpu":
                return self._reshape(item, raw.view(info.dtype).reshape(shape))
            with self._lock:
                staging = self.pool.acquire(raw.numel())
            host = raw if staging is None else staging[: raw.numel()].copy_(raw)
            y = torch.empty(shape, dtype=info.dtype, device=device)
            _flat_bytes(y).copy_(host, non_blocking=non_blocking)
            if staging is not None:
                done = torch.cuda.current_stream(device).record_event()
                with self._lock:
                    self.pool.release(staging, done)
            return self._reshape(item, y)
        if item.header is not None:
            self._check_header(item, host)
            data = host.to(device, non_blocking=non_blocking)
            y, verdict = codecs.get(item.codec).decompress_deferred(Compressed(data, item.header),
                                                                   config=self.codec_configs.get(item.codec))
            self._expect(item, verdict.bad, data)
        else:
            y = torch.empty(shape, dtype=info.dtype, device=device)
            _flat_bytes(y).copy_(host, non_blocking=non_blocking)
            self._expect(item, None, _flat_bytes(y))
        return self._reshape(item, y)

    # -- integrity ------------------------------------------------------------------------

    def _check_header(self, item: _Item, host: torch.Tensor) -> None:
        """The host copy's header must be the one written (read on the CPU, before any kernel)."""
        if item.d2h_done is not None:
            item.d2h_done.synchronize()  # the copy out has landed in `host`
        try:
            header = unpack_header(lambda n: host[:n].numpy().tobytes(), host.numel())
            problem = None if header == item.header else "its header differs from the one written"
        except CorruptDataError as exc:
            problem = str(exc)
        if problem is not None:
            raise self._corrupt(item, problem)

    def _expect(self, item: _Item, bad: torch.Tensor | None, data: torch.Tensor) -> None:
        """Queue this restore's verdicts (decoder flag, checksum of the bytes that came
        back) for _verify; on CUDA they reach the host with the restore itself."""
        if bad is None and not self.checksum:
            return
        flags = torch.zeros(2, dtype=torch.int64, device=data.device)
        if bad is not None:
            flags[0] = bad
        if self.checksum:
            flags[1] = integrity.checksum(data)
        item.pending = _to_host(flags)

    def _verify(self, item: _Item) -> None:
        """Read the restore's verdicts (after its own copy in) and raise on a corrupt copy."""
        flags, item.pending = item.pending, None
        if flags is None:
            return
        if item.h2d_done is not None:
            item.h2d_done.synchronize()
        bad, total = flags.tolist()
        if bad:
            raise self._corrupt(item, self._diagnose(item))
        if self.checksum and item.expected_sum is not None and total != int(item.expected_sum):
            raise self._corrupt(item, "its checksum differs from the one taken before the offload")

    def _diagnose(self, item: _Item) -> str:
        """The decoder's own words on what is wrong, from decoding the host copy on the CPU."""
        try:
            blob = Compressed(item.host[: item.moved], item.header)
            codecs.get(item.codec).decompress(blob, backend="torch")
        except CorruptDataError as exc:
            return str(exc)
        return "the decoder found it inconsistent on the device while the host copy decodes cleanly " \
               "(it was altered on the way in)"

    def _corrupt(self, item: _Item, problem: str) -> CorruptDataError:
        info = item.info
        hint = "" if self.checksum else " checksum=True (cswap.patch option) checks every byte end to end."
        return CorruptDataError(
            f"cswap: the offloaded copy of the {info.op} output of {info.where} "
            f"[{str(info.dtype).removeprefix('torch.')} {list(info.shape)}] is corrupt: {problem}. Backward "
            f"stops here rather than compute gradients from wrong values; the host memory or the PCIe link altered it (check the machine: ECC "
            f"errors, dmesg).{hint}")

    @staticmethod
    def _reshape(item: _Item, y: torch.Tensor) -> torch.Tensor:
        """Back to the saved tensor's strides (see _dense_permutation)."""
        return y.permute(_inverse(item.perm)) if item.perm is not None else y

    # -- lifetime ---------------------------------------------------------------------------

    def _drop_handle(self, handle: _Handle) -> None:
        item = handle.item
        with self._lock:  # handles die in whichever thread the garbage collector runs
            item.handles -= 1
            if handle.served_round == item.round:  # it was counted in this round
                item.unpacked -= 1
            if item.handles > 0:
                self._end_round_if_served(item)
                return
            if item.freed:
                return
            item.freed = True
            item.restored = None
            item.fallback = None
            item.host_blob = None
            # Not yet issued: the worker may be copying into the buffer; it returns it.
            if item.host is not None and item.issued.is_set():
                host, item.host = item.host, None
                self.pool.release(host, item.last_read or item.d2h_done)

    def _stream_pair(self, device: torch.device):
        pair = self._streams.get(device)
        if pair is None:
            pair = (torch.cuda.Stream(device), torch.cuda.Stream(device))
            self._streams[device] = pair
        return pair

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def synchronize(self) -> None:
        """Wait until every queued offload has been issued and its copy has completed."""
        while True:
            with self._lock:
                queued = self._stash_bytes > 0 and not self._inflight
                if not self._inflight and not queued:
                    return
            if queued:  # the worker has not issued it yet
                time.sleep(0.001)
            self._release_finished(wait_oldest=True)

    def trim_host_pool(self) -> int:
        """Give back host buffers unused since the last call (at each epoch end)."""
        with self._lock:
            return self.pool.trim_idle()

    def close(self) -> None:
        """Finish queued offloads, stop the worker, drop idle host buffers."""
        self.synchronize()
        if self._worker is not None and self._worker.is_alive():
            self._queue.put(_STOP)
            self._worker.join()
        self._worker = None
        if self._host_threads is not None:
            self._host_threads.shutdown(wait=True)
            self._host_threads = None
        with self._lock:
            self.pool.clear()

    # -- stats ------------------------------------------------------------------------------

    def on_stats_reset(self) -> None:
        self.pool.peak_reserved_bytes = self.pool.reserved_bytes
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def live_stat(self, name: str):
        if name == "host_pool_bytes":
            return self.pool.reserved_bytes
        if name == "peak_host_pool_bytes":
            return self.pool.peak_reserved_bytes
        return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
