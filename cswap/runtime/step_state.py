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
    """For one model: `take` keeps the random number generators' states and the running
    statistics of its normalization layers, `restore` puts back what was taken last.

    It is taken before every forward while budget="auto" waits for an out-of-memory error,
    so at every step of a model that fits: the statistics are copied with one `_foreach`
    copy into copies kept between steps (on a GPU, a launch or two instead of one per
    buffer), and the normalization layers are found once, when the model is patched."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.norms = [m for m in model.modules() if isinstance(m, _NormBase)]
        self.cpu_rng, self.cuda_rng = None, []
        self.buffers: list[torch.Tensor] = []  # the statistics taken last
        self.copies: list[torch.Tensor] = []   # their values then
        self._ids: list[int] = []

    def take(self, args=(), kwargs=None) -> None:
        self.cpu_rng = torch.get_rng_state()
        devices = {t.device for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor) and t.is_cuda}
        first = next(self.model.parameters(), None)
        if first is not None and first.is_cuda:
            devices.add(first.device)
        self.cuda_rng = [(d, torch.cuda.get_rng_state(d)) for d in devices]
        buffers = [buf for m in self.norms if m.training and m.track_running_stats
                   for buf in (m.running_mean, m.running_var, m.num_batches_tracked) if buf is not None]
        ids = [id(buf) for buf in buffers]  # (stable: self.buffers holds the ones taken last)
        if ids != self._ids:  # (module.to() and friends make new buffers: new copies for them)
            self.buffers, self._ids = buffers, ids
            self.copies = [buf.clone() for buf in buffers]
        elif buffers:
            torch._foreach_copy_(self.copies, buffers)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        for device, state in self.cuda_rng:
            torch.cuda.set_rng_state(state, device)
        if self.buffers:
            # Through .data: their versions stay, so a graph of this step that saved them (an
            # earlier forward's) is not taken as modified in place.
            torch._foreach_copy_([buf.data for buf in self.buffers], self.copies)
