"""A/B of the runtime's host cost per offloaded tensor: a commit against the working tree, in one process.

    python benchmarks/ab_overhead.py 9a39f93                 # vdnn, 120 rounds (about a minute)
    python benchmarks/ab_overhead.py HEAD~3 --mode cswap --rounds 60

benchmarks/overhead.py compares providers; two runs of it, before and after a change,
differ by the machine's speed as much as by the change (on this project's machine the
same code moves by up to 2x within minutes). Here the commit's `cswap` package is
extracted (git archive) and imported as `cswap_base` beside the installed one (the working
tree's, in the editable install README gives), and the
same chain as overhead.py's (100 x Linear 64 + ReLU, batch 32, one torch thread) runs
unpatched, patched by the commit and patched by the working tree, alternating round by
round (ten steps a round). What each adds per offloaded tensor is the median over rounds
of its difference to the unpatched chain in the same round, and the change is the median
of the paired differences. Young collections count (their cost is the objects' cost);
full ones are off while timing, as in overhead.py.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from cswap.tune.host_cost import chain, time_steps, young_collections_only  # (overhead.py's chain and clock)
from common import installed_tree, settle  # (a sibling: benchmarks/ is on the path when run as a script)

ROOT = Path(__file__).resolve().parent.parent
LAYERS, WIDTH, BATCH = 100, 64, 32


def compare(base, new, mode: str, rounds: int, steps: int = 10) -> dict:
    """us per offloaded tensor: {"base": added, "new": added, "change": new - base (paired)}."""
    options = dict(mode=mode, candidates="all", min_bytes=0, verbose=False)
    models = {"unpatched": chain(LAYERS, WIDTH), "base": base.patch(chain(LAYERS, WIDTH), **options),
              "new": new.patch(chain(LAYERS, WIDTH), **options)}
    x = torch.randn(BATCH, WIDTH)
    for model in models.values():
        time_steps(model, contextlib.nullcontext, x, 20)
    times = {name: [] for name in models}
    gc.collect()
    packages = {"base": base, "new": new}
    with young_collections_only():
        for r in range(rounds):
            for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
                forward, backward = time_steps(models[name], contextlib.nullcontext, x, steps)
                times[name].append((sum(forward) + sum(backward)) / steps)
                if name in packages:
                    settle(packages[name], models[name])

    def added(name, against):
        return statistics.median(a - b for a, b in zip(times[name], times[against])) / LAYERS * 1e6

    return {"base": added("base", "unpatched"), "new": added("new", "unpatched"), "change": added("new", "base")}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commit", help="the commit to compare the working tree with (e.g. HEAD~1)")
    parser.add_argument("--mode", default="vdnn", help="cswap mode (default vdnn)")
    parser.add_argument("--rounds", type=int, default=120)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*saves no memory", category=RuntimeWarning)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        installed_tree(args.commit, Path(folder), "cswap_base")
        sys.path.insert(0, folder)
        base, new = importlib.import_module("cswap_base"), importlib.import_module("cswap")
        result = compare(base, new, args.mode, args.rounds)
    print(f"{args.mode}, us per offloaded tensor (measured here, in one process): {args.commit} adds "
          f"{result['base']:.1f}, the working tree {result['new']:.1f}; change {result['change']:+.2f}")
    return result


if __name__ == "__main__":
    main()
