"""The memory-budget planner (cswap.plan.budget, issue 14): its model, its exact optimum and its plans."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

import cswap
from cswap.models import build
from cswap.plan.advisor import IterationProfile, TensorProfile
from cswap.plan.budget import (KEEP, Instance, extra_seconds, largest_first, offload_everything, optimum, peak,
                               per_tensor_rule, plan_budget)
from cswap.plan.gpus import gpu
from cswap.plan.whatif import AssumedProfile


def slow_link():
    profile = AssumedProfile(gpu("l4-24gb"))
    profile.codecs = ("zvc", "rle")
    profile.bw_d2h = profile.bw_h2d = 1e9  # slow enough that transfers show
    return profile


def instance(n: int, seed: int) -> Instance:
    """n tensors nested like a network's: saved in order, used in reverse, each held across the middle."""
    rng = random.Random(seed)
    forward_s, backward_s = 0.01, 0.02
    saves = sorted(rng.uniform(0, forward_s) for _ in range(n))
    uses = sorted((rng.uniform(0, backward_s) for _ in range(n)), reverse=True)
    tensors = []
    for i in range(n):
        numel = rng.choice([1, 2, 4, 8]) * 2**18
        tensors.append(TensorProfile(key=f"{i}:l{i}", layer=f"l{i}", layer_type="ReLU", op="relu", shape=(numel,),
                                     itemsize=4, sparsity=rng.uniform(0.2, 0.8), runs=numel // 4, save_s=saves[i],
                                     use_s=uses[i], hidden_f=0.001, hidden_b=0.002))
    ops = 4 * n
    curve = np.full(ops, 1e6)
    for i, t in enumerate(tensors):
        curve[2 * i:ops - 2 * i] += t.nbytes
    windows = [(2 * i + 1, ops - 2 * i - 1) for i in range(n)]
    return Instance.build(IterationProfile(forward_s, backward_s, tuple(tensors)), slow_link(), curve, windows)


def brute_force(inst: Instance, budget: float):
    best = None
    for choices in itertools.product([KEEP, None, *inst.codecs], repeat=inst.n):
        if peak(inst, choices) <= budget:
            t = extra_seconds(inst, choices)
            if best is None or t < best:
                best = t
    return best


def timeline_by_the_book(tensors, options, costs, forward_s, bw_d2h, bw_h2d) -> float:
    """The planner's timeline as first written (with a record per tensor, since dropped for
    speed): serial D2H in forward, backward once every offload is done, restore i issued at
    tensor i + 1's use on a serial H2D link, its decode after its copy; the exposed time."""
    link, offload_end = 0.0, []
    for t, c, k in zip(tensors, costs, options):
        link = max(t.save_s + c.t_c[k], link) + c.size[k] / bw_d2h
        offload_end.append(link)
    forward_stall = max(0.0, link - forward_s)
    b0 = forward_s + forward_stall
    stalls, h2d, issue = {}, b0, b0
    for i in range(len(tensors) - 1, -1, -1):
        t, c, k = tensors[i], costs[i], options[i]
        end = h2d = max(issue, h2d, offload_end[i]) + c.size[k] / bw_h2d + c.t_dc[k]
        use = b0 + t.use_s + sum(stalls.values())
        stalls[t.key] = max(0.0, end - use)
        issue = use + stalls[t.key]
    return forward_stall + sum(stalls.values())


