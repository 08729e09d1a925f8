"""Offline search for the launch config that minimises a measured time (paper IV-D).

Search space
    A codec kernel has two launch knobs (``LaunchConfig``): ``grid``, the
    number of persistent programs, an int in ``grid_range`` (default
    ``DEFAULT_GRID_RANGE`` = [1, 4096]), and ``block``, threads per program,
    one of ``blocks`` (default ``DEFAULT_BLOCKS`` = 128, 256, 512). That is
    4096 x 3 = 12288 configs by default. The caller's ``objective(config)``
    returns seconds (compress + decompress of a representative tensor);
    lower is better.

Bayesian optimisation (``bayes_tune``)
    ``bayes_opt.BayesianOptimization`` (3.x, a Gaussian process with a Matern
    kernel and an upper-confidence-bound acquisition) maximises ``-seconds``
    over two encoded parameters:

    - ``log2_grid``: a float in [log2(lo), log2(hi)]; the config's grid is
      ``round(2 ** log2_grid)`` clamped into the range. Kernel time against
      grid falls steeply at small grids (each program has less work) to a
      narrow valley and then rises slowly (scheduling and tail overhead),
      paper Fig. 5. On a linear axis that descent and valley are a sliver at
      the left of [1, 4096] that few probes land in; on a log2 axis every
      octave gets the same share, so the GP sees the descent and can follow
      it into the valley. On the Fig. 5-shaped surface of tests/test_tuner.py
      (within 5% of the optimum: grids 476..585, block 128) with the default
      budget, a linear int grid axis missed that band for 5 of 10 seeds
      (mean gap 7.9%), the log2 axis for none (mean gap 0.04%).
    - ``block_index``: an int parameter (``(0, len(blocks) - 1, int)``),
      an index into ``blocks``. bayes_opt reads a two-element tuple of
      numbers as a float range, so the block values themselves (128, 256)
      cannot be passed as choices; an index works for any number of blocks.

    s1 = ``init_points`` random probes, then s2 = ``n_iter`` probes suggested
    by the acquisition function (paper: 10 + 25). Every probe is registered
    with the optimiser at the config actually launched (the rounded grid), so
    the GP models real points rather than a staircase. Rounding makes repeats
    likely: a config already measured is not measured again (its memoised
    time is registered once more, with duplicates allowed), and
    ``TuneResult.evaluations`` lists only real objective calls, so it holds
    at most ``init_points + n_iter`` entries. Given a deterministic objective
    the result is a function of ``seed``. Each guided probe costs bayes_opt
    about 0.15 s of CPU (a GP fit, then differential evolution over the
    acquisition because ``block_index`` is an int), small next to timing a
    codec.

Errors
    Bad arguments raise ValueError naming the argument, before anything is
    measured; a non-callable objective raises TypeError. An objective that
    returns a non-number (TypeError), NaN, infinity or a negative number
    (ValueError) stops the search with an error naming the config.

Baselines
    - ``random_search``: the same budget, uniform in log2(grid) and uniform
      over blocks (a numpy Generator seeded with ``seed``).
    - ``expert``: the rule of thumb ``grid = waves x SM count`` (4 waves),
      block 128, evaluated once; also cswap's untuned default on CUDA.
    - ``grid_search``: every grid x every block. Exact but slow (12288
      measurements by default); opt-in, for judging the others.
"""

from __future__ import annotations

import contextlib
import io
import math
import numbers
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from ..kernels.launch import _MAX_GRID, LaunchConfig

__all__ = [
    "Evaluation",
    "TuneResult",
    "DEFAULT_GRID_RANGE",
    "DEFAULT_BLOCKS",
    "bayes_tune",
    "random_search",
    "expert_config",
    "expert",
    "grid_search",
]

