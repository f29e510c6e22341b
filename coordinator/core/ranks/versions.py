"""Which vLLM a rank runs, read from its greeting, against the range this coordinator supports.

Pure functions, no state: the engine rules keep each rank's version and call
`check_version` when a greeting names one. The supported range is the set of
releases whose own engine start-up, API-server client, KV events and wake the
compat suite runs against (docs/vllm.md): 0.29.x to 0.33.x. A version
outside it is worth one warning (the wire may differ in ways no test saw);
with ``require_supported_vllm`` the rank is refused instead.

Versions are parsed as vLLM writes them: ``0.33.0``, ``0.32.1.post1``,
``0.33.0+cu129`` (final releases of the supported minors are supported);
``0.33.0rc1``, ``0.34.0.dev12+g4ba787ec9`` and the like are pre-releases or
development builds, which no test covers, and so are outside the range.
"""

from __future__ import annotations

import enum
import re
from typing import Final, NamedTuple

__all__ = [
    "SUPPORTED_RANGE",
    "SUPPORTED_RELEASES",
    "VersionAction",
    "VersionCheck",
    "check_version",
    "is_supported",
    "parse_release",
]

SUPPORTED_RELEASES: Final = frozenset({(0, 29), (0, 30), (0, 31), (0, 32), (0, 33)})
"""(major, minor) of the vLLM releases the compat suite runs against."""
SUPPORTED_RANGE: Final = "0.29.x to 0.33.x"

_FINAL = re.compile(r"(\d+)\.(\d+)\.(\d+)(?:\.post\d+)?(?:\+[0-9A-Za-z.]+)?")
_ANY = re.compile(r"(\d+)\.(\d+)")


class VersionAction(enum.Enum):
    ACCEPT = "accept"
    """Supported: nothing to say."""
    WARN = "warn"
    """Outside the range: log once, keep the rank."""
    REFUSE = "refuse"
    """Outside the range and the operator asked for supported versions only."""


class VersionCheck(NamedTuple):
    action: VersionAction
    message: str
    """Empty for ACCEPT; otherwise what to log (and, for REFUSE, the refusal's reason)."""


def parse_release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a final release's version string, or None."""
    match = _FINAL.fullmatch(version.strip())
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


def is_supported(version: str) -> bool:
    release = parse_release(version)
    return release is not None and release[:2] in SUPPORTED_RELEASES


def _why(version: str) -> str:
    release = parse_release(version)
    if release is None:
        if _ANY.match(version.strip()) is not None:
            return "a pre-release or development build, which no compat test covers"
        return "not a vLLM release version"
    if release[:2] < min(SUPPORTED_RELEASES):
        return "older than the oldest supported release"
    return "newer than the newest supported release; its wire may have changed"


def check_version(rank: int, version: str, *, require_supported: bool) -> VersionCheck:
    """What to do about rank `rank` greeting with vLLM `version`."""
    if is_supported(version):
        return VersionCheck(VersionAction.ACCEPT, "")
    why = _why(version)
    if require_supported:
        return VersionCheck(
            VersionAction.REFUSE,
            f"dp_rank={rank} runs vLLM {version!r}, outside the supported range "
            f"{SUPPORTED_RANGE} ({why}); refused (--require-supported-vllm)")
    return VersionCheck(
        VersionAction.WARN,
        f"dp_rank={rank} runs vLLM {version!r}, outside the supported range {SUPPORTED_RANGE} "
        f"({why}); it is used, but untested here (docs/vllm.md; --require-supported-vllm "
        f"refuses such ranks)")
