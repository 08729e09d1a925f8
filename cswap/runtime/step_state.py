"""What a training forward changes besides its graph, kept so that a forward that ran
out of device memory can be retried as if it had not run (budget="auto", cswap.patch).

A failed attempt has drawn random numbers (dropout's masks) and updated normalization
layers' running statistics in place. Retried as it stands, the step would draw other
masks and count the batch twice in those statistics: training would differ from the
same step unpatched. As torch.utils.checkpoint keeps the generators' states for its
recomputation, this keeps the generators of the CPU and of the model's CUDA devices,
and copies of the running statistics (a few numbers per channel).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

__all__ = ["StepState"]


class StepState:
    """The random number generators' states and the running statistics of `model`'s
    normalization layers, taken now; `restore` puts them back."""

    def __init__(self, model: nn.Module, args=(), kwargs=None):
        self.cpu_rng = torch.get_rng_state()
        devices = {t.device for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor) and t.is_cuda}
        first = next(model.parameters(), None)
        if first is not None and first.is_cuda:
            devices.add(first.device)
        self.cuda_rng = [(d, torch.cuda.get_rng_state(d)) for d in devices]
        self.stats = [(buf, buf.clone()) for m in model.modules()
                      if isinstance(m, _NormBase) and m.training and m.track_running_stats
                      for buf in (m.running_mean, m.running_var, m.num_batches_tracked) if buf is not None]

    def restore(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        for device, state in self.cuda_rng:
            torch.cuda.set_rng_state(state, device)
        for buf, saved in self.stats:  # (through .data: its version stays, so a graph of this step that saved
            buf.data.copy_(saved)       # it, an earlier forward's, is not taken as modified in place)
