"""Admission decisions of the worker's two policies: the fixed-cost batcher
(`batching.policy.Batcher.add`) and the generation scheduler (`GenerationScheduler.add`).

Plain data: the policies return these, their async drivers turn a `Rejected` into the error the
caller gets.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RejectReason(enum.Enum):
    """Why a request (or one row of it) was not admitted. Values are Prometheus label values."""

    # The batcher: the row could run, but not now or not in time; retrying later can succeed.
    QUEUE_FULL = "queue_full"
    DRAINING = "draining"
    #: Run after everything queued ahead of it, it (or an item already queued, which it would
    #: delay) is predicted to finish past its admission limit: refused now (RESOURCE_EXHAUSTED)
    #: instead of timing out in the queue later.
    DEADLINE = "deadline"
    #: The queue is contended and the request's tenant already holds its weighted share of it:
    #: tenants over their share are refused before the others (RESOURCE_EXHAUSTED).
    TENANT_SHARE = "tenant_share"

    # The generation scheduler: the sequence can never run with this model's configuration;
    # retrying the same request cannot succeed.
    EMPTY_PROMPT = "empty_prompt"
    INVALID_MAX_TOKENS = "invalid_max_tokens"
    #: Prompt plus max_tokens exceeds the model's max_model_len.
    TOO_LONG = "too_long"
    #: The whole sequence needs more KV blocks than the cache has.
    EXCEEDS_KV_CACHE = "exceeds_kv_cache"


@dataclass(frozen=True)
class Admitted:
    """Queued: the driver sees it again in a later dispatch or step."""


@dataclass(frozen=True)
class Rejected:
    """Not queued; nothing was changed."""

    reason: RejectReason
    #: The specifics (sizes and limits) for the caller's error message; may be empty.
    detail: str = ""
