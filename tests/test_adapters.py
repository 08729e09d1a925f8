"""peft's adapters beyond LoRA, through cswap-plan and the runtime, on a tiny Llama.

Each adapter brings its own forward: DoRA's weight norm, IA3's scaling vectors, LoHa's
and LoKr's Hadamard and Kronecker products (skipped at random by a module dropout), VeRA's
shared matrices, OFT's and BOFT's orthogonal transforms (a linear solve per step), and
prompt and prefix tuning's virtual tokens. A sweep of them found two faults that LoRA did
not (CHANGELOG, 2026-12-03): these keep them found. Every adapter is predicted eager and
compiled, and trained through cswap bit-exact on the emulated device.
"""

from __future__ import annotations

import pytest
import torch

import cswap
from cswap.plan.inputs import Inputs
from test_modern_models import assert_trains_bit_identical

pytestmark = [pytest.mark.slow,  # (about a minute in all)
              pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning",
                                         "ignore::UserWarning", "ignore::RuntimeWarning")]
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

_QV = ["q_proj", "v_proj"]
ADAPTERS = {
    "dora": lambda: peft.LoraConfig(r=4, target_modules="all-linear", use_dora=True),
    "ia3": lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "loha": lambda: peft.LoHaConfig(r=4, target_modules=_QV, module_dropout=0.1),
    "lokr": lambda: peft.LoKrConfig(r=4, target_modules=_QV, module_dropout=0.1),
    "adalora": lambda: peft.AdaLoraConfig(r=4, target_modules=_QV, total_step=10),
    "vera": lambda: peft.VeraConfig(r=4, target_modules=_QV),
    "oft": lambda: peft.OFTConfig(r=0, oft_block_size=16, target_modules=_QV),
    "boft": lambda: peft.BOFTConfig(boft_block_size=8, target_modules=_QV),
    "prompt": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    "prefix": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
}
# (LoHa and LoKr skip a module at random, which dynamo cannot put in one graph, nor can torch.compile
# with fullgraph=True; prefix tuning hands each layer a key/value cache that it extends as it runs)
NOT_ONE_GRAPH = {"loha": "one graph", "lokr": "one graph", "prefix": "key/value cache"}


def _model(name: str, checkpointed: bool = False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=256, pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return peft.get_peft_model(model, ADAPTERS[name]())


def _ids():
    return torch.randint(1, 512, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_cswap_predict_plans_the_adapter_eager_and_compiled(name):
    ids = _ids()
    batch = {"input_ids": ids, "labels": ids}
    eager = cswap.predict(_model(name), batch, "a100-sxm4-80gb", precision="bf16", optimizer="adamw")
    assert eager.peak_bytes() > 0 and eager.step_seconds() > 0
    if name in NOT_ONE_GRAPH:
        with pytest.raises(cswap.plan.compiled.CompileUnsupported, match=NOT_ONE_GRAPH[name]):
            cswap.predict(_model(name), batch, "a100-sxm4-80gb", precision="bf16", compile=True)
        return
    compiled = cswap.predict(_model(name), batch, "a100-sxm4-80gb", precision="bf16", optimizer="adamw",
                             compile=True)
    assert 0 < compiled.peak_bytes() and 0 < compiled.step_seconds()


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_training_through_cswap_is_bit_identical(name):
    model = _model(name, checkpointed=name != "prefix")  # (peft refuses prefix tuning with checkpointing)
    ids = _ids()  # (LoHa's and LoKr's module dropout draws alike in both runs: train seeds each step)
    assert_trains_bit_identical(model, Inputs(kwargs={"input_ids": ids, "labels": ids}))
