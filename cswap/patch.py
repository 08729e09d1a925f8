"""The user-facing runtime API: patch, unpatch, offload, stats, epoch_end, check_decisions."""

from __future__ import annotations

import functools
import gc
import inspect
import warnings
import weakref
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch
from torch import nn

from .plan.controller import Controller
from .plan.inputs import Inputs
from .plan.recompute import resolve as resolve_blocks
from .plan.runtime_budget import AUTO, RETAINED_REFUSED, size_text
from .runtime.checkpointing import CheckpointedBlocks
from .runtime.device import device_of
from .runtime.hook_context import why_not_ours
from .runtime.layers import LayerTracker
from .runtime.module_hooks import Hook, unwrap_forward, wrap_forward
from .runtime.stats import SwapStats
from .runtime.step_state import StepState
from .runtime.swapper import Swapper, check_policy

if TYPE_CHECKING:
    from .report import EpochReport

__all__ = ["patch", "unpatch", "offload", "stats", "epoch_end", "epoch_end_hook", "check_decisions"]

# The Swapper options patch() passes through (mode and policy it takes itself; layer
# and observer it sets).
SWAPPER_OPTIONS = tuple(name for name in inspect.signature(Swapper.__init__).parameters
                        if name not in ("self", "mode", "policy", "layer", "observer"))

_PATCHED: "weakref.WeakKeyDictionary[nn.Module, _Patch]" = weakref.WeakKeyDictionary()


