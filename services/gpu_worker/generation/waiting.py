"""The sequences waiting for admission, grouped so that choosing the next one does not read
them all.

The scheduler admits the waiting sequence with the least (priority, its tenant's compute per
weight, arrival, id) (`GenerationScheduler._next_waiting`). Read as a minimum over every
waiting sequence, each admission cost a pass over the whole backlog: with 1,500 sequences
waiting (an open-loop flood past what the engine serves), a tenth of the engine's time went to
it, and steps slowed just when the backlog asked for more of them. Here the sequences wait in
one list per priority class and tenant, sorted by (arrival, id): a group's head is the least
of its sequences by every part of the key (a tenant's compute is the same for all of them),
so the next sequence is the least of the heads of the most urgent class's groups, and
choosing it costs one look per tenant waiting in that class.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator

from services.gpu_worker.generation.sequence import Sequence


def _arrival(seq: Sequence) -> tuple[float, int]:
    return (seq.arrival_s, seq.seq_id)


def _first_unstarted(group: list[Sequence]) -> Sequence | None:
    """A group's first sequence with no token yet (one look, but where a preempted sequence
    that streamed tokens comes first), or None."""
    for seq in group:
        if not seq.output_token_ids:
            return seq
    return None


class WaitingSequences:
    """Waiting sequences by priority class (lower first) and tenant, each group in arrival
    order."""

    __slots__ = ("_classes", "_count", "_tokens", "num_admitted")

    def __init__(self) -> None:
        #: priority -> tenant -> the tenant's waiting sequences of that priority, by arrival.
        #: Classes and tenants with none waiting are dropped.
        self._classes: dict[int, dict[str, list[Sequence]]] = {}
        self._count = 0
        #: priority -> the tokens of its waiting sequences (prompts, and what a preempted one
        #: produced: all of it computed again once it runs).
        self._tokens: dict[int, int] = {}
        #: Sequences taken out to run so far, each once (`admit`; not those finished while
        #: waiting).
        self.num_admitted = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def add(self, seq: Sequence) -> None:
        """Queues `seq` by its own arrival (a preempted sequence goes back ahead of later
        arrivals)."""
        group = self._classes.setdefault(seq.priority, {}).setdefault(seq.tenant, [])
        bisect.insort(group, seq, key=_arrival)
        self._count += 1
        self._tokens[seq.priority] = self._tokens.get(seq.priority, 0) + seq.num_tokens

    def remove(self, seq: Sequence) -> None:
        """Takes `seq` out; ValueError if it is not waiting here."""
        tenants = self._classes.get(seq.priority)
        group = None if tenants is None else tenants.get(seq.tenant)
        if group is None:
            raise ValueError(f"sequence {seq.seq_id} is not waiting")
        index = bisect.bisect_left(group, _arrival(seq), key=_arrival)
        if index == len(group) or group[index] is not seq:
            raise ValueError(f"sequence {seq.seq_id} is not waiting")
        del group[index]
        self._count -= 1
        self._tokens[seq.priority] -= seq.num_tokens
        if not group:
            del tenants[seq.tenant]  # type: ignore[union-attr]  # found above
            if not tenants:
                del self._classes[seq.priority]
                del self._tokens[seq.priority]

    def num_tokens_at_most(self, priority: int) -> int:
        """Tokens of the waiting sequences of priority `priority` or more urgent."""
        return sum(n for p, n in self._tokens.items() if p <= priority)

    def admit(self, seq: Sequence) -> None:
        """Takes `seq` out to run (`remove`), counted in `num_admitted` unless it ran before
        (a preempted one admitted again moves no one else's turn)."""
        self.remove(seq)
        if not seq.num_preemptions:
            self.num_admitted += 1

    def heads(self, max_priority: int) -> Iterator[tuple[int, str, Sequence]]:
        """(priority, tenant, its first sequence with no token yet) for each group of priority
        `max_priority` or more urgent that has one. (A preempted sequence that streamed tokens
        waits again, but its arrival is not when it began to wait: it is passed over.)"""
        for priority, tenants in self._classes.items():
            if priority <= max_priority:
                for tenant, head in self._class_heads(tenants):
                    yield priority, tenant, head

    def class_heads(self, priority: int) -> Iterator[tuple[str, Sequence]]:
        """As `heads`, for the groups of class `priority` alone: (tenant, its first), in the
        order the groups were made."""
        return self._class_heads(self._classes.get(priority, {}))

    def head(self, priority: int, tenant: str) -> Sequence | None:
        """The first sequence with no token yet of `tenant` in class `priority`, or None."""
        group = self._classes.get(priority, {}).get(tenant)
        return None if group is None else _first_unstarted(group)

    @staticmethod
    def _class_heads(tenants: dict[str, list[Sequence]]) -> Iterator[tuple[str, Sequence]]:
        for tenant, group in tenants.items():
            if (head := _first_unstarted(group)) is not None:
                yield tenant, head

    def oldest_arrival_s(self, max_priority: int) -> float | None:
        """The earliest arrival among the sequences of priority `max_priority` or more urgent
        that have no token yet (`heads`), or None."""
        return min((head.arrival_s for *_, head in self.heads(max_priority)), default=None)

    def waited_since(self, arrived_before_s: float, max_priority: int) -> list[Sequence]:
        """The sequences of priority `max_priority` or more urgent that arrived before
        `arrived_before_s` and have sampled no token yet (none preempted after its first)."""
        return [
            seq
            for priority, tenants in self._classes.items()
            if priority <= max_priority
            for group in tenants.values()
            for seq in itertools.takewhile(lambda s: s.arrival_s < arrived_before_s, group)
            if not seq.output_token_ids
        ]

    def next(self, compute_s: Callable[[str], float]) -> Sequence:
        """The sequence to admit next: the most urgent priority class, then the tenant with the
        least `compute_s(tenant)` (compute per weight), then the earliest arrival and the
        lowest id. IndexError when none waits."""
        if not self._classes:
            raise IndexError("no sequence is waiting")
        tenants = self._classes[min(self._classes)]
        best: Sequence | None = None
        best_key: tuple[float, float, int] | None = None
        for tenant, group in tenants.items():
            head = group[0]
            key = (compute_s(tenant), head.arrival_s, head.seq_id)
            if best_key is None or key < best_key:
                best, best_key = head, key
        assert best is not None  # a class kept has a group, a group kept has a sequence
        return best
