"""cswap's stages as profiler ranges (cswap.runtime.trace), what the GPU trace stage reads."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import cswap
from cswap.runtime import trace
from cswap.testing import emulated_device
from cswap.patch import _PATCHED

pytestmark = pytest.mark.filterwarnings("ignore:.*saves no memory:RuntimeWarning")


def _profiled_step(mode: str, everywhere: bool) -> set[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    x = torch.randn(32, 64)
    with emulated_device(bandwidth_gbps=math.inf):  # (copies done at once: released at saves)
        cswap.patch(model, mode=mode, min_bytes=0, verbose=False)
        model(x).sum().backward()  # warm-up
        if everywhere:  # every thread recorded, cswap's stages ranges on each
            config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                        experimental_config=config) as prof, trace.on_every_thread():
                loss = model(x).sum()
                _PATCHED[model].swapper.synchronize()  # every copy out done: released in this step, not raced by backward
                loss.backward()
        else:  # the training thread's, as a profiler records by default
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                model(x).sum().backward()
        cswap.unpatch(model)
    return {e.name for e in prof.events() if e.name.startswith("cswap.")}


@pytest.mark.parametrize("mode", ["vdnn", "sc"])
def test_every_stage_is_a_range_in_a_profile_of_every_thread(mode):
    names = _profiled_step(mode, everywhere=True)
    assert {"cswap.pack", "cswap.send", "cswap.release", "cswap.unpack", "cswap.prefetch"} <= names, names
    assert ("cswap.encode" in names) == (mode == "sc"), names  # (raw tensors need no encode)


def test_without_on_every_thread_only_the_profiled_threads_stages_are_ranges():
    names = _profiled_step("sc", everywhere=False)
    assert {"cswap.pack", "cswap.unpack", "cswap.prefetch"} <= names, names
    assert not names & {"cswap.encode", "cswap.copy_wait"}, names  # the worker's and the releaser's


def test_a_stage_costs_no_range_without_a_profiler():
    assert trace.stage("pack") is trace.stage("unpack")  # the one shared no-op context
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert trace.stage("pack") is not trace.stage("pack")