class _Patch:
    """The hooks cswap put on one model, and its swapper."""

    def __init__(self, model: nn.Module, swapper: Swapper, tracker: LayerTracker, controller: Controller):
        self.swapper = swapper
        self.controller = controller
        self.tracker = tracker
        self.depth = 0
        self.hooks_ctx = None
        self.traced = False          # a forward of this model was traced by torch.compile
        self.warned_traced = False
        self.told: set[str] = set()  # why forwards' saves were left alone, each said once
        self.checked_compiled = False  # the first pass was checked for compiled graphs cswap cannot read
        self.kept_before = 0         # stats["kept_on_gpu"] at the last epoch end
        self.blocks = None           # recompute=: the blocks the plan may checkpoint
        self.handles = [
            model.register_forward_pre_hook(Hook(self._enter), prepend=True),
            model.register_forward_hook(Hook(self._exit), always_call=True),
        ]

    def _enter(self, module, args):
        self.depth += 1
        if torch.compiler.is_compiling():
            # These hooks are being traced into a compiled graph, where PyTorch
            # applies no saved-tensor hooks. Leave the traced forward untouched
            # and only note it (a plain attribute store: no graph break, so
            # fullgraph=True works); the next eager cswap call warns.
            self.traced = True
            return
        if self.depth == 1 and torch.is_grad_enabled():
            why = why_not_ours("this patched model ran")
            if why is not None:  # (its saves are left to autograd, or to whoever decides here)
                if why and why not in self.told:
                    self.told.add(why)
                    warnings.warn(why, RuntimeWarning, stacklevel=2)
                return
            # One forward pass of the root: saved tensors go through the swapper
            # (nested calls of the root, e.g. recursion, stay in the same pass).
            self.tracker.reset()
            self.swapper.begin_pass()
            self.hooks_ctx = _hooks(self.swapper)
            self.hooks_ctx.__enter__()

    def _exit(self, module, args, output):
        self.depth -= 1
        if self.depth == 0 and self.hooks_ctx is not None:
            ctx, self.hooks_ctx = self.hooks_ctx, None
            ctx.__exit__(None, None, None)
            self.swapper.end_pass()
            self.tracker.end_pass()
            if not self.checked_compiled:
                self.checked_compiled = True
                self._check_compiled_graphs_recognised(output)

    def _check_compiled_graphs_recognised(self, output) -> None:
        """After the first pass: compiled graphs ran in it (their backward nodes are in
        the autograd graph) but none of their saves was recognised as theirs, so this
        torch calls the pack hook in a way cswap does not know: say so, once."""
        if self.swapper.compiled_saves == 0 and _runs_compiled_graph(output):
            warnings.warn(f"cswap: this model runs torch.compile'd graphs, but cswap did not recognise the tensors "
                          f"they save on torch {torch.__version__} (it reads a private part of AOTAutograd, known "
                          f"for torch 2.11-2.15); their activations stay on the GPU. Please report it with the "
                          f"output of `python -m cswap.env`", RuntimeWarning, stacklevel=2)

    def warn_if_traced(self) -> None:
        """Once: a forward of this model ran as a compiled graph with these hooks
        traced into it, so nothing it saved was offloaded."""
        if self.traced and not self.warned_traced:
            self.warned_traced = True
            warnings.warn(_traced_advice("ran under torch.compile"), RuntimeWarning, stacklevel=3)

    def retry_on_oom(self, model: nn.Module) -> None:
        """budget="auto": wrap the model's forward so that a forward that runs out of
        device memory is retried once with every saved activation offloaded."""
        forward = model.forward
        state = StepState(model)

        @functools.wraps(forward)
        def retrying(*args, **kwargs):
            if not (self.controller.budget.waiting_for_oom and self.depth == 1 and self.hooks_ctx is not None):
                return forward(*args, **kwargs)
            state.take(args, kwargs)  # (the retry draws the same dropout masks)
            try:
                return forward(*args, **kwargs)
            except torch.OutOfMemoryError as exc:
                if self.controller.budget.graph_retained:  # (a plan would not hold: refused, now it would move)
                    raise RuntimeError(RETAINED_REFUSED) from exc
                message = str(exc)  # leaving the handler frees the failed attempt's tensors
            self._restart_pass(message)
            state.restore()
            held, kept = _held_before(model, args, kwargs), self.swapper.stats["kept_on_gpu"]
            try:
                return forward(*args, **kwargs)
            except torch.OutOfMemoryError as exc:
                raise self._retry_failed(exc, held, kept) from exc

        wrap_forward(model, retrying)  # (the model's attribute: the patch keeps no reference to the model, or
        # _PATCHED's key would never die)

    def _retry_failed(self, exc: torch.OutOfMemoryError, held: str, kept: int) -> torch.OutOfMemoryError:
        """The error for a retried forward that ran out of memory too: what kept its saved
        tensors on the device (host memory at its limit), if anything did, else what the
        device held before it. `kept`: the count of kept tensors before the retry."""
        at_limit = self.swapper.stats["kept_on_gpu"] - kept
        retried = "the forward ran out of device memory, and again when retried to offload every saved activation " \
                  "(budget='auto')"
        if at_limit:
            return torch.OutOfMemoryError(
                f"cswap: {retried}, with {at_limit} of them kept on the device because host memory reached its "
                f"limit (max_host_bytes={self.swapper.pool.max_bytes}). Raise max_host_bytes, or lower the batch "
                f"size. ({exc})")
        return torch.OutOfMemoryError(
            f"cswap: the forward ran out of device memory, and again with every saved activation offloaded "
            f"(budget='auto'). Before this forward the device held {held}: parameters, gradients, optimizer "
            f"state, the inputs, and the saved activations of any earlier forward of this step whose backward "
            f"has not run yet. With this forward's largest layer, that does not fit. Lower the batch size, or run "
            f"each forward's backward before the next. ({exc})")

    def _restart_pass(self, message: str) -> None:
        """Drop the failed forward's pass and start the retry's, now profiled."""
        self.hooks_ctx.__exit__(None, None, None)
        self.swapper.end_pass(abandoned=True)
        gc.collect()  # the failed attempt's graph, before the retry allocates again
        self.controller.out_of_memory(message)
        self.tracker.reset()
        self.swapper.begin_pass()
        self.hooks_ctx = _hooks(self.swapper)
        self.hooks_ctx.__enter__()

    def remove(self, model: nn.Module) -> None:
        unwrap_forward(model)
        if self.blocks is not None:
            self.blocks.detach()
        for handle in self.handles:
            handle.remove()
        if self.hooks_ctx is not None:  # unpatched from inside forward
            self.hooks_ctx.__exit__(None, None, None)
            self.hooks_ctx = None
        self.tracker.detach()
        self.swapper.close()


