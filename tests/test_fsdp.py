"""cswap under FSDP: fully_shard (FSDP2) and FullyShardedDataParallel (FSDP1).

Both run on CPU with the gloo backend (a "cpu" DeviceMesh) in the torch CI
installs (2.13), so one spawn of two CPU ranks (module fixture) runs in CI; the same
checks run on CUDA with nccl (world size = number of GPUs, one GPU is enough)
in test_fsdp_on_cuda, which conftest.py skips without a GPU.

Each rank trains a small net a few steps (nets.VGGLike: conv/ReLU/maxpool;
nets.ResNetLike: BatchNorm, shortcuts), sharded per block and at the root:
unpatched, and with cswap patched into the module before sharding or into the
sharded module after, in modes "sc" and "cswap" (a policy), every saved
activation a candidate (candidates="all"). Every step's local gradient shards
and updated parameter shards must equal the unpatched FSDP run's bit for bit.

"Offloading never touches parameters or their shards": each patched run wraps
its swapper's pack with a recorder that, at every save, collects the storages
of every parameter alive at that moment (the sharded DTensors' local shards,
FSDP2's unsharded parameters and all-gather outputs, FSDP1's flat parameters,
their local shards and padded unsharded buffers, and the per-module
weight/bias tensors forward uses) and checks that no tensor the swapper
offloaded (its pack returned anything but a kept tensor) shares any byte with
them (or with a buffer), is a Parameter, or is not an activation. Saves of
parameters do reach pack (conv saves its weight, linear a transposed view of
it): the test counts them, all kept in place. (Equal gradients alone would not
show this: an offloaded parameter comes back with the same values.)

The ranks are spawned by tests/ranks.py (results or traceback to files, a
deadline); the parent compares.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # as conftest.py does; the children do not load conftest
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import cswap  # noqa: E402
import nets  # noqa: E402
from cswap.runtime.candidates import is_activation  # noqa: E402
from cswap.patch import _PATCHED  # noqa: E402
from cswap.runtime.items import Handle  # noqa: E402
from ranks import assert_same, run_rank, spawn  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*saves no memory:RuntimeWarning")

CPU_WORLD = 2
STEPS = 3
SHAPE = (4, 3, 16, 16)      # per-rank batch; VGGLike's activations are 2-8 KiB each
DEADLINE_S = 120            # for the whole CPU spawn; a healthy run takes ~10 s
CUDA_DEADLINE_S = 300       # the CUDA spawn also compiles the Triton kernels


def zvc_policy(info):
    return "zvc"


_ALL = {"candidates": "all"}  # every saved activation, not only ReLU/pooling outputs
_CSWAP = {"mode": "cswap", "policy": zvc_policy, **_ALL}

# net -> (factory, the blocks fully_shard wraps before the root, the classes FSDP1 wraps)
NETS = {
    "vgg": (nets.vgg_like, ("features", "classifier"), {nn.Sequential}),             # conv/ReLU/maxpool
    "resnet": (nets.resnet_like, ("stem", "layer1", "layer2", "fc"), {nn.Sequential, nets.BasicBlock}),
}
# name -> (API, net, where cswap.patch goes: None, "before" or "after" sharding; patch kwargs)
VARIANTS = {
    "fsdp2-vgg-unpatched": ("fsdp2", "vgg", None, {}),
    "fsdp2-vgg-before-sc": ("fsdp2", "vgg", "before", {"mode": "sc", **_ALL}),
    "fsdp2-vgg-after-sc": ("fsdp2", "vgg", "after", {"mode": "sc", **_ALL}),
    "fsdp2-vgg-before-cswap": ("fsdp2", "vgg", "before", _CSWAP),
    "fsdp2-vgg-after-cswap": ("fsdp2", "vgg", "after", _CSWAP),
    "fsdp2-vgg-after-cswap-no-stash": ("fsdp2", "vgg", "after", {**_CSWAP, "stash_bytes": 0}),
    # BatchNorm: candidates="all" also offloads the (dense) convolution outputs BN saves
    "fsdp2-resnet-unpatched": ("fsdp2", "resnet", None, {}),
    "fsdp2-resnet-before-sc": ("fsdp2", "resnet", "before", {"mode": "sc", **_ALL}),
    "fsdp2-resnet-after-cswap": ("fsdp2", "resnet", "after", _CSWAP),
    # FSDP1 with flat parameters: the weights forward reads are views of them
    "fsdp1-vgg-unpatched": ("fsdp1", "vgg", None, {}),
    "fsdp1-vgg-before-sc": ("fsdp1", "vgg", "before", {"mode": "sc", **_ALL}),
    "fsdp1-vgg-after-cswap": ("fsdp1", "vgg", "after", _CSWAP),
    "fsdp1-resnet-unpatched": ("fsdp1", "resnet", None, {}),
    "fsdp1-resnet-after-sc": ("fsdp1", "resnet", "after", {"mode": "sc", **_ALL}),
}
PATCHED = [name for name, (_, _, order, _) in VARIANTS.items() if order is not None]
REFERENCE = "fsdp2-vgg-unpatched"  # its full gradients are gathered too


def reference(variant: str) -> str:
    api, net, _, _ = VARIANTS[variant]
    return f"{api}-{net}-unpatched"


def data_shard(rank, device):
    """Each rank's own batches (different seeds: different data per rank)."""
    return [(x.to(device), y.to(device)) for x, y in nets.batches(SHAPE, STEPS, seed=100 + rank)]


