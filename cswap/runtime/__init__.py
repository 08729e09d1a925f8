"""The swapping runtime behind cswap.patch: saved tensors out to host memory and back.

    swapper.py    pack: which saved tensors leave, with which codec; the books
    offload.py    the copy out (worker thread) and the release after it (releaser)
    restore.py    prefetch, copy in, decode and verify for backward
    items.py      what is kept per saved tensor
    host_pool.py  pinned host buffers, reused
    device.py     the device seam: CUDA, or ...
    emulator.py   ... an asynchronous device emulated on CPU (cswap.testing.emulated_device)
    sync.py       the named synchronisation points, switchable off for mutation tests
    candidates.py, layers.py, stats.py, integrity.py
"""

from .swapper import Swapper

__all__ = ["Swapper"]
