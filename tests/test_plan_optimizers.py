"""cswap.plan.optimizers: what bitsandbytes' optimizers and optimizer-in-backward hold, on the fake GPU."""

from __future__ import annotations

import math

import pytest
import torch

from cswap.plan import optimizers
from cswap.plan.fake_gpu import trace_step

transformers = pytest.importorskip("transformers")


def _llama():
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                      max_position_embeddings=64)
    ids = torch.zeros(2, 64, dtype=torch.long)
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def llama():
    return _llama()


def _opt_bytes(trace) -> int:
    return trace.peak_by_kind.get("opt", 0)


def test_adamw8bit_holds_two_bytes_per_value_and_a_float_per_256_and_small_tensors_in_fp32(llama):
    model, inputs = llama
    expected = 0
    for p in model.parameters():
        n = p.numel()
        expected += 2 * (n + 4 * math.ceil(n / 256)) if n >= 4096 else 8 * n
    assert any(p.numel() < 4096 for p in model.parameters())  # (norms: the float32 rule is exercised)
    trace = trace_step(model, inputs, optimizer="adamw8bit", drops=False)
    assert _opt_bytes(trace) == expected
    adamw = trace_step(model, inputs, optimizer="adamw", drops=False)
    assert _opt_bytes(adamw) > 3.5 * _opt_bytes(trace)


@pytest.mark.parametrize("name,per_value", [("paged_adamw", 8), ("paged_adamw8bit", 2)])
def test_paged_state_is_outside_the_peak_and_reported(llama, name, per_value):
    """bitsandbytes pages the two states of each tensor of 100,000 elements or more; the
    states of smaller ones, and the 8-bit states' absmax (a float per 256), stay on the
    device, in PyTorch's allocator."""
    model, inputs = llama
    sizes = [p.numel() for p in model.parameters()]
    assert any(n < 100_000 for n in sizes) and any(n >= 100_000 for n in sizes)  # (both rules exercised)
    quantized = name.endswith("8bit")

    def on_device(n):
        absmax = 2 * 4 * math.ceil(n / 256) if quantized and n >= 4096 else 0
        return absmax + (0 if n >= 100_000 else 2 * n if quantized and n >= 4096 else 8 * n)

    assert optimizers.paged_bytes(name, model) == per_value * sum(n for n in sizes if n >= 100_000)
    assert _opt_bytes(trace_step(model, inputs, optimizer=name, drops=False)) == sum(map(on_device, sizes))
    assert optimizers.paged_bytes("adamw8bit", model) == 0


def test_optimizer_in_backward_frees_each_gradient_once_applied(llama):
    model, inputs = llama
    after = trace_step(model, inputs, optimizer="adamw", drops=False)
    during = trace_step(model, inputs, optimizer="adamw", drops=False, optimizer_in_backward=True)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert after.peak_by_kind["grad"] == grads  # every gradient alive at the optimizer step
    assert during.peak_by_kind["grad"] < grads / 4
    assert during.peak_bytes < after.peak_bytes
    assert not any(op.phase == "optimizer" for op in during.ops)  # (the steps ran in backward)
    assert _opt_bytes(during) == pytest.approx(_opt_bytes(after), rel=1e-3)  # (the same states)


def test_an_unknown_optimizer_names_the_known_ones(llama):
    model, inputs = llama
    with pytest.raises(ValueError, match="adamw8bit"):
        trace_step(model, inputs, optimizer="lion", drops=False)


def test_cswap_plan_prints_the_optimizer_and_the_paged_state(tmp_path, capsys):
    from cswap.cli.plan import main

    model, _ = _llama()
    path = tmp_path / "config.json"
    path.write_text(model.config.to_json_string())
    assert main(["--hf-config", str(path), "--seq-len", "32", "--optimizer", "paged_adamw8bit",
                 "--optimizer-in-backward", "--gpu", "rtx-a6000", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "paged_adamw8bit in backward" in out
    assert "GiB of paged optimizer state in unified memory" in out


def test_paged_state_beyond_what_the_gpu_has_left_crosses_the_link_each_step(llama):
    import cswap

    model, inputs = llama
    roomy = cswap.predict(model, inputs, "a100-80gb", optimizer="paged_adamw", recompute=False)
    assert roomy.modes["none"].paging_seconds == 0  # (an 80 GB GPU holds the tiny model's state)
    peak, paged = roomy.peak_bytes("none"), roomy.paged_bytes
    tight = cswap.predict(model, inputs, "a100-80gb", optimizer="paged_adamw", recompute=False,
                          budget=peak + paged // 2)
    mode = tight.modes["none"]
    link = roomy.gpu.link_bytes_per_s * 0.8  # (the assumed link: LINK_EFFICIENCY of its rate)
    assert mode.paging_seconds == pytest.approx(2 * (paged - paged // 2) / link, rel=1e-6)
    assert mode.step_seconds == pytest.approx(roomy.step_seconds("none") + mode.paging_seconds)


def test_a_parameter_without_a_gradient_has_no_paged_state_and_is_named():
    """A head the step never calls gets no gradient, so no state, paged or not."""
    import cswap

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)

        def forward(self, x):
            return self.used(x)

    model = Model()
    assert optimizers.paged_bytes("paged_adamw", model) == 2 * 8 * 512 * 512
    assert optimizers.paged_bytes("paged_adamw", model, ("unused.weight", "unused.bias")) == 8 * 512 * 512
    p = cswap.predict(model, torch.randn(4, 512), "a100-80gb", optimizer="paged_adamw", recompute=False)
    assert p.paged_bytes == 8 * 512 * 512
    assert "2 trainable parameters get no gradient in this step (unused.weight, unused.bias" in p.summary()
