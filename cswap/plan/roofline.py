"""Compute time per op on a named GPU, predicted by op class from FLOPs and bytes.

An op of a traced step (cswap.plan.fake_gpu.OpRecord) falls in one of four
classes, each timed against what the GPU reaches (cswap.plan.gpus):

    matmul     mm, addmm, bmm, baddbmm, grouped ones (MoE experts, cswap.plan.grouped_mm):
               flops / (rate * e_mm(flops)), where
               e_mm(f) = matmul_efficiency * f / (f + matmul_half_flops): large
               multiplies run near a fixed share of the rate, small ones (a LoRA
               adapter's, a batch of one's) far below it
    conv       convolutions and their backward: flops / (rate * e_conv), and on
               tensor cores in an NCHW model the layout transposes cuDNN runs
               around each call, 2 x bytes at the memory-bound share
               (_transposed; none in torch.channels_last)
    attention  fused SDPA kernels (flash, efficient, cuDNN): flops / (rate *
               e_attn), causal masking counted as executed (cswap.plan.fake_gpu)
    memory     everything else: bytes / (hbm_bandwidth * e_bw)

and no op is faster than its bytes at that bandwidth, nor than LAUNCH_FLOOR_S
(an eager op's launch). Views (and _unsafe_view, which aten does not mark as
one) move nothing and take no time. The rate is what a large torch.matmul
measurably reaches on the GPU in the op's dtype (GPU.reachable_flops: a public
measurement where one exists, else the datasheet's peak at the measured GPUs'
median share), so the clocks a GPU really runs at (a GeForce card above its
rated boost, a data-centre part below, held by power) are in the rate, not the
shares. The compute classes' shares are scaled per GPU family (how well a
generation's libraries use its units, against Ampere's 1.0), within what each
class can reach. The factors are fitted together (an OpTimeModel, committed as
cswap/data/time_model.json by `python benchmarks/plan_accuracy.py --fit`) on a
calibration set of published training runs, CNNs and LLMs on several GPUs (each
family weighing alike);
another set of published runs, kept apart, measures the model
(benchmarks/results/plan-accuracy/).

Which rate an op gets: float16 and bfloat16 ops the tensor-core rate of their
type; float32 convolutions TF32 where the GPU has it (PyTorch's default,
torch.backends.cudnn.allow_tf32 = True), float32 matmuls TF32 only with
precision "tf32" (torch.backends.cuda.matmul.allow_tf32 is False by default).

A measured profile beats this model: where one exists for the GPU, its layer
times are used instead (cswap.plan.whatif).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from .gpus import GPU
from .grouped_mm import GROUPED_MATMULS

__all__ = ["ADAPTER_DTYPES", "CLASSES", "LAUNCH_FLOOR_S", "PRECISIONS", "TIME_MODEL_FILE", "OpTimeModel", "fit",
           "op_class", "op_seconds", "op_times", "step_seconds", "time_model", "trace_for"]

# An eager PyTorch op costs the host about this much to launch (dispatch + cudaLaunchKernel);
# a step of many tiny ops is bound by it, not by the GPU. Assumed, not measured here.
LAUNCH_FLOOR_S = 5e-6
PRECISIONS = ("fp32", "tf32", "amp", "bf16", "fp16")
ADAPTER_DTYPES = ("float32", "model")  # peft's adapters on a bf16/fp16 model: peft's float32, or cast with it
TIME_MODEL_FILE = Path(__file__).resolve().parents[1] / "data" / "time_model.json"
CLASSES = ("matmul", "conv", "attention", "memory")
_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm", *GROUPED_MATMULS}
_CONV = {"convolution", "convolution_backward", "_convolution", "cudnn_convolution", "cudnn_convolution_transpose"}
# Ops aten does not mark as views that still only reinterpret their input: no kernel runs.
_FREE = {"_unsafe_view", "_reshape_alias", "alias", "lift_fresh"}


@dataclass(frozen=True)
class OpTimeModel:
    """The fitted factors (module docstring): shares of the measured matmul rate (compute
    classes) and of HBM bandwidth (memory-bound ops) that each class of op reaches, and per
    GPU family a scale on the compute classes' shares."""

    matmul_efficiency: float = 0.9    # of the measured matmul rate, for large multiplies
    matmul_half_flops: float = 1e9    # the multiply size at which half of that is reached
    conv_efficiency: float = 0.5
    attention_efficiency: float = 0.5
    bandwidth_efficiency: float = 0.8  # of the HBM bandwidth, for memory-bound ops
    family_scale: tuple = ()           # ((family, scale), ...) against ampere's 1.0

    def scale(self, family: str) -> float:
        """The family's scale; a family without one takes the geometric mean of those known."""
        scales = {"ampere": 1.0} | dict(self.family_scale)
        if family in scales:
            return float(scales[family])
        return float(np.exp(np.mean(np.log(list(scales.values())))))

    def factors(self) -> np.ndarray:
        """The five class factors, in field order."""
        return np.array([self.matmul_efficiency, self.matmul_half_flops, self.conv_efficiency,
                         self.attention_efficiency, self.bandwidth_efficiency], dtype=np.float64)

    @classmethod
    def from_dict(cls, doc: dict) -> "OpTimeModel":
        return cls(**{**doc, "family_scale": tuple(sorted(doc.get("family_scale", {}).items()))})

    def as_dict(self) -> dict:
        doc = {f.name: float(f"{getattr(self, f.name):.6g}") for f in fields(self) if f.name != "family_scale"}
        return doc | {"family_scale": {k: float(f"{v:.6g}") for k, v in self.family_scale}}


