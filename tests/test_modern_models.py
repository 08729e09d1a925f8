"""Today's models (issue 25): Hugging Face transformers, peft LoRA, activation
checkpointing, bf16, timm and torchvision, built tiny from configs (tests/modern.py).

Per model: training patched in every mode is bit-identical to stock autograd over
three steps, on the CPU default and on the emulated device (no hazards), and
unpatch leaves the model as it was; a budget is met; cswap.predict runs on it,
and its traced peak is within 10% of a real CPU step's, with attention as the
CPU runs it, at short and long sequences.
"""

from __future__ import annotations

import copy
import logging
import math
import warnings

import pytest
import torch

import cswap
import modern
from cpu_memory import cpu_step_peak
from cswap.plan import attention, fake_gpu, grouped_mm, roofline
from cswap.plan.inputs import default_loss

pytestmark = [pytest.mark.filterwarnings("ignore:.*saves no memory:RuntimeWarning",
                                         "ignore:.*no profile for this device:RuntimeWarning",
                                         "ignore:.*use_cache=True.*is incompatible:UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")]

STEPS = 3
MODELS = [n for n in modern.MODELS if n not in ("attention", "attention_bias", "prenorm_transformer", "llama_masked",
                                                 "llama_padded", "mistral_sliding", "padded_rows")]


def train(model, inputs, device=None) -> list[list[torch.Tensor]]:
    """STEPS SGD steps (a seed per step: dropout draws the same masks); each step's gradients."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    grads = []
    for step in range(STEPS):
        torch.manual_seed(step)
        opt.zero_grad(set_to_none=True)
        if device == "emulated":
            with cswap.testing.emulated_device() as dev:
                default_loss(inputs(model)).backward()
            assert dev.hazards == []
        else:
            default_loss(inputs(model)).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        opt.step()
    return grads


def assert_trains_bit_identical(model, inputs, mode="cswap", device="emulated") -> None:
    """Train `model` patched (every saved activation a candidate) and a copy of it unpatched,
    STEPS steps each: the patched run offloads, and every step's gradients are the same
    bit for bit. The model is unpatched after."""
    expected = train(copy.deepcopy(model), inputs)
    patched = cswap.patch(model, mode=mode, candidates="all", min_bytes=0, verbose=False)
    try:
        got = train(patched, inputs, device)
        assert cswap.stats(patched)["offloaded_tensors"] > 0
    finally:
        cswap.unpatch(patched)
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected)):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step}: gradients differ"


def hook_counts(model):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()]


# The emulated device's half, the compressed modes on most models, and the heavier CNNs'
# peaks run in the slow set: the quick set stays within the README's five minutes on two cores.
@pytest.mark.parametrize("device", ["cpu", pytest.param("emulated", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name,mode", [
    pytest.param(name, mode, id=f"{name}-{mode}",
                 marks=() if mode == "vdnn" or name in ("llama", "llama_lora", "resnet18") else pytest.mark.slow)
    for name in MODELS for mode in ("vdnn", "sc", "cswap")])
def test_training_is_bit_identical_and_unpatch_restores(name, mode, device):
    model, inputs = modern.build(name)
    before = hook_counts(model)
    assert_trains_bit_identical(model, inputs, mode, device)
    assert hook_counts(model) == before


def _peak_on_emulated(model, inputs, steps=3) -> list[int]:
    peaks = []
    for step in range(steps):
        with cswap.testing.emulated_device(bandwidth_gbps=math.inf) as dev:
            torch.manual_seed(step)
            model.zero_grad(set_to_none=True)
            default_loss(inputs(model)).backward()
        assert dev.hazards == []
        peaks.append(dev.peak_bytes)
    return peaks


@pytest.mark.parametrize("name", ["prenorm_transformer", "llama", "vit"])
def test_a_budget_between_offload_all_and_none_is_met(name):
    """Transformers save views of one storage (q, k and v of a projection; a LayerNorm
    output and its 2-D view): the plan moves storages, so moving part frees what it says
    (planning per tensor, the pre-norm transformer peaked at up to 1.17x budgets at 0.05-0.15;
    nearer offload-all the profiled floor itself moves with thread timing)."""
    model, inputs = modern.build(name)
    stock = max(_peak_on_emulated(copy.deepcopy(model), inputs, 1))
    everything = cswap.patch(copy.deepcopy(model), mode="vdnn", candidates="all", min_bytes=0, verbose=False)
    try:
        floor = max(_peak_on_emulated(everything, inputs)[1:])
    finally:
        cswap.unpatch(everything)
    assert floor < stock
    largest = modern.largest_saved(copy.deepcopy(model), inputs)
    for fraction in (0.15, 0.3, 0.6):
        budget = int(floor + fraction * (stock - floor))
        patched = cswap.patch(copy.deepcopy(model), budget=budget, min_bytes=0, verbose=False)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                peaks = _peak_on_emulated(patched, inputs, 4)
        finally:
            cswap.unpatch(patched)
        # Planned steps within it, give or take one saved tensor (docs/budget.md, limits): the budget
        # is enforced at saves and uses. With the host's time per tensor counted (issue 26 §4) ViT's
        # plans keep more and sit at 0.95 of the budget; on the emulated device 2 runs in 25 peaked
        # above it, by up to half an MLP activation.
        assert max(peaks[1:]) <= budget + largest, (fraction, peaks, budget, floor, stock)


def _vit_budget_peaks(seeds) -> tuple[int, dict[int, list[int]]]:
    """ViT-tiny under a budget of 0.45x the unpatched step's peak on the emulated device
    (0.5 GB/s, jittery): each seed's peak in the three steps after the profiled one."""
    model, inputs = modern.build("vit")
    budget = int(0.45 * max(_peak_on_emulated(copy.deepcopy(model), inputs, 1)))
    peaks = {}
    for seed in seeds:
        patched = cswap.patch(copy.deepcopy(model), budget=budget, verbose=False)
        try:
            with warnings.catch_warnings(), \
                    cswap.testing.emulated_device(bandwidth_gbps=0.5, jitter=0.001, seed=seed) as dev:
                warnings.simplefilter("ignore")
                peaks[seed] = []
                for step in range(4):
                    dev.reset_peak()
                    torch.manual_seed(step)
                    patched.zero_grad(set_to_none=True)
                    default_loss(inputs(patched)).backward()
                    peaks[seed].append(dev.peak_bytes)
            assert dev.hazards == []
        finally:
            cswap.unpatch(patched)
    return budget, {seed: p[1:] for seed, p in peaks.items()}


