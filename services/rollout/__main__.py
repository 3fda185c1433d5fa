"""`python -m services.rollout`: runtime labels and traffic weights, and canary rollouts.

    python -m services.rollout routing show
    python -m services.rollout routing set minilm --label canary=2 --traffic stable=90 \
        --traffic canary=10
    python -m services.rollout routing reset minilm
    python -m services.rollout canary minilm --version 2 --metrics-url http://w1:8202/metrics \
        [--steps 1,5,25,50,100] [--hold-s 60] [--dry-run]
    python -m services.rollout canary minilm --version 2 --namespace fabric \
        --canary-deployment gpu-worker-minilm-canary --canary-replicas 2 \
        --stable-deployment gpu-worker-minilm [--scale-down-on-rollback] [--dry-run]

`canary` steps the canary's traffic share, judges each step from the workers' metrics
(services.rollout.policy) and promotes or rolls back by itself; it exits 0 on promotion, 1 on
rollback, 2 when it could not run (bad arguments, no stable label, a canary version already
stable, Redis unreachable, the cluster refused or the canary pool never became ready; nothing
was changed), and 3 when it was aborted while stepping
(an error, such as a worker's metrics endpoint gone, or SIGTERM / SIGINT / SIGHUP): the canary's
share was then set back to 0 and its pool released, as for a rollback, unless that failed too
(logged). With `--canary-deployment` it first scales that Deployment and waits for its pods to
be Ready (services.rollout.cluster: the in-cluster service account, else the kubeconfig, else
`--kube-api-url`), and scrapes the ready pods of both pools, so `--metrics-url` is then
optional.

Connects as Redis user `admin` (`--redis-password-file`, or credentials in the URL). Every
gateway applies a change within about half a second (services.gateway.routing_sync).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from redis.exceptions import RedisError

from services.common.model_repository import ModelConfigError, ModelVersion, load_repository
from services.common.model_routing import ModelRouting
from services.common.redis_acl import ADMIN, role_credentials
from services.common.registry_schema import connect
from services.rollout.controller import (
    CanaryRollout,
    RolloutAborted,
    RolloutMetrics,
    describe_plan,
)
from services.rollout.health import scrape
from services.rollout.policy import Decision, Plan
from services.rollout.pool import ClusterError, PoolConfig
from services.rollout.routing_store import Change, RoutingStore

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from services.rollout.cluster import CanaryPool

#: `canary`'s exit status when aborted while stepping (the canary's share set back to 0).
ABORTED = 3


def _pairs(values: list[str]) -> dict[str, str]:
    pairs = {}
    for value in values:
        name, sep, number = value.partition("=")
        if not sep:
            raise ValueError(f"{value!r}: expected LABEL=NUMBER")
        pairs[name.strip()] = number.strip()
    return pairs


#: (flag, environment variable, default, help) of the connection settings.
_SETTINGS = (
    ("--redis-url", "ROLLOUT_REDIS_URL", "redis://127.0.0.1:6379/0", "registry Redis"),
    ("--redis-password-file", "ROLLOUT_REDIS_PASSWORD_FILE", None, "password of user admin"),
    ("--registry-prefix", "ROLLOUT_REGISTRY_PREFIX", "fabric", "Redis key prefix"),
    ("--model-repository", "ROLLOUT_MODEL_REPOSITORY", "models", "seeds and checks versions"),
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m services.rollout",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag, variable, default, doc in _SETTINGS:
        value = os.environ.get(variable, default)
        parser.add_argument(flag, default=value, help=f"{doc} (env {variable}; default {value})")
    commands = parser.add_subparsers(dest="command", required=True)
    routing = commands.add_parser("routing", help="version labels and traffic weights")
    actions = routing.add_subparsers(dest="action", required=True)
    actions.add_parser("show", help="every model's routing in force")
    set_parser = actions.add_parser("set", help="change labels and weights of a model")
    set_parser.add_argument("model")
    set_parser.add_argument("--label", action="append", default=[], help="LABEL=VERSION")
    set_parser.add_argument("--remove-label", action="append", default=[], help="LABEL")
    set_parser.add_argument(
        "--traffic", action="append", default=[], help="LABEL=WEIGHT (replaces all weights)"
    )
    reset_parser = actions.add_parser("reset", help="back to the repository's routing")
    reset_parser.add_argument("model")
    add_canary_parser(commands)
    return parser.parse_args(argv)


#: The canary plan's flags: Plan's field, its type, what it sets (policy.Plan says more).
_PLAN_FLAGS = (
    ("hold_s", float, "how long each step runs before it is judged, seconds"),
    ("max_error_rate_increase", float,
     "how far the canary's error rate may exceed stable's, a fraction: 0.01 is 1 point"),
    ("max_refusal_rate_increase", float,
     "how far the canary's refusal rate (calls answered unserved) may exceed stable's, a "
     "fraction"),
    ("max_p99_ratio", float, "canary p99 over stable's past which it is slower (and the slack)"),
    ("p99_slack_s", float, "how far past stable's p99 the canary's must also be, seconds"),
    ("min_requests", int, "calls the canary must serve in a step before it is judged"),
    ("max_holds", int, "extra holds a step may take for lack of traffic, then a rollback"),
)  # fmt: skip


def add_canary_parser(commands: Any) -> None:
    canary = commands.add_parser("canary", help="step a canary version's traffic, judge, decide")
    canary.add_argument("model")
    canary.add_argument("--version", type=int, required=True, help="the canary's version")
    canary.add_argument("--metrics-url", action="append", default=[], help="a worker's /metrics")
    defaults = Plan()
    canary.add_argument("--steps", default=",".join(f"{s:g}" for s in defaults.steps))
    for name, kind, doc in _PLAN_FLAGS:
        default = getattr(defaults, name)
        canary.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=default, help=f"{doc} ({default:g})"
        )
    canary.add_argument("--check-period-s", type=float, default=5.0)
    canary.add_argument("--metrics-port", type=int, default=-1, help="serve /metrics (-1: off)")
    canary.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    pools = canary.add_argument_group("Kubernetes worker pools (the `rollout` extra)")
    pools.add_argument("--namespace", default="default", help="the pools' namespace")
    pools.add_argument("--canary-deployment", help="Deployment of the canary's workers")
    pools.add_argument("--stable-deployment", help="Deployment of stable's workers (scraped)")
    pools.add_argument(
        "--canary-replicas", type=int, help="scale the canary pool to this first (default: keep)"
    )
    pools.add_argument("--ready-timeout-s", type=float, default=600.0)
    pools.add_argument("--pool-poll-s", type=float, default=2.0, help="pod listing period")
    pools.add_argument(
        "--scale-down-on-rollback", action="store_true", help="scale the canary pool to 0 then"
    )
    pools.add_argument(
        "--kube-api-url", help="API server as is, no credentials (kubectl proxy; tests)"
    )


def plan_from(args: argparse.Namespace) -> Plan:
    return Plan(
        steps=tuple(float(s) for s in args.steps.split(",")),
        hold_s=args.hold_s,
        max_error_rate_increase=args.max_error_rate_increase,
        max_refusal_rate_increase=args.max_refusal_rate_increase,
        max_p99_ratio=args.max_p99_ratio,
        p99_slack_s=args.p99_slack_s,
        min_requests=args.min_requests,
        max_holds=args.max_holds,
    )


def pool_config_from(args: argparse.Namespace) -> PoolConfig | None:
    """The canary pool's settings, None without `--canary-deployment`."""
    if args.canary_deployment is None:
        pool_only = {
            "--stable-deployment": args.stable_deployment is not None,
            "--canary-replicas": args.canary_replicas is not None,
            "--scale-down-on-rollback": args.scale_down_on_rollback,
        }
        if given := [flag for flag, is_given in pool_only.items() if is_given]:
            raise ValueError(f"{', '.join(given)}: needs --canary-deployment")
        return None
    return PoolConfig(
        namespace=args.namespace,
        canary_deployment=args.canary_deployment,
        stable_deployment=args.stable_deployment,
        num_canary_replicas=args.canary_replicas,
        ready_timeout_s=args.ready_timeout_s,
        poll_period_s=args.pool_poll_s,
        is_scaled_down_on_rollback=args.scale_down_on_rollback,
    )


