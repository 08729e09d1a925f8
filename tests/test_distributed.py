"""cswap under DistributedDataParallel (issue 7): 2 CPU processes, gloo backend.

One spawn of two ranks (module fixture) trains a small conv/ReLU/maxpool net
with DDP several ways on the same per-rank data shards: unpatched, and with
cswap patched into the module before wrapping it in DDP or into the DDP wrapper
after wrapping, in modes "sc" and "cswap" (a policy). The averaged gradients of
every step, and the final parameters, must equal the unpatched DDP run's bit
for bit. Each patched run ends with cswap.epoch_end in every rank; two of them
(one per order) write their reports into a per-rank report_dir.

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

import cswap  # noqa: E402
import nets  # noqa: E402
from cswap.report import ReportWriter  # noqa: E402
from ranks import assert_same, run_rank, spawn  # noqa: E402

# slow: the spawn takes about 14 s; FSDP's (tests/test_fsdp.py) stays in the quick set.
pytestmark = [pytest.mark.filterwarnings("ignore:.*saves no memory:RuntimeWarning"), pytest.mark.slow]

WORLD = 2
STEPS = 3
SHAPE = (4, 3, 16, 16)      # per-rank batch; VGGLike's activations are 2-8 KiB each
DEADLINE_S = 120            # for the whole spawn; a healthy run takes a few seconds


def zvc_policy(info):
    return "zvc"


# name -> (where cswap.patch goes: None, "before" or "after" wrapping in DDP; patch kwargs)
VARIANTS = {
    "unpatched": (None, {}),
    "before-sc": ("before", {"mode": "sc"}),
    "after-sc": ("after", {"mode": "sc"}),
    "before-cswap": ("before", {"mode": "cswap", "policy": zvc_policy}),
    "after-cswap": ("after", {"mode": "cswap", "policy": zvc_policy}),
    "after-cswap-no-stash": ("after", {"mode": "cswap", "policy": zvc_policy, "stash_bytes": 0}),
}
PATCHED = [name for name, (order, _) in VARIANTS.items() if order is not None]
REPORTED = ["before-sc", "after-cswap"]  # with a per-rank report_dir (writing the plots takes ~0.5 s a run)


def data_shard(rank):
    """Each rank's own batches (different seeds: different data per rank)."""
    return nets.batches(SHAPE, STEPS, seed=100 + rank)


# -- the children -------------------------------------------------------------------------------

def _train_local(rank):
    """One step without DDP on this rank's shard: the local gradients DDP averages."""
    model = nets.vgg_like()
    x, y = data_shard(rank)[0]
    F.cross_entropy(model(x), y).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _train_ddp(rank, order, kwargs, report_dir):
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = nets.vgg_like()  # seeded: the same weights on both ranks (DDP broadcasts rank 0's anyway)
    options = dict(min_bytes=0, verbose=False, report_dir=report_dir, **kwargs)
    if order == "before":
        cswap.patch(module, **options)
    model = DDP(module)
    if order == "after":
        cswap.patch(model, **options)
    patched = {"before": module, "after": model}.get(order)

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for x, y in data_shard(rank):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads.append({name: p.grad.clone() for name, p in module.named_parameters()})
        opt.step()
    out = {"grads": grads, "params": {name: p.detach().clone() for name, p in module.named_parameters()}}
    if patched is not None:
        out["stats"] = dict(cswap.stats(patched))
        report = cswap.epoch_end(patched)
        out["epoch"] = report.epoch
        out["layers"] = sorted({row.layer for row in report.rows})
        cswap.unpatch(patched)
    return out


def _run(rank, out):
    results = {"local": _train_local(rank)}
    for name, (order, kwargs) in VARIANTS.items():
        report_dir = out / name / f"rank{rank}" if name in REPORTED else None
        results[name] = _train_ddp(rank, order, kwargs, report_dir)
    return results


def _child(rank, out_dir):
    """Runs in a spawned process: every variant on this rank."""
    run_rank(rank, WORLD, out_dir, "gloo", _run)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    return {"dir": out, "ranks": spawn(_child, (str(out),), out, WORLD, DEADLINE_S, "DDP")}


# -- the tests --------------------------------------------------------------------------------------

def test_unpatched_ddp_averages_the_ranks_gradients(runs):
    """The reference is real DDP: both ranks hold the same gradients, the mean of their local ones."""
    r0, r1 = runs["ranks"][0], runs["ranks"][1]
    for step in range(STEPS):
        assert_same(r1["unpatched"]["grads"][step], r0["unpatched"]["grads"][step], f"step {step}, rank 1 vs 0")
    assert any(not torch.equal(r0["local"][k], r1["local"][k]) for k in r0["local"]), "shards must differ"
    for key, g in r0["unpatched"]["grads"][0].items():
        mean = (r0["local"][key] + r1["local"][key]) / 2  # DDP sums in bucket order: equal up to rounding
        assert torch.allclose(g, mean, rtol=1e-5, atol=1e-7), f"{key}: not the mean of the local gradients"


@pytest.mark.parametrize("variant", PATCHED)
def test_ddp_gradients_equal_unpatched(runs, variant):
    for rank, res in runs["ranks"].items():
        got, expected = res[variant], res["unpatched"]
        for step in range(STEPS):
            assert_same(got["grads"][step], expected["grads"][step], f"{variant}, rank {rank}, step {step}")
        assert_same(got["params"], expected["params"], f"{variant}, rank {rank}, final parameters")
        s = got["stats"]
        assert s["offloaded_tensors"] > 0 and s["restored_tensors"] > 0, (variant, rank, s)
        assert 0 < s["compressed_tensors"] <= s["offloaded_tensors"], (variant, rank, s)
        assert s["transferred_bytes"] < s["offloaded_bytes"], (variant, rank, s)


@pytest.mark.parametrize("variant", REPORTED)
def test_each_rank_writes_its_own_reports(runs, variant):
    order = VARIANTS[variant][0]
    for rank, res in runs["ranks"].items():
        report_dir = runs["dir"] / variant / f"rank{rank}"
        assert (report_dir / "epochs.jsonl").is_file(), f"{variant}: rank {rank} wrote no epochs.jsonl"
        reports = ReportWriter.read(report_dir)
        assert [r.epoch for r in reports] == [res[variant]["epoch"]] == [0]
        assert reports[0].rows, f"{variant}, rank {rank}: an empty report"
        layers = {row.layer for row in reports[0].rows}
        assert layers == set(res[variant]["layers"])
        # patched through the wrapper, layers are named by their path in it
        prefixed = {layer.startswith("module.") for layer in layers}
        assert prefixed == {order == "after"}, (variant, sorted(layers))
