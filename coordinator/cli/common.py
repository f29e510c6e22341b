"""What the operator commands share: key flags, the address file, the state query.

Without `--addr-file`, `status` and `top` look for the coordinators published on
this host (`coordinator.launch.find_coordinators`: a coordinator vLLM's plugin
started) and use the one that answers; none or several is an error that lists
what was found.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import zmq

from coordinator._zmq import CLIENT, CurveClientKeys, connect_monitored
from coordinator.launch import DISCOVERY_PREFIX, DISCOVERY_SUFFIX, discovery_dir, find_coordinators
from coordinator.protocol import frontend as fp
from coordinator.protocol.errors import ProtocolError


def add_curve_client_arguments(p: argparse.ArgumentParser) -> None:
    """Key flags for tools that talk to a coordinator with CURVE on its tcp sockets."""
    p.add_argument("--curve-secret-key", default=None, metavar="FILE",
                   help="this client's secret key file, for a coordinator that requires CURVE")
    p.add_argument("--curve-server-key", default=None, metavar="FILE",
                   help="the coordinator's public key file (NAME.key)")


DRAINED = "drained"
"""What the operator tools show for a draining rank with nothing left in flight."""

STATE_STYLES = {"ready": "green", "handshaking": "cyan", "draining": "yellow",
                DRAINED: "yellow", "cordoned": "yellow", "absent": "dim"}
"""rich styles of rank states; any other state (dead) is shown in bold red."""


def shown_state(state: str, in_flight: int) -> str:
    """A rank's state as the operator tools show it.

    The coordinator keeps a drained rank in `draining` (it takes no work until
    uncordoned either way); once nothing is in flight on it, it is `drained`.
    """
    return DRAINED if state == "draining" and in_flight == 0 else state


class StatusError(Exception):
    """Something the operator must fix; the message says what."""


def discover_addr_file() -> str:
    """The address file of the one published coordinator that answers on this host.

    StatusError, saying where it looked and what it found, when there is none or
    more than one.
    """
    directory = discovery_dir()
    found = find_coordinators(directory)
    answering = [f for f in found if f.answering]
    if len(answering) == 1:
        return answering[0].path
    if answering:
        listing = "".join(f"\n  {f.path}  (frontend {f.addresses['frontend']})"
                          for f in answering)
        raise StatusError(f"{len(answering)} coordinators started by vLLM's plugin answer on "
                          f"this host; choose one with --addr-file:{listing}")
    pattern = os.path.join(directory, f"{DISCOVERY_PREFIX}*{DISCOVERY_SUFFIX}")
    stale = "".join(f"\n  {f.path} (its coordinator does not answer)" for f in found)
    raise StatusError(
        f"no --addr-file given, and no coordinator started by vLLM's plugin answers on this "
        f"host (looked for {pattern}: vLLM's VLLM_RPC_BASE_PATH, else the temporary "
        "directory, so use the same VLLM_RPC_BASE_PATH or TMPDIR as vllm serve). For a "
        f"coordinator you started with `serve --addr-file F`, give --addr-file F.{stale}")


def read_frontend_address(path: str) -> str:
    """The coordinator's `frontend` address from its address file."""
    try:
        with open(path, encoding="utf-8") as handle:
            addresses = json.load(handle)
    except FileNotFoundError:
        raise StatusError(f"no address file at {path}: is the coordinator running, and was "
                          "it started with --addr-file pointing there?") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise StatusError(f"cannot read the address file {path}: {exc}") from None
    address = addresses.get("frontend") if isinstance(addresses, dict) else None
    if not isinstance(address, str) or not address:
        raise StatusError(f"the address file {path} has no 'frontend' address")
    return address


class StateQuery:
    """A DEALER to the coordinator's frontend socket, asking for state on demand.

    A socket monitor watches its handshakes, so a coordinator that refuses our
    CURVE key (or wants keys we lack, or has none while we use some) is named as
    such at once instead of as a coordinator that does not answer.
    """

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
            self._sock, self._handshakes = connect_monitored(self._ctx, zmq.DEALER, address,
                                                             CLIENT, curve=keys)
        except BaseException:
            self._ctx.term()
            raise
        self._call_ids = itertools.count(1)

    def query(self, timeout_s: float) -> fp.GroupState:
        call_id = next(self._call_ids)
        deadline = time.monotonic() + timeout_s
        self._send(fp.QueryState(call_id), timeout_s)
        while True:
            reply = self._next_reply(deadline, timeout_s)
            if isinstance(reply, fp.StateReply) and reply.call_id == call_id:
                return reply.state
            if isinstance(reply, fp.ErrorReply) and reply.call_id == call_id:
                raise StatusError(f"the coordinator refused the state query: "
                                  f"{reply.code}: {reply.message}")
            # Anything else is a late answer to an earlier query or a notice.

    def _send(self, message: fp.FrontendRequest, timeout_s: float) -> None:
        self._raise_if_refused()
        try:
            self._sock.send(fp.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            raise StatusError(self._silent(timeout_s)) from None

    def _next_reply(self, deadline: float, timeout_s: float) -> fp.FrontendReply | None:
        """The next readable reply (None for an unreadable one); StatusError at the deadline.

        Raises StatusError at once when the handshake failed for good.
        """
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._handshakes.socket, zmq.POLLIN)
        while True:
            remaining_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            ready = dict(poller.poll(remaining_ms)) if remaining_ms > 0 else {}
            if self._handshakes.socket in ready:
                self._raise_if_refused()
            if self._sock in ready:
                break
            if remaining_ms <= 0 or not ready:
                raise StatusError(self._silent(timeout_s))
        frames = self._sock.recv_multipart()
        if len(frames) != 1:
            return None
        try:
            return fp.decode_reply(frames[0])
        except ProtocolError:
            return None

    def _raise_if_refused(self) -> None:
        failure = self._handshakes.poll()
        if failure is not None and failure.final:
            raise StatusError(failure.message)

    def _silent(self, timeout_s: float) -> str:
        failure = self._handshakes.poll()
        if failure is not None:
            return f"{failure.message} (no answer within {timeout_s:g} s)"
        return (f"the coordinator at {self.address} did not answer within {timeout_s:g} s "
                "(is it running? is the address file current?)")

    def close(self) -> None:
        self._handshakes.close()
        self._sock.close(0)
        self._ctx.term()
