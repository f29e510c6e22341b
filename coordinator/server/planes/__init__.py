"""Frame -> event, one module per socket.

Each module's ``decode(frames)`` turns one multipart message, as read from its
socket (ROUTER sockets put the peer's identity first), into one core event
(``coordinator.core.events``), using the protocol package's typed decoders.
Anything that does not decode becomes a ``BadFrame`` carrying the
``ProtocolError``; whether it is counted, logged or answered is the core's
business. The sockets whose peers claim ranks (``SOURCED_DECODERS``) also
take the connection the message came on. Decoders never raise and never look
at state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from coordinator.core.events import Event
from coordinator.server.planes import (
    back_output,
    back_publish,
    dispatch,
    front_publish,
    frontend,
    handshake,
)

Decoder = Callable[[list[bytes]], Event]
SourcedDecoder = Callable[[list[bytes], int], Event]

DECODERS: Mapping[str, Decoder] = {
    "handshake": handshake.decode,
    "dispatch": dispatch.decode,
    "back_output": back_output.decode,
    "back_publish": back_publish.decode,
    "front_publish": front_publish.decode,
    "frontend": frontend.decode,
}

SOURCED_DECODERS: Mapping[str, SourcedDecoder] = {
    "handshake": handshake.decode,
    "dispatch": dispatch.decode,
}
