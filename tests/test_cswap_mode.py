"""The CSWAP loop on CPU: profiler, advisor decisions per epoch, reports, cswap-train."""

import json
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cswap
from cswap.patch import _PATCHED
from cswap.tune.profile import DEFAULT_PROFILE, save_profile
from cswap.cli.train import main as train_main

pytestmark = pytest.mark.filterwarnings("ignore:.*saves no memory:RuntimeWarning")


def profile_with_link(tmp_path, gbps: float):
    """The shipped default profile with another PCIe bandwidth (slow: compression pays)."""
    doc = json.loads(DEFAULT_PROFILE.read_text())
    doc["bandwidth"].update(d2h_gbps=gbps, h2d_gbps=gbps)
    return save_profile(doc, tmp_path / f"link-{gbps}.json")


class Shifted(nn.Module):
    """conv -> (+ shift) -> ReLU -> pool: `shift` sets how sparse the ReLU output is."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.shift = 0.0
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x):
        return self.fc(self.pool(self.relu(self.conv(x) + self.shift)).flatten(1))


def step(model, x, y):
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()


def data(n=16):
    gen = torch.Generator().manual_seed(3)
    return torch.randn(n, 3, 16, 16, generator=gen), torch.randint(0, 4, (n,), generator=gen)


def test_profiler_times_and_samples_the_first_iteration(tmp_path):
    model = cswap.patch(Shifted(), profile=profile_with_link(tmp_path, 1.0), verbose=False)
    x, y = data()
    step(model, x, y)
    step(model, x, y)  # the second forward finishes the profiled pass
    ctl = _PATCHED[model].controller
    it = ctl.profiler.latest()
    assert it is not None and it.forward_s > 0 and it.backward_s >= 0
    keys = [t.key for t in it.tensors]
    assert keys == ["0:relu", "1:pool"]  # named by the module that made it, though fc saves it (flattened)
    assert [ctl.profiler.infos[k].saved_in for k in keys] == ["relu", "fc"]  # ReLU saves its own output
    saves = [t.save_s for t in it.tensors]
    assert saves == sorted(saves) and all(t.hidden_f >= 0 and t.hidden_b >= 0 for t in it.tensors)
    # sampled sparsity is the ReLU output's real zero fraction
    relu_out = F.relu(model.conv(x))
    assert it.tensors[0].sparsity == pytest.approx(float((relu_out == 0).float().mean()), abs=1e-6)


class Chain(nn.Module):
    """Linear + ReLU layers: 1 MiB outputs, little compute between them."""

    def __init__(self, n=4, width=256):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(n)])

    def forward(self, x):
        return self.layers(x)


def test_the_profiled_step_times_the_models_compute_not_cswaps_waits(tmp_path):
    """Issue 26 §3: the timed pass offloads everything raw within the stash limit, so on a
    slow link each save waits for the copy before it, and backward for the copies in. Those
    waits (and the sampling) are cswap's, not compute that hides a transfer: the compute
    clock stops for them, and a tensor's save is stamped before its wait. Checked against
    the same pass's wall time, so a slow moment of the machine shows in both."""
    x = torch.randn(1024, 256, generator=torch.Generator().manual_seed(0))
    gbps = 0.005  # 1 MiB in 210 ms: 4 tensors ~ 0.8 s each way, against milliseconds of compute (tens, loaded)
    # (prefetch_bytes=0: backward restores each tensor when it asks, and its waits are timed)
    model = cswap.patch(Chain(), profile=profile_with_link(tmp_path, gbps), min_bytes=0, prefetch_bytes=0,
                        verbose=False)
    try:
        with cswap.testing.emulated_device(bandwidth_gbps=gbps, jitter=0.0) as dev:
            model.zero_grad()  # the timed pass
            start = time.perf_counter()
            loss = model(x).sum()
            forward_wall = time.perf_counter() - start
            start = time.perf_counter()
            loss.backward()
            backward_wall = time.perf_counter() - start
            stats = cswap.stats(model)
            forward_waits, backward_waits = stats["offload_stall_s"], stats["prefetch_stall_s"]
            model(x).sum().backward()  # its forward finishes the profiled pass
        assert dev.hazards == []
        it = _PATCHED[model].controller.profiler.latest()
    finally:
        cswap.unpatch(model)
    assert len(it.tensors) == 4
    link_s = 4 * (1 << 20) / (gbps * 1e9)  # each pass's copies, one way
    assert forward_waits > 0.1 * link_s and backward_waits > 0.25 * link_s  # the pass did wait for the link
    # compute only: the pass's wall time less its waits (before the fix forward_s and the
    # hidden times included them)
    assert 0 < it.forward_s < forward_wall - 0.9 * forward_waits
    assert all(t.save_s <= it.forward_s for t in it.tensors)  # each stamped before its wait
    assert 0 < it.backward_s < backward_wall - 0.9 * backward_waits