# The most each factor may reach, with its family's scale, as shares of the measured matmul rate:
# a large multiply reaches the rate (it is that rate), a convolution at best the same, and
# FlashAttention-2 50-73% of an A100's datasheet peak (Dao 2023, Fig. 5), up to 0.86 of the
# A100's measured rate; a copy kernel about 92% of HBM bandwidth. Unbounded, the fit trades every
# compute factor up against the bandwidth's, which the published step times alone cannot tell apart.
_UPPER = OpTimeModel(matmul_efficiency=1.0, matmul_half_flops=1e13, conv_efficiency=1.0, attention_efficiency=0.9,
                     bandwidth_efficiency=0.92)


def op_class(name: str) -> str:
    """The class of an aten op by its name (module docstring), or "free" for those that
    only reinterpret their input."""
    if name in _FREE:
        return "free"
    if name in _MATMUL:
        return "matmul"
    if name in _CONV:
        return "conv"
    if "scaled_dot_product" in name and "math" not in name:
        return "attention"
    return "memory"


def _peak_key(op, gpu: GPU, precision: str) -> str:
    if op.dtype == torch.float16:
        return "fp16"
    if op.dtype == torch.bfloat16:
        return "bf16"
    tf32 = precision == "tf32" or op.name in _CONV
    return "tf32" if tf32 and "tf32" in gpu.flops else "fp32"


def _arrays(ops, gpu: GPU, precision: str):
    """Per op: its class index, FLOPs, bytes, reachable FLOP/s on `gpu` and bytes moved by
    layout transposes (_transposed; ops that only reinterpret their input: no FLOPs, no bytes)."""
    classes = [op_class(op.name) for op in ops]
    free = np.array([c == "free" for c in classes], dtype=bool)
    kind = np.array([CLASSES.index("memory" if c == "free" else c) for c in classes], dtype=np.int64)
    flops = np.where(free, 0.0, np.array([float(op.flops) for op in ops], dtype=np.float64))
    nbytes = np.where(free, 0.0, np.array([float(op.bytes) for op in ops], dtype=np.float64))
    keys = [_peak_key(op, gpu, precision) for op in ops]
    peak = np.array([gpu.reachable_flops(key) if k < 3 and f else 1.0
                     for key, k, f in zip(keys, kind, flops)], dtype=np.float64)
    transposed = np.array([_transposed(op, c, key, gpu) for op, c, key in zip(ops, classes, keys)], dtype=np.float64)
    return kind, flops, nbytes, peak, transposed


def _transposed(op, cls: str, peak_key: str, gpu: GPU) -> float:
    """Bytes a convolution's layout transposes move. cuDNN's tensor-core kernels take NHWC, so
    on an NCHW model it transposes every operand in and every result out around the call,
    each read once and written once (2x the op's bytes); a model in torch.channels_last
    (OpRecord.channels_last) has none. The H200's VGG16 traces show it
    (benchmarks/results/nvidia-h200/trace/: 107 transpose kernels, 8.2 ms of the 47.6 ms
    ImageNet step, 2x the convolutions' bytes at 72% of HBM bandwidth). fp16 and bf16 run on
    tensor cores; TF32 only where they outrun the CUDA cores' float32 (not on a GeForce RTX
    3090 or 4090, whose TF32 tensor rate is their float32 rate)."""
    tensor_cores = peak_key in ("fp16", "bf16") or (peak_key == "tf32" and gpu.flops["tf32"] > gpu.flops["fp32"])
    return 2.0 * op.bytes if cls == "conv" and tensor_cores and not op.channels_last else 0.0


