"""The fabric benchmark's outputs: summary ratios, goals, the printed table and the plot.

Everything here reads the report dictionary `bench.fabric` builds (the same one written to
JSON), so a saved result can be re-rendered without measuring again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The issue's goals for the 2-core CPU machine class: (summary key, minimum).
GOALS = {
    "efficiency": 0.85,
    "mixed_efficiency": 0.6,
    "batching_gain": 1.8,
    "peer_ratio": 1.5,
    "overhead_ratio": 0.5,
    "overload_2x_goodput_fraction": 0.9,
    "overload_10x_goodput_fraction": 0.5,
}
#: Stacks and peer in the order they are shown.
CONFIG_ORDER = ("batching_off", "batching_on", "batching_on_mixed", "peer")


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The headline ratios, each beside the numbers it is made of."""
    configs = report.get("configs", {})
    on = configs.get("batching_on", {}).get("goodput_per_s")
    off = configs.get("batching_off", {}).get("goodput_per_s")
    peer = configs.get("peer", {})
    raw_best = report.get("raw_model", {}).get("best", {})
    overhead = report.get("overhead", {})
    stack_rps = overhead.get("identity_stack", {}).get("ok_per_s")
    echo_rps = overhead.get("echo", {}).get("ok_per_s")
    mixed = configs.get("batching_on_mixed", {}).get("goodput_per_s")
    raw_mixed_best = report.get("raw_model_mixed", {}).get("best", {})
    summary: dict[str, Any] = {
        "efficiency": _ratio(on, raw_best.get("sequences_per_s")),
        "mixed_efficiency": _ratio(mixed, raw_mixed_best.get("sequences_per_s")),
        "goodput_mixed_per_s": mixed,
        "raw_mixed_best_sequences_per_s": raw_mixed_best.get("sequences_per_s"),
        "raw_mixed_best_batch_size": raw_mixed_best.get("batch_size"),
        "batching_gain": _ratio(on, off),
        "peer_ratio": _ratio(on, peer.get("goodput_per_s")),
        "overhead_ratio": _ratio(stack_rps, echo_rps),
        "goodput_batching_on_per_s": on,
        "goodput_batching_off_per_s": off,
        "goodput_peer_per_s": peer.get("goodput_per_s"),
        "raw_best_sequences_per_s": raw_best.get("sequences_per_s"),
        "raw_best_batch_size": raw_best.get("batch_size"),
        "identity_stack_per_s": stack_rps,
        "echo_per_s": echo_rps,
    }
    if summary["peer_ratio"] is None:
        summary["peer_ratio_reason"] = peer.get("skipped") or "peer goodput not found"
    slo_s = report.get("model", {}).get("slo_p99_ms", 0) / 1000.0
    after = report.get("after_overload")
    if after is not None:
        summary["after_overload_good_fraction"] = after["good_fraction"]
    from_ready = report.get("from_ready", {})
    if "good_fraction" in from_ready:
        summary["from_ready_good_fraction"] = from_ready["good_fraction"]
    for point in report.get("bursty", []):
        summary[f"arrivals_{bursty_name(point, '_')}_good_fraction"] = point["good_fraction"]
    for point in report.get("overload", []):
        flood = flood_name(point, "_")
        summary[f"{flood}_goodput_fraction"] = _ratio(point["goodput_per_s"]["median"], on)
        p99 = point["p99_s"]["median"]
        summary[f"{flood}_accepted_p99_s"] = p99
        summary[f"{flood}_p99_within_slo"] = p99 is not None and p99 <= slo_s
        # More than 1% of its sends left late: it measured the generator, and its figures
        # meet no goal (they could: bench review).
        summary[f"{flood}_valid"] = bool(point.get("valid"))
    return summary


def flood_name(point: dict[str, Any], separator: str = " ") -> str:
    """A flood's name: "overload 2x", and "overload 2x throttled" where its callers throttled
    themselves (the goals are the floods of callers that send every call)."""
    words = ["overload", f"{point['factor']:.3g}x"]
    return separator.join([*words, "throttled"] if point.get("throttled") else words)


def bursty_name(point: dict[str, Any], separator: str = " ") -> str:
    """A point of the bursty phases (measure.bursty_phases) by its share of the goodput and
    its arrivals: "0.8x poisson", "0.8x bursty 0.1"."""
    burstiness = point["burstiness"]
    kind = ["poisson"] if burstiness == 1.0 else ["bursty", f"{burstiness:g}"]
    return separator.join([f"{point['share']:g}x", *kind])


def bursty_line(point: dict[str, Any]) -> str:
    """What a bursty phase's point got: its good share and its accepted p99."""
    p99 = point["p99_s"]["median"]
    return f"good {point['good_fraction']:.1%}, accepted p99 {_ms(p99)} ms" + (
        "" if point.get("valid") else " (INVALID: late sends)"
    )


