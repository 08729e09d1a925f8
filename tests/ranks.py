"""Spawned ranks for the distributed tests (DDP, FSDP).

Each child process initialises torch.distributed with a file store in a
temporary folder, runs its part, and writes its results (torch.save) or its
traceback to files there; the parent waits with a deadline, kills ranks stuck
in a collective after a peer failed, and reports every failure at once.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import multiprocessing.connection
import os
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Callable

import pytest
import torch

PG_TIMEOUT_S = 60  # collectives give up after this (a rank died mid-step)


def run_rank(rank: int, world: int, out_dir: str, backend: str, body: Callable[[int, Path], dict]) -> None:
    """In a child: join the group, run body(rank, out), save what it returns; a traceback on failure."""
    out = Path(out_dir)
    try:
        import torch.distributed as dist

        warnings.filterwarnings("ignore", message=".*saves no memory", category=RuntimeWarning)
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank, before the group forms
        if backend == "gloo":
            torch.set_num_threads(1)  # the ranks share the machine's cores
            if sys.platform.startswith("linux"):
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # never depend on the hostname resolving
        dist.init_process_group(backend, init_method=(out / "store").as_uri(), rank=rank, world_size=world,
                                timeout=timedelta(seconds=PG_TIMEOUT_S))
        try:
            results = body(rank, out)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        torch.save(results, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def spawn(target: Callable, args: tuple, out: Path, world: int, deadline_s: float, label: str) -> dict:
    """Start target(rank, *args) in `world` spawned processes; {rank: results} once all succeeded.
    One spawn at a time on the machine (pytest -n runs test modules side by side): gloo
    ranks of two spawns at once on two cores took 120 s instead of 10."""
    with open(Path(tempfile.gettempdir()) / "cswap-tests-spawned-ranks.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _spawn(target, args, out, world, deadline_s, label)


def _spawn(target: Callable, args: tuple, out: Path, world: int, deadline_s: float, label: str) -> dict:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, *args), name=f"cswap-{label}-rank{rank}", daemon=True)
             for rank in range(world)]
    start = time.monotonic()
    for p in procs:
        p.start()
    deadline = start + deadline_s
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            # Liveness is asked each second, not left to the sentinels: in full pytest -n runs the
            # wait sometimes returned only at the deadline (120 s), though both ranks had saved their
            # results within seconds and exited with code 0.
            multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()],
                                            timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            if any(p.exitcode not in (None, 0) for p in procs):  # one rank failed: the other may be stuck
                deadline = min(deadline, time.monotonic() + 10)   # in a collective; give it 10 s
    finally:
        hung = [p.name for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    problems = []
    for rank, p in enumerate(procs):
        error = out / f"rank{rank}.error"
        if error.exists():
            problems.append(f"rank {rank} raised:\n{error.read_text()}")
        elif p.name in hung:
            problems.append(f"rank {rank} did not finish within {deadline_s} s (killed)")
        elif p.exitcode != 0:
            problems.append(f"rank {rank} exited with code {p.exitcode} (no traceback: crashed or killed)")
        elif not (out / f"rank{rank}.pt").exists():
            problems.append(f"rank {rank} exited cleanly but wrote no results")
    if problems:
        pytest.fail(f"{label} children failed:\n" + "\n".join(problems), pytrace=False)
    return {rank: torch.load(out / f"rank{rank}.pt") for rank in range(world)}


def assert_same(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for key in expected:
        a, b = got[key], expected[key]
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {key}"
        assert torch.equal(a, b), \
            f"{what}: {key} differs (max abs diff {(a.double() - b.double()).abs().max().item()})"
