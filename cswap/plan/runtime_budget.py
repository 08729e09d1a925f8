"""`cswap.patch(model, budget=...)`: the budget planner on what the runtime measured.

The first step after patch offloads every saved activation raw and is timed
(cswap.plan.profiler), with the device's memory read at each save and use
(a MemoryTrace). From that step the planner (cswap.plan.budget) chooses per
tensor keep, raw or a codec; each epoch end plans again with the new
sparsity. The planner's unit is a storage: saved tensors that view one
(q, k and v of one projection, a LayerNorm output and Linear's 2-D view of
it) leave together or stay together, since a kept view keeps the storage.
The budget is in the bytes PyTorch allocates on the device
(torch.cuda.memory_allocated), compared at each save and use: a temporary
that lives and dies between two of them is not seen, so leave headroom.

budget="auto" (Capuchin's passive mode): nothing leaves until a forward runs
out of device memory; cswap.patch then retries that step with every saved
activation offloaded (the oldest leave first), which is also the profiled
step, and plans for AUTO_HEADROOM of what the device can hold.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

from .advisor import IterationProfile
from .budget import KEEP, Instance, Plan, fraction, offload_everything, parse_bytes, plan_budget, \
    with_encoder_scratch
from .recompute import RECOMPUTE, Block, inside, plan_with_recompute

__all__ = ["AUTO", "AUTO_HEADROOM", "RuntimeBudget", "check_budget"]

AUTO = "auto"
AUTO_HEADROOM = 0.9  # of what the device can hold: fragmentation and the temporaries between ticks


def size_text(nbytes: float) -> str:
    """`nbytes` in GiB, MiB or KiB, for messages."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def check_budget(budget) -> None:
    """Bad budgets fail at patch time, saying what is accepted."""
    if budget is None or budget == AUTO:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise TypeError(f"cswap.patch: budget must be bytes (an int), a size like '20GiB', a fraction of the "
                        f"device's memory like 0.8 or '80%', or 'auto'; got {type(budget).__name__}")
    try:
        value = parse_bytes(budget, capacity=1 << 60)
    except ValueError:
        raise ValueError(f"cswap.patch: budget={budget!r} is not a size; write e.g. 20GiB, 20e9, a fraction of "
                         f"the device's memory like 0.8 or 80%, or 'auto'") from None
    if value <= 0:
        raise ValueError(f"cswap.patch: budget must be positive, got {budget!r}")


