"""benchmarks/ratio.py --quick: the compression-ratio corpus runs, writes its files, and its figures hold."""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ratio

from cswap import codecs

pytestmark = pytest.mark.slow  # the benchmark's quick run: CI runs them (pytest -m slow)

ROWS = ("fp32", "bf16", "all", "dense GELU bf16")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("ratio")
    assert ratio.main(["--quick", "--out", str(out), "--cache", str(out / "corpus.pt")]) == 0
    doc = json.loads((out / "ratio.json").read_text())
    with open(out / "ratio_tensors.csv", newline="") as f:
        tensors = list(csv.DictReader(f))
    return out, doc, tensors


def test_every_codec_and_anchor_is_a_column(quick):
    out, doc, tensors = quick
    assert list(doc["columns"]) == [*codecs.names(), *ratio.ANCHORS]  # a codec registered later shows by itself
    text = (out / "ratio.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| data |"))
    assert header == "| data | " + " | ".join(doc["columns"].values()) + " |"
    assert [r["data"] for r in doc["rows"]] == list(ROWS)
    for row in doc["rows"]:
        label = next(line for line in text.splitlines() if line.startswith(f"| {row['data']} ("))
        assert f"{row['tensors']} tensors" in label and "MiB" in label and "zeros)" in label
        for key in doc["columns"]:
            installed = key not in ratio.ANCHORS or key == "ideal-zvc" or \
                ratio.versions()[{"lz4-package": "lz4", "lz4-hc9": "lz4", "zstd1": "zstandard",
                                  "zstd3": "zstandard", "blosc2": "blosc2"}[key]] is not None
            assert (row[key] > 0) if installed else row[key] is None, (row["data"], key)
    for name in codecs.names():  # every quick tensor went through a bit-exact round trip
        assert doc["round_trips"][name] == {"checked": len(tensors), "failed": []}
    env = doc["environment"]
    assert "do not depend on the device" in env["what"] and env["machine"] and env["torch"]
    assert doc["command"].startswith("python benchmarks/ratio.py --quick")
    assert "on CPU" in text and "same bytes on CPU and GPU" in text


def test_ratios_are_original_over_compressed_bytes(quick):
    _, doc, tensors = quick
    groups = {"fp32": ("fp32",), "bf16": ("bf16",), "all": ("fp32", "bf16"), "dense GELU bf16": ("dense",)}
    assert {t["group"] for t in tensors} == {"fp32", "bf16", "dense"}
    assert {t["dtype"] for t in tensors if t["group"] == "fp32"} == {"float32"}
    assert {t["dtype"] for t in tensors if t["group"] != "fp32"} == {"bfloat16"}
    for row in doc["rows"]:
        mine = [t for t in tensors if t["group"] in groups[row["data"]]]
        original = sum(int(t["nbytes"]) for t in mine)
        assert row["tensors"] == len(mine) and row["bytes"] == original
        assert row["zeros"] == pytest.approx(sum(int(t["zeros"]) for t in mine) /
                                             sum(int(t["nbytes"]) // (4 if t["dtype"] == "float32" else 2)
                                                 for t in mine))
        for key in doc["columns"]:
            if row[key] is not None:
                assert row[key] == pytest.approx(original / sum(int(t[f"{key}_bytes"]) for t in mine))
    for t in tensors:  # ZVC's masks cost at least the bound's bit per element; ideal ZVC is exact
        assert int(t["zvc_bytes"]) >= int(t["ideal-zvc_bytes"])
        numel = math.prod(map(int, t["shape"].split("x")))
        size = 4 if t["dtype"] == "float32" else 2
        assert int(t["ideal-zvc_bytes"]) == math.ceil(numel / 8) + (numel - int(t["zeros"])) * size
    dense = next(r for r in doc["rows"] if r["data"] == "dense GELU bf16")
    assert dense["zeros"] < 0.05                                           # GELU outputs are dense


