"""cswap.plan.fake_gpu: one training step traced without a GPU (issue 13).

What it must get right is checked against real CPU steps of the same models:
the same tensors saved for backward, in the same order, by the same ops and
modules, and used in backward in the same order.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from cswap.models import build
from cswap.plan import fake_gpu
from cswap.runtime.candidates import op_name, producer
from cswap.runtime.layers import LayerTracker

from cpu_memory import cpu_step_peak

CIFAR = (3, 32, 32)


def cpu_step_saved(model, x) -> list[tuple]:
    """(shape, dtype, kind, op, module, first use) of what a real CPU step saves."""
    model = copy.deepcopy(model)
    params, buffers = {id(p) for p in model.parameters()}, {id(b) for b in model.buffers()}
    tracker = LayerTracker()
    tracker.attach(model)
    records, uses = [], {}

    def pack(t):
        made_by = producer(t)
        kind = fake_gpu.kind_of(t, params, buffers, {id(x)})
        records.append((tuple(t.shape), t.dtype, kind, op_name(made_by) if made_by else "", *tracker.current))
        return len(records) - 1, t

    def unpack(packed):
        uses.setdefault(packed[0], len(uses))
        return packed[1]

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        model(x).float().mean().backward()
    opt.step()
    tracker.detach()
    return [(*r, uses.get(i)) for i, r in enumerate(records)]


@pytest.mark.parametrize("name", ["small_cnn", "vgg16", "resnet18"])
def test_saved_tensors_equal_a_real_cpu_step(name):
    torch.manual_seed(0)
    model = build(name, dataset="cifar10")
    x = torch.randn(4, *CIFAR)
    trace = fake_gpu.trace_step(model, x)
    got = [(r.shape, r.dtype, r.kind, r.op, r.module, r.module_type, r.use) for r in trace.saved]
    assert got == cpu_step_saved(model, x)
    assert trace.activations() and all(r.nbytes > 0 for r in trace.saved)
    # Who made each activation and which op keeps it: a max-pool output is made in the
    # MaxPool2d and saved by the next convolution, in the next Conv2d.
    assert all(r.saved_by for r in trace.saved)
    pooled = [r for r in trace.activations() if r.op == "max_pool2d"]
    if name == "vgg16":
        assert len(pooled) == 5
        assert all(r.made_in_type == "MaxPool2d" and r.saved_by == "convolution" and r.module_type == "Conv2d"
                   for r in pooled[:4])
        indices = [r for r in trace.activations() if r.dtype == torch.int64]
        assert len(indices) == 5 and all(r.saved_by == "max_pool2d" for r in indices)


def test_peak_counts_parameters_gradients_momentum_and_activations():
    torch.manual_seed(0)
    model = build("vgg16", dataset="cifar10")
    trace = fake_gpu.trace_step(model, torch.empty(32, *CIFAR, device="meta"))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    activations = sum(r.nbytes for r in trace.activations())
    assert activations > 0
    # The peak's breakdown is the moment of the peak: here the first optimizer step,
    # when SGD's momentum buffers join the parameters and their gradients.
    assert trace.peak_by_kind["param"] == params
    assert trace.peak_bytes >= 3 * params and trace.peak_bytes == sum(trace.peak_by_kind.values())
    assert trace.peak_bytes >= params + activations  # the end of forward holds every saved activation


def test_works_after_the_process_has_run_backward():
    # A user's process has trained before it asks for a prediction.
    a = torch.randn(3, requires_grad=True)
    (a * 2).sum().backward()
    trace = fake_gpu.trace_step(build("small_cnn", dataset="cifar10"), torch.randn(2, *CIFAR))
    assert trace.activations()


def test_the_model_is_not_touched_and_bad_input_is_named():
    model = build("small_cnn", dataset="cifar10")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fake_gpu.trace_step(model, torch.randn(2, *CIFAR), optimizer="adam")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(TypeError, match="nn.Module"):
        fake_gpu.trace_step(lambda x: x, torch.randn(2))
    with pytest.raises(ValueError, match="optimizer must be one of sgd, adam"):
        fake_gpu.trace_step(model, torch.randn(2, *CIFAR), optimizer="lion")


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
@pytest.mark.parametrize("name", ["small_cnn", pytest.param("vgg16", marks=pytest.mark.slow),
                                  pytest.param("resnet18", marks=pytest.mark.slow)])
def test_peak_within_5_percent_of_a_real_cpu_step(name):
    torch.manual_seed(0)
    model = build(name, dataset="cifar10")
    x = torch.randn(32, *CIFAR)
    trace = fake_gpu.trace_step(model, x)
    assert trace.peak_bytes == pytest.approx(cpu_step_peak(model, x), rel=0.05)
    # Offloading every activation at once lowers the floor, as a real step that
    # drops them does (VGG16's floor is its optimizer step: parameters, gradients, momentum).
    assert trace.offloaded_peak_bytes == pytest.approx(cpu_step_peak(model, x, drop=True), rel=0.05)
    assert trace.offloaded_peak_bytes < trace.peak_bytes
    # The op-by-op memory curve reaches the same peak MemTracker reports.
    assert max(op.live_bytes for op in trace.ops) == trace.peak_bytes


def test_ops_carry_phases_flops_and_when_saved_tensors_can_leave():
    torch.manual_seed(0)
    model = build("vgg16", dataset="cifar10")
    trace = fake_gpu.trace_step(model, torch.empty(8, *CIFAR))
    phases = [op.phase for op in trace.ops]
    assert phases == sorted(phases, key=["forward", "backward", "optimizer"].index)
    convs = [op for op in trace.ops if op.name == "convolution"]
    assert len(convs) == 13 and all(op.flops > 0 and op.bytes > 0 for op in convs)
    # 2 * N * Cout * H * W * Cin * k * k for the first conv: 8 x 64 x 32 x 32 x 3 x 9
    assert convs[0].flops == 2 * 8 * 64 * 32 * 32 * 3 * 9
    assert any(op.name == "convolution_backward" and op.flops > 0 for op in trace.ops)
    for r in trace.activations():
        assert r.saved_at <= r.dropped_at <= r.used_at
        assert trace.ops[r.used_at].phase == "backward"
        assert r.storage_bytes >= r.nbytes


def test_ops_say_whether_the_model_runs_channels_last():
    """Read off the model's 4-d weights (the "meta" device lays every convolution's output out
    NCHW); a model whose every kernel is 1x1 is laid out both ways and reads as NCHW."""
    model = build("vgg16", dataset="cifar10")
    x = torch.empty(2, *CIFAR)
    assert not any(op.channels_last for op in fake_gpu.trace_step(model, x).ops)
    nhwc = copy.deepcopy(model).to(memory_format=torch.channels_last)
    assert all(op.channels_last for op in fake_gpu.trace_step(nhwc, x).ops)
    pointwise = nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 32 * 32, 10))
    assert not any(op.channels_last for op in
                   fake_gpu.trace_step(pointwise.to(memory_format=torch.channels_last), x).ops)


def test_causal_attention_counts_the_tiles_a_fused_kernel_runs_and_the_math_path_all():
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self, causal):
            super().__init__()
            self.proj, self.causal = nn.Linear(64, 64), causal

        def forward(self, x):
            q = self.proj(x).view(2, 1024, 4, 16).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, is_causal=self.causal).sum()

    def attention_flops(causal, arch):
        trace = fake_gpu.trace_step(Attention(causal), torch.randn(2, 1024, 64), loss=lambda out: out, drops=False,
                           sdpa_arch=arch, dtype=torch.bfloat16 if arch else None)
        return sum(op.flops for op in trace.ops if "scaled_dot_product" in op.name or op.name == "bmm")

    # Fused (flash on an H100): 8 tiles of 128 along the sequence, 36 of 64 below or on the diagonal.
    assert attention_flops(True, 90) * 64 == attention_flops(False, 90) * 36
    assert attention_flops(True, None) == attention_flops(False, None)  # (math: every score computed)


def test_a_models_own_autocast_on_meta_turns_the_emulated_one_off_or_to_its_dtype():
    """Code that asks autocast for its tensors' device (peft's LoRA on expert stacks:
    torch.autocast(W.device.type, enabled=False)) gets "meta" in the trace, where torch
    raises: there it acts on the emulated CUDA autocast as CUDA's would."""
    x, w = torch.empty(2, 8, device="meta"), torch.empty(4, 8, device="meta")
    linear = torch.nn.functional.linear
    with fake_gpu._autocast_mode(torch.bfloat16), fake_gpu._model_autocast():
        assert linear(x, w).dtype == torch.bfloat16
        with torch.autocast(x.device.type, enabled=False):
            assert linear(x, w).dtype == torch.float32
            with torch.amp.autocast("meta", dtype=torch.float16):
                assert linear(x, w).dtype == torch.float16
            assert linear(x, w).dtype == torch.float32
        assert linear(x, w).dtype == torch.bfloat16
        with torch.autocast("cpu", dtype=torch.bfloat16):  # any other device: torch's own
            assert torch.is_autocast_enabled("cpu")
    assert torch.autocast is torch.amp.autocast is torch.amp.autocast_mode.autocast
    with pytest.raises(RuntimeError):  # (outside a trace, as torch has it)
        torch.autocast("meta", enabled=False)


