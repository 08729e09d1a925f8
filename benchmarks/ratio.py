"""How small cswap's codecs make real activations, beside general-purpose compressors (issue 15, section 3).

    python benchmarks/ratio.py                       # 20 min on 2 CPU cores: 8 building the corpus, 10 cswap's lz4
    python benchmarks/ratio.py --cache /tmp/ratio-corpus.pt   # keep the corpus on disk; later runs only compress
    python benchmarks/ratio.py --codecs zvc lz4 lz4-package   # some columns only
    python benchmarks/ratio.py --quick               # a few small tensors, seconds (what the test runs)

The anchors need two packages that are not cswap dependencies (a missing one
prints "n/a"): `pip install lz4 zstandard blosc2`.

Corpus (no download): the ReLU and pooling outputs cswap offloads, found by
cswap's own rule (cswap.runtime.candidates: a tensor autograd saves for
backward, seen by a saved_tensors_hooks pack hook during a training-mode
forward, that is an activation whose producer is in SPARSE_PRODUCERS),
each range of bytes once (an activation saved by two ops, or a flatten of a
pooling output, is one tensor: the swapper sends it once). Models: small_cnn, VGG16
and ResNet-18 at CIFAR shapes (cswap.models), trained with SGD on
scikit-learn's digits resized to 3x32x32 (as cswap-train reads them) and fed
held-out digits and 32x32 patches of scikit-learn's two sample photographs,
at initialisation and after Corpus.steps training steps; fp32, and the same weights
under torch.autocast("cpu", dtype=torch.bfloat16) for bf16 tensors. The
weights are trained in fp32: this CPU has no fast bf16 convolution (a bf16
ResNet-18 forward at batch 32 takes 25 s against 1.7 s in fp32).

"dense GELU bf16" is a separate corpus and row, not in "all": a post-norm
nn.TransformerEncoder (GELU, dropout 0) over the digits, each 8x8 image as 8
tokens of 8 pixels (nn.Linear to d_model plus a learned position embedding),
mean-pooled into a linear classifier, trained in fp32 with AdamW and captured
under bf16 autocast. Its corpus is every bf16 tensor it saves for backward
that is an activation (is_activation: made by a differentiable op, so not a
parameter nor the input batch) and not a copy of a parameter (reached from one
through casts and views alone: the bf16 casts of weights autocast makes, and
their transposes); each range of bytes once (q, k and v, views of one storage,
are three). That is GELU outputs and inputs, the inputs of every linear layer,
q, k, v and the attention output; fp32 tensors (layer-norm inputs and
statistics under autocast, the loss) are left out.

Columns, each the byte-weighted ratio (sum of original bytes / sum of
compressed bytes) of one row's tensors:
  - every codec in cswap.codecs.names(), cswap's own format (header
    included) from the PyTorch backend on CPU; the Triton kernels write the
    same bytes on a GPU, so the ratios do not depend on the device. Round
    trips are checked bit-exact (integer views) on every --verify-every-th tensor;
  - lz4 package: lz4.block.compress(store_size=False), one block per tensor;
  - lz4 HC 9: the same with mode="high_compression", compression=9;
  - zstd 1, zstd 3: zstandard.ZstdCompressor(level).compress, one frame per tensor;
  - blosc2 bitshuffle+zstd: blosc2.compress(typesize=element size,
    filter=BITSHUFFLE, codec=ZSTD, clevel=5);
  - ideal ZVC: the bound of any zero-value scheme with a 1-bit mask per
    element: ceil(numel / 8) + non-zero elements x element size.

Prints the table, the per-tensor size of cswap's lz4 against the lz4 package
(median, and how many tensors are within 5%), each column's time and a table
by source; writes ratio.md, ratio.csv (the table), ratio_tensors.csv (every
tensor's sizes) and ratio.json under benchmarks/results/ratio/.
"""

from __future__ import annotations

