"""Copy out and release: the offload worker and the releaser.

Dense tensors sent raw are copied out in groups. Consecutive such saves form a
group (at most GROUP_TENSORS tensors and half the stash limit's bytes), sent
when it is full: one ready event on compute, one copy call on the D2H stream (a
foreach copy on CUDA) into one host buffer, one completion event shared by its
items, and their release together. Pack sends it itself when the host pool has
an idle buffer for it (every step after the first) and hands it to nobody,
since a hand-off costs the training thread more than the calls; else the worker
allocates the buffer and sends it. Whatever must wait for one of its items (the
stash limit, synchronize, a restore during forward), forward's end, and a save
that goes another way send the open group first. The profiled pass, a memory
budget (which count each tensor's own copy) and vdnnpp (which compresses each
host copy) send a raw tensor alone: by pack, into an idle buffer of its own.
Everything else goes to the worker thread, so forward never waits for a
compression, a pinned allocation or a copy (unless the bytes in flight reached
the stash limit). Per item the worker:

  1. prepares the bytes to send, on the compression stream after the item's
     ready event: the codec's payload (a codec reads its output size back on
     the host, which blocks this thread only), or a gathered copy of a
     non-dense tensor; a dense raw tensor is sent as it is;
  2. takes a host buffer from the pool (allocating outside any lock pack takes);
  3. writes the header bytes on the host, and queues on the D2H stream, after
     the preparation (or the ready event), the copy out and, when asked, the
     checksum of the bytes sent;
  4. records d2h_done and hands the item to the releaser.

Compression of item i+1 (compression stream) thus overlaps the copy out of
item i (D2H stream).

Release. While forward runs, the training thread releases: at each save, the
oldest items in flight whose copies out have completed (one event query each;
the D2H stream completes them in order) drop the saved tensor and the bytes
sent. Waking a releaser thread per tensor would cost the training thread a GIL
hand-off each time. When forward ends, the releaser thread takes what is still
in flight and drops each as its copy completes, with no polling. Under a memory
budget the releaser takes every item at once: memory then goes the moment its
copy completes, not at the next save, which the plan's peak counts on. An item
whose copy has already completed when it is issued (a device whose work
completes at once: the CPU's) is released there and then. pack() with the stash
full, or over a memory budget, waits for the oldest item and releases it itself.

Failures. What is expected is handled: a compression that runs out of device
memory sends the tensor uncompressed (compress_oom), and one not dense in
memory with no room to be gathered, or a full host pool, keeps it on the
device (gather_oom, kept_on_gpu). Anything else (a codec bug, a failed
copy) is recorded on the item and the swapper and raised in the training step
at the next pack or unpack. The threads catch everything, and a thread that
stops anyway first fails what waits on it, so nothing waits forever.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref

import torch

from .. import codecs
from . import integrity
from .device import Work
from .items import ISSUED, HostBlock, Item, Signal, drop_storage, flat_bytes

__all__ = ["Offloader"]

_STOP = object()
GROUP_TENSORS = 16  # raw copies out queued together: at most this many (and half the stash limit's bytes)
_SLOT_ALIGN = 256   # a group's tensors start 256-byte aligned in its host buffer, as CUDA's allocations do
_TAIL = 24  # after the data, 8-byte aligned: the checksum of the bytes sent, then the restore's verdict (2 x int64)


def tail_offset(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


class _Jobs:
    """The worker's queue; closed when the worker stops, so that nothing is put where no
    one will take it (a closed queue refuses, and the caller starts a new worker)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._open = True

    def put(self, item) -> bool:
        with self._lock:
            if self._open:
                self._queue.put(item)
            return self._open

    def get(self):
        return self._queue.get()

    def close(self) -> list:
        """Refuse new items; the ones still queued."""
        with self._lock:
            self._open = False
            left = []
            while True:
                try:
                    left.append(self._queue.get_nowait())
                except queue.Empty:
                    return left