def test_a_module_skipped_at_random_is_traced_as_run():
    """`if torch.rand(1) > p` (peft's LoHa and LoKr module dropout, Hugging Face's
    LayerDrop) has no answer without data: the trace takes the step in which no skip
    fires, and says nothing is data-dependent."""

    class MaybeSkipped(nn.Module):
        def __init__(self, module_dropout, layerdrop):
            super().__init__()
            self.module_dropout, self.layerdrop = module_dropout, layerdrop
            self.inner, self.outer = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            if torch.rand(1) > self.module_dropout:  # LoHa's form: run it
                x = torch.relu(self.inner(x))
            if torch.rand([]) < self.layerdrop:  # LayerDrop's form: skip the rest
                return x
            return self.outer(x)

    def saved_in(*p):
        trace = fake_gpu.trace_step(MaybeSkipped(*p), torch.randn(4, 8), drops=False)
        return {r.module for r in trace.saved} - {""}  # ("": the loss's)

    assert saved_in(0.0, 0.0) == saved_in(0.5, 0.5) == {"inner", "outer"}
    assert saved_in(1.0, 0.0) == {"outer"} and saved_in(0.0, 1.0) == {"inner"}  # (a share of 1 always skips)


class _Scan(nn.Module):
    """A recurrence over the slices of one projection: 2 x 64 gradients accumulate into its buffer."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        a = self.proj(x)
        h = torch.zeros_like(a[:, 0])
        for i in range(a.shape[1]):
            h = a[:, i] * h + a[:, i]
        return h


class _Tied(nn.Module):
    """A weight used twice (tied embeddings): its second gradient meets the first, a view."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(4000, 64)
        self.body = nn.Linear(64, 64)

    def forward(self, ids):
        return torch.nn.functional.linear(torch.relu(self.body(self.embed(ids))), self.embed.weight)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