import argparse
import csv
import functools
import importlib
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, environment

from cswap import codecs
from cswap.models.data import load_data
from cswap.models import build
from cswap.runtime.candidates import SPARSE_PRODUCERS, is_activation, op_name, producer


def _optional(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


lz4_block = _optional("lz4.block")
zstandard = _optional("zstandard")
blosc2 = _optional("blosc2")

OUT = RESULTS / "ratio"
ROWS = ("fp32", "bf16", "all", "dense")
ROW_LABELS = {"fp32": "fp32", "bf16": "bf16", "all": "all", "dense": "dense GELU bf16"}
CORPUS_RULES = 1  # bump when what capture() keeps changes, so an older --cache file is not read
BLOSC2_CLEVEL = 5  # blosc2.CParams' default level (blosc2.compress alone defaults to 1)


@dataclass(frozen=True)
class Corpus:
    """What to capture. steps: training steps per model, as many as a 2-core CPU gives in a few minutes
    (a VGG16 step at batch 32 takes 1-3 s here, a ResNet-18 one 3-6 s; digits have 1437 training images)."""

    models: tuple[str, ...] = ("small_cnn", "vgg16", "resnet18")
    steps: tuple[int, ...] = (400, 60, 69)
    train_batch: int = 32
    lr: float = 0.02
    batch: int = 32          # images per fp32 capture
    bf16_batch: int = 16     # images per bf16 capture (bf16 convolutions are slow on this CPU)
    bf16_models: tuple[str, ...] = ("small_cnn", "vgg16", "resnet18")
    d_model: int = 256
    nhead: int = 8
    layers: int = 4
    dense_steps: int = 150
    dense_train_batch: int = 64
    dense_batch: int = 256   # digit images (8 tokens each) per dense capture
    seed: int = 0


QUICK = Corpus(models=("small_cnn",), steps=(3,), train_batch=8, batch=1, bf16_batch=1, bf16_models=("small_cnn",),
               d_model=32, nhead=4, layers=1, dense_steps=2, dense_train_batch=8, dense_batch=4)


# -- corpus --------------------------------------------------------------------------------------------------


def photo_patches(count: int, size: int = 32, seed: int = 0) -> torch.Tensor:
    """`count` random size x size crops of scikit-learn's sample photographs, (count, 3, size, size), standardised."""
    from sklearn.datasets import load_sample_images

    images = load_sample_images().images
    rng = np.random.default_rng(seed)
    crops = []
    for i in range(count):
        img = images[i % len(images)]
        r, c = rng.integers(0, img.shape[0] - size), rng.integers(0, img.shape[1] - size)
        crops.append(img[r:r + size, c:c + size].transpose(2, 0, 1))
    x = torch.as_tensor(np.stack(crops), dtype=torch.float32)
    return ((x - x.mean()) / (x.std() + 1e-6)).contiguous()


def offloaded(t: torch.Tensor) -> bool:
    """cswap's candidate rule (Swapper._candidate_op with the default candidates): a saved ReLU/pooling output."""
    return not isinstance(t, nn.Parameter) and t.layout == torch.strided and t.numel() > 0 \
        and is_activation(t) and producer(t) in SPARSE_PRODUCERS


# grad_fn names (version digit dropped) of the casts and views autocast and nn.Linear / MultiheadAttention
# put between a weight and the op that saves it: a tensor reached from a parameter through these alone is a copy
# of that parameter, not an activation.
PARAMETER_COPIES = frozenset({
    "ToCopyBackward", "TBackward", "TransposeBackward", "PermuteBackward", "ViewBackward", "UnsafeViewBackward",
    "ReshapeAliasBackward", "ExpandBackward", "SliceBackward", "SelectBackward", "SplitBackward",
    "SplitWithSizesBackward", "UnbindBackward", "SqueezeBackward", "UnsqueezeBackward", "AliasBackward",
})


def from_parameters(fn) -> bool:
    """`fn` reaches a parameter through casts and views only (a bf16 cast of a weight, its transpose)."""
    while fn is not None:
        if hasattr(fn, "variable"):  # AccumulateGrad: a leaf that requires grad
            return True
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if re.sub(r"\d+$", "", fn.name()) not in PARAMETER_COPIES or len(inputs) != 1:
            return False
        fn = inputs[0]
    return False


def dense_activation(t: torch.Tensor) -> bool:
    """The dense corpus' rule: a bf16 activation saved for backward that is not a copy of a parameter."""
    if t.dtype != torch.bfloat16 or isinstance(t, nn.Parameter) or t.numel() == 0 or not is_activation(t):
        return False
    base = t._base if t._is_view() and t._base is not None else t
    return not from_parameters(base.grad_fn)


def capture(model: nn.Module, x: torch.Tensor, bf16: bool, keep) -> list[tuple[torch.Tensor, str]]:
    """(copy, producing op) of each tensor `keep` accepts among what one training-mode forward saves, each
    range of bytes once: a tensor saved by two ops, or a flatten of a pooling output, is sent once by the
    swapper (q, k and v, three views of one storage at different offsets, are three tensors)."""
    seen: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, str]] = {}

    def pack(t):
        if keep(t):
            key = (t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size(), t.nbytes)
            if key not in seen:  # held until the forward ends, so no saved storage's address is reused
                seen[key] = (t, t.detach().contiguous().clone(), op_name(producer(t) or "input"))
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        model(x)
    return [(copy, op) for _, copy, op in seen.values()]


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, batch: int, optimizer,
          seed: int) -> float:
    """`steps` steps on random batches of (x, y); the last loss."""
    gen = torch.Generator().manual_seed(seed)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        pick = torch.randint(len(x), (batch,), generator=gen)
        loss = nn.functional.cross_entropy(model(x[pick]), y[pick])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return float(loss.detach())


