"""Smoke test: the codec benchmark runs end to end in quick mode on CPU."""

import importlib.util
import json
from pathlib import Path

import cswap

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "codecs.py"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_codec_benchmark_quick_run_writes_results(tmp_path, capsys):
    bench = _load(SCRIPT)
    rows = bench.main(["--quick", "--sizes-mib", "0.02", "--sparsities", "0.5", "--dtypes", "bf16",
                       "--repeats", "1", "--out", str(tmp_path)])
    assert [r["provider"] for r in rows] == list(cswap.codecs.names())
    for row in rows:
        assert "error" not in row, row
        assert row["compress_gbps"] > 0 and row["decompress_gbps"] > 0
        # bf16 at 50% zeros: CSR's 4-byte column indices outweigh 2-byte values; the others shrink it.
        assert (row["ratio"] < 1) if row["provider"] == "csr" else (row["ratio"] > 1.2), row
    saved = json.loads((tmp_path / "codecs-quick.json").read_text())
    assert saved["rows"] == rows and saved["environment"]["torch"]
    assert (tmp_path / "codecs-quick.csv").read_text().count("\n") == len(rows) + 1
    assert "zvc" in capsys.readouterr().out