def goals(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each goal with its value and whether it is met (None: not measured)."""
    result = {}
    for key, minimum in GOALS.items():
        value = summary.get(key)
        met = None if value is None else value >= minimum
        if key.startswith("overload_") and met is not None:
            factor = key.removeprefix("overload_").removesuffix("_goodput_fraction")
            met = (
                met
                and bool(summary.get(f"overload_{factor}_p99_within_slo"))
                and bool(summary.get(f"overload_{factor}_valid"))
            )
        result[key] = {"target": f">= {minimum:g}", "value": value, "met": met}
    return result


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _num(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _cpu_per_1k(rate: dict[str, Any]) -> str:
    cpu, sent = rate.get("cpu_s", {}), rate.get("sent_in_windows", 0)
    if not cpu or not sent:
        return "-"
    shown = {k: v for k, v in cpu.items() if v >= 0.005 and k not in ("redis", "launcher")}
    return " ".join(f"{k}={1000 * v / sent:.2f}" for k, v in shown.items())


def _batch(rate: dict[str, Any]) -> str:
    worker = rate.get("breakdown", {}).get("worker-0", {})
    return _num(worker.get("mean_batch_size"), ".1f")


def max_outside_share(report: dict[str, Any]) -> float:
    """The largest share of the CPU other processes took during any measurement."""
    shares = [
        p.get("outside_cpu_share", 0.0) for p in report.get("raw_model", {}).get("points", [])
    ]
    for part in (*report.get("configs", {}).values(), report):  # the stand-in's phases too
        for phase in ("rates", "bursty", "overload"):
            shares += [p.get("outside_cpu_share", 0.0) for p in part.get(phase, [])]
    return max(shares, default=0.0)


def _raw_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    raw = report.get("raw_model", {})
    if raw:
        lines.append(f"raw in-process model ({raw['num_tokens']} tokens), sequences/s:")
        points = raw["points"]
        lines.append("  " + _per_batch(points, "sequences_per_s", ".0f"))
        cpu = [f"b{p['batch_size']}={p.get('cpu_ms_per_sequence', 0):.1f}" for p in points]
        lines.append("  CPU ms per sequence: " + "  ".join(cpu))
    raw_mixed = report.get("raw_model_mixed", {})
    if raw_mixed:
        lines.append(
            f"raw model on the mixed-length texts (rows per bucket "
            f"{raw_mixed['rows_per_bucket']}), sequences/s:"
        )
        lines.append("  " + _per_batch(raw_mixed["points"], "sequences_per_s", ".0f"))
    return lines


def _per_batch(points: list[dict[str, Any]], key: str, spec: str) -> str:
    return "  ".join(f"b{p['batch_size']}={format(p[key], spec)}" for p in points)


def _rate_columns(point: dict[str, Any]) -> str:
    """goodput, p50, p90, p99, batch and late% of a measured rate (medians over windows)."""
    return (
        f"{_num(point['goodput_per_s']['median'], '.0f'):>9} "
        f"{_ms(point['p50_s']['median']):>5} {_ms(point['p90_s']['median']):>5} "
        f"{_ms(point['p99_s']['median']):>5} {_batch(point):>5} "
        f"{_num(point['late_fraction']['median'] * 100, '.1f'):>5}  "
    )


def _config_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for name in CONFIG_ORDER:
        config = report.get("configs", {}).get(name)
        if config is None:
            continue
        if "skipped" in config:
            lines.append(f"{name:<18} skipped: {config['skipped']}")
            continue
        at = config.get("at_goodput") or {}
        not_ok = {k: v for k, v in at.get("statuses", {}).items() if k != "OK"}
        late = at.get("late_fraction", {}).get("median")
        lines.append(
            f"{name:<18} {_num(config.get('goodput_per_s'), '.0f'):>9} "
            f"{_ms(at.get('p50_s', {}).get('median')):>5} "
            f"{_ms(at.get('p90_s', {}).get('median')):>5} "
            f"{_ms(at.get('p99_s', {}).get('median')):>5} {_batch(at):>5} "
            f"{_num(None if late is None else late * 100, '.1f'):>5}  "
            f"{not_ok or '-'!s:<28} {_cpu_per_1k(at)}"
        )
    for point in report.get("bursty", []):
        lines.append(f"{bursty_name(point):<18} {_rate_columns(point)}{bursty_line(point)}")
    for point in report.get("overload", []):
        not_ok = {k: v for k, v in point.get("statuses", {}).items() if k != "OK"}
        lines.append(
            f"{flood_name(point):<18} {_rate_columns(point)}"
            f"{not_ok or '-'!s:<28} offered {point['offered_rate_per_s']:.0f}/s"
            + ("" if point.get("valid") else "  (INVALID: late sends)")
        )
    after = report.get("after_overload")
    if after is not None:
        lines.append(
            f"{'after overload':<18} {_rate_columns(after)}"
            f"good {after['good_fraction']:.1%} at half the goodput, right after the floods of "
            f"callers sending every call"
        )
    from_ready = report.get("from_ready")
    if from_ready is not None and "skipped" in from_ready:
        lines.append(f"{'from ready':<18} skipped: {from_ready['skipped']}")
    elif from_ready is not None:
        lines.append(
            f"{'from ready':<18} {_rate_columns(from_ready)}"
            f"good {from_ready['good_fraction']:.1%} at half the mixed goodput, a fresh stack"
        )
    return lines


def _overhead_lines(report: dict[str, Any]) -> list[str]:
    overhead = report.get("overhead", {})
    if not overhead:
        return []
    lines = [
        f"\noverhead (closed loop, concurrency {overhead.get('concurrency')}, "
        f"{overhead.get('payload_bytes')} B payload): identity through 3 tiers "
        f"{_num(overhead.get('identity_stack', {}).get('ok_per_s'), '.0f')}/s, "
        f"bare grpc.aio echo {_num(overhead.get('echo', {}).get('ok_per_s'), '.0f')}/s"
    ]
    for name in ("identity_stack", "echo"):
        lines.append(f"  {name} CPU s / 1k requests: {_cpu_per_1k(overhead.get(name, {}))}")
    return lines


def format_table(report: dict[str, Any]) -> str:
    """The final table: raw model, each configuration at its goodput, overload, overhead,
    then ratios against goals."""
    lines = _raw_lines(report)
    slo = report.get("model", {}).get("slo_p99_ms")
    lines.append(f"\nopen loop, SLO p99 {slo} ms, goodput = highest rate with >=99% OK within SLO")
    header = f"{'configuration':<18} {'goodput/s':>9} {'p50':>5} {'p90':>5} {'p99':>5} "
    header += f"{'batch':>5} {'late%':>5}  {'not OK (all windows)':<28} CPU s / 1k requests"
    lines.append(header)
    lines += _config_lines(report)
    lines += _overhead_lines(report)
    outside = max_outside_share(report)
    if outside > 0.05:
        lines.append(
            f"\nWARNING: processes outside the benchmark took up to {outside:.0%} of the CPU "
            "during a measurement; the figures understate this machine."
        )
    lines.append("\nratio                          value   goal")
    for key, goal in report.get("goals", {}).items():
        met = {True: "met", False: "NOT met", None: "not measured"}[goal["met"]]
        lines.append(f"{key:<30} {_num(goal['value']):>6}   {goal['target']:<7} {met}")
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: Path) -> str | None:
    """Latency p50/p99 vs offered rate per configuration. Returns why it was skipped, if it
    was (matplotlib is an optional extra: `pip install -e '.[bench]'`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display; must precede pyplot
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install -e '.[bench]')"
    figure, axes = plt.subplots(figsize=(8, 5))
    colors = {
        "batching_off": "tab:blue",
        "batching_on": "tab:green",
        "batching_on_mixed": "tab:purple",
        "peer": "tab:orange",
    }
    for name in CONFIG_ORDER:
        rates = sorted(report.get("configs", {}).get(name, {}).get("rates", []),
                       key=lambda r: r["offered_rate_per_s"])  # fmt: skip
        if not rates:
            continue
        x = [r["offered_rate_per_s"] for r in rates]
        for q, style in (("p50_s", "--"), ("p99_s", "-")):
            y = [(r[q]["median"] or float("nan")) * 1000 for r in rates]
            axes.plot(x, y, style, marker="o", color=colors[name], label=f"{name} {q[:3]}")
    for is_throttled, marker, color in ((False, "x", "tab:red"), (True, "+", "tab:purple")):
        floods = [p for p in report.get("overload", []) if bool(p.get("throttled")) == is_throttled]
        if floods:
            label = "batching_on overload p99" + (", throttling callers" if is_throttled else "")
            axes.scatter([p["offered_rate_per_s"] for p in floods],
                         [(p["p99_s"]["median"] or float("nan")) * 1000 for p in floods],
                         marker=marker, color=color, label=label)  # fmt: skip
    slo_ms = report.get("model", {}).get("slo_p99_ms")
    if slo_ms:
        axes.axhline(slo_ms, color="gray", linestyle=":", label=f"SLO {slo_ms} ms")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("offered rate (requests/s, Poisson)")
    axes.set_ylabel("latency of accepted requests (ms)")
    axes.set_title("minilm: latency vs offered load (median of windows)")
    axes.legend(fontsize=8)
    axes.grid(True, which="both", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return None
