"""cswap.plan.quantized: QLoRA's NF4 base weights, as cswap-plan models them."""

from __future__ import annotations

import collections
import json

import pytest
import torch

import modern
from cswap.plan import fake_gpu
from cswap.plan.quantized import BLOCK, SCALE_BLOCK, NF4Linear, nf4, nf4_bytes, nf4_dequantize

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


def test_nf4_takes_half_a_byte_a_value_and_its_double_quantized_scales():
    n = 4096 * 4096
    assert nf4_bytes(n) == n // 2 + n // BLOCK + 4 * n // (BLOCK * SCALE_BLOCK)
    assert nf4_bytes(n) / n == pytest.approx(0.516, abs=1e-3)
    layer = NF4Linear(torch.nn.Linear(100, 30, bias=False))  # 3000 values: a partial block and factor
    assert sum(b.numel() * b.element_size() for b in layer.buffers()) == nf4_bytes(3000) == 1500 + 47 + 4


def test_dequantize_looks_up_the_levels_and_scales_each_block():
    codes = torch.tensor([0x0F, 0x70], dtype=torch.uint8)  # levels 0 and 15, then 7 (zero) and 0
    scales = torch.tensor([2], dtype=torch.uint8)
    factors = torch.tensor([0.25]).view(torch.int32)  # (float32 bits)
    out = nf4_dequantize(codes, scales, factors, 3, torch.float32)  # the last code's second half unused
    assert out.tolist() == [-0.5, 0.5, 0.0]


def test_the_frozen_linear_layers_but_the_head_are_quantized_and_the_adapters_train():
    model, inputs = modern.build("llama_qlora")
    quantized = [name for name, m in model.named_modules() if isinstance(m, NF4Linear)]
    assert len(quantized) == 2 * 7  # q, k, v, o, gate, up and down in each of the two layers
    # (LoRA on q and v: their base layers; k, o and the MLP's as they were)
    assert {name.rsplit(".", 1)[-1] for name in quantized} == {"base_layer", "k_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"}
    assert isinstance(model.get_base_model().lm_head, torch.nn.Linear)
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n in adapters)
    plain, _ = modern.build("llama")
    with pytest.raises(ValueError, match="has none to quantize.*LoRA first"):
        nf4(plain)


def test_gpt2s_conv1d_layers_are_quantized_and_linear_subclasses_left_as_transformers_leaves_them():
    """transformers' bitsandbytes integration quantizes nn.Linear itself and its own Conv1D
    (GPT-2's layers, whose weight is (in, out)), not nn.Linear's subclasses (Falcon's)."""
    peft = pytest.importorskip("peft")
    gpt2, inputs = modern.build("gpt2")
    model = nf4(peft.get_peft_model(gpt2, peft.LoraConfig(r=2, target_modules=["c_attn"])))
    layers = {name: m for name, m in model.named_modules() if isinstance(m, NF4Linear)}
    assert {name.rsplit(".", 1)[-1] for name in layers} == {"base_layer", "c_proj", "c_fc"}
    c = gpt2.config
    assert {(m.in_features, m.out_features) for m in layers.values()} == \
        {(c.n_embd, 3 * c.n_embd), (c.n_embd, c.n_embd), (c.n_embd, 4 * c.n_embd), (4 * c.n_embd, c.n_embd)}
    assert fake_gpu.trace_step(model, inputs.kwargs, dtype=torch.bfloat16, drops=False).peak_bytes > 0

    class FalconLike(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = type("FalconLinear", (torch.nn.Linear,), {})(8, 8)
            self.dense.requires_grad_(False)

    with pytest.raises(ValueError, match="this model's are FalconLinear, subclasses it leaves unquantized"):
        nf4(FalconLike())


def test_a_qlora_step_dequantizes_per_multiply_and_saves_no_input_for_the_base():
    """Each weight is dequantized for forward's multiply and again for backward's (except where
    the input needs no gradient: the first layer's q, k and v), one op that reads the codes and
    writes the bf16 weight; the activations saved are LoRA's, the FLOPs the same."""
    lora, inputs = modern.build("llama_lora")
    qlora, _ = modern.build("llama_qlora")

    def trace(model):
        return fake_gpu.trace_step(model, inputs.kwargs, dtype=torch.bfloat16, drops=False)

    plain, quantized = trace(lora), trace(qlora)
    dequantized = collections.Counter(op.bytes for op in quantized.ops if op.name == "nf4_dequantize")
    square, kv, mlp = 64 * 64, 32 * 64, 64 * 128  # q and o; k and v (grouped queries); gate, up and down
    per_weight = {n: nf4_bytes(n) + 2 * n for n in (square, kv, mlp)}
    assert dequantized == {per_weight[square]: 4 + 3, per_weight[kv]: 4 + 2, per_weight[mlp]: 6 + 6}
    assert [r.shape for r in quantized.activations()] == [r.shape for r in plain.activations()]
    assert sum(op.flops for op in quantized.ops) == sum(op.flops for op in plain.ops)
    assert quantized.peak_bytes < plain.peak_bytes


def test_cswap_plan_takes_quantize_with_lora_and_says_what_it_assumed(tmp_path, capsys):
    from cswap.cli.plan import main

    config = modern.llama_config().to_dict() | {"architectures": ["LlamaForCausalLM"]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["--hf-config", str(path), "--seq-len", "32", "--lora-rank", "4", "--quantize", "nf4",
                 "--dtype", "bf16", "--gpu", "rtx-4090", "--tensors", "0"]) == 0
    assert "quantized assumed: 14 frozen linear layers held in NF4" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--hf-config", str(path), "--quantize", "nf4"])
    assert "--quantize needs --lora-rank" in capsys.readouterr().err
