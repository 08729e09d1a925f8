"""The fourth choice beside keep, raw and codec: recompute a block (issue 25).

Activation checkpointing a block (a transformer layer, a residual block) drops
every activation saved inside it after its forward and runs its forward again
just before its backward: the memory of offloading those tensors, for the
block's forward time instead of link time. Capuchin and TENSILE choose swap or
recompute per tensor; here recompute is per block (what
torch.utils.checkpoint runs) and the rest is the budget planner's.

    blocks = [Block("layers.0", members=(3, 4, 5), seconds=2e-3), ...]
    plan = plan_with_recompute(inst, blocks, budget)     # RecomputePlan: blocks + per-tensor choices
    exact = optimum_with_recompute(inst, blocks, budget) # the same model, solved exactly (MILP)

The model (cswap.plan.budget's, extended): a recomputed block's members are
away over their windows like offloaded tensors (they come back at the block's
backward, as a restore would) and take no link time; the step pays the
block's forward seconds once. What the block saves at its boundary (its
input) is not a member: it stays a tensor the planner may keep, move or
compress. Recompute's extra backward time is not given back to the link as
slack for later restores (conservative).

The planner: which blocks to recompute is searched over a ranking of the
blocks (bytes freed per second of recompute: its prefixes, then a toggle of
each block; a step that does not fit counts as slower than any that does),
each candidate set's remaining tensors planned by the budget planner's greedy
stage, then refined by toggling blocks with the whole budget planner
(cswap.plan.budget.plan_budget) while that helps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .budget import KEEP, Instance, Plan, _cover, _greedy_pick, _prune, evaluate, offload_everything, optimum, \
    plan_budget

__all__ = ["RECOMPUTE", "Block", "RecomputePlan", "checkpoint_everything", "inside", "optimum_with_recompute",
           "plan_with_recompute", "repeated_blocks", "resolve"]

RECOMPUTE = "recompute"  # a choice beside KEEP, None (raw) and a codec


@dataclass(frozen=True)
class Block:
    """A module the user lets cswap checkpoint: the instance's tensors saved inside it and
    the seconds its forward takes (what recomputing it costs)."""

    name: str
    members: tuple[int, ...]
    seconds: float


@dataclass
class RecomputePlan:
    choices: list                 # per tensor: KEEP, None (raw), a codec or RECOMPUTE
    recomputed: tuple[str, ...]   # the blocks checkpointed
    extra_seconds: float          # transfers and kernels (the budget planner's) + recompute
    peak_bytes: float
    fits: bool
    planning_seconds: float = 0.0
    rest: Plan | None = field(default=None, repr=False)  # the budget planner's plan of the other tensors

    @property
    def moved(self) -> int:
        return sum(1 for c in self.choices if c not in (KEEP, RECOMPUTE))


def repeated_blocks(model) -> list[str]:
    """The default granularity: modules that are items of a ModuleList or Sequential holding
    two or more modules of their class (transformer layers, ResNet blocks), outermost first."""
    from torch import nn

    names = []
    for prefix, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            kinds = [type(m) for m in module.children()]
            for name, child in module.named_children():
                if kinds.count(type(child)) >= 2 and len(list(child.children())) > 0:
                    full = f"{prefix}.{name}" if prefix else name
                    if not any(full.startswith(f"{outer}.") for outer in names):
                        names.append(full)
    return names


def inside(module: str, block: str) -> bool:
    """`module` (a qualified name) is `block` or one of its submodules."""
    return module == block or module.startswith(f"{block}.")


def resolve(model, recompute) -> list[str]:
    """The block names `recompute` allows: None or "auto" the repeated blocks, a list of
    module names, or a predicate (name, module) -> bool over model.named_modules()."""
    if recompute is None or recompute == "auto":
        return repeated_blocks(model)
    if callable(recompute):
        return [name for name, module in model.named_modules() if name and recompute(name, module)]
    names = [recompute] if isinstance(recompute, str) else list(recompute)
    known = dict(model.named_modules())
    missing = [n for n in names if n not in known]
    if missing:
        raise ValueError(f"cswap: recompute names {missing[0]!r}, which is not a module of this model; give "
                         f"names from model.named_modules(), a predicate (name, module) -> bool, or 'auto'")
    return names


def _rest(inst: Instance, recomputed: list[Block]) -> tuple[Instance, list[int]]:
    """The instance without the recomputed blocks' members, whose bytes are away over their windows."""
    gone = {i for b in recomputed for i in b.members}
    keep = [i for i in range(inst.n) if i not in gone]
    curve = inst.curve.copy()
    for i in gone:
        a, b = inst.windows[i]
        curve[a:b] -= inst.nbytes[i]
    return inst.subset(keep, curve), keep


def _combine(inst: Instance, recomputed: list[Block], rest: Plan, kept: list[int], started: float) -> RecomputePlan:
    choices = [RECOMPUTE] * inst.n
    for j, i in enumerate(kept):
        choices[i] = rest.choices[j]
    extra = rest.extra_seconds + sum(b.seconds for b in recomputed)
    return RecomputePlan(choices, tuple(b.name for b in recomputed), extra, rest.peak_bytes, rest.fits,
                         time.perf_counter() - started, rest)


