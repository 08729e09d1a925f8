"""Grouped matrix multiplies: how a Mixture-of-Experts layer runs its experts.

transformers runs each MoE layer's experts as one torch._grouped_mm (its default,
experts_implementation="grouped_mm"; fp8: _scaled_grouped_mm), or, under torch.compile
in a dtype other than bf16, as its own custom op and that op's backward. The trace
needs two things PyTorch does not give it:

- their FLOPs: torch.utils.flop_counter has no formula for them (`flops`);
- torch._grouped_mm in float32 (an fp32 model, or fp16 autocast, whose experts' weights
  stay float32): CUDA runs it as one mm per group, but the meta kernel, which the fake
  device runs, refuses every dtype but bf16 and fp16 (`UnfusedGroupedMM`).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["GROUPED_MATMULS", "UnfusedGroupedMM", "flops", "output_as_cuda", "run_as_cuda", "runs_unfused"]

GROUPED_MATMULS = frozenset({"_grouped_mm", "_scaled_grouped_mm", "grouped_mm_fallback",
                             "grouped_mm_fallback_backward"})


def flops(name: str, a, b, *args, out_val, **kwargs) -> int:
    """FLOPs of the grouped multiply `name` (one of GROUPED_MATMULS) of a and b. Each group
    is an (m x k) @ (k x n) product; `offs` makes a's rows, b's columns or the shared k
    ragged, the groups' parts summing to the tensor's. transformers' fallback backward
    (input, weight, offs, grad) makes both gradients: twice its forward."""
    if name == "grouped_mm_fallback_backward":
        return 4 * a.shape[0] * a.shape[1] * b.shape[-1]
    out = out_val if isinstance(out_val, torch.Tensor) else out_val[0]
    if a.dim() == 2 and b.dim() == 2:  # k ragged: out is (groups, m, n)
        return 2 * out.shape[-2] * out.shape[-1] * a.shape[-1]
    return 2 * out.numel() * a.shape[-1]


_GROUPED_MM = torch.ops.aten._grouped_mm.default


def runs_unfused(func, args) -> bool:
    """torch._grouped_mm in a dtype its fused kernel lacks, which the meta kernel refuses."""
    return func is _GROUPED_MM and args[0].dtype not in (torch.bfloat16, torch.float16)


def run_as_cuda(func, args, kwargs):
    """func(*args, **kwargs), but torch._grouped_mm in float32 as CUDA runs it (output_as_cuda)."""
    return output_as_cuda(*args, **kwargs) if runs_unfused(func, args) else func(*args, **kwargs)


def output_as_cuda(a, b, offs=None, bias=None, out_dtype=None) -> torch.Tensor:
    """What CUDA's per-group loop returns for torch._grouped_mm(a, b, offs): a tensor of its
    shape and dtype, on a's device."""
    if a.dim() == 2 and b.dim() == 2:
        shape = (offs.shape[0], a.shape[0], b.shape[1])
    elif a.dim() == 2:
        shape = (a.shape[0], b.shape[-1])
    elif b.dim() == 2:
        shape = (a.shape[1], b.shape[1])
    else:
        shape = (a.shape[0], a.shape[1], b.shape[-1])
    return torch.empty(shape, dtype=out_dtype or a.dtype, device=a.device)


class UnfusedGroupedMM(TorchDispatchMode):
    """While active, torch._grouped_mm in float32 returns what CUDA would (output_as_cuda)
    instead of the meta kernel's refusal; every other op runs as it would."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return run_as_cuda(func, args, kwargs or {})
