"""cswap's stages as ranges in a torch.profiler trace.

While a profiler records on the calling thread (torch.autograd._profiler_enabled(), one C
call), or everywhere inside `on_every_thread()`, each stage of an offloaded tensor's
journey runs inside `torch.profiler.record_function("cswap.<stage>")`, so a Chrome trace
shows the host's time in each beside the device's streams: pack and unpack (the training
thread's save and use), encode (the worker queueing compressions), send (queueing copies
out: the sender, or whoever sends raw groups), copy_wait (the releaser waiting for a copy
out), release (dropping device tensors, wherever it happens), prefetch and restore
(backward's). The profiler records cswap's own threads only with
`experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)`,
and under it no thread's check says a profiler records (torch 2.11 to 2.14): the ranges
are then made only inside on_every_thread(). Otherwise a stage costs one call and no range.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["on_every_thread", "stage"]

_OFF = contextlib.nullcontext()
_everywhere = False


def stage(name: str):
    """A context: the range "cswap.<name>" while a profiler records, else nothing."""
    if _everywhere or torch.autograd._profiler_enabled():
        return torch.autograd.profiler.record_function("cswap." + name)
    return _OFF


@contextlib.contextmanager
def on_every_thread():
    """Within it, every thread's stages are ranges (for a profiler of all threads)."""
    global _everywhere
    _everywhere = True
    try:
        yield
    finally:
        _everywhere = False
