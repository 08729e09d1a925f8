"""Hugging Face's Trainer drives a patched model as it drives any other: the trained
weights are the unpatched run's bit for bit, and a callback calls cswap.epoch_end at each
epoch's end (docs/integrations.md)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import cswap
from cswap.testing import emulated_device

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning",
                                        "ignore::UserWarning")


class EpochEnd(transformers.TrainerCallback):
    """What docs/integrations.md tells Trainer users to add."""

    def __init__(self):
        self.offloaded = []

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        cswap.epoch_end(model)
        self.offloaded.append(cswap.stats(model)["offloaded_tensors"])


def _train(tmp_path, patched: bool, bf16: bool, device) -> tuple[list[torch.Tensor], list[int]]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=100, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(1, 100, (16, 32), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(str(tmp_path / ("patched" if patched else "plain")),
                                          per_device_train_batch_size=4, num_train_epochs=2, use_cpu=True,
                                          bf16=bf16, seed=0, report_to=[], save_strategy="no",
                                          logging_strategy="no", disable_tqdm=True)
    callback = EpochEnd()
    with device():
        if patched:
            model = cswap.patch(model, min_bytes=0, verbose=False)
        data = [{"input_ids": r, "labels": r} for r in ids]
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                       callbacks=[callback] if patched else [])
        trainer.train()
    return [p.detach().clone() for p in model.parameters()], callback.offloaded


@pytest.mark.parametrize("bf16, device", [(False, contextlib.nullcontext), (True, emulated_device)],
                         ids=["fp32-cpu", "bf16-emulated"])
def test_trainer_trains_a_patched_model_bit_exact_and_epoch_end_runs(tmp_path, bf16, device):
    expected, _ = _train(tmp_path, False, bf16, contextlib.nullcontext)
    got, offloaded = _train(tmp_path, True, bf16, device)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert len(offloaded) == 2 and 0 < offloaded[0] < offloaded[1]  # (two epochs; the first step only looks)
