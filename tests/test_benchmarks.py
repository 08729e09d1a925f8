"""Smoke tests: the benchmarks run end to end in quick mode on CPU."""

import contextlib
import gzip
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import cswap
import pytest
import torch

from benchmark_module import load_benchmark
from cswap.tune.host_cost import time_steps

pytestmark = pytest.mark.slow  # the benchmarks' quick runs: CI runs them (pytest -m slow)

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def test_codec_benchmark_quick_run_writes_results(tmp_path, capsys):
    bench = load_benchmark("codecs")
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


def test_zans_tile_benchmark_round_trips_each_tile_and_prices_the_short_ones(tmp_path):
    """Off a GPU it takes ratios only (no interpreter time passes for a GPU's); each tile
    round-trips the same tensor, and a shorter tile gives a plane more warps, fewer steps
    per lane and a lower ratio (more state flushes)."""
    bench = load_benchmark("zans_tiles")
    rows = bench.main(["--quick", "--sizes-mib", "0.0625", "--cases", "bf16-gelu", "--tiles", "4096", "8192",
                       "--out", str(tmp_path)])
    assert [r["tile"] for r in rows] == [4096, 8192, 16384]  # (the default tile joins, to compare with)
    assert all("decode_ms" not in r for r in rows)
    warps = [r["warps_per_plane"] for r in rows]
    steps = [r["steps_per_lane"] for r in rows]
    ratios = [r["ratio"] for r in rows]
    assert warps == [8, 4, 2] and steps == [128, 256, 512]
    assert ratios[0] < ratios[1] < ratios[2] and rows[-1]["ratio_vs_default"] == 1.0
    assert rows[0]["ratio_vs_default"] > 0.97
    assert json.loads((tmp_path / "zans-tiles.json").read_text())["rows"] == rows


def test_zans_tile_benchmark_times_the_default_tile_at_more_programs(tmp_path):
    """More programs an SM change where tiles run, not what they hold: the row decodes
    (measure checks its round trip) to the same ratio as the default launch's."""
    bench = load_benchmark("zans_tiles")
    rows = bench.main(["--quick", "--sizes-mib", "0.0625", "--cases", "bf16-gelu", "--tiles", "16384",
                       "--programs-per-sm", "16", "--out", str(tmp_path)])
    assert [(r["tile"], r["programs_per_sm"]) for r in rows] == [(16384, 4), (16384, 16)]
    assert rows[1]["ratio"] == rows[0]["ratio"] and rows[1]["ratio_vs_default"] == 1.0


def test_lz4_warps_benchmark_writes_the_same_bytes_at_every_count(tmp_path):
    """Off a GPU it compares bytes only: four chunks encoded by 1, 2 and 4 warps in flight
    (a warp taking several chunks by ticket, or one each) give one payload; each count's
    scratch is its warps' tables and staging."""
    bench = load_benchmark("lz4_warps")
    rows = bench.main(["--quick", "--sparsities", "0.5", "--out", str(tmp_path)])
    assert [r["warps"] for r in rows] == [1, 2, 4] and all(r["same_bytes"] for r in rows)
    assert all("encode_ms" not in r for r in rows) and len({r["ratio"] for r in rows}) == 1
    per_warp = 2 * 8 * 4096 + 16384  # two tables of 4096 8-byte entries, and a block's staging (plus its bound)
    assert rows[2]["scratch_mib"] == 4 * rows[0]["scratch_mib"] and 0 < rows[0]["scratch_mib"] * 2**20 - per_warp < 256
    assert json.loads((tmp_path / "lz4-warps.json").read_text())["rows"] == rows