def _held_before(model: nn.Module, args, kwargs) -> str:
    """What the device of `model` (or of its inputs) holds now, for an error message."""
    first = next(model.parameters(), None)
    tensors = ([first] if first is not None else []) + Inputs(args, kwargs).tensors()
    dev = next((d for d in map(device_of, tensors) if d is not None), None)
    if dev is None:
        return "an unknown amount"
    total = dev.total_memory()
    return size_text(dev.memory_allocated()) + (f" of its {size_text(total)}" if total else "")


def _runs_compiled_graph(output, limit: int = 100_000) -> bool:
    """A CompiledFunctionBackward node (AOTAutograd's compiled graph) is in the autograd
    graph of `output` (a tensor or a structure of them; at most `limit` nodes visited)."""
    stack, seen = [], set()
    _collect_grad_fns(output, stack)
    while stack and len(seen) < limit:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CompiledFunctionBackward":
            return True
        stack.extend(fn for fn, _ in node.next_functions)
    return False


def _collect_grad_fns(output, into: list) -> None:
    if isinstance(output, torch.Tensor):
        into.append(output.grad_fn)
    elif isinstance(output, (tuple, list)):
        for o in output:
            _collect_grad_fns(o, into)
    elif isinstance(output, dict):
        for o in output.values():
            _collect_grad_fns(o, into)


def _traced_advice(how: str) -> str:
    return (f"cswap: this patched model {how}, which traces cswap's hooks into the compiled graph; PyTorch "
            f"applies no saved-tensor hooks inside compiled graphs, so its activations stay on the GPU. Compile "
            f"first, then patch the compiled module: model = cswap.patch(torch.compile(model)); cswap then "
            f"offloads what each compiled graph saves for backward")


def _hooks(swapper: Swapper):
    """The saved-tensor hooks of one pass: the swapper's, or PyTorch's save_on_cpu baseline."""
    if swapper.mode == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
    return torch.autograd.graph.saved_tensors_hooks(swapper.pack, swapper.unpack)


