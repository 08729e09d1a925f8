"""The training thread's time per offloaded tensor on this machine (issue 26).

Every tensor cswap offloads costs the training thread some microseconds in its
hooks: records, events, a copy queued, a buffer from the pool. With tensors small
enough, that cost rather than the link bounds a step, so the planners count it
(cswap.plan.advisor.host_seconds). cswap-tune measures it here and writes it into
the profile as runtime.host_us_per_tensor: a chain of Linear + ReLU layers on tiny
tensors (copies cost nothing, so what is left is the host), trained unpatched and
with cswap in vdnn mode, step by step in turn; the difference of the fastest steps per
offloaded tensor (each layer's ReLU output; the next Linear's save shares it), plus
that of the garbage collector's mean time per step (its pauses fall in few steps,
which the fastest step leaves out, but the objects a step makes cause them; full collections
off, which would fall on whichever model ran then).

benchmarks/overhead.py measures the same chain against more providers and devices.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings

import torch
from torch import nn

__all__ = ["GcClock", "chain", "time_steps", "young_collections_only", "host_seconds_per_tensor"]


def chain(layers: int, width: int) -> nn.Module:
    """`layers` Linear + ReLU pairs of width x width (seeded: every provider trains the same)."""
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class GcClock:
    """Seconds spent in Python's garbage collector while on (gc.callbacks). `outside` is the
    wall clock less those seconds: steps are timed without the collector's pauses,
    which a median would hide (a collection every few steps, a full one every few
    hundred), and the pauses are counted apart, as a mean over all steps. A pause is the
    collecting thread's CPU time, not the wall's: on a busy machine a collection the
    scheduler preempts would otherwise count milliseconds that other processes ran."""

    def __init__(self):
        self.seconds, self._start = 0.0, None
        self.collections = [0, 0, 0]          # per generation (2: full collections)
        self.seconds_by = [0.0, 0.0, 0.0]

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.thread_time()
        elif self._start is not None:
            took = time.thread_time() - self._start
            self.seconds += took
            self.collections[info["generation"]] += 1
            self.seconds_by[info["generation"]] += took
            self._start = None

    def outside(self) -> float:
        return time.perf_counter() - self.seconds

    @contextlib.contextmanager
    def on(self):
        gc.callbacks.append(self)
        try:
            yield self
        finally:
            gc.callbacks.remove(self)


@contextlib.contextmanager
def young_collections_only():
    """Python's full collections off while timing: when one comes depends on every object
    the process holds (each provider's, the benchmark's, torch's), so it would fall on
    whichever provider ran then. The young generations' collections come from a step's
    own objects, and each provider's count as its own (the gc column)."""
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], 1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def time_steps(model: nn.Module, context, x: torch.Tensor, steps: int,
               clock=time.perf_counter) -> tuple[list[float], list[float]]:
    """Each step's forward and backward seconds on the host (by `clock`). On CUDA each
    step starts and ends with a device synchronize (inside backward's figure), so
    forward's is the host's time alone."""
    forward, backward = [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        _synchronize(x.device)
        with context():
            start = clock()
            loss = model(x).sum()
            mid = clock()
            loss.backward()
            _synchronize(x.device)
            end = clock()
        del loss
        forward.append(mid - start)
        backward.append(end - mid)
    return forward, backward


def host_seconds_per_tensor(device: torch.device, layers: int = 50, width: int = 64, batch: int = 32,
                            steps: int = 10, rounds: int = 3, warmup: int = 3, attempts: int = 3) -> float | None:
    """Seconds the training thread adds per offloaded tensor, pack and unpack together:
    cswap's vdnn mode against unpatched, on `device`. Each side's fastest step is the
    estimate, since other work on the machine only ever adds time (a median there swung
    by milliseconds under a parallel test run). A difference that noise still pushes to
    zero or below is measured again, with twice the steps, up to `attempts` times; None
    if every attempt did (the machine too busy to tell: a zero would tell the planners
    that offloading costs the host nothing)."""
    for attempt in range(attempts):
        added = _added_seconds(torch.device(device), layers, width, batch, steps << attempt, rounds, warmup)
        if added > 0:
            return added / layers
    return None


def _added_seconds(device: torch.device, layers: int, width: int, batch: int, steps: int, rounds: int,
                   warmup: int) -> float:
    import cswap  # (here: cswap imports this package)

    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(0)).to(device)
    plain = chain(layers, width).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "on CPU this saves no memory"
        patched = cswap.patch(chain(layers, width).to(device), mode="vdnn", candidates="all", min_bytes=0,
                              verbose=False)
        try:
            steps_s = {"unpatched": [], "vdnn": []}
            collecting = {"unpatched": GcClock(), "vdnn": GcClock()}
            for model in (plain, patched):
                time_steps(model, contextlib.nullcontext, x, warmup)
            for _ in range(rounds * steps):  # alternate step by step: the machine's load falls on both alike
                for name, model in (("unpatched", plain), ("vdnn", patched)):
                    with collecting[name].on(), young_collections_only():
                        forward, backward = time_steps(model, contextlib.nullcontext, x, 1,
                                                       clock=collecting[name].outside)
                    steps_s[name] += [f + b for f, b in zip(forward, backward)]
        finally:
            cswap.unpatch(patched)
    added = min(steps_s["vdnn"]) - min(steps_s["unpatched"])
    return added + (collecting["vdnn"].seconds - collecting["unpatched"].seconds) / (rounds * steps)
