"""Digests of a sequence's full KV blocks: the keys of the prefix cache.

Block i's digest covers its own tokens and, through block i-1's digest, every token before it:
two sequences share block i's keys and values only if all their tokens up to its end agree
(attention makes a block's KV depend on the whole prefix). A salt starts the chain, so blocks
are shared only among sequences with the same salt (the model's scope: one for everyone, or one
per tenant, when one tenant must not learn from its time to first token that another sent the
same prompt).

The digest is cryptographic (BLAKE2b, 128 bits) on purpose: a collision would hand a sequence
another prompt's KV, a wrong answer rather than a slow one, and Python's own hash of integers
can be collided on purpose (vLLM moved to SHA-256 for that reason). Pure: no torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Protocol

from services.gpu_worker.generation.block_allocator import BlockAllocator

DIGEST_BYTES = 16


def root_digest(salt: str) -> bytes:
    """The chain's start for sequences of this salt."""
    return hashlib.blake2b(salt.encode(), digest_size=DIGEST_BYTES, person=b"kv-prefix").digest()


def extend_digests(
    digests: list[bytes],
    token_ids: Sequence[int],
    *,
    block_size: int,
    num_blocks: int,
    salt: str,
) -> list[bytes]:
    """Appends to `digests` (those of the first len(digests) full blocks of `token_ids`) the
    digests of the next full blocks, up to `num_blocks` in all; returns `digests`. Raises
    ValueError if `token_ids` has fewer than num_blocks full blocks."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(
            f"{num_blocks} blocks of {block_size} need {num_blocks * block_size} tokens,"
            f" have {len(token_ids)}"
        )
    previous = digests[-1] if digests else root_digest(salt)
    for i in range(len(digests), num_blocks):
        block = array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        previous = hashlib.blake2b(previous + block, digest_size=DIGEST_BYTES).digest()
        digests.append(previous)
    return digests


class CachingSequence(Protocol):
    """What the prefix cache reads and keeps of a scheduler's sequence."""

    cache_salt: str
    block_digests: list[bytes]
    block_table: list[int]
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> tuple[int, ...]: ...


def _digests_up_to(seq: CachingSequence, num_blocks: int, block_size: int) -> list[bytes]:
    if len(seq.block_digests) < num_blocks:
        extend_digests(
            seq.block_digests,
            seq.all_token_ids,
            block_size=block_size,
            num_blocks=num_blocks,
            salt=seq.cache_salt,
        )
    return seq.block_digests[:num_blocks]


def cached_prefix_of(seq: CachingSequence, allocator: BlockAllocator) -> list[int]:
    """The remembered blocks of `seq`'s leading full blocks. Its last known token is always
    computed, never taken from the cache: its logits sample the next token."""
    block_size = allocator.block_size
    num_blocks = (seq.num_tokens - 1) // block_size
    return allocator.cached_prefix(_digests_up_to(seq, num_blocks, block_size))


def remember_filled_blocks(
    seq: CachingSequence, allocator: BlockAllocator, num_computed_before: int
) -> None:
    """Remembers the blocks of `seq` that its last step filled (its num_computed_tokens grew
    from `num_computed_before`): their KV is computed, so sequences with the same leading
    tokens may share them."""
    block_size = allocator.block_size
    first, end = num_computed_before // block_size, seq.num_computed_tokens // block_size
    if end <= first:
        return
    digests = _digests_up_to(seq, end, block_size)
    for i in range(first, end):
        allocator.remember(seq.block_table[i], digests[i])
