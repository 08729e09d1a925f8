"""The codecs as PyTorch custom ops, callable from torch.compile'd code.

    data = torch.ops.cswap.compress(x, "zvc")              # uint8 buffer, as codec.compress(x).data
    y = torch.ops.cswap.decompress(data, x.shape, x.dtype)  # bit-exact x

The compressed size depends on the data, so under torch.compile `compress`
returns a tensor of unbacked (data-dependent) length; `decompress` takes the
shape and dtype explicitly, which lets the compiler know its output without
reading the header, and checks them against the header at run time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import codecs
from .codecs.container import Compressed

__all__ = ["compress", "decompress"]


@torch.library.custom_op("cswap::compress", mutates_args=())
def compress(x: Tensor, codec: str) -> Tensor:
    return codecs.get(codec).compress(x).data


@compress.register_fake
def _compress_fake(x, codec):
    return x.new_empty(torch.library.get_ctx().new_dynamic_size(), dtype=torch.uint8)


@torch.library.custom_op("cswap::decompress", mutates_args=())
def decompress(data: Tensor, shape: list[int], dtype: torch.dtype) -> Tensor:
    blob = Compressed.from_bytes(data)
    if tuple(blob.shape) != tuple(shape) or blob.dtype != dtype:
        raise ValueError(f"cswap.ops.decompress: the buffer holds a {blob.dtype} tensor of shape "
                         f"{tuple(blob.shape)}, not {dtype} {tuple(shape)}")
    return blob.decompress()


@decompress.register_fake
def _decompress_fake(data, shape, dtype):
    return data.new_empty(shape, dtype=dtype)
