"""A step under torch.compile, for the fake trace: what inductor's partitioner saves and recomputes.

`capture` compiles the model (on fake tensors: nothing runs) with a backend that keeps the
forward and backward graphs AOTAutograd makes for inductor, partitioned as inductor's
default does (min_cut_rematerialization_partition: it saves what is dear to recompute,
matmul and attention outputs, and recomputes in backward the cheap pointwise and norm
work between them). F.scaled_dot_product_attention is captured as the fused kernel the
target GPU runs (cswap.plan.attention). `Captured.replay` then runs those graphs inside
cswap.plan.fake_gpu's trace as one autograd Function: the forward graph's extra outputs
are saved for backward, and the trace sees every op of both graphs.

Inductor also fuses the pointwise ops of each graph into fewer kernels, each reading its
inputs and writing its outputs once: the replay notes each op's data flow, and
cswap.plan.roofline.op_times times each run of them as one kernel. What the replay does not
model: the intermediates inside a fused kernel never reach memory, where the replay
allocates each for the moment its op runs (between two saved tensors: not in the peak of a
step whose peak is its saved activations).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
from dataclasses import dataclass

import torch
from torch import nn

from .attention import _sdpa_args, backend
from .grouped_mm import UnfusedGroupedMM
from .hf_masks import as_in_a_real_step
from .inputs import Inputs, default_loss
from .random_skips import NoRandomSkips

__all__ = ["Captured", "CompileUnsupported", "capture", "capture_blocks", "replay_blocks", "running"]

_running = threading.local()


def running() -> bool:
    """Whether this thread runs a captured graph now (its ops are one compiled kernel's
    candidates for fusion: cswap.plan.fake_gpu notes their data flow)."""
    return getattr(_running, "depth", 0) > 0


def _run(graph: torch.fx.GraphModule, args: list):
    """The graph on `args` (cleared: each value is dropped after its last use)."""
    _running.depth = getattr(_running, "depth", 0) + 1
    try:
        return torch.fx.Interpreter(graph).boxed_run(args)
    finally:
        _running.depth -= 1


class CompileUnsupported(ValueError):
    """The model cannot be captured as one compiled graph (a graph break, an input
    that is neither a parameter, a buffer nor an example input)."""


@dataclass
class Captured:
    """One compiled step's graphs: `forward(*primals)` returns the graph's outputs (the
    inputs it mutates, then the model's outputs) and then what it saves for backward;
    `backward(*saved, *tangents)` returns a gradient per primal. `primals` names each
    primal: ("param", name), ("buffer", name) or ("input", i), the i-th tensor of the
    call's arguments (torch.utils._pytree's leaves of (args, kwargs))."""

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    primals: list[tuple[str, object]]
    outputs: int      # the model's outputs (after the mutated inputs)
    saved: int        # forward outputs saved for backward
    tangents: int     # gradients of outputs that backward takes
    spec: object = None  # the output's pytree structure, with `leaves` its leaves
    leaves: tuple = ()   # per leaf: ("output", i), the graph's i-th output; ("input", i), the i-th argument
    #                      returned as it came (T5's position bias, passed on); ("constant", value)
    needs_grad: tuple | None = None  # per graph output, whether it needed a gradient (None: if floating)

    def moved(self, device: torch.device) -> "Captured":
        """These graphs with the tensors they make (arange, full, casts) made on `device`."""
        graphs = []
        for gm in (self.forward, self.backward):
            gm = copy.deepcopy(gm)
            for node in gm.graph.nodes:
                if isinstance(node.kwargs.get("device"), torch.device) and node.kwargs["device"] != device:
                    node.kwargs = {**node.kwargs, "device": device}
            gm.recompile()
            graphs.append(gm)
        return Captured(*graphs, self.primals, self.outputs, self.saved, self.tangents, self.spec, self.leaves,
                        self.needs_grad)

    def replay(self, model: nn.Module, inputs):
        """The model's output for `inputs` (cswap.plan.inputs.Inputs), computed by the
        captured graphs on `model`'s parameters and buffers (by name): as the model returns
        it, or, where its structure was not kept, {"loss": ..., "outputs": ...} when one
        output is a scalar (a loss computed inside) and a tuple otherwise."""
        from torch.utils._pytree import tree_flatten, tree_unflatten

        params = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        given = tree_flatten((inputs.args, inputs.kwargs))[0]
        primals = [{"param": params, "buffer": buffers, "input": given}[kind][key] for kind, key in self.primals]
        outs = _Replay.apply(self, *primals)
        outs = outs[len(outs) - self.outputs:]
        if self.spec is not None:
            return tree_unflatten([outs[key] if kind == "output" else given[key] if kind == "input" else key
                                   for kind, key in self.leaves], self.spec)
        scalars = [o for o in outs if isinstance(o, torch.Tensor) and o.dim() == 0 and o.is_floating_point()]
        return {"loss": scalars[0], "outputs": outs} if len(scalars) == 1 else tuple(outs)


class _Replay(torch.autograd.Function):
    """The captured graphs as one autograd node. Backward runs as AOTAutograd's does: the
    saved tensors leave the node (maybe_clear_saved_tensors, private) and the graph runs
    boxed, dropping each value after its last use, so activations free as backward goes."""

    @staticmethod
    def forward(ctx, captured: Captured, *primals):
        outs = _run(captured.forward, list(primals))
        visible, saved = outs[:len(outs) - captured.saved], outs[len(outs) - captured.saved:]
        ctx.captured = captured
        ctx.save_for_backward(*saved)
        ctx.differentiable = [isinstance(o, torch.Tensor) and o.is_floating_point() for o in visible]
        if captured.needs_grad is not None:  # (an output that needed none has no tangent: T5's cross-attention bias)
            ctx.differentiable[len(visible) - captured.outputs:] = captured.needs_grad
        ctx.mark_non_differentiable(*[o for o, d in zip(visible, ctx.differentiable) if not d])
        return tuple(visible)

    @staticmethod
    def backward(ctx, *grads):
        captured = ctx.captured
        differentiable = [g for g, d in zip(grads, ctx.differentiable) if d]
        args = [*ctx.saved_tensors, *differentiable[len(differentiable) - captured.tangents:]]
        ctx.maybe_clear_saved_tensors()
        del grads, differentiable
        return (None, *_run(captured.backward, args))


def _fused_sdpa(arch: int):
    """F.scaled_dot_product_attention as the fused kernel a GPU of compute capability
    `arch` runs (a plain function: dynamo traces into it)."""
    aten = torch.ops.aten
    plain = torch.nn.functional.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_args(*args, **kwargs)
        if q.dim() == 4:
            chosen = backend(arch, q.dtype, q.shape, k.shape, v.shape, masked=mask is not None,
                             is_causal=is_causal, gqa=gqa, dropout=dropout_p > 0)
            if chosen == "flash":
                return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                                scale=scale)[0]
            if chosen == "efficient" and mask is None:
                return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, is_causal,
                                                                    scale=scale)[0]
        return plain(*args, **kwargs)

    return sdpa


def capture(model: nn.Module, inputs, arch: int | None = None) -> Captured:
    """Compile `model` and keep its partitioned graphs: its parameters and the example
    `inputs` (cswap.plan.inputs.Inputs) fake tensors whose mode allows real ones (the
    graph's constants), not on "meta" (where dynamo drops the loss's gradient); `arch`: the
    GPU's compute capability, for the attention kernel. Resets dynamo's caches before and
    after (each capture compiles afresh). Raises CompileUnsupported on a graph break."""
    import torch._dynamo
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    import torch._inductor.lowering  # noqa: F401 - torch 2.15's max-pool decomposition reads it, unimported
    from torch.utils._pytree import tree_flatten

    names = {id(t): ("param", n) for n, t in model.named_parameters(remove_duplicate=False)}
    names.update({id(t): ("buffer", n) for n, t in model.named_buffers(remove_duplicate=False)})
    names.update({id(t): ("input", i) for i, t in enumerate(tree_flatten((inputs.args, inputs.kwargs))[0])
                  if isinstance(t, torch.Tensor)})
    got: dict = {}

    def keep_forward(gm, example_inputs):
        got["forward"] = gm
        return _in_their_mode(gm.forward)

    def keep_backward(gm, example_inputs):
        got["backward"] = gm
        return _in_their_mode(gm.forward)

    inner = aot_autograd(fw_compiler=keep_forward, bw_compiler=keep_backward,
                         partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())

    def backend_(gm, example_inputs):
        missing = [i for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor) and id(t) not in names]
        if missing:
            raise CompileUnsupported(f"cswap.plan: the compiled graph reads {len(missing)} tensor(s) that are "
                                     f"neither the model's parameters or buffers nor its example inputs")
        got["primals"] = [names[id(t)] for t in example_inputs]
        got["outputs"] = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        compiled = inner(gm, example_inputs)

        def run(*args):  # (what the graph returned: dynamo puts it in the output's structure)
            out = compiled(*args)
            got["returned"] = list(out) if isinstance(out, (list, tuple)) else [out]
            return out

        run._boxed_call = getattr(compiled, "_boxed_call", False)
        return run

    torch._dynamo.reset()
    masks = as_in_a_real_step(inputs)  # (no padding: transformers then asks SDPA for is_causal, as a real step)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if arch is not None:
        torch.nn.functional.scaled_dot_product_attention = _fused_sdpa(arch)
    try:
        compiled = torch.compile(model, backend=backend_, fullgraph=True, dynamic=False)
        with masks, _tokens_inside(), _checkpoint_side_effects_not_replayed():
            out = inputs(compiled)
        default_loss(out).backward()
        leaves, spec = tree_flatten(out)
    except torch._dynamo.exc.Unsupported as exc:
        raise CompileUnsupported(f"cswap.plan: torch.compile cannot capture this model as one graph "
                                 f"({str(exc).splitlines()[0]}); predict it without --compile") from None
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        torch._dynamo.reset()
    bw = got["backward"]
    for gm in (got["forward"], bw):
        _as_plain_calls(gm)
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    tangents = sum(n.name.startswith("tangents") for n in placeholders)
    returned = got.get("returned", [])
    kinds = _leaf_kinds(leaves, returned, tree_flatten((inputs.args, inputs.kwargs))[0])
    if kinds is None:
        spec = None  # (an output whose leaves are not the graph's outputs, arguments or constants)
    needs_grad = tuple(isinstance(r, torch.Tensor) and r.requires_grad for r in returned) \
        if len(returned) == got["outputs"] else None
    return Captured(got["forward"], bw, got["primals"], got["outputs"], len(placeholders) - tangents, tangents, spec,
                    kinds, needs_grad)


def _leaf_kinds(leaves: list, returned: list, given: list) -> tuple | None:
    """Where each leaf of the compiled call's output comes from (Captured.leaves): one of
    the graph's outputs, which dynamo may put in another order, an argument it passes
    through (not a graph output), or a constant; None if a leaf is none of these."""
    kinds = []
    for x in leaves:
        if not isinstance(x, torch.Tensor):
            kinds.append(("constant", x))
            continue
        at = next((i for i, r in enumerate(returned) if r is x), None)
        if at is not None:
            kinds.append(("output", at))
            continue
        at = next((i for i, g in enumerate(given) if g is x), None)
        if at is None:
            return None
        kinds.append(("input", at))
    return tuple(kinds)


def _tokens_inside():
    """AOTAutograd threads an op with side effects (torch.linalg.solve's error check, in
    peft's BOFT) through a token that its graphs take as an extra input and return; with
    unlift_effect_tokens the graphs make and drop the token themselves, as inductor's do,
    and take only the step's primals."""
    from torch._functorch import config  # (unlift_effect_tokens: torch 2.11-2.15 have it)

    return config.patch(unlift_effect_tokens=True)


def _checkpoint_side_effects_not_replayed():
    """transformers 5.25 with Hugging Face's `kernels` package sets a context variable in each
    attention forward (the kernels it may swap in), which dynamo refuses inside a checkpointed
    region, whose backward would not replay it: each checkpointed layer graph-breaks. The
    capture runs as dynamo advises for that case, skipping the replay (bookkeeping, no math);
    a torch without the option captures as before."""
    from torch._dynamo import config

    if not hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        return contextlib.nullcontext()
    return config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


def _as_plain_calls(gm: torch.fx.GraphModule) -> None:
    """Run the higher-order operators a captured graph may hold as plain calls of their
    ops: the recorder of cswap.plan.fake_gpu cannot enter them, and a trace's values are
    never read. torch 2.11 wraps a fused attention kernel in a checkpointed region to
    replay its random state (run_and_save_rng_state in forward, run_with_rng_state in
    backward); an op with side effects runs under with_effects, threading a token. And
    each view of a shape becomes a reshape (see _PLAIN)."""
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        replacement = _PLAIN.get(str(node.target))
        if replacement is not None:
            node.target, changed = replacement, True
    if changed:
        gm.recompile()


def _run_keeping_no_state(op, *args, **kwargs):
    out = op(*args, **kwargs)
    device = next(t.device for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor))
    return torch.empty(0, dtype=torch.uint8, device=device), out