def test_profiler_samples_zans_size_of_each_tensor(tmp_path):
    model = cswap.patch(Shifted(), profile=profile_with_link(tmp_path, 1.0), verbose=False)
    x, y = data()
    step(model, x, y)
    step(model, x, y)
    relu = _PATCHED[model].controller.profiler.latest().tensors[0]
    real = cswap.codecs.get("zans").compress(F.relu(model.conv(x)).detach(), backend="torch").payload.numel()
    assert relu.zans_bits is not None
    assert relu.zans_bits * relu.numel / 8 == pytest.approx(real, rel=0.01)


def test_dense_activations_go_to_zans_and_train_exactly(tmp_path):
    """A ReLU output with no zeros: no zero-based codec helps, ZANS (from its sampled size) does on a
    slow link; the next steps compress with it and the gradients equal an unpatched model's."""
    plain = Shifted()
    model = cswap.patch(Shifted(), profile=profile_with_link(tmp_path, 0.001), verbose=False)
    plain.shift = model.shift = 10.0
    x, y = data()
    step(model, x, y)
    report = cswap.epoch_end(model)
    row = next(r for r in report.rows if r.key == "0:relu")
    assert row.sparsity == 0.0 and row.decision == "zans"
    assert row.compressed_bytes < 0.9 * row.nbytes  # the exponent bytes of values near 10 code in a few bits
    before = cswap.stats(model)["compressed_tensors"]
    step(model, x, y)
    step(plain, x, y)
    assert cswap.stats(model)["compressed_tensors"] > before
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_decisions_follow_sparsity_across_epochs(tmp_path):
    model = cswap.patch(Shifted(), profile=profile_with_link(tmp_path, 0.001), verbose=False,
                        report_dir=tmp_path / "reports")
    x, y = data()
    model.shift = 10.0  # ReLU output almost dense: only ZANS (which codes the non-zero bytes too) can pay
    step(model, x, y)
    first = cswap.epoch_end(model)
    row = next(r for r in first.rows if r.key == "0:relu")
    assert row.sparsity < 0.05 and row.decision in (None, "zans")
    model.shift = -0.8  # now mostly zeros: worth compressing on a slow link
    step(model, x, y)
    second = cswap.epoch_end(model)
    row = next(r for r in second.rows if r.key == "0:relu")
    assert row.sparsity > 0.6 and row.decision is not None
    assert row.t_best_s < row.t_prime_s
    # the new decision is applied: the next step compresses
    before = cswap.stats(model)["compressed_tensors"]
    step(model, x, y)
    assert cswap.stats(model)["compressed_tensors"] > before
    reports = (tmp_path / "reports" / "epochs.jsonl").read_text().splitlines()
    assert len(reports) == 2


def test_fast_link_never_compresses(tmp_path):
    model = cswap.patch(Shifted(), profile=profile_with_link(tmp_path, 1e6), verbose=False)
    model.shift = -0.8
    x, y = data()
    for _ in range(3):
        step(model, x, y)
    report = cswap.epoch_end(model)
    assert report.rows and all(r.decision is None for r in report.rows)
    assert cswap.stats(model)["compressed_tensors"] == 0


@pytest.mark.parametrize("advisor", ["independent", "timeline"])
def test_cswap_mode_gradients_equal_unpatched(tmp_path, advisor):
    x, y = data()
    reference = Shifted()
    reference.shift = -0.5
    grads_ref = []
    for _ in range(3):
        step(reference, x, y)
        grads_ref.append([p.grad.clone() for p in reference.parameters()])
    model = cswap.patch(Shifted(), profile=profile_with_link(tmp_path, 0.001), advisor=advisor, verbose=False)
    model.shift = -0.5
    for i in range(3):
        step(model, x, y)
        for a, b in zip(model.parameters(), grads_ref[i]):
            assert torch.equal(a.grad, b)
    assert cswap.stats(model)["compressed_tensors"] > 0  # the advisor did compress


