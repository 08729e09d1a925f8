"""What the CUDA path asks of CUDA per tensor, counted on the CPU (issue 39).

On a GPU's host each seam call is a CUDA call (an API call or the caching allocator:
microseconds each, three times that in situ on an H200), so the runtime's fixed cost per
tensor is its count of them. cswap.runtime.trace.seam_calls counts every call a device
answers, by the stage that made it. The chain of the issue (60 Linear + ReLU layers, 256
wide, every activation a candidate) in steady state, on the devices of the seam that
stand for CUDA: at most 4 CUDA calls and 0.25 events recorded per offloaded tensor, and
none per tensor kept.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cswap
from cswap.runtime.device import CudaDevice
from cswap.runtime.emulator import EmulatedDevice, activate
from cswap.runtime.immediate import ImmediateDevice
from cswap.runtime.trace import per_tensor, seam_calls

pytestmark = pytest.mark.filterwarnings("ignore:.*saves no memory:RuntimeWarning")


def _chain(layers: int = 60, width: int = 256) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def _emulated() -> EmulatedDevice:
    """The emulated device with CUDA's window floor (its own is none: the tests of windows
    run small networks on it)."""
    dev = EmulatedDevice(bandwidth_gbps=50.0, log=False)
    dev.window_floor_bytes = CudaDevice.window_floor_bytes
    return dev


DEVICES = {
    "lagging": lambda: ImmediateDevice(latency_s=20e-6),  # events complete 20 us late, as a tiny copy's on a GPU
    "emulated": _emulated,
}


def _steady_counts(mode: str, device: str, steps: int = 3, **options):
    model, x = _chain(), torch.randn(64, 256)
    dev = DEVICES[device]()
    with activate(dev):
        cswap.patch(model, mode=mode, candidates="all", min_bytes=0, verbose=False, **options)
        for _ in range(3):  # the timed pass, then two steps: steady state
            model(x).sum().backward()
        cswap.stats(model).reset()
        with seam_calls(dev) as counts:
            for _ in range(steps):
                model(x).sum().backward()
            swapper = cswap.patch.__globals__["_PATCHED"][model].swapper
            swapper.synchronize()
        stats = dict(cswap.stats(model))
        cswap.unpatch(model)
    if isinstance(dev, EmulatedDevice):
        assert dev.hazards == []
        dev.close()
    return counts, stats


@pytest.mark.parametrize("device", list(DEVICES))
@pytest.mark.parametrize("mode", ["vdnn", "cswap"])
def test_an_offloaded_tensor_costs_at_most_4_cuda_calls_and_a_quarter_of_an_event(mode, device):
    counts, stats = _steady_counts(mode, device)
    offloaded = stats["offloaded_tensors"]
    assert offloaded == 3 * 60  # every ReLU output (the next Linear's save shares it)
    per = per_tensor(counts, offloaded)
    assert per["cuda_calls"] <= 4.0, per
    assert per["events"] <= 0.25, per
    # the capture check is asked once per phase, not per save and use
    assert per["by_call"].get("capturing", 0.0) <= 0.05, per


def test_a_kept_tensor_costs_no_cuda_call():
    """min_bytes above every tensor: each save is kept at once, asking CUDA nothing."""
    model, x = _chain(), torch.randn(64, 256)
    dev = ImmediateDevice(latency_s=20e-6)
    with activate(dev):
        cswap.patch(model, mode="vdnn", min_bytes=1 << 40, verbose=False)
        for _ in range(5):  # (the profiler times the first steps until one offloads, 4 at most)
            model(x).sum().backward()
        with seam_calls(dev) as counts:
            model(x).sum().backward()
        cswap.unpatch(model)
    assert sum(counts.values()) == 0, counts


def test_the_counts_name_each_stage():
    counts, stats = _steady_counts("vdnn", "lagging", steps=1)
    stages = {where for where, _ in counts}
    assert {"send", "prefetch"} <= stages, counts  # raw groups: sent from pack, restored ahead of use
    per = per_tensor(counts, stats["offloaded_tensors"])
    assert per["cuda_calls"] == pytest.approx(sum(v for k, v in per.items() if k.endswith("_calls")
                                                  and k != "cuda_calls"))
