"""The process's log lines: today's text, or one JSON object per line.

A JSON line holds ``time`` (UTC, ISO 8601 with milliseconds), ``level``,
``logger`` and ``message``, then every field the call site passed with
``extra=`` (an ``event`` name and its facts, e.g. ``rank`` and ``state``), and
``exception`` with the traceback text when there is one. Values JSON cannot
hold are written as their ``str``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Final

LOG_FORMATS: Final = ("text", "json")
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_RECORD_ATTRIBUTES: Final = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


def event_fields(record: logging.LogRecord) -> dict[str, object]:
    """The fields the call site attached to ``record`` with ``extra=``."""
    return {key: value for key, value in vars(record).items()
            if key not in _RECORD_ATTRIBUTES and not key.startswith("_")}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, object] = {
            "time": f"{seconds}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in event_fields(record).items():
            out.setdefault(key, value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class _OurHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler `configure_logging` installs."""


def configure_logging(level: str, log_format: str = "text") -> None:
    """The root logger writes to stderr at ``level``, as text or as JSON lines."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be text or json, got {log_format!r}")
    handler = _OurHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    # Replace only a handler of ours: others (a test's capture) keep theirs.
    for old in [h for h in root.handlers if isinstance(h, _OurHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
