"""cswap and torch.compile (issue 7).

What cswap does with compiled code:

- compile first, then patch (`cswap.patch(torch.compile(model))`, or compiled
  submodules inside a patched model): each compiled graph runs as one autograd
  Function whose saved tensors pass through cswap's hooks; the ones computed
  inside the graph are offloaded at the graph boundary (op "compiled_graph"),
  its inputs and parameters never are.
- patch first, then compile: the hooks are traced into the graph, where
  PyTorch applies no saved-tensor hooks; nothing is offloaded, training stays
  exact, fullgraph=True still compiles, and the next cswap call warns once
  with the fix. model.compile() (in place) before patch warns at patch time.

The AOTAutograd path is exercised with backend="aot_eager" (the same
CompiledFunction as inductor, without a C++ toolchain on CPU); inductor itself
runs in the GPU tests.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

import cswap
import nets
from cswap.runtime.candidates import COMPILED_GRAPH, compiled_graph_inputs, computed_inside, \
    input_storages
from cswap.patch import _PATCHED
from cswap.runtime.device import device_of
from cswap.runtime.swapper import Swapper
from test_runtime import Recorder, assert_same, record_offloaded, train

pytestmark = [pytest.mark.filterwarnings("ignore:.*saves no memory:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:.*no profile for this device:RuntimeWarning")]

CODECS = ("zvc", "rle", "csr", "lz4")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(model, **kwargs):
    return torch.compile(model, backend="aot_eager", fullgraph=True, **kwargs)


def reference(name, steps=2):
    """An unpatched compiled run: the same graphs, so the same floating-point results."""
    make, shape = nets.MODELS[name]
    result = train(compiled(make()), shape, steps=steps)
    torch._dynamo.reset()
    return {key.replace("_orig_mod.", ""): value for key, value in result.items()}


def without_prefix(result):
    return {key.replace("_orig_mod.", ""): value for key, value in result.items()}


@pytest.mark.parametrize("name,mode", [("vgg", "sc"), ("resnet", "cswap"),
                                       pytest.param("vgg", "cswap", marks=pytest.mark.slow),
                                       pytest.param("resnet", "sc", marks=pytest.mark.slow)])
def test_patching_a_compiled_model_offloads_at_graph_boundaries(name, mode):
    expected = reference(name)
    make, shape = nets.MODELS[name]
    policy = Recorder(lambda info: CODECS[info.index % 4]) if mode == "cswap" else None
    # Prefetch as far as it goes: what is tested is the direction it follows.
    model = cswap.patch(compiled(make()), mode=mode, policy=policy, min_bytes=0, prefetch_bytes=1 << 30)
    swapper = _PATCHED[model].swapper
    offloaded = record_offloaded(swapper)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "traced" warning: this is the supported order
        warnings.filterwarnings("ignore", message=".*saves no memory")
        got = without_prefix(train(model, shape, steps=2))
        stats = cswap.stats(model)
    assert_same(got, expected)
    assert stats["offloaded_tensors"] > 0 and stats["compressed_tensors"] > 0
    assert stats["restored_tensors"] + stats["served_from_device"] == stats["offloaded_tensors"]  # each once
    # The compiled backward unpacks in forward order; prefetch follows it: per step
    # only the first two items are fetched on demand.
    assert stats["on_demand"] <= 2 * 2 and stats["prefetched"] == stats["restored_tensors"] - stats["on_demand"]
    # only the graphs' own activations: no parameter, no input batch
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert not any(t.untyped_storage().data_ptr() in storages for t in offloaded)
    assert all(t.grad_fn is None and not t.requires_grad for t in offloaded)
    inputs = [x for x, _ in nets.batches(shape, 2)]
    assert not any(t.shape == x.shape and torch.equal(t, x) for t in offloaded for x in inputs)
    if policy is not None:
        assert policy.infos and {info.op for info in policy.infos} == {COMPILED_GRAPH}


class Head(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        return self.layers(x)


@pytest.mark.parametrize("in_place", [False, True])
def test_compiled_submodule_inside_a_patched_model(in_place):
    """Eager layers offload as usual, the compiled block at its boundary (compiled
    with torch.compile(block) or block.compile())."""
    make, shape = nets.MODELS["vgg"]

    def with_compiled_classifier():
        model = make()
        # A module class of the user's: torch 2.11 runs module.compile() of torch.nn's own
        # containers eagerly (their forward is in dynamo's skip files).
        model.classifier = Head(model.classifier)
        if in_place:
            model.classifier.compile(backend="aot_eager")
        else:
            model.classifier = compiled(model.classifier)
        return model

    expected = without_prefix(train(with_compiled_classifier(), shape, steps=2))
    torch._dynamo.reset()
    model = with_compiled_classifier()
    policy = Recorder(lambda info: "zvc")
    cswap.patch(model, policy=policy, min_bytes=0)
    got = without_prefix(train(model, shape, steps=2))
    assert_same(got, expected)
    ops = {info.op for info in policy.infos}
    assert COMPILED_GRAPH in ops and "relu" in ops


@pytest.mark.parametrize("in_place", [False, True])
def test_compiling_a_patched_model_trains_exactly_never_crashes_and_warns_once(in_place):
    make, shape = nets.MODELS["vgg"]
    expected = reference("vgg")
    model = cswap.patch(make(), mode="sc", min_bytes=0)
    if in_place:
        model.compile(backend="aot_eager", fullgraph=True)
        runner = model
    else:
        runner = compiled(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = without_prefix(train(runner, shape, steps=2))  # fullgraph=True: no graph break from cswap
        cswap.stats(model)
        cswap.stats(model)
        cswap.epoch_end(model)
    assert_same(got, expected)
    advice = [w for w in caught if "cswap.patch(torch.compile(model))" in str(w.message)]
    assert len(advice) == 1
    assert cswap.stats(model)["offloaded_tensors"] == 0


def test_in_place_compiled_model_warns_at_patch_time():
    model = nets.vgg_like()
    model.compile(backend="aot_eager")
    with pytest.warns(RuntimeWarning, match=r"model.compile\(\)"):
        cswap.patch(model, mode="sc")


def _frames_of(style, cls, args, name="apply"):
    """The frame that calls the pack hook for a compiled graph, as each torch builds it:
    up to 2.13 Function.apply's own Python frame; from 2.14 AOTAutograd's boxed call
    g(args) -> f(*args), with apply in C."""
    if style == "python-apply":
        code = SimpleNamespace(co_name=name, co_filename=os.path.join("site-packages", "torch", "autograd",
                                                                       "function.py"))
        return SimpleNamespace(f_code=code, f_locals={"cls": cls, "args": args}, f_back=None)
    apply = getattr(cls, "apply", None) if name == "apply" else getattr(cls, name)
    code = SimpleNamespace(co_name="g", co_filename=os.path.join("site-packages", "torch", "_functorch",
                                                                 "_aot_autograd", "utils.py"))
    return SimpleNamespace(f_code=code, f_locals={"f": apply, "args": list(args)}, f_back=None)


@pytest.mark.parametrize("style", ["python-apply", "boxed-call"])
def test_compiled_graph_candidates(style):
    """Only what a CompiledFunction saves and computed itself, whichever way this torch
    calls the pack hook: tensors with gaps too, which come back with their strides (a
    compiled backward may assert them; they came back contiguous, and stayed)."""
    fake_compiled = type("CompiledFunction", (torch.autograd.Function,),
                         {"__module__": "torch._functorch._aot_autograd.fake"})
    user_function = type("MyFunction", (torch.autograd.Function,), {"__module__": "mylib"})

    def caller(cls, args=(), name="apply"):
        return _frames_of(style, cls, args, name)

    swapper = Swapper("vdnn", min_bytes=0)

    def candidate_op(t, frame):
        return swapper._candidate_op(t, device_of(t), frame)

    param, x = torch.nn.Parameter(torch.randn(4, 4)), torch.randn(4, 4)
    intermediate = torch.randn(4, 8)
    assert candidate_op(intermediate, caller(fake_compiled, (param, x))) == COMPILED_GRAPH
    assert candidate_op(intermediate.t(), caller(fake_compiled, (param, x))) == COMPILED_GRAPH
    assert candidate_op(x, caller(fake_compiled, (param, x))) is None            # a graph input
    assert candidate_op(x.t(), caller(fake_compiled, (param, x))) is None        # a view of one
    assert candidate_op(param, caller(fake_compiled, (param, x))) is None
    assert candidate_op(intermediate[:, ::2], caller(fake_compiled)) == COMPILED_GRAPH  # with gaps
    assert candidate_op(intermediate, caller(user_function)) is None             # not compiled
    assert candidate_op(intermediate, caller(fake_compiled, name="forward")) is None
    assert candidate_op(intermediate, None) is None
    swapper.close()


def test_this_torchs_compiled_graphs_are_recognised():
    """The private structure compiled_graph_inputs reads holds on the torch under test:
    a real compiled graph's intermediates are found, its inputs are not (the graph
    saves x.t() for the weight's gradient: a tensor of its own on x's storage)."""
    seen = []

    def pack(t):
        inputs = compiled_graph_inputs(sys._getframe(1))
        seen.append(None if inputs is None else computed_inside(t, input_storages(inputs)))
        return t

    x = torch.randn(8, 16)
    fn = torch.compile(lambda a, w: torch.relu(a @ w).sum(), backend="aot_eager", fullgraph=True)
    w = torch.randn(16, 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, w).backward()
    assert None not in seen and True in seen and False in seen, seen


def test_an_unrecognised_compiled_graph_is_warned_about(monkeypatch):
    """A torch whose compiled graphs cswap cannot read (simulated: nothing is recognised)
    is named in a warning once, instead of offloading nothing in silence."""
    import cswap.runtime.swapper as swapper_module

    monkeypatch.setattr(swapper_module, "compiled_graph_inputs", lambda caller: None)
    make, shape = nets.MODELS["vgg"]
    model = cswap.patch(compiled(make()), mode="sc", min_bytes=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, shape, steps=2)
    unrecognised = [w for w in caught if "did not recognise" in str(w.message)]
    assert len(unrecognised) == 1 and torch.__version__ in str(unrecognised[0].message)
    assert cswap.stats(model)["offloaded_tensors"] == 0


@pytest.mark.parametrize("options", [{"budget": "auto"}, {"budget": 1 << 20, "recompute": ["0", "1"]}],
                         ids=["budget_auto", "recompute"])
def test_a_patched_model_whose_forward_cswap_wraps_exports(options):
    """torch.export of a trained, still patched model (to deploy it): the forward cswap wraps
    (budget="auto", or the blocks recompute= may checkpoint) reads as a function to export."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU()),
                                torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()), torch.nn.Linear(32, 1))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    cswap.patch(model, min_bytes=0, verbose=False, **options)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(x).sum().backward()
            exported = torch.export.export(model, (x,))
        assert torch.equal(exported.module()(x), model(x))
    finally:
        cswap.unpatch(model)
