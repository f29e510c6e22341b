"""Where `serve` takes its settings from: flags, environment variables, a TOML file.

Precedence, highest first: command-line flags, `DP_COORDINATOR_<NAME>` environment
variables (only the few in `ENV_SETTINGS`, which containers commonly pass that
way), the `--config` file, the defaults. The file's keys are the flags' names,
with dashes or underscores (`ipc-dir` or `ipc_dir`), or the name of the setting a
flag stores (`watchdog_rewake = false` is `no-watchdog-rewake = true`). Every
flag can be set there except `--config` and `--check` themselves.

The file and the environment become the serve parser's defaults, and the command
line is parsed again over them: a flag given on the command line always wins,
even when it repeats a default. `--bind` is the one flag that adds up: the
command line's endpoints are added to the file's, and win for the same socket.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

CONFIG_ENV: Final = "DP_COORDINATOR_CONFIG"
ENV_PREFIX: Final = "DP_COORDINATOR_"

ENV_SETTINGS: Final = (
    "engines", "host", "port_base", "ipc_dir", "state_file", "addr_file", "metrics_host",
    "metrics_port", "log_level", "log_format",
)
"""Settings read from `DP_COORDINATOR_<SETTING in upper case>` (and the config path
from `DP_COORDINATOR_CONFIG`)."""

# Flags that say how to read the settings, not settings themselves.
_NOT_SETTINGS: Final = frozenset({"help", "config", "check"})


class SettingsError(Exception):
    """The config file or an environment variable cannot be used; one line per problem."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


@dataclass(frozen=True)
class _Setting:
    action: argparse.Action
    flag: str

    @property
    def dest(self) -> str:
        return self.action.dest

    def convert(self, value: object, key: str, *, from_text: bool) -> object:
        """The parser default ``value`` stands for; ValueError naming ``key`` if it cannot."""
        action = self.action
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            flag_value = _boolean(value, key, from_text=from_text)
            # The flag's own name means "the flag is given"; the stored name is the value.
            if key_names(self.flag) & {key} and isinstance(action, argparse._StoreFalseAction):
                return not flag_value
            return flag_value
        if isinstance(action, argparse._AppendAction):
            return _string_list(value, key)
        kind = action.type
        if from_text:
            if not isinstance(value, str):
                raise ValueError(f"{key}: text expected, got {type(value).__name__}")
            try:
                converted: object = kind(value) if callable(kind) else value
            except (TypeError, ValueError):
                raise ValueError(f"{key}: {value!r} is not {_kind_name(kind)}") from None
        else:
            converted = _typed(value, kind, key)
        if action.choices is not None and converted not in action.choices:
            choices = ", ".join(str(c) for c in action.choices)
            raise ValueError(f"{key}: {converted!r} is not one of {choices}")
        return converted


def _kind_name(kind: object) -> str:
    if kind is int:
        return "an integer"
    return "a number" if kind is float else "a string"


def _typed(value: object, kind: object, key: str) -> object:
    # bool is an int to Python, never to an operator.
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(value, str):
        if not callable(kind):
            return value
        try:
            return kind(value)  # a flag's own parser, as on the command line
        except (TypeError, ValueError):
            pass
    raise ValueError(f"{key}: {value!r} is not {_kind_name(kind)}")


def _boolean(value: object, key: str, *, from_text: bool) -> bool:
    if isinstance(value, bool):
        return value
    if from_text and isinstance(value, str):
        word = value.strip().lower()
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off", ""):
            return False
    raise ValueError(f"{key}: {value!r} is not true or false")


def _string_list(value: object, key: str) -> list[str]:
    if isinstance(value, Mapping):
        # `[bind]` as a table: socket = "endpoint".
        items = list(value.items())
        if all(isinstance(k, str) and isinstance(v, str) for k, v in items):
            return [f"{k}={v}" for k, v in items]
    elif isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(value)
    raise ValueError(f"{key}: want a list of strings or a table of strings, got {value!r}")


