"""File descriptors: how many a group needs, and the process limit raised to fit it.

Every connection to a bound socket is a descriptor in this process. An engine
holds four while it handshakes (``handshake``, ``dispatch``, ``back_output``,
``back_publish``) and three afterwards (vLLM closes its handshake socket
after READY); a frontend holds two (``frontend`` and ``front_publish``). The
process itself needs some more: the listening sockets, libzmq's epoll and
mailboxes, the HTTP endpoints, the state file, operators' ``status`` and
``top`` connections.

Linux starts most processes with a soft ``RLIMIT_NOFILE`` of 1,024, which
holds about 240 engines handshaking at once (bench/README.md). libzmq does not
survive running out: over ipc it aborts the process (``Too many open files
(src/ipc_listener.cpp:...)``), over tcp it stops accepting and the handshake
hangs. So the limit is settled at start-up, before any socket exists: the
soft limit is raised to the hard limit (as much headroom as the process may
have: peers can open connections beyond the plan, and the connection budgets
of server.connection_gate are shares of this limit); if even the hard limit
is below what the configured group needs, the coordinator refuses to start
and says how many descriptors it needs and how to allow them.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

PER_ENGINE = 4
"""Descriptors an engine holds while it handshakes (3 afterwards)."""
PER_FRONTEND = 2
MIN_FRONTENDS = 16
"""Frontends planned for when ``--frontends`` names fewer (it is often 0: do not wait)."""
RESERVE = 256
"""The process's own descriptors, with room for operators' connections."""
# RLIM_INFINITY cannot be the soft limit for descriptors; the kernel caps it at nr_open.
UNLIMITED_TARGET = 1 << 20


def descriptors_needed(engines: int, frontends: int) -> int:
    """Descriptors a coordinator of ``engines`` ranks and ``frontends`` frontends needs."""
    return RESERVE + PER_ENGINE * engines + PER_FRONTEND * max(frontends, MIN_FRONTENDS)


@dataclass(frozen=True)
class LimitCheck:
    """What `ensure_descriptors` found and did."""

    needed: int
    soft: int
    hard: int
    raised_to: int | None = None
    """The new soft limit, when it was raised."""
    refusal: str | None = None
    """Why the coordinator cannot start (the hard limit is too low), with the remedy."""


def _show(limit: int) -> str:
    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)


def ensure_descriptors(engines: int, frontends: int) -> LimitCheck:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit, or refuse if the group needs more."""
    needed = descriptors_needed(engines, frontends)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if hard != resource.RLIM_INFINITY and hard < needed:
        return LimitCheck(needed, soft, hard, refusal=(
            f"{engines} engines and {max(frontends, MIN_FRONTENDS)} frontends need about "
            f"{needed} open files ({PER_ENGINE} per engine while it handshakes, "
            f"{PER_FRONTEND} per frontend, {RESERVE} for the process), but this process may "
            f"open at most {hard} (RLIMIT_NOFILE soft {_show(soft)}, hard {_show(hard)}). "
            f"Allow at least {needed}: `ulimit -n {needed}` in the shell that starts it "
            f"(as root, or after raising the hard limit), LimitNOFILE={needed} in a systemd "
            f"unit, --ulimit nofile={needed}:{needed} for docker, or a nofile line in "
            f"/etc/security/limits.conf"))
    if soft == resource.RLIM_INFINITY or soft >= target:
        return LimitCheck(needed, soft, hard)
    for attempt in (target, needed):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (attempt, hard))
        except (ValueError, OSError):
            continue
        return LimitCheck(needed, soft, hard, raised_to=attempt)
    if soft >= needed:
        return LimitCheck(needed, soft, hard)  # not raised, but the group fits
    return LimitCheck(needed, soft, hard, refusal=(
        f"{engines} engines need about {needed} open files, the soft limit is {_show(soft)} "
        f"and it could not be raised (hard limit {_show(hard)}); start the coordinator with "
        f"`ulimit -n {needed}` or LimitNOFILE={needed}"))
