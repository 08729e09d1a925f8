"""Epoch reports: the table, totals, JSON round trip, the report folder (JSON lines, CSV,
plots), running without matplotlib, and atomic writes."""

import csv
import dataclasses
import json
import sys
import warnings

import numpy as np
import pytest
import torch

import cswap.report as report_mod
from cswap.report import EpochReport, ReportWriter, TensorRow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PNGS = ("sparsity.png", "decisions.png", "compressed_layers.png")
LONG = "encoder.blocks.17.attention.output.dense_relu_activation_that_goes_on"


def row(epoch, index, layer, decision, nbytes=1000, sparsity=0.5, t_prime=0.010, t_best=0.004,
        compressed=300, layer_type="ReLU", op="relu", shape=(2, 5, 10, 5)):
    return TensorRow(epoch=epoch, key=f"{index}:{layer}", layer=layer, layer_type=layer_type, op=op,
                     shape=shape, nbytes=nbytes, sparsity=sparsity, decision=decision, t_prime_s=t_prime,
                     t_best_s=t_best, compressed_bytes=compressed)


def hand_report(epoch=0):
    """Four tensors whose totals are worked out by hand in test_totals."""
    return EpochReport(epoch=epoch, rows=[
        row(epoch, 0, "features.1", "zvc", nbytes=1000, sparsity=0.375, t_prime=0.010, t_best=0.004, compressed=300),
        # uncompressed: its T' - T must not count, and it moves all its bytes
        row(epoch, 1, "features.4", None, nbytes=2000, sparsity=0.125, t_prime=0.020, t_best=0.015,
            compressed=None, layer_type="MaxPool2d", op="max_pool2d"),
        # compressed without predictions (user policy): bytes count, no time saved
        row(epoch, 2, "features.6", "lz4", nbytes=4000, sparsity=0.9, t_prime=None, t_best=None, compressed=1000),
        # compressed, size unknown (moves nbytes), forced codec slower than no compression
        row(epoch, 3, "classifier.0", "csr", nbytes=500, sparsity=0.6, t_prime=0.005, t_best=0.007,
            compressed=None),
    ], metrics={"loss": 0.6931, "accuracy": 0.5, "step_ms": 12.5, "profiling_overhead_s": 0.25})


def epoch_report(epoch, n=5):
    """A small network's epoch: sparsity grows with the epoch and more tensors get compressed."""
    rows = []
    for i in range(n):
        s = min(0.95, 0.2 + 0.1 * i + 0.05 * epoch)
        rows.append(row(epoch, i, f"features.{2 * i}", "zvc" if s > 0.5 else None, nbytes=4096 * (i + 1),
                        sparsity=s, compressed=int(4096 * (i + 1) * (1 - s)) + 64))
    return EpochReport(epoch=epoch, rows=rows, metrics={"loss": 1.0 / (epoch + 1)})


def files(d):
    return {name: (d / name).read_bytes() for name in ("epochs.jsonl", "tensors.csv")}


# -- rows, totals, table --------------------------------------------------------------------


def test_where():
    assert hand_report().rows[1].where == "features.4 (MaxPool2d)"
    assert row(0, 0, "", None).where == "<root> (ReLU)"


def test_totals_hand_computed():
    t = hand_report().totals
    assert t["tensors"] == 4
    assert t["compressed_layers"] == 3
    assert t["bytes_offloaded"] == 1000 + 2000 + 4000 + 500
    assert t["bytes_moved"] == 300 + 2000 + 1000 + 500
    assert t["swap_time_saved_s"] == pytest.approx((0.010 - 0.004) + (0.005 - 0.007))


def test_totals_empty():
    assert EpochReport(3, [], {}).totals == {"bytes_offloaded": 0, "bytes_moved": 0, "swap_time_saved_s": 0.0,
                                             "compressed_layers": 0, "tensors": 0}


