"""End-to-end training benchmark (issue 6): every model x input shape x mode, as in the paper's Figs 6 and 7.

For each model of cswap.models.names(), each input shape (CIFAR10: 3x32x32 and
10 classes; ImageNet: 3x224x224 and 1000 classes) and each mode of
`cswap.patch(model, mode=...)`:

    none          hooks only, nothing offloaded (the reference for the loss and the exposed swap time)
    vdnn          offload every ReLU/pool activation uncompressed (the paper's vDNN; the Fig. 6 baseline)
    vdnnpp        offload uncompressed, compress on the host with CPU threads (the paper's vDNN++)
    sc            ZVC-compress every candidate on the GPU first (static compression, the paper's cDMA stand-in)
    cswap         the advisor decides per tensor from the device profile (paper eq. 1-4)
    save_on_cpu   PyTorch's torch.autograd.graph.save_on_cpu(pin_memory=True) (every saved tensor; a baseline)

it trains with SGD on synthetic data (torch.randn / randint from a seeded
generator; every mode sees the same weights and batch) and reports per row:

    step_ms               median step time over the timed iterations (after --warmup iterations, >= 2:
                          cswap profiles its first iteration uncompressed and decides from the second)
    samples_per_s         batch / step time: training throughput
    norm_vs_vdnn          throughput / vdnn's throughput for the same model and shape (paper Fig. 6)
    vs_sc                 throughput / sc's throughput (paper Fig. 7 plots cswap's (vs_sc - 1) in per cent)
    exposed_swap_ms       swap latency not hidden by compute, per iteration, ESTIMATED as
                          max(step_ms(mode) - step_ms(none), 0) with "none" from the same run (same
                          model, shape, batch and memory budget); None when "none" did not run. It charges
                          to the swap everything a mode adds to a step: copies not overlapped by compute,
                          (de)compression kernels, hook and worker-thread overhead.
    peak_gpu_mib          torch.cuda.max_memory_allocated over the timed iterations (CUDA only)
    moved_mib_per_iter    cswap.stats(model)["transferred_bytes"] / timed iterations: bytes over PCIe to
                          the host (after compression). None for save_on_cpu, which cswap does not count.
    compressed_layers     tensors with a codec in cswap.epoch_end(model)'s report (vdnn, vdnnpp, sc, cswap)
    loss_matches          the first step's loss equals "none"'s bit for bit (expected on CPU; cuDNN's
                          algorithm choice may differ between runs on a GPU); when "none" failed, the
                          first mode that ran is the reference (loss_reference names it)
    error                 "out of memory" (torch.cuda.OutOfMemoryError under --budget-gib), or the
                          exception a mode raised (the row is kept, the run goes on)

plus one computed row per model and shape, mode "orac (computed)" with
"computed": true: the paper's Orac (a GPU so fast that compression and
decompression take no time), estimated as

    orac step = cswap step - sum over cswap's compressed tensors of the profile's predicted
                Time_c + Time_dc (profile.seconds(codec, "compress" | "decompress", bytes, sparsity))

i.e. T_best - (the exposed-transfer part of T_best) per tensor, summed, taken off
as if all of it had been on the critical path (an optimistic bound), and never
below "none"'s step time (no swapping scheme beats not swapping; nor above cswap's, should noise put
"none" there; clipped_to_none says when the floor applied). On a CPU the
profile predicts GPU kernels, so the row only shows that the arithmetic runs.

Batch sizes follow the paper's Table III (X/Y = CIFAR10/ImageNet) for the GPU
named by --paper-gpu (V100 by default); --batch-scale scales them, --batch
overrides them. Models not in the table: see BATCH_NOTES. --budget-gib X caps
this process's GPU memory at X GiB (torch.cuda.set_per_process_memory_fraction),
e.g. 32 for the paper's V100 or 11 for its 2080Ti, so that "none" runs out of
memory where the paper needed swapping.

    python benchmarks/train.py --budget-gib 32                  # GPU: all models, both shapes, all modes
    python benchmarks/train.py --models vgg16 alexnet --datasets imagenet --batch-scale 0.5
    python benchmarks/train.py --quick                          # CPU-friendly: 2 small models, CIFAR, batch 4
    python benchmarks/train.py --from-json results/<device>/train.json              # table + charts again
    python benchmarks/train.py --readme --from-json results/<device>/train.json     # Markdown for the README

Results: a printed table; CSV + JSON (stem "train", or "train-quick") under
benchmarks/results/<device>/ (or --out); beside them, with matplotlib,
<stem>-throughput.png (Fig. 6 style: throughput normalised to vdnn, per model,
one bar per mode), <stem>-vs-sc.png (Fig. 7: cswap's throughput gain over sc,
per model) and <stem>-memory.png (peak GPU memory per model and mode on CUDA;
bytes moved per iteration elsewhere). On a CPU nothing is saved (host memory is
the device memory): the numbers only show that the pipeline runs.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import cswap
from cswap.models import build, names

from common import SETTLE_STEPS, environment, format_row, synchronize, write_results

MODES = ("none", "vdnn", "vdnnpp", "sc", "cswap", "save_on_cpu")
ORAC = "orac (computed)"
DATASETS = ("cifar10", "imagenet")
SHAPES = {"cifar10": (32, 10), "imagenet": (224, 1000)}  # input side, classes

# Paper Table III: (CIFAR10, ImageNet) batch per model family and GPU. None: the paper could not
# run it (Plain20 on ImageNet does not fit the 2080Ti's 11 GB even at batch 1).
PAPER_BATCH = {
    "v100": {"alexnet": (2560, 512), "vgg16": (2560, 128), "mobilenet": (2560, 128), "plain20": (2560, 32),
             "resnet": (2560, 64), "squeezenet": (2560, 512)},
    "2080ti": {"alexnet": (2560, 256), "vgg16": (2560, 32), "mobilenet": (1280, 32), "plain20": (1024, None),
               "resnet": (1280, 16), "squeezenet": (1280, 128)},
}
FAMILY = {"resnet18": "resnet", "resnet50": "resnet", "squeezenet1_0": "squeezenet",
          "squeezenet1_1": "squeezenet"}
# Our choices where the table says nothing.
FALLBACK_BATCH = {"v100": (2560, 128), "2080ti": (1280, 32)}
BATCH_NOTES = (
    "Table III says only 'ResNet' and 'SqueezeNet': its sizes are used for resnet18 and resnet50, and for "
    "squeezenet1_0 and squeezenet1_1. Models not in the table (small_cnn, any added later) get "
    f"FALLBACK_BATCH, VGG16's/MobileNet's sizes: {FALLBACK_BATCH}."
)
PATCH_STATS = ("none", "vdnn", "vdnnpp", "sc", "cswap")  # modes whose traffic cswap.stats counts
REPORTED = ("vdnn", "vdnnpp", "sc", "cswap")             # modes whose epoch report has decisions
QUIET = ("cswap: offloading CPU tensors", "cswap: no profile for this device")


def paper_batch(model: str, dataset: str, gpu: str) -> tuple[int | None, str]:
    """(batch, where it came from) for `model` on `dataset` per Table III on `gpu`."""
    table = PAPER_BATCH[gpu]
    family = FAMILY.get(model, model)
    pair, source = (table[family], f"Table III ({gpu})") if family in table else \
        (FALLBACK_BATCH[gpu], f"fallback ({gpu})")
    return pair[DATASETS.index(dataset)], source


def batch_for(model: str, dataset: str, args) -> tuple[int | None, str]:
    if args.batch:
        return args.batch, "--batch"
    batch, source = paper_batch(model, dataset, args.paper_gpu)
    if batch is None:
        return None, source
    if args.batch_scale != 1:
        batch, source = max(1, round(batch * args.batch_scale)), f"{source} x {args.batch_scale:g}"
    return batch, source


# -- one mode ---------------------------------------------------------------------------------------------


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def run_mode(mode: str, base: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, row: dict, args,
             device: torch.device, profile) -> dict:
    """Train a copy of `base` in `mode` for warmup + iters steps; the measurements go into `row`."""
    row = dict(row, mode=mode, computed=False)
    model = optimizer = report = None
    caught = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = copy.deepcopy(base).to(device)
            cswap.patch(model, mode=mode, verbose=False, profile=args.profile)
            optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
            xd, yd = x.to(device), y.to(device)
            torch.manual_seed(2)  # the same dropout masks in every mode (AlexNet, VGG16, SqueezeNet have dropout)
            times, first_loss = [], None
            for i in range(args.warmup + args.iters):
                if i == args.warmup:
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    cswap.stats(model).reset()
                synchronize(device)
                t0 = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(xd), yd)
                loss.backward()
                optimizer.step()
                synchronize(device)
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
                if first_loss is None:
                    first_loss = float(loss.detach().cpu())
                del loss
            step = statistics.median(times)
            row.update(step_ms=1e3 * step, samples_per_s=row["batch"] / step, first_loss=first_loss)
            if device.type == "cuda":
                row["peak_gpu_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
            s = cswap.stats(model)
            if mode in PATCH_STATS:
                row.update(moved_mib_per_iter=s["transferred_bytes"] / args.iters / 2**20,
                           offloaded_mib_per_iter=s["offloaded_bytes"] / args.iters / 2**20,
                           prefetch_stall_ms_per_iter=1e3 * s["prefetch_stall_s"] / args.iters)
            if mode == "vdnnpp":
                row["host_compressed_per_iter"] = s["host_compressed_tensors"] / args.iters
            if mode in REPORTED:
                report = cswap.epoch_end(model)
                row["compressed_layers"] = report.totals["compressed_layers"]
                row["candidate_tensors"] = len(report.rows)
                if mode == "cswap":
                    row["predicted_codec_ms"] = 1e3 * _codec_seconds(report, profile)
    except Exception as exc:  # a mode that fails is a row, not a crash
        row["error"] = "out of memory" if _is_oom(exc) else f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    finally:
        if model is not None:
            cswap.unpatch(model)
        del model, optimizer, report
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    seen = []
    for w in caught:
        text = str(w.message)
        if not text.startswith(QUIET) and text not in seen:
            seen.append(text)
    if seen:
        row["warnings"] = " | ".join(seen[:3])[:400]
    return row


def _codec_seconds(report, profile) -> float:
    """Predicted Time_c + Time_dc per iteration over the report's compressed tensors."""
    if profile is None:
        return math.nan
    total = 0.0
    for r in report.rows:
        if r.decision is not None:
            for direction in ("compress", "decompress"):
                total += max(float(profile.seconds(r.decision, direction, r.nbytes, r.sparsity)), 0.0)
    return total