def key_names(name: str) -> frozenset[str]:
    """A flag or setting name with dashes and with underscores, without leading dashes."""
    bare = name.lstrip("-")
    return frozenset({bare.replace("_", "-"), bare.replace("-", "_")})


def serve_settings(serve: argparse.ArgumentParser) -> dict[str, _Setting]:
    """Every accepted key of the config file -> the setting it sets."""
    out: dict[str, _Setting] = {}
    for action in serve._actions:
        longs = [opt for opt in action.option_strings if opt.startswith("--")]
        if not longs or action.dest in _NOT_SETTINGS:
            continue
        setting = _Setting(action, longs[0])
        for name in (*longs, action.dest):
            for key in key_names(name):
                out[key] = setting
    return out


def load_config_file(path: str, serve: argparse.ArgumentParser) -> dict[str, object]:
    """The parser defaults the TOML file at ``path`` sets; SettingsError listing every
    unknown key and every value of the wrong type."""
    values, problems = read_config_file(path, serve)
    if problems:
        raise SettingsError(problems)
    return values


def read_config_file(
    path: str, serve: argparse.ArgumentParser
) -> tuple[dict[str, object], list[str]]:
    """The parser defaults the TOML file at ``path`` sets, from the keys that can be
    used, and a line for each key that cannot."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        return {}, [f"config {path}: cannot read it: {exc.strerror or exc}"]
    except tomllib.TOMLDecodeError as exc:
        return {}, [f"config {path}: not valid TOML: {exc}"]
    known = serve_settings(serve)
    values: dict[str, object] = {}
    problems: list[str] = []
    for key, value in data.items():
        setting = known.get(key)
        if setting is None:
            problems.append(f"config {path}: unknown key {key!r} (the keys are the serve "
                            "flags' names, e.g. ipc-dir or ipc_dir)")
            continue
        if setting.dest in values:
            problems.append(f"config {path}: {key!r} sets {setting.dest} a second time")
            continue
        try:
            values[setting.dest] = setting.convert(value, key, from_text=False)
        except ValueError as exc:
            problems.append(f"config {path}: {exc}")
    return values, problems


def environment_settings(
    serve: argparse.ArgumentParser, environ: Mapping[str, str]
) -> dict[str, object]:
    """The parser defaults the `DP_COORDINATOR_*` variables of `ENV_SETTINGS` set."""
    known = serve_settings(serve)
    values: dict[str, object] = {}
    problems: list[str] = []
    for dest in ENV_SETTINGS:
        name = ENV_PREFIX + dest.upper()
        text = environ.get(name)
        if text is None or dest not in known:
            continue
        try:
            values[dest] = known[dest].convert(text, name, from_text=True)
        except ValueError as exc:
            problems.append(f"environment: {exc}")
    if problems:
        raise SettingsError(problems)
    return values


def serve_subparser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            serve = action.choices.get("serve")
            if isinstance(serve, argparse.ArgumentParser):
                return serve
    raise LookupError("the parser has no serve command")


def layer_serve_settings(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
) -> tuple[argparse.Namespace, list[str]]:
    """``args`` with the environment and the config file under the command line, and
    the problems found in them (empty when none). With problems, the settings that
    could be read are still applied, so `serve --check` can look at the rest."""
    env = os.environ if environ is None else environ
    serve = serve_subparser(parser)
    layered: dict[str, object] = {}
    problems: list[str] = []
    config_path = args.config if args.config is not None else env.get(CONFIG_ENV) or None
    if config_path is not None:
        from_file, problems = read_config_file(config_path, serve)
        layered.update(from_file)
    try:
        layered.update(environment_settings(serve, env))
    except SettingsError as exc:
        problems += exc.problems
    if not layered:
        return args, problems
    saved = {action.dest: action.default for action in serve._actions}
    serve.set_defaults(**layered)
    try:
        again = parser.parse_args(argv)
    finally:
        serve.set_defaults(**saved)
    again.config = config_path
    return again, problems

