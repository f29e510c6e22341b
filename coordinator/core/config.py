"""The core's settings: the server's flags that are rules, not IO.

``CoreConfig`` is the one place their defaults are written; the server's
configuration embeds it and the CLI reads its defaults from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.core.kv.plane import KVSettings


@dataclass(frozen=True)
class BootstrapSettings:
    """The KV bootstrap registry's sizes (``core.bootstrap``)."""

    tp_size: int = 1
    pp_size: int = 1


@dataclass(frozen=True)
class CoreConfig:
    """The core's settings (the server's flags that are rules, not IO)."""

    rank_start: int
    engines: int
    frontends: int = 0
    max_frontends: int = 1024
    max_in_flight: int = 1_000_000
    lockstep: bool = True
    lease_ttl_s: float = 10.0
    handshake_ttl_s: float = 1800.0
    publish_interval_s: float = 0.1
    heartbeat_s: float = 5.0
    first_publish_delay_s: float = 0.05
    policy: str = "least-loaded"
    row_width: int = 3
    """Values per published count row: 3 (vLLM 0.29 to 0.33), 2 (frontends before
    ``kv_cache_usage``). A separate choice from ``frontend_wake``."""
    frontend_wake: bool = True
    """Honour the pre-0.33 frontend wake in lockstep (vLLM 0.29 to 0.32 MoE groups hang
    without it); False drops it, as vLLM 0.33's coordinator does."""
    require_supported_vllm: bool = False
    """Refuse a rank whose greeting names a vLLM outside the supported range
    (``ranks.versions.SUPPORTED_RANGE``); by default such a rank is used and logged once."""
    frontend_lease_ttl_s: float = 30.0
    """A frontend registration not renewed (traffic, heartbeats) for this long expires."""
    admin_keys: frozenset[str] = frozenset()
    """CURVE client keys (Z85) of operators, who may run admin commands on ``frontend``."""
    min_engines: int = 0
    max_engines: int = 0
    """Bounds on SCALE_ELASTIC_EP's rank count; 0 means ``engines`` (a fixed size)."""
    watchdog_stall_s: float = 30.0
    """0 disables the watchdog's alerts."""
    watchdog_rewake: bool = True
    recorder_size: int = 1000
    persist: bool = False
    """Emit ``SaveState`` whenever what a restart needs changed."""
    rewake_after_s: float = 1.0
    observe_interval_s: float = 0.25
    state_retry_s: float = 1.0
    kv: KVSettings | None = None
    """Follow the engines' KV cache events (None: do not)."""
    prefix_slack_tokens: float = 256.0
    """The prefix policy's load/cache trade-off (``RoutingConfig.slack_tokens``)."""
    version: str = ""
    """The running dp-coordinator's version, for the ``state`` reply."""
    kv_bootstrap: BootstrapSettings | None = None
    """Serve the KV bootstrap registry with these sizes (None: do not)."""
