"""cswap-tune end to end on CPU (quick mode), as CI runs it."""

import subprocess
import sys
import threading

import pytest
import torch

from cswap.tune.profile import read_profile
from cswap.cli.tune import main

pytestmark = pytest.mark.slow  # cswap-tune end to end: CI runs them (pytest -m slow)


def test_quick_run_writes_a_valid_profile(tmp_path):
    out = tmp_path / "tmp.json"
    proc = subprocess.run([sys.executable, "-m", "cswap.cli.tune", "--quick", "--codecs", "zvc", "zans", "--out",
                           str(out), "--no-progress"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "describes the CPU, not a GPU" in proc.stderr
    assert f"profile written to {out}" in proc.stdout
    profile = read_profile(out)
    assert profile.codecs == ("zvc", "zans") and profile.doc["quick"] and profile.doc["device"]["type"] == "cpu"
    tuning = profile.doc["tuning"]["per_codec"]["zvc"]
    assert tuning["evaluations"] <= 35 and tuning["best_seconds"] > 0
    rae = profile.doc["codecs"]["zvc"]["rae"]
    assert set(rae["compress"]) == {"linear", "bayesian_ridge", "svr", "tree"}
    assert profile.seconds("zvc", "compress", 2**20, 0.5) > 0
    assert profile.doc["tuning"]["per_codec"]["zans"]["best_seconds"] > 0  # ZANS is tuned and timed like the others
    assert profile.seconds("zans", "decompress", 2**20, 0.5) > 0
    # the training thread's time per offloaded tensor, measured for the planners
    assert 0 < profile.host_s_per_tensor < 0.05 and "training thread per offloaded tensor" in proc.stdout


def test_host_cost_is_measured_and_leaves_no_threads_behind():
    from cswap.tune import host_cost

    threads = threading.active_count()
    seconds = host_cost.host_seconds_per_tensor(torch.device("cpu"), layers=10, steps=3, rounds=2, warmup=1)
    assert 1e-7 < seconds < 0.05  # vdnn's hooks, records and copies take real time per tensor
    assert threading.active_count() == threads  # the patched chain was unpatched: its swapper's threads stopped


def test_host_cost_noise_pushed_to_zero_is_measured_again_with_more_steps(monkeypatch):
    from cswap.tune import host_cost

    seen = []

    def noisy(device, layers, width, batch, steps, rounds, warmup):
        seen.append(steps)
        return -1e-3 if len(seen) < 3 else 2e-3  # a parallel test run swamps the first two

    monkeypatch.setattr(host_cost, "_added_seconds", noisy)
    assert host_cost.host_seconds_per_tensor(torch.device("cpu"), layers=10, steps=4) == pytest.approx(2e-4)
    assert seen == [4, 8, 16]
    seen.clear()
    monkeypatch.setattr(host_cost, "_added_seconds", lambda *a: seen.append(a) or -1.0)
    assert host_cost.host_seconds_per_tensor(torch.device("cpu"), attempts=2) is None and len(seen) == 2


def test_a_host_cost_noise_always_hides_is_not_recorded_as_free(monkeypatch, tmp_path):
    """A zero would tell the planners that offloading costs the training thread nothing: when
    every attempt is swamped, the profile leaves the figure out (the planners' default stands)
    and the summary says why."""
    from cswap.cli import tune as tune_cli
    from cswap.plan.advisor import HOST_S_PER_TENSOR, host_seconds

    monkeypatch.setattr(tune_cli, "host_seconds_per_tensor", lambda device, **kwargs: None)
    out = tmp_path / "busy.json"
    doc, path, lines = tune_cli.run(tune_cli.parse_args(["--quick", "--codecs", "zvc", "--out", str(out),
                                                         "--no-progress"]))
    profile = read_profile(path)
    assert "runtime" not in doc and profile.host_s_per_tensor is None
    assert host_seconds(profile) == HOST_S_PER_TENSOR
    assert any("not measured" in line and "quiet machine" in line for line in lines)


def test_compare_prints_search_and_regressor_tables(tmp_path, capsys):
    out = tmp_path / "p.json"
    code = main(["--quick", "--compare", "--codecs", "rle", "--out", str(out), "--no-progress",
                 "--init-probes", "3", "--guided-probes", "3", "--samples", "16", "--tune-mib", "0.0625"])
    assert code == 0
    text = capsys.readouterr().out
    assert "search comparison" in text and "regressor RAE" in text
    comparison = read_profile(out).doc["tuning"]["comparison"]["rle"]
    assert set(comparison) == {"bayes", "random", "expert"}
    # 3 + 3 probes; repeats are not re-measured, and random search gets the budget BO used
    assert 1 <= comparison["random"]["evaluations"] <= comparison["bayes"]["evaluations"] <= 6
    assert comparison["expert"]["evaluations"] == 1


def test_failure_exits_non_zero_with_a_clear_message(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code = main(["--quick", "--codecs", "zvc", "--out", str(blocker / "p.json"), "--no-progress",
                 "--init-probes", "1", "--guided-probes", "0", "--samples", "16", "--tune-mib", "0.0625"])
    assert code == 1
    assert "cswap-tune: error:" in capsys.readouterr().err


def test_bad_arguments_are_rejected():
    with pytest.raises(SystemExit):
        main(["--codecs", "gzip"])
    with pytest.raises(SystemExit):
        main(["--submodels", "0"])
