"""Today's models at tiny sizes, built from configs with random weights (nothing is
downloaded): Hugging Face transformers (GPT-2, a Llama-style decoder, a Qwen3
Mixture-of-Experts decoder, BERT, T5, BART), peft LoRA and QLoRA, timm (ViT, ConvNeXt) and
torchvision (ResNet-18, MobileNetV3). Two layers, hidden 64, short sequences: a training
step takes milliseconds on a CPU.

Each entry builds (model, inputs): inputs a cswap.plan.inputs.Inputs whose call
returns something default_loss turns into the step's loss.
"""

from __future__ import annotations

import pytest
import torch

from cswap.plan.hf import enable_checkpointing
from cswap.plan.inputs import Inputs, default_loss

VOCAB = 128


def _hf():
    return pytest.importorskip("transformers")


def _tokens(batch: int, seq: int, *, labels: bool = True, seed: int = 0) -> Inputs:
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return Inputs((), {"input_ids": ids, **({"labels": ids} if labels else {})})


def gpt2(seq: int = 16):
    tf = _hf()
    config = tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=max(seq, 64),
                           bos_token_id=0, eos_token_id=0)
    return tf.GPT2LMHeadModel(config), _tokens(2, seq)


def llama_config(seq: int = 16, **extra):
    return _hf().LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=max(seq, 64),
                             bos_token_id=0, eos_token_id=0, pad_token_id=0, **extra)


def llama(seq: int = 16, **extra):
    return _hf().LlamaForCausalLM(llama_config(seq, **extra)), _tokens(2, seq)


def llama_checkpointed(seq: int = 16):
    model, inputs = llama(seq)
    enable_checkpointing(model)  # (transformers' own, as cswap-plan's --gradient-checkpointing)
    return model, inputs


def llama_lora(seq: int = 16):
    peft = pytest.importorskip("peft")
    model, inputs = llama(seq)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])), inputs


def llama_qlora(seq: int = 16):
    """QLoRA: LoRA adapters on a base whose frozen linear layers are held in NF4 (cswap-plan's
    model of them, cswap.plan.quantized; it dequantizes for real on a CPU)."""
    from cswap.plan.quantized import nf4

    model, inputs = llama_lora(seq)
    return nf4(model), inputs


def llama_bf16(seq: int = 16):
    model, inputs = llama(seq)
    return model.to(torch.bfloat16), inputs


def qwen3_moe(seq: int = 16, **extra):
    """A Mixture-of-Experts decoder: each token's MLP is 2 of 4 experts, run as one grouped
    matmul (torch._grouped_mm, transformers' default)."""
    tf = _hf()
    config = tf.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                               num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                               max_position_embeddings=max(seq, 64), bos_token_id=0, eos_token_id=0, pad_token_id=0,
                               **extra)
    return tf.Qwen3MoeForCausalLM(config), _tokens(2, seq)


def qwen3_moe_lora(seq: int = 16):
    """LoRA on every linear layer of the MoE decoder, its expert stacks included: peft adapts
    those as parameters (a parametrization that folds W + BA in one baddbmm, under its own
    torch.autocast(W.device.type, enabled=False))."""
    peft = pytest.importorskip("peft")
    model, inputs = qwen3_moe(seq)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear")), inputs


def bert(seq: int = 16):
    tf = _hf()
    config = tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                           vocab_size=VOCAB, max_position_embeddings=max(seq, 64))
    return tf.BertForMaskedLM(config), _tokens(2, seq)


def t5(seq: int = 16):
    tf = _hf()
    config = tf.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=VOCAB,
                         decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return tf.T5ForConditionalGeneration(config), _tokens(2, seq)


def bart(seq: int = 16):
    tf = _hf()
    config = tf.BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=VOCAB,
                           max_position_embeddings=max(seq, 64), pad_token_id=1, bos_token_id=0, eos_token_id=2,
                           decoder_start_token_id=2, forced_eos_token_id=2)
    return tf.BartForConditionalGeneration(config), _tokens(2, seq)


def _image(batch: int = 2, size: int = 32) -> Inputs:
    return Inputs((torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0)),))


def vit():
    timm = pytest.importorskip("timm")
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             num_classes=10), _image()


def convnext():
    timm = pytest.importorskip("timm")
    return timm.create_model("convnext_atto", pretrained=False, num_classes=10), _image()


def resnet18():
    tv = pytest.importorskip("torchvision")
    return tv.models.resnet18(num_classes=10), _image()


def mobilenet_v3():
    tv = pytest.importorskip("torchvision")
    return tv.models.mobilenet_v3_small(num_classes=10), _image()


MODELS = {f.__name__: f for f in (gpt2, llama, llama_checkpointed, llama_lora, llama_qlora, llama_bf16, qwen3_moe,
                                  qwen3_moe_lora,
                                  bert, t5, bart, vit, convnext, resnet18, mobilenet_v3)}


