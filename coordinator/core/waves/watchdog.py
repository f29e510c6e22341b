"""Hang watchdog: a lockstep group that stopped stepping, or whose ranks disagree on the wave.

Theory of operation
-------------------
A lockstep (MoE) group hangs in a collective: one rank never enters it, the
others wait in it, and nothing moves until a 600 s NCCL timeout. From the
coordinator the hang looks like silence. The watchdog turns that silence into an
alert long before the timeout, from two observations:

* ``observe_stats(rank, wave, step, now)`` for every stats report. A rank made
  *progress* when its ``(wave, step)`` differs from its previous report (the
  first report counts too).
* ``observe_outputs(ranks, now)`` when a frontend's heartbeat says outputs of
  ``ranks`` reached it: they stepped. vLLM engines report stats only when
  their request counts change, so through a long steady decode this is the
  evidence that tells it from a hung collective (whose ranks produce no
  outputs); the project's own engines also repeat their stats, step counter
  included, while they step.
* ``observe_group(running, wave, ranks, now)`` whenever the group's wave state
  may have changed, and before each check: whether the coordinator believes the
  group is running, its current wave, and which ranks belong to the group. The
  group starting to run, or moving to another wave, counts as progress.

Two conditions are evaluated by small pure functions:

* ``no_progress`` (``stalled_since``): the group is believed running and no
  rank made progress for ``stall_after_s`` seconds. ``since`` is the moment of
  the last progress (or of the group starting to run, if later).
* ``wave_split`` (``split_waves``): among the ranks that reported within the
  last ``stall_after_s`` seconds, the latest reported waves differ, and have
  differed for ``stall_after_s`` seconds. Ranks that went quiet drop out, so an
  idle rank whose last report names an old wave cannot cause an alert; ranks
  momentarily on both sides of a wave boundary are normal and clear quickly.

Each condition is an *episode*: ``check(now)`` returns an alert only when a
condition starts firing, keeps it in ``active`` while it holds, and forgets it
once the condition ends, so the next occurrence alerts again. ``EPISODE`` is that
table. Progress ends ``no_progress`` at once; reports that agree end
``wave_split`` at once; ranks going quiet end it at the next check.

No IO, no clock: ``now`` is monotonic seconds from the caller.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

AlertKind: TypeAlias = Literal["no_progress", "wave_split"]
NO_PROGRESS: AlertKind = "no_progress"
WAVE_SPLIT: AlertKind = "wave_split"
ALERT_KINDS: tuple[AlertKind, ...] = (NO_PROGRESS, WAVE_SPLIT)

DEFAULT_STALL_AFTER_S = 30.0


@dataclass(frozen=True)
class WatchdogAlert:
    """A firing condition: what, since when (monotonic s), which ranks, and a log-ready message."""

    kind: AlertKind
    since: float
    message: str
    ranks: tuple[int, ...]

    def as_dict(self, now: float | None = None) -> dict[str, object]:
        out: dict[str, object] = {
            "kind": self.kind,
            "since": self.since,
            "message": self.message,
            "ranks": list(self.ranks),
        }
        if now is not None:
            out["for_s"] = round(now - self.since, 3)
        return out


@dataclass(slots=True)
class RankReport:
    """The latest stats report of one rank (updated in place: this is the hot path)."""

    wave: int
    step: int
    reported_at: float


# ---- the rules, as pure functions ------------------------------------------------------------


def stalled_since(
    *, running: bool, last_progress: float | None, now: float, stall_after_s: float
) -> float | None:
    """Start of a ``no_progress`` stall at ``now``, or None if the group is not stalled."""
    if not running or last_progress is None:
        return None
    return last_progress if now - last_progress >= stall_after_s else None


def fresh_waves(
    reports: Mapping[int, RankReport], ranks: Iterable[int], *, now: float, window_s: float
) -> dict[int, int]:
    """Latest wave of each rank in ``ranks`` that reported less than ``window_s`` ago."""
    out: dict[int, int] = {}
    for rank in ranks:
        report = reports.get(rank)
        if report is not None and now - report.reported_at < window_s:
            out[rank] = report.wave
    return out


def split_waves(waves: Mapping[int, int]) -> tuple[int, ...] | None:
    """Ranks behind the newest wave when the ranks' waves differ; None when they agree."""
    if len(set(waves.values())) < 2:
        return None
    newest = max(waves.values())
    return tuple(sorted(rank for rank, wave in waves.items() if wave < newest))


