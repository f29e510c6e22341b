"""The version of this project's own additions to the wire.

vLLM's sockets carry no version. This project's engine SDK adds
`protocol_version` to HELLO and its frontend protocol carries one in
`Register`; both send this number, so a coordinator can tell which of the
project's extensions a peer speaks. Raise it when an extension changes
incompatibly, never for vLLM's own bytes.
"""

from __future__ import annotations

from typing import Final

PROTOCOL_VERSION: Final = 1