def build(name: str, **kwargs):
    torch.manual_seed(0)
    return MODELS[name](**kwargs)


class Attention(torch.nn.Module):
    """One bare attention layer (projections, SDPA, output): what attention saves, alone."""

    def __init__(self, hidden: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.out = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        b, n, h = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, h))


def attention(seq: int = 16):
    return Attention(), Inputs((torch.randn(2, seq, 64, generator=torch.Generator().manual_seed(0)),))


MODELS["attention"] = attention


class BiasedAttention(Attention):
    """Attention with a learned bias as its mask (a relative position bias: MaxViT, CoAtNet),
    which needs a gradient: the CPU takes the math path for it."""

    def __init__(self, seq: int, hidden: int = 64, heads: int = 4):
        super().__init__(hidden, heads)
        self.bias = torch.nn.Parameter(torch.randn(heads, seq, seq) * 0.02)

    def forward(self, x):
        b, n, h = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return self.out(y.transpose(1, 2).reshape(b, n, h))


def attention_bias(seq: int = 16):
    return BiasedAttention(seq), Inputs((torch.randn(2, seq, 64, generator=torch.Generator().manual_seed(0)),))


MODELS["attention_bias"] = attention_bias


class PaddedRows(torch.nn.Module):
    """Two layers whose outputs are laid out in padded rows (a wider stride than their
    width, as torch.empty_strided makes them) and saved so: activations not dense in
    memory that view no other tensor, the one kind cswap gathers into a block to send
    (and restores contiguous; sin's gradient reads them element by element)."""

    def __init__(self, hidden: int = 64, pad: int = 8):
        super().__init__()
        self.pad = pad
        self.layers = torch.nn.ModuleList([torch.nn.Linear(hidden, hidden) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            y = layer(x)
            b, n, h = y.shape
            padded = torch.empty_strided(y.shape, (n * (h + self.pad), h + self.pad, 1)).copy_(y)
            x = torch.sin(padded)
        return x


def padded_rows(seq: int = 16):
    return PaddedRows(), Inputs((torch.randn(2, seq, 64, generator=torch.Generator().manual_seed(0)),))


MODELS["padded_rows"] = padded_rows


class PreNormBlock(torch.nn.Module):
    """A pre-norm transformer block: LayerNorm, attention, LayerNorm, GELU MLP, residuals."""

    def __init__(self, hidden: int = 64, heads: int = 4):
        super().__init__()
        self.norm1, self.attention = torch.nn.LayerNorm(hidden), Attention(hidden, heads)
        self.norm2 = torch.nn.LayerNorm(hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def prenorm_transformer(seq: int = 64):
    """Two pre-norm blocks at batch 8: activations outweigh the weights, as in training."""
    model = torch.nn.Sequential(PreNormBlock(), PreNormBlock())
    return model, Inputs((torch.randn(8, seq, 64, generator=torch.Generator().manual_seed(0)),))


MODELS["prenorm_transformer"] = prenorm_transformer


def llama_masked(seq: int = 16):
    """A Llama given the all-ones attention mask a tokenizer returns for an unpadded batch."""
    model, inputs = llama(seq)
    ids = inputs.kwargs["input_ids"]
    return model, Inputs((), {**inputs.kwargs, "attention_mask": torch.ones_like(ids)})


MODELS["llama_masked"] = llama_masked


def llama_padded(seq: int = 16):
    """A Llama given a batch whose first sequence is padded (its last quarter masked out):
    SDPA gets a boolean mask."""
    model, inputs = llama(seq)
    mask = torch.ones_like(inputs.kwargs["input_ids"])
    mask[0, seq - seq // 4:] = 0
    return model, Inputs((), {**inputs.kwargs, "attention_mask": mask})


def mistral_sliding(seq: int = 16):
    """Mistral with a sliding window of a quarter of the sequence: SDPA gets a boolean mask."""
    tf = _hf()
    config = tf.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=max(seq, 64),
                              sliding_window=max(seq // 4, 1), bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return tf.MistralForCausalLM(config), _tokens(2, seq)


MODELS["llama_padded"] = llama_padded
MODELS["mistral_sliding"] = mistral_sliding


def torch_encoder(seq: int = 16):
    """PyTorch's own transformer layers (nn.TransformerEncoderLayer, whose nn.MultiheadAttention
    calls SDPA from inside F.multi_head_attention_forward, as torchvision's ViT does)."""
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    return model, Inputs((torch.randn(2, seq, 64, generator=torch.Generator().manual_seed(0)),))


MODELS["torch_encoder"] = torch_encoder


def largest_saved(model, inputs) -> int:
    """The largest storage autograd saves in one step of the model: how far a budgeted step
    may exceed its budget (docs/budget.md, limits)."""
    sizes = []

    def pack(t):
        sizes.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        default_loss(inputs(model)).backward()
    return max(sizes)
