"""The JSON log format: one object per record, with the event's fields."""

from __future__ import annotations

import io
import json
import logging

import pytest

from coordinator.core.actions import Log
from coordinator.core.outbox import Outbox
from coordinator.server.logformat import JsonFormatter, configure_logging, event_fields


def record(message: str, *args: object, extra: dict[str, object] | None = None,
           exc: BaseException | None = None) -> logging.LogRecord:
    logger = logging.getLogger("coordinator.test")
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logger.makeRecord("coordinator.test", logging.WARNING, __file__, 1, message, args,
                             exc_info, extra=extra)


def test_a_record_is_one_line_of_json_with_the_events_fields() -> None:
    line = JsonFormatter().format(record("dp_rank=%d: %s", 3, "dead",
                                         extra={"event": "rank_state", "rank": 3,
                                                "ranks": [1, 2], "where": object()}))
    assert "\n" not in line
    out = json.loads(line)
    assert out["message"] == "dp_rank=3: dead" and out["level"] == "warning"
    assert out["logger"] == "coordinator.test" and out["event"] == "rank_state"
    assert out["rank"] == 3 and out["ranks"] == [1, 2]
    assert out["where"].startswith("<object object")  # what JSON cannot hold, as text
    assert out["time"].endswith("Z") and out["time"][10] == "T"
    assert set(out) == {"time", "level", "logger", "message", "event", "rank", "ranks", "where"}


def test_a_plain_record_has_no_event_fields() -> None:
    assert event_fields(record("plain")) == {}
    assert set(json.loads(JsonFormatter().format(record("plain")))) == {
        "time", "level", "logger", "message"}


def test_an_exception_is_a_field_of_the_same_line() -> None:
    try:
        raise RuntimeError("boom\nsecond line")
    except RuntimeError as exc:
        line = JsonFormatter().format(record("failed", exc=exc))
    assert line.count("\n") == 0
    out = json.loads(line)
    assert "RuntimeError: boom\nsecond line" in out["exception"]


def test_the_core_log_action_carries_its_event() -> None:
    out = Outbox()
    out.log(logging.INFO, "dp_rank=%d ready", 2, key="ready:2", event="rank_state", rank=2,
            new="ready")
    out.log(logging.INFO, "no event")
    with_event, without = out.actions
    assert isinstance(with_event, Log) and isinstance(without, Log)
    assert with_event.extra() == {"event": "rank_state", "rank": 2, "new": "ready"}
    assert without.extra() is None


def test_configure_logging_writes_json_and_refuses_unknown_formats(
    capsys: pytest.CaptureFixture[str]
) -> None:
    root = logging.getLogger()
    before = list(root.handlers), root.level
    try:
        configure_logging("info", "json")
        configure_logging("info", "json")  # replaces its own handler: one line per record
        ours = [h for h in root.handlers if h not in before[0]]
        assert len(ours) == 1
        assert isinstance(ours[0], logging.StreamHandler)
        stream = io.StringIO()
        ours[0].setStream(stream)
        logging.getLogger("coordinator.x").info("hello", extra={"event": "e"})
        assert json.loads(stream.getvalue())["event"] == "e"
        with pytest.raises(ValueError, match="text or json"):
            configure_logging("info", "yaml")
    finally:
        for handler in [h for h in root.handlers if h not in before[0]]:
            root.removeHandler(handler)
        root.setLevel(before[1])