def cnn_corpus(cfg: Corpus, log) -> list[dict]:
    x_train, y_train, x_test, _, _ = load_data("digits", 32, seed=cfg.seed)
    batch = max(cfg.batch, cfg.bf16_batch)
    inputs = {"digits": x_test[:batch], "photos": photo_patches(batch, seed=cfg.seed)}
    records = []
    for name, steps in zip(cfg.models, cfg.steps):
        torch.manual_seed(cfg.seed)
        model = build(name, dataset="cifar10")
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
        for point, done in (("init", 0), ("trained", steps)):
            if done:
                start = time.perf_counter()
                loss = train(model, x_train, y_train, steps, cfg.train_batch, opt, cfg.seed)
                log(f"# {name}: {steps} SGD steps at batch {cfg.train_batch}, last loss {loss:.3f} "
                    f"({time.perf_counter() - start:.0f} s)")
            for bf16 in (False, True):
                if bf16 and name not in cfg.bf16_models:
                    continue
                n = cfg.bf16_batch if bf16 else cfg.batch
                for source, x in inputs.items():
                    start = time.perf_counter()
                    got = capture(model, x[:n], bf16, offloaded)
                    group = "bf16" if bf16 else "fp32"
                    records += [{"group": group, "model": name, "point": point, "steps": done, "input": source,
                                 "op": op, "index": i, "tensor": t} for i, (t, op) in enumerate(got)]
                    log(f"#   {name} {point} {group} {source}: {len(got)} tensors, "
                        f"{sum(t.nbytes for t, _ in got) / 2**20:.1f} MiB ({time.perf_counter() - start:.1f} s)")
    return records


