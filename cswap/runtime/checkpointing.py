"""Blocks the budget plan recomputes, at run time: their forward runs under non-reentrant
torch.utils.checkpoint while the plan says so, and is timed in the profiled step.

Each block's forward is wrapped once at patch time (an instance attribute, put back
by detach). While `recomputed()` names the block, the wrapper runs the original
forward through checkpoint(use_reentrant=False): what the block saves inside goes
to checkpoint's holders instead of cswap's hooks and is made again before the
block's backward, and its inputs, saved at the boundary, are cswap's to keep or
move. In the first timed pass (the profiled step) each block's forward is bracketed
by stamps on the profiler's compute clock, which stops while cswap waits for copies
or samples (cswap.plan.profiler): a recompute runs without those waits. `seconds()`
reads them once that pass is over, and keeps them.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from .device import device_of
from .hook_context import hooks_turned_off
from .module_hooks import Hook, unwrap_forward, wrap_forward

__all__ = ["CheckpointedBlocks"]


def _is_hf_checkpointing_layer(module: torch.nn.Module) -> bool:
    """A Hugging Face transformers layer with its own gradient checkpointing (without importing it)."""
    return any(cls.__name__ == "GradientCheckpointingLayer" and cls.__module__.startswith("transformers.")
               for cls in type(module).__mro__)


def _hf_checkpointed(module: torch.nn.Module, forward, args, kwargs):
    """The layer's forward through its own gradient checkpointing, switched on for this call:
    it leaves its key-value cache alone (use_cache=False, cache=None) as checkpointing needs,
    or the recomputation would find the cache the forward filled and save other tensors."""
    before = module.__dict__.get("gradient_checkpointing"), module.__dict__.get("_gradient_checkpointing_func")
    module.gradient_checkpointing = True
    module._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    try:
        return forward(*args, **kwargs)
    finally:
        for attr, value in zip(("gradient_checkpointing", "_gradient_checkpointing_func"), before):
            if value is None:
                module.__dict__.pop(attr, None)
            else:
                setattr(module, attr, value)


class CheckpointedBlocks:
    def __init__(self, model: torch.nn.Module, names: list[str], recomputed, profiler):
        modules = dict(model.named_modules())
        self.blocks = {name: modules[name] for name in names}
        self.recomputed = recomputed  # () -> the block names to checkpoint now
        self.profiler = profiler
        self.stamps: dict[str, list] = {}  # name -> [start, end] stamps of the profiled step
        self._pass = None                  # that step's profiler pass
        self._seconds: dict[str, float] | None = None
        self._handles = []
        for name, module in self.blocks.items():
            self._wrap(name, module)
            self._handles.append(module.register_forward_pre_hook(Hook(self._start, name)))
            self._handles.append(module.register_forward_hook(Hook(self._end, name)))

    def _wrap(self, name: str, module: torch.nn.Module) -> None:
        forward = module.forward
        hf_layer = _is_hf_checkpointing_layer(module)

        @functools.wraps(forward)
        def maybe_checkpointed(*args, **kwargs):
            if name in self.recomputed() and torch.is_grad_enabled() and not hooks_turned_off():
                if hf_layer:
                    return _hf_checkpointed(module, forward, args, kwargs)
                return checkpoint(forward, *args, use_reentrant=False, **kwargs)
            return forward(*args, **kwargs)

        wrap_forward(module, maybe_checkpointed)

    def _start(self, name, module, args) -> None:
        p = self.profiler.current
        if p is None or not p.timing or self._seconds is not None:
            return
        if self._pass is None:
            self._pass = p
        if p is not self._pass or name in self.stamps:  # a recompute in backward or a second call: the first counts
            return
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        dev = device_of(tensor) if tensor is not None else None
        if dev is not None:
            self.stamps[name] = [self.profiler.stamp(dev), None]

    def _end(self, name, module, args, output) -> None:
        entry = self.stamps.get(name)
        if entry is not None and entry[1] is None and self.profiler.current is self._pass:
            entry[1] = self.profiler.stamp(self._pass.device)

    def seconds(self) -> dict[str, float]:
        """Each block's forward compute seconds in the profiled step ({} until that step
        is over; a step whose timing was incomplete leaves the blocks to the next)."""
        if self._seconds is None:
            if self._pass is None or self.profiler.current is self._pass:
                return {}
            clock = self._pass.compute
            if clock is None:  # not a complete timing: time the blocks again in the next timed pass
                self._pass, self.stamps = None, {}
                return {}
            self._seconds = {name: max(clock[end] - clock[start], 0.0)
                             for name, (start, end) in self.stamps.items() if end is not None}
        return self._seconds

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        for module in self.blocks.values():
            unwrap_forward(module)
        self._handles = []
