"""Signals through the whole life of a serving process, cleanup included.

The first SIGTERM/SIGINT asks for a clean shutdown; a second one while shutting
down (GNU ``timeout`` signals the child and then its group, an impatient double
Ctrl-C) is logged and ignored; a third forces a fast exit that still removes the
address file and the ipc sockets. SIGHUP never stops the process: it re-reads
the CURVE client keys when there are any. SIGUSR1 dumps the flight recorder.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from types import FrameType
from typing import Protocol

log = logging.getLogger("coordinator.server")

STOP = (signal.SIGTERM, signal.SIGINT)
HANDLED = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1}

EXIT_FORCED = 1
"""Exit code of a shutdown cut short by a third stop signal."""


class Served(Protocol):
    def dump_recorder(self) -> None: ...

    def remove_files(self) -> None: ...

    def reload_curve_clients(self) -> str: ...


class ProcessSignals:
    """Counts stop signals; the loop's handlers while serving, plain ones during cleanup."""

    def __init__(self, server: Served) -> None:
        self.server = server
        self.stop = asyncio.Event()
        self.stops = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def on_stop(self, signame: str) -> None:
        self.stops += 1
        if self.stops == 1:
            log.info("%s received; shutting down", signame)
            self.stop.set()
        elif self.stops == 2:
            log.warning("%s received while shutting down; ignored (a third one forces a "
                        "fast exit)", signame)
        else:
            log.warning("%s received a third time; exiting at once, without a clean "
                        "close", signame)
            self.server.remove_files()
            os._exit(EXIT_FORCED)

    def on_hup(self) -> None:
        try:
            what = self.server.reload_curve_clients()
        except Exception as exc:  # a bad key file must not stop a serving process
            log.error("SIGHUP received; reload failed, keeping the old settings: %s", exc)
            return
        log.info("SIGHUP received; %s", what)

    def install_on_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        for signum in STOP:
            loop.add_signal_handler(signum, self.on_stop, signum.name)
        loop.add_signal_handler(signal.SIGHUP, self.on_hup)
        loop.add_signal_handler(signal.SIGUSR1, self.server.dump_recorder)

    def hand_over_from_loop(self) -> None:
        """Swap the loop's handlers for plain ones that outlive the loop.

        Signals are blocked meanwhile, so none falls to the default action (death)."""
        loop = self._loop
        if loop is None:
            return
        signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
        try:
            for signum in HANDLED:
                loop.remove_signal_handler(signum)
            for signum in STOP:
                signal.signal(signum, self._plain_stop)
            signal.signal(signal.SIGHUP, self._plain_ignored)
            signal.signal(signal.SIGUSR1, self._plain_ignored)
        finally:
            self._loop = None
            signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)

    def _plain_stop(self, signum: int, frame: FrameType | None) -> None:
        self.on_stop(signal.Signals(signum).name)

    def _plain_ignored(self, signum: int, frame: FrameType | None) -> None:
        log.info("%s received while shutting down; ignored", signal.Signals(signum).name)
