"""Paged KV-cache accounting: which physical blocks are free, who owns the rest, and which hold a
cached prefix.

The KV cache is `num_blocks` blocks of `block_size` token slots each; a sequence owns a block
table (a list of block ids) and position p lives in block `table[p // block_size]`. This module
only hands out and takes back block ids; the tensors live with the model runner. Pure: no torch.

Prefix caching (vLLM's automatic prefix caching): a full block whose keys and values are
computed can be *remembered* under the digest of its tokens and every token before it
(`prefix_cache.block_digests`). Another sequence whose leading blocks have the same digests
*shares* those blocks instead of recomputing them: a block has a reference count, one per
owning sequence, and shared blocks are only ever read (a sequence writes past its cached
prefix, into blocks of its own). A remembered block whose last owner frees it stays in the
free list with its contents: it can still be shared until it is handed out again, least
recently freed first, which is when it is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks of `block_size` slots needed to hold `num_tokens` token slots (ceil division)."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // block_size)


class BlockAllocator:
    """A free list of KV-cache block ids in [0, num_blocks), owners per block, and the index of
    remembered (prefix-cached) blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        """Raises ValueError unless num_blocks >= 1 and block_size >= 1."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self._num_blocks = num_blocks
        self._block_size = block_size
        # Least recently freed first. FIFO reuse: a freed block goes to the back, so tables are
        # rarely contiguous (nothing downstream can come to depend on contiguity) and a cached
        # block survives as long as the free list allows.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        #: Owning sequences per block; 0 exactly when the block is in the free list.
        self._num_owners = [0] * num_blocks
        #: Remembered blocks: digest -> block, and back.
        self._block_of: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}

    @property
    def num_blocks(self) -> int:
        """Blocks in the whole cache."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        """Token slots per block."""
        return self._block_size

    @property
    def num_free(self) -> int:
        """Blocks not owned by any sequence (remembered ones included: they can be reused)."""
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        """Blocks owned by at least one sequence; always num_blocks - num_free."""
        return self._num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Remembered blocks, owned or free."""
        return len(self._block_of)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` token slots (ceil division)."""
        return num_blocks_for(num_tokens, self._block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        """True if `num_blocks` blocks are free right now."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks, least recently freed first; a remembered one among
        them is forgotten (its contents are about to be overwritten). Raises RuntimeError if
        fewer are free (a caller bug: check can_allocate first); nothing is taken then."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"cannot allocate {num_blocks} KV blocks: {self.num_free} free")
        blocks = [self._free.popitem(last=False)[0] for _ in range(num_blocks)]
        for block in blocks:
            self._num_owners[block] = 1
            digest = self._digest_of.pop(block, None)
            if digest is not None:
                del self._block_of[digest]
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Give up one ownership of each block; a block nobody owns any more returns to the free
        list (keeping its remembered contents). Raises ValueError on a block that is not owned
        (double free, unknown id) or listed twice; nothing is freed then."""
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"block listed twice in free({blocks})")
        for block in blocks:
            if not 0 <= block < self._num_blocks or not self._num_owners[block]:
                raise ValueError(f"KV block {block} is not allocated (double free?)")
        for block in blocks:
            self._num_owners[block] -= 1
            if not self._num_owners[block]:
                self._free[block] = None

    # -- prefix caching -----------------------------------------------------------------------

    def cached_prefix(self, digests: Sequence[bytes]) -> list[int]:
        """The remembered blocks of the longest leading run of `digests` (owned or free)."""
        blocks = []
        for digest in digests:
            block = self._block_of.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_free_among(self, blocks: Iterable[int]) -> int:
        """How many of `blocks` are in the free list: sharing them takes them out of it."""
        return sum(not self._num_owners[b] for b in blocks)

    def share(self, blocks: Iterable[int]) -> None:
        """Add one owner to each of `blocks` (remembered blocks from cached_prefix), taking free
        ones out of the free list. Raises ValueError on a block that is not remembered."""
        blocks = list(blocks)
        if any(b not in self._digest_of for b in blocks):
            raise ValueError(f"only remembered blocks can be shared, got {blocks}")
        for block in blocks:
            if not self._num_owners[block]:
                del self._free[block]
            self._num_owners[block] += 1

    def remember(self, block: int, digest: bytes) -> None:
        """Index an owned, fully computed block under `digest`. A digest already remembered
        keeps its block (this one was computed alongside it and stays private), and a block
        is remembered under one digest at most."""
        if not self._num_owners[block]:
            raise ValueError(f"KV block {block} is not allocated")
        if digest in self._block_of or block in self._digest_of:
            return
        self._block_of[digest] = block
        self._digest_of[block] = digest
