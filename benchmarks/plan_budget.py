"""Is the budget planner's plan good? Against the exact optimum, on instances from real traces (issue 14, §2).

    python benchmarks/plan_budget.py            # 100 instances, under a minute on 2 CPU cores
    python benchmarks/plan_budget.py --quick    # 12 instances from two small traces (what the test runs)

Instances: one training step of cswap's models at ImageNet shapes traced on a
fake GPU by cswap.predict (every saved activation of 1 MiB or more, its
window away from the device, the device's memory after each op), with the
GPU's assumed link and codec speeds (AssumedProfile) and one stated sparsity
per trace for the ReLU/pooling outputs. From each trace, random subsets of 5
to 20 tensors (the others stay on the device) with a random budget drawn
uniformly between the subset's floor (the peak with all of it offloaded) and
the peak with none of it offloaded.

On each instance, on the same timeline model (cswap.plan.budget): the
planner; offload everything (cswap.patch without a budget, codecs by the
paper's rule); largest-first greedy (raw copies); the paper's independent
per-tensor rule (cheapest eq. 1-4 cost per byte first); and the exact
optimum, a MILP solved by scipy/HiGHS. Step time = compute + exposed
transfers + codec kernels. Targets: the planner within 2% of the optimum's
step time on at least 95 of 100 instances, never slower than offloading
everything; planning time under 50 ms for ResNet-50's saved tensors.

Everything here is predicted (nothing ran on a GPU): it measures the planner
against the optimum of the model, not the model against a GPU.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, environment, write_results

from cswap import models
from cswap.plan import whatif
from cswap.plan.budget import (KEEP, Instance, largest_first, offload_everything, optimum, peak, per_tensor_rule,
                               plan_budget)
from cswap.plan.sparsity import from_number

# (model, batch, GPU, sparsity of ReLU/pooling outputs): traces that differ in shape, link and codec payoff.
TRACES = [("vgg16", 64, "a100-sxm4-40gb", 0.6), ("resnet50", 64, "a100-sxm4-40gb", 0.5),
          ("resnet18", 128, "h100-sxm-80gb", 0.4), ("mobilenet", 128, "v100-sxm2-32gb", 0.7),
          ("vgg16", 32, "l4-24gb", 0.3)]
QUICK_TRACES = [("resnet18", 16, "a100-sxm4-40gb", 0.5), ("mobilenet", 16, "h100-sxm-80gb", 0.6)]
STRATEGIES = {"planner": plan_budget, "offload_everything": offload_everything, "largest_first": largest_first,
              "per_tensor_rule": per_tensor_rule}


def trace(name: str, batch: int, gpu: str, sparsity: float, min_bytes: int = whatif.MIN_BYTES) -> Instance:
    """The planning problem of one training step of `name` (every saved activation of min_bytes+)."""
    saved, whatif.MIN_BYTES = whatif.MIN_BYTES, min_bytes
    try:
        p = whatif.predict(models.build(name, dataset="imagenet"), torch.empty(batch, 3, 224, 224, device="meta"),
                           gpu, sparsity=from_number(sparsity))
    finally:
        whatif.MIN_BYTES = saved
    return p.instance


def instances(traces: dict, count: int, rng: random.Random) -> list[tuple[str, Instance, float]]:
    """`count` (trace label, subset, budget) draws whose budget is strictly between floor and peak."""
    out = []
    labels = list(traces)
    while len(out) < count:
        label = labels[len(out) % len(labels)]
        inst = traces[label]
        movable = [i for i, (a, b) in enumerate(inst.windows) if a < b]
        chosen = sorted(rng.sample(movable, min(len(movable), rng.randint(5, 20))))
        sub = inst.subset(chosen)
        top = float(sub.curve.max())
        floor = peak(sub, [sub.paper_choice(i) for i in range(sub.n)])
        if top - floor < 0.01 * top:  # offloading this subset barely lowers the peak: no decision to make
            continue
        out.append((label, sub, rng.uniform(floor, top)))
    return out


def compare(label: str, inst: Instance, budget: float) -> dict:
    compute = inst.iteration.forward_s + inst.iteration.backward_s
    best = optimum(inst, budget)
    row = {"trace": label, "tensors": inst.n, "budget_mib": budget / 2**20, "optimum_ms": (compute + best.extra_seconds) * 1e3,
           "optimum_moved": best.moved, "optimum_fits": best.fits, "milp_s": best.planning_seconds}
    for name, strategy in STRATEGIES.items():
        plan = strategy(inst, budget)
        step = compute + plan.extra_seconds
        row[f"{name}_ms"] = step * 1e3
        row[f"{name}_vs_optimum"] = step / (compute + best.extra_seconds) - 1
        row[f"{name}_fits"] = plan.fits
        row[f"{name}_moved"] = plan.moved
        row[f"{name}_planning_ms"] = plan.planning_seconds * 1e3
        row[f"{name}_compressed"] = sum(1 for c in plan.choices if c not in (KEEP, None))
    return row


def planning_time(name: str, batch: int, gpu: str, sparsity: float, repeats: int = 5) -> dict:
    """The planner on every saved activation of one step (no size floor), at three budgets."""
    inst = trace(name, batch, gpu, sparsity, min_bytes=0)
    top = float(inst.curve.max())
    floor = peak(inst, [inst.paper_choice(i) for i in range(inst.n)])
    times = []
    for fraction in (0.25, 0.5, 0.75):
        budget = floor + fraction * (top - floor)
        for _ in range(repeats):
            times.append(plan_budget(inst, budget).planning_seconds)
    return {"model": name, "batch": batch, "gpu": gpu, "tensors": inst.n, "median_ms": statistics.median(times) * 1e3,
            "max_ms": max(times) * 1e3}


def markdown(rows: list[dict], timing: dict, traces: list) -> str:
    n = len(rows)
    lines = [f"Predicted on a CPU (no GPU): {n} instances of 5-20 tensors from {len(traces)} traces "
             f"(cswap.predict, ImageNet shapes, assumed link and codec speeds), budgets uniform between "
             f"each subset's floor and peak. Step time vs the MILP optimum on the same timeline model.", "",
             "| strategy | within 2% of optimum | within 0.1% | median gap | worst gap | meets budget | "
             "slower than offload-everything | median planning ms |",
             "|---|---|---|---|---|---|---|---|"]
    for name in STRATEGIES:
        gaps = [r[f"{name}_vs_optimum"] for r in rows]
        slower = sum(1 for r in rows if r[f"{name}_ms"] > r["offload_everything_ms"] * (1 + 1e-9))
        lines.append(f"| {name} | {sum(g <= 0.02 for g in gaps)}/{n} | {sum(g <= 0.001 for g in gaps)}/{n} "
                     f"| {statistics.median(gaps):+.2%} | {max(gaps):+.2%} | "
                     f"{sum(r[f'{name}_fits'] for r in rows)}/{n} | {slower}/{n} | "
                     f"{statistics.median(r[f'{name}_planning_ms'] for r in rows):.2f} |")
    lines.append(f"| optimum (MILP, HiGHS) | - | - | - | - | {sum(r['optimum_fits'] for r in rows)}/{n} | - | "
                 f"{statistics.median(r['milp_s'] for r in rows) * 1e3:.0f} |")
    gaps = sorted(r["planner_vs_optimum"] for r in rows)
    deciles = ", ".join(f"{gaps[min(n - 1, int(q * n))]:+.2%}" for q in (0.5, 0.9, 0.95, 0.99))
    lines += ["", f"Planner gap to the optimum at the 50th, 90th, 95th and 99th percentiles: {deciles}.", "",
              f"Planning time, every saved activation of {timing['model']} (batch {timing['batch']}, "
              f"{timing['gpu']}): {timing['tensors']} tensors, median {timing['median_ms']:.1f} ms, "
              f"max {timing['max_ms']:.1f} ms (target under 50 ms).", "",
              "Traces: " + "; ".join(f"{m} batch {b} on {g}, sparsity {s}" for m, b, g, s in traces) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="12 instances from two small traces")
    ap.add_argument("--instances", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help=f"results folder (default {RESULTS / 'plan-budget'})")
    args = ap.parse_args(argv)
    chosen = QUICK_TRACES if args.quick else TRACES
    count = 12 if args.quick else args.instances
    rng = random.Random(args.seed)
    traces = {}
    for m, b, g, s in chosen:
        start = time.perf_counter()
        traces[f"{m} b{b} {g} s{s}"] = trace(m, b, g, s)
        print(f"# traced {m} batch {b} on {g}: {traces[f'{m} b{b} {g} s{s}'].n} tensors "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    rows = [compare(label, inst, budget) for label, inst, budget in instances(traces, count, rng)]
    timing = planning_time(*(QUICK_TRACES[0] if args.quick else TRACES[1]))
    text = markdown(rows, timing, chosen)
    print(text)
    env = environment(torch.device("cpu"), what="predicted on a CPU: nothing ran on a GPU", timing=timing)
    out = args.out or RESULTS / "plan-budget"
    write_results(rows, env, args, out, torch.device("cpu"), "plan_budget")
    (out / "plan_budget.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
