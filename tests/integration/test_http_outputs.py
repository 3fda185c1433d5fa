"""Outputs a REST answer's JSON cannot carry, through a real gateway, router and worker: the
affine test model fed rows near FP32's largest value answers NaN and -inf."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch

from tests.support.in_process import affine_and_stall_fabric
from tests.support.models import affine_reference
from tests.support.redis import RedisServer

pytestmark = pytest.mark.integration

#: Finite inputs (the gateway refuses NaN and infinity in them) whose outputs overflow.
HUGE_ROW = [3e38] * 4


def infer_body(binary: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": HUGE_ROW}]
    }
    if binary:
        body["outputs"] = [{"name": "y", "parameters": {"binary_data": True}}]
    return body


async def test_outputs_json_cannot_carry_are_a_500_that_says_so_and_binary_carries_them(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Python writes NaN and infinity as bare `NaN` and `-Infinity`, which no JSON parser
    takes: the answer was a 200 whose body does not parse. It is now a 500 (the model's
    outputs are not numbers) that names the way to get them, and asked as binary data they
    come whole."""
    expected = affine_reference(torch.tensor([HUGE_ROW])).numpy()
    assert not np.isfinite(expected).all()  # what the test is about
    async with affine_and_stall_fabric(tmp_path, redis_server) as fabric:
        assert fabric.gateway.http is not None
        url = f"http://127.0.0.1:{fabric.gateway.http.port}/v2/models/affine/infer"
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json=infer_body(binary=False)) as answer:
                assert answer.status == 500, await answer.text()
                error = (await answer.json())["error"]
                assert "NaN or infinity" in error and "binary_data" in error
            async with session.post(url, json=infer_body(binary=True)) as answer:
                assert answer.status == 200, await answer.text()
                header_length = int(answer.headers["Inference-Header-Content-Length"])
                raw = (await answer.read())[header_length:]
    outputs = np.array(struct.unpack("<2f", raw), dtype=np.float32)
    np.testing.assert_array_equal(outputs, expected[0])
