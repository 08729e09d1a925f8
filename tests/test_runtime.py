"""Runtime on CPU: patch/unpatch/offload/stats, the swapper's pipeline and the host pool.

Without CUDA the swapper runs the code a GPU runs (worker and releaser threads,
side streams, events, pinned buffers) against an emulated device: a zero-delay
one by default, a slow and jittery one where a test says so (the ordering
tests proper are in test_emulated_runtime.py). Gradients are compared bit for
bit (torch.equal) with stock autograd.
"""

from __future__ import annotations

import gc
import threading
import time
import warnings
import weakref
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import cswap
import nets
from cswap.runtime import emulator
from cswap.runtime.emulator import EmulatedDevice
from cswap.runtime.candidates import SPARSE_PRODUCERS, op_name
from cswap.runtime.host_pool import HostPool, size_class
from cswap.patch import _PATCHED
from cswap.runtime.items import Handle
from cswap.runtime.swapper import Swapper

pytestmark = pytest.mark.filterwarnings("ignore:.*saves no memory:RuntimeWarning")

CODECS = ("zvc", "rle", "csr", "lz4")
COUNTERS = ("offloaded_tensors", "offloaded_bytes", "transferred_bytes", "compressed_tensors", "deduplicated",
            "kept_on_gpu", "restored_tensors", "prefetched", "on_demand", "prefetch_stall_s", "offload_stall_s")


def cycling_policy(info):
    """Every codec in turn, and None (offload uncompressed) every fifth tensor."""
    return (*CODECS, None)[info.index % 5]


MODES = {
    "none": {"mode": "none"},
    "vdnn": {"mode": "vdnn"},
    "sc": {"mode": "sc"},
    "cswap": {"mode": "cswap", "policy": cycling_policy},
}


# -- helpers ----------------------------------------------------------------------------------

def snapshot(model):
    """Parameters, their grads and the buffers (BatchNorm running stats), cloned."""
    out = {}
    for name, p in model.named_parameters():
        out["param:" + name] = p.detach().clone()
        out["grad:" + name] = None if p.grad is None else p.grad.clone()
    for name, b in model.named_buffers():
        out["buffer:" + name] = b.clone()
    return out


def assert_same(got, expected):
    assert got.keys() == expected.keys()
    for key in expected:
        a, b = got[key], expected[key]
        if b is None:
            assert a is None, key
            continue
        assert a is not None, key
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert torch.equal(a, b), f"{key} differs (max abs diff {(a.double() - b.double()).abs().max().item()})"


def train(model, shape, steps=3, lr=0.1, channels_last=False, train_mode=True):
    """`steps` SGD steps (momentum, so every step's grads matter) on fixed data."""
    model.train(train_mode)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in nets.batches(shape, steps, channels_last=channels_last):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return snapshot(model)


_REFERENCE = {}


def reference(name, **kw):
    """Stock autograd's result for nets.MODELS[name] (cached: the models are deterministic)."""
    key = (name, tuple(sorted(kw.items())))
    if key not in _REFERENCE:
        make, shape = nets.MODELS[name]
        model = make()
        if kw.get("channels_last"):
            model = model.to(memory_format=torch.channels_last)
        _REFERENCE[key] = train(model, shape, **kw)
    return _REFERENCE[key]


def swapper_of(model) -> Swapper:
    return _PATCHED[model].swapper


def counters(stats):
    return {k: stats[k] for k in COUNTERS}


def hook_counts(model):
    return {name: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._forward_hooks_always_called),
                   len(m._backward_hooks), len(m._backward_pre_hooks))
            for name, m in model.named_modules()}


def saved_tensor_hooks_installed() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def offload_threads():
    return {t for t in threading.enumerate() if t.name in ("cswap-offload", "cswap-release") and t.is_alive()}


def record_offloaded(swapper):
    """Wrap swapper.pack: the list gets every tensor that was handed to the offload path."""
    seen = []
    pack = swapper.pack

    def recording_pack(t):
        packed = pack(t)
        if isinstance(packed, Handle) and packed.view is None and packed.item.weak() is t \
                and all(s is not t for s in seen):
            seen.append(t)
        return packed

    swapper.pack = recording_pack
    return seen


class Recorder:
    """A policy that records every SwapInfo and answers with `choose(info)`."""

    def __init__(self, choose=lambda info: None):
        self.infos = []
        self.choose = choose

    def __call__(self, info):
        self.infos.append(info)
        return self.choose(info)


# -- 1. gradients equal stock autograd, bit for bit -------------------------------------------------

@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["vgg", "vgg_inplace", "resnet", "functional", "transformer"])
def test_gradients_equal_unpatched(name, mode):
    make, shape = nets.MODELS[name]
    model = cswap.patch(make(), min_bytes=0, **MODES[mode])
    got = train(model, shape)
    assert_same(got, reference(name))
    s = cswap.stats(model)
    if mode == "none":
        assert counters(s) == counters(cswap.SwapStats())
        assert swapper_of(model).pool.allocations == 0
    else:
        assert s["offloaded_tensors"] > 0 and s["offloaded_bytes"] > 0
        assert s["restored_tensors"] > 0
    if mode in ("sc", "cswap"):
        assert s["compressed_tensors"] > 0
        assert s["transferred_bytes"] < s["offloaded_bytes"]
    if mode == "vdnn":
        assert s["compressed_tensors"] == 0 and s["transferred_bytes"] == s["offloaded_bytes"]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["vgg", "resnet"])
def test_gradients_equal_unpatched_on_a_slow_emulated_device(name, mode):
    make, shape = nets.MODELS[name]
    with cswap.testing.emulated_device(bandwidth_gbps=0.05, jitter=0.0005) as dev:
        model = cswap.patch(make(), min_bytes=0, **MODES[mode])
        try:
            got = train(model, shape)
            assert_same(got, reference(name))
            if mode != "none":
                assert cswap.stats(model)["offloaded_tensors"] > 0
                assert dev.copies  # the copies really went through the emulated link
        finally:
            cswap.unpatch(model)
    assert dev.hazards == []


@pytest.mark.parametrize("name", ["functional", "transformer"])
def test_a_one_byte_stash(name):
    """stash_bytes=1: forward waits for the copy out after every tensor; still exact."""
    make, shape = nets.MODELS[name]
    model = cswap.patch(make(), mode="cswap", policy=cycling_policy, min_bytes=0,
                        stash_bytes=1, prefetch_bytes=0)
    try:
        assert_same(train(model, shape), reference(name))
        assert cswap.stats(model)["offloaded_tensors"] > 0
    finally:
        cswap.unpatch(model)


class SparseNet(nn.Module):
    """ReLU outputs with ~90% zeros: every codec shrinks them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x) - 1.0)
        x = F.max_pool2d(F.relu(self.conv2(x) - 0.5), 2)
        return self.fc(x.flatten(1))


@pytest.mark.parametrize("codec", CODECS)
def test_every_codec_compresses_and_round_trips_in_training(codec):
    expected = train(SparseNet(), nets.IMAGE)
    model = cswap.patch(SparseNet(), policy=lambda info: codec, min_bytes=0)
    assert swapper_of(model).mode == "cswap"  # passing a policy selects mode="cswap"
    assert_same(train(model, nets.IMAGE), expected)
    s = cswap.stats(model)
    assert s["compressed_tensors"] == s["offloaded_tensors"] > 0
    assert s["transferred_bytes"] < s["offloaded_bytes"]
    assert {item.codec for item in swapper_of(model)._pass.items} == {codec}


# -- 2. stats -----------------------------------------------------------------------------------------

def one_step(model, shape=nets.IMAGE, **backward):
    """One forward and backward; a patched model's copies out complete in between,
    so counts do not depend on thread timing (every item is restored, none is
    served from the device)."""
    x, y = nets.batches(shape, 1)[0]
    loss = F.cross_entropy(model(x), y)
    if model in _PATCHED:
        swapper_of(model).synchronize()
    loss.backward(**backward)
    return loss


def test_stats_count_offload_and_restore_vdnn():
    model = cswap.patch(nets.vgg_like(), mode="vdnn", min_bytes=0)
    with cswap.testing.emulated_device():  # it counts device memory (the CPU's default device does not)
        one_step(model)
    s = cswap.stats(model)
    assert s["offloaded_tensors"] > 0 and s["offloaded_bytes"] > 0
    assert s["transferred_bytes"] == s["offloaded_bytes"] and s["compressed_tensors"] == 0
    assert s["kept_on_gpu"] == 0
    assert s["restored_tensors"] == s["offloaded_tensors"]        # each item once per backward
    assert s["prefetched"] > 0                                     # backward restores ahead of need
    assert s["restored_tensors"] == s["prefetched"] + s["on_demand"]
    assert s["on_demand"] >= 1                                     # the first unpack cannot be prefetched
    assert s["peak_host_pool_bytes"] >= s["host_pool_bytes"] > 0
    device = swapper_of(model).device
    assert s["peak_gpu_bytes"] == device.max_memory_allocated() > 0
    assert isinstance(s, cswap.SwapStats) and set(s) == set(cswap.SwapStats.fields) and len(s) == len(s.fields)
    assert "offloaded_tensors=" in repr(s)
    with pytest.raises(KeyError, match="no field"):
        s["no_such_field"]
    # What the repr shows works as written: every field it prints is an attribute too.
    for name in s:
        assert getattr(s, name) == s[name] and f"{name}=" in repr(s)
    assert s.offloaded_tensors > 0 and "offloaded_tensors" in dir(s)
    with pytest.raises(AttributeError, match="no field 'offloaded'.*offloaded_tensors"):
        s.offloaded


def test_stats_sc_compresses_relu_sparse_activations():
    model = cswap.patch(nets.vgg_like(), mode="sc", min_bytes=0)
    one_step(model)
    s = cswap.stats(model)
    assert s["compressed_tensors"] > 0
    assert s["transferred_bytes"] < s["offloaded_bytes"]
    assert all(item.codec == "zvc" for item in swapper_of(model)._pass.items)


def test_stats_none_mode_offloads_nothing():
    model = cswap.patch(nets.resnet_like(), mode="none", min_bytes=0)
    one_step(model)
    s = cswap.stats(model)
    assert all(s[k] == 0 for k in COUNTERS)
    assert s["host_pool_bytes"] == s["peak_host_pool_bytes"] == 0


def test_dedup_counts_exactly():
    """Tiny: conv, relu r1, maxpool p, conv, relu r2, flatten, linear. Saves of activations:
    ReLU saves r1 (offload 1), maxpool saves r1 (dedup 1), conv saves p (offload 2), ReLU saves
    r2 (offload 3), linear saves flatten(r2), a view of r2 (dedup 2). Input, weights, the
    maxpool indices and linear's weight.t() are not candidates."""
    model = cswap.patch(nets.tiny(), mode="vdnn", min_bytes=0)
    one_step(model, shape=(2, 3, 8, 8))
    s = cswap.stats(model)
    r1, p, r2 = 2 * 4 * 8 * 8 * 4, 2 * 4 * 4 * 4 * 4, 2 * 4 * 4 * 4 * 4
    assert s["offloaded_tensors"] == 3
    assert s["deduplicated"] == 2
    assert s["offloaded_bytes"] == s["transferred_bytes"] == r1 + p + r2
    assert s["restored_tensors"] == 3
    assert s["prefetched"] + s["on_demand"] == 3
    items = swapper_of(model)._pass.items
    assert [(i.info.op, i.info.layer) for i in items] == [
        ("relu", "body.1"), ("max_pool2d", "body.2"), ("relu", "body.4")]
    # a second forward counts again: dedup is per pass, not across passes
    one_step(model, shape=(2, 3, 8, 8))
    assert s["offloaded_tensors"] == 6 and s["deduplicated"] == 4