def finish_group(group: list[dict]) -> list[dict]:
    """Ratios against vdnn / sc / none within one model x shape, and the computed orac row."""
    ok = {r["mode"]: r for r in group if "error" not in r and "step_ms" in r}
    ref = ok.get("none") or next(iter(ok.values()), None)  # first-loss reference: none, else the first that ran
    for r in group:
        if not any(r is v for v in ok.values()):
            continue
        if "vdnn" in ok:
            r["norm_vs_vdnn"] = r["samples_per_s"] / ok["vdnn"]["samples_per_s"]
        if "sc" in ok:
            r["vs_sc"] = r["samples_per_s"] / ok["sc"]["samples_per_s"]
        if "none" in ok:
            r["exposed_swap_ms"] = max(r["step_ms"] - ok["none"]["step_ms"], 0.0)
        if ref is not None:
            r["loss_matches"] = r["first_loss"] == ref["first_loss"]
            r["loss_reference"] = ref["mode"]
    cs = ok.get("cswap")
    if cs is not None and math.isfinite(cs.get("predicted_codec_ms", math.nan)):
        # no swapping scheme beats not swapping; and orac is never slower than cswap (noise can put none above it)
        floor = min(ok["none"]["step_ms"], cs["step_ms"]) if "none" in ok else 0.0
        step = cs["step_ms"] - cs["predicted_codec_ms"]
        orac = {k: cs[k] for k in ("model", "dataset", "batch", "batch_source", "budget_gib") if k in cs}
        orac.update(mode=ORAC, computed=True, based_on="cswap", predicted_codec_ms=cs["predicted_codec_ms"],
                    compressed_layers=cs.get("compressed_layers"), clipped_to_none=step < floor)
        step = max(step, floor)
        if step > 0:
            orac.update(step_ms=step, samples_per_s=orac["batch"] / (step / 1e3))
            if "vdnn" in ok:
                orac["norm_vs_vdnn"] = orac["samples_per_s"] / ok["vdnn"]["samples_per_s"]
            if "sc" in ok:
                orac["vs_sc"] = orac["samples_per_s"] / ok["sc"]["samples_per_s"]
            if "none" in ok:
                orac["exposed_swap_ms"] = max(step - ok["none"]["step_ms"], 0.0)
        group.append(orac)
    return group