def test_lz4_is_compared_with_the_package_per_tensor(quick):
    _, doc, tensors = quick
    if ratio.lz4_block is None:
        assert doc["lz4_vs_package"] == []
        return
    by_row = {r["data"]: r for r in doc["lz4_vs_package"]}
    fp32 = [int(t["lz4_bytes"]) / int(t["lz4-package_bytes"]) for t in tensors if t["group"] == "fp32"]
    assert by_row["fp32"]["median"] == pytest.approx(statistics.median(fp32))
    assert by_row["fp32"]["within_5pct"] == sum(q <= 1.05 for q in fp32)
    assert by_row["fp32"]["tensors"] == len(fp32)


def test_ideal_zvc_is_one_bit_per_element_plus_the_non_zero_bytes():
    t = torch.tensor([0.0, 1.0, -0.0, 0.0, 2.5, 0.0, 0.0, 0.0, 3.0])  # -0.0 is not an all-zero bit pattern
    assert ratio.ideal_zvc(t) == 2 + 4 * 4
    assert ratio.ideal_zvc(t.to(torch.bfloat16)) == 2 + 4 * 2
    assert ratio.ideal_zvc(torch.zeros(64, dtype=torch.float16)) == 8
    assert ratio.ideal_zvc(torch.ones(3, 3, dtype=torch.float64)) == 2 + 9 * 8


def test_missing_packages_print_na_and_the_cache_is_reused(quick, monkeypatch, capsys):
    out, _, _ = quick
    monkeypatch.setattr(ratio, "zstandard", None)
    monkeypatch.setattr(ratio, "blosc2", None)
    again = out / "again"
    capsys.readouterr()
    assert ratio.main(["--quick", "--out", str(again), "--cache", str(out / "corpus.pt"),
                       "--codecs", "zvc", "zstd1", "blosc2", "ideal-zvc"]) == 0
    printed = capsys.readouterr().out
    assert "corpus read from" in printed and "package not installed" in printed
    doc = json.loads((again / "ratio.json").read_text())
    assert list(doc["columns"]) == ["zvc", "zstd1", "blosc2", "ideal-zvc"]
    for row in doc["rows"]:
        assert row["zstd1"] is None and row["blosc2"] is None and row["zvc"] > 0 and row["ideal-zvc"] > 0
        line = next(line for line in printed.splitlines() if line.startswith(f"| {row['data']} ("))
        assert line.endswith(f"| {row['zvc']:.2f} | n/a | n/a | {row['ideal-zvc']:.2f} |")
    assert "n/a: zstd 1, blosc2 bitshuffle+zstd (package not installed" in printed
    with pytest.raises(SystemExit):
        ratio.main(["--quick", "--codecs", "zvc", "gzip"])


def test_the_corpus_rules():
    # cswap's rule on small_cnn: ReLU and pooling outputs only, each once (pool2's flatten is its output's bytes)
    torch.manual_seed(0)
    from cswap.models import build

    got = ratio.capture(build("small_cnn", dataset="cifar10"), torch.randn(2, 3, 32, 32), False, ratio.offloaded)
    assert [op for _, op in got] == ["relu", "max_pool2d", "relu", "max_pool2d", "relu"]
    assert all(t.dtype == torch.float32 for t, _ in got)
    # the dense rule: bf16 activations, no weight casts (with them, more tensors, each a parameter's shape)
    model = ratio.DigitRows(16, 2, 1)
    x = torch.randn(3, 8, 8)
    dense = ratio.capture(model, x, True, ratio.dense_activation)
    every = ratio.capture(model, x, True, lambda t: t.dtype == torch.bfloat16 and ratio.is_activation(t))
    ops = [op for _, op in dense]
    assert "gelu" in ops and all(t.dtype == torch.bfloat16 for t, _ in dense)
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.t().shape) for p in model.parameters()
                                                            if p.dim() == 2}
    left = Counter((op, tuple(t.shape)) for t, op in every) - Counter((op, tuple(t.shape)) for t, op in dense)
    assert sum(left.values()) >= 4 and all(op == "to_copy" and shape in shapes for op, shape in left), left
    w = nn.Parameter(torch.randn(4, 4))
    assert ratio.from_parameters(w.to(torch.bfloat16).t().grad_fn)
    assert not ratio.from_parameters(nn.functional.linear(torch.randn(2, 4), w).grad_fn)  # bias-free linear
