"""Where a forward's saves are cswap's to move, and where someone else decides.

cswap installs its saved-tensor hooks when a patched model's forward begins (or a
`cswap.offload()` region does). It leaves the saves to autograd, or to whoever
already decides, where:

- PyTorch refuses saved-tensor hooks: inside torch.func.grad, vjp, jacrev or
  hessian, or torch.autograd.graph.disable_saved_tensors_hooks;
- another saved-tensor hooks context encloses the forward: torch.utils.checkpoint
  around the model's call (installed as the innermost hooks, cswap's would keep
  what checkpoint means to recompute), save_on_cpu, another offloader. cswap's own
  contexts (a swapper's, the emulated device's) are marked `OWN` and nest with it;
  the planners' tracers are marked `TRACER`: they see the saves, and nobody is told;
- the forward runs inside a backward: a reentrant checkpoint's recomputation,
  whose saves that backward reads at once.
"""

from __future__ import annotations

import torch

__all__ = ["OWN", "TRACER", "enclosing_hooks", "hooks_turned_off", "in_backward", "mark"]

OWN = "_cswap_own_hooks"
TRACER = "_cswap_tracer_hooks"


def mark(pack, kind: str = OWN):
    """Mark a pack hook (a function; a method's function marks its bound methods too)."""
    setattr(pack, kind, True)
    return pack


def hooks_turned_off() -> bool:
    """PyTorch refuses saved-tensor hooks here, and with them non-reentrant checkpoint."""
    return torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is not None


def enclosing_hooks():
    """The pack hook of the innermost saved-tensor hooks context around this point, unless
    it is cswap's own (None then, or with none at all)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None or getattr(top[0], OWN, False):
        return None
    return top[0]


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1
