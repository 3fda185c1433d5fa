"""The job store's room in Redis: what a new job may fill of its `maxmemory`, and how a write
Redis refused at its cap reads. The store (services/common/job_store.py) looks at the room
before a job's items are written; its enqueue script decides, with the job's reservation, in
one step (job_scripts.ENQUEUE)."""

from __future__ import annotations

import logging
from typing import Any

from redis.exceptions import NoPermissionError, OutOfMemoryError, ResponseError

log = logging.getLogger(__name__)

#: Share of Redis's `maxmemory` that what it holds, the results the jobs not ended are
#: expected to add (reserved at submit) and a new job's items and expected results may fill;
#: past it the new job is refused (StoreFull; JobTooLarge for one that alone would pass it).
#: The rest is room for the runners' counters, results larger than expected, results written
#: while still reserved, and the fabric's own keys (heartbeats, quota shares), which Redis
#: refuses to write once at `maxmemory` with nothing to evict (deploy/k8s/base/redis.yaml).
SUBMIT_MEMORY_SHARE = 0.75
#: Bytes a result takes in the store besides its outputs (its hash field, status, framing).
RESULT_OVERHEAD_BYTES = 64


class StoreFull(Exception):
    """Redis holds too much to take a new job now (see SUBMIT_MEMORY_SHARE)."""

    def __init__(self, used: int, reserved: int, asked: int, room: int) -> None:
        super().__init__(
            f"{used} bytes held, {reserved} reserved and {asked} asked of the job store's {room}"
        )


class JobTooLarge(Exception):
    """A job's items and expected results alone are more than the store takes (see
    SUBMIT_MEMORY_SHARE): it would be refused however empty the store."""


async def check_room(client: Any, reserved_key: str, num_bytes: int) -> None:
    """Raises StoreFull when Redis, with what it holds, the reservations of the jobs not
    ended (`reserved_key`) and `num_bytes` more, would pass SUBMIT_MEMORY_SHARE of its
    `maxmemory` (none set: no check); JobTooLarge when `num_bytes` alone would."""
    try:
        memory = await client.info("memory")
    except NoPermissionError:  # an ACL of before INFO (README: ACL LOAD on upgrades)
        log.warning("job store: INFO refused by Redis's ACL; new jobs are not held to room")
        return
    limit = int(memory.get("maxmemory", 0))
    if not limit:
        return
    room = int(SUBMIT_MEMORY_SHARE * limit)
    if num_bytes > room:
        raise JobTooLarge(f"{num_bytes} bytes; the job store takes at most {room} a job")
    used = int(memory.get("used_memory", 0))
    reserved = max(0, int(await client.get(reserved_key) or 0))
    if used + reserved + num_bytes > room:
        raise StoreFull(used, reserved, num_bytes, room)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether Redis refused a write because it is at its `maxmemory` (nothing to evict): a
    command's OutOfMemoryError, or a script's error (Redis 6 wraps the OOM of a write in a
    script in its own error: "... -OOM command not allowed ...")."""
    return isinstance(error, OutOfMemoryError) or (
        isinstance(error, ResponseError) and "OOM command not allowed" in str(error)
    )
