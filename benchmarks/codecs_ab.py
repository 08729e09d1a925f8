"""A/B of the codec kernels: an older tree's cswap against this one, on one GPU, round by round.

A kernel change is judged by its time on a GPU, and two runs of codecs.py made in
different sessions (or on two GPUs of one kind) differ by more than many changes. Here
codecs.py runs with each tree's installed cswap in turn (its PYTHONPATH), round after
round, on the same cases (`--calls-only`: the codec calls, without the transfers, swaps
and kernel builds codecs.py adds on a GPU); each tree's time for a case is its median
over the rounds, and the change is new / base. Both trees' payloads must be the same
size (the format is fixed): a row whose sizes differ says so.

    python benchmarks/codecs_ab.py --base-site /tmp/site-base --new-site /tmp/site --rounds 2 \\
        -- --codecs zvc zans --sizes-mib 1 256 --sparsities 0.2 0.8 --dtypes fp32 bf16 --no-nvcomp

`scripts/gpu_session.sh codecs-ab` runs it against the tree in .base/ (an older checkout:
`git archive REV | tar -x -C .base`, named in the run's carry). Results: a printed table
and codecs-ab.csv / .json under --out (default benchmarks/results/<device>/codecs-ab/),
each run's own files in base-<round>/ and new-<round>/ beside them. Off a GPU codecs.py
times the codecs' PyTorch backend, which checks the plumbing only.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from common import RESULTS, device_slug, environment, format_row

HERE = Path(__file__).resolve().parent
KEY = ("provider", "dtype", "size_mib", "sparsity", "pattern")
TIMES = ("compress_ms", "launch_ms", "decompress_ms")


def run_codecs(site: str | None, args: list[str], out: Path) -> Path:
    """codecs.py with `site` first on the path (None: this process's path); its CSV."""
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join([site, *filter(None, [env.get("PYTHONPATH")])])
    subprocess.run([sys.executable, str(HERE / "codecs.py"), "--calls-only", *args, "--out", str(out)], env=env,
                   check=True)
    found = sorted(out.glob("codecs*.csv"))
    if not found:
        raise RuntimeError(f"codecs_ab: codecs.py wrote no CSV under {out}")
    return found[0]


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _float(value: str | None) -> float | None:
    return float(value) if value not in (None, "") else None


def compare(base_runs: list[list[dict]], new_runs: list[list[dict]]) -> list[dict]:
    """One row per case both trees ran: each time's median over each tree's rounds, and
    new / base; `same_size`: both wrote payloads of one size."""
    def by_case(runs):
        cases: dict[tuple, list[dict]] = {}
        for rows in runs:
            for row in rows:
                cases.setdefault(tuple(row[k] for k in KEY), []).append(row)
        return cases

    base, new = by_case(base_runs), by_case(new_runs)
    out = []
    for key in base.keys() & new.keys():
        row = dict(zip(KEY, key))
        sizes = {r.get("compressed_bytes") for r in base[key] + new[key]}
        row["same_size"] = len(sizes) == 1
        for name in TIMES:
            b = [t for t in map(_float, (r.get(name) for r in base[key])) if t is not None]
            n = [t for t in map(_float, (r.get(name) for r in new[key])) if t is not None]
            if b and n:
                row[f"base_{name}"], row[f"new_{name}"] = statistics.median(b), statistics.median(n)
                row[f"{name.removesuffix('_ms')}_ratio"] = row[f"new_{name}"] / row[f"base_{name}"]
        out.append(row)
    return sorted(out, key=lambda r: (r["provider"], r["dtype"], float(r["size_mib"]), float(r["sparsity"])))


COLUMNS = [("provider", "codec", "{}"), ("dtype", "dtype", "{}"), ("size_mib", "MiB", "{}"),
           ("sparsity", "zeros", "{}"), ("base_compress_ms", "comp ms base", "{:.3f}"),
           ("new_compress_ms", "new", "{:.3f}"), ("compress_ratio", "new/base", "{:.2f}"),
           ("base_launch_ms", "launch base", "{:.3f}"), ("new_launch_ms", "new", "{:.3f}"),
           ("launch_ratio", "new/base", "{:.2f}"), ("base_decompress_ms", "dec base", "{:.3f}"),
           ("new_decompress_ms", "new", "{:.3f}"), ("decompress_ratio", "new/base", "{:.2f}"),
           ("same_size", "same size", "{}")]


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    codecs_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-site", required=True, help="folder the base tree's cswap is installed in")
    p.add_argument("--new-site", help="folder this tree's cswap is installed in (default: this process's cswap)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each tree, alternating")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<device>/codecs-ab)")
    args = p.parse_args(own)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = args.out or RESULTS / device_slug(device) / "codecs-ab"
    runs: dict[str, list[list[dict]]] = {"base": [], "new": []}
    for round_ in range(1, args.rounds + 1):
        for tree, site in (("base", args.base_site), ("new", args.new_site)):
            print(f"# round {round_}: {tree} ({site or 'this process'})", flush=True)
            runs[tree].append(read_rows(run_codecs(site, codecs_args, out / f"{tree}-{round_}")))
    rows = compare(runs["base"], runs["new"])
    widths = [max(len(head), 7) for _, head, _ in COLUMNS]
    print(format_row(COLUMNS, widths))
    for row in rows:
        print(format_row(COLUMNS, widths, row))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "codecs-ab.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for row in rows for k in row}))
        writer.writeheader()
        writer.writerows(rows)
    env = environment(device, base_site=args.base_site, new_site=args.new_site, rounds=args.rounds,
                      codecs_args=codecs_args)
    (out / "codecs-ab.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    print(f"# wrote {out / 'codecs-ab'}.csv and .json")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