async def run_canary(args: argparse.Namespace, store: RoutingStore) -> int:
    plan = plan_from(args)
    pool_config = pool_config_from(args)
    registry = CollectorRegistry()
    metrics = RolloutMetrics(registry)
    if pool_config is None:
        return await _run_canary(args, store, plan, metrics, pool=None)
    # Imported here: only a rollout with a Kubernetes pool needs the `rollout` extra.
    from services.rollout.cluster import CanaryPool, Deployments, api_client

    with api_client(args.kube_api_url) as api:
        pool = CanaryPool(Deployments(api, pool_config.namespace), pool_config, metrics)
        return await _run_canary(args, store, plan, metrics, pool=pool)


async def _run_canary(
    args: argparse.Namespace,
    store: RoutingStore,
    plan: Plan,
    metrics: RolloutMetrics,
    *,
    pool: CanaryPool | None,
) -> int:
    if args.dry_run:
        routing = await store.routing(args.model)
        print(describe_plan(plan, args.model, args.version, routing))
        if pool is not None:
            print(await pool.describe())
        return 0
    if not args.metrics_url and pool is None:
        raise ValueError("--metrics-url or --canary-deployment: no worker metrics to judge from")
    if args.metrics_port >= 0:
        start_http_server(args.metrics_port, registry=metrics.registry)
    rollout = CanaryRollout(
        store,
        args.model,
        args.version,
        plan,
        scrape=lambda urls: scrape(urls, args.model),
        metrics=metrics,
        metrics_urls=tuple(args.metrics_url),
        pool=pool,
        check_period_s=args.check_period_s,
    )
    try:
        with aborted_by_signals():
            decision = await rollout.run()
    except RolloutAborted as error:
        print(error, file=sys.stderr)
        return ABORTED
    except asyncio.CancelledError:
        print(f"{args.model}: rollout stopped by a signal", file=sys.stderr)
        return ABORTED
    print(f"{args.model}: {decision.value}")
    return 0 if decision is Decision.PROMOTE else 1


