"""Settings of one coordinator process, with the defaults the CLI documents."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field

from coordinator import __version__
from coordinator.core.bootstrap.payload import MAX_PARALLEL_SIZE
from coordinator.core.config import BootstrapSettings, CoreConfig
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

CORE_DEFAULTS = CoreConfig(rank_start=0, engines=1)
"""The rules' defaults, written once in ``CoreConfig``: the settings below that are rules
refer to them, and the CLI reads its defaults from ``ServerConfig``."""
_D = CORE_DEFAULTS


@dataclass
class ServerConfig:
    engines: int
    """Number of DP ranks this coordinator manages."""
    rank_start: int = 0
    """First global DP rank managed; ranks are [rank_start, rank_start + engines)."""
    frontends: int = _D.frontends
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
    lockstep: bool = _D.lockstep
    """Wave coordination (MoE). False is dense mode: stats and balancing only."""
    publish_interval_s: float = _D.publish_interval_s
    heartbeat_s: float = _D.heartbeat_s
    first_publish_delay_s: float = _D.first_publish_delay_s
    lease_ttl_s: float = _D.lease_ttl_s
    handshake_timeout_s: float = _D.handshake_ttl_s
    """How long a rank may sit between HELLO and READY (vLLM loads its model there)."""
    policy: str = _D.policy
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Bound on one message on ``frontend``, all frames together (a submit's payload)."""
    max_engine_message_bytes: int = DEFAULT_MAX_ENGINE_MESSAGE_BYTES
    """Bound on one message on ``handshake``, ``dispatch`` and ``back_output``."""
    max_in_flight: int = _D.max_in_flight
    max_frontends: int = _D.max_frontends
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
    frontend_wake: bool = _D.frontend_wake
    """Honour the pre-0.33 frontend wake `[engine, wave]` on front_publish (vLLM 0.29 to
    0.32 MoE groups need it); False drops it, as vLLM 0.33's coordinator does."""
    require_supported_vllm: bool = _D.require_supported_vllm
    """Refuse ranks whose vLLM is outside the supported range (default: log once)."""
    loop: str = "auto"
    """Event loop: "auto" (uvloop when installed), "uvloop" or "asyncio"."""
    log_interval_s: float = 5.0
    """Minimum gap between two log lines about the same kind of bad input."""
    metrics_port: int | None = None
    """Serve /metrics, /healthz, /readyz, /state, /debug/waves here (None: off)."""
    metrics_host: str = "127.0.0.1"
    watchdog_stall_s: float = _D.watchdog_stall_s
    """Hang watchdog threshold; 0 disables it."""
    watchdog_rewake: bool = _D.watchdog_rewake
    """Re-broadcast the wave start when the watchdog sees no progress. Harmless when the
    alarm is false (running engines ignore it), so on by default."""
    recorder_size: int = _D.recorder_size
    curve_secret_key: str | None = None
    curve_clients_dir: str | None = None
    admin_keys_dir: str | None = None
    """Public keys (*.key) of operators, whose CURVE connections to ``frontend`` may run
    admin commands (they are allowed to connect like the client keys)."""
    frontend_lease_ttl_s: float = _D.frontend_lease_ttl_s
    """A frontend registration not renewed by traffic or heartbeats for this long expires."""
    min_engines: int = _D.min_engines
    """Fewest ranks SCALE_ELASTIC_EP may leave (0: --engines, a fixed size)."""
    max_engines: int = _D.max_engines
    """Most ranks SCALE_ELASTIC_EP may ask for (0: --engines, a fixed size)."""
    insecure: bool = False
    """Allow a non-loopback TCP bind without CURVE keys."""
    kv_events_endpoint: str | None = None
    """vLLM's kv_events_config endpoint: follow every rank's KV event publisher there."""
    kv_events_replay_endpoint: str | None = None
    """vLLM's kv_events_config replay_endpoint."""
    kv_block_size: int | None = None
    """Tokens per KV cache block (default: what the engines say)."""
    prefix_slack_tokens: float = _D.prefix_slack_tokens
    """The prefix policy's load/cache trade-off, in tokens of extra load."""
    graceful_stop_s: float = 0.0
    """SIGTERM/SIGINT first refuse new submits and wait this long for those in flight
    (0: stop at once)."""
    kv_bootstrap_port: int | None = None
    """Serve vLLM's Mooncake bootstrap registry (/register, /query) here (None: off)."""
    kv_bootstrap_host: str | None = None
    """Its address (default: the coordinator's --host; 127.0.0.1 with ipc sockets)."""
    kv_bootstrap_tp_size: int = 1
    kv_bootstrap_pp_size: int = 1
    """The prefill engines' tensor- and pipeline-parallel sizes."""
    kv_bootstrap_probe_timeout_s: float = 2.0
    """How long a probe of an old holder's side channel may wait for a connection."""

    def bootstrap_settings(self) -> BootstrapSettings | None:
        if self.kv_bootstrap_port is None:
            return None
        return BootstrapSettings(self.kv_bootstrap_tp_size, self.kv_bootstrap_pp_size)

    def bootstrap_host(self) -> str:
        """Where the registry listens: its own flag, else the coordinator's tcp host."""
        if self.kv_bootstrap_host is not None:
            return self.kv_bootstrap_host
        host = bind_host(self.host) if self.host is not None else None
        if host is None:
            return "127.0.0.1"
        return "0.0.0.0" if host == "*" else host

    def core_config(self, admin_keys: frozenset[str] = frozenset()) -> CoreConfig:
        """The rules' share of the process's settings (``admin_keys`` read from their files)."""
        return CoreConfig(
            rank_start=self.rank_start, engines=self.engines, frontends=self.frontends,
            max_frontends=self.max_frontends, max_in_flight=self.max_in_flight,
            lockstep=self.lockstep, lease_ttl_s=self.lease_ttl_s,
            handshake_ttl_s=self.handshake_timeout_s,
            publish_interval_s=self.publish_interval_s, heartbeat_s=self.heartbeat_s,
            first_publish_delay_s=self.first_publish_delay_s, policy=self.policy,
            row_width=self.row_width, frontend_wake=self.frontend_wake,
            require_supported_vllm=self.require_supported_vllm,
            watchdog_stall_s=self.watchdog_stall_s, watchdog_rewake=self.watchdog_rewake,
            recorder_size=self.recorder_size, persist=self.state_file is not None,
            admin_keys=admin_keys, min_engines=self.min_engines, max_engines=self.max_engines,
            frontend_lease_ttl_s=self.frontend_lease_ttl_s,
            kv=self.kv_settings(), prefix_slack_tokens=self.prefix_slack_tokens,
            version=__version__, kv_bootstrap=self.bootstrap_settings(),
        )

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
        if not 0 <= self.graceful_stop_s <= 86400:
            raise ValueError(f"--graceful-stop-s must be between 0 and 86400, got "
                             f"{self.graceful_stop_s}")
        if self.watchdog_stall_s < 0:
            raise ValueError(f"--watchdog-stall-s must be >= 0, got {self.watchdog_stall_s}")
        self._validate_kv()
        self._validate_bootstrap()
        if self.host is not None:
            check_host_resolves(self.host)
        check_bind_safety(
            self.host, has_keys=self.curve_secret_key is not None, insecure=self.insecure
        )

    def _validate_bootstrap(self) -> None:
        if self.kv_bootstrap_port is None:
            if self.kv_bootstrap_host is not None:
                raise ValueError("--kv-bootstrap-host needs --kv-bootstrap-port")
            return
        if not 0 <= self.kv_bootstrap_port <= 65535:
            raise ValueError(f"--kv-bootstrap-port must be between 0 and 65535, got "
                             f"{self.kv_bootstrap_port}")
        for flag, size in (("--kv-bootstrap-tp-size", self.kv_bootstrap_tp_size),
                           ("--kv-bootstrap-pp-size", self.kv_bootstrap_pp_size)):
            if not 1 <= size <= MAX_PARALLEL_SIZE:
                raise ValueError(f"{flag} must be between 1 and {MAX_PARALLEL_SIZE}, got {size}")
        if not 0 < self.kv_bootstrap_probe_timeout_s <= 60:
            raise ValueError("--kv-bootstrap-probe-timeout-s must be in (0, 60], got "
                             f"{self.kv_bootstrap_probe_timeout_s}")

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
