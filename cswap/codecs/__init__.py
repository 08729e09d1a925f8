"""Lossless GPU codecs for offloaded activations: zvc, rle, csr, lz4.

    codec = cswap.codecs.get("zvc")
    blob = codec.compress(x)          # cswap.Compressed: one uint8 buffer
    y = codec.decompress(blob)        # bit-exact, same shape/dtype/device
"""

from __future__ import annotations

import importlib

from .base import Codec
from .container import Compressed

__all__ = ["Codec", "Compressed", "get", "names", "decompress"]

_NAMES = ("zvc", "rle", "csr", "lz4")
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


def __getattr__(name):  # cswap.codecs.lz4 etc. import on first use
    if name in _NAMES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
