"""BlockAllocator: counting, exhaustion, double free, ceil division."""

from __future__ import annotations

import pytest

from services.gpu_worker.generation.block_allocator import BlockAllocator

pytestmark = pytest.mark.unit


def test_allocate_and_free_move_blocks_between_free_and_allocated() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    first = allocator.allocate(3)
    second = allocator.allocate(5)
    assert allocator.num_free == 0
    assert allocator.num_allocated == 8
    assert sorted(first + second) == list(range(8))  # each block handed out once
    allocator.free(first)
    assert allocator.num_free == 3
    assert allocator.num_allocated == 5
    assert sorted(allocator.allocate(3)) == sorted(first)


def test_can_allocate_is_true_exactly_up_to_the_free_count() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    allocator.allocate(1)
    assert allocator.can_allocate(3)
    assert not allocator.can_allocate(4)
    assert allocator.can_allocate(0)


def test_allocating_more_than_free_raises_and_takes_nothing() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    allocator.allocate(2)
    with pytest.raises(RuntimeError, match="2 free"):
        allocator.allocate(3)
    assert allocator.num_free == 2
    assert len(allocator.allocate(2)) == 2


def test_allocate_zero_returns_no_blocks() -> None:
    allocator = BlockAllocator(num_blocks=2, block_size=16)
    assert allocator.allocate(0) == []
    assert allocator.num_free == 2


def test_double_free_raises_and_frees_nothing() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    blocks = allocator.allocate(2)
    allocator.free(blocks[:1])
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free(blocks)  # blocks[1] is valid, blocks[0] was already freed
    assert allocator.num_free == 3  # blocks[1] is still allocated
    allocator.free(blocks[1:])
    assert allocator.num_free == 4


def test_freeing_a_block_twice_in_one_call_raises() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    block = allocator.allocate(1)[0]
    with pytest.raises(ValueError, match="twice"):
        allocator.free([block, block])
    assert allocator.num_free == 3


@pytest.mark.parametrize("block", [-1, 4, 2])
def test_freeing_unknown_or_never_allocated_block_raises(block: int) -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    allocator.allocate(2)  # blocks 0 and 1
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free([block])
    assert allocator.num_free == 2


def test_freed_blocks_are_reused_last_so_tables_are_not_contiguous() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    first = allocator.allocate(1)
    allocator.free(first)
    assert allocator.allocate(1) != first


@pytest.mark.parametrize(
    ("num_tokens", "expected"), [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (48, 3), (49, 4)]
)
def test_blocks_for_is_ceil_division(num_tokens: int, expected: int) -> None:
    assert BlockAllocator(num_blocks=1, block_size=16).blocks_for(num_tokens) == expected


def test_negative_counts_raise() -> None:
    allocator = BlockAllocator(num_blocks=2, block_size=16)
    with pytest.raises(ValueError):
        allocator.blocks_for(-1)
    with pytest.raises(ValueError):
        allocator.can_allocate(-1)


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 16), (4, 0)])
def test_rejects_empty_cache_or_blocks(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockAllocator(num_blocks=num_blocks, block_size=block_size)