# -- what a parameter is, at one moment -----------------------------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's sharded parameters and gradients); other tensors as they are."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def _span(t) -> tuple[int, int] | None:
    """The bytes of t's whole storage, or None (no tensor, or a freed storage)."""
    if not isinstance(t, torch.Tensor):
        return None
    t = _local(t)
    if t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    return (storage.data_ptr(), storage.data_ptr() + storage.nbytes()) if storage.nbytes() else None


def _parameter_tensors(root: nn.Module):
    """(name, tensor) for every parameter-related tensor alive now: registered parameters (sharded
    DTensors or, while a module runs, FSDP2's unsharded ones; FSDP1's flat parameters), the
    weight/bias each module's forward reads (FSDP1: views of the unsharded flat parameter),
    FSDP's own buffers where this torch version has them (all-gather outputs, padded shards),
    and the modules' buffers (BatchNorm's running statistics) for good measure."""
    for mod_name, mod in root.named_modules():
        for name, p in mod._parameters.items():
            yield f"{mod_name}.{name}", p
        for name, b in mod._buffers.items():
            yield f"{mod_name}.{name} (buffer)", b
        for name in ("weight", "bias"):
            yield f"{mod_name}.{name} (attribute)", getattr(mod, name, None)
        get_state = getattr(mod, "_get_fsdp_state", None)  # FSDP2
        group = getattr(get_state(), "_fsdp_param_group", None) if get_state is not None else None
        for i, fp in enumerate(getattr(group, "fsdp_params", None) or ()):
            for attr in ("sharded_param", "_sharded_param_data", "_unsharded_param"):
                yield f"{mod_name} fsdp_param {i}.{attr}", getattr(fp, attr, None)
            for j, out in enumerate(getattr(fp, "all_gather_outputs", None) or ()):
                yield f"{mod_name} fsdp_param {i}.all_gather_outputs[{j}]", out
        for name, p in mod._parameters.items():  # FSDP1's FlatParameter
            for attr in ("_local_shard", "_full_param_padded", "_mp_shard", "_full_prec_full_param_padded"):
                yield f"{mod_name}.{name}.{attr}", getattr(p, attr, None)


