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

import re
from dataclasses import dataclass

import torch

__all__ = ["COMPILED_GRAPH", "KEEP", "SPARSE_PRODUCERS", "SwapInfo", "is_activation", "op_name", "producer",
           "saved_by_compiled_graph"]

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


def _grad_fn_name(t: torch.Tensor) -> str | None:
    fn = t.grad_fn
    return _VERSION.sub("", fn.name()) if fn is not None else None


def op_name(grad_fn_name: str) -> str:
    """The op as users write it: "MaxPool2DWithIndicesBackward" -> "max_pool2d",
    "ReluBackward" -> "relu", "ConvolutionBackward" -> "convolution"."""
    name = grad_fn_name.removesuffix("Backward").replace("WithIndices", "")
    name = re.sub(r"Pool(\d)D", r"Pool\1d", name)
    return _CAMEL.sub("_", name).lower()


def producer(t: torch.Tensor) -> str | None:
    """The op that produced `t` ("ReluBackward", ...), looking through views to the
    base; None for leaves (parameters, buffers, inputs) and tensors outside autograd."""
    if t._is_view() and t._base is not None:
        base = _grad_fn_name(t._base)
        if base is not None:
            return base
    return _grad_fn_name(t)


def is_activation(t: torch.Tensor) -> bool:
    """An output of a differentiable op: never a parameter, buffer or input, nor a
    view of one (linear saves weight.t(), which has a grad_fn of its own)."""
    if t._is_view() and t._base is not None:
        return t._base.grad_fn is not None
    return t.grad_fn is not None


def saved_by_compiled_graph(t: torch.Tensor, caller, depth: int = 3) -> bool:
    """`t` is an activation a compiled graph saves for backward. `caller` is the
    frame that called the pack hook: for a compiled graph, autograd's
    Function.apply of AOTAutograd's CompiledFunction (looked for up to `depth`
    frames up, past wrappers of the hook), whose `args` are the graph's inputs;
    a saved tensor that is none of them (nor a view of one) was computed inside
    the graph."""
    for _ in range(depth):
        if caller is None:
            return False
        if caller.f_code.co_name == "apply":
            break
        caller = getattr(caller, "f_back", None)
    else:
        return False
    local = caller.f_locals
    cls = local.get("cls")
    if getattr(cls, "__name__", "") != "CompiledFunction" or \
            not getattr(cls, "__module__", "").startswith("torch._functorch"):
        return False
    base = t._base if t._is_view() and t._base is not None else t
    return not any(a is t or a is base for a in local.get("args", ()))


@dataclass(frozen=True)
class SwapInfo:
    """What a policy sees about one candidate tensor."""

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
