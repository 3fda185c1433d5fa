"""Reads and changes the runtime model routing in Redis (services.common.model_routing).

A change is a compare-and-set (WATCH/MULTI on `<prefix>:rollout`): the new record's revision
is the stored one's plus one, so concurrent writers never lose an update and gateways see
revisions only grow. A model without a record starts from its repository's labels and weights.
"""

from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from services.common.model_repository import ModelVersion
from services.common.model_routing import ModelRouting, routing_key

Change = Callable[[ModelRouting], ModelRouting]


class RoutingStore:
    def __init__(
        self, client: aioredis.Redis, key_prefix: str, repository: list[ModelVersion]
    ) -> None:
        self._client = client
        self._key = routing_key(key_prefix)
        self._versions: dict[str, set[int]] = {}
        self._seeds: dict[str, ModelRouting] = {}
        for version in repository:
            name = version.config.name
            self._versions.setdefault(name, set()).add(int(version.version))
            self._seeds[name] = ModelRouting(
                dict(version.config.labels), dict(version.config.traffic)
            )

    def has_version(self, model: str, version: int) -> bool:
        """Whether the repository has this version of the model: a rollout checks before it
        changes anything (a cluster's worker pool included)."""
        return version in self._versions.get(model, set())

    async def show(self) -> dict[str, ModelRouting]:
        """Every repository model's routing in force (stored, else the seed)."""
        stored = await self._client.hgetall(self._key)
        routing = dict(self._seeds)
        for field, value in stored.items():
            routing[field.decode() if isinstance(field, bytes) else field] = ModelRouting.loads(
                value
            )
        return routing

    async def change(self, model: str, change: Change) -> ModelRouting:
        """Applies `change` to the model's routing in force and stores the result with the next
        revision. Raises ValueError for an unknown model, or a result naming a version the
        repository lacks; nothing is stored then."""
        if model not in self._seeds:
            raise ValueError(f"model {model!r} is not in the model repository")
        async with self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(self._key)
                    raw = await pipe.hget(self._key, model)
                    current = self._seeds[model] if raw is None else ModelRouting.loads(raw)
                    changed = change(current)
                    new = ModelRouting(changed.labels, changed.traffic, current.revision + 1)
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
        if model not in self._seeds:
            raise ValueError(f"model {model!r} is not in the model repository")
        seed = self._seeds[model]
        before = (await self.show())[model]
        await self.change(model, lambda current: seed)
        return (before.labels, before.traffic) != (seed.labels, seed.traffic)