# [1, 4096]: paper IV-D's search range for the grid (about 31 programs per SM
# on a 132-SM H100 at the top, well past any useful occupancy).
DEFAULT_GRID_RANGE = (1, 4096)
# 128, 256 and 512 threads. The paper tuned 64 and 128 for its CUDA kernels;
# ours walk a tile in steps of 16 bytes per thread (kernels.launch.step_elements),
# so a larger block means longer steps, not more registers. Built for sm_80 and
# sm_90 (python -m cswap.kernels.aot): at 64 threads the first kernels spilled
# up to 15.8 KB per thread and ours fall to 2 warps per program (too little
# memory parallelism per SM slot); at 1024 threads the 64-register cap spills
# the LZ4 encoder; 128-512 build without spills at 48-128 registers.
DEFAULT_BLOCKS = (128, 256, 512)

Objective = Callable[[LaunchConfig], float]


@dataclass(frozen=True)
class Evaluation:
    """One measurement: ``objective(config)`` returned ``seconds``."""

    config: LaunchConfig
    seconds: float


@dataclass
class TuneResult:
    """Outcome of one search.

    method:        "bayes", "random", "expert" or "grid".
    best:          the config with the lowest measured time (the first probed on ties).
    best_seconds:  its time.
    evaluations:   every real objective call, in the order probed (no repeats).
    wall_s:        wall time of the whole search, objective included (time.perf_counter).
    """

    method: str
    best: LaunchConfig
    best_seconds: float
    evaluations: list[Evaluation] = field(default_factory=list)
    wall_s: float = 0.0

    def to_dict(self) -> dict:
        """JSON-ready summary (the evaluations are counted, not listed)."""
        return {
            "method": self.method,
            "best": {"grid": self.best.grid, "block": self.best.block},
            "best_seconds": float(self.best_seconds),
            "evaluations": len(self.evaluations),
            "wall_s": float(self.wall_s),
        }


# ---------------------------------------------------------------------------
# argument checks


def _check_objective(objective, who: str) -> None:
    if not callable(objective):
        raise TypeError(f"cswap.tune.tuner.{who}: objective must be callable(LaunchConfig) -> seconds, "
                        f"got {type(objective).__name__}")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_grid_range(grid_range, who: str) -> tuple[int, int]:
    try:
        lo, hi = grid_range
    except (TypeError, ValueError):
        raise ValueError(f"cswap.tune.tuner.{who}: grid_range must be a pair of ints (lo, hi), "
                         f"got {grid_range!r}") from None
    if not (_is_int(lo) and _is_int(hi)):
        raise ValueError(f"cswap.tune.tuner.{who}: grid_range must be a pair of ints (lo, hi), got {grid_range!r}")
    if not 1 <= lo <= hi <= _MAX_GRID:
        raise ValueError(f"cswap.tune.tuner.{who}: grid_range must satisfy 1 <= lo <= hi <= {_MAX_GRID}, "
                         f"got {grid_range!r}")
    return int(lo), int(hi)


def _check_blocks(blocks, who: str) -> tuple[int, ...]:
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Iterable):
        raise ValueError(f"cswap.tune.tuner.{who}: blocks must be a sequence of block sizes, got {blocks!r}")
    blocks = tuple(blocks)
    if not blocks:
        raise ValueError(f"cswap.tune.tuner.{who}: blocks is empty; give at least one block size, e.g. (128, 256)")
    for b in blocks:
        if not _is_int(b):
            raise ValueError(f"cswap.tune.tuner.{who}: blocks must hold ints, got {b!r} in {blocks!r}")
        try:
            LaunchConfig(grid=1, block=int(b))
        except ValueError as exc:
            raise ValueError(f"cswap.tune.tuner.{who}: blocks has an invalid block {b!r} ({exc})") from None
    if len(set(blocks)) != len(blocks):
        raise ValueError(f"cswap.tune.tuner.{who}: blocks has duplicates: {blocks!r}")
    return tuple(int(b) for b in blocks)


def _check_count(name: str, value, minimum: int, who: str) -> int:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"cswap.tune.tuner.{who}: {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _check_seed(seed, who: str) -> int:
    # bayes_opt seeds a numpy RandomState, which takes [0, 2**32).
    if not _is_int(seed) or not 0 <= seed < 2**32:
        raise ValueError(f"cswap.tune.tuner.{who}: seed must be an int in [0, 2**32), got {seed!r}")
    return int(seed)


# ---------------------------------------------------------------------------
# measuring


