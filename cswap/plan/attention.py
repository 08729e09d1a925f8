"""The attention kernel F.scaled_dot_product_attention runs on a CUDA GPU, in a traced step.

On the fake device ("meta") SDPA takes its math fallback, which saves the
B x H x Lq x Lk attention probabilities for backward; on a GPU PyTorch's
dispatcher picks a fused kernel that saves O(L): flash attention (output and
logsumexp) or memory-efficient attention (the same, plus the mask as a bias).
`backend` follows the dispatcher's order for CUDA (flash, then memory-efficient,
then math: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, torch 2.11-2.14)
on the conditions that decide between them in training:

- flash: fp16 or bf16 on compute capability 8.0+, no attn_mask, q, k and v of
  one head size of at most 256 (at most 192 on 8.6/8.9, where its backward
  lacks the larger tiles), is_causal only with as many queries as keys; grouped
  query attention allowed.
- memory-efficient: fp32 or fp16 (5.0+) or bf16 (8.0+), a head size aligned
  to 8 elements (16-bit) or 4 (fp32), attn_mask allowed (a boolean one becomes
  a float bias first), no grouped query attention.
- math otherwise: what the fake device does on its own.

cuDNN's attention (9.0+) is tried after these in these versions' default order
and saves what flash does; a process that forces another backend
(torch.nn.attention.sdpa_kernel) is not seen. Assumed, not measured.

The target "cpu" follows the CPU dispatcher instead (sdp_utils_cpp.cpp: flash for
any floating dtype, masks and grouped queries allowed, no dropout, no mask that needs
a gradient, as a real CPU step shows; a boolean mask becomes a float bias first, which
it saves): what a real CPU step saves, which the tests check the trace against.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.nn import functional as F

from .nested import call_seen

__all__ = ["BACKENDS", "backend", "fused_attention_mode"]

BACKENDS = ("flash", "efficient", "flash-cpu", "math")
CPU = "cpu"


def backend(target, dtype: torch.dtype, q_shape, k_shape, v_shape, *, masked: bool, is_causal: bool,
            gqa: bool, dropout: bool, learned_mask: bool = False) -> str:
    """The SDPA backend for this call on a GPU of compute capability `target` (90 for
    9.0), or on the CPU (target "cpu"). `learned_mask`: the mask needs a gradient (a
    relative position bias: MaxViT, CoAtNet), which the CPU's flash kernel cannot give."""
    head, head_k, head_v = q_shape[-1], k_shape[-1], v_shape[-1]
    if target == CPU:
        return "flash-cpu" if not dropout and not learned_mask and head == head_k == head_v \
            and dtype.is_floating_point else "math"
    arch = int(target)
    sixteen_bit = dtype in (torch.float16, torch.bfloat16)
    same_heads = q_shape[-3] == k_shape[-3] == v_shape[-3] if len(q_shape) >= 3 else True
    dtype_ok = dtype == torch.float16 or (dtype == torch.bfloat16 and arch >= 80)
    flash_head = 192 if arch in (86, 89) else 256
    if (arch >= 80 and dtype_ok and not masked and head == head_k == head_v and head <= flash_head
            and not (is_causal and q_shape[-2] != k_shape[-2])):
        return "flash"
    efficient_dtype = dtype in (torch.float32, torch.float16) or (dtype == torch.bfloat16 and arch >= 80)
    align = 8 if sixteen_bit else 4
    if (arch >= 50 and efficient_dtype and head == head_k and head % align == 0 and head_v % align == 0
            and (same_heads or not gqa)):
        return "efficient"
    return "math"


def _sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def fused_attention_mode(target, counts: Counter):
    """A TorchFunctionMode that runs F.scaled_dot_product_attention as the fused kernel
    `target` (a compute capability, or "cpu") would, counting the backends taken in `counts`."""
    from torch.overrides import TorchFunctionMode

    aten = torch.ops.aten

    class FusedAttention(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is not F.scaled_dot_product_attention:
                return call_seen(self, func, args, kwargs)  # (nn.MultiheadAttention calls it from inside)
            q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_args(*args, **kwargs)
            if q.dim() != 4:
                counts["math"] += 1
                return func(*args, **kwargs)
            chosen = backend(target, q.dtype, q.shape, k.shape, v.shape, masked=mask is not None,
                             is_causal=is_causal, gqa=gqa, dropout=dropout_p > 0,
                             learned_mask=mask is not None and mask.requires_grad)
            counts[chosen] += 1
            if chosen in ("flash-cpu", "efficient") and mask is not None and mask.dtype == torch.bool:
                # As SDPA does before these kernels (where(~mask, -inf, 0): the negated mask and
                # the bias, no third tensor): a float bias, which they save for backward.
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
            if chosen == "flash-cpu":
                return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                        attn_mask=mask, scale=scale)[0]
            if chosen == "flash":
                return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                                scale=scale)[0]
            if chosen == "efficient":
                if mask is not None:
                    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
                return aten._scaled_dot_product_efficient_attention(
                    q, k, v, mask, torch.is_grad_enabled(), dropout_p, is_causal, scale=scale)[0]
            return func(*args, **kwargs)

    return FusedAttention()
