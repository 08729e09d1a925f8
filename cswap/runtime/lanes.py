"""One device's lanes: its side streams and every wait and event between them.

An offloaded tensor travels through the device in stages, each on a stream of
its own, and each stage waits for the one before it with an event. Every such
wait, and every event the runtime records, is made here and named (the
synchronisation points of cswap.runtime.sync), so they can be read in one
place:

    forward                                   backward
    compute   the tensor is computed (ready)  h2d      copy in, after nothing
    codec     encode, after ready             codec    decode, after the copy in
    d2h       copy out, after ready/encode    compute  backward's use, after the
                                                       copy in (raw) or decode

(Encodes and decodes share the codec stream: they run in different passes, and
memory the caching allocator caches for one stream serves only that stream.)

What no stream wait orders is kept safe by keeping memory alive instead: a
restored tensor is allocated on the stream that writes it and recorded for
compute, which uses and frees it (its block is not recycled while compute may
still read it); a payload read by another stream is recorded for that stream.

Events come from a small pool: an event nothing else refers to any more (its
only reference is the pool's; CPython's reference count says so exactly) is
recorded again instead of made anew. Re-recording is safe on CUDA whatever the
event's state: waits already queued captured what they wait for.
"""

from __future__ import annotations

import sys
import threading

import torch

from .device import Device, Work

__all__ = ["Lanes", "lanes_of"]

_POOL = 64    # events kept for reuse, per device
_LOOK = 4     # the oldest this many are looked at for one free to reuse
_FREE = 2     # references of an event only the pool holds: the pool's list and getrefcount's argument


