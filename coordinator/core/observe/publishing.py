"""When to send the next full `[counts, wave, running]` publish to front-ends.

Theory of operation
-------------------
The schedule is a pure function of three monotonic times: when the gate
opened (`start`), when the last full publish went out (`published`), and
whether the load table has unpublished changes (passed in by the caller):

* before `start`: never;
* first publish after `start`: `first_publish_delay_s` after it (and never
  closer than `min_interval_s` to a publish made before `start`);
* afterwards, while changed: `min_interval_s` after the last publish;
* afterwards, while unchanged: a heartbeat `heartbeat_s` after the last one.

Wave-change publishes (`[nil, wave, running]`) are sent at once by the caller
and are not full publishes, so they do not move this schedule.

The deadline never depends on whether input is arriving. vLLM 0.33 publishes
only when its poll times out with no input, so a steady stream of engine
reports can starve publishing there; here a busy caller only has to ask
`due(now, ...)` (or sleep until `next_due(...)`) between messages.
"""

from __future__ import annotations

import math


class PublishSchedule:
    """Deadlines for full publishes; `due` and `next_due` always agree."""

    def __init__(
        self,
        *,
        min_interval_s: float = 0.1,
        heartbeat_s: float = 5.0,
        first_publish_delay_s: float = 0.05,
    ) -> None:
        if not min_interval_s > 0:
            raise ValueError(f"min_interval_s must be > 0, got {min_interval_s}")
        if not heartbeat_s >= min_interval_s:
            raise ValueError(
                f"heartbeat_s must be >= min_interval_s ({min_interval_s}), got {heartbeat_s}"
            )
        if not first_publish_delay_s >= 0:
            raise ValueError(f"first_publish_delay_s must be >= 0, got {first_publish_delay_s}")
        if math.isinf(heartbeat_s) or math.isinf(first_publish_delay_s):
            raise ValueError("publish intervals must be finite")
        self.min_interval_s = min_interval_s
        self.heartbeat_s = heartbeat_s
        self.first_publish_delay_s = first_publish_delay_s
        self._first_due: float | None = None
        self._awaiting_first = False
        self._last_publish: float | None = None

    @property
    def started(self) -> bool:
        return self._first_due is not None

    @property
    def last_publish(self) -> float | None:
        """Monotonic time of the last full publish, or None if there was none."""
        return self._last_publish

    def start(self, now: float) -> None:
        """The gate opened: the first publish is due `first_publish_delay_s` from now."""
        self._first_due = now + self.first_publish_delay_s
        self._awaiting_first = True

    def next_due(self, *, changed: bool) -> float:
        """Monotonic deadline of the next full publish (`math.inf` before `start`)."""
        if self._first_due is None:
            return math.inf
        last = self._last_publish
        # A publish is always recorded by the time the first one is no longer awaited.
        if self._awaiting_first or last is None:
            if last is None:
                return self._first_due
            return max(self._first_due, last + self.min_interval_s)
        interval = self.min_interval_s if changed else self.heartbeat_s
        return last + interval

    def due(self, now: float, *, changed: bool) -> bool:
        """True once `now` has reached `next_due(changed=changed)`."""
        return now >= self.next_due(changed=changed)

    def published(self, now: float) -> None:
        """A full publish went out at `now`."""
        self._last_publish = now
        if self._first_due is not None:
            self._awaiting_first = False
