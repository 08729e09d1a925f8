"""Reserved device memory as CUDA's caching allocator holds it, modelled from sizes alone.

The emulated device keeps its own blocks for what it checks (data, races); this
model only answers what `torch.cuda.memory_reserved()` would say for the same
allocations and frees. It follows c10's CUDACachingAllocator (defaults, no
`max_split_size_mb`, no `empty_cache`):

- each stream has its own pools: a block freed by one stream is never handed to
  an allocation on another, which is why memory allocated on side streams adds
  to what compute holds;
- sizes round up to 512 bytes; requests up to 1 MiB come from 2 MiB segments
  (the small pool), larger ones from 20 MiB segments up to 10 MiB and from
  segments rounded up to 2 MiB beyond (the large pool);
- a request takes the smallest free block that fits in its pool and splits it
  when enough is left over (512 bytes in the small pool, over 1 MiB in the
  large), and a freed block merges with its free neighbours;
- segments are never given back, so reserved memory only grows.
"""

from __future__ import annotations

import bisect
import itertools

__all__ = ["CachingAllocatorModel"]

_MIN_BLOCK = 512
_SMALL = 1 << 20            # requests up to this come from the small pool
_SMALL_SEGMENT = 2 << 20
_LARGE_SEGMENT = 20 << 20   # for large requests under _MIN_LARGE_ALLOC
_MIN_LARGE_ALLOC = 10 << 20
_ROUND_LARGE = 2 << 20


class _Block:
    __slots__ = ("pool", "segment", "offset", "size", "free", "prev", "next")

    def __init__(self, pool, segment, offset, size):
        self.pool, self.segment, self.offset, self.size = pool, segment, offset, size
        self.free, self.prev, self.next = True, None, None


class CachingAllocatorModel:
    """Reserved bytes per stream pool; `allocate` returns a handle that `free` takes back."""

    def __init__(self):
        self.reserved = 0                 # bytes of all segments
        self._free: dict = {}             # (stream, small) -> sorted [(size, seq, block)]
        self._seq = itertools.count()     # (ties between equal sizes: oldest first)

    def allocate(self, stream, nbytes: int) -> _Block:
        size = max(_MIN_BLOCK, -(-int(nbytes) // _MIN_BLOCK) * _MIN_BLOCK)
        pool = (stream, size <= _SMALL)
        free = self._free.setdefault(pool, [])
        i = bisect.bisect_left(free, (size, -1))
        if i < len(free):
            block = free.pop(i)[2]
        else:  # a new segment
            segment = _SMALL_SEGMENT if pool[1] else \
                _LARGE_SEGMENT if size < _MIN_LARGE_ALLOC else -(-size // _ROUND_LARGE) * _ROUND_LARGE
            self.reserved += segment
            block = _Block(pool, object(), 0, segment)
        left = block.size - size
        if left >= _MIN_BLOCK if pool[1] else left > _SMALL:  # split: the rest stays free
            rest = _Block(pool, block.segment, block.offset + size, left)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.free = False
        return block

    def free(self, block: _Block) -> None:
        """The block's memory may serve its pool again (its streams are done with it)."""
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(neighbour)
                if neighbour is block.prev:
                    block.offset = neighbour.offset
                    block.prev = neighbour.prev
                    if neighbour.prev is not None:
                        neighbour.prev.next = block
                else:
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
                block.size += neighbour.size
        self._insert(block)

    def _insert(self, block: _Block) -> None:
        block.free = True
        bisect.insort(self._free.setdefault(block.pool, []), (block.size, next(self._seq), block))

    def _remove(self, block: _Block) -> None:
        free = self._free[block.pool]
        i = bisect.bisect_left(free, (block.size, -1))
        while free[i][2] is not block:
            i += 1
        del free[i]
