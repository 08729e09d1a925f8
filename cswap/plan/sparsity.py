"""How sparse each saved activation is, for a prediction: measured on a few real
CPU steps, read from a file, or one number.

Tensors are matched to a trace's records by (module that made it, producing op,
occurrence), not by save order, so sparsity measured in float32 applies to a
bf16 or mixed-precision trace of the same model (a zero stays a zero when cast).

Measured tensors also carry ZANS's predicted size in bits per element (its
encoder's plan from the tensor's byte histograms, cswap.plan.profiler.zans_bits)
per dtype: as measured in float32, and for bfloat16 and float16 from the same
values cast (what an autocast trace saves is close to that: the op's result
rounded to 16 bits). A trace whose dtype has no measurement falls back to
ZANS's upper bound in the advisor.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..runtime.candidates import SPARSE_PRODUCERS, is_activation, op_name, producer
from ..runtime.layers import LayerTracker
from .profiler import sparsity_and_runs, zans_bits, zans_histograms
from .inputs import Inputs, default_loss

__all__ = ["SPARSE_OPS", "Sparsity", "auto", "dtype_name", "from_file", "from_number", "measure", "record_keys",
           "zans_bits_by_dtype"]

SPARSE_OPS = frozenset(op_name(p) for p in SPARSE_PRODUCERS)


@dataclass(frozen=True)
class Sparsity:
    """Per tensor key: (fraction of all-zero elements, maximal runs of non-zeros), where it came
    from, and (when measured) ZANS's predicted bits per element by dtype name ("bfloat16")."""

    values: dict[tuple, tuple[float, int]]
    source: str
    zans: dict[tuple, dict[str, float]] = field(default_factory=dict)

    def zans_bits_of(self, key: tuple, dtype: torch.dtype) -> float | None:
        """ZANS's bits per element for the tensor as `dtype` holds it, or None if not measured."""
        return self.zans.get(key, {}).get(dtype_name(dtype))

    def of(self, key: tuple, numel: int, op: str) -> tuple[float, int]:
        if key in self.values:
            return self.values[key]
        if "*" in self.values and op in SPARSE_OPS:  # one number for every ReLU / pooling output
            s = self.values["*"][0]
            return s, _iid_runs(numel, s)
        return 0.0, 1 if numel else 0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# A trace in another precision saves the same values rounded to these.
_CASTS = (torch.float32, torch.bfloat16, torch.float16)


def zans_bits_by_dtype(t: torch.Tensor) -> dict[str, float]:
    """ZANS's predicted bits per element of t, and for a floating t of t cast to each of _CASTS."""
    held = [t] + ([t.to(d) for d in _CASTS if d != t.dtype] if t.is_floating_point() else [])
    return {dtype_name(c.dtype): zans_bits(zans_histograms(c).cpu().numpy(), c.numel(), c.element_size())
            for c in held}


def _iid_runs(numel: int, s: float) -> int:
    """Expected maximal runs of non-zeros when each element is zero with probability s."""
    return max(1, round(numel * (1.0 - s) * s)) if s < 1.0 else 0


def record_keys(records) -> list[tuple]:
    """(made_in, op, n): the n-th tensor made in that module by that op, per record."""
    seen: dict[tuple, int] = {}
    keys = []
    for made_in, op in records:
        n = seen.get((made_in, op), 0)
        seen[(made_in, op)] = n + 1
        keys.append((made_in, op, n))
    return keys


def from_number(value: float) -> Sparsity:
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"cswap.plan.sparsity: a sparsity must be in [0, 1], got {value}")
    return Sparsity({"*": (value, 0)}, f"assumed: {value:g} for every ReLU and pooling output, 0 elsewhere")


