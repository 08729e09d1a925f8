"""Where a forward's saves are cswap's to move, and where someone else decides.

cswap installs its saved-tensor hooks when a patched model's forward begins (or a
`cswap.offload()` region does). It leaves the saves to autograd, or to whoever
already decides, where:

- PyTorch refuses saved-tensor hooks: inside torch.func.grad, vjp, jacrev or
  hessian, or torch.autograd.graph.disable_saved_tensors_hooks;
- another saved-tensor hooks context encloses the forward: torch.utils.checkpoint
  around the model's call (installed as the innermost hooks, cswap's would keep
  what checkpoint means to recompute), save_on_cpu, another offloader. cswap's own
  contexts (a swapper's, the emulated device's) are marked (`mark`) and nest with it;
- the forward runs inside a backward: a reentrant checkpoint's recomputation,
  whose saves that backward reads at once.
"""

from __future__ import annotations

import torch

__all__ = ["hooks_turned_off", "in_backward", "keeps_graph", "mark", "why_not_ours"]

_OWN = "_cswap_own_hooks"

try:  # (private, in torch 2.11-2.15)
    from torch._C._autograd import _get_current_graph_task_keep_graph as _keep_graph
except ImportError:  # pragma: no cover - a torch without it: retain_graph is seen at the second backward
    _keep_graph = None


def keeps_graph() -> bool | None:
    """Inside a backward: whether it keeps its graph (retain_graph=True, or create_graph),
    which keeps every tensor saved for it until the graph goes; None where torch does not say."""
    return _keep_graph() if _keep_graph is not None else None


def mark(pack):
    """Mark a pack hook as cswap's own (a function; a method's function marks its bound
    methods too)."""
    setattr(pack, _OWN, True)
    return pack


def in_backward() -> bool:
    """Running inside a backward: a forward here is a reentrant checkpoint's recomputation,
    whose saves that backward reads at once (left to autograd)."""
    return torch._C._current_graph_task_id() != -1


def hooks_turned_off() -> bool:
    """PyTorch refuses saved-tensor hooks here, and with them non-reentrant checkpoint."""
    return torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is not None


def why_not_ours(what: str) -> str | None:
    """Why the saves of a forward beginning here (`what`: "this patched model ran") are not
    cswap's to move: a warning to give, "" to leave them quietly, or None: they are cswap's."""
    if hooks_turned_off():
        return (f"cswap: {what} where PyTorch turns saved-tensor hooks off (inside torch.func.grad, vjp, jacrev "
                f"or hessian, or torch.autograd.graph.disable_saved_tensors_hooks), so what it saves for backward "
                f"there stays on the device; outside, cswap offloads as before")
    if in_backward():
        return ""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None or getattr(top[0], _OWN, False):
        return None
    pack = top[0]
    return (f"cswap: {what} inside another saved-tensor hooks context ({pack.__module__}.{pack.__qualname__}: "
            f"torch.utils.checkpoint around the model's call, save_on_cpu or another offloader), which decides "
            f"what happens to what the model saves there; cswap moves none of it. Patch a module inside that "
            f"context, or call the model outside it")
