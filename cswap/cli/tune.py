"""cswap-tune: measure this machine and write its device profile.

Steps (paper IV-C, IV-D): probe PCIe bandwidth; for every codec, find the
launch settings (grid, block) that minimise compress + decompress time of a
representative tensor with Bayesian optimisation; time the codec over sizes
and sparsities at those settings and fit the time model; measure the training
thread's time per offloaded tensor (cswap.tune.host_cost, for the planners);
write the profile.

    cswap-tune                       # full run on this GPU (paper sizes: 20 MB .. 2000 MB)
    cswap-tune --quick               # small sizes and budgets: minutes, also on a CPU
    cswap-tune --compare [--full-grid]   # also random search, the expert rule (and grid search),
                                     # and the four regressors' RAE, side by side
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .. import __version__, codecs
from ..kernels.launch import LaunchConfig
from ..plan.advisor import HOST_S_PER_TENSOR
from ..tune.bandwidth import probe
from ..tune.host_cost import host_seconds_per_tensor
from ..tune.profile import SCHEMA_VERSION, profile_path, save_profile
from ..tune.synthetic import make_tensor
from ..tune.timemodel import SPARSITY_RANGE, TimeModel, compare_regressors
from ..tune.timing import time_codec
from ..tune.tuner import bayes_tune, expert, grid_search, random_search

__all__ = ["main", "run"]

MB = 10**6
MiB = 1 << 20


def _bar(desc: str, total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(desc=desc, total=total, leave=False, file=sys.stderr, disable=not enabled)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cswap-tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codecs", nargs="+", default=list(codecs.names()), choices=codecs.names(),
                   help="codecs to tune (default: all)")
    p.add_argument("--out", type=Path, help="profile path (default: $CSWAP_HOME/profile-<device>.json)")
    p.add_argument("--quick", action="store_true", help="small sizes and budgets (minutes, also on CPU)")
    p.add_argument("--compare", action="store_true",
                   help="also run random search and the expert rule, and compare the four regressors")
    p.add_argument("--full-grid", action="store_true", help="with --compare: also exhaustive grid search (slow)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["auto", "triton", "torch"], default="auto",
                   help="codec backend to time (auto: triton on CUDA, torch on CPU)")
    p.add_argument("--init-probes", type=int, default=10, help="BO random probes (s1)")
    p.add_argument("--guided-probes", type=int, default=25, help="BO guided probes (s2)")
    p.add_argument("--samples", type=int, help="time-model samples per codec (default 48, quick 24)")
    p.add_argument("--submodels", type=int, default=3, help="time-model sparsity sub-ranges (n)")
    p.add_argument("--tune-mib", type=float, help="representative tensor size for tuning, MiB "
                   "(default: 500 MB as the paper; quick: 8 MiB on GPU, 0.25 MiB on CPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.init_probes < 1 or args.guided_probes < 0:
        p.error("--init-probes must be >= 1 and --guided-probes >= 0")
    if args.submodels < 1:
        p.error("--submodels must be >= 1")
    return args


def _plan(args, device: torch.device) -> dict:
    """Sizes and repeats for this run: the paper's on a full GPU run, scaled down otherwise."""
    gpu = device.type == "cuda"
    if not args.quick and gpu:
        sizes, tune_bytes, repeats = (20 * MB, 2000 * MB), 500 * MB, 10
    elif gpu:
        sizes, tune_bytes, repeats = (1 * MiB, 64 * MiB), 8 * MiB, 5
    elif not args.quick:
        sizes, tune_bytes, repeats = (1 * MiB, 32 * MiB), 4 * MiB, 5
    else:
        sizes, tune_bytes, repeats = (64 * 1024, 1 * MiB), MiB // 4, 3
    if args.tune_mib:
        tune_bytes = int(args.tune_mib * MiB)
    samples = args.samples or (24 if args.quick else 48)
    if samples < 3 * args.submodels + 4:
        raise ValueError(f"--samples {samples} is too few for {args.submodels} sub-models and a held-out set; "
                         f"use at least {3 * args.submodels + 4}")
    bw_sizes = (MiB, 4 * MiB, 16 * MiB) if args.quick else (MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
    return {"sizes": sizes, "tune_bytes": tune_bytes, "repeats": repeats, "samples": samples,
            "bw_sizes": bw_sizes}


def _device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"name": props.name, "type": "cuda", "compute_capability": [props.major, props.minor],
                "sm_count": props.multi_processor_count}
    import platform

    return {"name": platform.processor() or platform.machine() or "cpu", "type": "cpu",
            "compute_capability": None, "sm_count": None}


