"""Non-blocking multipart sends at the cost of libzmq's own calls.

pyzmq's ``send_multipart`` checks every part's type, goes through a Python
wrapper per frame and combines its flag enums on every call: about 12 µs for
three frames, against 3 µs for the three underlying sends with plain int
flags (measured on this project's machine; see bench/README.md). Every send
of the coordinator is NOBLOCK and passes bytes (or a ``zmq.Frame``), so the
checks buy nothing here.

A multipart message leaves whole or not at all: libzmq decides whether it can
queue a message (high-water mark, ``ROUTER_MANDATORY``) on its first frame, so
an error can only come from the first send of a message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import zmq
from zmq.backend import Socket as BackendSocket

# Plain ints: pyzmq converts its flag enums on every call otherwise.
NOBLOCK = int(zmq.NOBLOCK)
NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
EVENTS = int(zmq.EVENTS)
POLLIN = int(zmq.POLLIN)

_send = BackendSocket.send


def send_frames(sock: zmq.Socket[bytes], frames: Sequence[bytes]) -> None:
    """Send ``frames`` as one message, NOBLOCK; raises ``zmq.Again`` or ``zmq.ZMQError``."""
    last = len(frames) - 1
    for index in range(last):
        _send(sock, frames[index], NOBLOCK_MORE)
    _send(sock, frames[last], NOBLOCK)


def send_routed(sock: zmq.Socket[bytes], identity: bytes, frames: Sequence[bytes]) -> None:
    """Send ``[identity, *frames]`` on a ROUTER as one message, NOBLOCK."""
    if not frames:
        _send(sock, identity, NOBLOCK)
        return
    _send(sock, identity, NOBLOCK_MORE)
    last = len(frames) - 1
    for index in range(last):
        _send(sock, frames[index], NOBLOCK_MORE)
    _send(sock, frames[last], NOBLOCK)


def send_add(sock: zmq.Socket[bytes], identity: bytes, kind: bytes,
             payload: Sequence[bytes]) -> None:
    """Send ``[identity, kind, *payload]`` on a ROUTER as one message, NOBLOCK."""
    _send(sock, identity, NOBLOCK_MORE)
    if not payload:
        _send(sock, kind, NOBLOCK)
        return
    _send(sock, kind, NOBLOCK_MORE)
    last = len(payload) - 1
    for index in range(last):
        _send(sock, payload[index], NOBLOCK_MORE)
    _send(sock, payload[last], NOBLOCK)


def poke_if_readable(sock: zmq.Socket[bytes], poke: Callable[[], None]) -> None:
    """After a send on ``sock``: ``poke`` its reader if a message is waiting.

    A send lets libzmq process the socket's pending commands, among them "a
    message arrived", and clear the FD the reader waits on, so a reader asleep
    on it would never wake for that message. Asking libzmq whether one is
    waiting costs less than waking the reader for nothing, which every ADD on
    ``dispatch`` and every wake on ``back_publish`` would otherwise do. If none
    is waiting, every pipe is empty, and the next message signals the FD again.
    """
    if int(sock.get(EVENTS)) & POLLIN:
        poke()