def test_table_contents():
    rep = hand_report()
    rep.rows[1].saved_in = "features.5"  # a max-pool output, saved by the next convolution
    text = rep.table()
    for layer in ("features.1 (ReLU)", "features.4 (MaxPool2d)", "features.6 (ReLU)", "classifier.0 (ReLU)"):
        assert layer in text
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith(("features", "classifier"))}
    assert " zvc " in lines["features.1"] and " lz4 " in lines["features.6"] and " csr " in lines["classifier.0"]
    assert " - " in lines["features.4"]                      # no codec
    assert "37.5%" in lines["features.1"] and "12.5%" in lines["features.4"] and "90.0%" in lines["features.6"]
    assert "10.000" in lines["features.1"] and "4.000" in lines["features.1"]   # T' and T in ms
    assert "2x5x10x5" in lines["features.1"] and "max_pool2d" in lines["features.4"]
    assert lines["features.4"].split()[3] == "features.5" and lines["features.1"].split()[3] == "-"
    total = next(line for line in text.splitlines() if line.startswith("total:"))
    assert "4 tensors" in total and "3 compressed" in total
    assert f"{7500 / 2**20:.2f} MiB offloaded" in total and f"{3800 / 2**20:.2f} MiB moved" in total
    assert "predicted saving 4.000 ms" in total
    assert "loss=0.6931" in text and "profiling_overhead_s=0.25" in text


def test_table_width_and_truncation():
    rep = hand_report()
    rep.rows.append(row(0, 4, LONG, "zvc", layer_type="LeakyReLU", shape=(1024, 2048, 4096, 8192, 3)))
    rep.metrics.update({f"metric_{i}": i / 7 for i in range(30)})
    text = rep.table()
    assert max(len(line) for line in text.splitlines()) <= 110
    assert LONG not in text
    long_line = next(line for line in text.splitlines() if "…" in line and "(LeakyReLU)" in line)
    assert long_line.startswith(LONG[:8]) and f"{LONG[-8:]} (LeakyReLU)" in long_line  # name cut, type kept
    assert "metric_29=" in text                              # metrics wrap, none dropped


def test_table_empty():
    text = EpochReport(7, [], {}).table()
    assert "no candidate tensors" in text and "0 tensors" in text


# -- dicts and JSON -------------------------------------------------------------------------


def test_dict_round_trip_through_json():
    rep = hand_report()
    rep.rows[0].measured_swap_s = 0.0031
    d = rep.to_dict()
    assert d["rows"][0]["shape"] == [2, 5, 10, 5]
    back = EpochReport.from_dict(json.loads(json.dumps(d)))
    assert back == rep
    assert isinstance(back.rows[0].shape, tuple)
    older = {k: v for k, v in d["rows"][0].items() if k != "saved_in"}  # a report written before saved_in
    assert TensorRow.from_dict(older).saved_in == ""


def test_to_dict_plain_numbers():
    rep = EpochReport(np.int64(2), [row(2, 0, "f", "zvc", nbytes=np.int64(64), sparsity=np.float32(0.5),
                                        compressed=np.int64(10))],
                      {"loss": torch.tensor(0.25), "top1": np.float64(0.5)})
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["epoch"] == 2 and d["metrics"] == {"loss": 0.25, "top1": 0.5}
    assert d["rows"][0]["nbytes"] == 64 and d["rows"][0]["sparsity"] == 0.5


def test_from_dict_errors():
    d = hand_report().to_dict()
    d["rows"][0]["colour"] = "red"
    with pytest.raises(ValueError, match="cswap.report: unknown tensor row field.*colour"):
        EpochReport.from_dict(d)
    d = hand_report().to_dict()
    del d["rows"][1]["nbytes"]
    with pytest.raises(ValueError, match="missing field.*nbytes"):
        EpochReport.from_dict(d)


# -- the report folder ----------------------------------------------------------------------


