"""Copy out and release: an offloaded tensor's journey after pack.

Stages, each on its own thread and stream (cswap.runtime.lanes has the streams and
every wait between them):

  pack      (training thread) admits the item (Swapper), records `ready` on compute
            and either sends a dense raw tensor itself (below) or queues it for:
  encode    (worker) queues on the codec stream, after `ready`, the codec's
            encode (Codec.launch_into: into a device buffer reserved for the largest
            payload, or, for a bounded codec (ZVC, ZANS), for an eighth (at least
            64 KiB) more than the tensor's payload in the pass before; its sizes left
            on the device and copied to a small pinned slot). Where a bounded codec's
            room was sized from the pass before, as many bytes as that pass's payload
            are copied out right behind the encode (_copy_early), into a host buffer with
            the header's place left free: the link does not wait for the sender's Python.
            Every item is a dense tensor (one that is not leaves as the dense tensor it views, or as the span
            of memory it covers: Swapper._dense_whole). Nothing is read back, so the
            next tensor's encode is queued at once, while this one's runs and the one
            before it is copied out. A codec whose encoder must size its buffer on the
            host (RLE and CSR today), and ZVC's first pass (no payload to size its
            room from), are left to the next stage whole.
  send      (sender) takes the items in order. For a launched encode it waits for its
            sizes to land (the one blocking read, on this thread only), makes the
            header, takes a host buffer from the pool (allocating outside any lock pack
            takes), writes the header there on the host and queues the copy out on D2H
            after the encode (or, copied early, writes the header in front of what the
            copy brings and copies what the payload grew beyond it, or drops that copy
            where the payload outgrew its room or does not shrink); for a deferred
            codec it first runs the encode, waiting for it. The item is then ISSUED (d2h_done).
  release   once its copy out has completed, the tensor's device memory goes (and the
            reserved payload's): at the training thread's next save while forward
            runs (one event query each, oldest first: D2H completes them in order),
            by the releaser thread after it, which waits for each without polling,
            and under a memory budget at once (the plan counts on memory going the
            moment a copy completes). A copy already complete when issued (a device
            whose work completes at once) is released there and then; pack with the
            stash full, or over a memory budget, waits for the oldest and releases it.

Tensors sent raw skip the worker: consecutive such saves form a group (at most
GROUP_TENSORS tensors and half the stash limit's bytes), sent when full with one
ready event, one copy call on D2H into one pooled host buffer and one completion
event shared by its items. Pack sends it itself when the pool has an idle buffer,
or an idle buffer for each of its tensors (the ones the first, timed step took,
sending each alone: then the worker pins one of the group's size as forward ends,
for the next step); else the worker allocates one and sends it. Whatever
must wait for one of its items (the stash limit, synchronize, a restore during
forward), forward's end and a save that goes another way send the open group
first. The profiled pass, a memory budget (each tensor's own copy counted) and
vdnnpp (each host copy compressed on its own) send a raw tensor alone.

Failures. What is expected is handled: an encode that runs out of device memory
sends the tensor raw (compress_oom); a full host pool keeps it on the device
(kept_on_gpu). Anything else (a codec bug, a failed copy) is recorded on the item
and the swapper and raised in the training step at the next pack or unpack. The threads catch everything, and a thread that stops
anyway first fails what waits on it, so nothing waits forever.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import queue
import threading
import weakref

import torch

from .. import codecs
from ..codecs.container import header_size
from . import integrity
from .device import Work
from .host_pool import idle
from .items import Item, Lease, Phase, Signal, drop_storage
from .lanes import lanes_of
from .trace import stage

__all__ = ["Offloader"]

_STOP = object()
GROUP_TENSORS = 16  # raw copies out queued together: at most this many (and half the stash limit's bytes)
_SLOT_ALIGN = 256   # a group's tensors start 256-byte aligned in its host buffer, as CUDA's allocations do
_TAIL = 24  # after the data, 8-byte aligned: the checksum of the bytes sent, then the restore's verdict (2 x int64)
SLOT, SLOTS = 64, 256  # the pinned slots encodes' sizes are read back into: bytes each, and per block


def tail_offset(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


class _Jobs:
    """A stage's queue; closed when its thread stops, so that nothing is put where no one
    will take it (a closed queue refuses, and the caller starts new threads)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._open = True

    def put(self, job) -> bool:
        with self._lock:
            if self._open:
                self._queue.put(job)
            return self._open

    def get(self):
        return self._queue.get()

    def close(self) -> list:
        """Refuse new jobs; the ones still queued."""
        with self._lock:
            self._open = False
            left = []
            while True:
                try:
                    left.append(self._queue.get_nowait())
                except queue.Empty:
                    return left


def _run_stage(swapper_ref, jobs: _Jobs, stage: str, after: _Jobs | None, done: queue.SimpleQueue) -> None:
    """A stage's thread: the worker ("encode") or the sender ("send"), each job in order.
    Whatever is left when it stops (or dies) fails, so that nothing waits on it forever."""
    job = None
    try:
        while True:
            job = jobs.get()
            if job is _STOP:
                if after is not None:  # (the sender stops after what the worker gave it)
                    after.put(_STOP)
                return
            swapper = swapper_ref()
            if swapper is None:
                return
            getattr(swapper.offloader, stage)(job)
            job = swapper = None
    finally:
        left = [job] if job is not None and job is not _STOP else []
        left += [j for j in jobs.close() if j is not _STOP]
        if after is not None:  # (the sender sends what it was given, then stops)
            after.put(_STOP)
        _strand(swapper_ref, left, stage, done)


