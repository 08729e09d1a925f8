"""Autograd's in-place gradient accumulation, put back into the trace.

Where gradients reach one tensor by several paths (a loop over its slices, a weight used
twice), autograd's engine adds each into the buffer the first one started, in place when
it holds the buffer's last reference (`accumulate` in torch/csrc/autograd/input_buffer.cpp).
Under any Python dispatch mode it never does (`at::isTensorSubclassLike` is true for
every tensor then), and the trace needs two: FakeTensorMode and MemTracker. So the trace
would hold one gradient-sized tensor more at each such add: Mamba's sequential scan
traced 5.6-8.2% over a real CPU step, a hand-written scan 19%.

`InPlaceAccumulation` counts those adds as the engine runs them outside a mode. An add is
the engine's when it runs after an autograd node's post hook and before the next node
(a backward formula's own adds run inside the node); it would have been in place when
its first operand, the buffer, is dense, not a view, and dies before the next op (nothing
else held it). Then the add's output is counted in the buffer's memory: the peak and the op's
live bytes are put back to what they were before it. Adds inside a reentrant
checkpoint's nested backward are left as traced (their nodes carry no hook).

Private PyTorch surfaces (checked on 2.11-2.15): MemTracker's running peak
(`_peak_mem`, `_peak_mem_snap`, `_update_peak_stats`) and
`torch._C._current_autograd_node`.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from ..runtime.items import dense_permutation

__all__ = ["InPlaceAccumulation"]

_ADD = torch.ops.aten.add.Tensor


class InPlaceAccumulation:
    """Watches one backward on the fake device for the engine's accumulating adds.

    memory: the trace's MemTracker; ops: its list of OpRecord (an add's record is
    corrected in place); live_bytes: memory in use now."""

    def __init__(self, memory, ops: list, live_bytes) -> None:
        self._memory = memory
        self._ops = ops
        self._live_bytes = live_bytes
        self._finished = None   # the node whose outputs the engine is adding into buffers now
        self._pending = None    # an add waiting for its buffer's death: (storage ref, op index, peak, bytes)
        self._handles: list = []

    def watch(self, root) -> None:
        """Hooks every node of the graph under `root` (a grad_fn) but the leaves'."""
        seen, stack = set(), [root]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            stack.extend(edge for edge, _ in node.next_functions)
            if "AccumulateGrad" not in node.name():  # (a hook there changes when it steals a gradient)
                self._handles.append(node.register_hook(self._ran))

    def _ran(self, grad_inputs, grad_outputs) -> None:
        # Held until the next op in another node: the node's own object, whose identity
        # `_current_autograd_node` gives back while it is referenced.
        self._finished = torch._C._current_autograd_node()

    def before(self, func, args, kwargs):
        """Called before each op in backward: the state to restore if it turns out to be
        an add the engine runs in place, else None."""
        self.settle()
        node = torch._C._current_autograd_node()
        if node is None or node is not self._finished:
            self._finished = None
            return None
        if func is not _ADD or kwargs or len(args) != 2 or not isinstance(args[0], torch.Tensor):
            return None
        buffer = args[0]
        # (a view shares its storage with its base: its storage's use count is not 1)
        if buffer._is_view() or buffer._is_zerotensor() or buffer.is_nested or dense_permutation(buffer) is None:
            return None
        peak = ({d: n for d, n in self._memory._peak_mem.items()},
                {d: dict(s) for d, s in self._memory._peak_mem_snap.items()})
        return peak, self._live_bytes()

    def after(self, state, buffer: torch.Tensor, out, index: int) -> None:
        """Called after the op `before` returned `state` for, recorded as ops[index]."""
        if not isinstance(out, torch.Tensor) or out.shape != buffer.shape or out.dtype != buffer.dtype:
            return
        peak, live = state
        self._pending = (weakref.ref(buffer.untyped_storage()), index, peak, self._live_bytes() - live)

    def settle(self) -> None:
        """Counts the last add in place if its buffer has died since (call before each op
        and once after backward)."""
        if self._pending is None:
            return
        storage, index, peak, added = self._pending
        self._pending = None
        if storage() is not None:  # held elsewhere: the engine adds out of place too
            return
        self._memory._peak_mem, self._memory._peak_mem_snap = peak
        self._memory._update_peak_stats(None)
        op = self._ops[index]
        self._ops[index] = replace(op, live_bytes=op.live_bytes - added)

    def close(self) -> None:
        self.settle()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._finished = None
