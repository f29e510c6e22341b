"""Shared fixtures: coordinator processes on ipc or tcp, and a ZMQ context.

    def test_something(coordinator, zmq_ctx):
        handle = coordinator(engines=4, transport="tcp", extra_args=["--heartbeat-s", "0.5"])
        handle.addresses["handshake"]   # where engines connect

Every process started through `coordinator` is shut down in teardown; if it
died during the test, its stderr is printed so the failure report shows why.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import pytest
import zmq
from hypothesis import settings

from coordinator.launch import CoordinatorHandle, launch

# Property and state-machine tests explore new examples on every run here, which is how
# they find bugs; CI (`.ci/run` sets HYPOTHESIS_PROFILE=ci) runs a fixed set instead, so
# that a landing is judged on the examples its author ran too.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

TRANSPORTS = ("ipc", "tcp")

# Which vLLM releases the compat suite runs each version-parametrised test against
# (`--vllm-versions` or DP_VLLM_VERSIONS: a comma-separated list, or "all").
# By default the newest and the oldest supported; `make compat-matrix` runs all.
VLLM_VERSIONS_ENV = "DP_VLLM_VERSIONS"
DEFAULT_VLLM_VERSIONS = "0.29.0,0.33.0"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--vllm-versions", default=None, metavar="V[,V...]|all",
                     help=f"vLLM releases for the version-parametrised compat tests "
                     f"(default ${VLLM_VERSIONS_ENV} or {DEFAULT_VLLM_VERSIONS})")


def selected_vllm_versions(config: pytest.Config) -> list[str]:
    from tools.vllm_wheel import PINNED_WHEELS, VERSIONS

    text = (config.getoption("--vllm-versions") or os.environ.get(VLLM_VERSIONS_ENV)
            or DEFAULT_VLLM_VERSIONS)
    names = [name.strip() for name in text.split(",") if name.strip()]
    if "all" in names:
        return list(VERSIONS)
    unknown = [name for name in names if name not in PINNED_WHEELS]
    if unknown or not names:
        raise pytest.UsageError(f"--vllm-versions / {VLLM_VERSIONS_ENV}: {text!r} names "
                                f"{', '.join(unknown) or 'nothing'}; pinned: "
                                f"{', '.join(VERSIONS)} (or 'all')")
    return list(dict.fromkeys(names))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "vllm_version" in metafunc.fixturenames:
        metafunc.parametrize("vllm_version", selected_vllm_versions(metafunc.config),
                             scope="module")

# sun_path holds 108 bytes; leave room for the longest socket key.
_MAX_IPC_DIR = 80


class CoordinatorFactory(Protocol):
    def __call__(
        self,
        engines: int,
        *,
        transport: str = "ipc",
        frontends: int = 0,
        lockstep: bool = True,
        rank_start: int = 0,
        extra_args: Sequence[str] = (),
    ) -> CoordinatorHandle: ...


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A private ZMQ context; every socket on it is closed (linger 0) in teardown."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorFactory]:
    """Start `python -m coordinator serve` processes; all are stopped in teardown.

    transport "ipc" binds in a directory under tmp_path (or a short temp dir
    when tmp_path is too long for a unix socket path); "tcp" binds 127.0.0.1.
    """
    started: list[CoordinatorHandle] = []
    scratch: list[str] = []

    def start(
        engines: int,
        *,
        transport: str = "ipc",
        frontends: int = 0,
        lockstep: bool = True,
        rank_start: int = 0,
        extra_args: Sequence[str] = (),
    ) -> CoordinatorHandle:
        index = len(started)
        args = list(extra_args)
        host: str | None = None
        if transport == "tcp":
            host = "127.0.0.1"
        elif transport == "ipc":
            ipc_dir = str(tmp_path / f"ipc{index}")
            if len(ipc_dir) > _MAX_IPC_DIR:
                ipc_dir = tempfile.mkdtemp(prefix="dpc-")
                scratch.append(ipc_dir)
            args += ["--ipc-dir", ipc_dir]
        else:
            raise ValueError(f"unknown transport {transport!r}")
        handle = launch(
            engines=engines,
            frontends=frontends,
            rank_start=rank_start,
            host=host,
            lockstep=lockstep,
            addr_file=str(tmp_path / f"addresses{index}.json"),
            extra_args=args,
            timeout=20.0,
        )
        started.append(handle)
        return handle

    yield start

    for handle in started:
        died = handle.returncode
        code = handle.shutdown(timeout=5.0)
        if died is not None or code != 0:
            print(f"coordinator pid {handle.pid} exit code {code} (died during test: "
                  f"{died is not None}); stderr tail:\n{handle.stderr_text()[-4000:]}")
    for directory in scratch:
        shutil.rmtree(directory, ignore_errors=True)
