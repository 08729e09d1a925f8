"""The optimizers a traced step runs: PyTorch's, and stand-ins with the memory of bitsandbytes'.

A fake GPU sees an optimizer only through the tensors it allocates, so bitsandbytes'
AdamW8bit and its paged variants (which need CUDA to run) are modelled here by what
they hold, not how they compute:

- 8-bit (AdamW8bit): two uint8 states per element, plus one float32 absmax per
  block of 256 elements for each (bitsandbytes' blockwise quantization); tensors
  under 4096 elements keep float32 states (its `min_8bit_size`). Its update is one
  fused kernel per parameter, with no temporaries of the parameter's size.
- paged (PagedAdamW, PagedAdamW8bit): the two states of each tensor of at least
  100,000 elements in CUDA unified memory, allocated by bitsandbytes outside PyTorch's
  caching allocator; smaller tensors' states, and the 8-bit states' absmax, stay
  ordinary device tensors (bitsandbytes 0.50, `Optimizer8bit.get_state_buffer` and
  `Optimizer2State.init_state`). The driver moves unified memory to host memory when
  the GPU runs short, so it does not count toward what PyTorch's allocator must fit;
  `paged_bytes` says how much it is.

Optimizer-in-backward (torchtune's `optimizer_in_bwd`) is `in_backward`: one
optimizer per parameter, stepped from a post-accumulate-grad hook, each gradient
freed as soon as it is applied.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["OPTIMIZERS", "in_backward", "make", "paged_bytes"]

OPTIMIZERS = ("sgd", "adam", "adamw", "adamw8bit", "paged_adamw", "paged_adamw8bit")
_BLOCK = 256            # bitsandbytes' blockwise quantization: one absmax per 256 values
_MIN_8BIT_SIZE = 4096   # bitsandbytes' min_8bit_size: smaller tensors keep float32 states
_MIN_PAGED_SIZE = 100_000  # bitsandbytes pages the states of tensors this large (get_state_buffer)


def _quantized(name: str, n: int) -> bool:
    """Whether `name` keeps the states of an n-element tensor in 8 bits."""
    return name.endswith("8bit") and n >= _MIN_8BIT_SIZE


def _paged(name: str, p: torch.Tensor) -> bool:
    """Whether `name` keeps `p`'s two states in unified memory."""
    return name.startswith("paged") and p.numel() >= _MIN_PAGED_SIZE


def _paged_state_bytes(name: str, p: torch.Tensor) -> int:
    """Bytes of `p`'s state in unified memory: the two states, not the absmax beside them."""
    return 2 * p.numel() * (1 if _quantized(name, p.numel()) else 4) if _paged(name, p) else 0


class _Bitsandbytes(torch.optim.Optimizer):
    """AdamW as bitsandbytes keeps it (module docstring): its states, an in-place update."""

    def __init__(self, params, name: str, lr: float = 1e-3):
        super().__init__(params, {"lr": lr})
        self.name = name

    def _states(self, p: torch.Tensor) -> dict:
        n, quantized = p.numel(), _quantized(self.name, p.numel())
        if _paged(self.name, p):  # unified memory: PyTorch's allocator (and the fake GPU) never sees it
            states = {"paged_bytes": _paged_state_bytes(self.name, p)}
        else:
            dtype = torch.uint8 if quantized else torch.float32
            states = {key: torch.zeros(n, dtype=dtype, device=p.device) for key in ("state1", "state2")}
        if quantized:
            blocks = math.ceil(n / _BLOCK)
            states.update(absmax1=torch.zeros(blocks, device=p.device), absmax2=torch.zeros(blocks, device=p.device))
        return states

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self._states(p))
                # One fused kernel, no temporaries: it reads and writes the states and the
                # parameter, and reads the gradient (in place here, so the roofline counts those bytes).
                for key in ("state1", "state2"):
                    if key in state:
                        state[key].add_(1)
                p.add_(p.grad, alpha=-group["lr"])


def make(name: str, params) -> torch.optim.Optimizer:
    """The optimizer `name` (OPTIMIZERS) over `params`, as a traced step runs it."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if name in OPTIMIZERS:
        return _Bitsandbytes(params, name)
    raise ValueError(f"cswap.plan: optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


def paged_bytes(name: str, model: nn.Module, idle: tuple[str, ...] = ()) -> int:
    """Bytes of optimizer state a paged optimizer keeps in unified memory (0 if not paged).
    idle: names of trainable parameters that get no gradient, so no state."""
    return sum(_paged_state_bytes(name, p) for n, p in model.named_parameters() if p.requires_grad and n not in idle)


def in_backward(name: str, model: nn.Module) -> list[torch.optim.Optimizer]:
    """One optimizer per trainable parameter, stepped as soon as its gradient is
    accumulated, the gradient then freed (torchtune's optimizer_in_bwd)."""
    optimizers = []
    for p in model.parameters():
        if p.requires_grad:
            opt = make(name, [p])

            def step(param, opt=opt):
                opt.step()
                opt.zero_grad(set_to_none=True)

            p.register_post_accumulate_grad_hook(step)
            optimizers.append(opt)
    return optimizers
