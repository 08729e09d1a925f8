"""Test your training code's offloading on CPU, against an emulated GPU.

    with cswap.testing.emulated_device(bandwidth_gbps=1.0, jitter=0.001) as dev:
        model = cswap.patch(model, mode="vdnn")
        loss_fn(model(x), y).backward()          # CPU tensors, the CUDA code path
        print(dev.peak_bytes, dev.hazards)

Inside the block, cswap.patch and cswap.offload offload CPU tensors through
the same code that runs on a GPU (side streams, events, pinned buffers,
record_stream, prefetch, release after the copy), against an asynchronous
device emulated on CPU: copies finish bytes / bandwidth (plus jitter) after
they start, freed memory is poisoned as CUDA's caching allocator would reuse
it, and a race detector records every access that no synchronisation orders
(`dev.hazards`, and the data it touched is poisoned, so gradients go wrong as
they would on a GPU). See cswap.runtime.emulator for what it models and what
it does not.

`dev.live_bytes`, `dev.peak_bytes` and `dev.reset_peak()` report the device
bytes held by saved activations (patched or not: the block counts what
autograd saves outside cswap too) and by cswap's own device buffers, which is
what offloading can reduce.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .runtime.candidates import movable
from .runtime.emulator import EmulatedDevice, activate
from .runtime.twin import ComputeClock, TimedDevice, TwinSpec
from .runtime.hook_context import mark
from .runtime.items import Kept, modified_error
from .runtime.swapper import held_for_backward

__all__ = ["emulated_device", "timed_twin", "EmulatedDevice", "TimedDevice", "TwinSpec"]


@contextmanager
def emulated_device(bandwidth_gbps: float = 12.0, jitter: float = 0.0, seed: int = 0,
                    capacity_bytes: int | None = None, pin_latency_s: float = 0.0, compute_lag_s: float = 0.0):
    """An emulated asynchronous device for the CPU tensors offloaded inside the block.

    bandwidth_gbps: copy speed each way (GB/s, 1e9 bytes; math.inf for instant
    copies); jitter: up to this many seconds added to each copy, drawn from a
    generator seeded with `seed`; capacity_bytes: device memory, beyond which
    an allocation raises torch.OutOfMemoryError (None: unlimited);
    pin_latency_s: the time each new pinned host allocation takes;
    compute_lag_s: how far the compute stream runs behind the host (an event
    recorded on it completes that many seconds later), as a GPU's does.
    """
    dev = EmulatedDevice(bandwidth_gbps=bandwidth_gbps, jitter=jitter, seed=seed, capacity_bytes=capacity_bytes,
                         pin_latency_s=pin_latency_s, compute_lag_s=compute_lag_s)
    with _serving(dev):
        yield dev


@contextmanager
def timed_twin(spec: TwinSpec | None = None, model: torch.nn.Module | None = None, seed: int = 0,
               capacity_bytes: int | None = None):
    """The emulated device on a GPU's virtual clock (cswap.runtime.twin): inside the
    block, the model's ops, cswap's copies and codec kernels and the host's own work
    take the time they would on the GPU of `spec` (default TwinSpec.measured(): the
    H200 measured on 2026-11-26), and `dev.now()` reads the calling thread's clock. With
    spec.scale, a small batch stands for one `scale` times larger (`model`: whose
    parameters do not grow with it). A step's time on that GPU:

        with cswap.testing.timed_twin(TwinSpec.measured(scale=80), model) as dev:
            ...; dev.synchronize(); t0 = dev.now(); step(); dev.synchronize(); seconds = dev.now() - t0
    """
    dev = TimedDevice(spec or TwinSpec.measured(), seed=seed, capacity_bytes=capacity_bytes)
    with _serving(dev), ComputeClock(dev, model):
        yield dev


@contextmanager
def _serving(dev: EmulatedDevice):
    """`dev` serves the CPU tensors offloaded inside the block, and counts what autograd
    saves outside cswap's hooks too; closed at the end."""

    def pack(t: torch.Tensor) -> Kept:  # saves outside cswap's hooks count too (an unpatched model's)
        if movable(t) and t.device.type == "cpu" and held_for_backward(t):
            dev.on_saved(t)
        return Kept(t)  # a detached alias: no cycle through an output's own grad_fn

    def unpack(kept: Kept) -> torch.Tensor:  # autograd's in-place check, which hooks turn off
        if kept.tensor._version != kept.version:
            raise modified_error(f"[{kept.tensor.dtype} {list(kept.tensor.shape)}]", kept.version,
                                 kept.tensor._version)
        return kept.tensor

    mark(pack)  # (cswap's own: a patched model inside the block offloads as usual)
    try:
        with activate(dev), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield dev
    finally:
        dev.close()
