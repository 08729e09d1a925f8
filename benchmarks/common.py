"""What every benchmark shares: device naming, environment record, result files."""

from __future__ import annotations

import csv
import datetime as dt
import importlib
import json
import platform
import re
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import torch

import cswap

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
# A patched model's steps before it is steady: the timed step sends each raw tensor alone; the
# second groups them into those host buffers while pinning its groups' own; the third is the
# one the host pool counts; the fourth begins by freeing the buffers the third did without
# (cswap.runtime.swapper: _trim_after_timed_pass). Freeing pinned memory is slow: on the H200
# the fourth step of vdnn spent 253 ms in 17 cudaFreeHost calls before its first kernel
# (results/nvidia-h200/trace/trace-cifar-vdnn.json.gz), and timed steps that began at the third
# took 364 ms where the others took 112. Benchmarks time steps from the fifth on.
SETTLE_STEPS = 4


def installed_tree(commit: str, into: Path, name: str = "cswap") -> Path:
    """`commit`'s cswap extracted (git archive) into `into`/`name`, laid out as installed:
    kernels/ and models/ inside it, as cswap.kernels and cswap.models."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "cswap", "kernels", "models"],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    package = into / name
    if name != "cswap":
        (into / "cswap").rename(package)
    for sub in ("kernels", "models"):
        (into / sub).rename(package / sub)
    return package


def synchronize(device: torch.device) -> None:
    """Wait for the device (a no-op on CPU), so host clocks time finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def settle(package, model) -> None:
    """Let the background work a patched model left running finish, and stop its threads
    (new ones start at its next step), outside the timing: sc's worker compressing, vdnnpp's
    threads compressing host copies. Timed next, stock autograd took 8.1 ms a step right
    after vdnnpp against 4.4 after vdnn. `package`: the cswap that patched it (ab_overhead.py
    runs a commit's as cswap_base beside the working tree's)."""
    entry = importlib.import_module(package.__name__ + ".patch")._PATCHED.get(model)
    if entry is not None:
        entry.swapper.synchronize()
        entry.swapper.offloader.stop()  # waits for its threads' queues


def kernel_ms(fn, device: torch.device, repeats: int = 5) -> float | None:
    """Median ms of fn() on a GPU by CUDA events (triton's do_bench, L2 flushed between
    runs); None off a GPU, where the interpreter's time is not a GPU's."""
    if device.type != "cuda":
        return None
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=max(20, 10 * repeats), return_mode="median"))


def device_slug(device: torch.device) -> str:
    """'nvidia-h100-80gb-hbm3', 'cpu-x86-64': the results folder name."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{platform.machine()}"
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def environment(device: torch.device, **extra) -> dict:
    """Device, date and versions, recorded beside every result."""
    import triton

    env = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "python": sys.version.split()[0], "cswap": cswap.__version__, **extra}
    try:
        from nvidia import nvcomp
        env["nvcomp"] = nvcomp.__version__
    except ImportError:
        pass
    return env


def write_results(rows: list[dict], env: dict, args, out: Path | None, device: torch.device, stem: str) -> Path:
    """rows as <stem>.csv and, with env and args, <stem>.json under out (default results/<device>)."""
    out = out or RESULTS / device_slug(device)
    out.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for row in rows for k in row})
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (out / f"{stem}.json").write_text(json.dumps({"environment": env, "args": config, "rows": rows}, indent=1))
    print(f"# wrote {out / stem}.csv and .json")
    return out


def format_row(columns, widths, row: dict | None = None) -> str:
    """One table line of (key, header, format) columns; the header line when row is None."""
    cells = []
    for (key, head, fmt), width in zip(columns, widths):
        text = head if row is None else ("" if row.get(key) is None else fmt.format(row[key]))
        cells.append(text.rjust(width))
    return " ".join(cells)
