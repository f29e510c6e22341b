"""Who holds each DP rank's bootstrap entry, decided on evidence.

vLLM's own bootstrap server keys prefill workers by DP rank and never forgets
one: a restarted engine (new engine id, new side-channel port) is refused
until the server restarts. This registry keeps vLLM's shapes and replaces an
entry when, and only when, its holder is proven gone.

An entry is one DP rank's engine: its engine id and its workers' side channels
(``{tp_rank: {pp_rank: "tcp://host:port"}}``). Evidence that its holder is
gone comes from two places: the coordinator's membership (the rank died, left,
or a new incarnation said HELLO) and a probe of the holder's side channels
(none accepts a connection within the probe's bound). The registry never does
IO: it asks for a probe (``ProbeNeeded``) and is told the outcome
(``probe_answered``); the caller then asks again with ``probed=True``.

The rule, for a registration of worker (dp, tp, pp) of engine E at address A:

=========================================  ==========================================
the DP rank's entry                        outcome
=========================================  ==========================================
none                                       a new entry for E; ``ok``
held with evidence that its holder is      the whole entry goes, a new one for E
gone (membership or a failed probe)        takes its place; ``ok``, a replacement
E's, slot (tp, pp) empty                   the worker is added; ``ok``
E's, slot (tp, pp) at A                    an identical retry; ``ok``, nothing changes
E's, slot (tp, pp) at another address B    probe B: gone, the whole entry is replaced;
                                           answers, a conflict (400)
another engine F's                         probe F's side channels: all gone, the
                                           whole entry is replaced; one answers, a
                                           conflict (400) naming E, F, F's live
                                           address and the remedy
=========================================  ==========================================

A conflict changes nothing: the live holder keeps its entry. Replacing the
whole entry, not one slot, keeps a decoder from mixing workers of two
incarnations of one engine.

``query`` shows only live, current entries: not those with evidence against
them (a dead rank's entry comes back if the same incarnation revives), and not
an engine whose workers have not all registered yet (a vLLM decoder reads the
TP size from the entry once and keeps it, so a partial entry would mislead it
for the engine's whole life; until complete it hears "engine not found" and
asks again on its next request).

Entries restored from the state file are kept and shown, and probed once each
(``unverified``); one whose side channels all refuse is marked gone.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from coordinator.core.bootstrap.payload import PayloadBounds, RegisterWorkerPayload

Workers = dict[int, dict[int, str]]
"""``{tp_rank: {pp_rank: addr}}``, as vLLM's ``EngineEntry.worker_addr``."""


@dataclass
class DPEntry:
    """One DP rank's engine and its workers' side channels."""

    engine_id: str
    generation: int
    registered_at: float
    workers: Workers = field(default_factory=dict)
    gone: str | None = None
    """Why its holder is proven gone for good (None: no evidence)."""
    rank_dead: bool = False
    """Membership says the rank is dead now; it may revive."""
    verified: bool = True
    """False for an entry restored from the state file until its probe answered."""
    check_asked: bool = False
    """The restored entry's probe was asked for (``unverified``)."""

    def addresses(self) -> tuple[str, ...]:
        return tuple(sorted({addr for by_pp in self.workers.values()
                             for addr in by_pp.values()}))

    def worker_count(self) -> int:
        return sum(len(by_pp) for by_pp in self.workers.values())

    def evidence(self) -> str | None:
        """Why the holder is believed gone, or None."""
        if self.gone is not None:
            return self.gone
        return "membership saw the rank die" if self.rank_dead else None


@dataclass(frozen=True)
class Replacement:
    dp_rank: int
    old_engine_id: str
    new_engine_id: str
    evidence: str


@dataclass(frozen=True)
class Registered:
    """The registration is recorded (or was already: ``retry``)."""

    retry: bool = False
    replaced: Replacement | None = None


@dataclass(frozen=True)
class Conflict:
    """Refused: the DP rank's live holder keeps it. ``detail`` is the 400's detail."""

    detail: str


@dataclass(frozen=True)
class ProbeNeeded:
    """Probe ``addresses`` (does any accept a connection?), then call ``probe_answered``."""

    dp_rank: int
    generation: int
    addresses: tuple[str, ...]


Decision = Registered | Conflict | ProbeNeeded

CONFLICT_REMEDY = (
    "two live engines claim one DP rank: two deployments share this bootstrap registry "
    "(give each its own coordinator or --kv-bootstrap-port), or an engine was started "
    "with the wrong --data-parallel-rank; stop the wrong engine, then restart the refused "
    "one (vLLM does not retry a refused registration)"
)


