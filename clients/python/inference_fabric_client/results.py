"""What the client's calls return, and what they raise."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np


class FabricError(Exception):
    """A call the server (or, as `ThrottledError`, this client) refused, or that failed:
    `code` is the gRPC status name (for example "RESOURCE_EXHAUSTED"); `retry_after_s` is the
    retry hint, when there is one (the server's, or the throttle's)."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> FabricError:
        call = error if isinstance(error, grpc.Call) else None
        code = call.code().name if call else "UNKNOWN"
        hint = None
        for key, value in (call.trailing_metadata() or ()) if call else ():
            if key == "retry-after-ms" and str(value).isascii() and str(value).isdigit():
                hint = int(value) / 1000.0
        return cls(code, (call.details() if call else str(error)) or "", hint)


class ThrottledError(FabricError):
    """A predict this client refused itself, unsent, because the gateway refused many of the
    model's predicts lately (inference_fabric_client.throttle): RESOURCE_EXHAUSTED, with a
    hint (`retry_after_s`) of one slice of the throttle's window."""


@dataclass(frozen=True)
class PredictResult:
    """The outputs of one predict call, one array per input, in input order."""

    model: str
    version: str
    outputs: list[np.ndarray]
    request_id: str


@dataclass(frozen=True)
class GenerationChunk:
    """Text and token ids produced since the previous chunk. The last chunk has
    `finish_reason` ("length" or "stop") and the token counts."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