@pytest.mark.parametrize("model, x", [(_Scan(), torch.randn(8, 64, 32)),
                                     (_Tied(), torch.randint(0, 4000, (2, 16)))], ids=["scan", "tied"])
def test_gradients_accumulate_in_place_where_autograd_adds_them_in_place(model, x):
    """Autograd's engine adds a second gradient into a tensor's buffer in place when it holds
    the buffer's last reference, but never under a Python dispatch mode, which the trace runs
    under: the scan was traced 19% over a real step (one more gradient of the projection's
    size). A buffer that is a view (the tied weight's first gradient, a transpose) is added
    out of place by the engine too, and stays so."""
    trace = fake_gpu.trace_step(model, x)
    assert trace.peak_bytes == pytest.approx(cpu_step_peak(model, x), rel=0.01)
    assert max(op.live_bytes for op in trace.ops) == trace.peak_bytes


class _Reentrant(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(32, 64)
        self.block = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        # (no RNG state kept: on a CPU it is 5 KB of the step's memory, on a GPU host memory)
        return self.head(torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True,
                                                           preserve_rng_state=False))


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_a_reentrant_checkpoint_is_traced_with_its_recompute_left_to_autograd():
    """A reentrant checkpoint runs its region again inside backward, where the runtime leaves
    what it saves to autograd (cswap.runtime.hook_context): the trace records what forward
    saved, and counts the recompute's memory. Its trace failed ("saved different tensors
    in two traces"): the recompute's saves went through the trace's own hooks."""
    model, x = _Reentrant(), torch.randn(64, 32)
    trace = fake_gpu.trace_step(model, x)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        value = copy.deepcopy(model)(x).mean()
    value.backward()
    assert [r.shape for r in trace.saved] == [tuple(s) for s in saved]
    assert trace.peak_bytes == pytest.approx(cpu_step_peak(model, x), rel=0.01)