def from_file(path) -> Sparsity:
    """A prediction's JSON (cswap-plan --json): its tensors' measured sparsity and runs."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
        values = {(t["made_in"], t["op"], int(t["occurrence"])): (float(t["sparsity"]), int(t["runs"]))
                  for t in doc["tensors"]}
        zans = {(t["made_in"], t["op"], int(t["occurrence"])): {str(t["dtype"]): float(t["zans_bits"])}
                for t in doc["tensors"] if t.get("zans_bits") is not None}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cswap.plan.sparsity: {path} is not a cswap-plan JSON with tensors' made_in, op, "
                         f"occurrence, sparsity and runs ({exc}); write one with cswap-plan --json") from exc
    return Sparsity(values, f"from {path}", zans)


def measure(model: nn.Module, batches, steps: int = 3, lr: float = 0.01, what: str = "", targets=None) -> Sparsity:
    """Train a copy of `model` on CPU for `steps` SGD steps on `batches` (an iterable
    of input tuples or cswap.plan.inputs.Inputs) and measure every saved activation of
    the last one. With `targets` (an iterable of class-index tensors, one per batch)
    the loss is cross-entropy against them; without, the output's own loss or its
    mean (cswap.plan.inputs.default_loss: a stand-in that still moves the weights)."""
    from .fake_gpu import _Recorder

    model = copy.deepcopy(model).cpu().float().train()
    tracker = LayerTracker()
    recorder = _Recorder(tracker, lambda: 0)  # which module made each tensor, as the trace sees it
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    made: list[tuple] = []
    stats: list[tuple] = []
    zans: list[dict] = []
    measuring = [False]

    def pack(t):
        if measuring[0] and is_activation(t):
            made.append((recorder.made_in(t)[0], op_name(producer(t))))
            nnz, runs = sparsity_and_runs(t)
            stats.append((1.0 - int(nnz) / max(t.numel(), 1), int(runs)))
            zans.append(zans_bits_by_dtype(t.detach()))
        return t

    tracker.attach(model)
    try:
        targets = iter(targets) if targets is not None else None
        for step, inputs in zip(range(steps), batches):
            measuring[0] = step == steps - 1
            recorder.ops.clear()
            recorder.made.clear()
            with recorder.mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = Inputs.of(inputs)(model)
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(out.float(), next(targets)) if targets is not None else \
                default_loss(out)
            loss.backward()
            opt.step()
    finally:
        tracker.detach()
    keys = record_keys(made)
    return Sparsity(dict(zip(keys, stats)), what or f"measured: {steps} CPU training steps", dict(zip(keys, zans)))


def auto(model: nn.Module, example_inputs, data: str = "digits", steps: int = 3, batch: int = 8) -> Sparsity:
    """Measure on `steps` CPU training steps at `batch`: image batches (3 x H x H) from
    `data` (as cswap-train reads it: "digits" is scikit-learn's, resized) with their
    labels and a cross-entropy loss, any other input as random normal tensors of the
    example's shapes (integer ones drawn from the example's values when it holds data,
    zeros on "meta"), keyword inputs included."""
    inputs = Inputs.of(example_inputs)
    shape = tuple(inputs.args[0].shape[1:]) if inputs.args and isinstance(inputs.args[0], torch.Tensor) else ()
    gen = torch.Generator().manual_seed(0)
    if len(inputs.args) == 1 and not inputs.kwargs and len(shape) == 3 and shape[0] == 3 and \
            shape[1] == shape[2] and inputs.args[0].is_floating_point():
        from ..models.data import load_data

        x, y = load_data(data, shape[-1], seed=0)[:2]
        pick = torch.randint(len(x), (steps * batch,), generator=gen)
        x, y = x[pick], y[pick]
        batches = [Inputs((x[i * batch:(i + 1) * batch],)) for i in range(steps)]
        targets = [y[i * batch:(i + 1) * batch] for i in range(steps)]
        what = f"{data} images and labels"
    else:
        def like(t: torch.Tensor) -> torch.Tensor:
            shape = (batch, *t.shape[1:])
            if t.is_floating_point():
                return torch.randn(shape, generator=gen).to(t.dtype)
            if t.is_meta or t.numel() == 0:
                return torch.zeros(shape, dtype=t.dtype)
            values = t.detach().cpu().reshape(-1)
            return values[torch.randint(len(values), shape, generator=gen)]

        batches = [inputs.map(like) for _ in range(steps)]
        targets = None
        what = "random normal inputs"
    return measure(model, batches, steps=steps, targets=targets,
                   what=f"measured: {steps} SGD steps on this CPU, batch {batch}, {what}, from the model's "
                        f"current weights")