def patch(model: nn.Module, mode: str | None = None, policy=None, *, budget=None, recompute=None, profile=None,
          advisor: str = "independent", report_dir=None, verbose: bool = True, **options) -> nn.Module:
    """Offload the activations `model` saves for backward to host memory.

    Returns the same module, patched in place (patching again replaces the
    settings). Modes: "cswap" (the default: the advisor decides per tensor,
    each epoch, whether and how to compress it; or `policy(info) -> codec
    name, None (offload raw) or "keep" (leave it on the device)` decides), "vdnn" (offload every candidate uncompressed),
    "sc" (ZVC on every candidate), "none" (hooks only, the overhead baseline),
    "vdnnpp" (offload uncompressed, compress on the host with CPU threads),
    "save_on_cpu" (PyTorch's torch.autograd.graph.save_on_cpu(pin_memory=True)
    around each forward: every saved tensor, parameters included; a baseline).

    budget: offload only what must go to keep the device's memory within it:
    bytes, a size like "20GiB", a fraction of the device's memory like 0.8 or "80%", or
    "auto" (nothing leaves until a forward runs out of device memory; that step
    is retried with every saved activation offloaded and a budget is chosen).
    Every saved activation is then a candidate (candidates="all"): after the
    first step (offloaded raw, timed and its memory traced) the planner keeps,
    moves raw or compresses each for the least predicted step time within the
    budget, and plans again each epoch end (cswap.plan.runtime_budget).
    recompute: with a budget, blocks the plan may also checkpoint (recompute in
    backward instead of keeping or moving what they save): "auto" for the model's
    repeated blocks (transformer layers, residual blocks), module names, or a
    predicate (name, module) -> bool; None (the default) for none. Chosen blocks
    run under torch.utils.checkpoint(use_reentrant=False) from the step after the
    profiled one (cswap.runtime.checkpointing).
    profile: a cswap.Profile or a path (default: cswap.load_profile()).
    advisor: "independent" (paper eq. 1-4 per tensor) or "timeline" (a
    simulated iteration with shared PCIe links). report_dir: where
    cswap.epoch_end(model) writes its reports (JSON lines, CSV, PNG plots);
    verbose: print each epoch's table. Swapper options (cswap.runtime.Swapper):
    candidates="auto" (default: ReLU and pooling outputs, or every saved
    activation when the first step makes none, as in GELU/SiLU transformers,
    said once) | "sparse" | "all", min_bytes (default 1 MiB on CUDA),
    stash_bytes and prefetch_bytes (bytes in flight each way; default an
    eighth of what the previous forward pass offloaded), max_host_bytes,
    pin_memory, codec_configs={codec: LaunchConfig} (default: the profile's
    tuned ones), checksum=True (an end-to-end checksum of every offloaded
    buffer, see cswap.runtime.integrity; off by default: compressed copies are
    always checked by their header and decoder, and raise CorruptDataError
    when altered).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"cswap.patch: expected a torch.nn.Module, got {type(model).__name__}")
    mode = mode or "cswap"
    unknown = sorted(set(options) - set(SWAPPER_OPTIONS))
    if unknown:
        raise TypeError(f"cswap.patch: unknown option {unknown[0]!r}; options are mode, policy, budget, recompute, profile, "
                        f"advisor, report_dir, verbose, {', '.join(SWAPPER_OPTIONS)}")
    check_policy(mode, policy)  # the swapper only ever sees the controller's policy
    if recompute is not None and budget is None:
        raise ValueError("cswap.patch: recompute= lets a budget's plan checkpoint blocks; give budget= too")
    if budget is not None:
        if mode != "cswap" or policy is not None:
            raise ValueError(f"cswap.patch: a budget is planned in mode='cswap' without a policy (got "
                             f"mode={mode!r}{', a policy' if policy is not None else ''}); drop one of them")
        if options.setdefault("candidates", "all") != "all":
            raise ValueError("cswap.patch: with a budget every saved activation is a candidate; drop "
                             "candidates= (the plan keeps what need not leave)")
    controller = Controller(mode, profile, user_policy=policy, advisor_mode=advisor, report_dir=report_dir,
                            verbose=verbose, budget=budget)
    if mode == "cswap" and "codec_configs" not in options and policy is None:
        options["codec_configs"] = controller.codec_configs()
    tracker = LayerTracker()
    swapper = Swapper(mode, controller.policy if mode == "cswap" else None, layer=tracker.where,
                      observer=controller.profiler, **options)  # validates the options first
    controller.warm_up = swapper.warm_up
    if controller.budget is not None:
        swapper.memory_limit = controller.budget.limit
        swapper.step_unplanned = controller.budget.step_unplanned
    names = resolve_blocks(model, recompute) if recompute is not None else []
    unpatch(model)
    tracker.attach(model)
    _PATCHED[model] = entry = _Patch(model, swapper, tracker, controller)
    if names:
        controller.blocks = entry.blocks = CheckpointedBlocks(
            model, names, lambda: controller.budget.recomputed, controller.profiler)
    if budget == AUTO:
        entry.retry_on_oom(model)
    if getattr(model, "_compiled_call_impl", None) is not None:  # model.compile(): hooks run inside the graph
        warnings.warn(_traced_advice("was compiled in place (model.compile())"), RuntimeWarning, stacklevel=2)
        _PATCHED[model].warned_traced = True
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Remove cswap's hooks: stock autograd behaviour again. Idempotent.

    Graphs built while patched still restore their tensors in backward."""
    entry = _PATCHED.pop(model, None)
    if entry is not None:
        entry.remove(model)
    return model


def is_patched(model: nn.Module) -> bool:
    return model in _PATCHED