def run(args) -> tuple[dict, Path, list[str]]:
    """The whole pipeline; returns (profile document, path written, summary lines)."""
    start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = args.backend if args.backend != "auto" else ("triton" if device.type == "cuda" else "torch")
    plan = _plan(args, device)
    show = not args.no_progress
    lines = []
    if device.type != "cuda":
        print("cswap-tune: no CUDA device: timing the codecs on the CPU; this profile describes the CPU, "
              "not a GPU", file=sys.stderr)
        if backend == "torch":
            print("cswap-tune: the torch backend ignores launch settings, so tuning here only exercises the "
                  "search", file=sys.stderr)
    bandwidth = probe(device, plan["bw_sizes"], repeats=plan["repeats"])
    rng = np.random.default_rng(args.seed)
    lo, hi = plan["sizes"]
    sizes = np.exp(rng.uniform(math.log(lo), math.log(hi), plan["samples"])).astype(np.int64)
    # Sparsities stratified over the range (one per equal slice, jittered), so every
    # sub-model gets samples; every 4th slice is held out to score the regressors.
    n = plan["samples"]
    slices = (np.arange(n) + rng.uniform(size=n)) / n
    sparsities = SPARSITY_RANGE[0] + slices * (SPARSITY_RANGE[1] - SPARSITY_RANGE[0])
    test_mask = np.arange(n) % 4 == 3
    sm_count = (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda"
                else 4)

    doc_codecs, per_codec, comparison = {}, {}, {}
    for name in args.codecs:
        def timer(tensor, config):  # (compress s, decompress s) of this codec
            return time_codec(name, tensor, config, backend, plan["repeats"])[:2]

        x = make_tensor(plan["tune_bytes"], 0.5, torch.float32, "blocky", device, seed=args.seed)
        bar = _bar(f"tune {name}", args.init_probes + args.guided_probes, show)

        def objective(config: LaunchConfig) -> float:
            bar.update(1)
            return sum(timer(x, config))

        tuned = bayes_tune(objective, init_points=args.init_probes, n_iter=args.guided_probes, seed=args.seed)
        per_codec[name] = tuned.to_dict()
        if args.compare:
            results = [tuned, random_search(objective, budget=len(tuned.evaluations), seed=args.seed),
                       expert(objective, sm_count)]
            if args.full_grid:
                results.append(grid_search(objective))
            comparison[name] = {r.method: r.to_dict() for r in results}
        bar.close()
        del x

        times = {"compress": [], "decompress": []}
        with _bar(f"time {name}", len(sizes), show) as bar:
            for i, (size, sparsity) in enumerate(zip(sizes, sparsities)):
                sample = make_tensor(int(size), float(sparsity), torch.float32, "blocky", device,
                                     seed=args.seed + i)
                c, d = timer(sample, tuned.best)
                times["compress"].append(c)
                times["decompress"].append(d)
                bar.update(1)
        entry = {"backend": backend, "config": {"grid": tuned.best.grid, "block": tuned.best.block}, "rae": {}}
        nbytes = sizes // 4 * 4  # make_tensor rounds down to whole float32 elements
        for direction, ys in times.items():
            ys = np.asarray(ys)
            train = (nbytes[~test_mask], sparsities[~test_mask], ys[~test_mask])
            test = (nbytes[test_mask], sparsities[test_mask], ys[test_mask])
            entry["rae"][direction] = compare_regressors(train, test, n_submodels=args.submodels, seed=args.seed)
            entry[direction] = TimeModel(args.submodels).fit(nbytes, sparsities, ys).to_dict()
        doc_codecs[name] = entry

    host_s = host_seconds_per_tensor(device, **({"steps": 4, "rounds": 2, "warmup": 2} if args.quick else {}))

    import triton

    doc = {
        "schema_version": SCHEMA_VERSION,
        "device": _device_info(device),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cswap": __version__},
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": bool(args.quick),
        "bandwidth": bandwidth,
        **({} if host_s is None else {"runtime": {"host_us_per_tensor": 1e6 * host_s}}),
        "codecs": doc_codecs,
        "tuning": {"wall_s": time.perf_counter() - start, "method": "bayes", "per_codec": per_codec,
                   "comparison": comparison or None},
    }
    path = save_profile(doc, args.out or profile_path(device))
    lines += _summary(doc, comparison)
    return doc, path, lines


