"""CURVE between real sockets on tcp://127.0.0.1, and key files."""

from __future__ import annotations

import argparse
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from coordinator._zmq import configure_client_socket, load_public_key, load_secret_key
from coordinator.cli.keygen import add_keygen_parser, generate_keypair, run_keygen
from coordinator.cli.serve import add_curve_arguments
from coordinator.server.curve import CurveServer, load_client_keys

pytestmark = pytest.mark.timeout(30)

WAIT_S = 5.0


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, str]:
    """A coordinator key pair, an allowed client, and a stranger whose key is not allowed."""
    server_dir = tmp_path / "server"
    clients_dir = tmp_path / "clients"
    client_dir = tmp_path / "client"
    stranger_dir = tmp_path / "stranger"
    server_pub, server_secret = generate_keypair(str(server_dir), "coordinator")
    client_pub, client_secret = generate_keypair(str(client_dir), "engine0")
    _, stranger_secret = generate_keypair(str(stranger_dir), "engine0")
    clients_dir.mkdir()
    (clients_dir / "engine0.key").write_bytes(Path(client_pub).read_bytes())
    (clients_dir / "README").write_text("only *.key files count\n")
    return {
        "server_public": server_pub,
        "server_secret": server_secret,
        "clients_dir": str(clients_dir),
        "client_secret": client_secret,
        "client_public": client_pub,
        "stranger_secret": stranger_secret,
    }


def curve_router(ctx: zmq.Context[zmq.Socket[bytes]], server: CurveServer) -> tuple[
    zmq.Socket[bytes], str
]:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    server.configure_socket(sock)
    sock.bind("tcp://127.0.0.1:0")
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return sock, endpoint.decode()


def dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, *, secret: str | None,
           server_public: str | None) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if secret is not None and server_public is not None:
        configure_client_socket(sock, secret, server_public)
    sock.connect(endpoint)
    return sock


def receive(sock: zmq.Socket[bytes], timeout_s: float) -> list[bytes] | None:
    if sock.poll(int(timeout_s * 1000), zmq.POLLIN):
        return sock.recv_multipart()
    return None


