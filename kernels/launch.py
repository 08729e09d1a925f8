"""Launch settings shared by every codec kernel: the tuner's two knobs."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["LaunchConfig", "PROGRAMS_PER_SM", "interpreting", "launch_grid", "default_config", "check_triton_device",
           "decoder_output", "to_device", "step_elements"]

_MAX_GRID = 1 << 20
PROGRAMS_PER_SM = 4  # the untuned default launch's programs an SM (default_config)


@dataclass(frozen=True)
class LaunchConfig:
    """How a codec kernel is launched.

    grid:  number of programs. Kernels are persistent: each program walks the
           tiles in a grid-stride loop, so any grid >= 1 is correct and the
           tuner is free to search it.
    block: threads per program, a multiple of 32 (Triton's num_warps = block // 32).
    """

    grid: int
    block: int = 128

    def __post_init__(self):
        if not isinstance(self.grid, int) or not 1 <= self.grid <= _MAX_GRID:
            raise ValueError(f"cswap.LaunchConfig: grid must be an int in [1, {_MAX_GRID}], got {self.grid!r}")
        warps = self.block // 32 if isinstance(self.block, int) else 0
        if self.block % 32 or warps < 1 or warps > 32 or warps & (warps - 1):
            raise ValueError(
                f"cswap.LaunchConfig: block must be 32 times a power of two up to 1024 "
                f"(32, 64, 128, ..., 1024), got {self.block!r}"
            )

    @property
    def num_warps(self) -> int:
        return self.block // 32


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host-made table on `device`, without a host sync: a copy from pageable
    memory waits for the stream (CUDA stages it), one from pinned memory is queued.
    PyTorch's host allocator keeps the pinned block until that copy has run."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def check_triton_device(device: torch.device, who: str) -> None:
    """Raise a clear error when the Triton backend cannot run on `device`."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreting():
        return
    raise ValueError(
        f"{who}: backend='triton' needs a CUDA tensor (or a CPU tensor with TRITON_INTERPRET=1 "
        f"set before cswap is imported); got a tensor on {device}. Use backend='torch' or 'auto'."
    )


def default_config(device: torch.device) -> LaunchConfig:
    """Untuned default: a few programs per SM, 4 warps each.

    grid = PROGRAMS_PER_SM x SMs: enough resident programs to hide memory latency on H100
    (132 SMs); cswap-tune replaces it with a measured optimum.
    """
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return LaunchConfig(grid=PROGRAMS_PER_SM * sms, block=128)
    # The interpreter runs programs one after another and pays per operation, not
    # per element: fewer programs and longer steps (block 512: two or more steps
    # per tile still) are faster. Tests pass small blocks explicitly too.
    return LaunchConfig(grid=4, block=512)


def decoder_output(out: torch.Tensor | None, n: int, dtype: torch.dtype, device: torch.device,
                   zero: bool) -> torch.Tensor:
    """A decoder's output: `out` when the caller provides one (checked, zeroed when the
    decoder writes only non-zeros), else a new tensor of n elements."""
    if out is None:
        return (torch.zeros if zero else torch.empty)(n, dtype=dtype, device=device)
    if out.dtype != dtype or tuple(out.shape) != (n,) or out.device != device or not out.is_contiguous():
        raise ValueError(f"cswap.kernels: out must be a contiguous {dtype} tensor of shape ({n},) on {device}, "
                         f"got {out.dtype} of shape {tuple(out.shape)} on {out.device}")
    return out.zero_() if zero else out


# Per thread and step: 16 bytes (one 128-bit load) and at most 8 elements (each
# carries 32-bit positions and flags). Holding a whole 4096-element tile at once
# (the first kernels) took 164-255 registers at 128 threads and spilled (issue
# 12's table); steps this size keep the codec kernels under 128 registers at
# every block size the tuner searches (python -m cswap.kernels.aot).
BYTES_PER_THREAD = 16
ELEMENTS_PER_THREAD = 8

# Every launch caps ptxas at 128 registers per thread (four programs of 128 threads,
# 16 warps, per SM on sm_80/sm_90: enough resident warps to keep loads in flight).
# Left to itself ptxas went past it on sm_80 (CSR's encoder, 146-155) or held the LZ4
# encoder to 64 and spilled in its match loop; under the cap no kernel spills on
# Triton 3.8 and 6 of 672 builds do on 3.6 (benchmarks/results/static-triton-*).
MAX_REGISTERS = 128
# A block has at most 64K registers on sm_80/sm_90: at 1024 threads a thread gets 64.
# Above 512 threads the cap falls with the block, or the launch fails for want of
# registers ("out of resource: threads", seen on an H200 with LZ4's encoder at 1024).
REGISTERS_PER_BLOCK = 1 << 16


def max_registers(num_warps: int) -> int:
    """ptxas' register cap for a launch of `num_warps` warps: MAX_REGISTERS where the
    block's registers hold that many per thread, else what they hold."""
    return min(MAX_REGISTERS, REGISTERS_PER_BLOCK // (32 * num_warps))


def step_elements(tile: int, num_warps: int, itemsize: int, elements_per_thread: int = ELEMENTS_PER_THREAD) -> int:
    """Elements a program handles per step of its loop over a tile: at most the
    tile, and otherwise at least one 32-element mask word."""
    per_thread = max(1, min(elements_per_thread, BYTES_PER_THREAD // itemsize))
    return min(tile, max(32, 32 * num_warps * per_thread))


def launch_grid(config: LaunchConfig | None, num_tiles: int, device: torch.device) -> tuple[int, int]:
    """(programs, num_warps) for a persistent kernel over `num_tiles` tiles."""
    config = config or default_config(device)
    if not isinstance(config, LaunchConfig):
        raise TypeError(f"cswap.kernels: config must be a cswap.LaunchConfig or None, got {type(config).__name__}")
    return max(1, min(config.grid, num_tiles)), config.num_warps
