"""The shared host: compute and hops slow down as the tiers and the model load its cores."""

from __future__ import annotations

from typing import Any

import pytest

from services.sim.curve import LatencyCurve
from services.sim.fleet_config import FleetConfig
from services.sim.host import HostConfig, SharedHost
from services.sim.simulation import Scenario, run
from services.sim.traffic import LengthMix, Stream, Traffic
from services.sim.worker import ModelSpec

pytestmark = pytest.mark.unit


def _steady(host: SharedHost, *, rate_per_s: float, until_s: float) -> None:
    """Requests at `rate_per_s` from 0 to `until_s`."""
    for i in range(int(rate_per_s * until_s)):
        host.request(i / rate_per_s)


def test_a_host_the_tiers_do_not_share_never_slows_anything() -> None:
    host = SharedHost(HostConfig())
    _steady(host, rate_per_s=1000, until_s=5)
    assert host.compute_stretch(5.0) == 1.0
    assert host.hop_stretch(5.0) == 1.0


def test_at_idle_the_curve_and_the_hops_hold_exactly() -> None:
    host = SharedHost(HostConfig(cores=2, tier_cpu_s=0.003))
    assert host.compute_stretch(0.0) == 1.0
    assert host.hop_stretch(0.0) == 1.0


def test_compute_stretches_by_the_cores_the_tiers_take() -> None:
    # 200 requests/s at 2.5 ms of tier CPU each: half a core, so the model's two threads and
    # the tiers want 2.5 cores of 2.
    host = SharedHost(HostConfig(cores=2, tier_cpu_s=0.0025, window_s=1.0))
    _steady(host, rate_per_s=200, until_s=10)
    assert host.tier_load(10.0) == pytest.approx(0.5, rel=0.02)
    assert host.compute_stretch(10.0) == pytest.approx(1.25, rel=0.01)


def test_hops_stretch_only_when_the_tiers_outgrow_the_cores() -> None:
    # 200 requests/s at 2.5 ms: half a core of tiers, and a hop's thread: 1.5 of 2 cores.
    light = SharedHost(HostConfig(cores=2, tier_cpu_s=0.0025, window_s=1.0))
    _steady(light, rate_per_s=200, until_s=10)
    assert light.hop_stretch(10.0) == 1.0
    # 800 requests/s: 2 cores of tiers and the hop's thread want 3 of 2.
    heavy = SharedHost(HostConfig(cores=2, tier_cpu_s=0.0025, window_s=1.0))
    _steady(heavy, rate_per_s=800, until_s=10)
    assert heavy.hop_stretch(10.0) == pytest.approx(1.5, rel=0.02)


def test_load_estimates_decay_when_traffic_stops() -> None:
    host = SharedHost(HostConfig(cores=2, tier_cpu_s=0.004, window_s=1.0))
    _steady(host, rate_per_s=300, until_s=5)
    loaded = host.compute_stretch(5.0)
    assert loaded > 1.5
    assert host.compute_stretch(15.0) == pytest.approx(1.0, abs=1e-3)


def test_bad_host_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        HostConfig(cores=-1)
    with pytest.raises(ValueError, match="window_s"):
        HostConfig(cores=2, window_s=0)


def _one_worker(host: HostConfig, rate_per_s: float) -> dict[str, Any]:
    model = ModelSpec(name="m", slo_s=0.25, max_batch_size=32, length_buckets=(16,))
    curve = LatencyCurve.linear((16,), (1, 2, 4, 8, 16, 32), fixed_s=0.008, per_token_s=0.0001)
    scenario = Scenario(
        name="host",
        models=(model,),
        curves=(curve,),
        traffic=Traffic(streams=(Stream("m", rate_per_s, lengths=LengthMix((12,), (1.0,))),)),
        duration_s=20.0,
        warmup_s=5.0,
        fleet=FleetConfig(workers=1, startup_s=0.0, host=host),
    )
    return run(scenario).summary


def test_a_fleet_on_a_shared_host_serves_slower_and_saturates_sooner() -> None:
    apart = HostConfig()
    shared = HostConfig(cores=2, tier_cpu_s=0.004)
    light_apart, light_shared = _one_worker(apart, 50), _one_worker(shared, 50)
    assert light_shared["latency_ms"]["p50"] > light_apart["latency_ms"]["p50"]
    # 400 requests/s: 1.6 cores of tiers leave the model 2 of 3.6 wanted, so batches run 1.8x
    # longer; the worker apart keeps up, the shared one falls behind its SLO.
    heavy_apart, heavy_shared = _one_worker(apart, 400), _one_worker(shared, 400)
    assert heavy_apart["slo_attainment"] > 0.99
    assert heavy_shared["slo_attainment"] < heavy_apart["slo_attainment"]


def test_the_summary_reports_the_hops_as_the_host_stretched_them() -> None:
    configured_ms = (FleetConfig().upstream_s + FleetConfig().downstream_s) * 1e3
    apart = _one_worker(HostConfig(), 100)
    assert apart["mean_hops_ms"] == pytest.approx(configured_ms)
    light = _one_worker(HostConfig(cores=2, tier_cpu_s=0.004), 200)
    assert light["mean_hops_ms"] == pytest.approx(configured_ms)
    # 1.6 cores of tiers and the hop's thread want 2.6 of 2: every hop waits 1.3x.
    heavy = _one_worker(HostConfig(cores=2, tier_cpu_s=0.004), 400)
    assert heavy["mean_hops_ms"] == pytest.approx(1.3 * configured_ms, rel=0.05)


def test_the_summary_reports_the_compute_per_batch_as_the_host_stretched_it() -> None:
    apart = _one_worker(HostConfig(), 100)
    shared = _one_worker(HostConfig(cores=2, tier_cpu_s=0.004), 100)
    # Mostly one-row batches of 12 tokens (bucket 16): 8 ms + 16 x 0.1 ms on the curve.
    assert 9.6 <= apart["mean_compute_ms"] < 12.0
    assert shared["mean_compute_ms"] > 1.1 * apart["mean_compute_ms"]