# -- output -----------------------------------------------------------------------------------------------

COLUMNS = [
    ("model", "model", "{}"), ("dataset", "data", "{}"), ("mode", "mode", "{}"), ("batch", "batch", "{}"),
    ("step_ms", "step ms", "{:.1f}"), ("samples_per_s", "samples/s", "{:.1f}"),
    ("norm_vs_vdnn", "x vdnn", "{:.2f}"), ("vs_sc", "x sc", "{:.2f}"),
    ("exposed_swap_ms", "exposed ms", "{:.1f}"), ("peak_gpu_mib", "peak MiB", "{:.0f}"),
    ("moved_mib_per_iter", "moved MiB", "{:.1f}"), ("compressed_layers", "compr.", "{}"),
    ("loss_matches", "loss ==", "{}"),
]
WIDTHS = [13, 8, 15, 6, 9, 10, 7, 6, 10, 9, 10, 7, 7]


def print_row(row: dict | None = None) -> None:
    line = format_row(COLUMNS, WIDTHS, row)
    if row is None:
        line += "  notes"
    elif row.get("error"):
        line += f"  {row['error']}"
    elif row.get("computed"):
        line += "  computed: cswap - predicted (de)compression"
        line += ", clipped to none" if row.get("clipped_to_none") else ""
    print(line, flush=True)


