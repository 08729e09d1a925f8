"""Soak benchmark: a long "cswap"-mode training run whose memory must stay flat after warm-up.

A swapper that leaks a little per step (a host buffer never returned to the pool, a
restored tensor still referenced, a per-tensor record never dropped) passes every short
test and fails only after hours of training. This run trains a small CNN with
`cswap.patch(model, mode="cswap")` for --iterations steps (SGD, synthetic or digits data as
cswap-train loads it, a re-decision by `cswap.epoch_end(model)` every --epoch-every steps so
that the advisor's decisions and the profiler's samples are refreshed too) and every
--every steps, after gc.collect(), samples:

    rss_bytes              this process's resident memory (VmRSS of /proc/self/status)
    host_pool_bytes        the swapper's host buffer pool, cswap.stats(model)["host_pool_bytes"]
                           (pinned memory on CUDA)
    gpu_allocated_bytes    torch.cuda.memory_allocated between steps (CUDA only)
    gpu_window_peak_bytes  torch.cuda.max_memory_allocated since the previous sample (CUDA only;
                           the peak counter is reset after each sample)
    gpu_reserved_bytes     torch.cuda.memory_reserved: the caching allocator's footprint (CUDA only)
    python_objects         objects the garbage collector tracks
    live_tensors           of those, torch.Tensor objects
    threads                threading.active_count()
    offloaded_tensors, compressed_tensors, restored_tensors, served_from_device, offloaded_bytes,
                           transferred_bytes, kept_on_gpu, payload_overflow
                           cswap.stats(model) counters, cumulative

The verdict compares, for each series, the last sample with the first one at or after
--warmup steps (growth in bytes or count, and in per cent of the first). The host pool,
GPU memory, live tensors and threads must not grow at all (tolerance 0 by default): in
steady state every step reuses the same buffers. RSS and the object count get a
tolerance (--rss-tolerance-mib, --objects-tolerance) for allocator and interpreter noise.
It also checks that every post-warm-up window offloaded tensors and kept none on the
device (the swap did not quietly stop, e.g. at the host memory limit). The process exits
with 1 when a check fails.

Warm-up: the pool acquires a buffer per size class the first time it meets that class
(each batch shape, the partial last batch of a pass included), and decisions may change
at the first epoch ends; the default warm-up (2 x --epoch-every = 200 steps) covers two
re-decisions and, at the default batch sizes, more than one pass over the data (a note
is printed when it does not). With compression the sizes sent vary from step to step
with the sparsity: the pool serves a request from an idle buffer of up to twice its
size, and at each epoch end gives back buffers the epoch did not use
(cswap/host_pool.py), so a size class first met after warm-up can add one buffer until
the next epoch end. The pool is therefore judged bounded rather than constant: after
warm-up it must never exceed its warm-up peak (the largest sample up to and including
the first post-warm-up one, plus --pool-tolerance-mib). A leaked
buffer also shows in the live tensors, whose tolerance is 0.

    python benchmarks/soak.py                        # 1000 steps, sample every 50 (GPU when there is one)
    python benchmarks/soak.py --quick                # CPU smoke: 400 steps, batch 16
    python benchmarks/soak.py --codec zvc            # force ZVC on every candidate (the CPU profile
                                                     # compresses nothing, so this exercises compression)

Results: a printed table and verdict; CSV (the samples) and JSON (environment, args,
samples, verdict) with stem "soak" (or "soak-quick") under benchmarks/results/<device>/.
On a CPU the pool is pageable memory and there is no GPU series; the run still shows that
nothing the swapper keeps grows.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import cswap
from cswap.models import build, names
from cswap.models.data import load_data

from common import environment, format_row, synchronize, write_results

MiB = 1 << 20
QUIET = ("cswap: offloading CPU tensors", "cswap: no profile for this device")
COUNTERS = ("offloaded_tensors", "compressed_tensors", "restored_tensors", "served_from_device", "offloaded_bytes",
            "transferred_bytes", "kept_on_gpu", "payload_overflow")
GPU_SERIES = ("gpu_allocated_bytes", "gpu_window_peak_bytes", "gpu_reserved_bytes")


# -- sampling ---------------------------------------------------------------------------------------------


def rss_bytes() -> tuple[int, str]:
    """(resident memory now, where it came from). /proc gives the current RSS; elsewhere
    getrusage gives only the peak (which cannot shrink, so it still shows growth)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024, "VmRSS"
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024), "ru_maxrss"


