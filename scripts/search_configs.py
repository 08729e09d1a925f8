"""A random search for configurations where cswap trains differently from stock autograd.

Each seed draws a model (today's models from tests/modern.py, the CNNs and transformer of
tests/nets.py, channels_last or not), a mode and swapper options (candidates, min_bytes,
stash and prefetch limits, a host memory limit, checksums, a cycling codec policy, a
memory budget or budget="auto" with recompute, on a device just too small for the
unpatched step), and how training runs (the CPU or the emulated device, prompt, slow and
jittery or with compute behind the host; the model called twice a step, retain_graph,
gradient accumulation, bf16 autocast, a gradient penalty (backward through backward),
the input's gradient, the model's call inside torch.utils.checkpoint (reentrant or not),
evaluation passes and epoch ends between steps). It trains three or five steps (five
reach the host pool's count of a step's buffers and its trim) patched and
unpatched and compares every gradient bit for bit; on the emulated device any race or
unsynchronised free it reports is a failure too. An out-of-memory error that names what to change (the device is
small on purpose), a configuration stock autograd cannot train, or trains with
gradients that differ from run to run, and one cswap refuses (a budget with a backward
that keeps its graph), are counted apart.

    python scripts/search_configs.py 0:400            # seeds 0 to 399: about 3 minutes on 2 cores
    python scripts/search_configs.py 76 140           # those seeds again, with their tracebacks

It exits with 1 when a seed failed. Its first version found five faults (2026-11-26),
each fixed with a test of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import random
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import cswap  # noqa: E402
import modern  # noqa: E402
import nets  # noqa: E402
from cswap.plan.inputs import Inputs, default_loss  # noqa: E402

STEPS = (3, 3, 5)  # drawn: the host pool counts the third step's buffers and frees the rest at the fourth
CYCLE = ("zvc", "rle", "csr", "lz4", None, "keep")


def cycling_policy(info):
    return CYCLE[info.index % len(CYCLE)]


class _Classifier(torch.nn.Module):
    """A tests/nets.py model with its loss inside: (input, target) -> loss."""

    def __init__(self, make):
        super().__init__()
        self.net = make()

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


def _model(r: random.Random):
    """(name, model, inputs)."""
    if r.random() < 0.7:
        name = r.choice(list(modern.MODELS))
        return name, *modern.build(name)
    name = r.choice(list(nets.MODELS))
    channels_last = name != "transformer" and r.random() < 0.5
    make, shape = nets.MODELS[name]
    torch.manual_seed(0)
    x, y = nets.batches(shape, 1, channels_last=channels_last)[0]
    return f"{name}{' channels_last' if channels_last else ''}", _Classifier(make), Inputs((x, y), {})


def draw(seed: int) -> dict:
    """The configuration of one seed."""
    r = random.Random(seed)
    name, model, inputs = _model(r)
    mode = r.choice(["vdnn", "sc", "cswap", "vdnnpp", "none", "save_on_cpu"])
    options = {}
    if mode not in ("none", "save_on_cpu"):
        options = {"candidates": r.choice(["all", "auto", "sparse"]), "min_bytes": r.choice([0, 0, 4096])}
        for key, values, chance in (("stash_bytes", [1, 8192, 65536], 0.3),
                                    ("prefetch_bytes", [0, 1, 8192, 65536], 0.3),
                                    ("max_host_bytes", [0, 32768, 262144], 0.25)):
            if r.random() < chance:
                options[key] = r.choice(values)
        if r.random() < 0.25:
            options["checksum"] = True
        if mode == "cswap" and r.random() < 0.4:
            options["policy"] = cycling_policy
    device = r.choice(["cpu", "emulated", "emulated slow", "emulated lagging"])
    budget = None
    if device != "cpu" and mode != "none" and r.random() < 0.25:  # a plan: mode and candidates are its own
        budget = r.choice([0.5, 0.8, "auto"])  # of the unpatched step's peak
        mode = None
        options.pop("candidates", None)
        options.pop("policy", None)
        if r.random() < 0.5:
            options["recompute"] = "auto"
    c = {"seed": seed, "name": name, "model": model, "inputs": inputs, "mode": mode, "options": options,
         "device": device, "budget": budget, "retain": r.random() < 0.15, "accumulate": r.choice([1, 1, 2]),
         "autocast": r.random() < 0.2, "eval": r.random() < 0.3, "epoch_every": r.choice([0, 1, 2]),
         "penalty": r.random() < 0.1, "calls": r.choice([1, 1, 1, 2])}
    # (drawn last, so that the seeds drawn before these existed keep the rest of their configurations)
    c["input_grad"] = isinstance(model, _Classifier) and r.random() < 0.25  # the input's gradient too
    c["wrap"] = r.choice([None] * 4 + ["checkpoint"] + ["checkpoint_reentrant"] * c["input_grad"])
    if c["wrap"] == "checkpoint" and budget is not None:  # (a step that saves nothing has no peak to size a budget
        c["wrap"] = None                                   # from: checkpoint keeps the model's saves to itself)
    if c["wrap"] == "checkpoint_reentrant" and c["penalty"]:  # (reentrant checkpoint refuses autograd.grad)
        c["wrap"] = "checkpoint"
    c["steps"] = r.choice(STEPS)
    return c


def describe(c: dict) -> str:
    shown = {k: c[k] for k in ("mode", "device", "budget", "retain", "accumulate", "autocast", "eval", "epoch_every",
                               "penalty", "calls", "input_grad", "wrap", "steps")}
    options = {k: ("cycling" if k == "policy" else v) for k, v in c["options"].items()}
    return f"seed {c['seed']}: {c['name']} {shown} {options}"


def _device(kind: str, capacity: int | None, seed: int):
    if kind == "cpu":
        return contextlib.nullcontext()
    timing = {"emulated": {}, "emulated slow": {"bandwidth_gbps": 0.05, "jitter": 0.001, "seed": seed},
              "emulated lagging": {"compute_lag_s": 0.002}}[kind]
    return cswap.testing.emulated_device(capacity_bytes=capacity, **timing)


def _call(model, inputs, c: dict):
    """The model's output, its call inside torch.utils.checkpoint if the configuration says so
    (the reentrant kind needs an input that requires grad: input_grad)."""
    if c["wrap"] is None:
        return inputs(model)
    return torch.utils.checkpoint.checkpoint(model, *inputs.args, use_reentrant=c["wrap"] == "checkpoint_reentrant",
                                             **inputs.kwargs)


def step(model, inputs, c: dict) -> list[torch.Tensor]:
    """One training step's forward and backward passes, as the configuration says; the
    gradients of its inputs (input_grad) or none."""
    if c["input_grad"]:
        inputs = inputs.map(lambda x: x.detach().clone().requires_grad_() if x.is_floating_point() else x)
    for _ in range(c["accumulate"]):
        with torch.autocast("cpu", dtype=torch.bfloat16) if c["autocast"] else contextlib.nullcontext():
            # (called twice: two graphs of one model in flight, as a siamese net's)
            loss = sum(default_loss(_call(model, inputs, c)) * (1 + i) for i in range(c["calls"]))
        if c["penalty"]:  # a gradient penalty: backward through backward (create_graph)
            first = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], create_graph=True)
            loss = loss + 0.1 * sum((g.float() ** 2).sum() for g in first)
        if c["retain"]:
            loss.backward(retain_graph=True)
        loss.backward()
    return [x.grad for x in inputs.tensors() if x.requires_grad]


def train(model, inputs, c: dict, device: str, capacity: int | None = None, patched: bool = False):
    """Each step's gradients; raises on a hazard the emulated device saw."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    grads = []
    for i in range(c["steps"]):
        torch.manual_seed(i)
        opt.zero_grad(set_to_none=True)
        with _device(device, capacity, c["seed"]) as dev:
            input_grads = step(model, inputs, c)
        if dev is not None and dev.hazards:
            raise AssertionError(f"the emulated device saw {len(dev.hazards)} hazards: {dev.hazards[:2]}")
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None] + input_grads)
        opt.step()
        if c["eval"]:
            with torch.no_grad():
                torch.manual_seed(99)
                inputs(model)
        if patched and c["epoch_every"] and (i + 1) % c["epoch_every"] == 0:
            cswap.epoch_end(model)
    return grads


