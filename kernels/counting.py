"""What a codec call would cost a GPU, counted on a CPU: the kernels it launches,
the host syncs it makes, and the global memory bytes each kernel reads and writes.

    with CallCounts() as counts:
        codec.launch_into(x, reserved, sizes)
    counts.launches, counts.syncs, counts.bytes_read, counts.bytes_written

Inside the block, under Triton's interpreter (TRITON_INTERPRET=1):

- a **launch** is a Triton kernel's (the interpreter's run) or an ATen op's that
  would run a CUDA kernel: every op but views, allocations (empty), Python
  numbers wrapped as tensors and the host reads below;
- a **host sync** is a read of device data on the host: a scalar read
  (`item()`, `int()`, `bool()`: aten._local_scalar_dense), an op whose output
  size depends on the data (nonzero, masked_select), or a tensor handed to the
  host (`numpy()`, `tolist()`);
- **bytes** are the lanes a Triton kernel loads, stores or updates atomically,
  summed over its programs (each at its element size: the interpreter has no
  cache, so these are the kernel's global accesses, L2 hits included), and for an
  ATen op the sizes of its tensor inputs (read; not the destination of a fill or
  a copy) and outputs (written).

It uses private parts of Triton's interpreter (InterpreterBuilder's masked
load/store and atomic methods, InterpretedFunction.run), as the fuzz tests'
bounds checker does; a Triton without them fails on entry with a message that
says so.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .launch import interpreting

__all__ = ["KernelRun", "CallCounts"]

# Ops that run no kernel: allocations, aliases, a Python number wrapped as a tensor.
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "alias",
              "lift_fresh", "set_", "resize_", "scalar_tensor", "_local_scalar_dense"}
_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique2", "unique_consecutive", "equal", "is_nonzero"}
_OVERWRITES = {"zero_", "fill_", "copy_", "normal_", "uniform_", "random_"}  # their first argument is not read


@dataclass
class KernelRun:
    """One kernel a GPU would run: its name, whether it is a Triton kernel (else an
    ATen op's), and the global bytes it reads and writes."""

    name: str
    triton: bool
    bytes_read: int = 0
    bytes_written: int = 0


@dataclass
class CallCounts(TorchDispatchMode):
    """The kernels, host syncs and bytes of the code run inside it (module docstring)."""

    runs: list[KernelRun] = field(default_factory=list)
    syncs: list[str] = field(default_factory=list)

    def __post_init__(self):
        super().__init__()
        self._kernel: KernelRun | None = None
        self._saved: list = []

    @property
    def launches(self) -> int:
        return len(self.runs)

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.runs)

    @property
    def bytes_written(self) -> int:
        return sum(r.bytes_written for r in self.runs)

    def names(self, triton: bool | None = None) -> list[str]:
        """The launches' names, in order (only Triton's or only ATen's when asked)."""
        return [r.name for r in self.runs if triton is None or r.triton == triton]

    # -- ATen ops ---------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._kernel is not None:  # the interpreter's own handling of a kernel's arguments
            return out
        name = func.overloadpacket.__name__
        if name in _DATA_DEPENDENT or name == "_local_scalar_dense":
            self.syncs.append(f"aten.{name}")
        if func.is_view or name in _NO_KERNEL:
            return out
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if name in _OVERWRITES and inputs:
            inputs = inputs[1:]
        outputs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        self.runs.append(KernelRun(f"aten.{name}", False, sum(map(_nbytes, inputs)), sum(map(_nbytes, outputs))))
        return out

    # -- Triton kernels and host reads --------------------------------------------------------------

    def __enter__(self):
        if not interpreting():
            raise RuntimeError("cswap.kernels.counting: CallCounts counts in Triton's interpreter; "
                               "set TRITON_INTERPRET=1 before triton is imported")
        import triton.runtime.interpreter as ti

        builder = ti.InterpreterBuilder
        for name, read, written in (("create_masked_load", True, False), ("create_masked_store", False, True),
                                    ("create_atomic_rmw", True, True), ("create_atomic_cas", True, True)):
            if not hasattr(builder, name):
                raise RuntimeError(f"cswap.kernels.counting: this Triton's interpreter has no "
                                   f"InterpreterBuilder.{name}; CallCounts needs updating for it")
            self._patch(builder, name, self._accesses(getattr(builder, name), read, written))
        self._patch(ti.InterpretedFunction, "run", self._launch(ti.InterpretedFunction.run))
        for method in ("numpy", "tolist"):
            self._patch(torch.Tensor, method, self._host_read(getattr(torch.Tensor, method), method))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for owner, name, original in reversed(self._saved):
                setattr(owner, name, original)
            self._saved.clear()

    def _patch(self, owner, name, replacement) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def _launch(self, run):
        me = self

        def counted(function, *args, **kwargs):
            outer, me._kernel = me._kernel, KernelRun(function.fn.__name__.strip("_").removesuffix("_kernel"), True)
            me.runs.append(me._kernel)
            try:
                return run(function, *args, **kwargs)
            finally:
                me._kernel = outer
        return counted

    def _accesses(self, original, read: bool, written: bool):
        params = list(inspect.signature(original).parameters)
        at_ptr = params.index("ptrs" if "ptrs" in params else "ptr")
        at_mask = params.index("mask") if "mask" in params else None
        me = self

        def counted(*args, **kwargs):
            kernel = me._kernel
            if kernel is not None:
                ptrs = args[at_ptr] if at_ptr < len(args) else kwargs.get(params[at_ptr])
                mask = None
                if at_mask is not None:
                    mask = args[at_mask] if at_mask < len(args) else kwargs.get("mask")
                lanes = np.asarray(ptrs.data).size if mask is None else \
                    int(np.broadcast_to(np.asarray(mask.data, dtype=bool), np.asarray(ptrs.data).shape).sum())
                nbytes = lanes * max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
                kernel.bytes_read += nbytes if read else 0
                kernel.bytes_written += nbytes if written else 0
            return original(*args, **kwargs)
        return counted

    def _host_read(self, original, method: str):
        me = self

        def counted(tensor, *args, **kwargs):
            if me._kernel is None:
                me.syncs.append(f"Tensor.{method}")
            return original(tensor, *args, **kwargs)
        return counted


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