class Lanes:
    """The side streams of one device and the waits between them (module docstring)."""

    def __init__(self, dev: Device):
        self.dev = dev
        self._events: list = []
        self._lock = threading.Lock()

    # -- streams -------------------------------------------------------------------------------

    @property
    def codec(self):
        """Encodes in forward and decodes in backward: one stream, so that one pool of the
        caching allocator serves both (a decode's output takes the block a payload left)."""
        return self.dev.side_stream("codec")

    @property
    def d2h(self):
        return self.dev.side_stream("d2h")

    @property
    def h2d(self):
        return self.dev.side_stream("h2d")

    # -- events -----------------------------------------------------------------------------------

    def record(self, stream, timing: bool = False):
        """An event recorded on `stream` now: one from the pool nobody refers to, else a new
        one. (Timing events, for the few restores backward waits for, are not pooled.)"""
        if timing:
            return self.dev.record_event(stream, timing=True)
        reuse = None
        events = self._events
        with self._lock:
            for i in range(min(_LOOK, len(events))):
                if sys.getrefcount(events[i]) == _FREE:
                    reuse = events.pop(i)
                    break
        event = self.dev.record_event(stream, reuse=reuse)
        with self._lock:
            events.append(event)
            if len(events) > _POOL:
                del events[0]
        return event

    def computed(self):
        """The event at which compute has made what it made so far (a saved tensor)."""
        return self.record(self.dev.compute_stream())

    # -- forward ----------------------------------------------------------------------------------

    def encode(self, ready, fn, reads, writes, work: Work, read_back=None, scratch_bytes: int = 0):
        """Queue an encode on the codec stream after `ready`: the
        tensor it reads has been computed; with `read_back` = (host, device), then copy the
        few words it left on the device (its sizes) to pinned host memory. Its event: the
        payload is written (and the sizes are on the host). `scratch_bytes`: what it
        allocates beside `writes` while it runs (a codec's launch_scratch_bytes)."""
        dev, stream = self.dev, self.codec
        dev.wait_event(stream, ready, at="offload.compress_after_ready")
        dev.launch(stream, fn, reads=reads, writes=writes, work=work, scratch_bytes=scratch_bytes)
        if read_back is not None:
            dev.copy(*read_back, stream)
        return self.record(stream)

    def encode_now(self, ready, fn, reads, scratch_bytes: int, work: Work):
        """An encode whose codec reads its size back itself: run on the codec stream
        after `ready`, the calling thread waiting for it (the one blocking read, off the
        thread that queues compressions). Its value, and the event of its end."""
        dev, stream = self.dev, self.codec
        dev.wait_event(stream, ready, at="offload.compress_after_ready")
        value = dev.call(stream, fn, reads=reads, scratch_bytes=scratch_bytes, work=work)
        return value, self.record(stream)

    def copy_out(self, dsts, srcs, after, prepared: bool):
        """Queue copies to the host on D2H after `after` (the ready event of raw tensors,
        or, `prepared`, the event of the encode that made them); their event."""
        dev, stream = self.dev, self.d2h
        dev.wait_event(stream, after, at="offload.copy_after_compress" if prepared else "offload.copy_after_ready")
        if len(dsts) == 1:
            dev.copy(dsts[0], srcs[0], stream)
        else:
            dev.copy_all(dsts, srcs, stream)
        return self.record(stream)

    def checksum_out(self, dst: torch.Tensor, data: torch.Tensor, fn) -> None:
        """Take the checksum of bytes being sent, on D2H after their copy, into `dst` (host)."""
        dev, stream = self.dev, self.d2h
        total = dev.empty(8, stream)
        dev.launch(stream, lambda: fn(total), reads=[data], writes=[total], work=Work("checksum", None, data.numel()))
        dev.copy(dst, total, stream)

    def keep_while_read(self, tensor: torch.Tensor) -> None:
        """A saved tensor stays on the device after the codec stream read it (no
        host memory for it): its memory is not recycled while that read runs."""
        self.dev.record_stream(tensor, self.codec, at="offload.record_kept")

    # -- backward ---------------------------------------------------------------------------------

    def alloc_in(self, nbytes: int, dtype, shape, stride=None, stream=None, lead: int = 0) -> torch.Tensor:
        """A tensor to restore into, on the stream that writes it (H2D unless given), `lead`
        bytes into its allocation (Item.lead)."""
        return self.dev.empty_as(nbytes, dtype, shape, stream or self.h2d, stride, lead)

    def copy_in(self, dsts, srcs, timing: bool = False):
        """Queue copies from the host on H2D (their destinations were allocated there, so
        nothing else on the device can still be using them); their event."""
        dev, stream = self.dev, self.h2d
        if len(dsts) == 1:
            dev.copy(dsts[0], srcs[0], stream)
        else:
            dev.copy_all(dsts, srcs, stream)
        return self.record(stream, timing=timing)

    def decode_after(self, landed, fn, reads, writes, work: Work, verdict: torch.Tensor, host_verdict: torch.Tensor,
                     timing: bool = False):
        """Queue a decode on the codec stream after the copy in of its payload (`landed`),
        and the copy of its verdict to the host; the event: the tensor and verdict are there."""
        dev, stream = self.dev, self.codec
        dev.wait_event(stream, landed, at="restore.decode_after_copy_in")
        dev.launch(stream, fn, reads=reads, writes=writes, work=work)
        dev.record_stream(reads[0], stream, at="restore.record_payload")  # (the payload: H2D's memory)
        dev.copy(host_verdict, verdict, stream)
        return self.record(stream, timing=timing)

    def check_after(self, landed_stream, fn, reads, writes, verdict: torch.Tensor, host_verdict: torch.Tensor,
                    timing: bool = False):
        """Queue a check of restored bytes (their checksum) on the stream that restored
        them, and the copy of its verdict to the host; the event."""
        dev = self.dev
        dev.launch(landed_stream, fn, reads=reads, writes=writes, work=Work("checksum", None, reads[0].numel()))
        dev.copy(host_verdict, verdict, landed_stream)
        return self.record(landed_stream, timing=timing)

    def hand_to_compute(self, restored) -> None:
        """Tensors restored on a side stream are used and freed by compute: their memory
        is not recycled before compute's work on them (queued from now on) completes."""
        dev = self.dev
        compute = dev.compute_stream()
        for tensor in restored:
            dev.record_stream(tensor, compute, at="restore.record_restored")

    def use(self, done) -> None:
        """Compute waits for a restore (its copy in, or its decode) before using it."""
        dev = self.dev
        dev.wait_event(dev.compute_stream(), done, at="unpack.compute_after_copy_in")


def lanes_of(dev: Device) -> Lanes:
    """The device's Lanes, made once."""
    lanes = dev.__dict__.get("_lanes")
    if lanes is None:
        lanes = dev.__dict__.setdefault("_lanes", Lanes(dev))
    return lanes
