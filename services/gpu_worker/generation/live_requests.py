"""The generation engine's live requests, by sequence id, and the prompt tokens of those whose
first token is not sampled yet (the prefill backlog), kept as a count.

The count is read at every admission (the first-token deadline's prediction) and by the
worker's record: summed over every live request at each read, it cost a pass over the whole
backlog per arriving request, as the scheduler's choice of the next waiting sequence once did
(`waiting.py`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.gpu_worker.generation.request_stream import RequestStream


class LiveRequests:
    """Requests by sequence id, each counted in `num_waiting_tokens` until its first token is
    sampled (`sampled`) or it leaves (`pop`, `clear`)."""

    __slots__ = ("_awaiting", "_by_seq", "_num_waiting_tokens")

    def __init__(self) -> None:
        self._by_seq: dict[int, RequestStream] = {}
        #: seq_id -> prompt tokens, of the requests whose first token is not sampled yet.
        self._awaiting: dict[int, int] = {}
        self._num_waiting_tokens = 0  # the sum of `_awaiting`

    @property
    def num_waiting_tokens(self) -> int:
        """Prompt tokens whose first token is still to come."""
        return self._num_waiting_tokens

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._by_seq

    def values(self) -> Iterator[RequestStream]:
        return iter(self._by_seq.values())

    def get(self, seq_id: int) -> RequestStream | None:
        return self._by_seq.get(seq_id)

    def add(self, request: RequestStream) -> None:
        """A new request, its prompt waiting for its first token."""
        self._by_seq[request.seq_id] = request
        self._awaiting[request.seq_id] = request.num_prompt_tokens
        self._num_waiting_tokens += request.num_prompt_tokens

    def sampled(self, seq_id: int) -> RequestStream | None:
        """The live request of a sequence that just sampled a token (None: gone), its prompt
        no longer waiting."""
        self._forget_prompt(seq_id)
        return self._by_seq.get(seq_id)

    def pop(self, seq_id: int) -> RequestStream | None:
        """Forgets the request of `seq_id` (None: not live)."""
        self._forget_prompt(seq_id)
        return self._by_seq.pop(seq_id, None)

    def clear(self) -> None:
        self._by_seq.clear()
        self._awaiting.clear()
        self._num_waiting_tokens = 0

    def _forget_prompt(self, seq_id: int) -> None:
        if (num_tokens := self._awaiting.pop(seq_id, None)) is not None:
            self._num_waiting_tokens -= num_tokens
