"""A Hugging Face model from its config file alone, on the "meta" device: no weights,
no download, built in a second at any size, for cswap.predict and cswap-plan --hf-config.

    model, inputs = from_config("config.json", batch=1, seq_len=4096, lora_rank=16,
                                gradient_checkpointing=True)
    cswap.predict(model, inputs, "l4-24gb", precision="bf16", optimizer="adam")

The class is the config's first `architectures` entry (LlamaForCausalLM, ...),
else the first that transformers can build from it of a sequence-to-sequence LM
(encoder-decoder configs), a masked LM (encoders such as BERT), a causal LM and
the bare model. Inputs are token ids with labels
equal to them, so the model computes its own loss (cswap.plan.inputs.default_loss).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .inputs import Inputs

__all__ = ["ChunkCrossEntropy", "ChunkedLoss", "enable_checkpointing", "from_config", "is_causal_lm"]

_AUTO_CLASSES = ("AutoModelForMaskedLM", "AutoModelForCausalLM", "AutoModel")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("cswap: --hf-config needs the transformers package: pip install transformers") from None
    return transformers


def _build(transformers, config):
    for name in (config.architectures or [])[:1]:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls(config)
    errors = []
    for name in ("AutoModelForSeq2SeqLM",) * bool(config.is_encoder_decoder) + _AUTO_CLASSES:
        try:
            return getattr(transformers, name).from_config(config)
        except (ValueError, KeyError) as exc:
            errors.append(f"{name}: {exc}")
    raise ValueError(f"cswap: no transformers model class builds from this config ({'; '.join(errors)[:400]})")


def enable_checkpointing(model) -> None:
    """The model's own activation checkpointing, non-reentrant: `activation_checkpointing_enable`
    (transformers 5.24 and later), else `gradient_checkpointing_enable`, its name before (a
    deprecated alias since, to be removed in transformers 6)."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", None):  # (transformers turns it off in checkpointed layers, and says so)
        config.use_cache = False
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class ChunkCrossEntropy(nn.Module):
    """One chunk's float32 cross-entropy, summed: torchtune's `compute_cross_entropy`, which
    its recipes compile on its own under compile (`training.compile_loss`); so does
    `--compile` (cswap.plan.fake_gpu)."""

    def forward(self, logits, targets):
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")


class ChunkedLoss(nn.Module):
    """A causal LM whose cross-entropy is computed in `chunks` pieces of the sequence, as
    torchtune's CEWithChunkedOutputLoss does: the output head makes the logits chunk by
    chunk (kept in the model's dtype), and each chunk is upcast to float32 only inside its
    own loss (a ChunkCrossEntropy per chunk). Without it (the model's own loss) the whole
    vocabulary x tokens logits are upcast at once, and three float32 copies are alive at the
    log-softmax's backward. As torchtune, every position is predicted and the labels are
    shifted by one with an ignored label last, so the chunks are alike. forward(input_ids,
    labels) returns the mean loss over the predicted tokens, the model's own (labels
    shifted by one, -100 ignored)."""

    def __init__(self, lm: nn.Module, chunks: int):
        super().__init__()
        if chunks < 1:
            raise ValueError(f"cswap: a chunked loss needs at least 1 chunk, got {chunks}")
        self.lm, self.chunks = lm, chunks
        self.cross_entropy = nn.ModuleList(ChunkCrossEntropy() for _ in range(chunks))

    def forward(self, input_ids, labels, **kwargs):
        base = self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm  # (peft)
        hidden = base.get_decoder()(input_ids=input_ids, **kwargs)[0]
        head = base.get_output_embeddings()
        logits = [head(h) for h in hidden.chunk(self.chunks, dim=1)]
        shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
        targets = shifted.chunk(self.chunks, dim=1)
        total = sum(loss(z, y) for loss, z, y in zip(self.cross_entropy, logits, targets))
        return total / (labels[:, 1:] != -100).sum()


def is_causal_lm(model: nn.Module) -> bool:
    """A Hugging Face causal LM (peft's wrapper seen through): what ChunkedLoss can wrap. The
    ...ForCausalLM classes, and the older LM-head ones transformers' AutoModelForCausalLM
    builds (GPT-2's GPT2LMHeadModel among them)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    if name.endswith("ForCausalLM"):
        return True
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    return name.endswith("LMHeadModel") and name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def _with_lora(peft, model, rank: int, targets):
    """`model` wrapped with peft LoRA of `rank` on `targets`; a target list that matches no
    module is an error that names the linear layers there are."""
    targets = targets if isinstance(targets, str) else list(targets)
    try:
        with torch.device("meta"), warnings.catch_warnings():
            # (peft asks the model for `is_gradient_checkpointing`, deprecated in transformers 5.24:
            # peft's call, not the user's, so not theirs to see)
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            return peft.get_peft_model(model, peft.LoraConfig(r=rank, target_modules=targets))
    except ValueError as exc:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"cswap: LoRA targets {targets!r} match no module of this model ({exc}); its linear "
                         f"layers are named {', '.join(linear)}") from None


def from_config(path, *, batch: int = 1, seq_len: int = 1024, lora_rank: int | None = None,
                lora_targets="all-linear", gradient_checkpointing: bool = False, chunked_loss: int | None = None,
                quantize: str | None = None):
    """(model on "meta", Inputs of token ids and labels) for the config at `path` (a
    config.json, or a folder holding one). lora_rank: wrap with peft LoRA of that rank
    (the base frozen) on `lora_targets`: "all-linear" (every linear layer but the output
    head) or module names as peft matches them (["q_proj", "v_proj", "o_proj"]: every module
    whose name ends so); gradient_checkpointing: the model's own activation checkpointing
    (enable_checkpointing); chunked_loss: a causal LM's loss in that many chunks
    (ChunkedLoss); quantize="nf4": QLoRA, the frozen linear layers held in 4-bit NF4
    (cswap.plan.quantized; needs lora_rank)."""
    transformers = _transformers()
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        doc = json.loads(path.read_text())
        config = transformers.AutoConfig.for_model(doc.pop("model_type"), **doc)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cswap: {path} is not a Hugging Face config.json with a model_type ({exc})") from None
    if quantize not in (None, "nf4"):
        raise ValueError(f"cswap: quantize must be 'nf4' (QLoRA's 4-bit base weights) or None, got {quantize!r}")
    if quantize and not lora_rank:
        raise ValueError("cswap: NF4 base weights are QLoRA's, which trains LoRA adapters beside them: give a "
                         "LoRA rank too (--lora-rank)")
    if batch < 1 or seq_len < 1:
        raise ValueError(f"cswap: batch and seq_len must be at least 1, got {batch} and {seq_len}")
    with torch.device("meta"):
        model = _build(transformers, config)
    if gradient_checkpointing:
        enable_checkpointing(model)
    if lora_rank:
        try:
            import peft
        except ImportError:
            raise ImportError("cswap: --lora-rank needs the peft package: pip install peft") from None
        model = _with_lora(peft, model, lora_rank, lora_targets)
    if quantize:
        from .quantized import nf4

        nf4(model)
    if chunked_loss:
        if not is_causal_lm(model):
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            raise ValueError(f"cswap: a chunked loss is a causal LM's; {type(base).__name__} is not one")
        model = ChunkedLoss(model, chunked_loss)
    model.train()
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    return model, Inputs((), {"input_ids": ids, "labels": ids})
