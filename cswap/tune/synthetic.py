"""Synthetic activations of a chosen size, sparsity and zero pattern.

Used by the codec benchmark and the offline tuner: deterministic by seed, made
directly on the target device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PATTERNS", "make_tensor"]

PATTERNS = ("iid", "blocky")


def make_tensor(nbytes: int, sparsity: float, dtype: torch.dtype = torch.float32, pattern: str = "blocky",
                device=None, seed: int = 0, run: int = 64) -> torch.Tensor:
    """A 1-D tensor of about `nbytes` bytes whose fraction `sparsity` of elements
    are zero and the rest non-zero (positive, like a ReLU output).

    pattern "iid": zeros at independent random positions.
    pattern "blocky": ReLU of a smooth random field: zeros come in runs of
    about `run` elements, as in the activations of convolutional layers.
    """
    if pattern not in PATTERNS:
        raise ValueError(f"cswap.tune.synthetic: pattern must be one of {PATTERNS}, got {pattern!r}")
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"cswap.tune.synthetic: sparsity must be in [0, 1], got {sparsity}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    itemsize = dtype.itemsize
    n = max(0, nbytes // itemsize)
    gen = torch.Generator(device=device).manual_seed(seed)
    if pattern == "iid":
        zero = torch.rand(n, generator=gen, device=device) < sparsity
    else:
        field = _smooth_field(n, run, gen, device)
        zero = field < _threshold(field, sparsity)
        del field
    if dtype.is_floating_point:
        values = torch.rand(n, generator=gen, device=device) + 0.01  # never rounds to zero
    else:
        values = torch.randint(1, 100, (n,), generator=gen, device=device)
    values = values.to(dtype) if dtype != torch.bool else torch.ones(n, dtype=torch.bool, device=device)
    return values.masked_fill_(zero, 0)


def _smooth_field(n: int, run: int, gen: torch.Generator, device) -> torch.Tensor:
    coarse = torch.randn(1, 1, n // run + 2, generator=gen, device=device)
    return F.interpolate(coarse, size=n, mode="linear", align_corners=True).reshape(n)


def _threshold(field: torch.Tensor, sparsity: float) -> float:
    """The `sparsity` quantile of the field (from a strided sample of at most 4M)."""
    if sparsity <= 0 or field.numel() == 0:
        return float("-inf")
    if sparsity >= 1:
        return float("inf")
    sample = field[:: max(1, field.numel() // (1 << 22))]
    return float(torch.quantile(sample, sparsity))
