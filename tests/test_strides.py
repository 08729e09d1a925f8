"""A restored tensor has exactly the saved tensor's strides (issue 25 §1), and starts at
its address modulo the allocator's alignment.

Kernels choose their path from strides, size-1 dimensions included: timm's
ConvNeXt saves an (N, C, 1, 1) channels_last tensor (LayerNorm2d at a 1x1
stage) whose strides differ from the contiguous ones although is_contiguous()
is true for both. A Function here saves tensors of such layouts (and of layouts
with gaps, which leave as a dense tensor they lie in) and folds the strides and
values it gets back into its gradient, so a restore with other strides changes
gradients; each layout goes through every mode, on the CPU default and
on the emulated device. Also here: what a saved tensor may be beyond its layout (a
real view of a complex tensor, a tensor with the neg bit, a ZeroTensor).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cswap

pytestmark = pytest.mark.filterwarnings("ignore:.*saves no memory:RuntimeWarning",
                                        "ignore:.*no profile for this device:RuntimeWarning")

LAYOUTS = {  # size, strides
    "nc11-channels-last": ((2, 3, 1, 1), (3, 1, 3, 3)),
    "size1-odd-strides": ((4, 1, 5), (5, 7, 1)),
    "channels-last": ((2, 3, 4, 5), (60, 1, 15, 3)),
    "transposed": ((6, 4), (1, 6)),
    "one-element": ((1, 1), (9, 4)),
    "padded-rows": ((3, 4), (6, 1)),  # gaps: sent as the span of memory they cover
    "gaps-transposed": ((4, 3), (1, 8)),
}
SAVES = 3


class StridesIntoGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return h * 3

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        StridesIntoGradient.seen.append(h.stride())
        return grad * (3 + sum(i * s for i, s in enumerate(h.stride(), 1))) + h


class Net(nn.Module):
    def __init__(self, size, stride):
        super().__init__()
        self.size, self.stride = size, stride
        self.w = nn.Parameter(torch.linspace(-1, 1, torch.Size(size).numel()).reshape(size))

    def forward(self, x):
        total = 0
        for k in range(1, SAVES + 1):  # backward uses the last first, and restores the others ahead of use
            h = torch.empty_strided(self.size, self.stride).copy_(x * self.w * k)  # an activation with these strides
            total = total + StridesIntoGradient.apply(h).sum()
        return total


def _grads(model, x):
    StridesIntoGradient.seen = []
    model.zero_grad()
    model(x).backward()
    return model.w.grad.clone(), StridesIntoGradient.seen


def _patched_steps(model, x, device, grads=_grads) -> list:
    """`grads(model, x)` of each of two steps of a patched model (the second restores as
    the first did), on the CPU default or on the emulated device, which must find no hazard."""
    results = []
    for _ in range(2):
        if device == "emulated":
            with cswap.testing.emulated_device() as dev:
                results.append(grads(model, x))
            assert dev.hazards == []
        else:
            results.append(grads(model, x))
    return results


def _exact_steps(make, x, mode, device, **options) -> tuple[dict, list]:
    """Two steps of the patched model make() against an unpatched one: the same gradients and
    the same strides seen in backward at each. cswap's stats after them, and those strides."""
    expected, seen = _grads(make(), x)
    model = cswap.patch(make(), mode=mode, candidates="all", min_bytes=0, **options)
    try:
        for got, seen_now in _patched_steps(model, x, device):
            assert seen_now == seen and torch.equal(got, expected)
        return dict(cswap.stats(model)), seen
    finally:
        cswap.unpatch(model)


