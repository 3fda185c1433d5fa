"""A discrete-event simulator of the serving fleet, built from the real policies.

The batcher (`gpu_worker.batching.policy.Batcher` with its `LatencyModel`), the router's
`RouteTable`, the gateway's `AdaptiveThrottle` and the HPA's rule run against simulated time:
nothing here reads a clock, sleeps, or imports asyncio or gRPC. `python -m services.sim` runs a
scenario file or plans capacity (see services/sim/__main__.py).
"""
