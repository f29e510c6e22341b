"""The actions of the event being handled, in the order they must be carried out.

Every handler of the core is given the ``Outbox`` of the event it handles and
appends to it; nothing else holds actions. Two things are owed once per
event rather than once per change, so handlers only raise a flag: the state
file is rewritten (``state_changed``, when the core persists) and the
operators' snapshot refreshed (``refresh``). ``CoordinatorCore`` turns the
flags into ``SaveState`` / ``RefreshObserved`` when it hands the actions out.

A handler that must hold some actions back (a wave's first request's wake
rides on its ``DispatchAdd`` until the ADD is sent) gives the machine a fresh
outbox of its own and ``merge_flags`` it afterwards, so no handler ever
slices actions back out of another's.
"""

from __future__ import annotations

from collections.abc import Sequence
from logging import WARNING
from typing import Any

from coordinator.core.actions import Action, Log, Send, SendPurpose, SocketName
from coordinator.protocol import frontend as fp


class Outbox:
    """One event's actions, and whether a save or a refresh is owed at its end."""

    __slots__ = ("actions", "refresh_due", "save_due")

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.save_due = False
        self.refresh_due = False

    def add(self, action: Action) -> None:
        self.actions.append(action)

    def extend(self, actions: Sequence[Action]) -> None:
        self.actions.extend(actions)

    def send(self, socket: SocketName, identity: bytes, frames: Sequence[bytes],
             purpose: SendPurpose = SendPurpose.REPLY, *, confirm: bool = False,
             conn: int = 0) -> None:
        self.actions.append(Send(socket, identity, frames, purpose, confirm, conn))

    def answer(self, socket: SocketName, identity: bytes, message: fp.FrontendReply,
               purpose: SendPurpose = SendPurpose.REPLY) -> None:
        """One frontend-protocol message to ``identity`` on ``socket``."""
        self.actions.append(Send(socket, identity, (fp.encode(message),), purpose))

    def reply(self, identity: bytes, message: fp.FrontendReply,
              purpose: SendPurpose = SendPurpose.REPLY) -> None:
        """One frontend-protocol message to a frontend connection."""
        self.actions.append(Send("frontend", identity, (fp.encode(message),), purpose))

    def notify(self, identities: Sequence[bytes], message: fp.FrontendReply) -> None:
        """One notice, encoded once, to each of ``identities``."""
        notice = (fp.encode(message),)
        for identity in identities:
            self.actions.append(Send("frontend", identity, notice, SendPurpose.NOTICE))

    def log(self, level: int, message: str, *args: Any, key: str | None = None,
            event: str | None = None, **fields: object) -> None:
        """A log line; with ``event``, a structured event with ``fields`` as well."""
        self.actions.append(Log(level, message, args, key, event, fields or None))

    def send_failed(self, socket: SocketName, identity: bytes) -> None:
        # Keyed by socket only: peers choose their identities, and a key per identity
        # would give every new one a line of its own.
        self.log(WARNING, "could not send on %s to %s (peer gone or queue full)", socket,
                 identity.hex(), key=f"send:{socket}")

    def state_changed(self) -> None:
        """Registrations, frontends, the gate or the wave changed: a restart needs this."""
        self.save_due = True

    def refresh(self) -> None:
        """The operators' snapshot is out of date."""
        self.refresh_due = True

    def merge_flags(self, other: Outbox) -> None:
        self.save_due = self.save_due or other.save_due
        self.refresh_due = self.refresh_due or other.refresh_due
