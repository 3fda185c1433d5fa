"""Tenant admission at the gateway: quotas before any work, priority classes, per-tenant
metrics. The policies are pure (services.gateway.quotas, services.gateway.tenants); this is
where they meet the clock, the metrics and the error types.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from types import TracebackType

from services.common.errors import InvalidInput, Overloaded, ServingError, UpstreamError
from services.common.priority import PriorityClass
from services.common.telemetry import Outcome, given_up_in
from services.gateway.metrics import GatewayMetrics
from services.gateway.quotas import QuotaRefusal, TenantQuotas
from services.gateway.tenants import TenantLabels, TenantPolicy

#: The calls quotas apply to: the ones that run models. Metadata, health and listing calls
#: are cheap and never counted.
INFERENCE_METHODS = frozenset(
    {
        "/inference.v1.InferenceService/Predict",
        "/inference.v1.InferenceService/Generate",
        "/inference.GRPCInferenceService/ModelInfer",
        "/inference.GRPCInferenceService/ModelStreamInfer",
    }
)


class TenantAdmission:
    """Admits inference calls against their tenant's quotas, and counts them per tenant."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        labels: TenantLabels,
        *,
        quotas: TenantQuotas | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.quotas = quotas or TenantQuotas()
        self.labels = labels
        self._metrics = metrics
        self._clock = clock

    def _refused(self, policy: TenantPolicy, refusal: QuotaRefusal) -> Overloaded:
        self.refused(policy.name, refusal.quota)
        return Overloaded(
            refusal.message, retry_after_s=refusal.retry_after_s, is_least=refusal.is_least
        )

    def refused(self, tenant: str, reason: str) -> None:
        self._metrics.tenant_refused_total_of[(self.labels(tenant), reason)].inc()

    def acquire(self, policy: TenantPolicy, *, has_place: bool = False) -> Overloaded | None:
        """Checks room in flight and takes a request token for one call (before its body is
        even parsed), or returns the refusal to answer with. A granted call counts in flight
        from `enter` (in the same step: TenantQuotas.acquire) to `release`. A call that
        `has_place` takes a token only."""
        refusal = self.quotas.acquire(policy, self._clock(), has_place=has_place)
        return None if refusal is None else self._refused(policy, refusal)

    def give_back_rows(self, policy: TenantPolicy, num_rows: int) -> None:
        """The rows charged for a call refused downstream for load, never served, return to
        its tenant's bucket (TenantQuotas.give_back_rows)."""
        self.quotas.give_back_rows(policy.name, num_rows, self._clock())

    def set_share_gauge(self, tenant: str, share: float) -> None:
        """Sets `tenant`'s share, unless it has no label of its own: the tenants past the
        labelled ones share `other`, whose one share would read as whichever was set last."""
        if (label := self.labels(tenant)) == tenant:
            self._metrics.tenant_quota_share.labels(label).set(share)

    def enter(self, policy: TenantPolicy) -> None:
        self.quotas.enter(policy.name)

    def release(self, policy: TenantPolicy) -> None:
        self.quotas.release(policy.name)

    def charge_rows(self, policy: TenantPolicy, num_rows: int) -> None:
        """Charges a call's input rows; raises Overloaded (rows_per_s) over the row rate."""
        refusal = self.quotas.take_rows(policy, num_rows, self._clock())
        if refusal is not None:
            raise self._refused(policy, refusal)
        self._metrics.tenant_rows_total_of[(self.labels(policy.name),)].inc(num_rows)

    def rows_charged(self, policy: TenantPolicy, num_rows: int) -> RowsCharged:
        """`charge_rows` for a call whose body checks and serves its inputs: the rows of a
        call never served (`never_served`) return to the tenant's bucket, or a tenant that
        sent one bad call of many rows, or whose calls downstream refused for load, would be
        refused for rows it never got."""
        return RowsCharged(self, policy, num_rows)

    def priority_for(self, policy: TenantPolicy, requested: PriorityClass | None) -> PriorityClass:
        """The call's class (see TenantPolicy.priority_for); a refusal is counted."""
        try:
            return policy.priority_for(requested)
        except ServingError:
            self.refused(policy.name, "priority")
            raise

    def observe(
        self, tenant: str, priority: PriorityClass, time_left_s: float | None = None
    ) -> Outcome:
        """Counts and times one inference call of `tenant` by its final status: enter it
        around the call (`time_left_s` as GatewayMetrics.observe_request's)."""
        label = self.labels(tenant)
        return Outcome(
            self._metrics.tenant_requests_total_of,
            (label, priority.value),
            self._metrics.tenant_request_seconds_of[(label,)],
            given_up=given_up_in(time_left_s),
        )


class RowsCharged:
    """`TenantAdmission.rows_charged`: a class, not a generator, as it is entered per
    request."""

    __slots__ = ("_admission", "_is_given_back", "_num_rows", "_policy")

    def __init__(self, admission: TenantAdmission, policy: TenantPolicy, num_rows: int) -> None:
        self._admission = admission
        self._policy = policy
        self._num_rows = num_rows
        self._is_given_back = False

    def __enter__(self) -> RowsCharged:
        self._admission.charge_rows(self._policy, self._num_rows)
        return self

    def give_back(self) -> None:
        """The call's rows return to its tenant now, once (its slice was dropped before it left
        this process: it ran nowhere, whatever status the call then ends with)."""
        if not self._is_given_back:
            self._is_given_back = True
            self._admission.give_back_rows(self._policy, self._num_rows)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if never_served(error):
            self.give_back()


def never_served(error: BaseException | None) -> bool:
    """Whether a call that ended with `error` was never served: refused for its input
    (InvalidInput, here or when its bundle was tokenized), or downstream for load or before
    anything ran (not started, or a version it did not know: `UpstreamError.ran_nothing`)."""
    if isinstance(error, UpstreamError):
        return error.is_overload or error.ran_nothing
    return isinstance(error, InvalidInput)


class StreamRequests:
    """Admission of the requests one stream carries (ModelStreamInfer). The stream itself was
    admitted as one call, with a request token and a place in flight for its whole life, so
    idle streams count against their tenant too. Its first request rides on the stream's
    token, and a request that starts while none of the stream's others runs rides on the
    stream's place; every other request takes a token of its own, and a place of its own
    while it runs, or is refused as a call of its own would be. So does every request of a
    tenant other than `tenant`, the stream's (its key moved to another tenant by a keys file
    reloaded while the stream is open): the stream's token and place are its first tenant's
    (a review finding: the other tenant's requests rode on them, past its own limits)."""

    def __init__(self, admission: TenantAdmission, tenant: str) -> None:
        self._admission = admission
        self._tenant = tenant
        self._has_admitted = False
        self._is_place_taken = False

    @contextlib.contextmanager
    def admitted(self, policy: TenantPolicy) -> Iterator[None]:
        """Admits one request under its tenant's `policy` as it stands now (keys and limits
        reload while a stream is open; raises Overloaded) and holds what it took while it
        runs."""
        is_streams = policy.name == self._tenant
        rides_on_place = is_streams and not self._is_place_taken
        if self._has_admitted or not is_streams:
            refusal = self._admission.acquire(policy, has_place=rides_on_place)
            if refusal is not None:
                raise refusal
        self._has_admitted = self._has_admitted or is_streams
        if rides_on_place:
            self._is_place_taken = True
        else:
            self._admission.enter(policy)
        try:
            yield
        finally:
            if rides_on_place:
                self._is_place_taken = False
            else:
                self._admission.release(policy)