def _summary(doc: dict, comparison: dict) -> list[str]:
    bw = doc["bandwidth"]
    lines = [f"device: {doc['device']['name']} ({doc['device']['type']}); "
             f"D2H {bw['d2h_gbps']:.1f} GB/s, H2D {bw['h2d_gbps']:.1f} GB/s "
             f"({'pinned' if bw['pinned'] else 'pageable'})",
             f"{'codec':<6} {'grid':>6} {'block':>6} {'best ms':>9} {'RAE c':>7} {'RAE d':>7} {'probes':>7}"]
    for name, entry in doc["codecs"].items():
        tuned = doc["tuning"]["per_codec"][name]
        lines.append(f"{name:<6} {entry['config']['grid']:>6} {entry['config']['block']:>6} "
                     f"{1e3 * tuned['best_seconds']:>9.3f} {100 * entry['rae']['compress']['linear']:>6.1f}% "
                     f"{100 * entry['rae']['decompress']['linear']:>6.1f}% {tuned['evaluations']:>7}")
    if comparison:
        lines.append("search comparison (paper Fig. 12): best compress+decompress ms / probes / wall s")
        for name, methods in comparison.items():
            cells = [f"{m} {1e3 * r['best_seconds']:.3f} / {r['evaluations']} / {r['wall_s']:.1f}"
                     for m, r in methods.items()]
            lines.append(f"  {name:<5} " + "; ".join(cells))
        lines.append("regressor RAE on held-out samples (paper Fig. 10), compress | decompress:")
        for name, entry in doc["codecs"].items():
            cells = [f"{reg} {100 * entry['rae']['compress'][reg]:.1f}% | "
                     f"{100 * entry['rae']['decompress'][reg]:.1f}%" for reg in entry["rae"]["compress"]]
            lines.append(f"  {name:<5} " + "; ".join(cells))
    if "runtime" in doc:
        lines.append(f"training thread per offloaded tensor: {doc['runtime']['host_us_per_tensor']:.0f} us "
                     f"(cswap vdnn against unpatched; the planners count it)")
    else:
        lines.append("training thread per offloaded tensor: not measured (the machine was too busy to tell it "
                     f"from noise); the planners use {1e6 * HOST_S_PER_TENSOR:.0f} us. Run cswap-tune again "
                     "on a quiet machine to measure it")
    lines.append(f"tuning wall time: {doc['tuning']['wall_s']:.1f} s")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        _, path, lines = run(args)
    except KeyboardInterrupt:
        print("cswap-tune: interrupted; no profile written", file=sys.stderr)
        return 130
    except Exception as exc:  # one clear line, not a traceback, for expected failures
        print(f"cswap-tune: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    print(f"profile written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