class PackRecorder:
    """Wraps a swapper's pack: checks every offloaded save against the parameters alive at that moment."""

    def __init__(self, swapper, root: nn.Module):
        self.pack = swapper.pack  # the bound method: the real pack
        self.root = root
        self.offloaded = 0        # saves pack returned a handle for (offloaded, deduplicated or fell back)
        self.offloaded_bytes = 0
        self.parameter_saves = 0  # saves sharing storage with a parameter or buffer (all must be kept)
        self.violations: list[str] = []

    def __call__(self, t):
        packed = self.pack(t)
        spans = [(name, span) for name, tensor in _parameter_tensors(self.root)
                 if (span := _span(tensor)) is not None]
        mine = _span(t)
        shared = [name for name, (lo, hi) in spans if mine is not None and lo < mine[1] and mine[0] < hi]
        if shared:
            self.parameter_saves += 1
        if isinstance(packed, Handle):  # offloaded (kept tensors are packed as (tensor, version))
            self.offloaded += 1
            self.offloaded_bytes += t.numel() * t.element_size()
            what = f"{type(t).__name__} {t.dtype} {list(t.shape)} (grad_fn {type(t.grad_fn).__name__})"
            if shared:
                self.violations.append(f"offloaded {what}: shares storage with {', '.join(shared)}")
            if isinstance(t, nn.Parameter):
                self.violations.append(f"offloaded {what}: a Parameter")
            if not is_activation(t):
                self.violations.append(f"offloaded {what}: not an activation")
        return packed

    def summary(self) -> dict:
        return {"offloaded": self.offloaded, "offloaded_bytes": self.offloaded_bytes,
                "parameter_saves": self.parameter_saves, "violations": self.violations}


# -- the children -------------------------------------------------------------------------------

def _train_local(rank, device):
    """One step without FSDP on this rank's shard: the local gradients FSDP averages."""
    model = nets.vgg_like().to(device)
    x, y = data_shard(rank, device)[0]
    F.cross_entropy(model(x), y).backward()
    return {name: p.grad.detach().cpu() for name, p in model.named_parameters()}


def _shard(api, net, module, device, mesh):
    _, blocks, wrapped = NETS[net]
    if api == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(getattr(module, block), mesh=mesh)
        return fully_shard(module, mesh=mesh)  # the same object, now an FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(module, device_id=device, auto_wrap_policy=ModuleWrapPolicy(wrapped),
                use_orig_params=False)  # flat parameters: forward's weights are views of them


def _snapshot(named) -> dict:
    """The local shards (FSDP2: DTensor.to_local(); FSDP1: the flat shard), on the host."""
    return {name: _local(t).detach().cpu().clone() for name, t in named}


def _train_fsdp(rank, device, mesh, api, net, order, kwargs, full_grads=False):
    module = NETS[net][0]().to(device)  # seeded: the same weights on every rank
    options = dict(min_bytes=0, verbose=False, **kwargs)
    if order == "before":
        cswap.patch(module, **options)
    model = _shard(api, net, module, device, mesh)
    if order == "after":
        cswap.patch(model, **options)
    patched = {"before": module, "after": model}.get(order)
    recorder = None
    if patched is not None:
        swapper = _PATCHED[patched].swapper
        recorder = PackRecorder(swapper, model)
        swapper.pack = recorder  # each forward's hooks read swapper.pack when the pass begins

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = {"grads": [], "params": []}
    for step, (x, y) in enumerate(data_shard(rank, device)):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        out["grads"].append(_snapshot((name, p.grad) for name, p in model.named_parameters()))
        if step == 0 and full_grads:  # a collective: every rank runs it
            out["full_grads"] = {name: p.grad.full_tensor().cpu() for name, p in model.named_parameters()}
        opt.step()
        out["params"].append(_snapshot(model.named_parameters()))
    if patched is not None:
        out["stats"] = dict(cswap.stats(patched))
        out["recorder"] = recorder.summary()
        report = cswap.epoch_end(patched)
        out["report_rows"] = len(report.rows)
        cswap.unpatch(patched)
    return out