def test_a_policy_that_keeps_a_tensor_is_counted_and_exact(tmp_path):
    """policy(info) -> KEEP leaves that candidate on the device, every step, counted in
    stats["kept_by_plan"]; the other still moves, and gradients are the unpatched model's."""
    from cswap.runtime.candidates import KEEP

    x, y = data()
    plain = Shifted()
    model = cswap.patch(Shifted(), policy=lambda info: KEEP if info.key.endswith(":pool") else None,
                        profile=profile_with_link(tmp_path, 1.0), verbose=False)
    for _ in range(2):
        step(model, x, y)
        step(plain, x, y)
        for a, b in zip(model.parameters(), plain.parameters()):
            assert torch.equal(a.grad, b.grad)
    stats = cswap.stats(model)
    assert stats["kept_by_plan"] == 2 and stats["offloaded_tensors"] == 2


def test_epoch_end_prints_the_table(tmp_path, capsys):
    model = cswap.patch(Shifted(), profile=profile_with_link(tmp_path, 1.0))
    x, y = data()
    step(model, x, y)
    report = cswap.epoch_end(model, {"loss": 1.25})
    out = capsys.readouterr().out
    assert "relu" in out and report.metrics["loss"] == 1.25 and "profiling_overhead_s" in report.metrics
    with pytest.raises(ValueError, match="not patched"):
        cswap.epoch_end(nn.Linear(2, 2))


def test_epoch_end_hook_ignores_the_loops_arguments(tmp_path):
    model = cswap.patch(Shifted(), profile=profile_with_link(tmp_path, 1.0), verbose=False)
    hook = cswap.epoch_end_hook(model, metrics=lambda: {"lr": 0.1})
    x, y = data()
    step(model, x, y)
    first = hook("engine", state=None)
    second = hook()
    assert (first.epoch, second.epoch) == (0, 1) and second.metrics["lr"] == 0.1
    with pytest.raises(ValueError, match="not patched"):
        cswap.epoch_end_hook(nn.Linear(2, 2))


def test_check_decisions_measures_each_sampled_tensor(tmp_path):
    model = cswap.patch(Shifted(), profile=profile_with_link(tmp_path, 0.001), verbose=False)
    model.shift = -0.8
    x, y = data()
    step(model, x, y)
    step(model, x, y)
    checks = cswap.check_decisions(model, sample=2, repeats=1)
    assert [c.key for c in checks] == ["0:relu", "1:pool"]
    assert all(c.t_prime_s >= 0 and c.t_s > 0 for c in checks)


# -- cswap-train ------------------------------------------------------------------------------


