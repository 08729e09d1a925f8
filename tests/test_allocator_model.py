"""cswap.runtime.allocator_model: reserved memory as CUDA's caching allocator holds it."""

from __future__ import annotations

from cswap.runtime.allocator_model import CachingAllocatorModel

MiB = 1 << 20


def test_segments_are_sized_as_cudas_small_and_large_pools():
    model = CachingAllocatorModel()
    model.allocate("compute", 100)                 # small pool: one 2 MiB segment
    assert model.reserved == 2 * MiB
    model.allocate("compute", 3 * MiB)             # large, under 10 MiB: a 20 MiB segment
    assert model.reserved == 22 * MiB
    model.allocate("compute", 18 * MiB + 1)        # 10 MiB and over, more than is left: rounded up to 2 MiB
    assert model.reserved == 22 * MiB + 20 * MiB
    model.allocate("compute", 17 * MiB)            # what the 20 MiB segment has left
    assert model.reserved == 42 * MiB


def test_a_segment_is_split_between_requests_and_merged_back_when_freed():
    model = CachingAllocatorModel()
    a = model.allocate("s", 3 * MiB)
    b = model.allocate("s", 3 * MiB)               # the rest of a's 20 MiB segment
    c = model.allocate("s", 3 * MiB)
    assert model.reserved == 20 * MiB
    model.free(a)
    model.free(b)                                  # a and b merge: 6 MiB free in one block
    model.allocate("s", 6 * MiB)
    assert model.reserved == 20 * MiB
    model.free(c)
    assert model.allocate("s", 14 * MiB) and model.reserved == 20 * MiB  # c merged with the tail


def test_a_leftover_of_1_mib_or_less_is_not_split_off():
    model = CachingAllocatorModel()
    a = model.allocate("s", 12 * MiB)
    model.free(a)
    model.allocate("s", 11 * MiB + 512)            # takes the whole 12 MiB block
    model.allocate("s", 11 * MiB)                  # nothing left in it: a new segment
    assert model.reserved == 24 * MiB


def test_the_smallest_free_block_that_fits_is_taken():
    model = CachingAllocatorModel()
    big, small = model.allocate("s", 16 * MiB), model.allocate("s", 12 * MiB)
    model.free(big)
    model.free(small)
    model.allocate("s", 12 * MiB)                  # the 12 MiB block, leaving the 16 MiB one whole
    model.allocate("s", 16 * MiB)
    assert model.reserved == 28 * MiB


def test_memory_one_stream_freed_never_serves_another_stream():
    model = CachingAllocatorModel()
    model.free(model.allocate("codec", 12 * MiB))
    model.allocate("h2d", 12 * MiB)
    assert model.reserved == 24 * MiB
    model.allocate("codec", 12 * MiB)              # the codec stream's own cached block
    assert model.reserved == 24 * MiB