class _Recorder:
    """Calls the objective once per distinct config, checks and records the result."""

    def __init__(self, objective: Objective, who: str):
        self.objective = objective
        self.who = who
        self.seen: dict[LaunchConfig, float] = {}
        self.evaluations: list[Evaluation] = []

    def __call__(self, config: LaunchConfig) -> float:
        if config in self.seen:
            return self.seen[config]
        value = self.objective(config)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"cswap.tune.tuner.{self.who}: objective({config}) returned {value!r} "
                            f"({type(value).__name__}); it must return seconds as a float")
        seconds = float(value)
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"cswap.tune.tuner.{self.who}: objective({config}) returned {seconds!r}; "
                             f"it must return a finite, non-negative number of seconds")
        self.seen[config] = seconds
        self.evaluations.append(Evaluation(config, seconds))
        return seconds

    def result(self, method: str, start: float) -> TuneResult:
        best = min(self.evaluations, key=lambda e: e.seconds)  # min keeps the first on ties
        return TuneResult(method, best.config, best.seconds, self.evaluations, time.perf_counter() - start)


def _grid_from_log2(x: float, lo: int, hi: int) -> int:
    return min(max(int(round(2.0 ** float(x))), lo), hi)


# ---------------------------------------------------------------------------
# searches


def bayes_tune(
    objective: Objective,
    *,
    grid_range: tuple[int, int] = DEFAULT_GRID_RANGE,
    blocks: Sequence[int] = DEFAULT_BLOCKS,
    init_points: int = 10,
    n_iter: int = 25,
    seed: int = 0,
) -> TuneResult:
    """Bayesian optimisation of ``objective`` over grid x block (paper IV-D).

    ``init_points`` random probes (s1), then ``n_iter`` guided ones (s2); at
    most ``init_points + n_iter`` objective calls, fewer when a probe rounds
    to a config already measured. Deterministic for a given ``seed`` and a
    deterministic objective.
    """
    who = "bayes_tune"
    _check_objective(objective, who)
    lo, hi = _check_grid_range(grid_range, who)
    blocks = _check_blocks(blocks, who)
    init_points = _check_count("init_points", init_points, 1, who)
    n_iter = _check_count("n_iter", n_iter, 0, who)
    seed = _check_seed(seed, who)

    # Imported here: only tuning needs them, and bayes_opt takes seconds to import.
    from bayes_opt import BayesianOptimization
    from sklearn.exceptions import ConvergenceWarning

    start = time.perf_counter()
    measure = _Recorder(objective, who)
    pbounds = {
        "log2_grid": (math.log2(lo), math.log2(hi)),  # log2 axis: see the module docstring
        "block_index": (0, len(blocks) - 1, int),
    }
    with warnings.catch_warnings():
        # bayes_opt flags int parameters as experimental; they are the intended use here.
        warnings.filterwarnings("ignore", message="Non-float parameters are experimental")
        # The GP's kernel fit may stop at its length-scale bounds on a flat stretch; harmless.
        warnings.filterwarnings("ignore", category=ConvergenceWarning)
        optimizer = BayesianOptimization(
            f=None, pbounds=pbounds, random_state=seed, verbose=0, allow_duplicate_points=True
        )
        for step in range(init_points + n_iter):
            params = optimizer.random_sample(1)[0] if step < init_points else _suggest(optimizer)
            index = min(max(int(round(float(params["block_index"]))), 0), len(blocks) - 1)
            config = LaunchConfig(grid=_grid_from_log2(params["log2_grid"], lo, hi), block=blocks[index])
            repeat = config in measure.seen
            seconds = measure(config)  # memoised: a repeat is not measured again
            point = {"log2_grid": math.log2(config.grid), "block_index": index}
            if repeat:
                # bayes_opt prints a line for every duplicate point, whatever verbose says.
                with contextlib.redirect_stdout(io.StringIO()):
                    optimizer.register(point, -seconds)
            else:
                optimizer.register(point, -seconds)  # bayes_opt maximises
    return measure.result("bayes", start)