class DigitRows(nn.Module):
    """A transformer encoder over digit images, one 8-pixel row per token."""

    def __init__(self, d_model: int, nhead: int, layers: int, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(8, d_model)
        self.position = nn.Parameter(0.02 * torch.randn(8, d_model))
        layer = nn.TransformerEncoderLayer(d_model, nhead, 4 * d_model, dropout=0.0, activation="gelu",
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x):  # x: (N, 8, 8)
        return self.head(self.encoder(self.embed(x) + self.position).mean(1))


def dense_corpus(cfg: Corpus, log) -> list[dict]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(digits.target))
    x = torch.as_tensor(digits.images[order], dtype=torch.float32)
    x = (x - x.mean()) / x.std()
    y = torch.as_tensor(digits.target[order])
    split = int(0.8 * len(y))
    torch.manual_seed(cfg.seed)
    model = DigitRows(cfg.d_model, cfg.nhead, cfg.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    label = f"dense d_model {cfg.d_model}, {cfg.layers} layers"
    records = []
    for point, done in (("init", 0), ("trained", cfg.dense_steps)):
        if done:
            start = time.perf_counter()
            loss = train(model, x[:split], y[:split], done, cfg.dense_train_batch, opt, cfg.seed)
            log(f"# {label}: {done} AdamW steps at batch {cfg.dense_train_batch}, last loss {loss:.3f} "
                f"({time.perf_counter() - start:.0f} s)")
        start = time.perf_counter()
        got = capture(model, x[split:split + cfg.dense_batch], True, dense_activation)
        records += [{"group": "dense", "model": "transformer", "point": point, "steps": done, "input": "digits",
                     "op": op, "index": i, "tensor": t} for i, (t, op) in enumerate(got)]
        log(f"#   {label} {point} bf16 digits: {len(got)} tensors, {sum(t.nbytes for t, _ in got) / 2**20:.1f} MiB "
            f"({time.perf_counter() - start:.1f} s)")
    return records


def corpus(cfg: Corpus, cache: Path | None, log) -> list[dict]:
    """The records (metadata and a 'tensor'), from `cache` when it holds this configuration's corpus."""
    key = {**vars(cfg), "torch": torch.__version__, "rules": CORPUS_RULES}
    key = json.loads(json.dumps(key))  # tuples as lists, as they come back from the file
    if cache is not None and cache.is_file():
        doc = torch.load(cache, weights_only=True)
        if doc.get("config") == key:
            log(f"# corpus read from {cache}")
            return doc["records"]
        log(f"# {cache} holds another configuration's corpus; building it again")
    start = time.perf_counter()
    records = cnn_corpus(cfg, log) + dense_corpus(cfg, log)
    log(f"# corpus built in {time.perf_counter() - start:.0f} s")
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"config": key, "records": records}, cache)
        log(f"# corpus written to {cache}")
    return records


# -- columns -------------------------------------------------------------------------------------------------


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def ideal_zvc(t: torch.Tensor) -> int:
    """A 1-bit mask per element plus the non-zero elements (zero = all-zero bit pattern, as the codecs see it)."""
    words = t.contiguous().reshape(-1).view(codecs.base.WORD_DTYPES[t.element_size()])
    return math.ceil(t.numel() / 8) + int(torch.count_nonzero(words)) * t.element_size()


def _lz4(mode: str, **kw):
    def size(t):
        if lz4_block is None:
            return None
        return len(lz4_block.compress(raw_bytes(t), mode=mode, store_size=False, **kw))
    return size


def _zstd(level: int):
    def size(t):
        if zstandard is None:
            return None
        return len(zstandard.ZstdCompressor(level=level).compress(raw_bytes(t)))
    return size


def _blosc2(t):
    if blosc2 is None:
        return None
    return len(blosc2.compress(raw_bytes(t), typesize=t.element_size(), clevel=BLOSC2_CLEVEL,
                               filter=blosc2.Filter.BITSHUFFLE, codec=blosc2.Codec.ZSTD))