def _strand(swapper_ref, left: list, stage: str, done: queue.SimpleQueue) -> None:
    """Jobs no thread of `stage` will run: fail their items (the training step raises at its
    next pack or unpack), hand them to the releaser, and end what waits on them."""
    stranded = [it for j in left for it in (j.items if type(j) in (_Group, _Pin) else [j])
                if not it.issued.is_set()]
    for j in left:
        if type(j) is _Pin:
            j.done.set()  # (nothing to fail: only buffers ahead of need)
    swapper = swapper_ref()
    for it in stranded:
        stopped = RuntimeError(f"cswap: the offload thread ({stage}) stopped before copying this tensor")
        if swapper is not None:
            swapper.offloader._drop_early(it)
            swapper.fail(stopped, it)
            with swapper.lock:
                it.failure = it.failure or stopped
                it.advance(Phase.ISSUED, signal=False)  # (a group's signal once all of it has failed)
        else:
            it.failure = it.failure or stopped
    for it in stranded:
        it.issued.set()
        done.put(it)


def _release(swapper_ref, done: queue.SimpleQueue) -> None:
    """The releaser: drop each item's tensor once its copy out has completed."""
    while True:
        item = done.get()
        if item is _STOP:
            return
        swapper = swapper_ref()
        if swapper is None:
            return
        swapper.offloader.finish(item)
        item = swapper = None


class _Pin:
    """Host buffers to pin on the worker and leave idle in the pool, one per group this
    forward sent into the buffers its tensors had alone (Offloader.flush): the next step's
    groups take one buffer each again. Queued at forward's end, after its encodes."""

    __slots__ = ("buffers", "done")
    items = ()

    def __init__(self, buffers: list[tuple[int, object]]):
        self.buffers = buffers  # (bytes, device)
        self.done = Signal()    # (set once pinned, or once its worker stopped without it)


class _Group:
    """Raw copies out sent together into one host buffer: the items, the dense tensors
    to send and where each goes in the buffer."""

    __slots__ = ("device", "stream", "max_bytes", "issued", "ready", "items", "srcs", "offsets", "nbytes", "size")

    def __init__(self, device, stream, max_bytes: int):
        self.device, self.stream, self.max_bytes = device, stream, max_bytes
        self.issued = Signal()  # the items' `issued`: set once their copies are queued
        self.ready = None                # recorded on compute when the group is sent
        self.items, self.srcs, self.offsets = [], [], []
        self.nbytes = 0                  # the tensors' bytes
        self.size = 0                    # the host buffer's, each tensor from a _SLOT_ALIGN boundary


