"""Which saved tensors to offload: found from the saved tensor itself.

A tensor autograd saves carries its producer in `grad_fn`, so `F.relu(x)`,
`nn.ReLU()` and `nn.ReLU(inplace=True)` all give `ReluBackward0`. A view of
such a tensor (a flatten after pooling) counts through its base.

A torch.compile'd graph runs as one autograd Function (AOTAutograd's
CompiledFunction): the tensors it saves for backward carry no grad_fn, and
the op that produced them is hidden in the graph. Those that are not the
graph's inputs (parameters, input batches) are its activations: offloadable
at the graph boundary, under the op name "compiled_graph".
"""

from __future__ import annotations

import functools
import os
import re
from typing import NamedTuple

import torch

__all__ = ["COMPILED_GRAPH", "KEEP", "SPARSE_PRODUCERS", "SwapInfo", "activation_producer", "compiled_graph_inputs",
           "computed_inside", "input_storages", "is_activation", "is_compiled_function", "movable", "op_name",
           "producer"]

# grad_fn names (without the trailing version digit) of ops whose outputs are
# sparse: the ReLU family (relu6 dispatches to hardtanh) and pooling.
SPARSE_PRODUCERS = frozenset({
    "ReluBackward", "ThresholdBackward", "HardtanhBackward", "LeakyReluBackward",
    "MaxPool1DWithIndicesBackward", "MaxPool2DWithIndicesBackward", "MaxPool3DWithIndicesBackward",
    "AvgPool2DBackward", "AvgPool3DBackward",
    "AdaptiveMaxPool2DBackward", "AdaptiveMaxPool3DBackward",
    "AdaptiveAvgPool2DBackward", "AdaptiveAvgPool3DBackward",
})
COMPILED_GRAPH = "compiled_graph"
KEEP = "keep"  # what a policy returns to leave a candidate on the device
_VERSION = re.compile(r"\d+$")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def movable(t) -> bool:
    """cswap can copy `t` out and restore it exactly: a plain dense tensor on CUDA or
    the CPU. Not sparse (COO, CSR, ...), nested, quantized or meta, nor a tensor
    subclass (DTensor, float8 wrappers, FakeTensor, jagged nested tensors), whose
    data and metadata a copy of its bytes would not bring back; nor a tensor whose
    negation is pending (the neg bit: z.conj().imag), whose bytes are not its values, nor
    a ZeroTensor (autograd's zeros without memory)."""
    return type(t) in _PLAIN and t.layout == torch.strided and not t.is_nested and not t.is_quantized and \
        (t.is_cuda or t.is_cpu) and not t.is_neg() and not t._is_zerotensor()


_NODE_NAMES: dict[type, str] = {}  # autograd node class -> its name without the version ("ReluBackward")


def _grad_fn_name(t: torch.Tensor) -> str | None:
    fn = t.grad_fn
    if fn is None:
        return None
    name = _NODE_NAMES.get(type(fn))
    if name is None:  # each node class has one name (a custom Function's too)
        name = _NODE_NAMES[type(fn)] = _VERSION.sub("", fn.name())
    return name


@functools.lru_cache(maxsize=4096)
def op_name(grad_fn_name: str) -> str:
    """The op as users write it: "MaxPool2DWithIndicesBackward" -> "max_pool2d",
    "ReluBackward" -> "relu", "ConvolutionBackward" -> "convolution"."""
    name = grad_fn_name.removesuffix("Backward").replace("WithIndices", "")
    name = re.sub(r"Pool(\d)D", r"Pool\1d", name)
    return _CAMEL.sub("_", name).lower()


def activation_producer(t: torch.Tensor) -> tuple[bool, str | None]:
    """(is_activation(t), producer(t)) from one look at t and its base (pack asks both)."""
    if t._is_view():
        base = t._base
        if base is not None:
            name = _grad_fn_name(base)
            return (True, name) if name is not None else (False, _grad_fn_name(t))
    name = _grad_fn_name(t)
    return name is not None, name


def producer(t: torch.Tensor) -> str | None:
    """The op that produced `t` ("ReluBackward", ...), looking through views to the
    base; None for leaves (parameters, buffers, inputs) and tensors outside autograd."""
    return activation_producer(t)[1]


