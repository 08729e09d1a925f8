"""benchmarks/gil_wait.py: a helper thread's wait for the GIL under each switch interval, with
and without a torch op in the training loop. Its figures are timings (they live in
benchmarks/results/gil-wait/); this checks what it measures and writes."""

import json
import sys

import pytest
from benchmark_module import load_benchmark


def test_quick_run_measures_every_gap_and_interval_and_a_control_without_torch_ops(tmp_path):
    before = sys.getswitchinterval()
    doc = load_benchmark("gil_wait").main(["--quick", "--seconds", "0.05", "--out", str(tmp_path)])
    assert sys.getswitchinterval() == before  # (each measurement puts the interval back)
    rows = doc["rows"]
    assert [(r["python_us"], r["torch_op"], r["interval_ms"]) for r in rows] == [
        (2.0, True, 5.0), (2.0, True, 0.2), (40.0, True, 5.0), (40.0, True, 0.2),
        (40.0, False, 5.0), (40.0, False, 0.2)]
    for r in rows:
        assert r["waits"] >= 1 and 0 <= r["median_ms"] <= r["p90_ms"] <= r["max_ms"] and r["loop_x_alone"] > 0
    assert json.loads((tmp_path / "gil_wait.json").read_text())["rows"] == rows
    assert (tmp_path / "gil_wait.csv").read_text().count("\n") == len(rows) + 1


def test_the_helpers_wait_is_measured_from_the_end_of_its_sleep(monkeypatch):
    """The sleep's own length is not counted: with no training thread contending, a helper
    whose sleep returned at once has waited nothing."""
    bench = load_benchmark("gil_wait")
    clock = iter([10.0, 10.0 + 0.002 + 0.0003])
    monkeypatch.setattr(bench.time, "sleep", lambda s: None)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    assert bench.idle_waits(0.002, 1)[0] == pytest.approx(0.0003)
