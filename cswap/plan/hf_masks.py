"""Hugging Face attention masks in a traced step, built as a real step builds them.

transformers reads some tensors' values to decide how to build an attention mask:
whether position ids pack several sequences in a row, whether a padding mask pads
anything. A FakeTensor has no values, so transformers counts it as tracing
(`utils.import_utils.is_tracing`) and takes the general path: it builds the
B x 1 x L x L mask (and repeats k and v for it) where a real step of the same
batch passes `is_causal=True` to SDPA and builds nothing. A checkpointed Llama's
traced peak was 11% (L = 512) to 37% (L = 2048) above a real step's.

While a step is traced, `as_in_a_real_step(inputs)` makes those choices from what
is known of the batch: position ids the model makes itself (0, 1, 2, ...) pack
nothing; position ids and attention masks given as real tensors are read. What is
not known (given on "meta") keeps transformers' general path, the safe side.

The functions replaced are private to transformers (its `masking_utils`), so they are
looked up by name here only; a transformers without them is traced as it is.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .inputs import Inputs

__all__ = ["as_in_a_real_step"]


def _is_fake(t) -> bool:
    """A tensor without values: fake, or one torch.compile traces (as cswap.plan.compiled's
    capture sees the fake ones)."""
    return isinstance(t, FakeTensor) or torch.compiler.is_compiling()


def _known(t) -> bool:
    """A tensor whose values can be read (not meta, not fake)."""
    return isinstance(t, torch.Tensor) and t.device.type != "meta" and not _is_fake(t)


def as_in_a_real_step(example_inputs) -> contextlib.AbstractContextManager:
    """A context in which transformers builds masks for fake tensors as a real step of
    `example_inputs` would. Call it outside any fake mode: it reads the inputs' values now."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:  # no transformers model in this process
        return contextlib.nullcontext()
    kwargs = Inputs.of(example_inputs).kwargs
    replaced = {}

    find_packed = getattr(masking, "find_packed_sequence_indices", None)
    given = kwargs.get("position_ids")
    # the model counts positions 0, 1, 2, ... itself when none are given: nothing is packed
    unpacked = given is None or (_known(given) and find_packed(given) is None)
    if find_packed is not None and unpacked:
        def find_packed_sequence_indices(position_ids, *args, **kw):
            return None if _is_fake(position_ids) else find_packed(position_ids, *args, **kw)

        replaced["find_packed_sequence_indices"] = find_packed_sequence_indices

    masks = [v for k, v in kwargs.items() if k.endswith("attention_mask") and v is not None]
    # 2-D masks (1: a token, 0: padding) that pad nothing; no mask given pads nothing either
    unpadded = all(_known(m) and m.dim() == 2 and bool((m != 0).all()) for m in masks)
    for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa"):
        original = getattr(masking, name, None)
        if original is None or not unpadded:
            continue

        def ignore(padding_mask, *args, _original=original, **kw):
            return _original(None if _is_fake(padding_mask) else padding_mask, *args, **kw)

        replaced[name] = ignore
    return _Replaced(masking, replaced)


class _Replaced(contextlib.AbstractContextManager):
    """Module attributes replaced while inside (the wrappers change only what fake tensors get)."""

    def __init__(self, module, replacements: dict):
        self.module, self.replacements, self.saved = module, replacements, {}

    def __enter__(self):
        self.saved = {name: getattr(self.module, name) for name in self.replacements}
        for name, fn in self.replacements.items():
            setattr(self.module, name, fn)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.module, name, fn)
        return False
