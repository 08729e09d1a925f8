"""Write cswap/data/default_profile.json: the generic profile used before any tuning.

It is not a measurement of your machine. Its figures are conservative, chosen so
that the advisor compresses only clearly sparse tensors until cswap-tune has
measured the machine, and no faster than cswap's kernels ran on an H200
(benchmarks/results/nvidia-h200/codecs.json):

    PCIe            25 GB/s each way (a PCIe 4.0 x16 link as training jobs see it;
                    H100 on PCIe 5.0 reaches about 55 GB/s)
    ZVC, RLE, CSR   about 400 / 300 / 250 GB/s of input
    LZ4             3 GB/s compress (a sequential walk per chunk: the H200 measured 3-4),
                    40 GB/s decompress
    ZANS            about 100 GB/s compress (histogram, rANS, copy), 120 GB/s decompress
    per call        the fixed time the H200 measured (host syncs, launches, Python):
                    0.11-0.2 ms for ZVC, RLE and CSR, 0.4 / 0.18 ms for LZ4, over 1 ms for ZANS

    python scripts/make_default_profile.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import cswap
from cswap.plan.whatif import CODEC_FIXED_S
from cswap.tune.profile import DEFAULT_PROFILE, SCHEMA_VERSION, validate
from cswap.tune.timemodel import SPARSITY_RANGE, TimeModel

GBPS = 1e9
# codec: (compress, decompress) as (GB/s over all bytes read, GB/s over non-zero bytes moved); the
# fixed time per call is the what-if's, measured on the H200 (one source for both)
THROUGHPUT = {
    "zvc": ((400, 800), (500, 800)),
    "rle": ((300, 600), (300, 600)),
    "csr": ((250, 500), (300, 500)),
    "lz4": ((3, 200), (40, 200)),
    "zans": ((100, 300), (120, 300)),
}


def law(size, sparsity, call_s, scan_gbps, nonzero_gbps):
    return call_s + size / (scan_gbps * GBPS) + size * (1 - sparsity) / (nonzero_gbps * GBPS)


def main() -> None:
    rng = np.random.default_rng(0)
    sizes = np.exp(rng.uniform(np.log(20e6), np.log(2e9), 64))
    sparsities = rng.uniform(*SPARSITY_RANGE, 64)
    codecs = {}
    for name, directions in THROUGHPUT.items():
        entry = {"backend": "triton", "config": {"grid": 528, "block": 128}, "rae": {}}
        for direction, rates, call_s in zip(("compress", "decompress"), directions, CODEC_FIXED_S[name]):
            entry[direction] = TimeModel(3).fit(sizes, sparsities, law(sizes, sparsities, call_s, *rates)).to_dict()
            entry["rae"][direction] = {}
        codecs[name] = entry
    doc = {
        "schema_version": SCHEMA_VERSION,
        "device": {"name": "generic (not measured)", "type": "cuda", "compute_capability": None,
                   "sm_count": None},
        "versions": {"torch": "", "triton": "", "cswap": cswap.__version__},
        "created": "2026-11-26T00:00:00+00:00",
        "quick": False,
        "bandwidth": {"d2h_gbps": 25.0, "h2d_gbps": 25.0, "pinned": True, "samples": []},
        "codecs": codecs,
        "tuning": {"wall_s": 0.0, "method": "none (generic defaults)", "per_codec": {}, "comparison": None},
    }
    validate(doc, "default profile")
    Path(DEFAULT_PROFILE).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {DEFAULT_PROFILE}")


if __name__ == "__main__":
    main()
