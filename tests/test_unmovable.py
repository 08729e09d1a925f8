"""Saved tensors cswap cannot move stay where they are (issue 24 §4).

Sparse (COO, CSR), nested (strided and jagged), quantized, meta, and tensor
subclasses (DTensor, a float8-style wrapper) saved for backward are left in
place by every mode, on the CPU default and on the emulated device, counted
in stats["kept_unmovable"], and gradients equal stock autograd's; the plain
activations beside them still leave.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

import cswap
from cswap.runtime.candidates import movable

pytestmark = pytest.mark.filterwarnings("ignore:.*saves no memory:RuntimeWarning",
                                        "ignore:.*no profile for this device:RuntimeWarning")


class Wrapped(torch.Tensor):
    """A wrapper tensor subclass, as float8 training libraries write them: the data
    lives in an inner tensor and every op is run on it and wrapped again."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                   device=inner.device, requires_grad=inner.requires_grad)

    def __init__(self, inner):
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return Wrapped(inner_tensors["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t.inner if isinstance(t, Wrapped) else t
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: Wrapped(t) if isinstance(t, torch.Tensor) else t, out)


class Wrap(torch.autograd.Function):
    """Into the subclass and back for gradients, as a float8 cast is."""

    @staticmethod
    def forward(ctx, h):
        return Wrapped(h.detach())

    @staticmethod
    def backward(ctx, grad):
        return grad.inner if isinstance(grad, Wrapped) else grad


class QuantizedReLU(torch.autograd.Function):
    """Saves its output's sign as a quantized tensor (a memory-saving activation)."""

    @staticmethod
    def forward(ctx, x):
        y = x.clamp(min=0)
        ctx.save_for_backward(torch.quantize_per_tensor(y, 1.0, 0, torch.quint8))
        return y

    @staticmethod
    def backward(ctx, grad):
        (q,) = ctx.saved_tensors
        return grad * (q.dequantize() > 0)


class Net(nn.Module):
    """A plain ReLU block (whose activations cswap moves) around `middle`, which
    makes the saved tensors of one kind cswap cannot move."""

    def __init__(self, middle):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 6)
        self.w = nn.Parameter(torch.randn(6, 5) / 3)
        self.middle = middle

    def forward(self, x):
        return self.middle(torch.relu(self.first(x)), self.w)


def _sparse_coo(h, w):
    return torch.sparse.mm(torch.relu(h).to_sparse(), w).sum()


def _sparse_csr(h, w):
    return (torch.relu(h).to_sparse_csr() @ w).sum()


def _nested(layout):
    def middle(h, w):
        nt = torch.nested.as_nested_tensor([h[:3], h[3:]], layout=layout)
        y = torch.relu(nt * 2)
        return sum(part.sum() for part in y.unbind()) + (h @ w).sum()
    return middle


def _quantized(h, w):
    return (QuantizedReLU.apply(h - 0.1) @ w).sum()


def _wrapped(h, w):
    y = torch.relu(Wrap.apply(h) @ w)
    return (y * y).sum()


# (middle, which saved tensors are of the kind)
KINDS = {
    "sparse_coo": (_sparse_coo, lambda t: t.layout == torch.sparse_coo),
    "sparse_csr": (_sparse_csr, lambda t: t.layout == torch.sparse_csr),
    "nested": (_nested(torch.strided), lambda t: t.is_nested),
    "nested_jagged": (_nested(torch.jagged), lambda t: t.is_nested),
    "quantized": (_quantized, lambda t: t.is_quantized),
    "wrapper_subclass": (_wrapped, lambda t: type(t) is Wrapped),
}


def _step(model, x):
    model.zero_grad()
    model(x).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _count_saves(model, x, of_kind):
    seen = []

    def pack(t):
        seen.append(of_kind(t) and not (t.is_leaf and t.requires_grad))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen)


STEPS = 6  # the profiler's timed steps (4 at most), then steps on the fast paths of pack