def _peak(model, inputs, c: dict) -> int:
    """The device's peak in one unpatched step of the configuration."""
    with cswap.testing.emulated_device() as dev:
        torch.manual_seed(0)
        step(model, inputs, c)
    return dev.peak_bytes


def _first_difference(a: list, b: list) -> int | None:
    """The first step whose gradients differ, or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if len(x) != len(y) or not all(torch.equal(u, v) for u, v in zip(x, y)):
            return i
    return None


def run(c: dict) -> str:
    """'ok', 'oom: ...' (a small device's clear out-of-memory error), 'n/a: ...' (stock
    autograd cannot train it so, as SDPA's CPU kernels have no double backward, or does
    not give the same gradients twice; or cswap refuses it, as a budget with a backward that
    keeps its graph) or raises."""
    model, inputs = c["model"], c["inputs"]
    try:
        expected = train(copy.deepcopy(model), inputs, c, "cpu")
    except RuntimeError as exc:
        if "derivative for" in str(exc) and "is not implemented" in str(exc):
            return f"n/a: {exc}"
        raise
    differs = _first_difference(train(copy.deepcopy(model), inputs, c, "cpu"), expected)
    if differs is not None:  # (resnet18's double backward on the CPU, from its second step)
        return f"n/a: stock autograd's own gradients differ from run to run at step {differs}"
    options, capacity = dict(c["options"]), None
    if c["budget"] == "auto":
        capacity = int(0.8 * _peak(copy.deepcopy(model), inputs, c))
        options["budget"] = "auto"
    elif c["budget"] is not None:
        options["budget"] = int(c["budget"] * _peak(copy.deepcopy(model), inputs, c))
    patched = cswap.patch(model, mode=c["mode"], verbose=False, **options)
    try:
        got = train(patched, inputs, c, c["device"], capacity, patched=True)
    except RuntimeError as exc:  # (torch.OutOfMemoryError among them)
        if "does not support a backward that keeps its graph" in str(exc) and c["budget"] is not None and \
                (c["retain"] or c["penalty"]):  # (refused, as it should be: issue 39 §3.3)
            return f"n/a: {str(exc)[:160]}"
        if not isinstance(exc, torch.OutOfMemoryError):
            raise
        # (what a gradient penalty's backward saves for the second one is made outside forward:
        # not cswap's to move, so a device sized from the unpatched step may not hold it)
        if capacity is None or ("cswap:" not in str(exc) and not c["penalty"]):
            raise
        return f"oom: {str(exc)[:160]}"
    finally:
        cswap.unpatch(patched)
    differs = _first_difference(got, expected)
    if differs is not None:
        raise AssertionError(f"step {differs}: gradients differ from stock autograd's")
    return "ok"


def seeds(specs: list[str]) -> list[int]:
    out = []
    for spec in specs:
        start, _, end = spec.partition(":")
        out.extend(range(int(start), int(end)) if end else [int(start)])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("seeds", nargs="+", help="seeds, or ranges START:END")
    p.add_argument("--traceback", action="store_true", help="print each failure's traceback (on by default "
                                                             "for up to 3 seeds)")
    args = p.parse_args(argv)
    chosen = seeds(args.seeds)
    show = args.traceback or len(chosen) <= 3
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    failed, ooms, unsupported = [], 0, 0
    for seed in chosen:
        c = draw(seed)
        start = time.perf_counter()
        try:
            outcome = run(c)
        except Exception as exc:  # noqa: BLE001 - a failure to report, with its seed
            failed.append(seed)
            print(f"FAIL {describe(c)}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            if show:
                traceback.print_exc()
            continue
        ooms += outcome.startswith("oom")
        unsupported += outcome.startswith("n/a")
        print(f"{outcome[:3]:4} {describe(c)} ({time.perf_counter() - start:.1f} s)", flush=True)
    print(f"{len(chosen)} seeds: {len(failed)} failed{' (' + ' '.join(map(str, failed)) + ')' if failed else ''}, "
          f"{ooms} out of memory on a small device with a clear error, {unsupported} that stock autograd "
          f"cannot train, or not the same way twice, or that cswap refuses with a clear error")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
