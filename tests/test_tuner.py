"""cswap.tune.tuner: Bayesian optimisation and its baselines on a synthetic launch-time surface."""

import json
import math

import numpy as np
import pytest

from cswap.kernels.launch import LaunchConfig
from cswap.tune.tuner import (
    DEFAULT_BLOCKS,
    DEFAULT_GRID_RANGE,
    Evaluation,
    TuneResult,
    bayes_tune,
    expert,
    expert_config,
    grid_search,
    random_search,
)

OPT_GRID = 528  # = 4 waves x 132 SMs, where paper Fig. 5's valley sits on an H100-class GPU
SEEDS = range(5)
BUDGET = 35  # 10 random + 25 guided probes, the defaults


def kernel_seconds(config: LaunchConfig) -> float:
    """Synthetic compress+decompress time shaped like paper Fig. 5.

    W/g work term (steep fall at small grids: 318x slower at grid 1) plus a
    g**1.5 overhead term (slower rise: 8.8x at grid 4096), minimum 1 ms at
    grid 528 with block 128; a cosine ripple in log2(grid) (period one
    octave, +0..20%) adds local minima at grids 291 and 915; every other
    block is uniformly 20% slower. Configs within 5% of the optimum: grids
    476..585 with block 128 only, 110 of 12288.
    """
    g, q = config.grid, 1.5
    base = (OPT_GRID / g + (g / OPT_GRID) ** q / q) / (1 + 1 / q)
    ripple = 1 + 0.1 * (1 - math.cos(2 * math.pi * math.log2(g / OPT_GRID)))
    return 1e-3 * base * ripple * (1.0 if config.block == 128 else 1.2)


class Counting:
    """Objective wrapper that records every call."""

    def __init__(self, fn=kernel_seconds):
        self.fn = fn
        self.calls: list[LaunchConfig] = []

    def __call__(self, config):
        self.calls.append(config)
        return self.fn(config)


def gap(result: TuneResult, best_seconds: float) -> float:
    return result.best_seconds / best_seconds - 1


@pytest.fixture(scope="module")
def true_best():
    lo, hi = DEFAULT_GRID_RANGE
    configs = [LaunchConfig(g, b) for b in DEFAULT_BLOCKS for g in range(lo, hi + 1)]
    assert len(configs) == 4096 * len(DEFAULT_BLOCKS) == 12288
    best = min(configs, key=kernel_seconds)
    return best, kernel_seconds(best)


@pytest.fixture(scope="module")
def bo_runs():
    """Default-budget BO for each seed, with the objective's call log (the slow part: ~4 s each)."""
    runs = {}
    for seed in SEEDS:
        counting = Counting()
        runs[seed] = (bayes_tune(counting, seed=seed), counting)
    return runs


def test_surface_has_a_narrow_valley(true_best):
    best, seconds = true_best
    assert best == LaunchConfig(OPT_GRID, 128)
    assert seconds == pytest.approx(1e-3)
    near = [g for g in range(1, 4097) if kernel_seconds(LaunchConfig(g, 128)) <= 1.05 * seconds]
    assert (min(near), max(near)) == (476, 585)
    assert all(kernel_seconds(LaunchConfig(g, 256)) > 1.05 * seconds for g in range(1, 4097))
    times = [kernel_seconds(LaunchConfig(g, 128)) for g in range(1, 4097)]
    local_minima = [g for g in range(2, 4096) if times[g - 2] > times[g - 1] < times[g]]
    assert local_minima == [291, 528, 915]


@pytest.mark.slow  # the shared BO runs take 16-24 s
def test_bayes_finds_the_valley_for_every_seed(bo_runs, true_best):
    best, seconds = true_best
    for seed, (result, counting) in bo_runs.items():
        assert result.method == "bayes"
        assert len(result.evaluations) <= BUDGET
        assert gap(result, seconds) <= 0.05, (seed, result.best, gap(result, seconds))
        assert result.best.block == best.block
        assert result.best_seconds == min(e.seconds for e in result.evaluations)
        assert result.best_seconds == kernel_seconds(result.best)
        assert result.wall_s > 0


@pytest.mark.slow  # the shared BO runs take 16-24 s
def test_bayes_memoises_repeated_configs(bo_runs):
    for result, counting in bo_runs.values():
        configs = [e.config for e in result.evaluations]
        assert counting.calls == configs  # one objective call per evaluation, in probe order
        assert len(set(configs)) == len(configs)
        assert all(e.seconds == kernel_seconds(e.config) for e in result.evaluations)


