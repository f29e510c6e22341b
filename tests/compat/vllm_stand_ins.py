"""Stand-ins for the few parts of vLLM that the modules under test import, and nothing more.

`tools.vllm_wheel.load(name, stand_ins=...)` serves these instead of vLLM's
own modules, so only the module under test runs from the pinned wheel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any


@dataclass
class KVEventsConfigStandIn:
    """vLLM 0.33's `KVEventsConfig` (a pydantic dataclass there): its fields and defaults.

    vLLM's publisher builds one; a frontend decodes one from an engine's greeting.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


def _unused_split(path: str) -> Any:  # only reached for tcp://*:0, which no test uses
    raise AssertionError(f"unexpected split_zmq_path({path!r})")


# What vLLM's KV event module imports from the rest of vLLM.
KV_STAND_INS: dict[str, dict[str, Any]] = {
    "vllm.config.kv_events": {"KVEventsConfig": KVEventsConfigStandIn},
    "vllm.logger": {"init_logger": logging.getLogger},
    "vllm.utils.network_utils": {
        "get_ip": lambda: "127.0.0.1",
        "get_tcp_uri": lambda ip, port: f"tcp://{ip}:{port}",
        "is_valid_ipv6_address": lambda ip: False,
        "split_zmq_path": _unused_split,
    },
    "vllm.v1.core.kv_cache_utils": {"ExternalBlockHash": bytes | int},
}
