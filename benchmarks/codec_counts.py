"""What each codec call costs a GPU, counted on a CPU, and what that predicts (issue 41, §4).

Per codec, dtype and sparsity (ReLU-like blocky zeros), counted in Triton's interpreter
(`cswap.kernels.counting`): the kernels a call launches, its host syncs, and the global
bytes its kernels read and write per input byte, for `compress` and `decompress` (what
`benchmarks/codecs.py` times) and, where the codec has one, `launch_into` (the runtime's
compression, no size read back). With the compiled sm_90 code of each kernel
(`cswap.kernels.aot`, block 128): registers, spilled bytes, and the bytes of global loads
a thread issues in one pass through a loop (what it can have in flight).

The counts become times with a static model, t = launches * L + syncs * S + bytes / B,
calibrated on the H200's measured compress and decompress times (benchmarks/results/
nvidia-h200/codecs.csv) against the counts of the code it measured (`--measured`, counted
from that commit's extracted tree). The fit uses the byte-bound codecs (ZVC, RLE, CSR);
LZ4's and ZANS's errors show where a byte count cannot see their time.

    python benchmarks/codec_counts.py            # about 25 min: both trees, the fit, the builds
    python benchmarks/codec_counts.py --codecs zvc --dtypes fp32 --sparsities 0.8 --no-builds --no-fit

Results: the printed tables and benchmarks/results/codec-counts/counts.json. Every time
here is predicted (from counts and the H200's measurements), none measured.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "codec-counts"
H200_CODECS = ROOT / "benchmarks" / "results" / "nvidia-h200" / "codecs.csv"
# The codec kernels the H200 measured on 2026-11-26 (06:20 UTC): this commit's, unchanged
# in their compress and decompress paths until this one-pass ZVC.
MEASURED_COMMIT = "4043ddd"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FIT_CODECS = ("zvc", "rle", "csr")
CONFIG = dict(grid=528, block=128)  # the default GPU config (cswap.kernels.launch.default_config on 132 SMs)


# -- counting (in whichever tree is on the path) --------------------------------------------------


def count_rows(codecs, dtypes, sparsities, mib: float, progress=print) -> list[dict]:
    import cswap
    from cswap.kernels.counting import CallCounts
    from cswap.tune.synthetic import make_tensor

    config = cswap.LaunchConfig(**CONFIG)
    rows = []
    for dtype_name in dtypes:
        for sparsity in sparsities:
            x = make_tensor(int(mib * (1 << 20)), sparsity, DTYPES[dtype_name], "blocky", torch.device("cpu"), seed=0)
            nbytes = x.numel() * x.element_size()
            for name in codecs:
                codec = cswap.codecs.get(name)
                paths = {}
                with CallCounts() as counts:
                    blob = codec.compress(x, config, "triton")
                paths["compress"] = counts
                with CallCounts() as counts:
                    y = codec.decompress(blob, config, "triton", check=False)
                paths["decompress"] = counts
                if not torch.equal(y.view(torch.uint8), x.view(torch.uint8)):
                    raise AssertionError(f"{name} did not round-trip")
                # (the measured commit's codecs predate Codec.reserve_nbytes and launch_into)
                reserve = getattr(codec, "reserve_nbytes", lambda *a: None)(x.numel(), x.element_size())
                if reserve is not None:
                    reserved = torch.empty(reserve, dtype=torch.uint8)
                    sizes = torch.empty(codec.size_words, dtype=torch.int64)
                    with CallCounts() as counts:
                        codec.launch_into(x, reserved, sizes, config, "triton")
                    paths["launch_into"] = counts
                for path, c in paths.items():
                    rows.append({"codec": name, "dtype": dtype_name, "sparsity": sparsity, "path": path,
                                 "input_bytes": nbytes, "launches": c.launches, "triton_launches": len(c.names(True)),
                                 "syncs": len(c.syncs), "sync_kinds": sorted(set(c.syncs)),
                                 "read_per_byte": c.bytes_read / nbytes, "written_per_byte": c.bytes_written / nbytes,
                                 "kernels": c.names()})
                progress(f"  counted {name} {dtype_name} {sparsity}")
    return rows


def count_commit(commit: str, args) -> list[dict]:
    """count_rows in `commit`'s cswap (extracted with git archive; this tree's counter put in)."""
    from common import installed_tree  # (not at the top: the worker runs without benchmarks/ on its path)

    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        shutil.copy(ROOT / "kernels" / "counting.py", installed_tree(commit, tree) / "kernels" / "counting.py")
        out = tree / "rows.json"
        env = {**os.environ, "PYTHONPATH": str(tree), "TRITON_INTERPRET": "1"}
        subprocess.run([sys.executable, "-P", __file__, "--worker", str(out), "--codecs", *args.codecs,
                        "--dtypes", *args.dtypes, "--sparsities", *map(str, args.sparsities), "--mib", str(args.mib)],
                       env=env, check=True, cwd=tmp)
        return json.loads(out.read_text())


# -- the static model ---------------------------------------------------------------------------


def measured_rows(path: Path = H200_CODECS) -> list[dict]:
    with open(path) as f:
        return [r for r in csv.DictReader(f) if r["compress_ms"] and r["pattern"] == "blocky"]


# A counted path and the column of benchmarks/codecs.py that timed it (launch_ms: the runtime's
# compression, no size read back; a sweep before 2026-12-04 has no such column)
TIMED = {"compress": "compress_ms", "decompress": "decompress_ms", "launch_into": "launch_ms"}


def _features(counted: dict, size_bytes: float) -> np.ndarray:
    moved = (counted["read_per_byte"] + counted["written_per_byte"]) * size_bytes
    return np.array([counted["launches"], counted["syncs"], moved])


def fit(counts: list[dict], measured: Path = H200_CODECS) -> dict:
    """L (s per launch), S (s per host sync) and B (bytes/s) by non-negative least squares
    of the relative error, on the H200's ZVC, RLE and CSR rows; and every row's error."""
    from scipy.optimize import nnls

    index = {(r["codec"], r["dtype"], r["sparsity"], r["path"]): r for r in counts}
    samples = []
    for m in measured_rows(measured):
        for path, column in TIMED.items():
            counted = index.get((m["provider"], m["dtype"], float(m["sparsity"]), path))
            if counted is not None and m.get(column):
                samples.append((m, path, _features(counted, float(m["bytes"])), float(m[column]) / 1e3))
    fitting = [s for s in samples if s[0]["provider"] in FIT_CODECS]
    a = np.array([f / t for _, _, f, t in fitting])
    coef, _ = nnls(a, np.ones(len(fitting)))
    launch_s, sync_s, per_byte_s = coef
    rows = []
    for m, path, f, t in samples:
        predicted = float(f @ coef)
        rows.append({"codec": m["provider"], "dtype": m["dtype"], "sparsity": float(m["sparsity"]),
                     "size_mib": float(m["size_mib"]), "path": path, "measured_ms": t * 1e3,
                     "predicted_ms": predicted * 1e3, "error": predicted / t - 1,
                     "fitted_on": m["provider"] in FIT_CODECS})
    return {"launch_us": launch_s * 1e6, "sync_us": sync_s * 1e6,
            "bandwidth_gbps": 1 / per_byte_s / 1e9 if per_byte_s else float("inf"), "rows": rows, "coef": list(coef)}


def predict(counts: list[dict], model: dict, size_mib: float) -> list[dict]:
    coef = np.array(model["coef"])
    size = size_mib * (1 << 20)
    out = []
    for c in counts:
        seconds = float(_features(c, size) @ coef)
        out.append({**{k: c[k] for k in ("codec", "dtype", "sparsity", "path")}, "size_mib": size_mib,
                    "predicted_ms": seconds * 1e3, "predicted_gbps": size / seconds / 1e9})
    return out


# -- static builds ------------------------------------------------------------------------------


def builds() -> list[dict]:
    """This tree's kernels built for sm_90 at block 128 (python -m cswap.kernels.aot)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "builds.json"
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        subprocess.run([sys.executable, "-m", "cswap.kernels.aot", "--arch", "90", "--blocks", "128",
                        "--json", str(out)], env=env, check=True, capture_output=True)
        return json.loads(out.read_text())


