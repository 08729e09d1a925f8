"""The H200's training runs replayed on this CPU by the timed twin (cswap.runtime.twin).

The one GPU measurement of training (benchmarks/results/nvidia-h200/, 2026-11-26) ran VGG16,
fp32, SGD, in two shapes:

    cifar     CIFAR-10 shape, batch 2560 (benchmarks/train.py; session-final.log)
    imagenet  ImageNet shape, batch 64   (benchmarks/runtime.py; runtime.csv)

Here each runs at a batch this CPU can train (`--scale`: 80 and 32 times smaller) on the
timed twin of that H200 (cswap.testing.timed_twin with TwinSpec.measured(): its link and
codecs as measured there, compute by the roofline, every device byte and FLOP counted
`scale` times). Compute is calibrated once per run: the roofline's op times are scaled so
that the unpatched step takes what the H200 measured. Then every mode trains a few steps,
and its step time is reported as a multiple of unpatched, beside the H200's multiple;
"exposed ms" is the step time less unpatched's (the swapping compute did not hide); "peak
MiB" the most device memory the twin saw held by saved activations and cswap's buffers
(weights, gradients and the optimizer's state are not among them).

    python benchmarks/twin.py                       # this tree's cswap, both runs
    python benchmarks/twin.py --commit c01d24c      # the runtime the H200 measured, on the same twin
    python benchmarks/twin.py --runs cifar --modes vdnn sc --steps 2
    python benchmarks/twin.py --table               # cswap/data/twin-nvidia-h200.json from codecs.csv
    python benchmarks/twin.py --gpu                 # on a GPU: the runs measured there (the headline stage)

With --commit, the commit's cswap is extracted (git archive) and run in a subprocess, with
this tree's emulator, seam and twin put in its place (the seam's calls are the same; where
the commit's runtime does not say what its device work is, `LegacyTimedDevice` reads it off
the work itself). Results: a table, and CSV + JSON under benchmarks/results/twin/.
Every figure the twin prints is a prediction of the twin, not a measurement.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "twin"
H200 = ROOT / "benchmarks" / "results" / "nvidia-h200"
TABLE = ROOT / "cswap" / "data" / "twin-nvidia-h200.json"
SWEEP = H200 / "gpu-2026-12-04" / "codecs"  # the codec sweep the table is made from (the kernels of 8c7f6ba)
MODES = ("none", "vdnn", "sc", "cswap")

# What the H200 measured, ms per step: benchmarks/results/nvidia-h200/headline.csv (this
# script's --gpu, 2026-12-04, at commit 8c7f6ba, whose decode still made the host sync
# --pageable-verdict replays). The first measurement (2026-11-26, commits c01d24c and 8439791:
# cifar 41.3 / 122.6 / 117.3 / 117.1 ms, imagenet 47.64 / 47.66 / 142.76 / 146.71 / 139.76)
# is in that folder's README.
RUNS = {
    "cifar": dict(model="vgg16", dataset="cifar10", batch=2560, scale=80, measured_commit="8c7f6ba",
                  measured_ms={"unpatched": 41.3, "none": 41.3, "vdnn": 111.6, "sc": 117.0, "cswap": 107.0}),
    "imagenet": dict(model="vgg16", dataset="imagenet", batch=64, scale=32, measured_commit="8c7f6ba",
                     measured_ms={"unpatched": 47.5, "none": 47.6, "vdnn": 133.5, "sc": 126.6, "cswap": 117.7}),
}


def make_table(out: Path = TABLE) -> dict:
    """The twin's figures for the H200 from its latest measured codec sweep (SWEEP): the
    pinned link's bandwidth and latency (a line through the copies timed at the smallest and
    largest size) and each codec's compress and decompress times (fp32 and bf16, blocky
    zeros), compress on the runtime's path (`launch_ms`: no size read back) where the codec
    has one."""
    rows = list(csv.DictReader(open(SWEEP / "codecs.csv")))
    env = json.loads((SWEEP / "codecs.json").read_text())["environment"]
    good = [r for r in rows if not r.get("error") and r.get("compress_ms")]
    link = {}
    for direction in ("d2h", "h2d"):
        timed = sorted({(int(r["bytes"]), float(r[f"{direction}_ms"]) / 1e3) for r in good})
        (b0, t0), (b1, t1) = timed[0], timed[-1]
        rate = (b1 - b0) / (t1 - t0)
        link[f"{direction}_bytes_per_s"] = round(rate)
        link.setdefault("latency_s", [])
        link["latency_s"].append(t0 - b0 / rate)
    link["latency_s"] = round(statistics.mean(link["latency_s"]), 9)
    codecs = [{"codec": r["provider"], "itemsize": 2 if r["dtype"] == "bf16" else 4, "pattern": r["pattern"],
               "sparsity": float(r["sparsity"]), "bytes": int(r["bytes"]),
               "compress_ms": float(r.get("launch_ms") or r["compress_ms"]), "decompress_ms": float(r["decompress_ms"])}
              for r in good]
    doc = {"what": "the timed twin's figures for this GPU (cswap.runtime.twin.TwinSpec.measured)",
           "gpu": "h200", "device": env["device"], "date": env["date"][:10],
           "versions": {k: env[k] for k in ("torch", "triton", "cuda")},
           "source": f"{SWEEP.relative_to(ROOT)}/codecs.csv (compress: launch_ms where measured), by "
                     "benchmarks/twin.py --table",
           "link": link, "codecs": codecs}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"# wrote {out}: link {link}, {len(codecs)} codec rows")
    return doc


def scaled_profile(cswap, scale: float):
    """The device profile the advisor reads, for tensors `scale` times smaller than the
    run's: bandwidths divided and per-byte coefficients multiplied by scale (the fixed time
    per call unchanged), so it decides on a small tensor as on the one it stands for."""
    profile = cswap.load_profile()
    doc = json.loads(profile.to_json())
    for name in ("d2h_gbps", "h2d_gbps"):
        doc["bandwidth"][name] /= scale
    for codec in doc["codecs"].values():
        for direction in ("compress", "decompress"):
            model = codec[direction]
            if model.get("kind") != "piecewise_linear":
                raise SystemExit(f"twin: cannot scale a {model.get('kind')} time model")
            for sub in model["submodels"]:
                sub["coef"] = [c * scale for c in sub["coef"]]
    path = Path(tempfile.mkdtemp()) / "profile-scaled.json"
    path.write_text(json.dumps(doc))
    return cswap.load_profile(path)


def legacy_device():
    """A TimedDevice for a runtime that does not say what its device work is (before
    cswap.runtime.device.Work): the work is read off the function the runtime queues (its
    closure holds the item being compressed, or the decoder and header)."""
    from cswap.runtime.device import Work
    from cswap.runtime.twin import TimedDevice

    def cells(fn) -> dict:
        return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ())}

    def read_off(fn, work):
        if work is not None:
            return work
        found = cells(fn)
        item = found.get("item")
        if item is not None:  # offload: _prepare(item, src, stream)
            info = item.info
            kind = "encode" if item.codec is not None else "gather"
            return Work(kind, item.codec, info.nbytes, info.dtype.itemsize)
        header = found.get("header")
        if header is not None:  # restore: the decoder
            return Work("decode", header.codec, header.shape.numel() * header.dtype.itemsize, header.dtype.itemsize)
        if "check" in fn.__code__.co_name or "checksum" in str(fn.__code__.co_names):
            return None
        return None

    class LegacyTimedDevice(TimedDevice):
        def launch(self, stream, fn, reads=(), writes=(), work=None, scratch_bytes: int = 0) -> None:
            super().launch(stream, fn, reads, writes, read_off(fn, work), scratch_bytes)

        def call(self, stream, fn, reads=(), writes=(), scratch_bytes: int = 0, work=None):
            return super().call(stream, fn, reads, writes, scratch_bytes, read_off(fn, work))

    return LegacyTimedDevice


def train(run: dict, mode: str, compute_factor: float, args) -> dict:
    """Steps of one mode on a fresh twin: virtual ms per step and what the twin saw."""
    import cswap
    from cswap.runtime.emulator import activate
    from cswap.runtime.twin import ComputeClock, TwinSpec

    scale = run["scale"]
    spec = TwinSpec.measured(TABLE_IN_TREE, scale=scale, compute_factor=compute_factor, sm_share=args.sm_share,
                             host_scale=args.host_scale)
    dev = legacy_device()(spec)
    model, x, y = _model_and_batch(run)
    batch = x.shape[0]
    if mode != "unpatched":
        options = dict(mode=mode, verbose=False, min_bytes=max(1, (1 << 20) // scale))
        if mode == "cswap":
            options["profile"] = scaled_profile(cswap, scale)
        cswap.patch(model, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    times, phases, busy, blocked, host_scales, peaks = [], [], [], [], [], []
    with activate(dev), ComputeClock(dev, model):
        for i in range(args.warmup + args.steps):
            if i == args.warmup and mode != "unpatched":
                cswap.stats(model).reset()
            dev.synchronize()
            dev.reset_peak()  # (each step's own peak)
            host_scales.append(dev.calibrate_host())  # (this CPU's speed swings: a host of one speed)
            t0, busy0, blocked0 = dev.now(), dict(dev.busy_s), dict(dev.blocked_s)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            forward = dev.record_event(dev.compute_stream())  # (when compute finishes the forward)
            loss.backward()
            backward = dev.record_event(dev.compute_stream())
            optimizer.step()
            dev.synchronize()
            if i >= args.warmup:
                times.append(dev.now() - t0)
                phases.append((forward.at - t0, backward.at - forward.at))
                busy.append({k: v - busy0.get(k, 0.0) for k, v in dev.busy_s.items()})
                blocked.append({k: v - blocked0.get(k, 0.0) for k, v in dev.blocked_s.items()})
                peaks.append(dev.peak_bytes * scale / 2**20)
        stats = dict(cswap.stats(model)) if mode != "unpatched" else {}
    dev.close()
    middle = times.index(statistics.median_low(times))
    row = {"run": args.run_name, "mode": mode, "batch": run["batch"], "twin_batch": batch, "scale": scale,
           "step_ms": 1e3 * times[middle], "steps_ms": [round(1e3 * t, 2) for t in times],
           "forward_ms": 1e3 * phases[middle][0], "backward_ms": 1e3 * phases[middle][1],
           "compute_ms": 1e3 * busy[middle].get("compute", 0.0), "d2h_ms": 1e3 * busy[middle].get("d2h", 0.0),
           "h2d_ms": 1e3 * busy[middle].get("h2d", 0.0),
           # (the codec stream; runtimes before it had compress and decode streams)
           "codec_ms": 1e3 * sum(busy[middle].get(s, 0.0) for s in ("codec", "compress", "decode")),
           "host_blocked_ms": 1e3 * blocked[middle].get("MainThread", 0.0),
           "worker_blocked_ms": 1e3 * blocked[middle].get("cswap-offload", 0.0),
           "hazards": len(dev.hazards),
           "host_scale": statistics.median(host_scales),  # (this CPU's time x this: the host's)
           # the device bytes the twin tracks (saved activations, cswap's buffers), at full scale
           "peak_saved_mib": max(peaks), "peaks_saved_mib": [round(p) for p in peaks]}
    if stats:
        steps = args.steps
        row.update(moved_mib_per_step=stats["transferred_bytes"] * scale / steps / 2**20,
                   compressed_per_step=stats["compressed_tensors"] / steps,
                   offloaded_per_step=stats["offloaded_tensors"] / steps,
                   on_demand_per_step=stats.get("on_demand", 0) / steps,
                   served_from_device_per_step=stats.get("served_from_device", 0) / steps)
        if _stalls_on_device_clock():  # (else the runtime timed its stalls on this CPU's clock: meaningless)
            row.update(offload_stall_ms_per_step=1e3 * stats["offload_stall_s"] / steps,
                       prefetch_stall_ms_per_step=1e3 * stats["prefetch_stall_s"] / steps)
    return row


def measure_gpu(run: dict, mode: str, args) -> dict:
    """Steps of one mode at the run's full batch on this GPU: ms per step (median), the
    forward and backward phases on compute (CUDA events), peak memory, cswap's counters."""
    import cswap

    device = torch.device("cuda")
    model, x, y = _model_and_batch(dict(run, scale=1))
    model, x, y = model.to(device), x.to(device), y.to(device)
    if mode != "unpatched":
        cswap.patch(model, mode=mode, verbose=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    times, phases, peaks, reserved = [], [], [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup and mode != "unpatched":
            cswap.stats(model).reset()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)  # (each step's own peak: which step peaks, if one does)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        start = time.perf_counter()
        marks[0].record()
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        marks[1].record()
        loss.backward()
        marks[2].record()
        optimizer.step()
        torch.cuda.synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            phases.append((marks[0].elapsed_time(marks[1]), marks[1].elapsed_time(marks[2])))
            peaks.append(torch.cuda.max_memory_allocated(device) / 2**20)
            reserved.append(torch.cuda.max_memory_reserved(device) / 2**20)
    middle = times.index(statistics.median_low(times))
    row = {"run": args.run_name, "mode": mode, "batch": run["batch"], "step_ms": 1e3 * times[middle],
           "steps_ms": [round(1e3 * t, 2) for t in times], "forward_ms": phases[middle][0],
           "backward_ms": phases[middle][1],
           "peak_allocated_mib": max(peaks), "peaks_allocated_mib": [round(p) for p in peaks],
           "peak_reserved_mib": max(reserved)}
    if mode != "unpatched":
        stats, steps = dict(cswap.stats(model)), args.steps
        row.update(moved_mib_per_step=stats["transferred_bytes"] / steps / 2**20,
                   compressed_per_step=stats["compressed_tensors"] / steps,
                   offloaded_per_step=stats["offloaded_tensors"] / steps,
                   on_demand_per_step=stats["on_demand"] / steps,
                   served_from_device_per_step=stats["served_from_device"] / steps,
                   offload_stall_ms_per_step=1e3 * stats["offload_stall_s"] / steps,
                   prefetch_stall_ms_per_step=1e3 * stats["prefetch_stall_s"] / steps)
        cswap.unpatch(model)
    del model, optimizer, x, y
    torch.cuda.empty_cache()
    return row


def headline(args) -> list[dict]:
    """The twin's runs measured on this GPU (at their full batch), beside the H200's
    measurement of 2026-11-26 and the twin's prediction committed in twin-today.json."""
    import cswap

    twin_rows = {}
    committed = RESULTS / "twin-today.json"
    if committed.exists():
        twin_rows = {(r["run"], r["mode"]): r for r in json.loads(committed.read_text())["rows"]}
    nan = float("nan")
    rows = []
    for name in args.runs:
        run, args.run_name = RUNS[name], name
        print(f"# {name}: VGG16 {run['dataset']} batch {run['batch']} on {torch.cuda.get_device_name()} (measured)",
              flush=True)
        print(f"{'mode':<10} {'ms':>8} {'x unp.':>7} {'H200 x':>7} {'twin x':>7} {'fwd':>7} {'bwd':>7} "
              f"{'fwd st':>7} {'bwd st':>7} {'moved MiB':>9} {'peak MiB':>9} {'plan ms':>8}", flush=True)
        unpatched, planned = None, {}
        for mode in ["unpatched", *args.modes]:
            row = measure_gpu(run, mode, args)
            unpatched = unpatched or row["step_ms"]
            if mode == "unpatched" and args.plan:
                try:
                    planned = plan(run, {"forward_s": row["forward_ms"] / 1e3, "backward_s": row["backward_ms"] / 1e3},
                                   gpu=torch.cuda.get_device_name())
                except ValueError as exc:  # (a GPU the table does not have)
                    print(f"# no plan: {exc}")
            row["x_unpatched"] = row["step_ms"] / unpatched
            if mode in run["measured_ms"]:
                row["h200_x_unpatched"] = run["measured_ms"][mode] / run["measured_ms"]["unpatched"]
            twin = twin_rows.get((name, mode))
            if twin is not None:
                row["twin_x_unpatched"] = twin["x_unpatched"]
            if mode in planned:
                row["plan_ms"] = planned[mode]
                row["vs_plan"] = row["step_ms"] / planned[mode] - 1
            rows.append(row)
            print(f"{mode:<10} {row['step_ms']:8.1f} {row['x_unpatched']:7.2f} {row.get('h200_x_unpatched', nan):7.2f} "
                  f"{row.get('twin_x_unpatched', nan):7.2f} {row['forward_ms']:7.1f} {row['backward_ms']:7.1f} "
                  f"{row.get('offload_stall_ms_per_step', nan):7.1f} {row.get('prefetch_stall_ms_per_step', nan):7.1f} "
                  f"{row.get('moved_mib_per_step', 0.0):9.0f} {row['peak_allocated_mib']:9.0f} "
                  f"{row.get('plan_ms', nan):8.1f}", flush=True)
    return rows


def _stalls_on_device_clock() -> bool:
    import inspect

    import cswap.runtime.swapper

    return "host_time" in inspect.getsource(cswap.runtime.swapper)


class _TwinProfile:
    """The twin's GPU as a profile the planner takes (cswap.predict's `profile`): its link
    and its codecs' measured times, so the plan and the twin agree on the machine."""

    def __init__(self, spec):
        self.bw_d2h, self.bw_h2d = spec.d2h_bytes_per_s, spec.h2d_bytes_per_s
        self.codecs = ("zvc", "rle", "csr", "lz4", "zans")
        self._seconds = spec.codec_seconds
        self.source = f"measured: {spec.source}"

    def seconds(self, codec, direction, size, sparsity):
        return self._seconds(codec, direction, size, sparsity)


def plan(run: dict, times: dict, gpu: str = "h200") -> dict:
    """cswap-plan's prediction of each mode's step for the run (cswap.predict on `gpu`, with
    the H200's measured link and codecs, compute as the unpatched step measured: its forward
    and backward times; sparsity measured on CPU steps of the twin's batch): {mode: ms}."""
    import cswap
    from cswap.plan.sparsity import measure
    from cswap.runtime.twin import TwinSpec

    model, x, y = _model_and_batch(run)
    sparsity = measure(model, [(x,)] * 3, targets=[y] * 3)
    size = x.shape[-1]
    p = cswap.predict(model, torch.empty(run["batch"], 3, size, size, device="meta"), gpu=gpu,
                      profile=_TwinProfile(TwinSpec.measured(TABLE_IN_TREE)), sparsity=sparsity, times=times,
                      recompute=False)
    return {mode: 1e3 * p.step_seconds(mode) for mode in MODES if mode in p.modes}


def _model_and_batch(run: dict):
    """The run's model (seeded) and its batch at the twin's scale."""
    from cswap.models import build

    torch.manual_seed(0)
    model = build(run["model"], dataset=run["dataset"])
    size, classes = (224, 1000) if run["dataset"] == "imagenet" else (32, 10)
    batch = run["batch"] // run["scale"]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, size, size, generator=gen)
    y = torch.randint(0, classes, (batch,), generator=gen)
    return model, x, y


def replay(args) -> list[dict]:
    nan = float("nan")
    rows = []
    for name in args.runs:
        run = RUNS[name]
        args.run_name = name
        base = train(run, "unpatched", 1.0, args)  # the roofline's own step, to calibrate compute on
        factor = run["measured_ms"]["unpatched"] / base["compute_ms"]
        print(f"# {name}: VGG16 {run['dataset']} batch {run['batch']} as {run['batch'] // run['scale']} x "
              f"{run['scale']}; compute calibrated: the roofline's {base['compute_ms']:.1f} ms x {factor:.3f} = "
              f"the H200's unpatched {run['measured_ms']['unpatched']} ms", flush=True)
        print(f"{'mode':<10} {'twin ms':>8} {'x unp.':>7} {'H200 x':>7} {'error':>7} {'exposed':>8} {'fwd':>6} "
              f"{'bwd':>6} {'d2h':>6} {'h2d':>6} {'codec':>6} {'fwd st':>6} {'bwd st':>6} {'moved MiB':>9} "
              f"{'peak MiB':>8} {'plan ms':>8} {'vs plan':>7}", flush=True)
        unpatched = None
        planned = {}
        for mode in ["unpatched", *args.modes]:
            row = train(run, mode, factor, args)
            if mode == "unpatched" and args.plan:
                planned = plan(run, {"forward_s": row["forward_ms"] / 1e3, "backward_s": row["backward_ms"] / 1e3})
            if mode in planned:
                row["plan_ms"] = planned[mode]
                row["vs_plan"] = row["step_ms"] / planned[mode] - 1
            row["compute_factor"] = factor
            unpatched = unpatched or row["step_ms"]
            row["x_unpatched"] = row["step_ms"] / unpatched
            row["exposed_ms"] = row["step_ms"] - unpatched
            measured = run["measured_ms"].get(mode)
            if measured is not None:
                row["h200_ms"] = measured
                row["h200_x_unpatched"] = measured / run["measured_ms"]["unpatched"]
                row["x_error"] = row["x_unpatched"] / row["h200_x_unpatched"] - 1
            rows.append(row)
            print(f"{mode:<10} {row['step_ms']:8.1f} {row['x_unpatched']:7.2f} "
                  f"{row.get('h200_x_unpatched', nan):7.2f} {row.get('x_error', nan):+7.1%} "
                  f"{row['exposed_ms']:8.1f} {row['forward_ms']:6.1f} {row['backward_ms']:6.1f} {row['d2h_ms']:6.1f} "
                  f"{row['h2d_ms']:6.1f} {row['codec_ms']:6.1f} {row.get('offload_stall_ms_per_step', nan):6.1f} "
                  f"{row.get('prefetch_stall_ms_per_step', nan):6.1f} {row.get('moved_mib_per_step', 0.0):9.0f} "
                  f"{row['peak_saved_mib']:8.0f} {row.get('plan_ms', nan):8.1f} {row.get('vs_plan', nan):+7.1%}", flush=True)
    return rows


def _wait_for_every_decode() -> None:
    """The restore's thread waits for each decode it queues, as torch 2.11 on CUDA made it
    before 138c7ca (`words[1] = 0`: a copy from pageable memory on the codec stream)."""
    from cswap.runtime.lanes import Lanes

    decode_after = Lanes.decode_after

    def waiting(self, *args, **kwargs):
        done = decode_after(self, *args, **kwargs)
        self.dev.event_synchronize(done, at=None)
        return done

    Lanes.decode_after = waiting


def extract(commit: str, into: Path) -> Path:
    """The commit's cswap laid out as installed (kernels and models inside it), with this
    tree's emulator, seam, twin, the twin's table and the roofline it times ops by put in."""
    from common import installed_tree

    installed_tree(commit, into)
    for path in ("cswap/runtime/device.py", "cswap/runtime/emulator.py", "cswap/runtime/allocator_model.py",
                 "cswap/runtime/twin.py", "cswap/data/twin-nvidia-h200.json", "cswap/data/time_model.json"):
        shutil.copy(ROOT / path, into / path)
    # The twin times the model's ops by this tree's roofline: put in beside the commit's own plan,
    # which its cswap.predict uses, as cswap/twin_plan/
    today = into / "cswap" / "twin_plan"
    today.mkdir()
    (today / "__init__.py").write_text("")
    for name in ("roofline.py", "gpus.py", "grouped_mm.py"):
        shutil.copy(ROOT / "cswap" / "plan" / name, today / name)
    twin = into / "cswap" / "runtime" / "twin.py"
    twin.write_text(twin.read_text().replace("from ..plan.", "from ..twin_plan."))
    return into


def main(argv=None) -> list[dict]:
    from common import SETTLE_STEPS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--warmup", type=int, default=SETTLE_STEPS,
                   help="steps before timing (default: %(default)s, until the runtime is steady: benchmarks/common.py, "
                        "SETTLE_STEPS; the H200's 2026-12-04 headline warmed up 2, so its second timed step freed "
                        "pinned buffers)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sm-share", type=float, default=1.0,
                   help="of a codec kernel's time, what compute running beside it loses (1: all, the default; 0: none)")
    p.add_argument("--host-scale", type=float, default=1.0,
                   help="the host's speed: it runs cswap.runtime.twin's reference Python in this times "
                        "HOST_REFERENCE_S (default 1; 0.5: a host twice as fast), however fast this CPU is meanwhile")
    p.add_argument("--commit", help="replay this commit's runtime instead of this tree's")
    p.add_argument("--no-plan", dest="plan", action="store_false",
                   help="skip cswap-plan's prediction of each mode (cswap.predict) beside the twin's")
    p.add_argument("--pageable-verdict", action="store_true",
                   help="replay the host sync every decode made on CUDA before 138c7ca (torch 2.11 copied the "
                        "verdict's Python 0 from pageable memory and waited for the codec stream), as measured")
    p.add_argument("--label", help="results file name (default: 'today' or the commit)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--table", action="store_true", help="rebuild cswap/data/twin-nvidia-h200.json and stop")
    p.add_argument("--gpu", action="store_true",
                   help="measure the runs on this GPU at their full batch instead (the GPU session's headline stage): "
                        "headline.csv/.json under benchmarks/results/<device>/")
    args = p.parse_args(argv)
    if args.table:
        make_table()
        return []
    if args.gpu:
        from common import device_slug, environment

        device = torch.device("cuda")
        rows = headline(args)
        out = ROOT / "benchmarks" / "results" / device_slug(device)
        out.mkdir(parents=True, exist_ok=True)
        keys = sorted({k for row in rows for k in row})
        with open(out / "headline.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
        from cswap.runtime.twin import host_reference_s

        env = {**environment(device), "host_reference_ms": 1e3 * host_reference_s(repeats=20)}  # (for the twin's host)
        (out / "headline.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
        print(f"# wrote {out / 'headline'}.csv and .json")
        return rows
    if args.commit and not os.environ.get("CSWAP_TWIN_TREE"):
        with tempfile.TemporaryDirectory() as tmp:
            tree = extract(args.commit, Path(tmp))
            env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{Path(__file__).parent}",
                   "CSWAP_TWIN_TREE": str(tree)}
            argv = [a for a in (argv if argv is not None else sys.argv[1:])]
            subprocess.run([sys.executable, "-P", __file__, *argv, "--label", args.label or args.commit],
                           env=env, check=True, cwd=tmp)
        return []
    import cswap
    from cswap.runtime.twin import HOST_REFERENCE_S

    if os.environ.get("CSWAP_TWIN_TREE"):  # a commit's runtime, in a process of its own: runtimes
        from cswap.runtime import emulator  # before 29afc0c encoded and decoded on streams of their own

        emulator.SIDE_STREAMS = (*emulator.SIDE_STREAMS, "compress", "decode")
    if args.pageable_verdict:
        _wait_for_every_decode()
    global TABLE_IN_TREE
    TABLE_IN_TREE = Path(cswap.__file__).parent / "data" / "twin-nvidia-h200.json"
    print(f"# the timed twin of the H200 (predicted, not measured) on {cswap.__file__}; torch {torch.__version__}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="cswap: offloading CPU tensors")
        warnings.filterwarnings("ignore", message=".*default profile")
        rows = replay(args)
    label = args.label or "today"
    args.out.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for row in rows for k in row})
    with open(args.out / f"twin-{label}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    config = {k: v for k, v in vars(args).items() if not isinstance(v, Path)}
    code = args.commit or subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                                         capture_output=True, text=True).stdout.strip()
    (args.out / f"twin-{label}.json").write_text(json.dumps(
        {"environment": {"what": "predicted by the timed twin of the H200 on a CPU, not measured",
                         "torch": torch.__version__, "runtime": code, "date": _today(),
                         "host": "this CPU's host time, scaled each step to a host that runs the reference "
                                 f"Python in {1e3 * args.host_scale * HOST_REFERENCE_S:.2f} ms"},
         "args": config, "rows": rows}, indent=1))
    print(f"# wrote {args.out / f'twin-{label}'}.csv and .json")
    return rows


def _today() -> str:
    import datetime as dt

    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


TABLE_IN_TREE = TABLE

if __name__ == "__main__":
    main()