def test_extra_seconds_is_the_timeline_by_the_book():
    """The planner's fast cost is the exposed time on the planner's timeline plus each moved
    tensor's kernels and host time, on any choice of keep, raw or codec."""
    rng = random.Random(0)
    for seed in range(4):
        inst = instance(12, seed)
        for _ in range(50):
            choices = [rng.choice([KEEP, None, *inst.codecs]) for _ in range(inst.n)]
            moved = [i for i, c in enumerate(choices) if c != KEEP]
            exposed = timeline_by_the_book([inst.iteration.tensors[i] for i in moved], [choices[i] for i in moved],
                                           [inst.costs[i] for i in moved], inst.iteration.forward_s, inst.bw_d2h,
                                           inst.bw_h2d)
            kernels = sum(inst.costs[i].host + inst.costs[i].t_c[choices[i]] + inst.costs[i].t_dc[choices[i]]
                          for i in moved)
            assert extra_seconds(inst, choices) == pytest.approx(exposed + kernels if moved else 0.0, rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_the_integer_program_is_the_exact_optimum_of_the_model(seed):
    inst = instance(6, seed)
    floor = peak(inst, [None] * inst.n)
    budget = random.Random(seed).uniform(floor, inst.curve.max())
    exact = brute_force(inst, budget)
    best = optimum(inst, budget)
    assert best.fits and exact is not None
    assert best.extra_seconds == pytest.approx(exact, abs=1e-9)
    plan = plan_budget(inst, budget)
    assert plan.fits and plan.extra_seconds >= exact - 1e-12
    for baseline in (offload_everything, largest_first, per_tensor_rule):
        assert baseline(inst, budget).extra_seconds >= exact - 1e-12


def test_a_step_that_fits_moves_nothing():
    inst = instance(8, 0)
    plan = plan_budget(inst, inst.curve.max())
    assert plan.moved == 0 and plan.extra_seconds == 0 and plan.fits


def test_plans_meet_the_budget_and_never_lose_to_offloading_everything():
    for seed in range(20):
        inst = instance(12, seed)
        floor = peak(inst, [None] * inst.n)
        budget = random.Random(seed).uniform(floor, inst.curve.max())
        plan = plan_budget(inst, budget)
        assert plan.fits and plan.peak_bytes <= budget
        everything = offload_everything(inst, budget)
        assert plan.extra_seconds <= everything.extra_seconds + 1e-12
    # below what offloading everything reaches, it says so and moves all it can
    inst = instance(12, 0)
    plan = plan_budget(inst, 0.5 * peak(inst, [None] * inst.n))
    assert not plan.fits and plan.moved == inst.n


def test_plans_leave_room_for_their_encoders_temporaries():
    """Issue 26 §5: an encoder allocates beside its payload (ZANS about twice the tensor)
    while it runs, which the profiled step, offloading raw, never saw. Where the plan
    without that in mind would overshoot the budget by its scratch, the plan rules the
    encoder out for that tensor and fits, scratch included."""
    from cswap.plan.budget import encoder_scratch, with_encoder_scratch

    link = slow_link()  # with ZANS fast enough to be chosen (the H200 measured 1.4 ms a call at these sizes)
    link.seconds = lambda codec, direction, size, sparsity: 10e-6 + size / 100e9
    overshot = 0
    for seed in range(4):
        base = instance(6, seed)
        inst = Instance.build(base.iteration, link, base.curve, base.windows, codecs=("zans",))
        for fraction in (0.5, 0.6, 0.7, 0.8, 0.9):
            budget = peak(inst, [KEEP] * inst.n) * fraction
            bare = plan_budget(inst, budget)
            plan = with_encoder_scratch(inst, budget, plan_budget)
            assert plan.peak_bytes == peak(inst, plan.choices) + encoder_scratch(inst, plan.choices)
            assert plan.fits and plan.peak_bytes <= budget, (seed, fraction)
            if bare.peak_bytes + encoder_scratch(inst, bare.choices) > budget:
                overshot += 1
                assert plan.choices != bare.choices
    assert overshot >= 3  # the case this is for happens here


def test_predict_plans_for_the_budget_on_the_full_curve():
    model = build("resnet18", dataset="cifar10")
    x = torch.empty(256, 3, 32, 32)
    free = cswap.predict(model, x, gpu="v100-sxm2-16gb", sparsity=0.5)
    assert free.modes["budget"].offloaded == 0  # it fits: nothing moves
    assert all(t.decisions["budget"] == "keep" for t in free.tensors)
    everything = free.instance.n
    assert everything > 0
    floor = cswap.predict(model, x, gpu="v100-sxm2-16gb", sparsity=0.5, budget="1B").peak_bytes("budget")
    budget = (free.peak_bytes("none") + floor) // 2
    p = cswap.predict(model, x, gpu="v100-sxm2-16gb", sparsity=0.5, budget=budget)
    assert p.fits("budget") and p.peak_bytes("budget") <= budget
    assert 0 < p.modes["budget"].offloaded < everything
    assert p.step_seconds("budget") >= p.step_seconds("none")
    assert any(t.decisions["budget"] != "keep" for t in p.tensors)


def test_the_host_time_per_offloaded_tensor_is_counted():
    """Issue 26 §4: the training thread pays for every tensor it offloads, so a plan of
    many small tensors is not free. Over a link that hides every copy, offloading n tensors
    costs n times the host's time per tensor, and the planner frees memory with the one large
    tensor rather than with twenty small ones of the same bytes."""
    from cswap.plan.advisor import HOST_S_PER_TENSOR

    profile = AssumedProfile(gpu("h100-sxm-80gb"))
    profile.codecs = ()
    profile.bw_d2h = profile.bw_h2d = 1e15  # every copy hidden
    small, n = 2**16, 20
    sizes = [n * small] + [small] * n
    tensors = tuple(TensorProfile(key=f"{i}:l{i}", layer=f"l{i}", layer_type="GELU", op="gelu", shape=(s // 4,),
                                  itemsize=4, sparsity=0.0, runs=1, save_s=0.001 * i, use_s=0.001 * (n - i),
                                  hidden_f=0.001, hidden_b=0.001) for i, s in enumerate(sizes))
    curve = np.full(4, 1e6 + sum(sizes))
    inst = Instance.build(IterationProfile(0.05, 0.1, tensors), profile, curve, [(0, 4)] * len(tensors))
    everything = [None] * inst.n
    assert extra_seconds(inst, everything) == pytest.approx(inst.n * HOST_S_PER_TENSOR)
    budget = 1e6 + sum(sizes) - n * small  # one large tensor's bytes must go, or all the small ones
    plan = plan_budget(inst, budget)
    assert plan.fits and plan.choices == [None] + [KEEP] * n
    assert plan.extra_seconds == pytest.approx(HOST_S_PER_TENSOR)
    assert optimum(inst, budget).extra_seconds == pytest.approx(HOST_S_PER_TENSOR)


def test_a_profile_carries_its_machines_host_time(tmp_path):
    import json

    from cswap.plan.advisor import host_seconds
    from cswap.tune.profile import DEFAULT_PROFILE, read_profile, save_profile

    doc = json.loads(DEFAULT_PROFILE.read_text())
    assert read_profile(DEFAULT_PROFILE).host_s_per_tensor is None
    doc["runtime"] = {"host_us_per_tensor": 12.5}
    assert host_seconds(read_profile(save_profile(doc, tmp_path / "p.json"))) == pytest.approx(12.5e-6)
    doc["runtime"] = {"host_us_per_tensor": -1}
    with pytest.raises(ValueError, match="runtime.host_us_per_tensor"):
        read_profile(save_profile(doc, tmp_path / "bad.json"))
