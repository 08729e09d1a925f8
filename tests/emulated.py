"""Shared pieces of the emulated-device tests: small networks, and the scenarios the
mutation test runs with each synchronisation point switched off."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import cswap
import nets
from cswap.patch import _PATCHED
from cswap.models.small import SmallCNN

# Copies slower than compute on these networks (16 KiB take about 0.8 ms at 20 MB/s,
# a layer's compute a few tens of microseconds) and jittery.
SLOW = {"bandwidth_gbps": 0.02, "jitter": 0.001}
CODECS = ("zvc", "rle", "csr", "lz4")


def cycling_policy(info):
    """Every codec in turn, and None (offload uncompressed) every fifth tensor."""
    return (*CODECS, None)[info.index % 5]


MODES = {
    "vdnn": {"mode": "vdnn"},
    "sc": {"mode": "sc"},
    "cswap": {"mode": "cswap", "policy": cycling_policy},
    "vdnnpp": {"mode": "vdnnpp"},
    "rle": {"mode": "cswap", "policy": lambda info: "rle"},  # a codec that reads its size back itself
}


def small_cnn():
    torch.manual_seed(0)
    return SmallCNN(num_classes=10, image_size=16, width=8)


def resnet_blocks():
    """A stem and a stack of ResNet basic blocks (BatchNorm, in-place ReLU, shortcuts)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nets.BasicBlock(8, 8), nets.BasicBlock(8, 16, stride=2), nets.BasicBlock(16, 16),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def transformer():
    """torch's own nn.TransformerEncoder, activation "relu"."""
    return nets.transformer_net()


NETS = {
    "small_cnn": (small_cnn, (2, 3, 16, 16)),
    "resnet_blocks": (resnet_blocks, (2, 3, 16, 16)),
    "transformer": (transformer, nets.SEQUENCE),
}


def gradients(model, x, y) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def exact(got: dict, expected: dict) -> bool:
    return got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


# -- the mutation scenarios: each returns "" when all is well, else what went wrong -------------------------

def _steps(mode: str, steps: int = 2, make=nets.vgg_like, shape=nets.IMAGE, **options) -> str:
    """Training steps on a slow device; the second step reuses the memory of the first."""
    stock, model = make(), cswap.patch(make(), min_bytes=0, **MODES[mode], **options)
    try:
        with cswap.testing.emulated_device(**SLOW) as dev:
            for x, y in nets.batches(shape, steps):
                if not exact(gradients(model, x, y), gradients(stock, x, y)):
                    return "wrong gradients"
        return "; ".join(dev.hazards[:2])
    finally:
        cswap.unpatch(model)


def _synchronized_step(model, x, y) -> None:
    """A step whose copies out have all completed and been released before backward,
    whatever this machine's load: backward restores every tensor (none is served from
    the device). The graph goes with this frame."""
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    _PATCHED[model].swapper.synchronize()
    loss.backward()


def _host_decompressed(steps: int = 2) -> str:
    """vdnnpp: a 16 KiB activation and then a 4 KiB one, each compressed on the host
    before the next is saved (synchronize waits for that), so that the second is copied
    out into the first's pinned buffer (a buffer serves requests down to a quarter of
    its size). Backward restores the 4 KiB one first: decompressed on the host into that
    buffer, which goes back to the pool while the copy up from it is in flight; the
    16 KiB one's host write must then take another (host_pool.buffer_free). (Left to the
    host threads' timing, whether any buffer served two sizes depended on this
    machine's load: CI once saw none.)"""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))

    stock, model = make(), cswap.patch(make(), min_bytes=0, **MODES["vdnnpp"])
    sw = _PATCHED[model].swapper
    model[1].register_forward_hook(lambda *args: sw.synchronize())
    try:
        with cswap.testing.emulated_device(**SLOW) as dev:
            for x, y in nets.batches((64, 64), steps):
                _synchronized_step(model, x, y)
                if not exact({name: p.grad for name, p in model.named_parameters()}, gradients(stock, x, y)):
                    return "wrong gradients"
        if cswap.stats(model)["host_compressed_tensors"] == 0:
            return "no host copy was compressed"
        return "; ".join(dev.hazards[:2])
    finally:
        cswap.unpatch(model)


def _exception_in_backward() -> str:
    """A user hook raises halfway through backward with restores in flight; the graph is
    dropped, and the next step must be exact (its buffers are those of the failed one).
    The prefetch window holds one tensor, so each restore has its own event and the one
    in flight when the hook raises is dropped before compute waited for it (a larger
    group shares the event of a tensor backward used, which orders them all); the step's
    copies out complete before backward, so no tensor is served from the device. (With
    neither, whether the hook met a restore depended on this machine's load: CI once saw
    none with restore.record_restored switched off.)"""
    make, shape = nets.vgg_like, nets.IMAGE
    stock, model = make(), cswap.patch(make(), min_bytes=0, mode="vdnn", prefetch_bytes=8 << 10)

    def failing_hook(grad):
        raise KeyError("user hook")

    def add_failing_hook(module, args, out):
        out.register_hook(failing_hook)  # returns None: the output stays as it is

    batches = nets.batches(shape, 3)
    try:
        with cswap.testing.emulated_device(**SLOW) as dev:
            gradients(model, *batches[0])
            handle = model.features[5].register_forward_hook(add_failing_hook)
            try:
                _synchronized_step(model, *batches[1])
            except KeyError:
                pass
            else:
                return "the hook did not raise"
            handle.remove()
            if not exact(gradients(model, *batches[2]), gradients(stock, *batches[2])):
                return "wrong gradients after the exception"
        return "; ".join(dev.hazards[:2])
    finally:
        cswap.unpatch(model)


def _host_limit() -> str:
    """No host memory: each tensor, compressed on the codec stream first (by RLE,
    whose encode the host does not wait for to the end), stays on the device (as warned)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "cswap: host memory limit", RuntimeWarning)
        return _steps("rle", max_host_bytes=0)


SCENARIOS = {
    "vdnn": lambda: _steps("vdnn"),
    "sc": lambda: _steps("sc"),
    "cswap": lambda: _steps("cswap"),
    "checksum": lambda: _steps("vdnn", checksum=True),
    "vdnnpp": lambda: _steps("vdnnpp"),
    "host_decompressed": _host_decompressed,
    # Same-size activations one after another, restored one at a time: backward recycles
    # the memory of a restore it has just freed for the next one.
    "recycled": lambda: _steps("vdnn", make=resnet_blocks, prefetch_bytes=0),
    "exception": _exception_in_backward,
    "host_limit": _host_limit,
}


def run_scenarios() -> dict[str, str]:
    """Each scenario's problem ("" for none); an exception counts as a problem."""
    out = {}
    for name, scenario in SCENARIOS.items():
        try:
            out[name] = scenario()
        except Exception as exc:  # noqa: BLE001 - a switched-off point may break things any way
            out[name] = f"{type(exc).__name__}: {exc}"
    return out
