"""cswap-plan against published training runs: peak memory and throughput, side by side.

    python benchmarks/plan_accuracy.py                 # every run (about 5 minutes on 2 cores)
    python benchmarks/plan_accuracy.py --runs bert-squad

Each run is a published single-GPU measurement (benchmarks/results/plan-accuracy/
published-draft.json, row `row`: its source at a commit and a verbatim quote) put as
cswap.predict's arguments, with the model built from its public config
(benchmarks/hf_configs/) on the meta device. Nothing is measured here: the
"predicted" columns are cswap-plan's, the "published" ones the source's.

A run whose setup cswap-plan cannot express yet (torch.compile) is predicted as eager
and marked so: its error says how far eager is from what was run, not how far the
model is. The roofline's efficiency is fitted on ResNet-50 (cswap.plan.roofline's
calibration set, PUBLISHED_RESNET50); every run here is outside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
CONFIGS = ROOT / "hf_configs"
RESULTS = ROOT / "results" / "plan-accuracy"
DRAFT = RESULTS / "published-draft.json"


@dataclass(frozen=True)
class Run:
    name: str
    row: int                    # the row of published-draft.json
    config: str                 # benchmarks/hf_configs/<config>
    gpu: str
    seq_len: int
    batch: int
    precision: str
    optimizer: str = "adamw"
    lora_rank: int | None = None
    lora_targets: tuple = ()
    checkpointing: bool = False
    chunked_loss: int | None = None
    in_backward: bool = False
    eager_for: str = ""         # what the run used that cswap-plan cannot express (predicted as eager)
    tokens_per_s: float | None = None   # published throughput, tokens/s
    peak_gib: float | None = None       # published peak memory, GiB
    note: str = ""


_LLAMA3B = dict(config="llama-3.2-3b.json", gpu="a100-sxm4-80gb", seq_len=4096, batch=2, precision="bf16")
RUNS = [
    Run("llama3.2-3b-full-packed", 6, **_LLAMA3B, tokens_per_s=7075, peak_gib=60.0,
        note="torchtune's flags table, '+ Packed': the eager baseline with packing"),
    Run("llama3.2-3b-compile", 7, **_LLAMA3B, eager_for="compile", tokens_per_s=8998, peak_gib=51.0),
    Run("llama3.2-3b-chunked", 8, **_LLAMA3B, chunked_loss=8, eager_for="compile", tokens_per_s=9174,
        peak_gib=42.9),
    Run("llama3.2-3b-ckpt", 9, **_LLAMA3B, chunked_loss=8, checkpointing=True, eager_for="compile",
        tokens_per_s=7210, peak_gib=24.9),
    Run("llama3.2-3b-in-bwd", 10, **_LLAMA3B, chunked_loss=8, checkpointing=True, in_backward=True,
        eager_for="compile", tokens_per_s=7309, peak_gib=23.1),
    Run("llama3.2-3b-8bit", 12, **_LLAMA3B, chunked_loss=8, checkpointing=True, in_backward=True,
        optimizer="adamw8bit", eager_for="compile, activation offloading", tokens_per_s=6960, peak_gib=17.6),
    Run("llama2-7b-lora-4090", 16, "llama-2-7b.json", "rtx-4090-24gb", 2048, 4, "bf16", lora_rank=8,
        lora_targets=("q_proj", "v_proj"), checkpointing=True, tokens_per_s=2582, peak_gib=21.3,
        note="batch 4 as the table says (its config's default is 2)"),
    Run("llama2-7b-full-4090", 17, "llama-2-7b.json", "rtx-4090-24gb", 2048, 4, "bf16", optimizer="paged_adamw",
        checkpointing=True, in_backward=True, tokens_per_s=702, peak_gib=24.1,
        note="batch 4 as the table says (its config's default is 2)"),
    Run("bert-large-pretrain-128-amp", 39, "bert-large-uncased.json", "a100-sxm4-80gb", 128, 256, "amp",
        optimizer="adam", tokens_per_s=580 * 128, note="LAMB in the source (Adam's two states here); MLM loss only"),
    Run("bert-large-pretrain-128-tf32", 40, "bert-large-uncased.json", "a100-sxm4-80gb", 128, 128, "tf32",
        optimizer="adam", tokens_per_s=317 * 128, note="LAMB in the source; MLM loss only"),
    Run("bert-large-pretrain-512-amp", 41, "bert-large-uncased.json", "a100-sxm4-80gb", 512, 32, "amp",
        optimizer="adam", tokens_per_s=210 * 512, note="LAMB in the source; MLM loss only"),
]


# The H200's VGG16 runs (benchmarks/results/nvidia-h200/: session-final.log's train.py table at
# CIFAR shape, runtime.csv at ImageNet shape), fp32, measured on commit c01d24c's runtime:
# step ms and peak MiB (max_memory_allocated) per mode. Both runs trained with plain SGD.
H200 = {
    "vgg16-cifar10-b2560": {"dataset": "cifar10", "batch": 2560, "step_ms": {"none": 41.3, "vdnn": 122.6, "sc": 117.3,
                                                                           "cswap": 117.1},
                            "peak_mib": {"none": 3933, "vdnn": 3672, "sc": 3414, "cswap": 3415},
                            "source": "benchmarks/results/nvidia-h200/session-final.log (train.py, 5 timed steps)"},
    "vgg16-imagenet-b64": {"dataset": "imagenet", "batch": 64, "step_ms": {"none": 47.64, "vdnn": 142.76, "sc": 146.71,
                                                                         "cswap": 139.76},
                           "peak_mib": {"none": 5714.7, "vdnn": 5286.6, "sc": 5082.6, "cswap": 5082.1},
                           "source": "benchmarks/results/nvidia-h200/runtime.csv"},
}
# ReLU/pooling sparsity of those runs, from their own compressed bytes: ZVC keeps (1 - s) of a
# tensor plus a 1/32 bitmap, and sc moved 1707 of 3015 MiB (CIFAR) and 2077 of 3683 (ImageNet).
H200_SPARSITY = 0.47


def predict_h200(name: str, run: dict) -> list[dict]:
    import torch

    import cswap
    from cswap.models import build
    from cswap.plan.sparsity import from_number

    model = build("vgg16", dataset=run["dataset"])
    shape = (3, 32, 32) if run["dataset"] == "cifar10" else (3, 224, 224)
    p = cswap.predict(model, torch.empty((run["batch"], *shape), device="meta"), "h200", precision="fp32", optimizer="sgd",
                      sparsity=from_number(H200_SPARSITY), recompute=False)
    momentum = sum(q.numel() * q.element_size() for q in model.parameters())  # (plain SGD holds none)
    rows = []
    for mode, measured_ms in run["step_ms"].items():
        peak = (p.peak_bytes(mode) - momentum) / 2**20
        step = p.step_seconds(mode) * 1e3
        rows.append({"run": name, "mode": mode, "predicted_step_ms": step, "measured_step_ms": measured_ms,
                     "step_error": step / measured_ms - 1, "predicted_peak_mib": peak,
                     "measured_peak_mib": run["peak_mib"][mode], "peak_error": peak / run["peak_mib"][mode] - 1,
                     "source": run["source"]})
    return rows


def predict_run(run: Run) -> dict:
    import cswap
    from cswap.plan.hf import from_config

    model, inputs = from_config(CONFIGS / run.config, batch=run.batch, seq_len=run.seq_len,
                                lora_rank=run.lora_rank, lora_targets=list(run.lora_targets) or "all-linear",
                                gradient_checkpointing=run.checkpointing, chunked_loss=run.chunked_loss)
    start = time.perf_counter()
    p = cswap.predict(model, inputs, run.gpu, precision=run.precision, optimizer=run.optimizer,
                      optimizer_in_backward=run.in_backward, recompute=False)
    row = {"run": run.name, "row": run.row, "gpu": run.gpu, "eager_for": run.eager_for,
           "predicted_peak_gib": p.peak_bytes("none") / 2**30, "published_peak_gib": run.peak_gib,
           "predicted_tokens_per_s": run.batch * run.seq_len / p.step_seconds("none"),
           "published_tokens_per_s": run.tokens_per_s, "paged_gib": p.paged_bytes / 2**30,
           "predict_s": time.perf_counter() - start, "note": run.note}
    for error, figure in (("peak_error", "peak_gib"), ("tokens_per_s_error", "tokens_per_s")):
        published = row[f"published_{figure}"]
        row[error] = row[f"predicted_{figure}"] / published - 1 if published else None
    return row


def _pct(x) -> str:
    return "" if x is None else f"{x:+.1%}"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", choices=[r.name for r in RUNS], default=[r.name for r in RUNS])
    parser.add_argument("--h200", nargs="*", choices=list(H200), default=list(H200),
                        help="the H200's VGG16 runs to set against (none: skip them)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    draft = json.loads(DRAFT.read_text())["rows"]
    rows = []
    print(f"{'run':<30} {'eager for':<12} {'peak GiB':>9} {'published':>9} {'error':>7} "
          f"{'tokens/s':>9} {'published':>9} {'error':>7}")
    for run in RUNS:
        if run.name not in args.runs:
            continue
        row = predict_run(run) | {"source": draft[run.row]["source"], "quote": draft[run.row]["quote"]}
        rows.append(row)
        print(f"{run.name:<30} {run.eager_for[:12]:<12} {row['predicted_peak_gib']:>9.1f} "
              f"{run.peak_gib if run.peak_gib else '':>9} {_pct(row['peak_error']):>7} "
              f"{row['predicted_tokens_per_s']:>9.0f} {run.tokens_per_s or '':>9} "
              f"{_pct(row['tokens_per_s_error']):>7}", flush=True)
    h200 = []
    if args.h200:
        print(f"\n{'H200 run':<22} {'mode':<6} {'step ms':>8} {'measured':>8} {'error':>7} {'peak MiB':>8} "
              f"{'measured':>8} {'error':>7}")
    for name in args.h200:
        for row in predict_h200(name, H200[name]):
            h200.append(row)
            print(f"{name:<22} {row['mode']:<6} {row['predicted_step_ms']:>8.1f} {row['measured_step_ms']:>8.1f} "
                  f"{_pct(row['step_error']):>7} {row['predicted_peak_mib']:>8.0f} {row['measured_peak_mib']:>8.0f} "
                  f"{_pct(row['peak_error']):>7}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"what": "cswap-plan's predictions (nothing measured here) against published single-GPU runs, and "
                   "against the H200's VGG16 runs measured by this project (on commit c01d24c's runtime)",
           "command": "python benchmarks/plan_accuracy.py", "rows": rows, "h200": h200}
    (args.out / "accuracy.json").write_text(json.dumps(doc, indent=1))
    print(f"# wrote {args.out / 'accuracy.json'}")
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