def _saved_again(after_first_save, mode, device, again=lambda t: t):
    """t = 2x is saved by sin (a branch that backward never runs), then `after_first_save`,
    then cos saves it again (or saves `again(t)`, a view of it), then more tensors are
    offloaded (reusing freed host buffers); x's gradient and the dedup count, under cswap
    (with copies out left in flight) on the CPU's default device or the emulated one (pack
    takes another path for each)."""
    x = torch.randn(64, 64, requires_grad=True)
    emulated = cswap.testing.emulated_device() if device == "emulated" else nullcontext()
    with emulated:
        with cswap.offload(mode=mode, min_bytes=0, candidates="all") as sw:
            t = x * 2
            branch = t.sin()
            branch = after_first_save(t, branch)
            kept = again(t).cos()
            more = [(x * k).sin() for k in range(3, 8)]
        loss = kept.sum() + sum(m.sum() for m in more)
        loss.backward()
        del branch
    return x.grad, sw.stats["deduplicated"]


def _stock_grad(after_first_save, again=lambda t: t):
    x = torch.randn(64, 64, requires_grad=True)
    t = x * 2
    after_first_save(t, t.sin())
    loss = again(t).cos().sum() + sum((x * k).sin().sum() for k in range(3, 8))
    loss.backward()
    return x.grad


@pytest.mark.parametrize("device", ["cpu", "emulated"])
@pytest.mark.parametrize("mode", ["vdnn", "sc"])
def test_a_save_after_every_earlier_save_died_is_offloaded_anew(mode, device):
    """Dedup serves a live record only: once sin's save of t is gone (its node freed, its
    host buffer given back to the pool), cos's save of t is a tensor of its own."""
    def drop_branch(t, branch):
        return None  # the sin node and its save die here

    torch.manual_seed(0)
    grad, deduplicated = _saved_again(drop_branch, mode, device)
    torch.manual_seed(0)
    assert torch.equal(grad, _stock_grad(drop_branch))
    assert deduplicated == 0


@pytest.mark.parametrize("device", ["cpu", "emulated"])
@pytest.mark.parametrize("mode", ["vdnn", "sc"])
def test_a_save_after_an_in_place_change_is_offloaded_anew(mode, device):
    """t changed in place after sin saved it (legal: sin's backward never runs): cos saves
    the new values, which dedup must not serve from sin's record of the old ones."""
    def change(t, branch):
        t.mul_(3)
        return branch  # (alive: its save of t, at the old version, stays)

    torch.manual_seed(0)
    grad, deduplicated = _saved_again(change, mode, device)
    torch.manual_seed(0)
    assert torch.equal(grad, _stock_grad(change))
    assert deduplicated == 0


@pytest.mark.parametrize("saved", ["itself", "a view"])
@pytest.mark.parametrize("device", ["cpu", "emulated"])
@pytest.mark.parametrize("mode", ["vdnn", "sc"])
def test_a_save_whose_record_dies_while_it_is_looked_up_is_offloaded_anew(mode, device, saved, monkeypatch):
    """The dedup lookup found sin's record of t live, and its last save died before cos's
    save (of t, or of a view of t) was counted on it (a collection, or another thread, can
    drop it there): the freed record, whose host buffer went back to the pool, must not
    serve cos's save."""
    from cswap.runtime.swapper import Swapper

    held = {}
    lookup = Swapper._live_entry
    again = (lambda t: t) if saved == "itself" else (lambda t: t.view(32, 128))

    def dying_meanwhile(self, t, version):
        entry = lookup(self, t, version)
        if entry is not None and t is held.get("t") and held.get("branch") is not None:
            held["branch"] = None  # sin's node and its save of t die now, after the lookup
        return entry

    def hold(t, branch):
        held["t"], held["branch"] = t, branch
        return None

    monkeypatch.setattr(Swapper, "_live_entry", dying_meanwhile)
    torch.manual_seed(0)
    grad, deduplicated = _saved_again(hold, mode, device, again)
    assert held["branch"] is None  # (the lookup did find it live)
    torch.manual_seed(0)
    assert torch.equal(grad, _stock_grad(lambda t, branch: None, again))
    assert deduplicated == 0


def test_stats_reset_zeroes_counters():
    model = cswap.patch(nets.vgg_like(), mode="sc", min_bytes=0)
    one_step(model)
    s = cswap.stats(model)
    first = counters(s)
    assert first["offloaded_tensors"] > 0 and first["restored_tensors"] > 0
    s.reset()
    assert all(s[k] == 0 for k in COUNTERS)
    assert isinstance(s["prefetch_stall_s"], float)
    assert s["peak_offload_bytes"] == s["peak_prefetch_bytes"] == 0
    one_step(model)  # same data and weights (no optimizer step): the same counts again
    again = counters(s)
    for k in COUNTERS:
        if not k.endswith("_s"):
            assert again[k] == first[k], k
    assert s["peak_offload_bytes"] > 0 and s["peak_prefetch_bytes"] > 0  # peaks since the reset, not before


