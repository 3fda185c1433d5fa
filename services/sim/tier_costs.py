"""Every tier's CPU in a capacity plan: gateways, routers and the workers' own processes.

On a GPU fleet the device is rarely what binds: measured on an H100 box, the whole fabric
served 957 one-text requests/s against the model's 36,900 rows/s at batch 64, because every
tier spent about a millisecond of CPU per request (services/sim/scenarios/plan_h100.toml has
the figures). A plan that counts only devices (the closed form and the simulator's search)
would deploy about a twentieth of the worker processes that traffic needs (2 of 39 for
plan_h100's 20,000 requests/s), a fifth of the gateways, and no routers.

Each tier is a set of processes; a process's work is its event loop (plus grpc's own
threads), so it serves at most `cores_per_process / cpu_s_per_request` requests/s, and a plan
fills it to `utilization` of that. Then, for offered lambda requests/s with headroom h:

    gateways          g = the fewest with peak (1 + h) c_g(b(peak (1 + h) / g)) <= g k u,
                          in ceil(g / per_pod) pods
    worker processes  w = ceil(lambda (1 + h) (c_w(b(lambda (1 + h) / g)) + rows c_row) / (k u))
    devices           d = max(device term of the closed form, ceil(w / f_max), 1)
    per device        f = ceil(w / d)           (worker processes sharing one device, at most
                                                 f_max: MIG slices or time-slicing; a worker's
                                                 gRPC front and its engine share one process)
    routers           r = ceil(peak (1 + h) c_r(b(peak (1 + h) / g)) / (k u))

where a tier's cost per request c_t(b) = its cost per caller + its cost per bundle / b, and a
gateway process offered x calls/s bundles b(x) = min(b_max, 1 + max(0, x - x_0) window) of
them (x_0: where its coalescer starts holding bundles back; no window: b = 1, and the costs
are per request whatever the bundles, as the GPU scenarios measured them). A process's whole
rate is taken as one bundle key's: its coalescer bundles per model version, class and
deadline class, so a process serving several of them bundles less than this says.

and each answer names what binds it: a device count the device curve ("device"), the
processes per device the worker CPU ("worker CPU") once it asks for more than one, the
gateways and routers their CPU. `capacity_per_s` is the inverse: what a given fleet serves,
the lowest of its tiers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

#: What binds a tier's count.
DEVICE, WORKER_CPU, GATEWAY_CPU, ROUTER_CPU = "device", "worker CPU", "gateway CPU", "router CPU"


@dataclass(frozen=True)
class TierCpu:
    """CPU seconds each tier's process spends per request (and the worker's per row), as
    bench.fabric measures them per tier, with where they were measured."""

    gateway_s_per_request: float = 0.0
    router_s_per_request: float = 0.0
    worker_s_per_request: float = 0.0
    #: The worker's CPU per row beyond a request's own cost (multi-row requests).
    worker_s_per_row: float = 0.0
    #: CPU seconds per bundle, the downstream call that carries several callers' rows: the
    #: gateway's call to a router and its answer, the router's forwarding, the worker's pass
    #: over a bundle (its admission, its message). A request pays its share of it, over the
    #: slices per bundle (`slices_per_bundle`); the `*_s_per_request` costs are then each
    #: caller's own. 0: costs measured per request whatever the bundles (the GPU scenarios').
    gateway_s_per_bundle: float = 0.0
    router_s_per_bundle: float = 0.0
    worker_s_per_bundle: float = 0.0
    #: How bundles grow with load: a gateway process offered `per_s` calls a second bundles
    #: 1 + (per_s - min_bundling_per_s) * bundle_window_s of them on average past
    #: min_bundling_per_s (its coalescer holds a bundle back only under load:
    #: services/common/write_linger.py), at most max_slices_per_bundle (the model's batch).
    #: bundle_window_s 0: one slice per bundle.
    bundle_window_s: float = 0.0
    min_bundling_per_s: float = 0.0
    max_slices_per_bundle: int = 64
    #: CPU of a call the gateway refuses (its tenant's quota, its throttle), as a share of a
    #: served call's: grpc's own per-call work, which no refusal avoids (bench.server_calls:
    #: a refusal costs about a bare call, 0.3-0.4 of the gateway's served call).
    gateway_refusal_share: float = 0.35
    #: Cores one process's work can use: its event loop, and grpc's threads beside it.
    cores_per_process: float = 1.0
    #: Share of a process's cores a plan fills, leaving the rest for bursts (the CPU HPAs'
    #: target is 0.7).
    utilization: float = 0.7
    #: Gateway processes per pod (the gateway's --processes).
    gateway_processes_per_pod: int = 1
    #: Worker processes one device can take (MIG slices, or time-slicing): past it, worker
    #: CPU adds devices.
    max_worker_processes_per_device: int = 8
    #: Where the costs were measured (a log and its command).
    provenance: str = ""

    def __post_init__(self) -> None:
        costs = (
            self.gateway_s_per_request,
            self.router_s_per_request,
            self.worker_s_per_request,
            self.worker_s_per_row,
            self.gateway_s_per_bundle,
            self.router_s_per_bundle,
            self.worker_s_per_bundle,
        )
        if min(costs) < 0:
            raise ValueError("tier CPU costs must be >= 0 seconds")
        if min(self.bundle_window_s, self.min_bundling_per_s) < 0:
            raise ValueError("bundle_window_s and min_bundling_per_s must be >= 0")
        if self.max_slices_per_bundle < 1:
            raise ValueError("max_slices_per_bundle must be >= 1")
        if not 0 <= self.gateway_refusal_share <= 1:
            raise ValueError("gateway_refusal_share must be in [0, 1]")
        if self.cores_per_process <= 0 or not 0 < self.utilization <= 1:
            raise ValueError("cores_per_process must be > 0 and utilization in (0, 1]")
        if self.gateway_processes_per_pod < 1 or self.max_worker_processes_per_device < 1:
            raise ValueError("processes per gateway pod and per device must be >= 1")

    @property
    def is_set(self) -> bool:
        """Whether any tier's cost is known (else plans count devices and gateway_rps only)."""
        return max(self.gateway_s(), self.router_s(), self.worker_s(1.0)) > 0

    def slices_per_bundle(self, per_gateway_process_per_s: float) -> float:
        """Callers per bundle, on average, at a gateway process offered that many calls/s."""
        beyond_per_s = per_gateway_process_per_s - self.min_bundling_per_s
        if self.bundle_window_s <= 0 or beyond_per_s <= 0:
            return 1.0
        grown = 1.0 + beyond_per_s * self.bundle_window_s
        return min(float(self.max_slices_per_bundle), grown)

    def gateway_s(self, slices: float = 1.0) -> float:
        """A gateway process's CPU seconds per request, `slices` requests a bundle."""
        return self.gateway_s_per_request + self.gateway_s_per_bundle / slices

    def router_s(self, slices: float = 1.0) -> float:
        """A router's CPU seconds per request, `slices` requests a bundle."""
        return self.router_s_per_request + self.router_s_per_bundle / slices

    def worker_s(self, rows_per_request: float, slices: float = 1.0) -> float:
        """A worker process's CPU seconds per request of `rows_per_request` rows, `slices`
        requests a bundle."""
        return (
            self.worker_s_per_request
            + rows_per_request * self.worker_s_per_row
            + self.worker_s_per_bundle / slices
        )

    def processes_for(self, rate_per_s: float, cpu_s: float) -> int:
        """Processes serving `rate_per_s` requests of `cpu_s` each, filled to `utilization`."""
        cores = rate_per_s * cpu_s / (self.cores_per_process * self.utilization)
        return max(1, math.ceil(cores - 1e-9))  # 700 x 1 ms at 0.7 is 1, not 1.0000000000000002