def _child(rank, world, device_type, out_dir):
    """Runs in a spawned process: every variant on this rank."""
    def run(rank, out):
        from torch.distributed.device_mesh import init_device_mesh

        if device_type == "cuda":
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        mesh = init_device_mesh(device_type, (world,))
        results = {"local": _train_local(rank, device)}
        for name, (api, net, order, kwargs) in VARIANTS.items():
            results[name] = _train_fsdp(rank, device, mesh, api, net, order, kwargs, name == REFERENCE)
        return results

    run_rank(rank, world, out_dir, "nccl" if device_type == "cuda" else "gloo", run)


def _spawn(out, world: int, device_type: str, deadline_s: float) -> dict:
    return spawn(_child, (world, device_type, str(out)), out, world, deadline_s, "FSDP")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("fsdp"), CPU_WORLD, "cpu", DEADLINE_S)


# -- the checks (CPU and CUDA) ----------------------------------------------------------------------

def check_reference_is_sharded(ranks: dict):
    """The unpatched FSDP2 run (VGGLike) really shards and averages: each rank holds its part of the full
    gradient, which is the same on every rank and the mean of the ranks' local gradients."""
    world = len(ranks)
    ref = {rank: res[REFERENCE] for rank, res in ranks.items()}
    for rank in range(1, world):
        assert_same(ref[rank]["full_grads"], ref[0]["full_grads"], f"full gradients, rank {rank} vs 0")
    for key, full in ref[0]["full_grads"].items():
        shards = [ref[rank]["grads"][0][key] for rank in range(world)]
        assert_same({key: torch.cat(shards)}, {key: full}, "the local shards make up the full gradient")
        if world > 1:
            assert shards[0].shape[0] < full.shape[0], f"{key}: not sharded"
        mean = sum(ranks[rank]["local"][key] for rank in range(world)) / world
        assert torch.allclose(full, mean, rtol=1e-5, atol=1e-6), f"{key}: not the mean of the local gradients"


def check_variant(ranks: dict, variant: str):
    for rank, res in ranks.items():
        got, expected = res[variant], res[reference(variant)]
        for step in range(STEPS):
            assert_same(got["grads"][step], expected["grads"][step], f"{variant}, rank {rank}, step {step} grads")
            assert_same(got["params"][step], expected["params"][step],
                        f"{variant}, rank {rank}, step {step} params")
        s, rec = got["stats"], got["recorder"]
        assert s["offloaded_tensors"] > 0 and s["restored_tensors"] > 0, (variant, rank, s)
        assert 0 < s["compressed_tensors"] <= s["offloaded_tensors"], (variant, rank, s)
        # the recorder saw every handle pack gave out
        assert rec["offloaded"] == s["offloaded_tensors"] + s["deduplicated"] + s["kept_on_gpu"], (variant, rank)
        assert got["report_rows"] > 0, (variant, rank)


def check_parameters_untouched(ranks: dict, variant: str):
    for rank, res in ranks.items():
        rec = res[variant]["recorder"]
        assert not rec["violations"], f"{variant}, rank {rank}:\n" + "\n".join(rec["violations"])
        # the check has something to check: parameters (or views of them) were saved and kept
        assert rec["parameter_saves"] > 0, (variant, rank, rec)
        assert rec["offloaded"] > 0, (variant, rank, rec)


# -- the tests --------------------------------------------------------------------------------------

def test_unpatched_fsdp_shards_and_averages(runs):
    check_reference_is_sharded(runs)


@pytest.mark.parametrize("variant", PATCHED)
def test_fsdp_gradients_and_params_equal_unpatched(runs, variant):
    check_variant(runs, variant)


@pytest.mark.parametrize("variant", PATCHED)
def test_offloading_never_touches_parameters_or_their_shards(runs, variant):
    check_parameters_untouched(runs, variant)


@pytest.mark.gpu
def test_fsdp_on_cuda(tmp_path):
    """The same runs on CUDA with nccl: one rank per GPU (a single GPU runs world size 1)."""
    world = torch.cuda.device_count()
    ranks = _spawn(tmp_path, world, "cuda", CUDA_DEADLINE_S)
    check_reference_is_sharded(ranks)
    for variant in PATCHED:
        check_variant(ranks, variant)
        check_parameters_untouched(ranks, variant)
