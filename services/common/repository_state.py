"""The fleet's desired model state: which models the workers should have loaded.

Redis layout (under the registry prefix, default "fabric"):
- `<prefix>:repository`  hash: model name -> JSON `{"state": "loaded"|"unloaded",
  "revision": <int>}`

The gateway writes it (Triton's repository extension: RepositoryModelLoad / Unload, each write
at a revision past the hash's highest, in one step: WRITE_STATE, the one Redis script here);
every worker reads the whole hash (one HGETALL)
about once a second and converges (services.gpu_worker.repository_follower). A model with no
field is loaded wherever the repository and the worker's `--models` pool have it, as at start.
No Redis client here.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


class ModelState(enum.Enum):
    """What an operator asked for a model (all its versions in the repository)."""

    LOADED = "loaded"
    UNLOADED = "unloaded"


@dataclass(frozen=True)
class DesiredState:
    """One model's entry in `<prefix>:repository`."""

    state: ModelState
    #: Grows with every write to the hash: a worker retries a failed load only when it grows,
    #: and re-reads its repository (new versions on the volume) when any entry's does.
    revision: int

    def to_json(self) -> str:
        return json.dumps({"state": self.state.value, "revision": self.revision})


def repository_key(prefix: str) -> str:
    """The hash of desired states under registry prefix `prefix`."""
    return f"{prefix}:repository"


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def parse_desired(fields: Mapping[Any, Any]) -> dict[str, DesiredState]:
    """The desired states in an HGETALL reply (str or bytes keys and values). A malformed
    entry is logged and left out (its model follows the repository, as with no entry): one
    bad write must not stop the fleet from following the others."""
    desired: dict[str, DesiredState] = {}
    for name, value in fields.items():
        try:
            raw = json.loads(_text(value))
            desired[_text(name)] = DesiredState(ModelState(raw["state"]), int(raw["revision"]))
        except (ValueError, KeyError, TypeError, OverflowError) as error:
            log.warning("ignoring desired state of %r: %r (%s)", name, value, error)
    return desired


#: KEYS: the desired-state hash; ARGV: model, state value, now (ms). Writes the model's
#: desired state at the next revision (`revision_after` every entry's: the time in ms, or
#: past every entry's, so that revisions keep growing across a Redis restarted empty; an
#: entry whose revision is no number in [0, 2^53) counts none) and returns {the entry
#: written, the one it replaced or false}, in one step. Read, then written by a gateway, two
#: gateways writing at once could give two writes one revision (a worker that applied an
#: unload at it then seemed to have applied the load too), and a load could take the state
#: before it for one it had replaced (review finding).
WRITE_STATE = """
local highest, before = 0, false
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  local ok, entry = pcall(cjson.decode, entries[i + 1])
  local r = ok and type(entry) == 'table' and tonumber(entry['revision'])
  if r and r >= 0 and r < 2^53 then highest = math.max(highest, math.floor(r)) end
  if entries[i] == ARGV[1] then before = entries[i + 1] end
end
local revision = math.max(tonumber(ARGV[3]), highest + 1)
local written = string.format('{"state": "%s", "revision": %d}', ARGV[2], revision)
redis.call('HSET', KEYS[1], ARGV[1], written)
return {written, before}
"""


def revision_after(highest: int, now_s: float) -> int:
    """The revision of a record written after one at `highest` (desired states here, routing
    records in services.rollout.routing_store): the time in milliseconds (`now_s`, seconds
    since the epoch), or `highest` + 1 if that is not less, so that revisions keep growing
    across a Redis restarted empty, where the readers still hold the old ones."""
    return max(int(now_s * 1000), highest + 1)
