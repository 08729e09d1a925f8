"""Where a patched model's saves are not cswap's to move: inside torch.func.grad, vjp,
jacrev or hessian (per-sample gradients, meta-learning), where PyTorch refuses saved-tensor
hooks, and inside another saved-tensor hooks context (torch.utils.checkpoint around the
model's call, save_on_cpu). cswap steps aside there, saying so once, instead of making the
transform raise or overriding that context; outside, it offloads as before."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import cswap
from cswap.patch import _PATCHED
from cswap.runtime.checkpointing import CheckpointedBlocks

pytestmark = pytest.mark.filterwarnings("ignore:.*saves no memory:RuntimeWarning",
                                        "ignore:.*no profile for this device:RuntimeWarning")


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(4, 16), nn.ReLU()), nn.Sequential(nn.Linear(16, 16), nn.ReLU()),
                         nn.Linear(16, 1))


def _per_sample_grads(model, x):
    """torch.func's per-sample gradients: vmap over grad of the model's functional call."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, sample):
        return functional_call(model, p, (sample[None],)).sum()

    return vmap(grad(loss), in_dims=(None, 0))(params, x)


def _step(model, x):
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["vdnn", "cswap"])
def test_a_patched_model_inside_torch_func_transforms_gives_their_gradients_and_warns_once(mode):
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    model = _net()
    expected, expected_step = _per_sample_grads(model, x), _step(copy.deepcopy(model), x)
    cswap.patch(model, mode=mode, min_bytes=0, verbose=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [_per_sample_grads(model, x) for _ in range(2)]
        said = [w for w in caught if "turns saved-tensor hooks off" in str(w.message)]
        assert len(said) == 1 and "torch.func.grad" in str(said[0].message)
        assert all(torch.equal(g[k], expected[k]) for g in got for k in expected)
        assert cswap.stats(model)["offloaded_tensors"] == 0  # nothing left inside the transform
        step = _step(model, x)  # outside it, cswap offloads as before
        assert cswap.stats(model)["offloaded_tensors"] > 0
        assert all(torch.equal(a, b) for a, b in zip(step, expected_step))
    finally:
        cswap.unpatch(model)


def test_blocks_the_plan_recomputes_run_plainly_inside_a_transform():
    """Non-reentrant checkpoint is refused there too: a block the plan recomputes runs as is."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    model = _net()
    expected = _per_sample_grads(model, x)
    cswap.patch(model, mode="vdnn", min_bytes=0, verbose=False)
    blocks = CheckpointedBlocks(model, ["0", "1"], lambda: {"0", "1"}, _PATCHED[model].controller.profiler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _per_sample_grads(model, x)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    finally:
        blocks.detach()
        cswap.unpatch(model)


def test_an_offload_region_inside_a_transform_steps_aside_with_a_warning():
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    model = _net()
    params = {k: v.detach() for k, v in model.named_parameters()}
    expected = grad(lambda p: functional_call(model, p, (x,)).sum())(params)

    def loss(p):
        with cswap.offload(mode="vdnn", min_bytes=0) as region:
            out = functional_call(model, p, (x,)).sum()
        assert region.stats["offloaded_tensors"] == 0
        return out

    with pytest.warns(RuntimeWarning, match=r"cswap.offload\(\) region began where PyTorch turns saved-tensor hooks"):
        got = grad(loss)(params)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


# -- other saved-tensor hooks around a patched model --------------------------------------------------------------

class _Counted(nn.Module):
    """_net() that counts its forward calls (a recomputation is one more)."""

    def __init__(self):
        super().__init__()
        self.net, self.calls = _net(), 0

    def forward(self, x):
        self.calls += 1
        return self.net(x)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_around_a_patched_models_call_recomputes_as_asked(reentrant):
    """torch.utils.checkpoint around the model's call decides what its saves become (made
    again in backward): cswap, whose hooks would be the innermost, leaves them alone
    instead of offloading what checkpoint means to recompute. Non-reentrant: cswap says so
    once. Reentrant: the recomputation runs inside backward, which reads its saves at once."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1), requires_grad=reentrant)
    model = _Counted()
    expected = _step(copy.deepcopy(model), x)
    cswap.patch(model, mode="vdnn", min_bytes=0, verbose=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                torch.utils.checkpoint.checkpoint(model, x, use_reentrant=reentrant).sum().backward()
        said = [w for w in caught if "inside another saved-tensor hooks context" in str(w.message)]
        assert len(said) == (0 if reentrant else 1)
        assert not said or "torch.utils.checkpoint" in str(said[0].message)
        assert model.calls == 4  # each step ran forward, then again in backward
        assert cswap.stats(model)["offloaded_tensors"] == 0
        assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
        _step(model, x)  # called plainly, cswap offloads as before
        assert cswap.stats(model)["offloaded_tensors"] > 0
    finally:
        cswap.unpatch(model)


def test_save_on_cpu_around_a_patched_model_keeps_its_say_and_a_cswap_region_nests():
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    model = _net()
    expected = _step(copy.deepcopy(model), x)
    cswap.patch(model, mode="vdnn", min_bytes=0, verbose=False)
    try:
        with pytest.warns(RuntimeWarning, match=r"inside another saved-tensor hooks context \(torch.*save_on_cpu"):
            with torch.autograd.graph.save_on_cpu():
                got = _step(model, x)
        assert cswap.stats(model)["offloaded_tensors"] == 0
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        with cswap.offload(mode="vdnn", min_bytes=0):  # cswap's own: the patched model offloads as usual
            got = _step(model, x)
        assert cswap.stats(model)["offloaded_tensors"] > 0
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    finally:
        cswap.unpatch(model)


def test_the_planners_trace_a_patched_model_as_the_same_model_unpatched():
    """cswap-plan's tracer counts what a copy of the model saves under hooks of its own: a
    patched model's copy is unpatched (cswap.runtime.module_hooks), so the tracer sees every save."""
    from cswap.plan.fake_gpu import trace_step

    x = torch.randn(32, 4)
    expected = trace_step(_net(), x)
    model = cswap.patch(_net(), mode="vdnn", min_bytes=0, verbose=False)
    try:
        got = trace_step(model, x)
    finally:
        cswap.unpatch(model)
    assert [(r.shape, r.kind) for r in got.saved] == [(r.shape, r.kind) for r in expected.saved]
    assert len(expected.saved) > 0 and (got.peak_bytes, got.offloaded_peak_bytes) == \
        (expected.peak_bytes, expected.offloaded_peak_bytes)
