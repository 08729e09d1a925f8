"""Runtime benchmark: cswap's modes against no offload and save_on_cpu, in one run.

Trains VGG16 (from cswap.models) with SGD for a few iterations per provider:

    unpatched     stock PyTorch, nothing offloaded (the memory and speed reference)
    none          cswap.patch(mode="none"): hooks only, the overhead baseline
    vdnn          offload every ReLU/pool activation, uncompressed
    sc            ZVC-compress every one first (static compression, as cDMA)
    cswap         the advisor decides per tensor (paper eq. 1-4), from the device profile
    cswap_timeline  the advisor's timeline mode (shared PCIe links simulated)
    save_on_cpu   torch.autograd.graph.save_on_cpu(pin_memory=True): every saved tensor
    vdnn_checksum, sc_checksum, cswap_checksum
                  the same with checksum=True (an end-to-end checksum of every
                  offloaded buffer); "chk cost" is their step time over the
                  provider's without it, minus one: checksum=True stays off by
                  default while that exceeds 2%

and reports the median step time, peak GPU memory allocated and reserved (the
caching allocator's footprint: memory left in side streams' pools shows here),
the peak against the step's memory floor (predicted, without a GPU, by
cswap.plan.fake_gpu: static state plus the largest working set one op needs at
once, every saved activation away whenever the step does not hold it), reserved
memory over its target (unpatched's reserved plus the stash and prefetch windows
the provider filled; issue 39 §2),
bytes moved to the host, forward's stall per offloaded tensor, compute's stall
per restored tensor, tensors kept on the GPU, and ratios against unpatched and
save_on_cpu. The first step's loss of every provider is checked to equal the
unpatched one bit for bit.

--emulate GBPS (or "measured": the PCIe bandwidth probed on this GPU) runs every
provider a second time on the CPU against cswap.testing.emulated_device at that
bandwidth and puts the emulator's prediction beside the measurement (columns
"emu ..."): the peak of saved activations and cswap's buffers, as a fraction of
unpatched, the stalls and the tensors kept. On a GPU this measures the
emulator's fidelity; the emulated stalls use CPU compute, so compare them as
"there or not", not in milliseconds.

    python benchmarks/runtime.py             # GPU: ImageNet-shaped VGG16, batch 64
    python benchmarks/runtime.py --quick     # CPU-friendly: CIFAR-shaped, batch 4
    python benchmarks/runtime.py --dataset cifar10 --batch 32 --emulate measured   # fidelity

Results: a printed table, and CSV + JSON under benchmarks/results/<device>/.
On CPU nothing is saved (host memory is the device memory): the numbers only
show that the pipeline runs; the memory and time targets are for a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import cswap
from cswap.models import build

from common import SETTLE_STEPS, environment, format_row, synchronize, write_results

PROVIDERS = ("unpatched", "none", "vdnn", "sc", "cswap", "cswap_timeline", "save_on_cpu",
             "vdnn_checksum", "sc_checksum", "cswap_checksum")
PATCHED = ("none", "vdnn", "sc", "cswap", "cswap_timeline", "vdnn_checksum", "sc_checksum", "cswap_checksum")
_CHECKSUM = "_checksum"


def run_provider(name: str, args, device: torch.device, emulated=None) -> dict:
    """One provider's run on `device`; with `emulated` (an EmulatedDevice, device CPU)
    the memory figures are the emulator's."""
    torch.manual_seed(0)
    model = build(args.model, dataset=args.dataset).to(device)
    mode, checksum = name.removesuffix(_CHECKSUM), name.endswith(_CHECKSUM)
    if mode in ("none", "vdnn", "sc"):
        cswap.patch(model, mode=mode, verbose=False, checksum=checksum)
    elif mode.startswith("cswap"):
        cswap.patch(model, mode="cswap", advisor="timeline" if mode == "cswap_timeline" else "independent",
                    profile=args.profile, verbose=False, checksum=checksum)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    size = 224 if args.dataset == "imagenet" else 32
    classes = 1000 if args.dataset == "imagenet" else 10
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, size, size, generator=gen).to(device)
    y = torch.randint(0, classes, (args.batch,), generator=gen).to(device)
    region = (lambda: torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")) \
        if name == "save_on_cpu" else contextlib.nullcontext

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with region():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    times, first_loss = [], None
    for i in range(args.warmup + args.iters):
        if i == args.warmup:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            if emulated is not None:
                emulated.reset_peak()
            if name in PATCHED:
                cswap.stats(model).reset()
        synchronize(device)
        t0 = time.perf_counter()
        loss = step()
        synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        if first_loss is None:
            first_loss = loss.detach().cpu()
    row = {"provider": name, "model": args.model, "dataset": args.dataset, "batch": args.batch,
           "step_ms": 1e3 * statistics.median(times), "first_loss": float(first_loss)}
    if device.type == "cuda":
        row["peak_gpu_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        row["peak_reserved_mib"] = torch.cuda.max_memory_reserved(device) / 2**20
    if emulated is not None:  # saved activations and cswap's buffers only (what offloading changes)
        row["peak_gpu_mib"] = emulated.peak_bytes / 2**20
        row["peak_reserved_mib"] = emulated.max_memory_reserved() / 2**20
        row["hazards"] = len(emulated.hazards)
    if name.startswith("cswap"):
        report = cswap.epoch_end(model)
        row["compressed_layers"] = report.totals["compressed_layers"]
        row["candidate_tensors"] = len(report.rows)
        # host time the profiler spent over the run, per timed step
        row["profiling_overhead_ms_per_step"] = 1e3 * report.metrics["profiling_overhead_s"] / args.iters
        if args.check_decisions:
            checks = cswap.check_decisions(model, sample=args.check_decisions)
            row["decision_accuracy"] = sum(c.right for c in checks) / max(len(checks), 1)
    if name in PATCHED:
        s = cswap.stats(model)
        row.update(moved_mib_per_step=s["transferred_bytes"] / args.iters / 2**20,
                   offloaded_mib_per_step=s["offloaded_bytes"] / args.iters / 2**20,
                   compressed_per_step=s["compressed_tensors"] / args.iters,
                   prefetch_stall_ms_per_step=1e3 * s["prefetch_stall_s"] / args.iters,
                   offload_stall_ms_per_tensor=1e3 * s["offload_stall_s"] / max(s["offloaded_tensors"], 1),
                   prefetch_stall_ms_per_tensor=1e3 * s["prefetch_stall_s"] / max(s["restored_tensors"], 1),
                   kept_on_gpu=s["kept_on_gpu"], served_from_device=s["served_from_device"],
                   host_pool_mib=s["host_pool_bytes"] / 2**20,
                   windows_mib=(s["peak_offload_bytes"] + s["peak_prefetch_bytes"]) / 2**20)
        cswap.unpatch(model)
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


COLUMNS = [
    ("provider", "provider", "{}"), ("step_ms", "step ms", "{:.1f}"), ("vs_unpatched", "x unpatch", "{:.2f}"),
    ("vs_save_on_cpu", "x s_o_cpu", "{:.2f}"), ("peak_gpu_mib", "peak MiB", "{:.0f}"),
    ("peak_reserved_mib", "resv MiB", "{:.0f}"), ("peak_vs_unpatched", "peak x", "{:.2f}"),
    ("peak_vs_floor", "peak/floor", "{:.2f}"), ("resv_over_target_mib", "resv-tgt", "{:+.0f}"),
    ("moved_mib_per_step", "moved MiB", "{:.1f}"), ("offload_stall_ms_per_tensor", "fwd st/t", "{:.3f}"),
    ("prefetch_stall_ms_per_tensor", "bwd st/t", "{:.3f}"), ("kept_on_gpu", "kept", "{}"),
    ("compressed_layers", "compr.", "{}"), ("decision_accuracy", "dec. acc", "{:.2f}"),
    ("loss_matches", "loss ==", "{}"), ("checksum_cost", "chk cost", "{:+.1%}"),
    ("emu_peak_vs_unpatched", "emu peak x", "{:.2f}"), ("emu_offload_stall_ms_per_tensor", "emu fwd st", "{:.3f}"),
    ("emu_resv_over_target_mib", "emu r-tgt", "{:+.1f}"), ("emu_kept_on_gpu", "emu kept", "{}"),
    ("emu_hazards", "emu haz.", "{}"),
]
WIDTHS = [15] + [10] * (len(COLUMNS) - 1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CIFAR-shaped model, small batch (CPU-friendly)")
    p.add_argument("--model", default="vgg16", help="a name from cswap.models.names()")
    p.add_argument("--dataset", choices=["cifar10", "imagenet"])
    p.add_argument("--batch", type=int)
    p.add_argument("--warmup", type=int, default=SETTLE_STEPS, help="steps before timing (default: %(default)s, "
                   "until the runtime is steady: benchmarks/common.py, SETTLE_STEPS)")
    p.add_argument("--iters", type=int)
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--profile", type=Path, help="device profile for the cswap modes (default: this device's)")
    p.add_argument("--check-decisions", type=int, default=0, metavar="N",
                   help="cswap modes: measure N tensors' real swaps and report decision accuracy")
    p.add_argument("--emulate", metavar="GBPS",
                   help="also run each provider against the emulated device at GBPS (or 'measured': this GPU's "
                        "probed PCIe bandwidth) and report its prediction beside the measurement")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<device>)")
    args = p.parse_args(argv)
    args.dataset = args.dataset or ("cifar10" if args.quick else "imagenet")
    args.batch = args.batch or (4 if args.quick else 64)
    args.iters = args.iters or (2 if args.quick else 10)
    return args


def emulation_bandwidth(option: str | None, device: torch.device) -> float | None:
    """--emulate's GB/s: a number, or the slower direction probed on this GPU."""
    if option is None:
        return None
    if option != "measured":
        return float(option)
    if device.type != "cuda":
        raise SystemExit("--emulate measured needs a GPU to measure; give a bandwidth in GB/s instead")
    from cswap.tune.bandwidth import probe

    link = probe(device, sizes=(64 << 20,), repeats=5)
    return min(link["d2h_gbps"], link["h2d_gbps"])


def memory_floor(args) -> dict:
    """The step's memory floor and unpatched peak in MiB, predicted by cswap.plan.fake_gpu
    (no GPU): the floor is the traced peak with every saved activation away from when the
    step stops holding it until just before its first use, i.e. static state (parameters,
    gradients, the batch) plus the largest working set that one op needs at once."""
    from cswap.plan.fake_gpu import trace_step

    torch.manual_seed(0)
    model = build(args.model, dataset=args.dataset)
    size = 224 if args.dataset == "imagenet" else 32
    trace = trace_step(model, torch.empty(args.batch, 3, size, size, device="meta"), optimizer="sgd")
    # (the trace's SGD keeps momentum, one buffer per parameter all step long; this benchmark's keeps none)
    momentum = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"floor_mib": (trace.offloaded_peak_bytes - momentum) / 2**20,
            "predicted_unpatched_mib": (trace.peak_bytes - momentum) / 2**20}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device)
    floor = memory_floor(args)
    print(f"# cswap runtime benchmark: {args.model} ({args.dataset}), batch {args.batch}, on {env['device']}; "
          f"torch {env['torch']}")
    print(f"# memory floor {floor['floor_mib']:.0f} MiB, unpatched peak {floor['predicted_unpatched_mib']:.0f} MiB "
          f"(both predicted by cswap.plan.fake_gpu, not measured)")
    print(format_row(COLUMNS, WIDTHS))
    rows = []
    bandwidth = emulation_bandwidth(args.emulate, device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="cswap: offloading CPU tensors")
        for name in args.providers:
            rows.append(run_provider(name, args, device))
            if bandwidth is not None and name != "save_on_cpu":  # (its hooks are PyTorch's: nothing to see)
                with cswap.testing.emulated_device(bandwidth_gbps=bandwidth) as emulated:
                    emu = run_provider(name, args, torch.device("cpu"), emulated)
                rows[-1].update({f"emu_{k}": v for k, v in emu.items() if k not in ("provider", "model", "dataset",
                                                                                      "batch")})
                rows[-1]["emu_bandwidth_gbps"] = bandwidth
    ref = {r["provider"]: r for r in rows}
    for row in rows:
        row.update(floor)
        if "peak_gpu_mib" in row and device.type == "cuda":  # (on the CPU nothing measures the device)
            row["peak_vs_floor"] = row["peak_gpu_mib"] / floor["floor_mib"]
        if "unpatched" in ref:
            row["vs_unpatched"] = row["step_ms"] / ref["unpatched"]["step_ms"]
            row["loss_matches"] = row["first_loss"] == ref["unpatched"]["first_loss"]
            if "peak_gpu_mib" in row:
                row["peak_vs_unpatched"] = row["peak_gpu_mib"] / ref["unpatched"]["peak_gpu_mib"]
            if "peak_reserved_mib" in row and "windows_mib" in row:
                row["resv_over_target_mib"] = row["peak_reserved_mib"] - ref["unpatched"]["peak_reserved_mib"] \
                    - row["windows_mib"]
            if "emu_peak_gpu_mib" in row and ref["unpatched"].get("emu_peak_gpu_mib"):
                row["emu_peak_vs_unpatched"] = row["emu_peak_gpu_mib"] / ref["unpatched"]["emu_peak_gpu_mib"]
                if "emu_windows_mib" in row:  # (the emulator's pools: one per stream, as CUDA's allocator)
                    row["emu_resv_over_target_mib"] = row["emu_peak_reserved_mib"] \
                        - ref["unpatched"]["emu_peak_reserved_mib"] - row["emu_windows_mib"]
        if "save_on_cpu" in ref:
            row["vs_save_on_cpu"] = row["step_ms"] / ref["save_on_cpu"]["step_ms"]
        base = ref.get(row["provider"].removesuffix(_CHECKSUM))
        if row["provider"].endswith(_CHECKSUM) and base is not None:
            row["checksum_cost"] = row["step_ms"] / base["step_ms"] - 1
        print(format_row(COLUMNS, WIDTHS, row), flush=True)
    stem = "runtime-quick" if args.quick else "runtime"
    write_results(rows, env, args, args.out, device, stem + ("-emulated" if args.emulate else ""))
    return rows


if __name__ == "__main__":
    main()