@dataclass(frozen=True)
class TierCount:
    """One tier's processes and what binds them."""

    tier: str
    processes: int
    binds: str
    #: Requests/s one process serves at the plan's utilization (inf: no cost known).
    per_process_per_s: float


@dataclass(frozen=True)
class FleetPlan:
    """Devices, worker processes per device, gateways (processes and pods) and routers."""

    devices: int
    device_binds: str
    worker_processes_per_device: int
    worker_binds: str
    gateways: TierCount
    gateway_pods: int
    routers: TierCount

    @property
    def worker_processes(self) -> int:
        return self.devices * self.worker_processes_per_device


def fleet_plan(
    cpu: TierCpu,
    *,
    device_workers: int,
    mean_per_s: float,
    peak_per_s: float,
    rows_per_request: float = 1.0,
    least_per_device: int = 1,
) -> FleetPlan:
    """The fleet for `mean_per_s` requests/s on average and `peak_per_s` at the busiest (both
    with headroom already), given `device_workers` devices the device curve needs. Worker
    processes follow the mean, as devices do (the worker HPA answers surges); gateways and
    routers the peak (they hold no queue). Bundles are as large as the planned gateway
    processes' load makes them (`TierCpu.slices_per_bundle`): the routers' at the peak, the
    workers' at the mean. `least_per_device`: the fewest worker processes a device (a plan
    states what its trials ran)."""
    gateways = _gateway_tier(cpu, peak_per_s)
    slices_at_peak = cpu.slices_per_bundle(peak_per_s / gateways.processes)
    slices_at_mean = cpu.slices_per_bundle(mean_per_s / gateways.processes)
    worker_cost_s = cpu.worker_s(rows_per_request, slices_at_mean)
    worker_processes = cpu.processes_for(mean_per_s, worker_cost_s)
    by_cpu = math.ceil(worker_processes / cpu.max_worker_processes_per_device)
    devices = max(1, device_workers, by_cpu)
    per_device = max(1, least_per_device, math.ceil(worker_processes / devices))
    routers = _tier("router", cpu, peak_per_s, cpu.router_s(slices_at_peak), ROUTER_CPU)
    return FleetPlan(
        devices=devices,
        device_binds=WORKER_CPU if by_cpu > max(1, device_workers) else DEVICE,
        worker_processes_per_device=per_device,
        worker_binds=WORKER_CPU if per_device > 1 else DEVICE,
        gateways=gateways,
        gateway_pods=math.ceil(gateways.processes / cpu.gateway_processes_per_pod),
        routers=routers,
    )