class _Slots:
    """A pooled host buffer of SLOTS SLOT-byte slots (Offloader._slot), each cut when taken:
    the buffer goes back to the pool whenever all its slots are back, about once an encode
    in forward, and cutting every slot up front took the worker 256 tensor views a time (half
    of the H200's encodes in the profiled sc steps, 1.5 ms each there)."""

    __slots__ = ("buffer", "free", "out", "last_copy")

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.free = [(i, None) for i in range(SLOTS)]  # (slot index, the last copy into it)
        self.out = 0
        self.last_copy = None

    def take(self, dev) -> torch.Tensor | None:
        for k, (i, event) in enumerate(self.free):
            if idle(event, dev):
                del self.free[k]
                self.out += 1
                return self.buffer[i * SLOT: (i + 1) * SLOT]
        return None

    def holds(self, slot: torch.Tensor) -> bool:
        start = self.buffer.data_ptr()
        return start <= slot.data_ptr() < start + self.buffer.numel()

    def put(self, slot: torch.Tensor, last_copy) -> bool:
        """Back; True when it was the last one out (the buffer can go back to the pool)."""
        self.free.append(((slot.data_ptr() - self.buffer.data_ptr()) // SLOT, last_copy))
        self.out -= 1
        if last_copy is not None:
            self.last_copy = last_copy  # (the slots' copies complete in order: the codec stream's)
        return self.out == 0


class Offloader:
    """The copy-out half of a Swapper (see the module docstring)."""

    def __init__(self, swapper):
        self.sw = swapper
        self._group: _Group | None = None  # raw copies out not yet queued (the training thread's)
        self._jobs: _Jobs | None = None    # the worker's
        self._sends: _Jobs | None = None   # the sender's
        self._done: queue.SimpleQueue | None = None  # the releaser's
        self._threads: list[threading.Thread] = []
        self._host_threads = None  # vdnnpp's CPU compression pool, made on first use
        self._host_jobs: list = []  # its futures not seen done yet (the releaser appends, synchronize waits)
        self._slots: dict = {}     # device -> [_Slots]: the buffers encodes' sizes are read back into
        self._pins: list = []      # (bytes, device) of group buffers to pin at forward's end (_Pin)
        self._last_pin: _Pin | None = None  # the last queued (the worker runs them in order)

    # -- pack's part --------------------------------------------------------------------------

    def offload(self, item: Item, grouped: bool) -> None:
        """Start the item's copy out (see the module docstring): a tensor sent raw
        joins the open group (`grouped`), or is copied here when the host pool has an idle
        buffer for it; anything else goes to the worker."""
        sw = self.sw
        if item.codec is None and not sw.checksum and sw.pool.pinned:
            # (from pageable memory a copy blocks its caller until done: the worker's job)
            if grouped:
                self._join(item)  # (which polls when it sends the group)
                return
            host = sw.pool.acquire(item.info.nbytes, item.device, allocate=False)
            if host is not None:
                self.flush()  # (the copy stream completes copies in the order of the stash)
                item.ready = lanes_of(item.device).computed()
                try:
                    with stage("send"):
                        self._send(item, item.dense_src(), None, host, item.ready, prepared=False)
                except Exception as exc:  # noqa: BLE001 - raised in the training step, see module docstring
                    self._failed(item, exc)
                self.settle(item)
                return
        self.flush()
        self.poll()
        item.ready = lanes_of(item.device).computed()
        item.issued = Signal()
        self._running().put_job(item)

    def footprint(self, item: Item) -> int:
        """Device bytes the item holds while in flight out: the tensor, and what is made to
        send it (the room reserved for its payload). Sets item.room."""
        nbytes = item.info.nbytes
        if item.codec is not None:
            item.room = self._room(item)
            return nbytes + (item.room if item.room is not None else nbytes)
        return nbytes

    def _room(self, item: Item) -> int | None:
        """The bytes an encode launched without its size reserves, or None: the sender
        encodes it, reading its size back first (a codec that must; a memory budget, whose
        plan counts each payload at its size). The room is for the largest payload the
        codec can write, or, for a bounded codec, for an eighth (at least 64 KiB) more than
        the same tensor's payload in the pass before (Codec.room_nbytes; scaled by its size
        if that changed).
        A bounded codec's first pass reads sizes back first where that needs less than
        the largest payload's room (ZVC: no pass holds it; ZANS's exact encode goes
        through that room, so it launches into it)."""
        if self.sw.memory_limit is not None:
            return None
        info, codec = item.info, codecs.get(item.codec)
        numel, itemsize = math.prod(info.shape), info.dtype.itemsize
        largest = codec.reserve_nbytes(numel, itemsize)
        if largest is None or not codec.bounded:
            return largest
        payload = self._last_payload(item)
        if payload is None:
            return None if codec.encode_scratch_bytes(numel, itemsize) < largest else largest
        return codec.room_nbytes(numel, itemsize, payload)

    def _last_payload(self, item: Item) -> int | None:
        """The tensor's payload in the pass before with the same codec (scaled by its size if
        that changed), or None."""
        info, last = item.info, self.sw.payload_sizes.get(item.info.key)
        if last is None or last[0] != item.codec or not last[1]:
            return None
        return last[2] if last[1] == info.nbytes else last[2] * info.nbytes // last[1]

    def _remember(self, item: Item, header) -> None:
        """Keep the size of a bounded codec's payload: the next pass's room (_room)."""
        if codecs.get(item.codec).bounded:
            self.sw.payload_sizes[item.key] = (item.codec, item.info.nbytes, header.payload_nbytes)

    # -- groups: raw copies out queued together, into one host buffer -------------------------

    def _join(self, item: Item) -> None:
        """Add the item to the open group (a new one if none is open, or if the item comes
        from another device or compute stream); the group is sent once full."""
        group = self._group
        dev = item.device
        stream = dev.compute_stream()
        if group is not None and (group.device is not dev or group.stream is not stream):
            self.flush()
            group = None
        src = item.dense_src()
        nbytes = item.info.nbytes
        with self.sw.lock:  # (another thread may flush it meanwhile: synchronize)
            if group is None or group is not self._group:
                group = self._group = _Group(dev, stream, max(1, self.sw.stash_limit() // 2))
            item.issued = group.issued
            group.items.append(item)
            group.srcs.append(src)
            group.offsets.append(group.size)
            group.size += -(-nbytes // _SLOT_ALIGN) * _SLOT_ALIGN
            group.nbytes += nbytes
            full = len(group.items) >= GROUP_TENSORS or group.nbytes >= group.max_bytes
        if full:
            self.flush()
            self.poll()  # (once a group: a copy completes per group, not per save)

    def flush(self) -> None:
        """Send the open group: its ready event is recorded on compute now, and its copies
        are queued here into an idle host buffer of the pool, or by the worker, which
        allocates one. Called by whoever needs its items on their way (a full group, a
        wait for one of them, the end of forward, an item that goes another way)."""
        sw = self.sw
        with sw.lock:
            group, self._group = self._group, None
        if group is None:
            return
        dev = group.device
        try:
            group.ready = lanes_of(dev).record(group.stream)
        except Exception as exc:  # noqa: BLE001 - raised in the training step, see module docstring
            self._group_failed(group, exc)
            return
        block = sw.pool.acquire(group.size, dev, allocate=False)
        if block is None:  # the buffers its tensors had alone (the timed step's), else the worker pins one
            block = sw.pool.acquire_each([item.info.nbytes for item in group.items], dev)
            if block is not None:  # (and one of the group's size is pinned for the next step's, _Pin)
                self._pins.append((group.size, dev))
        if block is None:  # (pinning blocks: the worker's job)
            self._running().put_job(group)
        else:
            self.send_group(group, block)

    def wait_issued(self, item: Item) -> None:
        """Wait until the item's copy out is queued (or it is kept, or failed): the sender
        sets `issued` whatever happens, even when it stops. No wait when pack sent it itself."""
        if not item.issued.is_set():
            self.flush()  # (it may wait in the open group)
            item.issued.wait()

    def send_group(self, group: _Group, block: torch.Tensor | list | None = None) -> None:
        """Queue the group's copies out into `block` (a list: a buffer per item; None:
        allocate one; at the host memory limit the tensors stay on the device): one wait
        for the ready event, one copy call, one completion event for all. Then its items
        are issued and settled; never raises (failures are recorded on each item)."""
        with stage("send"):
            self._send_group(group, block)

    def _send_group(self, group: _Group, block: torch.Tensor | list | None) -> None:
        sw, dev, items = self.sw, group.device, group.items
        buffers = []
        try:
            if block is None:
                block = sw.pool.acquire(group.size, dev)
                if block is None:  # host memory limit: the tensors stay where they are
                    with sw.lock:
                        for item in items:
                            item.fallback = item.src.detach()  # (src itself lets its memory go at release)
                            item.advance(Phase.ISSUED, signal=False)
                        group.issued.set()  # (once every item is kept: see Item.advance)
                    sw.stats.add("kept_on_gpu", len(items))
                    self.settle_all(items)
                    return
            if type(block) is list:  # a buffer each (see flush)
                buffers, places = block, [(buf, 0) for buf in block]
            else:
                buffers, places = [block], [(block, offset) for offset in group.offsets]
            view = sw.pool.view
            dsts = [view(buf, src.dtype, src.shape, offset) for (buf, offset), src in zip(places, group.srcs)]
            done = lanes_of(dev).copy_out(dsts, group.srcs, group.ready, prepared=False)
        except Exception as exc:  # noqa: BLE001 - raised in the training step, see module docstring
            for buf in buffers:
                sw.pool.release(buf)  # no copy was queued into it
            self._group_failed(group, exc)
            return
        # (one buffer shared by all the items, or one each)
        leases = {id(buf): Lease(sw.pool, buf, dev, shares=len(items) // len(buffers)) for buf in buffers}
        for lease in leases.values():
            lease.last_use = done
        with sw.lock:
            for item, src, (buf, offset), dst in zip(items, group.srcs, places, dsts):
                item.d2h_done, item.sent, item.moved, item.offset = done, src, item.info.nbytes, offset
                item.ready = group.ready
                item.lease, item.host_view = leases[id(buf)], dst  # (the restore copies back from that view)
                item.advance(Phase.ISSUED, signal=False)
                sw.return_host(item)  # (its every save died meanwhile: its share goes back)
            group.issued.set()  # (under the lock, once all are issued: a handle dropped from now on gives its
            # share back itself, and a waiter finds every item's copy recorded; see Item.advance)
        sw.stats.add_all(("offloaded_tensors", len(items)), ("offloaded_bytes", group.nbytes),
                         ("transferred_bytes", group.nbytes))
        self.settle_all(items)

    def _group_failed(self, group: _Group, exc: BaseException) -> None:
        for item in group.items:
            self._failed(item, exc, signal=False)
        group.issued.set()  # (once every item has failed: see Item.advance)
        self.settle_all(group.items)

    def _failed(self, item: Item, exc: BaseException, signal: bool = True) -> None:
        """The item's offload failed: raised in the training step; it is handled (ISSUED)."""
        self.sw.fail(exc, item)
        with self.sw.lock:
            item.advance(Phase.ISSUED, signal)

    # -- the worker: encode ---------------------------------------------------------------------

    def encode(self, job) -> None:
        """Queue the item's encode on the compression stream, and hand it to the sender; a
        group: send it (allocating its buffer). Never raises: failures are recorded."""
        if type(job) is _Group:
            self.send_group(job)
            return
        if type(job) is _Pin:
            try:
                for dev in {dev for _, dev in job.buffers}:
                    self.sw.pool.pin_idle([nbytes for nbytes, d in job.buffers if d is dev], dev)
            finally:
                job.done.set()
            return
        item = job
        with stage("encode"):
            try:
                if not item.freed:
                    self._launch(item)
            except Exception as exc:  # noqa: BLE001 - raised in the training step, see module docstring
                self._failed(item, exc)
        self._sends_put(item)

    def _launch(self, item: Item) -> None:
        sw, dev = self.sw, item.device
        lanes = lanes_of(dev)
        # An alias of the saved tensor, which the work queued below reads: release empties
        # item.src itself (its storage goes, its version counter stays), while work on a
        # stream may still be to run (the emulator's run later; a GPU's kernels took the address).
        src = item.src.detach()
        dense = src.permute(item.perm)
        if item.codec is not None:
            codec = codecs.get(item.codec)
            nbytes = item.room
            if nbytes is None:
                return  # (the sender encodes it, reading its size back itself)
            try:
                reserved = dev.empty(nbytes, lanes.codec)
                sizes = dev.empty(8 * codec.size_words, lanes.codec)
            except torch.OutOfMemoryError:  # no room to compress into: sent as it is
                sw.stats.add("compress_oom")
                item.codec = None
            else:
                config = sw.codec_configs.get(item.codec)
                slot = self._slot(dev)
                work = Work("encode", item.codec, item.info.nbytes, item.info.dtype.itemsize)
                item.encoded = lanes.encode(
                    item.ready, lambda: codec.launch_into(dense, reserved, sizes.view(torch.int64), config),
                    reads=[src], writes=[reserved, sizes], work=work, read_back=(slot[: sizes.numel()], sizes),
                    scratch_bytes=codec.launch_scratch_bytes(src.numel(), src.element_size()))
                item.sizes, item.pending = slot, reserved
                with sw.lock:
                    item.advance(Phase.LAUNCHED)
                self._copy_early(item, codec, reserved)
                return

    def _copy_early(self, item: Item, codec, reserved: torch.Tensor) -> None:
        """Queue the copy out of the payload a bounded codec is expected to write (the same
        tensor's in the pass before) right behind its encode, into a host buffer with room
        for the header in front and for the whole room after (item.early). The sender makes
        the header once the sizes land, in Python: on the H200 it got the GIL 2.6-4.4 ms after
        them while forward ran, the link idle meanwhile (benchmarks/results/gil-wait/); it then
        copies what the payload outgrew the expected size by, if anything. Only where the
        room, with the header, is smaller than the tensor (sized from the pass before); in
        pinned memory (a pageable copy would block this thread until done); not with
        checksum=True (the checksum is of the payload sent)."""
        sw, dev = self.sw, item.device
        hsize = header_size(len(item.info.shape), codec.n_meta)  # (known before the sizes: ndim and codec)
        room = reserved.numel()
        if not codec.bounded or sw.checksum or not sw.pool.pinned or hsize + room >= item.info.nbytes:
            return
        expected = min(self._last_payload(item) or 0, room)
        if not expected:
            return
        host = sw.pool.acquire(tail_offset(hsize + room) + _TAIL, dev)
        if host is None:  # (host memory limit: the sender decides)
            return
        try:
            done = lanes_of(dev).copy_out([host[hsize: hsize + expected]], [reserved[:expected]], item.encoded, True)
        except BaseException:
            sw.pool.release(host)
            raise
        item.early = (host, done, expected)

    def _drop_early(self, item: Item) -> None:
        """The copy queued at the encode is not the item's (it went raw, stayed, failed or
        died): its host buffer goes back once that copy completes, and the item is not
        released before (that copy reads its room, after the encode that read the tensor):
        it is the item's copy out until a later one, on the same stream, replaces it."""
        early, item.early = item.early, None
        if early is None:
            return
        host, done, copied = early
        with self.sw.lock:
            if item.d2h_done is None:
                item.d2h_done = done
        self.sw.pool.release(host, done, item.device)
        self.sw.stats.add("transferred_bytes", copied)  # (moved all the same)

    # -- the sender: copy out -----------------------------------------------------------------------

    def send(self, item: Item) -> None:
        """Copy the item out, in order (or keep it); never raises: failures are recorded."""
        try:
            if not item.freed and item.phase < Phase.ISSUED:
                with stage("send"):
                    self._copy_out(item)
        except Exception as exc:  # noqa: BLE001 - raised in the training step, see module docstring
            self.sw.fail(exc, item)
        finally:
            self._drop_early(item)  # (first: a copy it dropped waits for the encode, as a copy out does)
            src = item.src
            if item.encoded is not None and item.d2h_done is None and src is not None:
                # read by an encode that no copy out waits for (it stays, or its saves
                # died, or it failed): its memory is not recycled before that read ends
                lanes_of(item.device).keep_while_read(src)
            self._drop_launch(item)  # (when not read above: before it is issued, as there)
            with self.sw.lock:
                item.advance(Phase.ISSUED)
                self.sw.return_host(item)
        self.settle(item)

    def _copy_out(self, item: Item) -> None:
        sw, dev = self.sw, item.device
        lanes = lanes_of(dev)
        src = item.src
        header, after, prepared = None, item.ready, False
        if item.pending is not None:  # launched: its sizes land, then the header can be made
            dev.event_synchronize(item.encoded, at="offload.sizes_landed")
            words = item.sizes[: 8 * codecs.get(item.codec).size_words]
            dev.host_access(words, write=False)
            header = codecs.get(item.codec).launched(words.view(torch.int64).tolist(), item.info.shape,
                                                     item.info.dtype)
            self._drop_launch(item)  # (read: its slot goes back before the item is issued, and maybe released)
            self._remember(item, header)
            data, after, prepared = item.pending[: header.payload_nbytes], item.encoded, True
            if header.payload_nbytes > item.pending.numel():  # it outgrew the room the last pass's payload gave
                sw.stats.add("payload_overflow")
                header, data, after, prepared = None, *self._raw(item, item.encoded)
            elif header.header_nbytes + header.payload_nbytes >= item.info.nbytes:  # it does not shrink: sent raw
                header, data, after, prepared = None, *self._raw(item, item.encoded)
        elif item.codec is not None:  # a codec that reads its size back itself: encoded now, this thread waiting
            codec = codecs.get(item.codec)
            scratch = codec.encode_scratch_bytes(src.numel(), src.element_size())
            work = Work("encode", item.codec, item.info.nbytes, item.info.dtype.itemsize)
            (data, header), after = lanes.encode_now(item.ready, lambda: self._encode(item, src, lanes.codec),
                                                     reads=[src], scratch_bytes=scratch, work=work)
            item.encoded, prepared = after, True
            if header is not None:
                self._remember(item, header)
            if data is None:  # (it does not shrink, or no room: as a raw tensor)
                header, (data, after, prepared) = None, self._raw(item, after)
        else:
            data, after, prepared = self._raw(item)
        with sw.lock:
            if item.freed:  # every save died before the copy: nothing to keep
                return
        if item.early is not None and header is not None and item.pending is not None:  # copied at the encode
            self._send(item, data, header, item.early[0], after, prepared, queued=item.early[1:])
            item.early = None
            return
        sent = data.numel() * data.element_size() + (header.header_nbytes if header is not None else 0)
        verdicts = header is not None or sw.checksum
        host = sw.pool.acquire(tail_offset(sent) + _TAIL if verdicts else sent, dev)
        if host is None:  # host memory limit: the tensor stays where it is (see send: what read it)
            sw.stats.add("kept_on_gpu")
            item.fallback = src.detach()  # (src itself lets its memory go at release)
            return
        self._send(item, data, header, host, after, prepared)

    def _raw(self, item: Item, read=None):
        """(bytes to send, the event they are ready at, prepared) for the tensor as it is.
        `read`: the event after an encode that read it on the compression stream, which
        its copy must follow too (its memory goes at release)."""
        return item.flat_src(), (read or item.ready), read is not None

    def _encode(self, item: Item, src: torch.Tensor, stream):
        """On the codec stream, with its size read on the host first: (payload, header),
        (None, header) when it does not shrink, (None, None) when there is no room."""
        dev = item.device
        dense = src.permute(item.perm)
        try:
            payload, header = codecs.get(item.codec).encode(
                dense, config=self.sw.codec_configs.get(item.codec), alloc=lambda n: dev.empty(n, stream))
        except torch.OutOfMemoryError:  # no room to compress into: send it as it is
            self.sw.stats.add("compress_oom")
            return None, None
        if header.header_nbytes + payload.numel() < item.info.nbytes:
            return payload, header
        return None, header  # compression that does not shrink is not sent

    def _send(self, item: Item, data: torch.Tensor, header, host: torch.Tensor, after, prepared: bool,
              queued=None) -> None:
        """Queue the copy of [header] data into `host` on D2H after `after` (the item's
        ready event, or, `prepared`, the encode that made `data`). `queued`: (the event of
        the copy of its first bytes already queued there after the header's place, how many:
        _copy_early): the header is written, and what the payload has beyond them copied."""
        sw, dev = self.sw, item.device
        lanes = lanes_of(dev)
        nbytes = data.numel() * data.element_size()
        sent = nbytes + (header.header_nbytes if header is not None else 0)
        copied = sent if queued is None else header.header_nbytes + max(nbytes, queued[1])
        tail = tail_offset(sent if queued is None else header.header_nbytes + item.pending.numel())  # (past the room)
        if header is not None:  # written here on the host: no copy, no stream sync for it
            raw = header.to_bytes()
            dev.host_access(host[: len(raw)], write=True)
            host[: len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            dst = host[len(raw): len(raw) + nbytes]
        else:  # raw: the tensor's own dtype and shape (or its bytes), a view the pool keeps
            dst = sw.pool.view(host, data.dtype, data.shape)
        if queued is not None and nbytes <= queued[1]:
            done, data = queued[0], item.pending  # (all it copied is read until the copy completes)
        elif queued is not None:  # the payload outgrew what was copied: the rest, behind it on D2H
            done = lanes.copy_out([dst[queued[1]:]], [data[queued[1]:]], after, prepared)
            data = item.pending
        else:
            try:
                done = lanes.copy_out([dst], [data], after, prepared)
                if sw.checksum:  # of the bytes sent, taken on the device before they leave
                    lanes.checksum_out(host[tail: tail + 8], data,
                                       lambda total: total.view(torch.int64).copy_(integrity.checksum(data).view(1)))
                    done = lanes.record(lanes.d2h)
            except BaseException:
                sw.pool.release(host)  # (nothing was queued into it that matters)
                raise
        lease = Lease(sw.pool, host, dev)
        lease.last_use = done
        with sw.lock:
            item.d2h_done = done
            item.sent = data  # alive until the copy completes
            item.header, item.moved, item.tail, item.lease = header, sent, tail, lease
            item.advance(Phase.ISSUED)
            sw.return_host(item)  # (every save died meanwhile: the buffer goes back after the copy)
        counts = [("offloaded_tensors", 1), ("offloaded_bytes", item.info.nbytes), ("transferred_bytes", copied)]
        if header is not None:
            counts.append(("compressed_tensors", 1))
        if queued is not None:
            counts.append(("sent_at_encode", 1))
        sw.stats.add_all(*counts)

    def _slot(self, dev) -> torch.Tensor:
        """A SLOT-byte pinned host buffer for the few words an encode's sizes are read back
        into, cut from a buffer of the host pool (SLOTS slots); a slot is reused once the
        copy into it has completed, and the buffer goes back to the pool when all its slots
        are back (after each pass's encodes have been read)."""
        with self.sw.lock:
            for block in self._slots.get(dev, ()):
                slot = block.take(dev)
                if slot is not None:
                    return slot
        buffer = self.sw.pool.acquire(SLOT * SLOTS, dev)
        if buffer is None:  # (host memory limit: one slot, pageable)
            return dev.host_empty(SLOT, pinned=False)
        block = _Slots(buffer)
        with self.sw.lock:
            self._slots.setdefault(dev, []).append(block)
            return block.take(dev)

    def _drop_launch(self, item: Item) -> None:
        """The slot its sizes were read back into is read (or never will be): reusable once
        the copy into it has completed."""
        with self.sw.lock:
            slot, item.sizes = item.sizes, None
            if slot is None:
                return
            blocks = self._slots.get(item.device, [])
            for block in blocks:
                if block.holds(slot):
                    if block.put(slot, item.encoded):
                        blocks.remove(block)
                        self.sw.pool.release(block.buffer, block.last_copy, item.device)
                    return

    # -- settling: who releases an issued item ---------------------------------------------------

    def settle(self, item: Item) -> None:
        """An issued item: released now if its copy has completed, else by the training
        thread's polls while forward runs, else by the releaser."""
        if not self.released_at_once(item):
            self._hand(item)

    def settle_all(self, items: list[Item]) -> None:
        """`settle` for items whose copies out complete with the same event (a group): one query."""
        if not items:
            return
        if not self.copy_completed(items[0]):
            for item in items:
                self._hand(item)
            return
        self._released_with(items[0], items)

    def _hand(self, item: Item) -> None:
        """An issued item whose copy is still running: the releaser's, unless the training
        thread's polls release it (while forward runs)."""
        sw = self.sw
        with sw.lock:
            if sw.releases_at_saves or not item.advance(Phase.HANDED):
                return
        self._running().put_done(item)

    def _released_with(self, first: Item, items: list[Item]) -> None:
        """Release items whose copies completed with `first`'s event: a failure that event
        carried is theirs too."""
        if first.failure is not None:
            for item in items:
                self.sw.fail(first.failure, item)  # (first's own: recorded already, a no-op)
        self.release(*items)

    def poll(self) -> None:
        """In forward, as a tensor or a group is sent: release the items whose copies out
        have completed. Not at every save: each query is a CUDA call."""
        if self.sw.releases_at_saves:
            self.release_completed()

    def release_completed(self, handed: bool = False) -> None:
        """Release, oldest first, the items in flight whose copies out have completed (the
        D2H stream completes them in order; a group's share one event, queried once), up to
        the first one whose copy still runs or that the worker or sender still has. `handed`:
        the releaser's items too (under a memory budget, whose plan counts a tensor gone as
        its copy completes, and whose releaser thread a loaded host runs late)."""
        sw = self.sw
        while True:
            with sw.lock:
                if not sw.inflight:
                    return
                item = sw.inflight[0]
            if not (item.phase == Phase.ISSUED or (handed and item.phase == Phase.HANDED)) or \
                    not self.copy_completed(item):
                return
            self.release_with(item)  # (and the rest of its group)
            with sw.lock:
                if sw.inflight and sw.inflight[0] is item:  # (not released here: the releaser has it now)
                    return

    def hand_over(self) -> None:
        """Forward is over (or did not end): the releaser takes the issued items still in flight."""
        sw = self.sw
        self.flush()
        self.poll()
        if self._pins:
            self._last_pin = _Pin(self._pins)
            self._pins = []
            self._running().put_job(self._last_pin)
        with sw.lock:
            sw.in_forward = False
            pending = [item for item in sw.inflight if item.phase == Phase.ISSUED and item.advance(Phase.HANDED)]
        if pending:
            self._running()
            for item in pending:
                self.put_done(item)

    def release_with(self, item: Item) -> None:
        """Release the item, whose copy out has completed, and the items after it in flight
        whose copies completed with the same event (the rest of its group)."""
        done, inflight = item.d2h_done, self.sw.inflight
        with self.sw.lock:
            rest = [] if done is None else [it for it in inflight if it is not item and it.d2h_done is done
                                            and it.phase == Phase.ISSUED]
        self._released_with(item, [item, *rest])

    def released_at_once(self, item: Item) -> bool:
        """Release the item now if its copy out has already completed (never raises)."""
        if not self.copy_completed(item):
            return False
        self.release(item)
        return True

    def copy_completed(self, item: Item) -> bool:
        """The item's copy out has completed, or failed (recorded on it): its tensor may go."""
        done = item.d2h_done
        try:
            return done is None or item.device.event_query(done, at="release.copy_done")
        except Exception as exc:  # noqa: BLE001 - the copy failed: unpack raises it
            self.sw.fail(exc, item)
            return True

    # -- threads ----------------------------------------------------------------------------------

    def _running(self) -> "Offloader":
        if not (self._threads and all(t.is_alive() for t in self._threads)):
            self._start()  # first use, or a thread stopped: new ones (and new queues)
        return self

    def put_job(self, job) -> None:
        if not self._jobs.put(job):  # the worker stopped meanwhile
            self._start()
            if not self._jobs.put(job):  # and its successor too: nothing may wait on the job for ever
                _strand(weakref.ref(self.sw), [job], "encode", self._done)

    def _sends_put(self, item: Item) -> None:
        if not self._sends.put(item):  # the sender stopped: it fails what it was given, this too
            stopped = RuntimeError("cswap: the offload thread (send) stopped before copying this tensor")
            self.sw.fail(stopped, item)
            with self.sw.lock:
                item.failure = item.failure or stopped
                item.advance(Phase.ISSUED)
            self._drop_launch(item)
            self._drop_early(item)
            self.put_done(item)

    def put_done(self, item: Item) -> None:
        self._done.put(item)

    def _start(self) -> None:
        if self._jobs is not None:  # a thread stopped: the others finish what they have, then stop
            _stop_queues(self._jobs, self._done)
        jobs, sends, done = _Jobs(), _Jobs(), queue.SimpleQueue()
        ref = weakref.ref(self.sw)  # the threads hold the swapper weakly and stop when it is collected
        self._threads = [
            threading.Thread(target=_run_stage, args=(ref, jobs, "encode", sends, done), name="cswap-offload",
                             daemon=True),
            threading.Thread(target=_run_stage, args=(ref, sends, "send", None, done), name="cswap-send", daemon=True),
            threading.Thread(target=_release, args=(ref, done), name="cswap-release", daemon=True)]
        self._jobs, self._sends, self._done = jobs, sends, done
        weakref.finalize(self.sw, _stop_queues, jobs, done)
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop the worker after its queue, the sender after the worker's last item, then the
        releaser after the sender's."""
        if self._jobs is not None:
            worker, sender, releaser = self._threads
            self._jobs.put(_STOP)
            worker.join()
            sender.join()
            self._done.put(_STOP)
            releaser.join()
        self._threads, self._jobs, self._sends, self._done = [], None, None, None
        if self._host_threads is not None:
            self._host_threads.shutdown(wait=True)
            self._host_threads = None

    # -- the releaser's part --------------------------------------------------------------------

    def finish(self, item: Item) -> None:
        """Wait for the item's copy out, then release it; never raises."""
        try:
            if item.d2h_done is not None:
                with stage("copy_wait"):
                    item.device.event_synchronize(item.d2h_done, at="release.copy_done")
        except Exception as exc:  # noqa: BLE001 - the copy failed: unpack raises it
            self.sw.fail(exc, item)
        self.release(item)

    def release(self, *items: Item) -> None:
        """Their copies out are complete (or never happened): drop the device tensors and
        what was made to send them."""
        with stage("release"):
            self._release_all(items)

    def _release_all(self, items) -> None:
        sw = self.sw
        compress = []
        with sw.lock:
            for item in items:
                if not item.advance(Phase.RELEASED):
                    continue
                src = item.src
                item.src = item.sent = item.pending = None
                if src is not None:  # the device memory goes here (unless the user still holds the tensor)
                    if sw.held_drops is not None:  # (a pass tracing memory: at its next tick)
                        sw.held_drops.append((src, item.device.nothing))
                    else:
                        drop_storage(src, item.device.nothing)
                sw.unstash(item)  # with the memory gone: a pack waiting for memory sees it so
                if sw.mode == "vdnnpp" and item.header is None and not item.freed and item.failure is None \
                        and item.lease is not None:
                    compress.append((item, item.lease))
            # (queued under the lock that released the items: synchronize, seeing them released,
            # sees their compressions queued)
            if compress:
                self._host_jobs = [job for job in self._host_jobs if not job.done()]
            for item, lease in compress:
                if self._host_threads is None:
                    self._host_threads = concurrent.futures.ThreadPoolExecutor(
                        max(1, (os.cpu_count() or 2) // 2), thread_name_prefix="cswap-host-zvc")
                self._host_jobs.append(self._host_threads.submit(self._host_compress, item, lease))

    def wait_background(self) -> None:
        """Wait for the work queued so far that no item waits for: the buffers the worker
        pins for the next step (_Pin), and vdnnpp's host compressions."""
        pin, self._last_pin = self._last_pin, None
        if pin is not None:
            pin.done.wait()
        with self.sw.lock:
            jobs, self._host_jobs = self._host_jobs, []
        concurrent.futures.wait(jobs)

    def _host_compress(self, item: Item, lease: Lease) -> None:
        """vdnnpp: ZVC the host copy on the CPU and give the pinned buffer back."""
        sw = self.sw
        host = lease.buffer
        try:
            words = host[: item.moved]
            item.device.host_access(words, write=False)
            blob = codecs.get("zvc").compress(words.view(item.info.dtype), backend="torch")
            expected = None
            if sw.checksum:  # it lives in the pinned buffer, which goes back now
                total = host[item.tail: item.tail + 8]
                item.device.host_access(total, write=False)
                expected = int(total.view(torch.int64)[0])
        except Exception as exc:  # noqa: BLE001 - the pinned copy stays; nothing is lost
            sw.notice("host-zvc", f"cswap: host compression failed ({type(exc).__name__}: {exc}); the "
                                  f"uncompressed host copy is kept")
            return
        with sw.lock:
            if item.lease is not lease or item.freed or item.busy or item.verdict_pending or blob.nbytes >= item.moved:
                return
            item.host_blob, item.expected_sum = blob, expected
            sw.return_host(item)
        sw.stats.add("host_compressed_tensors")


def _stop_queues(jobs: _Jobs, done: queue.SimpleQueue) -> None:
    jobs.put(_STOP)
    done.put(_STOP)