class BootstrapRegistry:
    """The registry's state and rule; see the module docstring."""

    def __init__(self, bounds: PayloadBounds, counters: Counter[str]) -> None:
        self.bounds = bounds
        self.entries: dict[int, DPEntry] = {}
        self.counters = counters
        self._generations = 0

    # ---- registrations -----------------------------------------------------------------

    def register(self, payload: RegisterWorkerPayload, now: float, *,
                 probed: bool = False) -> Decision:
        """Apply the rule to one (already bounded) registration."""
        dp, tp, pp, addr = payload.dp_rank, payload.tp_rank, payload.pp_rank, payload.addr
        entry = self.entries.get(dp)
        if entry is None:
            self._new_entry(payload, now)
            return Registered()
        evidence = entry.evidence()
        if evidence is not None:
            return self._replace(entry, payload, evidence, now)
        if entry.engine_id == payload.engine_id:
            existing = entry.workers.get(tp, {}).get(pp)
            if existing is None:
                entry.workers.setdefault(tp, {})[pp] = addr
                self.counters["kv_bootstrap.registrations"] += 1
                return Registered()
            if existing == addr:
                self.counters["kv_bootstrap.retries"] += 1
                return Registered(retry=True)
            if not probed:
                return self._probe(entry, (existing,))
            self.counters["kv_bootstrap.conflicts"] += 1
            return Conflict(
                f"worker dp_rank={dp}, tp_rank={tp}, pp_rank={pp} of engine "
                f"{entry.engine_id} is registered at {existing}, which still accepts "
                f"connections; refusing {addr} for engine {payload.engine_id}: "
                f"{CONFLICT_REMEDY}")
        if not probed:
            return self._probe(entry, entry.addresses())
        self.counters["kv_bootstrap.conflicts"] += 1
        live = ", ".join(entry.addresses()) or "(no workers)"
        return Conflict(
            f"Engine ID mismatch for dp_rank={dp}: engine {entry.engine_id} holds it and "
            f"its side channel ({live}) still accepts connections; refusing engine "
            f"{payload.engine_id} at {addr}: {CONFLICT_REMEDY}")

    def _new_entry(self, payload: RegisterWorkerPayload, now: float) -> DPEntry:
        self._generations += 1
        entry = DPEntry(payload.engine_id, self._generations, now,
                        {payload.tp_rank: {payload.pp_rank: payload.addr}})
        self.entries[payload.dp_rank] = entry
        self.counters["kv_bootstrap.registrations"] += 1
        return entry

    def _replace(self, old: DPEntry, payload: RegisterWorkerPayload, evidence: str,
                 now: float) -> Registered:
        self._new_entry(payload, now)
        self.counters["kv_bootstrap.replacements"] += 1
        return Registered(replaced=Replacement(payload.dp_rank, old.engine_id,
                                               payload.engine_id, evidence))

    def _probe(self, entry: DPEntry, addresses: tuple[str, ...]) -> ProbeNeeded:
        self.counters["kv_bootstrap.probes"] += 1
        dp = next(rank for rank, held in self.entries.items() if held is entry)
        return ProbeNeeded(dp, entry.generation, addresses)

    # ---- evidence ----------------------------------------------------------------------

    def probe_answered(self, probe: ProbeNeeded, alive: bool) -> bool:
        """Record a probe's outcome; True if it marked the entry gone.

        An outcome about an entry that was replaced meanwhile is ignored."""
        entry = self.entries.get(probe.dp_rank)
        if entry is None or entry.generation != probe.generation:
            return False
        if alive:
            entry.verified = True
            return False
        self.counters["kv_bootstrap.probes_gone"] += 1
        entry.gone = (f"its side channel ({', '.join(probe.addresses)}) accepts no "
                      "connection")
        return True

    def rank_died(self, rank: int) -> bool:
        """Membership saw ``rank`` die (it may revive); True if an entry is affected."""
        entry = self.entries.get(rank)
        if entry is None or entry.rank_dead or entry.gone is not None:
            return False
        entry.rank_dead = True
        return True

    def rank_revived(self, rank: int) -> bool:
        entry = self.entries.get(rank)
        if entry is None or not entry.rank_dead:
            return False
        entry.rank_dead = False
        return True

    def rank_superseded(self, rank: int, why: str) -> bool:
        """Membership saw ``rank``'s engine replaced or leave for good."""
        entry = self.entries.get(rank)
        if entry is None or entry.gone is not None:
            return False
        entry.gone = why
        return True

    # ---- queries -----------------------------------------------------------------------

    def complete(self, entry: DPEntry) -> bool:
        bounds = self.bounds
        return (len(entry.workers) == bounds.tp_size
                and all(len(by_pp) == bounds.pp_size for by_pp in entry.workers.values()))

    def query(self) -> dict[int, DPEntry]:
        """The live, current, complete entries (what a decoder may use)."""
        return {dp: entry for dp, entry in sorted(self.entries.items())
                if entry.evidence() is None and self.complete(entry)}

    def unverified(self) -> list[ProbeNeeded]:
        """Probes for the restored entries not checked yet (each asked for once)."""
        probes = []
        for dp, entry in sorted(self.entries.items()):
            if not entry.verified and not entry.check_asked and entry.gone is None:
                entry.check_asked = True
                self.counters["kv_bootstrap.probes"] += 1
                probes.append(ProbeNeeded(dp, entry.generation, entry.addresses()))
        return probes

    def state_of(self, entry: DPEntry) -> str:
        """One word for operators: live, incomplete, dead, gone, unverified."""
        if entry.gone is not None:
            return "gone"
        if entry.rank_dead:
            return "dead"
        if not entry.verified:
            return "unverified"
        return "live" if self.complete(entry) else "incomplete"

    # ---- the state file ----------------------------------------------------------------

    def saved(self) -> dict[int, tuple[str, Workers]]:
        """What a restart keeps: the entries not proven gone."""
        return {dp: (entry.engine_id, {tp: dict(by_pp) for tp, by_pp in entry.workers.items()})
                for dp, entry in sorted(self.entries.items()) if entry.gone is None}

    def restore(self, saved: dict[int, tuple[str, Workers]], now: float) -> list[str]:
        """Take back saved entries, unverified; the reasons for any skipped."""
        skipped = []
        bounds = self.bounds
        for dp, (engine_id, workers) in sorted(saved.items()):
            fits = (dp in bounds.dp_ranks
                    and all(0 <= tp < bounds.tp_size and all(0 <= pp < bounds.pp_size
                                                             for pp in by_pp)
                            for tp, by_pp in workers.items()))
            if not fits:
                skipped.append(f"dp_rank={dp} of engine {engine_id} does not fit the "
                               "configured group or TP/PP sizes")
                continue
            self._generations += 1
            self.entries[dp] = DPEntry(engine_id, self._generations, now,
                                       {tp: dict(by_pp) for tp, by_pp in workers.items()},
                                       verified=False)
        return skipped
