"""The tiers' CPU in a simulated request's path: each tier's processes as a queue of CPU work.

A request costs each tier the CPU seconds its [fleet.tier_cpu] says (tier_costs.TierCpu): its
own, and its share of its bundle's, the bundles as large as the gateways' load makes them. The
gateways together and the routers together are one queue each; every worker has its own, of
`FleetConfig.worker_processes` processes. A queue of n processes of k cores works through n k
CPU seconds per second, first come first served, so a request waits for the work ahead of it
and then takes its own cost: the hop to the worker lengthens by both, and grows without bound
once a tier is offered more than its processes can do. The router decides once the gateway's
and its own queue are through (fleet.py), so a call the routers refuse has cost both tiers a
forwarded call's work; a call the gateways refuse costs them a share of a served call (grpc's
own per-call work). The model's device is the worker's executor, as before (worker.py);
nothing here applies while no tier cost is set."""

from __future__ import annotations

import math

from services.sim.tier_costs import TierCpu


class ProcessQueue:
    """`processes` processes of `cores` cores each, working through CPU work in arrival
    order."""

    __slots__ = ("_cores", "_free_s")

    def __init__(self, processes: int, cores: float) -> None:
        #: The queue's cores: work's CPU seconds over them is its share of the queue's time.
        self._cores = max(1, processes) * cores
        self._free_s = 0.0

    def add_work(self, now_s: float, cost_s: float) -> float:
        """Queues `cost_s` CPU seconds of work arriving at `now_s` (a refusal's answers no
        one, but delays the requests after it); returns when the work starts."""
        start_s = max(now_s, self._free_s)
        self._free_s = start_s + cost_s / self._cores
        return start_s

    def delay_s(self, now_s: float, cost_s: float) -> float:
        """How long a request of `cost_s` CPU seconds arriving at `now_s` spends in this
        tier: the work ahead of it, then its own cost."""
        return self.add_work(now_s, cost_s) - now_s + cost_s


#: Weight of the newest gap between arrivals in the gateways' moving average (about the last
#: hundred arrivals), and the arrivals before it takes over from the plain mean.
_GAP_SMOOTHING = 0.01
_WARM_ARRIVALS = 100


class TierQueues:
    """The gateways', the routers' and each worker's CPU queues of one simulated fleet. A
    request's costs follow the bundles the gateways' load makes (TierCpu.slices_per_bundle),
    from the moving average of the gap between arrivals at the gateways."""

    def __init__(self, cpu: TierCpu, *, gateways: int, routers: int, worker_processes: int) -> None:
        self.is_set = cpu.is_set
        self._cpu = cpu
        cores = cpu.cores_per_process
        self._num_gateways = max(1, gateways)
        self._gateways = ProcessQueue(gateways, cores)
        self._routers = ProcessQueue(routers, cores)
        self._worker = (worker_processes, cores)
        self._workers: dict[str, ProcessQueue] = {}
        self._first_arrival_s: float | None = None
        self._last_arrival_s = 0.0
        self._arrivals = 0
        self._mean_gap_s = math.inf
        #: Callers per bundle at the gateways' load now.
        self.slices = 1.0

    def refused_at_gateway(self, now_s: float) -> None:
        """A call the gateways refused at `now_s` (quota, throttle): grpc's per-call work,
        `gateway_refusal_share` of a served call's, still falls on them."""
        refusal_s = self._cpu.gateway_refusal_share * self._cpu.gateway_s(self.slices)
        self._gateways.add_work(now_s, refusal_s)

    def at_gateway_and_router(self, now_s: float) -> float:
        """Seconds a request spends in the gateway and then the router, arriving at `now_s`."""
        self._arrived(now_s)
        cpu = self._cpu
        gateway_s = self._gateways.delay_s(now_s, cpu.gateway_s(self.slices))
        return gateway_s + self._routers.delay_s(now_s + gateway_s, cpu.router_s(self.slices))

    def at_worker(self, worker_id: str, now_s: float) -> float:
        """Seconds a request reaching `worker_id`'s processes at `now_s` spends in them before
        its rows reach the batcher."""
        queue = self._workers.get(worker_id)
        if queue is None:
            queue = self._workers[worker_id] = ProcessQueue(*self._worker)
        return queue.delay_s(now_s, self._cpu.worker_s(1.0, self.slices))

    def _arrived(self, now_s: float) -> None:
        if self._first_arrival_s is None:
            self._first_arrival_s = now_s
        elif self._arrivals < _WARM_ARRIVALS:
            # Until the average has as many gaps as it weighs, the plain mean since the first
            # arrival: one gap (two calls at once: 0) would set the rate for the next hundred.
            self._mean_gap_s = (now_s - self._first_arrival_s) / self._arrivals
        else:
            gap_s = max(0.0, now_s - self._last_arrival_s)
            self._mean_gap_s += _GAP_SMOOTHING * (gap_s - self._mean_gap_s)
        self._arrivals += 1
        self._last_arrival_s = now_s
        if self._mean_gap_s > 0 and not math.isinf(self._mean_gap_s):
            per_process_per_s = 1.0 / (self._mean_gap_s * self._num_gateways)
            self.slices = self._cpu.slices_per_bundle(per_process_per_s)
