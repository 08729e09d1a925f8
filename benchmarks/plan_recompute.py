"""Recompute as the budget planner's fourth choice: is the plan good? (issue 25, "Beyond")

    python benchmarks/plan_recompute.py            # 100 instances, a few minutes on 2 CPU cores
    python benchmarks/plan_recompute.py --quick    # 12 instances from two small traces (what the test runs)

Instances: one training step traced on a fake GPU by cswap.predict (every saved
activation of 1 MiB or more, its window away from the device, the device's
memory after each op, and the model's repeated blocks: each block's members,
the activations made and saved inside it, and its forward's seconds), for CNNs
(cswap.models at ImageNet shapes) and transformers (Llama- and GPT-2-style
decoders built from configs on the meta device, transformers needed). From
each trace, 2 to 4 consecutive blocks with their members plus up to 4 other
tensors (the rest stay on the device), with a budget drawn uniformly between
the subset's floor (the least peak of offloading all of it and of
checkpointing every block with the rest offloaded) and its peak with nothing
moved.

On each instance, on the same timeline model (cswap.plan.budget and
cswap.plan.recompute): the planner with recompute; the planner without it;
checkpoint-everything plus offload-everything (what Unsloth's and torchtune's
users run); and the exact optimum (a MILP per set of recomputed blocks, HiGHS).
Targets: within 2% of the optimum on at least 95 of 100 instances, never
slower than checkpoint-everything at the same budget.

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
from cswap.plan.budget import peak, plan_budget
from cswap.plan.recompute import Block, checkpoint_everything, optimum_with_recompute, plan_with_recompute
from cswap.plan.sparsity import from_number

# (label, builder, GPU, precision, sparsity of ReLU/pooling outputs)
TRACES = [("resnet50 b32", "resnet50", 32, "a100-sxm4-40gb", "fp32", 0.5),
          ("resnet18 b64", "resnet18", 64, "h100-sxm-80gb", "fp32", 0.4),
          ("llama 8x1024 L1024 b4", "llama", 4, "h100-sxm-80gb", "bf16", 0.0),
          ("gpt2 6x768 L1024 b8", "gpt2", 8, "l4-24gb", "fp32", 0.0)]
QUICK_TRACES = [("resnet18 b16", "resnet18", 16, "a100-sxm4-40gb", "fp32", 0.5),
                ("llama 4x256 L256 b2", "llama-small", 2, "h100-sxm-80gb", "bf16", 0.0)]


def _model(name: str, batch: int):
    """(model, example inputs on meta)."""
    if name in models.names():
        return models.build(name, dataset="imagenet"), torch.empty(batch, 3, 224, 224, device="meta")
    import transformers as tf

    if name.startswith("llama"):
        small = name == "llama-small"
        hidden, layers, seq = (256, 4, 256) if small else (1024, 8, 1024)
        config = tf.LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                                num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                                vocab_size=32000, max_position_embeddings=seq)
        cls = tf.LlamaForCausalLM
    else:
        seq = 1024
        config = tf.GPT2Config(n_layer=6, n_embd=768, n_head=12, n_positions=seq, vocab_size=32000, bos_token_id=0,
                               eos_token_id=0)
        cls = tf.GPT2LMHeadModel
    with torch.device("meta"):
        model = cls(config)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def trace(name: str, batch: int, gpu: str, precision: str, sparsity: float):
    """(the budget planner's instance, its blocks) for one training step."""
    model, inputs = _model(name, batch)
    p = whatif.predict(model, inputs, gpu, precision=precision, sparsity=from_number(sparsity))
    return p.instance, p.blocks


def instances(traces: dict, count: int, rng: random.Random) -> list:
    """`count` (label, subset, its blocks, budget) draws whose budget is strictly between floor and peak."""
    out = []
    labels = list(traces)
    while len(out) < count:
        label = labels[len(out) % len(labels)]
        inst, blocks = traces[label]
        blocks = [b for b in blocks if b.members]
        k = rng.randint(2, min(4, len(blocks)))
        first = rng.randrange(len(blocks) - k + 1)
        picked = blocks[first:first + k]
        members = sorted({i for b in picked for i in b.members})
        others = [i for i in range(inst.n) if i not in members and inst.windows[i][0] < inst.windows[i][1]]
        chosen = sorted(members + rng.sample(others, min(len(others), rng.randint(0, 4))))
        if len(chosen) > 28:  # the exact optimum's MILPs stay small
            continue
        where = {i: j for j, i in enumerate(chosen)}
        sub = inst.subset(chosen)
        sub_blocks = [Block(b.name, tuple(where[i] for i in b.members), b.seconds) for b in picked]
        top = float(sub.curve.max())
        floor = min(peak(sub, [sub.paper_choice(i) for i in range(sub.n)]),
                    checkpoint_everything(sub, sub_blocks, top).peak_bytes)
        if top - floor < 0.01 * top:
            continue
        out.append((label, sub, sub_blocks, rng.uniform(floor, top)))
    return out


STRATEGIES = {"with_recompute": plan_with_recompute,
              "without_recompute": lambda inst, blocks, budget: plan_budget(inst, budget),
              "checkpoint_everything": checkpoint_everything}


def compare(label, inst, blocks, budget) -> dict:
    compute = inst.iteration.forward_s + inst.iteration.backward_s
    best = optimum_with_recompute(inst, blocks, budget)
    row = {"trace": label, "tensors": inst.n, "blocks": len(blocks), "budget_mib": budget / 2**20,
           "optimum_ms": (compute + best.extra_seconds) * 1e3, "optimum_fits": best.fits,
           "optimum_recomputed": len(best.recomputed), "milp_s": best.planning_seconds}
    for name, strategy in STRATEGIES.items():
        plan = strategy(inst, blocks, budget)
        step = compute + plan.extra_seconds
        row[f"{name}_ms"] = step * 1e3
        row[f"{name}_vs_optimum"] = step / (compute + best.extra_seconds) - 1
        row[f"{name}_fits"] = plan.fits
        row[f"{name}_recomputed"] = len(getattr(plan, "recomputed", ()))
        row[f"{name}_planning_ms"] = plan.planning_seconds * 1e3
    return row


def markdown(rows: list[dict], traces: list) -> str:
    n = len(rows)
    lines = [f"Predicted on a CPU (no GPU): {n} instances of 2-4 consecutive blocks (with up to 4 other tensors) "
             f"from {len(traces)} traces (cswap.predict; assumed link and codec speeds), budgets uniform between "
             f"each subset's floor and peak. Step time vs the exact optimum with recompute on the same model.", "",
             "| strategy | within 2% of optimum | within 0.1% | median gap | worst gap | meets budget | "
             "slower than checkpoint-everything | blocks recomputed (median) | median planning ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in STRATEGIES:
        gaps = [r[f"{name}_vs_optimum"] for r in rows]
        slower = sum(1 for r in rows if r[f"{name}_fits"] and r["checkpoint_everything_fits"]
                     and r[f"{name}_ms"] > r["checkpoint_everything_ms"] * (1 + 1e-9))
        lines.append(f"| {name} | {sum(g <= 0.02 for g in gaps)}/{n} | {sum(g <= 0.001 for g in gaps)}/{n} "
                     f"| {statistics.median(gaps):+.2%} | {max(gaps):+.2%} | "
                     f"{sum(r[f'{name}_fits'] for r in rows)}/{n} | {slower}/{n} | "
                     f"{statistics.median(r[f'{name}_recomputed'] for r in rows):.0f} | "
                     f"{statistics.median(r[f'{name}_planning_ms'] for r in rows):.2f} |")
    lines.append(f"| optimum (MILP per block set, HiGHS) | - | - | - | - | {sum(r['optimum_fits'] for r in rows)}/{n} "
                 f"| - | {statistics.median(r['optimum_recomputed'] for r in rows):.0f} | "
                 f"{statistics.median(r['milp_s'] for r in rows) * 1e3:.0f} |")
    lines += ["", "Traces: " + "; ".join(f"{label} on {g} ({prec})" for label, _, _, g, prec, _ in traces) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="12 instances from two small traces")
    ap.add_argument("--instances", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help=f"results folder (default {RESULTS / 'plan-recompute'})")
    args = ap.parse_args(argv)
    chosen = QUICK_TRACES if args.quick else TRACES
    count = 12 if args.quick else args.instances
    rng = random.Random(args.seed)
    traces = {}
    for label, name, batch, gpu, precision, sparsity in chosen:
        start = time.perf_counter()
        traces[label] = trace(name, batch, gpu, precision, sparsity)
        inst, blocks = traces[label]
        print(f"# traced {label} on {gpu}: {inst.n} tensors, {sum(1 for b in blocks if b.members)} blocks "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    rows = [compare(*draw) for draw in instances(traces, count, rng)]
    text = markdown(rows, chosen)
    print(text)
    env = environment(torch.device("cpu"), what="predicted on a CPU: nothing ran on a GPU")
    out = args.out or RESULTS / "plan-recompute"
    write_results(rows, env, args, out, torch.device("cpu"), "plan_recompute")
    (out / "plan_recompute.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
