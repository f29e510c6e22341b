"""What the operator commands share: key flags, the address file, the state query."""

from __future__ import annotations

import argparse
import itertools
import json
import time

import zmq

from coordinator._zmq import CLIENT, CurveClientKeys, connect
from coordinator.protocol import frontend as fp
from coordinator.protocol.errors import ProtocolError


def add_curve_client_arguments(p: argparse.ArgumentParser) -> None:
    """Key flags for tools that talk to a coordinator with CURVE on its tcp sockets."""
    p.add_argument("--curve-secret-key", default=None, metavar="FILE",
                   help="this client's secret key file, for a coordinator that requires CURVE")
    p.add_argument("--curve-server-key", default=None, metavar="FILE",
                   help="the coordinator's public key file (NAME.key)")


class StatusError(Exception):
    """Something the operator must fix; the message says what."""


def read_frontend_address(path: str, key: str = "frontend") -> str:
    """The coordinator's `frontend` (or another `key`'s) address from its address file."""
    try:
        with open(path, encoding="utf-8") as handle:
            addresses = json.load(handle)
    except FileNotFoundError:
        raise StatusError(f"no address file at {path}: is the coordinator running, and was "
                          "it started with --addr-file pointing there?") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise StatusError(f"cannot read the address file {path}: {exc}") from None
    address = addresses.get(key) if isinstance(addresses, dict) else None
    if not isinstance(address, str) or not address:
        raise StatusError(f"the address file {path} has no '{key}' address")
    return address


class StateQuery:
    """A DEALER to the coordinator's frontend socket, asking for state on demand."""

    def __init__(
        self,
        address: str,
        *,
        curve_secret_key: str | None = None,
        curve_server_key: str | None = None,
    ) -> None:
        self.address = address
        keys = CurveClientKeys.from_options(curve_secret_key, curve_server_key)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            self._sock = connect(self._ctx, zmq.DEALER, address, CLIENT, curve=keys)
        except BaseException:
            self._ctx.term()
            raise
        self._call_ids = itertools.count(1)

    def query(self, timeout_s: float) -> fp.GroupState:
        call_id = next(self._call_ids)
        deadline = time.monotonic() + timeout_s
        try:
            self._sock.send(fp.encode(fp.QueryState(call_id)), zmq.NOBLOCK)
        except zmq.Again:
            raise StatusError(self._silent(timeout_s)) from None
        while True:
            remaining_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not self._sock.poll(remaining_ms, zmq.POLLIN):
                raise StatusError(self._silent(timeout_s))
            frames = self._sock.recv_multipart()
            if len(frames) != 1:
                continue
            try:
                reply = fp.decode_reply(frames[0])
            except ProtocolError:
                continue
            if isinstance(reply, fp.StateReply) and reply.call_id == call_id:
                return reply.state
            if isinstance(reply, fp.ErrorReply) and reply.call_id == call_id:
                raise StatusError(f"the coordinator refused the state query: "
                                  f"{reply.code}: {reply.message}")
            # Anything else is a late answer to an earlier query or a notice.

    def _silent(self, timeout_s: float) -> str:
        return (f"the coordinator at {self.address} did not answer within {timeout_s:g} s "
                "(is it running? is the address file current?)")

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()
