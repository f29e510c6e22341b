"""What the core shows: the ``state`` reply, the state file, counters, the operators' view.

Queries only: building a view changes nothing (the wave latencies are read
through a cursor the caller keeps). ``CoreViews`` reads the domains it is given
at construction; it owns none of their state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from coordinator.core.bootstrap.handlers import BootstrapHandlers
from coordinator.core.dispatch.choice import RankChoice
from coordinator.core.dispatch.handlers import DispatchHandlers
from coordinator.core.frontends.handlers import FrontendHandlers
from coordinator.core.kv.handlers import KVHandlers
from coordinator.core.observe.journal import Journal
from coordinator.core.observe.recorder import WaveTotals
from coordinator.core.persisted import STATE_VERSION, SavedLease, SavedState
from coordinator.core.ranks.handlers import RankHandlers
from coordinator.core.ranks.membership import EngineLease, RankState
from coordinator.core.ranks.readiness import NOT_JUDGED, Readiness, group_serves
from coordinator.core.ranks.span import RankSpan
from coordinator.core.waves.handlers import WaveHandlers
from coordinator.protocol import frontend as fp

# Registrations that survive a coordinator restart (see core.persisted).
_SETTLED = (RankState.READY, RankState.CORDONED, RankState.DRAINING)


@dataclass(frozen=True)
class RankView:
    """One rank as the core saw it when the view was taken."""

    rank: int
    state: str
    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    dispatched: int = 0
    """Requests dispatched to this rank since the coordinator started."""
    report_age_s: float | None = None
    """Seconds since this rank's last stats report (None: never reported)."""
    in_flight: int = 0
    vllm_version: str | None = None
    """The vLLM version the rank's engine named in its greeting (None: none named)."""


@dataclass(frozen=True)
class PrefixView:
    """The KV event plane and the prefix index when the view was taken."""

    block_size: int | None
    blocks: dict[int, int]
    """Blocks the index holds, by rank."""
    streams: dict[int, str]
    """Each followed rank's stream state: sync, live or replaying."""
    batches: dict[int, int]
    """KV event batches received, by rank."""
    subscriptions: dict[int, str]
    """Where each followed rank's publisher is reached."""
    total_blocks: int = 0
    distinct_blocks: int = 0
    memory_bytes: int = 0
    pending_blocks: int = 0


@dataclass(frozen=True)
class OperatorView:
    """Everything the operators' endpoints show that the core knows, at one moment."""

    wave: int
    running: bool
    lockstep: bool
    ranks: list[RankView]
    counters: dict[str, int]
    totals: WaveTotals
    watchdog: list[dict[str, object]]
    all_ready: bool
    group: fp.GroupState
    policy: str
    prefix: PrefixView | None = None
    readiness: Readiness = NOT_JUDGED
    """Whether the group serves (``core.ranks.readiness``): what ``/readyz`` says."""
    kv_bootstrap: list[dict[str, object]] | None = None
    """The KV bootstrap registry's entries (None: not served)."""