def test_codec_host_benchmark_splits_a_calls_host_time(tmp_path):
    """Run as a script (the interpreter these tests set would replace the kernels): every
    ZVC call launches its one Triton kernel through Triton's path, and the host time splits
    into cswap's part and Triton's, both there."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, str(BENCHMARKS / "codec_host.py"), "--codecs", "zvc", "--mib", "0.25",
                          "--calls", "20", "--rounds", "3", "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads((tmp_path / "codec-host.json").read_text())["rows"]
    assert [(r["codec"], r["direction"], r["triton_launches"]) for r in rows] == [("zvc", "encode", 1),
                                                                                  ("zvc", "decode", 1)]
    for r in rows:
        assert r["cswap_us"] > 0 and r["triton_us"] > 0
        assert r["host_us"] == pytest.approx(r["cswap_us"] + r["triton_us"])


def test_codecs_ab_runs_both_trees_and_compares_each_case(tmp_path):
    """Off a GPU both "trees" are this one (the base site is empty): each case pairs up,
    its payload sizes agree, and every time has a ratio; the runs' own files stay."""
    bench = load_benchmark("codecs_ab")
    rows = bench.main(["--base-site", str(tmp_path / "empty"), "--rounds", "1", "--out", str(tmp_path / "ab"), "--",
                       "--quick", "--codecs", "zvc", "--dtypes", "fp32", "--sparsities", "0.5", "--sizes-mib",
                       "0.0625", "--no-nvcomp"])
    assert [(r["provider"], r["dtype"], r["sparsity"]) for r in rows] == [("zvc", "fp32", "0.5")]
    assert rows[0]["same_size"] and rows[0]["compress_ratio"] > 0 and rows[0]["decompress_ratio"] > 0
    assert (tmp_path / "ab" / "base-1" / "codecs-quick.csv").exists()
    assert json.loads((tmp_path / "ab" / "codecs-ab.json").read_text())["rows"] == rows


def test_codecs_ab_takes_medians_over_rounds_and_flags_a_size_change():
    bench = load_benchmark("codecs_ab")
    case = {"provider": "zvc", "dtype": "fp32", "size_mib": "256.0", "sparsity": "0.8", "pattern": "blocky"}

    def run(ms, size="100"):
        return [{**case, "compress_ms": str(ms), "launch_ms": "", "decompress_ms": str(2 * ms),
                 "compressed_bytes": size}]

    rows = bench.compare([run(1.0), run(3.0), run(2.0)], [run(0.5), run(1.5)])
    assert rows[0]["base_compress_ms"] == 2.0 and rows[0]["new_compress_ms"] == 1.0
    assert rows[0]["compress_ratio"] == 0.5 and rows[0]["decompress_ratio"] == 0.5
    assert "launch_ratio" not in rows[0] and rows[0]["same_size"]
    assert not bench.compare([run(1.0)], [run(1.0, size="101")])[0]["same_size"]
    assert bench.compare([run(1.0)], [[{**run(1.0)[0], "dtype": "bf16"}]]) == []  # no case in common


def test_codec_counts_benchmark_counts_both_trees_and_fits_the_h200(tmp_path, capsys):
    bench = load_benchmark("codec_counts")
    doc = bench.main(["--codecs", "zvc", "--dtypes", "fp32", "--sparsities", "0.5", "0.8", "--mib", "0.0625",
                      "--no-builds", "--out", str(tmp_path)])
    now = {(r["sparsity"], r["path"]): r for r in doc["counts"]}
    before = {(r["sparsity"], r["path"]): r for r in doc["measured_counts"]}
    # The one-pass encoder reads its input once where the measured code read it twice (a
    # compress into a buffer of the exact size still counts the non-zeros first).
    assert now[(0.8, "launch_into")]["read_per_byte"] < before[(0.8, "compress")]["read_per_byte"] - 0.9
    assert now[(0.8, "launch_into")]["syncs"] == 0 and (0.8, "launch_into") not in before
    model = doc["model"]
    assert model["launch_us"] > 0 and model["bandwidth_gbps"] > 100
    assert {r["path"] for r in model["rows"]} == {"compress", "decompress"} and len(model["rows"]) == 2 * 2 * 3
    assert json.loads((tmp_path / "counts.json").read_text())["counts"] == doc["counts"]
    assert "static model" in capsys.readouterr().out


def test_codec_counts_benchmark_fits_this_tree_on_a_later_sweep(tmp_path):
    """--measured this: the sweep timed this tree's kernels; the runtime's compress path
    (launch_ms, 2026-12-04 on) is fitted on beside compress and decompress."""
    bench = load_benchmark("codec_counts")
    sweep = BENCHMARKS / "results" / "nvidia-h200" / "gpu-2026-12-04" / "codecs" / "codecs.csv"
    doc = bench.main(["--codecs", "zvc", "--dtypes", "fp32", "--sparsities", "0.8", "--mib", "0.0625",
                      "--no-builds", "--measured", "this", "--measured-csv", str(sweep), "--out", str(tmp_path)])
    assert doc["measured_counts"] is doc["counts"] and doc["measured_csv"].endswith("codecs.csv")
    rows = doc["model"]["rows"]
    assert {r["path"] for r in rows} == {"compress", "decompress", "launch_into"} and len(rows) == 3 * 3
    launch = [r for r in rows if r["path"] == "launch_into" and r["size_mib"] == 256][0]
    assert launch["measured_ms"] == pytest.approx(0.4679, rel=1e-3)  # the H200's runtime path at 256 MiB


