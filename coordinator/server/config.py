"""Settings of one coordinator process, with the defaults the CLI documents."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field

from coordinator.core.dispatch.prefix_policy import PREFIX_POLICY
from coordinator.core.kv.plane import KVSettings
from coordinator.protocol.addresses import SOCKET_KEYS, bind_host, check_bind_safety
from coordinator.protocol.identity import MAX_RANK
from coordinator.protocol.kv_events import subscription_for
from coordinator.server.transport import (
    CONTROL_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_ENGINE_MESSAGE_BYTES,
    DEFAULT_MAX_REQUEST_BYTES,
    KV_EVENTS_MAX_MESSAGE_BYTES,
    PUBLISH_UPSTREAM_MAX_MESSAGE_BYTES,
)


@dataclass
class ServerConfig:
    engines: int
    """Number of DP ranks this coordinator manages."""
    rank_start: int = 0
    """First global DP rank managed; ranks are [rank_start, rank_start + engines)."""
    frontends: int = 0
    """INIT replies wait until this many frontends registered (0: do not wait)."""
    host: str | None = None
    """Bind tcp://host:0 for every socket; None binds ipc in a private directory."""
    ipc_dir: str | None = None
    """Fixed directory for the ipc sockets (so a restart binds the same paths)."""
    port_base: int | None = None
    """With a host: bind the six sockets on ports port_base..port_base+5 instead of
    free ones, so a restarted coordinator is found at the same addresses."""
    bind_overrides: dict[str, str] = field(default_factory=dict)
    """Per-socket endpoints (key -> endpoint) that replace the default for that key."""
    state_file: str | None = None
    """Where to keep what a restarted coordinator cannot learn again from its peers."""
    addr_file: str | None = None
    lockstep: bool = True
    """Wave coordination (MoE). False is dense mode: stats and balancing only."""
    publish_interval_s: float = 0.1
    heartbeat_s: float = 5.0
    first_publish_delay_s: float = 0.05
    lease_ttl_s: float = 10.0
    handshake_timeout_s: float = 1800.0
    """How long a rank may sit between HELLO and READY (vLLM loads its model there)."""
    policy: str = "least-loaded"
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Bound on one message on ``frontend``, all frames together (a submit's payload)."""
    max_engine_message_bytes: int = DEFAULT_MAX_ENGINE_MESSAGE_BYTES
    """Bound on one message on ``handshake``, ``dispatch`` and ``back_output``."""
    max_in_flight: int = 1_000_000
    max_frontends: int = 1024
    master_ip: str | None = None
    """data_parallel_master_ip sent in INIT (default: the advertised host)."""
    master_port: int | None = None
    """data_parallel_master_port sent in INIT (default: a free port found at start-up)."""
    master_port_list: list[int] = field(default_factory=list)
    coord_store_port: int | None = None
    vllm_compat: str = "0.33"
    """The count rows' width: "0.33" publishes 3-wide rows (what every vLLM from 0.29
    to 0.33 unpacks); "legacy" 2-wide rows for frontends from before
    ``kv_cache_usage``, with the pre-0.33 wake honoured (unless ``frontend_wake``)."""
    frontend_wake: bool = True
    """Honour the pre-0.33 frontend wake `[engine, wave]` on front_publish (vLLM 0.29 to
    0.32 MoE groups need it); False drops it, as vLLM 0.33's coordinator does."""
    require_supported_vllm: bool = False
    """Refuse ranks whose vLLM is outside the supported range (default: log once)."""
    loop: str = "auto"
    """Event loop: "auto" (uvloop when installed), "uvloop" or "asyncio"."""
    log_interval_s: float = 5.0
    """Minimum gap between two log lines about the same kind of bad input."""
    metrics_port: int | None = None
    """Serve /metrics, /healthz, /readyz, /state, /debug/waves here (None: off)."""
    metrics_host: str = "127.0.0.1"
    watchdog_stall_s: float = 30.0
    """Hang watchdog threshold; 0 disables it."""
    watchdog_rewake: bool = True
    """Re-broadcast the wave start when the watchdog sees no progress. Harmless when the
    alarm is false (running engines ignore it), so on by default."""
    recorder_size: int = 1000
    curve_secret_key: str | None = None
    curve_clients_dir: str | None = None
    admin_keys_dir: str | None = None
    """Public keys (*.key) of operators, whose CURVE connections to ``frontend`` may run
    admin commands (they are allowed to connect like the client keys)."""
    frontend_lease_ttl_s: float = 30.0
    """A frontend registration not renewed by traffic or heartbeats for this long expires."""
    min_engines: int = 0
    """Fewest ranks SCALE_ELASTIC_EP may leave (0: --engines, a fixed size)."""
    max_engines: int = 0
    """Most ranks SCALE_ELASTIC_EP may ask for (0: --engines, a fixed size)."""
    insecure: bool = False
    """Allow a non-loopback TCP bind without CURVE keys."""
    kv_events_endpoint: str | None = None
    """vLLM's kv_events_config endpoint: follow every rank's KV event publisher there."""
    kv_events_replay_endpoint: str | None = None
    """vLLM's kv_events_config replay_endpoint."""
    kv_block_size: int | None = None
    """Tokens per KV cache block (default: what the engines say)."""
    prefix_slack_tokens: float = 256.0
    """The prefix policy's load/cache trade-off, in tokens of extra load."""

    def kv_settings(self) -> KVSettings | None:
        """What to follow of the engines' KV events: all of it for the prefix policy, the
        configured publishers otherwise, nothing without either."""
        if self.policy != PREFIX_POLICY and self.kv_events_endpoint is None:
            return None
        return KVSettings(endpoint=self.kv_events_endpoint,
                          replay_endpoint=self.kv_events_replay_endpoint,
                          block_size=self.kv_block_size)

    @property
    def row_width(self) -> int:
        """Values per published count row (``vllm_compat``)."""
        return 2 if self.vllm_compat == "legacy" else 3

    def max_message_bytes(self, key: str) -> int:
        """The bound on one message (all frames) read on socket ``key``."""
        if key == "frontend":
            return self.max_request_bytes
        if key in ("back_publish", "front_publish"):
            return PUBLISH_UPSTREAM_MAX_MESSAGE_BYTES
        if key == "admin":
            return CONTROL_MAX_MESSAGE_BYTES
        if key == "kv_events":
            return KV_EVENTS_MAX_MESSAGE_BYTES
        return self.max_engine_message_bytes

    def validate(self) -> None:
        """Raise ValueError with a message an operator can act on."""
        if not 1 <= self.engines <= MAX_RANK + 1:
            raise ValueError(f"--engines must be between 1 and {MAX_RANK + 1}, got {self.engines}")
        if self.rank_start < 0 or self.rank_start + self.engines > MAX_RANK + 1:
            raise ValueError(
                f"ranks {self.rank_start}..{self.rank_start + self.engines - 1} do not fit in "
                f"a two-byte engine identity (0..{MAX_RANK})"
            )
        if self.port_base is not None:
            if self.host is None:
                raise ValueError("--port-base needs --host (ipc sockets have no ports)")
            if not 1 <= self.port_base <= 65535 - 5:
                raise ValueError(f"--port-base must be between 1 and 65530, got {self.port_base}")
        for key, endpoint in self.bind_overrides.items():
            if key not in SOCKET_KEYS:
                raise ValueError(f"--bind {key}=...: unknown socket; the keys are "
                                 f"{', '.join(SOCKET_KEYS)}")
            if not endpoint.startswith(("ipc://", "tcp://")):
                raise ValueError(f"--bind {key}={endpoint}: use an ipc:// or tcp:// endpoint")
            if endpoint.startswith("tcp://"):
                check_bind_safety(endpoint, has_keys=self.curve_secret_key is not None,
                                  insecure=self.insecure)
        if self.frontends < 0:
            raise ValueError(f"--frontends must be >= 0, got {self.frontends}")
        if self.publish_interval_s <= 0 or self.heartbeat_s < self.publish_interval_s:
            raise ValueError("need 0 < --publish-interval-ms <= --heartbeat-s")
        if self.vllm_compat not in ("0.33", "legacy"):
            raise ValueError(f"--vllm-compat must be 0.33 or legacy, got {self.vllm_compat!r}")
        if self.loop not in ("auto", "uvloop", "asyncio"):
            raise ValueError(f"--loop must be auto, uvloop or asyncio, got {self.loop!r}")
        if self.master_ip is not None and self.master_port is None and self.lockstep:
            raise ValueError(
                "--master-ip names the host where rank 0 meets its peers; give its port "
                "with --master-port too (the coordinator cannot look for free ports there)"
            )
        if self.lease_ttl_s <= 0:
            raise ValueError("--lease-ttl-s must be positive")
        if self.frontend_lease_ttl_s <= 0:
            raise ValueError("--frontend-lease-ttl-s must be positive")
        if (self.curve_secret_key is None) != (self.curve_clients_dir is None):
            raise ValueError(
                "CURVE needs both --curve-secret-key and --curve-clients-dir (the allowed "
                "client public keys)"
            )
        for flag, value in (("--max-request-bytes", self.max_request_bytes),
                            ("--max-engine-message-bytes", self.max_engine_message_bytes)):
            if value < 1024:
                raise ValueError(f"{flag} must be at least 1024, got {value}")
        low, high = self.min_engines or self.engines, self.max_engines or self.engines
        if not 1 <= low <= self.engines <= high:
            raise ValueError(f"need 1 <= --min-engines ({low}) <= --engines ({self.engines}) "
                             f"<= --max-engines ({high})")
        if self.rank_start + high > MAX_RANK + 1:
            raise ValueError(f"--max-engines {high} from rank {self.rank_start} does not fit in "
                             f"a two-byte engine identity (0..{MAX_RANK})")
        if self.admin_keys_dir is not None and self.curve_secret_key is None:
            raise ValueError("--admin-keys-dir needs CURVE (--curve-secret-key and "
                             "--curve-clients-dir): admin keys are CURVE client keys")
        if self.recorder_size < 1:
            raise ValueError(f"--recorder-size must be >= 1, got {self.recorder_size}")
        if self.watchdog_stall_s < 0:
            raise ValueError(f"--watchdog-stall-s must be >= 0, got {self.watchdog_stall_s}")
        self._validate_kv()
        if self.host is not None:
            check_host_resolves(self.host)
        check_bind_safety(
            self.host, has_keys=self.curve_secret_key is not None, insecure=self.insecure
        )

    def _validate_kv(self) -> None:
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        if self.kv_block_size is not None and not 1 <= self.kv_block_size <= 1 << 20:
            raise ValueError(f"--kv-block-size must be between 1 and {1 << 20}, "
                             f"got {self.kv_block_size}")
        if not (self.prefix_slack_tokens >= 0 and self.prefix_slack_tokens != float("inf")):
            raise ValueError("--prefix-slack-tokens must be a finite number >= 0, got "
                             f"{self.prefix_slack_tokens}")
        for flag, endpoint in (("--kv-events-endpoint", self.kv_events_endpoint),
                               ("--kv-events-replay-endpoint", self.kv_events_replay_endpoint)):
            if endpoint is None:
                continue
            try:
                # Every rank's publisher offsets the same endpoint: the first and the
                # last rank show whether all of them can be reached.
                for rank in (self.rank_start, self.rank_start + self.engines - 1):
                    subscription_for(endpoint, rank, replay=flag != "--kv-events-endpoint")
            except ValueError as exc:
                raise ValueError(f"{flag} {endpoint}: {exc}") from None


def check_host_resolves(host: str) -> None:
    """ValueError when ``--host`` is neither an address, ``*``, an interface nor a name
    that resolves: said as such, not as some later bind or safety refusal."""
    tcp_host = bind_host(host)
    if tcp_host is None or tcp_host == "*":
        return
    try:
        ipaddress.ip_address(tcp_host)
        return
    except ValueError:
        pass
    try:
        if tcp_host in {name for _, name in socket.if_nameindex()}:
            return  # ZeroMQ binds an interface by its name
    except OSError:
        pass
    try:
        socket.getaddrinfo(tcp_host, None)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise ValueError(f"--host {host!r} does not resolve ({reason}): give an address, "
                         "a name this host can resolve, or an interface name") from None