def _grid(rows: list[dict], key: str):
    """{dataset: (models, modes, {(model, mode): value})} over the rows that have `key`."""
    out = {}
    for r in rows:
        if r.get(key) is None:
            continue
        models, modes, vals = out.setdefault(r["dataset"], ([], [], {}))
        if r["model"] not in models:
            models.append(r["model"])
        if r["mode"] not in modes:
            modes.append(r["mode"])
        vals[(r["model"], r["mode"])] = r[key]
    return out


def plot(rows: list[dict], out: Path, stem: str) -> list[Path]:
    """The Fig. 6 / Fig. 7 / memory bar charts beside the CSV; [] with a note when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib is not installed: no charts (pip install matplotlib)")
        return []
    mem_key = "peak_gpu_mib" if any(r.get("peak_gpu_mib") is not None for r in rows) else "moved_mib_per_iter"
    vs_sc = [dict(r, gain_pct=100 * (r["vs_sc"] - 1)) for r in rows if r.get("mode") == "cswap" and
             r.get("vs_sc") is not None]
    charts = [
        ("throughput", rows, "norm_vs_vdnn", "throughput normalised to vdnn", 1.0),
        ("vs-sc", vs_sc, "gain_pct", "cswap throughput over sc (%)", 0.0),
        ("memory", rows, mem_key, "peak GPU memory (MiB)" if mem_key == "peak_gpu_mib"
         else "moved to host per iteration (MiB)", None),
    ]
    written = []
    for name, data, key, label, ref in charts:
        grid = _grid(data, key)
        if not grid:
            continue
        fig, axes = plt.subplots(1, len(grid), figsize=(max(6.0, 1.3 * max(len(g[0]) for g in grid.values())
                                                            * len(grid)), 3.6), squeeze=False)
        for ax, (dataset, (models, modes, vals)) in zip(axes[0], grid.items()):
            width = 0.8 / len(modes)
            for j, mode in enumerate(modes):
                xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(models))]
                ys = [vals.get((m, mode), math.nan) for m in models]
                ax.bar(xs, ys, width, label=mode, hatch="//" if mode == ORAC else None)
            if ref is not None:
                ax.axhline(ref, color="black", linewidth=0.7)
            ax.set_xticks(range(len(models)), models, rotation=30, ha="right", fontsize=8)
            ax.set_title(dataset, fontsize=9)
            ax.set_ylabel(label, fontsize=8)
        axes[0][-1].legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = out / f"{stem}-{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    if written:
        print(f"# wrote {', '.join(p.name for p in written)}")
    return written


def readme_table(doc: dict) -> str:
    """A short Markdown results section from a run's JSON: throughput normalised to vdnn per model and mode."""
    env, rows, args = doc["environment"], doc["rows"], doc.get("args", {})
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "cuda", "triton", "cswap", "python") if env.get(k))
    budget = args.get("budget_gib")
    lines = [f"Training throughput normalised to vdnn (higher is better; paper Fig. 6), from `benchmarks/train.py` "
             f"on {env.get('device', '?')}, {env.get('date', '?')[:10]}; {versions}; memory budget "
             f"{f'{budget:g} GiB' if budget else 'the whole device'}; median of {args.get('iters', '?')} timed "
             f"steps after {args.get('warmup', '?')} warm-up. \"OOM\": out of memory in that budget; \"-\": not run, "
             f"or no vdnn run to normalise by; orac is computed (cswap's step minus its predicted compression "
             f"time), not measured.", ""]
    modes = [m for m in (*MODES, ORAC) if any(r.get("mode") == m for r in rows)]
    lines.append("| model | data | batch | " + " | ".join(modes) + " |")
    lines.append("| --- | --- | ---: | " + " | ".join("---:" for _ in modes) + " |")
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["dataset"]), {})[r["mode"]] = r
    for (model, dataset), by in groups.items():
        cells = []
        for m in modes:
            r = by.get(m)
            if r is None:
                cells.append("-")
            elif r.get("error"):
                cells.append("OOM" if r["error"] == "out of memory" else "error")
            elif r.get("norm_vs_vdnn") is not None:
                cells.append(f"{r['norm_vs_vdnn']:.2f}")
            else:
                cells.append("-")
        batch = next((r.get("batch") for r in by.values() if r.get("batch")), "-")
        lines.append(f"| {model} | {dataset} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- command line ------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="CPU-friendly: small_cnn and resnet18 on CIFAR shapes, batch 4, 2 warm-up + 1 timed step")
    p.add_argument("--models", nargs="+", help="names from cswap.models.names() (default: all)")
    p.add_argument("--datasets", nargs="+", choices=DATASETS, help="input shapes (default: both)")
    p.add_argument("--modes", nargs="+", choices=MODES, help=f"default: all of {', '.join(MODES)}")
    p.add_argument("--paper-gpu", choices=sorted(PAPER_BATCH), default="v100", help="Table III column for batches")
    p.add_argument("--batch", type=int, help="one batch size for every model and shape (overrides Table III)")
    p.add_argument("--batch-scale", type=float, default=1.0, help="scale Table III's batch sizes")
    p.add_argument("--warmup", type=int, help="untimed steps first (>= 2; default 4, until the runtime is steady: "
                   "common.SETTLE_STEPS; quick 2)")
    p.add_argument("--iters", type=int, help="timed steps (default 10, quick 1)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    p.add_argument("--budget-gib", type=float,
                   help="CUDA: cap this process's GPU memory (set_per_process_memory_fraction); no-op on CPU")
    p.add_argument("--profile", type=Path, help="device profile for the advisor (default: this device's)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG charts")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<device>)")
    p.add_argument("--from-json", type=Path, help="read a previous run's JSON instead of running: print its "
                                                  "table and redraw its charts beside it (or see --readme)")
    p.add_argument("--readme", action="store_true", help="with --from-json: print a Markdown results table")
    args = p.parse_args(argv)
    if args.readme and args.from_json is None:
        p.error("--readme needs --from-json PATH (the JSON of a previous run)")
    available = names()
    if args.models is None:
        args.models = [m for m in ("small_cnn", "resnet18") if m in available] if args.quick else list(available)
    unknown = [m for m in args.models if m not in available]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; cswap.models.names(): {', '.join(available)}")
    args.datasets = args.datasets or (["cifar10"] if args.quick else list(DATASETS))
    args.modes = args.modes or list(MODES)
    args.batch = args.batch or (4 if args.quick else None)
    args.warmup = 2 if args.warmup is None and args.quick else (SETTLE_STEPS if args.warmup is None else args.warmup)
    args.iters = args.iters or (1 if args.quick else 10)
    if args.warmup < 2:
        p.error("--warmup must be >= 2: cswap profiles its first step uncompressed and decides from the second")
    if args.iters < 1 or (args.batch is not None and args.batch < 1) or args.batch_scale <= 0:
        p.error("--iters, --batch and --batch-scale must be positive")
    return args