def test_runtime_benchmark_quick_run_matches_losses(tmp_path):
    bench = load_benchmark("runtime")
    rows = bench.main(["--quick", "--batch", "2", "--warmup", "2", "--iters", "1", "--check-decisions", "1",
                       "--out", str(tmp_path)])
    by = {r["provider"]: r for r in rows}
    assert set(by) == {"unpatched", "none", "vdnn", "sc", "cswap", "cswap_timeline", "save_on_cpu",
                       "vdnn_checksum", "sc_checksum", "cswap_checksum"}
    # the same bytes move with the checksum on, but for what ZVC's copies queued at their encodes move
    # as the pass before's payload, when a payload shrank since (the checksum leaves them to the sender)
    assert by["vdnn_checksum"]["moved_mib_per_step"] == by["vdnn"]["moved_mib_per_step"]
    assert by["sc_checksum"]["moved_mib_per_step"] <= by["sc"]["moved_mib_per_step"]
    for name in ("vdnn", "sc", "cswap"):
        assert by[name + "_checksum"]["checksum_cost"] == by[name + "_checksum"]["step_ms"] / by[name]["step_ms"] - 1
    assert all(r["loss_matches"] for r in rows), rows  # same first step, bit for bit
    assert by["none"]["moved_mib_per_step"] == 0
    assert by["vdnn"]["moved_mib_per_step"] > 0 and by["vdnn"]["compressed_per_step"] == 0
    # ZVC shrinks ReLU outputs: sc moves less than vdnn
    assert 0 < by["sc"]["moved_mib_per_step"] < by["vdnn"]["moved_mib_per_step"]
    assert by["sc"]["compressed_per_step"] > 0
    for name in ("cswap", "cswap_timeline"):
        assert by[name]["candidate_tensors"] > 0 and by[name]["profiling_overhead_ms_per_step"] >= 0
    assert json.loads((tmp_path / "runtime-quick.json").read_text())["rows"] == rows
    # the floor, predicted: the same for every provider, at most the unpatched peak (CIFAR, batch 2:
    # the parameters and their gradients are nearly all of it)
    floors = {(r["floor_mib"], r["predicted_unpatched_mib"]) for r in rows}
    assert len(floors) == 1 and 0 < min(floors)[0] <= min(floors)[1]
    assert all(r["windows_mib"] > 0 for r in rows if r["provider"] in ("vdnn", "sc"))


def test_the_runtime_benchmarks_floor_is_static_state_plus_one_ops_working_set():
    """Issue 39 §2: VGG16 ImageNet batch 64 with plain SGD: parameters and gradients (2 x 528
    MiB) plus the largest op's backward (conv1_2: its input, its output's gradient and its
    input's gradient, 784 MiB each at 224x224x64, plus its temporaries): about 3445 MiB."""
    bench = load_benchmark("runtime")
    floor = bench.memory_floor(bench.parse_args(["--dataset", "imagenet", "--batch", "64"]))
    assert 2 * 528 + 3 * 784 <= floor["floor_mib"] < 3600, floor
    assert floor["floor_mib"] < 0.7 * floor["predicted_unpatched_mib"], floor


