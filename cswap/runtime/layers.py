"""Which module made a saved tensor, and which module is running when it is saved.

A tensor is reported under the module that produced it (a max-pool output is
the MaxPool2d's, though the next convolution is what saves it): each module's
forward hook tags the autograd node of its outputs, and a saved tensor's node
(through views to the base) names its module. Tensors no module returned
(functional ops inside a forward) fall back to the module running at the save.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LayerTracker", "made_in"]

_TAG = "cswap.made_in"  # key in an autograd node's metadata: (module path, module type)


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
    """A stack of running modules, kept by forward pre- and post-hooks.

    attach(model) hooks every submodule with its path ("features.3");
    attach_global() hooks every module in the process (for `cswap.offload()`
    regions, where no model is given), naming each by its class. The post
    hooks use always_call=True, so an exception in forward still pops.
    """

    def __init__(self):
        self._stack: list[tuple[str, str]] = []
        self._handles: list = []

    @property
    def current(self) -> tuple[str, str]:
        """(layer name, layer type) of the innermost running module; ("", "") outside any."""
        return self._stack[-1] if self._stack else ("", "")

    def where(self, t: torch.Tensor) -> tuple[str, str, str]:
        """(made in, its type, saved in) for a tensor being saved now."""
        running = self.current
        made = made_in(t) or running
        return made[0], made[1], running[0]

    def reset(self) -> None:
        self._stack.clear()

    def attach(self, model: nn.Module) -> None:
        for name, module in model.named_modules():
            kind = type(module).__name__
            self._handles.append(module.register_forward_pre_hook(self._pusher(name, kind)))
            self._handles.append(module.register_forward_hook(self._popper((name, kind)), always_call=True))

    def attach_global(self) -> None:
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

