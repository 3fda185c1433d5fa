"""The few error types the fabric raises, grouped by what the caller can do about them.

Business code raises these; `services.common.grpc_errors.status_of` turns them into gRPC
statuses (for the server's interceptor, services.common.interceptors, and for multiplexed calls
alike), so no handler calls `context.abort` itself. A caller going away is asyncio's own
cancellation, not a type here.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

import grpc

#: Trailing-metadata key carrying the retry hint of RESOURCE_EXHAUSTED answers.
RETRY_AFTER_MS_KEY = "retry-after-ms"
#: Trailing-metadata entry marking a call refused before it started (a draining server, a
#: closing stream): nothing ran, so the caller may send it to another server. One hop only:
#: a tier never passes its peer's mark on to its own caller.
NOT_STARTED_TRAILER = ("x-fabric-retry", "not-started")
#: Retry hints are spread by this share either way, so that callers refused together do not
#: all come back together (one more flood, in step).
RETRY_JITTER = 0.25


def retry_after_trailer(
    retry_after_s: float, rng: random.Random | None = None, *, is_least: bool = False
) -> tuple[str, str]:
    """The `retry-after-ms` trailer of a refusal: `retry_after_s`, jittered by RETRY_JITTER
    either way, at least 1 ms; upward only where it `is_least` wait that can succeed (a
    token bucket's refill: a caller that waits exactly the hint must not be refused again)."""
    low = 1.0 if is_least else 1 - RETRY_JITTER
    spread_ms = retry_after_s * (rng or random).uniform(low, low + 2 * RETRY_JITTER) * 1000
    return (RETRY_AFTER_MS_KEY, str(max(1, math.ceil(spread_ms) if is_least else round(spread_ms))))


#: What reading a record another process wrote (JSON, then its fields) may raise when the
#: record is not what this version expects: a missing key, a wrong type, a number of 1e400
#: (OverflowError in int()), JSON nested past Python's limit (RecursionError). Readers of
#: shared state skip such a record; none of these may end their loop.
MALFORMED_RECORD_ERRORS: tuple[type[Exception], ...] = (
    ValueError,
    KeyError,
    TypeError,
    AttributeError,
    OverflowError,
    RecursionError,
)


class ServingError(Exception):
    """Base class. `code` is the gRPC status the caller sees."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def trailers(self) -> tuple[tuple[str, str], ...]:
        """Trailing metadata sent with the status (retry hints)."""
        return ()


class InvalidInput(ServingError):
    """The request is malformed; retrying it unchanged can never succeed."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServingError):
    """The model or version does not exist here."""

    code = grpc.StatusCode.NOT_FOUND


class FingerprintMismatch(ServingError):
    """The inputs were prepared for other weights or another tokenizer. Re-resolve the model
    and prepare again; never run them here, the answer would be wrong."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ModelLoadFailed(ServingError):
    """A model version in the repository does not load (corrupt or incompatible files). Fix
    the repository, then load again; the versions already served keep serving."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Overloaded(ServingError):
    """Queue full, quota exceeded or the deadline cannot be met. Retry after `retry_after_s`."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, *, retry_after_s: float = 0.0, is_least: bool = False) -> None:
        """`is_least`: no retry sooner than `retry_after_s` can succeed (retry_after_trailer)."""
        super().__init__(message)
        #: The hint before jitter, seconds (policies compare it; the trailer spreads it).
        self.retry_after_s = retry_after_s
        self.is_least = is_least
        self._trailer: tuple[str, str] | None = None

    def trailers(self) -> tuple[tuple[str, str], ...]:
        if self.retry_after_s <= 0:
            return ()
        if self._trailer is None:  # jittered once per refusal
            self._trailer = retry_after_trailer(self.retry_after_s, is_least=self.is_least)
        return (self._trailer,)

    def for_one_caller(self) -> Overloaded:
        """The same refusal for one of several callers it answers together: its hint is
        jittered on its own (UpstreamError.for_one_caller's reason)."""
        return Overloaded(str(self), retry_after_s=self.retry_after_s, is_least=self.is_least)


#: What grpc says of a message past a size limit (RESOURCE_EXHAUSTED, sender's or receiver's),
#: and so what ours say: a call or answer too large, not a tier short of capacity (a client
#: that throttles itself on refusals for load, and `UpstreamError.is_overload`, tell them
#: apart by it).
TOO_LARGE = "message larger than max"


def is_too_large(code: grpc.StatusCode, message: str) -> bool:
    """Whether a call failed for a message past a size limit (RESOURCE_EXHAUSTED in grpc's
    words, TOO_LARGE), not for load: retried as it is, it fails the same way."""
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and TOO_LARGE in message


class MessageTooLarge(ServingError):
    """A message past the limit of the stream or call that would carry it (as grpc answers a
    unary call's, in its words: TOO_LARGE)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str) -> None:
        super().__init__(f"{TOO_LARGE}: {message}")


class DeadlineExceeded(ServingError):
    """The deadline passed before the work ran; it was not run."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(ServingError):
    """Not ready, draining or no healthy backend; safe to retry elsewhere.
    `is_not_started`: the call was refused before any work, or (a worker's rows when its
    batching stops or its drain runs out) it was never answered and may be sent elsewhere
    (sends NOT_STARTED_TRAILER; a bundle's slice so refused is sent again by its gateway)."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str, *, is_not_started: bool = False) -> None:
        super().__init__(message)
        self.is_not_started = is_not_started

    def trailers(self) -> tuple[tuple[str, str], ...]:
        return (NOT_STARTED_TRAILER,) if self.is_not_started else ()


class Unimplemented(ServingError):
    """An RPC of a standard service (Triton's) that this server declares but does not serve."""

    code = grpc.StatusCode.UNIMPLEMENTED


class ExecutionFailed(ServingError):
    """The model raised on this input. Only this request fails; the batch it ran in does not."""

    code = grpc.StatusCode.INTERNAL


def _is_retry_hint(value: str) -> bool:
    """Whether `value` is a `retry-after-ms` hint: whole milliseconds, under twelve days."""
    return value.isascii() and value.isdigit() and len(value) <= 9


#: gRPC status codes by their number.
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class UpstreamError(ServingError):
    """A downstream tier's status, passed through to our caller unchanged (retry hint kept).

    `is_not_started`: the downstream call provably ran nothing (refused with
    NOT_STARTED_TRAILER, or never sent), so sending it elsewhere cannot run it twice. The mark
    is not passed on: our own caller cannot know what else this tier tried. `ran_nothing`:
    nothing ran either, though it is not sent elsewhere (`as_not_served_now`)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        trailers: tuple[tuple[str, str], ...] = (),
        *,
        is_not_started: bool = False,
        ran_nothing: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        # Only a hint that reads as one: a malformed one passed on failed the HTTP answer that
        # turns it into Retry-After (a bare 500) and misled clients' backoff (review finding).
        self._trailers = tuple(
            (k, v) for k, v in trailers if k == RETRY_AFTER_MS_KEY and _is_retry_hint(v)
        )
        self.is_not_started = code == grpc.StatusCode.UNAVAILABLE and (
            is_not_started or NOT_STARTED_TRAILER in trailers
        )
        self.ran_nothing = ran_nothing or self.is_not_started

    def trailers(self) -> tuple[tuple[str, str], ...]:
        return self._trailers

    def as_not_served_now(self) -> UpstreamError:
        """This status for a version the caller's tier knows exists (a gateway's, from its
        repository): downstream's NOT_FOUND then means no worker serves it now (a router
        started since, that has not seen its workers yet, or a worker that unloaded it), and
        is UNAVAILABLE, which clients retry, not NOT_FOUND, which they take as permanent.
        So is FAILED_PRECONDITION, a worker's refusal of inputs prepared for another
        fingerprint (its version's files changed since the fleet's view this tier acted on,
        which a refresh corrects): nothing ran, and it is no fault of the caller's (HTTP 400,
        never retried, before: review finding). Neither is sent elsewhere from here."""
        if self.code == grpc.StatusCode.NOT_FOUND:
            message = f"not served now: {self}"
        elif self.code == grpc.StatusCode.FAILED_PRECONDITION:
            message = f"the version's files changed; retry: {self}"
        else:
            return self
        # Nothing ran (a router's NOT_FOUND is its refusal before routing: a worker's it turns
        # into UNAVAILABLE): the caller's rows go back to its tenant (review finding).
        return UpstreamError(grpc.StatusCode.UNAVAILABLE, message, self._trailers, ran_nothing=True)

    @property
    def retry_after_s(self) -> float | None:
        """The downstream retry hint, seconds, or None without one."""
        for key, value in self._trailers:
            if key == RETRY_AFTER_MS_KEY:
                return int(value) / 1000.0
        return None

    def for_one_caller(self, rng: random.Random | None = None) -> UpstreamError:
        """The same status for one of several callers it answers together (a bundle's): an
        error of its own, its retry hint jittered again (RETRY_JITTER), so that callers refused
        in one bundle do not all come back together. The hint was jittered where it was made,
        so callers' hints range from about 0.56x to 1.56x of the drain time it followed."""
        hint_s = self.retry_after_s
        trailers = () if hint_s is None else (retry_after_trailer(hint_s, rng),)
        return UpstreamError(
            self.code,
            str(self),
            trailers,
            is_not_started=self.is_not_started,
            ran_nothing=self.ran_nothing,
        )

    @property
    def is_overload(self) -> bool:
        """Downstream refused for load. DEADLINE_EXCEEDED is not counted: a request that
        waited too long in this tier's own queue runs out of time too, and taking that for a
        downstream refusal would throttle harder exactly when this tier is the bottleneck. Nor
        is a message past a size limit (TOO_LARGE: an answer too large, its model having run;
        a review finding: counted, it throttled the caller's tenant and gave its rows back)."""
        code = self.code
        return code == grpc.StatusCode.RESOURCE_EXHAUSTED and not is_too_large(code, str(self))

    @classmethod
    def from_status(cls, code: int, message: str, trailers: Mapping[str, str]) -> UpstreamError:
        """A status that came back as numbers and maps (a multiplexed call's, a slice's)."""
        return cls(_CODES.get(code, grpc.StatusCode.UNKNOWN), message, tuple(trailers.items()))

    @classmethod
    def from_rpc_error(cls, error: grpc.aio.AioRpcError) -> UpstreamError:
        trailers = tuple((k, str(v)) for k, v in (error.trailing_metadata() or ()))
        return cls(error.code(), error.details() or "", trailers)


class Unauthenticated(ServingError):
    """No API key, or one we do not know."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ServingError):
    """A valid key that may not use this model."""

    code = grpc.StatusCode.PERMISSION_DENIED