#: A deleted Job's SIGTERM, ^C, and SIGHUP (the terminal it runs in closed: an SSH session
#: lost, which killed it before, the canary left at its share; review finding).
ABORT_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


@contextlib.contextmanager
def aborted_by_signals() -> Iterator[None]:
    """While in it, ABORT_SIGNALS cancel the running task once (`cancel_once`): the rollout
    aborts. Not after it: a signal once it has decided must not cancel what follows (its
    exit). Only the main thread may take signals: `main` run on another takes none."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    task, loop = asyncio.current_task(), asyncio.get_running_loop()
    assert task is not None
    handle = cancel_once(task)
    for signum in ABORT_SIGNALS:
        loop.add_signal_handler(signum, handle, signum.name)
    try:
        yield
    finally:
        for signum in ABORT_SIGNALS:
            loop.remove_signal_handler(signum)


def cancel_once(task: asyncio.Task[Any]) -> Callable[[str], None]:
    """The rollout's signal handler: the first signal cancels `task` (the rollout aborts, the
    canary's share set back to 0 and its pool released, for up to 120 s through a Redis
    outage); later ones are logged only. A second signal (or ^C: asyncio.run's own handler)
    cancelled that abort half done, the canary left at its share, judged by nobody (review
    finding)."""
    signalled: list[str] = []

    def handle(name: str) -> None:
        if signalled:
            log.warning("%s: the rollout is aborting (sending its canary's traffic back)", name)
            return
        signalled.append(name)
        task.cancel(name)

    return handle


def changer(args: argparse.Namespace) -> Change:
    """The change `routing set` asks for: labels added or moved, labels removed (and their
    weights), and, with --traffic, the whole set of weights replaced."""
    labels = {label: int(v) for label, v in _pairs(args.label).items()}
    traffic = {label: float(v) for label, v in _pairs(args.traffic).items()}

    def change(current: ModelRouting) -> ModelRouting:
        new_labels = {**current.labels, **labels}
        for label in args.remove_label:
            new_labels.pop(label, None)
        new_traffic = traffic or {k: w for k, w in current.traffic.items() if k in new_labels}
        return ModelRouting(new_labels, new_traffic, current.revision)

    return change


def read_repository(args: argparse.Namespace) -> list[ModelVersion]:
    """The repository's models that read. One that does not (a typo, its files still being
    copied) fails only a command naming it: before, every command failed, and an unrelated
    model being copied blocked moving traffic off a bad canary (review finding)."""
    unread: dict[str, ModelConfigError] = {}
    versions = load_repository(Path(args.model_repository), on_error=unread.__setitem__)
    if getattr(args, "model", None) in unread:
        raise unread[args.model]
    for name, error in sorted(unread.items()):
        log.warning("model %s left out (it does not read): %s", name, error)
    return versions


async def run(args: argparse.Namespace) -> int:
    password_file = Path(args.redis_password_file) if args.redis_password_file else None
    credentials = role_credentials(ADMIN, args.redis_url, password_file)
    client = connect(args.redis_url, timeout_s=5.0, credentials=credentials)
    store = RoutingStore(client, args.registry_prefix, read_repository(args))
    try:
        if args.command == "canary":
            return await run_canary(args, store)
        if args.action == "show":
            for model, routing in sorted((await store.show()).items()):
                print(f"{model}: {routing.dumps()}")
        elif args.action == "set":
            print(f"{args.model}: {(await store.change(args.model, changer(args))).dumps()}")
        else:
            changed = await store.reset(args.model)
            print(f"{args.model}: {'reset' if changed else 'already as the repository'}")
    finally:
        await client.aclose()
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return asyncio.run(run(args))
    except (ValueError, ClusterError, RedisError, OSError) as error:
        # Redis unreachable before stepping, a metrics port taken, a password file missing:
        # it could not run (1 says the canary was rolled back; review finding).
        print(f"error: {error!r}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
