"""The runtime's synchronisation points, by name, each switchable off for tests.

Every wait, event synchronize or query, and record_stream the runtime relies
on for correctness goes through the device seam with one of these names
(`at=`). A test can switch one off (`switched_off(name)`) and check that an
emulator test then fails: a point no test misses is either redundant or
untested. Registering a name here is the only way to add a point, and the
mutation test lists these names, so a new point cannot go untested.
"""

from __future__ import annotations

from contextlib import contextmanager

__all__ = ["POINTS", "active", "switched_off"]

POINTS = {
    "offload.compress_after_ready":
        "the codec stream waits for the event recorded at pack: the tensor has been computed",
    "offload.sizes_landed":
        "the sender reads an encode's sizes (to size its copy out and write its header) only once their "
        "copy to the host has completed",
    "offload.copy_after_ready":
        "the copy-out stream waits for the event recorded at pack before copying a raw tensor",
    "offload.copy_after_compress":
        "the copy-out stream waits for the encode of the bytes it copies",
    "offload.record_kept":
        "a tensor kept on the device at the host memory limit, after the codec stream read it (to "
        "compress it), is record_stream()ed to that stream: its memory is not recycled while "
        "that read runs",
    "release.copy_done":
        "the releaser drops a saved tensor only after its copy out has completed",
    "pack.stash_full":
        "pack, with the stash full, waits for the oldest copy out to complete before going on",
    "restore.decode_after_copy_in":
        "the codec stream waits for the copy in of the payload it decodes",
    "restore.record_payload":
        "a payload copied in on the H2D stream is record_stream()ed to the codec stream that reads it: its "
        "memory is not recycled by the next copy in while the decode runs",
    "restore.record_restored":
        "a tensor restored on a side stream is record_stream()ed to compute, which uses and frees it: its "
        "memory is not recycled by the next restore while compute may still read it",
    "unpack.compute_after_copy_in":
        "compute waits for the item's restore (copy in, and decode) before backward uses the tensor",
    "unpack.verdict_landed":
        "the host reads an item's decoder and checksum verdict only once its restore has completed (queried "
        "at later unpacks, waited for at the end of backward)",
    "host_pool.buffer_free":
        "a host buffer is reused only once the last copy that read or wrote it has completed",
}

_off: set[str] = set()


def active(name: str) -> bool:
    """Whether the point `name` synchronises (always, outside tests)."""
    if name not in POINTS:
        raise KeyError(f"cswap.runtime.sync: unknown synchronisation point {name!r}; register it in POINTS")
    return name not in _off


@contextmanager
def switched_off(name: str):
    """Skip the synchronisation at `name` inside this block (a mutation test)."""
    active(name)
    _off.add(name)
    try:
        yield
    finally:
        _off.discard(name)
