"""cswap.patch(model, budget=...) and budget="auto" on the emulated device (issue 14 §1, §3, §5).

The first step offloads every saved activation raw and traces the device's
memory; from then on the plan keeps, moves raw or compresses each tensor. Each
test checks gradients bit for bit against stock autograd, and the device's
measured peak (the emulator counts every saved activation and cswap's buffers)
against the budget.
"""

from __future__ import annotations

import copy
import gc
import math
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import cswap
import modern
import nets
from cswap.patch import _PATCHED
from cswap.plan.runtime_budget import size_text
from cswap.runtime.candidates import KEEP
from cswap.runtime import emulator
from cswap.runtime.step_state import StepState
from emulated import NETS, SLOW, exact, gradients

STEPS = 4
# Copies that finish at once: when each tensor leaves does not depend on the machine's load, so
# the profiled step's memory trace, and the plan made from it, are the same on every run.
PROMPT = {"bandwidth_gbps": math.inf}


def batch(shape, i):
    return nets.batches(shape, 1, seed=i)[0]  # a fresh batch each step: none stays alive on the device


def unpatched_peak(make, shape) -> int:
    with cswap.testing.emulated_device(**SLOW) as dev:
        gradients(make(), *batch(shape, 0))
    return dev.peak_bytes


def offload_all_peak(make, shape, device=SLOW) -> int:
    """The device's peak with every saved activation offloaded raw, within the windows a
    memory budget keeps (an eighth of a pass ahead, one tensor at least, strictly: not the
    two tensors at least that mode vdnn admits without a budget): what no budget gets below."""
    probe = cswap.patch(make(), mode="vdnn", candidates="all", min_bytes=0)
    try:
        with cswap.testing.emulated_device(**device):
            gradients(probe, *batch(shape, 0))
        items = _PATCHED[probe].swapper._pass.items
        per_pass, largest = sum(it.info.nbytes for it in items), max(it.info.nbytes for it in items)
    finally:
        cswap.unpatch(probe)
    model = cswap.patch(make(), mode="vdnn", candidates="all", min_bytes=0,
                        stash_bytes=max(largest, per_pass // 8), prefetch_bytes=per_pass // 8)
    try:
        with cswap.testing.emulated_device(**device) as dev:
            for i in range(3):
                dev.reset_peak()
                gradients(model, *batch(shape, i))
        return dev.peak_bytes
    finally:
        cswap.unpatch(model)


def between(make, shape, fraction: float, device=SLOW) -> int:
    low, high = offload_all_peak(make, shape, device), unpatched_peak(make, shape)
    return int(low + fraction * (high - low))


def train(model, shape, expected, dev) -> list[int]:
    """STEPS steps, gradients checked; the device's peak of each."""
    peaks = []
    for i in range(STEPS):
        dev.reset_peak()
        assert exact(gradients(model, *batch(shape, i)), expected[i]), f"step {i}: gradients differ"
        peaks.append(dev.peak_bytes)
    return peaks


def with_expected(name: str):
    """(make, shape, stock autograd's gradients for each step's batch)."""
    make, shape = NETS[name]
    stock = make()
    return make, shape, [gradients(stock, *batch(shape, i)) for i in range(STEPS)]


@pytest.fixture(params=["small_cnn", "resnet_blocks"])
def net(request):
    return with_expected(request.param)


# Not nearer offload-all: in these small nets one release the loaded machine's releaser thread
# makes late moves the profiled offload-all peak by a whole tensor, past a budget at 0.3; and a
# tensor that only Python's cycle collector frees stays on the device in the profiled step, which
# then plans it never away (in one CI run of the quick set, at 0.5, the plan kept none).
@pytest.mark.parametrize("fraction", [0.6, 0.8])
def test_a_budget_between_offload_all_and_none_is_met_by_moving_only_part(net, fraction):
    make, shape, expected = net
    budget = between(make, shape, fraction, PROMPT)
    for attempt in range(2):
        gc.collect()  # (the earlier tests' garbage: when the collector runs inside the profiled step)
        model = cswap.patch(make(), budget=budget, min_bytes=0, verbose=False)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the default profile's notice
                with cswap.testing.emulated_device(**PROMPT) as dev:
                    peaks = train(model, shape, expected, dev)
                    report = cswap.epoch_end(model)
            plan = _PATCHED[model].controller.budget
        finally:
            cswap.unpatch(model)
        choices = [r.decision for r in report.rows]
        windows = plan.instance.windows if plan.instance else []
        # In about one CI run in three until 2026-11-29, the profiled step recorded all but one
        # tensor never away (window (0, 0)) and the plan kept none, likely because its trace waited
        # on cswap's worker and releaser threads, which a loaded host runs late. It no longer does
        # (the test below); what still depends on timing is when the emulated device's copy thread completes
        # a copy. Such a profile is run once more; a second one, or any other failure, fails the
        # test (what it printed says which).
        if attempt == 0 and "keep" not in choices and sum(w == (0, 0) for w in windows) >= len(windows) - 1:
            print(f"profiled step with windows {windows}: run again")
            continue
        break
    assert dev.hazards == []
    assert max(peaks[1:]) <= budget, (peaks, budget)  # planned steps stay within it
    m = report.metrics
    # only part moves (what the plan saw, should it not: each tensor's ticks away in the profiled step)
    assert "keep" in choices and any(c != "keep" for c in choices), (choices, m, windows)
    assert m["budget_bytes"] == budget and m["predicted_peak_bytes"] <= budget
    assert m["predicted_peak_offload_all_bytes"] <= m["predicted_peak_bytes"] < \
        m["predicted_peak_no_offload_bytes"]
    assert m["predicted_step_no_offload_s"] <= m["predicted_step_s"] <= m["predicted_step_offload_all_s"]
    table = report.table()
    assert "keep" in table and "budget_bytes=" in table


def test_the_profiled_step_traces_memory_whatever_the_worker_threads_speed(monkeypatch):
    """The profiled step is the first, whose host buffers the worker thread pins (20 ms each
    here), and the releaser thread may run late (a second here): its trace, which every
    later step's plan reads, must wait on neither. At each save and use the copies out of
    the saves before it are queued, as in a later step, where pack queues a raw copy itself
    into a buffer the first step pinned, and those completed are released; so every tensor
    the forward drops is away before backward uses it."""
    from cswap.plan import profiler
    from cswap.runtime import offload

    make, shape, expected = with_expected("small_cnn")
    budget = between(make, shape, 0.6, PROMPT)
    unqueued, traced, saved = [], [], [0]
    on_tick = profiler.TensorProfiler.on_tick

    def watch(self, pass_, device, incoming=0):
        if self.traces_memory and pass_ is not None:
            unqueued.append(sum(not item.issued.is_set() for item in pass_.items))
            saved[0] = max(saved[0], len(pass_.items))
        on_tick(self, pass_, device, incoming)
        if self.traces_memory:
            traced.append(self.current.ticks[-1])

    put_done, timers = offload.Offloader.put_done, []

    def late(self, item):  # the releaser thread gets the item a second later
        timers.append(threading.Timer(1.0, put_done, (self, item)))
        timers[-1].start()

    monkeypatch.setattr(profiler.TensorProfiler, "on_tick", watch)
    monkeypatch.setattr(offload.Offloader, "put_done", late)
    model = cswap.patch(make(), budget=budget, min_bytes=0, verbose=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the default profile's notice
            with cswap.testing.emulated_device(**PROMPT, pin_latency_s=0.02) as dev:
                train(model, shape, expected, dev)
    finally:
        for timer in timers:
            timer.cancel()  # (what the step released itself needs no releaser)
        cswap.unpatch(model)
    assert unqueued and not any(unqueued), unqueued
    most_away = max(len(away) for _, away in traced)
    assert saved[0] >= 4 and most_away >= saved[0] - 1, traced  # (the last one saved may be used at once)


def test_a_step_that_fits_moves_nothing_and_says_so_once(capsys):
    make, shape, expected = with_expected("small_cnn")
    model = cswap.patch(make(), budget="1GiB", min_bytes=0, verbose=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cswap.testing.emulated_device(**SLOW) as dev:
                gradients(model, *batch(shape, 0))  # the profiled step: everything leaves
                assert cswap.stats(model)["offloaded_tensors"] > 0
                cswap.stats(model).reset()
                train(model, shape, expected, dev)
                report = cswap.epoch_end(model)
        assert cswap.stats(model)["offloaded_tensors"] == 0
        assert {r.decision for r in report.rows} == {"keep"}
        assert report.totals["bytes_offloaded"] == 0
        out = capsys.readouterr().out
        assert out.count("the step fits in the budget") == 1, out
    finally:
        cswap.unpatch(model)


def test_an_unreachable_budget_offloads_everything_and_warns():
    make, shape, expected = with_expected("small_cnn")
    model = cswap.patch(make(), budget=1024, min_bytes=0, verbose=False)
    try:
        with pytest.warns(RuntimeWarning, match="does not fit in the budget even with every saved activation"):
            with cswap.testing.emulated_device(**SLOW) as dev:
                train(model, shape, expected, dev)
        assert _PATCHED[model].controller.budget.plan.moved == len(_PATCHED[model].controller.budget.choices)
    finally:
        cswap.unpatch(model)


def test_the_plan_is_made_again_at_each_epoch_end(net):
    make, shape, expected = net
    # (at 0.5, one run of the quick set in about 20 had its first plan keep nothing, on a loaded
    # machine, leaving no kept tensor to check; 0.8 leaves room to keep some whatever the timing)
    budget = between(make, shape, 0.8)
    model = cswap.patch(make(), budget=budget, min_bytes=0, verbose=False)
    controller = _PATCHED[model].controller
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cswap.testing.emulated_device(**SLOW) as dev:
                train(model, shape, expected, dev)
                first = controller.budget.plan
                cswap.epoch_end(model)
                controller.profiler.sparsity.clear()  # what the next epoch samples, alone
                train(model, shape, expected, dev)
                cswap.epoch_end(model)
        assert controller.budget.plan is not first
        kept = {k for k, c in first_choices(first, controller).items() if c == "keep"}
        assert kept and kept <= set(controller.profiler.sparsity)  # kept tensors are sampled too
        assert set(controller.budget.choices) == set(controller.profiler.sparsity)
    finally:
        cswap.unpatch(model)


def first_choices(plan, controller) -> dict:
    return {t.key: c for t, c in zip(controller.budget.instance.iteration.tensors, plan.choices)}


@pytest.mark.parametrize("budget", [0.3, "30%"])
def test_a_fraction_of_the_device_memory(budget):
    make, shape = NETS["small_cnn"]
    capacity = 2 * unpatched_peak(make, shape)
    model = cswap.patch(make(), budget=budget, min_bytes=0, verbose=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cswap.testing.emulated_device(capacity_bytes=capacity, **SLOW):
                for i in range(2):
                    gradients(model, *batch(shape, i))
        assert _PATCHED[model].controller.budget.bytes == int(0.3 * capacity)
    finally:
        cswap.unpatch(model)


# -- passive mode ---------------------------------------------------------------------------------------------

def test_auto_retries_the_step_that_ran_out_of_memory_then_plans(net):
    make, shape, expected = net
    capacity = between(make, shape, 0.7)
    with cswap.testing.emulated_device(capacity_bytes=capacity, **SLOW):
        with pytest.raises(torch.OutOfMemoryError):
            gradients(make(), *batch(shape, 0))  # unpatched, it does not fit
    model = cswap.patch(make(), budget="auto", min_bytes=0, verbose=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with cswap.testing.emulated_device(capacity_bytes=capacity, **SLOW) as dev:
                peaks = train(model, shape, expected, dev)
                report = cswap.epoch_end(model)
        chose = [w for w in caught if "budget='auto' chose" in str(w.message)]
        assert len(chose) == 1, [str(w.message) for w in caught]
        assert max(peaks) <= capacity and dev.hazards == []
        assert report.metrics["budget_bytes"] == int(0.9 * capacity)
    finally:
        cswap.unpatch(model)
    assert "forward" not in vars(model)  # unpatch gave the model its own forward back


class DropoutNet(torch.nn.Module):
    """Dropout and BatchNorm: a forward draws random numbers and updates running statistics."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Dropout(0.5),
            torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Dropout(0.5),
            torch.nn.Flatten(), torch.nn.Linear(8 * 16 * 16, 10))

    def forward(self, x):
        return self.body(x)


def _train_dropout_net(model, calls: int = 1, capacity=None):
    """Three steps of a DropoutNet called `calls` times a step (a batch each), on the emulated
    device: each step's gradients, the BatchNorm's state after them, and the device."""
    grads = []
    with cswap.testing.emulated_device(**({"capacity_bytes": capacity} if capacity else {}), **SLOW) as dev:
        for i in range(3):
            torch.manual_seed(100 + i)
            model.zero_grad(set_to_none=True)
            steps = (batch(nets.IMAGE, i + 10 * c) for c in range(calls))
            sum(F.cross_entropy(model(x), y) for x, y in steps).backward()
            grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    return grads, model.body[1].state_dict(), dev


def test_auto_retries_the_step_as_if_the_failed_attempt_had_not_run():
    """The retried forward draws the dropout masks the failed attempt drew, and BatchNorm
    counts its batch once: gradients and running statistics are stock autograd's. (Found
    by a random search: HF BERT, T5 and BART with dropout trained differently.)"""
    expected, expected_stats, _ = _train_dropout_net(DropoutNet())
    capacity = between(DropoutNet, nets.IMAGE, 0.7)
    model = cswap.patch(DropoutNet(), budget="auto", min_bytes=0, verbose=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, stats, dev = _train_dropout_net(model, capacity=capacity)
        assert any("budget='auto' chose" in str(w.message) for w in caught)  # the first step was retried
        assert dev.hazards == []
        assert all(exact(g, e) for g, e in zip(got, expected))
        assert stats.keys() == expected_stats.keys()
        assert all(torch.equal(stats[k], expected_stats[k]) for k in stats), stats["num_batches_tracked"]
    finally:
        cswap.unpatch(model)


def test_step_state_puts_back_what_it_took_last_even_after_the_model_is_converted():
    """StepState keeps its copies between steps (one _foreach copy a step); new buffers
    (model.double() makes them) get new copies, and a restore keeps the versions."""
    model = DropoutNet().train()
    state = StepState(model)
    norm = model.body[1]
    for convert in (None, torch.float64):
        if convert is not None:
            model.to(convert)
        for step in range(2):
            state.take()
            taken = {k: v.clone() for k, v in norm.state_dict().items()}
            model(batch(nets.IMAGE, step)[0].to(norm.running_mean.dtype))  # updates the running statistics
            assert not torch.equal(norm.running_mean, taken["running_mean"])
            versions = [buf._version for buf in norm.buffers()]
            state.restore()
            assert all(torch.equal(norm.state_dict()[k], v) and norm.state_dict()[k].dtype == v.dtype
                       for k, v in taken.items())
            assert [buf._version for buf in norm.buffers()] == versions


def test_auto_retries_the_second_forward_of_a_step_without_touching_the_first_ones_graph():
    """A step that calls the model twice (a siamese net) and runs out of memory in the second
    call: the retry puts the running statistics back without bumping their versions, which
    the first call's graph saved (an in-place copy made its backward raise, as modified in
    place). Found by the random search (MobileNetV3, budget="auto", two calls a step)."""
    expected, expected_stats, dev = _train_dropout_net(DropoutNet(), calls=2)
    model = cswap.patch(DropoutNet(), budget="auto", min_bytes=0, verbose=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # the first call fits, the second does not:
            got, stats, dev = _train_dropout_net(model, calls=2, capacity=int(0.85 * dev.peak_bytes))
        assert any("budget='auto' chose" in str(w.message) for w in caught)
        assert dev.hazards == []
        assert all(exact(g, e) for g, e in zip(got, expected))
        assert all(torch.equal(stats[k], expected_stats[k]) for k in stats)
    finally:
        cswap.unpatch(model)


def _two_forward_steps(model, shape, steps: int = 3, capacity=None):
    """`steps` steps that call the model twice before one backward, on the emulated device:
    each step's gradients and peak."""
    grads, peaks = [], []
    with cswap.testing.emulated_device(**({"capacity_bytes": capacity} if capacity else {}), **SLOW) as dev:
        for i in range(steps):
            dev.reset_peak()
            model.zero_grad(set_to_none=True)
            sum(F.cross_entropy(model(x), y) for x, y in (batch(shape, i + 10 * c) for c in range(2))).backward()
            grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
            peaks.append(dev.peak_bytes)
    assert dev.hazards == []
    return grads, peaks


def test_two_forwards_before_a_backward_move_everything_and_say_why():
    """Issue 39 §3.3: the plan describes one forward whose backward frees its saves as it
    goes; a step that calls the model twice before its backward holds both forwards' saves,
    and the tensors the plan kept twice over (1.18x the budget before). The swapper sees a
    forward start before the previous one's backward, and the plan moves every saved
    activation from then on, saying why once; the budget holds, gradients stay exact."""
    make, shape = NETS["small_cnn"]
    expected, stock_peaks = _two_forward_steps(make(), shape, 1)
    budget = int(0.85 * stock_peaks[0])
    model = cswap.patch(make(), budget=budget, min_bytes=0, verbose=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, peaks = _two_forward_steps(model, shape, 4)
        said = [str(w.message) for w in caught if "before the backward of the one before it" in str(w.message)]
        assert len(said) == 1 and "every saved activation now leaves the device" in said[0], said
        plan = _PATCHED[model].controller.budget
        assert KEEP not in plan.choices.values() and plan.choices
    finally:
        cswap.unpatch(model)
    assert exact(got[0], expected[0])
    assert max(peaks[1:]) <= budget, ([p / budget for p in peaks], budget)


@pytest.mark.parametrize("kind", ["retain_graph", "create_graph"])
@pytest.mark.parametrize("budget", ["bytes", "auto"])
def test_a_backward_that_keeps_its_graph_is_refused_under_a_budget(kind, budget):
    """Issue 39 §3.3: a kept graph holds every saved activation until it goes, which the
    plan counts as freed as backward runs: with budget="auto" it ran out of memory restoring
    a tensor in backward. Refused with an error that says what to do instead: at the first
    such backward with a budget in bytes; with budget="auto" only once a forward runs out of
    memory (until then nothing is planned or moved, and training goes on)."""
    make, shape = NETS["small_cnn"]
    capacity = between(make, shape, 0.7)
    model = cswap.patch(make(), budget="1GiB" if budget == "bytes" else "auto", min_bytes=0, verbose=False)

    def step(i):
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(batch(shape, i)[0]), batch(shape, i)[1])
        if kind == "retain_graph":
            loss.backward(retain_graph=True)
        else:  # a gradient penalty
            first = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
            loss = loss + sum((g ** 2).sum() for g in first)
        loss.backward()

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if budget == "auto":  # (a device that holds the step: it trains as unpatched)
                with cswap.testing.emulated_device(**SLOW):
                    step(0)
            with cswap.testing.emulated_device(capacity_bytes=capacity, **SLOW):
                with pytest.raises(RuntimeError, match=r"does not support a backward that keeps its graph.*"
                                                       r"Run backward without retain_graph"):
                    step(1)
    finally:
        cswap.unpatch(model)


def test_auto_moves_nothing_while_the_step_fits():
    make, shape, expected = with_expected("small_cnn")
    model = cswap.patch(make(), budget="auto", min_bytes=0, verbose=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no budget chosen, nothing to say
            with cswap.testing.emulated_device(**SLOW) as dev:
                train(model, shape, expected, dev)
        assert cswap.stats(model)["offloaded_tensors"] == 0
        assert _PATCHED[model].controller.budget.waiting_for_oom
    finally:
        cswap.unpatch(model)


def test_auto_says_what_to_do_when_even_offloading_everything_does_not_fit():
    make, shape = NETS["small_cnn"]
    model = cswap.patch(make(), budget="auto", min_bytes=0, verbose=False)
    try:
        with cswap.testing.emulated_device(capacity_bytes=8000, **SLOW):
            with pytest.raises(torch.OutOfMemoryError, match="again with every saved activation offloaded"):
                gradients(model, *batch(shape, 0))
    finally:
        cswap.unpatch(model)


def test_auto_says_what_the_device_held_before_a_forward_that_cannot_fit():
    """A step that calls the model twice: the first call's saved activations stay on the
    device until backward, so the second call cannot fit even with its own offloaded. The
    error says how much the device held before that forward, and that an earlier forward's
    saves count there."""
    _, _, dev = _train_dropout_net(DropoutNet(), calls=2)
    model = cswap.patch(DropoutNet(), budget="auto", min_bytes=0, verbose=False)
    held = []
    model.register_forward_pre_hook(lambda *_: held.append(emulator.current().memory_allocated()))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(torch.OutOfMemoryError, match="again with every saved activation offloaded") as caught:
                _train_dropout_net(model, calls=2, capacity=int(0.6 * dev.peak_bytes))
    finally:
        cswap.unpatch(model)
    assert len(held) == 2  # it is the second call that cannot fit
    held_then = held[1] + batch(nets.IMAGE, 10)[0].nbytes  # (the emulator counts its input once conv saved it)
    capacity = size_text(int(0.6 * dev.peak_bytes))
    assert f"Before this forward the device held {size_text(held_then)} of its {capacity}" in str(caught.value)
    assert "the saved activations of any earlier forward of this step" in str(caught.value)


def test_auto_names_the_host_memory_limit_when_that_is_what_kept_tensors_on_the_device():
    make, shape, _ = with_expected("small_cnn")
    capacity = between(make, shape, 0.7)
    model = cswap.patch(make(), budget="auto", min_bytes=0, max_host_bytes=0, verbose=False)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "cswap: host memory limit", RuntimeWarning)
            with cswap.testing.emulated_device(capacity_bytes=capacity, **SLOW):
                with pytest.raises(torch.OutOfMemoryError, match=r"with \d+ of them kept on the device because host "
                                                                 r"memory reached its limit \(max_host_bytes=0\)\. "
                                                                 r"Raise max_host_bytes"):
                    gradients(model, *batch(shape, 0))
    finally:
        cswap.unpatch(model)


def test_auto_moves_tensors_laid_out_with_gaps_as_the_span_they_cover():
    """A saved tensor not dense in memory that views no other tensor (padded rows) leaves
    as the span of memory it covers, allocating nothing to be sent: the retry fits 80% of
    the stock peak. (Gathered into a dense copy on the device, it ran out of memory at
    every fraction from 70% to 90%, with the copies or for want of room for them.)"""
    model, inputs = modern.build("padded_rows")
    expected = copy.deepcopy(model)
    with cswap.testing.emulated_device(**SLOW) as dev:
        modern.default_loss(inputs(expected)).backward()
    model = cswap.patch(model, budget="auto", verbose=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cswap.testing.emulated_device(capacity_bytes=int(0.8 * dev.peak_bytes), **SLOW):
                modern.default_loss(inputs(model)).backward()
        assert cswap.stats(model)["offloaded_tensors"] > 0
        for (name, p), q in zip(model.named_parameters(), expected.parameters()):
            assert torch.equal(p.grad, q.grad), name
    finally:
        cswap.unpatch(model)


# -- arguments ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    ({"budget": "lots"}, ValueError, "not a size"),
    ({"budget": -5}, ValueError, "positive"),
    ({"budget": [1]}, TypeError, "budget must be"),
    ({"budget": "1GiB", "mode": "vdnn"}, ValueError, "mode='cswap' without a policy"),
    ({"budget": "1GiB", "policy": lambda info: None}, ValueError, "without a policy"),
    ({"budget": "1GiB", "candidates": "sparse"}, ValueError, "every saved activation is a candidate"),
])
def test_bad_budget_arguments_fail_at_patch_time(kwargs, error, match):
    with pytest.raises(error, match=match):
        cswap.patch(NETS["small_cnn"][0](), **kwargs)


def test_a_fraction_needs_a_device_with_a_memory_size():
    make, shape = NETS["small_cnn"]
    model = cswap.patch(make(), budget=0.5, min_bytes=0, verbose=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with cswap.testing.emulated_device(**SLOW):
                gradients(model, *batch(shape, 0))
                with pytest.raises(ValueError, match="fraction of the device's memory"):
                    gradients(model, *batch(shape, 1))
    finally:
        cswap.unpatch(model)


def test_a_policy_may_keep_a_tensor_on_the_device(net):
    """'keep' from a user's policy: that tensor stays, the others move, gradients are exact,
    and keys stay those of the profiled step (kept candidates count in the index)."""
    make, shape, expected = net
    seen = []

    def every_other(info):
        seen.append(info.key)
        return "keep" if info.index % 2 else None

    model = cswap.patch(make(), policy=every_other, min_bytes=0, verbose=False)
    try:
        with cswap.testing.emulated_device(**SLOW) as dev:
            train(model, shape, expected, dev)
        per_step = len(seen) // STEPS
        assert seen == seen[:per_step] * STEPS                      # the same keys every step
        assert cswap.stats(model)["offloaded_tensors"] == STEPS * ((per_step + 1) // 2)
        assert dev.hazards == []
    finally:
        cswap.unpatch(model)