class CoreViews:
    """The core's read-only views; see the module docstring."""

    def __init__(self, *, journal: Journal, span: RankSpan, lockstep: bool, policy: str,
                 ranks: RankHandlers, waves: WaveHandlers, dispatch: DispatchHandlers,
                 frontends: FrontendHandlers, kv: KVHandlers,
                 hot_counters: Callable[[], Mapping[str, int]], version: str = "",
                 bootstrap: BootstrapHandlers | None = None) -> None:
        self._journal = journal
        self._version = version
        self._span = span
        self._lockstep = lockstep
        self._policy = policy
        self._ranks = ranks
        self._waves = waves
        self._dispatch = dispatch
        self._frontends = frontends
        self._kv = kv
        self._hot_counters = hot_counters
        self._bootstrap = bootstrap
        self.server_counters: dict[str, int] = {}
        """The server's own counters, as its last ``ServerCounters`` said."""

    def counter_values(self) -> dict[str, int]:
        """Every counter by name, including the server's own."""
        counters: dict[str, int] = dict(self._journal.counters)
        for name, value in self._hot_counters().items():
            if value:
                counters[name] = value
        choice: RankChoice = self._dispatch.choice
        if self._kv.plane is not None or choice.router is not None:
            counters.update(self._prefix_counters())
        counters.update(self.server_counters)
        return counters

    def _prefix_counters(self) -> dict[str, int]:
        """The KV event and routing counters, under ``kv.`` and ``route.``."""
        out: dict[str, int] = {}
        plane = self._kv.plane
        if plane is not None:
            for name, value in vars(plane.streams.counters).items():
                out[f"kv.{name}"] = value
            for kind, value in plane.counters.events.items():
                out[f"kv.events.{kind}"] = value
            out["kv.events.unknown"] = plane.counters.unknown_events
            for reason, value in plane.counters.bad_batches.items():
                out[f"kv.bad_batches.{reason}"] = value
            for cause, value in plane.counters.resets.items():
                out[f"kv.resets.{cause}"] = value
            if plane.index is not None:
                for name, value in vars(plane.index.counters).items():
                    out[f"prefix_index.{name}"] = value
        router = self._dispatch.choice.router
        if router is not None:
            for reason, value in router.counters.reasons.items():
                out[f"route.decisions.{reason}"] = value
            out["route.prompt_tokens"] = router.counters.prompt_tokens
            out["route.cached_tokens"] = router.counters.cached_tokens
            out["route.unmatched"] = router.counters.unmatched
        # Like every other counter, one appears once it counted something.
        return {name: value for name, value in out.items() if value}

    def group_state(self, now: float) -> fp.GroupState:
        """The group as the frontend protocol's ``state`` reply shows it."""
        wave, running = self._waves.snapshot()
        leases: dict[int, EngineLease] = {
            lease.rank: lease for lease in self._ranks.membership.leases()}
        loads, requests = self._dispatch.choice.loads, self._dispatch.requests
        versions = self._ranks.vllm_versions
        engines: list[fp.EngineStatus] = []
        for rank in self._span.range:
            load = loads.load(rank)
            lease = leases.get(rank)
            engines.append(fp.EngineStatus(
                rank=rank, state=lease.state.value if lease else "absent",
                engine_id=lease.engine_id if lease else None,
                waiting=load.waiting, running=load.running, kv_cache_usage=load.kv_cache_usage,
                dispatched_since_report=load.dispatched_since_report,
                in_flight=requests.count(rank),
                last_seen_age_s=round(now - lease.last_seen, 3) if lease else None,
                vllm_version=versions.get(rank) if lease else None,
            ))
        return fp.GroupState(
            wave=wave, running=running, lockstep=self._lockstep,
            rank_start=self._span.start, rank_count=len(self._span),
            frontends=len(self._frontends.registry), in_flight=len(requests), engines=engines,
            counters=self.counter_values(),
            shutting_down=self._dispatch.shutting_down or self._dispatch.stopping,
            version=self._version,
        )

    def saved_state(self) -> SavedState:
        """What a restarted coordinator resumes from (see ``core.persisted``)."""
        leases = [
            SavedLease(lease.rank, lease.engine_id, lease.incarnation, lease.state.value,
                       lease.local, lease.headless, lease.parallel_config_hash)
            for lease in self._ranks.membership.leases() if lease.state in _SETTLED
        ]
        registry = self._frontends.registry
        return SavedState(
            version=STATE_VERSION, wave=self._waves.table.current_wave,
            gate_open=self._waves.gate.is_open, inits_sent=registry.inits_sent,
            leases=leases, frontends=registry.saved(),
            addresses=dict(self._frontends.addresses), pinned=registry.pinned() or None,
            kv_bootstrap=self._bootstrap.saved() if self._bootstrap is not None else None,
        )

    def prefix_view(self) -> PrefixView | None:
        """What the KV event plane and the index hold now."""
        plane = self._kv.plane
        if plane is None:
            return None
        index = plane.index
        streams = {}
        for rank in plane.streams.ranks():
            view = plane.streams.view(rank)
            if view is not None:
                streams[rank] = view.state
        return PrefixView(
            block_size=index.block_size if index is not None else None,
            blocks=index.blocks_per_rank() if index is not None else {},
            streams=streams,
            batches=dict(plane.counters.batches_by_rank),
            subscriptions={rank: sub.live.address for rank, sub in plane.subscriptions.items()},
            total_blocks=index.total_blocks if index is not None else 0,
            distinct_blocks=index.distinct_blocks if index is not None else 0,
            memory_bytes=index.memory_estimate_bytes() if index is not None else 0,
            pending_blocks=plane.pending_blocks,
        )

    def operator_view(self, now: float) -> OperatorView:
        """The per-rank table, the wave's totals and alerts, and the ``state`` reply."""
        wave, running = self._waves.snapshot()
        membership = self._ranks.membership
        dispatch, watchdog = self._dispatch, self._waves.watchdog
        loads = dispatch.choice.loads
        ranks = []
        for rank in self._span.range:
            lease = membership.lease(rank)
            load = loads.load(rank)
            ranks.append(RankView(
                rank=rank, state=lease.state.value if lease else "absent",
                waiting=load.waiting, running=load.running, kv_cache_usage=load.kv_cache_usage,
                dispatched=dispatch.dispatched_by_rank[rank],
                report_age_s=watchdog.report_age(rank, now),
                in_flight=dispatch.requests.count(rank),
                vllm_version=self._ranks.vllm_versions.get(rank) if lease else None,
            ))
        group = self.group_state(now)  # its counters are the view's: built once
        return OperatorView(
            wave=wave, running=running, lockstep=self._lockstep, ranks=ranks,
            counters=dict(group.counters), totals=self._waves.timeline.totals(now),
            watchdog=[alert.as_dict(now) for alert in watchdog.active],
            all_ready=membership.all_ready(now=now), group=group,
            policy=self._policy, prefix=self.prefix_view(),
            readiness=group_serves({view.rank: view.state for view in ranks},
                                   membership.dispatchable(now=now),
                                   gate_open=self._waves.gate.is_open),
            kv_bootstrap=self._bootstrap.view() if self._bootstrap is not None else None,
        )
