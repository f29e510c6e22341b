"""What the frontend SDK raises and reports: errors, finished requests, notices.

Re-exported by `coordinator.frontend`, which is where users import them from.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.protocol import frontend as fp
from coordinator.protocol import vllm

# Position of `finish_reason` in vLLM's array-encoded EngineCoreOutput.
_FINISH_REASON_INDEX = 5


class FrontendError(Exception):
    """Base class of every error the SDK raises."""


class FrontendClosed(FrontendError):
    """The client was closed while a call was waiting (or before it started)."""


class CoordinatorTimeout(FrontendError, TimeoutError):
    """The coordinator did not answer within the call's timeout."""

    def __init__(self, what: str, timeout_s: float) -> None:
        super().__init__(f"no answer from the coordinator to {what} within {timeout_s:g} s")
        self.what = what
        self.timeout_s = timeout_s


class InvalidRequest(FrontendError, ValueError):
    """A call's arguments are outside the protocol's bounds; nothing was sent."""


class ReplyError(FrontendError):
    """The coordinator answered a call with an ErrorReply."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class RegisterError(ReplyError):
    """Register was refused (e.g. `bad_client_index`)."""


class SubmitError(ReplyError):
    """Submit was refused (e.g. `unknown_rank`, `duplicate_request_id`)."""


class AdminError(ReplyError):
    """An admin command, state query or abort was refused."""


@dataclass(frozen=True)
class FinishedRequest:
    """One request an engine reported finished, as seen on this client's PULL."""

    request_id: str
    engine_index: int
    at: float
    """`time.monotonic()` when the output was read."""


@dataclass(frozen=True)
class EngineDead:
    """An engine sent ENGINE_CORE_DEAD to this frontend's output socket."""

    at: float


Notice = fp.RequestsFailed | fp.RankDrained | fp.ShuttingDown | fp.ErrorReply | EngineDead
"""Something the coordinator or an engine told us without being asked.

An `ErrorReply` here has call id 0 (or an id no call waits for): the coordinator
could not read one of our messages, so it could not say which call it was."""

def finished_ids(message: vllm.EngineCoreOutputs) -> list[str]:
    """Request ids an EngineCoreOutputs reports finished, in order, without repeats."""
    seen: dict[str, None] = {}
    for output in message.outputs:
        if (
            isinstance(output, (list, tuple))
            and len(output) > _FINISH_REASON_INDEX
            and output[_FINISH_REASON_INDEX] is not None
            and isinstance(output[0], str)
        ):
            seen[output[0]] = None
    for request_id in message.finished_requests or ():
        seen[request_id] = None
    return list(seen)
