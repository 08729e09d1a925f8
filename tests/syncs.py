"""Host syncs counted on CUDA (tests that run on a GPU)."""

import warnings

import torch


def cuda_syncs(fn) -> tuple[object, list[str]]:
    """fn()'s result and the host syncs it made, as torch.cuda's sync debug mode reports them."""
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = fn()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return result, [str(w.message) for w in caught if "synchroniz" in str(w.message)]
