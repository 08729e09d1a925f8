"""Which module is running: the layer name a saved tensor is reported under."""

from __future__ import annotations

from torch import nn

__all__ = ["LayerTracker"]


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

    def reset(self) -> None:
        self._stack.clear()

    def attach(self, model: nn.Module) -> None:
        for name, module in model.named_modules():
            kind = type(module).__name__
            self._handles.append(module.register_forward_pre_hook(self._pusher(name, kind)))
            self._handles.append(module.register_forward_hook(self._pop, always_call=True))

    def attach_global(self) -> None:
        from torch.nn.modules import module as module_mod

        def push(module, args):
            self._stack.append((type(module).__name__, type(module).__name__))

        self._handles.append(module_mod.register_module_forward_pre_hook(push))
        self._handles.append(module_mod.register_module_forward_hook(self._pop, always_call=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()

    def _pusher(self, name: str, kind: str):
        def push(module, args):
            self._stack.append((name, kind))
        return push

    def _pop(self, module, args, output):
        if self._stack:
            self._stack.pop()

