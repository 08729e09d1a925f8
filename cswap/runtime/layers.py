"""Which module made a saved tensor, and which module is running when it is saved.

A tensor is reported under the module that produced it (a max-pool output is
the MaxPool2d's, though the next convolution is what saves it): each module's
forward hook tags the autograd node of its outputs, and a saved tensor's node
(through views to the base) names its module. Tensors no module returned
(functional ops inside a forward) fall back to the module running at the save.

Module hooks are dear: one takes PyTorch's slow call path, about 5 us per module
call on a 2-core EPYC (benchmarks/overhead.py), more than cswap spends on a saved
tensor. So once two passes in a row named the same candidates in the same order
(a static network, the common case), the hooks come off and later passes replay
those names by candidate index, each checked against the candidate's op, dtype
and rank (not its shape: a smaller last batch is the same layer). A pass that
departs from the record (a data-dependent branch) names its candidates from there
on ("", "", "") and the hooks are back for the next pass. A branch whose candidates
repeat the other's ops, dtypes and ranks at the same positions keeps the other's
names: their keys (index:layer) then stand for positions in the pass.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .module_hooks import Hook

__all__ = ["LayerTracker", "made_in"]

_TAG = "cswap.made_in"  # key in an autograd node's metadata: (module path, module type)
STEADY_PASSES = 2  # passes naming the same candidates before the hooks come off
UNNAMED = ("", "", "")


def made_in(t: torch.Tensor) -> tuple[str, str] | None:
    """(module path, type) of the module whose output `t` (or its view's base) is; None if none returned it."""
    base = t._base if t._is_view() and t._base is not None else t
    fn = base.grad_fn
    return fn.metadata.get(_TAG) if fn is not None else None


def _tag(output, where: tuple[str, str]) -> None:
    """Tag the nodes of a module's output tensors; an inner module's tag stays (a
    container returns its last child's output; an in-place op makes a new node).
    Not called while torch.compile traces the hooks (see LayerTracker)."""
    if isinstance(output, torch.Tensor):
        fn = output.grad_fn
        if fn is not None:
            fn.metadata.setdefault(_TAG, where)
    elif isinstance(output, (tuple, list)):
        for o in output:
            _tag(o, where)
    elif isinstance(output, dict):
        for o in output.values():
            _tag(o, where)


class LayerTracker:
    """A stack of running modules, kept by forward pre- and post-hooks, and the
    names of each pass's candidates (see the module docstring for the replay).

    attach(model) hooks every submodule with its path ("features.3");
    attach_global() hooks every module in the process (for `cswap.offload()`
    regions, where no model is given), naming each by its class. The post
    hooks use always_call=True, so an exception in forward still pops.
    reset() starts a pass, end_pass() ends its forward.
    """

    def __init__(self):
        self._stack: list[tuple[str, str]] = []
        self._handles: list = []
        self._attach = None      # puts the hooks (back) on; None: never attached
        self._names: list = []   # this pass: (signature, names) per candidate, in order (while hooked)
        self._replayed = 0       # this pass's candidates named so far (while replaying)
        self._previous = None    # the last pass's, while hooked
        self._steady = 1         # passes in a row that named the same candidates
        self._replay = None      # the names replayed while the hooks are off
        self._departed = False   # this pass left the replayed record

    @property
    def current(self) -> tuple[str, str]:
        """(layer name, layer type) of the innermost running module; ("", "") outside any."""
        return self._stack[-1] if self._stack else ("", "")

    @property
    def hooked(self) -> bool:
        return bool(self._handles)

    def where(self, t: torch.Tensor, op: str | None = None) -> tuple[str, str, str]:
        """(made in, its type, saved in) for the next candidate of this pass, saved now."""
        replay = self._replay
        if replay is not None:  # (no record of its own: a pass that departs puts the hooks back)
            i = self._replayed
            self._replayed = i + 1
            if not self._departed and i < len(replay):
                (op_was, dtype, dims), where = replay[i]
                if op_was == op and dtype == t.dtype and dims == t.dim():
                    return where
            self._departed = True
            return UNNAMED
        running = self.current
        made = made_in(t) or running
        where = (made[0], made[1], running[0])
        self._names.append(((op, t.dtype, t.dim()), where))
        return where

    def reset(self) -> None:
        """A pass starts."""
        self._stack.clear()
        self._names, self._replayed, self._departed = [], 0, False

    def end_pass(self) -> None:
        """A pass's forward is over: take the hooks off after STEADY_PASSES passes named
        alike, put them back after a pass that departed from the replayed names. (Here,
        not at the next pass's start: a module's hooks are collected before they run.)"""
        if self._attach is None:
            return
        names = self._names
        if self._replay is not None:
            if self._departed:
                self._replay, self._previous, self._steady = None, None, 1
                self._attach()
            return
        self._steady = self._steady + 1 if names == self._previous else 1
        self._previous = names
        if self._steady >= STEADY_PASSES:
            self._replay = names
            self._remove_hooks()

    def attach(self, model: nn.Module) -> None:
        root = weakref.ref(model)  # the patch lives as long as the model, not longer

        def attach():
            for name, module in root().named_modules():
                kind = type(module).__name__
                self._handles.append(module.register_forward_pre_hook(Hook(self._pusher(name, kind))))
                self._handles.append(module.register_forward_hook(Hook(self._popper((name, kind))), always_call=True))

        self._attach = attach
        attach()

    def attach_global(self) -> None:
        """For one region (no passes: the hooks stay on)."""
        from torch.nn.modules import module as module_mod

        def push(module, args):
            if not torch.compiler.is_compiling():
                self._stack.append((type(module).__name__, type(module).__name__))

        def pop(module, args, output):
            if not torch.compiler.is_compiling():
                self._pop()
                _tag(output, (type(module).__name__, type(module).__name__))

        self._handles.append(module_mod.register_module_forward_pre_hook(push))
        self._handles.append(module_mod.register_module_forward_hook(pop, always_call=True))

    def detach(self) -> None:
        self._remove_hooks()
        self._attach = self._replay = self._previous = None
        self._names = []
        self._stack.clear()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()

    # Inside a module compiled in place (module.compile()) dynamo traces these hooks;
    # they then do nothing: the stack is eager state (tracing it would guard on its
    # length and recompile at every depth), and a compiled graph's saves have no
    # node to tag.
    def _pusher(self, name: str, kind: str):
        def push(module, args):
            if not torch.compiler.is_compiling():
                self._stack.append((name, kind))
        return push

    def _popper(self, where: tuple[str, str]):
        def pop(module, args, output):
            if not torch.compiler.is_compiling():
                self._pop()
                _tag(output, where)
        return pop

    def _pop(self) -> None:
        if self._stack:
            self._stack.pop()