class _PartlyIdle(nn.Module):
    """Trainable parameters the step gives no gradient: a part run under no_grad and a head
    never called (a classifier left over, a pooler)."""

    def __init__(self):
        super().__init__()
        self.frozen_by_code = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        self.body = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        self.unused_head = nn.Linear(64, 512)

    def forward(self, x):
        with torch.no_grad():
            h = self.frozen_by_code(x)
        return self.body(h + x)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_parameters_without_a_gradient_hold_no_optimizer_state():
    """A real optimizer skips a parameter whose gradient is None: it never has momentum or
    moments. The trace gave every trainable parameter a steady state (22% over a real
    step for a model with a fifth of its weights idle); it now traces again without theirs,
    and names them."""
    model, x = _PartlyIdle(), torch.randn(32, 64)
    idle = ("frozen_by_code.0.weight", "frozen_by_code.0.bias", "frozen_by_code.2.weight", "frozen_by_code.2.bias",
            "unused_head.weight", "unused_head.bias")
    trace = fake_gpu.trace_step(model, x)
    assert trace.idle_parameters == idle
    assert trace.peak_bytes == pytest.approx(cpu_step_peak(model, x), rel=0.01)
    momentum = sum(p.numel() * 4 for n, p in model.named_parameters() if n not in idle)
    assert trace.peak_by_kind["opt"] == momentum
    # stepped in backward, Adam's state and its step's temporaries: as for the busy part alone
    in_backward = fake_gpu.trace_step(model, x, optimizer="adam", optimizer_in_backward=True, drops=False)
    busy = fake_gpu.trace_step(model.body, x, optimizer="adam", optimizer_in_backward=True, drops=False)
    assert in_backward.idle_parameters == idle and busy.idle_parameters == ()
    assert in_backward.peak_by_kind["opt"] == busy.peak_by_kind["opt"] > 2 * momentum


def test_a_torch_function_mode_sees_what_a_python_torch_function_calls_inside():
    """cswap.plan.nested: a mode handles a call with itself off, so it missed the calls inside
    F.multi_head_attention_forward (SDPA, the projections); with call_seen it sees them, and a
    Tensor method written in Python (handing its work to the C method, which reports it
    again) is still seen once."""
    from torch.overrides import TorchFunctionMode

    from cswap.plan.nested import call_seen

    class Names(TorchFunctionMode):
        def __init__(self, seen: bool):
            super().__init__()
            self.seen, self.names = seen, []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", ""))
            return call_seen(self, func, args, kwargs) if self.seen else func(*args, **(kwargs or {}))

    attention, x = nn.MultiheadAttention(16, 2, batch_first=True), torch.randn(2, 4, 16)
    expected = attention(x, x, x, need_weights=False)[0]
    for seen in (False, True):
        with Names(seen) as mode:
            out = attention(x, x, x, need_weights=False)[0]
        assert torch.equal(out, expected)
        assert ("scaled_dot_product_attention" in mode.names) == seen
        assert ("linear" in mode.names) == seen
        t = torch.randn(2, 6)
        with Names(seen) as mode:
            t.unflatten(1, (2, 3))
        assert mode.names == ["unflatten"]


def test_a_fake_tensors_storage_reference_lives_as_long_as_the_tensor():
    """What cswap.plan.accumulation reads a buffer's death from: a weak reference to its
    storage's Python object, alive while any tensor uses the storage (torch keeps the
    object with the storage), dead once none does."""
    import gc
    import weakref

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        t = torch.empty(4, 8, device="meta")
        ref = weakref.ref(t.untyped_storage())
        gc.collect()
        assert ref() is not None
        view = t[1:]
        del t
        gc.collect()
        assert ref() is not None  # (a view still uses it)
        del view
        assert ref() is None
