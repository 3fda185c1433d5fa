"""What the slim client hands back from a real gRPC server on port 0 playing the gateway: a
reply as big as the fabric sends (its servers' 64 MiB bound, not grpc's 4 MiB default), as
arrays of the caller's own (writable)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from inference_fabric_client import Client

from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import types_pb2
from tests.support.sync_servers import sync_servers

pytestmark = pytest.mark.integration

#: One output row of 6 MiB: past grpc's default receive limit, within the fabric's.
ROW_VALUES = 6 * 1024 * 1024 // 4


class Wide(api_grpc.InferenceServiceServicer):
    """Answers each input with a float32 row of ROW_VALUES values, 0, 1, 2, ..."""

    def Predict(self, request: api.PredictRequest, context: Any) -> api.PredictResponse:
        row = np.arange(ROW_VALUES, dtype="<f4")
        tensor = types_pb2.Tensor(
            dtype=types_pb2.DATA_TYPE_FP32, shape=[ROW_VALUES], raw_data=row.tobytes()
        )
        return api.PredictResponse(
            model_name=request.model_name, model_version="1", outputs=[tensor] * len(request.inputs)
        )


@pytest.fixture
def address() -> Iterator[str]:
    with sync_servers(api_grpc.add_InferenceServiceServicer_to_server) as start:
        yield start(Wide(), options=(("grpc.max_send_message_length", 64 * 1024 * 1024),))


def test_a_reply_past_grpcs_default_limit_is_taken_and_its_arrays_are_the_callers(
    address: str,
) -> None:
    """Before, grpc's 4 MiB receive limit failed such a reply RESOURCE_EXHAUSTED after the
    server did the whole work, and each output was a read-only view of the message's bytes
    (`result.outputs[0] /= norm` raised) where `embed`'s stacked copy was not (review
    finding)."""
    with Client(address, throttle=None) as client:
        result = client.predict("wide", ["a", "b"])
    assert [output.shape for output in result.outputs] == [(ROW_VALUES,)] * 2
    first = result.outputs[0]
    first /= 2  # in place: the caller's own array
    assert first[:3].tolist() == [0.0, 0.5, 1.0]
    assert result.outputs[1][:3].tolist() == [0.0, 1.0, 2.0]  # rows share no memory
