"""One training step per mode under torch.profiler: where a step's time goes, on a GPU.

For each run of benchmarks/twin.py (VGG16 at CIFAR shape, batch 2560; at ImageNet shape,
batch 64) and each mode (unpatched, vdnn, sc, cswap), four warm-up steps (common.SETTLE_STEPS:
until 2026-12-05 three, so the step profiled was the one that freed idle pinned buffers) and then one
step profiled with every thread recorded: the device's kernels and copies on each stream
(CUDA activity), cswap's stages on each host thread as `cswap.<stage>` ranges
(cswap.runtime.trace: pack, encode, send, release, unpack, prefetch, restore), and the
host's CUDA synchronisations. Written as gzipped Chrome traces (open them in
chrome://tracing or https://ui.perfetto.dev), with a CUDA memory snapshot of the step
(torch.cuda.memory._dump_snapshot: every allocation with its stack, the peak among them;
open it in https://pytorch.org/memory_viz) and a summary of each step, with what the step
holds at its peak by where it was allocated (benchmarks/memory_peak.py).

    python benchmarks/trace.py                          # GPU: both runs, every mode
    python benchmarks/trace.py --runs cifar --modes sc  # one
    python benchmarks/trace.py --quick                  # CPU smoke run: a small batch on the emulated device

Results under benchmarks/results/<device>/trace/: trace-<run>-<mode>.json.gz,
memory-<run>-<mode>.pickle.gz and trace.json (per step: wall ms, peak allocated and
reserved MiB, cswap's counters).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import pickle
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import cswap
from cswap.runtime.trace import on_every_thread

import memory_peak
from common import RESULTS, SETTLE_STEPS, device_slug, environment, synchronize
from twin import MODES, RUNS, _model_and_batch

_MIB = 2 ** 20


def profiled_step(run: dict, mode: str, device: torch.device, out: Path, quick: bool) -> dict:
    """Warm-up steps, then one step profiled (and its memory recorded on CUDA); its summary."""
    run = dict(run, scale=run["scale"] if quick else 1)
    model, x, y = _model_and_batch(run)
    model, x, y = model.to(device), x.to(device), y.to(device)
    if mode != "unpatched":
        cswap.patch(model, mode=mode, verbose=False, min_bytes=0 if quick else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    cuda = device.type == "cuda"
    for _ in range(SETTLE_STEPS):
        step()
    synchronize(device)
    if mode != "unpatched":
        cswap.stats(model).reset()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=cuda)
    name = f"{run['name']}-{mode}"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        # (Python stacks only, and a bounded history: the session brings back 16 MiB a file)
        torch.cuda.memory._record_memory_history(max_entries=20_000, stacks="python")
    with torch.profiler.profile(activities=activities, experimental_config=config) as prof, on_every_thread():
        start = time.perf_counter()
        step()
        synchronize(device)
        wall = time.perf_counter() - start
    summary = {"run": run["name"], "mode": mode, "batch": x.shape[0], "wall_ms": 1e3 * wall}
    if cuda:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        with gzip.open(out / f"memory-{name}.pickle.gz", "wb") as f:  # (as _dump_snapshot writes it)
            pickle.dump(snapshot, f)
        summary.update(peak_allocated_mib=torch.cuda.max_memory_allocated(device) / _MIB,
                       peak_reserved_mib=torch.cuda.max_memory_reserved(device) / _MIB)
        try:  # (first read of a real snapshot: a surprise in it must not cost the stage's other runs)
            summary["at_peak"] = memory_peak.replay(snapshot, torch.cuda.current_device())
        except Exception as exc:  # (the snapshot is saved: memory_peak.py reads it again)
            summary["at_peak_error"] = repr(exc)
    _gzip_to(out / f"trace-{name}.json.gz", prof.export_chrome_trace)
    summary["ranges"] = sorted({e.name for e in prof.events() if e.name.startswith("cswap.")})
    if mode != "unpatched":
        summary["stats"] = {k: v for k, v in cswap.stats(model).items()}
        cswap.unpatch(model)
    return summary


def _gzip_to(path: Path, write) -> None:
    """write(plain path), then gzip it to `path`."""
    plain = path.with_suffix("")
    write(str(plain))
    with open(plain, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    plain.unlink()


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--modes", nargs="+", choices=["unpatched", *MODES], default=["unpatched", "vdnn", "sc", "cswap"])
    p.add_argument("--quick", action="store_true", help="on the CPU: each run at the twin's small batch, emulated")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<device>/trace)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    out = args.out or RESULTS / device_slug(device) / "trace"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    device_block = cswap.testing.emulated_device(bandwidth_gbps=1.0) if device.type == "cpu" else \
        contextlib.nullcontext()
    with warnings.catch_warnings(), device_block:
        warnings.simplefilter("ignore")
        for name in args.runs:
            for mode in args.modes:
                row = profiled_step(dict(RUNS[name], name=name), mode, device, out, args.quick)
                rows.append(row)
                print(f"{name:<9} {mode:<10} {row['wall_ms']:9.1f} ms  "
                      f"{row.get('peak_allocated_mib', float('nan')):8.0f} MiB  {', '.join(row['ranges'])}",
                      flush=True)
                if "at_peak" in row:
                    print(memory_peak.report(row["at_peak"]), flush=True)
    (out / "trace.json").write_text(json.dumps({"environment": environment(device), "rows": rows}, indent=1,
                                               default=str))
    print(f"# wrote {out}: traces, memory snapshots and trace.json")
    return rows


if __name__ == "__main__":
    main()
