"""Settings tables: environment fallbacks, flag precedence, errors, --help, and every tier's
table parsing an empty command line into its config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.common.settings import (
    Setting,
    SettingsTable,
    build_parser,
    parse_weights,
    read_config,
)
from services.gateway import config as gateway_config
from services.gpu_worker import config as worker_config
from services.jobs import config as jobs_config
from services.router import config as router_config

pytestmark = pytest.mark.unit

TIER_TABLES = (gateway_config, router_config, worker_config)


@dataclass(frozen=True)
class DemoConfig:
    port: int
    ratio: float
    is_on: bool
    output: Path | None

    def __post_init__(self) -> None:
        if self.ratio < 0:
            raise ValueError("ratio must be >= 0")


DEMO = SettingsTable(
    prog="demo",
    description="A demo tier.",
    env_prefix="DEMO",
    settings=(
        Setting("port", int, 8000, "port to listen on", "port"),
        Setting("ratio", float, 0.5, "a 100% made-up ratio"),
        Setting("is_on", bool, True, "whether it is on", flag="--on"),
        Setting("output", Path, None, "where to write", env="DEMO_OUT"),
    ),
)


def read_demo(argv: list[str], environ: dict[str, str] | None = None) -> DemoConfig:
    return read_config(DEMO, lambda values: DemoConfig(**values), argv, environ or {})


def test_table_defaults_without_flags_or_environment() -> None:
    assert read_demo([]) == DemoConfig(port=8000, ratio=0.5, is_on=True, output=None)


def test_environment_fills_in_for_missing_flags() -> None:
    environ = {"DEMO_PORT": "9000", "DEMO_IS_ON": "off", "DEMO_OUT": "/tmp/x"}
    assert read_demo([], environ) == DemoConfig(
        port=9000, ratio=0.5, is_on=False, output=Path("/tmp/x")
    )


def test_flag_overrides_environment() -> None:
    environ = {"DEMO_PORT": "9000", "DEMO_IS_ON": "0"}
    config = read_demo(["--port", "9100", "--on"], environ)
    assert (config.port, config.is_on) == (9100, True)
    assert read_demo(["--no-on"], {"DEMO_IS_ON": "yes"}).is_on is False


def test_empty_variable_unsets_an_optional_setting() -> None:
    assert read_demo([], {"DEMO_OUT": ""}).output is None


@pytest.mark.parametrize(
    ("environ", "named"),
    [({"DEMO_PORT": "eighty"}, "DEMO_PORT"), ({"DEMO_IS_ON": "maybe"}, "DEMO_IS_ON")],
)
def test_bad_environment_value_exits_2_naming_it(
    environ: dict[str, str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        read_demo([], environ)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_value_the_config_rejects_exits_2_with_its_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        read_demo(["--ratio", "-1"])
    assert exit_info.value.code == 2
    assert "ratio must be >= 0" in capsys.readouterr().err


def test_help_lists_defaults_units_and_environment_names() -> None:
    # The environment changes the value, not what --help says the default is.
    text = " ".join(build_parser(DEMO, {"DEMO_PORT": "9000"}).format_help().split())
    assert "port to listen on (port; env DEMO_PORT; default 8000)" in text
    assert "a 100% made-up ratio (env DEMO_RATIO; default 0.5)" in text
    assert "--on, --no-on whether it is on (env DEMO_IS_ON; default on)" in text
    assert "(env DEMO_OUT; default unset)" in text


def test_weights_parse_and_reject_malformed_items() -> None:
    assert parse_weights("") == {}
    assert parse_weights("search=3, batch=0.5") == {"search": 3.0, "batch": 0.5}
    for text in ("search", "=2", "search=0", "search=x", "search=inf"):
        with pytest.raises(ValueError):
            parse_weights(text)


@pytest.mark.parametrize("module", TIER_TABLES, ids=lambda m: m.SETTINGS.env_prefix)
def test_every_tier_table_parses_an_empty_command_line(module: Any) -> None:
    table: SettingsTable = module.SETTINGS
    # The gateway fails closed: without a keys file it starts only when told to.
    argv = ["--allow-unauthenticated"] if table.env_prefix == "GATEWAY" else []
    config = read_config(table, module.config_from_settings, argv, {})
    assert config.host == "127.0.0.1"
    help_text = build_parser(table, {}).format_help()
    for setting in table.settings:
        assert table.flag(setting) in help_text
        assert table.env_var(setting) in " ".join(help_text.split())


@pytest.mark.parametrize("module", [*TIER_TABLES, jobs_config], ids=lambda m: m.SETTINGS.env_prefix)
@pytest.mark.parametrize("grace", ["inf", "nan", "-1"])
def test_a_drain_grace_that_is_no_duration_exits_2_before_anything_starts(
    module: Any, grace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, it parsed, and the tier failed at SIGTERM instead, with no drain at all."""
    table: SettingsTable = module.SETTINGS
    argv = ["--allow-unauthenticated"] if table.env_prefix == "GATEWAY" else []
    with pytest.raises(SystemExit) as exit_info:
        read_config(table, module.config_from_settings, [*argv, "--drain-grace-s", grace], {})
    assert exit_info.value.code == 2
    assert "--drain-grace-s" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--max-retries", "-1", "max_retries must be >= 0"),
        ("--refresh-period-s", "0", "refresh_period_s must be"),
        # Durations that are not finite and >= 0 are refused as the flag is read.
        ("--refresh-period-s", "nan", "argument --refresh-period-s"),
        ("--default-timeout-s", "-5", "argument --default-timeout-s"),
        ("--stale-after-s", "nan", "argument --stale-after-s"),
    ],
)
def test_a_router_setting_out_of_its_range_exits_2_naming_it(
    flag: str, value: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, -1 retries parsed, and the router then made no attempt at all: every call
    failed UNAVAILABLE with its rows left reserved, until every worker looked busy."""
    with pytest.raises(SystemExit) as exit_info:
        read_config(router_config.SETTINGS, router_config.config_from_settings, [flag, value], {})
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--catalog-refresh-s", "0", "catalog_refresh_s must be > 0"),
        ("--quota-sync-period-s", "0", "period_s and its counts of periods must be > 0"),
        ("--catalog-refresh-s", "inf", "argument --catalog-refresh-s"),
        ("--throttle-accepts-multiplier", "nan", "argument --throttle-accepts-multiplier"),
    ],
)
def test_a_gateway_setting_out_of_its_range_exits_2_naming_it(
    flag: str, value: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: 0 refreshed the catalog back to back and divided quota demand by zero; NaN and
    # inf passed, and stopped the refresh or turned the throttle off without a word.
    with pytest.raises(SystemExit) as exit_info:
        read_config(
            gateway_config.SETTINGS,
            gateway_config.config_from_settings,
            ["--allow-unauthenticated", flag, value],
            {},
        )
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("module", TIER_TABLES, ids=lambda m: m.SETTINGS.env_prefix)
def test_two_listeners_on_one_port_exit_2_naming_both(
    module: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every listener sets SO_REUSEPORT: before, both bound, and the kernel split connections
    between the health-only listener and the real one at random."""
    table: SettingsTable = module.SETTINGS
    argv = ["--allow-unauthenticated"] if table.env_prefix == "GATEWAY" else []
    ports = ["--grpc-port", "18555", "--health-port", "18555"]
    with pytest.raises(SystemExit) as exit_info:
        read_config(table, module.config_from_settings, [*argv, *ports], {})
    assert exit_info.value.code == 2
    assert "grpc_port and health_port are both port 18555" in capsys.readouterr().err


@pytest.mark.parametrize("module", TIER_TABLES, ids=lambda m: m.SETTINGS.env_prefix)
def test_every_tier_follows_the_naming_convention(module: Any) -> None:
    table: SettingsTable = module.SETTINGS
    names = [s.name for s in table.settings]
    assert len(set(names)) == len(names)
    unconventional = {table.env_var(s) for s in table.settings} - {
        f"{table.env_prefix}_{name.upper()}" for name in names
    }
    assert unconventional <= {"WORKER_ID"}, "only WORKER_ID keeps a deployed name"


def test_tier_tables_reach_nested_configs() -> None:
    environ = {
        "GATEWAY_ALLOW_UNAUTHENTICATED": "true",
        "GATEWAY_THROTTLE_MEMORY_S": "0.5",
        "GATEWAY_BUNDLE_MAX_OUT": "2",
        "GATEWAY_BUNDLE_MAX_HOLD_S": "0.005",
        "ROUTER_STALE_AFTER_S": "4",
        "WORKER_HEARTBEAT_PERIOD_S": "0.25",
        "WORKER_TENANT_WEIGHTS": "search=3",
        "WORKER_UPSTREAM_BUDGET_MS": "20",
    }
    gateway = read_config(gateway_config.SETTINGS, gateway_config.config_from_settings, [], environ)
    router = read_config(router_config.SETTINGS, router_config.config_from_settings, [], environ)
    worker = read_config(worker_config.SETTINGS, worker_config.config_from_settings, [], environ)
    assert gateway.throttle.memory_s == 0.5
    assert (gateway.bundle_clock.max_out, gateway.bundle_clock.max_hold_s) == (2, 0.005)
    assert router.routing.stale_after_s == 4.0
    assert worker.heartbeat.period_s == 0.25
    assert worker.batching.tenant_weights == {"search": 3.0}
    assert worker.batching.upstream_budget_s == pytest.approx(0.02)
    assert worker.worker_id, "defaults to hostname-pid"


def test_tier_defaults_match_the_config_dataclasses() -> None:
    """The table's defaults are the dataclasses' defaults: no second source of truth."""
    router = read_config(router_config.SETTINGS, router_config.config_from_settings, [], {})
    assert router == router_config.RouterConfig(redis_url="redis://127.0.0.1:6379/0")
    worker = read_config(worker_config.SETTINGS, worker_config.config_from_settings, [], {})
    expected = worker_config.WorkerConfig(
        model_repository=Path("models"), worker_id=worker.worker_id
    )
    assert worker == expected
    gateway = read_config(
        gateway_config.SETTINGS,
        gateway_config.config_from_settings,
        ["--allow-unauthenticated"],
        {},
    )
    assert gateway == gateway_config.GatewayConfig(
        model_repository=Path("models"), allow_unauthenticated=True
    )