def _run_ignoring_state(state, op, *args, **kwargs):
    return op(*args, **kwargs)


def _run_with_effects(token, op, *args, **kwargs):
    out = op(*args, **kwargs)
    return (token, *out) if isinstance(out, tuple) else (token, out)  # (with_effects' return form)


_PLAIN = {"run_and_save_rng_state": _run_keeping_no_state, "run_with_rng_state": _run_ignoring_state,
          "with_effects": _run_with_effects,
          # A graph captured on CPU tensors views what the CPU laid out densely; the trace's
          # device may lay it out otherwise (HF ConvNeXt's permuted convolution output): a
          # reshape is that view where it can be, else the copy a graph traced so would make.
          "aten.view.default": torch.ops.aten.reshape.default}


def capture_blocks(model: nn.Module, inputs, names: list[str], arch: int | None = None) -> dict[str, Captured]:
    """Regional compilation, as torchtune compiles a model (and PyTorch's tutorials advise
    for transformers): each of the blocks `names` (the repeated layers) compiled on its
    own, the rest of the step eager. A block's example arguments are taken from one
    forward of the model (fake, as for capture); blocks alike (the same class, parameter
    names and shapes, and arguments of the same shapes) share one capture. Returns block
    name -> Captured."""
    from torch.utils._pytree import tree_flatten, tree_map

    seen: dict[str, tuple] = {}
    hooks = []

    def keep(name):
        def hook(module, args, kwargs):
            if name not in seen:
                seen[name] = tree_map(lambda t: t.detach().requires_grad_(t.requires_grad)
                                      if isinstance(t, torch.Tensor) else t, (args, kwargs))
        return hook

    for name in names:
        hooks.append(model.get_submodule(name).register_forward_pre_hook(keep(name), with_kwargs=True))
    try:
        # (autograd on: what needs a gradient is as in training; no layer skipped, as in the trace)
        with as_in_a_real_step(inputs), UnfusedGroupedMM(), NoRandomSkips():
            inputs(model)
    finally:
        for hook in hooks:
            hook.remove()
    regions, by_kind = {}, {}
    for name in names:
        block = model.get_submodule(name)
        args, kwargs = seen[name]
        leaves = tree_flatten((args, kwargs))[0]
        if any(type(x).__name__.endswith("Cache") and hasattr(x, "update") for x in leaves):
            raise CompileUnsupported(f"cswap.plan: {name} is given a key/value cache in training (peft's prefix "
                                     f"tuning passes its prefixes so), which it extends as it runs: its compiled "
                                     f"graph cannot be captured from one call; predict it without --compile")
        kind = (type(block), tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()),
                tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor)))
        if kind not in by_kind:
            if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves) and \
                    not any(p.requires_grad for p in block.parameters()):
                continue  # (nothing to differentiate: frozen and fed no gradient)
            by_kind[kind] = capture(block, Inputs(tuple(args), dict(kwargs)), arch)
        regions[name] = by_kind[kind]
    return regions


def replay_blocks(model: nn.Module, regions: dict[str, Captured]) -> None:
    """Run each block of `regions` ("" for `model` itself) by its captured graphs from now
    on (its forward replaced)."""
    for name, captured in regions.items():
        block = model.get_submodule(name)
        block.forward = functools.partial(_replay_block, captured, block)


def _replay_block(captured: Captured, block: nn.Module, *args, **kwargs):
    return captured.replay(block, Inputs(args, kwargs))


def _in_their_mode(run):
    """`run` inside its fake arguments' FakeTensorMode, if any: the graph's constants, made
    real while tracing, then meet the fake inputs (their mode must allow_non_fake_inputs)."""
    from torch._subclasses.fake_tensor import FakeTensor

    def call(args: list):  # (AOTAutograd's boxed convention: a list, which the callee may clear)
        mode = next((a.fake_mode for a in args if isinstance(a, FakeTensor)), None)
        with mode if mode is not None else contextlib.nullcontext():
            return run(*args)

    call._boxed_call = True
    return call

