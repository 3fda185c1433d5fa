"""Per-version health from the workers' own metrics: calls by status and the row-latency
histogram, per (model, version), scraped from each worker's `/metrics`.

A snapshot is cumulative, one set of counters per endpoint; the health over a window is the
difference of two, taken endpoint by endpoint and then summed, so that one worker restarting
(its counters back to 0) counts from 0 alone, not for the whole fleet. (In a cluster, a
Prometheus query gives the same figures fleet-wide; this reads the workers directly, which is
what the local stack and the tests have.)
"""

from __future__ import annotations

import asyncio
import http.client
import urllib.request
from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families

from services.common import metric_names as names
from services.rollout.policy import STARTED, Health, difference, p99_from_buckets

#: Statuses that count against a version: the server failed, not the caller or the load.
ERROR_CODES = frozenset({"INTERNAL", "UNKNOWN", "UNAVAILABLE", "DEADLINE_EXCEEDED", "DATA_LOSS"})
#: Statuses that are not refusals (every other one is: RESOURCE_EXHAUSTED, INVALID_ARGUMENT,
#: FAILED_PRECONDITION, ...): served, failed, or given up by the caller.
_NOT_REFUSED = ERROR_CODES | {"OK", "CANCELLED"}

#: prometheus_client's process collector's start time, which every tier exports.
_PROCESS_STARTED = "process_start_time_seconds"
#: version -> flat counters: "code:<CODE>" calls, "le:<bound>" cumulative latency buckets,
#: and the worker process's start time (STARTED).
Counters = dict[str, dict[str, float]]
#: One endpoint's counters per endpoint, in the order of the endpoints scraped.
Snapshot = list[Counters]


def parse_snapshot(texts: Sequence[str], model: str) -> Snapshot:
    """The model's counters in each worker's exposition text, per version."""
    return [_counters(text, model) for text in texts]


def _counters(text: str, model: str) -> Counters:
    counters_of: Counters = {}
    wanted = {f"{names.WORKER_REQUESTS_TOTAL}", f"{names.WORKER_ROW_LATENCY_SECONDS}_bucket"}
    started = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # The engine's own, unlabelled: a worker with fronts serves each front's start
            # too (labelled worker_front), and one restarted, or missing from a scrape,
            # read as the worker's restart (review finding).
            if sample.name == _PROCESS_STARTED and not sample.labels:
                started = sample.value
            if sample.name not in wanted or sample.labels.get("model") != model:
                continue
            version = sample.labels.get("version", "")
            if sample.name == names.WORKER_REQUESTS_TOTAL:
                key = f"code:{sample.labels.get('code', '')}"
            else:
                key = f"le:{sample.labels.get('le', '')}"
            counters = counters_of.setdefault(version, {})
            counters[key] = counters.get(key, 0.0) + sample.value
    if started is not None:  # each version's counters tell the process they count in
        for counters in counters_of.values():
            counters[STARTED] = started
    return counters_of


def health_between(before: Snapshot, after: Snapshot, version: str) -> Health:
    """The version's calls served and refused, server errors and p99 between two snapshots of
    the same endpoints (ValueError for snapshots of different counts)."""
    delta: dict[str, float] = {}
    for was, now in zip(before, after, strict=True):
        for key, value in difference(now.get(version, {}), was.get(version, {})).items():
            delta[key] = delta.get(key, 0.0) + value
    calls = {k.removeprefix("code:"): v for k, v in delta.items() if k.startswith("code:")}
    errors = sum(v for code, v in calls.items() if code in ERROR_CODES)
    served = calls.get("OK", 0.0) + errors
    refused = sum(v for code, v in calls.items() if code not in _NOT_REFUSED)
    buckets = [(float(k[3:]), v) for k, v in delta.items() if k.startswith("le:")]
    return Health(int(served), int(errors), p99_from_buckets(buckets), refused=int(refused))


#: Tries of one endpoint's scrape, RETRY_S apart, before the rollout gives up on it: one
#: failure (a timeout through a GC pause, a reset connection) aborted the whole rollout, near
#: its end too (review finding). An endpoint gone for good still aborts it, seconds later.
SCRAPE_TRIES = 3
RETRY_S = 1.0


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


async def _fetch_patiently(url: str) -> str:
    for _ in range(SCRAPE_TRIES - 1):
        try:
            return await asyncio.to_thread(_fetch, url)
        except (OSError, http.client.HTTPException):  # URLError, HTTPError; IncompleteRead
            await asyncio.sleep(RETRY_S)
    return await asyncio.to_thread(_fetch, url)


async def scrape(urls: Sequence[str], model: str) -> Snapshot:
    """One snapshot of `model` across the workers at `urls` (their /metrics)."""
    texts = await asyncio.gather(*(_fetch_patiently(url) for url in urls))
    return parse_snapshot(texts, model)
