"""A model's example inputs (positional, keyword or both) and the loss of its output.

    Inputs.of(x)                                   # model(x)
    Inputs.of((x, mask))                           # model(x, mask)
    Inputs.of({"input_ids": ids, "labels": ids})   # model(input_ids=ids, labels=ids)

The planners read only the tensors' shapes and dtypes; the batch is the first
tensor's leading dimension (positional first, then keyword in order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Inputs", "default_loss"]


@dataclass(frozen=True)
class Inputs:
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    @classmethod
    def of(cls, example_inputs) -> "Inputs":
        """A tensor, a tuple or list of positional arguments, or a dict of keyword arguments."""
        if isinstance(example_inputs, Inputs):
            return example_inputs
        if isinstance(example_inputs, torch.Tensor):
            return cls((example_inputs,))
        if isinstance(example_inputs, dict):
            if not all(isinstance(k, str) for k in example_inputs):
                raise TypeError("example inputs: a dict's keys are forward's keyword names (strings)")
            return cls((), dict(example_inputs))
        if isinstance(example_inputs, (tuple, list)):
            return cls(tuple(example_inputs))
        raise TypeError(f"example inputs must be a tensor, a tuple of forward's positional arguments or a dict "
                        f"of its keyword arguments, got {type(example_inputs).__name__}")

    def tensors(self) -> list[torch.Tensor]:
        return [x for x in (*self.args, *self.kwargs.values()) if isinstance(x, torch.Tensor)]

    @property
    def batch(self) -> int:
        first = next(iter(self.tensors()), None)
        if first is None or first.dim() == 0:
            raise ValueError("example inputs must hold at least one tensor with a batch dimension")
        return first.shape[0]

    def map(self, fn) -> "Inputs":
        """These inputs with fn applied to every tensor."""
        def each(x):
            return fn(x) if isinstance(x, torch.Tensor) else x

        return Inputs(tuple(each(x) for x in self.args), {k: each(v) for k, v in self.kwargs.items()})

    def __call__(self, model):
        return model(*self.args, **self.kwargs)


def default_loss(output) -> torch.Tensor:
    """The loss a model's output stands for: its own `loss` when it computed one (Hugging
    Face models given labels), else the mean of its first tensor (logits), in float32."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        output = next((x for x in output if isinstance(x, torch.Tensor)), None)
    if not isinstance(output, torch.Tensor):
        raise TypeError("the model's output holds no tensor to take a loss of; pass loss=lambda output: ...")
    return output.float().mean()