def _suggest(optimizer) -> dict:
    """bayes_opt's next probe; a random one where its acquisition's optimiser gives up.
    With an int parameter, bayes_opt maximises the acquisition by scipy's differential
    evolution and raises when that stops at its iteration cap, now and then, on a
    surface as noisy as measured kernel times (bayesian-optimization/BayesianOptimization
    #592; it failed a CI run of `cswap-tune --quick`). One random probe costs a guided
    one; the GP keeps every point measured."""
    try:
        return optimizer.suggest()
    except RuntimeError as exc:
        if "Differential evolution" not in str(exc):
            raise
        return optimizer.random_sample(1)[0]


def random_search(
    objective: Objective,
    *,
    budget: int = 35,
    grid_range: tuple[int, int] = DEFAULT_GRID_RANGE,
    blocks: Sequence[int] = DEFAULT_BLOCKS,
    seed: int = 0,
) -> TuneResult:
    """``budget`` probes uniform in log2(grid) and over ``blocks``; repeats are measured once."""
    who = "random_search"
    _check_objective(objective, who)
    budget = _check_count("budget", budget, 1, who)
    lo, hi = _check_grid_range(grid_range, who)
    blocks = _check_blocks(blocks, who)
    seed = _check_seed(seed, who)

    start = time.perf_counter()
    measure = _Recorder(objective, who)
    rng = np.random.default_rng(seed)
    for _ in range(budget):
        grid = _grid_from_log2(rng.uniform(math.log2(lo), math.log2(hi)), lo, hi)
        measure(LaunchConfig(grid=grid, block=blocks[int(rng.integers(len(blocks)))]))
    return measure.result("random", start)


def expert_config(
    sm_count: int, waves: int = 4, block: int = 128, *, grid_range: tuple[int, int] = DEFAULT_GRID_RANGE
) -> LaunchConfig:
    """Rule of thumb: ``waves`` programs per SM (grid = waves x sm_count, clamped into grid_range).

    4 waves of 4-warp programs keep enough memory requests in flight to hide
    latency on current GPUs; it is cswap's untuned CUDA default too.
    """
    who = "expert_config"
    sm_count = _check_count("sm_count", sm_count, 1, who)
    waves = _check_count("waves", waves, 1, who)
    (block,) = _check_blocks((block,), who)
    lo, hi = _check_grid_range(grid_range, who)
    return LaunchConfig(grid=min(max(waves * sm_count, lo), hi), block=block)


def expert(objective: Objective, sm_count: int, **kw) -> TuneResult:
    """One evaluation of ``expert_config(sm_count, **kw)``: the baseline that needs no search."""
    _check_objective(objective, "expert")
    config = expert_config(sm_count, **kw)
    start = time.perf_counter()
    measure = _Recorder(objective, "expert")
    measure(config)
    return measure.result("expert", start)


def grid_search(
    objective: Objective,
    *,
    grids: Iterable[int] | None = None,
    blocks: Sequence[int] = DEFAULT_BLOCKS,
) -> TuneResult:
    """Measure every grid in ``grids`` (default range(1, 4097)) with every block: exact, slow, opt-in."""
    who = "grid_search"
    _check_objective(objective, who)
    blocks = _check_blocks(blocks, who)
    if grids is None:
        grids = range(DEFAULT_GRID_RANGE[0], DEFAULT_GRID_RANGE[1] + 1)
    if isinstance(grids, (str, bytes)) or not isinstance(grids, Iterable):
        raise ValueError(f"cswap.tune.tuner.{who}: grids must be an iterable of ints, got {grids!r}")
    grids = list(grids)
    if not grids:
        raise ValueError(f"cswap.tune.tuner.{who}: grids is empty; give at least one grid, e.g. range(1, 4097)")
    for g in grids:
        if not _is_int(g) or not 1 <= g <= _MAX_GRID:
            raise ValueError(f"cswap.tune.tuner.{who}: grids must hold ints in [1, {_MAX_GRID}], got {g!r}")

    start = time.perf_counter()
    measure = _Recorder(objective, who)
    for block in blocks:
        for grid in grids:
            measure(LaunchConfig(grid=int(grid), block=block))
    return measure.result("grid", start)