def test_stats_counted_from_many_threads_add_up():
    """Each thread counts in a tally of its own, without a lock: none is lost, and a
    peak is the largest any thread saw."""
    import threading

    s = cswap.SwapStats()
    start = threading.Barrier(4)

    def count(k):
        start.wait()
        for i in range(20000):
            s.add("offloaded_tensors")
            s.add_all(("offloaded_bytes", 2), ("transferred_bytes", 1))
            s.peak("peak_offload_bytes", 1000 * k + i % 7)
        s.add("offload_stall_s", 0.5)

    threads = [threading.Thread(target=count, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s["offloaded_tensors"] == 80000 and s["offloaded_bytes"] == 160000 and s["transferred_bytes"] == 80000
    assert s["peak_offload_bytes"] == 3006
    assert s["offload_stall_s"] == 2.0 and isinstance(s["offload_stall_s"], float)
    s.reset()
    assert s["offloaded_tensors"] == 0 and s["peak_offload_bytes"] == 0 and s["offload_stall_s"] == 0.0


def test_stats_of_unpatched_model_raises():
    model = nets.tiny()
    with pytest.raises(ValueError, match="not patched"):
        cswap.stats(model)
    with pytest.raises(ValueError, match="not patched"):
        cswap.stats(object())
    cswap.patch(model)
    cswap.stats(model)
    cswap.unpatch(model)
    with pytest.raises(ValueError, match="not patched"):
        cswap.stats(model)


def test_each_offloaded_tensor_restored_once_when_saved_twice():
    """Saved twice (ReLU + maxpool): one restore serves both."""
    model = cswap.patch(nets.vgg_like(), mode="vdnn", min_bytes=0)
    one_step(model)
    s = cswap.stats(model)
    assert s["deduplicated"] > 0
    assert s["restored_tensors"] == s["offloaded_tensors"]


def test_tensor_saved_three_times_is_restored_once():
    w = torch.randn(16, 16, requires_grad=True)
    w1 = torch.randn(16, requires_grad=True)
    w2 = torch.randn(16, requires_grad=True)
    x = torch.randn(8, 16)
    with cswap.offload(mode="vdnn", min_bytes=0) as sw:
        r = F.relu(x @ w)              # saved by ReluBackward
        loss = (r * w1 + r * w2).sum()  # and by both muls: one item, three handles
    assert sw.stats["offloaded_tensors"] == 1 and sw.stats["deduplicated"] == 2
    loss.backward()
    assert sw.stats["restored_tensors"] == 1
    assert sw.stats["on_demand"] == 1


def test_resnet_restores_each_offloaded_tensor_once():
    model = cswap.patch(nets.resnet_like(), mode="vdnn", min_bytes=0)
    one_step(model)
    s = cswap.stats(model)
    assert s["restored_tensors"] == s["offloaded_tensors"]


# -- 3. candidates ------------------------------------------------------------------------------------

CANDIDATES = {
    "F.relu": (lambda a: F.relu(a), (2, 4, 8, 8), "relu"),
    "nn.ReLU": (nn.ReLU(), (2, 4, 8, 8), "relu"),
    "nn.ReLU(inplace)": (nn.ReLU(inplace=True), (2, 4, 8, 8), "relu"),
    "relu_": (lambda a: a.relu_(), (2, 4, 8, 8), "relu"),
    "threshold": (lambda a: F.threshold(a, 0.1, 0.0), (2, 4, 8, 8), "threshold"),
    "relu6": (lambda a: F.relu6(a * 4), (2, 4, 8, 8), "hardtanh"),
    "nn.ReLU6": (nn.ReLU6(), (2, 4, 8, 8), "hardtanh"),
    "leaky_relu": (lambda a: F.leaky_relu(a, 0.1), (2, 4, 8, 8), "leaky_relu"),
    "nn.LeakyReLU(inplace)": (nn.LeakyReLU(0.1, inplace=True), (2, 4, 8, 8), "leaky_relu"),
    "hardtanh": (lambda a: F.hardtanh(a), (2, 4, 8, 8), "hardtanh"),
    "max_pool2d": (lambda a: F.max_pool2d(a, 2), (2, 4, 8, 8), "max_pool2d"),
    "nn.MaxPool2d": (nn.MaxPool2d(2), (2, 4, 8, 8), "max_pool2d"),
    "avg_pool2d": (lambda a: F.avg_pool2d(a, 2), (2, 4, 8, 8), "avg_pool2d"),
    "nn.AvgPool2d": (nn.AvgPool2d(2), (2, 4, 8, 8), "avg_pool2d"),
    "adaptive_max_pool2d": (lambda a: F.adaptive_max_pool2d(a, 3), (2, 4, 8, 8), "adaptive_max_pool2d"),
    "adaptive_avg_pool2d": (lambda a: F.adaptive_avg_pool2d(a, 3), (2, 4, 8, 8), "adaptive_avg_pool2d"),
    "max_pool1d": (lambda a: F.max_pool1d(a, 2), (2, 4, 8), "max_pool2d"),
    "avg_pool1d": (lambda a: F.avg_pool1d(a, 2), (2, 4, 8), "avg_pool2d"),
    "max_pool3d": (lambda a: F.max_pool3d(a, 2), (2, 2, 4, 4, 4), "max_pool3d"),
    "avg_pool3d": (lambda a: F.avg_pool3d(a, 2), (2, 2, 4, 4, 4), "avg_pool3d"),
}


def run_op(op, shape, swap=None):
    """a = x * s (non-leaf), y = op(a), loss = sum(y * v): y is saved by the mul (and
    by op itself for ReLU). Returns (grads of s and v, y's shape)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=gen)
    s = torch.randn(shape[1], *([1] * (len(shape) - 2)), generator=gen).requires_grad_()
    with swap if swap is not None else nullcontext():
        y = op(x * s)
        v = torch.randn(y.shape, generator=gen).requires_grad_()
        loss = (y * v).sum()
    loss.backward()
    return [s.grad, v.grad], tuple(y.shape)


@pytest.mark.parametrize("name", list(CANDIDATES))
def test_candidates(name):
    op, shape, producer = CANDIDATES[name]
    expected, _ = run_op(op, shape)
    policy = Recorder()
    region = cswap.offload(policy=policy, min_bytes=0)
    got, yshape = run_op(op, shape, region)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert [(i.op, i.shape) for i in policy.infos] == [(producer, yshape)]
    assert producer in {op_name(n) for n in SPARSE_PRODUCERS}


@pytest.mark.parametrize("name", ["conv", "tanh", "sigmoid", "gelu", "add"])
@pytest.mark.parametrize("candidates", ["sparse", "all"])
def test_non_sparse_outputs_are_candidates_only_with_all(name, candidates):
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    op = {"conv": conv, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "gelu": F.gelu,
          "add": lambda a: a + 1}[name]
    x = torch.randn(2, 3, 8, 8, requires_grad=True)  # a leaf: never offloaded
    with cswap.offload(mode="vdnn", min_bytes=0, candidates=candidates) as sw:
        y = op(x)
        v = torch.randn(y.shape, requires_grad=True)
        loss = (y * v).sum()
    loss.backward()
    assert sw.stats["offloaded_tensors"] == (1 if candidates == "all" else 0)
    assert not saved_tensor_hooks_installed()


def leaf_storages(model):
    return {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}


@pytest.mark.parametrize("train_mode", [True, False])
def test_parameters_and_buffers_never_offloaded(train_mode):
    """Every activation is a candidate, BatchNorm saves weight and (eval) running stats."""
    model = cswap.patch(nets.resnet_like_conv_head(), mode="vdnn", candidates="all", min_bytes=0)
    offloaded = record_offloaded(swapper_of(model))
    model.train(train_mode)
    one_step(model)
    assert offloaded and cswap.stats(model)["offloaded_tensors"] == len(offloaded)
    leaves = leaf_storages(model)
    assert not [tuple(t.shape) for t in offloaded if t.untyped_storage().data_ptr() in leaves]
    assert all(t.grad_fn is not None or t._base is not None for t in offloaded)


def test_linear_weight_view_never_offloaded_with_all():
    model = cswap.patch(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), mode="vdnn",
                        candidates="all", min_bytes=0)
    offloaded = record_offloaded(swapper_of(model))
    model(torch.randn(4, 8)).sum().backward()
    leaves = leaf_storages(model)
    assert offloaded
    assert not [tuple(t.shape) for t in offloaded if t.untyped_storage().data_ptr() in leaves]


def test_min_bytes_floor():
    """Tiny's saved activations: r1 2048 bytes, p and r2 512 bytes each."""
    counts = {}
    for floor in (0, 513, 2048, 2049):
        model = cswap.patch(nets.tiny(), mode="vdnn", min_bytes=floor)
        one_step(model, shape=(2, 3, 8, 8))
        counts[floor] = (cswap.stats(model)["offloaded_tensors"], cswap.stats(model)["offloaded_bytes"])
    assert counts == {0: (3, 3072), 513: (1, 2048), 2048: (1, 2048), 2049: (0, 0)}


def test_default_min_bytes_on_cpu_offloads_small_tensors():
    model = cswap.patch(nets.tiny(), mode="vdnn")  # the 1 MiB floor applies to CUDA tensors only
    one_step(model, shape=(2, 3, 8, 8))
    assert cswap.stats(model)["offloaded_tensors"] == 3


def test_non_float_and_empty_tensors_are_not_offloaded():
    with cswap.offload(mode="vdnn", min_bytes=0, candidates="all") as sw:
        x = torch.randn(2, 4, 8, 8, requires_grad=True)
        y, idx = F.max_pool2d(x * 1, 2, return_indices=True)  # int64 indices: no grad_fn
        e = F.relu(torch.zeros(0, 3, requires_grad=True) * 1)    # empty
        loss = y.sum() + e.sum()
    loss.backward()
    assert sw.stats["offloaded_tensors"] == 1  # x * 1 only (saved by max_pool2d)


# -- 4. SwapInfo -----------------------------------------------------------------------------------

def test_swap_info_fields():
    policy = Recorder()
    model = cswap.patch(nets.vgg_like(), policy=policy, min_bytes=0)
    one_step(model)
    got = [(i.index, i.layer, i.layer_type, i.op, i.saved_in, i.shape) for i in policy.infos]
    assert got == [  # named by the module that made the tensor; saved_in: the one that saved it first
        (0, "features.1", "ReLU", "relu", "features.1", (2, 8, 16, 16)),
        (1, "features.3", "ReLU", "relu", "features.3", (2, 8, 16, 16)),
        (2, "features.4", "MaxPool2d", "max_pool2d", "features.5", (2, 8, 8, 8)),
        (3, "features.6", "ReLU", "relu", "features.6", (2, 16, 8, 8)),
        (4, "features.7", "MaxPool2d", "max_pool2d", "classifier.0", (2, 256)),  # the flattened view
        (5, "classifier.1", "ReLU", "relu", "classifier.1", (2, 32)),
    ]
    for info in policy.infos:
        assert info.dtype == torch.float32
        assert info.device == torch.device("cpu")
        assert info.nbytes == torch.Size(info.shape).numel() * 4
        assert info.where == f"{info.layer} ({info.layer_type})"
    with pytest.raises(AttributeError):
        policy.infos[0].layer = "x"  # frozen


def test_swap_info_layer_of_sequential_and_root():
    policy = Recorder()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3))
    cswap.patch(model, policy=policy, min_bytes=0)
    model(torch.randn(1, 3, 10, 10)).sum().backward()
    assert [(i.layer, i.layer_type, i.saved_in) for i in policy.infos] == [("1", "ReLU", "1"),
                                                                           ("2", "MaxPool2d", "3")]

    policy = Recorder()
    model = cswap.patch(nets.functional_net(), policy=policy, min_bytes=0)
    one_step(model)
    root = [(i.op, i.where) for i in policy.infos if i.layer == ""]
    assert root and all(where == "<root> (FunctionalNet)" for _, where in root)
    assert {i.op for i in policy.infos} == {"relu", "max_pool2d", "leaky_relu",
                                             "avg_pool2d", "hardtanh"}


def test_swap_info_in_offload_region_names_layers_by_class():
    policy = Recorder()
    model = nets.tiny()
    with cswap.offload(policy=policy, min_bytes=0):
        loss = model(torch.randn(2, 3, 8, 8)).sum()
    loss.backward()
    assert [(i.layer, i.layer_type, i.saved_in) for i in policy.infos] == [
        ("ReLU", "ReLU", "ReLU"), ("MaxPool2d", "MaxPool2d", "Conv2d"), ("ReLU", "ReLU", "ReLU")]


class Provenance(nn.Module):
    """An in-place ReLU after BatchNorm, a block whose output is its last child's, a
    functional ReLU inside a forward and a pooled view saved by a linear layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True))
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        x = self.conv(self.stem(x))
        x = F.relu(x)  # made by no module: named after the running one (the root)
        return self.fc(self.pool(x).view(x.shape[0], -1))


def test_swap_info_names_the_module_that_made_the_tensor():
    policy = Recorder()
    model = cswap.patch(Provenance(), policy=policy, min_bytes=0)
    model(torch.randn(2, 3, 6, 6)).sum().backward()
    got = [(i.op, i.layer, i.layer_type, i.saved_in) for i in policy.infos]
    assert got == [("relu", "stem.2", "ReLU", "stem.2"), ("relu", "", "Provenance", ""),
                   ("adaptive_avg_pool2d", "pool", "AdaptiveAvgPool2d", "fc")]


class Branching(nn.Module):
    """A data-dependent branch: `wide` takes other modules, whose second candidate has another rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.left = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.right = nn.Sequential(nn.Linear(8, 8), nn.Unflatten(1, (2, 4)), nn.ReLU(), nn.Flatten(),
                                   nn.Linear(8, 8), nn.ReLU())
        self.wide = False

    def forward(self, x):
        return (self.right if self.wide else self.left)(self.stem(x))


def test_layer_names_are_replayed_without_module_hooks_once_steady():
    """Module hooks cost more than cswap's own work per saved tensor: after two passes
    that name the same candidates they come off and names are replayed; a pass that
    departs (another branch) is not misnamed from there on, and the hooks come back."""
    policy = Recorder()
    model = cswap.patch(Branching(), policy=policy, min_bytes=0)
    tracker = _PATCHED[model].tracker
    x = torch.randn(4, 8)
    passes = []
    for wide in (False, False, False, False, True, True, True, True):
        model.wide = wide
        policy.infos.clear()
        hooked = tracker.hooked
        model(x).sum().backward()
        passes.append((hooked, [(i.key, i.layer, i.layer_type, i.saved_in) for i in policy.infos]))
    left = [("0:stem.1", "stem.1", "ReLU", "stem.1"), ("1:left.1", "left.1", "ReLU", "left.1")]
    right = [("0:stem.1", "stem.1", "ReLU", "stem.1"), ("1:right.2", "right.2", "ReLU", "right.2"),
             ("2:right.5", "right.5", "ReLU", "right.5")]
    assert passes[:4] == [(True, left), (True, left), (False, left), (False, left)]  # hooks off after two
    # The first wide pass replays index 0, then departs: unnamed rather than named after `left`.
    assert passes[4] == (False, [left[0], ("1:", "", "", ""), ("2:", "", "", "")])
    assert passes[5:] == [(True, right), (True, right), (False, right)]
    for module in model.modules():  # off means off: no hook of cswap's left on any module
        ours = 1 if module is model else 0  # the root's: a pass starts and ends
        assert len(module._forward_pre_hooks) == len(module._forward_hooks) == ours
    cswap.unpatch(model)
    assert not model._forward_hooks and not model._forward_pre_hooks


# -- 5. works with ... ----------------------------------------------------------------------------

class CheckpointNet(nn.Module):
    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                   nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True))
        self.head = nn.Sequential(nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))

    def forward(self, x):
        x = self.stem(x)
        if self.mode is None:
            x = self.block(x)
        else:
            x = checkpoint(self.block, x, use_reentrant=self.mode == "reentrant")
        return self.head(x)


@pytest.mark.parametrize("ckpt", ["non_reentrant", "reentrant"])
def test_checkpoint_inside_patched_model(ckpt):
    expected = train(CheckpointNet(ckpt), nets.IMAGE)
    assert_same(expected, train(CheckpointNet(None), nets.IMAGE))  # sanity: checkpoint itself is exact
    plain = cswap.patch(CheckpointNet(None), mode="sc", min_bytes=0)
    train(plain, nets.IMAGE)
    model = cswap.patch(CheckpointNet(ckpt), mode="sc", min_bytes=0)
    assert_same(train(model, nets.IMAGE), expected)
    s = cswap.stats(model)
    # the checkpointed block's saves belong to checkpoint (recomputed), not to cswap
    assert 0 < s["offloaded_tensors"] < cswap.stats(plain)["offloaded_tensors"]
    assert s["restored_tensors"] + s["served_from_device"] == s["offloaded_tensors"]


