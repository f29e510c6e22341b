"""The operator-authority table and the resize bounds (``core.authority``), row by row."""

from __future__ import annotations

import pytest

from coordinator.core.ranks.authority import (
    Authority,
    authority,
    not_authorized_message,
    resize_refusal,
)

ADMIN = "A" * 40
OTHER = "B" * 40


@pytest.mark.parametrize(("channel", "user_id", "verdict"), [
    ("admin", None, Authority.OPERATOR),
    ("admin", OTHER, Authority.OPERATOR),
    ("frontend", ADMIN, Authority.OPERATOR),
    ("frontend", OTHER, Authority.REFUSED),
    ("frontend", None, Authority.REFUSED),
])
def test_every_row_of_the_authority_table(channel: str, user_id: str | None,
                                          verdict: Authority) -> None:
    assert authority(channel, user_id, {ADMIN}) is verdict  # type: ignore[arg-type]


def test_no_admin_keys_means_no_operator_on_the_frontend_socket() -> None:
    assert authority("frontend", ADMIN, frozenset()) is Authority.REFUSED


def test_the_refusal_says_how_an_operator_gets_through() -> None:
    message = not_authorized_message("drain")
    assert message.startswith("drain changes membership and needs an operator")
    assert "`dp-coordinator drain`" in message and "--admin-keys-dir" in message


@pytest.mark.parametrize(("count", "low", "high", "refused"), [
    (4, 4, 4, False),
    (5, 4, 4, True),
    (3, 4, 4, True),
    (65536, 4, 4, True),
    (1, 1, 8, False),
    (8, 1, 8, False),
    (9, 1, 8, True),
    (0, 1, 8, True),
])
def test_resize_bounds(count: int, low: int, high: int, refused: bool) -> None:
    refusal = resize_refusal(count, current=4, min_engines=low, max_engines=high)
    assert (refusal is not None) == refused
    if refused and low == high:
        assert refusal == (f"SCALE_ELASTIC_EP to {count} ranks refused: the group size is fixed "
                           "at 4 (start the coordinator with --min-engines/--max-engines to let "
                           "elastic EP resize it)")
    elif refused:
        assert refusal is not None and f"allows {low}..{high}" in refusal
