"""The CSWAP loop for one patched model: profile, decide, report, each epoch.

The first iteration after `patch` is timed (and its tensors' sparsity
sampled) while everything is offloaded uncompressed. From then on, in
"cswap" mode, the advisor's decisions say which tensors to compress and
with which codec; `epoch_end` re-decides from the sparsity sampled during
the epoch, writes the epoch's report and arms sampling for the next epoch.
In the other modes the same report shows what the mode did and what the
advisor would have predicted.
"""

from __future__ import annotations

import os
import sys
import time

from ..report import EpochReport, ReportWriter, TensorRow
from ..runtime.candidates import KEEP, SwapInfo
from ..tune.profile import Profile, load_profile
from .advisor import MODES as ADVISOR_MODES
from .advisor import Advisor, Decision
from .profiler import TensorProfiler
from .runtime_budget import RuntimeBudget

__all__ = ["Controller"]


def _check_options(profile, advisor_mode, report_dir, verbose) -> None:
    """Bad values fail at patch time, naming the option, not epochs later."""
    if profile is not None and not isinstance(profile, (Profile, str, os.PathLike)):
        raise TypeError(f"cswap.patch: profile must be a cswap.Profile, a path to a profile JSON file, or None "
                        f"(this device's tuned profile), got {type(profile).__name__}")
    if advisor_mode not in ADVISOR_MODES:
        raise ValueError(f"cswap.patch: advisor must be one of {ADVISOR_MODES}, got {advisor_mode!r}")
    if report_dir is not None and not isinstance(report_dir, (str, os.PathLike)):
        raise TypeError(f"cswap.patch: report_dir must be a folder path or None, got {type(report_dir).__name__}")
    if not isinstance(verbose, bool):
        raise TypeError(f"cswap.patch: verbose must be True or False, got {verbose!r}")