def _gateway_tier(cpu: TierCpu, peak_per_s: float) -> TierCount:
    """The fewest gateway processes whose CPU takes `peak_per_s`, each bundling the calls of
    its share (more processes: smaller bundles, more CPU per call)."""
    processes = 1
    while True:
        cost_s = cpu.gateway_s(cpu.slices_per_bundle(peak_per_s / processes))
        if cpu.processes_for(peak_per_s, cost_s) <= processes:
            return _tier("gateway", cpu, peak_per_s, cost_s, GATEWAY_CPU)
        processes += 1


def _tier(name: str, cpu: TierCpu, rate_per_s: float, cost_s: float, binds: str) -> TierCount:
    per_process = math.inf if cost_s <= 0 else cpu.cores_per_process * cpu.utilization / cost_s
    return TierCount(name, cpu.processes_for(rate_per_s, cost_s), binds, per_process)


def capacity_per_s(
    cpu: TierCpu,
    *,
    device_rows_per_s: float,
    worker_processes: int,
    gateway_processes: int,
    routers: int,
    rows_per_request: float = 1.0,
) -> tuple[float, str]:
    """Requests/s a fleet serves at full use of its processes (utilization 1), and the tier
    that binds it: the lowest of its devices (`device_rows_per_s` in all), worker processes,
    gateways and routers. A tier's limit is the first rate its processes cannot keep up with,
    its bundles as large as that rate makes them (larger bundles later cannot help a fleet
    that saturated on the way)."""
    cores = cpu.cores_per_process
    gateways = max(1, gateway_processes)
    # Below this fleet rate no gateway process bundles: every request costs its whole bundle.
    bundling_from_per_s = gateways * cpu.min_bundling_per_s if cpu.bundle_window_s > 0 else math.inf

    def slices(rate_per_s: float) -> float:
        return cpu.slices_per_bundle(rate_per_s / gateways)

    def served(processes: int, cost_s_at: Callable[[float], float]) -> float:
        return _served(processes * cores, cost_s_at, bundling_from_per_s)

    limits = {
        DEVICE: device_rows_per_s / rows_per_request,
        WORKER_CPU: served(worker_processes, lambda r: cpu.worker_s(rows_per_request, slices(r))),
        GATEWAY_CPU: served(gateway_processes, lambda r: cpu.gateway_s(slices(r))),
        ROUTER_CPU: served(routers, lambda r: cpu.router_s(slices(r))),
    }
    binds = min(limits, key=limits.__getitem__)
    return limits[binds], binds


def _served(cores: float, cost_s_at: Callable[[float], float], bundling_from_per_s: float) -> float:
    """The first rate (requests/s) at which `cores` cannot do a request's CPU `cost_s_at`
    that rate; inf when requests cost nothing, 0 without cores.

    Below `bundling_from_per_s` a request costs cost_s_at(1) whatever the rate, so the CPU
    used grows linearly and first fills the cores at cores / cost_s_at(1), if that comes
    first. Past it, rate x cost is convex in the rate (bundles growing linearly with it, then
    capped), so the rates that keep up there are one interval, from where they start to at
    most cores / cost_s_at(inf) (the cost at the largest bundles): bisection finds its end."""
    if cost_s_at(1.0) <= 0:
        return math.inf
    if cores <= 0:
        return 0.0

    def keeps_up(rate_per_s: float) -> bool:
        return rate_per_s * cost_s_at(rate_per_s) <= cores

    low = cores / cost_s_at(1.0)
    if low <= bundling_from_per_s:
        return low
    high = cores / cost_s_at(math.inf)
    if keeps_up(high):
        return high
    for _ in range(60):  # to well under a request/s
        middle = (low + high) / 2
        low, high = (middle, high) if keeps_up(middle) else (low, middle)
    return low
