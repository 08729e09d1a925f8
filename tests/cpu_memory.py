"""What a real training step holds on this CPU: the allocator's peak, to check the
fake-GPU trace's prediction against."""

from __future__ import annotations

import contextlib
import copy
import weakref

import torch

from cswap.plan import fake_gpu
from cswap.plan.inputs import Inputs, default_loss


def cpu_step_peak(model, example_inputs, drop: bool = False, loss=default_loss) -> int:
    """The allocator's peak over one steady-state SGD step on this CPU (the profiler's
    memory timeline), with oneDNN off and one thread: oneDNN's scratch and the per-thread
    buffers of CPU flash attention's backward are workspace, like cuDNN's on a GPU, which
    the trace leaves to the device reserve. drop: saved activations are dropped at save
    and made again (zeros) at first use, as an offload that is instantaneous would (the
    gradients are then wrong; the memory is the point). example_inputs: as cswap.predict
    takes them (a tensor, a tuple or a dict)."""
    inputs = Inputs.of(example_inputs)
    model = copy.deepcopy(model)
    params, buffers = {id(p) for p in model.parameters()}, {id(b) for b in model.buffers()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    restored = {}

    def pack(t):
        if fake_gpu.kind_of(t, params, buffers, {id(x) for x in inputs.tensors()}) != "activation":
            return t
        st = t.untyped_storage()
        return (st.data_ptr(), st.nbytes(), t.dtype, t.shape, t.stride(), t.storage_offset())

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        key, nbytes, dtype, shape, stride, offset = packed
        base = restored.get(key)
        base = base() if base is not None else None
        if base is None or base.dtype != dtype:
            base = torch.zeros(nbytes // dtype.itemsize, dtype=dtype)  # zeros: valid max-pool indices
            restored[key] = weakref.ref(base)
        return base.as_strided(shape, stride, offset)

    def step():
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack) if drop else contextlib.nullcontext()
        with hooks:
            value = loss(inputs(model))
        value.backward()
        opt.step()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.backends.mkldnn.flags(enabled=False):
            peak = _profiled_peak(step, opt, restored)
    finally:
        torch.set_num_threads(threads)
    return peak


def _profiled_peak(step, opt, restored) -> int:
    """The peak of the second step (the first gives the optimizer its state)."""
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    step()
    opt.zero_grad(set_to_none=True)
    restored.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                record_shapes=True, with_stack=True) as prof:
        step()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    return max(sum(s) for s in sizes)
