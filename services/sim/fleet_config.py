"""How a simulated fleet is built and how its parts talk (services.sim.fleet runs it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.gateway.tenants import TenantPolicy
from services.gateway.throttle import ThrottleConfig
from services.router.routing_config import RoutingConfig
from services.sim.host import HostConfig
from services.sim.tier_costs import TierCpu


@dataclass(frozen=True)
class FleetConfig:
    """How the fleet is built and how its parts talk."""

    workers: int = 1
    #: From a new worker's creation to its first heartbeat (image pull, model load, warm-up).
    startup_s: float = 60.0
    heartbeat_period_s: float = 1.0
    refresh_period_s: float = 0.5
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    throttle: ThrottleConfig = field(default_factory=ThrottleConfig)
    gateways: int = 1
    #: Gateway + router + hop to the worker, and the hop back, seconds.
    upstream_s: float = 0.002
    downstream_s: float = 0.001
    #: Workers per router cell; 0: one router table over the whole fleet.
    cell_size: int = 0
    #: Retries after UNAVAILABLE, as the router's default (RouterConfig.max_retries).
    max_retries: int = 2
    #: Lognormal sigma of batch compute around the curve (0: exactly the curve).
    noise_sigma: float = 0.0
    #: CPU seconds the worker process spends per row outside the model (decode, copies).
    cpu_per_row_s: float = 0.0002
    cpu_cores: float = 1.0
    #: The cores a worker shares with its tiers (host.py); the default shares none.
    host: HostConfig = field(default_factory=HostConfig)
    #: The gateways' tenant tables (services.gateway.tenants; a scenario's [tenants.NAME]).
    tenants: Mapping[str, TenantPolicy] = field(default_factory=dict)
    #: How often the gateways share their demand to split fleet-wide quotas, seconds (the
    #: gateway's --quota-sync-period-s); 0: each gateway enforces whole limits (no Redis).
    quota_sync_period_s: float = 0.5
    #: Requests/s one gateway process serves (CPU-bound), for the planner's gateway count
    #: when `tier_cpu` is not given: about one grpc.aio process's tiny unary calls per second
    #: on the 2-core dev machine.
    gateway_rps: float = 3000.0
    #: Every tier's CPU per request (tier_costs.py; a scenario's [fleet.tier_cpu]): the
    #: planner's process counts, and a queue of CPU work per tier on a request's path
    #: (tier_queues.py) of `gateways`, `routers` and, per worker, `worker_processes`.
    tier_cpu: TierCpu = field(default_factory=TierCpu)
    routers: int = 1
    worker_processes: int = 1