def test_writer_jsonl_csv_and_read(tmp_path):
    d = tmp_path / "report"
    w = ReportWriter(d, plots=False)
    reports = [epoch_report(e) for e in range(3)]
    reports[1].rows.append(row(1, 5, LONG, "lz4", shape=(3,)))
    for i, rep in enumerate(reports):
        paths = w.write(rep)
        assert paths == [d / "epochs.jsonl", d / "tensors.csv"]
        lines = (d / "epochs.jsonl").read_text().splitlines()
        assert len(lines) == i + 1                                   # one line per epoch, appended
        assert json.loads(lines[-1]) == rep.to_dict()
        with open(d / "tensors.csv", newline="") as f:
            got = list(csv.DictReader(f))
        assert len(got) == sum(len(r.rows) for r in reports[:i + 1])   # rows of all epochs so far
    assert list(got[0]) == [f.name for f in dataclasses.fields(TensorRow)]
    assert [int(g["epoch"]) for g in got] == [r.epoch for rep in reports for r in rep.rows]
    first = reports[0].rows[0]
    assert got[0]["key"] == first.key and got[0]["shape"] == "2x5x10x5"
    assert float(got[0]["sparsity"]) == first.sparsity and int(got[0]["nbytes"]) == first.nbytes
    assert got[0]["decision"] == "" and got[-1]["decision"] == "zvc" and got[0]["measured_swap_s"] == ""
    assert ReportWriter.read(d) == reports
    assert not list(d.glob("*.tmp")) and not list(d.glob("*.png"))


def test_new_writer_appends_to_existing_folder(tmp_path):
    ReportWriter(tmp_path, plots=False).write(epoch_report(0))
    ReportWriter(tmp_path, plots=False).write(epoch_report(1))     # a resumed run
    assert [r.epoch for r in ReportWriter.read(tmp_path)] == [0, 1]
    with open(tmp_path / "tensors.csv", newline="") as f:
        assert [int(g["epoch"]) for g in csv.DictReader(f)] == [0] * 5 + [1] * 5


def test_repeated_epoch_supersedes_in_csv(tmp_path):
    w = ReportWriter(tmp_path, plots=False)
    for e in range(3):
        w.write(epoch_report(e))
    with pytest.warns(RuntimeWarning, match="epoch 1 written after epoch 2"):
        w.write(epoch_report(1, n=2))                              # resumed from the epoch-1 checkpoint
    assert [r.epoch for r in ReportWriter.read(tmp_path)] == [0, 1, 2, 1]   # the log keeps everything
    with open(tmp_path / "tensors.csv", newline="") as f:
        assert [int(g["epoch"]) for g in csv.DictReader(f)] == [0] * 5 + [1] * 2


def test_read_ignores_corrupt_last_line(tmp_path):
    w = ReportWriter(tmp_path, plots=False)
    w.write(epoch_report(0))
    w.write(epoch_report(1))
    good = (tmp_path / "epochs.jsonl").read_text()
    (tmp_path / "epochs.jsonl").write_text(good + '{"epoch": 2, "rows": [{"epo')
    with pytest.warns(RuntimeWarning, match="corrupt last line"):
        assert ReportWriter.read(tmp_path) == [epoch_report(0), epoch_report(1)]
    lines = good.splitlines()
    (tmp_path / "epochs.jsonl").write_text(lines[0] + "\n{not json\n" + lines[1] + "\n")
    with pytest.raises(ValueError, match="line 2"):
        ReportWriter.read(tmp_path)


def test_read_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="cswap.report"):
        ReportWriter.read(tmp_path)


# -- plots ----------------------------------------------------------------------------------


def assert_pngs(d, paths):
    for name in PNGS:
        assert d / name in paths
        data = (d / name).read_bytes()
        assert data[:8] == PNG_MAGIC
        assert len(data) > 5000, f"{name} is only {len(data)} bytes"


