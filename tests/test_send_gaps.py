"""benchmarks/send_gaps.py: how long each compressed send waited after its sizes landed,
from a Chrome trace of a profiled step (only a GPU makes one: these build one as the
profiler lays it out)."""

import gzip
import json

import pytest
from benchmark_module import load_benchmark


@pytest.fixture(scope="module")
def send_gaps():
    return load_benchmark("send_gaps")


def _copy(ts_ms, dur_ms, nbytes):
    return {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": ts_ms * 1e3, "dur": dur_ms * 1e3,
            "args": {"bytes": nbytes}}


def _trace():
    """A kernel at 0; sizes land at 1, send 1 at 1.5 until 5; the next sizes queue behind it
    (5 to 5.01), send 2 at 8.01 until 9; a host-to-device copy and a send with no sizes
    before it (a raw one) are left out."""
    return {"traceEvents": [
        {"cat": "kernel", "name": "_zvc_one_pass_kernel", "ts": 0.0, "dur": 500.0, "args": {}},
        _copy(0.99, 0.01, 8), _copy(1.5, 3.5, 300 << 20),
        _copy(5.0, 0.01, 8), _copy(8.01, 0.99, 100 << 20),
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 9e3, "dur": 1e3, "args": {"bytes": 1 << 30}},
        {"cat": "cpu_op", "name": "aten::relu", "ts": 10e3, "dur": 5.0},
    ]}


def test_each_send_is_timed_from_its_sizes_and_from_the_send_before(send_gaps):
    rows = send_gaps.gaps(_trace())
    assert [round(r["at_ms"], 2) for r in rows] == [1.5, 8.01]
    assert [r["after_sizes_ms"] for r in rows] == pytest.approx([0.5, 3.0])
    assert [r["after_previous_ms"] for r in rows] == pytest.approx([1.5, 3.01])  # (the first: from the step's start)
    assert [r["mib"] for r in rows] == [300, 100]


def test_a_send_with_no_sizes_before_it_is_left_out(send_gaps):
    trace = _trace()
    trace["traceEvents"].insert(1, _copy(0.2, 0.5, 50 << 20))  # raw: pack sent it before any encode's sizes
    assert [round(r["at_ms"], 2) for r in send_gaps.gaps(trace)] == [1.5, 8.01]


def test_the_command_reads_a_gzipped_trace(send_gaps, tmp_path, capsys):
    path = tmp_path / "trace-cifar-sc.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    (result,) = send_gaps.main([str(path)])
    assert result["trace"] == path.name and len(result["copies"]) == 2
    assert "median 1.75 ms, sum 3.5 ms" in capsys.readouterr().out
