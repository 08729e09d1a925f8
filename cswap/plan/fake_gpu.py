"""One training step traced without a GPU: what autograd saves, and the peak.

No tensor holds data: the model is copied with its parameters and buffers as
fake tensors (PyTorch's FakeTensorMode) on the "meta" device, and one real
step (forward, loss, backward, optimizer step) runs on them. Every tensor
autograd saves is recorded: shape, dtype, what it is (activation, parameter,
buffer, input), the op and module that made it, the op that saves it for its
backward and the module running then, save order and first use in backward.
PyTorch's MemTracker gives the step's peak memory by kind (parameters,
gradients, activations, optimizer state, temporaries).

Why "meta" and not a fake "cuda" or a PrivateUse1 device: a fake "cuda"
aborts autograd on a CPU build of torch, and a PrivateUse1 device registered
after the process's first backward fails inside autograd's engine (its device
queues are sized once); "meta" tensors run backward on the caller's thread in
any process. What differs from CUDA: ops that pick a fused CUDA kernel take
their CPU form here; the one seen in cswap's models is dropout, which saves a
float mask (CUDA: a bool mask, a quarter of the bytes).

Private PyTorch surfaces, pinned here and nowhere else (checked on 2.13):
`torch._subclasses.fake_tensor.FakeTensorMode`,
`torch.distributed._tools.mem_tracker.MemTracker` (a torch without them
raises FakeGPUUnavailable naming what is missing), a TorchDispatchMode from
`torch.utils._python_dispatch` (which module made a tensor) and autograd
nodes' `_saved_*` attributes (which op saves it: reading one runs the unpack
hook on what the node holds).
"""

from __future__ import annotations

import copy
import gc
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ..runtime.candidates import op_name, producer
from ..runtime.layers import LayerTracker

__all__ = ["DEVICE", "FakeGPUUnavailable", "SavedRecord", "StepTrace", "kind_of", "trace_step"]

DEVICE = "meta"
_VERSION = re.compile(r"\d+$")


class FakeGPUUnavailable(RuntimeError):
    """This torch lacks a private API the trace needs."""


class _Provenance:
    """A dispatch mode noting, for every tensor an op returns, the module running then."""

    def __init__(self, tracker: LayerTracker):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        made = self.made = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                where = tracker.current
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        made[id(t)] = where
                return out

        self.mode = Mode()

    def made_in(self, t: torch.Tensor) -> tuple[str, str]:
        for candidate in (t, t._base if t._is_view() else None):
            if candidate is not None and id(candidate) in self.made:
                return self.made[id(candidate)]
        return ("", "")


def _graph_nodes(root):
    """Every node of the autograd graph behind `root`, once each."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(next_node for next_node, _ in node.next_functions)


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
    kind: str          # "activation" (made by the step), "parameter", "buffer" or "input"
    op: str            # the op that produced it ("relu", "max_pool2d", ...); "" for leaves
    module: str        # the module that was running when it was saved ("features.3")
    module_type: str   # its class name ("Conv2d")
    use: int | None = None  # order of first use in backward (0 = first), None if never used
    made_in: str = ""       # the innermost module running when it was produced ("features.2")
    made_in_type: str = ""  # its class name ("MaxPool2d")
    saved_by: str = ""      # the op whose backward needs it ("convolution")

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


def kind_of(t: torch.Tensor, params: set[int], buffers: set[int], inputs: set[int]) -> str:
    """"parameter", "buffer" or "input" when `t` (or the tensor it views) is one, by
    identity; else "activation": made during the step, with a grad_fn or not (max-pool
    indices, batch-norm statistics and dropout masks are activations too)."""
    base = t._base if t._is_view() and t._base is not None else t
    for ids, kind in ((params, "parameter"), (buffers, "buffer"), (inputs, "input")):
        if id(t) in ids or id(base) in ids:
            return kind
    return "activation"


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-3)


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
    if optimizer not in ("sgd", "adam"):
        raise ValueError(f"cswap.plan.fake_gpu: optimizer must be 'sgd' or 'adam', got {optimizer!r}")
    trace = _trace(model, example_inputs, loss, optimizer)
    # The fake model, its hooks and the modes form reference cycles: free them now,
    # not at some later collection in the middle of the caller's training.
    gc.collect()
    return trace


def _trace(model: nn.Module, example_inputs, loss, optimizer: str) -> StepTrace:
    device = torch.device(DEVICE)
    loss = loss or (lambda out: out.float().mean())
    mode = _fake_mode()
    tracker = LayerTracker()
    provenance = _Provenance(tracker)
    records: list[SavedRecord] = []
    saved_by: dict[int, str] = {}
    probing: list[str | None] = [None]
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

        buffers = {id(b) for b in fake.buffers()}

        def pack(t):
            index = len(records)
            made_by = producer(t)
            kind = kind_of(t, params, buffers, input_ids)
            module, module_type = tracker.current
            made_in, made_in_type = provenance.made_in(t) if kind == "activation" else ("", "")
            records.append(SavedRecord(index, tuple(t.shape), t.dtype, kind, op_name(made_by) if made_by else "",
                                       module, module_type, None, made_in, made_in_type))
            return index, t

        def unpack(packed):
            index, t = packed
            if probing[0] is not None:  # naming the node that holds it, not a use
                saved_by.setdefault(index, probing[0])
            else:
                uses.setdefault(index, len(uses))
            return t

        memory = _mem_tracker()
        memory.track_external(fake, opt)
        tracker.attach(fake)
        try:
            with memory, provenance.mode, torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                value = loss(fake(*inputs))
                # The op each tensor is saved for: the graph node holding it (reading
                # a node's _saved_* attributes runs the unpack hook on what it holds).
                for node in _graph_nodes(value.grad_fn):
                    probing[0] = op_name(_VERSION.sub("", node.name()))
                    for attr in dir(node):
                        if attr.startswith("_saved_"):
                            getattr(node, attr)
                probing[0] = None
                value.backward()
                opt.step()
        finally:
            tracker.detach()
        peak = memory.get_tracker_snapshot("peak")
    by_kind: dict[str, int] = {}
    for per_device in peak.values():
        for kind, nbytes in per_device.items():
            name = str(kind).rsplit(".", 1)[-1].lower()
            by_kind[name] = by_kind.get(name, 0) + int(nbytes)
    saved = [SavedRecord(**{**r.__dict__, "use": uses.get(r.index), "saved_by": saved_by.get(r.index, "")})
             for r in records]
    return StepTrace(saved, by_kind.pop("total", 0), by_kind)