def test_cswap_train_defaults_learn_and_report(tmp_path, capsys):
    reports = tmp_path / "reports"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = train_main(["--epochs", "2", "--report-dir", str(reports), "--no-progress"])
    assert code == 0
    out = capsys.readouterr().out
    accuracies = [float(line.split("accuracy ")[1].rstrip("%")) for line in out.splitlines()
                  if line.startswith("epoch ") and "accuracy" in line]
    assert len(accuracies) == 2 and accuracies[-1] > 50  # 10 classes: chance is 10%
    assert "features.1 (ReLU)" in out  # the per-epoch report names layers
    # on a CPU the report says its decisions are trivial and how to predict a GPU's
    assert "decisions are trivial" in out
    assert "cswap-plan --model small_cnn --dataset cifar10 --batch 64 --gpu h100-sxm-80gb" in out
    assert len((reports / "epochs.jsonl").read_text().splitlines()) == 2
    assert (reports / "tensors.csv").exists()
    pytest.importorskip("matplotlib")
    for name in ("sparsity.png", "decisions.png", "compressed_layers.png"):
        assert (reports / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cswap_train_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        train_main(["--epochs", "0"])
    assert info.value.code == 2
    code = train_main(["--data", str(tmp_path / "nothing.npz"), "--report-dir", str(tmp_path), "--no-progress"])
    assert code == 1 and "cswap-train: error" in capsys.readouterr().err


def test_cswap_train_reads_npz_and_survives_interruption(tmp_path, monkeypatch, capsys):
    gen = torch.Generator().manual_seed(0)
    path = tmp_path / "data.npz"
    import numpy as np

    np.savez(path, x=torch.rand(64, 12, 12, generator=gen).numpy(), y=np.arange(64) % 4)
    calls = {"n": 0}
    real_epoch_end = cswap.epoch_end

    def epoch_end(model, metrics=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_epoch_end(model, metrics)

    monkeypatch.setattr(cswap, "epoch_end", epoch_end)
    patched = []
    real_patch = cswap.patch
    monkeypatch.setattr(cswap, "patch", lambda model, **kw: patched.append(kw) or real_patch(model, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = train_main(["--data", str(path), "--epochs", "3", "--batch-size", "16", "--mode", "sc",
                           "--checksum", "--report-dir", str(tmp_path / "r"), "--no-progress"])
    assert patched and patched[0]["checksum"] is True and patched[0]["mode"] == "sc"
    assert code == 130 and "interrupted" in capsys.readouterr().err
    lines = (tmp_path / "r" / "epochs.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["epoch"] == 0


def test_kernels_are_built_when_decided_not_mid_step(tmp_path, monkeypatch):
    """After the profiling iteration, the codecs the decisions use are warmed (Triton
    compiles on first launch) once per (codec, word size), before any tensor is compressed."""
    warmed = []

    def warm_up(name, dtype, device, config=None):
        warmed.append((name, dtype, torch.device(device), cswap.stats(model)["compressed_tensors"]))
        return False

    monkeypatch.setattr(cswap.codecs, "warm_up", warm_up)
    model = cswap.patch(Shifted(), profile=profile_with_link(tmp_path, 0.001), verbose=False)
    model.shift = -0.8
    x, y = data()
    step(model, x, y)
    assert warmed == []  # profiling: nothing decided yet
    for _ in range(3):
        step(model, x, y)
    cswap.epoch_end(model)
    step(model, x, y)
    decided = {d.codec for d in _PATCHED[model].controller.decisions.values() if d.codec is not None}
    assert decided and cswap.stats(model)["compressed_tensors"] > 0
    assert sorted(w[0] for w in warmed) == sorted(decided)  # once each, not again at the epoch's re-decision
    assert {(w[1], w[2], w[3]) for w in warmed} == {(torch.int32, torch.device("cpu"), 0)}


@pytest.mark.parametrize("budget", [False, True], ids=["advisor", "budget"])
def test_no_save_pays_for_planning_or_kernel_builds(tmp_path, budget):
    """Issue 39 §3.4: the advisor's decisions, the budget's plan and the kernels they
    need are made at a step boundary (the forward after the profiled one starts, or an
    epoch's end), never inside a save of the training thread."""
    model = Shifted()
    model.shift = -0.8
    entry_options = dict(profile=profile_with_link(tmp_path, 0.001), verbose=False)
    device = cswap.testing.emulated_device(capacity_bytes=1 << 20) if budget else None
    with device if device is not None else warnings.catch_warnings():
        if budget:
            entry_options["budget"] = 0.4  # (of 1 MiB: about 0.8x the step's peak)
        cswap.patch(model, **entry_options)
        entry = _PATCHED[model]
        controller, swapper = entry.controller, entry.swapper
        in_save, made = [], []

        def watched(name, fn):
            def call(*args, **kwargs):
                made.append((name, bool(in_save)))
                return fn(*args, **kwargs)
            return call

        pack = swapper.pack

        def watched_pack(*args, **kwargs):
            in_save.append(True)
            try:
                return pack(*args, **kwargs)
            finally:
                in_save.pop()

        swapper.pack = watched_pack
        controller.advisor.decide = watched("decide", controller.advisor.decide)
        if budget:
            controller.budget.replan = watched("replan", controller.budget.replan)
        controller.warm_up = watched("warm_up", controller.warm_up)
        x, y = data()
        for _ in range(4):
            step(model, x, y)
        cswap.epoch_end(model)
        step(model, x, y)
    assert {"decide", "warm_up"} | ({"replan"} if budget else set()) <= {name for name, _ in made}, made
    assert not any(inside for _, inside in made), made
