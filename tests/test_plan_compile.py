"""cswap-plan --compile (issue 40 §2): the step as torch.compile runs it, from the graphs
AOTAutograd's min-cut partitioner makes (the whole model, or each repeated layer as
torchtune compiles), replayed in the fake trace; and inductor's fusion of pointwise ops in
the time model."""

from __future__ import annotations

import copy

import pytest
import torch

import cswap
import modern
from cswap.plan import compiled, fake_gpu, roofline
from cswap.plan.gpus import gpu


def _fake(model, inputs):
    """A copy of `model` and `inputs` as fake CPU tensors (as cswap.plan.fake_gpu captures)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = copy.deepcopy(model)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_gpu._to_fake(model, torch.device("cpu"))
        inputs = fake_gpu._fake_inputs(inputs, torch.device("cpu"))
    return model, inputs


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model, inputs = modern.llama(seq=32)
    model.config.use_cache = False
    return model, inputs


@pytest.fixture(scope="module")
def captured(llama):
    return compiled.capture(*_fake(*llama))


def test_the_captured_graphs_compute_the_eager_step(llama, captured):
    """Replayed on real CPU tensors, the captured forward and backward give the eager
    loss and gradients (the graphs were captured on "meta": only their plumbing, the
    primals by name, the tangents and the saved tensors, is checked here)."""
    model, inputs = llama
    eager = copy.deepcopy(model)
    loss = inputs(eager).loss
    loss.backward()
    replayed = copy.deepcopy(model)
    out = captured.moved(torch.device("cpu")).replay(replayed, inputs)
    out.loss.backward()  # (the model's own output type: its structure was kept)
    torch.testing.assert_close(out.loss, loss, rtol=1e-5, atol=1e-5)
    grads = dict(eager.named_parameters())
    for name, p in replayed.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)
    assert captured.saved > 0 and captured.tangents >= 1
    assert {kind for kind, _ in captured.primals} >= {"param", "input"}


@pytest.mark.parametrize("make", [modern.llama, modern.llama_checkpointed])
def test_each_transformer_layer_is_compiled_on_its_own_and_computes_the_eager_step(make):
    """Regional compilation (torchtune's): the decoder layers, alike, share one capture;
    replayed on real CPU tensors in place of each layer's forward, the step's loss and
    gradients are the eager ones. Checkpointed too (torch 2.11 wraps the attention kernel
    of a checkpointed region in random-state operators, which the capture unwraps)."""
    torch.manual_seed(0)
    model, inputs = make(seq=32)
    model.config.use_cache = False
    regions = compiled.capture_blocks(*_fake(model, inputs), ["model.layers.0", "model.layers.1"])
    assert set(regions) == {"model.layers.0", "model.layers.1"}
    assert regions["model.layers.0"] is regions["model.layers.1"]
    eager = copy.deepcopy(model)
    loss = inputs(eager).loss
    loss.backward()
    replayed = copy.deepcopy(model)
    compiled.replay_blocks(replayed, {n: c.moved(torch.device("cpu")) for n, c in regions.items()})
    out = inputs(replayed)
    out.loss.backward()
    torch.testing.assert_close(out.loss, loss, rtol=1e-5, atol=1e-5)
    grads = dict(eager.named_parameters())
    for name, p in replayed.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow  # (five captures and two traces: the quick set stays under its five minutes)
def test_a_chunked_loss_is_compiled_chunk_by_chunk_as_torchtune_compiles_it():
    """Under compile each chunk's upcast and cross-entropy is a compiled region of its own
    (torchtune's compile_loss), the chunks alike sharing one capture: replayed on real CPU
    tensors it gives the eager loss and gradients, and it saves no float32 logits for
    backward, where eager saves each chunk's float32 log-softmax."""
    from cswap.plan.hf import ChunkedLoss

    torch.manual_seed(0)
    model, inputs = modern.llama(seq=32)
    model.config.use_cache = False
    step = ChunkedLoss(model, 4)
    ids = inputs.kwargs["input_ids"]
    chunks = [f"cross_entropy.{i}" for i in range(4)]
    regions = compiled.capture_blocks(*_fake(step, fake_gpu.Inputs((ids, ids), {})), chunks)
    assert set(regions) == set(chunks) and len({id(c) for c in regions.values()}) == 1
    eager = copy.deepcopy(step)
    loss = eager(ids, ids)
    loss.backward()
    replayed = copy.deepcopy(step)
    compiled.replay_blocks(replayed, {n: c.moved(torch.device("cpu")) for n, c in regions.items()})
    out = replayed(ids, ids)
    out.backward()
    torch.testing.assert_close(out, loss, rtol=1e-5, atol=1e-5)
    grads = dict(eager.named_parameters())
    for name, p in replayed.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)

    def float_logits(trace):
        return {r.storage for r in trace.activations() if r.dtype == torch.float32 and r.shape[-1:] == (modern.VOCAB,)}

    bf16 = {"drops": False, "dtype": torch.bfloat16, "optimizer": "adamw"}
    assert len(float_logits(fake_gpu.trace_step(step, {"input_ids": ids, "labels": ids}, **bf16))) == 4
    traced = fake_gpu.trace_step(step, {"input_ids": ids, "labels": ids}, compile=True, **bf16)
    assert float_logits(traced) == set()
    assert any(op.compiled and op.module.startswith("cross_entropy.") for op in traced.ops)


def test_a_compiled_step_saves_what_the_partitioner_saves(llama):
    """Compiled layers save fewer bytes than eager ones (the partitioner recomputes norms
    and activations in backward); every saved tensor is used in backward; the layers' ops
    are marked compiled, the optimizer's are not."""
    model, inputs = llama
    eager = fake_gpu.trace_step(model, inputs, optimizer="adamw", drops=False)
    traced = fake_gpu.trace_step(model, inputs, optimizer="adamw", drops=False, compile=True)
    assert sum(r.nbytes for r in traced.activations()) < sum(r.nbytes for r in eager.activations())
    assert all(r.use is not None for r in traced.saved)
    assert any(op.compiled for op in traced.ops) and not any(op.compiled for op in eager.ops)
    assert all(not op.compiled for op in traced.ops if op.phase == "optimizer")
    # the compiled ops' pointwise runs take less as fused kernels than op by op
    ops = [op for op in traced.ops if op.compiled]
    a100, m = gpu("a100-sxm4-80gb"), roofline.time_model()[0]
    assert roofline.op_times(ops, a100, "bf16", m).sum() < sum(roofline.op_seconds(op, a100, "bf16", m) for op in ops)


def test_predict_with_compile_says_so_and_fuses(llama):
    model, inputs = llama
    a100 = "a100-sxm4-80gb"
    eager = cswap.predict(model, inputs, a100, precision="bf16", optimizer="adamw", recompute=False)
    fused = cswap.predict(model, inputs, a100, precision="bf16", optimizer="adamw", recompute=False, compile=True)
    assert "compiled" in fused.sources["memory"] and "compiled" not in eager.sources["memory"]
    assert fused.peak_bytes("none") != eager.peak_bytes("none")
    assert set(fused.modes) == set(eager.modes)


def _op(name, reads=(), writes=(), compiled=True, phase="forward", flops=0):
    nbytes = sum(n for _, n in reads) + sum(n for _, n in writes)
    return fake_gpu.OpRecord(0, name, phase, flops, nbytes, torch.bfloat16, "", 0, tuple(reads), tuple(writes),
                             compiled)


def test_a_run_of_pointwise_ops_in_a_compiled_graph_is_one_kernel():
    """x -> mul -> add -> silu -> mm: the three pointwise ops read x once and write the
    silu output once (what the mm reads); their intermediates never reach memory."""
    h100 = gpu("h100-sxm-80gb")
    m = roofline.OpTimeModel(bandwidth_efficiency=0.5)
    mb = 64 << 20  # (far above the launch floor)
    ops = [_op("mul", [(1, mb)], [(2, mb)]), _op("add", [(2, mb)], [(3, mb)]), _op("silu", [(3, mb)], [(4, mb)]),
           _op("mm", [(4, mb), (9, mb)], [(5, mb)], flops=10**9)]
    times = roofline.op_times(ops, h100, "bf16", m)
    assert times[0] == pytest.approx(2 * mb / (h100.hbm_bytes_per_s * 0.5))  # x in, silu's out
    assert list(times[1:3]) == [0.0, 0.0]
    assert times[3] == roofline.op_seconds(ops[3], h100, "bf16", m)
    # eager (not compiled): each op on its own
    eager = [_op(o.name, o.reads, o.writes, compiled=False, flops=o.flops) for o in ops]
    assert list(roofline.op_times(eager, h100, "bf16", m)) == [roofline.op_seconds(o, h100, "bf16", m) for o in eager]
    # an intermediate read again later (saved for backward) is written too
    later = ops + [_op("mul", [(3, mb)], [(6, mb)], phase="backward")]
    assert roofline.op_times(later, h100, "bf16", m)[0] == pytest.approx(3 * mb / (h100.hbm_bytes_per_s * 0.5))


def test_an_op_with_side_effects_is_captured_and_replayed():
    """torch.linalg.solve checks its result for errors, an op with side effects that
    AOTAutograd threads through a token (peft's BOFT solves a Cayley transform
    per step): the graphs take only the step's primals and compute the eager step."""

    class Cayley(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.skew = torch.nn.Parameter(torch.randn(4, 4) * 0.1)

        def forward(self, x):
            q = self.skew - self.skew.T
            eye = torch.eye(4)
            return x @ torch.linalg.solve(eye + q, eye - q)

    torch.manual_seed(0)
    model, x = Cayley(), torch.randn(3, 4)
    captured = compiled.capture(*_fake(model, cswap.plan.inputs.Inputs((x,))))
    assert [kind for kind, _ in captured.primals] == ["param", "input"]
    eager = copy.deepcopy(model)
    eager(x).mean().backward()
    replayed = copy.deepcopy(model)
    out = captured.moved(torch.device("cpu")).replay(replayed, cswap.plan.inputs.Inputs((x,)))
    out.mean().backward()
    torch.testing.assert_close(out, eager(x))
    torch.testing.assert_close(replayed.skew.grad, eager.skew.grad)


def test_the_output_keeps_its_structure_with_arguments_passed_on_and_outputs_without_gradient():
    """A T5 block returns (hidden, the position bias it was given, passed on) or, with a
    bias of its own, (hidden, its bias, a cross-attention bias that needs no gradient):
    dynamo returns a passed-on argument and a constant itself, not as graph outputs, and
    may order them otherwise. The replay rebuilds the output leaf for leaf, and gives
    backward the tangents of the outputs that needed gradients only."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.bias = torch.nn.Parameter(torch.randn(4))

        def forward(self, x, passed):
            return self.lin(x) + passed, passed, None, self.bias * 2, torch.zeros(3)

    torch.manual_seed(0)
    block, x, passed = Block(), torch.randn(2, 4), torch.randn(2, 4, requires_grad=True)
    inputs = cswap.plan.inputs.Inputs((x, passed))
    captured = compiled.capture(*_fake(block, inputs))
    assert [kind for kind, _ in captured.leaves] == ["output", "input", "constant", "output", "output"]
    assert captured.needs_grad is not None and sum(captured.needs_grad) == captured.tangents == 2
    eager = copy.deepcopy(block)
    expected = eager(x, passed)
    (expected[0].sum() + expected[3].sum()).backward()
    replayed = copy.deepcopy(block)
    got = captured.moved(torch.device("cpu")).replay(replayed, inputs)
    assert got[1] is passed and got[2] is None and len(got) == 5
    (got[0].sum() + got[3].sum()).backward()
    for a, b in zip(got, expected):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b)
    torch.testing.assert_close(replayed.lin.weight.grad, eager.lin.weight.grad)
    torch.testing.assert_close(replayed.bias.grad, eager.bias.grad)


def test_a_model_that_breaks_the_graph_is_refused_clearly():
    class Breaks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            print("a graph break")  # (dynamo cannot trace print into a graph)
            return y

    model, inputs = _fake(Breaks(), cswap.plan.inputs.Inputs((torch.zeros(2, 4),)))
    with pytest.raises(compiled.CompileUnsupported, match="one graph"):
        compiled.capture(model, inputs)


@pytest.mark.slow  # (two captures: the quick set stays under its five minutes)
def test_cswap_plan_compile_flag(tmp_path, capsys):
    from cswap.cli.plan import main

    config = modern.llama_config(seq=32)
    config.architectures = ["LlamaForCausalLM"]
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string())
    assert main(["--hf-config", str(path), "--seq-len", "32", "--batch", "2", "--gpu", "a100-sxm4-80gb",
                 "--dtype", "bf16", "--compile"]) == 0
    assert "compiled: the graphs torch.compile's partitioner makes" in capsys.readouterr().out
    assert main(["--hf-config", str(path), "--seq-len", "32", "--gpu", "a100-sxm4-80gb", "--dtype", "amp",
                 "--compile"]) == 2
    assert "autocast" in capsys.readouterr().err