def take_sample(iteration: int, model, device: torch.device, start: float, loss: float | None) -> dict:
    """One row of the soak: memory series and swap counters, between two steps."""
    gc.collect()  # garbage in reference cycles is not a leak: collect it so that it does not look like one
    objects = gc.get_objects()
    with warnings.catch_warnings():  # isinstance() on deprecated torch aliases warns
        warnings.simplefilter("ignore")
        tensors = sum(1 for o in objects if isinstance(o, torch.Tensor))
    rss, rss_source = rss_bytes()
    stats = cswap.stats(model)
    row = {"iteration": iteration, "elapsed_s": time.perf_counter() - start, "loss": loss,
           "rss_bytes": rss, "rss_source": rss_source, "host_pool_bytes": stats["host_pool_bytes"],
           "peak_host_pool_bytes": stats["peak_host_pool_bytes"], "python_objects": len(objects),
           "live_tensors": tensors, "threads": threading.active_count(), **{k: stats[k] for k in COUNTERS}}
    del objects
    if device.type == "cuda":
        synchronize(device)
        row.update(gpu_allocated_bytes=torch.cuda.memory_allocated(device),
                   gpu_window_peak_bytes=torch.cuda.max_memory_allocated(device),
                   gpu_reserved_bytes=torch.cuda.memory_reserved(device))
        torch.cuda.reset_peak_memory_stats(device)  # the next sample's peak covers its own window only
    return row


# -- the run ----------------------------------------------------------------------------------------------


def _force_codec(codec: str):
    """--codec: a policy(info) -> codec that compresses every candidate, whatever the advisor would decide."""
    def policy(info):
        return codec
    return policy


def _keep_activations(model, kept: list) -> list:
    """--inject-leak: forward hooks that keep every ReLU/pool output alive, as a swapper that
    never drops the tensors it restores would (the detector must flag it). Returns the handles."""
    kinds = (torch.nn.ReLU, torch.nn.MaxPool2d, torch.nn.AvgPool2d)
    return [m.register_forward_hook(lambda mod, args, out: kept.append(out.detach()))
            for m in model.modules() if isinstance(m, kinds)]


