"""End-to-end payload checksum for offloaded tensors (Swapper(checksum=True)).

`checksum(data)` is a position-weighted 64-bit sum of the buffer's 32-bit
words, sum_i w_i * (i + 1) mod 2**64 with w_i read as unsigned, computed with
plain torch ops on the buffer's own device and stream: no host sync, no
kernel of its own, the same value on CPU and CUDA (integer sums wrap, so the
order of the additions does not matter).

What it catches: any change confined to one 32-bit word (a flipped bit, an
overwritten byte) changes the sum for certain, because w * (i + 1) with
0 < |w| < 2**32 and i + 1 < 2**31 is never 0 mod 2**64; two words swapped
with each other change it unless they are equal. Larger corruptions are
missed with probability about 2**-64. It is not a cryptographic hash and
does not defend against deliberate tampering.
"""

from __future__ import annotations

import torch

__all__ = ["checksum"]

# 4M words (16 MiB of input) per step: two int64 temporaries of 32 MiB each,
# whatever the buffer's size.
_CHUNK_WORDS = 1 << 22
_MAX_WORDS = 1 << 31  # i + 1 < 2**31 keeps every product w * (i + 1) below 2**63


def checksum(data: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 tensor on data's device: the checksum of a 1-D uint8 buffer."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise TypeError(f"cswap.integrity.checksum: expected a 1-D uint8 tensor, got {data.dtype} of "
                        f"shape {tuple(data.shape)}")
    n = data.numel()
    body = n // 4 * 4
    if body // 4 > _MAX_WORDS:
        raise ValueError(f"cswap.integrity.checksum: buffers up to {4 * _MAX_WORDS} bytes are supported, "
                         f"got {n}")
    if body and data.storage_offset() % 4:
        data = data.clone()  # a view of 32-bit words needs a 4-byte aligned start
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    if body:
        words = data[:body].view(torch.int32)
        for start in range(0, words.numel(), _CHUNK_WORDS):
            chunk = words[start: start + _CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF
            weights = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=data.device)
            total += (chunk * weights).sum()
    if body < n:  # the last 1-3 bytes as one more word, zero-padded
        tail = data[body:].to(torch.int64)
        shifts = torch.arange(0, 8 * (n - body), 8, dtype=torch.int64, device=data.device)
        total += (tail << shifts).sum() * (body // 4 + 1)
    return total
