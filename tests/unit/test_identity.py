"""Engine identities: a DP rank is exactly two little-endian bytes, nothing else."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.protocol import (
    IDENTITY_LENGTH,
    MAX_RANK,
    IdentityError,
    ProtocolError,
    RankRangeError,
    check_rank_in_range,
    identity_to_rank,
    rank_to_identity,
)

FAST = settings(max_examples=300, deadline=None)


def expected_identity_message(identity: bytes) -> str:
    return f"coordinator requires a Python-compatible two-byte engine id, got {identity!r}"


def test_constants() -> None:
    assert IDENTITY_LENGTH == 2
    assert MAX_RANK == 65535


@pytest.mark.parametrize(
    ("rank", "identity"),
    [(0, b"\x00\x00"), (1, b"\x01\x00"), (258, b"\x02\x01"), (65535, b"\xff\xff")],
)
def test_known_identities(rank: int, identity: bytes) -> None:
    assert rank_to_identity(rank) == identity
    assert identity_to_rank(identity) == rank


def test_every_two_byte_value_round_trips() -> None:
    # 65536 values: cheap enough to check them all rather than sample.
    for rank in range(MAX_RANK + 1):
        identity = rank_to_identity(rank)
        assert len(identity) == 2
        assert identity_to_rank(identity) == rank


@FAST
@given(st.binary(min_size=2, max_size=2))
def test_two_byte_identity_round_trips(identity: bytes) -> None:
    rank = identity_to_rank(identity)
    assert rank == int.from_bytes(identity, "little")
    assert 0 <= rank <= MAX_RANK
    assert rank_to_identity(rank) == identity


@FAST
@given(st.integers(min_value=0, max_value=MAX_RANK))
def test_rank_round_trips(rank: int) -> None:
    assert identity_to_rank(rank_to_identity(rank)) == rank


@pytest.mark.parametrize("length", [0, 1, 3, 4, 5, 6, 7, 8])
def test_other_lengths_are_refused(length: int) -> None:
    identity = bytes(range(1, length + 1))
    with pytest.raises(IdentityError) as info:
        identity_to_rank(identity)
    assert str(info.value) == expected_identity_message(identity)
    assert info.value.reason == "identity_length"


@FAST
@given(st.binary(max_size=64).filter(lambda b: len(b) != 2))
def test_any_other_length_is_refused_with_the_searchable_message(identity: bytes) -> None:
    with pytest.raises(IdentityError) as info:
        identity_to_rank(identity)
    assert str(info.value) == expected_identity_message(identity)
    assert info.value.message == expected_identity_message(identity)
    # Callers catch the base class to drop any bad peer input.
    assert isinstance(info.value, ProtocolError)
    assert isinstance(info.value, ValueError)


def test_message_shows_the_bytes_as_python_repr() -> None:
    with pytest.raises(IdentityError, match=r"got b'\\x01\\x02\\x03'$"):
        identity_to_rank(b"\x01\x02\x03")
    with pytest.raises(IdentityError, match=r"got b'abcd'$"):
        identity_to_rank(b"abcd")


@FAST
@given(st.integers(max_value=-1))
def test_rank_to_identity_refuses_negative_ranks(rank: int) -> None:
    with pytest.raises(RankRangeError) as info:
        rank_to_identity(rank)
    assert info.value.rank == rank
    assert info.value.reason == "rank_out_of_range"
    assert f"dp_rank={rank}" in str(info.value)
    assert "valid ranks are 0..65535" in str(info.value)


@FAST
@given(st.integers(min_value=MAX_RANK + 1))
def test_rank_to_identity_refuses_ranks_that_do_not_fit_two_bytes(rank: int) -> None:
    with pytest.raises(RankRangeError) as info:
        rank_to_identity(rank)
    assert f"dp_rank={rank}" in str(info.value)
    assert "valid ranks are 0..65535" in str(info.value)


@FAST
@given(
    start=st.integers(min_value=0, max_value=1000),
    count=st.integers(min_value=1, max_value=1000),
    data=st.data(),
)
def test_check_rank_in_range_accepts_exactly_the_range(
    start: int, count: int, data: st.DataObject
) -> None:
    inside = data.draw(st.integers(min_value=start, max_value=start + count - 1))
    assert check_rank_in_range(inside, start, count) == inside
    outside = data.draw(
        st.integers(max_value=start - 1) | st.integers(min_value=start + count), label="outside"
    )
    with pytest.raises(RankRangeError) as info:
        check_rank_in_range(outside, start, count)
    error = info.value
    assert (error.rank, error.start, error.count) == (outside, start, count)
    assert error.reason == "rank_out_of_range"
    assert isinstance(error, ProtocolError)
    text = str(error)
    assert f"dp_rank={outside}" in text
    assert f"valid ranks are {start}..{start + count - 1}" in text
    # The message tells the operator what to change.
    assert "--rank-start" in text


def test_range_error_with_no_configured_ranks() -> None:
    with pytest.raises(RankRangeError) as info:
        check_rank_in_range(0, 0, 0)
    assert "no ranks are configured" in str(info.value)
    assert "dp_rank=0" in str(info.value)


def test_range_bounds_are_inclusive_exclusive() -> None:
    assert check_rank_in_range(4, 4, 2) == 4
    assert check_rank_in_range(5, 4, 2) == 5
    for rank in (3, 6):
        with pytest.raises(RankRangeError, match=f"dp_rank={rank} .*valid ranks are 4..5"):
            check_rank_in_range(rank, 4, 2)
