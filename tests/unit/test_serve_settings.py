"""`serve` settings from a TOML file and the environment, under the command line."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from coordinator.cli import build_parser
from coordinator.cli.serve_settings import (
    ENV_SETTINGS,
    SettingsError,
    layer_serve_settings,
    load_config_file,
    serve_subparser,
)


def layered(argv: list[str], environ: dict[str, str] | None = None
            ) -> tuple[argparse.Namespace, list[str]]:
    parser = build_parser()
    args = parser.parse_args(argv)
    return layer_serve_settings(parser, argv, args, environ or {})


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "coordinator.toml"
    path.write_text(text)
    return str(path)


def test_file_keys_are_flag_names_with_dashes_or_underscores(tmp_path: Path) -> None:
    config = write(tmp_path, 'engines = 4\nipc-dir = "/run/x"\nstate_file = "/var/s.json"\n'
                   'heartbeat-s = 2\nno-wave-coordination = true\npolicy = "p2c"\n'
                   'bind = ["frontend=ipc:///tmp/f"]\n')
    args, problems = layered(["serve", "--config", config])
    assert problems == []
    assert (args.engines, args.ipc_dir, args.state_file) == (4, "/run/x", "/var/s.json")
    assert args.heartbeat_s == 2.0 and isinstance(args.heartbeat_s, float)
    assert args.no_wave_coordination is True and args.policy == "p2c"
    assert args.bind == ["frontend=ipc:///tmp/f"]


def test_a_store_false_flag_by_its_flag_name_or_its_setting_name(tmp_path: Path) -> None:
    by_flag, _ = layered(["serve", "--config", write(tmp_path, "no-watchdog-rewake = true\n")])
    by_setting, _ = layered(["serve", "--config", write(tmp_path, "watchdog_rewake = false\n")])
    untouched, _ = layered(["serve", "--engines", "1"])
    assert by_flag.watchdog_rewake is False and by_setting.watchdog_rewake is False
    assert untouched.watchdog_rewake is True


def test_every_serve_flag_can_be_set_in_the_file() -> None:
    serve = serve_subparser(build_parser())
    from coordinator.cli.serve_settings import serve_settings

    keys = serve_settings(serve)
    for action in serve._actions:
        for option in action.option_strings:
            if option.startswith("--") and option not in ("--help", "--config", "--check"):
                assert option[2:] in keys and option[2:].replace("-", "_") in keys, option


def test_the_command_line_wins_over_the_environment_which_wins_over_the_file(
    tmp_path: Path
) -> None:
    config = write(tmp_path, 'engines = 2\nhost = "127.0.0.2"\nlog-level = "debug"\n'
                   'state-file = "/from/file"\nheartbeat-s = 7\n')
    env = {"DP_COORDINATOR_HOST": "127.0.0.3", "DP_COORDINATOR_STATE_FILE": "/from/env",
           "DP_COORDINATOR_PORT_BASE": "7000"}
    # The flag wins even when it repeats the default value.
    args, problems = layered(["serve", "--config", config, "--host", "127.0.0.4",
                              "--log-level", "info"], env)
    assert problems == []
    assert args.host == "127.0.0.4" and args.log_level == "info"
    assert args.state_file == "/from/env" and args.port_base == 7000
    assert args.engines == 2 and args.heartbeat_s == 7.0


def test_the_config_path_from_the_environment(tmp_path: Path) -> None:
    config = write(tmp_path, "engines = 3\n")
    args, problems = layered(["serve"], {"DP_COORDINATOR_CONFIG": config})
    assert problems == [] and args.engines == 3 and args.config == config


def test_command_line_binds_add_to_the_files(tmp_path: Path) -> None:
    config = write(tmp_path, '[bind]\nfrontend = "ipc:///tmp/f"\n')
    args, _ = layered(["serve", "--config", config, "--bind", "handshake=ipc:///tmp/h"])
    assert args.bind == ["frontend=ipc:///tmp/f", "handshake=ipc:///tmp/h"]


@pytest.mark.parametrize(("text", "named"), [
    ("enginez = 2\n", "'enginez'"),
    ('engines = "2"\n', "engines: '2' is not an integer"),
    ("engines = true\n", "engines: True is not an integer"),
    ('heartbeat-s = "fast"\n', "heartbeat-s: 'fast' is not a number"),
    ('policy = "random"\n', "policy: 'random' is not one of least-loaded, p2c, prefix"),
    ('insecure = "yes"\n', "insecure: 'yes' is not true or false"),
    ("bind = [1]\n", "bind: want a list of strings"),
    ("check = true\n", "'check'"),
    ("engines = 2\nengines_ = 3\n", "'engines_'"),
    ("engines = 2\n[x\n", "not valid TOML"),
])
def test_bad_keys_and_values_are_named(tmp_path: Path, text: str, named: str) -> None:
    config = write(tmp_path, text)
    with pytest.raises(SettingsError) as caught:
        load_config_file(config, serve_subparser(build_parser()))
    assert len(caught.value.problems) == 1
    assert named in caught.value.problems[0] and config in caught.value.problems[0]


def test_every_problem_is_listed_and_the_good_keys_still_apply(tmp_path: Path) -> None:
    config = write(tmp_path, 'engines = 2\nbogus = 1\nlease-ttl-s = "x"\nhost = "h"\n')
    args, problems = layered(["serve", "--config", config],
                             {"DP_COORDINATOR_METRICS_PORT": "ninety"})
    assert len(problems) == 3
    assert "'bogus'" in problems[0] and "lease-ttl-s" in problems[1]
    assert problems[2] == "environment: DP_COORDINATOR_METRICS_PORT: 'ninety' is not an integer"
    assert args.engines == 2 and args.host == "h"


def test_a_missing_file_is_one_problem(tmp_path: Path) -> None:
    _, problems = layered(["serve", "--config", str(tmp_path / "none.toml")])
    assert problems == [f"config {tmp_path / 'none.toml'}: cannot read it: "
                        "No such file or directory"]


def test_the_environment_settings_are_serve_flags() -> None:
    serve = serve_subparser(build_parser())
    dests = {action.dest for action in serve._actions}
    assert set(ENV_SETTINGS) <= dests
    assert {"host", "port_base", "state_file", "log_level", "log_format",
            "metrics_port"} <= set(ENV_SETTINGS)


def test_parsing_again_leaves_the_parser_as_it_was(tmp_path: Path) -> None:
    parser = build_parser()
    argv = ["serve", "--config", write(tmp_path, "engines = 5\n")]
    layer_serve_settings(parser, argv, parser.parse_args(argv), {})
    assert parser.parse_args(["serve"]).engines is None


REPO = Path(__file__).resolve().parents[2]


def test_the_documented_config_files_are_accepted(tmp_path: Path) -> None:
    operations = (REPO / "docs" / "OPERATIONS.md").read_text()
    readme = (REPO / "README.md").read_text()
    examples = [operations.split("```toml\n", 1)[1].split("```", 1)[0],
                readme.split("<<'TOML'\n", 1)[1].split("TOML\n", 1)[0]]
    for text in examples:
        args, problems = layered(["serve", "--config", write(tmp_path, text)])
        assert problems == [] and args.engines == 8 and args.log_format == "json"


def test_every_documented_log_event_is_logged_somewhere() -> None:
    import re

    operations = (REPO / "docs" / "OPERATIONS.md").read_text()
    table = operations.split("## Logs", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", table, flags=re.M)) - {"event"}
    assert len(documented) >= 10
    sources = "\n".join(path.read_text() for path in (REPO / "coordinator").rglob("*.py"))
    logged = set(re.findall(r'event="([a-z_]+)"', sources))
    logged |= set(re.findall(r'"event": "([a-z_]+)"', sources))
    assert documented == logged