@contextmanager
def offload(mode: str | None = None, policy=None, **options):
    """Offload tensors saved for backward inside this region; yields the Swapper
    (its .stats counts what moved). Backward may run after the region ends."""
    tracker = LayerTracker()
    swapper = Swapper(mode, policy, layer=tracker.where, **options)
    tracker.attach_global()
    swapper.begin_pass()
    why = why_not_ours("a cswap.offload() region began")
    if why:
        warnings.warn(why, RuntimeWarning, stacklevel=3)
    try:
        with nullcontext() if why is not None else _hooks(swapper):
            yield swapper
    finally:
        tracker.detach()
        swapper.end_pass()
        swapper.close()  # offloads finish; restores in a later backward need no worker


def epoch_end(model: nn.Module, metrics: dict | None = None) -> "EpochReport":
    """End an epoch: read the sparsity sampled during it, re-decide which tensors
    to compress (cswap mode), print the report (verbose) and write it (report_dir).

    Call it once per epoch, e.g. after the last batch; `metrics` (loss,
    accuracy, ...) are printed and stored with the report."""
    entry = _PATCHED.get(model) if isinstance(model, nn.Module) else None
    if entry is None:
        raise ValueError(f"cswap.epoch_end: {type(model).__name__} is not patched; call cswap.patch(model) first")
    entry.warn_if_traced()
    entry.swapper.surface()  # warnings from the background threads, in the user's thread
    entry.swapper.trim_host_pool()  # sizes this epoch did not use (see HostPool.trim_idle)
    kept = entry.swapper.stats["kept_on_gpu"]
    since = kept - entry.kept_before if kept >= entry.kept_before else kept  # (stats reset mid-epoch)
    metrics = {**(metrics or {}), "kept_on_gpu": since}  # candidates left on the device this epoch
    if entry.controller.budget is not None:  # measured, beside the plan's predicted peak
        metrics["peak_gpu_bytes"] = entry.swapper.stats["peak_gpu_bytes"]
    entry.kept_before = kept
    return entry.controller.epoch_end(metrics)


def epoch_end_hook(model: nn.Module, metrics=None):
    """`cswap.epoch_end(model)` as a callable for training loops' epoch-end events;
    it ignores the loop's arguments (e.g. ignite's engine, a Lightning callback's
    trainer). `metrics`: a dict, or a callable returning one, stored with each report.

        trainer.add_event_handler(Events.EPOCH_COMPLETED, cswap.epoch_end_hook(model))
    """
    if not is_patched(model):
        raise ValueError(f"cswap.epoch_end_hook: {type(model).__name__} is not patched; call cswap.patch first")

    def hook(*args, **kwargs):
        return epoch_end(model, metrics() if callable(metrics) else metrics)

    return hook


def check_decisions(model: nn.Module, sample: int = 16, repeats: int = 5):
    """Measure, for up to `sample` profiled tensors, the real swap cost with and
    without compression and whether the advisor's decision was right
    (cswap.plan.accuracy.DecisionCheck list; paper Fig. 11)."""
    entry = _PATCHED.get(model) if isinstance(model, nn.Module) else None
    if entry is None:
        raise ValueError(f"cswap.check_decisions: {type(model).__name__} is not patched")
    ctl = entry.controller
    iteration = ctl.profiler.latest()
    if iteration is None:
        raise ValueError("cswap.check_decisions: no profiled iteration yet; train at least one step first")
    from .plan.accuracy import check_decisions as measure_checks

    decisions = ctl.decide()
    infos = ctl.profiler.infos
    device = infos[iteration.tensors[0].key].device if iteration.tensors else None  # where the tensors live
    return measure_checks(iteration, decisions, device=device, sample=sample, repeats=repeats,
                          configs=ctl.codec_configs())


def stats(target) -> SwapStats:
    """The counters of a patched model (or of the Swapper an offload() region yielded)."""
    if isinstance(target, Swapper):
        return target.stats
    entry = _PATCHED.get(target) if isinstance(target, nn.Module) else None
    if entry is None:
        raise ValueError(f"cswap.stats: {type(target).__name__} is not patched; call cswap.patch(model) first "
                         f"(or pass the object `with cswap.offload() as s` yields)")
    entry.warn_if_traced()
    return entry.swapper.stats
