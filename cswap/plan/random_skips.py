"""Control flow drawn at random (`if torch.rand(1) > p`), as cswap-plan traces it.

peft's LoHa and LoKr skip an adapter at random (`module_dropout`), Hugging Face's
encoders and decoders a whole layer (LayerDrop): a uniform draw of one number on the CPU
decides. A step traced without data cannot answer the comparison, and one forward of
real tensors answers it at random. Both take the draw as the largest value below 1: in
the usual forms no skip fires, and the traced step is the one with the most work and
memory.

Private PyTorch surfaces (checked on 2.11-2.15): FakeTensorMode's converter making a
constant fake tensor (`fake_tensor_converter.from_real_tensor(..., make_constant=True)`,
which answers comparisons and `.item()`) and `unset_fake_temporarily`.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["NoRandomSkips", "as_run"]

_DRAWS = ("rand", "rand_like")


def _decides(func, out) -> bool:
    return func._overloadpacket.__name__ in _DRAWS and isinstance(out, torch.Tensor) and out.numel() <= 1 and \
        out.device.type == "cpu"


def _top(shape, dtype) -> torch.Tensor:
    return torch.full(shape, 1.0, dtype=dtype).nextafter(torch.zeros((), dtype=dtype))


def as_run(func, out):
    """`out`, the fake tensor op `func` returned, or, for a deciding draw, a fake tensor
    holding a known value (a constant of its FakeTensorMode) that answers comparisons."""
    if not _decides(func, out) or not hasattr(out, "fake_mode"):
        return out
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        top = _top(out.shape, out.dtype)
    return out.fake_mode.fake_tensor_converter.from_real_tensor(out.fake_mode, top, make_constant=True)


class NoRandomSkips(TorchDispatchMode):
    """A dispatch mode for a forward of real (or fake) tensors in which every deciding
    draw is the largest value below 1."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _decides(func, out) and not hasattr(out, "fake_mode"):
            return _top(out.shape, out.dtype)
        return as_run(func, out)
