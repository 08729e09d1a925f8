"""How long each compressed send waited after its encode's sizes landed, from a GPU trace.

benchmarks/trace.py records one profiled step per mode as a Chrome trace (the GPU session's
`trace` stage). In it, an encode's sizes come back to the host by a copy of a few bytes
(device to pinned), and the runtime's sender thread then queues the tensor's payload copy.
This lists, per payload copy out (device to pinned, over 1 MiB), the time from the last
sizes copy that ended before it to its start (the sender's: its Python, its wait for the
GIL) and from the copy before it on the link (what the link idled). cswap-plan's SEND_S and
SWITCH_S (cswap.plan.advisor) are read off this.

    python benchmarks/send_gaps.py benchmarks/results/<device>/trace/trace-*-sc.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

SIZES_MAX_BYTES = 64      # an encode's sizes: a few int64 words
PAYLOAD_MIN_BYTES = 1 << 20


def _copies_out(events: list[dict]) -> list[dict]:
    return sorted((e for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")),
                  key=lambda e: e["ts"])


def gaps(trace: dict) -> list[dict]:
    """Per payload copy out, in order: {"at_ms" (from the first GPU event), "mib",
    "after_sizes_ms", "after_previous_ms"}; one with no sizes copy before it is left out."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return []
    t0 = min(e["ts"] for e in gpu)
    copies = _copies_out(events)
    rows, link_free, landed = [], None, None
    for e in copies:
        nbytes = e.get("args", {}).get("bytes", 0)
        if nbytes <= SIZES_MAX_BYTES:
            landed = e["ts"] + e["dur"]
        elif nbytes >= PAYLOAD_MIN_BYTES:
            if landed is not None and landed <= e["ts"]:
                rows.append({"at_ms": (e["ts"] - t0) / 1e3, "mib": nbytes / 2**20,
                             "after_sizes_ms": (e["ts"] - landed) / 1e3,
                             "after_previous_ms": (e["ts"] - (link_free if link_free is not None else t0)) / 1e3})
            link_free = e["ts"] + e["dur"]
    return rows


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", type=Path, help="trace-<run>-<mode>.json(.gz) from benchmarks/trace.py")
    args = p.parse_args(argv)
    results = []
    for path in args.traces:
        rows = gaps(load(path))
        print(f"# {path.name}: {len(rows)} payload copies out after their sizes")
        print(f"{'at ms':>8} {'MiB':>7} {'after sizes ms':>15} {'link idle ms':>13}")
        for r in rows:
            print(f"{r['at_ms']:8.2f} {r['mib']:7.1f} {r['after_sizes_ms']:15.2f} {r['after_previous_ms']:13.2f}")
        if rows:
            waits = [r["after_sizes_ms"] for r in rows]
            print(f"# after sizes: median {statistics.median(waits):.2f} ms, sum {sum(waits):.1f} ms")
        results.append({"trace": path.name, "copies": rows})
    return results


if __name__ == "__main__":
    main()