@pytest.mark.parametrize("seeds", [range(4), pytest.param(range(4, 20), marks=pytest.mark.slow)],
                         ids=["seeds 0-3", "seeds 4-19"])
def test_a_budget_is_a_contract_whatever_the_copies_timing(seeds):
    """Issue 39 §3.2: ViT's planned steps peaked at 1.016x this budget in 3 runs of 80 on a
    loaded machine: the worker allocated a gathered copy (attention's transposed views)
    after its save, past the wait that had made room at the save. Room is now made for it
    at the save (counted until the worker has allocated it), and the wait at each save and
    use leaves room for what the profiled step rose to before the next."""
    budget, peaks = _vit_budget_peaks(seeds)
    over = {seed: [f"{p / budget:.3f}" for p in ps] for seed, ps in peaks.items() if max(ps) > budget}
    assert not over, over


def test_the_budget_plan_moves_or_keeps_a_storage_whole():
    """q, k and v are views of one projection's output: a plan that moves k and keeps q
    frees nothing. They leave as that output, one candidate for the three (a plan gives
    candidates that still share a storage, a view saved before its base, one choice)."""
    from cswap.patch import _PATCHED

    model, inputs = modern.build("prenorm_transformer")
    patched = cswap.patch(model, budget=int(3.2e6), min_bytes=0, verbose=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _peak_on_emulated(patched, inputs, 2)
        controller = _PATCHED[patched].controller
        groups, choices = controller.profiler.memory.groups, controller.budget.choices
    finally:
        cswap.unpatch(patched)
    assert all(len(keys) == 1 for keys in groups), groups  # (no two candidates share a storage: q, k, v are one)
    moved = [c != "keep" for c in choices.values()]
    assert any(moved) and not all(moved)  # the budget asks for part


def _traced_and_real(name, **kwargs):
    model, inputs = modern.build(name, **kwargs)
    trace = fake_gpu.trace_step(model, inputs, sdpa_arch=attention.CPU)
    return trace, cpu_step_peak(model, inputs)


HEAVY = ("convnext", "mobilenet_v3", "resnet18", "t5", "bart", "gpt2", "llama_lora",  # slow: the longest traces
         "llama_qlora")  # (and the slowest real step: its layers dequantize a few blocks at a time)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n
                                  for n in [*MODELS, "attention"]])
