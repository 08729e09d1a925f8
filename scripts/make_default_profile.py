"""Write cswap/data/default_profile.json: the generic profile used before any tuning.

It is not a measurement of your machine. Its codec times are what cswap's kernels measured on an
NVIDIA H200 (benchmarks/results/nvidia-h200/gpu-2026-12-04/codecs/codecs.csv: 1, 16 and 256 MiB,
20/50/80% blocky zeros, fp32 and bf16; compress on the runtime's path, which reads no size back,
where a codec has one), fitted with cswap-tune's time model; a slower GPU runs them slower, so
cswap-tune on it is worth its minutes. The link is assumed, conservatively, at 25 GB/s each way
(a PCIe 4.0 x16 link as training jobs see it; the H200's measured 55), so that the advisor
compresses only where that pays.

    python scripts/make_default_profile.py
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

import cswap
from cswap.tune.profile import DEFAULT_PROFILE, SCHEMA_VERSION, validate
from cswap.tune.timemodel import TimeModel

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "benchmarks" / "results" / "nvidia-h200" / "gpu-2026-12-04" / "codecs"
CODECS = ("zvc", "rle", "csr", "lz4", "zans")


def measured(codec: str, direction: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bytes, sparsity, seconds) of the sweep's rows for `codec`: compress on the runtime's path
    (launch_ms) where measured, else with its size read back (compress_ms)."""
    rows = [r for r in csv.DictReader(open(SWEEP / "codecs.csv")) if r["provider"] == codec and not r.get("error")]
    ms = [r["decompress_ms"] if direction == "decompress" else r.get("launch_ms") or r["compress_ms"] for r in rows]
    return (np.array([float(r["bytes"]) for r in rows]), np.array([float(r["sparsity"]) for r in rows]),
            np.array(ms, dtype=float) / 1e3)


def main() -> None:
    env = json.loads((SWEEP / "codecs.json").read_text())["environment"]
    codecs = {}
    for name in CODECS:
        entry = {"backend": "triton", "config": {"grid": 528, "block": 128}, "rae": {}}
        for direction in ("compress", "decompress"):
            sizes, sparsities, seconds = measured(name, direction)
            model = TimeModel(3).fit(sizes, sparsities, seconds)
            entry[direction] = model.to_dict()
            miss = np.abs(model.predict(sizes, sparsities) - seconds).sum()
            # (relative absolute error on the rows it was fitted on, in cswap-tune's format)
            entry["rae"][direction] = {"linear": float(miss / np.abs(seconds - seconds.mean()).sum())}
        codecs[name] = entry
    measured_on = f"{env['device']}, {env['date'][:10]}, torch {env['torch']}, triton {env['triton']}"
    doc = {
        "schema_version": SCHEMA_VERSION,
        "device": {"name": f"generic: codec times measured on {measured_on}; link assumed", "type": "cuda",
                   "compute_capability": None, "sm_count": None},
        "versions": {"torch": "", "triton": "", "cswap": cswap.__version__},
        "created": "2026-12-04T00:00:00+00:00",
        "quick": False,
        "bandwidth": {"d2h_gbps": 25.0, "h2d_gbps": 25.0, "pinned": True, "samples": []},
        "codecs": codecs,
        "tuning": {"wall_s": 0.0, "method": f"none: {SWEEP.relative_to(ROOT)}/codecs.csv fitted "
                   "(scripts/make_default_profile.py)", "per_codec": {}, "comparison": None},
    }
    validate(doc, "default profile")
    Path(DEFAULT_PROFILE).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {DEFAULT_PROFILE}")


if __name__ == "__main__":
    main()