# key: (header, size(tensor) -> compressed bytes or None when its package is missing)
ANCHORS = {
    "lz4-package": ("lz4 package", _lz4("default")),
    "lz4-hc9": ("lz4 HC 9", _lz4("high_compression", compression=9)),
    "zstd1": ("zstd 1", _zstd(1)),
    "zstd3": ("zstd 3", _zstd(3)),
    "blosc2": ("blosc2 bitshuffle+zstd", _blosc2),
    "ideal-zvc": ("ideal ZVC", ideal_zvc),
}


def columns() -> dict[str, str]:
    """Column key -> header: every cswap codec (as registered now), then the anchors."""
    return {**{name: name for name in codecs.names()}, **{k: head for k, (head, _) in ANCHORS.items()}}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    words = codecs.base.WORD_DTYPES[a.element_size()]
    return torch.equal(a.contiguous().view(words), b.contiguous().view(words))


@dataclass
class Measured:
    sizes: dict[str, list[int | None]] = field(default_factory=dict)  # column -> per tensor
    seconds: dict[str, float] = field(default_factory=dict)           # compression only
    errors: dict[str, str] = field(default_factory=dict)
    verified: dict[str, int] = field(default_factory=dict)           # column -> tensors round-tripped
    failed: dict[str, list[int]] = field(default_factory=dict)       # column -> tensors that did not


def measure(tensors: list[torch.Tensor], chosen: list[str], verify_every: int, log) -> Measured:
    """Every column's compressed size of every tensor; cswap codecs' buffers of every `verify_every`-th
    tensor are decompressed (PyTorch backend) and compared bit for bit."""
    m = Measured()
    for key in chosen:
        m.sizes[key], m.seconds[key] = [], 0.0
        codec = codecs.get(key) if key in codecs.names() else None
        if codec is not None and verify_every > 0:
            m.verified[key], m.failed[key] = 0, []
        try:
            for i, t in enumerate(tensors):
                start = time.perf_counter()
                if codec is None:
                    m.sizes[key].append(ANCHORS[key][1](t))
                    m.seconds[key] += time.perf_counter() - start
                    continue
                blob = codec.compress(t, backend="torch")
                m.seconds[key] += time.perf_counter() - start
                m.sizes[key].append(blob.nbytes)
                if verify_every > 0 and i % verify_every == 0:
                    m.verified[key] += 1
                    if not same_bits(codec.decompress(blob, backend="torch"), t):
                        m.failed[key].append(i)
        except Exception as exc:  # noqa: BLE001 - one broken column must not hide the others; shown as "error"
            m.errors[key] = f"{type(exc).__name__}: {exc}"
            m.sizes[key] = [None] * len(tensors)
        missing = bool(tensors) and m.sizes[key][0] is None and key not in m.errors
        status = m.errors.get(key) or (f", {m.verified[key] - len(m.failed[key])}/{m.verified[key]} round trips "
                                       f"exact" if key in m.verified else "")
        log(f"# {key}: " + ("package not installed" if missing else f"{m.seconds[key]:.1f} s{status}"))
    return m


def pick_quick(records: list[dict], per_group: int = 3, low: int = 1024, high: int = 32768) -> list[dict]:
    """--quick: the first `per_group` tensors of `low`..`high` bytes of each group (seconds for any codec)."""
    out, count = [], {}
    for r in records:
        if low <= r["tensor"].nbytes <= high and count.get(r["group"], 0) < per_group:
            count[r["group"]] = count.get(r["group"], 0) + 1
            out.append(r)
    return out


# -- summary -------------------------------------------------------------------------------------------------


def members(records: list[dict], row: str) -> list[int]:
    groups = ("fp32", "bf16") if row == "all" else (row,)
    return [i for i, r in enumerate(records) if r["group"] in groups]


def ratio(records: list[dict], sizes: list[int | None], idx: list[int]) -> float | None:
    if not idx or any(sizes[i] is None for i in idx):
        return None
    return sum(records[i]["nbytes"] for i in idx) / sum(sizes[i] for i in idx)


