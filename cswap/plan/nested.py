"""Torch function modes that see what a torch function written in Python calls inside.

A TorchFunctionMode handles a call with itself turned off, so when the call is a torch
function written in Python (`F.multi_head_attention_forward`, which nn.MultiheadAttention,
nn.TransformerEncoderLayer and torchvision's ViT run), none of the calls inside it reach
the mode: the trace's choice of SDPA kernel and its emulated CUDA autocast missed them,
and a TransformerEncoder's attention was traced as the math path, 20-25% over a real CPU
step. `call_seen(mode, func, args, kwargs)` runs such a function with the mode on for
what it calls: a copy of the function whose check for torch function overrides answers
no (it would hand the call back to the mode), all else as written. A function that is
not Python, or makes no such check, is called as the mode would.

What it relies on (checked on torch 2.11-2.15): the functions of torch.nn.functional and
torch.functional look their override check up by name in their module
(`has_torch_function`, `_unary`, `_variadic`).
"""

from __future__ import annotations

import functools
import threading
import types

__all__ = ["call_seen"]

_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
_MODULES = ("torch.nn.functional", "torch.functional")


class _Running(threading.local):
    def __init__(self):
        self.functions: set = set()  # the functions whose copies run now, on this thread


_RUNNING = _Running()


def _never(*args, **kwargs) -> bool:
    return False


@functools.cache
def _unchecked(func):
    """`func` without its override check (None where it has none to drop). Only the
    functional modules' functions: a Tensor method written in Python hands its work to the
    C method, which reports the same function to the mode."""
    if not isinstance(func, types.FunctionType) or func.__module__ not in _MODULES or \
            not any(n in func.__code__.co_names for n in _CHECKS):
        return None
    names = dict(func.__globals__)  # (a copy: every other caller keeps the check)
    names.update({n: _never for n in _CHECKS})
    body = types.FunctionType(func.__code__, names, func.__name__, func.__defaults__, func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    return body


def call_seen(mode, func, args=(), kwargs=None):
    """func(*args, **kwargs) from inside `mode`'s __torch_function__, with `mode` on for the
    torch functions it calls."""
    kwargs = kwargs or {}
    body = _unchecked(func)
    running = _RUNNING.functions
    if body is None or func in running:  # (a function calling itself: the mode has seen it once)
        return func(*args, **kwargs)
    running.add(func)
    try:
        with mode:
            return body(*args, **kwargs)
    finally:
        running.discard(func)
