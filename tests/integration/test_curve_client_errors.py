"""What a client is told when its CURVE set-up does not match the coordinator's.

Real coordinator processes on tcp://127.0.0.1, one with CURVE keys and one
without, and real clients: the frontend SDK, the engine SDK, `status`, `top`
and `cordon`. For each mismatch (a key the coordinator does not list, no key
against a coordinator that requires one, a key against a coordinator that has
none, the wrong server key) the client must say what is wrong instead of "did
not answer"; where libzmq gives the connection up, it must say so before its
timeout runs out. A listed key is the control: everything answers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from coordinator import _zmq
from coordinator.cli import main
from coordinator.cli.keygen import generate_keypair
from coordinator.engine import EngineAgent, EngineHandshakeFailed, EngineStartupTimeout
from coordinator.frontend import CoordinatorTimeout, FrontendClient, HandshakeFailed
from coordinator.launch import CoordinatorHandle
from tests.conftest import CoordinatorFactory

pytestmark = pytest.mark.timeout(90)

# Long enough that an answer "at once" and one at the timeout cannot be confused.
PATIENT_S = 20.0

REFUSED = "refused our CURVE key"
REQUIRED = "requires CURVE keys"
HAS_NONE = "has no CURVE keys"
WRONG_SERVER_KEY = "most likely not this coordinator's public key"


@dataclass(frozen=True)
class Keys:
    server_secret: str
    server_public: str
    clients_dir: str
    client_secret: str
    stranger_secret: str
    stranger_public: str


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    server_public, server_secret = generate_keypair(str(tmp_path / "server"), "coordinator")
    client_public, client_secret = generate_keypair(str(tmp_path / "client"), "client")
    stranger_public, stranger_secret = generate_keypair(str(tmp_path / "stranger"), "stranger")
    clients = tmp_path / "allowed"
    clients.mkdir()
    (clients / "client.key").write_bytes(Path(client_public).read_bytes())
    return Keys(server_secret, server_public, str(clients), client_secret, stranger_secret,
                stranger_public)


def curve_coordinator(coordinator: CoordinatorFactory, keys: Keys) -> CoordinatorHandle:
    return coordinator(1, transport="tcp", extra_args=[
        "--curve-secret-key", keys.server_secret, "--curve-clients-dir", keys.clients_dir])


def key_options(secret: str | None, server: str | None) -> list[str]:
    options = []
    if secret is not None:
        options += ["--curve-secret-key", secret]
    if server is not None:
        options += ["--curve-server-key", server]
    return options


def run_cli(capsys: pytest.CaptureFixture[str], args: Sequence[str]) -> tuple[int, str, float]:
    """One command in this process; its exit code, stderr and how long it took."""
    capsys.readouterr()
    started = time.monotonic()
    code = main(list(args))
    took = time.monotonic() - started
    return code, capsys.readouterr().err, took


async def frontend_call(handle: CoordinatorHandle, secret: str | None, server: str | None,
                        *, timeout: float) -> tuple[BaseException | None, float]:
    """A state query through the frontend SDK; the error it raised and how long it took."""
    client = FrontendClient(handle.addresses, host="127.0.0.1", curve_secret_key=secret,
                            curve_server_key=server)
    started = time.monotonic()
    try:
        await client.query_state(timeout=timeout)
    except Exception as exc:
        return exc, time.monotonic() - started
    finally:
        await client.close()
    return None, time.monotonic() - started


async def engine_start(handle: CoordinatorHandle, secret: str | None, server: str | None,
                       *, timeout: float) -> tuple[BaseException | None, float]:
    agent = EngineAgent(handle.addresses["handshake"], 0, handshake_timeout_s=timeout,
                        ready_timeout_s=timeout, accept_timeout_s=timeout,
                        curve_secret_key=secret, curve_server_key=server)
    started = time.monotonic()
    try:
        await asyncio.wait_for(agent.start(), timeout + 10)
    except Exception as exc:
        return exc, time.monotonic() - started
    await agent.close(linger_s=0)
    return None, time.monotonic() - started


# ---- the control ---------------------------------------------------------------------------


async def test_a_listed_key_gets_answers_from_every_client(
    coordinator: CoordinatorFactory, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    handle = curve_coordinator(coordinator, keys)
    error, _ = await frontend_call(handle, keys.client_secret, keys.server_public,
                                   timeout=PATIENT_S)
    assert error is None
    error, _ = await engine_start(handle, keys.client_secret, keys.server_public,
                                  timeout=PATIENT_S)
    assert error is None
    code, err, _ = run_cli(capsys, ["status", "--addr-file", handle.addr_file, "--json",
                                    *key_options(keys.client_secret, keys.server_public)])
    assert code == 0, err


# ---- a key the coordinator does not list ---------------------------------------------------


async def test_an_unlisted_key_is_told_it_was_refused_at_once(
    coordinator: CoordinatorFactory, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    handle = curve_coordinator(coordinator, keys)
    stranger = (keys.stranger_secret, keys.server_public)

    error, took = await frontend_call(handle, *stranger, timeout=PATIENT_S)
    assert isinstance(error, HandshakeFailed), error
    assert error.failure.kind == _zmq.KEY_REFUSED and error.failure.final
    assert REFUSED in str(error) and handle.addresses["frontend"] in str(error)
    assert "--curve-clients-dir" in str(error)
    assert took < PATIENT_S

    error, took = await engine_start(handle, *stranger, timeout=PATIENT_S)
    assert isinstance(error, EngineHandshakeFailed), error
    assert error.stage == "init" and error.failure.kind == _zmq.KEY_REFUSED
    assert str(error).startswith("rank 0: ") and REFUSED in str(error)
    assert took < PATIENT_S

    options = key_options(*stranger)
    for command in (["status", "--addr-file", handle.addr_file, "--timeout", str(PATIENT_S)],
                    ["top", "--addr-file", handle.addr_file, "--once",
                     "--timeout", str(PATIENT_S)],
                    ["cordon", "0", "--addr-file", handle.addr_file,
                     "--timeout", str(PATIENT_S)]):
        code, err, took = run_cli(capsys, [*command, *options])
        assert code != 0, command
        assert REFUSED in err and "did not answer" not in err, (command, err)
        assert took < PATIENT_S, command
    # The coordinator kept serving the listed client.
    error, _ = await frontend_call(handle, keys.client_secret, keys.server_public,
                                   timeout=PATIENT_S)
    assert error is None


# ---- no key against a coordinator that requires one ----------------------------------------


async def test_a_client_without_keys_is_told_the_coordinator_requires_them(
    coordinator: CoordinatorFactory, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    handle = curve_coordinator(coordinator, keys)

    error, took = await frontend_call(handle, None, None, timeout=PATIENT_S)
    assert isinstance(error, HandshakeFailed), error
    assert error.failure.kind == _zmq.CURVE_REQUIRED and REQUIRED in str(error)
    assert "--curve-secret-key" in str(error) and "curve_secret_key=" in str(error)
    assert took < PATIENT_S

    error, took = await engine_start(handle, None, None, timeout=PATIENT_S)
    assert isinstance(error, EngineHandshakeFailed), error
    assert error.failure.kind == _zmq.CURVE_REQUIRED and took < PATIENT_S

    code, err, took = run_cli(capsys, ["status", "--addr-file", handle.addr_file,
                                       "--timeout", str(PATIENT_S)])
    assert code == 1 and REQUIRED in err and took < PATIENT_S, err


async def test_publishes_wait_fails_the_same_way(
    coordinator: CoordinatorFactory, keys: Keys
) -> None:
    """The XSUB on front_publish has the same handshake; wait_for() says why it sees nothing."""
    handle = curve_coordinator(coordinator, keys)
    client = FrontendClient(handle.addresses, host="127.0.0.1")
    try:
        await client.start()
        started = time.monotonic()
        with pytest.raises(HandshakeFailed) as caught:
            await client.wait_for(lambda c: c.stats["publishes"] > 0, timeout=PATIENT_S)
        assert caught.value.failure.kind == _zmq.CURVE_REQUIRED
        assert handle.addresses["front_publish"] in str(caught.value)
        assert time.monotonic() - started < PATIENT_S
    finally:
        await client.close()


# ---- keys against a coordinator that has none ----------------------------------------------


async def test_a_client_with_keys_is_told_the_coordinator_has_none(
    coordinator: CoordinatorFactory, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    handle = coordinator(1, transport="tcp")
    with_keys = (keys.client_secret, keys.server_public)

    error, took = await frontend_call(handle, *with_keys, timeout=PATIENT_S)
    assert isinstance(error, HandshakeFailed), error
    assert error.failure.kind == _zmq.CURVE_NOT_OFFERED and HAS_NONE in str(error)
    assert took < PATIENT_S

    error, took = await engine_start(handle, *with_keys, timeout=PATIENT_S)
    assert isinstance(error, EngineHandshakeFailed), error
    assert error.failure.kind == _zmq.CURVE_NOT_OFFERED and took < PATIENT_S

    code, err, took = run_cli(capsys, ["status", "--addr-file", handle.addr_file,
                                       "--timeout", str(PATIENT_S), *key_options(*with_keys)])
    assert code == 1 and HAS_NONE in err and took < PATIENT_S, err


async def test_a_short_wait_still_names_the_mismatch(
    coordinator: CoordinatorFactory, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    """The server may close the connection before the client has read its greeting, and
    libzmq then retries; a wait that ends before a retry saw the mismatch still says
    which one it most likely is."""
    with_curve = curve_coordinator(coordinator, keys)
    plain = coordinator(1, transport="tcp")
    for handle, options, words in (
            (with_curve, [], REQUIRED),
            (plain, key_options(keys.client_secret, keys.server_public), HAS_NONE)):
        for _ in range(3):
            code, err, _ = run_cli(capsys, ["status", "--addr-file", handle.addr_file,
                                            "--timeout", "0.3", *options])
            assert code == 1 and words in err and "did not answer" not in err, err


# ---- the wrong server key ------------------------------------------------------------------


async def test_the_wrong_server_key_is_named_when_the_wait_ends(
    coordinator: CoordinatorFactory, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    """The coordinator cannot read a handshake made for another key and drops it;
    libzmq retries, so the client waits out its timeout, which then says why."""
    handle = curve_coordinator(coordinator, keys)
    wrong = (keys.client_secret, keys.stranger_public)

    error, _ = await frontend_call(handle, *wrong, timeout=1.0)
    assert isinstance(error, CoordinatorTimeout), error
    assert error.handshake_failure is not None
    assert error.handshake_failure.kind == _zmq.CURVE_DROPPED
    assert not error.handshake_failure.final
    assert "within 1 s" in str(error) and WRONG_SERVER_KEY in str(error)

    error, _ = await engine_start(handle, *wrong, timeout=1.0)
    assert isinstance(error, EngineStartupTimeout), error
    assert error.stage == "init" and error.handshake_failure is not None
    assert error.handshake_failure.kind == _zmq.CURVE_DROPPED
    assert WRONG_SERVER_KEY in str(error)

    code, err, _ = run_cli(capsys, ["status", "--addr-file", handle.addr_file,
                                    "--timeout", "1", *key_options(*wrong)])
    assert code == 1 and WRONG_SERVER_KEY in err and "within 1 s" in err, err


async def test_a_coordinator_that_is_not_there_is_still_called_silent(tmp_path: Path) -> None:
    """No handshake ever happens: the old message stays, with no CURVE guess."""
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as taken:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
    addresses = {"frontend": f"tcp://127.0.0.1:{port}",
                 "front_publish": f"tcp://127.0.0.1:{port}"}
    client = FrontendClient(addresses, host="127.0.0.1")
    try:
        with pytest.raises(CoordinatorTimeout) as caught:
            await client.query_state(timeout=0.5)
        assert caught.value.handshake_failure is None
        assert str(caught.value) == "no answer from the coordinator to state query within 0.5 s"
    finally:
        await client.close()


# ---- the words for each event --------------------------------------------------------------


@pytest.mark.parametrize(("event", "value", "curve", "kind", "final"), [
    (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400, True, _zmq.KEY_REFUSED, True),
    (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 300, True, _zmq.KEY_CHECK_FAILED, True),
    (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 500, True, _zmq.KEY_CHECK_FAILED, True),
    (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH, False,
     _zmq.CURVE_REQUIRED, True),
    (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH, True,
     _zmq.CURVE_NOT_OFFERED, True),
    (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC, True,
     _zmq.PROTOCOL_ERROR, True),
    (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32, True, _zmq.CURVE_DROPPED, False),
    (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32, False, _zmq.HANDSHAKE_DROPPED, False),
])
def test_each_handshake_failure_has_its_own_words(
    event: int, value: int, curve: bool, kind: str, final: bool
) -> None:
    failure = _zmq.describe_handshake_failure(event, value, address="tcp://h:1", curve=curve)
    assert failure is not None
    assert (failure.kind, failure.final) == (kind, final)
    assert "tcp://h:1" in failure.message


def test_other_events_are_not_failures() -> None:
    for event in (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_CONNECTED, zmq.EVENT_DISCONNECTED):
        assert _zmq.describe_handshake_failure(event, 0, address="a", curve=True) is None
    assert "cryptographic" in _zmq.describe_handshake_failure(
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC,
        address="a", curve=True).message  # type: ignore[union-attr]


def test_a_dropped_handshake_suggests_curve_only_where_curve_can_be() -> None:
    dropped = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    over_tcp = _zmq.describe_handshake_failure(dropped, 104, address="tcp://h:1", curve=False)
    over_ipc = _zmq.describe_handshake_failure(dropped, 104, address="ipc:///x", curve=False)
    assert over_tcp is not None and REQUIRED in over_tcp.message
    assert over_ipc is not None and "CURVE" not in over_ipc.message
