"""cswap's stages, as profiler ranges or as the stage each seam call is counted under.

While a profiler records on the calling thread (torch.autograd._profiler_enabled(), one C
call), or everywhere inside `on_every_thread()`, each stage of an offloaded tensor's
journey runs inside `torch.profiler.record_function("cswap.<stage>")`, so a Chrome trace
shows the host's time in each beside the device's streams: pack and unpack (the training
thread's save and use), encode (the worker queueing compressions), send (queueing copies
out: the sender, or whoever sends raw groups), copy_wait (the releaser waiting for a copy
out), release (dropping device tensors, wherever it happens), prefetch and restore
(backward's). The profiler records cswap's own threads only with
`experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)`,
and under it no thread's check says a profiler records (torch 2.11 to 2.15): the ranges
are then made only inside on_every_thread().

Inside `seam_calls(dev)`, the stages instead name where each of the device's seam calls
was made (cswap.runtime.device: what a GPU's host pays CUDA for), counted per stage:
benchmarks/overhead.py's calls per tensor, and the tests that hold them.
Otherwise a stage costs one call and no range.
"""

from __future__ import annotations

import collections
import contextlib
import threading

import torch

__all__ = ["CUDA_CALLS", "LOOKUPS", "on_every_thread", "per_tensor", "seam_calls", "stage"]

# The seam's calls that reach CUDA on a GPU (an API call, or the caching allocator), and
# the two stream lookups, which the CUDA device answers from a cache.
CUDA_CALLS = ("capturing", "record_event", "wait_event", "wait_stream", "event_synchronize", "event_query",
              "elapsed_s", "record_stream", "synchronize", "copy", "copy_all", "launch", "call", "empty", "empty_as",
              "host_empty")
LOOKUPS = ("compute_stream", "side_stream")

_OFF = contextlib.nullcontext()
_everywhere = False
_counting = 0          # seam_calls blocks open
_where = threading.local()  # .stages: the calling thread's open stages, innermost last


def stage(name: str):
    """A context: the range "cswap.<name>" while a profiler records, the stage seam calls
    are counted under inside seam_calls(), else nothing."""
    if _counting:
        return _Counted(name)
    if _everywhere or torch.autograd._profiler_enabled():
        return torch.autograd.profiler.record_function("cswap." + name)
    return _OFF


class _Counted:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        stages = getattr(_where, "stages", None)
        if stages is None:
            stages = _where.stages = []
        stages.append(self.name)

    def __exit__(self, *exc):
        _where.stages.pop()


def _current() -> str:
    stages = getattr(_where, "stages", None)
    return stages[-1] if stages else "other"


@contextlib.contextmanager
def on_every_thread():
    """Within it, every thread's stages are ranges (for a profiler of all threads)."""
    global _everywhere
    _everywhere = True
    try:
        yield
    finally:
        _everywhere = False


@contextlib.contextmanager
def seam_calls(dev):
    """Within it, count each seam call `dev` answers, by the stage that made it (on any
    thread): a Counter of (stage, call) -> calls, plus ("*", "timing events") for events
    recorded with timing on. Calls made outside every stage count under "other"."""
    global _counting
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()

    inside = threading.local()  # .depth: seam calls open on this thread (a device's calls made by its own)

    def counted(name, call):
        def call_counted(*args, **kwargs):
            depth = getattr(inside, "depth", 0)
            if not depth:  # (the runtime's call, not one the device makes to serve it)
                with lock:
                    counts[(_current(), name)] += 1
                    if name == "record_event" and (kwargs.get("timing") or (len(args) > 1 and args[1])):
                        counts[("*", "timing events")] += 1
            inside.depth = depth + 1
            try:
                return call(*args, **kwargs)
            finally:
                inside.depth = depth
        return call_counted

    names = CUDA_CALLS + LOOKUPS
    for name in names:
        setattr(dev, name, counted(name, getattr(dev, name)))
    _counting += 1
    try:
        yield counts
    finally:
        _counting -= 1
        for name in names:
            delattr(dev, name)  # (the class's methods again)


def per_tensor(counts: collections.Counter, tensors: int) -> dict:
    """Calls per tensor: each stage's CUDA calls, every CUDA call, events recorded (timing
    ones apart) and the stream lookups."""
    out: dict = {}
    for (where, name), n in counts.items():
        if name in CUDA_CALLS:
            out[f"{where}_calls"] = out.get(f"{where}_calls", 0.0) + n / tensors
    cuda = sum(n for (where, name), n in counts.items() if name in CUDA_CALLS)
    out["cuda_calls"] = cuda / tensors
    out["events"] = sum(n for (_, name), n in counts.items() if name == "record_event") / tensors
    out["timing_events"] = counts[("*", "timing events")] / tensors
    out["lookups"] = sum(n for (_, name), n in counts.items() if name in LOOKUPS) / tensors
    out["by_call"] = {name: sum(n for (_, c), n in counts.items() if c == name) / tensors
                      for name in CUDA_CALLS + LOOKUPS if any(c == name for (_, c) in counts)}
    return out