def test_plots_written_and_regenerated(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    backend = matplotlib.get_backend()
    had_pyplot = "matplotlib.pyplot" in sys.modules
    w = ReportWriter(tmp_path)
    rep = epoch_report(0)
    rep.rows.append(row(0, 9, LONG, "csr"))
    rep.rows.append(row(0, 10, "features.0", "rle"))           # same layer as key 0: a second tensor
    paths = w.write(rep)
    assert_pngs(tmp_path, paths)
    before = {name: (tmp_path / name).read_bytes() for name in PNGS}
    paths = w.write(epoch_report(1))
    assert_pngs(tmp_path, paths)
    for name in PNGS:
        assert (tmp_path / name).read_bytes() != before[name], f"{name} was not redrawn"
    assert matplotlib.get_backend() == backend
    assert had_pyplot or "matplotlib.pyplot" not in sys.modules
    assert not list(tmp_path.glob("*.tmp"))


def test_plots_with_no_rows(tmp_path):
    pytest.importorskip("matplotlib")
    w = ReportWriter(tmp_path)
    assert_pngs(tmp_path, w.write(EpochReport(0, [], {})))
    assert_pngs(tmp_path, w.write(epoch_report(1)))             # tensors appear later


def test_plots_off(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = ReportWriter(tmp_path, plots=False).write(epoch_report(0))
    assert all(p.suffix != ".png" for p in paths) and not list(tmp_path.glob("*.png"))


def test_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib now raises ImportError
    w = ReportWriter(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = [w.write(epoch_report(e)) for e in range(2)]
    messages = [str(c.message) for c in caught if "pip install matplotlib" in str(c.message)]
    assert len(messages) == 1
    assert paths[-1] == [tmp_path / "epochs.jsonl", tmp_path / "tensors.csv"]
    assert not list(tmp_path.glob("*.png"))
    assert len(ReportWriter.read(tmp_path)) == 2


# -- atomic writes --------------------------------------------------------------------------


def _boom(*args, **kwargs):
    raise RuntimeError("disk on fire")


def test_failed_plot_leaves_files_intact(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    w = ReportWriter(tmp_path)
    w.write(epoch_report(0))
    old = files(tmp_path)
    old_png = (tmp_path / "sparsity.png").read_bytes()
    monkeypatch.setattr(report_mod, "_plot_decisions", _boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        w.write(epoch_report(1))
    assert files(tmp_path) == old
    assert (tmp_path / "sparsity.png").read_bytes() == old_png    # drawn before the failure, not replaced
    assert ReportWriter.read(tmp_path) == [epoch_report(0)]
    assert not list(tmp_path.glob("*.tmp"))
    monkeypatch.undo()
    w.write(epoch_report(1))                                       # the failed epoch is not half-recorded
    assert [r.epoch for r in ReportWriter.read(tmp_path)] == [0, 1]


@pytest.mark.parametrize("target", ["_csv_bytes", "_stage_second"])
def test_failed_csv_leaves_files_intact(tmp_path, monkeypatch, target):
    w = ReportWriter(tmp_path, plots=False)
    w.write(epoch_report(0))
    old = files(tmp_path)
    if target == "_csv_bytes":
        monkeypatch.setattr(report_mod, "_csv_bytes", _boom)
    else:                                                          # jsonl staged, then the disk fills up
        real, calls = report_mod._stage, []

        def stage(path, data):
            calls.append(path)
            if len(calls) == 2:
                raise OSError(28, "No space left on device")
            return real(path, data)
        monkeypatch.setattr(report_mod, "_stage", stage)
    with pytest.raises((RuntimeError, OSError)):
        w.write(epoch_report(1))
    assert files(tmp_path) == old
    with open(tmp_path / "tensors.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 5
    assert ReportWriter.read(tmp_path) == [epoch_report(0)]
    assert not list(tmp_path.glob("*.tmp"))


def test_failed_replace_leaves_whole_files(tmp_path, monkeypatch):
    """Even if the final renames stop halfway, every file is a whole one (old or new)."""
    w = ReportWriter(tmp_path, plots=False)
    w.write(epoch_report(0))
    real, calls = report_mod.os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(5, "I/O error")
        return real(src, dst)
    monkeypatch.setattr(report_mod.os, "replace", replace)
    with pytest.raises(OSError):
        w.write(epoch_report(1))
    monkeypatch.undo()
    assert [r.epoch for r in ReportWriter.read(tmp_path)] == [0, 1]   # jsonl was replaced whole
    with open(tmp_path / "tensors.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 5                       # csv is the old one, whole
    assert not list(tmp_path.glob("*.tmp"))
    w.write(epoch_report(1))                                          # retry: no duplicate line
    assert [r.epoch for r in ReportWriter.read(tmp_path)] == [0, 1]
