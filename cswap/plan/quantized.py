"""QLoRA's 4-bit base weights (NF4), as the trace models them.

QLoRA (Dettmers et al. 2023) keeps a model's frozen linear weights in 4-bit NormalFloat
(NF4) and trains LoRA adapters beside them in bf16. Every use of a weight dequantizes it
to the compute dtype first: in forward, and again in backward for the input's gradient
(no weight gradient: it is frozen). What the trace needs of it:

- memory: per weight, the 4-bit codes (half a byte a value), an 8-bit scale per block of
  64 values and a float32 factor per 256 of those (double quantization: the QLoRA paper's
  setting, torchtune's through torchao's NF4Tensor, bitsandbytes' with
  bnb_4bit_use_double_quant), about 0.516 bytes a value; a bf16 weight exists only while a
  multiply uses it;
- time: each dequantization is one memory-bound op that reads the codes and writes the
  weight (`cswap_plan::nf4_dequantize`), then the multiply runs in the compute dtype.

`nf4(model)` replaces every frozen linear layer (nn.Linear, and transformers' Conv1D) but the
output head with an NF4Linear (what bitsandbytes' `load_in_4bit` and torchtune's QLoRA recipes
quantize). Its codes are made on the model's device (meta: no data); on a real device the
layer runs, dequantizing whatever codes it holds: a model of the memory and time, not a
quantizer.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BLOCK", "SCALE_BLOCK", "NF4Linear", "nf4", "nf4_bytes", "nf4_dequantize"]

BLOCK = 64          # values per 8-bit scale
SCALE_BLOCK = 256   # scales per float32 factor
# QLoRA's NF4 levels (Dettmers et al. 2023, Appendix E): quantiles of N(0, 1), scaled to [-1, 1].
_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
           -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
           0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
           0.7229568362236023, 1.0)


def _blocks(numel: int) -> tuple[int, int]:
    """(8-bit scales, float32 factors) for `numel` values."""
    scales = -(-numel // BLOCK)
    return scales, -(-scales // SCALE_BLOCK)


def nf4_bytes(numel: int) -> int:
    """Bytes `numel` values take in NF4 with double quantization."""
    scales, factors = _blocks(numel)
    return -(-numel // 2) + scales + 4 * factors


@torch.library.custom_op("cswap_plan::nf4_dequantize", mutates_args=())
def nf4_dequantize(codes: torch.Tensor, scales: torch.Tensor, factors: torch.Tensor, numel: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """`numel` values of `dtype` from their NF4 codes (two a byte) and their scales
    (8-bit, one per BLOCK values, each times its float32 factor, one per SCALE_BLOCK; the
    factors' bits given as int32), a few blocks at a time: as a GPU kernel, it holds little
    beside its output."""
    factors = factors.view(torch.float32)
    levels = torch.tensor(_LEVELS, dtype=torch.float32, device=codes.device)
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    step = 8 * BLOCK
    for start in range(0, numel, step):
        end = min(start + step, numel)
        pairs = codes[start // 2: -(-end // 2)]
        index = torch.stack([pairs >> 4, pairs & 15], dim=-1).reshape(-1)[: end - start].long()
        block = torch.arange(start, end, device=codes.device) // BLOCK
        absmax = scales[block].float() * factors[block // SCALE_BLOCK]
        out[start:end] = levels[index] * absmax
    return out


@nf4_dequantize.register_fake
def _(codes, scales, factors, numel, dtype):
    return codes.new_empty(numel, dtype=dtype)


class _NF4Linear(torch.autograd.Function):
    """x @ W.T with W dequantized for the multiply and again for backward's: only the codes
    are saved, never the input (the weight gets no gradient)."""

    @staticmethod
    def forward(ctx, x, codes, scales, factors, shape):
        weight = nf4_dequantize(codes, scales, factors, shape[0] * shape[1], x.dtype).view(shape)
        ctx.save_for_backward(codes, scales, factors)
        ctx.shape = shape
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        codes, scales, factors = ctx.saved_tensors
        shape = ctx.shape
        weight = nf4_dequantize(codes, scales, factors, shape[0] * shape[1], grad.dtype).view(shape)
        return grad @ weight, None, None, None, None


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is held in NF4 (module docstring); the bias, if
    any, as it was."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        if type(linear) is nn.Linear:
            self.in_features, self.out_features = linear.in_features, linear.out_features
        else:  # transformers' Conv1D (GPT-2): its weight is (in, out); bitsandbytes transposes it to quantize
            self.in_features, self.out_features = linear.weight.shape
        numel, device = linear.weight.numel(), linear.weight.device
        scales, factors = _blocks(numel)
        self.register_buffer("codes", torch.zeros(-(-numel // 2), dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.ones(scales, dtype=torch.uint8, device=device))
        # float32 factors, held as their bits: casting the model to bf16 (as the trace does) leaves them be
        self.register_buffer("factors", torch.full((factors,), 1 / 127, device=device).view(torch.int32))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _NF4Linear.apply(x, self.codes, self.scales, self.factors, (self.out_features, self.in_features))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def nf4(model: nn.Module) -> nn.Module:
    """`model` (changed in place, and returned) with every frozen linear layer but the output
    head (a Hugging Face model's get_output_embeddings()) held in NF4: what transformers'
    bitsandbytes integration quantizes, nn.Linear itself (not its subclasses) and
    transformers' Conv1D. Apply it after LoRA: the adapters train, so they stay as they are."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    frozen = [(name, m) for name, m in model.named_modules()
              if _quantizable(m) and m is not head and not m.weight.requires_grad]
    if not frozen:
        subclasses = sorted({type(m).__name__ for m in model.modules()
                             if isinstance(m, nn.Linear) and m is not head and not m.weight.requires_grad})
        if subclasses:
            raise ValueError(f"cswap: NF4 quantizes frozen nn.Linear and Conv1D layers, as transformers' "
                             f"bitsandbytes integration does; this model's are {', '.join(subclasses)}, "
                             f"subclasses it leaves unquantized")
        raise ValueError("cswap: NF4 quantizes frozen linear layers, and this model has none to quantize "
                         "(QLoRA freezes the base model: add LoRA first, e.g. --lora-rank)")
    for name, linear in frozen:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, NF4Linear(linear))
    return model


def _quantizable(module: nn.Module) -> bool:
    """transformers' rule (integrations/bitsandbytes.py, replace_with_bnb_linear)."""
    if type(module) is nn.Linear:
        return True
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return False
    return isinstance(module, Conv1D)
