"""Decoupled look-back (Merrill and Garland 2016): a one-pass exclusive prefix sum
over tiles that programs take by ticket, shared by the encoders that place their
output in one pass (ZVC's tiles, LZ4's chunks).

state_ptr: int64[num_tiles + 1], zero before the launch. Word 0 hands out tickets;
word 1 + t holds tile t's state: a count with its kind in the top bits.
AGGREGATE: the tile's own count; INCLUSIVE: the count up to and including the tile.
Tiles are taken in ticket order, so a tile waits only on tiles that running programs
hold, which never wait on it: no deadlock, however many programs the grid has.

Every atomic here is relaxed. A state word carries all a reader needs (the count and its
kind, in one 64-bit word), and no tile reads anything else another tile wrote in the same
launch, so no ordering is needed beyond the word's own. Triton's default, acq_rel, put a
full fence before each (MEMBAR.ALL.GPU: wait until every store the thread issued, the
tile's values among them, has landed) and an L1 invalidation after it: four or more a
tile, serialising each tile's stores with the next tile's ticket (sm_90 builds, 2026-12-05).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["LOOK_BACK", "ticket", "exclusive_prefix"]

# Predecessors a tile's look-back reads at once: one warp-wide load.
LOOK_BACK = 32

_AGGREGATE = tl.constexpr(1 << 60)
_INCLUSIVE = tl.constexpr(2 << 60)
_COUNT = tl.constexpr((1 << 60) - 1)


@triton.jit
def ticket(state_ptr):
    """The next tile to work on (tiles are handed out in order)."""
    return tl.atomic_add(state_ptr, 1, sem="relaxed").to(tl.int64)


@triton.jit
def exclusive_prefix(state_ptr, t, total, LOOK: tl.constexpr):
    """Publish tile t's count `total` (int64) and return the sum of the counts of
    tiles 0..t-1: look back over windows of LOOK predecessors until one holds an
    inclusive count (a window with a tile not yet published is read again)."""
    look = tl.arange(0, LOOK)
    first = t == 0
    tl.atomic_xchg(state_ptr + 1 + t, total | tl.where(first, _INCLUSIVE, _AGGREGATE), sem="relaxed")
    prefix = total * 0
    end = t
    done = first.to(tl.int32)
    while done == 0:
        idx = end - LOOK + look
        state = tl.atomic_add(state_ptr + 1 + idx, 0, mask=idx >= 0, sem="relaxed")
        state = tl.where(idx >= 0, state, _INCLUSIVE)  # before tile 0: an inclusive count of 0
        kind = state >> 60
        last = tl.max(tl.where(kind == 2, look, -1), axis=0)
        ready = tl.min(tl.where(look >= last, kind, 2), axis=0) > 0
        add = tl.sum(tl.where(look >= last, state & _COUNT, 0), axis=0)
        prefix += tl.where(ready, add, 0)
        end = tl.where(ready & (last < 0), end - LOOK, end)
        done = (ready & (last >= 0)).to(tl.int32)
    if t > 0:
        tl.atomic_xchg(state_ptr + 1 + t, (prefix + total) | _INCLUSIVE, sem="relaxed")
    return prefix
