"""The ranks this coordinator manages now: ``rank_start`` up to an end that
``SCALE_ELASTIC_EP`` may move. One ``RankSpan`` is shared by the domains, so a
resize is seen by all of them at once."""

from __future__ import annotations


class RankSpan:
    """``range(start, end)``, with the end movable by a resize."""

    __slots__ = ("end", "start")

    def __init__(self, start: int, count: int) -> None:
        self.start = start
        self.end = start + count

    @property
    def range(self) -> range:
        return range(self.start, self.end)

    def __contains__(self, rank: int) -> bool:
        return self.start <= rank < self.end

    def __len__(self) -> int:
        return self.end - self.start
