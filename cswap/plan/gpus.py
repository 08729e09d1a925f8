"""Named GPUs: the datasheet figures cswap-plan predicts with, each with its source.

Conventions:

- FLOP/s are dense peaks. NVIDIA datasheets print tensor-core rates "with
  sparsity" (2:4 structured), twice the dense rate; every tensor figure here is
  the dense one. "fp32" is the CUDA-core (non-tensor) rate; "tf32", "fp16" and
  "bf16" are tensor-core rates with FP32 accumulate (what AMP's matmuls and
  convolutions use). GeForce cards run FP16 with FP32 accumulate at half their
  FP16-accumulate rate; the FP32-accumulate figure is stored. Volta has no
  TF32 or BF16 tensor cores, so its table has neither key.
- Bandwidths are bytes/s in decimal units, as datasheets give them
  (900 GB/s = 900e9).
- The host link's rate is the theoretical per-direction rate of an x16 PCIe
  link after 128b/130b encoding (lanes * GT/s * 128/130 / 8): 15.754e9 for
  3.0, 31.508e9 for 4.0, 63.015e9 for 5.0 (PCI-SIG base specifications).
  Measured copies land below it (packet and protocol overhead).
- memory_bytes is the capacity CUDA reports to a program
  (torch.cuda.get_device_properties(i).total_memory), not the marketed one:
  ECC and driver reservations make it 1-3% smaller (H100 "80GB" reports
  79.18 GiB). Where such a report was found it is stored: measured here in
  bytes, or from a published printout in MiB as torch prints it. Otherwise the
  marketed GB are read as GiB (GB * 2**30) and the entry says "nominal". The
  reported value moves by a few tens of MiB between drivers.

- matmul_flops holds what torch.matmul measurably reaches on the GPU, by
  dtype, where a public measurement of that exact model was found (MATMUL_DB:
  large square multiplies, the best size). It is what the time model's shares
  are of (GPU.reachable_flops): a datasheet peak is a rate at the rated boost
  clock, which data-centre parts, held by power, reach about 80% of in cuBLAS,
  and GeForce parts, whose clocks run above their rated boost, all of (RTX
  4090: 165 of 165 TFLOPS bf16; RTX 3090: 77 of 71).

PUBLISHED_RESNET50 holds per-GPU ResNet-50 v1.5 training throughputs from
NVIDIA's DeepLearningExamples and Lambda's benchmark, each with the file, row
and batch it was read from; the efficiency calibration fits against them.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

import numpy as np

__all__ = ["GPU", "GPUS", "MATMUL_DB", "PUBLISHED_RESNET50", "Throughput", "gpu", "gpus"]

_MIB = 2**20
_GIB = 2**30
_TFLOPS = 1e12


def _pcie_x16(gt_per_s: float) -> float:
    """Per-direction bytes/s of an x16 link at this transfer rate (128b/130b)."""
    return 16 * gt_per_s * 128 / 130 / 8


_PCIE3 = ("PCIe 3.0 x16", _pcie_x16(8e9))  # 15.754e9
_PCIE4 = ("PCIe 4.0 x16", _pcie_x16(16e9))  # 31.508e9
_PCIE5 = ("PCIe 5.0 x16", _pcie_x16(32e9))  # 63.015e9
_C2C = ("NVLink-C2C", 450e9)  # GH200's CPU-GPU link: 900 GB/s both ways together

_DTYPES = ("fp32", "tf32", "fp16", "bf16")
_DTYPE_ALIASES = {"amp": "fp16"}


@dataclass(frozen=True)
class GPU:
    """One GPU model's datasheet figures (see the module docstring for units)."""

    name: str  # lookup key: "h100-sxm-80gb"
    label: str  # "NVIDIA H100 SXM5 80GB"
    family: str  # "volta", "ampere", "ada", "hopper", "blackwell"
    arch: int  # compute capability: 90 for 9.0
    memory_bytes: int  # what CUDA reports, or nominal GiB (see docstring)
    hbm_bytes_per_s: float  # device-memory bandwidth, bytes/s
    flops: dict = field(hash=False)  # dense peak FLOP/s by dtype
    link: str  # host link: "PCIe 5.0 x16"
    link_bytes_per_s: float  # per direction, bytes/s
    sources: tuple[str, ...] = ()
    matmul_flops: dict = field(default_factory=dict, hash=False)  # measured torch.matmul FLOP/s by dtype
    measured_link: tuple[float, float] | None = None  # measured pinned copies (D2H, H2D), bytes/s

    def reachable_flops(self, dtype: str) -> float:
        """What a large torch.matmul reaches in `dtype` ("fp32", "tf32", "fp16", "bf16",
        "amp"): the measured rate (matmul_flops) where there is one; else the datasheet's
        peak times this GPU's measured share of it on the same units (the tensor cores run
        every tensor dtype at one clock); else times the median share of the GPUs measured."""
        key = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
        peak = self.peak_flops(key)
        if key in self.matmul_flops:
            return self.matmul_flops[key]
        units = _units(key)
        own = [self.matmul_flops[k] / self.flops[k] for k in self.matmul_flops if _units(k) == units]
        return peak * (float(np.mean(own)) if own else _MEDIAN_SHARE[units])

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for "fp32", "tf32", "fp16", "bf16" or "amp" (= fp16)."""
        key = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
        if key not in _DTYPES:
            raise ValueError(
                f"cswap.plan.gpus: unknown compute dtype {dtype!r}; "
                f"use one of {', '.join(_DTYPES + tuple(_DTYPE_ALIASES))}"
            )
        if key not in self.flops:
            if key == "bf16":
                why = "has no bf16 tensor cores (they arrived with Ampere); use 'fp16' or 'amp'"
            elif key == "tf32":
                why = "has no tf32 tensor cores (they arrived with Ampere); use 'fp32', or 'fp16'/'amp'"
            else:
                why = f"has no {key} figure in cswap's table"
            raise ValueError(f"cswap.plan.gpus: {self.label} ({self.name}) {why}")
        return self.flops[key]


@dataclass(frozen=True)
class Throughput:
    """A published training throughput: the efficiency calibration's ground truth."""

    gpu: str  # a GPU.name
    precision: str  # "fp32", "tf32", "amp" (mixed fp16) or "bf16"
    batch: int  # per-GPU batch
    images_per_s: float  # per GPU
    source: str  # where it was published, and what it measured
    channels_last: bool = False  # the run's memory format: NHWC (torch.channels_last), else NCHW


