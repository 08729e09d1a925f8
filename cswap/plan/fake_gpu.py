"""One training step traced without a GPU: what autograd saves, and the peak.

No tensor holds data: the model is copied with its parameters and buffers as
fake tensors (PyTorch's FakeTensorMode) on the "meta" device, and one real
step (forward, loss, backward, optimizer step) runs on them. Every tensor
autograd saves is recorded (shape, dtype, the op that produced it, the module
running when it was saved, save order, first use in backward) and PyTorch's
MemTracker gives the step's peak memory by kind (parameters, gradients,
activations, optimizer state, temporaries).

Why "meta" and not a fake "cuda" or a PrivateUse1 device: a fake "cuda"
aborts autograd on a CPU build of torch, and a PrivateUse1 device registered
after the process's first backward fails inside autograd's engine (its device
queues are sized once); "meta" tensors run backward on the caller's thread in
any process. What differs from CUDA: ops that pick a fused CUDA kernel take
their CPU form here; the one seen in cswap's models is dropout, which saves a
float mask (CUDA: a bool mask, a quarter of the bytes).

Private PyTorch surfaces, pinned here and nowhere else (checked on 2.13):
`torch._subclasses.fake_tensor.FakeTensorMode` and
`torch.distributed._tools.mem_tracker.MemTracker`. A torch without them
raises FakeGPUUnavailable naming what is missing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from ..runtime.candidates import op_name, producer
from ..runtime.layers import LayerTracker

__all__ = ["DEVICE", "FakeGPUUnavailable", "SavedRecord", "StepTrace", "trace_step"]

DEVICE = "meta"


class FakeGPUUnavailable(RuntimeError):
    """This torch lacks a private API the trace needs."""


def _fake_mode():
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        raise FakeGPUUnavailable(f"cswap.plan.fake_gpu: no FakeTensorMode in torch {torch.__version__} ({exc})")
    return FakeTensorMode(allow_non_fake_inputs=False)


def _mem_tracker():
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        raise FakeGPUUnavailable(f"cswap.plan.fake_gpu: no MemTracker in torch {torch.__version__} ({exc}); "
                                 f"a torch built with distributed support is needed")
    return MemTracker()


@dataclass(frozen=True)
class SavedRecord:
    """One tensor autograd saved for backward, in save order."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str          # "activation", "parameter" or "input"
    op: str            # the op that produced it ("relu", "max_pool2d", ...); "" for leaves
    module: str        # the module that was running when it was saved ("features.3")
    module_type: str   # its class name ("ReLU")
    use: int | None = None  # order of first use in backward (0 = first), None if never used

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * self.dtype.itemsize


@dataclass
class StepTrace:
    """What one training step saves and its peak memory, on the fake device."""

    saved: list[SavedRecord]
    peak_bytes: int                                   # MemTracker's peak, all kinds
    peak_by_kind: dict[str, int] = field(default_factory=dict)

    def activations(self) -> list[SavedRecord]:
        return [r for r in self.saved if r.kind == "activation"]


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    raise ValueError(f"cswap.plan.fake_gpu: optimizer must be 'sgd' or 'adam', got {name!r}")


def _fake_inputs(example_inputs, device) -> tuple:
    """Fake tensors of the example inputs' shapes and dtypes on the fake device."""
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=device) if isinstance(x, torch.Tensor) else x
                 for x in example_inputs)


def _to_fake(model: nn.Module, device: torch.device) -> None:
    """Replace every parameter and buffer of `model` (on "meta") by an empty fake
    tensor on `device`, in place; tied tensors stay tied. Call inside the fake mode."""
    made: dict[int, torch.Tensor] = {}

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        return made[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = fake_of(t)


def trace_step(model: nn.Module, example_inputs, loss=None, optimizer: str = "sgd") -> StepTrace:
    """Trace one training step of `model` on `example_inputs` (tensors of the
    batch's shape and dtype, on any device, meta included; their values are not
    read). `loss(output) -> scalar` defaults to the mean of the output; `optimizer`
    is "sgd" (momentum) or "adam". The model itself is not touched: a copy is."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"cswap.plan.fake_gpu: expected a torch.nn.Module, got {type(model).__name__}")
    device = torch.device(DEVICE)
    loss = loss or (lambda out: out.float().mean())
    mode = _fake_mode()
    tracker = LayerTracker()
    records: list[SavedRecord] = []
    uses: dict[int, int] = {}
    # A copy with no data (parameters and buffers on "meta"), then fake ones.
    memo = {id(t): torch.empty_like(t, device="meta") for t in model.buffers()}
    memo.update({id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                 for p in model.parameters()})
    fake = copy.deepcopy(model, memo)
    with mode:
        _to_fake(fake, device)
        params = {id(p) for p in fake.parameters()}
        inputs = _fake_inputs(example_inputs, device)
        input_ids = {id(x) for x in inputs if isinstance(x, torch.Tensor)}
        opt = _optimizer(optimizer, fake.parameters())

        def pack(t):
            index = len(records)
            made_by = producer(t)
            kind = "parameter" if id(t) in params else "input" if id(t) in input_ids or made_by is None \
                else "activation"
            module, module_type = tracker.current
            records.append(SavedRecord(index, tuple(t.shape), t.dtype, kind, op_name(made_by) if made_by else "",
                                       module, module_type))
            return index, t

        def unpack(packed):
            index, t = packed
            uses.setdefault(index, len(uses))
            return t

        memory = _mem_tracker()
        memory.track_external(fake, opt)
        tracker.attach(fake)
        try:
            with memory, torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                loss(fake(*inputs)).backward()
                opt.step()
        finally:
            tracker.detach()
        peak = memory.get_tracker_snapshot("peak")
    by_kind: dict[str, int] = {}
    for per_device in peak.values():
        for kind, nbytes in per_device.items():
            name = str(kind).rsplit(".", 1)[-1].lower()
            by_kind[name] = by_kind.get(name, 0) + int(nbytes)
    saved = [SavedRecord(**{**r.__dict__, "use": uses.get(r.index)}) for r in records]
    return StepTrace(saved, by_kind.pop("total", 0), by_kind)