def test_saved_tensors_stay_in_place_while_a_cuda_graph_captures(monkeypatch):
    """Issue 26 §6: under capture nothing may go to a side stream, be recorded or waited
    for, so pack keeps every tensor; backward captured after an uncaptured forward
    that offloaded says what to do instead of failing inside CUDA."""
    from cswap.runtime.immediate import ImmediateDevice

    expected = train(nets.vgg_like(), nets.IMAGE, steps=2)
    model = cswap.patch(nets.vgg_like(), mode="vdnn", min_bytes=0)
    try:
        monkeypatch.setattr(ImmediateDevice, "capturing", lambda self: True)
        assert_same(train(model, nets.IMAGE, steps=2), expected)
        assert cswap.stats(model)["offloaded_tensors"] == 0
        monkeypatch.setattr(ImmediateDevice, "capturing", lambda self: False)
        x, y = nets.batches(nets.IMAGE, 1)[0]
        loss = F.cross_entropy(model(x), y)
        assert swapper_of(model)._pass.items  # (offloaded: their copies may still be queued)
        monkeypatch.setattr(ImmediateDevice, "capturing", lambda self: True)
        with pytest.raises(RuntimeError, match="captured into a CUDA graph.*Capture forward and backward together"):
            loss.backward()
    finally:
        cswap.unpatch(model)


def test_a_tensor_saved_again_once_a_capture_began_stays_in_place(monkeypatch):
    """Offloaded before a CUDA graph capture began, saved again inside it: the capture's
    save keeps the tensor, as every save under capture does, rather than share the
    offloaded record (whose restore a captured backward could not replay). The check is
    asked once per phase and stream: the capture's stream is a new one."""
    from cswap.runtime.immediate import ImmediateDevice

    sw = Swapper("vdnn", candidates="all", min_bytes=0)
    x = torch.randn(4, 16, requires_grad=True)
    try:
        sw.begin_pass()
        t = (x * 2).relu()
        first = sw.pack(t)  # (held: a record whose saves all died is not shared anyway)
        assert isinstance(first, Handle)
        # torch.cuda.graph makes its capture stream current, then captures on it
        capture_stream = object()
        monkeypatch.setattr(ImmediateDevice, "compute_stream", lambda self: capture_stream)
        monkeypatch.setattr(ImmediateDevice, "capturing", lambda self: True)
        again = sw.pack(t)
        assert type(again) is tuple and again[0] is not t and torch.equal(again[0], t)
        assert sw.stats["deduplicated"] == 0
        sw.end_pass()
    finally:
        sw.close()


def test_no_grad_offloads_nothing():
    model = cswap.patch(nets.vgg_like(), mode="sc", min_bytes=0)
    x, _ = nets.batches(nets.IMAGE, 1)[0]
    with torch.no_grad():
        out = model(x)
    with torch.inference_mode():
        out2 = model(x)
    assert torch.equal(out, nets.vgg_like()(x).detach()) and torch.equal(out2, out)
    assert all(cswap.stats(model)[k] == 0 for k in COUNTERS)
    assert swapper_of(model).pool.allocations == 0
    one_step(model)  # grad mode again: offloads
    assert cswap.stats(model)["offloaded_tensors"] > 0


@pytest.mark.parametrize("name", ["resnet", "vgg", "transformer"])
def test_eval_mode_training_steps(name):
    make, shape = nets.MODELS[name]
    model = cswap.patch(make(), mode="cswap", policy=cycling_policy, min_bytes=0)
    assert_same(train(model, shape, train_mode=False), reference(name, train_mode=False))
    assert cswap.stats(model)["offloaded_tensors"] > 0


@pytest.mark.parametrize("mode", ["vdnn", "sc", "cswap"])
@pytest.mark.parametrize("name", ["vgg", "resnet"])
def test_channels_last(name, mode):
    make, shape = nets.MODELS[name]
    model = cswap.patch(make().to(memory_format=torch.channels_last), min_bytes=0, **MODES[mode])
    perms = []
    sw = swapper_of(model)
    pack = sw.pack

    def spy(t):
        packed = pack(t)
        if isinstance(packed, Handle):
            perms.append(packed.item.perm)
        return packed

    sw.pack = spy
    got = train(model, shape, channels_last=True)
    assert_same(got, reference(name, channels_last=True))
    assert any(p is not None and p != sorted(p) for p in perms)  # channels_last really went through