@pytest.mark.slow  # the shared BO runs take 16-24 s
def test_bayes_beats_random_search_on_average(bo_runs, true_best):
    _, seconds = true_best
    bo_gaps = [gap(result, seconds) for result, _ in bo_runs.values()]
    rs = [random_search(kernel_seconds, budget=BUDGET, seed=seed) for seed in SEEDS]
    rs_gaps = [gap(result, seconds) for result in rs]
    assert all(len(r.evaluations) <= BUDGET and r.method == "random" for r in rs)
    # Observed (seeds 0-4): BO mean gap 0.05%, random 10.7%; random misses the
    # 5% band for 4 of 5 seeds. A BO that never leaves its random phase
    # (init_points=35, n_iter=0) averages 20%.
    assert np.mean(rs_gaps) > np.mean(bo_gaps) + 0.03, (bo_gaps, rs_gaps)
    assert sum(g > 0.05 for g in rs_gaps) >= 2


def test_memoisation_on_a_tiny_space():
    # 4 configs, 10 probes: rounding must hit repeats, which are measured once.
    counting = Counting()
    result = bayes_tune(counting, grid_range=(1, 4), blocks=(128,), init_points=6, n_iter=4, seed=1)
    assert len(counting.calls) == len(result.evaluations) <= 4
    assert len(set(counting.calls)) == len(counting.calls)
    assert result.best == min(counting.calls, key=kernel_seconds)
    counting = Counting()
    result = random_search(counting, budget=BUDGET, grid_range=(1, 4), blocks=(128,), seed=0)
    assert len(counting.calls) == len(result.evaluations) == 4  # 35 draws over 4 configs
    assert result.best == LaunchConfig(4, 128)


def test_bayes_is_deterministic_for_a_seed():
    def run(seed):
        return [(e.config, e.seconds) for e in
                bayes_tune(kernel_seconds, init_points=3, n_iter=3, seed=seed).evaluations]

    first = run(7)
    assert run(7) == first
    assert run(8) != first


def test_bayes_probes_at_random_where_the_acquisitions_optimiser_gives_up(monkeypatch):
    """bayes_opt raises when scipy's differential evolution, which maximises its acquisition
    over the int block axis, stops at its iteration cap (it failed a CI run of
    `cswap-tune --quick`): that probe is a random one, and the search goes on. Any other
    error of bayes_opt is raised."""
    from bayes_opt import BayesianOptimization

    suggest, failures = BayesianOptimization.suggest, []

    def failing(self, *args, **kwargs):
        if len(failures) < 2:
            failures.append(1)
            raise RuntimeError("Differential evolution optimization failed. Message: Maximum number of "
                               "iterations has been exceeded.")
        return suggest(self, *args, **kwargs)

    monkeypatch.setattr(BayesianOptimization, "suggest", failing)
    result = bayes_tune(kernel_seconds, init_points=3, n_iter=4, seed=0)
    assert failures == [1, 1] and 1 <= len(result.evaluations) <= 7
    assert result.best == min(result.evaluations, key=lambda e: e.seconds).config

    def broken(self, *args, **kwargs):
        raise RuntimeError("something else")

    monkeypatch.setattr(BayesianOptimization, "suggest", broken)
    with pytest.raises(RuntimeError, match="something else"):
        bayes_tune(kernel_seconds, init_points=1, n_iter=1, seed=0)


def test_random_search_is_deterministic_and_log_uniform():
    a = random_search(kernel_seconds, seed=3)
    b = random_search(kernel_seconds, seed=3)
    assert a.evaluations == b.evaluations and a.best == b.best
    assert random_search(kernel_seconds, seed=4).evaluations != a.evaluations
    # Uniform in log2(grid): about half the draws below the geometric midpoint
    # 2**10 of [1, 2**20] (a linear-uniform sampler would put 0.1% there).
    wide = random_search(lambda c: 1.0, budget=400, grid_range=(1, 2**20), seed=0)
    low = np.mean([e.config.grid <= 2**10 for e in wide.evaluations])
    assert 0.35 < low < 0.65
    assert {e.config.block for e in wide.evaluations} == set(DEFAULT_BLOCKS)


def test_bayes_handles_more_than_two_blocks():
    factor = {32: 1.6, 64: 1.3, 128: 1.1, 256: 1.0}
    result = bayes_tune(lambda c: factor[c.block] * kernel_seconds(LaunchConfig(c.grid, 128)),
                        grid_range=(256, 1024), blocks=(32, 64, 128, 256), init_points=8, n_iter=4, seed=0)
    assert {e.config.block for e in result.evaluations} <= set(factor)
    assert result.best.block == 256
    assert all(256 <= e.config.grid <= 1024 for e in result.evaluations)


