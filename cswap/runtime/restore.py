"""Restore for backward: prefetch, copy in, decode, verify.

Backward unpacks items in roughly reverse pack order. On the first unpack of
item k, the restores of items k-1, k-2, ... are queued, within the prefetch
window ahead; then item k's own verdict is checked, and compute waits for item
k's restore only. An item not prefetched is fetched on demand, and the time
compute waits for it is measured with events (no host sync just to time it).

Stages (cswap.runtime.lanes has the streams and waits): the copy in on the H2D
stream, into memory allocated on that stream (nothing else on the device can be
using it, so the copy waits for nothing); for a compressed item, the decode on
the codec stream after the copy in of its payload, so that decoding item k and
copying in item k-1 overlap; then compute waits for the restore it uses. What a
side stream restored is recorded for compute, which uses and frees it: its
memory is not recycled while compute may still read it.

Prefetched raw copies go in groups: consecutive released raw tensors are
restored with one copy call and one completion event. So that groups form, the
window is refilled once half of it has been served (or when the next item is
not on its way), not one tensor per use. The window counts what a restore holds
on the device while ahead of use (the tensor, and a compressed one's payload
until decoded) and admits at least two restores (the largest included) unless a
memory budget forbids it.

An item whose tensor is still on the device (not yet released: the last
tensors of forward) is served from it: no round trip.

Integrity. A compressed host copy's header bytes must equal those written,
and the decoder's consistency flag (and with checksum=True, the checksum of
the bytes that came back) land in the host buffer with the restore. The host
never waits for one per tensor: unpack reads the verdicts whose restores have
completed (an event query), and those still in flight when backward ends are
waited for then, once (a final callback of autograd's engine). A corrupt copy
raises CorruptDataError naming the layer before backward() returns, so no
optimizer step applies gradients computed from it. A host buffer whose verdict
is unread stays out of the pool.

Out of memory. A prefetch that runs out stops prefetching (the item is
fetched on demand later); an on-demand restore that runs out gives back the
prefetched tensors backward has not used yet (their host copies stay) and
retries once (CUDA's allocator waits for pending frees itself before it
reports out of memory), and only then raises. No tensor is ever dropped.
"""

from __future__ import annotations

import torch

from .. import codecs
from ..codecs.container import Compressed, unpack_header
from ..errors import CorruptDataError
from . import integrity
from .device import Work
from .hook_context import keeps_graph
from .items import Handle, Item, Pass, flat_bytes, is_identity, restore_strides
from .lanes import lanes_of
from .trace import stage

__all__ = ["Restorer"]

MiB = 1 << 20
BLOCK_ALIGN = 512  # where each tensor of a group's restore starts in its block (the allocator's own rounding)


