"""The user-facing runtime API: patch, unpatch, offload, stats."""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch import nn

from .layers import LayerTracker
from .stats import SwapStats
from .swapper import Swapper

__all__ = ["patch", "unpatch", "offload", "stats"]

_PATCHED: "weakref.WeakKeyDictionary[nn.Module, _Patch]" = weakref.WeakKeyDictionary()


class _Patch:
    """The hooks cswap put on one model, and its swapper."""

    def __init__(self, model: nn.Module, swapper: Swapper, tracker: LayerTracker):
        self.swapper = swapper
        self.tracker = tracker
        self.depth = 0
        self.hooks_ctx = None
        self.handles = [
            model.register_forward_pre_hook(self._enter, prepend=True),
            model.register_forward_hook(self._exit, always_call=True),
        ]

    def _enter(self, module, args):
        self.depth += 1
        if self.depth == 1 and torch.is_grad_enabled():
            # One forward pass of the root: saved tensors go through the swapper
            # (nested calls of the root, e.g. recursion, stay in the same pass).
            self.tracker.reset()
            self.swapper.begin_pass()
            self.hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self.swapper.pack, self.swapper.unpack)
            self.hooks_ctx.__enter__()

    def _exit(self, module, args, output):
        self.depth -= 1
        if self.depth == 0 and self.hooks_ctx is not None:
            ctx, self.hooks_ctx = self.hooks_ctx, None
            ctx.__exit__(None, None, None)
            self.swapper.end_pass()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        if self.hooks_ctx is not None:  # unpatched from inside forward
            self.hooks_ctx.__exit__(None, None, None)
            self.hooks_ctx = None
        self.tracker.detach()
        self.swapper.close()


def patch(model: nn.Module, mode: str | None = None, policy=None, **options) -> nn.Module:
    """Offload the activations `model` saves for backward to host memory.

    Returns the same module, patched in place (patching again replaces the
    settings). Modes: "none" (hooks only, the overhead baseline), "vdnn"
    (offload every candidate uncompressed), "sc" (ZVC on every candidate),
    "cswap" (policy(info) -> codec name or None per tensor). The default is
    "vdnn", or "cswap" when a policy is given. Options (see cswap.swapper.Swapper): candidates="sparse" |
    "all", min_bytes (default 1 MiB on CUDA), stash_bytes, prefetch_bytes,
    max_host_bytes, pin_memory, codec_configs={codec: LaunchConfig}.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"cswap.patch: expected a torch.nn.Module, got {type(model).__name__}")
    tracker = LayerTracker()
    swapper = Swapper(mode, policy, layer=lambda: tracker.current, **options)  # validates first
    unpatch(model)
    tracker.attach(model)
    _PATCHED[model] = _Patch(model, swapper, tracker)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Remove cswap's hooks: stock autograd behaviour again. Idempotent.

    Graphs built while patched still restore their tensors in backward."""
    entry = _PATCHED.pop(model, None)
    if entry is not None:
        entry.remove()
    return model


def is_patched(model: nn.Module) -> bool:
    return model in _PATCHED


@contextmanager
def offload(mode: str | None = None, policy=None, **options):
    """Offload tensors saved for backward inside this region; yields the Swapper
    (its .stats counts what moved). Backward may run after the region ends."""
    tracker = LayerTracker()
    swapper = Swapper(mode, policy, layer=lambda: tracker.current, **options)
    tracker.attach_global()
    swapper.begin_pass()
    try:
        with torch.autograd.graph.saved_tensors_hooks(swapper.pack, swapper.unpack):
            yield swapper
    finally:
        tracker.detach()
        swapper.end_pass()
        swapper.close()  # offloads finish; restores in a later backward need no worker


def stats(target) -> SwapStats:
    """The counters of a patched model (or of the Swapper an offload() region yielded)."""
    if isinstance(target, Swapper):
        return target.stats
    entry = _PATCHED.get(target) if isinstance(target, nn.Module) else None
    if entry is None:
        raise ValueError(f"cswap.stats: {type(target).__name__} is not patched; call cswap.patch(model) first "
                         f"(or pass the object `with cswap.offload() as s` yields)")
    return entry.swapper.stats