def _apply_budget(args, device: torch.device) -> dict:
    if args.budget_gib is None:
        return {"budget_gib": None}
    if device.type != "cuda":
        print(f"# --budget-gib {args.budget_gib:g}: no-op on {device.type} (recorded only)")
        return {"budget_gib": args.budget_gib, "budget_applied": False}
    if device.index is None:  # set_per_process_memory_fraction needs an index ("cuda" has none)
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(args.budget_gib * 2**30 / total, 1.0)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    print(f"# GPU memory budget {args.budget_gib:g} GiB = {fraction:.3f} of {total / 2**30:.1f} GiB")
    return {"budget_gib": args.budget_gib, "budget_applied": True, "budget_fraction": fraction}


def _load_profile(args):
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=QUIET[1])
            return cswap.load_profile(args.profile)
    except Exception as exc:  # no orac row then; the cswap mode reports its own error
        print(f"# no device profile for the orac row ({type(exc).__name__}: {exc})")
        return None


def _from_json(args):
    doc = json.loads(args.from_json.read_text())
    if args.readme:
        text = readme_table(doc)
        print(text)
        return text
    print_row()
    for row in doc["rows"]:
        print_row(row)
    if not args.no_plots:
        plot(doc["rows"], args.from_json.parent, args.from_json.stem)
    return doc["rows"]