# -- main ---------------------------------------------------------------------------------------


def _print_counts(rows: list[dict], title: str) -> None:
    print(f"\n## {title}\n")
    print("| codec | dtype | zeros | path | launches (Triton) | host syncs | read B/B | written B/B |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['codec']} | {r['dtype']} | {r['sparsity']:.0%} | {r['path']} | {r['launches']} "
              f"({r['triton_launches']}) | {r['syncs']} | {r['read_per_byte']:.3f} | {r['written_per_byte']:.3f} |")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--codecs", nargs="+", default=["zvc", "rle", "csr", "lz4", "zans"])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--sparsities", type=float, nargs="+", default=[0.2, 0.5, 0.8])
    p.add_argument("--mib", type=float, default=0.25, help="tensor size counted (the interpreter is slow)")
    p.add_argument("--measured", default=MEASURED_COMMIT,
                   help="the commit whose codecs the H200 measured ('this': this tree's, counted once)")
    p.add_argument("--measured-csv", type=Path, default=H200_CODECS,
                   help="the H200's codec sweep of that commit (benchmarks/codecs.py's codecs.csv)")
    p.add_argument("--no-fit", dest="fit", action="store_false", help="count this tree only")
    p.add_argument("--no-builds", dest="builds", action="store_false", help="skip the sm_90 builds")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.worker.write_text(json.dumps(count_rows(args.codecs, args.dtypes, args.sparsities, args.mib)))
        return {}
    import triton

    print(f"# codec calls counted in Triton's interpreter ({triton.__version__}), {args.mib} MiB per tensor")
    doc = {"what": "counted on a CPU in Triton's interpreter; times predicted by a model calibrated on the "
                   "H200's measured codecs.csv, none measured", "torch": torch.__version__,
           "triton": triton.__version__, "mib": args.mib, "config": CONFIG}
    doc["counts"] = count_rows(args.codecs, args.dtypes, args.sparsities, args.mib)
    _print_counts(doc["counts"], "this tree")
    if args.fit:
        doc["measured_commit"], doc["measured_csv"] = args.measured, os.path.relpath(args.measured_csv, ROOT)
        doc["measured_counts"] = doc["counts"] if args.measured == "this" else count_commit(args.measured, args)
        _print_counts(doc["measured_counts"], f"the code the H200 measured ({args.measured})")
        doc["model"] = model = fit(doc["measured_counts"], args.measured_csv)
        print(f"\n## The static model, fitted on the H200's {', '.join(FIT_CODECS)} rows\n")
        print(f"per launch {model['launch_us']:.1f} us, per host sync (with the call's Python) "
              f"{model['sync_us']:.1f} us, bytes at {model['bandwidth_gbps']:.0f} GB/s")
        print("\n| codec | path | mean abs. error (fitted on) | at 256 MiB fp32 80%: measured / predicted ms |")
        print("|---|---|---|---|")
        for codec in args.codecs:
            for path in TIMED:
                mine = [r for r in model["rows"] if r["codec"] == codec and r["path"] == path]
                if not mine:
                    continue
                head = [r for r in mine if r["size_mib"] == 256 and r["dtype"] == "fp32" and r["sparsity"] == 0.8]
                figure = f"{head[0]['measured_ms']:.3f} / {head[0]['predicted_ms']:.3f}" if head else ""
                print(f"| {codec} | {path} | {np.mean([abs(r['error']) for r in mine]):.1%} "
                      f"({'yes' if mine[0]['fitted_on'] else 'no'}) | {figure} |")
        doc["predicted"] = predict(doc["counts"], model, 256) + predict(doc["counts"], model, 1)
        print("\n## This tree, predicted on the H200 (fp32, 80% zeros)\n")
        print("| codec | path | 256 MiB GB/s | 1 MiB us per call |")
        print("|---|---|---|---|")
        for r in doc["predicted"]:
            if r["dtype"] == "fp32" and r["sparsity"] == 0.8 and r["size_mib"] == 256:
                small = next(s for s in doc["predicted"] if s["size_mib"] == 1 and
                             all(s[k] == r[k] for k in ("codec", "dtype", "sparsity", "path")))
                print(f"| {r['codec']} | {r['path']} | {r['predicted_gbps']:.0f} | {small['predicted_ms'] * 1e3:.0f} |")
    if args.builds:
        doc["builds"] = [b for b in builds() if not b.get("error")]
        print("\n## sm_90 builds at block 128 (int32 words: fp32)\n")
        print("| kernel | config | registers | spilled B | load B per thread per loop pass |")
        print("|---|---|---|---|---|")
        for b in doc["builds"]:
            if (" int32 " in b["config"] or " u8 " in b["config"] or "tables" in b["kernel"]) and " i32 " in b["config"]:
                print(f"| {b['kernel']} | {b['config']} | {b['registers']} | {b['spill_bytes']} | {b['load_bytes']} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "counts.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\n# wrote {args.out / 'counts.json'}")
    return doc


if __name__ == "__main__":
    main()