# Datasheets and whitepapers.
_V100_DS = ("NVIDIA Tesla V100 GPU Accelerator datasheet, "
            "https://images.nvidia.com/content/technologies/volta/pdf/tesla-volta-v100-datasheet-letter-fnl-web.pdf")
_V100_WP = ("NVIDIA Tesla V100 GPU Architecture whitepaper, "
            "https://images.nvidia.com/content/volta-architecture/pdf/volta-architecture-whitepaper.pdf")
_A100_DS = ("NVIDIA A100 Tensor Core GPU datasheet, "
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_A100_WP = ("NVIDIA Ampere GA100 architecture whitepaper, "
            "https://images.nvidia.com/aem-dam/en-zz/Solutions/data-center/nvidia-ampere-architecture-whitepaper.pdf")
_H100_DS = ("NVIDIA H100 Tensor Core GPU datasheet (H100 SXM / H100 PCIe columns, 'with sparsity' halved), "
            "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet")
_H200_DS = ("NVIDIA H200 Tensor Core GPU datasheet / product page (H200 SXM: 141GB HBM3e, 4.8TB/s, "
            "compute as H100 SXM), https://www.nvidia.com/en-us/data-center/h200/")
_L4_DS = ("NVIDIA L4 Tensor Core GPU datasheet ('with sparsity' halved), "
          "https://www.nvidia.com/en-us/data-center/l4/")
_L40S_DS = ("NVIDIA L40S datasheet ('with sparsity' halved), "
            "https://www.nvidia.com/en-us/data-center/l40s/")
_ADA_WP = ("NVIDIA Ada GPU Architecture whitepaper, Appendix A (GeForce RTX 4090), "
           "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf")
_A6000_DS = ("NVIDIA RTX A6000 datasheet (48GB GDDR6 ECC, 768 GB/s, FP32 38.7 TFLOPS, PCIe 4.0 x16), "
             "https://www.nvidia.com/en-us/design-visualization/rtx-a6000/; tensor rates from the GA102 "
             "whitepaper v2, Appendix A (RTX A6000 column, 'with sparsity' halved)")
_RTX6000_ADA_DS = ("NVIDIA RTX 6000 Ada Generation datasheet (48GB GDDR6 ECC, 960 GB/s, FP32 91.1 TFLOPS, "
                   "PCIe 4.0 x16), https://www.nvidia.com/en-us/design-visualization/rtx-6000/; tensor rates "
                   "from the Ada whitepaper, Appendix A (RTX 6000 Ada column, 'with sparsity' halved)")
_B200_DS = ("NVIDIA HGX B200 datasheet, per GPU at 1000 W (180GB HBM3e, 8 TB/s; dense TF32 1.1 PFLOPS, "
            "FP16/BF16 2.25 PFLOPS, FP32 80 TFLOPS), https://www.nvidia.com/en-us/data-center/hgx/, as "
            "tabulated at https://glennklockwood.com/garden/processors/B200; host link: the HGX B200 "
            "hosts' CPUs (DGX B200: Xeon Platinum 8570) link at PCIe 5.0, though the GPU supports 6.0")
_GH200_DS = ("NVIDIA GH200 Grace Hopper Superchip datasheet (96GB HBM3, 4 TB/s; compute as H100 SXM; "
             "NVLink-C2C 900 GB/s total, 450 GB/s per direction), "
             "https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/")
_GA102_WP = ("NVIDIA Ampere GA102 GPU Architecture whitepaper v2, Appendix A (GeForce RTX 3090), "
             "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf")
# Memory capacities as CUDA reports them.
_MEASURED = ("memory_bytes measured by cswap: cuDeviceTotalMem (= torch total_memory) on the GPU, "
             "driver 580.159.04; nvidia-smi: PCIe gen 5 x16")
_PRINTOUT = "memory_bytes from a published torch.cuda.get_device_properties printout: total_memory={}MB"
_NOMINAL = "memory_bytes nominal: {} GB read as GiB; no published CUDA report found"
_A100_40_MEM = ("memory_bytes from CUDA deviceQuery 'Total amount of global memory: 40441 MBytes "
                "(42405855232 bytes)', Paderborn PC2 'NVIDIA A100 40GB with NVLINK' page, "
                "https://upb-pc2.atlassian.net/wiki/spaces/PC2DOK/pages/1900609/NVIDIA+A100+40GB+with+NVLINK")


# Measured matmul rates: a public table of torch.matmul throughput by GPU, each row one
# contributor's run of the repository's test.py (square multiplies of 1024 to 10240, 6 warm-up and
# 30 timed runs, the best size's TFLOPS per dtype). Where a model has several rows (RTX 4090: six
# of the 24GB card), the median of each dtype's column; rows of other variants (48GB mods, 4090D,
# V100S, A100 PCIe) are not used for ours.
MATMUL_DB = ("zzc0721/torch-performance-test-data @9d82827637262c4351e3f9483f96b8cff57a601f, database.md "
             "(columns fp32 | tf32 | fp16 | bf16, TFLOPS), https://github.com/zzc0721/torch-performance-test-data")


def _measured(rows, *columns) -> tuple[dict, str]:
    """(dtype -> median measured FLOP/s, its source) from the MATMUL_DB rows named `rows` (a
    name or a tuple of the names the rows give), each row's (fp32, tf32, fp16, bf16) TFLOPS,
    None where the row has no figure."""
    rows = "', '".join((rows,) if isinstance(rows, str) else rows)
    table = {}
    for key, values in zip(_DTYPES, zip(*columns)):
        values = [v for v in values if v is not None]
        if values:
            table[key] = float(np.median(values)) * _TFLOPS
    return table, f"matmul_flops measured: {MATMUL_DB}, rows '{rows}' ({len(columns)} run(s))"


def _same_chip(name: str) -> tuple[dict, str]:
    """Another entry's measured matmul rates, for a part of the same chip, clocks and datasheet
    compute rates that differs in memory only (no row of its own in MATMUL_DB)."""
    table, source = _MATMUL_ROWS[name]
    return table, source.replace("matmul_flops measured:", f"matmul_flops as {name}'s (same chip and compute "
                                                           f"rates, memory differs):", 1)


def _gpu(name, label, family, arch, memory_bytes, hbm, flops, link, sources, measured=({}, None),
         measured_link=None) -> GPU:
    matmul, source = measured
    link_source = (measured_link[2],) if measured_link else ()
    return GPU(name, label, family, arch, int(memory_bytes), float(hbm),
               {k: v * _TFLOPS for k, v in flops.items()}, link[0], link[1],
               tuple(sources) + ((source,) if source else ()) + link_source, matmul,
               measured_link[:2] if measured_link else None)


def _units(key: str) -> str:
    return "cuda cores" if key == "fp32" else "tensor cores"


_V100_SXM2 = {"fp32": 15.7, "fp16": 125}
_A100 = {"fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312}
_H100_SXM = {"fp32": 67, "tf32": 494.5, "fp16": 989.5, "bf16": 989.5}

# The host link as this project measured it (pinned cudaMemcpyAsync; the median of the 256 MiB
# rows of benchmarks/results/nvidia-h200/codecs.csv, whose copies move 48-215 MiB; the profiled
# steps' large copies ran at 55.0-55.5 GB/s): 0.88 of PCIe 5.0 x16, where cswap-plan assumes
# LINK_EFFICIENCY elsewhere
_H200_LINK = (55.27e9, 55.42e9, "Host link measured by this project on an H200 (2026-12-04): pinned copies at "
              "55.27 GB/s D2H and 55.42 GB/s H2D, benchmarks/results/nvidia-h200/codecs.csv (256 MiB rows)")

_MATMUL_ROWS = {
    "v100-sxm2-16gb": _measured("NVIDIA Tesla V100-SXM2-16GB", (14.06, None, 94.84, None)),
    "a100-sxm4-80gb": _measured("NVIDIA A100 SXM4 80GB", (19.18, None, 258.74, 264.53)),
    "h100-pcie-80gb": _measured("NVIDIA H100 PCIe", (36.95, 240.43, 458.03, 495.93)),
    "h100-sxm-80gb": _measured("NVIDIA H100 80GB HBM3", (51.88, 402.15, 760.04, 797.51),
                               (52.11, None, 758.14, 783.66)),
    "h200-sxm-141gb": _measured("NVIDIA H200", (51.34, None, 759.40, 790.29)),
    "b200-180gb": _measured("NVIDIA B200 180GB", (66.24, None, 1627.64, 1696.03)),
    "l4-24gb": _measured("NVIDIA L4", (15.38, 31.88, 68.83, 70.89)),
    "l40s-48gb": _measured("NVIDIA L40S", (46.88, None, 264.02, 269.15)),
    "rtx-4090-24gb": _measured(("NVIDIA RTX 4090 24GB", "NVIDIA GeForce RTX 4090 24GB", "NVIDIA GeForce RTX 4090"),
        (55.01, None, 165.08, 170.06), (54.77, None, 171.06, 173.31), (46.48, None, 162.35, 162.39),
        (54.67, None, 167.80, 163.09), (51.57, None, 165.94, 165.71), (53.84, 85.65, 168.38, 164.81)),
    "rtx-a6000-48gb": _measured("NVIDIA RTX A6000", (23.92, None, 120.49, 123.34)),
    "rtx-3090-24gb": _measured(("NVIDIA RTX 3090 24GB", "NVIDIA GeForce RTX 3090 24GB", "NVIDIA GeForce RTX 3090"),
        (24.46, None, 75.64, 76.34), (24.84, None, 75.88, 76.68), (24.79, None, 75.48, 76.58)),
}

GPUS: dict[str, GPU] = {g.name: g for g in (
    _gpu("v100-sxm2-16gb", "NVIDIA Tesla V100 SXM2 16GB", "volta", 70, 16160 * _MIB, 900e9,
         _V100_SXM2, _PCIE3, (_V100_DS, _V100_WP,
                             _PRINTOUT.format(16160) + " (name='Tesla V100-SXM2-16GB'; several public logs)"),
         _MATMUL_ROWS["v100-sxm2-16gb"]),
    _gpu("v100-sxm2-32gb", "NVIDIA Tesla V100 SXM2 32GB", "volta", 70, 32 * _GIB, 900e9,
         _V100_SXM2, _PCIE3, (_V100_DS, _NOMINAL.format(32)), _same_chip("v100-sxm2-16gb")),
    _gpu("v100-pcie-16gb", "NVIDIA Tesla V100 PCIe 16GB", "volta", 70, 16160 * _MIB, 900e9,
         {"fp32": 14, "fp16": 112}, _PCIE3,
         (_V100_DS, _PRINTOUT.format(16160) + " (name='Tesla V100-PCIE-16GB')")),
    _gpu("a100-sxm4-40gb", "NVIDIA A100 SXM4 40GB", "ampere", 80, 42405855232, 1555e9,
         _A100, _PCIE4, (_A100_DS, _A100_WP, _A100_40_MEM), _same_chip("a100-sxm4-80gb")),
    _gpu("a100-sxm4-80gb", "NVIDIA A100 SXM4 80GB", "ampere", 80, 80 * _GIB, 2039e9,
         _A100, _PCIE4, (_A100_DS, _A100_WP, _NOMINAL.format(80)),
         _MATMUL_ROWS["a100-sxm4-80gb"]),
    _gpu("h100-pcie-80gb", "NVIDIA H100 PCIe 80GB", "hopper", 90, 81008 * _MIB, 2.0e12,
         {"fp32": 51, "tf32": 378, "fp16": 756.5, "bf16": 756.5}, _PCIE5,
         (_H100_DS, _PRINTOUT.format(81008) + " (name='NVIDIA H100 PCIe')"),
         _MATMUL_ROWS["h100-pcie-80gb"]),
    _gpu("h100-sxm-80gb", "NVIDIA H100 SXM5 80GB", "hopper", 90, 85017493504, 3.35e12,
         _H100_SXM, _PCIE5, (_H100_DS, _MEASURED + " (name 'NVIDIA H100 80GB HBM3')"),
         _MATMUL_ROWS["h100-sxm-80gb"]),
    _gpu("h200-sxm-141gb", "NVIDIA H200 SXM 141GB", "hopper", 90, 150109880320, 4.8e12,
         _H100_SXM, _PCIE5, (_H200_DS, _H100_DS, _MEASURED + " (name 'NVIDIA H200')"),
         _MATMUL_ROWS["h200-sxm-141gb"], _H200_LINK),
    _gpu("gh200-96gb", "NVIDIA GH200 96GB", "hopper", 90, 96 * _GIB, 4.0e12,
         _H100_SXM, _C2C, (_GH200_DS, _H100_DS, _NOMINAL.format(96)), _same_chip("h100-sxm-80gb")),
    _gpu("b200-180gb", "NVIDIA B200 180GB", "blackwell", 100, 180 * _GIB, 8.0e12,
         {"fp32": 80, "tf32": 1100, "fp16": 2250, "bf16": 2250}, _PCIE5, (_B200_DS, _NOMINAL.format(180)),
         _MATMUL_ROWS["b200-180gb"]),
    _gpu("l4-24gb", "NVIDIA L4 24GB", "ada", 89, 24 * _GIB, 300e9,
         {"fp32": 30.3, "tf32": 60, "fp16": 121, "bf16": 121}, _PCIE4, (_L4_DS, _NOMINAL.format(24)),
         _MATMUL_ROWS["l4-24gb"]),
    _gpu("l40s-48gb", "NVIDIA L40S 48GB", "ada", 89, 45589 * _MIB, 864e9,
         {"fp32": 91.6, "tf32": 183, "fp16": 362.05, "bf16": 362.05}, _PCIE4,
         (_L40S_DS, _PRINTOUT.format(45589) + " (name='NVIDIA L40S')"),
         _MATMUL_ROWS["l40s-48gb"]),
    _gpu("rtx-4090-24gb", "NVIDIA GeForce RTX 4090 24GB", "ada", 89, 24563 * _MIB, 1008e9,
         {"fp32": 82.6, "tf32": 82.6, "fp16": 165.2, "bf16": 165.2}, _PCIE4,
         (_ADA_WP, _PRINTOUT.format(24563) + " (name='NVIDIA GeForce RTX 4090')"),
         _MATMUL_ROWS["rtx-4090-24gb"]),
    _gpu("rtx-6000-ada-48gb", "NVIDIA RTX 6000 Ada Generation 48GB", "ada", 89, 48 * _GIB, 960e9,
         {"fp32": 91.1, "tf32": 182.1, "fp16": 364.25, "bf16": 364.25}, _PCIE4,
         (_RTX6000_ADA_DS, _ADA_WP, _NOMINAL.format(48))),
    _gpu("rtx-a6000-48gb", "NVIDIA RTX A6000 48GB", "ampere", 86, 48 * _GIB, 768e9,
         {"fp32": 38.7, "tf32": 77.4, "fp16": 154.8, "bf16": 154.8}, _PCIE4,
         (_A6000_DS, _GA102_WP, _NOMINAL.format(48)),
         _MATMUL_ROWS["rtx-a6000-48gb"]),
    _gpu("rtx-3090-24gb", "NVIDIA GeForce RTX 3090 24GB", "ampere", 86, 24268 * _MIB, 936e9,
         {"fp32": 35.6, "tf32": 35.6, "fp16": 71, "bf16": 71}, _PCIE4,
         (_GA102_WP, _PRINTOUT.format(24268) + " (name='GeForce RTX 3090'), Hugging Face transformers "
                                               "docs, debugging.md"),
         _MATMUL_ROWS["rtx-3090-24gb"]),
)}

# The median share of the datasheet's peak that the measured GPUs reach, by units: what a GPU
# without a measurement of its own is assumed to reach.
_MEDIAN_SHARE = {units: float(np.median([GPUS[n].matmul_flops[k] / GPUS[n].flops[k] for n in _MATMUL_ROWS
                                         for k in GPUS[n].matmul_flops if _units(k) == units]))
                 for units in ("cuda cores", "tensor cores")}

# Short names and the names CUDA gives the devices (after normalisation) -> table names.
_ALIASES = {
    "v100": "v100-sxm2-16gb", "v100-sxm2": "v100-sxm2-16gb", "v100-16gb": "v100-sxm2-16gb",
    "v100-32gb": "v100-sxm2-32gb", "v100-pcie": "v100-pcie-16gb",
    "a100": "a100-sxm4-80gb", "a100-80gb": "a100-sxm4-80gb", "a100-40gb": "a100-sxm4-40gb",
    "a100-sxm4": "a100-sxm4-80gb",
    "h100": "h100-sxm-80gb", "h100-sxm": "h100-sxm-80gb", "h100-sxm5": "h100-sxm-80gb",
    "h100-sxm5-80gb": "h100-sxm-80gb", "h100-80gb-hbm3": "h100-sxm-80gb", "h100-pcie": "h100-pcie-80gb",
    "h200": "h200-sxm-141gb", "h200-sxm": "h200-sxm-141gb",
    "l4": "l4-24gb", "l40s": "l40s-48gb",
    "gh200": "gh200-96gb", "gh200-480gb": "gh200-96gb", "b200": "b200-180gb",
    "a6000": "rtx-a6000-48gb", "rtx-a6000": "rtx-a6000-48gb",
    "rtx-6000-ada": "rtx-6000-ada-48gb", "rtx-6000-ada-generation": "rtx-6000-ada-48gb",
    "rtx-6000-ada-generation-48gb": "rtx-6000-ada-48gb",
    "6000-ada": "rtx-6000-ada-48gb",
    "4090": "rtx-4090-24gb", "rtx-4090": "rtx-4090-24gb", "rtx4090": "rtx-4090-24gb",
    "3090": "rtx-3090-24gb", "rtx-3090": "rtx-3090-24gb", "rtx3090": "rtx-3090-24gb",
}
_VENDOR = re.compile(r"^(nvidia-)?(tesla-|geforce-)?")


def gpus() -> list[str]:
    """The table's GPU names, sorted."""
    return sorted(GPUS)


def gpu(name) -> GPU:
    """The GPU named `name`: a table name, an alias ("h100", "a100", "4090", ...) or the
    name CUDA reports ("NVIDIA H100 80GB HBM3"); case, spaces and underscores don't matter.
    A GPU is returned as it is."""
    if isinstance(name, GPU):
        return name
    if not isinstance(name, str):
        raise TypeError(f"cswap.plan.gpus: a GPU name must be a str, not {type(name).__name__}")
    key = re.sub(r"[\s_]+", "-", name.strip().lower())
    key = _VENDOR.sub("", key)
    key = _ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]
    candidates = {n: n for n in GPUS} | _ALIASES
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    hint = f"; did you mean {candidates[close[0]]!r}?" if close else ""
    raise ValueError(f"cswap.plan.gpus: unknown GPU {name!r}; known: {', '.join(gpus())}{hint}")


# ResNet-50 v1.5 training throughput, one GPU. NVIDIA's runs (DLE) use NHWC for AMP and
# the batch of ConvNets/configs.yml; Lambda's run the same code on synthetic data, NCHW,
# with larger batches, so one GPU's figures differ between the two (A100 AMP: 2470 vs 1582).
_DLE = ("NVIDIA DeepLearningExamples PyTorch ResNet50 v1.5, 1 GPU, {system}: "
        "PyTorch/Classification/ConvNets/resnet50v1.5/README.md @291f0d02, table 'Training performance: "
        "{table}', row GPUs=1, column 'Throughput - {column}' (pytorch-21.03 NGC container); batch from "
        "ConvNets/configs.yml resnet50.{platform}.{precision}.batch_size @097c7ff9; "
        "https://github.com/NVIDIA/DeepLearningExamples/tree/master/PyTorch/Classification/ConvNets/resnet50v1.5")
_LAMBDA = ("Lambda deeplearning-benchmark, 1 GPU ({row}): github.com/lambdal/deeplearning-benchmark @aa5addb6, "
           "pytorch/pytorch-train-throughput-{file}.csv row '{row}' column resnet50, batch from "
           "pytorch/pytorch-train-bs-{file}.csv; log {log}: train.compute_ips {ips} images/s. "
           "NVIDIA DLE ConvNets main.py, synthetic data, NCHW{note}")
_TF32_NOTE = ("; Lambda labels it FP32, but PyTorch runs cuDNN convolutions in TF32 on Ampere and later "
              "by default (torch.backends.cudnn.allow_tf32 = True)")


def _dle(gpu_name, precision, batch, ips, dgx, column):
    system, table, platform = dgx
    cfg = {"fp32": "FP32", "tf32": "TF32", "amp": "AMP"}[precision]
    source = _DLE.format(system=system, table=table, column=column, platform=platform, precision=cfg)
    if precision == "amp":  # (its FP32 and TF32 configs name no memory format: NCHW, main.py's default)
        source += f"; NHWC from ConvNets/configs.yml resnet50.{platform}.AMP.memory_format: nhwc @097c7ff9"
    return Throughput(gpu_name, precision, batch, float(ips), source, channels_last=precision == "amp")


def _lambda(gpu_name, precision, batch, ips, row, run, stamp, log_ips):
    file, kind = ("fp16", "AMP") if precision == "amp" else ("fp32", "FP32")
    log = f"pytorch/results/{run}/PyTorch_resnet50_{kind}/{stamp}.txt"
    note = ", --amp" if precision == "amp" else _TF32_NOTE
    return Throughput(gpu_name, precision, batch, float(ips),
                      _LAMBDA.format(row=row, file=file, log=log, ips=log_ips, note=note))


# (system, README table, configs.yml platform)
_DGXA100 = ("DGX A100", "NVIDIA DGX A100 (8x A100 80GB)", "DGXA100")
_DGX1_16 = ("DGX-1 16GB", "NVIDIA DGX-1 16GB (8x V100 16GB)", "DGX1V")
_DGX1_32 = ("DGX-1 32GB", "NVIDIA DGX-1 32GB (8x V100 32GB)", "DGX1V")

PUBLISHED_RESNET50: tuple[Throughput, ...] = (
    _dle("v100-sxm2-16gb", "fp32", 112, 367, _DGX1_16, "FP32"),
    _dle("v100-sxm2-16gb", "amp", 256, 1200, _DGX1_16, "mixed precision"),
    _dle("v100-sxm2-32gb", "fp32", 112, 356, _DGX1_32, "FP32"),
    _dle("v100-sxm2-32gb", "amp", 256, 1156, _DGX1_32, "mixed precision"),
    _dle("a100-sxm4-80gb", "tf32", 256, 938, _DGXA100, "TF32"),
    _dle("a100-sxm4-80gb", "amp", 256, 2470, _DGXA100, "mixed precision"),
    _lambda("a100-sxm4-80gb", "tf32", 640, 1066, "A100 80GB SXM4", "A100_80GB_SXM4_v1",
            "19-11-2022_19-10-36", 1066.99),
    _lambda("a100-sxm4-80gb", "amp", 1280, 1582, "A100 80GB SXM4", "A100_80GB_SXM4_v1",
            "19-11-2022_18-30-46", 1582.44),
    _lambda("rtx-3090-24gb", "tf32", 224, 513, "RTX 3090", "3090_v1", "24-10-2022_23-28-58", 513.16),
    _lambda("rtx-3090-24gb", "amp", 448, 905, "RTX 3090", "3090_v1", "24-10-2022_22-56-58", 905.44),
    _lambda("rtx-4090-24gb", "tf32", 224, 721, "RTX 4090", "4090_v1", "16-10-2022_00-11-17", 721.24),
    _lambda("rtx-4090-24gb", "amp", 448, 1301, "RTX 4090", "4090_v1", "15-10-2022_23-46-13", 1301.69),
    _lambda("h100-pcie-80gb", "tf32", 640, 1197, "H100 80GB PCIe Gen5", "H100_80GB_PCIe5_v1",
            "30-11-2022_05-06-56", 1197.47),
    _lambda("h100-pcie-80gb", "amp", 1280, 1866, "H100 80GB PCIe Gen5", "H100_80GB_PCIe5_v1",
            "30-11-2022_04-25-14", 1866.74),
    _lambda("h100-sxm-80gb", "tf32", 640, 1753, "H100 80GB SXM5", "H100_80GB_SXM5_v1",
            "14-02-2023_05-40-27", 1753.83),
    _lambda("h100-sxm-80gb", "amp", 1280, 2616, "H100 80GB SXM5", "H100_80GB_SXM5_v1",
            "14-02-2023_05-07-45", 2616.25),
)
