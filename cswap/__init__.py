"""cswap: compressed activation swapping for PyTorch training (CSWAP, CLUSTER 2021)."""

from . import codecs, ops, testing
from .codecs.container import Compressed
from .errors import CorruptDataError
from .kernels.launch import LaunchConfig
from .plan.gpus import gpus
from .plan.whatif import predict
from .patch import check_decisions, epoch_end, epoch_end_hook, offload, patch, stats, unpatch
from .runtime.candidates import SwapInfo
from .runtime.stats import SwapStats
from .tune.profile import Profile, load_profile

__all__ = ["codecs", "ops", "testing", "Compressed", "CorruptDataError", "LaunchConfig", "Profile", "SwapInfo",
           "SwapStats", "check_decisions", "epoch_end", "epoch_end_hook", "gpus", "load_profile", "offload", "patch",
           "predict", "stats", "unpatch"]
__version__ = "0.1.0"
