"""Lossless GPU codecs for offloaded activations: zvc, rle, csr, lz4, zans.

    codec = cswap.codecs.get("zvc")
    blob = codec.compress(x)          # cswap.Compressed: one uint8 buffer
    y = codec.decompress(blob)        # bit-exact, same shape/dtype/device
"""

from __future__ import annotations

import importlib

import torch

from .base import Codec, resolve_backend
from .container import Compressed

__all__ = ["Codec", "Compressed", "get", "names", "decompress", "warm_up"]

_NAMES = ("zvc", "rle", "csr", "lz4", "zans")
_REGISTRY: dict[str, Codec] = {}


def names() -> tuple[str, ...]:
    """The registered codec names."""
    return _NAMES


def get(name: str) -> Codec:
    """The codec called `name` (one of `names()`)."""
    if name not in _NAMES:
        raise ValueError(f"cswap.codecs: unknown codec {name!r}; available: {', '.join(_NAMES)}")
    if name not in _REGISTRY:
        _REGISTRY[name] = importlib.import_module(f".{name}", __name__).CODEC
    return _REGISTRY[name]


def decompress(blob: Compressed, **kwargs):
    """Decompress with whichever codec wrote `blob`."""
    return get(blob.codec).decompress(blob, **kwargs)


# Three tiles of the block-tiled codecs and a partial one, half zeros in short runs:
# every kernel of every codec launches (count, compress, decompress).
_WARM_ELEMENTS = 3 * 4096 + 37


def warm_up(name: str, dtype: torch.dtype, device, config=None) -> bool:
    """Compress and decompress a small tensor of `dtype` on `device` with `config`,
    so that Triton compiles the kernels codec `name` launches for it now rather
    than in the middle of a training step (the kernels take no specialisation from
    sizes: one build serves every tensor of that word size and config).

    Returns False, doing nothing, where the backend is PyTorch's (nothing to compile)."""
    device = torch.device(device)
    if resolve_backend("auto", device, "cswap.codecs.warm_up") != "triton":
        return False
    codec = get(name)
    sample = torch.arange(_WARM_ELEMENTS, device=device) % 7 % 2
    sample = sample.to(torch.uint8).view(-1).repeat_interleave(dtype.itemsize).view(dtype)
    codec.decompress(codec.compress(sample, config=config), config=config)
    return True


def __getattr__(name):  # cswap.codecs.lz4 etc. import on first use
    if name in _NAMES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