def _with(inst: Instance, recomputed: list[Block], budget: float, planner, started: float) -> RecomputePlan:
    sub, kept = _rest(inst, recomputed)
    rest = planner(sub, budget) if sub.n else evaluate(sub, [], budget)  # every tensor recomputed
    return _combine(inst, recomputed, rest, kept, started)


def _quick(inst: Instance, budget: float) -> Plan:
    """The budget planner's first stage alone (its greedy cover, then what need not move kept
    again): what a candidate set of blocks is ranked by."""
    started = time.perf_counter()
    if len(inst.curve) == 0 or inst.curve.max() <= budget:
        return evaluate(inst, [KEEP] * inst.n, budget, started)
    choices = _cover(inst, budget, _greedy_pick(inst, True))
    if choices is None:
        return evaluate(inst, [inst.paper_choice(i) for i in range(inst.n)], budget, started)
    dearest = sorted((i for i, c in enumerate(choices) if c != KEEP),
                     key=lambda i: -inst.standalone[i][choices[i]] / max(inst.nbytes[i], 1.0))
    return evaluate(inst, _prune(inst, budget, choices, dearest), budget, started)


def _better(a: RecomputePlan, b: RecomputePlan | None) -> bool:
    """a beats b: it fits where b does not, or is faster at the same fit."""
    if b is None:
        return True
    if a.fits != b.fits:
        return a.fits
    return a.extra_seconds < b.extra_seconds * (1 - 1e-12) if a.fits else a.peak_bytes < b.peak_bytes


def plan_with_recompute(inst: Instance, blocks: list[Block], budget: float, search_seconds: float = 1.0
                        ) -> RecomputePlan:
    """The planner (module docstring): blocks ranked by the bytes their members hold per
    second of recompute; the best prefix of that ranking (none, the first, the first two,
    ... all), then each block toggled once where that helps, the other tensors planned by
    the budget planner's first stage; then, by the whole budget planner, blocks toggled
    while that helps (for at most search_seconds)."""
    started = time.perf_counter()
    useful = sorted((b for b in blocks if b.members),
                    key=lambda b: -sum(inst.nbytes[i] for i in b.members) / max(b.seconds, 1e-12))

    def planned(chosen: list[Block]) -> RecomputePlan:
        return _with(inst, chosen, budget, _quick, started)

    prefixes = [(useful[:k], planned(useful[:k])) for k in range(len(useful) + 1)]
    chosen, current = prefixes[0]
    for trial, plan in prefixes[1:]:
        if _better(plan, current):
            chosen, current = trial, plan
    for block in useful:
        trial = [c for c in chosen if c is not block] if block in chosen else chosen + [block]
        plan = planned(trial)
        if _better(plan, current):
            chosen, current = trial, plan
    # The chosen set and its neighbours (a block toggled) by the full budget planner, while one helps
    final = _with(inst, chosen, budget, plan_budget, started)
    deadline = started + search_seconds
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for block in useful:
            trial = [c for c in chosen if c is not block] if block in chosen else chosen + [block]
            plan = _with(inst, trial, budget, plan_budget, started)
            if _better(plan, final):
                chosen, final, improved = trial, plan, True
            if time.perf_counter() > deadline:
                break
    if chosen:  # never worse than the budget planner alone
        alone = _with(inst, [], budget, plan_budget, started)
        final = alone if _better(alone, final) else final
    final.planning_seconds = time.perf_counter() - started
    return final


def checkpoint_everything(inst: Instance, blocks: list[Block], budget: float) -> RecomputePlan:
    """What Unsloth's and torchtune's users run: every block checkpointed, every other saved
    activation offloaded (codecs by the paper's rule), whatever the budget."""
    started = time.perf_counter()
    return _with(inst, [b for b in blocks if b.members], budget, offload_everything, started)


def optimum_with_recompute(inst: Instance, blocks: list[Block], budget: float, time_limit: float = 60.0
                           ) -> RecomputePlan:
    """The least extra step time within the budget with recompute as a fourth choice, exact
    on the same model: the budget's MILP (cswap.plan.budget.optimum) for each set of
    recomputed blocks, over every set (for instances with a handful of blocks)."""
    started = time.perf_counter()
    useful = [b for b in blocks if b.members]
    if len(useful) > 8:
        raise ValueError(f"cswap.plan.recompute: the exact optimum enumerates block sets; {len(useful)} blocks "
                         f"make {2 ** len(useful)} MILPs (at most 8 blocks)")
    best = None
    for mask in range(1 << len(useful)):
        chosen = [b for k, b in enumerate(useful) if mask >> k & 1]
        plan = _with(inst, chosen, budget, lambda sub, bud: optimum(sub, bud, time_limit), started)
        if _better(plan, best):
            best = plan
    best.planning_seconds = time.perf_counter() - started
    return best