class ViewNet(nn.Module):
    """Saved tensors that are views: transposed (dense), strided slices (not dense), of offloaded
    bases (ReLU) and of bases that are not offloaded themselves (leaky_relu saves its input)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(16, 16)
        self.lin2 = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(5, 7))
        self.scale = nn.Parameter(torch.randn(16))
        self.head = nn.Linear(16 * 7 + 3 * 16 + 16 * 5 + 2 * 8, 10)

    def forward(self, x):                                  # x: (B, 5, 16)
        h = F.relu(self.lin1(x))                           # offloaded (saved by ReLU)
        a = torch.bmm(h.transpose(1, 2), self.w.expand(len(x), 5, 7))  # saves a transposed view of h
        b = h[:, ::2] * self.scale                         # saves a strided view of h
        lk = F.leaky_relu(self.lin2(x), 0.2)               # saved only through views below
        c = lk.transpose(1, 2) * self.w[:, :1].t()         # a transposed view: its own item (dense)
        d = lk[:, 1::2, ::2] * self.scale[::2]             # a non-dense view: copied contiguous
        return self.head(torch.cat([a.flatten(1), b.flatten(1), c.flatten(1), d.flatten(1)], 1))


@pytest.mark.parametrize("mode", ["vdnn", "sc", "cswap"])
def test_views_and_non_contiguous_saved_tensors(mode):
    expected = train(ViewNet(), nets.SEQUENCE)
    model = cswap.patch(ViewNet(), min_bytes=0, **MODES[mode])
    assert_same(train(model, nets.SEQUENCE), expected)
    s = cswap.stats(model)
    assert s["offloaded_tensors"] > 0 and s["deduplicated"] > 0


def grad_penalty_step(model, x, y, region=None):
    """loss + |d loss / d x|^2: backward through the backward (create_graph=True)."""
    x = x.clone().requires_grad_()
    with region if region is not None else nullcontext():
        loss = F.cross_entropy(model(x), y)
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        total = loss + gx.pow(2).sum() * 10
        total.backward()
    return gx.detach(), snapshot(model)


@pytest.mark.parametrize("mode", ["vdnn", "sc", "cswap"])
def test_double_backward(mode):
    x, y = nets.batches(nets.IMAGE, 1)[0]
    exp_gx, expected = grad_penalty_step(nets.functional_net(), x, y)
    model = cswap.patch(nets.functional_net(), min_bytes=0, **MODES[mode])
    gx, got = grad_penalty_step(model, x, y)
    assert torch.equal(gx, exp_gx)
    assert_same(got, expected)
    assert cswap.stats(model)["offloaded_tensors"] > 0


def test_double_backward_inside_offload_region():
    """The backward graph (built in the region by create_graph) is offloaded too."""
    x, y = nets.batches(nets.IMAGE, 1)[0]
    exp_gx, expected = grad_penalty_step(nets.functional_net(), x, y)
    region = cswap.offload(mode="sc", min_bytes=0)
    gx, got = grad_penalty_step(nets.functional_net(), x, y, region)
    assert torch.equal(gx, exp_gx)
    assert_same(got, expected)


@pytest.mark.parametrize("name", ["vgg", "resnet"])
def test_retain_graph_two_backwards(name):
    make, shape = nets.MODELS[name]
    stock = make()
    one_step(stock, shape, retain_graph=True).backward()
    model = cswap.patch(make(), mode="sc", min_bytes=0, stash_bytes=0)
    try:
        loss = one_step(model, shape, retain_graph=True)
        sw = swapper_of(model)
        assert sw.pool.idle_bytes < sw.pool.reserved_bytes  # host copies kept for the second backward
        loss.backward()
        assert_same(snapshot(model), snapshot(stock))
        s = cswap.stats(model)
        assert s["restored_tensors"] + s["served_from_device"] >= 2 * s["offloaded_tensors"] > 0
        del loss
        gc.collect()
        assert sw.pool.idle_bytes == sw.pool.reserved_bytes
    finally:
        cswap.unpatch(model)


def test_each_backward_prefetches_once_per_item(monkeypatch):
    """A tensor saved twice (a ReLU's output, saved by the ReLU and by the next Linear)
    starts the prefetch after it at its first use in each backward only, although
    autograd drops the first save as soon as its node ran (which uncounts its use)."""
    torch.manual_seed(0)
    model = cswap.patch(nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.ReLU())]),
                        mode="vdnn", candidates="all", min_bytes=0)
    sw = swapper_of(model)
    started = []
    prefetch = sw.restorer.prefetch
    monkeypatch.setattr(sw.restorer, "prefetch", lambda pass_, item, round_: (started.append((item.index, round_)),
                                                                              prefetch(pass_, item, round_)))
    loss = model(torch.randn(2, 16)).sum()
    items = len(sw._pass.items)
    assert cswap.stats(model)["deduplicated"] == 3  # (each Linear but the first saves a ReLU output again)
    loss.backward(retain_graph=True)
    loss.backward()
    assert sorted(started) == sorted((index, round_) for index in range(items) for round_ in (0, 1))


def test_a_tensor_the_policy_keeps_is_asked_about_once_however_often_saved():
    """A candidate the policy keeps, saved again (a ReLU's output, by the next Linear),
    stays without a second question or a key of its own."""
    asked = []

    def keep_all(info):
        asked.append(info.index)
        return "keep"

    torch.manual_seed(0)
    layers = [m for _ in range(3) for m in (nn.Linear(16, 16), nn.ReLU())]
    model = cswap.patch(nn.Sequential(*layers, nn.Linear(16, 16)), policy=keep_all, min_bytes=0, verbose=False)
    model(torch.randn(2, 16)).sum().backward()
    assert asked == [0, 1, 2]  # the three ReLU outputs, each saved twice
    assert cswap.stats(model)["offloaded_tensors"] == 0


def autocast_steps(model, steps=2, dtype=torch.bfloat16):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in nets.batches(nets.IMAGE, steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return snapshot(model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ["vdnn", "sc", "cswap"])
def test_half_precision_autocast(mode, dtype):
    expected = autocast_steps(nets.vgg_like(), dtype=dtype)
    model = cswap.patch(nets.vgg_like(), min_bytes=0, **MODES[mode])
    assert_same(autocast_steps(model, dtype=dtype), expected)
    assert {item.info.dtype for item in swapper_of(model)._pass.items} == {dtype}
    if mode != "vdnn":
        assert cswap.stats(model)["compressed_tensors"] > 0


def two_forwards_one_backward(model, accumulate):
    (x1, y1), (x2, y2) = nets.batches(nets.IMAGE, 2)
    if accumulate:  # gradient accumulation: backward per micro-batch
        F.cross_entropy(model(x1), y1).backward()
        F.cross_entropy(model(x2), y2).backward()
    else:           # both graphs alive at once (siamese style)
        (F.cross_entropy(model(x1), y1) + F.cross_entropy(model(x2), y2)).backward()
    return snapshot(model)


@pytest.mark.parametrize("accumulate", [False, True])
def test_two_forward_passes(accumulate):
    expected = two_forwards_one_backward(nets.resnet_like(), accumulate)
    model = cswap.patch(nets.resnet_like(), mode="cswap", policy=cycling_policy, min_bytes=0)
    assert_same(two_forwards_one_backward(model, accumulate), expected)
    sw = swapper_of(model)
    assert sw.pool.idle_bytes == sw.pool.reserved_bytes


def test_patched_model_inside_offload_region():
    """The model's own hooks take its saves; the region gets the rest (the loss head)."""
    def run(model, region):
        x, y = nets.batches(nets.IMAGE, 1)[0]
        with region as sw:
            out = model(x)
            loss = F.cross_entropy(F.relu(out) * 2, y)
        loss.backward()
        return snapshot(model), sw

    expected, _ = run(nets.vgg_like(), nullcontext())
    model = cswap.patch(nets.vgg_like(), mode="sc", min_bytes=0)
    got, sw = run(model, cswap.offload(mode="vdnn", min_bytes=0))
    assert_same(got, expected)
    assert sw.stats["offloaded_tensors"] == 1  # relu(out), saved by the region's ReLU
    assert cswap.stats(model)["offloaded_tensors"] == 6


# -- 6. in-place changes after a save still raise ----------------------------------------------------

def inplace_case(kind, region):
    """y = relu(x @ w) (a candidate) or exp(x @ w) (not one: passed through); loss saves y."""
    w = torch.randn(16, 16, requires_grad=True)
    v = torch.randn(16, requires_grad=True)
    x = torch.randn(4, 16)
    with region as sw:
        h = x @ w
        y = F.relu(h) if kind == "candidate" else torch.exp(h)
        loss = (y * v).sum()
    return y, loss, sw


def make_region(swap):
    if swap == "stock":
        return nullcontext()
    return cswap.offload(mode=swap, min_bytes=0)


@pytest.mark.parametrize("swap", ["stock", "none", "vdnn", "sc"])
@pytest.mark.parametrize("kind", ["candidate", "kept"])
@pytest.mark.parametrize("how", ["direct", "view", "view_after_del"])
def test_inplace_change_after_save_raises(kind, swap, how):
    y, loss, sw = inplace_case(kind, make_region(swap))
    if sw is not None:
        sw.synchronize()
        offloaded = sw.stats["offloaded_tensors"]
        assert offloaded == (1 if kind == "candidate" and swap.startswith(("vdnn", "sc")) else 0)
    if how == "direct":
        y.add_(1)
    elif how == "view":
        y.view(-1)[3].mul_(2)
    else:
        alias = y[1:]
        del y
        alias.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    if sw is not None:
        sw.close()


def test_inplace_change_through_detached_alias_raises():
    for swap in ("stock", "kept", "vdnn"):
        kind = "kept" if swap == "kept" else "candidate"
        y, loss, _ = inplace_case(kind, make_region("stock" if swap == "stock" else "vdnn"))
        alias = y.detach()  # shares y's version counter: stock autograd sees the change
        del y
        alias.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


class InplaceAfterSave(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        h = F.relu(self.conv1(x))
        out = self.conv2(h)  # saves h
        h.mul_(2)            # illegal: h is needed by ReLU's and conv2's backward
        return out


@pytest.mark.parametrize("mode", ["none", "vdnn", "sc"])
def test_inplace_change_inside_forward_raises(mode):
    x = torch.randn(1, 3, 8, 8)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        InplaceAfterSave()(x).sum().backward()
    model = cswap.patch(InplaceAfterSave(), mode=mode, min_bytes=0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()


def test_inplace_relu_of_a_pooled_tensor_is_fine():
    """In-place ops on tensors not saved before them are legal and stay exact."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(inplace=True),
                             nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Flatten(),
                             nn.Linear(4 * 8 * 8, 10))
    expected = train(make(), nets.IMAGE)
    model = cswap.patch(make(), mode="sc", min_bytes=0)
    assert_same(train(model, nets.IMAGE), expected)


# -- 7. unpatch, patch twice -----------------------------------------------------------------------------

def test_unpatch_restores_stock_behaviour():
    model = nets.resnet_like()
    before = hook_counts(model)
    cswap.patch(model, mode="sc", min_bytes=0)
    assert model in _PATCHED
    patched = hook_counts(model)
    assert patched != before
    s = cswap.stats(model)
    one_step(model)
    counted = counters(s)
    assert counted["offloaded_tensors"] > 0
    assert cswap.unpatch(model) is model
    assert hook_counts(model) == before
    assert model not in _PATCHED
    cswap.unpatch(model)  # idempotent
    # training after unpatch: stock results, the old stats never move again
    stock = nets.resnet_like()
    one_step(stock)
    assert_same(train(model, nets.IMAGE), train(stock, nets.IMAGE))
    assert counters(s) == counted


def test_graph_built_while_patched_survives_unpatch():
    stock = nets.vgg_like()
    one_step(stock)
    model = cswap.patch(nets.vgg_like(), mode="sc", min_bytes=0)
    x, y = nets.batches(nets.IMAGE, 1)[0]
    loss = F.cross_entropy(model(x), y)
    sw = swapper_of(model)
    cswap.unpatch(model)
    assert not sw.offloader._threads  # unpatch stopped the worker and the releaser
    loss.backward()
    assert_same(snapshot(model), snapshot(stock))


def test_patch_twice_is_harmless():
    model = nets.vgg_like()
    cswap.patch(model, mode="sc", min_bytes=0)
    once = hook_counts(model)
    first = swapper_of(model)
    cswap.patch(model, mode="cswap", policy=cycling_policy, min_bytes=0)
    assert hook_counts(model) == once  # one set of hooks
    assert swapper_of(model) is not first and swapper_of(model).mode == "cswap"  # the new settings
    assert_same(train(model, nets.IMAGE), reference("vgg"))
    single = cswap.patch(nets.vgg_like(), mode="cswap", policy=cycling_policy, min_bytes=0)
    train(single, nets.IMAGE)
    assert counters(cswap.stats(model))["offloaded_tensors"] == cswap.stats(single)["offloaded_tensors"]
    assert first.stats["offloaded_tensors"] == 0


def test_patch_argument_checks():
    with pytest.raises(TypeError, match="nn.Module"):
        cswap.patch(lambda x: x)
    with pytest.raises(ValueError, match="mode"):
        cswap.patch(nets.tiny(), mode="zip")
    with pytest.raises(ValueError, match="policy"):
        cswap.patch(nets.tiny(), mode="sc", policy=lambda info: "zvc")
    with pytest.raises(TypeError, match="callable"):
        cswap.patch(nets.tiny(), mode="cswap", policy="zvc")
    with pytest.raises(ValueError, match="candidates"):
        cswap.patch(nets.tiny(), candidates="relu")
    with pytest.raises(ValueError, match="min_bytes"):
        cswap.patch(nets.tiny(), min_bytes=-1)
    with pytest.raises(ValueError, match="max_host_bytes"):
        cswap.patch(nets.tiny(), max_host_bytes=1.5)
    model = nets.tiny()
    try:
        cswap.patch(model, mode="zip")
    except ValueError:
        pass
    assert model not in _PATCHED and hook_counts(model) == hook_counts(nets.tiny())


# -- 8. the offload() region ----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["sc", "cswap"])
def test_offload_region_exact_and_counted(mode):
    model = nets.vgg_like()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    offloaded = compressed = 0
    for x, y in nets.batches(nets.IMAGE, 3):
        opt.zero_grad()
        with cswap.offload(min_bytes=0, **MODES[mode]) as s:
            loss = F.cross_entropy(model(x), y)
        assert isinstance(s, Swapper) and cswap.stats(s) is s.stats
        assert s.stats["offloaded_tensors"] > 0 and s.stats["restored_tensors"] == 0
        loss.backward()  # after the region
        assert s.stats["restored_tensors"] > 0
        offloaded += s.stats["offloaded_tensors"]
        compressed += s.stats["compressed_tensors"]
        opt.step()
    assert_same(snapshot(model), reference("vgg"))
    assert offloaded > 0 and compressed > 0


def test_offload_region_ends_cleanly():
    with cswap.offload(mode="vdnn", min_bytes=0) as s:
        pass
    # after the region: no saved-tensor hooks and no global module hooks of cswap's left
    assert not saved_tensor_hooks_installed()
    model = nets.tiny()
    one_step(model, shape=(2, 3, 8, 8))
    assert s.stats["offloaded_tensors"] == 0
    from torch.nn.modules import module as module_mod
    assert not module_mod._global_forward_hooks and not module_mod._global_forward_pre_hooks


def test_offload_region_closed_by_an_exception():
    with pytest.raises(ZeroDivisionError):
        with cswap.offload(mode="vdnn", min_bytes=0) as s:
            keep = F.relu(torch.randn(3, requires_grad=True) * 1)  # noqa: F841 (offloaded once)
            1 / 0
    assert not saved_tensor_hooks_installed()
    assert s.stats["offloaded_tensors"] == 1


def test_offload_region_leaves_no_thread_behind():
    before = offload_threads()
    refs = []
    w = torch.randn(16, 16, requires_grad=True)
    for _ in range(2):
        with cswap.offload(mode="vdnn", min_bytes=0) as s:
            loss = (F.relu(torch.randn(4, 16) @ w) * 2).sum()
        loss.backward()
        refs.append(weakref.ref(s))
        del s, loss
    gc.collect()
    time.sleep(0.05)
    assert not offload_threads() - before  # each region stopped its worker and releaser
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("options", [{"mode": "vdnn"}, {"budget": "auto"}, {"budget": "auto", "recompute": "auto"}],
                         ids=["vdnn", "budget_auto", "recompute"])
def test_patched_model_dropped_without_unpatch_frees_it_and_its_swapper(options):
    """The model is freed too: budget="auto" wraps its forward, and a reference back to the
    model from what cswap keeps for it would keep it (and its GPU memory) for ever."""
    model = cswap.patch(nets.tiny(), min_bytes=0, verbose=False, **options)
    one_step(model, shape=(2, 3, 8, 8))
    refs = weakref.ref(swapper_of(model)), weakref.ref(model)
    del model
    gc.collect()  # (budget="auto": the wrapped forward and the model are a cycle; freeing them frees the
    time.sleep(0.05)  # swapper's, the next collection's)
    gc.collect()
    assert [r() for r in refs] == [None, None]


def _blocks_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(8, 32), nn.ReLU()), nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
                         nn.Linear(32, 1))


def _saved_and_loaded(model):
    import io

    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("options", [{"mode": "vdnn"}, {"budget": "auto"}, {"budget": 1 << 20, "recompute": ["0", "1"]}],
                         ids=["vdnn", "budget_auto", "recompute"])
def test_a_copy_of_a_patched_model_is_an_unpatched_model_of_its_own(options, how):
    """copy.deepcopy(model) after patching (an EMA model, a planner's trace), or the model
    saved whole and loaded: the copy runs unpatched, with its own weights. (Both raised:
    the swapper's lock cannot be copied, the layer tracker's hooks cannot be pickled; and a
    forward that cswap wraps, copied as it was, would have run the original model.)"""
    import copy

    from cswap.patch import is_patched

    def grads(model):
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    def halved(model):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        return model

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model = cswap.patch(_blocks_net(), min_bytes=0, verbose=False, **options)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            first = grads(model)
            ema = halved(copy.deepcopy(model) if how == "deepcopy" else _saved_and_loaded(model))
            expected = halved(_blocks_net())
            assert not is_patched(ema)
            assert torch.equal(ema(x), expected(x))  # its own weights, not the original's
            assert all(torch.equal(a, b) for a, b in zip(grads(ema), grads(expected)))
            moved = cswap.stats(model)["offloaded_tensors"]  # (the copy's steps moved nothing of the original's)
            assert all(torch.equal(a, b) for a, b in zip(grads(model), first))  # the original: patched as before
            if "budget" not in options:
                assert cswap.stats(model)["offloaded_tensors"] == 2 * moved > 0
    finally:
        cswap.unpatch(model)


# -- 9. memory lifetime ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["vdnn", "sc"])
def test_a_steps_records_go_without_the_garbage_collector(mode):
    """A step's records (items, handles, groups) hold no reference cycle: they go by
    reference counting once backward and the next pass are done with them, not in the
    garbage collector's passes, whose full collections cost a training loop far more
    than the records themselves."""
    model = cswap.patch(nets.tiny(), mode=mode, min_bytes=0)
    sw = swapper_of(model)
    one_step(model, shape=(2, 3, 8, 8))  # (the first step allocates buffers and settles candidates)
    gc.collect()
    gc.disable()
    try:
        one_step(model, shape=(2, 3, 8, 8))
        items = [weakref.ref(item) for item in sw._pass.items]
        assert items
        one_step(model, shape=(2, 3, 8, 8))  # the next pass replaces the swapper's
        assert [r() for r in items] == [None] * len(items)
    finally:
        gc.enable()

@pytest.mark.parametrize("mode", ["vdnn", "sc"])
def test_host_pool_buffers_reused_across_iterations(mode):
    model = cswap.patch(nets.resnet_like(), mode=mode, min_bytes=0)
    try:
        sw = swapper_of(model)
        # sc: fixed weights (no step) and data, so compressed sizes repeat exactly
        lr = 0.1 if mode == "vdnn" else 0.0
        # (the first step is the timed pass, which sends each tensor alone; later ones, in groups,
        # and the fourth starts by freeing the buffers the third did not use)
        train(model, nets.IMAGE, steps=4, lr=lr)
        sw.synchronize()
        allocations, peak = sw.pool.allocations, cswap.stats(model)["peak_host_pool_bytes"]
        reserved = sw.pool.reserved_bytes
        assert allocations > 0 and peak > 0
        for _ in range(4):
            train(model, nets.IMAGE, steps=1, lr=lr)
            sw.synchronize()
            assert sw.pool.allocations == allocations
            assert cswap.stats(model)["peak_host_pool_bytes"] == peak
            assert cswap.stats(model)["host_pool_bytes"] == reserved
            assert sw.pool.idle_bytes == sw.pool.reserved_bytes  # everything came back
    finally:
        cswap.unpatch(model)


def test_everything_freed_after_backward():
    model = cswap.patch(nets.vgg_like(), mode="sc", min_bytes=0)
    sw = swapper_of(model)
    x, y = nets.batches(nets.IMAGE, 1)[0]
    out = model(x)
    sw.synchronize()
    items = list(sw._pass.items)
    assert items and not any(i.freed for i in items)
    assert sw.pool.idle_bytes < sw.pool.reserved_bytes  # lent to the items
    assert all(i.src is None for i in items)             # copied out: the source tensors are dropped
    assert all(i.counter.untyped_storage().nbytes() == 0 for i in items)  # (only their version counters stay)
    loss = F.cross_entropy(out, y)
    loss.backward()
    # backward released every node's saved tensors: items freed even while `loss` is alive
    assert all(i.freed and i.host is None and i.restored is None for i in items)
    assert sw.pool.idle_bytes == sw.pool.reserved_bytes
    assert not sw.inflight and sw._offload_bytes == 0


def test_graph_dropped_without_backward_frees_items():
    model = cswap.patch(nets.resnet_like(), mode="vdnn", min_bytes=0)
    sw = swapper_of(model)
    out = model(nets.batches(nets.IMAGE, 1)[0][0])
    items = list(sw._pass.items)
    del out
    gc.collect()
    assert items and all(i.freed for i in items)
    assert sw.pool.idle_bytes == sw.pool.reserved_bytes


def test_graph_dropped_before_the_worker_copies_returns_its_buffer(monkeypatch):
    torch.manual_seed(0)
    # leaky_relu's output is saved only by the next Linear, so the item's one handle lives in that
    # Linear's node (not in the output's own grad_fn, which the swapper holds until the copy)
    model = cswap.patch(nn.Sequential(nn.Linear(16, 16), nn.LeakyReLU(), nn.Linear(16, 4)),
                        mode="cswap", policy=lambda info: "zvc", min_bytes=0)
    sw = swapper_of(model)
    zvc = cswap.codecs.get("zvc")
    launch, gate = zvc.launch_into, threading.Event()

    def slow_launch(*args, **kwargs):
        gate.wait(5)
        return launch(*args, **kwargs)

    monkeypatch.setattr(zvc, "launch_into", slow_launch)
    try:
        for _ in range(3):
            gate.clear()
            out = model(torch.randn(4, 16))
            del out  # e.g. a forward whose loss is skipped
            gate.set()
            sw.synchronize()
        assert sw.pool.idle_bytes == sw.pool.reserved_bytes
        # the slot its sizes are read into and, once, a buffer for the first step's raw copy: reused, never leaked
        assert sw.pool.allocations <= 2
    finally:
        gate.set()
        cswap.unpatch(model)


def test_a_slots_buffer_cuts_each_slot_when_taken_and_reuses_it_when_put_back():
    """The buffer an encode's sizes are read back into: SLOTS slots of SLOT bytes, each cut
    when taken (a block comes from the pool about once an encode; cutting all 256 up front
    cost the worker 1.5 ms an encode on the H200). Taken ones are distinct and within the
    buffer; one put back is taken again; the block is idle once all are back."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from cswap.runtime.offload import SLOT, SLOTS, _Slots

    class Views(TorchDispatchMode):
        made = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Views.made += func.is_view
            return func(*args, **(kwargs or {}))

    buffer = torch.zeros(SLOT * SLOTS, dtype=torch.uint8)
    with Views():
        block = _Slots(buffer)
        first = block.take(None)
    assert Views.made == 1  # (one slot cut, not SLOTS)
    views = [first] + [block.take(None) for _ in range(SLOTS - 1)]
    assert block.take(None) is None
    starts = sorted(v.data_ptr() - buffer.data_ptr() for v in views)
    assert starts == [i * SLOT for i in range(SLOTS)] and all(v.numel() == SLOT for v in views)
    assert all(block.holds(v) for v in views)
    assert block.put(views[7], None) is False
    again = block.take(None)
    assert again.data_ptr() == views[7].data_ptr()
    assert [block.put(v, None) for v in views][-1] is True  # (the last one back)


def test_host_limit_keeps_tensors_in_place():
    model = cswap.patch(nets.vgg_like(), mode="vdnn", min_bytes=0, max_host_bytes=0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = train(model, nets.IMAGE)
            swapper_of(model).synchronize()
        limit = [w for w in caught if "host memory limit" in str(w.message)]
        assert len(limit) == 1 and limit[0].category is RuntimeWarning
        assert_same(got, reference("vgg"))
        s = cswap.stats(model)
        assert s["kept_on_gpu"] > 0 and s["offloaded_tensors"] == 0
        assert swapper_of(model).pool.reserved_bytes == 0
    finally:
        cswap.unpatch(model)


@pytest.mark.parametrize("env, ranks", [({}, 1), ({"LOCAL_WORLD_SIZE": "8"}, 8),
                                         ({"SLURM_NTASKS_PER_NODE": "4(x2)"}, 4),
                                         ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 2), ({"LOCAL_WORLD_SIZE": "zero"}, 1)])
def test_default_host_limit_is_shared_among_the_ranks_of_a_machine(monkeypatch, env, ranks):
    """Eight ranks each taking half the free RAM would promise four times what there is."""
    from cswap.runtime import swapper as swapper_mod

    for name in swapper_mod._LOCAL_WORLD_SIZE:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    pages = 1 << 20
    monkeypatch.setattr(swapper_mod.os, "sysconf", lambda name: pages if name == "SC_AVPHYS_PAGES" else 4096)
    assert swapper_mod.local_world_size() == ranks
    assert swapper_mod.default_max_host_bytes() == (pages * 4096 // 2) // ranks
    sw = Swapper("vdnn")
    try:
        assert sw.pool.max_bytes == (pages * 4096 // 2) // ranks
    finally:
        sw.close()


def test_host_limit_partly_reached():
    """Room for a few buffers: some tensors offloaded, the rest kept, all exact."""
    model = cswap.patch(nets.vgg_like(), mode="vdnn", min_bytes=0, max_host_bytes=20_000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = train(model, nets.IMAGE)
    assert_same(got, reference("vgg"))
    s = cswap.stats(model)
    assert s["kept_on_gpu"] > 0 and s["offloaded_tensors"] > 0
    assert s["peak_host_pool_bytes"] <= 20_000


def test_stats_count_no_restores_for_tensors_kept_in_place():
    model = cswap.patch(nets.vgg_like(), mode="vdnn", min_bytes=0, max_host_bytes=0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            one_step(model)
        s = cswap.stats(model)
        assert s["kept_on_gpu"] > 0 and s["offloaded_tensors"] == 0 and s["restored_tensors"] == 0
        assert s["prefetched"] == s["on_demand"] == 0
    finally:
        cswap.unpatch(model)


# -- 10. failures --------------------------------------------------------------------------------------

def test_a_broken_codec_stops_the_training_step_and_the_next_starts_clean(monkeypatch):
    """A codec that raises is a bug, not a reason to keep tensors on the device
    quietly: the step that met it raises, naming the layer; the next one is exact."""
    rle = cswap.codecs.get("rle")
    encode = rle.encode
    monkeypatch.setattr(rle, "encode", lambda *a, **k: (_ for _ in ()).throw(ValueError("rle down")))
    model = cswap.patch(nets.vgg_like(), policy=cycling_policy, min_bytes=0)
    x, y = nets.batches(nets.IMAGE, 1)[0]
    with pytest.raises(RuntimeError, match=r"cswap: offloading the \w+ output of .* failed \(ValueError: rle down\)") \
            as raised:
        F.cross_entropy(model(x), y).backward()
    assert isinstance(raised.value.__cause__, ValueError)
    monkeypatch.setattr(rle, "encode", encode)
    got = train(model, nets.IMAGE)
    assert_same(got, reference("vgg"))


def test_compression_out_of_memory_sends_the_tensor_uncompressed(monkeypatch):
    from cswap.runtime.immediate import ImmediateDevice

    empty = ImmediateDevice.empty

    def no_room(self, nbytes, stream):  # (the buffer an encode writes into: on the codec stream)
        if stream.name == "codec":
            raise torch.OutOfMemoryError("no room for the compressed buffer")
        return empty(self, nbytes, stream)

    monkeypatch.setattr(ImmediateDevice, "empty", no_room)
    model = cswap.patch(nets.resnet_like(), mode="sc", min_bytes=0)
    assert_same(train(model, nets.IMAGE), reference("resnet"))
    s = cswap.stats(model)
    assert s["compress_oom"] == s["offloaded_tensors"] > 0
    assert s["compressed_tensors"] == 0 and s["kept_on_gpu"] == 0


def test_unknown_codec_raises_value_error_naming_it():
    model = cswap.patch(nets.vgg_like(), policy=lambda info: "gzip", min_bytes=0)
    x, y = nets.batches(nets.IMAGE, 1)[0]
    with pytest.raises(ValueError, match="'gzip'"):
        model(x)
    entry = _PATCHED[model]
    assert entry.depth == 0 and entry.hooks_ctx is None and entry.tracker.current == ("", "")
    assert not saved_tensor_hooks_installed()  # the failed forward left no hooks behind
    # and the model works once patched with a good policy
    cswap.patch(model, policy=cycling_policy, min_bytes=0)
    assert_same(train(model, nets.IMAGE), reference("vgg"))


def test_forward_exception_leaves_no_hooks():
    class Boom(nn.Module):
        def forward(self, x):
            raise KeyError("boom")

    torch.manual_seed(0)
    model = cswap.patch(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), Boom()), mode="vdnn", min_bytes=0)
    with pytest.raises(KeyError):
        model(torch.randn(2, 4))
    assert _PATCHED[model].hooks_ctx is None and _PATCHED[model].depth == 0
    assert not saved_tensor_hooks_installed()
    assert _PATCHED[model].tracker.current == ("", "")


# -- 11. HostPool ----------------------------------------------------------------------------------------

@pytest.fixture
def dev():
    device = EmulatedDevice(bandwidth_gbps=float("inf"))
    yield device
    device.close()


def pending_event(dev):
    """An event on a side stream that completes when the returned gate is set."""
    gate = threading.Event()
    stream = dev.side_stream("d2h")
    dev.launch(stream, lambda: gate.wait(5))
    return dev.record_event(stream), gate


def test_size_class_rounding():
    sizes = list(range(0, 5000)) + [2 ** k + d for k in range(12, 34) for d in (-1, 0, 1, 2 ** (k - 3))]
    for n in sorted(sizes):
        c = size_class(n)
        assert c >= max(n, 512) and c & (c - 1) == 0, n  # a power of two: what pinning really takes
        assert n < 512 or c < 2 * n, n
        assert size_class(c) == c
    assert size_class(0) == size_class(1) == size_class(512) == 512
    assert size_class(513) == 1024 and size_class(1025) == 2048


def test_host_pool_acquire_release_reuse(dev):
    pool = HostPool(1 << 20, pin_memory=True)
    a = pool.acquire(1000, dev)
    assert a.dtype == torch.uint8 and a.dim() == 1 and a.numel() == size_class(1000) == 1024
    assert pool.allocations == 1 and pool.reserved_bytes == 1024 and pool.idle_bytes == 0
    pool.release(a)
    assert pool.idle_bytes == 1024
    b = pool.acquire(900, dev)  # same class
    assert b.data_ptr() == a.data_ptr() and pool.allocations == 1
    c = pool.acquire(1100, dev)  # another class: a new buffer
    assert c.numel() == 2048 and pool.allocations == 2 and pool.reserved_bytes == 3072
    assert pool.peak_reserved_bytes == 3072
    pool.release(b)
    pool.release(c)
    assert pool.idle_bytes == pool.reserved_bytes == 3072
    pool.clear()
    assert pool.reserved_bytes == pool.idle_bytes == 0 and pool.peak_reserved_bytes == 3072


def test_host_pool_acquire_each_takes_an_idle_buffer_for_every_size_or_none(dev):
    """A group with no buffer of its own size takes one per tensor, all or none: nothing is
    allocated, and what it could not use stays idle and unused (trim_idle frees it)."""
    pool = HostPool(1 << 20, pin_memory=True)

    def idle_buffers(*sizes):
        for buf in [pool.acquire(n, dev) for n in sizes]:
            pool.release(buf)

    idle_buffers(1000, 3000)  # (1024 and 4096 bytes)
    pool.restart_use()
    assert pool.acquire_each([1000, 5000], dev) is None  # (no idle buffer holds 5000 bytes)
    assert pool.allocations == 2 and pool.idle_bytes == 1024 + 4096
    assert pool.trim_idle() == 1024 + 4096  # (the one it took and gave back counts as unused)
    idle_buffers(1000, 3000)
    taken = pool.acquire_each([3000, 600], dev)
    assert [t.numel() for t in taken] == [4096, 1024] and pool.idle_bytes == 0
    pool.release(taken[1])
    assert pool.acquire_each([4000, 4000], dev) is None and pool.idle_bytes == 1024
    pool.release(taken[0])
    assert pool.trim_idle() == 0  # both used since restart_use
    assert pool.trim_idle() == 1024 + 4096 and pool.reserved_bytes == 0
    # Buffers of 4096 and 8192 bytes: 2000 bytes fit both, 1000 only the 4096 one (up to 4x its
    # 1024-byte class): in either order, both are served
    idle_buffers(3000, 5000)
    for sizes in ([2000, 1000], [1000, 2000]):
        taken = pool.acquire_each(sizes, dev)
        assert taken is not None and sorted(t.numel() for t in taken) == [4096, 8192]
        assert taken[sizes.index(1000)].numel() == 4096
        for t in taken:
            pool.release(t)
    assert pool.allocations == 6


def test_host_pool_pins_idle_buffers_ahead_within_its_bound_and_frees_nothing(dev):
    """The buffers pinned at forward's end for the next step's groups: one idle buffer per
    size (an idle one that fits counts), the missing ones pinned while the bound allows.
    At the bound nothing idle is freed to make room and nothing is warned of: no tensor
    stayed on the device. What is pinned counts as unused until a request takes it."""
    warned = []
    pool = HostPool(8192, pin_memory=True, warn=lambda key, message: warned.append(key))
    pool.release(pool.acquire(1000, dev))  # an idle 1024-byte buffer
    pool.restart_use()
    assert pool.pin_idle([1000, 1000, 3000], dev) == 2  # (the idle one serves one 1000)
    assert pool.allocations == 3 and pool.idle_bytes == pool.reserved_bytes == 1024 + 1024 + 4096
    assert pool.pin_idle([1000, 1000, 3000], dev) == 0 and pool.allocations == 3
    assert pool.pin_idle([5000], dev) == 0  # (8192 bytes would pass the bound of 8192 in all)
    assert pool.idle_bytes == pool.reserved_bytes == 6144 and warned == []
    assert pool.trim_idle() == 6144  # none was used


def test_host_pool_keeps_typed_views_of_its_buffers_and_drops_them_with_them(dev):
    """Copies in and out of a pooled buffer go through a view of its first bytes as the
    tensor's dtype and shape, made once per buffer and kind; freeing the buffer frees them."""
    from torch.multiprocessing.reductions import StorageWeakRef

    pool = HostPool(1 << 20, pin_memory=True)
    buf = pool.acquire(1000, dev)
    view = pool.view(buf, torch.float32, torch.Size([10, 20]))
    assert view.shape == (10, 20) and view.dtype == torch.float32 and view.data_ptr() == buf.data_ptr()
    view.fill_(1.5)
    assert torch.equal(buf[:800].view(torch.float32), torch.full((200,), 1.5))  # the buffer's own bytes
    assert pool.view(buf, torch.float32, (10, 20)) is view  # made once
    assert pool.view(buf, torch.int16, (8,)).shape == (8,) and pool.view(buf, torch.int16, (8,)) is not view
    other = pool.acquire(1000, dev)
    assert pool.view(other, torch.float32, (10, 20)).data_ptr() == other.data_ptr()  # each buffer its own
    memory = StorageWeakRef(buf.untyped_storage())
    pool.release(buf)
    pool.release(other)
    del buf, other, view
    pool.clear()
    gc.collect()
    assert memory.expired()  # the cached views did not keep the freed buffer's memory


def test_host_pool_counts_what_pinning_really_holds_and_gives_it_back(dev):
    """F9: PyTorch's host allocator pins a power of two per request and caches freed
    blocks; the pool counts exactly what is pinned, and trimming really unpins."""
    pool = HostPool(1 << 24, pin_memory=True)
    bufs = [pool.acquire(n, dev) for n in (600, 5000, 70_000, 70_000)]
    held = 1024 + 8192 + 2 * 131072
    assert pool.reserved_bytes == dev.pinned_bytes == held
    for buf in bufs:
        pool.release(buf)
    del bufs, buf
    assert pool.trim_idle() == 0  # used since the last trim: kept
    assert dev.pinned_bytes == held
    assert pool.trim_idle() == held
    assert pool.reserved_bytes == dev.pinned_bytes == 0  # unpinned, not just cached by PyTorch


def test_host_pool_waits_for_the_release_event(dev):
    pool = HostPool(1 << 20)
    a = pool.acquire(600, dev)
    event, gate = pending_event(dev)
    pool.release(a, event, dev)
    b = pool.acquire(600, dev)  # a is still being copied: not reused
    assert b.data_ptr() != a.data_ptr() and pool.allocations == 2
    pool.clear()           # nor trimmed
    assert pool.reserved_bytes == 2 * 1024
    gate.set()
    dev.event_synchronize(event, None)
    c = pool.acquire(600, dev)
    assert c.data_ptr() == a.data_ptr() and pool.allocations == 2


def test_a_buffer_whose_copy_failed_is_idle_not_a_failure_forever(dev):
    """The copy that last used a pool buffer failed (reported through its item): the buffer
    is free again. Querying its event raised the old failure at every later use, so the
    training step after a failed copy failed too, and every one after it."""
    class Failed:
        def __init__(self, inner):
            self.inner = inner

        def event_query(self, event, at=None):
            raise RuntimeError("link down")

        def __getattr__(self, name):
            return getattr(self.inner, name)

    pool = HostPool(1 << 20)
    a = pool.acquire(600, dev)
    pool.release(a, object(), Failed(dev))
    assert pool.acquire(600, dev).data_ptr() == a.data_ptr() and pool.allocations == 1
    pool.release(a, object(), Failed(dev))
    pool.clear()
    assert pool.reserved_bytes == 0


def test_host_pool_max_bytes_bound(dev):
    warned = []
    pool = HostPool(4096, warn=lambda key, message: warned.append(message))
    a = pool.acquire(4096, dev)
    assert a is not None and pool.reserved_bytes == 4096
    assert pool.acquire(1, dev) is None and "host memory limit" in warned[0]
    assert pool.acquire(600, dev) is None
    assert pool.reserved_bytes == 4096 and pool.allocations == 1
    assert HostPool(0).acquire(1, dev) is None
    with pytest.raises(ValueError):
        HostPool(-1)


def test_a_handle_dropped_as_the_worker_finishes_a_copy_gives_its_buffer_back():
    """The worker queued an item's copy into a pooled buffer; the item's last save dies
    before the worker is done with it. The buffer must go back to the pool (the worker
    marks the item issued under the swapper's lock, with the buffer: before, a drop in
    between found the item not issued, left the buffer to the worker, which had already
    let it go, and it never came back)."""
    sw = Swapper(mode="vdnnpp", candidates="all", min_bytes=0)  # (raw tensors go one by one: the worker's)
    send, in_window, go = sw.offloader._send, threading.Event(), threading.Event()

    def send_then_pause(*args, **kwargs):
        send(*args, **kwargs)
        in_window.set()
        go.wait(5)

    sw.offloader._send = send_then_pause
    x = torch.randn(4, 16, requires_grad=True)
    try:
        sw.begin_pass()
        handle = sw.pack((x * 2).relu())
        item = handle.item
        assert in_window.wait(5)
        del handle  # the last save dies while the worker is between its copy and its end
        go.set()
        sw.end_pass()
        sw.synchronize()
        assert item.freed and item.host is None
        assert sw.pool.idle_bytes == sw.pool.reserved_bytes > 0  # back in the pool
    finally:
        go.set()
        sw.close()


def test_the_host_limit_warning_never_holds_the_pools_lock(dev):
    """Issue 26 (review §1): acquire at the host limit warned while holding the pool's lock,
    and the warning takes the swapper's; the swapper returns buffers to the pool while
    holding its own (drop_handle, the worker). A handle dropped while a pack met the
    limit deadlocked. The window widened: the swapper's lock is held across the warning."""
    sw = Swapper(mode="vdnn", max_host_bytes=4096)
    try:
        held = sw.pool.acquire(4096, dev)
        warning_given = threading.Event()
        notice = sw.notice

        def slow_notice(key, message):
            warning_given.set()
            notice(key, message)

        sw.pool._warn = slow_notice

        def drop_a_handle():  # as drop_handle: the swapper's lock, then the pool's
            with sw.lock:
                locked.set()
                warning_given.wait(timeout=5)
                sw.pool.release(held)

        locked = threading.Event()
        dropper = threading.Thread(target=drop_a_handle, daemon=True)
        dropper.start()
        locked.wait(timeout=5)
        packer = threading.Thread(target=lambda: sw.pool.acquire(1, dev), daemon=True)  # at the limit: warns
        packer.start()
        dropper.join(timeout=10)
        packer.join(timeout=10)
        assert not dropper.is_alive() and not packer.is_alive(), "deadlock: pool lock held while warning"
        assert any("host memory limit" in m for m in sw._notices)
    finally:
        sw.offloader.stop()


def test_host_pool_trims_idle_buffers(dev):
    pool = HostPool(8192)
    small = [pool.acquire(1024, dev) for _ in range(2)]
    pool.release(small[0])
    big = pool.acquire(2048, dev)                 # fits beside the two small ones
    assert big is not None and pool.reserved_bytes == 4096
    pool.release(big)
    assert pool.acquire(7000, dev) is None       # 8192: even with the idle ones dropped, small[1] is lent
    pool.release(small[1])
    huge = pool.acquire(7000, dev)               # now every idle buffer can go
    assert huge is not None and huge.numel() == 8192 and pool.reserved_bytes == 8192 and pool.idle_bytes == 0
    pool.release(huge)
    pool.clear()
    assert pool.reserved_bytes == 0


def test_host_pool_trim_idle_frees_only_buffers_unused_since_the_last_trim(dev):
    pool = HostPool(1 << 20)
    first = pool.acquire(16384, dev)  # e.g. the first epoch's larger batch
    pool.release(first)
    assert pool.trim_idle() == 0      # used in this window: kept
    steady = pool.acquire(2048, dev)  # the sizes every later iteration uses (16384 is more than 4x)
    lent = pool.acquire(512, dev)     # still lent at the trim: untouched
    pool.release(steady)
    assert pool.trim_idle() == 16384 and pool.reserved_bytes == 2048 + 512
    assert pool.acquire(2048, dev) is steady  # the kept buffer serves the next request
    pool.release(steady)
    pool.release(lent)
    assert pool.trim_idle() == 512 and pool.reserved_bytes == 2048


def test_host_pool_serves_a_request_from_an_idle_buffer_up_to_four_times_its_size(dev):
    """The first iteration sends tensors uncompressed: its buffers serve later
    iterations that compress them up to 4x, with no new pinned allocation."""
    pool = HostPool(1 << 20)
    big = pool.acquire(8192, dev)
    pool.release(big)
    assert pool.acquire(2048, dev) is big       # 8192 <= 4 * 2048: no new allocation
    pool.release(big)
    other = pool.acquire(1024, dev)              # 8192 > 4 * 1024: a buffer of its own class
    assert other is not big and other.numel() == 1024 and pool.allocations == 2
    pool.release(other)
    assert pool.acquire(1024, dev) is other      # its own class first, even with a larger one idle


def test_epoch_end_gives_back_host_buffers_of_sizes_no_longer_used():
    """The first epoch trains with a larger batch than the rest: the buffers of its
    sizes go back to the system at the end of the first epoch that did not use them."""
    model = cswap.patch(nets.vgg_like(), mode="sc", min_bytes=0, verbose=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pools = []
    for epoch in range(3):
        for x, y in nets.batches((32 if epoch == 0 else 2, 3, 16, 16), 2):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cswap.epoch_end(model)
        pools.append(cswap.stats(model)["host_pool_bytes"])
    assert pools[0] > pools[1] == pools[2] > 0


class _PageableOnly(EmulatedDevice):
    """An emulated device on which pinning always fails."""

    def host_empty(self, nbytes, pinned):
        if pinned:
            raise RuntimeError("cudaHostAlloc failed")
        return super().host_empty(nbytes, pinned)


class _FailingHost(EmulatedDevice):
    """An emulated device whose pinned (and maybe pageable) host allocations fail."""

    def __init__(self, pageable_fails=False):
        super().__init__(bandwidth_gbps=float("inf"))
        self.pageable_fails = pageable_fails

    def host_empty(self, nbytes, pinned):
        if pinned or self.pageable_fails:
            raise RuntimeError("out of memory")
        return super().host_empty(nbytes, pinned)


def test_host_pool_falls_back_to_pageable_memory_with_one_warning():
    warned = []
    pool = HostPool(1 << 20, pin_memory=True, warn=lambda key, message: warned.append(key))
    dev = _FailingHost()
    a, b = pool.acquire(1000, dev), pool.acquire(5000, dev)
    assert warned == ["pageable"] and not pool.pinned
    assert a is not None and b is not None and a.numel() >= 1000 and b.numel() >= 5000


def test_without_pinned_memory_the_training_thread_never_copies_out_itself():
    """Issue 26 §7: a copy from pageable memory blocks its caller until it is done (the
    emulator now does so too), so without pinned memory every copy out stays with the
    sender thread: forward waits for no copy, and the step stays exact."""
    expected = train(nets.vgg_like(), nets.IMAGE, steps=3)
    model = cswap.patch(nets.vgg_like(), mode="vdnn", min_bytes=0, stash_bytes=1 << 30)
    dev = _PageableOnly(bandwidth_gbps=0.5)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the fallback's one warning)
            with emulator.activate(dev):
                got = train(model, nets.IMAGE, steps=3)
            dev.close()
        assert_same(got, expected)
        assert not swapper_of(model).pool.pinned and dev.hazards == []
        training = {at: n for (thread, at), n in dev.host_syncs.items() if thread == threading.current_thread().name}
        # backward's restores copy in on this thread (autograd runs CPU backward here); forward copies nothing
        assert training.get("pageable copy", 0) == cswap.stats(model)["restored_tensors"] > 0, training
        assert dev.host_syncs["cswap-send", "pageable copy"] >= cswap.stats(model)["offloaded_tensors"]
    finally:
        cswap.unpatch(model)


def test_host_pool_returns_none_when_host_memory_runs_out():
    pool = HostPool(1 << 20, pin_memory=False)
    assert pool.acquire(1000, _FailingHost(pageable_fails=True)) is None and pool.reserved_bytes == 0


# -- the paper's other baselines ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["vdnnpp", "save_on_cpu"])
@pytest.mark.parametrize("name", ["vgg", "resnet"])
def test_baseline_modes_train_exactly(name, mode):
    make, shape = nets.MODELS[name]
    model = cswap.patch(make(), mode=mode, min_bytes=0)
    assert_same(train(model, shape), reference(name))


def test_vdnnpp_compresses_host_copies_and_returns_pinned_buffers(monkeypatch):
    make, shape = nets.MODELS["vgg"]
    model = cswap.patch(make(), mode="vdnnpp", min_bytes=0)
    sw = swapper_of(model)
    zvc = cswap.codecs.get("zvc")
    compress = zvc.compress
    monkeypatch.setattr(zvc, "compress", lambda *args, **kwargs: (time.sleep(0.05), compress(*args, **kwargs))[1])
    x, y = nets.batches(shape, 1)[0]
    loss = F.cross_entropy(model(x), y)
    sw.synchronize()  # waits for the (slow) host compressions too
    s = cswap.stats(model)
    compressed = s["host_compressed_tensors"]
    sw.offloader.stop()  # (joins the host threads: nothing was left to finish)
    assert s["host_compressed_tensors"] == compressed > 0 and s["compressed_tensors"] == 0
    assert s["transferred_bytes"] == s["offloaded_bytes"]  # the link carried raw bytes
    assert sw.pool.idle_bytes > 0  # pinned buffers came back once their copies were compressed
    loss.backward()
    assert s["restored_tensors"] > 0


def test_signal_wakes_every_waiter_once_set_and_only_then():
    """The `issued` flag of groups and worker items: waiters on other threads block until
    it is set, all of them wake, and setting it again (the worker does) changes nothing."""
    from cswap.runtime.items import Signal

    signal, woke = Signal(), []
    waiters = [threading.Thread(target=lambda i=i: (signal.wait(), woke.append(i))) for i in range(3)]
    for thread in waiters:
        thread.start()
    time.sleep(0.05)
    assert woke == [] and not signal.is_set()
    signal.set()
    signal.set()
    for thread in waiters:
        thread.join(timeout=5)
    assert sorted(woke) == [0, 1, 2] and signal.is_set()
    signal.wait()  # (set: returns at once)