class FreshWaves:
    """How many watched ranks reported each wave within the window; two or more waves is a split.

    The same answer as ``split_waves(fresh_waves(...)) is not None``, kept current
    report by report in O(1) amortised instead of a pass over every rank: ranks
    sit in the order of their last report and leave from the front once that
    report is ``window_s`` old. ``report`` and ``expire`` return False when time
    went backwards; the caller then builds a new one (``build``).
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._order: OrderedDict[int, float] = OrderedDict()  # rank -> reported_at, oldest first
        self._waves: dict[int, int] = {}  # watched ranks in the window -> their counted wave
        self._counts: dict[int, int] = {}  # wave -> watched ranks in the window on it
        self._clock = -math.inf

    @classmethod
    def build(cls, reports: Mapping[int, RankReport], watched: Iterable[int], *, now: float,
              window_s: float) -> FreshWaves:
        fresh = cls(window_s)
        kept = [rank for rank in reports if now - reports[rank].reported_at < window_s]
        kept.sort(key=lambda rank: reports[rank].reported_at)
        watched_set = set(watched)
        for rank in kept:
            fresh._order[rank] = reports[rank].reported_at
            if rank in watched_set:
                fresh._count(rank, reports[rank].wave)
        # Later calls must not come before any report kept here, or the order breaks.
        fresh._clock = max([now, *(reports[rank].reported_at for rank in kept[-1:])])
        return fresh

    @property
    def split(self) -> bool:
        return len(self._counts) > 1

    def report(self, rank: int, wave: int, *, now: float, watched: bool) -> bool:
        if now < self._clock:
            return False
        self._clock = now
        order = self._order
        if rank in order and self._waves.get(rank) == (wave if watched else None):
            order.move_to_end(rank)  # the common case: same wave, still in the window
            order[rank] = now
            return True
        self._drop(rank)
        order[rank] = now
        if watched:
            self._count(rank, wave)
        return True

    def expire(self, now: float) -> bool:
        if now < self._clock:
            return False
        self._clock = now
        order = self._order
        while order:
            rank, reported_at = next(iter(order.items()))
            if now - reported_at < self.window_s:
                break
            self._drop(rank)
        return True

    def _count(self, rank: int, wave: int) -> None:
        self._waves[rank] = wave
        self._counts[wave] = self._counts.get(wave, 0) + 1

    def _drop(self, rank: int) -> None:
        if self._order.pop(rank, None) is None:
            return
        wave = self._waves.pop(rank, None)
        if wave is not None:
            left = self._counts[wave] - 1
            if left:
                self._counts[wave] = left
            else:
                del self._counts[wave]


class EpisodeStep(enum.Enum):
    QUIET = "quiet"  # not firing, not active: nothing to do
    ALERT = "alert"  # starts firing: a new alert
    ONGOING = "ongoing"  # still firing: already alerted
    CLEAR = "clear"  # stopped firing: forget, so the next episode alerts again


# (was active, is firing now) -> what happens
EPISODE: Mapping[tuple[bool, bool], EpisodeStep] = {
    (False, False): EpisodeStep.QUIET,
    (False, True): EpisodeStep.ALERT,
    (True, True): EpisodeStep.ONGOING,
    (True, False): EpisodeStep.CLEAR,
}


def describe_waves(waves: Mapping[int, int]) -> str:
    """``wave 5: ranks 0,1; wave 6: ranks 2`` (waves ascending)."""
    by_wave: dict[int, list[int]] = {}
    for rank, wave in sorted(waves.items()):
        by_wave.setdefault(wave, []).append(rank)
    return "; ".join(
        f"wave {wave}: ranks {','.join(map(str, ranks))}" for wave, ranks in sorted(by_wave.items())
    )


class HangWatchdog:
    """Raises ``no_progress`` and ``wave_split`` alerts, once per episode."""

    def __init__(self, *, stall_after_s: float = DEFAULT_STALL_AFTER_S) -> None:
        if not stall_after_s > 0:
            raise ValueError(f"watchdog stall time must be positive, got {stall_after_s}")
        self.stall_after_s = stall_after_s
        self._reports: dict[int, RankReport] = {}
        self._members: tuple[int, ...] | None = None
        self._member_set: frozenset[int] = frozenset()
        # Kept per report, so telling a split costs O(1), not a pass over every rank.
        self._fresh = FreshWaves(stall_after_s)
        self._running = False
        self._wave: int | None = None
        self._last_progress: float | None = None
        self._split_since: float | None = None
        self._active: dict[AlertKind, WatchdogAlert] = {}
        self.alerts_raised: dict[AlertKind, int] = dict.fromkeys(ALERT_KINDS, 0)

    # ---- observations ----------------------------------------------------------------------

    def observe_stats(self, rank: int, *, wave: int, step: int, now: float) -> None:
        """One stats report from ``rank``. O(1) unless waves may differ or an alert is active."""
        report = self._reports.get(rank)
        if report is None:
            self._reports[rank] = RankReport(wave, step, now)
            progressed = waves_may_differ = True
        else:
            wave_changed = report.wave != wave
            progressed = wave_changed or report.step != step
            # The set of fresh waves changes only when this rank's wave changes or the
            # rank comes back into the window; while split, any report may end it.
            waves_may_differ = (
                wave_changed
                or now - report.reported_at >= self.stall_after_s
                or self._split_since is not None
            )
            report.wave = wave
            report.step = step
            report.reported_at = now
        watched = self._members is None or rank in self._member_set
        if not self._fresh.report(rank, wave, now=now, watched=watched):
            self._rebuild_fresh(now)
        if progressed and watched:
            self._last_progress = now
        if waves_may_differ:
            self._update_split(now)
        if self._active:
            self._settle(now, report_new=False)

    def observe_outputs(self, ranks: Sequence[int], *, now: float) -> None:
        """Outputs of ``ranks`` reached a frontend since its last word: they stepped."""
        if self._members is None or any(rank in self._member_set for rank in ranks):
            self._last_progress = now
        if self._active:
            self._settle(now, report_new=False)

    def observe_group(
        self, *, running: bool, wave: int, ranks: Sequence[int], now: float
    ) -> None:
        """The group's believed state and membership (call on wave changes and before checks)."""
        if (running and not self._running) or (self._wave is not None and wave != self._wave):
            self._last_progress = now
        self._running = running
        self._wave = wave
        members = frozenset(ranks)
        if members != self._member_set or self._members is None:
            self._member_set = members
            self._members = tuple(sorted(members))
            self._rebuild_fresh(now)
        self._update_split(now)
        self._settle(now, report_new=False)

    # ---- evaluation ------------------------------------------------------------------------

    def check(self, now: float) -> list[WatchdogAlert]:
        """Alerts that start firing now (an ongoing condition is not repeated)."""
        self._update_split(now)
        return self._settle(now, report_new=True)

    @property
    def active(self) -> list[WatchdogAlert]:
        """Conditions firing as of the last check or observation, in kind order."""
        return [self._active[kind] for kind in ALERT_KINDS if kind in self._active]

    def report_age(self, rank: int, now: float) -> float | None:
        """Seconds since ``rank``'s last stats report (None: it never reported)."""
        report = self._reports.get(rank)
        return None if report is None else now - report.reported_at

    def last_progress_age(self, now: float) -> float | None:
        """Seconds since any watched rank last made progress (None before any)."""
        return None if self._last_progress is None else now - self._last_progress

    # ---- internals -------------------------------------------------------------------------

    def _settle(self, now: float, *, report_new: bool) -> list[WatchdogAlert]:
        """Apply ``EPISODE`` to both conditions; only ``check`` may start an episode."""
        new: list[WatchdogAlert] = []
        for kind in ALERT_KINDS:
            alert = self._firing(kind, now)
            step = EPISODE[(kind in self._active, alert is not None)]
            if step is EpisodeStep.CLEAR:
                del self._active[kind]
            elif step is EpisodeStep.ALERT and alert is not None and report_new:
                self._active[kind] = alert
                self.alerts_raised[kind] += 1
                new.append(alert)
        return new

    def _firing(self, kind: AlertKind, now: float) -> WatchdogAlert | None:
        if kind == NO_PROGRESS:
            return self._no_progress_alert(now)
        return self._wave_split_alert(now)

    def _watched(self) -> tuple[int, ...]:
        return self._members if self._members is not None else tuple(sorted(self._reports))

    def _rebuild_fresh(self, now: float) -> None:
        self._fresh = FreshWaves.build(self._reports, self._watched(), now=now,
                                       window_s=self.stall_after_s)

    def _update_split(self, now: float) -> None:
        if not self._fresh.expire(now):
            self._rebuild_fresh(now)
        if not self._fresh.split:
            self._split_since = None
        elif self._split_since is None:
            self._split_since = now

    def _no_progress_alert(self, now: float) -> WatchdogAlert | None:
        since = stalled_since(
            running=self._running,
            last_progress=self._last_progress,
            now=now,
            stall_after_s=self.stall_after_s,
        )
        if since is None:
            return None
        ranks = self._watched()
        steps = ", ".join(
            f"rank {rank} at wave {report.wave} step {report.step}"
            for rank in ranks
            if (report := self._reports.get(rank)) is not None
        )
        silent = [rank for rank in ranks if rank not in self._reports]
        message = (
            f"wave {self._wave} is believed running but no rank has reported progress for "
            f"{now - since:.1f} s (limit {self.stall_after_s:g} s): a collective may be hung "
            f"(or a long steady decode whose outputs no frontend heartbeat reported: "
            f"engines' stats come only on changes). Last reports: {steps or 'none'}"
            + (f"; never reported: ranks {','.join(map(str, silent))}" if silent else "")
        )
        return WatchdogAlert(NO_PROGRESS, since, message, ranks)

    def _wave_split_alert(self, now: float) -> WatchdogAlert | None:
        since = self._split_since
        if since is None or now - since < self.stall_after_s:
            return None
        waves = fresh_waves(self._reports, self._watched(), now=now, window_s=self.stall_after_s)
        behind = split_waves(waves) or ()  # a split: _update_split ran just before
        message = (
            f"ranks have reported different waves for {now - since:.1f} s "
            f"(limit {self.stall_after_s:g} s): {describe_waves(waves)}; ranks "
            f"{','.join(map(str, behind))} may have missed a START_DP_WAVE"
        )
        return WatchdogAlert(WAVE_SPLIT, since, message, behind)