def soak(args, device: torch.device) -> list[dict]:
    """Train for args.iterations steps; a sample (take_sample) before the first step and every args.every."""
    torch.manual_seed(args.seed)
    x_train, y_train, _, _, classes = load_data(args.data, 32, args.seed, args.samples)
    steps_per_pass = -(-len(y_train) // args.batch_size)
    if args.warmup < steps_per_pass:
        print(f"# note: warm-up ({args.warmup} steps) is shorter than one pass over the data ({steps_per_pass} "
              f"steps): the buffers of its partial last batch will count as growth", flush=True)
    model = build(args.model, dataset="cifar10", num_classes=classes).to(device)
    policy = _force_codec(args.codec) if args.codec else None
    kept: list[torch.Tensor] = []
    handles = _keep_activations(model, kept) if args.inject_leak else []
    rows = []
    with warnings.catch_warnings():
        for text in QUIET:
            warnings.filterwarnings("ignore", message=text)
        cswap.patch(model, mode="cswap", policy=policy, verbose=False, profile=args.profile)
        try:
            optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
            gen = torch.Generator().manual_seed(args.seed)
            order, cursor = torch.randperm(len(y_train), generator=gen), 0
            start = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            rows.append(take_sample(0, model, device, start, None))
            print_row(rows[-1])
            for step in range(1, args.iterations + 1):
                if cursor >= len(order):  # a new pass over the data, reshuffled; its last batch may be partial
                    order, cursor = torch.randperm(len(y_train), generator=gen), 0
                idx = order[cursor:cursor + args.batch_size]
                cursor += args.batch_size
                xb, yb = x_train[idx].to(device), y_train[idx].to(device)
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                optimizer.step()
                del xb, yb
                if step % args.epoch_every == 0:
                    cswap.epoch_end(model, {"loss": float(loss.detach())})
                if step % args.every == 0 or step == args.iterations:
                    rows.append(take_sample(step, model, device, start, float(loss.detach())))
                    print_row(rows[-1])
                del loss
        finally:
            cswap.unpatch(model)
            for h in handles:
                h.remove()
    return rows


# -- verdict ----------------------------------------------------------------------------------------------


def tolerances(args) -> dict[str, int]:
    """Series judged for growth after warm-up, and how much each may grow (bytes or count)."""
    tol = {"rss_bytes": int(args.rss_tolerance_mib * MiB), "host_pool_bytes": int(args.pool_tolerance_mib * MiB),
           "python_objects": args.objects_tolerance, "live_tensors": args.tensors_tolerance, "threads": 0}
    tol.update({name: int(args.gpu_tolerance_mib * MiB) for name in GPU_SERIES})
    return tol


def verdict(rows: list[dict], warmup: int, tolerance: dict[str, int]) -> dict:
    """Growth of each series from the first sample at or after `warmup` steps to the last, against
    its tolerance; plus whether every post-warm-up window offloaded tensors and kept none in place."""
    steady = [r for r in rows if r["iteration"] >= warmup]
    if len(steady) < 2:
        raise ValueError(f"soak: need at least 2 samples at or after warm-up step {warmup}, got {len(steady)} "
                         f"(raise --iterations or lower --warmup / --every)")
    first, last = steady[0], steady[-1]
    series = []
    for name, tol in tolerance.items():
        if first.get(name) is None:
            continue  # not measured here (GPU series on a CPU)
        values = [r[name] for r in steady]
        growth = last[name] - first[name]
        ok = growth <= tol
        entry = {"series": name, "first": first[name], "last": last[name], "min": min(values), "max": max(values),
                 "growth": growth,
                 "growth_pct": 100.0 * growth / first[name] if first[name] else (0.0 if growth == 0 else None),
                 "tolerance": tol}
        if name == "host_pool_bytes":  # bounded by what warm-up needed (see the module docstring)
            entry["warmup_peak"] = max([r[name] for r in rows if r["iteration"] < warmup] + [first[name]])
            ok = max(values) <= entry["warmup_peak"] + tol
        series.append(dict(entry, ok=ok))
    windows = list(zip(steady, steady[1:]))
    offloaded = [b["offloaded_tensors"] - a["offloaded_tensors"] for a, b in windows]
    kept = [b["kept_on_gpu"] - a["kept_on_gpu"] for a, b in windows]
    swapping = {"offloaded_per_window": offloaded, "kept_on_gpu_per_window": kept,
                "compressed_tensors": last["compressed_tensors"],
                "ok": all(n > 0 for n in offloaded) and not any(kept)}
    return {"warmup": warmup, "first_iteration": first["iteration"], "last_iteration": last["iteration"],
            "series": series, "swapping": swapping, "ok": all(s["ok"] for s in series) and swapping["ok"]}


# -- output -----------------------------------------------------------------------------------------------

COLUMNS = [
    ("iteration", "iter", "{}"), ("elapsed_s", "s", "{:.1f}"), ("loss", "loss", "{:.3f}"),
    ("rss_mib", "rss MiB", "{:.2f}"), ("pool_mib", "pool MiB", "{:.3f}"),
    ("gpu_alloc_mib", "gpu MiB", "{:.2f}"), ("gpu_peak_mib", "peak MiB", "{:.2f}"),
    ("gpu_reserved_mib", "resv MiB", "{:.1f}"), ("python_objects", "objects", "{}"),
    ("live_tensors", "tensors", "{}"), ("threads", "thr", "{}"), ("offloaded_tensors", "offloaded", "{}"),
    ("compressed_tensors", "compressed", "{}"), ("restored_tensors", "restored", "{}"),
    ("served_from_device", "served", "{}"),
]
WIDTHS = [6, 6, 6, 9, 9, 9, 9, 9, 8, 8, 4, 10, 11, 9, 7]
_MIB_COLUMNS = {"rss_mib": "rss_bytes", "pool_mib": "host_pool_bytes", "gpu_alloc_mib": "gpu_allocated_bytes",
                "gpu_peak_mib": "gpu_window_peak_bytes", "gpu_reserved_mib": "gpu_reserved_bytes"}


def print_row(row: dict | None = None) -> None:
    if row is not None:
        row = dict(row, **{k: row[v] / MiB for k, v in _MIB_COLUMNS.items() if row.get(v) is not None})
    print(format_row(COLUMNS, WIDTHS, row), flush=True)


def print_verdict(result: dict) -> None:
    print(f"# growth from step {result['first_iteration']} (first sample after {result['warmup']} warm-up steps) "
          f"to step {result['last_iteration']}:")
    for s in result["series"]:
        scale = MiB if s["series"].endswith("_bytes") else 1
        unit = " MiB" if scale == MiB else ""
        pct = "n/a" if s["growth_pct"] is None else f"{s['growth_pct']:+.2f}%"
        print(f"#   {s['series']:22} {s['first'] / scale:12.3f}{unit} -> {s['last'] / scale:12.3f}{unit}   "
              f"growth {s['growth'] / scale:+.3f}{unit} ({pct}; {s['growth']:+d} raw), "
              f"tolerance {s['tolerance'] / scale:g}{unit}"
              + (f", post-warm-up max {s['max'] / scale:.3f}{unit} vs warm-up peak {s['warmup_peak'] / scale:.3f}{unit}"
                 if "warmup_peak" in s else "")
              + f": {'ok' if s['ok'] else 'GROWS'}")
    sw = result["swapping"]
    print(f"#   offloaded per window {sw['offloaded_per_window']}, kept in place {sw['kept_on_gpu_per_window']}, "
          f"{sw['compressed_tensors']} compressed in all: {'ok' if sw['ok'] else 'SWAP STOPPED'}")
    print(f"# verdict: {'flat after warm-up' if result['ok'] else 'FAIL: memory grows or swapping stopped'}",
          flush=True)


# -- command line ------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU smoke: 400 steps, batch 16 (explicit options win)")
    p.add_argument("--iterations", type=int, help="training steps (default 1000, quick 400)")
    p.add_argument("--every", type=int, default=50, help="sample every N steps (default 50)")
    p.add_argument("--warmup", type=int, help="steps before the flatness check starts; cover at least one pass "
                                              "over the data (default 2 x --epoch-every)")
    p.add_argument("--epoch-every", type=int, default=100,
                   help="call cswap.epoch_end(model) every N steps: the advisor re-decides (default 100)")
    p.add_argument("--model", default="small_cnn", choices=names())
    p.add_argument("--data", default="synthetic", help="synthetic or digits (see cswap-train), or an .npz file")
    p.add_argument("--samples", type=int, help="synthetic data: number of images (default 2048)")
    p.add_argument("--batch-size", type=int, help="default 64 (cswap-train's), quick 16")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (momentum 0.9)")
    p.add_argument("--codec", choices=cswap.codecs.names(),
                   help="force this codec on every candidate (a policy) instead of the advisor's decisions")
    p.add_argument("--profile", type=Path, help="device profile for the advisor (default: this device's)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1, ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch.set_num_threads for the run (default: torch's); 1 keeps a "
                                                "CPU run steady on a busy machine (memory, not speed, is measured)")
    p.add_argument("--rss-tolerance-mib", type=float, default=8.0,
                   help="RSS growth allowed after warm-up, for allocator noise (default 8 MiB)")
    p.add_argument("--pool-tolerance-mib", type=float, default=0.0, help="host pool growth allowed (default 0)")
    p.add_argument("--gpu-tolerance-mib", type=float, default=0.0,
                   help="growth allowed for each GPU series (allocated, window peak, reserved; default 0)")
    p.add_argument("--objects-tolerance", type=int, default=500,
                   help="growth allowed in gc-tracked Python objects (default 500)")
    p.add_argument("--tensors-tolerance", type=int, default=0, help="growth allowed in live tensors (default 0)")
    p.add_argument("--inject-leak", action="store_true",
                   help="keep every ReLU/pool output alive (a deliberate leak: the verdict must fail)")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<device>)")
    args = p.parse_args(argv)
    args.iterations = args.iterations or (400 if args.quick else 1000)
    args.batch_size = args.batch_size or (16 if args.quick else 64)
    args.warmup = 2 * args.epoch_every if args.warmup is None else args.warmup
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    for name in ("iterations", "every", "epoch_every", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.warmup + args.every > args.iterations:
        p.error(f"--warmup {args.warmup} leaves fewer than 2 samples in {args.iterations} steps sampled every "
                f"{args.every}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available; use --device cpu")
    return args


def main(argv=None) -> dict:
    """Run the soak; returns {"rows": samples, "verdict": ..., "path": results folder}."""
    args = parse_args(argv)
    device = torch.device(args.device)
    env = environment(device, rss_source=rss_bytes()[1])
    what = f"codec {args.codec} forced" if args.codec else "the advisor decides"
    print(f"# cswap soak: {args.model} on {args.data}, batch {args.batch_size}, mode cswap ({what}), "
          f"{args.iterations} steps sampled every {args.every}, epoch_end every {args.epoch_every}, warm-up "
          f"{args.warmup}, on {env['device']}; torch {env['torch']}"
          + ("; LEAK INJECTED" if args.inject_leak else ""), flush=True)
    print_row()
    threads = torch.get_num_threads()
    try:
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        rows = soak(args, device)
    finally:
        torch.set_num_threads(threads)
    result = verdict(rows, args.warmup, tolerances(args))
    print_verdict(result)
    stem = "soak-quick" if args.quick else "soak"
    out = write_results(rows, env, args, args.out, device, stem)
    doc = json.loads((out / f"{stem}.json").read_text())
    doc["verdict"] = result  # beside the samples, so a committed run says what it showed
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    return {"rows": rows, "verdict": result, "path": out}


if __name__ == "__main__":
    sys.exit(0 if main()["verdict"]["ok"] else 1)
