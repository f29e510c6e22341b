"""The bootstrap registry applied: its decisions logged, counted and saved.

``BootstrapRegistry`` decides; ``BootstrapHandlers`` tells the rest of the
core: a replacement is logged once with both engine ids and recorded, every
change owes a state-file write and a refresh of the operators' view, and the
membership's evidence (``CoordinatorCore``'s fan-out) reaches the registry.
"""

from __future__ import annotations

from logging import INFO, WARNING

from coordinator.core.bootstrap.payload import PayloadBounds, RegisterWorkerPayload
from coordinator.core.bootstrap.registry import (
    BootstrapRegistry,
    Conflict,
    Decision,
    ProbeNeeded,
    Registered,
    Workers,
)
from coordinator.core.observe.journal import Journal
from coordinator.core.observe.recorder import KIND_MEMBERSHIP
from coordinator.core.outbox import Outbox
from coordinator.core.persisted import SavedBootstrapEntry


class BootstrapHandlers:
    """The registry with the core's journal and outbox; see the module docstring."""

    def __init__(self, bounds: PayloadBounds, journal: Journal) -> None:
        self._journal = journal
        self.registry = BootstrapRegistry(bounds, journal.counters)

    def register(self, payload: RegisterWorkerPayload, now: float, out: Outbox, *,
                 probed: bool = False) -> Decision:
        decision = self.registry.register(payload, now, probed=probed)
        if isinstance(decision, Registered) and not decision.retry:
            out.state_changed()
            out.refresh()
            replaced = decision.replaced
            if replaced is not None:
                self._journal.record(now, KIND_MEMBERSHIP, "kv bootstrap entry replaced",
                                     rank=replaced.dp_rank, old=replaced.old_engine_id,
                                     new=replaced.new_engine_id)
                out.log(WARNING, "kv bootstrap: dp_rank=%d: engine %s replaces %s (%s)",
                        replaced.dp_rank, replaced.new_engine_id, replaced.old_engine_id,
                        replaced.evidence)
            else:
                out.log(INFO, "kv bootstrap: registered engine %s dp_rank=%d tp_rank=%d "
                        "pp_rank=%d at %s", payload.engine_id, payload.dp_rank,
                        payload.tp_rank, payload.pp_rank, payload.addr)
        elif isinstance(decision, Conflict):
            out.refresh()
            out.log(WARNING, "kv bootstrap: refused: %s", decision.detail,
                    key=f"bootstrap-conflict:{payload.dp_rank}")
        return decision

    def probe_answered(self, probe: ProbeNeeded, alive: bool, now: float,
                       out: Outbox) -> None:
        if self.registry.probe_answered(probe, alive):
            out.state_changed()
            out.refresh()
            out.log(INFO, "kv bootstrap: dp_rank=%d: no side channel of its engine accepts "
                    "a connection (%s): its entry is gone", probe.dp_rank,
                    ", ".join(probe.addresses))

    def refused(self, reason: str) -> None:
        """A request that was not a valid registration (bad JSON, types, bounds, size)."""
        self._journal.counters[f"kv_bootstrap.refused.{reason}"] += 1

    def query(self) -> dict[int, tuple[str, Workers]]:
        """What ``/query`` shows: ``{dp: (engine_id, {tp: {pp: addr}})}``."""
        self._journal.counters["kv_bootstrap.queries"] += 1
        return {dp: (entry.engine_id, entry.workers)
                for dp, entry in self.registry.query().items()}

    # ---- evidence from membership --------------------------------------------------------

    def rank_died(self, rank: int, out: Outbox) -> None:
        if self.registry.rank_died(rank):
            out.refresh()

    def rank_revived(self, rank: int, out: Outbox) -> None:
        if self.registry.rank_revived(rank):
            out.refresh()

    def rank_superseded(self, rank: int, why: str, out: Outbox) -> None:
        if self.registry.rank_superseded(rank, why):
            out.state_changed()
            out.refresh()

    # ---- views and the state file --------------------------------------------------------

    def view(self) -> list[dict[str, object]]:
        """Every entry, with its state, for ``/state`` and ``status``."""
        registry = self.registry
        return [{"dp_rank": dp, "engine_id": entry.engine_id, "state": registry.state_of(entry),
                 "workers": entry.worker_count(), "addresses": list(entry.addresses()),
                 **({"evidence": entry.evidence()} if entry.evidence() else {})}
                for dp, entry in sorted(registry.entries.items())]

    def saved(self) -> list[SavedBootstrapEntry]:
        return [SavedBootstrapEntry(dp, engine_id, workers)
                for dp, (engine_id, workers) in self.registry.saved().items()]

    def restore(self, saved: list[SavedBootstrapEntry], now: float, out: Outbox) -> None:
        skipped = self.registry.restore(
            {item.dp_rank: (item.engine_id, item.workers) for item in saved}, now)
        for reason in skipped:
            out.log(WARNING, "state file: kv bootstrap entry skipped: %s", reason)

    def unverified(self) -> list[ProbeNeeded]:
        return self.registry.unverified()
