"""Compute time per op on a named GPU, predicted from FLOPs and bytes (a roofline).

An op of a traced step (cswap.plan.fake_gpu.OpRecord) takes

    t = max(flops / peak(dtype), bytes / hbm_bandwidth) / efficiency, at least LAUNCH_FLOOR_S

with the GPU's dense peak for the op's compute dtype (cswap.plan.gpus) and one
efficiency factor per GPU family, calibrated against published ResNet-50
training throughputs (`calibrate`, committed as cswap/data/efficiency.json).
Views move nothing and take no time. Which peak an op gets: float16 and
bfloat16 ops the tensor-core rate of their type; float32 convolutions TF32
where the GPU has it (PyTorch's default, torch.backends.cudnn.allow_tf32 =
True), float32 matmuls TF32 only with precision "tf32" (PyTorch's default
torch.backends.cuda.matmul.allow_tf32 is False); ops without a FLOP formula
are memory-bound.

A measured profile beats this model: where one exists for the GPU, its layer
times are used instead (cswap.plan.whatif).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .gpus import GPU, PUBLISHED_RESNET50, Throughput, gpu as lookup

__all__ = ["EFFICIENCY_FILE", "LAUNCH_FLOOR_S", "PRECISIONS", "Calibration", "efficiency", "op_seconds",
           "step_seconds", "calibrate", "trace_for"]

# An eager PyTorch op costs the host about this much to launch (dispatch + cudaLaunchKernel);
# a step of many tiny ops is bound by it, not by the GPU. Assumed, not measured here.
LAUNCH_FLOOR_S = 5e-6
PRECISIONS = ("fp32", "tf32", "amp", "bf16", "fp16")
EFFICIENCY_FILE = Path(__file__).resolve().parents[1] / "data" / "efficiency.json"
_CONV = {"convolution", "convolution_backward", "_convolution", "cudnn_convolution"}


def _peak_key(op, gpu: GPU, precision: str) -> str:
    if op.dtype == torch.float16:
        return "fp16"
    if op.dtype == torch.bfloat16:
        return "bf16"
    tf32 = precision == "tf32" or op.name in _CONV
    return "tf32" if tf32 and "tf32" in gpu.flops else "fp32"


def op_seconds(op, gpu: GPU, precision: str, efficiency: float) -> float:
    """Predicted seconds of one traced op (module docstring)."""
    if op.bytes == 0 and op.flops == 0:
        return 0.0
    compute = op.flops / gpu.peak_flops(_peak_key(op, gpu, precision)) if op.flops else 0.0
    memory = op.bytes / gpu.hbm_bytes_per_s
    return max(max(compute, memory) / efficiency, LAUNCH_FLOOR_S)


def step_seconds(ops, gpu: GPU, precision: str, efficiency: float) -> dict[str, float]:
    """Predicted seconds per phase ("forward", "backward", "optimizer") of a traced step."""
    out = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    for op in ops:
        out[op.phase] += op_seconds(op, gpu, precision, efficiency)
    return out


def trace_for(model, example_inputs, precision: str, optimizer: str = "sgd", loss=None, drop: bool = True,
              arch: int | None = None, optimizer_in_backward: bool = False):
    """Trace one step of `model` at `precision` (PRECISIONS): fp32/tf32 as float32,
    amp as float16 autocast, bf16 and fp16 as the model cast to that type; attention
    as a GPU of compute capability `arch` runs it (cswap.plan.attention).
    example_inputs: a tensor, a tuple, a dict of keyword arguments, or a batch shape (a
    float32 image batch)."""
    from . import fake_gpu

    if precision not in PRECISIONS:
        raise ValueError(f"cswap.plan.roofline: precision must be one of {', '.join(PRECISIONS)}, "
                         f"got {precision!r}")
    if isinstance(example_inputs, (tuple, list)) and all(isinstance(d, int) for d in example_inputs):
        example_inputs = torch.empty(tuple(example_inputs), device="meta")
    kwargs = {"amp": {"autocast": torch.float16}, "bf16": {"dtype": torch.bfloat16},
              "fp16": {"dtype": torch.float16}}.get(precision, {})
    return fake_gpu.trace_step(model, example_inputs, loss=loss, optimizer=optimizer, drops=drop, sdpa_arch=arch,
                               optimizer_in_backward=optimizer_in_backward, **kwargs)


# -- calibration --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """One published throughput against the roofline's prediction for it."""

    point: Throughput
    roofline_s: float      # predicted step seconds at efficiency 1
    published_s: float     # batch / images_per_s
    predicted_s: float = 0.0  # with the family's fitted efficiency

    @property
    def efficiency(self) -> float:
        return self.roofline_s / self.published_s

    @property
    def residual(self) -> float:
        """Predicted over published step time, minus one."""
        return self.predicted_s / self.published_s - 1.0


