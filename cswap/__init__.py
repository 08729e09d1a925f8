"""cswap: compressed activation swapping for PyTorch training (CSWAP, CLUSTER 2021)."""

from . import codecs, ops
from .candidates import SwapInfo
from .codecs.container import Compressed
from .errors import CorruptDataError
from .kernels.launch import LaunchConfig
from .patch import check_decisions, epoch_end, epoch_end_hook, offload, patch, stats, unpatch
from .profile import Profile, load_profile
from .stats import SwapStats

__all__ = ["codecs", "ops", "Compressed", "CorruptDataError", "LaunchConfig", "Profile", "SwapInfo", "SwapStats",
           "check_decisions", "epoch_end", "epoch_end_hook", "load_profile", "offload", "patch", "stats",
           "unpatch"]
__version__ = "0.1.0"