def is_activation(t: torch.Tensor) -> bool:
    """An output of a differentiable op: never a parameter, buffer or input, nor a
    view of one (linear saves weight.t(), which has a grad_fn of its own)."""
    return activation_producer(t)[0]


# The two frames that call the pack hook for a compiled graph (see compiled_graph_inputs).
_APPLY_FRAME = ("apply", os.path.join("torch", "autograd", "function.py"))
_BOXED_CALL_FRAME = ("g", os.path.join("torch", "_functorch", "_aot_autograd", "utils.py"))


def compiled_graph_inputs(caller, depth: int = 3):
    """The inputs of the torch.compile'd graph whose saved tensors are being packed
    now, or None when the pack hook was not called for one. `caller` is the frame
    that called the pack hook; AOTAutograd runs a compiled graph as the autograd
    Function `CompiledFunction`, and autograd packs what it saved when its apply
    returns. Private structure, known for torch 2.11-2.15 and kept here alone:
    up to torch 2.13 the hook's caller is Function.apply's Python frame (locals
    `cls`, `args`); from 2.14 apply is C and the caller is AOTAutograd's boxed
    call `g(args)`, which calls `f(*args)` with f = CompiledFunction.apply. A
    torch that calls it otherwise is caught after the first pass (patch warns:
    compiled graphs ran, none of their saves was recognised).

    Only those two frames' locals are read: reading a frame's f_locals keeps a
    snapshot of them alive with the frame, and a user's frame holds tensors."""
    for _ in range(depth):
        if caller is None:
            return None
        code = caller.f_code
        where = (code.co_name, code.co_filename)
        if where[0] == _APPLY_FRAME[0] and where[1].endswith(_APPLY_FRAME[1]):
            cls = caller.f_locals.get("cls")
        elif where[0] == _BOXED_CALL_FRAME[0] and where[1].endswith(_BOXED_CALL_FRAME[1]):
            f = caller.f_locals.get("f")
            cls = getattr(f, "__self__", None) if getattr(f, "__name__", "") == "apply" else None
        else:
            caller = caller.f_back
            continue
        return caller.f_locals.get("args", ()) if is_compiled_function(cls) else None
    return None


def is_compiled_function(cls) -> bool:
    """`cls` is AOTAutograd's CompiledFunction (a class made per compiled graph)."""
    return isinstance(cls, type) and cls.__name__ == "CompiledFunction" and \
        cls.__module__.startswith("torch._functorch")


def input_storages(graph_inputs) -> frozenset[int]:
    """Addresses of the storages a compiled graph's inputs live in."""
    return frozenset(a.untyped_storage().data_ptr() for a in graph_inputs
                     if type(a) in (torch.Tensor, torch.nn.Parameter) and a.layout == torch.strided)


def computed_inside(t: torch.Tensor, storages: frozenset[int]) -> bool:
    """`t`, saved by a compiled graph whose inputs live in `storages`, shares no storage
    with them (a graph saves x.t() of its input x as a tensor of its own): the graph
    computed it, so it is the graph's activation."""
    return t.untyped_storage().data_ptr() not in storages


class SwapInfo(NamedTuple):
    """What a policy sees about one candidate tensor (immutable; a named tuple
    because pack makes one per offloaded tensor, at a fifth of a frozen dataclass's cost)."""

    op: str                  # producing op, e.g. "relu", "max_pool2d" (see op_name)
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    device: torch.device
    layer: str               # module path of the module that produced it, e.g. "features.2" ("" = root)
    layer_type: str          # its class name, e.g. "MaxPool2d"
    index: int               # position among this forward pass's offloaded tensors
    saved_in: str = ""       # module path of the module running when autograd saved it, e.g. "features.3"

    @property
    def key(self) -> str:
        """'3:features.3': the same tensor's id in every iteration of a static network."""
        return f"{self.index}:{self.layer}"

    @property
    def where(self) -> str:
        """'features.3 (ReLU)', as reports print it."""
        return f"{self.layer or '<root>'} ({self.layer_type})"
