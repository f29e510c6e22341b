"""core/ranks/versions.py: a rank's vLLM version against the supported range."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator import vllm_plugin
from coordinator.core.ranks.versions import (
    SUPPORTED_RANGE,
    SUPPORTED_RELEASES,
    VersionAction,
    check_version,
    is_supported,
    parse_release,
)
from tools.vllm_wheel import VERSIONS


def test_the_range_is_the_pinned_releases_and_the_plugin_gate() -> None:
    pinned = {tuple(int(x) for x in v.split(".")[:2]) for v in VERSIONS}
    assert pinned == SUPPORTED_RELEASES == vllm_plugin.TARGETED_RELEASES
    assert SUPPORTED_RANGE == vllm_plugin.targeted_range() == "0.29.x to 0.33.x"


@pytest.mark.parametrize(("version", "release"), [
    ("0.33.0", (0, 33, 0)), ("0.29.1.post2", (0, 29, 1)), (" 0.30.0+cu129 ", (0, 30, 0)),
    ("0.33.0rc1", None), ("0.34.0.dev12+g4ba787ec9", None), ("0.33", None), ("", None),
    ("dev", None), ("0.033.0x", None),
])
def test_parse_release(version: str, release: tuple[int, int, int] | None) -> None:
    assert parse_release(version) == release


@given(st.integers(0, 3), st.integers(0, 60), st.integers(0, 20),
       st.sampled_from(["", ".post1", "+cu129", ".post3+rocm"]))
def test_a_final_release_is_supported_exactly_when_its_minor_is(
        major: int, minor: int, patch: int, suffix: str) -> None:
    version = f"{major}.{minor}.{patch}{suffix}"
    supported = (major, minor) in SUPPORTED_RELEASES
    assert is_supported(version) is supported
    for require in (False, True):
        check = check_version(3, version, require_supported=require)
        if supported:
            assert check.action is VersionAction.ACCEPT and check.message == ""
        else:
            assert check.action is (VersionAction.REFUSE if require else VersionAction.WARN)
            assert f"dp_rank=3 runs vLLM {version!r}" in check.message
            assert SUPPORTED_RANGE in check.message


@pytest.mark.parametrize(("version", "why"), [
    ("0.28.2", "older than the oldest supported release"),
    ("0.34.0", "newer than the newest supported release"),
    ("1.0.0", "newer than the newest supported release"),
    ("0.33.0rc1", "a pre-release or development build"),
    ("0.31.1.dev3+gabc", "a pre-release or development build"),
    ("0.35.0.dev1", "a pre-release or development build"),
    ("garbage", "not a vLLM release version"),
])
def test_the_message_says_why(version: str, why: str) -> None:
    warn = check_version(0, version, require_supported=False)
    assert warn.action is VersionAction.WARN and why in warn.message
    assert "it is used, but untested here" in warn.message
    assert "--require-supported-vllm refuses such ranks" in warn.message
    refuse = check_version(0, version, require_supported=True)
    assert refuse.action is VersionAction.REFUSE and why in refuse.message
    assert refuse.message.endswith("refused (--require-supported-vllm)")


def test_the_flag_reaches_the_core_config() -> None:
    from coordinator.cli import build_parser
    from coordinator.server.config import ServerConfig

    parser = build_parser()
    assert parser.parse_args(["serve", "--engines", "2", "--require-supported-vllm"]
                             ).require_supported_vllm is True
    assert parser.parse_args(["serve", "--engines", "2"]).require_supported_vllm is False
    assert ServerConfig(engines=2, require_supported_vllm=True
                        ).core_config().require_supported_vllm is True
    assert ServerConfig(engines=2).core_config().require_supported_vllm is False
