"""cuDNN's convolution workspaces: transient device memory no trace of tensors sees.

A cuDNN convolution allocates a workspace for the algorithm it runs, through
PyTorch's caching allocator, and frees it when the kernel is queued. On the
H200 (torch 2.11, cuDNN 9, benchmark mode off; the memory snapshots in
benchmarks/results/nvidia-h200/trace/, VGG16 at two sizes) every 3x3
convolution's backward passes (data and filter) took the bytes of its input
plus its output, plus one to three times its weight's, and so did its forward
but for one layer (a third of that): 1280 MiB beside CIFAR's second
convolution at batch 2560, where vdnn's step peaks. workspace_bytes models that
as input + output + twice the weight for every convolution larger than 1x1
and not grouped; 1x1 and grouped ones (implicit GEMM, depthwise kernels) are
taken to need none. Measured on one GPU and two models; assumed elsewhere.

PyTorch tries cuDNN's algorithms in its heuristic's order and takes the first
whose workspace it can allocate (`try_plans` in aten/src/ATen/native/cudnn/
Conv_v8.cpp skips one that raises OutOfMemoryError): a workspace never makes a
step run out of memory, it takes what is free up to what it asks for
(with_workspaces)."""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["CONVOLUTIONS", "with_workspaces", "workspace_bytes"]

CONVOLUTIONS = {"convolution", "convolution_backward"}


def _nbytes(t) -> int:
    return math.prod(t.shape) * t.element_size() if isinstance(t, torch.Tensor) else 0


def workspace_bytes(name: str, args, out) -> int:
    """The workspace cuDNN asks for to run aten op `name` on `args` (returning `out`):
    0 for an op that is no convolution, a 1x1 or a grouped one (module docstring)."""
    if name not in CONVOLUTIONS or len(args) < (9 if name == "convolution" else 10):
        return 0  # (the dispatcher passes both ops every argument positionally)
    if name == "convolution":  # (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
        x, w, groups, y = args[0], args[1], args[8], out
    else:  # (grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask)
        y, x, w, groups = args[0], args[1], args[2], args[9]
    if groups != 1 or math.prod(w.shape[2:]) <= 1:
        return 0
    return _nbytes(x) + _nbytes(y) + 2 * _nbytes(w)


def with_workspaces(curve: np.ndarray, workspace: np.ndarray, room: float) -> np.ndarray:
    """`curve` (bytes in use per op) with each op's workspace on top, as much of it as
    fits under `room` (the device's memory for the step): what cuDNN takes."""
    return curve + np.minimum(workspace, np.maximum(0.0, room - curve))
