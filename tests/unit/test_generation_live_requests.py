"""LiveRequests: the prefill backlog kept as a count must equal the sum it replaced, over the
requests whose first token is not sampled yet, through admissions, samples and departures."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from services.gpu_worker.generation.live_requests import LiveRequests

pytestmark = pytest.mark.unit


def _request(seq_id: int, num_prompt_tokens: int) -> Any:
    return SimpleNamespace(seq_id=seq_id, num_prompt_tokens=num_prompt_tokens)


def test_the_backlog_count_is_the_sum_over_requests_still_waiting_for_a_first_token() -> None:
    rng = random.Random(3)
    live = LiveRequests()
    requests: dict[int, Any] = {}
    waiting: set[int] = set()
    for seq_id in range(1, 4_000):
        action = rng.random()
        if action < 0.4 or not requests:
            request = _request(seq_id, rng.randrange(1, 300))
            live.add(request)
            requests[seq_id] = request
            waiting.add(seq_id)
        elif action < 0.8:  # a step sampled a token of a live sequence (or of one gone)
            sampled = rng.choice([*requests, seq_id + 10_000])
            assert live.sampled(sampled) is requests.get(sampled)
            waiting.discard(sampled)
        elif action < 0.97:  # finished, cancelled or failed: before or after its first token
            gone = rng.choice(list(requests))
            assert live.pop(gone) is requests.pop(gone)
            assert live.pop(gone) is None
            waiting.discard(gone)
        else:
            live.clear()
            requests.clear()
            waiting.clear()
        assert live.num_waiting_tokens == sum(requests[i].num_prompt_tokens for i in waiting)
        assert sorted(r.seq_id for r in live.values()) == sorted(requests)
        assert all((i in live) == (i in requests) for i in (seq_id, seq_id - 1))
