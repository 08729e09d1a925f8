"""cswap's hooks and forward wrappers on a user's modules, made so that a deep copy of a
patched module (an EMA model, copy.deepcopy; a planner tracing a copy), or the module
saved whole (torch.save(model)) and loaded, comes out unpatched: its hooks do nothing
and its forward is its own. Plain functions and bound methods would instead be copied as
they are (the copy calling into this module's patch) or with the patch itself (its
swapper, whose locks and threads cannot be copied), and local functions cannot be
pickled at all."""

from __future__ import annotations

import copy
import functools
import types

__all__ = ["Hook", "WrappedForward", "wrap_forward", "unwrap_forward"]


def _nothing(*args, **kwargs) -> None:
    return None


class Hook(functools.partial):
    """A module hook of cswap's: `Hook(fn, *args)` calls fn(*args, ...) (a partial: no
    extra Python frame per call); a copy (deep, or pickled) does nothing."""

    def __deepcopy__(self, memo):
        return _nothing

    def __reduce__(self):
        return _unpickled_hook, ()


def _unpickled_hook():
    return _nothing


class WrappedForward:
    """An instance attribute `forward` of cswap's that calls `fn` (functools.wraps of the
    forward it wraps: signatures read through it); `own` is the user's instance attribute
    it replaced, or None. A copy of `module` (deep, or pickled) gets `own` back, or else
    its class's forward, instead of a wrapper that runs this module."""

    def __init__(self, fn, module, own):
        functools.update_wrapper(self, fn)
        self.fn, self.module, self.own = fn, module, own

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    @property
    def __code__(self):  # (torch.export reads forward.__code__)
        return self.fn.__code__

    def __deepcopy__(self, memo):
        if self.own is not None:
            return copy.deepcopy(self.own, memo)
        module = memo.get(id(self.module))
        if module is None:  # (the wrapper copied alone, not as its module's attribute)
            return self
        return _class_forward(module)

    def __reduce__(self):  # (the module, pickled already when its attributes are: a reference)
        if self.own is not None:
            return _own, (self.own,)
        return _class_forward, (self.module,)


def wrap_forward(module, fn) -> None:
    """module.forward = a WrappedForward calling fn (made with functools.wraps(module.forward))."""
    module.forward = WrappedForward(fn, module, module.__dict__.get("forward"))


def unwrap_forward(module) -> None:
    """Put back the forward that wrap_forward replaced, if module.forward is still its wrapper
    (not, say, a wrapper another library put over it since)."""
    wrapper = module.__dict__.get("forward")
    if isinstance(wrapper, WrappedForward):
        if wrapper.own is not None:
            module.forward = wrapper.own
        else:
            del module.__dict__["forward"]


def _own(forward):
    return forward


def _class_forward(module):
    return types.MethodType(type(module).forward, module)
