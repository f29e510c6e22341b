"""What a prefill worker posts to ``/register``, read strictly and bounded.

vLLM 0.33's Mooncake connector posts ``RegisterWorkerPayload.model_dump()``:
``{"engine_id": str, "dp_rank": int, "tp_rank": int, "pp_rank": int,
"addr": "tcp://host:port"}`` (its side channel, a ZeroMQ ROUTER socket).
Unknown fields are ignored, as pydantic does. The bounds keep one request
from making the registry hold more than the group can have: the DP rank
must be one of the group's, the TP and PP ranks below the configured sizes,
the strings short.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

MAX_ENGINE_ID_CHARS = 256
"""vLLM's engine ids are uuid4 strings (36 characters); room to spare, no more."""
MAX_ADDR_CHARS = 300
"""``tcp://`` and a host name (at most 253) and a port."""
MAX_PARALLEL_SIZE = 1024
"""Bound on ``--kv-bootstrap-tp-size`` and ``--kv-bootstrap-pp-size``."""


class RegisterWorkerPayload(msgspec.Struct, forbid_unknown_fields=False):
    """vLLM's ``RegisterWorkerPayload``, field for field."""

    engine_id: str
    dp_rank: int
    tp_rank: int
    pp_rank: int
    addr: str


@dataclass(frozen=True)
class PayloadBounds:
    """The ranks and sizes a registration may name."""

    dp_ranks: range
    tp_size: int = 1
    pp_size: int = 1

    @property
    def max_workers(self) -> int:
        """The most worker entries the registry can ever hold."""
        return len(self.dp_ranks) * self.tp_size * self.pp_size


class PayloadError(ValueError):
    """A registration that cannot be taken; the message says why, for the 4xx detail."""


_decoder = msgspec.json.Decoder(RegisterWorkerPayload)


def decode_payload(body: bytes, bounds: PayloadBounds) -> RegisterWorkerPayload:
    """The payload in ``body`` (JSON), or PayloadError saying what is wrong with it."""
    try:
        payload = _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise PayloadError(f"not a RegisterWorkerPayload: {exc}") from None
    except msgspec.DecodeError as exc:
        raise PayloadError(f"the body is not JSON: {exc}") from None
    check_payload(payload, bounds)
    return payload


def check_payload(payload: RegisterWorkerPayload, bounds: PayloadBounds) -> None:
    """PayloadError unless ``payload`` is within ``bounds``."""
    if not 0 < len(payload.engine_id) <= MAX_ENGINE_ID_CHARS:
        raise PayloadError(f"engine_id must have 1 to {MAX_ENGINE_ID_CHARS} characters, "
                           f"got {len(payload.engine_id)}")
    if not payload.addr.startswith("tcp://") or not 6 < len(payload.addr) <= MAX_ADDR_CHARS:
        raise PayloadError(f"addr must be a tcp://host:port of at most {MAX_ADDR_CHARS} "
                           f"characters, got {payload.addr[:64]!r}"
                           f"{'...' if len(payload.addr) > 64 else ''}")
    if split_tcp_address(payload.addr) is None:
        raise PayloadError(f"addr {payload.addr!r} is not tcp://host:port")
    dp = bounds.dp_ranks
    if payload.dp_rank not in dp:
        raise PayloadError(f"dp_rank={payload.dp_rank} is not a rank of this coordinator's "
                           f"group ({dp.start}..{dp.stop - 1})")
    if not 0 <= payload.tp_rank < bounds.tp_size:
        raise PayloadError(f"tp_rank={payload.tp_rank} is outside 0..{bounds.tp_size - 1}: "
                           "set --kv-bootstrap-tp-size to the prefill engines' "
                           "--tensor-parallel-size")
    if not 0 <= payload.pp_rank < bounds.pp_size:
        raise PayloadError(f"pp_rank={payload.pp_rank} is outside 0..{bounds.pp_size - 1}: "
                           "set --kv-bootstrap-pp-size to the prefill engines' "
                           "--pipeline-parallel-size")


def split_tcp_address(addr: str) -> tuple[str, int] | None:
    """``tcp://host:port`` (host may be ``[v6]``) as (host, port), or None."""
    if not addr.startswith("tcp://"):
        return None
    host, sep, port_text = addr[len("tcp://"):].rpartition(":")
    if not sep or not host or not port_text.isdigit() or len(port_text) > 5:
        return None
    port = int(port_text)
    if not 1 <= port <= 65535:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c in host for c in "/[] "):
        return None
    return host, port