class Controller:
    def __init__(self, mode: str, profile=None, user_policy=None, advisor_mode: str = "independent",
                 report_dir=None, verbose: bool = True, budget=None):
        _check_options(profile, advisor_mode, report_dir, verbose)
        # With a budget the planner chooses keep, raw or a codec per tensor (cswap.plan.runtime_budget).
        self.budget = RuntimeBudget(budget) if budget is not None else None
        self.mode = mode
        self._profile_source = profile
        self._profile = None
        self._advisor_mode = advisor_mode
        self._advisor = None
        self.user_policy = user_policy
        self.chosen: dict[str, str | None] = {}   # what a user policy chose, per tensor key
        self.profiler = TensorProfiler()
        self.profiler.on_iteration = self._iteration_profiled
        self.profiler.record_memory = self.budget is not None and not self.budget.waiting_for_oom
        self.decisions: dict[str, Decision] = {}
        self.epoch = 0
        self.writer = ReportWriter(report_dir) if report_dir is not None else None
        self.verbose = verbose
        self._decided_from = None
        # Called with the (codec, itemsize) pairs the decisions use, to build their
        # kernels before the next step needs them (patch wires Swapper.warm_up).
        self.warm_up = None
        self.blocks = None  # cswap.runtime.checkpointing.CheckpointedBlocks, with patch(recompute=...)

    @property
    def profile(self):
        """The device profile, loaded on first use (the shipped default warns once)."""
        if self._profile is None:
            source = self._profile_source
            self._profile = source if isinstance(source, Profile) else load_profile(source)
        return self._profile

    @property
    def advisor(self) -> Advisor:
        if self._advisor is None:
            self._advisor = Advisor(self.profile, mode=self._advisor_mode)
        return self._advisor

    def codec_configs(self) -> dict:
        """The profile's tuned launch settings per codec (the shipped default has none for this GPU)."""
        if self.profile.is_default:
            return {}
        return {name: self.profile.config(name) for name in self.profile.codecs}

    # -- the policy the swapper asks in "cswap" mode -------------------------------------------

    def policy(self, info: SwapInfo) -> str | None:
        """The user's policy, else the budget plan's choice (KEEP, None or a codec), else
        the advisor's codec for this tensor (None, i.e. uncompressed, until the first
        iteration has been profiled). Asked in every save: it only looks up what decide()
        chose when the profiled iteration completed (at the next forward's start)."""
        if self.budget is not None and self.budget.waiting_for_oom:
            return KEEP  # passive mode: as unpatched until a forward runs out of memory
        if self.user_policy is not None:
            codec = self.chosen[info.key] = self.user_policy(info)
            return codec
        if self.budget is not None:
            return self.budget.choice(info.key)
        decision = self.decisions.get(info.key)
        return decision.codec if decision is not None else None

    def out_of_memory(self, message: str) -> None:
        """Passive mode: a forward ran out of device memory. Its retry offloads every
        saved activation raw and is the profiled step the budget is planned from."""
        self.budget.waiting_for_oom = False
        self.budget.oom_message = message.splitlines()[0][:200] if message else "torch.OutOfMemoryError"
        self.profiler.record_memory = True
        self.profiler.arm_timing()
        self.profiler.arm_sampling()

    def _iteration_profiled(self) -> None:
        """A timed iteration completed, at a step boundary: plan and build kernels now rather
        than inside the next save, if the swapper asks this controller's policy."""
        asked = self.mode == "cswap" and self.user_policy is None
        if asked and not (self.budget is not None and self.budget.waiting_for_oom):
            self.decide()

    def decide(self) -> dict[str, Decision]:
        iteration = self.profiler.latest()
        if iteration is not None and self.mode != "none":
            self.decisions = self.advisor.decide(iteration)
            self._decided_from = self.profiler.iteration
            if self.budget is not None:
                blocks = self.blocks.seconds() if self.blocks is not None else None
                self.budget.replan(iteration, self.profiler.memory, self.profile, self.profiler.device,
                                   blocks=blocks, infos=self.profiler.infos)
            if self.warm_up is not None:
                self.warm_up({(codec, t.itemsize) for t in iteration.tensors
                              if (codec := self._decision(t.key)) not in (None, KEEP)})
        return self.decisions

    # -- epochs ---------------------------------------------------------------------------------

    def epoch_end(self, metrics: dict | None = None, stream=None) -> EpochReport:
        start = time.perf_counter()
        decided = self._decided_from
        self.profiler.finish()  # (which decides, if it completes a timed iteration)
        decisions = self.decisions if self._decided_from is not decided else self.decide()
        rows = self._rows(decisions)
        self.profiler.overhead_s += time.perf_counter() - start
        all_metrics = dict(metrics or {})
        all_metrics["profiling_overhead_s"] = self.profiler.overhead_s
        iteration = self.profiler.latest()
        if iteration is not None:  # measured on this device: what cswap-plan --times reads
            all_metrics["forward_s"], all_metrics["backward_s"] = iteration.forward_s, iteration.backward_s
        if self.budget is not None:
            all_metrics.update(self.budget.metrics())
        report = EpochReport(epoch=self.epoch, rows=rows, metrics=all_metrics)
        if self.writer is not None:
            self.writer.write(report)
        if self.verbose:
            print(report.table(), file=stream or sys.stdout, flush=True)
        self.epoch += 1
        self.profiler.overhead_s = 0.0
        self.profiler.arm_sampling()
        return report

    def _decision(self, key: str) -> str | None:
        """The codec this mode uses for the tensor from now on."""
        if self.mode == "sc":
            return "zvc"
        if self.mode != "cswap":
            return None
        if self.user_policy is not None:
            return self.chosen.get(key)
        if self.budget is not None:
            return self.budget.choice(key)
        d = self.decisions.get(key)
        return d.codec if d is not None else None

    def _rows(self, decisions: dict[str, Decision]) -> list[TensorRow]:
        iteration = self.profiler.latest()
        rows = []
        if iteration is not None:
            for t in iteration.tensors:
                info = self.profiler.infos.get(t.key)
                d = decisions.get(t.key)
                codec = self._decision(t.key)
                t_best = None
                if d is not None and codec != KEEP:
                    t_best = d.t_codec.get(codec, d.t_prime) if codec else d.t_prime
                rows.append(TensorRow(
                    epoch=self.epoch, key=t.key, layer=t.layer, layer_type=t.layer_type, op=t.op,
                    shape=tuple(t.shape), nbytes=t.nbytes, sparsity=t.sparsity, decision=codec,
                    t_prime_s=d.t_prime if d is not None else None, t_best_s=t_best,
                    compressed_bytes=(d.sizes.get(codec) if d is not None and codec not in (None, KEEP) else None),
                    saved_in=info.saved_in if info is not None else ""))
            return rows
        for key, (sparsity, _) in self.profiler.sparsity.items():  # sampled but never timed (no backward)
            info = self.profiler.infos[key]
            rows.append(TensorRow(epoch=self.epoch, key=key, layer=info.layer, layer_type=info.layer_type,
                                  op=info.op, shape=tuple(info.shape), nbytes=info.nbytes, sparsity=sparsity,
                                  decision=None, t_prime_s=None, t_best_s=None, compressed_bytes=None,
                                  saved_in=info.saved_in))
        return rows
