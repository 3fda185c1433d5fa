"""The router's fleet catalog: ListModels answered from the registry snapshot."""

from __future__ import annotations

import time
from collections.abc import Iterable

import grpc

from services.common.errors import Unavailable
from services.common.pb_conversions import model_kind_to_pb
from services.common.registry_schema import ModelRecord
from services.pb.inference.v1 import worker_pb2 as pb
from services.router.routing import RouteTable


class Catalog:
    """Answers ListModels with every version some live worker serves, and the versions live
    workers failed to load."""

    def __init__(self, table: RouteTable) -> None:
        self._table = table

    async def list_models(
        self, request: pb.ListWorkerModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListWorkerModelsResponse:
        if not self._table.has_snapshot:
            # Empty only because nothing was read yet: a gateway that took this for the fleet
            # would refuse every call until its next poll (seen in a rolling restart).
            raise Unavailable("router has not read the registry yet")
        versions = []
        for served in self._table.served_models(time.monotonic()).values():
            # Its facts (the fingerprints the gateway stamps on calls) are a serving worker's:
            # a draining or unready one may hold the version's files of before a re-stage.
            ready = [m for w, m in served if m.is_ready and not w.is_draining]
            model = ready[0] if ready else served[0][1]
            is_ready = bool(ready)
            # The highest a ready worker applied: one that did serves the version on (a
            # worker of a build before reports none, -1).
            revision = max((m.revision for m in ready if m.revision >= 0), default=None)
            versions.append(
                pb.ModelVersionInfo(
                    model_name=model.name,
                    model_version=model.version,
                    fingerprint=model.fingerprint,
                    tokenizer_fingerprint=model.tokenizer_fingerprint,
                    kind=model_kind_to_pb(model.kind),
                    max_batch_size=model.max_batch_size,
                    slo_p99_ms=model.slo_p99_ms,
                    is_ready=is_ready,
                    totals=_totals(m for _, m in served),
                    revision=revision,
                )
            )
        failures = [
            pb.LoadFailure(
                model_name=f.name,
                model_version=f.version,
                worker_id=w.worker_id,
                error=f.error,
                revision=f.revision,
            )
            for w in self._table.live_workers(time.monotonic())
            for f in w.failed
        ]
        return pb.ListWorkerModelsResponse(
            versions=versions, device="router", load_failures=failures
        )


def _totals(models: Iterable[ModelRecord]) -> pb.BatcherTotals:
    """One version's cumulative batcher figures, summed over the workers that serve it."""
    totals = pb.BatcherTotals()
    for model in models:
        totals.executions += model.executions
        totals.rows += model.executed_rows
        totals.queue_ns += round(model.queue_s_total * 1e9)
        totals.compute_ns += round(model.compute_s_total * 1e9)
    return totals
