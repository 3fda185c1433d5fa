"""Reads and changes the runtime model routing in Redis (services.common.model_routing).

A change is a compare-and-set (WATCH/MULTI on `<prefix>:rollout`): the new record's revision
is the stored one's plus one, so concurrent writers never lose an update and gateways see
revisions only grow. A model without a record starts from its repository's labels and weights.

A record that cannot be read (edited by hand) fails only what touches its model: listing skips
it (logged), `reset` rewrites it from the repository with the next revision when its revision
can still be read.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from services.common.errors import MALFORMED_RECORD_ERRORS
from services.common.model_repository import ModelKind, ModelVersion
from services.common.model_routing import ModelRouting, routing_key
from services.common.repository_state import revision_after

log = logging.getLogger(__name__)

Change = Callable[[ModelRouting], ModelRouting]


class RoutingStore:
    def __init__(
        self, client: aioredis.Redis, key_prefix: str, repository: list[ModelVersion]
    ) -> None:
        self._client = client
        self._key = routing_key(key_prefix)
        self._versions: dict[str, set[int]] = {}
        self._seeds: dict[str, ModelRouting] = {}
        self._kinds: dict[str, ModelKind] = {}
        for version in repository:
            name = version.config.name
            self._kinds[name] = version.config.kind
            self._versions.setdefault(name, set()).add(int(version.version))
            self._seeds[name] = ModelRouting(
                dict(version.config.labels), dict(version.config.traffic)
            )

    def kind(self, model: str) -> ModelKind:
        """The model's kind (ValueError for a model the repository lacks)."""
        self._check_model(model)
        return self._kinds[model]

    def has_version(self, model: str, version: int) -> bool:
        """Whether the repository has this version of the model: a rollout checks before it
        changes anything (a cluster's worker pool included)."""
        return version in self._versions.get(model, set())

    async def show(self) -> dict[str, ModelRouting]:
        """Every repository model's routing in force (stored, else the seed); a stored record
        that cannot be read is left out, logged."""
        stored = await self._client.hgetall(self._key)
        routing = dict(self._seeds)
        for field, value in stored.items():
            model = field.decode() if isinstance(field, bytes) else field
            try:
                routing[model] = _parsed(model, value)
            except ValueError as error:
                routing.pop(model, None)
                log.warning("%s", error)
        return routing

    async def routing(self, model: str) -> ModelRouting:
        """The model's routing in force. Raises ValueError for a model the repository lacks,
        or a stored record that cannot be read."""
        self._check_model(model)
        raw = await self._client.hget(self._key, model)
        return self._seeds[model] if raw is None else _parsed(model, raw)

    def _check_model(self, model: str) -> None:
        if model not in self._seeds:
            raise ValueError(f"model {model!r} is not in the model repository")

    async def change(
        self, model: str, change: Change, *, rewrites_unreadable: bool = False
    ) -> ModelRouting:
        """Applies `change` to the model's routing in force and stores the result with the
        next revision (`revision_after` the record's: a Redis restarted empty starts no
        record over at a revision the gateways hold already, which would ignore every change
        up to it). Raises ValueError
        for an unknown model, a result naming a version the repository lacks, or a stored
        record that cannot be read (unless `rewrites_unreadable`: `change` then gets the
        seed, and the record's revision is kept when it can be read); nothing is stored
        then."""
        self._check_model(model)
        async with self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(self._key)
                    raw = await pipe.hget(self._key, model)
                    if raw is None:
                        current = self._seeds[model]
                    elif rewrites_unreadable:
                        current = _readable_or_seed(model, raw, self._seeds[model])
                    else:
                        current = _parsed(model, raw)
                    changed = change(current)
                    revision = revision_after(current.revision, time.time())
                    new = ModelRouting(changed.labels, changed.traffic, revision)
                    new.check_versions(self._versions[model])
                    pipe.multi()
                    pipe.hset(self._key, model, new.dumps())
                    await pipe.execute()
                    return new
                except WatchError:
                    continue  # another writer got in first: read again

    async def reset(self, model: str) -> bool:
        """Back to the repository's labels and weights, stored as the next revision. True if a
        routing other than the repository's was in force. Not a deletion: revisions would then
        restart from the seed's, and a gateway that missed the deletion between two polls
        would ignore every later change as older than the one it holds."""
        self._check_model(model)
        seed = self._seeds[model]
        before: ModelRouting | None
        try:
            before = await self.routing(model)
        except ValueError:
            before = None  # unreadable: rewritten
        await self.change(model, lambda current: seed, rewrites_unreadable=True)
        return before is None or (before.labels, before.traffic) != (seed.labels, seed.traffic)


def _parsed(model: str, raw: str | bytes) -> ModelRouting:
    try:
        return ModelRouting.loads(raw)
    except ValueError as error:
        raise ValueError(
            f"model {model!r}: its stored routing cannot be read ({error}); "
            "`routing reset` rewrites it from the repository"
        ) from None


def _readable_or_seed(model: str, raw: str | bytes, seed: ModelRouting) -> ModelRouting:
    """The stored record; for one that cannot be read, the seed at the record's revision. Raises
    ValueError when not even that can be read: a rewrite at a revision gateways hold already
    would be ignored by them."""
    try:
        return ModelRouting.loads(raw)
    except ValueError:
        pass
    try:  # its revision, read as a record's is, with the seed's labels and weights
        revision = json.loads(raw)["revision"]
        record = {"revision": revision, "labels": dict(seed.labels), "traffic": dict(seed.traffic)}
        return ModelRouting.loads(json.dumps(record))
    except MALFORMED_RECORD_ERRORS:  # ModelRouting.loads raises ValueError
        raise ValueError(
            f"model {model!r}: its stored routing and its revision cannot be read; delete the "
            "field and restart the gateways (they ignore revisions not above theirs)"
        ) from None