def test_train_benchmark_quick_run_writes_results_and_readme(tmp_path, capsys):
    bench = load_benchmark("train")
    rows = bench.main(["--quick", "--batch", "2", "--out", str(tmp_path)])
    models = {r["model"] for r in rows}
    assert models == {"small_cnn", "resnet18"} and {r["dataset"] for r in rows} == {"cifar10"}
    for model in models:
        by = {r["mode"]: r for r in rows if r["model"] == model}
        assert set(by) == set(bench.MODES) | {bench.ORAC}  # a mode that raises still has its row
        for name in ("none", "vdnn", "sc", "cswap"):
            assert "error" not in by[name], by[name]
        ran = [r for r in by.values() if "error" not in r and not r["computed"]]
        assert all(r["loss_matches"] for r in ran), ran  # same first step as "none", bit for bit
        assert by["vdnn"]["norm_vs_vdnn"] == 1 and by["none"]["exposed_swap_ms"] == 0
        assert by["none"]["moved_mib_per_iter"] == 0 < by["sc"]["moved_mib_per_iter"] < by["vdnn"]["moved_mib_per_iter"]
        assert by["sc"]["compressed_layers"] > 0 and by["vdnn"]["compressed_layers"] == 0
        orac = by[bench.ORAC]
        assert orac["computed"] is True and orac["step_ms"] <= by["cswap"]["step_ms"]
    saved = json.loads((tmp_path / "train-quick.json").read_text())
    assert saved["rows"] == rows
    assert (tmp_path / "train-quick.csv").read_text().count("\n") == len(rows) + 1
    if importlib.util.find_spec("matplotlib") is not None:
        for chart in ("throughput", "vs-sc", "memory"):
            assert (tmp_path / f"train-quick-{chart}.png").stat().st_size > 0
    capsys.readouterr()
    text = bench.main(["--readme", "--from-json", str(tmp_path / "train-quick.json")])
    out = capsys.readouterr().out
    assert text in out and "| model | data | batch |" in out
    assert "| small_cnn | cifar10 | 2 |" in out and "| resnet18 | cifar10 | 2 |" in out


