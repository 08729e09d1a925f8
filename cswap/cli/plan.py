"""cswap-plan: what training a model on a named GPU will cost, predicted without the GPU.

    cswap-plan --model resnet50 --dataset imagenet --batch 256 --gpu h100-sxm-80gb
    cswap-plan --model vgg16 --batch 128 --gpu v100-sxm2-16gb --sparsity 0.6 --json plan.json --plot plan.png
    cswap-plan --hf-config config.json --seq-len 4096 --lora-rank 16 --gradient-checkpointing \
               --gpu l4-24gb --dtype bf16 --optimizer adam
    cswap-plan --list-gpus

One training step is traced on a fake GPU; per mode (none, vdnn, sc, cswap; budget:
keep, raw or a codec per tensor within the GPU's memory or --budget; recompute: the
same with checkpointing blocks as a fourth choice) it prints the predicted peak memory and whether it fits, the step time and
slowdown against no offload, the bytes over PCIe, the compressed tensors and
the largest batch that fits; then per saved activation what each mode does
with it and why. Every figure is a prediction and says from what.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .. import models
from ..plan import sparsity as sparsity_sources
from ..plan.gpus import gpus
from ..plan.optimizers import OPTIMIZERS
from ..plan.roofline import ADAPTER_DTYPES, PRECISIONS
from ..plan.whatif import RESERVE_BYTES, Prediction, gib, parse_bytes, predict

__all__ = ["main", "parse_args"]

_SHAPES = {"cifar10": (3, 32, 32), "imagenet": (3, 224, 224)}

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cswap-plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50", choices=models.names())
    p.add_argument("--dataset", default="imagenet", choices=sorted(_SHAPES), help="input shape and classes")
    p.add_argument("--hf-config", type=Path, help="a Hugging Face config.json (or its folder) instead of --model: "
                                                  "the model is built on the meta device, no weights")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence, with --hf-config")
    p.add_argument("--lora-rank", type=int, help="with --hf-config: peft LoRA of this rank (on --lora-targets)")
    p.add_argument("--lora-targets", default="all-linear",
                   help="with --lora-rank: the modules LoRA adapts, names separated by commas (e.g. "
                        "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj), or all-linear (the default)")
    p.add_argument("--adapter-dtype", default="float32", choices=ADAPTER_DTYPES,
                   help="with --lora-rank and --dtype bf16/fp16: float32 (peft's default: the adapters, their "
                        "gradients and optimizer states in float32, the step under autocast as Hugging Face's "
                        "Trainer runs it) or model (cast with the model, as torchtune holds them)")
    p.add_argument("--quantize", choices=["nf4"],
                   help="with --lora-rank: QLoRA, every frozen linear layer but the output head held in 4-bit "
                        "NF4 and dequantized for each multiply (bitsandbytes' load_in_4bit, torchtune's QLoRA)")
    p.add_argument("--chunked-loss", type=int, metavar="N",
                   help="with --hf-config: the cross-entropy in N chunks of the sequence, each upcast to float32 "
                        "alone (torchtune's CEWithChunkedOutputLoss)")
    p.add_argument("--compile", action="store_true",
                   help="the model under torch.compile (inductor): what its partitioner saves and recomputes, its "
                        "pointwise ops fused; each repeated block compiled on its own (as torchtune), or the whole "
                        "model where there are none, as one graph")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="with --hf-config: the model's activation_checkpointing_enable() (non-reentrant)")
    p.add_argument("--channels-last", action="store_true",
                   help="with --model: run it in torch.channels_last (NHWC), so cuDNN's tensor-core convolutions "
                        "need no layout transposes around each call")
    p.add_argument("--batch", type=int, help="default 64, or 1 with --hf-config")
    p.add_argument("--gpu", default="h100-sxm-80gb", help="a name from --list-gpus")
    p.add_argument("--dtype", default="fp32", choices=PRECISIONS,
                   help="fp32 (TF32 convolutions, PyTorch's default), tf32, amp (fp16 autocast), bf16, fp16")
    p.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS,
                   help="sgd (momentum), adam, adamw, or bitsandbytes' adamw8bit, paged_adamw, paged_adamw8bit "
                        "(paged state lies outside PyTorch's allocator: reported, in no peak)")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="step each parameter as soon as its gradient is made, freeing it (torchtune's "
                        "optimizer_in_bwd)")
    p.add_argument("--budget", help="a memory limit below the GPU's: 40GiB, 40GB or a share like 0.5 or 50%%")
    p.add_argument("--recompute", default="auto",
                   help="blocks mode 'recompute' may checkpoint: auto (the repeated blocks: transformer layers, "
                        "residual blocks), none, or module names separated by commas")
    p.add_argument("--profile", help="a cswap-tune profile of that GPU (measured PCIe and codec times)")
    p.add_argument("--times", help="forward and backward times measured by a cswap run on that GPU: its report "
                                   "folder or epochs.jsonl (replaces the roofline's phase totals)")
    p.add_argument("--sparsity",
                   help="auto (measured on a few CPU training steps on --data; the default with --model), a "
                        "cswap-plan JSON, or a number (default 0 with --hf-config: no steps run on the CPU)")
    p.add_argument("--data", default="digits", help="data for --sparsity auto: digits, synthetic, an .npz file "
                                                     "or a folder (as cswap-train)")
    p.add_argument("--reserve", default=f"{RESERVE_BYTES / 2**30:g}GiB",
                   help="memory kept for the CUDA context and cuBLAS's workspace (default %(default)s)")
    p.add_argument("--no-largest-batch", action="store_true",
                   help="skip the search for the largest batch (always skipped with --hf-config)")
    p.add_argument("--tensors", type=int, default=20, help="saved activations to list (largest first; 0: all)")
    p.add_argument("--json", type=Path, help="write the prediction as JSON")
    p.add_argument("--plot", type=Path, help="write a PNG of device memory over one step per mode")
    p.add_argument("--fit", action="store_true",
                   help="search checkpointing, a chunked loss (with --hf-config), 8-bit and paged AdamW (with an "
                        "Adam optimizer), optimizer-in-backward, torch.compile and cswap's modes for the fastest "
                        "that fits; print the ranking")
    p.add_argument("--list-gpus", action="store_true", help="list the GPUs and exit")
    args = p.parse_args(argv)
    hf_only = [flag for flag, value in (("--lora-rank", args.lora_rank), ("--chunked-loss", args.chunked_loss),
                                        ("--gradient-checkpointing", args.gradient_checkpointing)) if value]
    if hf_only and args.hf_config is None:
        p.error(f"{hf_only[0]} needs --hf-config")
    if args.lora_targets != "all-linear" and not args.lora_rank:
        p.error("--lora-targets needs --lora-rank")
    if args.adapter_dtype != "float32" and not args.lora_rank:
        p.error("--adapter-dtype needs --lora-rank")
    if args.quantize and not args.lora_rank:
        p.error("--quantize needs --lora-rank: QLoRA trains LoRA adapters beside the quantized base")
    if args.batch is None:
        args.batch = 1 if args.hf_config else 64
    if args.sparsity is None:
        args.sparsity = "0" if args.hf_config else "auto"
    if args.batch < 1 or args.seq_len < 1:
        p.error(f"--batch and --seq-len must be at least 1, got {args.batch} and {args.seq_len}")
    return args


def sparsity_for(spec: str, model, shape, data: str):
    """--sparsity: 'auto' measures on CPU steps of `data`, a path reads a cswap-plan JSON,
    anything else is one number."""
    if spec == "auto":
        return sparsity_sources.auto(model, torch.empty(8, *shape), data)
    if Path(spec).is_file():
        return sparsity_sources.from_file(spec)
    try:
        return sparsity_sources.from_number(float(spec))
    except ValueError:
        raise SystemExit(f"cswap-plan: --sparsity {spec!r}: not 'auto', an existing cswap-plan JSON file, "
                         f"or a number in [0, 1]") from None


def _recompute(spec: str):
    """--recompute: 'auto', 'none' (False) or module names separated by commas."""
    if spec in ("auto", "none"):
        return spec if spec == "auto" else False
    return [name.strip() for name in spec.split(",") if name.strip()]


def _lora_targets(spec: str):
    """--lora-targets: 'all-linear' or module names separated by commas."""
    return spec if spec == "all-linear" else [name.strip() for name in spec.split(",") if name.strip()]


def fit_report(choices, tried: int, gpu_label: str, precision: str, shown: int = 15) -> str:
    """The --fit ranking: the combinations that fit, fastest first."""
    fitting = [c for c in choices if c.fits]
    rows = fitting[:shown] if fitting else sorted(choices, key=lambda c: c.peak_bytes)[:5]
    lines = [f"cswap-plan --fit: {tried} setups x their cswap modes on {gpu_label}, {precision}. PREDICTED, "
             f"nothing measured on the GPU.",
             f"{len(fitting)} of {len(choices)} distinct combinations fit" +
             ("; the fastest first:" if fitting else "; none does: the five smallest peaks:"), ""]
    head = f"{'rank':>4} {'step ms':>9} {'peak':>10} {'mode':<9} {'exact':<5} setup"
    lines += [head, "-" * len(head)]
    for i, c in enumerate(rows, 1):
        paged = f" (+{gib(c.paged_bytes)} paged)" if c.paged_bytes else ""
        lines.append(f"{i:>4} {c.step_seconds * 1e3:>9.2f} {gib(c.peak_bytes):>10} {c.mode:<9} "
                     f"{'yes' if c.exact else 'no':<5} {c.setup.label()}{paged}")
    exact = next((c for c in fitting if c.exact), None)
    if fitting and exact is not None and not fitting[0].exact:
        lines += ["", f"fastest exact: {exact.step_seconds * 1e3:.2f} ms, {gib(exact.peak_bytes)}, {exact.mode}, "
                      f"{exact.setup.label()} (rank {fitting.index(exact) + 1})"]
    lines += ["", "exact: trains the numbers the plain step would (8-bit optimizer states do not); "
                  "of combinations predicted alike, the simplest is shown."]
    return "\n".join(lines)


def _fit(args, spars, reserve, model, inputs) -> str:
    """--fit: `model` and `inputs` as built for a plain prediction (a Hugging Face model is
    built again for each setup)."""
    from ..plan.fit import fit, setups

    if args.hf_config is not None:
        from ..plan.hf import from_config, is_causal_lm

        def build(setup):
            return from_config(args.hf_config, batch=args.batch, seq_len=args.seq_len, lora_rank=args.lora_rank,
                               lora_targets=_lora_targets(args.lora_targets),
                               gradient_checkpointing=setup.gradient_checkpointing, chunked_loss=setup.chunked_loss,
                               quantize=args.quantize)

        causal = is_causal_lm(build(setups(args.optimizer, False)[0])[0])
    else:
        def build(setup):
            return model, inputs

        causal = False
    candidates = setups(args.optimizer, causal)
    searched = [flag for flag, value in (("--gradient-checkpointing", args.gradient_checkpointing),
                                         ("--chunked-loss", args.chunked_loss),
                                         ("--optimizer-in-backward", args.optimizer_in_backward),
                                         ("--compile", args.compile)) if value]
    if searched:
        print(f"cswap-plan --fit: {', '.join(searched)} ignored: --fit tries with and without", file=sys.stderr)

    def progress(i, n, setup, skipped=None):
        print(f"  [{i + 1}/{n}] {setup.label()}" + (f": left out, {skipped}" if skipped else ""), file=sys.stderr,
              flush=True)

    choices = fit(build, args.gpu, candidates, progress=progress, precision=args.dtype, budget=args.budget,
                  profile=args.profile, sparsity=spars, times=args.times, reserve_bytes=reserve,
                  recompute=_recompute(args.recompute), adapter_dtype=args.adapter_dtype)
    from ..plan.gpus import gpu

    return fit_report(choices, len(candidates), gpu(args.gpu).label, args.dtype)


def plot(p: Prediction, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for m, mp in p.modes.items():
        ax.plot([t * 1e3 for t in mp.curve_seconds], [b / 2**30 for b in mp.curve_bytes], label=m, lw=1.2)
    top = max(mp.peak_bytes for mp in p.modes.values())
    if p.capacity_bytes < 2 * top:  # the limit, where it would not flatten the curves
        ax.axhline(p.capacity_bytes / 2**30, color="k", ls="--", lw=0.8, label="limit")
    ax.set_xlabel("time in the step, ms (compute only)")
    ax.set_ylabel("device memory, GiB")
    ax.set_title(f"PREDICTED: {p.gpu.label}, batch {p.batch}, {p.precision} "
                 f"(limit {p.capacity_bytes / 2**30:.1f} GiB)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list_gpus:
        from ..plan.gpus import gpu

        table = [gpu(name) for name in gpus()]
        width = max(len(g.name) for g in table), max(len(g.label) for g in table)
        for g in table:
            half = "bf16" if "bf16" in g.flops else "fp16"  # (Volta: no bf16 tensor cores)
            reach = "measured" if half in g.matmul_flops else "assumed"
            print(f"{g.name:<{width[0]}} {g.label:<{width[1]}} {gib(g.memory_bytes):>11} "
                  f"{g.hbm_bytes_per_s / 1e12:5.2f} TB/s {g.link:<12} {half} {g.peak_flops(half) / 1e12:6.0f} "
                  f"TFLOPS datasheet, {g.reachable_flops(half) / 1e12:6.0f} {reach} (torch.matmul)")
        return 0
    try:
        if args.hf_config is not None:
            from ..plan.hf import from_config

            if args.channels_last:
                raise ValueError("--channels-last is for a convolutional --model, not --hf-config")
            model, inputs = from_config(args.hf_config, batch=args.batch, seq_len=args.seq_len,
                                        lora_rank=args.lora_rank, lora_targets=_lora_targets(args.lora_targets),
                                        gradient_checkpointing=args.gradient_checkpointing,
                                        chunked_loss=args.chunked_loss, quantize=args.quantize)
            if args.sparsity == "auto":
                raise ValueError("--sparsity auto runs CPU steps, which a model built from a config alone "
                                 "cannot; give a number or a cswap-plan JSON")
            spars = sparsity_for(args.sparsity, model, None, args.data)
        else:
            shape = _SHAPES[args.dataset]
            with torch.random.fork_rng(devices=[]):  # the same weights, so the same measured sparsity, each run
                torch.manual_seed(0)
                model = models.build(args.model, dataset=args.dataset)
                spars = sparsity_for(args.sparsity, model, shape, args.data)
            if args.channels_last:
                model = model.to(memory_format=torch.channels_last)
            inputs = torch.empty(args.batch, *shape, device="meta")
        reserve = parse_bytes(args.reserve)
        if args.fit:
            print(_fit(args, spars, reserve, model, inputs))
            return 0
        p = predict(model, inputs, args.gpu, precision=args.dtype, optimizer=args.optimizer, budget=args.budget,
                    profile=args.profile, sparsity=spars, times=args.times, reserve_bytes=reserve,
                    recompute=_recompute(args.recompute), optimizer_in_backward=args.optimizer_in_backward,
                    compile=args.compile, adapter_dtype=args.adapter_dtype)
        print(p.summary(largest=not (args.no_largest_batch or args.hf_config), tensors=args.tensors))
    except ValueError as exc:
        print(f"cswap-plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        args.json.write_text(p.to_json())
        print(f"wrote {args.json}")
    if args.plot:
        plot(p, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