@pytest.mark.parametrize("emulated", [False, True], ids=["cpu", "emulated"])
@pytest.mark.parametrize("mode", ["vdnn", "sc", "cswap"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_unmovable_tensors_stay_and_gradients_are_exact(kind, mode, emulated):
    middle, of_kind = KINDS[kind]
    x = torch.randn(5, 8)
    expected = _step(Net(middle), x)
    model = Net(middle)
    unmovable = _count_saves(model, x, of_kind)
    assert unmovable > 0, f"{kind}: the model saves no tensor of this kind; the test tests nothing"
    options = {"policy": lambda info: "zvc"} if mode == "cswap" else {}
    cswap.patch(model, mode=mode, candidates="all", min_bytes=0, **options)
    with cswap.testing.emulated_device(bandwidth_gbps=0.5, jitter=1e-4) if emulated else nullcontext() as dev:
        steps = [_step(model, x) for _ in range(STEPS)]
    assert not emulated or not dev.hazards
    stats = cswap.stats(model)
    assert stats["kept_unmovable"] == STEPS * unmovable
    assert stats["offloaded_tensors"] > 0  # the plain activations beside them still leave
    for got in steps:
        assert got.keys() == expected.keys()
        for name in expected:
            assert torch.equal(got[name], expected[name]), name
    cswap.unpatch(model)


@pytest.mark.parametrize("path", ["never_a_candidate", "budget"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_unmovable_tensors_stay_on_the_other_paths_of_pack(kind, path):
    """Issue 39 §3.1: pack's fast path for tensors too small to be candidates read a sparse
    COO tensor's nbytes, which raises; under a budget pack asks the plan. Each path keeps
    them in place, steps after steps."""
    middle, _ = KINDS[kind]
    x = torch.randn(5, 8)
    expected = _step(Net(middle), x)
    model = Net(middle)
    if path == "never_a_candidate":
        cswap.patch(model, mode="vdnn", min_bytes=1 << 30)
        steps = [_step(model, x) for _ in range(STEPS)]
    else:
        with cswap.testing.emulated_device(bandwidth_gbps=0.5, capacity_bytes=1 << 20) as dev:
            cswap.patch(model, candidates="all", min_bytes=0, budget=0.5)
            steps = [_step(model, x) for _ in range(STEPS)]
        assert not dev.hazards
    for got in steps:
        for name in expected:
            assert torch.equal(got[name], expected[name]), name
    cswap.unpatch(model)


def test_dtensor_activations_stay_and_gradients_are_exact(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def step(patched):
            torch.manual_seed(0)
            model = nn.Linear(8, 6)
            for name, p in list(model.named_parameters()):
                setattr(model, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
            if patched:
                cswap.patch(model, mode="vdnn", candidates="all", min_bytes=0)
            x = distribute_tensor(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), mesh, [Shard(0)])
            torch.relu(model(x)).pow(2).sum().backward()
            return model, {name: p.grad.full_tensor() for name, p in model.named_parameters()}

        _, expected = step(False)
        model, got = step(True)
        assert cswap.stats(model)["kept_unmovable"] >= 1
        assert cswap.stats(model)["offloaded_tensors"] == 0
        for name in expected:
            assert torch.equal(got[name], expected[name]), name
        cswap.unpatch(model)
    finally:
        dist.destroy_process_group()


def test_meta_tensors_stay():
    """A model on the meta device (shapes only, as for a dry run) trains through the hooks."""
    model = cswap.patch(nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2)).to("meta"), mode="vdnn",
                        candidates="all", min_bytes=0)
    model(torch.randn(4, 8, device="meta")).sum().backward()
    assert all(p.grad is not None and p.grad.is_meta and p.grad.shape == p.shape for p in model.parameters())
    assert cswap.stats(model)["kept_unmovable"] >= 2 and cswap.stats(model)["offloaded_tensors"] == 0


def test_movable_names_exactly_the_plain_dense_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    dense = torch.randn(4, 4)
    assert movable(dense) and movable(dense.t()) and movable(nn.Parameter(dense)) and movable(dense[:, ::2])
    assert not movable(dense.to_sparse()) and not movable(dense.to_sparse_csr())
    assert not movable(torch.nested.nested_tensor([dense, dense]))
    assert not movable(torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8))
    assert not movable(dense.to("meta")) and not movable(Wrapped(dense))
    with FakeTensorMode():
        assert not movable(torch.empty(4))


def test_the_emulated_device_block_itself_keeps_them():
    """cswap.testing.emulated_device() counts what an unpatched model saves: not these."""
    x = torch.randn(5, 8)
    model = Net(_sparse_coo)
    expected = _step(Net(_sparse_coo), x)
    with cswap.testing.emulated_device() as dev:
        got = _step(model, x)
    assert dev.peak_bytes > 0 and all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["sparse_coo", "nested_jagged", "wrapper_subclass"])
def test_on_cuda_they_stay_and_gradients_are_exact(kind):
    """The CUDA path: the same check before anything reads the tensor's storage."""
    middle, of_kind = KINDS[kind]
    x = torch.randn(5, 8, device="cuda")
    expected = _step(Net(middle).cuda(), x)
    model = Net(middle).cuda()
    unmovable = _count_saves(model, x, of_kind)
    cswap.patch(model, mode="sc", candidates="all", min_bytes=0)
    got = _step(model, x)
    torch.cuda.synchronize()
    stats = cswap.stats(model)
    assert stats["kept_unmovable"] == unmovable > 0 and stats["offloaded_tensors"] > 0
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    cswap.unpatch(model)