def _storages(iteration: IterationProfile, memory) -> tuple[IterationProfile, list, list[list[str]]]:
    """The planning units: one per storage of the profiled tensors (the first view's
    profile, sized to the storage), their windows, and each unit's keys."""
    profiles = {t.key: t for t in iteration.tensors}
    units, windows, members = [], [], []
    for keys, nbytes, window in zip(memory.groups, memory.group_bytes, memory.group_windows):
        keys = [k for k in keys if k in profiles]
        if not keys:
            continue
        first = profiles[keys[0]]
        units.append(replace(first, shape=(max(nbytes // first.itemsize, 1),)))
        windows.append(window)
        members.append(keys)
    order = sorted(range(len(units)), key=lambda i: units[i].save_s)
    return (IterationProfile(iteration.forward_s, iteration.backward_s, tuple(units[i] for i in order)),
            [windows[i] for i in order], [members[i] for i in order])


def _blocks(seconds: dict[str, float], members: list[list[str]], infos: dict) -> list[Block]:
    """Each block's planning units: those whose every tensor it made and saved (its inputs,
    saved at its boundary, are not: checkpointing still saves them)."""
    def within(key: str, name: str) -> bool:
        info = infos.get(key)
        return info is not None and inside(info.layer, name) and inside(info.saved_in, name)

    return [Block(name, tuple(i for i, keys in enumerate(members) if all(within(k, name) for k in keys)), s)
            for name, s in seconds.items()]


RETAINED_REFUSED = (
    "cswap: budget= does not support a backward that keeps its graph (retain_graph=True, or create_graph=True as a "
    "gradient penalty's autograd.grad does): its plan counts on backward freeing each saved activation as it goes, "
    "and a kept graph holds them until it is gone. Run backward without retain_graph, or patch without budget= "
    "(cswap.patch(model) offloads every ReLU and pooling output; mode='vdnn', candidates='all' every saved activation)")


class RuntimeBudget:
    """The plan of one patched model: per tensor key, KEEP, None (raw) or a codec."""

    def __init__(self, spec):
        check_budget(spec)
        self.spec = spec
        self.waiting_for_oom = spec == AUTO  # passive mode, until a forward runs out of memory
        self.oom_message = ""
        self.bytes: int | None = None
        self.choices: dict[str, object] = {}
        self.plan: Plan | None = None
        self.everything: Plan | None = None  # offloading every tensor, as patch(model) without a budget
        self.instance: Instance | None = None
        self.recomputed: frozenset[str] = frozenset()  # blocks the plan checkpoints (patch(recompute=...))
        self.compute_s = 0.0
        self.rise = None      # per tick of the profiled step: how far it rose above it (MemoryTrace.rise)
        self.unplanned: str | None = None  # why the steps are not what the plan describes (then all moves)
        self.graph_retained = False        # a backward kept its graph (budget="auto" refuses it at its OOM)
        self._members: list[list[str]] = []
        self._said: set[str] = set()

    def limit(self, tick: int) -> int | None:
        """The bytes the runtime keeps the device within at the pass's `tick`-th save or use,
        once there is a plan that moves something: the budget less how far the profiled step
        rose above that tick before the next (the model's temporaries, which no wait at a
        tick can make room for later), the largest such rise past the profiled ticks."""
        if self.plan is None or not self.plan.moved:
            return None
        rise = self.rise
        if rise is None or not len(rise):
            return self.bytes
        return self.bytes - int(rise[tick] if tick < len(rise) else rise.max())

    def choice(self, key: str):
        """What to do with this tensor: raw until there is a plan (the profiled step), and for
        a tensor the profiled step did not see."""
        return self.choices.get(key)

    def resolve(self, device) -> int:
        """The budget in bytes on `device` (a cswap.runtime.device.Device)."""
        if self.spec == AUTO:
            usable = device.usable_memory()
            if usable is None:
                raise ValueError("cswap: budget='auto' found no device memory limit (the emulated device has "
                                 "no capacity_bytes); give the budget in bytes")
            return int(AUTO_HEADROOM * usable)
        share = fraction(self.spec) if not isinstance(self.spec, int) else None  # (an int is bytes)
        if share is not None:
            total = device.total_memory()
            if total is None:
                raise ValueError(f"cswap: budget={self.spec!r} is a fraction of the device's memory, but this "
                                 f"device has no limit (the emulated device without capacity_bytes); give bytes")
            return int(share * total)
        return parse_bytes(self.spec)

    def replan(self, iteration, memory, profile, device, blocks: dict | None = None, infos: dict | None = None
               ) -> dict:
        """Plan from the profiled step (`iteration`, its MemoryTrace `memory`) and the
        profile's link and codec figures; returns the new choices. blocks: the blocks the
        plan may recompute, name -> forward seconds in that step, with `infos` (key ->
        SwapInfo) telling which tensors each makes and saves inside it."""
        if memory is None or not iteration.tensors:
            return self.choices
        self.bytes = self.resolve(device)
        self.rise = memory.rise
        units, windows, members = _storages(iteration, memory)
        self.instance = inst = Instance.build(units, profile, memory.curve, windows)
        if blocks:  # (each with room for its encoders' temporaries, which the memory trace did not see)
            block_list = _blocks(blocks, members, infos or {})
            self.plan = with_encoder_scratch(inst, self.bytes, lambda i, b: plan_with_recompute(i, block_list, b))
            self.recomputed = frozenset(self.plan.recomputed)
        else:
            self.plan = with_encoder_scratch(inst, self.bytes, plan_budget)
        self.everything = offload_everything(inst, self.bytes)
        self.compute_s = iteration.forward_s + iteration.backward_s
        self._members = members
        if self.unplanned is not None:
            self._move_everything()
        else:
            self._choose()
        self._tell()
        return self.choices

    def _choose(self) -> None:
        # a recomputed tensor is never seen while its block is checkpointed: raw, should it be
        self.choices = {key: None if c == RECOMPUTE else c for keys, c in zip(self._members, self.plan.choices)
                        for key in keys}

    def step_unplanned(self, kind: str) -> None:
        """The swapper saw a step the plan does not describe (its step is one forward whose
        backward frees its saved activations as it goes). "two forwards": from now on every
        saved activation leaves the device, which no tensor kept past its planned end can
        break. "retained graph": refused (raises), except while budget="auto" waits for an
        out-of-memory error and nothing is planned (refused then, should one come)."""
        if kind == "retained graph":
            self.graph_retained = True
            if not self.waiting_for_oom:
                raise RuntimeError(RETAINED_REFUSED)
            return
        if self.unplanned is not None:
            return
        self.unplanned = ("a forward started before the backward of the one before it (as a model called twice a "
                          "step), so two forwards' saved activations were on the device at once")
        if self.plan is not None:
            self._move_everything()
            self._tell()

    def _move_everything(self) -> None:
        self.plan, self.recomputed = self.everything, frozenset()
        self._choose()

    def _tell(self) -> None:
        """Say once what the plan means: fits without offloading, fits by offloading, or cannot fit."""
        plan, budget = self.plan, self.bytes
        peak = f"predicted peak {size_text(plan.peak_bytes)} of a {size_text(budget)} budget"
        if self.unplanned is not None:
            self._once("unplanned", f"cswap: budget= plans each step as one forward whose backward frees its saved "
                                    f"activations as it goes, but {self.unplanned}. A tensor the plan kept on the "
                                    f"device would stay past where the plan counted it gone, so every saved "
                                    f"activation now leaves the device, as patch(model) without a budget does "
                                    f"({peak}). For a plan that keeps what fits, run each forward's backward "
                                    f"before the next forward, without retain_graph", RuntimeWarning)
        if plan.moved == 0 and plan.fits:
            self._once("fits", f"cswap: the step fits in the budget ({peak}): nothing is offloaded", None)
        elif not plan.fits:
            self._once("over", f"cswap: the step does not fit in the budget even with every saved activation "
                               f"offloaded ({peak}); offloading all of them. Lower the batch size or raise the "
                               f"budget", RuntimeWarning)
        if self.spec == AUTO:
            self._once("auto", f"cswap: budget='auto' chose {size_text(budget)} ({AUTO_HEADROOM:.0%} of what "
                               f"the device can hold) after a forward ran out of device memory "
                               f"({self.oom_message}); {plan.moved} of {len(plan.choices)} saved activations now "
                               f"leave the device ({peak}). Pass budget= to choose it yourself", RuntimeWarning)

    def _once(self, key: str, message: str, category) -> None:
        if key in self._said:
            return
        self._said.add(key)
        if category is None:
            print(message, flush=True)
        else:
            warnings.warn(message, category, stacklevel=2)

    def metrics(self) -> dict:
        """What the epoch report shows: the budget, the predicted peaks, and the predicted
        step time of the plan against offloading everything and offloading nothing."""
        if self.plan is None:
            return {"budget": "auto: waiting for an out-of-memory" if self.waiting_for_oom else "not planned yet"}
        inst = self.instance
        return {
            "budget_bytes": self.bytes,
            "predicted_peak_bytes": int(self.plan.peak_bytes),
            "predicted_peak_no_offload_bytes": int(inst.curve.max()) if len(inst.curve) else 0,
            "predicted_peak_offload_all_bytes": int(self.everything.peak_bytes),
            "predicted_step_s": self.compute_s + self.plan.extra_seconds,
            "predicted_step_no_offload_s": self.compute_s,
            "predicted_step_offload_all_s": self.compute_s + self.everything.extra_seconds,
            "plan": f"{sum(c == KEEP for c in self.plan.choices)} keep, "
                    f"{sum(c is None for c in self.plan.choices)} raw, "
                    f"{sum(c not in (KEEP, None, RECOMPUTE) for c in self.plan.choices)} compressed"
                    + (f", {len(self.recomputed)} blocks recomputed ({', '.join(sorted(self.recomputed))})"
                       if self.recomputed else ""),
            "planning_ms": 1e3 * self.plan.planning_seconds,
        }
