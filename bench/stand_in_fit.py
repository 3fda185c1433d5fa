"""Each tier's CPU per caller and per bundle, fitted from two closed loops whose bundles differ
(bench/stand_in_validation.py's calibration)."""

from __future__ import annotations

from dataclasses import dataclass

from services.sim.tier_costs import TierCpu


@dataclass(frozen=True)
class CostPoint:
    """Each tier's CPU seconds per request under one closed loop, and its bundles."""

    callers: int
    per_s: float
    #: Callers per bundle, from the gateway's `inference_gateway_bundle_slices`.
    slices: float
    #: "gateway", "router", "worker" and "bench" (the load generator).
    cost_s: dict[str, float]
    statuses: dict[str, int]


def fit_bundle_costs(light: CostPoint, busy: CostPoint, *, max_slices: int) -> TierCpu:
    """Each tier's cost per caller and per bundle from two loads whose bundles differ
    (cost = per caller + per bundle / slices), and how bundles grow with a gateway process's
    load: linearly past the rate from which its coalescer starts holding bundles back, the
    line through both points (at most the light point's rate from zero: a light point of one
    caller a bundle leaves it there). Both costs stay at or above zero, and the busy point's
    cost is always matched (noise between the points moves only the split)."""
    if busy.slices <= light.slices or busy.per_s <= light.per_s:
        raise ValueError(
            f"the two loads bundled alike ({light.slices:.2f} and {busy.slices:.2f} callers a "
            f"bundle at {light.per_s:.0f}/s and {busy.per_s:.0f}/s): nothing to fit"
        )
    # Bundles: the line through both points, b = 1 + (rate - bundling_from) window.
    window_s = (busy.slices - light.slices) / (busy.per_s - light.per_s)
    bundling_from_per_s = max(0.0, busy.per_s - (busy.slices - 1) / window_s)
    span = 1 / light.slices - 1 / busy.slices
    fitted: dict[str, tuple[float, float]] = {}
    for tier in ("gateway", "router", "worker"):
        busy_s = busy.cost_s[tier]
        per_bundle = max(0.0, (light.cost_s[tier] - busy_s) / span)
        per_call = busy_s - per_bundle / busy.slices
        if per_call < 0:  # the light load cost more than its bundles explain: all per bundle
            per_call, per_bundle = 0.0, busy_s * busy.slices
        fitted[tier] = (per_call, per_bundle)
    return TierCpu(
        gateway_s_per_request=fitted["gateway"][0],
        gateway_s_per_bundle=fitted["gateway"][1],
        router_s_per_request=fitted["router"][0],
        router_s_per_bundle=fitted["router"][1],
        worker_s_per_request=fitted["worker"][0],
        worker_s_per_bundle=fitted["worker"][1],
        bundle_window_s=window_s,
        min_bundling_per_s=bundling_from_per_s,
        max_slices_per_bundle=max_slices,
        provenance=(
            f"bench.stand_in_validation: {light.callers} and {busy.callers} closed-loop "
            "callers, this run"
        ),
    )
