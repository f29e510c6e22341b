"""Fixtures for the multi-host tests: is a sandbox possible here, and one per test.

Whether this machine can build network namespaces is probed once per session
(`sandbox.probe`). Where it cannot (not root, no `ip`, no CAP_NET_ADMIN, `ip
netns add` refused), every test here is skipped with the reason; with
`DPC_NETNS_REQUIRED=1` (set by `make netns-test`) it fails instead, so that a
run that was meant to exercise the network does not pass by skipping.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator

import pytest

from tests.netns import sandbox as sandbox_module
from tests.netns.sandbox import Sandbox

REQUIRED_ENV = "DPC_NETNS_REQUIRED"

# Sandboxes alive right now; an exit that skips fixture teardown still removes them.
_live: list[Sandbox] = []


def _destroy_live() -> None:
    for sandbox in list(_live):
        sandbox.destroy()
    _live.clear()


atexit.register(_destroy_live)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "netns: builds network namespaces (needs root; see tests/netns/README.md)"
    )


@pytest.fixture(scope="session")
def netns_ready() -> None:
    """Skip (or, when required, fail) unless namespaces can be built here."""
    reason = sandbox_module.probe()
    if reason is None:
        sandbox_module.sweep_stale()
        return
    if os.environ.get(REQUIRED_ENV, "") not in ("", "0"):
        pytest.fail(f"{REQUIRED_ENV} is set but network namespaces are unavailable: {reason}")
    pytest.skip(f"network namespaces unavailable: {reason}")


def make_sandbox(hosts: list[str]) -> Sandbox:
    """A sandbox that is destroyed at exit if its owner's teardown never ran."""
    built = Sandbox.create(hosts)
    _live.append(built)
    return built


def release_sandbox(built: Sandbox) -> None:
    built.destroy()
    if built in _live:
        _live.remove(built)


@pytest.fixture
def sandbox(netns_ready: None) -> Iterator[Sandbox]:
    """Three hosts (coord, hosta, hostb) on one switch; removed after the test."""
    built = make_sandbox(["coord", "hosta", "hostb"])
    try:
        yield built
    finally:
        release_sandbox(built)
