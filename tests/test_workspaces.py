"""cswap.plan.workspaces: cuDNN's convolution workspaces, which no trace of tensors sees."""

import numpy as np
import torch

from cswap.plan import fake_gpu, workspaces


def _meta(*shape):
    return torch.empty(shape, device="meta")


def test_a_3x3_convolution_takes_its_input_its_output_and_twice_its_weight():
    """As the H200's snapshots measured on VGG16 (module docstring), forward and backward."""
    x, w, y = _meta(8, 64, 32, 32), _meta(128, 64, 3, 3), _meta(8, 128, 32, 32)
    expected = (x.numel() + y.numel() + 2 * w.numel()) * 4
    forward = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert workspaces.workspace_bytes("convolution", forward, y) == expected
    backward = (y, x, w, [128], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])
    assert workspaces.workspace_bytes("convolution_backward", backward, (x, w, None)) == expected


def test_1x1_grouped_and_other_ops_take_none():
    x, y = _meta(8, 64, 32, 32), _meta(8, 64, 32, 32)
    pointwise = (x, _meta(64, 64, 1, 1), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    depthwise = (x, _meta(64, 1, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 64)
    assert workspaces.workspace_bytes("convolution", pointwise, y) == 0
    assert workspaces.workspace_bytes("convolution", depthwise, y) == 0
    assert workspaces.workspace_bytes("relu", (x,), y) == 0


def test_a_workspace_takes_only_what_the_device_has_free():
    """PyTorch tries cuDNN's algorithms until one's workspace can be allocated: a workspace
    raises the curve to the room at most, and never past a curve already above it."""
    curve = np.array([10.0, 50.0, 95.0, 120.0])
    workspace = np.array([30.0, 30.0, 30.0, 30.0])
    assert workspaces.with_workspaces(curve, workspace, room=100.0).tolist() == [40.0, 80.0, 100.0, 120.0]


def test_a_traced_step_records_each_convolutions_workspace():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 1),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 16 * 16, 2))
    trace = fake_gpu.trace_step(model, torch.empty(4, 3, 16, 16), drops=False)
    taken = [(op.phase, op.workspace) for op in trace.ops if op.name.startswith("convolution")]
    first = 4 * 3 * 16 * 16 * 4 + 4 * 8 * 16 * 16 * 4 + 2 * 8 * 3 * 9 * 4  # image, output, twice the weight
    assert taken == [("forward", first), ("forward", 0), ("backward", 0), ("backward", first)]
    assert all(op.workspace == 0 for op in trace.ops if not op.name.startswith("convolution"))
