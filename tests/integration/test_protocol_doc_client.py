"""A frontend written from docs/PROTOCOL.md alone, against the real coordinator process.

`DocClient` imports nothing of the project: plain pyzmq and the `msgpack`
package (another msgpack implementation than the coordinator's), message
shapes and tags as the document lists them, its sockets as its *Sockets*
table says (DEALER to `frontend`, SUB on `front_publish`, a bound PULL for
engine outputs; for the operator's commands a DEALER to `admin`), the
SimRequest payload as *Frames and encoding* describes
it. The engines are a simulated group in their own process
(`python -m coordinator.sim group`), so they can be killed for `failed`.

Each step checks a statement of the document: `registered` before any engine
joined; refusals and their codes; `bad_frame` echoing a readable call id; a
submit that wakes the paused group; the finished request on the PULL, then
`finished`; abort; drain and the `drained` notice; `failed` within the
liveness bound after the engines die; and the `shutdown` notice.
"""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from tests.conftest import CoordinatorFactory

pytestmark = pytest.mark.timeout(120)

STEP = 5.0
LEASE_TTL_S = 1.5


class DocClient:
    """A frontend built from the document: one DEALER, one SUB, one PULL."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], addresses: dict[str, str]) -> None:
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(addresses["frontend"])
        self.operator = ctx.socket(zmq.DEALER)
        self.operator.setsockopt(zmq.LINGER, 0)
        self.operator.connect(addresses["admin"])
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")  # a SUB sends b"\x01" for this
        self.sub.connect(addresses["front_publish"])
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind("tcp://127.0.0.1:*")
        self.output_address = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self.call_ids = itertools.count(1)
        self.notices: list[list[Any]] = []
        self.seen_publishes: list[list[Any]] = []
        self.wave = 0

    # -- sending

    def send(self, header: list[Any], *payload: bytes) -> None:
        self.dealer.send_multipart([msgpack.packb(header), *payload])

    def call(self, tag: str, *fields: Any, payload: tuple[bytes, ...] = ()) -> list[Any]:
        call_id = next(self.call_ids)
        self.send([tag, call_id, *fields], *payload)
        return self.answer(call_id)

    def admin(self, command: str, rank: int) -> list[Any]:
        """On the owner-only `admin` socket, as *admin* says operators must."""
        call_id = next(self.call_ids)
        self.operator.send(msgpack.packb(["admin", call_id, command, rank]))
        assert self.operator.poll(int(STEP * 1000)), "no answer on the admin socket"
        reply = msgpack.unpackb(self.operator.recv(), raw=False)
        assert reply[1] == call_id
        return reply

    # -- receiving: replies by call id; notices (no call id) are kept aside

    def receive(self, timeout: float = STEP) -> list[Any]:
        assert self.dealer.poll(int(timeout * 1000)), "no message from the coordinator"
        message = msgpack.unpackb(self.dealer.recv(), raw=False)
        assert isinstance(message, list) and isinstance(message[0], str)
        return message

    def answer(self, call_id: int, timeout: float = STEP) -> list[Any]:
        deadline = time.monotonic() + timeout
        while True:
            message = self.receive(max(0.0, deadline - time.monotonic()))
            if message[0] in ("failed", "drained", "shutdown", "rank_lost"):
                self.notices.append(message)
            elif message[1] == call_id:
                return message

    def notice(self, tag: str, timeout: float = STEP) -> list[Any]:
        deadline = time.monotonic() + timeout
        while True:
            for index, message in enumerate(self.notices):
                if message[0] == tag:
                    return self.notices.pop(index)
            self.notices.append(self.receive(max(0.0, deadline - time.monotonic())))

    def register(self) -> list[Any]:
        return self.call("register", 0, self.output_address, None, 1)

    def submit(self, request_id: str, decode_steps: int, dp_rank: int | None = None
               ) -> list[Any]:
        sim_request = msgpack.packb([request_id, 0, self.wave, decode_steps, time.monotonic_ns()])
        return self.call("submit", request_id, self.wave, dp_rank, payload=(sim_request,))

    def publishes(self, timeout: float) -> list[list[Any]]:
        """Every publish that arrives within `timeout`; each is [counts, wave, running]."""
        out = []
        deadline = time.monotonic() + timeout
        while self.sub.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            publish = msgpack.unpackb(self.sub.recv(), raw=False)
            assert isinstance(publish, list) and len(publish) == 3
            self.wave = publish[1]
            out.append(publish)
        self.seen_publishes += out
        return out

    def finished_on_pull(self, request_id: str, timeout: float = 3 * STEP) -> None:
        """Wait until an EngineCoreOutputs names `request_id` as finished (index 5, or an
        output whose finish_reason, index 5, is set); then tell the coordinator."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0 and self.pull.poll(int(remaining * 1000)), \
                f"{request_id} never finished"
            frames = self.pull.recv_multipart()
            assert frames[0] != b"ENGINE_CORE_DEAD"
            outputs = msgpack.unpackb(frames[0], raw=False)
            done = set(outputs[5] or [])
            done |= {o[0] for o in outputs[1] or [] if len(o) > 5 and o[5] is not None}
            if request_id in done:
                self.send(["finished", [request_id]])
                return


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def start_engines(handshake: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "coordinator.sim", "group", "--engines", "2",
         "--handshake", handshake, "--step-ms", "2", "--sync-interval", "4",
         "--heartbeat", "0.3", "--ready-timeout", "20", "--log-level", "WARNING"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def test_a_client_written_from_the_document(
    coordinator: CoordinatorFactory, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    handle = coordinator(2, transport="tcp", frontends=1,
                         extra_args=["--lease-ttl-s", str(LEASE_TTL_S)])
    client = DocClient(ctx, handle.addresses)

    # `registered` comes at once, before any engine joined (INIT waits for us).
    begun = time.monotonic()
    assert client.register() == ["registered", 1, 0, 0, 2, 0, False, True, []]
    assert time.monotonic() - begun < STEP
    state = client.call("state")[2]
    assert [engine[1] for engine in state["engines"]] == ["absent", "absent"]
    assert state["rank_count"] == 2 and state["frontends"] == 1

    # Refusals, each with its documented code and the request id.
    refused = client.submit("early", 10)
    assert refused[:3] == ["error", refused[1], "no_ready_engine"] and refused[4] == "early"
    assert client.submit("far", 10, dp_rank=5)[2] == "unknown_rank"
    # bad_frame: the call id is echoed when readable, 0 when not.
    client.send(["submit", 900, "no-payload", 0, None])
    assert client.answer(900)[:3] == ["error", 900, "bad_frame"]
    client.send(["no-such-tag", 901])
    assert client.answer(901)[:3] == ["error", 901, "bad_frame"]
    client.dealer.send(b"\xc1")
    assert client.answer(0)[:3] == ["error", 0, "bad_frame"]

    engines = start_engines(handle.addresses["handshake"])
    try:
        deadline = time.monotonic() + 4 * STEP
        while True:  # dispatchable: READY accepted and greeted on dispatch
            reply = client.submit("first", 40)
            if reply[0] == "submitted":
                break
            assert reply[2] in ("no_ready_engine", "rank_not_ready"), reply
            assert time.monotonic() < deadline, "the engines never became ready"
            client.publishes(0.05)
        _, _, request_id, rank, woke = reply
        assert request_id == "first" and rank in (0, 1)
        assert woke is True  # the group was paused: this submit woke it
        # While it runs: a duplicate id is refused.
        assert client.submit("first", 40)[2] == "duplicate_request_id"
        client.finished_on_pull("first")
        client.publishes(0.5)
        # The wake shows as a wave publish [nil, wave, true]; full ones carry a row per rank.
        assert [None, 0, True] in client.seen_publishes
        assert any(p[0] is not None and len(p[0]) == 2 for p in client.seen_publishes)

        # Abort: only routed ids are listed, and an aborted id is not routed again.
        assert client.submit("long", 1_000_000)[0] == "submitted"
        aborted = client.call("abort", ["long", "never-submitted"])
        assert aborted[0] == "aborted" and aborted[2] == ["long"]
        assert client.call("abort", ["long"])[2] == []

        # Drain a rank with nothing in flight: admin_done, then `drained`.
        # From the frontend connection it is refused: changing membership is an operator's.
        assert client.call("admin", "drain", 1)[2] == "not_authorized"
        done = client.admin("drain", 1)
        assert done[0] == "admin_done" and done[2:] == [1, "draining"]
        assert client.notice("drained") == ["drained", 1]
        assert client.submit("to-drained", 10, dp_rank=1)[2] == "rank_not_ready"
        assert client.admin("uncordon", 1)[2:] == [1, "ready"]

        # `failed`: the engines die with a request in flight.
        submitted = client.submit("doomed", 1_000_000)
        assert submitted[0] == "submitted"
        client.publishes(0.3)
        engines.send_signal(signal.SIGKILL)
        engines.wait(STEP)
        killed_at = time.monotonic()
        failed = client.notice("failed", timeout=LEASE_TTL_S + 3.0)
        assert failed[1] == ["doomed"] and failed[2] == submitted[3]
        assert isinstance(failed[3], str) and failed[3]
        # Then every registered frontend hears that the rank was lost.
        assert client.notice("rank_lost")[1:] == failed[2:]
        assert time.monotonic() - killed_at < LEASE_TTL_S / 3 + 1.0 + 1.0
    finally:
        if engines.poll() is None:
            engines.kill()
        engines.wait(STEP)
        assert engines.stderr is not None
        engines.stderr.close()

    # `shutdown` when the coordinator stops.
    assert handle.shutdown(timeout=STEP) == 0
    assert client.notice("shutdown")[1]
