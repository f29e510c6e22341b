"""The stop-signal count of a serving process: once shuts down, twice is ignored,
three times forces an exit that still removes the files."""

from __future__ import annotations

import pytest

from coordinator.server import signals
from coordinator.server.signals import EXIT_FORCED, ProcessSignals


class FakeServer:
    def __init__(self) -> None:
        self.removed = 0
        self.dumped = 0

    def dump_recorder(self) -> None:
        self.dumped += 1

    def remove_files(self) -> None:
        self.removed += 1

    def reload_curve_clients(self) -> str:
        raise ValueError("client key directory /x does not exist")


class Exited(Exception):
    pass


def test_the_third_stop_signal_removes_the_files_and_exits(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise Exited

    monkeypatch.setattr(signals.os, "_exit", fake_exit)
    server = FakeServer()
    process = ProcessSignals(server)
    process.on_stop("SIGTERM")
    assert process.stop.is_set() and server.removed == 0
    process.on_stop("SIGTERM")
    assert codes == [] and "ignored" in caplog.text
    with pytest.raises(Exited):
        process.on_stop("SIGINT")
    assert codes == [EXIT_FORCED] and server.removed == 1


def test_a_failed_sighup_reload_is_logged_and_keeps_serving(
        caplog: pytest.LogCaptureFixture) -> None:
    process = ProcessSignals(FakeServer())
    process.on_hup()
    assert "reload failed" in caplog.text and not process.stop.is_set()