def _seconds(kind, flops, nbytes, peak, transposed, bandwidth, m: OpTimeModel, family: str) -> np.ndarray:
    """Vectorised over ops (_arrays), on a GPU of this bandwidth and family."""
    scale = m.scale(family)
    with np.errstate(invalid="ignore", divide="ignore"):
        sized = m.matmul_efficiency * flops / (flops + m.matmul_half_flops)
    efficiency = np.select([kind == 0, kind == 1, kind == 2],
                           [np.minimum(sized * scale, _UPPER.matmul_efficiency),
                            min(m.conv_efficiency * scale, _UPPER.conv_efficiency),
                            min(m.attention_efficiency * scale, _UPPER.attention_efficiency)], 1.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        compute = np.where((kind < 3) & (flops > 0), flops / (peak * efficiency), 0.0)
    memory = nbytes / (bandwidth * m.bandwidth_efficiency)
    moves = (flops > 0) | (nbytes > 0)
    transposes = transposed / (bandwidth * m.bandwidth_efficiency)  # (kernels of their own, before and after)
    return np.where(moves, np.maximum(np.maximum(compute, memory), LAUNCH_FLOOR_S) + transposes, 0.0)


def op_seconds(op, gpu: GPU, precision: str, model: OpTimeModel) -> float:
    """Predicted seconds of one traced op on its own (module docstring)."""
    return float(_seconds(*_arrays([op], gpu, precision), gpu.hbm_bytes_per_s, model, gpu.family)[0])


def op_times(ops, gpu: GPU, precision: str, model: OpTimeModel) -> np.ndarray:
    """Predicted seconds of each traced op, in order. In a compiled graph's replay
    (cswap.plan.compiled) each run of memory-bound ops between two others is one kernel,
    as inductor fuses them: it reads once what the run did not make and writes once what
    ops outside it read (or nothing reads), timed as one memory-bound op on the run's
    first op, the rest taking none."""
    times = _seconds(*_arrays(ops, gpu, precision), gpu.hbm_bytes_per_s, model, gpu.family)
    if not any(op.compiled for op in ops):
        return times
    readers: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        for key, _ in op.reads:
            readers.setdefault(key, []).append(i)

    def fusible(op, phase) -> bool:
        return op.compiled and op.phase == phase and op_class(op.name) in ("memory", "free")

    i = 0
    while i < len(ops):
        if not fusible(ops[i], ops[i].phase):
            i += 1
            continue
        j = i
        while j + 1 < len(ops) and fusible(ops[j + 1], ops[i].phase):
            j += 1
        made = {key for op in ops[i:j + 1] for key, _ in op.writes}
        reads = {key: n for op in ops[i:j + 1] for key, n in op.reads if key not in made}
        writes = {key: n for op in ops[i:j + 1] for key, n in op.writes
                  if not readers.get(key) or any(r < i or r > j for r in readers[key])}
        nbytes = sum(reads.values()) + sum(writes.values())
        times[i:j + 1] = 0.0
        if nbytes:
            times[i] = max(nbytes / (gpu.hbm_bytes_per_s * model.bandwidth_efficiency), LAUNCH_FLOOR_S)
        i = j + 1
    return times


def step_seconds(ops, gpu: GPU, precision: str, model: OpTimeModel) -> dict[str, float]:
    """Predicted seconds per phase ("forward", "backward", "optimizer") of a traced step."""
    out = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    for op, seconds in zip(ops, op_times(ops, gpu, precision, model)):
        out[op.phase] += float(seconds)
    return out


def trace_for(model, example_inputs, precision: str, optimizer: str = "sgd", loss=None, drop: bool = True,
              arch: int | None = None, optimizer_in_backward: bool = False, compile: bool = False,
              adapter_dtype: str = "float32"):
    """Trace one step of `model` at `precision` (PRECISIONS): fp32/tf32 as float32,
    amp as float16 autocast, bf16 and fp16 as the model cast to that type; attention
    as a GPU of compute capability `arch` runs it (cswap.plan.attention).
    adapter_dtype (ADAPTER_DTYPES), for a peft model cast to bf16 or fp16: "float32", its
    adapter weights kept in float32 as peft does (autocast_adapter_dtype), their gradients
    and optimizer states too, and the step run under autocast at the model's precision, as
    Hugging Face's Trainer (bf16=True) runs it: the adapters' multiplies in bf16; "model",
    the adapters cast with the model, as torchtune holds them.
    example_inputs: a tensor, a tuple, a dict of keyword arguments, or a batch shape (a
    float32 image batch)."""
    from . import fake_gpu

    if precision not in PRECISIONS:
        raise ValueError(f"cswap.plan.roofline: precision must be one of {', '.join(PRECISIONS)}, "
                         f"got {precision!r}")
    if adapter_dtype not in ADAPTER_DTYPES:
        raise ValueError(f"cswap.plan.roofline: adapter_dtype must be one of {', '.join(ADAPTER_DTYPES)}, "
                         f"got {adapter_dtype!r}")
    if isinstance(example_inputs, (tuple, list)) and all(isinstance(d, int) for d in example_inputs):
        example_inputs = torch.empty(tuple(example_inputs), device="meta")
    kwargs = {"amp": {"autocast": torch.float16}, "bf16": {"dtype": torch.bfloat16},
              "fp16": {"dtype": torch.float16}}.get(precision, {})
    if "dtype" in kwargs and adapter_dtype == "float32" and fake_gpu.adapter_parameters(model):
        kwargs.update(adapter_dtype=torch.float32, autocast=kwargs["dtype"])
    return fake_gpu.trace_step(model, example_inputs, loss=loss, optimizer=optimizer, drops=drop, sdpa_arch=arch,
                               optimizer_in_backward=optimizer_in_backward, compile=compile, **kwargs)


# -- fitting ----------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One published run's traced step, as arrays for fitting: per op its class index,
    FLOPs, bytes and peak FLOP/s on the run's GPU, and the run's measured step seconds
    (less what the model does not time by op, such as paged optimizer state's traffic).
    group names the kind of model ("cnn", "transformer"): fit weighs each group alike."""

    name: str
    kind: np.ndarray
    flops: np.ndarray
    bytes: np.ndarray
    peak: np.ndarray
    transposed: np.ndarray
    bandwidth: float
    family: str
    published_s: float
    group: str = ""

    @classmethod
    def of(cls, name: str, ops, gpu: GPU, precision: str, published_s: float, group: str = "") -> "Sample":
        if any(op.compiled for op in ops):
            raise ValueError("cswap.plan.roofline: a compiled step's ops fuse (op_times); fit on eager steps")
        return cls(name, *_arrays(ops, gpu, precision), gpu.hbm_bytes_per_s, gpu.family, published_s, group)

    def predicted_s(self, model: OpTimeModel) -> float:
        return float(_seconds(self.kind, self.flops, self.bytes, self.peak, self.transposed, self.bandwidth,
                              model, self.family).sum())


def fit(samples: list[Sample]) -> OpTimeModel:
    """The OpTimeModel whose predicted step times are nearest the samples' published ones,
    in the least squares of log(predicted / published) (scipy's bounded trust region;
    each run counts alike whatever its length, and each group of runs (Sample.group) alike
    however many runs it holds: ten CNN runs do not outvote three transformer ones):
    the five class factors within _UPPER, and a scale per GPU family the samples hold but
    ampere (the reference, 1.0)."""
    from scipy.optimize import least_squares

    groups = [s.group for s in samples]
    weight = np.sqrt([len(samples) / (len(set(groups)) * groups.count(g)) for g in groups])
    families = sorted({s.family for s in samples} - {"ampere"})
    unit = np.array([1.0, 1e9, 1.0, 1.0, 1.0] + [1.0] * len(families))  # (the half-size in GFLOPs: all near 1)
    low = np.array([0.05, 0.0, 0.05, 0.05, 0.05] + [0.2] * len(families)) / unit
    high = np.concatenate([_UPPER.factors(), [2.0] * len(families)]) / unit

    def model_of(x) -> OpTimeModel:
        x = x * unit
        return OpTimeModel(*x[:5], family_scale=tuple(zip(families, x[5:])))

    def residuals(x):
        m = model_of(x)
        return weight * np.array([np.log(s.predicted_s(m) / s.published_s) for s in samples])

    x0 = np.clip(np.concatenate([OpTimeModel().factors(), [1.0] * len(families)]) / unit, low, high)
    return model_of(least_squares(residuals, x0, bounds=(low, high)).x)


def time_model(gpu: GPU | None = None) -> tuple[OpTimeModel, str]:
    """(the committed OpTimeModel, where it came from, for `gpu`'s family when given)."""
    doc = _committed()
    model = OpTimeModel.from_dict(doc["model"])
    source = (f"op-class time model fitted on {len(doc['calibration'])} published runs "
              f"({doc['calibration_summary']}; cswap/data/time_model.json)")
    if gpu is not None:
        known = {"ampere": 1.0} | dict(model.family_scale)
        source += (f", {gpu.family} scale {model.scale(gpu.family):.2f}" if gpu.family in known else
                   f", no calibration run on {gpu.family}: the mean scale of {', '.join(sorted(known))}")
    return model, source


@functools.lru_cache(maxsize=1)
def _committed() -> dict:
    return json.loads(TIME_MODEL_FILE.read_text())