def describe(records: list[dict], idx: list[int]) -> dict:
    nbytes = sum(records[i]["nbytes"] for i in idx)
    numel = sum(records[i]["numel"] for i in idx)
    return {"tensors": len(idx), "mib": nbytes / 2**20, "bytes": nbytes,
            "zeros": sum(records[i]["zeros"] for i in idx) / numel if numel else 0.0}


def label(name: str, d: dict) -> str:
    mib = f"{d['mib']:.0f}" if d["mib"] >= 10 else f"{d['mib']:.2g}"
    return f"{name} ({d['tensors']} tensors, {mib} MiB, {d['zeros']:.0%} zeros)"


def summary(records: list[dict], m: Measured, cols: dict[str, str]) -> list[dict]:
    rows = []
    for row in ROWS:
        idx = members(records, row)
        if not idx:
            continue
        rows.append({"data": ROW_LABELS[row], **describe(records, idx),
                     **{key: ratio(records, m.sizes[key], idx) for key in cols}})
    return rows


def lz4_versus_package(records: list[dict], m: Measured) -> list[dict]:
    """Per row: cswap's lz4 size / the lz4 package's, per tensor (median; tensors within 5%: at most 1.05)."""
    if "lz4" not in m.sizes or "lz4-package" not in m.sizes:
        return []
    out = []
    for row in ROWS:
        idx = [i for i in members(records, row) if m.sizes["lz4"][i] is not None and m.sizes["lz4-package"][i]]
        if not idx:
            continue
        q = [m.sizes["lz4"][i] / m.sizes["lz4-package"][i] for i in idx]
        large = [v for v, i in zip(q, idx) if records[i]["nbytes"] >= 2**20]
        out.append({"data": ROW_LABELS[row], "tensors": len(q), "median": statistics.median(q), "max": max(q),
                    "within_5pct": sum(v <= 1.05 for v in q), "smaller": sum(v <= 1.0 for v in q),
                    "tensors_1mib": len(large), "within_5pct_1mib": sum(v <= 1.05 for v in large),
                    "bytes": sum(m.sizes["lz4"][i] for i in idx) / sum(m.sizes["lz4-package"][i] for i in idx)})
    return out


def by_source(records: list[dict], m: Measured, cols: dict[str, str]) -> list[dict]:
    keys = []
    for r in records:
        k = (r["model"], "bf16" if r["group"] == "dense" else r["group"], r["point"])
        if k not in keys:
            keys.append(k)
    rows = []
    for k in keys:
        idx = [i for i, r in enumerate(records)
               if (r["model"], "bf16" if r["group"] == "dense" else r["group"], r["point"]) == k]
        steps = records[idx[0]]["steps"]
        rows.append({"data": f"{k[0]} {k[1]} " + (f"after {steps} steps" if steps else "at init"),
                     **describe(records, idx), **{key: ratio(records, m.sizes[key], idx) for key in cols}})
    return rows


def cell(v) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def table(rows: list[dict], cols: dict[str, str], m: Measured) -> list[str]:
    lines = ["| data | " + " | ".join(cols.values()) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in rows:
        name = label(r["data"], r)
        lines.append(f"| {name} | " + " | ".join("error" if k in m.errors else cell(r[k]) for k in cols) + " |")
    return lines


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}"


def versions() -> dict:
    out = {}
    for name in ("lz4", "zstandard", "blosc2", "numpy", "sklearn"):
        mod = _optional(name)
        out[name] = getattr(mod, "__version__", "?") if mod is not None else None
    return out


