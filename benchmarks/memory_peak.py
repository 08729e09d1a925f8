"""What a step holds on the GPU at its peak, read from a CUDA memory snapshot.

benchmarks/trace.py records one step's allocator history per mode (the GPU session's
`trace` stage). This replays it and names the blocks allocated at the step's peak, grouped
by where they were allocated: cswap's own buffers (its restores, payloads), forward's
outputs (by module), optimizer, blocks allocated before the history began (parameters and
whatever the step keeps from the last), and allocations made with no Python on the stack:
backward's ops on autograd's device thread, their outputs (gradients) and workspaces. The
question it answers (issue 40): what lies beside the saved activations at vdnn's peak,
which cswap-plan puts 20-26% under the H200's measurement.

    python benchmarks/memory_peak.py benchmarks/results/<device>/trace/memory-*.pickle.gz

Where there are several allocation times at the same peak bytes, the first is reported.
A block counts from its `alloc` to its `free_requested`, as torch.cuda.max_memory_allocated
counts it (the caching allocator takes a block off its allocated bytes in `free`, before
it waits for the streams that still use it). With `--until-completed` it counts to its
`free_completed`: a block freed while another stream may still read it (record_stream)
cannot be reused until then, so that peak is what the allocator must hold.
"""

from __future__ import annotations

import argparse
import gzip
import pickle
from collections import defaultdict
from pathlib import Path

_MIB = 2 ** 20
BEFORE = "before the history (parameters, what the last step left)"
NO_PYTHON = "no Python on the stack (backward's ops: gradients, workspaces)"


def where(frames: list[dict]) -> str:
    """The group of an allocation, from its Python frames (innermost first)."""
    if not frames:
        return NO_PYTHON
    for f in frames:
        path = f["filename"].replace("\\", "/")
        if "/cswap/" in path:
            return f"cswap: {Path(path).stem}.{f['name']}"
    for f in frames:
        path = f["filename"].replace("\\", "/")
        if "/torch/nn/modules/" in path or "/torch/nn/functional" in path:
            return f"forward: {Path(path).stem}.{f['name']}"
        if "/torch/optim/" in path:
            return "optimizer"
    f = frames[0]
    return f"{Path(f['filename']).name}:{f['name']}"


def replay(snapshot: dict, device: int = 0, until_completed: bool = False) -> dict:
    """The peak of the allocated bytes over the device's trace, and the blocks live there by
    group: {"peak_mib", "at_event" (-1: before the history's first event), "events", "groups":
    [{"where", "mib", "blocks", "largest_mib"}]}, groups largest first. A block counts until
    its free is requested (max_memory_allocated), or with `until_completed` until it completes."""
    trace = snapshot["device_traces"][device]
    end = "free_completed" if until_completed else "free_requested"
    held = {"active_allocated", "active_pending_free"} if until_completed else {"active_allocated"}
    # What is allocated when the snapshot was taken; walking the trace backwards from there
    # gives what was allocated before each event, blocks from before the history included.
    live = {b["address"]: (b["size"], BEFORE) for seg in snapshot["segments"] if seg.get("device", device) == device
            for b in _blocks(seg) if b["state"] in held}
    for e in reversed(trace):
        if e["action"] == "alloc":
            live.pop(e["addr"], None)
        elif e["action"] == end:
            live[e["addr"]] = (e["size"], BEFORE)
    # Forward again: each alloc names its block; the peak is where the sum is largest.
    total = sum(size for size, _ in live.values())
    peak, at, at_peak = total, -1, dict(live)
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], where(e.get("frames", [])))
            total += e["size"]
            if total > peak:
                peak, at, at_peak = total, i, dict(live)
        elif e["action"] == end and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    groups = defaultdict(list)
    for size, group in at_peak.values():
        groups[group].append(size)
    rows = [{"where": g, "mib": sum(s) / _MIB, "blocks": len(s), "largest_mib": [x / _MIB for x in sorted(s)[::-1][:5]]}
            for g, s in groups.items()]
    return {"peak_mib": peak / _MIB, "at_event": at, "events": len(trace),
            "groups": sorted(rows, key=lambda r: -r["mib"])}


def _blocks(segment: dict):
    """A segment's blocks with their addresses (snapshots give each block's size in order)."""
    address = segment["address"]
    for b in segment["blocks"]:
        yield {**b, "address": b.get("address", address)}
        address += b["size"]


def report(result: dict, name: str = "") -> str:
    at = f"event {result['at_event']} of {result['events']}" if result["at_event"] >= 0 else "before the history"
    lines = [f"# {name}peak {result['peak_mib']:.0f} MiB allocated ({at})",
             f"{'MiB':>8} {'blocks':>6}  where (largest blocks, MiB)"]
    for g in result["groups"]:
        largest = ", ".join(f"{x:.0f}" for x in g["largest_mib"])
        lines.append(f"{g['mib']:8.0f} {g['blocks']:6d}  {g['where']} ({largest})")
    return "\n".join(lines)


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return pickle.load(f)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("snapshots", nargs="+", type=Path, help="memory-<run>-<mode>.pickle(.gz) from benchmarks/trace.py")
    p.add_argument("--until-completed", action="store_true",
                   help="count a block until its free completes (its streams done), not until it is requested")
    args = p.parse_args(argv)
    results = []
    for path in args.snapshots:
        result = replay(load(path), until_completed=args.until_completed)
        print(report(result, f"{path.name}: "))
        results.append({"snapshot": path.name, **result})
    return results


if __name__ == "__main__":
    main()
