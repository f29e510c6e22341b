"""One source of defaults: CoreConfig for the rules, ServerConfig for the process, the CLI
reading both. A default changed in one place is the default everywhere."""

from __future__ import annotations

import dataclasses

from coordinator.cli import build_parser
from coordinator.core.config import CoreConfig
from coordinator.server.config import ServerConfig

# ServerConfig's name for a CoreConfig setting, where they differ.
RENAMED = {"handshake_ttl_s": "handshake_timeout_s"}
# CoreConfig fields the server computes rather than takes as a setting.
DERIVED = {"rank_start", "engines", "row_width", "persist", "admin_keys", "kv", "version",
           "kv_bootstrap"}
# CoreConfig timings with no flag: the process always runs the core's default.
FIXED = {"rewake_after_s", "observe_interval_s", "state_retry_s"}


def serve_defaults() -> dict[str, object]:
    args = build_parser().parse_args(["serve", "--engines", "1"])
    return vars(args)


def test_a_servers_default_settings_are_the_cores_defaults() -> None:
    from coordinator import __version__

    assert ServerConfig(engines=3, rank_start=2).core_config() == CoreConfig(
        rank_start=2, engines=3, version=__version__)


def test_every_rule_setting_of_the_server_defaults_to_the_cores_value() -> None:
    server = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    missing = []
    for field in dataclasses.fields(CoreConfig):
        if field.name in DERIVED | FIXED:
            continue
        name = RENAMED.get(field.name, field.name)
        if name not in server:
            missing.append(name)
            continue
        assert server[name] == field.default, name
    assert missing == [], f"CoreConfig settings ServerConfig cannot set: {missing}"


def test_the_serve_flags_default_to_the_servers_settings() -> None:
    cli = serve_defaults()
    server = ServerConfig(engines=1)
    checked = 0
    for field in dataclasses.fields(ServerConfig):
        if field.name in cli and field.name not in ("engines", "frontend_wake"):
            assert cli[field.name] == getattr(server, field.name), field.name
            checked += 1
    assert checked >= 20, checked
    # The flags whose form differs from the setting.
    assert cli["publish_interval_ms"] == server.publish_interval_s * 1000.0
    assert cli["no_wave_coordination"] is (not server.lockstep)
    assert (cli["frontend_wake"] == "honour") is server.frontend_wake
    assert cli["bind"] == [] and server.bind_overrides == {}