def report(records, m, cols, command, cfg, quick, seconds) -> tuple[str, dict]:
    rows = summary(records, m, cols)
    lz4 = lz4_versus_package(records, m)
    sources = by_source(records, m, cols)
    env = environment(torch.device("cpu"), machine=machine(), **versions(),
                      what="measured on this CPU with cswap's PyTorch backend; the ratios do not depend on the "
                           "device (the Triton kernels write the same bytes on a GPU)")
    total_mib = sum(r["nbytes"] for r in records) / 2**20
    na = [head for k, head in cols.items() if all(v is None for v in m.sizes[k]) and k not in m.errors]
    lines = [f"`{command}` on {env['machine']}, {env['date']}; torch {env['torch']}, cswap {env['cswap']}, "
             f"lz4 {env['lz4']}, zstandard {env['zstandard']}, blosc2 {env['blosc2']}.", "",
             "Measured on CPU (cswap's codecs through their PyTorch backend); the ratios do not depend on the "
             "device: the codecs write the same bytes on CPU and GPU. Ratio = sum of original bytes / sum of "
             "compressed bytes (cswap's include their header).", ""]
    lines += table(rows, cols, m)
    lines += ["", "\"all\" is fp32 + bf16 (the ReLU/pooling outputs cswap offloads); \"dense GELU bf16\" is the "
              "transformer's saved bf16 activations, not in \"all\"."]
    if na:
        lines += [f"n/a: {', '.join(na)} (package not installed; pip install lz4 zstandard blosc2)."]
    for key, err in m.errors.items():
        lines += [f"error in {cols[key]}: {err}"]
    for key, bad in m.failed.items():
        if bad:
            lines += [f"ROUND TRIP FAILED for {key} on tensors {bad[:10]}"]
    if lz4:
        lines += ["", "cswap's lz4 against the lz4 package, compressed size per tensor (cswap / package; within 5%: "
                  "cswap at most 5% larger):", ""]
        lines += [f"- {r['data']}: median {r['median']:.3f}, worst {r['max']:.3f}, within 5% on {r['within_5pct']}"
                  f"/{r['tensors']} tensors ({r['within_5pct_1mib']}/{r['tensors_1mib']} of those of 1 MiB or more), "
                  f"smaller on {r['smaller']}; all bytes {r['bytes']:.3f}" for r in lz4]
    verified = ", ".join(f"{k} {v - len(m.failed.get(k, []))}/{v}" for k, v in m.verified.items())
    lines += ["", f"Round trips checked bit-exact (integer views): {verified or 'none'}.", "",
              "Seconds per column (compression only, whole corpus, this CPU): "
              + ", ".join(f"{cols[k]} {s:.3g} s ({total_mib / s:.3g} MiB/s)" if s > 0 else f"{cols[k]} 0"
                          for k, s in m.seconds.items())
              + f"; corpus {seconds['corpus']:.0f} s, whole run {seconds['total']:.0f} s.", "",
              "By source (model, dtype, when captured):", ""]
    lines += table(sources, cols, m)
    small = [i for i, r in enumerate(records) if r["group"] != "dense" and r["nbytes"] < 2**20]
    if small:
        share = sum(records[i]["nbytes"] for i in small) / sum(r["nbytes"] for r in records if r["group"] != "dense")
        lines += ["", f"{len(small)} of the ReLU/pooling tensors are under 1 MiB ({share:.1%} of their bytes); cswap "
                      f"on a GPU leaves those on the device by default (min_bytes)."]
    lines += ["", corpus_note(cfg, quick)]
    text = "\n".join(lines) + "\n"
    doc = {"environment": env, "command": command, "corpus": vars(cfg), "quick": quick, "columns": cols,
           "rows": rows, "lz4_vs_package": lz4, "by_source": sources, "seconds": {**m.seconds, **seconds},
           "errors": m.errors, "round_trips": {k: {"checked": v, "failed": m.failed.get(k, [])}
                                               for k, v in m.verified.items()},
           "blosc2_clevel": BLOSC2_CLEVEL}
    return text, doc


