"""Runtime labels and traffic weights from Redis, applied to this gateway's catalog.

Every `period_s` (0.5 s) one HGETALL of `<prefix>:rollout` (services.common.model_routing)
reads every model's routing; a field with a higher revision than the one in force replaces it,
and a field removed sends the model back to its repository's seed. A change is in force on
every gateway within one period plus a round trip. A field that does not parse, or names a
version this gateway's repository lacks, is logged and skipped: the last good routing stays.
While Redis is unreachable the routing in force stays.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from redis.exceptions import RedisError

from services.common.lifecycle import cancel_and_wait, sleep_unless_stopped, stop_if_cancelled
from services.common.model_routing import ModelRouting, routing_key
from services.common.redis_acl import GATEWAY, role_credentials
from services.common.registry_schema import connect
from services.gateway.catalog import ModelCatalog

log = logging.getLogger(__name__)


class RoutingSync:
    def __init__(
        self,
        catalog: ModelCatalog,
        *,
        redis_url: str,
        password_file: Path | None,
        key_prefix: str,
        period_s: float = 0.5,
    ) -> None:
        self._catalog = catalog
        self._key = routing_key(key_prefix)
        self._period_s = period_s
        credentials = role_credentials(GATEWAY, redis_url, password_file)
        self._client = connect(redis_url, credentials=credentials)
        self._task: asyncio.Task[None] | None = None
        # Fields already reported as bad, so a bad field is logged once, not every period.
        self._reported: dict[str, bytes | str] = {}

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="routing-sync")

    async def stop(self) -> None:
        await cancel_and_wait(self._task, "the routing sync")
        await self._client.aclose()

    async def _run(self) -> None:
        while True:
            try:
                await self.sync_once()
            except (RedisError, OSError) as error:
                stop_if_cancelled()
                log.warning("routing sync failed, the routing in force stays: %s", error)
            except Exception:  # kept running: a stopped sync would freeze the routing
                stop_if_cancelled()
                log.exception("routing sync failed, the routing in force stays")
            await sleep_unless_stopped(self._period_s)

    async def sync_once(self) -> list[str]:
        """One round; returns the models whose routing changed."""
        raw = await self._client.hgetall(self._key)
        # Values are read (and refused) per model; a field name that is no UTF-8 names none.
        stored = {_text(field): value for field, value in raw.items()}
        changed = []
        for model in self._catalog.model_names():
            value = stored.get(model)
            try:
                routing = None if value is None else ModelRouting.loads(value)
                if self._catalog.set_routing(model, routing):
                    changed.append(model)
                    log.info("routing of %s now %s", model, routing or "the repository's")
                self._reported.pop(model, None)
            except ValueError as error:
                if value is not None and self._reported.get(model) != value:
                    self._reported[model] = value
                    log.error("routing of %s in Redis ignored: %s", model, error)
        return changed


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