def test_predicted_peak_within_10_percent_of_a_cpu_step(name):
    trace, real = _traced_and_real(name)
    assert trace.peak_bytes == pytest.approx(real, rel=0.10)


LONG = ["attention", "attention_bias", "torch_encoder", "llama", "llama_bf16", "llama_lora", "gpt2", "bert"]


@pytest.mark.parametrize("seq", [512, pytest.param(2048, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", [n if n in ("attention", "attention_bias", "torch_encoder", "llama", "bert")
                                  else pytest.param(n, marks=pytest.mark.slow)
                                  for n in LONG])  # the quick set: flash, the math path with dropout, a bare SDPA
def test_attention_at_long_sequences_is_predicted_as_run(name, seq):
    """The fake device runs SDPA as the target would (here the CPU: flash attention saves
    the output and logsumexp; with dropout, GPT-2 and BERT take the math path and save
    the L x L probabilities, and so does a learned bias as the mask, which the CPU's flash
    kernel cannot give a gradient: tracing one failed), not always as the math fallback."""
    trace, real = _traced_and_real(name, seq=seq)
    assert trace.peak_bytes == pytest.approx(real, rel=0.10)
    assert sum(trace.attention.values()) > 0


@pytest.mark.parametrize("seq", [512, pytest.param(2048, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["llama_checkpointed", "llama_masked", "llama_padded", "mistral_sliding"])
def test_masks_are_traced_as_a_real_step_builds_them(name, seq):
    """transformers counts a FakeTensor as tracing and would build the L x L causal mask
    (packed sequences, padding) where a real step passes is_causal=True (cswap.plan.hf_masks):
    a checkpointed Llama's peak was 11% over at L=512, 37% at 2048. Where a real step does
    pass a boolean mask (padding, a sliding window), SDPA saves it as a float bias: Mistral's
    peak was 24% under at L=512."""
    trace, real = _traced_and_real(name, seq=seq)
    assert trace.peak_bytes == pytest.approx(real, rel=0.10)


def test_attention_called_from_inside_pytorchs_own_layers_runs_as_the_target_runs_it():
    """nn.MultiheadAttention calls SDPA from inside F.multi_head_attention_forward, a torch
    function written in Python, which a torch function mode handles with itself off: the
    trace ran the math path there (saving L x L probabilities, 20-25% over a real CPU step
    at L=32) and left its projections in float32 under the emulated autocast."""
    model, inputs = modern.build("torch_encoder")
    trace = fake_gpu.trace_step(model, inputs, sdpa_arch=90, autocast=torch.bfloat16, drops=False)
    assert trace.attention == {"flash": 2}
    projected = [r for r in trace.activations() if r.module.endswith("self_attn") and r.saved_by in ("mm", "addmm")]
    assert projected and all(r.dtype == torch.bfloat16 for r in projected), projected


@pytest.mark.parametrize("arch, dtype, expect", [(90, torch.bfloat16, "flash"), (90, torch.float32, "efficient"),
                                                 (70, torch.float16, "efficient"), (70, torch.bfloat16, "math")])
def test_backend_follows_the_cuda_dispatcher(arch, dtype, expect):
    shape = (2, 4, 128, 64)
    assert attention.backend(arch, dtype, shape, shape, shape, masked=False, is_causal=True, gqa=False,
                             dropout=False) == expect
    # a mask rules out flash; grouped queries rule out memory-efficient attention
    assert attention.backend(90, torch.bfloat16, shape, shape, shape, masked=True, is_causal=False, gqa=False,
                             dropout=False) == "efficient"
    grouped = (2, 2, 128, 64)
    assert attention.backend(90, torch.float32, shape, grouped, grouped, masked=False, is_causal=True, gqa=True,
                             dropout=False) == "math"
    assert attention.backend(90, torch.bfloat16, shape, grouped, grouped, masked=False, is_causal=True, gqa=True,
                             dropout=False) == "flash"
    assert attention.backend(attention.CPU, torch.float32, shape, shape, shape, masked=True, is_causal=False,
                             gqa=False, dropout=True) == "math"
    # the CPU's flash kernel takes a mask, but gives it no gradient
    for learned, expect in ((False, "flash-cpu"), (True, "math")):
        assert attention.backend(attention.CPU, torch.float32, shape, shape, shape, masked=True, is_causal=False,
                                 gqa=False, dropout=False, learned_mask=learned) == expect


def test_predict_takes_keyword_inputs_uses_the_models_loss_and_names_its_attention():
    model, inputs = modern.build("llama", seq=256)
    assert inputs.kwargs.keys() == {"input_ids", "labels"}
    fp32 = cswap.predict(model, inputs.kwargs, "h100-sxm-80gb")
    bf16 = cswap.predict(model, inputs.kwargs, "h100-sxm-80gb", precision="bf16")
    assert "2 math" in fp32.sources["attention"]  # fp32 with grouped queries: the math path on CUDA
    assert "2 flash" in bf16.sources["attention"] and "9.0" in bf16.sources["attention"]
    assert bf16.peak_bytes() < fp32.peak_bytes()
    # labels given: the model's own loss; a custom loss on the output works too
    custom = cswap.predict(model, inputs.kwargs, "h100-sxm-80gb", loss=lambda out: out.logits.float().mean())
    assert custom.peak_bytes() > 0
    positional = cswap.predict(model, inputs.kwargs["input_ids"], "h100-sxm-80gb")
    assert positional.peak_bytes() > 0
    with pytest.raises(TypeError, match="keyword arguments"):
        cswap.predict(model, 3, "h100-sxm-80gb")


@pytest.mark.parametrize("name", ["llama_lora", "llama_checkpointed", "llama_bf16",
                                  pytest.param("t5", marks=pytest.mark.slow),
                                  pytest.param("convnext", marks=pytest.mark.slow)])
def test_predict_runs_on_frozen_checkpointed_and_bf16_models(name):
    model, inputs = modern.build(name)
    prediction = cswap.predict(model, inputs.kwargs or inputs.args, "h100-sxm-80gb")
    assert prediction.peak_bytes("vdnn") <= prediction.peak_bytes("none")
    assert prediction.step_seconds("none") > 0


def test_the_default_moves_a_gelu_models_activations_after_saying_so():
    """No saved activation of GPT-2 is a ReLU or pooling output: the default (candidates="auto")
    says so at the first step, names the choices, and offloads every saved activation from then on."""
    model, inputs = modern.build("gpt2")
    expected = train(copy.deepcopy(model), inputs)
    patched = cswap.patch(model, verbose=False)
    try:
        with pytest.warns(RuntimeWarning, match=r"none of the \d+ activations .* is a ReLU or pooling output.*"
                                                r"budget=.*candidates='sparse'") as caught:
            got = train(patched, inputs)
        assert sum("ReLU or pooling" in str(w.message) for w in caught) == 1
        assert cswap.stats(patched)["offloaded_tensors"] > 0
    finally:
        cswap.unpatch(patched)
    assert all(torch.equal(x, y) for a, b in zip(got, expected) for x, y in zip(a, b))


def _tiny_config(tmp_path, **overrides):
    import json

    config = modern.llama_config().to_dict()
    config.update({"architectures": ["LlamaForCausalLM"], **overrides})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_cswap_plan_takes_a_hugging_face_config(tmp_path, capsys):
    from cswap.cli.plan import main

    path = _tiny_config(tmp_path)
    assert main(["--hf-config", str(path), "--seq-len", "64", "--batch", "2", "--lora-rank", "4",
                 "--gradient-checkpointing", "--gpu", "l4-24gb", "--dtype", "bf16", "--optimizer", "adam",
                 "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "2 per step on NVIDIA L4 24GB" in out and "PREDICTED" in out
    assert "attention assumed" in out and "compute capability 8.9" in out
    assert "sparsity  assumed: 0" in out  # no CPU steps for a model built from a config alone
    assert (tmp_path / "plan.json").is_file()
    # the folder works as well as the file; --lora-rank alone is refused
    assert main(["--hf-config", str(tmp_path), "--seq-len", "16", "--no-largest-batch"]) == 0
    with pytest.raises(SystemExit):
        main(["--lora-rank", "4"])
    assert main(["--hf-config", str(path), "--sparsity", "auto"]) == 2
    assert "cannot" in capsys.readouterr().err


def test_a_model_from_a_config_is_built_on_meta_with_the_asked_for_wrapping(tmp_path):
    from cswap.plan.hf import from_config

    with warnings.catch_warnings():  # transformers' supported API, not its deprecated aliases (peft's call too)
        warnings.filterwarnings("error", ".*deprecated", FutureWarning)
        model, inputs = from_config(_tiny_config(tmp_path), batch=3, seq_len=8, lora_rank=2,
                                    gradient_checkpointing=True)
    assert all(p.is_meta for p in model.parameters())
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    base = model.base_model.model
    assert getattr(base, "is_activation_checkpointing", None) or base.is_gradient_checkpointing
    assert inputs.batch == 3 and inputs.kwargs["input_ids"].shape == (3, 8)
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(modern.bert()[0].config.to_json_string())
    model, _ = from_config(bert)
    assert type(model).__name__ == "BertForMaskedLM"
    with pytest.raises(ValueError, match="not a Hugging Face config.json"):
        from_config(tmp_path / "missing.json")


def test_checkpointing_turns_the_cache_off_so_transformers_has_nothing_to_say():
    """A training step keeps no key/value cache: transformers turns it off in each
    checkpointed layer and says so (once a process) on stderr, in cswap-plan's output too."""
    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()  # (another test in this process may have had it said)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        model, inputs = modern.llama_checkpointed()
        model.train()
        model(**inputs.kwargs).loss.backward()
    finally:
        logger.removeHandler(handler)
    assert model.config.use_cache is False
    assert not [r.getMessage() for r in records if "use_cache" in r.getMessage()]


def test_attention_flops_of_grouped_queries_count_as_torch_counts_equal_heads():
    """torch 2.11's flop formulas refuse grouped-query shapes; the trace counts them itself."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    q = torch.empty(2, 4, 128, 16, device="meta")
    lse = torch.empty(2, 4, 128, device="meta")
    forward = flop_registry[aten._scaled_dot_product_efficient_attention](q, q, q, None, True, 0.0, False,
                                                                         out_val=None)
    backward = flop_registry[aten._scaled_dot_product_efficient_attention_backward](
        q, q, q, q, None, q, lse, None, None, 0.0, (True, True, True, False), out_val=None)
    assert fake_gpu._attention_flops("_scaled_dot_product_efficient_attention", (q, q, q)) == forward
    assert fake_gpu._attention_flops("_scaled_dot_product_efficient_attention_backward", (q, q, q, q)) == backward


def _moe_flops(model, inputs, dtype=None, name=None) -> int:
    ops = fake_gpu.trace_step(model, inputs.kwargs, drops=False, dtype=dtype).ops
    return sum(op.flops for op in ops if name in (None, op.name))


def test_moe_experts_count_as_the_matmuls_they_are():
    """torch.utils.flop_counter has no formula for torch._grouped_mm, which runs a Mixture-of-
    Experts layer's experts: the trace counts it, here in float32 (which CUDA runs as one mm
    per group and the meta kernel refuses), and the roofline times it as a matmul."""
    model, inputs = modern.build("qwen3_moe")
    c = model.config
    routed = 2 * 16 * c.num_experts_per_tok  # batch x sequence, each token to 2 experts
    gate_up_down = 3 * 2 * routed * c.hidden_size * c.moe_intermediate_size
    expected = 3 * gate_up_down * c.num_hidden_layers  # forward, then backward's two gradients
    assert _moe_flops(model, inputs, name="_grouped_mm") == expected
    assert roofline.op_class("_grouped_mm") == "matmul"


@pytest.mark.slow
def test_moe_experts_count_as_bmm_counts_them_fused_too_and_eager_ones_are_named():
    """Fused (bf16), the same FLOPs; the same experts run as bmm (whose FLOPs torch counts),
    the same step's; run eager (a loop over the experts that got tokens), an error that says why."""
    model, inputs = modern.build("qwen3_moe")
    grouped = _moe_flops(model, inputs, name="_grouped_mm")
    assert _moe_flops(model, inputs, torch.bfloat16, name="_grouped_mm") == grouped > 0
    batched, _ = modern.build("qwen3_moe", experts_implementation="batched_mm")
    assert _moe_flops(batched, inputs, name="_grouped_mm") == 0
    assert _moe_flops(batched, inputs) == _moe_flops(model, inputs)
    eager, _ = modern.build("qwen3_moe", experts_implementation="eager")
    with pytest.raises(ValueError, match=r"nonzero.*depends on tensor values.*experts_implementation='eager'"):
        fake_gpu.trace_step(eager, inputs.kwargs, drops=False)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_moe_experts_count_as_the_matmuls_they_are(dtype):
    """Under torch.compile, transformers runs float32 experts as its own custom op (and that
    op's backward), bf16 ones as torch._grouped_mm: both counted as the eager step's."""
    model, inputs = modern.build("qwen3_moe")
    eager = fake_gpu.trace_step(model, inputs.kwargs, drops=False, dtype=dtype).ops
    compiled = fake_gpu.trace_step(model, inputs.kwargs, drops=False, dtype=dtype, compile=True).ops
    names = {op.name for op in compiled if op.name in grouped_mm.GROUPED_MATMULS}
    assert names == ({"grouped_mm_fallback", "grouped_mm_fallback_backward"} if dtype == torch.float32
                     else {"_grouped_mm"})
    assert sum(op.flops for op in compiled if op.name in names) == \
        sum(op.flops for op in eager if op.name == "_grouped_mm") > 0


def test_lora_adapts_only_the_targeted_modules_and_a_wrong_name_lists_the_real_ones(tmp_path, capsys):
    from cswap.cli.plan import main
    from cswap.plan.hf import from_config

    path = _tiny_config(tmp_path)
    model, _ = from_config(path, seq_len=8, lora_rank=2, lora_targets=["q_proj", "v_proj"])
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert adapted == {"q_proj", "v_proj"}
    everything, _ = from_config(path, seq_len=8, lora_rank=2)
    assert sum(p.numel() for p in everything.parameters() if p.requires_grad) > \
        sum(p.numel() for p in model.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="linear layers are named .*q_proj"):
        from_config(path, seq_len=8, lora_rank=2, lora_targets=["query"])
    assert main(["--hf-config", str(path), "--seq-len", "16", "--lora-rank", "2",
                 "--lora-targets", "q_proj,k_proj, v_proj,o_proj"]) == 0
    with pytest.raises(SystemExit):
        main(["--hf-config", str(path), "--lora-targets", "q_proj"])  # (no --lora-rank)


def _adapter_traces(tmp_path, compile=False):
    from cswap.plan.hf import from_config

    model, inputs = from_config(_tiny_config(tmp_path), batch=2, seq_len=16, lora_rank=4,
                                gradient_checkpointing=True)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return adapters, {dtype: roofline.trace_for(model, inputs, "bf16", "adamw", drop=False, compile=compile,
                                                adapter_dtype=dtype) for dtype in roofline.ADAPTER_DTYPES}


def _matmul_dtypes(trace) -> set:
    """The dtypes the adapters' multiplies run in (forward, recompute and backward)."""
    return {op.dtype for op in trace.ops if op.name in ("mm", "addmm", "bmm") and ".lora_" in op.module}


def test_peft_adapters_stay_float32_on_a_bf16_model_and_multiply_in_bf16_as_the_trainer_runs_them(tmp_path):
    """peft keeps LoRA weights in float32 on a bf16 base (autocast_adapter_dtype), so their
    gradients and AdamW states are float32 too; Hugging Face's Trainer (bf16=True) runs the
    step under autocast, the adapters' multiplies in bf16, a checkpointed layer's recompute
    included. torchtune casts its adapters with the model ("model")."""
    adapters, traces = _adapter_traces(tmp_path)
    peft, cast = traces["float32"].peak_by_kind, traces["model"].peak_by_kind
    assert peft["param"] - cast["param"] == adapters * 2  # (float32 against bf16, nothing else moved)
    assert peft["opt"] == pytest.approx(2 * cast["opt"], rel=0.01)  # (two moments each, twice the bytes)
    for trace in traces.values():
        assert _matmul_dtypes(trace) == {torch.bfloat16}


@pytest.mark.slow
def test_compiled_peft_adapters_stay_float32_and_multiply_in_bf16(tmp_path):
    adapters, traces = _adapter_traces(tmp_path, compile=True)
    peft, cast = traces["float32"].peak_by_kind, traces["model"].peak_by_kind
    assert peft["param"] - cast["param"] == adapters * 2
    for trace in traces.values():  # (each layer's graph: adapters and base alike)
        assert {op.dtype for op in trace.ops if op.compiled and op.name in ("mm", "addmm", "bmm")} == {torch.bfloat16}


def test_cswap_plan_says_which_adapter_dtype_it_assumed(tmp_path, capsys, monkeypatch):
    from cswap.cli.plan import main
    from cswap.plan.hf import from_config

    path = _tiny_config(tmp_path)
    model, inputs = from_config(path, seq_len=16, lora_rank=4)
    p = cswap.predict(model, inputs, "a100-sxm4-80gb", precision="bf16", optimizer="adamw")
    assert "in float32 (peft's default)" in p.sources["adapters"]
    cast = cswap.predict(model, inputs, "a100-sxm4-80gb", precision="bf16", optimizer="adamw", adapter_dtype="model")
    assert "cast to bf16 with the model" in cast.sources["adapters"]
    assert p.peak_bytes("none") > cast.peak_bytes("none")
    asked = []  # the largest-batch search predicts other batches as this one was predicted
    monkeypatch.setattr("cswap.plan.whatif.predict", lambda *a, **kw: asked.append(kw) or cast)
    cast.largest_batch("none", limit=8)
    assert asked and all(kw["adapter_dtype"] == "model" and kw["compile"] is False for kw in asked)
    assert "adapters" not in cswap.predict(model, inputs, "a100-sxm4-80gb", optimizer="adamw").sources  # (fp32)
    with pytest.raises(ValueError, match="adapter_dtype must be one of float32, model, got 'bf16'"):
        cswap.predict(model, inputs, "a100-sxm4-80gb", precision="bf16", adapter_dtype="bf16")
    assert main(["--hf-config", str(path), "--seq-len", "16", "--lora-rank", "4", "--dtype", "bf16",
                 "--adapter-dtype", "model", "--gpu", "a100-sxm4-80gb"]) == 0
    assert "cast to bf16 with the model" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--hf-config", str(path), "--adapter-dtype", "model"])  # (no --lora-rank)


def test_a_chunked_loss_is_the_models_own_and_holds_less_at_its_peak(tmp_path, capsys):
    from cswap.cli.plan import main
    from cswap.plan.fake_gpu import trace_step
    from cswap.plan.hf import ChunkedLoss, from_config

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=8000,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 8000, (2, 256))
    labels = ids.clone()
    labels[0, :9] = -100  # (ignored tokens count as in the model's own loss)
    own = model(input_ids=ids, labels=labels).loss
    for chunks in (1, 4):
        assert torch.allclose(ChunkedLoss(model, chunks)(ids, labels), own, rtol=1e-5)
    inputs = {"input_ids": ids, "labels": ids}
    whole = trace_step(model, inputs, drops=False, dtype=torch.bfloat16).peak_bytes
    chunked = trace_step(ChunkedLoss(model, 8), inputs, drops=False, dtype=torch.bfloat16).peak_bytes
    logits_fp32 = 2 * 255 * 8000 * 4
    assert whole - chunked > logits_fp32  # (of three float32 copies alive at once, one is left)
    with pytest.raises(ValueError, match="needs at least 1 chunk"):
        ChunkedLoss(model, 0)
    path = _tiny_config(tmp_path)
    wrapped, _ = from_config(path, seq_len=8, lora_rank=2, chunked_loss=2)
    assert isinstance(wrapped, ChunkedLoss)
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(modern.bert()[0].config.to_json_string())
    with pytest.raises(ValueError, match="BertForMaskedLM is not one"):
        from_config(bert, chunked_loss=2)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=500)).eval()
    ids = torch.randint(0, 500, (2, 16))  # (GPT-2's LM-head class is a causal LM too)
    assert torch.allclose(ChunkedLoss(gpt2, 4)(ids, ids), gpt2(input_ids=ids, labels=ids).loss, rtol=1e-5)
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(gpt2.config.to_json_string())
    assert isinstance(from_config(tmp_path / "gpt2", seq_len=8, chunked_loss=2)[0], ChunkedLoss)
    assert main(["--hf-config", str(path), "--seq-len", "32", "--chunked-loss", "4", "--dtype", "bf16"]) == 0
    assert "PREDICTED" in capsys.readouterr().out