@pytest.mark.parametrize("device", ["cpu", "emulated"])
@pytest.mark.parametrize("mode", ["vdnn", "sc", "cswap"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_restored_tensors_keep_their_strides(layout, mode, device):
    size, stride = LAYOUTS[layout]
    x = torch.randn(size).relu()  # zeros: the codecs have something to compress
    stats, seen = _exact_steps(lambda: Net(size, stride), x, mode, device, prefetch_bytes=1 << 20)
    assert seen == [stride] * SAVES
    assert stats["offloaded_tensors"] > 0
    assert stats["prefetched"] > 0  # (restored in a group, raw, or one by one)


class FusedViews(nn.Module):
    """q, k and v as a fused projection makes them (ModernBERT, GPT-NeoX, Phi-3): views
    with gaps of one tensor, each saved by an op that folds its strides into its gradient."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, 4 * 12).reshape(4, 12))

    def forward(self, x):
        qkv = (x @ self.w).view(2, 3, 3, 4)  # (batch, position, q/k/v, width)
        views = [qkv[:, :, i] for i in range(3)]  # each (2, 3, 4), strides (36, 12, 1): gaps
        views[2] = views[2].transpose(1, 2)  # (and one permuted too)
        return sum(StridesIntoGradient.apply(v).sum() for v in views)


@pytest.mark.parametrize("device", ["cpu", "emulated"])
@pytest.mark.parametrize("mode", ["vdnn", "sc", "cswap"])
def test_views_with_gaps_come_back_with_their_strides_sent_once_as_their_base(mode, device):
    """A view that is not dense leaves as the tensor it views, once for all its views:
    each comes back with its own strides, as kernels choose their path (and their
    rounding) by strides. Gathered and restored contiguous, ModernBERT's gradients
    differed in the last bit."""
    x = torch.randn(6, 4).relu()
    stats, seen = _exact_steps(FusedViews, x, mode, device)
    assert seen == [(36, 1, 12), (36, 12, 1), (36, 12, 1)]  # (backward: v, k, q)
    # (each step: the base once, its 72 floats, and k and v found in it)
    assert stats["offloaded_tensors"] == 2 and stats["deduplicated"] == 4
    assert stats["offloaded_bytes"] == 2 * 72 * 4


@pytest.mark.parametrize("mode", ["vdnn", "sc"])
def test_tensors_with_gaps_that_view_no_dense_tensor_leave_as_the_span_they_cover(monkeypatch, mode):
    """A saved tensor with gaps that views no dense tensor (padded rows, made by
    torch.empty_strided; a detached slice) leaves as the span of memory it covers, gaps
    included: nothing is allocated on the device to send it raw (it was gathered into a
    block, which could run out of memory, and came back contiguous), and it comes back
    with its strides."""
    from cswap.runtime.immediate import ImmediateDevice

    size, stride = LAYOUTS["padded-rows"]
    x = torch.randn(size).relu()
    expected, _ = _grads(Net(size, stride), x)
    if mode == "vdnn":
        def allocates(self, nbytes, stream):  # (the CPU's raw copies allocate nothing on the device)
            raise AssertionError("a raw copy allocated on the device")

        monkeypatch.setattr(ImmediateDevice, "empty", allocates)
    model = cswap.patch(Net(size, stride), mode=mode, candidates="all", min_bytes=0)
    try:
        for _ in range(2):
            got, seen = _grads(model, x)
            assert seen == [stride] * SAVES and torch.equal(got, expected)
        stats = cswap.stats(model)
        span = 1 + sum((n - 1) * s for n, s in zip(size, stride))  # 16 floats for 12
        assert stats["offloaded_tensors"] == 2 * SAVES
        if mode == "vdnn":
            assert stats["offloaded_bytes"] == 2 * SAVES * span * 4
    finally:
        cswap.unpatch(model)




class SpanSavedTwice(nn.Module):
    """One tensor with gaps that views no dense tensor, saved by two ops."""

    def __init__(self, size, stride):
        super().__init__()
        self.size, self.stride = size, stride
        self.w = nn.Parameter(torch.linspace(-1, 1, torch.Size(size).numel()).reshape(size))

    def forward(self, x):
        h = torch.empty_strided(self.size, self.stride).copy_(x * self.w)
        return StridesIntoGradient.apply(h).sum() + StridesIntoGradient.apply(h).sum()


@pytest.mark.parametrize("device", ["cpu", "emulated"])
@pytest.mark.parametrize("mode", ["vdnn", "sc"])
def test_a_span_saved_twice_is_sent_once(mode, device):
    """The span a tensor with gaps leaves as is made anew at each save: the second save of
    the same tensor finds the first's copy (it was sent twice), and comes back with its
    strides."""
    size, stride = LAYOUTS["padded-rows"]
    x = torch.randn(size).relu()
    stats, seen = _exact_steps(lambda: SpanSavedTwice(size, stride), x, mode, device)
    assert seen == [stride] * 2
    span = 1 + sum((n - 1) * s for n, s in zip(size, stride))
    assert stats["offloaded_tensors"] == 2 and stats["deduplicated"] == 2
    if mode == "vdnn":
        assert stats["offloaded_bytes"] == 2 * span * 4


class AddressIntoGradient(torch.autograd.Function):
    """Saves h and notes, in backward, where the tensor it gets back starts modulo 64."""

    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return h * 3

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        AddressIntoGradient.seen.append(h.data_ptr() % 64)
        return grad * 3 + h


class OffsetSaves(nn.Module):
    """Saves tensors that start off the allocator's alignment: a dense slice 4 bytes into a
    larger tensor, a tensor with gaps that views no dense tensor (a span) 12 bytes in, and
    a bf16 slice 10 bytes in."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, 24).reshape(4, 6))

    def forward(self, x):
        h = x * self.w
        saves = [torch.empty(1 + 24)[1:].view(4, 6).copy_(h),
                 torch.empty(4, 9)[:, 3:].detach().copy_(h),
                 torch.empty(5 + 24, dtype=torch.bfloat16)[5:].view(4, 6).copy_(h)]
        total = 0
        for s in saves:
            AddressIntoGradient.made.append(s.data_ptr() % 64)
            total = total + AddressIntoGradient.apply(s).float().sum()
        return total


def _address_grads(model, x):
    AddressIntoGradient.made, AddressIntoGradient.seen = [], []
    model.zero_grad()
    model(x).backward()
    return model.w.grad.clone(), AddressIntoGradient.made[::-1], AddressIntoGradient.seen


@pytest.mark.parametrize("device", ["cpu", "emulated"])
@pytest.mark.parametrize("mode", ["vdnn", "sc", "cswap"])
def test_restored_tensors_start_at_their_address_modulo_the_allocators_alignment(mode, device):
    """Kernels choose their path by alignment as well as by strides (cuBLASLt by up to 256
    bytes, vectorized loads and reductions by 16), so a tensor that started off the
    allocator's alignment comes back as far off it (on the CPU, modulo its 64 bytes; on
    CUDA, modulo the caching allocator's 512)."""
    x = torch.randn(4, 6).relu()
    expected, made, seen = _address_grads(OffsetSaves(), x)
    assert made == seen == [10, 12, 4]  # (the test's own premise: CPU tensors start at 64 bytes)
    model = cswap.patch(OffsetSaves(), mode=mode, candidates="all", min_bytes=0)
    try:
        for got, made, seen in _patched_steps(model, x, device, _address_grads):
            assert seen == made and torch.equal(got, expected)
        assert cswap.stats(model)["offloaded_tensors"] == 2 * 3
    finally:
        cswap.unpatch(model)


class WithZeros(torch.autograd.Function):
    """Saves h and a ZeroTensor (autograd's zeros without memory) beside it."""

    @staticmethod
    def forward(ctx, h, zeros):
        ctx.save_for_backward(h, zeros)
        return h * 3

    @staticmethod
    def backward(ctx, grad):
        h, zeros = ctx.saved_tensors
        return grad * 3 + h + zeros, None


class ComplexViews(nn.Module):
    """Real views of a complex tensor, saved: z.real (gaps, in floats), view_as_real(z)
    (dense) and z.conj().imag (gaps, with its negation pending: the neg bit); and a
    ZeroTensor."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, 24).reshape(4, 6))

    def forward(self, x):
        z = torch.complex(x * self.w, x - self.w)
        saves = [z.real, torch.view_as_real(z), z.conj().imag]
        total = sum((StridesIntoGradient.apply(s) * k).sum() for k, s in enumerate(saves, 1))
        return total + WithZeros.apply(x * self.w, torch._efficientzerotensor(x.shape)).sum()


@pytest.mark.parametrize("device", ["cpu", "emulated"])
@pytest.mark.parametrize("mode", ["vdnn", "sc", "cswap"])
def test_real_views_of_complex_tensors_come_back_as_they_were(mode, device):
    """A view in another dtype than the tensor it views (z.real of a complex z) leaves as
    the span it covers, not as that tensor (it came back as a complex tensor, and failed);
    a tensor with the neg bit (z.conj().imag) stays, as its bytes are not its values (a
    copy of its bytes failed, and could abort the process), and so does a ZeroTensor
    (the emulated device failed on it)."""
    x = torch.randn(4, 6).relu()
    stats, _ = _exact_steps(ComplexViews, x, mode, device)
    assert stats["kept_unmovable"] == 2 * 2 and stats["offloaded_tensors"] > 0  # (each step: neg bit, zeros)


class ComplexViewOfAnOffloadedTensor(nn.Module):
    """A float tensor saved (and offloaded), then a complex view of it saved too."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, 24).reshape(4, 6))

    def forward(self, x):
        f = torch.stack([x * self.w, x - self.w], -1)  # (4, 6, 2): its own base
        c = torch.view_as_complex(f)
        return StridesIntoGradient.apply(f).sum() + (StridesIntoGradient.apply(c) * (1 + 2j)).real.sum()


@pytest.mark.parametrize("device", ["cpu", "emulated"])
@pytest.mark.parametrize("mode", ["vdnn", "sc"])
def test_a_view_in_another_dtype_is_not_served_from_its_bases_copy(mode, device):
    """view_as_complex(f) of an offloaded float f came back as f's floats, laid out with the
    complex view's strides: wrong values and dtype, and gradients that differed silently."""
    x = torch.randn(4, 6).relu()
    stats, _ = _exact_steps(ComplexViewOfAnOffloadedTensor, x, mode, device)
    assert stats["offloaded_tensors"] > 0
