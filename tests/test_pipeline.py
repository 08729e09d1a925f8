"""The shape of the pipeline, read off the timed twin's log of device work (issue 38).

On the twin (cswap.runtime.twin) every piece of work the runtime queues is logged with
the virtual time it was queued, started and ended. These tests check the structure the
pipeline promises, whatever the machine running them: in forward, the next tensor's
compression is queued before the copy out of the one before it ends, two compressed
tensors or more are in flight, and no thread that queues compressions waits for the
device per tensor; in backward, decoding one tensor overlaps copying in the next. Each
also holds with the named synchronisation points on (the mutation tests of
test_emulated_runtime.py check they are all needed).
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import cswap
from cswap.runtime.twin import TwinSpec
from cswap.testing import timed_twin

pytestmark = pytest.mark.filterwarnings("ignore:.*saves no memory:RuntimeWarning")


def _relu_mlp(layers: int = 8, width: int = 256) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())],
                         nn.Linear(width, 10))


def _steps(mode: str, steps: int = 3, **options):
    """`steps` steps of the MLP on an H200's twin, each activation standing for 1 GB
    (copies take ~10 ms, compressions ~2 ms): the last step's spans and the device."""
    model, x = _relu_mlp(), torch.randn(512, 256)
    reference = _relu_mlp()
    reference(x).sum().backward()
    with timed_twin(TwinSpec.measured(scale=2000, host_scale=0.0), model) as dev:
        cswap.patch(model, mode=mode, min_bytes=0, verbose=False, **options)
        for _ in range(steps):
            first = len(dev.spans)
            dev.host_syncs.clear()
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
            dev.synchronize()
        spans = list(dev.spans)[first:]
        syncs = dict(dev.host_syncs)
    assert dev.hazards == []
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    stats = dict(cswap.stats(model))
    cswap.unpatch(model)
    return spans, syncs, stats


def _pairs(spans, first: str, then: str, first_stream: str, then_stream: str):
    """The k-th span of `first` on its stream with the k-th of `then` on its stream."""
    a = [s for s in spans if s.stream == first_stream and s.what.startswith(first)]
    b = [s for s in spans if s.stream == then_stream and s.what.startswith(then)]
    assert len(a) == len(b) > 3, (len(a), len(b))
    return list(zip(a, b))


def test_forward_compresses_the_next_tensor_while_the_one_before_is_copied_out():
    spans, syncs, stats = _steps("sc")
    assert stats["compressed_tensors"] > 0
    out = _pairs(spans, "encode", "copy", "codec", "d2h")  # tensor k: its encode, its copy out
    # compress(i+1) queued before copy(i) completes, for every tensor but the last
    early = [i for i in range(len(out) - 1) if out[i + 1][0].queued < out[i][1].end]
    assert len(early) == len(out) - 1, [(e.queued, c.end) for e, c in out]
    # two compressed tensors or more in flight (encode queued, copy out not ended) at once
    most = max(sum(1 for e, c in out if e.queued <= t < c.end) for t in [e.queued for e, _ in out])
    assert most >= 2
    # and compression overlaps the link: some encode runs while a copy out does
    assert any(e.start < c.end and c.start < e.end for e, _ in out for _, c in out)


def test_no_thread_that_queues_compressions_waits_for_the_device_per_tensor():
    spans, syncs, stats = _steps("sc")
    compressed = stats["compressed_tensors"] // 3  # (the last step's)
    by_thread = {}
    for (thread, at), n in syncs.items():
        by_thread.setdefault(thread, {})[at] = n
    assert "cswap-offload" not in by_thread, syncs  # the worker, which queues the encodes, never waits
    assert by_thread["cswap-send"] == {"offload.sizes_landed": compressed}, syncs  # one read of sizes each
    training = by_thread.get(threading.current_thread().name, {})
    assert training.get("unpack.verdict_landed", 0) <= 1, syncs  # backward: one wait at its end, at most


def test_backward_decodes_one_tensor_while_the_next_is_copied_in():
    spans, syncs, stats = _steps("sc")
    back = _pairs(spans, "copy", "decode", "h2d", "codec")  # tensor k: its copy in, its decode
    assert all(d.start >= c.end for c, d in back)  # a decode follows its own copy in
    overlap = [i for i in range(len(back) - 1)
               if back[i][1].start < back[i + 1][0].end and back[i + 1][0].start < back[i][1].end]
    assert len(overlap) >= len(back) // 2, [(c.start, c.end, d.start, d.end) for c, d in back]


def test_raw_restores_need_no_wait_for_compute():
    """A restore writes memory its own stream allocated: it starts as soon as the link is
    free, not when compute has caught up with what the host queued."""
    spans, syncs, stats = _steps("vdnn")
    copies_in = [s for s in spans if s.stream == "h2d" and s.what == "copy"]
    computes = [s for s in spans if s.stream == "compute"]
    backward_start = min(c.queued for c in copies_in)
    busy_until = max(c.end for c in computes if c.queued <= backward_start)  # compute queued by then
    assert any(c.start < busy_until for c in copies_in)


@pytest.mark.parametrize("codec", ["zans", "lz4"])
def test_zans_and_lz4_are_launched_by_the_worker_and_only_their_sizes_are_read_by_the_sender(codec):
    """ZANS and LZ4 launch like ZVC (issue 41): the worker queues them (ZANS reads its
    histograms back for its plan, a read of host memory on the twin), and the sender
    reads each tensor's sizes once; gradients equal stock autograd's (in _steps)."""
    spans, syncs, stats = _steps("cswap", steps=1, policy=lambda info: codec)
    encodes = [s for s in spans if s.stream == "codec" and s.what.startswith("encode")]
    assert len(encodes) >= 4 and all(codec in s.what for s in encodes), {s.what for s in encodes}
    assert not [key for key in syncs if key[0] == "cswap-offload"], syncs  # no wait the twin names
    assert syncs.get(("cswap-send", "offload.sizes_landed")) == len(encodes), syncs