def test_expert_config_arithmetic():
    assert expert_config(132) == LaunchConfig(528, 128)  # H100: 4 waves x 132 SMs
    assert expert_config(108, waves=2, block=64) == LaunchConfig(216, 64)
    assert expert_config(2000) == LaunchConfig(4096, 128)  # 8000 clamped to the default range
    assert expert_config(132, grid_range=(1, 256)) == LaunchConfig(256, 128)
    assert expert_config(1, grid_range=(8, 64)) == LaunchConfig(8, 128)
    counting = Counting()
    result = expert(counting, 80, waves=3)
    assert counting.calls == [LaunchConfig(240, 128)]
    assert result.method == "expert"
    assert result.best == LaunchConfig(240, 128)
    assert result.best_seconds == kernel_seconds(LaunchConfig(240, 128))
    assert result.evaluations == [Evaluation(LaunchConfig(240, 128), result.best_seconds)]


def test_grid_search_is_exact():
    result = grid_search(kernel_seconds, grids=range(1, 257))
    configs = [LaunchConfig(g, b) for b in DEFAULT_BLOCKS for g in range(1, 257)]
    assert result.method == "grid"
    assert [e.config for e in result.evaluations] == configs
    assert result.best == min(configs, key=kernel_seconds) == LaunchConfig(256, 128)
    assert grid_search(kernel_seconds, grids=range(449, 705), blocks=(64, 128)).best == LaunchConfig(OPT_GRID, 128)
    counting = Counting()
    assert len(grid_search(counting, grids=[5, 5, 6], blocks=(64,)).evaluations) == len(counting.calls) == 2


def test_to_dict_is_json():
    result = bayes_tune(kernel_seconds, init_points=3, n_iter=1, seed=0)
    doc = json.loads(json.dumps(result.to_dict()))
    assert doc == {
        "method": "bayes",
        "best": {"grid": result.best.grid, "block": result.best.block},
        "best_seconds": result.best_seconds,
        "evaluations": len(result.evaluations),
        "wall_s": result.wall_s,
    }
    assert 1 <= doc["evaluations"] <= 4


@pytest.mark.parametrize("call, match", [
    (lambda f: bayes_tune(f, grid_range=(64, 8)), "grid_range"),
    (lambda f: bayes_tune(f, grid_range=(0, 8)), "grid_range"),
    (lambda f: bayes_tune(f, grid_range=(1, 2**21)), "grid_range"),
    (lambda f: bayes_tune(f, grid_range=(1.0, 8)), "grid_range"),
    (lambda f: bayes_tune(f, grid_range=8), "grid_range"),
    (lambda f: bayes_tune(f, blocks=()), "blocks"),
    (lambda f: bayes_tune(f, blocks=(96,)), "blocks"),
    (lambda f: bayes_tune(f, blocks=(64, 64)), "blocks"),
    (lambda f: bayes_tune(f, init_points=0), "init_points"),
    (lambda f: bayes_tune(f, n_iter=-1), "n_iter"),
    (lambda f: bayes_tune(f, seed=-1), "seed"),
    (lambda f: random_search(f, budget=0), "budget"),
    (lambda f: random_search(f, grid_range=(5, 4)), "grid_range"),
    (lambda f: random_search(f, blocks=[]), "blocks"),
    (lambda f: grid_search(f, grids=[]), "grids"),
    (lambda f: grid_search(f, grids=[0, 1]), "grids"),
    (lambda f: expert_config(0), "sm_count"),
    (lambda f: expert_config(132, waves=0), "waves"),
    (lambda f: expert(f, 132, block=100), "block"),
])
def test_bad_arguments_raise_value_error(call, match):
    counting = Counting()
    with pytest.raises(ValueError, match=match):
        call(counting)
    assert counting.calls == []  # checked before anything is measured


def test_objective_must_be_callable():
    for search in (bayes_tune, random_search, grid_search):
        with pytest.raises(TypeError, match="objective must be callable"):
            search(42)
    with pytest.raises(TypeError, match="objective must be callable"):
        expert("fast", 132)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1e-3])
def test_bad_objective_value_names_the_config(bad):
    with pytest.raises(ValueError, match=r"objective\(LaunchConfig\(grid=7, block=64\)\) returned"):
        grid_search(lambda c: bad, grids=[7], blocks=(64,))
    with pytest.raises(ValueError, match=r"bayes_tune: objective\(LaunchConfig\(grid=\d+, block=(128|256|512)\)\)"):
        bayes_tune(lambda c: bad, init_points=2, n_iter=1)
    with pytest.raises(ValueError, match=r"random_search: objective\(LaunchConfig\("):
        random_search(lambda c: bad)


def test_non_number_objective_value_is_a_type_error():
    with pytest.raises(TypeError, match=r"objective\(LaunchConfig\(grid=3, block=128\)\) returned None"):
        grid_search(lambda c: None, grids=[3], blocks=(128,))


def test_nan_in_a_later_probe_still_raises():
    # Only one config misbehaves: the error names that one.
    def objective(config):
        return float("nan") if config.grid == 9 else kernel_seconds(config)

    with pytest.raises(ValueError, match=r"LaunchConfig\(grid=9, block=128\)"):
        grid_search(objective, grids=range(1, 17), blocks=(128,))
