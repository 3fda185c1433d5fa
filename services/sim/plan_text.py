"""The planner's answer as text: the plan, the formulas with their numbers, every simulated
count, and each tier's processes with what binds them."""

from __future__ import annotations

from services.sim.planner import Plan
from services.sim.tier_costs import FleetPlan


def format_plan(result: Plan, *, percentile: float, headroom: float, slo_ms: float) -> str:
    """The plan, the formulas with their numbers, and every simulated count, as text.
    `slo_ms`: the SLO of a single-model scenario (several models: each one's, from the plan)."""
    cf, gw = result.closed_form, result.gateways
    slo = f"SLO {slo_ms:g} ms" if len(cf.models) < 2 else "each model's SLO"
    lines = [
        f"offered with {headroom:.0%} headroom: {result.offered_per_s:.1f} req/s; "
        f"{slo} at p{percentile:g}",
    ]
    lines += [  # what the plan rests on that no measurement does
        f"warning: {m.model} {gap} (extrapolated: measure them for a plan to act on)"
        for m in cf.models
        for gap in m.unmeasured
    ]
    if len(cf.models) > 1:
        lines.append(
            "closed form: c >= sum_m lambda_m (1 + h) t_m(b*_m) / b*_m, b*_m as b* with m's SLO"
        )
        lines += [
            f"  {m.model}: {m.offered_per_s:.1f} req/s, SLO {m.slo_s * 1e3:g} ms, b* = "
            f"{m.batch_size}, t(b*) = {m.batch_s * 1e3:.2f} ms -> {m.workers:.2f} workers"
            for m in cf.models
        ]
        lines.append(f"  {cf.rows_per_s:.0f} rows/s per worker -> {cf.workers} workers")
    else:
        lines += [
            "closed form: c >= lambda (1 + h) t(b*) / b*, b* = largest b with 2 t(b) <= SLO budget",
            f"  b* = {cf.batch_size}, t(b*) = {cf.batch_s * 1e3:.2f} ms, "
            f"{cf.rows_per_s:.0f} rows/s per worker -> {cf.workers} workers",
        ]
    if result.fleet is None:
        lines.append(
            f"gateways: g >= peak lambda (1 + h) / gateway_rps = {gw.peak_offered_per_s:.0f} x "
            f"{1.0 + headroom:.2f} / {gw.gateway_rps:g} -> {gw.gateways} gateways"
        )
    lines.append(f"simulated (workers: p{percentile:g} latency, SLO attainment, meets):")
    for trial in result.trials:
        lines.append(
            f"  {trial.workers:5d}: {trial.latency_ms:9.1f} ms  {trial.slo_attainment:.4f}  "
            f"{'yes' if trial.meets else 'no'}"
        )
    if result.workers is None:
        lines.append("no worker count up to --max-workers meets the SLO")
        return "\n".join(lines)
    if result.fleet is None:
        lines.append(
            f"plan: {result.workers} workers (closed form: {cf.workers}), {gw.gateways} gateways"
        )
    else:
        lines += _fleet_lines(
            result.fleet, result.closed_form_devices or cf.workers, result.workers
        )
    lines += [
        f"simulated HPA ([hpa] target, mean per row at {result.workers} workers under the "
        "scenario's own traffic):",
        f"  backlog {result.hpa_backlog_target_ms:.2f} ms, queue_wait "
        f"{result.hpa_queue_wait_target_ms:.2f} ms. Prefer backlog: queue wait includes the "
        "batcher's linger, which adding workers does not shorten",
        "  (scenarios/hpa_queue_wait.toml climbs to max_replicas).",
        f"deployed HPA (deploy/k8s/overlays/prod/hpa.yaml, p90 queue wait per pod from the "
        f"worker histogram's buckets): target {result.hpa_p90_queue_wait_target_ms:.1f} ms",
    ]
    return "\n".join(lines)


def _fleet_lines(fleet: FleetPlan, closed_form_devices: int, simulated: int) -> list[str]:
    """The plan of every tier (tier_costs.py), each with what binds it. The devices are the
    more of the simulated count (worker processes at most planner.STABLE_LOAD busy) and the
    closed form's (each process filled to the plan's utilization, leaving room for bursts)."""
    gateways, routers = fleet.gateways, fleet.routers
    return [
        f"plan: {fleet.devices} devices ({fleet.device_binds} binds; closed form: "
        f"{closed_form_devices}, simulated: {simulated} with worker processes at most 95% busy), "
        f"{fleet.worker_processes_per_device} worker process(es) per device "
        f"({fleet.worker_binds} binds)",
        f"  gateways: {gateways.processes} processes in {fleet.gateway_pods} pods "
        f"({gateways.binds} binds, {gateways.per_process_per_s:.0f} req/s per process)",
        f"  routers: {routers.processes} ({routers.binds} binds, "
        f"{routers.per_process_per_s:.0f} req/s per router)",
    ]
