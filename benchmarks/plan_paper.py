"""The CSWAP paper's V100 evaluation, replayed by cswap-plan's what-if (issue 13, section 4).

    python benchmarks/plan_paper.py            # the 12 V100 settings of Table III, about 5 min on 2 CPU cores
    python benchmarks/plan_paper.py --quick    # 2 small settings and one stated sparsity (what the test runs)

The setting is the paper's section V: an NVIDIA V100 SXM2 32 GB (section V's
first server; issue 13 said 16 GB, but no figure here depends on it) on PCIe
3.0 x16 with the effective bandwidths the authors measured with bandwidthTest
(10.6 GB/s host to device, 11.7 GB/s device to host); AlexNet, VGG16, ResNet
(the paper names no depth: ResNet-50 here), MobileNet (v1), SqueezeNet (1.0) and
Plain20 at Table III's V100 batch sizes for CIFAR-10 and ImageNet shapes; fp32
and SGD, as Torch 1.5 trained them.

Nothing here ran on a GPU: every figure of ours is predicted by cswap.predict,
from the roofline compute model (calibrated on published Volta ResNet-50
throughputs), the paper's link bandwidths, cswap's codec speeds as measured on
an H200 and scaled to the V100's 900 GB/s HBM (whatif.CODEC_HBM_FRACTION and
CODEC_FIXED_S) and sparsities measured on real
CPU training steps (scikit-learn digits with their labels, cross-entropy, SGD;
--steps per setting). The paper's figures are the ones its text states (its
bar charts carry no numbers in the text): `PAPER` below quotes each with its
place.

Per setting and mode (vdnn: every ReLU/pooling output of at least 1 MiB moved
raw; sc: all of them ZVC-compressed, the paper's cDMA replica; cswap: the
advisor's choice per tensor):
- swap latency: time on the link both ways plus (de)compression kernel time,
  the paper's definition in Fig. 3;
- training time: the predicted step (compute + exposed transfers + codec time).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, environment, write_results

from cswap import models
from cswap.plan import sparsity as sparsity_sources
from cswap.plan.gpus import gpu as lookup
from cswap.plan.whatif import AssumedProfile, predict

GPU = "v100-sxm2-32gb"
H2D, D2H = 10.6e9, 11.7e9  # the paper's bandwidthTest figures on its V100 server (section V.A)
SHAPES = {"cifar10": (3, 32, 32), "imagenet": (3, 224, 224)}
# Table III, V100 column: (paper's name, cswap model, CIFAR-10 batch, ImageNet batch).
TABLE_III = [("AlexNet", "alexnet", 2560, 512), ("VGG16", "vgg16", 2560, 128),
             ("MobileNet", "mobilenet", 2560, 128), ("Plain20", "plain20", 2560, 32),
             ("ResNet", "resnet50", 2560, 64), ("SqueezeNet", "squeezenet1_0", 2560, 512)]
QUICK = [("AlexNet", "alexnet", 256, None), ("Plain20", "plain20", 256, None)]

# What the paper's text states for V100 (training time and swap latency against vDNN, CSWAP against SC).
PAPER = {
    "time_vs_vdnn": {("AlexNet", "cifar10"): "-31% (up to; V.A)", ("Plain20", "cifar10"): "-24.1% (V.A)",
                     "cifar10": "up to -19.3% for the others (V.A)"},
    "transfer_share": {("AlexNet", "cifar10"): "71% (V.A)", ("Plain20", "cifar10"): "73% (V.A)",
                       "cifar10": "<50% (V.A)"},
    "cswap_vs_sc": {"Plain20": "+0% (V.B: every layer compressed)", "*": "+5.5% mean, +12.5% max (V.B, Fig. 7)"},
    "summary": [
        ("swap latency, CSWAP vs vDNN", "up to -50.9% (abstract)"),
        ("training time, CSWAP vs vDNN, CIFAR-10 mean", "-20% (throughput +25%, V.A)"),
        ("training time, CSWAP vs vDNN, CIFAR-10 best", "-29.2% (V.A)"),
        ("training time, CSWAP vs vDNN, ImageNet mean", "-20.3% (V.A)"),
        ("training time, CSWAP vs vDNN, mean over all", "-20.7% (abstract)"),
        ("CSWAP vs SC throughput, mean over all but Plain20", "+5.5% (V.B)"),
        ("SC: (de)compression share of swap latency, VGG16", "about 30% (II, Fig. 3)"),
        ("VGG16 (de)compression time per iteration, CSWAP with BO", "66 ms (V.D, Fig. 12)"),
    ],
}


class PaperLink(AssumedProfile):
    """The V100's link at the paper's measured bandwidths; codecs as cswap assumes."""

    def __init__(self, g):
        super().__init__(g)
        self.bw_h2d, self.bw_d2h = H2D, D2H
        codecs = self.source.split("; ", 1)[1]
        self.source = (f"the paper's bandwidthTest figures (H2D {H2D / 1e9:.1f} GB/s, D2H {D2H / 1e9:.1f} GB/s; "
                       f"section V.A); {codecs} (assumed)")


def swap_seconds(mode) -> float:
    """The paper's swap latency: on the link both ways, plus (de)compression."""
    return mode.pcie_bytes / 2 * (1 / D2H + 1 / H2D) + mode.codec_seconds


