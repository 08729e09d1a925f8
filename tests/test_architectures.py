"""cswap-plan and the runtime across today's decoder architectures, built tiny from configs.

Each architecture brings its own attention (sliding windows, MLA, fused qkv, parallel
blocks), norms, MoE routing and linear classes; a sweep of them found four faults that the
Llama-style tests did not (CHANGELOG, 2026-12-02). These keep them found: cswap-plan with
LoRA and checkpointing, compiled with a chunked loss, and as QLoRA; and training through
cswap bit-exact with LoRA and checkpointing on the emulated device.
"""

from __future__ import annotations

import pytest
import torch

import cswap
from cswap.plan.inputs import Inputs
from test_modern_models import assert_trains_bit_identical

pytestmark = [pytest.mark.slow,  # (about a minute in all: each plan traces the step two or three times)
              pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning",
                                         "ignore::UserWarning", "ignore::RuntimeWarning")]
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, pad_token_id=0, bos_token_id=0,
              eos_token_id=0)
CONFIGS = {
    "gemma3": lambda: transformers.Gemma3TextConfig(**_SMALL, head_dim=16),  # sliding windows, four norms
    "phi3": lambda: transformers.Phi3Config(**_SMALL),  # fused qkv and gate_up projections
    "mixtral": lambda: transformers.MixtralConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(  # multi-head latent attention, shared experts
        **_SMALL, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, q_lora_rank=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
        n_group=1, topk_group=1),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                   num_attention_heads=4, vocab_size=512),  # parallel blocks
    "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512),  # Conv1D layers
}
PLANS = {
    "lora-checkpointed": ["--lora-rank", "4", "--gradient-checkpointing", "--dtype", "bf16", "--budget", "50%"],
    "compiled-chunked": ["--compile", "--chunked-loss", "2", "--dtype", "bf16"],
    "qlora": ["--lora-rank", "4", "--quantize", "nf4", "--dtype", "bf16"],
}


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    for name, make in CONFIGS.items():
        make().save_pretrained(root / name)
    return root


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cswap_plan_predicts_the_architecture(config_dirs, name, plan, capsys):
    from cswap.cli.plan import main

    assert main(["--hf-config", str(config_dirs / name), "--seq-len", "32", "--batch", "2", "--gpu",
                 "a100-sxm4-80gb", "--no-largest-batch", *PLANS[plan]]) == 0
    out = capsys.readouterr().out
    assert "PREDICTED" in out and "budget" in out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_with_lora_and_checkpointing_is_bit_identical(name):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    ids = torch.randint(1, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    assert_trains_bit_identical(model, Inputs(kwargs={"input_ids": ids, "labels": ids}))