def test_codec_benchmark_static_figures_cover_every_codec_and_word_size():
    # What the GPU stage records beside throughput; built here for sm_90 in a process
    # without TRITON_INTERPRET (the interpreter replaces the kernels at import).
    import os
    import subprocess

    script = ("import importlib.util, json, sys; sys.path.insert(0, %r); "
              "spec = importlib.util.spec_from_file_location('bench_codecs', %r); "
              "bench = importlib.util.module_from_spec(spec); spec.loader.exec_module(bench); "
              "f = bench.static_figures(90, 128, ['zvc', 'lz4']); "
              "print(json.dumps({f'{c} {i}': v for (c, i), v in f.items()}))"
              ) % (str(BENCHMARKS), str(BENCHMARKS / "codecs.py"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout.splitlines()[-1])
    assert set(figures) == {f"{c} {i}" for c in ("zvc", "lz4") for i in (1, 2, 4, 8)}
    for entry in figures.values():
        assert 0 < entry["registers"] <= 128 and entry["hot_spills"] == 0 and not entry["build_errors"], entry


def test_overhead_benchmark_quick_run(tmp_path):
    bench = load_benchmark("overhead")
    rows = bench.main(["--quick", "--out", str(tmp_path)])
    devices = {r["device"] for r in rows}
    assert devices == {"cpu", "emulated", "lagging"}
    for device in devices:
        by = {r["provider"]: r for r in rows if r["device"] == device}
        assert set(by) == {"unpatched", "hooks", "save_on_cpu", "minimal", "lean", "batched", "keep", "vdnn", "sc",
                           "cswap", "vdnnpp"}
        assert by["unpatched"]["x_unpatched"] == 1.0
        for name in ("vdnn", "sc", "cswap", "vdnnpp"):
            assert by[name]["offloaded_per_step"] == 10 and "added_us_per_tensor" in by[name], by[name]
        assert by["keep"]["offloaded_per_step"] == 0
    assert json.loads((tmp_path / "overhead-quick.json").read_text())["rows"] == rows
    # and the seam calls per tensor, counted on each device (issue 39)
    calls = json.loads((tmp_path / "calls-quick.json").read_text())["rows"]
    by = {(r["device"], r["provider"]): r for r in calls}
    for device in devices:
        # (the emulator is told of every save: a capture check per phase, as for offloaded ones)
        assert by[(device, "keep")]["cuda_calls"] <= 0.05 and by[(device, "keep")]["per"] == "saved tensor"
        assert 0 < by[(device, "vdnn")]["cuda_calls"] < by[(device, "sc")]["cuda_calls"]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_overhead_benchmark_lets_a_providers_background_work_finish_before_the_next():
    """vdnnpp compresses host copies on threads of its own after its steps return; timed next,
    stock autograd took twice as long. common.settle, which overhead.py calls after each
    provider's steps, waits for that work and stops the threads."""
    bench = load_benchmark("overhead")
    model, context = bench.provider("vdnnpp", bench.chain(8, 64))
    try:
        time_steps(model, context, torch.randn(32, 64), 2)
        with context():
            loss = model(torch.randn(32, 64)).sum()
        # (settled before backward: no restore takes a host copy from its compression, which on a
        # loaded machine could run late enough that every one was skipped)
        bench.settle(cswap, model)
        stats = cswap.stats(model)
        done = stats["host_compressed_tensors"]
        assert done > 0  # (relu outputs of a random chain: half zeros, worth compressing)
        assert not [t for t in threading.enumerate() if t.name.startswith(("cswap-host-zvc", "cswap-offload"))]
        time.sleep(0.2)
        assert stats["host_compressed_tensors"] == done  # nothing was left to finish
        with context():
            loss.backward()
        offloaded = stats["offloaded_tensors"]
        time_steps(model, context, torch.randn(32, 64), 1)  # the next step starts new threads
        assert stats["offloaded_tensors"] == offloaded + 8
    finally:
        cswap.unpatch(model)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_in_process_ab_lets_each_chains_background_work_finish():
    """ab_overhead.py settles each patched chain after its steps, through the package that
    patched it (the base commit's or the working tree's), as overhead.py does."""
    ab = load_benchmark("ab_overhead")
    model = cswap.patch(ab.chain(8, 64), mode="vdnnpp", candidates="all", min_bytes=0)
    try:
        time_steps(model, contextlib.nullcontext, torch.randn(32, 64), 3)
        ab.settle(cswap, model)
        assert not [t for t in threading.enumerate() if t.name.startswith(("cswap-host-zvc", "cswap-offload"))]
    finally:
        cswap.unpatch(model)


def test_the_minimal_offload_floor_really_offloads():
    """The benchmark's floor copies each activation out once and back once (a provider that
    copied nothing would make the floor, and cswap's distance to it, meaningless)."""
    bench = load_benchmark("overhead")
    x = torch.randn(8, 16)
    grads = []
    for hooks in (None, bench.MinimalOffload()):
        model = bench.chain(4, 16)
        for _ in range(2):  # the second step reuses the first's host buffers
            model.zero_grad()
            with hooks.hooks() if hooks else contextlib.nullcontext():
                loss = model(x).sum()
            loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    packed = [p for _, p in hooks.seen.values()]
    assert len(packed) == 4 and all(p[3] is not None for p in packed)  # 4 ReLU outputs, each restored once
    assert sum(len(v) for v in hooks.pool.values()) == 0  # the first step's buffers were taken again


def test_the_lean_sketch_really_offloads_and_releases():
    """The `lean` provider prices cswap's per-tensor mechanics: it must copy each activation out,
    release it once copied (memory gone, version counter kept), bring it back exactly and
    reuse the host buffers, or its figure would mean nothing."""
    bench = load_benchmark("overhead")
    x = torch.randn(8, 16)
    grads = []
    for hooks in (None, bench.LeanOffload()):
        model = bench.chain(4, 16)
        for _ in range(2):  # the second step reuses the first's host buffers
            model.zero_grad()
            with hooks.hooks() if hooks else contextlib.nullcontext():
                loss = model(x).sum()
                if hooks:
                    items = list(hooks.items)
                    assert len(items) == 4 and not hooks.inflight and hooks.stash == 0
                    assert all(i.src is None and i.counter.untyped_storage().nbytes() == 0 for i in items)
            loss.backward()
            if hooks:
                assert all(i.restored is not None for i in items)  # each came back through the host
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert hooks.stats["offloaded_tensors"] == 8 and hooks.stats["deduplicated"] == 6
    del loss, items
    assert sum(len(v) for v in hooks.pool.values()) == 4  # every buffer came back once its saves were gone


def test_the_batched_sketch_really_offloads_in_groups():
    """The `batched` provider copies whole groups out with one foreach copy, releases them,
    and brings them back exactly, reusing the previous step's host tensors."""
    bench = load_benchmark("overhead")
    x = torch.randn(8, 16)
    grads = []
    for hooks in (None, bench.BatchedOffload(group=2)):
        model = bench.chain(5, 16)
        for _ in range(2):
            model.zero_grad()
            with hooks.hooks() if hooks else contextlib.nullcontext():
                loss = model(x).sum()
                if hooks:
                    groups, tail = list(hooks.groups), hooks.pending
                    assert len(groups) == 2 and len(tail.tensors) == 1  # 5 ReLU outputs: 2 + 2 copied, 1 left
                    assert all(t.untyped_storage().nbytes() == 0 for g in groups for t in g.tensors)
                    assert tail.tensors[0].untyped_storage().nbytes() > 0
            loss.backward()
            if hooks:
                assert all(g.restored is not None and g.restored is not g.host for g in groups)
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert len(hooks.host) == 2  # the second step reused the first step's host tensors


def test_the_overhead_benchmark_times_the_collector_over_long_runs(tmp_path):
    """--collector counts every generation's collections while each provider runs alone:
    cswap's records make some (a 100-layer step holds more than the 700 new objects that
    start one), stock autograd's steps next to none."""
    bench = load_benchmark("overhead")
    rows = bench.main(["--collector", "20", "--providers", "unpatched", "vdnn", "--warmup", "2",
                       "--out", str(tmp_path)])
    by = {r["provider"]: r for r in rows}
    assert by["vdnn"]["gen0_collections"] > by["unpatched"]["gen0_collections"]
    assert by["vdnn"]["us_per_tensor"] > 0 and by["vdnn"]["gen0_ms_each"] > 0
    assert (tmp_path / "overhead-collector.json").exists()


def test_the_in_process_ab_runs_a_commit_beside_the_working_tree():
    """benchmarks/ab_overhead.py extracts the commit's cswap as cswap_base and times both
    patched chains against the unpatched one in the same rounds: each adds time (cswap's
    hooks on 100 offloaded tensors a step), and the change is their paired difference."""
    import re
    import subprocess

    run = subprocess.run([sys.executable, str(BENCHMARKS / "ab_overhead.py"), "HEAD", "--rounds", "4"],
                         capture_output=True, text=True, timeout=600, cwd=BENCHMARKS.parent)
    assert run.returncode == 0, run.stderr
    found = re.search(r"HEAD adds ([\d.]+), the working tree ([\d.]+); change ([+-][\d.]+)", run.stdout)
    assert found, run.stdout
    base, new, change = map(float, found.groups())
    assert base > 0 and new > 0 and abs(change) < max(base, new)


def test_twin_benchmark_replays_the_h200_runs(tmp_path):
    bench = load_benchmark("twin")
    rows = bench.main(["--runs", "cifar", "--modes", "vdnn", "sc", "--warmup", "1", "--steps", "1",
                       "--out", str(tmp_path)])
    by = {r["mode"]: r for r in rows}
    assert set(by) == {"unpatched", "vdnn", "sc"}
    # compute calibrated on the H200's unpatched step (41.3 ms), which is compute-bound
    assert by["unpatched"]["step_ms"] == pytest.approx(41.3, rel=0.05)
    assert by["vdnn"]["h200_x_unpatched"] == pytest.approx(111.6 / 41.3)
    assert by["unpatched"]["step_ms"] < by["sc"]["step_ms"] < by["vdnn"]["step_ms"]
    assert by["sc"]["moved_mib_per_step"] < 0.7 * by["vdnn"]["moved_mib_per_step"]
    assert by["sc"]["codec_ms"] > 0 == by["vdnn"]["codec_ms"]  # (encodes and decodes: the codec stream's time)
    assert all(r["hazards"] == 0 for r in rows)
    for r in rows:  # each timed step's own peak, and the row's the largest of them
        assert len(r["peaks_saved_mib"]) == 1 and round(r["peak_saved_mib"]) == max(r["peaks_saved_mib"]) >= 0
    assert by["vdnn"]["peak_saved_mib"] > 0
    saved = json.loads((tmp_path / "twin-today.json").read_text())
    assert saved["rows"] == rows
    from cswap.runtime import emulator

    assert "compress" not in emulator.SIDE_STREAMS  # (old runtimes' streams: only where one is replayed)


def test_twin_benchmark_can_replay_the_decodes_host_sync(monkeypatch):
    """--pageable-verdict: the restoring thread waits for each decode it queues, as the runtime
    the H200 measured on 2026-12-04 did (fixed since); the replay is what the twin reproduces."""
    from cswap.runtime.lanes import Lanes

    bench = load_benchmark("twin")
    monkeypatch.setattr(Lanes, "decode_after", lambda self, *args, **kwargs: "decoded")
    waited = []

    class Device:
        def event_synchronize(self, event, at):
            waited.append((event, at))

    bench._wait_for_every_decode()
    assert Lanes(Device()).decode_after("landed", None, [], [], None, None, None) == "decoded"
    assert waited == [("decoded", None)]


def test_twin_benchmark_replays_the_runtime_the_h200_measured(tmp_path):
    """--commit runs an old runtime on this tree's twin: one from before the codec stream (its
    compress and decode streams), the twin's roofline and the allocator model."""
    import subprocess

    if subprocess.run(["git", "cat-file", "-e", "c01d24c^{commit}"], cwd=BENCHMARKS.parent).returncode:
        pytest.skip("this checkout lacks commit c01d24c (a shallow clone)")
    bench = load_benchmark("twin")
    bench.main(["--commit", "c01d24c", "--runs", "cifar", "--modes", "sc", "--warmup", "1", "--steps", "1",
                "--no-plan", "--out", str(tmp_path)])
    rows = {r["mode"]: r for r in json.loads((tmp_path / "twin-c01d24c.json").read_text())["rows"]}
    assert rows["sc"]["compressed_per_step"] == rows["sc"]["offloaded_per_step"] > 0
    assert rows["sc"]["codec_ms"] > 0 and rows["sc"]["hazards"] == 0
    assert rows["unpatched"]["step_ms"] < rows["sc"]["step_ms"]


def test_twin_benchmark_headline_stage_runs_its_host_side_on_a_cpu(monkeypatch):
    """The GPU session's headline stage (twin.py --gpu) has never run on a GPU: everything but
    the measurement itself (the plan for the GPU torch names, the H200's and the twin's ratios
    beside each row) runs here, so a lent GPU's minutes are not lost to a mistake in it."""
    bench = load_benchmark("twin")
    step_ms = {"unpatched": 40.0, "vdnn": 120.0, "sc": 90.0, "cswap": 85.0}
    measured = []

    def measure_gpu(run, mode, args):
        measured.append(mode)
        row = {"run": args.run_name, "mode": mode, "batch": run["batch"], "step_ms": step_ms[mode],
               "forward_ms": 14.0, "backward_ms": 26.0, "peak_allocated_mib": 3000.0}
        return row if mode == "unpatched" else {**row, "moved_mib_per_step": 1000.0}

    monkeypatch.setattr(bench, "measure_gpu", measure_gpu)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    args = bench.argparse.Namespace(runs=["cifar"], modes=["vdnn", "sc", "cswap"], plan=True, warmup=1, steps=1)
    rows = {r["mode"]: r for r in bench.headline(args)}
    assert measured == ["unpatched", "vdnn", "sc", "cswap"]
    assert rows["sc"]["x_unpatched"] == 90.0 / 40.0
    assert rows["vdnn"]["h200_x_unpatched"] == pytest.approx(111.6 / 41.3)
    assert rows["cswap"]["twin_x_unpatched"] > 1  # (twin-today.json, committed)
    for mode in ("vdnn", "sc", "cswap"):  # planned on the H200 ("NVIDIA H200" resolved), from the step measured
        assert rows[mode]["plan_ms"] > 40.0 and rows[mode]["vs_plan"] == step_ms[mode] / rows[mode]["plan_ms"] - 1


def test_trace_benchmark_quick_run_writes_a_trace_per_mode(tmp_path):
    bench = load_benchmark("trace")
    rows = bench.main(["--quick", "--runs", "cifar", "--modes", "unpatched", "sc", "--out", str(tmp_path)])
    assert [r["mode"] for r in rows] == ["unpatched", "sc"]
    assert rows[0]["ranges"] == [] and {"cswap.pack", "cswap.encode", "cswap.unpack"} <= set(rows[1]["ranges"])
    assert rows[1]["stats"]["compressed_tensors"] > 0
    for mode in ("unpatched", "sc"):
        with gzip.open(tmp_path / f"trace-cifar-{mode}.json.gz") as f:
            assert json.load(f)["traceEvents"]
    assert json.loads((tmp_path / "trace.json").read_text())["rows"][1]["mode"] == "sc"


def test_plan_accuracy_benchmark_predicts_a_published_run_and_cites_it(tmp_path):
    bench = load_benchmark("plan_accuracy")
    doc = bench.main(["--runs", "bert-large-pretrain-512-amp", "--out", str(tmp_path)])
    (row,) = doc["rows"]
    assert row["published_tokens_per_s"] == 210 * 512  # (210 sequences/s of 512 tokens, as the source says)
    assert row["predicted_tokens_per_s"] > 0 and row["tokens_per_s_error"] == pytest.approx(
        row["predicted_tokens_per_s"] / row["published_tokens_per_s"] - 1)
    assert "210" in row["quote"] and "DeepLearningExamples" in row["source"]
    assert row["set"] == "" and row["differs"]  # NVIDIA's own BERT: in neither set
    assert doc["sets"] == {} and "op-class time model" in doc["time_model"]
    assert json.loads((tmp_path / "accuracy.json").read_text()) == json.loads(json.dumps(doc))
    h200 = {(r["run"], r["mode"]): r for r in doc["h200"]}
    assert len(h200) == 8 and h200[("vgg16-imagenet-b64", "none")]["measured_step_ms"] == 47.6
    assert all(r["predicted_step_ms"] > 0 and r["predicted_peak_mib"] > 0 for r in h200.values())
    # set against the runtime measured, whose decodes the thread waited for; today's has no wait
    sc = h200[("vgg16-cifar10-b2560", "sc")]
    assert sc["today_step_ms"] < sc["predicted_step_ms"]
    assert h200[("vgg16-cifar10-b2560", "vdnn")]["today_step_ms"] == h200[("vgg16-cifar10-b2560", "vdnn")][
        "predicted_step_ms"]  # (nothing to decode)
    assert h200[("vgg16-cifar10-b2560", "vdnn")]["profiled_peak_mib"] == 3414


def test_plan_accuracy_reads_each_peak_in_the_unit_its_source_prints():
    """A published peak is compared in the unit its source prints (its citation says which):
    torchtune's 2024 table and Qwen's print GB, 1e9 bytes; torchtune's later ones GiB."""
    bench = load_benchmark("plan_accuracy")
    draft = json.loads(bench.DRAFT.read_text())["rows"]
    runs = [r for r in bench.RUNS if r.peak]
    assert {r.peak_unit for r in runs} == {"GB", "GiB"}
    for run in runs:
        assert draft[run.row]["memory_unit_note"].split()[0].strip(",") == run.peak_unit, run.name
        assert draft[run.row]["peak_memory_gb"] == run.peak, run.name


def test_plan_accuracy_counts_issue_40s_targets_per_set():
    bench = load_benchmark("plan_accuracy")
    llm = lambda which, tokens, peak: {"set": which, "tokens_per_s_error": tokens, "peak_gib_error": peak}
    rows = [llm("evaluation", -0.149, 0.099), llm("evaluation", 0.151, -0.101), llm("evaluation", 0.0, None),
            {"set": "evaluation", "images_per_s_error": 0.3}, llm("calibration", 0.5, 0.5)]
    s = bench.summary(rows)["evaluation"]
    assert (s["runs"], s["within_15pct"], s["max_abs_error"]) == (4, 2, 0.3)
    assert (s["llm_runs"], s["llm_tokens_per_s_within_15pct"], s["llm_peaks"], s["llm_peak_within_10pct"]) == \
        (3, 2, 2, 1)


def test_plan_accuracy_sets_are_apart_and_span_gpus_and_families():
    """The evaluation set shares no run with the calibration set, and holds CNNs and LLMs on at
    least two GPUs each (issue 40); every run in a set is one cswap-plan can express."""
    bench = load_benchmark("plan_accuracy")
    runs = [(r.name, r.gpu, "llm", r.set, r.differs) for r in bench.RUNS]
    runs += [(name, p.gpu, "cnn", which, "") for name, p, which in bench.resnet50_runs()]
    evaluation = [r for r in runs if r[3] == bench.EVALUATION]
    calibration = {r[0] for r in runs if r[3] == bench.CALIBRATION}
    assert calibration and not calibration & {r[0] for r in evaluation}
    for family in ("llm", "cnn"):
        assert len({r[1] for r in evaluation if r[2] == family}) >= 2, family
    assert all(not r[4] for r in runs if r[3])
    doc = json.loads((ROOT / "cswap" / "data" / "time_model.json").read_text())
    assert {c["run"] for c in doc["calibration"]} == calibration | {f"{n}-none" for n in bench.H200}