def replay(label: str, name: str, dataset: str, batch: int, sparsity, link) -> dict:
    model = models.build(name, dataset=dataset)
    p = predict(model, torch.empty(batch, *SHAPES[dataset], device="meta"), GPU, profile=link, sparsity=sparsity)
    m = p.modes
    swap = {k: swap_seconds(m[k]) for k in ("vdnn", "sc", "cswap")}
    sparse = [t.sparsity for t in p.tensors if t.decisions["vdnn"] != "keep"]
    return {
        "model": label, "cswap_model": name, "dataset": dataset, "batch": batch,
        "fits_unpatched": p.fits("none"), "peak_none_gib": m["none"].peak_bytes / 2**30,
        "offloaded": m["vdnn"].offloaded, "compressed_cswap": m["cswap"].compressed,
        "codecs_cswap": dict(sorted(collections.Counter(
            t.decisions["cswap"] for t in p.tensors if t.decisions["cswap"] not in ("keep", "raw")).items())),
        "mean_sparsity_offloaded": statistics.fmean(sparse) if sparse else 0.0,
        "step_none_ms": m["none"].step_seconds * 1e3, "step_vdnn_ms": m["vdnn"].step_seconds * 1e3,
        "step_sc_ms": m["sc"].step_seconds * 1e3, "step_cswap_ms": m["cswap"].step_seconds * 1e3,
        "swap_vdnn_ms": swap["vdnn"] * 1e3, "swap_sc_ms": swap["sc"] * 1e3, "swap_cswap_ms": swap["cswap"] * 1e3,
        "codec_sc_ms": m["sc"].codec_seconds * 1e3, "codec_cswap_ms": m["cswap"].codec_seconds * 1e3,
        "transfer_share_vdnn": (swap["vdnn"] / m["vdnn"].step_seconds),
        "swap_cswap_vs_vdnn": swap["cswap"] / swap["vdnn"] - 1,
        "time_cswap_vs_vdnn": m["cswap"].step_seconds / m["vdnn"].step_seconds - 1,
        "time_sc_vs_vdnn": m["sc"].step_seconds / m["vdnn"].step_seconds - 1,
        "throughput_cswap_vs_sc": m["sc"].step_seconds / m["cswap"].step_seconds - 1,
        "codec_share_sc": m["sc"].codec_seconds / swap["sc"] if swap["sc"] else 0.0,
        "sparsity_source": p.sources["sparsity"],
    }


def _paper(table: str, label: str, dataset: str) -> str:
    t = PAPER[table]
    return t.get((label, dataset)) or t.get(label) or t.get(dataset) or t.get("*", "-")


