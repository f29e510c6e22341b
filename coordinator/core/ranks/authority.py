"""Operator authority: who may change membership, and how far a resize may go.

Theory of operation
-------------------
Engines and frontends are trusted for what they are, nothing more. Commands
that change which ranks take work (``cordon``, ``uncordon``, ``drain``) need an
*operator*, and the coordinator knows one by the channel a command came in on,
never by what the message says about itself:

=============================================  =============================  =========
channel                                        credential                     verdict
=============================================  =============================  =========
``admin`` socket (ipc, owner-only file mode)   the OS checked the caller's    OPERATOR
                                               user when it connected
``frontend`` socket, CURVE                     client key in ``admin_keys``   OPERATOR
``frontend`` socket, CURVE                     any other client key           REFUSED
``frontend`` socket, no CURVE (ipc, loopback)  none                           REFUSED
=============================================  =============================  =========

A refused command gets ``not_authorized`` with what to do instead, is counted
(``refused.admin.not_authorized``) and changes nothing. Read-only calls
(``state``) need no authority.

``SCALE_ELASTIC_EP`` arrives on ``front_publish``, where vLLM's own frontends
send it and nobody can be authenticated beyond CURVE's client keys; it changes
the group's size and with it every full publish. It is bounded instead: the new
rank count must lie in ``min_engines ..= max_engines`` (both default to the
count the coordinator started with, so by default the size is fixed).
Anything else is refused, counted (``refused.front_publish.scale_out_of_range``)
and changes nothing.

No IO: the server says which channel and which CURVE key (its ``User-Id``, the
key's Z85 text) each message came with.
"""

from __future__ import annotations

import enum
from collections.abc import Set
from typing import Literal, TypeAlias

Channel: TypeAlias = Literal["frontend", "admin"]


class Authority(enum.Enum):
    OPERATOR = "operator"
    REFUSED = "refused"


def authority(channel: Channel, user_id: str | None, admin_keys: Set[str]) -> Authority:
    """The table in the module docstring."""
    if channel == "admin":
        return Authority.OPERATOR
    if user_id is not None and user_id in admin_keys:
        return Authority.OPERATOR
    return Authority.REFUSED


def not_authorized_message(command: str) -> str:
    """What a refused peer is told: why, and the two ways an operator gets through."""
    return (f"{command} changes membership and needs an operator: run `dp-coordinator "
            f"{command}` on the coordinator's host as the user it runs as (it uses the "
            f"owner-only admin socket named in the address file), or connect over CURVE "
            f"with a client key listed in the coordinator's --admin-keys-dir")


def resize_refusal(new_count: int, *, current: int, min_engines: int,
                   max_engines: int) -> str | None:
    """Why ``SCALE_ELASTIC_EP`` to ``new_count`` ranks is refused, or None to honour it."""
    if min_engines <= new_count <= max_engines:
        return None
    if min_engines == max_engines:
        allowed = (f"the group size is fixed at {current} (start the coordinator with "
                   "--min-engines/--max-engines to let elastic EP resize it)")
    else:
        allowed = (f"the coordinator allows {min_engines}..{max_engines} "
                   "(--min-engines, --max-engines)")
    return f"SCALE_ELASTIC_EP to {new_count} ranks refused: {allowed}"