def _work(swapper_ref, jobs: _Jobs, done: queue.SimpleQueue) -> None:
    """The offload worker: issue the queued items in order."""
    item = None
    try:
        while True:
            item = jobs.get()
            if item is _STOP:
                return
            swapper = swapper_ref()
            if swapper is None:
                return
            if type(item) is _Group:
                swapper.offloader.issue_group(item)
            else:
                swapper.offloader.issue(item)
                swapper.offloader.settle(item)
            item = swapper = None
    finally:  # stopped, or died: whatever is still queued must not wait on this thread
        stranded = [] if item is None or item is _STOP or item.issued.is_set() else [item]
        stranded = [it for job in stranded + jobs.close()
                    for it in (job.items if type(job) is _Group else [job])]  # (a group's items, each)
        swapper = swapper_ref()
        for it in stranded:
            if it is not _STOP:
                stopped = RuntimeError("cswap: the offload worker stopped before copying this tensor")
                if swapper is not None:
                    swapper.fail(stopped, it)  # raised in the training step at its next pack or unpack
                it.failure = it.failure or stopped
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


class Offloader:
    """The copy-out half of a Swapper (see the module docstring)."""

    def __init__(self, swapper):
        self.sw = swapper
        self._group: _Group | None = None  # raw copies out not yet queued (the training thread's)
        self._jobs: _Jobs | None = None
        self._done: queue.SimpleQueue | None = None
        self._threads: list[threading.Thread] = []
        self._host_threads = None  # vdnnpp's CPU compression pool, made on first use

    # -- threads ----------------------------------------------------------------------------

    def offload(self, item: Item, grouped: bool) -> None:
        """Start the item's copy out (see the module docstring): a dense tensor sent raw
        joins the open group (`grouped`), or is copied here when the host pool has an idle
        buffer for it; anything else goes to the worker."""
        sw = self.sw
        if item.codec is None and item.perm is not None and not sw.checksum and sw.pool.pinned:
            # (from pageable memory a copy blocks its caller until done: the worker's job)
            if grouped:
                self._join(item)
                return
            host = sw.pool.acquire(item.info.nbytes, item.device, allocate=False)
            if host is not None:
                self.flush()  # (the copy stream completes copies in the order of the stash)
                item.ready = item.device.record_event(item.device.compute_stream())
                item.issued = ISSUED
                try:
                    self._send(item, item.dense_src(), None, host)
                except Exception as exc:  # noqa: BLE001 - raised in the training step, see module docstring
                    sw.fail(exc, item)
                self.settle(item)
                return
        self.flush()
        item.ready = item.device.record_event(item.device.compute_stream())
        item.issued = Signal()
        self._running().put_job(item)

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
            group.ready = dev.record_event(group.stream)
        except Exception as exc:  # noqa: BLE001 - raised in the training step, see module docstring
            self._group_failed(group, exc)
            return
        block = sw.pool.acquire(group.size, dev, allocate=False)
        if block is None:  # (pinning blocks: the worker's job)
            self._running().put_job(group)
        else:
            self.issue_group(group, block)

    def issue_group(self, group: "_Group", block: torch.Tensor | None = None) -> None:
        """Queue the group's copies out into `block` (None: allocate one; at the host
        memory limit the tensors stay on the device): one wait for the ready event, one
        copy call, one completion event for all. Then its items are issued and settled;
        never raises (failures are recorded on each item)."""
        sw, dev, items = self.sw, group.device, group.items
        try:
            if block is None:
                block = sw.pool.acquire(group.size, dev)
                if block is None:  # host memory limit: the tensors stay where they are
                    with sw.lock:
                        for item in items:
                            item.fallback = item.src.detach()  # (src itself lets its memory go at release)
                        group.issued.set()
                    sw.stats.add("kept_on_gpu", len(items))
                    self.settle_all(items)
                    return
            d2h = dev.side_stream("d2h")
            dev.wait_event(d2h, group.ready, at="offload.copy_after_ready")
            view = sw.pool.view
            dsts = [view(block, src.dtype, src.shape, offset) for src, offset in zip(group.srcs, group.offsets)]
            dev.copy_all(dsts, group.srcs, d2h)
            done = dev.record_event(d2h)
        except Exception as exc:  # noqa: BLE001 - raised in the training step, see module docstring
            if block is not None:
                sw.pool.release(block)  # no copy was queued into it
            self._group_failed(group, exc)
            return
        shared = HostBlock(block, len(items), done)
        with sw.lock:
            for item, src, offset, dst in zip(items, group.srcs, group.offsets, dsts):
                item.d2h_done, item.sent, item.moved, item.block, item.offset = done, src, item.info.nbytes, \
                    shared, offset
                item.ready = group.ready
                item.host, item.host_view = block, dst  # (the restore copies back from that view)
                if item.freed:  # every save died meanwhile: its share goes back after the copy
                    sw.give_back_host(item)
            group.issued.set()  # (under the lock: a handle dropped from now on gives its share back itself)
        sw.stats.add_all(("offloaded_tensors", len(items)), ("offloaded_bytes", group.nbytes),
                         ("transferred_bytes", group.nbytes))
        self.settle_all(items)

    def _group_failed(self, group: "_Group", exc: BaseException) -> None:
        for item in group.items:
            self.sw.fail(exc, item)
        group.issued.set()
        self.settle_all(group.items)

    def settle(self, item: Item) -> None:
        """An issued item: released now if its copy has completed, else by the training
        thread's polls while forward runs, else by the releaser."""
        if self.released_at_once(item):
            return
        sw = self.sw
        with sw.lock:
            if sw.releases_at_saves or item.to_releaser:
                return
            item.to_releaser = True
        self._running().put_done(item)

    def settle_all(self, items: list[Item]) -> None:
        """`settle` for items whose copies out complete with the same event (a group)."""
        if not items:
            return
        if not self._copied(items[0]):
            for item in items:
                self.settle(item)
            return
        self._released_with(items[0], items)

    def _released_with(self, first: Item, items: list[Item]) -> None:
        """Release items whose copies completed with `first`'s event: a failure that event
        carried is theirs too."""
        if first.failure is not None:
            for item in items:
                self.sw.fail(first.failure, item)  # (first's own: recorded already, a no-op)
        self.release(*items)

    def poll(self) -> None:
        """At a save in forward: release, oldest first, the items whose copies out have
        completed (the D2H stream completes them in order; a group's share one event,
        queried once)."""
        sw = self.sw
        inflight = sw.inflight
        completed = None  # the item whose event was found complete last
        while inflight:
            item = inflight[0]
            if not item.issued.is_set() or item.to_releaser:  # the worker has it still, or the releaser
                return
            if not item.released:
                if completed is not None and item.d2h_done is completed.d2h_done:
                    self._released_with(completed, [item])
                elif self.released_at_once(item):
                    completed = item if item.d2h_done is not None else None
                else:
                    return
            if inflight and inflight[0] is item:  # (released: unstashed already)
                return

    def hand_over(self) -> None:
        """Forward is over (or did not end): the releaser takes the issued items still in flight."""
        sw = self.sw
        self.flush()
        self.poll()
        with sw.lock:
            sw.in_forward = False
            pending = [item for item in sw.inflight if item.issued.is_set() and not item.to_releaser]
            for item in pending:
                item.to_releaser = True
        for item in pending:
            self._running().put_done(item)

    def released_at_once(self, item: Item) -> bool:
        """Release the item now if its copy out has already completed (never raises)."""
        if not self._copied(item):
            return False
        self.release(item)
        return True

    def _copied(self, item: Item) -> bool:
        """The item's copy out has completed, or failed (recorded on it): its tensor may go."""
        done = item.d2h_done
        try:
            return done is None or item.device.event_query(done, at="release.copy_done")
        except Exception as exc:  # noqa: BLE001 - the copy failed: unpack raises it
            self.sw.fail(exc, item)
            return True

    def _running(self) -> "Offloader":
        if not (self._threads and all(t.is_alive() for t in self._threads)):
            self._start()  # first use, or a thread stopped: new ones (and new queues)
        return self

    def put_job(self, item: Item) -> None:
        if not self._jobs.put(item):  # the worker stopped meanwhile
            self._start()
            self._jobs.put(item)

    def put_done(self, item: Item) -> None:
        self._done.put(item)

    def _start(self) -> None:
        jobs, done = _Jobs(), queue.SimpleQueue()
        ref = weakref.ref(self.sw)  # the threads hold the swapper weakly and stop when it is collected
        self._threads = [threading.Thread(target=_work, args=(ref, jobs, done), name="cswap-offload", daemon=True),
                         threading.Thread(target=_release, args=(ref, done), name="cswap-release", daemon=True)]
        self._jobs, self._done = jobs, done
        weakref.finalize(self.sw, _stop_queues, jobs, done)
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop the worker after its queue, then the releaser after the worker's last item."""
        if self._jobs is not None:
            worker, releaser = self._threads
            self._jobs.put(_STOP)
            worker.join()
            self._done.put(_STOP)
            releaser.join()
        self._threads, self._jobs, self._done = [], None, None
        if self._host_threads is not None:
            self._host_threads.shutdown(wait=True)
            self._host_threads = None

    # -- the worker's part --------------------------------------------------------------------

    def issue(self, item: Item) -> None:
        """Copy the item out (or keep it); never raises: failures are recorded."""
        try:
            if not item.freed:
                self._copy_out(item)
        except Exception as exc:  # noqa: BLE001 - raised in the training step, see module docstring
            self.sw.fail(exc, item)
        finally:
            item.issued.set()

    def _copy_out(self, item: Item) -> None:
        sw, dev = self.sw, item.device
        src = item.src
        data_ready = None
        if item.codec is not None or item.perm is None:  # prepared on the compression stream
            compress = dev.side_stream("compress")
            dev.wait_event(compress, item.ready, at="offload.compress_after_ready")
            scratch = codecs.get(item.codec).encode_scratch_bytes(src.numel(), src.element_size()) \
                if item.codec is not None else 0
            work = Work("encode", item.codec, item.info.nbytes, item.info.dtype.itemsize) if item.codec is not None else \
                Work("gather", None, item.info.nbytes)
            data, header = dev.call(compress, lambda: self._prepare(item, src, compress), reads=[src],
                                    scratch_bytes=scratch, work=work)
            data_ready = dev.record_event(compress)
        else:
            data, header = item.flat_src(), None
        with sw.lock:
            if item.freed:  # every save died before the copy: nothing to keep
                return
        host = None
        if data is not None:  # (else no device memory to gather it into)
            sent = data.numel() + (header.header_nbytes if header is not None else 0)
            verdicts = header is not None or sw.checksum
            host = sw.pool.acquire(tail_offset(sent) + _TAIL if verdicts else sent, dev)
            if host is None:
                sw.stats.add("kept_on_gpu")
        if host is None:  # host memory limit, or no room to gather it: the tensor stays where it is
            if data_ready is not None:  # (read on the compression stream: not recycled before that read ends)
                dev.record_stream(src, compress, at="offload.record_kept")
            item.fallback = src.detach()  # (src itself lets its memory go at release)
            return
        self._send(item, data, header, host, data_ready)

    def _send(self, item: Item, data: torch.Tensor, header, host: torch.Tensor, data_ready=None) -> None:
        """Queue the copy of [header] data into `host` on the D2H stream, after
        `data_ready` (a preparation) or else the item's ready event."""
        sw, dev = self.sw, item.device
        nbytes = data.numel() * data.element_size()
        sent = nbytes + (header.header_nbytes if header is not None else 0)
        tail = tail_offset(sent)
        if header is not None:  # written here on the host: no copy, no stream sync for it
            raw = header.to_bytes()
            dev.host_access(host[: len(raw)], write=True)
            host[: len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            dst = host[len(raw): len(raw) + nbytes]
        else:  # raw: the tensor's own dtype and shape (or its bytes), a view the pool keeps
            dst = sw.pool.view(host, data.dtype, data.shape)
        d2h = dev.side_stream("d2h")
        if data_ready is not None:
            dev.wait_event(d2h, data_ready, at="offload.copy_after_compress")
        else:
            dev.wait_event(d2h, item.ready, at="offload.copy_after_ready")
        dev.copy(dst, data, d2h)
        if sw.checksum:  # of the bytes sent, taken on the device before they leave
            total = dev.empty(8, d2h)
            dev.launch(d2h, lambda: total.view(torch.int64).copy_(integrity.checksum(data).view(1)),
                       reads=[data], writes=[total], work=Work("checksum", None, nbytes))
            dev.copy(host[tail: tail + 8], total, d2h)
        done = dev.record_event(d2h)
        with sw.lock:
            item.d2h_done = done
            item.sent = data  # alive until the copy completes
            item.header, item.moved, item.tail = header, sent, tail
            if item.freed:  # every save died meanwhile: the buffer goes back after the copy
                sw.pool.release(host, done, dev)
            else:
                item.host = host
            item.issued.set()  # (under the lock: a handle dropped from now on gives the buffer back itself)
        counts = [("offloaded_tensors", 1), ("offloaded_bytes", item.info.nbytes), ("transferred_bytes", sent)]
        if header is not None:
            counts.append(("compressed_tensors", 1))
        sw.stats.add_all(*counts)

    def _prepare(self, item: Item, src: torch.Tensor, stream):
        """On the compression stream: (bytes to send, header or None); (None, None) when a
        tensor that is not dense finds no device memory to be gathered into."""
        dev = item.device
        dense = src.permute(item.perm) if item.perm is not None else src
        if item.codec is not None:
            try:
                payload, header = codecs.get(item.codec).encode(
                    dense, config=self.sw.codec_configs.get(item.codec), alloc=lambda n: dev.empty(n, stream))
            except torch.OutOfMemoryError:  # no room to compress into: send it as it is
                self.sw.stats.add("compress_oom")
            else:
                if header.header_nbytes + payload.numel() < item.info.nbytes:
                    return payload, header
                # compression that does not shrink is not sent
        if item.perm is not None:
            return flat_bytes(dense), None
        try:
            gathered = dev.empty(item.info.nbytes, stream)  # not dense: sent (and restored) contiguous
        except torch.OutOfMemoryError:  # no room to gather it into: it stays on the device
            self.sw.stats.add("gather_oom")
            return None, None
        gathered.view(src.dtype).view(src.shape).copy_(src)
        return gathered, None

    # -- the releaser's part --------------------------------------------------------------------

    def finish(self, item: Item) -> None:
        """Wait for the item's copy out, then release it; never raises."""
        try:
            if item.d2h_done is not None:
                item.device.event_synchronize(item.d2h_done, at="release.copy_done")
        except Exception as exc:  # noqa: BLE001 - the copy failed: unpack raises it
            self.sw.fail(exc, item)
        self.release(item)

    def release(self, *items: Item) -> None:
        """Their copies out are complete (or never happened): drop the device tensors."""
        sw = self.sw
        compress = []
        with sw.lock:
            for item in items:
                if item.released:
                    continue
                item.released = True
                src = item.src
                item.src = item.sent = None
                if src is not None:  # the device memory goes here (unless the user still holds the tensor)
                    drop_storage(src, item.device.nothing)
                sw.unstash(item)  # with the memory gone: a pack waiting for memory sees it so
                if sw.mode == "vdnnpp" and item.header is None and not item.freed and item.failure is None \
                        and item.host is not None:
                    compress.append((item, item.host))
        for item, host in compress:
            if self._host_threads is None:
                from concurrent.futures import ThreadPoolExecutor

                self._host_threads = ThreadPoolExecutor(max(1, (os.cpu_count() or 2) // 2),
                                                        thread_name_prefix="cswap-host-zvc")
            self._host_threads.submit(self._host_compress, item, host)

    def _host_compress(self, item: Item, host: torch.Tensor) -> None:
        """vdnnpp: ZVC the host copy on the CPU and give the pinned buffer back."""
        sw = self.sw
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
            if item.host is not host or item.freed or item.busy or item.verdict_pending or blob.nbytes >= item.moved:
                return
            item.host_blob, item.expected_sum = blob, expected
            sw.give_back_host(item)
        sw.stats.add("host_compressed_tensors")


def _stop_queues(jobs: _Jobs, done: queue.SimpleQueue) -> None:
    jobs.put(_STOP)
    done.put(_STOP)