def corpus_note(cfg: Corpus, quick: bool) -> str:
    steps = ", ".join(f"{n} {s}" for n, s in zip(cfg.models, cfg.steps))
    return (f"Corpus{' (--quick)' if quick else ''}: ReLU/pooling outputs of {', '.join(cfg.models)} (CIFAR shapes), "
            f"SGD lr {cfg.lr} momentum 0.9 at batch {cfg.train_batch} on digits for {steps} steps, captured at "
            f"initialisation and after training in training-mode forwards of {cfg.batch} (fp32) and "
            f"{cfg.bf16_batch} (bf16 autocast: {', '.join(cfg.bf16_models)}) held-out digits and photograph "
            f"patches; dense: TransformerEncoder d_model {cfg.d_model}, {cfg.nhead} heads, {cfg.layers} layers, "
            f"GELU, {cfg.dense_steps} AdamW steps at batch {cfg.dense_train_batch}, captured on "
            f"{cfg.dense_batch} held-out digits ({cfg.dense_batch * 8} tokens) under bf16 autocast. Seed {cfg.seed}.")


def write(out: Path, text: str, doc: dict, records: list[dict], m: Measured, cols: dict[str, str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "ratio.md").write_text(text)
    (out / "ratio.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    head = ["data", "tensors", "mib", "zeros", *cols]
    with open(out / "ratio.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["data", "tensors", "mib", "zeros", *cols.values()])
        for r in doc["rows"]:
            w.writerow([r[k] if r[k] is not None else "n/a" for k in head])
    meta = ["group", "model", "point", "steps", "input", "op", "index", "dtype", "shape", "nbytes", "zeros"]
    with open(out / "ratio_tensors.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(meta + [f"{k}_bytes" for k in cols])
        for i, r in enumerate(records):
            w.writerow([r[k] for k in meta] + ["" if m.sizes[k][i] is None else m.sizes[k][i] for k in cols])
    print(f"# wrote {out}/ratio.md, ratio.csv, ratio_tensors.csv and ratio.json")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small_cnn and a one-layer transformer, tiny batches")
    ap.add_argument("--codecs", nargs="+", metavar="COLUMN",
                    help=f"columns to measure (default all): {', '.join(columns())}")
    ap.add_argument("--cache", type=Path, help="corpus file (.pt): read when it holds this configuration, "
                                               "else built and written there")
    ap.add_argument("--verify-every", type=int, default=None,
                    help="round-trip every n-th tensor per cswap codec (default 8; 1 with --quick; 0: none)")
    ap.add_argument("--out", type=Path, help=f"results folder (default {OUT})")
    args = ap.parse_args(argv)
    cols = columns()
    if args.codecs:
        unknown = [c for c in args.codecs if c not in cols]
        if unknown:
            ap.error(f"--codecs: unknown column(s) {', '.join(unknown)}; choose from {', '.join(cols)}")
        cols = {k: v for k, v in cols.items() if k in args.codecs}
    verify_every = args.verify_every if args.verify_every is not None else (1 if args.quick else 8)
    cfg = QUICK if args.quick else Corpus()
    start = time.perf_counter()
    log = functools.partial(print, flush=True)
    records = corpus(cfg, args.cache, log)
    if args.quick:
        records = pick_quick(records)
    built = time.perf_counter() - start
    tensors = [r["tensor"] for r in records]
    for r in records:
        t = r["tensor"]
        words = t.reshape(-1).view(codecs.base.WORD_DTYPES[t.element_size()])
        r.update(dtype=str(t.dtype).removeprefix("torch."), shape="x".join(map(str, t.shape)), numel=t.numel(),
                 nbytes=t.numel() * t.element_size(), zeros=t.numel() - int(torch.count_nonzero(words)))
    m = measure(tensors, list(cols), verify_every, log)
    for r in records:
        del r["tensor"]
    seconds = {"corpus": built, "total": time.perf_counter() - start}
    command = "python benchmarks/ratio.py" + "".join(f" {a}" for a in argv)
    text, doc = report(records, m, cols, command, cfg, args.quick, seconds)
    print(text)
    write(args.out or OUT, text, doc, records, m, cols)
    return 1 if m.errors or any(m.failed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