def _published_precision(point: Throughput) -> str:
    """A published "tf32" run is PyTorch's float32 default: TF32 convolutions, float32 matmuls."""
    return "fp32" if point.precision == "tf32" else point.precision


def calibrate(points=PUBLISHED_RESNET50, progress=None) -> tuple[dict[str, float], list[Calibration]]:
    """Fit one efficiency per GPU family: the geometric mean of roofline / published
    step time over its points (ResNet-50 v1.5 at ImageNet shape, SGD, each point's
    batch and precision). Returns ({family: efficiency}, per-point results with residuals)."""
    from ..models import build

    model = build("resnet50", dataset="imagenet")
    traces = {}
    rows = []
    for p in points:
        precision, key = _published_precision(p), (p.batch, _published_precision(p))
        if key not in traces:
            traces[key] = trace_for(model, (p.batch, 3, 224, 224), precision, drop=False).ops
        g = lookup(p.gpu)
        roofline = sum(step_seconds(traces[key], g, precision, 1.0).values())
        rows.append(Calibration(p, roofline, p.batch / p.images_per_s))
        if progress:
            progress(p)
    by_family: dict[str, list[float]] = {}
    for r in rows:
        by_family.setdefault(lookup(r.point.gpu).family, []).append(math.log(r.efficiency))
    factors = {family: math.exp(sum(v) / len(v)) for family, v in by_family.items()}
    fitted = []
    for r in rows:
        g = lookup(r.point.gpu)
        precision = _published_precision(r.point)
        predicted = sum(step_seconds(traces[(r.point.batch, precision)], g, precision, factors[g.family]).values())
        fitted.append(Calibration(r.point, r.roofline_s, r.published_s, predicted))
    return factors, fitted


def efficiency(gpu: GPU) -> tuple[float, str]:
    """(the efficiency for `gpu`'s family, where it came from). A family without
    published points takes the mean over families, and says so."""
    data = _calibration()
    factors = data["efficiency"]
    if gpu.family in factors:
        n = sum(1 for p in data["points"] if p["family"] == gpu.family)
        return factors[gpu.family], (f"{gpu.family} efficiency {factors[gpu.family]:.2f}, calibrated on {n} "
                                     f"published ResNet-50 throughputs (cswap/data/efficiency.json)")
    mean = math.exp(sum(math.log(v) for v in factors.values()) / len(factors))
    return mean, (f"efficiency {mean:.2f}: no published throughput for {gpu.family}; the mean over "
                  f"{', '.join(sorted(factors))}")


@functools.lru_cache(maxsize=1)
def _calibration() -> dict:
    return json.loads(EFFICIENCY_FILE.read_text())


def _write(path: Path) -> None:
    factors, rows = calibrate(progress=lambda p: print(f"  traced {p.gpu} {p.precision} batch {p.batch}"))
    points = [{"gpu": r.point.gpu, "family": lookup(r.point.gpu).family, "precision": r.point.precision,
               "batch": r.point.batch, "published_images_per_s": r.point.images_per_s,
               "predicted_images_per_s": round(r.point.batch / r.predicted_s, 1),
               "residual": round(r.residual, 4), "source": r.point.source} for r in rows]
    data = {"what": "roofline efficiency per GPU family, fitted to published ResNet-50 v1.5 training throughput "
                    "(python -m cswap.plan.roofline)", "torch": torch.__version__,
            "launch_floor_s": LAUNCH_FLOOR_S,
            "efficiency": {k: round(v, 4) for k, v in sorted(factors.items())}, "points": points}
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{'gpu':<16} {'precision':<9} {'batch':>5} {'published':>10} {'predicted':>10} {'residual':>9}")
    for p in points:
        print(f"{p['gpu']:<16} {p['precision']:<9} {p['batch']:>5} {p['published_images_per_s']:>10.0f} "
              f"{p['predicted_images_per_s']:>10.0f} {p['residual']:>+9.1%}")
    print("efficiency per family:", ", ".join(f"{k} {v:.3f}" for k, v in sorted(factors.items())))
    print(f"wrote {path}")


if __name__ == "__main__":
    _write(EFFICIENCY_FILE)
