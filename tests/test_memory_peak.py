"""benchmarks/memory_peak.py: what a step holds at its peak, from a CUDA memory snapshot.

A snapshot comes only from a GPU, so these build one as torch.cuda.memory._snapshot()
lays it out (segments of blocks, and the allocator's trace)."""

import gzip
import pickle

import pytest
from benchmark_module import load_benchmark

MIB = 2 ** 20


@pytest.fixture(scope="module")
def memory_peak():
    return load_benchmark("memory_peak")


def _frame(path, name):
    return {"filename": path, "line": 1, "name": name}


CONV = [_frame("/site/torch/nn/modules/conv.py", "_conv_forward"),
        _frame("/site/torch/nn/modules/module.py", "_call_impl")]
RESTORE = [_frame("/site/torch/cuda/streams.py", "__enter__"), _frame("/site/cswap/runtime/lanes.py", "alloc_in"),
           _frame("/site/torch/nn/modules/module.py", "_call_impl")]


def _event(action, addr, mib, frames=()):
    return {"action": action, "addr": addr, "size": mib * MIB, "stream": 0, "frames": list(frames)}


def _snapshot():
    """Parameters (100 MiB) and the last step's gradients (10 MiB, freed) from before the
    history; then forward's conv output (50), a restore (30, freed while its stream may still
    read it, completed after the peak), a backward op's workspace (40, no Python frame)."""
    trace = [
        _event("free_requested", 1 * MIB, 10), _event("free_completed", 1 * MIB, 10),
        _event("alloc", 2 * MIB, 50, CONV),
        _event("alloc", 3 * MIB, 30, RESTORE),
        _event("free_requested", 3 * MIB, 30, RESTORE),
        _event("alloc", 4 * MIB, 40),  # the peak: 100 + 50 + 30 + 40
        _event("free_requested", 4 * MIB, 40), _event("free_completed", 4 * MIB, 40),
        _event("free_completed", 3 * MIB, 30),
        _event("free_requested", 2 * MIB, 50), _event("free_completed", 2 * MIB, 50),
        _event("alloc", 5 * MIB, 5),
    ]
    blocks = [{"address": 0, "size": 100 * MIB, "requested_size": 100 * MIB, "state": "active_allocated", "frames": []},
              {"address": 2 * MIB, "size": 50 * MIB, "requested_size": 50 * MIB, "state": "inactive", "frames": []},
              {"address": 5 * MIB, "size": 5 * MIB, "requested_size": 5 * MIB, "state": "active_allocated",
               "frames": []}]
    return {"segments": [{"device": 0, "address": 0, "total_size": 300 * MIB, "stream": 0, "segment_type": "large",
                          "allocated_size": 105 * MIB, "active_size": 105 * MIB, "blocks": blocks}],
            "device_traces": [trace]}


def test_peak_is_replayed_with_the_blocks_from_before_the_history(memory_peak):
    result = memory_peak.replay(_snapshot(), until_completed=True)
    assert result["peak_mib"] == 220 and result["at_event"] == 5 and result["events"] == 12
    groups = {g["where"]: (g["mib"], g["blocks"]) for g in result["groups"]}
    assert groups == {memory_peak.BEFORE: (100, 1), "forward: conv._conv_forward": (50, 1),
                      memory_peak.NO_PYTHON: (40, 1), "cswap: lanes.alloc_in": (30, 1)}
    assert [g["mib"] for g in result["groups"]] == [100, 50, 40, 30]  # largest first


def test_a_block_counts_until_its_free_is_requested_as_max_memory_allocated_counts(memory_peak):
    """The caching allocator takes a block off its allocated bytes when its free is
    requested, before the streams that may still read it are done: the restore freed before
    the workspace is allocated is not in max_memory_allocated's peak, and is in the peak of
    what cannot be reused (until_completed)."""
    result = memory_peak.replay(_snapshot())
    assert (result["peak_mib"], result["at_event"]) == (190, 5)
    assert "cswap: lanes.alloc_in" not in {g["where"] for g in result["groups"]}
    assert memory_peak.replay(_snapshot(), until_completed=True)["peak_mib"] == 220


def test_the_innermost_cswap_frame_names_an_allocation_made_inside_a_module(memory_peak):
    assert memory_peak.where(RESTORE) == "cswap: lanes.alloc_in"
    assert memory_peak.where(CONV) == "forward: conv._conv_forward"
    assert memory_peak.where([_frame("/site/torch/optim/sgd.py", "step")]) == "optimizer"
    assert memory_peak.where([_frame("/work/train.py", "main")]) == "train.py:main"
    assert memory_peak.where([]) == memory_peak.NO_PYTHON


def test_the_command_reads_a_gzipped_snapshot_as_trace_py_writes_it(memory_peak, tmp_path, capsys):
    path = tmp_path / "memory-cifar-vdnn.pickle.gz"
    with gzip.open(path, "wb") as f:
        pickle.dump(_snapshot(), f)
    (result,) = memory_peak.main([str(path), "--until-completed"])
    assert result["snapshot"] == path.name and result["peak_mib"] == 220
    out = capsys.readouterr().out
    assert "peak 220 MiB" in out and "cswap: lanes.alloc_in (30)" in out


def test_a_peak_before_the_history_is_what_the_snapshot_holds(memory_peak):
    snap = _snapshot()
    snap["device_traces"] = [[]]
    result = memory_peak.replay(snap)
    assert (result["peak_mib"], result["at_event"]) == (105, -1)
    assert "(before the history)" in memory_peak.report(result)
