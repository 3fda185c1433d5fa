"""The GPU-speed stand-in: the real model's rows (same tokenizer, same buckets, same refusals),
batches that take the curve's time asleep rather than on the CPU, outputs of the model's shape
and dtype, and a fingerprint of its own so its rows never pass for the real model's."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.fabric.stand_in import best_rate, echo_calls, tier_of_processes
from services.common.errors import InvalidInput
from services.common.model_repository import ModelConfigError, load_repository
from services.gpu_worker.backends import LoadOptions, load_backend
from services.gpu_worker.backends.embedding import EmbeddingBackend
from services.gpu_worker.backends.stand_in import StandInBackend
from services.sim.curve import LatencyCurve

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
H100 = REPO_ROOT / "services" / "sim" / "curves" / "minilm_h100.json"
CPU = torch.device("cpu")


def minilm():
    return next(v for v in load_repository(REPO_ROOT / "models") if v.config.name == "minilm")


def test_rows_and_outputs_are_the_models() -> None:
    stand_in = load_backend(minilm(), CPU, LoadOptions(stand_in_curve=H100))
    assert isinstance(stand_in, StandInBackend)
    real = EmbeddingBackend(minilm(), CPU)
    texts = ["hi", "a somewhat longer sentence than the first one " * 4]
    assert [r.bucket for r in stand_in.prepare_many(texts)] == [
        r.bucket for r in real.prepare_many(texts)
    ]
    assert stand_in.tokenizer_fingerprint == real.tokenizer_fingerprint
    assert stand_in.fingerprint != real.fingerprint
    with pytest.raises(InvalidInput, match="at most 256"):
        stand_in.prepare_many(["word " * 400])
    outputs = stand_in.run(stand_in.prepare_many(texts))
    assert [(o.shape, o.dtype) for o in outputs] == [((384,), np.float32)] * 2
    assert all(np.linalg.norm(o) == pytest.approx(1.0) for o in outputs)


def test_batch_time_is_the_curves() -> None:
    stand_in = StandInBackend(minilm(), CPU, H100)
    curve = LatencyCurve.load(H100)
    measured = dict(curve.points)
    for bucket, size in ((16, 1), (64, 8), (256, 64)):
        assert stand_in.batch_seconds(bucket, size) == pytest.approx(measured[(bucket, size)])
    # Between measured sizes the curve is interpolated, never below the smaller size's time.
    assert stand_in.batch_seconds(32, 16) <= stand_in.batch_seconds(32, 24)
    assert stand_in.batch_seconds(32, 24) <= stand_in.batch_seconds(32, 32)


def test_a_batch_sleeps_without_spending_cpu(tmp_path: Path) -> None:
    curve = tmp_path / "slow.json"
    curve.write_text(json.dumps({"points": [{"bucket": 16, "batch_size": 1, "seconds": 0.3}]}))
    stand_in = StandInBackend(minilm(), CPU, curve)
    rows = stand_in.prepare_many(["hello"])
    wall, cpu = time.monotonic(), time.thread_time()
    stand_in.run(rows)
    wall, cpu = time.monotonic() - wall, time.thread_time() - cpu
    assert wall >= 0.3
    # Asleep: the thread's own CPU seconds are a small share of the batch. Measured over 10
    # runs beside a parallel unit run: 0.0004-0.0008 of the wall time; the bound is 0.1.
    assert cpu < 0.1 * wall, (cpu, wall)


def test_a_bad_curve_fails_loading_with_its_path(tmp_path: Path) -> None:
    curve = tmp_path / "bad.json"
    curve.write_text(json.dumps({"points": []}))
    with pytest.raises(ModelConfigError, match=r"bad\.json"):
        StandInBackend(minilm(), CPU, curve)
    with pytest.raises(ModelConfigError, match=r"missing\.json"):
        StandInBackend(minilm(), CPU, tmp_path / "missing.json")


def test_the_benchmarks_cpu_per_tier_counts_only_the_stacks_tiers() -> None:
    tiers = tier_of_processes(
        {"gateway": 1, "router": 2, "worker-0": 3, "worker-1": 4, "redis": 5, "launcher": 6}
    )
    assert tiers == {"gateway": "gateway", "router": "router", "worker-0": "worker",
                     "worker-1": "worker"}  # fmt: skip
    echo = {"cpu_s": {"echo": 1.0}, "sent_in_windows": 1000}  # 1 ms of CPU per echo call
    run = {
        "sent_in_windows": 200,  # half refused: the CPU is per call served
        "ok_in_windows": 100,
        "cpu_s": {"gateway": 0.3, "router": 0.1, "worker-0": 0.05, "worker-1": 0.05,
                  "bench": 5.0, "other_children": 1.0, "redis": 0.2, "outside_bench": 9.0},
    }  # fmt: skip
    assert echo_calls(run, echo, tiers) == {"gateway": 3.0, "router": 1.0, "worker": 1.0}
    assert echo_calls(run, {"cpu_s": {}}, tiers) == {}


def test_best_rate_reads_the_nearest_measured_bucket() -> None:
    assert best_rate(H100, 16) == pytest.approx(max(
        size / seconds for (bucket, size), seconds in LatencyCurve.load(H100).points
        if bucket == 16
    ))  # fmt: skip
    assert best_rate(H100, 20) == best_rate(H100, 16)


def test_threads_per_request_and_their_line() -> None:
    from bench.fabric.stand_in import threads_line, threads_per_request

    run = {
        "sent_in_windows": 1000,
        "threads": {
            "gateway": {
                "main": {"threads": 1, "cpu_s": 0.2, "voluntary_switches": 100,
                         "involuntary_switches": 5000},
                "python": {"threads": 2, "cpu_s": 0.03, "voluntary_switches": 4500,
                           "involuntary_switches": 0},
                "lifeguard": {"threads": 1, "cpu_s": 0.0, "voluntary_switches": 1,
                              "involuntary_switches": 0},
            },
            "redis": {"main": {"threads": 1, "cpu_s": 0.01, "voluntary_switches": 0,
                               "involuntary_switches": 0}},
        },
    }  # fmt: skip
    threads = threads_per_request(run, ["gateway", "router"])
    assert list(threads) == ["gateway"]  # only the processes asked for
    assert threads["gateway"]["main"] == {
        "cpu_us": 200.0, "voluntary_switches": 0.1, "involuntary_switches": 5.0
    }  # fmt: skip
    # Busiest first; under a microsecond a request left out.
    assert threads_line(threads) == "gateway: main 200 (0.1/5), python 30 (4.5/0)"
    assert threads_per_request({"sent_in_windows": 0}, ["gateway"]) == {}