def main(argv=None):
    args = parse_args(argv)
    if args.from_json is not None:
        return _from_json(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    budget = _apply_budget(args, device)
    env = environment(device, paper_gpu=args.paper_gpu, **budget)
    profile = _load_profile(args)
    print(f"# cswap training benchmark on {env['device']}; torch {env['torch']}; models {', '.join(args.models)}; "
          f"{', '.join(args.datasets)}; modes {', '.join(args.modes)}; {args.warmup} warm-up + {args.iters} timed "
          f"steps")
    print_row()
    rows = []
    for model_name in args.models:
        for dataset in args.datasets:
            batch, source = batch_for(model_name, dataset, args)
            base_row = {"model": model_name, "dataset": dataset, "batch": batch, "batch_source": source,
                        "budget_gib": budget["budget_gib"]}
            if batch is None:
                group = [dict(base_row, mode=m, computed=False, error=f"skipped: not run in the paper ({source})")
                         for m in args.modes]
            else:
                size, classes = SHAPES[dataset]
                torch.manual_seed(0)
                base = build(model_name, dataset=dataset)
                gen = torch.Generator().manual_seed(1)
                x = torch.randn(batch, 3, size, size, generator=gen)
                y = torch.randint(0, classes, (batch,), generator=gen)
                group = [run_mode(m, base, x, y, base_row, args, device, profile) for m in args.modes]
                del base, x, y
                group = finish_group(group)
            for row in group:
                print_row(row)
            rows.extend(group)
    out = write_results(rows, env, args, args.out, device, "train-quick" if args.quick else "train")
    if not args.no_plots:
        plot(rows, out, "train-quick" if args.quick else "train")
    return rows


if __name__ == "__main__":
    main()