def markdown(rows: list[dict], link_source: str) -> str:
    pct = "{:+.1%}".format
    lines = [
        (f"Predicted on a CPU by cswap.predict for {lookup(GPU).label}, PCIe at {link_source}. "
         f"Paper figures are quoted from its text with their section."),
        "",
        ("| model | data | batch | vDNN: transfer share of step (ours / paper) | swap latency, CSWAP vs vDNN "
         "| training time, CSWAP vs vDNN (ours / paper) | SC vs vDNN | CSWAP vs SC throughput (ours / paper) "
         "| compressed / offloaded (codecs) | mean sparsity |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, d = r["model"], r["dataset"]
        lines.append(
            f"| {m} | {d} | {r['batch']} | {r['transfer_share_vdnn']:.0%} / {_paper('transfer_share', m, d)} "
            f"| {pct(r['swap_cswap_vs_vdnn'])} | {pct(r['time_cswap_vs_vdnn'])} / {_paper('time_vs_vdnn', m, d)} "
            f"| {pct(r['time_sc_vs_vdnn'])} | {pct(r['throughput_cswap_vs_sc'])} / {_paper('cswap_vs_sc', m, d)} "
            f"| {r['compressed_cswap']} / {r['offloaded']} ({', '.join(r['codecs_cswap']) or 'none'}) "
            f"| {r['mean_sparsity_offloaded']:.0%} |")
    ours = summary(rows)
    lines += ["", "| summary (V100) | ours (predicted) | paper |", "|---|---|---|"]
    for (what, paper), mine in zip(PAPER["summary"], ours):
        lines.append(f"| {what} | {mine} | {paper} |")
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> list[str]:
    """Ours, in PAPER['summary']'s order."""
    def mean(key, keep=lambda r: True):
        values = [r[key] for r in rows if keep(r)]
        return f"{statistics.fmean(values):+.1%}" if values else "-"

    cifar = [r for r in rows if r["dataset"] == "cifar10"]
    vgg = [r for r in rows if r["model"] == "VGG16"]
    vgg_in = [r for r in vgg if r["dataset"] == "imagenet"] or vgg
    return [
        f"best {min(r['swap_cswap_vs_vdnn'] for r in rows):+.1%}",
        mean("time_cswap_vs_vdnn", lambda r: r["dataset"] == "cifar10"),
        f"{min(r['time_cswap_vs_vdnn'] for r in cifar):+.1%}" if cifar else "-",
        mean("time_cswap_vs_vdnn", lambda r: r["dataset"] == "imagenet"),
        mean("time_cswap_vs_vdnn"),
        mean("throughput_cswap_vs_sc", lambda r: r["model"] != "Plain20"),
        f"{statistics.fmean(r['codec_share_sc'] for r in vgg):.0%}" if vgg else "-",
        f"{vgg_in[0]['codec_cswap_ms']:.0f} ms (ImageNet, batch {vgg_in[0]['batch']})" if vgg_in else "-",
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="AlexNet and Plain20 at CIFAR-10 shapes, batch 256, sparsity 0.5 (no CPU training)")
    ap.add_argument("--steps", type=int, default=50, help="CPU training steps per CIFAR-10 setting (ImageNet: a "
                                                          "fifth as many, at least 2)")
    ap.add_argument("--sparsity", type=float, help="one stated sparsity instead of measuring")
    ap.add_argument("--out", type=Path, help=f"results folder (default {RESULTS / 'plan-paper'})")
    args = ap.parse_args(argv)
    link = PaperLink(lookup(GPU))
    settings = [(label, name, "cifar10", b) for label, name, b, _ in (QUICK if args.quick else TABLE_III)]
    if not args.quick:
        settings += [(label, name, "imagenet", b) for label, name, _, b in TABLE_III]
    fixed = 0.5 if args.quick and args.sparsity is None else args.sparsity
    rows = []
    for label, name, dataset, batch in settings:
        start = time.perf_counter()
        if fixed is not None:
            sparsity = sparsity_sources.from_number(fixed)
        else:
            steps = args.steps if dataset == "cifar10" else max(2, args.steps // 5)
            batch_cpu = 16 if dataset == "cifar10" else 8
            torch.manual_seed(0)  # the same fresh weights each run, so a rerun measures the same sparsity
            sparsity = sparsity_sources.auto(models.build(name, dataset=dataset),
                                             torch.empty(batch_cpu, *SHAPES[dataset]), "digits", steps=steps,
                                             batch=batch_cpu)
        rows.append(replay(label, name, dataset, batch, sparsity, link))
        r = rows[-1]
        print(f"# {label:10s} {dataset:8s} batch {batch:5d}: swap {r['swap_cswap_vs_vdnn']:+.1%}, "
              f"time {r['time_cswap_vs_vdnn']:+.1%} vs vDNN ({time.perf_counter() - start:.0f} s)", flush=True)
    text = markdown(rows, link.source)
    print(text)
    env = environment(torch.device("cpu"), what="predicted by cswap.predict; nothing ran on a GPU",
                      gpu=GPU, link=link.source)
    out = write_results(rows, env, args, args.out or RESULTS / "plan-paper", torch.device("cpu"), "plan_paper")
    (out / "plan_paper.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
