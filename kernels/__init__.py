"""GPU codec kernels (Triton) with pure-PyTorch references of the same formats.

One module per codec. Kernels see 1-D integer views of tensors and know nothing
of the rest of cswap (DESIGN.md: one direction only).
"""

from .launch import LaunchConfig

__all__ = ["LaunchConfig"]
