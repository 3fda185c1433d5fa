"""Deterministic test sentences of varied lengths."""

from __future__ import annotations

import random

_WORDS = (
    "the quick brown fox jumps over lazy dog while serving models on a small machine with "
    "batches of requests that arrive at random times and must finish before their deadline "
    "because users wait for answers GPU memory is precious so the scheduler packs compatible "
    "work together Paris London café naïve résumé 42 3.14 hello world!"
).split()


def sentences(count: int, *, min_words: int = 1, max_words: int = 200, seed: int = 7) -> list[str]:
    """`count` sentences whose word counts spread evenly over [min_words, max_words]."""
    rng = random.Random(seed)
    span = max_words - min_words
    lengths = [min_words + (span * i) // max(1, count - 1) for i in range(count)]
    rng.shuffle(lengths)
    return [" ".join(rng.choice(_WORDS) for _ in range(n)) for n in lengths]
