"""Offload only what must go: per saved tensor keep, move raw, or compress with a
codec, for the least step time whose peak stays within a memory budget (issue 14).

    inst = Instance.build(iteration, profile, curve, windows)
    plan = plan_budget(inst, budget)                  # choices, step time, peak
    exact = optimum(inst, budget)                     # the same model, solved exactly (MILP)

The model, which the planner, its baselines and the exact optimum share:

- time: a timeline simpler than the runtime's (extra_seconds, below; the runtime's
  is cswap.plan.advisor.simulate): the offloaded tensors, in save order, share one
  D2H link in forward and one H2D link in backward, each restore issued when the
  tensor offloaded after it is used; a step costs the exposed transfer time plus
  every (de)compression kernel's time. Kept tensors take no link time. It is linear
  enough for `optimum` to solve exactly; under a budget the runtime keeps its
  windows strict (one tensor at least), as this model does.
- memory: `curve` is the device's bytes after each op with nothing offloaded;
  an offloaded tensor is away over its window of ops (from when the step drops
  it until it is restored for backward: `windows`, from the trace) and the peak
  is the curve's maximum after those subtractions. How late a copy actually
  finishes is the timeline's business: a caller that knows it (the what-if's
  full curve) checks the plan and plans again with the overshoot taken off.

The planner (`plan_budget`): if the step fits, nothing moves. Otherwise, while
some op is over budget, it offloads, among the tensors away at the worst op,
the one that frees most bytes per second of step time it adds. That time is
the best option's kernel time plus the larger of its own exposed transfer
(paper eq. 1-4) and what it adds to a link already busier than the compute
beside it. Then it drops tensors the budget no longer needs, tries each
moved tensor's other options on the full timeline, searches exchanges of kept
and moved tensors, and, with time left, kicks the result out of its local
optimum and searches again (iterated local search). It never returns a plan
slower than offloading everything that meets the budget.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from math import prod

import numpy as np

from ..runtime.candidates import KEEP  # a choice beside None (offload raw) and a codec name
from .advisor import IterationProfile, _check_profile, _costs, _Costs, _exposed

__all__ = ["KEEP", "Instance", "Plan", "encoder_scratch", "evaluate", "largest_first", "offload_everything",
           "optimum", "parse_bytes", "plan_budget", "per_tensor_rule", "with_encoder_scratch"]



@dataclass
class Instance:
    """One planning problem: the tensors that may leave, their options and the memory they hold."""

    iteration: IterationProfile     # the tensors that may be offloaded, in save order
    costs: list[_Costs]             # per tensor: bytes moved and kernel seconds per option (None = raw)
    codecs: tuple[str, ...]
    bw_d2h: float
    bw_h2d: float
    curve: np.ndarray               # device bytes after each op, nothing offloaded
    windows: list[tuple[int, int]]  # per tensor: [first op away, first op back) when offloaded
    standalone: list[dict] = field(default_factory=list)  # per tensor: option -> eq. 1-4 cost (seconds)
    nbytes: np.ndarray = field(init=False)                 # per tensor: device bytes it holds

    def __post_init__(self):
        self.nbytes = np.array([t.nbytes for t in self.iteration.tensors], dtype=np.float64)

    @classmethod
    def build(cls, iteration: IterationProfile, profile, curve, windows, codecs=None, sizes=None) -> "Instance":
        bw_d2h, bw_h2d, available = _check_profile(profile)
        codecs = tuple(available if codecs is None else codecs)
        costs = [_costs(t, profile, codecs, (sizes or {}).get(t.key)) for t in iteration.tensors]
        curve = np.asarray(curve, dtype=np.float64)
        windows = [(int(a), int(b)) for a, b in windows]
        if len(windows) != len(iteration.tensors):
            raise ValueError(f"cswap.plan.budget: {len(windows)} windows for {len(iteration.tensors)} tensors")
        standalone = [{o: c.host + c.t_c[o] + c.t_dc[o] + _exposed(c.size[o], t, bw_d2h, bw_h2d) for o in c.size}
                      for t, c in zip(iteration.tensors, costs)]
        return cls(iteration, costs, codecs, bw_d2h, bw_h2d, curve, windows, standalone)

    @property
    def n(self) -> int:
        return len(self.iteration.tensors)

    def subset(self, chosen: list[int], curve: np.ndarray | None = None) -> "Instance":
        """The same step with only `chosen` tensors allowed to leave (the others stay, or
        are accounted for in `curve`, by default this instance's)."""
        it = self.iteration
        return Instance(IterationProfile(it.forward_s, it.backward_s, tuple(it.tensors[i] for i in chosen)),
                        [self.costs[i] for i in chosen], self.codecs, self.bw_d2h, self.bw_h2d,
                        self.curve if curve is None else curve, [self.windows[i] for i in chosen],
                        [self.standalone[i] for i in chosen])

    def paper_choice(self, i: int):
        """The paper's rule for an offloaded tensor: the codec whose cost beats the raw copy's, else raw."""
        costs = self.standalone[i]
        best = min(self.codecs, key=lambda k: costs[k], default=None)
        return best if best is not None and costs[best] < costs[None] else None


@dataclass
class Plan:
    choices: list                   # per tensor: KEEP, None (raw) or a codec
    extra_seconds: float            # exposed transfers + kernels: the step's time beyond compute
    peak_bytes: float
    fits: bool
    planning_seconds: float = 0.0

    @property
    def moved(self) -> int:
        return sum(1 for c in self.choices if c != KEEP)


_FORBIDDEN_S = 1e9  # an option's kernel seconds where it may not be chosen: never worth it


def _scratch_of(inst: Instance) -> dict[tuple[int, str], int]:
    """(tensor, codec) -> the bytes that codec's encoder allocates beside its payload
    (Codec.encode_scratch_bytes)."""
    from .. import codecs

    names = set(codecs.names())
    return {(i, c): codecs.get(c).encode_scratch_bytes(prod(t.shape), t.itemsize)
            for i, t in enumerate(inst.iteration.tensors) for c in inst.codecs if c in names}


def encoder_scratch(inst: Instance, choices) -> int:
    """The most device bytes one of `choices`' encoders allocates beside its payload: one
    tensor compresses at a time, on the codec stream, so the step's peak may grow
    by that much wherever a compression runs."""
    return _largest_scratch(_scratch_of(inst), choices)


def _largest_scratch(scratch_of: dict[tuple[int, str], int], choices) -> int:
    return max((scratch_of.get((i, c), 0) for i, c in enumerate(choices)), default=0)


def _forbidding(inst: Instance, forbidden: set) -> Instance:
    """`inst` where the (tensor, option) pairs in `forbidden` cost _FORBIDDEN_S each."""
    costs = [replace(c, t_c={o: _FORBIDDEN_S if (i, o) in forbidden else s for o, s in c.t_c.items()})
             for i, c in enumerate(inst.costs)]
    standalone = [{o: s + _FORBIDDEN_S if (i, o) in forbidden else s for o, s in options.items()}
                  for i, options in enumerate(inst.standalone)]
    return Instance(inst.iteration, costs, inst.codecs, inst.bw_d2h, inst.bw_h2d, inst.curve, inst.windows,
                    standalone)


def with_encoder_scratch(inst: Instance, budget: float, plan_for) -> Plan:
    """plan_for(instance, budget) with room for its encoders' temporaries, which the
    profiled step (offloading raw) never saw: while the plan's peak plus the scratch
    of an encoder it runs exceeds the budget, the encoders whose scratch exceeds what
    the plan leaves free are ruled out for their tensors and it plans again. The
    plan's peak_bytes and fits count the scratch."""
    scratch_of = _scratch_of(inst)
    forbidden: set = set()
    current = inst
    for _ in range(len(scratch_of) + 1):  # each round rules out at least one pair
        plan = plan_for(current, budget)
        scratch = _largest_scratch(scratch_of, plan.choices)
        if plan.peak_bytes + scratch <= budget or not plan.fits:
            break
        slack = budget - plan.peak_bytes
        more = {pair for pair, nbytes in scratch_of.items() if nbytes > slack} - forbidden
        if not more:
            break
        forbidden |= more
        current = _forbidding(inst, forbidden)
    return replace(plan, peak_bytes=plan.peak_bytes + scratch, fits=plan.peak_bytes + scratch <= budget)


def peak(inst: Instance, choices) -> float:
    """The model's peak: the curve less each offloaded tensor's bytes over its window."""
    if len(inst.curve) == 0:
        return 0.0
    delta = np.zeros(len(inst.curve) + 1)
    for (a, b), n, c in zip(inst.windows, inst.nbytes, choices):
        if c != KEEP and a < b:
            delta[a] -= n
            delta[b] += n
    return float((inst.curve + np.cumsum(delta)[:-1]).max())


def extra_seconds(inst: Instance, choices) -> float:
    """Exposed transfer time plus kernel time of `choices` on the timeline, plus the
    training thread's time per offloaded tensor. The timeline is simpler than the runtime's,
    so that its exact optimum can be written as a mixed-integer program: one serial D2H link
    in forward, offload i starting at max(save_i + Time_c_i, link free), and backward
    starting once every offload is done; restore i issued when tensor i + 1 is used (the
    first at backward's start), on one serial H2D link with its decode after its copy. It
    keeps no per-tensor records: the local search calls this for every exchange it tries."""
    moved = [i for i, c in enumerate(choices) if c != KEEP]
    if not moved:
        return 0.0
    tensors, costs = inst.iteration.tensors, inst.costs
    link, kernels, offload_end = 0.0, 0.0, []
    for i in moved:
        c, k = costs[i], choices[i]
        link = max(tensors[i].save_s + c.t_c[k], link) + c.size[k] / inst.bw_d2h
        offload_end.append(link)
        kernels += c.host + c.t_c[k] + c.t_dc[k]
    forward_stall = max(0.0, link - inst.iteration.forward_s)
    b0 = inst.iteration.forward_s + forward_stall
    shift, h2d, issue = 0.0, b0, b0
    for j in range(len(moved) - 1, -1, -1):
        c, k = costs[moved[j]], choices[moved[j]]
        h2d = max(issue, h2d, offload_end[j]) + c.size[k] / inst.bw_h2d + c.t_dc[k]
        use = b0 + tensors[moved[j]].use_s + shift
        if h2d > use:
            shift += h2d - use
            use = h2d
        issue = use
    return forward_stall + shift + kernels


def evaluate(inst: Instance, choices, budget: float, started: float | None = None) -> Plan:
    p = peak(inst, choices)
    spent = time.perf_counter() - started if started is not None else 0.0
    return Plan(list(choices), extra_seconds(inst, choices), p, p <= budget, spent)


def fraction(value) -> float | None:
    """The share of memory `value` names (0.5, "0.5" or "50%"), or None if it names none."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip()
        try:
            value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            return None
    return float(value) if isinstance(value, (int, float)) and 0 < value <= 1 else None


def parse_bytes(value, capacity: int | None = None) -> int:
    """40GiB, 40GB, 4e10, 40e9 bytes, or a fraction of `capacity` (0.5, 50%)."""
    share = fraction(value)
    if share is not None and capacity:
        return int(share * capacity)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    text = str(value).strip().replace(" ", "")
    units = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "TB": 1e12, "GB": 1e9, "MB": 1e6,
             "KB": 1e3, "B": 1}
    for unit, scale in units.items():
        if text.upper().endswith(unit):
            try:
                return int(float(text[: -len(unit)]) * scale)
            except ValueError:
                break
    try:
        return parse_bytes(float(text), capacity)
    except ValueError:
        raise ValueError(f"cswap.plan: {value!r} is not a size; write e.g. 40GiB, 40GB, 4e10 or a share "
                         f"of the GPU's memory like 0.5 or 50%") from None


# -- covering the deficit ------------------------------------------------------------------------------------


def _cover(inst: Instance, budget: float, pick) -> list | None:
    """Offload tensors until no op is over budget: at the worst op, `pick(candidates)`
    names (tensor, option) among the kept tensors away there, given the op's deficit in bytes.
    None if it cannot."""
    choices = [KEEP] * inst.n
    over = inst.curve - budget
    nbytes = inst.nbytes
    starts, ends = (np.array(w, dtype=np.int64).reshape(-1) for w in zip(*inst.windows)) if inst.n else \
        (np.zeros(0, dtype=np.int64),) * 2
    kept = np.ones(inst.n, dtype=bool)
    while len(over) and over.max() > 0:
        worst = int(over.argmax())
        candidates = np.flatnonzero(kept & (starts <= worst) & (worst < ends))
        if not len(candidates):
            return None
        i, option = pick(candidates, over[worst])
        choices[i], kept[i] = option, False
        a, b = inst.windows[i]
        over[a:b] -= nbytes[i]
    return choices


def _prune(inst: Instance, budget: float, choices: list, order) -> list:
    """Keep again, in `order`, each moved tensor the budget does not need."""
    choices = list(choices)
    curve = inst.curve.copy()
    nbytes = inst.nbytes
    for i, c in enumerate(choices):
        if c != KEEP:
            a, b = inst.windows[i]
            curve[a:b] -= nbytes[i]
    for i in order:
        if choices[i] == KEEP:
            continue
        a, b = inst.windows[i]
        if a >= b or (curve[a:b] + nbytes[i]).max() <= budget:
            curve[a:b] += nbytes[i]
            choices[i] = KEEP
    return choices


def _greedy_pick(inst: Instance, useful_only: bool):
    """The cover's choice: among the tensors away at the worst op, the one that frees the
    most bytes (with useful_only, at most the op's deficit: more is wasted there) per
    second it adds. That time is the best option's kernel time plus the larger of its
    own exposed transfer (eq. 1-4) and what it adds to a link busier than the compute
    beside it (the load of what was picked so far). Vectorised over tensors x options."""
    it = inst.iteration
    options = [None, *inst.codecs]
    size = np.array([[c.size[o] for o in options] for c in inst.costs], dtype=np.float64).reshape(inst.n, len(options))
    t_dc = np.array([[c.t_dc[o] for o in options] for c in inst.costs], dtype=np.float64).reshape(inst.n, len(options))
    kernels = t_dc + np.array([[c.host + c.t_c[o] for o in options] for c in inst.costs],
                              dtype=np.float64).reshape(inst.n, len(options))  # (and the host's time per tensor)
    exposed = np.array([[inst.standalone[i][o] for o in options] for i in range(inst.n)],
                       dtype=np.float64).reshape(inst.n, len(options)) - kernels
    d2h, h2d = size / inst.bw_d2h, size / inst.bw_h2d + t_dc
    load = [0.0, 0.0]  # seconds of D2H and H2D link time picked so far

    def pick(candidates, deficit):
        c = np.asarray(candidates)
        over_f, over_b = max(load[0] - it.forward_s, 0.0), max(load[1] - it.backward_s, 0.0)
        crowd = (np.maximum(load[0] + d2h[c] - it.forward_s, 0.0) - over_f +
                 np.maximum(load[1] + h2d[c] - it.backward_s, 0.0) - over_b)
        added = kernels[c] + np.maximum(exposed[c], crowd)
        best_option = added.argmin(axis=1)
        cost = added[np.arange(len(c)), best_option]
        freed = np.minimum(inst.nbytes[c], deficit) if useful_only else inst.nbytes[c]
        k = int(np.argmax(freed / (cost + 1e-9)))
        i, o = int(c[k]), int(best_option[k])
        load[0] += d2h[i, o]
        load[1] += h2d[i, o]
        return i, options[o]

    return pick


def _refine_options(inst: Instance, choices: list, best: float) -> tuple[list, float]:
    """Each moved tensor, largest first, tries its other options on the full timeline."""
    for i in sorted(range(inst.n), key=lambda i: -inst.nbytes[i]):
        if choices[i] == KEEP:
            continue
        for option in [None, *inst.codecs]:
            if option != choices[i]:
                trial = choices[:i] + [option] + choices[i + 1:]
                t = extra_seconds(inst, trial)
                if t < best:
                    choices, best = trial, t
    return choices, best


def _swap_search(inst: Instance, budget: float, choices: list, best: float, deadline: float) -> tuple[list, float]:
    """Local search until no move helps or the deadline: keep one or two moved tensors and
    move one kept tensor instead (any option), or keep one and move two (raw or the
    paper's codec each), when the budget still holds and the step gets faster. Dearest
    moved tensors and largest kept ones are tried first; the first improvement is taken."""
    def better(out: tuple, into: tuple):
        trial = list(choices)
        for i in out:
            trial[i] = KEEP
        for j in into:
            trial[j] = None
        if peak(inst, trial) > budget:  # every option frees the same bytes
            return None
        if len(into) == 1:
            combos = [(o,) for o in [None, *inst.codecs]]
        else:
            combos = [(a, b) for a in {None, inst.paper_choice(into[0])} for b in {None, inst.paper_choice(into[1])}]
        found = None
        for combo in combos:
            for j, option in zip(into, combo):
                trial[j] = option
            t = extra_seconds(inst, trial)
            if t < (found[1] if found else best * (1 - 1e-9)):
                found = (list(trial), t)
        return found

    while time.perf_counter() < deadline:
        moved = sorted((i for i, c in enumerate(choices) if c != KEEP),
                       key=lambda i: -inst.standalone[i][choices[i]])
        kept = sorted((j for j, c in enumerate(choices) if c == KEEP and inst.windows[j][0] < inst.windows[j][1]),
                      key=lambda j: -inst.nbytes[j])
        singles_out, singles_in = [(i,) for i in moved], [(j,) for j in kept]
        pairs_out = [(a, b) for k, a in enumerate(moved) for b in moved[k + 1:]]
        pairs_in = [(a, b) for k, a in enumerate(kept) for b in kept[k + 1:]]
        found = None
        for outs, ins in ((singles_out, singles_in), (pairs_out, singles_in), (singles_out, pairs_in)):
            for out in outs:
                for into in ins:
                    found = better(out, into)
                    if found is not None or time.perf_counter() > deadline:
                        break
                if found is not None or time.perf_counter() > deadline:
                    break
            if found is not None or time.perf_counter() > deadline:
                break
        if found is None:
            break
        choices, best = found
    return choices, best


def _kicked_searches(inst: Instance, budget: float, choices: list, best: float, deadline: float,
                     patience: int = 10, seed: int = 0) -> tuple[list, float]:
    """With time left before the deadline, escape the local search's optimum (iterated local
    search): move one to three kept tensors at random, keep again what the budget then does
    not need (in random order), search from there, and take the result if it is faster;
    until `patience` kicks in a row find nothing faster. Seeded: the same instance gets the
    same kicks."""
    rng = random.Random(seed)
    movable = [j for j in range(inst.n) if inst.windows[j][0] < inst.windows[j][1]]
    fruitless = 0
    while fruitless < patience and time.perf_counter() < deadline:
        kept = [j for j in movable if choices[j] == KEEP]
        if not kept:
            break
        kicked = list(choices)
        into = rng.sample(kept, min(len(kept), rng.randint(1, 3)))
        for j in into:
            kicked[j] = inst.paper_choice(j)
        others = [i for i, c in enumerate(kicked) if c != KEEP and i not in into]
        rng.shuffle(others)
        kicked = _prune(inst, budget, kicked, others + into)
        kicked, t = _refine_options(inst, kicked, extra_seconds(inst, kicked))
        kicked, t = _swap_search(inst, budget, kicked, t, deadline)
        fruitless += 1
        if t < best * (1 - 1e-9):
            choices, best, fruitless = kicked, t, 0
    return choices, best


def plan_budget(inst: Instance, budget: float, search_seconds: float = 0.03) -> Plan:
    """The planner (module docstring). search_seconds bounds the local search."""
    started = time.perf_counter()
    if len(inst.curve) == 0 or inst.curve.max() <= budget:
        return evaluate(inst, [KEEP] * inst.n, budget, started)
    everything = [inst.paper_choice(i) for i in range(inst.n)]
    starts = []
    for useful_only in (True, False):
        choices = _cover(inst, budget, _greedy_pick(inst, useful_only))
        if choices is None:  # nothing can fit: offload all there is
            return evaluate(inst, everything, budget, started)
        dearest = sorted((i for i, c in enumerate(choices) if c != KEEP),
                         key=lambda i: -inst.standalone[i][choices[i]] / max(inst.nbytes[i], 1.0))
        choices = _prune(inst, budget, choices, dearest)
        starts.append((extra_seconds(inst, choices), choices))
    # and the other way round: everything moved, then kept again dearest per byte first
    dearest = sorted(range(inst.n), key=lambda i: -inst.standalone[i][everything[i]] / max(inst.nbytes[i], 1.0))
    choices = _prune(inst, budget, everything, dearest)
    starts.append((extra_seconds(inst, choices), choices))
    best, choices = min(starts, key=lambda pair: pair[0])
    choices, best = _refine_options(inst, choices, best)
    deadline = started + search_seconds
    searched, after = _swap_search(inst, budget, choices, best, deadline)
    if searched is not choices:  # the search moved other tensors: their options again
        choices, best = _refine_options(inst, searched, after)
    choices, best = _kicked_searches(inst, budget, choices, best, deadline)
    if extra_seconds(inst, everything) < best and peak(inst, everything) <= budget:
        choices = everything
    return evaluate(inst, choices, budget, started)


# -- baselines -----------------------------------------------------------------------------------------------


def offload_everything(inst: Instance, budget: float) -> Plan:
    """cswap.patch(model) without a budget: every tensor offloaded, codecs by the paper's rule."""
    started = time.perf_counter()
    return evaluate(inst, [inst.paper_choice(i) for i in range(inst.n)], budget, started)


def largest_first(inst: Instance, budget: float) -> Plan:
    """Offload the largest tensor away at the worst op until the step fits; raw copies."""
    started = time.perf_counter()
    choices = _cover(inst, budget, lambda cands, deficit: (max(cands, key=lambda i: inst.nbytes[i]), None))
    return evaluate(inst, choices if choices is not None else [None] * inst.n, budget, started)


def per_tensor_rule(inst: Instance, budget: float) -> Plan:
    """The paper's rule, per tensor and blind to the shared link: offload the tensor away
    at the worst op whose eq. 1-4 cost per byte is lowest, with the codec the rule picks."""
    started = time.perf_counter()

    def pick(cands, deficit):
        i = min(cands, key=lambda i: (inst.standalone[i][inst.paper_choice(i)] / max(inst.nbytes[i], 1.0),
                                      -inst.nbytes[i]))
        return i, inst.paper_choice(i)

    choices = _cover(inst, budget, pick)
    if choices is None:
        choices = [inst.paper_choice(i) for i in range(inst.n)]
    return evaluate(inst, choices, budget, started)


# -- the exact optimum ---------------------------------------------------------------------------------------


def optimum(inst: Instance, budget: float, time_limit: float = 60.0) -> Plan:
    """The least extra step time within the budget on the same model, as a mixed-integer
    program (scipy.optimize.milp, HiGHS). The timeline's max() terms become lower bounds
    that the minimisation makes tight; keeping a tensor switches its link constraints off
    (big-M). For small instances (tens of tensors)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    started = time.perf_counter()
    n, it = inst.n, inst.iteration
    if n == 0 or inst.curve.max() <= budget:
        return evaluate(inst, [KEEP] * n, budget, started)
    opts = [KEEP, None, *inst.codecs]
    k = len(opts)
    names: dict = {}

    def var(*key):
        return names.setdefault(key, len(names))

    for i in range(n):
        for o in range(k):
            var("x", i, o)
    for i in range(n):
        for v in ("E", "start", "H", "I", "S", "stall", "T"):
            var(v, i)
    var("F")
    var("H", n)  # the H2D link is free from backward's start
    var("S", n)  # no shift before the first restore
    m = len(names)
    x = [[names["x", i, o] for o in range(k)] for i in range(n)]
    d2h = [[inst.costs[i].size[o] / inst.bw_d2h if o != KEEP else 0.0 for o in opts] for i in range(n)]
    h2d = [[inst.costs[i].size[o] / inst.bw_h2d + inst.costs[i].t_dc[o] if o != KEEP else 0.0 for o in opts]
           for i in range(n)]
    t_c = [[inst.costs[i].t_c[o] if o != KEEP else 0.0 for o in opts] for i in range(n)]
    t_dc = [[inst.costs[i].t_dc[o] if o != KEEP else 0.0 for o in opts] for i in range(n)]
    big = it.forward_s + it.backward_s + sum(max(a) + max(b) + max(c) for a, b, c in zip(d2h, h2d, t_c)) + 1.0
    rows, lo, hi = [], [], []

    def row(terms: dict, lower=-np.inf, upper=np.inf):
        r = np.zeros(m)
        for j, v in terms.items():
            r[j] += v
        rows.append(r)
        lo.append(lower)
        hi.append(upper)

    def plus(terms: dict, i, table, sign=1.0):
        for o in range(k):
            terms[x[i][o]] = terms.get(x[i][o], 0.0) + sign * table[i][o]
        return terms

    keep = [x[i][0] for i in range(n)]
    fs, v = it.forward_s, names.__getitem__
    for i, t in enumerate(it.tensors):
        row({x[i][o]: 1.0 for o in range(k)}, 1.0, 1.0)
        # forward: E_i >= E_{i-1} + d2h_i ; E_i >= save_i + t_c,i + d2h_i (unless kept)
        terms = plus({v(("E", i)): 1.0}, i, d2h, -1.0)
        if i:
            terms[v(("E", i - 1))] = -1.0
        row(terms, 0.0)
        terms = plus(plus({v(("E", i)): 1.0, keep[i]: big}, i, d2h, -1.0), i, t_c, -1.0)
        row(terms, t.save_s)
    row({v(("F",)): 1.0, v(("E", n - 1)): -1.0}, -fs)
    row({v(("H", n)): 1.0, v(("F",)): -1.0}, fs, fs)
    row({v(("S", n)): 1.0}, 0.0, 0.0)
    for i in range(n - 1, -1, -1):
        t = it.tensors[i]
        # issue: the use of the nearest later-saved tensor that was offloaded (backward's start if none)
        if i == n - 1:
            row({v(("I", i)): 1.0, v(("F",)): -1.0}, fs)
        else:
            row({v(("I", i)): 1.0, v(("T", i + 1)): -1.0, keep[i + 1]: big}, 0.0)
            row({v(("I", i)): 1.0, v(("I", i + 1)): -1.0, keep[i + 1]: -big}, -big)
        row({v(("start", i)): 1.0, v(("I", i)): -1.0}, 0.0)
        row({v(("start", i)): 1.0, v(("H", i + 1)): -1.0}, 0.0)
        row({v(("start", i)): 1.0, v(("E", i)): -1.0}, 0.0)
        row({v(("H", i)): 1.0, v(("H", i + 1)): -1.0}, 0.0)
        row(plus({v(("H", i)): 1.0, v(("start", i)): -1.0, keep[i]: big}, i, h2d, -1.0), 0.0)
        # stall_i >= start_i + h2d_i - (forward_s + F + use_i + S_{i+1})
        row(plus({v(("stall", i)): 1.0, v(("start", i)): -1.0, v(("F",)): 1.0, v(("S", i + 1)): 1.0,
                  keep[i]: big}, i, h2d, -1.0), -fs - t.use_s)
        row({v(("S", i)): 1.0, v(("S", i + 1)): -1.0, v(("stall", i)): -1.0}, 0.0, 0.0)
        row({v(("T", i)): 1.0, v(("F",)): -1.0, v(("S", i)): -1.0}, fs + t.use_s, fs + t.use_s)
    # memory: at every op over budget, the tensors away there free enough
    over = inst.curve - budget
    seen = set()
    for p in np.flatnonzero(over > 0):
        cover = tuple(i for i, (a, b) in enumerate(inst.windows) if a <= p < b)
        if (cover, over[p]) in seen:
            continue
        seen.add((cover, over[p]))
        row({keep[i]: -inst.nbytes[i] for i in cover}, over[p] - sum(inst.nbytes[i] for i in cover))
    c = np.zeros(m)
    for i in range(n):
        for o in range(k):
            c[x[i][o]] = t_c[i][o] + t_dc[i][o] + (inst.costs[i].host if opts[o] != KEEP else 0.0)
    c[v(("F",))] += 1.0
    c[v(("S", 0))] += 1.0
    integrality = np.zeros(m)
    integrality[[x[i][o] for i in range(n) for o in range(k)]] = 1
    lower = np.zeros(m)
    upper = np.full(m, np.inf)
    upper[[x[i][o] for i in range(n) for o in range(k)]] = 1.0
    res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality,
               bounds=Bounds(lower, upper), options={"time_limit": time_limit})
    if res.x is None:  # infeasible: nothing meets the budget
        return evaluate(inst, [inst.paper_choice(i) for i in range(n)], budget, started)
    choices = [opts[int(np.argmax([res.x[x[i][o]] for o in range(k)]))] for i in range(n)]
    return evaluate(inst, choices, budget, started)
