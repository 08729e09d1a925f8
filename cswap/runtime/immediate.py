"""A device whose every operation completes at once, on the calling thread, checking nothing.

It is what CPU tensors use outside `cswap.testing.emulated_device()`: the runtime
runs its full CUDA code path (events, streams, the host pool, the worker and the
releaser) at the cost of the runtime's own Python and nothing more. Copies are made
when they are queued, device work runs when it is launched, events are complete when
recorded, and waits return at once; no memory is counted (memory_allocated() is 0)
and no race is looked for. So it also stands for the CUDA path's own host cost per
saved tensor (benchmarks/overhead.py): on a GPU the same calls queue work instead.
With `latency_s`, an event completes that long after it is recorded (a query says
False until then, a synchronisation sleeps): as a tiny copy on a GPU, which sends
releases through the releaser thread as on CUDA.

For ordering checks, late copies, poisoned memory and memory accounting, use the
emulated device (cswap.runtime.emulator), which CI runs the runtime's tests against.
"""

from __future__ import annotations

import time

import torch

from .device import SIDE_STREAMS, Device

__all__ = ["ImmediateDevice"]


class _Stream:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class _Event:
    """Complete `latency` seconds after it is made; `time` is when it was made (for elapsed_s)."""

    __slots__ = ("time",)

    def __init__(self):
        self.time = time.perf_counter()


class ImmediateDevice(Device):
    kind = "immediate"
    window_floor_bytes = 16 << 20  # as CUDA's: it stands for the CUDA path's host cost
    alignment = 64  # PyTorch's CPU allocator's (c10 gAlignment)

    def __init__(self, latency_s: float = 0.0):
        if not latency_s >= 0:
            raise ValueError(f"cswap.runtime: latency_s must be >= 0 seconds, got {latency_s!r}")
        self.latency_s = float(latency_s)
        self.device = torch.device("cpu")
        self._compute = _Stream("compute")
        self._streams = {role: _Stream(role) for role in SIDE_STREAMS}

    def __repr__(self) -> str:
        return "<cswap immediate device: every operation completes at once>"

    # -- streams and events: all complete -----------------------------------------------------
    def compute_stream(self):
        return self._compute

    def side_stream(self, role: str):
        stream = self._streams.get(role)
        if stream is None:
            raise ValueError(f"cswap.runtime: unknown stream role {role!r}")
        return stream

    def record_event(self, stream, timing: bool = False, reuse=None):
        if reuse is not None:
            reuse.time = time.perf_counter()
            return reuse
        return _Event()

    def wait_event(self, stream, event, at: str) -> None:
        pass

    def wait_stream(self, stream, other, at: str) -> None:
        pass

    def event_synchronize(self, event, at: str) -> None:
        if self.latency_s:
            left = event.time + self.latency_s - time.perf_counter()
            if left > 0:
                time.sleep(left)

    def event_query(self, event, at: str) -> bool:
        return not self.latency_s or time.perf_counter() >= event.time + self.latency_s

    def elapsed_s(self, start, end) -> float | None:
        if not (self.event_query(start, "") and self.event_query(end, "")):
            return None
        return end.time - start.time

    def record_stream(self, tensor: torch.Tensor, stream, at: str) -> None:
        pass

    def synchronize(self) -> None:
        pass

    # -- work: done now ---------------------------------------------------------------------------
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        dst.copy_(src)

    def copy_all(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], stream) -> None:
        torch._foreach_copy_(dsts, srcs)

    def launch(self, stream, fn, reads=(), writes=(), work=None, scratch_bytes: int = 0) -> None:
        fn()

    def call(self, stream, fn, reads=(), writes=(), scratch_bytes: int = 0, work=None):
        return fn()

    # -- memory: plain CPU tensors, nothing counted --------------------------------------------------
    def empty(self, nbytes: int, stream) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def empty_as(self, nbytes: int, dtype: torch.dtype, shape, stream, stride=None, lead: int = 0) -> torch.Tensor:
        if lead:
            return super().empty_as(nbytes, dtype, shape, stream, stride, lead)
        if stride is None:
            return torch.empty(shape, dtype=dtype)
        return torch.empty_strided(shape, stride, dtype=dtype)

    def host_empty(self, nbytes: int, pinned: bool) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def memory_allocated(self) -> int:
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def memory_reserved(self) -> int:
        return 0

    def max_memory_reserved(self) -> int:
        return 0

    def reset_peak(self) -> None:
        pass

    def total_memory(self) -> int | None:
        return None

    def usable_memory(self) -> int | None:
        return None