def wait_for(predicate: object, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if callable(predicate) and predicate():
            return True
        time.sleep(0.02)
    return False


# --- CURVE on the wire -------------------------------------------------------------------------


def test_allowed_client_talks_both_ways(ctx: zmq.Context[zmq.Socket[bytes]],
                                        keys: dict[str, str]) -> None:
    with CurveServer(ctx, keys["server_secret"], keys["clients_dir"]) as server:
        router, endpoint = curve_router(ctx, server)
        client = dealer(ctx, endpoint, secret=keys["client_secret"],
                        server_public=keys["server_public"])
        client.send(b"hello")
        frames = receive(router, WAIT_S)
        assert frames is not None
        identity, payload = frames
        assert payload == b"hello"
        router.send_multipart([identity, b"welcome"])
        assert receive(client, WAIT_S) == [b"welcome"]
        assert server.refusal_counts() == {}
        assert server.allowed_clients == 1
        assert server.started


def test_client_with_a_key_not_in_the_directory_is_refused_and_counted(
    ctx: zmq.Context[zmq.Socket[bytes]], keys: dict[str, str]
) -> None:
    with CurveServer(ctx, keys["server_secret"], keys["clients_dir"]) as server:
        router, endpoint = curve_router(ctx, server)
        stranger = dealer(ctx, endpoint, secret=keys["stranger_secret"],
                          server_public=keys["server_public"])
        stranger.send(b"let me in")
        assert wait_for(lambda: server.refusal_counts().get("unknown_key", 0) >= 1)
        assert receive(router, 0.3) is None
        assert server.counters()["refused.curve.unknown_key"] >= 1
        # the allowed client still gets through on the same socket
        client = dealer(ctx, endpoint, secret=keys["client_secret"],
                        server_public=keys["server_public"])
        client.send(b"hello")
        frames = receive(router, WAIT_S)
        assert frames is not None
        assert frames[1] == b"hello"


def test_clients_without_curve_or_with_the_wrong_server_key_get_nothing_through(
    ctx: zmq.Context[zmq.Socket[bytes]], keys: dict[str, str], tmp_path: Path
) -> None:
    other_pub, _ = generate_keypair(str(tmp_path / "other"), "coordinator")
    with CurveServer(ctx, keys["server_secret"], keys["clients_dir"]) as server:
        router, endpoint = curve_router(ctx, server)
        plain = dealer(ctx, endpoint, secret=None, server_public=None)
        plain.send(b"plain")
        confused = dealer(ctx, endpoint, secret=keys["client_secret"], server_public=other_pub)
        confused.send(b"wrong server")
        assert receive(router, 0.5) is None


def test_reload_picks_up_new_client_keys(ctx: zmq.Context[zmq.Socket[bytes]],
                                         keys: dict[str, str], tmp_path: Path) -> None:
    new_pub, new_secret = generate_keypair(str(tmp_path / "new"), "frontend0")
    with CurveServer(ctx, keys["server_secret"], keys["clients_dir"]) as server:
        router, endpoint = curve_router(ctx, server)
        Path(keys["clients_dir"], "frontend0.key").write_bytes(Path(new_pub).read_bytes())
        assert server.reload_clients() == 2
        client = dealer(ctx, endpoint, secret=new_secret, server_public=keys["server_public"])
        client.send(b"new")
        frames = receive(router, WAIT_S)
        assert frames is not None
        assert frames[1] == b"new"


def test_sockets_cannot_be_configured_before_the_zap_handler_runs(
    ctx: zmq.Context[zmq.Socket[bytes]], keys: dict[str, str]
) -> None:
    server = CurveServer(ctx, keys["server_secret"], keys["clients_dir"])
    sock = ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(RuntimeError, match="start"):
            server.configure_socket(sock)
        server.start()
        server.start()  # idempotent
        server.configure_socket(sock)
        assert sock.getsockopt(zmq.CURVE_SERVER) == 1
        assert sock.getsockopt(zmq.ZAP_DOMAIN) == b"dp-coordinator"
    finally:
        sock.close(0)
        server.stop()
        server.stop()
    assert not server.started


# --- key files ---------------------------------------------------------------------------------


def test_generate_keypair_writes_loadable_private_keys(tmp_path: Path) -> None:
    directory = tmp_path / "new" / "keys"
    public, secret = generate_keypair(str(directory), "coordinator")
    assert (public, secret) == (str(directory / "coordinator.key"),
                                str(directory / "coordinator.key_secret"))
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    pub_key, secret_key = load_secret_key(secret)
    assert load_public_key(public) == pub_key
    assert len(pub_key) == len(secret_key) == 40
    assert b"secret-key" not in Path(public).read_bytes()


def test_generate_keypair_refuses_to_replace_unless_asked(tmp_path: Path) -> None:
    public, secret = generate_keypair(str(tmp_path), "a")
    old = load_public_key(public)
    with pytest.raises(FileExistsError, match="--force"):
        generate_keypair(str(tmp_path), "a")
    os.chmod(secret, 0o644)
    generate_keypair(str(tmp_path), "a", overwrite=True)
    assert load_public_key(public) != old
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600


@pytest.mark.parametrize("name", ["", ".", "..", "a/b"])
def test_generate_keypair_wants_a_plain_name(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="plain file name"):
        generate_keypair(str(tmp_path), name)


def test_bad_key_files_are_explained(tmp_path: Path, keys: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="only a public key"):
        load_secret_key(keys["server_public"])
    with pytest.raises(ValueError, match="cannot read key file"):
        load_public_key(str(tmp_path / "missing.key"))
    junk = tmp_path / "junk.key"
    junk.write_text("hello\n")
    with pytest.raises(ValueError, match="not a ZeroMQ key file"):
        load_public_key(str(junk))
    short = tmp_path / "short.key"
    short.write_text('curve\n    public-key = "abc"\n')
    with pytest.raises(ValueError, match="malformed key"):
        load_public_key(str(short))
    with pytest.raises(ValueError, match="does not exist"):
        load_client_keys(str(tmp_path / "nowhere"))


def test_curve_server_refuses_a_useless_configuration(
    ctx: zmq.Context[zmq.Socket[bytes]], keys: dict[str, str], tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="every engine and frontend would be refused"):
        CurveServer(ctx, keys["server_secret"], str(empty))
    with pytest.raises(ValueError, match="only a public key"):
        CurveServer(ctx, keys["server_public"], keys["clients_dir"])


def test_keygen_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="dp-coordinator")
    add_keygen_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["keygen", "--dir", str(tmp_path), "--name", "engine3"])
    assert run_keygen(args) == 0
    out = capsys.readouterr().out
    assert f"public key: {tmp_path / 'engine3.key'}" in out
    assert f"secret key: {tmp_path / 'engine3.key_secret'}" in out
    assert run_keygen(args) == 1
    assert "already exists" in capsys.readouterr().err
    forced = parser.parse_args(["keygen", "--dir", str(tmp_path), "--name", "engine3",
                                "--force"])
    assert run_keygen(forced) == 0


def test_curve_arguments() -> None:
    parser = argparse.ArgumentParser()
    add_curve_arguments(parser)
    args = parser.parse_args([])
    assert (args.curve_secret_key, args.curve_clients_dir, args.insecure) == (None, None, False)
    args = parser.parse_args(["--curve-secret-key", "k", "--curve-clients-dir", "d",
                              "--insecure"])
    assert (args.curve_secret_key, args.curve_clients_dir, args.insecure) == ("k", "d", True)