class Restorer:
    """The restore half of a Swapper (see the module docstring)."""

    def __init__(self, swapper):
        self.sw = swapper
        self.unread: list = []        # (item, its restore's event): served, verdict not landed yet
        self.waited = self.waited_on = None  # the event of the latest wait for a restore, and the stream waiting
        self.settling = False         # the end-of-backward read is queued

    def unpack(self, handle: Handle, at: int | None = None) -> torch.Tensor:
        """The tensor back for backward (`at`: the profiler's stamp of this use, if timed)."""
        sw, item = self.sw, handle.item
        if item.counter._version != item.version:  # (autograd's in-place check, which hooks turn off)
            sw.check_version(item)
        if at is not None:
            sw.observer.on_unpack(item.key, at)
        if item.error is not None:  # a prefetch found its host copy corrupt
            raise item.error
        dev = item.device
        if sw.capturing(dev):
            raise RuntimeError(
                f"cswap: backward is being captured into a CUDA graph, but the {item.info.op} output of "
                f"{item.info.where} was offloaded by a forward outside the capture: a graph cannot replay a copy "
                f"it did not capture. Capture forward and backward together (cswap then keeps saved tensors in "
                f"place), or run backward uncaptured")
        lanes = lanes_of(dev)
        if item.restored is None:  # not prefetched: backward waits for this restore
            asked = lanes.record(dev.compute_stream(), timing=True)
            with stage("restore"):
                restored = self.on_demand(item, handle.pass_)
            if restored:
                sw.stats.add("on_demand")
                sw.note_stall(dev, asked, item.h2d_done)
        with sw.lock:
            # Its first use in this round (a count of uses would not do: autograd drops a save
            # once its node ran, which uncounts it, so the item's next save would look first).
            round_ = item.round
            first = item.prefetched_round != round_
            item.prefetched_round = round_
            if item.prefetch_counted:  # served now: no longer ahead of backward
                sw.uncount_prefetch(item)
        if first:
            with stage("prefetch"):
                self.prefetch(handle.pass_, item, round_)  # issue the next restores before checking this one
        if item.verdict_pending or self.unread:
            self.verify(item)
        out, done = item.restored, item.h2d_done
        compute = dev.compute_stream()
        if done is not None and (done is not self.waited or compute is not self.waited_on):  # its own item only
            lanes.use(done)
            self.waited, self.waited_on = done, compute  # (a group's next tensor: compute waits for it already)
        if dev.observes:
            dev.on_use(out)
        with sw.lock:
            if handle.served_round != item.round:
                handle.served_round = item.round
                item.unpacked += 1
            if item.unpacked >= item.handles:
                sw.end_round_if_served(item)
        if handle.view is None:
            return out
        size, stride, offset = handle.view  # (offset: from the saved base's own, which out may not start at)
        return out.as_strided(size, stride, out.storage_offset() + offset)

    def prefetch(self, pass_: Pass, item: Item, round_: int) -> None:
        """Start restoring the items backward will want next while what is restored ahead
        and not yet served fits in the prefetch window (prefetch_bytes=0 turns prefetch off;
        an item that does not fit is fetched when backward asks), skipping those already
        served in this backward (round_: item's round in it). Eager backward unpacks in
        reverse pack order; a compiled graph's backward unpacks its saved tensors in
        forward order: the direction follows what was served. The pass keeps where the
        last call stopped (its cursor), so each item is looked at once per backward,
        however large the window."""
        sw, items = self.sw, pass_.items
        before = items[item.index - 1] if item.index > 0 else None
        step = 1 if before is not None and not before.freed and before.round != round_ else -1
        start = item.index + step
        cursor = pass_.cursor
        if cursor is not None and cursor[0] == round_ and cursor[1] == step:  # further on in this backward
            start = max(start, cursor[2]) if step > 0 else min(start, cursor[2])
        limit = sw.prefetch_limit(pass_)
        if start != item.index + step and sw.prefetched_bytes > limit // 2:
            return  # the next items are on their way: refill once half the window is served, in one group
        memory_limit = sw.memory_limit(pass_.ticks - 1) if sw.memory_limit is not None else None  # (this use's)
        raw = []  # released raw copies to restore together, in backward's order
        j, end = start, (len(items) if step > 0 else -1)
        try:
            while j != end:
                other = items[j]
                if other.freed or other.round != round_:  # gone, or already served in this backward
                    j += step
                    continue
                held = restore_footprint(other)
                if not sw.fits_prefetch(held, limit, sum(restore_footprint(it) for it in raw), len(raw)):
                    break
                if memory_limit is not None and other.device.memory_allocated() + sum(it.info.nbytes for it in raw) \
                        + other.info.nbytes > memory_limit:  # (the group gathered so far is not allocated yet)
                    break  # over the memory budget: backward fetches it when it needs it
                if other.restored is None and other.error is None and other.failure is None:
                    if raw and other.device is not raw[0].device:
                        self.restore_all(raw)
                    if self._take_raw(other):
                        raw.append(other)
                    else:
                        self.restore_all(raw)  # (restores go in the order backward uses them)
                        try:
                            if self.restore(other):
                                sw.stats.add("prefetched")
                            with sw.lock:  # restored, or still on the device: ahead of backward either way
                                sw.count_prefetch(other)
                        except CorruptDataError as exc:  # raised when backward reaches that item
                            other.error = exc
                j += step
            self.restore_all(raw)
        except torch.OutOfMemoryError:  # no room now: backward fetches the rest on demand
            sw.stats.add("prefetch_oom")
        pass_.cursor = (round_, step, j)

    def _take_raw(self, item: Item) -> bool:
        """Whether the item's restore is a plain copy of a released raw tensor (it is then
        counted ahead of backward and kept from vdnnpp's host compression until queued)."""
        sw = self.sw
        if not item.issued.is_set() or item.header is not None or sw.checksum:
            return False
        with sw.lock:
            if item.lease is None or item.host_blob is not None or item.src is not None or \
                    item.fallback is not None or item.failure is not None:
                return False
            item.busy = True
            sw.count_prefetch(item)
        return True

    def restore_all(self, items: list[Item]) -> None:
        """Restore released raw tensors of one device together, emptying `items`: one copy
        call and one completion event for all. Out of memory, none is restored (backward
        fetches them when it needs them) and it raises."""
        if not items:
            return
        sw = self.sw
        lanes = lanes_of(items[0].device)
        try:
            # One allocation for the group, each tensor a view of it (one allocator call and one
            # record_stream, not one per tensor; the memory goes when the group's last tensor is
            # freed), except under a memory budget, whose plan counts each tensor freed as used.
            block = None
            if len(items) > 1 and sw.memory_limit is None:
                offsets, end = [], 0
                for item in items:  # (each at its original's address modulo the alignment: Item.lead)
                    offsets.append(-(-end // BLOCK_ALIGN) * BLOCK_ALIGN + item.lead)
                    end = offsets[-1] + item.info.nbytes
                block = lanes.alloc_in(end, torch.uint8, (end,))
            ys, hosts, restored = [], [], []
            for i, item in enumerate(items):  # where their copies write them; compute uses and frees them
                info, perm, shape = item.info, item.perm, item.dense_shape()
                stride = item.stride if is_identity(perm) else None  # (own strides at once)
                if block is not None:
                    flat = block[offsets[i]: offsets[i] + info.nbytes].view(info.dtype)
                    y = flat.view(shape) if stride is None else flat.as_strided(shape, stride)
                else:
                    y = lanes.alloc_in(info.nbytes, info.dtype, shape, stride, lead=item.lead)
                # (else its bytes' order, then its strides)
                restored.append(y if stride is not None else restore_strides(y, perm, item.stride))
                ys.append(y)
                hosts.append(item.host_view if item.host_view is not None
                             else sw.pool.view(item.host, info.dtype, shape, item.offset))
            done = lanes.copy_in(ys, hosts)
            lanes.hand_to_compute(ys if block is None else [block])
        except BaseException:
            with sw.lock:
                for item in items:
                    item.busy = False
                    sw.uncount_prefetch(item)
            items.clear()
            raise
        with sw.lock:
            for item, y in zip(items, restored):
                item.restored = y
                item.h2d_done = item.lease.last_use = done
                item.busy = False
        sw.stats.add_all(("restored_tensors", len(items)), ("prefetched", len(items)))
        items.clear()

    def on_demand(self, item: Item, pass_: Pass) -> bool:
        """`restore`; when the device is out of memory, give back the prefetched
        restores backward has not used yet (their host copies stay), wait for the
        copies out still in flight to release their tensors, and retry once."""
        try:
            return self.restore(item, timing=True)
        except torch.OutOfMemoryError:
            self.sw.stats.add("oom_retries")
            self.drop_unused_prefetches(item, pass_)
            self.sw.synchronize()  # and tensors still being copied out leave the device first
            try:
                return self.restore(item, timing=True)
            except torch.OutOfMemoryError as exc:
                kept = " This backward keeps its graph (retain_graph=True), which keeps every tensor saved for it " \
                       "that stayed on the device until the graph goes: call backward without retain_graph, or " \
                       "lower the batch size." if keeps_graph() else " Lower prefetch_bytes or the batch size."
                raise torch.OutOfMemoryError(
                    f"cswap: restoring the {item.info.nbytes / MiB:.1f} MiB {item.info.op} output of "
                    f"{item.info.where} for backward ran out of device memory, even after giving back prefetched "
                    f"tensors; its host copy is kept.{kept} ({exc})") from exc

    def drop_unused_prefetches(self, keep: Item, pass_: Pass) -> None:
        sw = self.sw
        with sw.lock:
            for other in pass_.items:
                if other is not keep and other.h2d_done is not None and other.unpacked == 0:
                    sw.uncount_prefetch(other)
                    other.restored = other.h2d_done = None
                    if not other.verdict_unread:  # (an earlier round's verdict, unread, still needs the buffer)
                        other.verdict_pending = False
                        sw.return_host(other)

    def restore(self, item: Item, timing: bool = False) -> bool:
        """Bring the item back into item.restored (asynchronously); False when no copy
        was needed (kept on the device, or still there). `timing`: its last event can be
        timed (an on-demand restore's stall is measured; CUDA's timing events cost more)."""
        sw = self.sw
        sw.offloader.wait_issued(item)
        if item.failure is not None:
            raise sw.offload_failed(item, item.failure)
        if item.fallback is not None:
            item.restored = item.fallback
            return False
        with sw.lock:
            if item.src is not None:  # not released yet: the tensor itself is still on the device
                item.restored = item.src.detach()  # (src itself lets its memory go at release)
                sw.stats.add("served_from_device")
                return False
            blob = item.host_blob
            item.busy = True  # vdnnpp's host compression leaves this buffer alone for now
        try:
            y = self._copy_in(item, blob, timing)
        finally:
            with sw.lock:
                item.busy = False
        item.restored = y
        sw.stats.add("restored_tensors")
        return True

    def _copy_in(self, item: Item, blob, timing: bool) -> torch.Tensor:
        sw, dev, info = self.sw, item.device, item.info
        lanes = lanes_of(dev)
        shape, host = item.dense_shape(), item.host
        if blob is not None:  # vdnnpp: decompress on the CPU into a pinned buffer, then copy up
            y = lanes.alloc_in(info.nbytes, info.dtype, shape, lead=item.lead)
            staging = sw.pool.acquire(info.nbytes, dev)
            # At the host memory limit, pageable memory: the copy up then blocks until it is read.
            source = staging[: info.nbytes] if staging is not None else dev.host_empty(info.nbytes, pinned=False)
            dev.host_access(source, write=True)
            try:
                try:
                    codecs.get("zvc").decompress(blob, backend="torch", out=source)
                except CorruptDataError as exc:
                    raise self.corrupt(item, str(exc)) from exc
                if sw.checksum and int(integrity.checksum(source)) != item.expected_sum:
                    raise self.corrupt(item, "its checksum differs from the one taken before the offload")
            except BaseException:
                if staging is not None:
                    sw.pool.release(staging)  # (no copy read it)
                raise
            done = lanes.copy_in([flat_bytes(y)], [source], timing=timing)
            if staging is not None:
                sw.pool.release(staging, done, dev)
        elif item.header is not None:  # the payload in on H2D, decoded on the codec stream
            self.check_header(item, host)
            hsize = item.header.header_nbytes
            payload = dev.empty(item.moved - hsize, lanes.h2d)
            landed = lanes.copy_in([payload], [host[hsize: item.moved]])
            y = lanes.alloc_in(info.nbytes, info.dtype, shape, stream=lanes.codec, lead=item.lead)
            y_bytes, verdict = flat_bytes(y), dev.empty(16, lanes.codec)
            codec, header, config = codecs.get(item.codec), item.header, sw.codec_configs.get(item.codec)

            def decode():
                check = codec.decode(payload, header, out=y_bytes, config=config)[1]
                write_verdict(verdict, check.bad, integrity.checksum(payload) if sw.checksum else None)

            done = lanes.decode_after(landed, decode, reads=[payload], writes=[y_bytes, verdict],
                                      work=Work("decode", item.codec, info.nbytes, info.dtype.itemsize),
                                      verdict=verdict, host_verdict=host[item.tail + 8: item.tail + 24], timing=timing)
            item.verdict_pending = True
        else:
            y = lanes.alloc_in(info.nbytes, info.dtype, shape, lead=item.lead)
            done = lanes.copy_in([y], [sw.pool.view(host, info.dtype, shape, item.offset)],  # (typed: a kept view)
                                 timing=timing and not sw.checksum)
            if sw.checksum:
                y_bytes, verdict = flat_bytes(y), dev.empty(16, lanes.h2d)

                def check():
                    write_verdict(verdict, None, integrity.checksum(y_bytes))

                done = lanes.check_after(lanes.h2d, check, reads=[y_bytes], writes=[verdict], verdict=verdict,
                                         host_verdict=host[item.tail + 8: item.tail + 24], timing=timing)
                item.verdict_pending = True
        lanes.hand_to_compute([y])
        item.h2d_done = done
        if item.lease is not None:
            item.lease.last_use = done
        return restore_strides(y, item.perm, item.stride)

    # -- integrity ------------------------------------------------------------------------

    def check_header(self, item: Item, host: torch.Tensor) -> None:
        """The host copy's header must be the one written (the host wrote it: no sync)."""
        dev = item.device
        dev.host_access(host[: item.header.header_nbytes], write=False)
        try:
            header = unpack_header(lambda n: host[:n].numpy().tobytes(), item.moved)
            problem = None if header == item.header else "its header differs from the one written"
        except CorruptDataError as exc:
            problem = str(exc)
        if problem is not None:
            raise self.corrupt(item, problem)

    def verify(self, item: Item) -> None:
        """Read the verdicts that have landed, this item's included if its restore has
        completed; leave the others for later unpacks and the end of backward."""
        unread = self.unread
        if item.verdict_pending and not item.verdict_unread:
            with self.sw.lock:  # (return_host reads the flag: the buffer stays until the verdict is read)
                item.verdict_unread = True
            unread.append((item, item.h2d_done))
        landed = [entry for entry in unread if entry[0].device.event_query(entry[1], at="unpack.verdict_landed")]
        for entry in landed:
            unread.remove(entry)
        self._read([it for it, _ in landed])
        if unread and not self.settling:
            try:  # (only backward's engine takes one; unpack called outside backward reads now)
                torch.autograd.Variable._execution_engine.queue_callback(self.settle)
                self.settling = True
            except RuntimeError:
                self.settle()

    def settle(self) -> None:
        """At the end of backward: wait for the verdicts still in flight (once per device and
        stream: decoded ones on the codec stream, checked raw copies on H2D; each stream
        runs in order) and read them."""
        self.settling = False
        unread, self.unread = self.unread, []
        items = [item for item, _ in unread]
        streams = {}
        for item in items:
            lanes = lanes_of(item.device)
            stream = lanes.codec if item.header is not None else lanes.h2d
            streams[id(lanes), id(stream)] = (lanes, stream)
        try:
            for lanes, stream in streams.values():
                lanes.dev.event_synchronize(lanes.record(stream), at="unpack.verdict_landed")
        except BaseException:
            self.abandon(items)
            raise
        self._read(items)

    def _read(self, items: list[Item]) -> None:
        """Read each landed verdict; when one raises, the rest are abandoned (buffers back)."""
        for i, item in enumerate(items):
            try:
                self.read_verdict(item)
            except BaseException:
                self.abandon(items[i + 1:])
                raise

    def abandon(self, items=None) -> None:
        """Verdicts no one will read (a backward that raised): their host buffers go back."""
        if items is None:
            items, self.unread, self.settling = [it for it, _ in self.unread], [], False
        for item in items:
            self.done_reading(item)

    def read_verdict(self, item: Item) -> None:
        """The verdict of the item's last restore (landed) and raise on a corrupt copy."""
        if item.host is None:  # (cannot happen while verdict_pending holds the buffer; never read freed memory)
            return
        try:
            words = item.host[item.tail: item.tail + 24]
            item.device.host_access(words, write=False)
            expected, bad, total = words.view(torch.int64).tolist()
            if bad:
                raise self.corrupt(item, self.diagnose(item))
            if self.sw.checksum and total != expected:
                raise self.corrupt(item, "its checksum differs from the one taken before the offload")
        finally:
            self.done_reading(item)

    def done_reading(self, item: Item) -> None:
        sw = self.sw
        with sw.lock:
            item.verdict_pending = item.verdict_unread = False
            sw.return_host(item)  # (its last save died before the verdict was read)

    def diagnose(self, item: Item) -> str:
        """The decoder's own words on what is wrong, from decoding the host copy on the CPU."""
        if item.header is None:
            return "its check on the device failed"
        try:
            blob = Compressed(item.host[: item.moved], item.header)
            codecs.get(item.codec).decompress(blob, backend="torch")
        except CorruptDataError as exc:
            return str(exc)
        return "the decoder found it inconsistent on the device while the host copy decodes cleanly " \
               "(it was altered on the way in)"

    def corrupt(self, item: Item, problem: str) -> CorruptDataError:
        info = item.info
        hint = "" if self.sw.checksum else " checksum=True (cswap.patch option) checks every byte end to end."
        return CorruptDataError(
            f"cswap: the offloaded copy of the {info.op} output of {info.where} "
            f"[{str(info.dtype).removeprefix('torch.')} {list(info.shape)}] is corrupt: {problem}. Backward "
            f"stops here rather than compute gradients from wrong values; the host memory or the PCIe link altered "
            f"it (check the machine: ECC errors, dmesg).{hint}")


def restore_footprint(item: Item) -> int:
    """Device bytes a restore holds while ahead of use: the tensor, and a compressed one's
    payload until decoded."""
    payload = item.moved if item.header is not None else 0
    return item.info.nbytes + payload


def write_verdict(verdict: torch.Tensor, bad: torch.Tensor | None, total: torch.Tensor | None) -> None:
    """A restore's verdict, two int64 words on the device: whether the decoder found the payload
    inconsistent and the restored bytes' checksum (0 where not computed). Device tensors and
    `fill_` only: on CUDA, torch 2.11 copies a Python number assigned to an element
    (`words[1] = 0`) from pageable host memory, which waits for the stream; on the H200 that
    held autograd's thread in every decode until the restore had landed (2026-12-04)."""
    for word, value in zip(verdict.view(torch.int64), (bad, total)):
        if value is None:
            word.fill_(0)
        else:
            word.copy_(value)
