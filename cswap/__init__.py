"""cswap: compressed activation swapping for PyTorch training (CSWAP, CLUSTER 2021)."""

from . import codecs
from .codecs.container import Compressed
from .errors import CorruptDataError
from .kernels.launch import LaunchConfig

__all__ = ["codecs", "Compressed", "CorruptDataError", "LaunchConfig"]
__version__ = "0.1.0"
